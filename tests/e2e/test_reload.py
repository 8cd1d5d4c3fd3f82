"""`omnipipe serve` reloads its file on SIGHUP as the operator rolls out a revision: real
workers of two revisions, a steady stream of requests through the official openai client
across the switch, and the workers' own per-request log lines as the proof that no
request ever ran on two revisions."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import openai
import pytest

from omnipipe.api.loading import load_pipeline
from omnipipe.api.revision import pipeline_revision
from omnipipe.checkpoints.fetch import fetch
from tests.e2e.conftest import Served, start_serve, stop_cleanly, wait_line, write_pipeline

pytestmark = pytest.mark.timeout(420)
FAST = {"num_inference_steps": 2}
REQUEST_LINE = re.compile(
    r"\[(\w+)\] omnipipe\.worker\.requests: request (\w+) stage (\w+) revision (\w+)"
)
STAGES = {"encode", "denoise", "decode"}


class Stream:
    """Clients sending requests back to back until stopped; every outcome is kept."""

    def __init__(self, served: Served, clients: int = 2) -> None:
        self.served = served
        self.ok = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, seed: int) -> None:
        # No retries: a request that fails once counts as a failure.
        with openai.OpenAI(base_url=self.served.base_url, api_key="unused", max_retries=0) as c:
            while not self.done.is_set():
                try:
                    r = c.images.generate(
                        model="reload", prompt="a fox", size="32x32", extra_body=FAST
                    )
                    assert r.data
                    assert r.data[0].b64_json
                except Exception as exc:
                    with self.lock:
                        self.failures.append(repr(exc))
                else:
                    with self.lock:
                        self.ok += 1

    def __enter__(self) -> Stream:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=60)

    def wait_for(self, successes: int, timeout: float = 60) -> None:
        target = self.ok + successes
        deadline = time.monotonic() + timeout
        while self.ok < target:
            assert time.monotonic() < deadline, f"only {self.ok} requests succeeded"
            time.sleep(0.05)


def requests_by_revision(lines: list[str]) -> dict[str, dict[str, str]]:
    """request id -> stage -> revision, from the workers' log lines."""
    seen: dict[str, dict[str, str]] = defaultdict(dict)
    for line in lines:
        if m := REQUEST_LINE.search(line):
            logger_stage, request, stage, revision = m.groups()
            assert logger_stage == stage
            assert stage not in seen[request], f"request {request} ran {stage} twice"
            seen[request][stage] = revision
    return dict(seen)


def test_sighup_rolls_out_a_new_revision_under_load(tmp_path: Path) -> None:
    manifest = write_pipeline(tmp_path, "reload", transfer="ucx")
    old = pipeline_revision(load_pipeline(manifest))
    served = start_serve(manifest)
    try:
        with Stream(served) as stream:
            stream.wait_for(5)

            # A change of transfer backend: an old encoder cannot hand a new denoiser
            # its tensors, so this is a new revision.
            write_pipeline(tmp_path, "reload", transfer="tcp")
            new = pipeline_revision(load_pipeline(manifest))
            assert new != old
            mark = len(served.output)
            served.proc.send_signal(signal.SIGHUP)
            rolling = wait_line(served, f"rolling out revision {new} beside revision {old}", mark)
            switched = wait_line(served, f"switched: new requests start on revision {new}", mark)
            reloaded = wait_line(served, f"reloaded: serving revision {new}", mark)
            stream.wait_for(5)

            # A file that does not parse: logged, and the new revision keeps serving.
            manifest.write_text(manifest.read_text() + "  stages: [broken\n")
            mark = len(served.output)
            served.proc.send_signal(signal.SIGHUP)
            failed = wait_line(served, f"reload failed, still serving revision {new}", mark)
            assert "not valid YAML" in "".join(served.output[failed : failed + 3])
            stream.wait_for(5)

            # An in-place change: one more denoise worker, same revision, nothing drained.
            write_pipeline(
                tmp_path, "reload", "  stages:\n    - {name: denoise, replicas: 2}\n", "tcp"
            )
            assert pipeline_revision(load_pipeline(manifest)) == new
            mark = len(served.output)
            served.proc.send_signal(signal.SIGHUP)
            scaled = wait_line(served, f"reloaded: serving revision {new} with 4 worker", mark)
            assert not any("draining" in line for line in served.output[mark:scaled])
            stream.wait_for(5)

        assert stream.failures == [], stream.failures
        lines = served.output
        runs = requests_by_revision(lines)
        assert len(runs) >= stream.ok
        for request, stages in runs.items():
            assert set(stages) == STAGES, f"request {request} ran only {stages}"
            assert len(set(stages.values())) == 1, f"request {request} crossed: {stages}"
        before = requests_by_revision(lines[:rolling])
        during = requests_by_revision(lines[rolling:switched])
        after = requests_by_revision(lines[reloaded:])
        assert before
        assert all(set(s.values()) == {old} for s in before.values())
        # Requests kept flowing while the new revision's workers started.
        assert during, "no request ran while the new revision started"
        assert after
        assert all(set(s.values()) == {new} for s in after.values())
        # The old revision's workers are gone; every worker now reports the new one.
        assert all(f"revision {old}" not in line for line in lines[reloaded:])
    finally:
        stop_cleanly(served)


def test_sighup_with_an_invalid_manifest_keeps_serving(tmp_path: Path) -> None:
    manifest = write_pipeline(tmp_path, "reload", transfer="tcp")
    served = start_serve(manifest)
    try:
        # It parses, but fails validation: an unknown pipeline type.
        manifest.write_text(manifest.read_text().replace("pipeline: qwen-image", "pipeline: nope"))
        mark = len(served.output)
        served.proc.send_signal(signal.SIGHUP)
        failed = wait_line(served, "reload failed, still serving revision", mark)
        assert "nope" in "".join(served.output[failed : failed + 5])
        with openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as c:
            r = c.images.generate(model="reload", prompt="a fox", size="32x32", extra_body=FAST)
        assert r.data[0].b64_json
        assert served.proc.poll() is None
    finally:
        stop_cleanly(served)


def served_model(served: Served) -> dict[str, object]:
    with openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as c:
        (entry,) = c.models.list().data
    return entry.model_dump()


def test_sighup_applies_a_model_change_and_its_rollback(tmp_path: Path) -> None:
    # A second real checkpoint: the same tiny model, fetched into a directory of its own.
    checkpoint = str(fetch("tiny://qwen-image", tmp_path / "qwen-image-v2"))
    manifest = write_pipeline(tmp_path, "reload", transfer="tcp")
    old = pipeline_revision(load_pipeline(manifest))
    served = start_serve(manifest)
    try:
        assert served_model(served)["root"] == "tiny://qwen-image"
        with Stream(served) as stream:
            stream.wait_for(5)

            # The headline case: bump the model and reload.
            write_pipeline(tmp_path, "reload", transfer="tcp", model=checkpoint)
            new = pipeline_revision(load_pipeline(manifest))
            assert new != old
            mark = len(served.output)
            served.proc.send_signal(signal.SIGHUP)
            rolling = wait_line(served, f"rolling out revision {new} beside revision {old}", mark)
            switched = wait_line(served, f"switched: new requests start on revision {new}", mark)
            reloaded = wait_line(served, f"reloaded: serving revision {new}", mark)
            assert checkpoint in served.output[reloaded]
            stream.wait_for(5)
            entry = served_model(served)
            assert (entry["id"], entry["root"]) == ("reload", checkpoint)
            with openai.OpenAI(base_url=served.base_url, api_key="unused", max_retries=0) as c:
                r = c.images.generate(
                    model=checkpoint, prompt="a fox", size="32x32", extra_body=FAST
                )
                assert r.data[0].b64_json
                # The old model is no longer what this pipeline serves.
                with pytest.raises(openai.NotFoundError, match="tiny://qwen-image"):
                    c.images.generate(
                        model="tiny://qwen-image", prompt="a fox", size="32x32", extra_body=FAST
                    )

            # A rename is still refused, with the reason, and the new model keeps serving.
            write_pipeline(tmp_path, "renamed", transfer="tcp", model=checkpoint, file="reload")
            mark = len(served.output)
            served.proc.send_signal(signal.SIGHUP)
            refused = wait_line(served, f"reload refused, still serving revision {new}", mark)
            assert "it changes name:" in served.output[refused]
            assert "restart `omnipipe serve`" in served.output[refused]
            stream.wait_for(5)

            # Rollback: the old model, as a new rollout of the old revision.
            write_pipeline(tmp_path, "reload", transfer="tcp")
            mark = len(served.output)
            served.proc.send_signal(signal.SIGHUP)
            back = wait_line(served, f"rolling out revision {old} beside revision {new}", mark)
            back_switched = wait_line(
                served, f"switched: new requests start on revision {old}", mark
            )
            back_done = wait_line(served, f"reloaded: serving revision {old}", mark)
            stream.wait_for(5)
            assert served_model(served)["root"] == "tiny://qwen-image"

        assert stream.failures == [], stream.failures
        lines = served.output
        runs = requests_by_revision(lines)
        assert len(runs) >= stream.ok
        for request, stages in runs.items():
            assert set(stages) == STAGES, f"request {request} ran only {stages}"
            assert len(set(stages.values())) == 1, f"request {request} crossed: {stages}"
        assert all(set(s.values()) == {old} for s in requests_by_revision(lines[:rolling]).values())
        assert requests_by_revision(lines[rolling:switched]), "no request while v2 started"
        on_new = requests_by_revision(lines[reloaded:back])
        assert on_new
        assert all(set(s.values()) == {new} for s in on_new.values())
        assert requests_by_revision(lines[back:back_switched]), "no request during rollback"
        after = requests_by_revision(lines[back_done:])
        assert after
        assert all(set(s.values()) == {old} for s in after.values())
        assert all(f"revision {new}" not in line for line in lines[back_done:])
    finally:
        stop_cleanly(served)
