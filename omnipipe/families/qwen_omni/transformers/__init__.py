"""The Qwen Omni stages on transformers: the reference the other engines are held to."""
