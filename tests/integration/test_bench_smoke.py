"""Each benchmark's --quick mode runs end to end (no timing is asserted): it prints its
table and a last `name: key=value ...` line, and appends one JSON line with the machine.

Two lanes. The benchmarks of BESIDE run one after another in a lane of their own from
the module's start, on ports of their own; their tests, last, check what each printed.
The others run in pytest's order meanwhile. The pipelines that several benchmarks run
(SHARED) are started once, beside the benchmarks that run on one core, and lent to the
tests of TestSharedServes (bench/_serves.py says how a benchmark borrows one)."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from omnipipe.local.ports import PORT_RANGE_ENV, port_range
from tests.e2e.conftest import stop_cleanly
from tests.harness.bench_runs import Beside, run_quick
from tests.integration.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# tiny://qwen-image as it comes: throughput's and colocation's image workload, diffusion's
# split graph without acceleration, soak's images. tiny://qwen2.5-omni as it comes (its
# thinker on vLLM): throughput's speech workload, engines' vLLM thinker, soak's chats.
SHARED = {
    "image": """apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: tiny-image}
spec:
  model: tiny://qwen-image
  pipeline: qwen-image
""",
    "omni": """apiVersion: omnipipe.io/v1alpha1
kind: OmniPipeline
metadata: {name: tiny-omni}
spec:
  model: tiny://qwen2.5-omni
  pipeline: qwen2.5-omni
""",
}
BORROWED = "borrowing the shared serve at "
# The second lane's benchmarks, in its order: none borrows a shared serve.
BESIDE: dict[str, tuple[str, ...]] = {
    "reconcile": (),
    "tts": ("--levels", "1,2", "--requests", "1"),
    "pipelining": (),
    "router_overhead": (),
    "transfer": (),
    "diffusion_real_size": ("--device", "cpu", "--size", "tiny"),
    "local_handoff": ("--device", "cpu"),
    "code2wav_engines": ("--codes", "50"),
}


@pytest.fixture(scope="module", autouse=True)
def beside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Beside]:
    """The second lane, from the module's first test: its ports are the upper half of
    this run's, and this process (its serves, its benchmarks) keeps the lower half."""
    low, high = port_range()
    middle = (low + high) // 2
    before = os.environ.get(PORT_RANGE_ENV)
    os.environ[PORT_RANGE_ENV] = f"{low}-{middle}"
    lane = Beside(BESIDE, tmp_path_factory.mktemp("beside"), f"{middle + 1}-{high}")
    try:
        yield lane
    finally:
        lane.stop()
        if before is None:
            os.environ.pop(PORT_RANGE_ENV, None)
        else:
            os.environ[PORT_RANGE_ENV] = before


def test_autoscale_reaction_quick(tmp_path: Path) -> None:
    out, results = run_quick("autoscale_reaction", tmp_path)
    # --quick replays the HPA at a 4 s sync, so that its load step is seconds.
    assert "HPA (replayed, sync 4s)" in out
    assert results["hpa_sync_s"] == 4
    assert results["up_decision_s"] > 0  # type: ignore[operator]
    assert results["hpa_up_decision_s"] > 0  # type: ignore[operator]


def check_engines(out: str, results: dict[str, object], rate: str) -> None:
    """talker_engines' and code2wav_engines': each family on both engines, at 1 and 4."""
    assert "vLLM/transformers" in out
    for family in ("qwen2.5-omni", "qwen3-omni"):
        for engine in ("vllm", "transformers"):
            levels = results[family][engine]  # type: ignore[index]
            assert set(levels) == {"1", "4"}
            for r in levels.values():
                assert r[rate] > 0
                assert r["round_s"] > 0


# One torch thread: the shared serves start on the other core meanwhile.
@pytest.mark.usefixtures("shared_serves_starting")
def test_talker_engines_quick(tmp_path: Path) -> None:
    check_engines(*run_quick("talker_engines", tmp_path), "codes_per_s")


def bench_serves() -> ModuleType:
    """bench/_serves.py, as the benchmarks import it."""
    if str(REPO / "bench") not in sys.path:
        sys.path.insert(0, str(REPO / "bench"))
    return importlib.import_module("_serves")


class SharedServes:
    """SHARED's serves, started together in the background when made (bench/_serves.py's
    Together); env() waits until they are ready and gives the environment that lends them
    to the benchmarks; stop() stops each cleanly (exit code 0, no worker left behind), as
    a benchmark stops a serve of its own."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.serves = bench_serves()
        self.starting = self.serves.Together(work, SHARED)
        self.ready: dict[str, Any] | None = None

    def env(self) -> dict[str, str]:
        if self.ready is None:
            self.ready = self.starting.take_all()
        listing = self.work / "serves.json"
        listing.write_text(
            json.dumps(
                [
                    {
                        "pipeline": self.serves.resolved(SHARED[name]),
                        "base_url": served.base_url,
                        "pid": served.proc.pid,
                        "workers": {w: [url, pid] for w, (url, pid) in served.workers.items()},
                    }
                    for name, served in self.ready.items()
                ]
            )
        )
        return {self.serves.SHARED_SERVES: str(listing)}

    def stop(self) -> None:
        ready = self.starting.take_all() if self.ready is None else self.ready
        # Side by side: a stop is seconds of waiting on its processes' exits.
        with ThreadPoolExecutor(max(1, len(ready))) as pool:
            stops = [pool.submit(stop_cleanly, served) for served in ready.values()]
        failures = [str(e) for f in stops if isinstance(e := f.exception(), AssertionError)]
        assert not failures, failures
        for stop in stops:
            stop.result()


@pytest.fixture(scope="module")
def shared_serves_starting(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServes]:
    """SHARED's serves, starting from the first test that asks: a test that leaves a core
    idle (a benchmark on one torch thread) asks for it so that they start beside it.
    Stopped after the module's last test."""
    shared = SharedServes(tmp_path_factory.mktemp("shared-serves"))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(scope="module")
def shared_serves(shared_serves_starting: SharedServes) -> dict[str, str]:
    """The environment that lends SHARED's serves, once they are ready, to the benchmarks
    (bench/_serves.py borrow())."""
    return shared_serves_starting.env()


def borrowed(out: str) -> int:
    """How many shared serves a benchmark's run borrowed instead of starting its own."""
    return sum(line.startswith(BORROWED) for line in out.splitlines())


class TestSharedServes:
    """The benchmarks that run SHARED's pipelines, each borrowing those serves (a shared
    serve that a benchmark stopped borrowing would cost the smoke run its start again)."""

    def test_engines_quick(self, tmp_path: Path, shared_serves: dict[str, str]) -> None:
        out, results = run_quick("engines", tmp_path, env=shared_serves)
        assert borrowed(out) == 1  # the vLLM thinker's
        assert "vllm/transformers" in out
        assert set(results["versions"]) == {"vllm", "torch", "transformers"}  # type: ignore[arg-type]
        for engine in ("vllm", "transformers"):
            levels = results[engine]
            assert set(levels) == {"1", "4"}  # type: ignore[arg-type]
            for r in levels.values():  # type: ignore[attr-defined]
                assert r["thinker_tokens_per_s"] > 0
                assert r["pipeline_rps"] > 0
                assert 0 < r["first_audio_p50_s"] <= r["first_audio_p90_s"]

    def test_soak_quick(self, tmp_path: Path, shared_serves: dict[str, str]) -> None:
        out, results = run_quick("soak", tmp_path, env=shared_serves)
        assert borrowed(out) == 2  # the image and the omni pipeline's
        assert "open fds start -> end" in out
        kinds = results["kinds"]
        assert set(kinds) == {"image", "text_chat", "audio_chat", "speech"}  # type: ignore[arg-type]
        for r in kinds.values():  # type: ignore[attr-defined]
            assert r["ok"] > 0
            assert r["errors"] == {}
            assert 0 < r["p50_s"] <= r["p99_s"]
        assert results["restarted"] == []
        procs = results["processes"]
        assert {"image/router", "image/denoise-0", "omni/router", "omni/thinker-0"} <= set(procs)  # type: ignore[arg-type]
        for p in procs.values():  # type: ignore[attr-defined]
            assert p["rss_mib_end"] > 0
            assert p["fds_end"] > 0

    def test_throughput_quick(self, tmp_path: Path, shared_serves: dict[str, str]) -> None:
        # No baseline: a clean clone may be shallow, without the baseline commit.
        out, results = run_quick("throughput", tmp_path, "--no-baseline", env=shared_serves)
        assert borrowed(out) == 2  # image and speech
        assert "targets (issue 25)" in out
        assert results["baseline"] is None
        for workload in ("image", "speech"):
            levels = results["ours"][workload]  # type: ignore[index]
            assert set(levels) == {"1", "4", "1+busy", "4+busy"}
            for r in levels.values():
                assert r["throughput"] > 0
                assert 0 < r["p50_ms"] <= r["p99_ms"]

    def test_colocation_quick(self, tmp_path: Path, shared_serves: dict[str, str]) -> None:
        # Image only: the speech pair costs minutes, and the image pair runs the same code.
        out, results = run_quick("colocation", tmp_path, "--workloads", "image", env=shared_serves)
        assert borrowed(out) == 1  # the disaggregated one
        assert "thrpt ratio" in out
        pair = results["pairs"]["image"]  # type: ignore[index]
        for placement in ("disaggregated", "colocated"):
            assert set(pair[placement]) == {"1", "4", "1+busy", "4+busy"}
            for r in pair[placement].values():
                assert r["throughput"] > 0
                assert 0 < r["p50_ms"] <= r["p99_ms"]

    def test_diffusion_quick(self, tmp_path: Path, shared_serves: dict[str, str]) -> None:
        out, results = run_quick("diffusion", tmp_path, env=shared_serves)
        assert borrowed(out) == 1  # the split graph without acceleration
        assert "vs monolith" in out
        servers = ["monolith", "split_graph", "split_graph_step_cache", "split_graph_cfg_parallel"]
        for server in [*servers, "split_graph_int8_weights"]:
            for c in (1, 4):
                row = results[f"{server}_c{c}"]
                assert row["errors"] == 0  # type: ignore[index]
                assert row["img_per_s"] > 0  # type: ignore[index]
        shares = results["steps_reused_share"]
        assert shares["split graph"] == 0  # type: ignore[index]
        assert shares["split graph + step cache"] > 0  # type: ignore[index]

    def test_diffusion_families_quick(self, tmp_path: Path, shared_serves: dict[str, str]) -> None:
        out, results = run_quick("diffusion_families", tmp_path, env=shared_serves)
        assert borrowed(out) == 1  # --quick: qwen-image's row, on the shared serve
        assert "c1 / diffusers" in out
        row = results["qwen-image"]
        assert row["diffusers_s"] > 0  # type: ignore[index]
        assert row["split_c1_s"] > 0  # type: ignore[index]
        assert row["split_c4_img_per_s"] > 0  # type: ignore[index]


# The second lane's benchmarks, checked as each has run there.


def test_reconcile_quick(beside: Beside) -> None:
    _, results = beside.result("reconcile")
    for n in ("1", "3"):
        ours = results["omnipipe"][n]  # type: ignore[index]
        assert ours["ready_s"] > 0
        assert ours["requests_per_pipeline"] > 0  # the operator's requests were counted
        assert results["direct"][n]["ready_s"] > 0  # type: ignore[index]


def test_tts_quick(beside: Beside) -> None:
    out, results = beside.result("tts")
    assert "RTF p50" in out
    for row in [results["qwen-tts"], *results["omnipipe"].values()]:  # type: ignore[attr-defined]
        assert 0 < row["ttfa_p50_s"] <= row["ttfa_p99_s"]
        assert row["audio_s_per_s"] > 0
        assert row["rtf_p50"] > 0
    assert set(results["omnipipe"]) == {"1", "2"}  # type: ignore[arg-type]
    assert results["summary"]["audio_c2_over_c1"] > 0  # type: ignore[index]


def test_pipelining_quick(beside: Beside) -> None:
    _, results = beside.result("pipelining")
    assert set(results["omnipipe"]) == set(results["monolithic"]) == {"1", "4", "16"}  # type: ignore[arg-type]


def test_router_overhead_quick(beside: Beside) -> None:
    _out, results = beside.result("router_overhead")
    assert set(results) == {"direct", "vllm-router", "omnipipe"}
    for path in results.values():
        assert set(path) == {"1", "64", "512"}  # type: ignore[arg-type]
        assert all(r["errors"] == 0 and r["rps"] > 0 for r in path.values())  # type: ignore[index, union-attr]


def test_transfer_quick(beside: Beside) -> None:
    out, results = beside.result("transfer")
    for size in ("4KiB", "1MiB", "64MiB"):
        paths = results[size]
        assert set(paths) == {  # type: ignore[arg-type]
            *("memcpy", "ucx_perftest", "raw-ucxx", "socket", "omnipipe-ucx", "omnipipe-tcp")
        }
        assert all(p["gbps"] > 0 for p in paths.values())  # type: ignore[index, union-attr]
    assert "x raw-ucxx" in out
    assert "x socket" in out
    kv = results["kv-16MiB"]
    assert set(kv) == {"ucx-blocks", "ucx-contiguous", "tcp-blocks", "tcp-contiguous"}  # type: ignore[arg-type]
    assert all(r["gbps"] > 0 for r in kv.values())  # type: ignore[index, union-attr]
    for idle in results["idle"].values():  # type: ignore[union-attr]
        assert idle["hot_p50_us"] > 0
        assert idle["receiver_idle_cpu"] >= 0


def test_diffusion_real_size_path_runs_on_the_cpu_at_a_tiny_size(beside: Beside) -> None:
    """The GPU side's code, at a tiny size on the CPU: the monolith, the stages sharing
    its modules, the step probe, and the step cache forced to reuse."""
    out, results = beside.result("diffusion_real_size")
    assert "split_c1_time_vs_monolith_c1=" in out
    rows = results["results"]
    for name in ("split_c1", "split_c4", "split_cache_c1", "split_cache_forced_all_c1"):
        assert rows[name]["latents_finite"] is True  # type: ignore[index]
    assert rows["split_c4"]["request_steps"] == {"computed": 16, "reused": 0}  # type: ignore[index]
    forced = rows["split_cache_forced_all_c1"]["request_steps"]  # type: ignore[index]
    assert forced["reused"] > 0  # type: ignore[index]
    assert rows["monolith_c4"]["s_per_image"] > 0  # type: ignore[index]


def test_local_handoff_quick(beside: Beside) -> None:
    out, results = beside.result("local_handoff")
    assert "by reference" in out
    assert results["device"] == "cpu"
    for size in ("4096", "1048576"):
        row = results[size]  # type: ignore[index]
        assert row["local_us"] > 0
        assert row["copy_us"] > 0


def test_code2wav_engines_quick(beside: Beside) -> None:
    check_engines(*beside.result("code2wav_engines"), "audio_s_per_s")
