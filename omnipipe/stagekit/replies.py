"""What every autoregressive thinker shares, whatever its family: its default sampling,
the reply as text deltas, and vLLM's sampling parameters from ours."""

from __future__ import annotations

from typing import Any

from omnipipe.stagekit.sampling import Sampling
from omnipipe.stagekit.stage import StageInputError

THINKER_SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=0, max_tokens=2048)


class ReplyText:
    """The reply's token ids as text deltas for the router."""

    def __init__(self, tokenizer: Any, eos: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.text = ""

    def delta(self, generated: list[int], final: bool) -> list[dict[str, Any]]:
        ids = [t for t in generated if t not in self.eos]
        decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
        if decoded.endswith("\ufffd") and not final:
            return []  # a multi-byte character is still incomplete
        delta, self.text = decoded[len(self.text) :], decoded
        return [{"text": delta}] if delta else []


def sampling_params(
    sampling: Sampling,
    eos: frozenset[int],
    max_tokens: int,
    allowed: list[int] | None = None,
) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        return SamplingParams(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=max_tokens,
            min_tokens=min(sampling.min_tokens, max_tokens),
            repetition_penalty=sampling.repetition_penalty,
            seed=sampling.seed,
            stop_token_ids=sorted(eos),
            allowed_token_ids=allowed,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except ValueError as exc:
        raise StageInputError(f"invalid sampling parameter: {exc}") from None
