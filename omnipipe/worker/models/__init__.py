"""Model sources: Hugging Face ids, local paths, and the built-in tiny:// models."""
