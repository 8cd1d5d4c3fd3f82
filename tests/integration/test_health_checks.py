"""Flux's and Argo CD's health verdicts on OmniPipelines in each state the operator's
conditions describe, from the tools' own libraries (tests/harness/gitops.py): kstatus
from sigs.k8s.io/cli-utils, and charts/omnipipe/health/omnipipe.io_OmniPipeline.lua run
by Argo CD's Lua runtime. The objects are written here by hand, to the condition
contract; tests/integration/test_gitops.py and tests/realnode/ read live ones."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness.gitops import ARGOCD_KEY, HEALTH_LUA, ToolFailed, argo_health, kstatus

pytestmark = pytest.mark.integration

GENERATION = 4
Condition = tuple[str, str, str]  # status, reason, message

SERVING: Condition = ("True", "Serving", "stages encode, denoise, decode and the router serve")
RECONCILED: Condition = ("False", "Reconciled", "the pipeline matches its spec")
NOT_STALLED: Condition = ("False", "NotStalled", "")


def stage(name: str, ready: int, desired: int) -> dict[str, Any]:
    return {"name": name, "replicas": ready, "readyReplicas": ready, "desiredReplicas": desired}


STAGES = [stage("encode", 1, 1), stage("denoise", 2, 2), stage("decode", 1, 1)]


@dataclass(frozen=True)
class State:
    """An OmniPipeline's status as the operator writes it, and both tools' verdicts."""

    name: str
    kstatus: tuple[str, str]
    argo: tuple[str, str]
    ready: Condition | None = SERVING
    reconciling: Condition = RECONCILED
    stalled: Condition = NOT_STALLED
    # The other conditions the operator writes, which neither tool reads.
    others: dict[str, Condition] = field(default_factory=dict)
    stages: list[dict[str, Any]] = field(default_factory=lambda: STAGES)
    observed: int | None = GENERATION  # None: no status at all
    deleting: bool = False

    def obj(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": "images", "namespace": "ml", "generation": GENERATION}
        if self.deleting:
            meta |= {
                "deletionTimestamp": "2026-11-24T10:05:00Z",
                "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"],
            }
        obj: dict[str, Any] = {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": meta,
        }
        if self.observed is None:
            return obj
        conditions = {
            "StagesReady": ("True", "AllStagesReady", ""),
            "StagesAtCapacity": ("True", "AtCapacity", ""),
            "RouterReady": ("True", "RouterReady", ""),
            "Progressing": ("False", "Reconciled", ""),
            "Reconciling": self.reconciling,
            "Stalled": self.stalled,
            **{f"Stage{s['name'].capitalize()}Ready": ("True", "Ready", "") for s in self.stages},
            **self.others,
        }
        if self.ready is not None:
            conditions["Ready"] = self.ready
        obj["status"] = {
            "observedGeneration": self.observed,
            "conditions": [
                {
                    "type": type_,
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": "2026-11-24T10:00:00Z",
                    "observedGeneration": self.observed,
                }
                for type_, (status, reason, message) in conditions.items()
            ],
            "stages": self.stages,
        }
        return obj


def stalled(reason: str, message: str) -> State:
    return State(
        f"stalled: {reason}",
        kstatus=("Failed", message),
        argo=("Degraded", f"{reason}: {message}"),
        ready=("False", reason, message),
        stalled=("True", reason, message),
        others={"StagesReady": ("False", reason, message)},
    )


WAITING = f"waiting for the operator to observe generation {GENERATION}"
BELOW_MINIMUM = "stage denoise has 0 of 1 ready replicas"
FETCHING = "fetching tiny://qwen-image into the model cache"
ROLLING = "rolling out revision 5: stage denoise 1 of 2 updated"
SCALED_TO_ZERO = ("True", "ScaledToZero", "scaled to zero; wakes on demand")

STATES = [
    # kstatus reads a custom resource with no status at all as Current: the moment
    # between the create and the operator's first status write. Argo CD waits.
    State(
        "created, no status yet",
        kstatus=("Current", "Resource is current"),
        argo=("Progressing", WAITING),
        observed=None,
    ),
    State(
        "a new generation not observed yet",
        kstatus=(
            "InProgress",
            f"OmniPipeline generation is {GENERATION}, but latest observed generation is 3",
        ),
        argo=("Progressing", WAITING),
        observed=3,
    ),
    State(
        "a stall of the old generation while a new one waits",
        kstatus=(
            "InProgress",
            f"OmniPipeline generation is {GENERATION}, but latest observed generation is 3",
        ),
        argo=("Progressing", WAITING),
        ready=("False", "ImagePullFailed", "stage encode: x"),
        stalled=("True", "ImagePullFailed", "stage encode: x"),
        observed=3,
    ),
    State(
        "just created: a stage below its minimum",
        kstatus=("InProgress", BELOW_MINIMUM),
        argo=("Progressing", BELOW_MINIMUM),
        ready=("False", "StagesNotReady", "stage denoise: 0 of 1 replicas ready"),
        reconciling=("True", "StageBelowMinimum", BELOW_MINIMUM),
        stages=[stage("encode", 1, 1), stage("denoise", 0, 1), stage("decode", 1, 1)],
    ),
    State(
        "fetching the model's weights",
        kstatus=("InProgress", FETCHING),
        argo=("Progressing", FETCHING),
        ready=("False", "ModelNotCached", "the model cache is not filled yet"),
        reconciling=("True", "FetchingWeights", FETCHING),
        stages=[stage("encode", 0, 1), stage("denoise", 0, 2), stage("decode", 0, 1)],
    ),
    State(
        "rolling out while the old revision serves",
        kstatus=("InProgress", ROLLING),
        argo=("Progressing", ROLLING),
        reconciling=("True", "RollingOut", ROLLING),
    ),
    stalled("FetchFailed", "stage denoise: fetching tiny://missing failed: 404 Not Found"),
    stalled("ImagePullFailed", "stage encode: localhost/omnipipe/missing:dev: image not found"),
    stalled("CrashLooping", "stage encode: the worker exits: /models/missing does not exist"),
    stalled("Unschedulable", "stage denoise: 0/1 nodes are available: 1 Insufficient cpu"),
    stalled("ModelRefused", "stage denoise: the worker refuses model tiny://bagel: unknown"),
    State(
        "the router not ready",
        kstatus=("InProgress", "the router has 0 of 1 ready replicas"),
        argo=("Progressing", "the router has 0 of 1 ready replicas"),
        ready=("False", "RouterNotReady", "the router has 0 of 1 ready replicas"),
        others={"RouterReady": ("False", "NoReadyReplicas", "")},
    ),
    State("serving", kstatus=("Current", "Resource is Ready"), argo=("Healthy", SERVING[2])),
    State(
        "serving during an autoscaler scale-up",
        kstatus=("Current", "Resource is Ready"),
        argo=("Healthy", SERVING[2]),
        others={"StagesAtCapacity": ("False", "ScalingUp", "stage denoise: 2 of 4 replicas ready")},
        stages=[stage("encode", 1, 1), stage("denoise", 2, 4), stage("decode", 1, 1)],
    ),
    State(
        "every stage scaled to zero",
        kstatus=("Current", "Resource is Ready"),
        argo=("Suspended", "scaled to zero; wakes on demand"),
        others={f"Stage{n}Ready": SCALED_TO_ZERO for n in ("Encode", "Denoise", "Decode")},
        stages=[stage("encode", 0, 0), stage("denoise", 0, 0), stage("decode", 0, 0)],
    ),
    State(
        "one stage scaled to zero",
        kstatus=("Current", "Resource is Ready"),
        argo=("Healthy", SERVING[2]),
        others={"StageDenoiseReady": SCALED_TO_ZERO},
        stages=[stage("encode", 1, 1), stage("denoise", 0, 0), stage("decode", 1, 1)],
    ),
    # Ready is always written; kstatus reads a status without it as Current.
    State(
        "Ready missing",
        kstatus=("Current", "Resource is current"),
        argo=("Progressing", "waiting for the Ready condition"),
        ready=None,
    ),
    # gitops-engine decides a resource being deleted before any health script runs.
    State(
        "being deleted",
        kstatus=("Terminating", "Resource scheduled for deletion"),
        argo=("Progressing", "Pending deletion"),
        deleting=True,
    ),
]
NOT_DELETING = [s for s in STATES if not s.deleting]


def ids(state: State) -> str:
    return state.name


@pytest.mark.parametrize("state", STATES, ids=ids)
def test_flux_kstatus_verdict(state: State) -> None:
    assert kstatus(state.obj()) == state.kstatus


@pytest.mark.parametrize("state", STATES, ids=ids)
def test_argo_cd_health_verdict(state: State) -> None:
    assert argo_health(state.obj()) == state.argo


def test_the_states_cover_every_verdict() -> None:
    assert {s.kstatus[0] for s in STATES} == {"InProgress", "Current", "Failed", "Terminating"}
    assert {s.argo[0] for s in STATES} == {"Progressing", "Degraded", "Healthy", "Suspended"}


# -- negative checks: the verdicts come from the health check, and the table tells -------


@pytest.mark.parametrize("state", NOT_DELETING, ids=ids)
def test_without_the_health_check_argo_cd_gives_no_health(state: State) -> None:
    assert argo_health(state.obj(), script=None)[0] == ""


def test_the_check_applies_to_omnipipelines_only(tmp_path: Path) -> None:
    obj = stalled("CrashLooping", "stage encode: exits").obj()
    assert argo_health(obj, key="omnipipe.io_OtherKind")[0] == ""
    assert argo_health(obj, key=ARGOCD_KEY)[0] == "Degraded"


NAIVE_LUA = """\
hs = {status = "Progressing", message = "not ready"}
for _, c in ipairs(obj.status and obj.status.conditions or {}) do
  if c.type == "Ready" and c.status == "True" then
    hs.status = "Healthy"
    hs.message = c.message
  end
end
return hs
"""


def test_a_check_that_reads_only_ready_fails_the_table(tmp_path: Path) -> None:
    script = tmp_path / "naive.lua"
    script.write_text(NAIVE_LUA)
    wrong = {s.name for s in NOT_DELETING if argo_health(s.obj(), script=script) != s.argo}
    assert {
        "a new generation not observed yet",
        "rolling out while the old revision serves",
        "every stage scaled to zero",
        "stalled: CrashLooping",
        "Ready missing",
    } <= wrong


def test_kstatus_reads_whichever_of_reconciling_and_stalled_comes_first() -> None:
    """Why the operator never writes both True: kstatus' verdict would then hang on the
    order of the conditions. The health check puts Stalled first either way."""
    both = State(
        "both",
        kstatus=("", ""),
        argo=("", ""),
        reconciling=("True", "RollingOut", ROLLING),
        stalled=("True", "CrashLooping", "stage encode: exits"),
    ).obj()
    conditions = both["status"]["conditions"]
    assert kstatus(both) == ("InProgress", ROLLING)  # Reconciling is listed first
    both["status"]["conditions"] = list(reversed(conditions))
    assert kstatus(both) == ("Failed", "stage encode: exits")
    assert argo_health(both) == ("Degraded", "CrashLooping: stage encode: exits")


@pytest.mark.parametrize(
    ("lua", "returncode", "error"),
    [
        ("hs = {status = 'Healthy'\n", 1, "syntax error"),
        ("return {status = obj.status.missing.field}", 1, "attempt to index"),
        # Argo CD opens no `string` library for a check from argocd-cm.
        ("return {status = string.format('%s', 'Healthy')}", 1, "string"),
        ("return 'Healthy'", 1, "expect table output from Lua script, not string"),
        ("return {status = 'Broken'}", 3, "not one of Healthy, Progressing"),
        ("return {message = 'no status'}", 3, "not one of Healthy, Progressing"),
        ("return {}", 3, "no status"),
        ("return nil", 3, "no status"),
    ],
    ids=[
        "syntax",
        "runtime",
        "closed-string-lib",
        "not-a-table",
        "invalid",
        "no-status",
        "empty",
        "nil",
    ],
)
def test_a_broken_check_is_an_error(tmp_path: Path, lua: str, returncode: int, error: str) -> None:
    script = tmp_path / "broken.lua"
    script.write_text(lua)
    with pytest.raises(ToolFailed) as failed:
        argo_health(STATES[0].obj(), script=script)
    assert failed.value.returncode == returncode
    assert error in failed.value.stderr


def test_a_check_that_never_returns_is_stopped_by_argo_cds_time_limit(tmp_path: Path) -> None:
    script = tmp_path / "loop.lua"
    script.write_text("while true do end\n")
    start = time.monotonic()
    with pytest.raises(ToolFailed) as failed:
        argo_health(STATES[0].obj(), script=script)
    assert failed.value.returncode == 1
    assert "context deadline exceeded" in failed.value.stderr
    assert time.monotonic() - start < 10


def test_the_header_snippet_installs_the_check(tmp_path: Path) -> None:
    """The argocd-cm snippet in health.lua's header, with the file pasted in as it says,
    is a ConfigMap whose key installs this check for OmniPipelines."""
    lines = HEALTH_LUA.read_text().splitlines()
    start = lines.index("--   apiVersion: v1")
    snippet = []
    for line in lines[start:]:
        snippet.append(line.removeprefix("--   "))
        if line.rstrip().endswith(": |"):
            indent = len(snippet[-1]) - len(snippet[-1].lstrip()) + 2
            break
    body = [" " * indent + line if line else "" for line in lines]
    cm = yaml.safe_load("\n".join(snippet + body) + "\n")
    assert (cm["kind"], cm["metadata"]["name"], cm["metadata"]["namespace"]) == (
        "ConfigMap",
        "argocd-cm",
        "argocd",
    )
    ((key, lua),) = cm["data"].items()
    assert key == f"resource.customizations.health.{ARGOCD_KEY}"
    assert lua == HEALTH_LUA.read_text()
    script = tmp_path / "from-configmap.lua"
    script.write_text(lua)
    obj = stalled("Unschedulable", "stage denoise: no node").obj()
    key_suffix = key.removeprefix("resource.customizations.health.")
    assert argo_health(obj, script=script, key=key_suffix) == (
        "Degraded",
        "Unschedulable: stage denoise: no node",
    )
