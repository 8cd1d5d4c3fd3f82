"""kwok's stage configuration for the test cluster: kwok's "fast" stages, plus a way for a
test to decide how each attempt of a Job's pod ends.

kwok completes every Job pod at once (pod-complete). Pods of a pipeline named
MANUAL_PIPELINE are left Running instead, until a test annotates one:
`omnipipe.test/outcome: fail` ends it Failed (exit 3) with `omnipipe.test/message` as its
container's termination message, as `omnipipe fetch --termination-log` would leave it;
`succeed` ends it Succeeded. So a test plays a fetch's attempts one by one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MANUAL_PIPELINE = "fetch-manual"
OUTCOME = "omnipipe.test/outcome"
MESSAGE = "omnipipe.test/message"
_PIPELINE_KEY = '.metadata.labels["omnipipe.io/pipeline"]'


def _outcome_stage(name: str, outcome: str, phase: str, exit_code: int) -> dict[str, Any]:
    message = (
        f'      message: {{{{ index $root.metadata.annotations "{MESSAGE}" | Quote }}}}\n'
        if outcome == "fail"
        else ""
    )
    template = (
        "{{ $now := Now }}\n"
        "{{ $root := . }}\n"
        "containerStatuses:\n"
        "{{ range $index, $item := .spec.containers }}\n"
        "- image: {{ $item.image | Quote }}\n"
        "  name: {{ $item.name | Quote }}\n"
        "  ready: false\n"
        "  restartCount: 0\n"
        "  started: false\n"
        "  state:\n"
        "    terminated:\n"
        f"      exitCode: {exit_code}\n"
        "      finishedAt: {{ $now | Quote }}\n"
        f"      reason: {'Completed' if exit_code == 0 else 'Error'}\n"
        f"{message}"
        "      startedAt: {{ $now | Quote }}\n"
        "{{ end }}\n"
        f"phase: {phase}\n"
    )
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": {
            "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
            "selector": {
                "matchExpressions": [
                    {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"},
                    {"key": ".status.phase", "operator": "In", "values": ["Running"]},
                    {
                        "key": f'.metadata.annotations["{OUTCOME}"]',
                        "operator": "In",
                        "values": [outcome],
                    },
                ]
            },
            "next": {"statusTemplate": template},
        },
    }


def write_config(fast_stages: Path, out: Path) -> Path:
    docs = [d for d in yaml.safe_load_all(fast_stages.read_text()) if d]
    for doc in docs:
        if doc["metadata"]["name"] == "pod-complete":
            doc["spec"]["selector"]["matchExpressions"].append(
                {"key": _PIPELINE_KEY, "operator": "NotIn", "values": [MANUAL_PIPELINE]}
            )
    docs.append(_outcome_stage("omnipipe-test-attempt-fails", "fail", "Failed", 3))
    docs.append(_outcome_stage("omnipipe-test-attempt-succeeds", "succeed", "Succeeded", 0))
    out.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return out
