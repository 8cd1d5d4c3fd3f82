"""How an admitted request reaches its stage's engine, one scheduler per stage kind:
one-shot stages batch whole requests, stepped ones share each step, streaming ones step
open sessions as their chunks arrive."""
