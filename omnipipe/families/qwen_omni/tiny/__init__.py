"""tiny:// Qwen Omni checkpoints: the real architectures with tiny random weights."""
