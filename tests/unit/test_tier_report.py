"""`make test`'s report and its CI rule (tests/tier_report.py), run on a small suite of
its own in a pytest subprocess: the counts and slowest items it writes, a skip that fails
under CI=true in the tiers that may not skip, and the skips that stay allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SUITE = {
    "e2e/test_skips.py": """
import pytest

def test_plain_skip():
    pytest.skip("no widget on this machine")

@pytest.fixture
def widget():
    pytest.skip("no widget fixture")

def test_fixture_skip(widget):
    pass

@pytest.mark.gpu
def test_gpu_skip():
    pytest.skip("needs CUDA")

@pytest.mark.opt_in
def test_opt_in_skip():
    pytest.skip("opt-in")

@pytest.mark.xfail(reason="known")
def test_known_failure():
    raise AssertionError

def test_passes():
    pass
""",
    "unit/test_unit_skip.py": """
import time

import pytest

def test_unit_may_skip():
    pytest.skip("unit tests may skip")

@pytest.mark.xdist_group("slow")
def test_slow():
    time.sleep(0.3)
""",
}


Run = tuple[subprocess.CompletedProcess[str], dict[str, object]]


def run_suite(tmp_path: Path, ci: bool, args: tuple[str, ...] = ()) -> Run:
    suite = tmp_path / "tests"
    for name, text in SUITE.items():
        (suite / name).parent.mkdir(parents=True, exist_ok=True)
        (suite / name).write_text(text)
    report = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "OMNIPIPE_TEST_REPORT": str(report),
            "OMNIPIPE_TEST_TIER": "mixed",
            **({"CI": "true"} if ci else {}),
        }
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "tests.tier_report",
            "-p",
            "no:cacheprovider",
            "-o",
            "markers=gpu\n opt_in",
            "-rs",
            *args,
            str(suite),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc, json.loads((report / "mixed.json").read_text())


@pytest.fixture(scope="module")
def under_ci(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_suite(tmp_path_factory.mktemp("ci"), ci=True)


@pytest.fixture(scope="module")
def outside_ci(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return run_suite(tmp_path_factory.mktemp("dev"), ci=False)


@pytest.fixture(scope="module")
def under_ci_on_workers(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """As `make e2e` runs: pytest-xdist's workers, by group (tests/e2e/conftest.py)."""
    return run_suite(tmp_path_factory.mktemp("xdist"), ci=True, args=XDIST)


XDIST = ("-n", "2", "--dist", "loadgroup")


@pytest.mark.parametrize("workers", [0, 2])
def test_under_ci_a_skip_in_a_tier_that_may_not_skip_fails_and_says_why(
    request: pytest.FixtureRequest, workers: int
) -> None:
    """The same on pytest-xdist's workers: the rule runs in each worker, and the
    controller alone writes the report, from the reports its workers send."""
    proc, report = request.getfixturevalue("under_ci_on_workers" if workers else "under_ci")
    assert proc.returncode == 1, proc.stdout
    assert "skipped under CI=true, which no e2e test may: no widget on this machine" in proc.stdout
    assert "skipped under CI=true, which no e2e test may: no widget fixture" in proc.stdout
    assert report["outcomes"] == {
        "failed": 1,  # the plain skip
        "errors": 1,  # the fixture's skip, in setup
        "skipped": 3,  # gpu, opt-in, and the unit tier's
        "xfailed": 1,
        "passed": 2,
    }
    assert report["collected"] == 8
    assert report["exitstatus"] == 1
    assert report["workers"] == workers


def test_outside_ci_skips_stay_skips(outside_ci: Run) -> None:
    proc, report = outside_ci
    assert proc.returncode == 0, proc.stdout
    assert report["outcomes"] == {"skipped": 5, "xfailed": 1, "passed": 2}


def test_the_report_names_the_slowest_items_first(outside_ci: Run) -> None:
    _, report = outside_ci
    slowest = report["slowest"]
    assert isinstance(slowest, list)
    assert slowest[0][0].endswith("test_unit_skip.py::test_slow")
    assert slowest[0][1] >= 0.3
    assert len(slowest) == 8
    assert [s for _, s in slowest] == sorted((s for _, s in slowest), reverse=True)


def test_the_report_sums_each_modules_items_costliest_first(outside_ci: Run) -> None:
    _, report = outside_ci
    modules = report["modules"]
    assert isinstance(modules, list)
    seconds = dict(report["slowest"])  # type: ignore[arg-type]
    assert modules[0][0].endswith("test_unit_skip.py")
    assert len(modules) == len({nodeid.split("::")[0] for nodeid in seconds})
    for module, total in modules:
        items = [s for nodeid, s in seconds.items() if nodeid.startswith(f"{module}::")]
        assert total == pytest.approx(sum(items), abs=0.05 * len(items) + 0.05), module
    assert [s for _, s in modules] == sorted((s for _, s in modules), reverse=True)


def test_on_workers_the_slowest_items_are_named_without_their_group(
    under_ci_on_workers: Run,
) -> None:
    """loadgroup appends `@group` to a grouped test's id; the table names the test."""
    _, report = under_ci_on_workers
    slowest = report["slowest"]
    assert isinstance(slowest, list)
    assert slowest[0][0].endswith("test_unit_skip.py::test_slow"), slowest
    assert slowest[0][1] >= 0.3
    assert not [nodeid for nodeid, _ in slowest if "@" in nodeid], slowest
