"""The Qwen Omni stages on vLLM, and the models they register in its engines."""
