"""The OpenAI-compatible router: validates requests, picks replicas, streams results."""
