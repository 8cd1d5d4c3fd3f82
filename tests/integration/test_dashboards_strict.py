"""The chart's Grafana dashboards as Grafana's own code reads them, without a Grafana
server (tests/harness/grafana.py): the Grafana Foundation SDK's strict decoding and
Validate() (tools/grafana/dashcheck), and Grafana's dashboard-linter. Broken dashboards
prove that both can fail, and that they say which field or rule."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness.grafana import DASHBOARDS, dashcheck, lint

pytestmark = pytest.mark.integration

BOARDS = sorted(DASHBOARDS.glob("*.json"))
OVERVIEW = DASHBOARDS / "pipeline-overview.json"
Board = dict[str, Any]


def test_every_dashboard_decodes_strictly_and_validates() -> None:
    assert [p.stem for p in BOARDS] == ["operator", "pipeline-overview"]
    verdict = dashcheck(*BOARDS)
    assert verdict.returncode == 0, verdict.output
    assert verdict.output.splitlines() == [f"{p}: ok" for p in BOARDS]


def _set(path: tuple[str | int, ...], value: Any) -> Callable[[Board], None]:
    def edit(board: Board) -> None:
        node: Any = board
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _drop(key: str) -> Callable[[Board], None]:
    return lambda board: board.pop(key)


# (case, edit of the overview, the line dashcheck must print after the file's name)
BROKEN: list[tuple[str, Callable[[Board], None], str]] = [
    (
        "unknown dashboard field",
        _set(("titel",), "omnipipe"),
        "decode: Dashboard: unexpected field 'titel'",
    ),
    (
        "unknown panel field",
        _set(("panels", 2, "gridpos"), {"x": 0}),
        "decode: panels[2].Panel: unexpected field 'gridpos'",
    ),
    (
        # A typo inside a Prometheus query: the query is typed by its data source.
        "unknown query field",
        _set(("panels", 0, "targets", 0, "legendFomat"), "{{route}}"),
        "decode: panels[0].targets[0].Dataquery: unexpected field 'legendFomat'",
    ),
    (
        "mistyped field",
        _set(("schemaVersion",), "39"),
        "decode: schemaVersion: json: cannot unmarshal string into Go value of type uint16",
    ),
    (
        "mistyped panel field",
        _set(("panels", 1, "gridPos", "w"), "12"),
        "decode: panels[1].gridPos.w: json: cannot unmarshal string into Go value of type uint32",
    ),
    (
        "missing required field",
        _drop("templating"),
        "decode: templating: required field is missing from input",
    ),
    (
        # Decodes, so only Validate() can refuse it.
        "constraint",
        _set(("fiscalYearStartMonth",), 12),
        "validate: fiscalYearStartMonth: must be < 12",
    ),
]


@pytest.mark.parametrize(("edit", "expected"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN])
def test_dashcheck_rejects_a_broken_dashboard_naming_the_field(
    tmp_path: Path, edit: Callable[[Board], None], expected: str
) -> None:
    board = copy.deepcopy(json.loads(OVERVIEW.read_text()))
    edit(board)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(board))
    verdict = dashcheck(OVERVIEW, broken)
    assert verdict.returncode == 1, verdict.output
    # The good file passes beside it: each file gets its own verdict.
    assert verdict.output.splitlines() == [f"{OVERVIEW}: ok", f"{broken}: {expected}"]


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.stem)
def test_dashboard_linter_passes_strict(path: Path) -> None:
    """With the exclusions in the dashboards' .lint, each for a stated reason."""
    verdict = lint(path)
    assert verdict.returncode == 0, verdict.output


def _fixed_window(board: Board) -> None:
    target = board["panels"][0]["targets"][0]
    target["expr"] = target["expr"].replace("$__rate_interval", "5m")


# (case, edit of the overview, what the linter must print)
LINTED: list[tuple[str, Callable[[Board], None], str]] = [
    ("fixed rate window", _fixed_window, "should use $__rate_interval"),
    ("no description", _set(("panels", 1, "description"), ""), "missing title or description"),
    ("editable", _set(("editable",), True), "should be set to 'editable: false'"),
    (
        "fixed data source",
        _set(("panels", 2, "datasource"), {"type": "prometheus", "uid": "prom-1"}),
        "does not use a templated datasource",
    ),
]


@pytest.mark.parametrize(("edit", "expected"), [c[1:] for c in LINTED], ids=[c[0] for c in LINTED])
def test_dashboard_linter_rejects_a_broken_dashboard(
    tmp_path: Path, edit: Callable[[Board], None], expected: str
) -> None:
    board = copy.deepcopy(json.loads(OVERVIEW.read_text()))
    edit(board)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(board))
    verdict = lint(broken, config=DASHBOARDS / ".lint")
    assert verdict.returncode != 0, verdict.output
    assert expected in verdict.output, verdict.output
