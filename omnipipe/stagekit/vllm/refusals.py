"""vLLM's refusals of a request, in words a client can act on. vLLM's own name engine
flags (`--limit-mm-per-prompt`) that only the operator of the server can set."""

from __future__ import annotations

import re

from omnipipe.stagekit.stage import refusal_message

# vllm/v1/engine/input_processor.py, _validate_model_input (vLLM 0.32).
_ENCODER_CACHE = re.compile(
    r"contains a\(n\) (?P<kind>\w+) item with (?P<tokens>\d+) embedding tokens, which "
    r"exceeds the pre-allocated encoder cache size (?P<cache>\d+)"
)
_SMALLER = {
    "video": "a shorter clip, or fewer frames with a lower mm_processor_kwargs.fps",
    "image": "a smaller image",
    "audio": "a shorter clip",
}


def engine_refusal(exc: BaseException) -> str:
    """What vLLM's refusal of a request says, for the client."""
    message = refusal_message(exc)
    found = _ENCODER_CACHE.search(message)
    if found is None:
        return message
    kind = found["kind"]
    return (
        f"the {kind} makes {found['tokens']} tokens, more than the {found['cache']} the "
        f"engine's encoder holds for one item: send {_SMALLER.get(kind, 'a smaller one')}"
    )
