"""Engine adapters: how a stage gets its model objects (diffusers, transformers, vLLM)."""
