"""BAGEL's generation side, written from the published architecture (ByteDance-Seed/Bagel):
the mixture-of-transformers LLM whose generation expert denoises VAE latents with
attention over the understanding expert's KV cache, flow matching with a timestep shift,
CFG over text and image conditions, and the FLUX-style VAE. vLLM runs the understanding
side; these modules read the same checkpoint."""
