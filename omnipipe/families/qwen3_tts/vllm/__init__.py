"""Qwen3-TTS's talker on vLLM: its decoder in vLLM's continuous batch with paged KV."""
