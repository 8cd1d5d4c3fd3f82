"""The stage kit: what a family builds its stages from. The stage contract (stage.py),
sampling and replies, media decoding and its limits, the vLLM adapters (vllm/) and the
tiny tokenizer. It imports api/, checkpoints/ and transfer/, never the worker that hosts
the stages nor any family (docs/adding-a-family.md)."""
