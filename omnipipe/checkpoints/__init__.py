"""Model sources: Hugging Face ids, local paths, and the tiny:// checkpoints the installed
families build (fetch.py writes one; tiny.py builds one on first use, once per machine)."""
