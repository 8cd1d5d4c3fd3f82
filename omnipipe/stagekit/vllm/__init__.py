"""vLLM as a stage's engine: one in-process engine (engine.py), its hidden-state tap
(tap.py), rows fed in as embeddings (feed.py), its KV cache exported as blocks (kv.py)
and LoRA adapters loaded into it (lora.py)."""
