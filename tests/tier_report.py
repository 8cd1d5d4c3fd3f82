"""What `make test` reports about each tier, and the rule that no tier may skip under CI.

Loaded by tests/conftest.py. With OMNIPIPE_TEST_REPORT set (a folder; hack/test_tiers.py
sets it), a run writes `<folder>/<tier>.json`: its wall time, its outcomes, its
pytest-xdist workers and its ten slowest items (setup, call and teardown together), which
hack/test_tiers.py turns into the table at the end of `make test`. Under pytest-xdist
only the controller writes it, from the reports its workers send.

With CI=true, a skipped e2e, integration or real-node test fails, naming what was
missing: a broken install must not hide behind a green run. Tests marked `gpu` (no CUDA
here) or `opt_in` (run by their own make target) may still skip, with their reason shown.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Generator
from pathlib import Path

import pytest

# Tiers whose skips mean a missing piece of the machine, not a missing accelerator.
NO_SKIP_TIERS = frozenset({"e2e", "integration", "realnode"})
EXEMPT_MARKERS = ("gpu", "opt_in")
SLOWEST = 10


def tier_of(path: Path) -> str:
    """The folder under the nearest `tests` folder: unit, e2e, integration or realnode."""
    parts = path.parts
    for i in range(len(parts) - 2, -1, -1):
        if parts[i] == "tests":
            return parts[i + 1]
    return "other"


def skips_fail_here() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and skips_fail_here()) or hasattr(report, "wasxfail"):
        return
    tier = tier_of(item.path)
    if tier not in NO_SKIP_TIERS or any(item.get_closest_marker(m) for m in EXEMPT_MARKERS):
        return
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true, which no {tier} test may: {_reason(report)}\n"
        "(`make test` sets everything up; a skip here means a set-up step is missing or "
        "broken on this machine)"
    )


def item_id(nodeid: str) -> str:
    """The test's id without the `@group` pytest-xdist's loadgroup appends to it (the
    rule xdist splits it by: an @ after the parameters' closing bracket)."""
    if nodeid.rfind("@") > nodeid.rfind("]"):
        return nodeid.rsplit("@", 1)[0]
    return nodeid


class TierRecorder:
    def __init__(self, folder: Path, tier: str) -> None:
        self.folder, self.tier = folder, tier
        self.started = time.monotonic()
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[item_id(report.nodeid)] += report.duration

    def counts(self, config: pytest.Config) -> tuple[dict[str, int], int]:
        """The outcomes as pytest's own summary line counts them (a plugin's sub-reports,
        schemathesis's generated cases, are not tests of their own there), and the number
        of tests: a fixture's error in setup stands for its test, one in teardown does not."""
        terminal = config.pluginmanager.get_plugin("terminalreporter")
        if terminal is None:  # -p no:terminal: nothing counted them
            return {}, 0
        names = {"error": "errors", **{k: k for k in ("passed", "failed", "skipped")}}
        names |= {"xfailed": "xfailed", "xpassed": "xpassed"}
        stats = {key: reports for key, reports in terminal.stats.items() if key in names}
        outcomes = {names[key]: len(reports) for key, reports in stats.items() if reports}
        teardown_errors = sum(1 for r in stats.get("error", []) if r.when == "teardown")
        return outcomes, sum(outcomes.values()) - teardown_errors

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        slowest = sorted(self.seconds.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST]
        # A module's items together, its shared serve's start and stop included (a
        # module-scoped fixture's setup and teardown are its first and last item's).
        per_module: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.seconds.items():
            per_module[nodeid.split("::", 1)[0]] += seconds
        modules = sorted(per_module.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST]
        outcomes, tests = self.counts(session.config)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / f"{self.tier}.json").write_text(
            json.dumps(
                {
                    "tier": self.tier,
                    "wall_s": round(time.monotonic() - self.started, 1),
                    "exitstatus": int(exitstatus),
                    "collected": tests,
                    # pytest-xdist's workers (-n): 0 when the tier ran in this process.
                    "workers": int(getattr(session.config.option, "numprocesses", 0) or 0),
                    "outcomes": outcomes,
                    "slowest": [[nodeid, round(s, 1)] for nodeid, s in slowest],
                    "modules": [[module, round(s, 1)] for module, s in modules],
                },
                indent=1,
            )
        )


def pytest_configure(config: pytest.Config) -> None:
    folder = os.environ.get("OMNIPIPE_TEST_REPORT")
    if folder and not hasattr(config, "workerinput"):
        tier = os.environ.get("OMNIPIPE_TEST_TIER") or "all"
        config.pluginmanager.register(TierRecorder(Path(folder), tier), "omnipipe-tier-report")
