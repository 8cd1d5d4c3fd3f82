"""What a SIGHUP to `omnipipe serve` changes (local/reload.py), and the router's side of
it: a replicas file that it re-reads when it changes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from omnipipe.api import parse_resource, resolve
from omnipipe.api.wire import StaticReplicas
from omnipipe.local.reload import plan_reload
from omnipipe.router.discovery import StaticDiscovery

pytestmark = pytest.mark.timeout(30)


def pipeline(**spec: Any) -> Any:
    body = {"model": "tiny://qwen-image", "pipeline": "qwen-image", **spec}
    return resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "p"},
                "spec": body,
            }
        )
    )


def test_a_new_revision_replaces_every_stage() -> None:
    plan = plan_reload(pipeline(), pipeline(transfer={"backend": "tcp"}))
    assert plan.new_revision_rolls_out
    assert not plan.refused
    assert plan.replace == ("encode", "denoise", "decode")
    assert plan.counts == {}


def test_an_in_place_change_adjusts_counts_and_replaces_only_changed_stages() -> None:
    old = pipeline()
    scaled = plan_reload(old, pipeline(stages=[{"name": "denoise", "replicas": 3}]))
    assert not scaled.new_revision_rolls_out
    assert scaled.replace == ()
    assert scaled.counts["denoise"] == (1, 3)
    assert scaled.changes_anything
    resampled = plan_reload(old, pipeline(stages=[{"name": "denoise", "sampling": {"seed": 1}}]))
    assert not resampled.new_revision_rolls_out
    assert resampled.replace == ("denoise",)
    assert not plan_reload(old, pipeline()).changes_anything


def test_an_adapter_change_goes_to_the_running_workers_instead_of_replacing_them() -> None:
    ink = {"name": "ink", "source": "/loras/ink", "stage": "denoise"}
    neon = {"name": "neon", "source": "/loras/neon", "stage": "denoise"}
    old = pipeline(adapters=[ink])
    swapped = plan_reload(old, pipeline(adapters=[neon]))
    assert not swapped.new_revision_rolls_out
    assert swapped.replace == ()
    assert [a.name for a in swapped.adapters["denoise"]] == ["neon"]
    assert swapped.changes_anything
    assert plan_reload(old, pipeline(adapters=[])).adapters == {"denoise": ()}
    assert not plan_reload(old, pipeline(adapters=[ink])).changes_anything
    # A stage replaced anyway starts with its new set: nothing to send it.
    both = plan_reload(
        old, pipeline(adapters=[neon], stages=[{"name": "denoise", "sampling": {"seed": 1}}])
    )
    assert both.replace == ("denoise",)
    assert both.adapters == {}


def test_a_model_change_rolls_out_a_new_revision() -> None:
    plan = plan_reload(pipeline(), pipeline(model="/models/qwen-image-v2"))
    assert not plan.refused
    assert plan.new_revision_rolls_out
    assert plan.replace == ("encode", "denoise", "decode")
    staged = plan_reload(pipeline(), pipeline(stages=[{"name": "encode", "model": "/m/enc"}]))
    assert not staged.refused
    assert staged.new_revision_rolls_out


def test_a_change_to_what_the_router_is_built_on_is_refused() -> None:
    renamed = resolve(
        parse_resource(
            {
                "apiVersion": "omnipipe.io/v1alpha1",
                "kind": "OmniPipeline",
                "metadata": {"name": "q"},
                "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
            }
        )
    )
    plan = plan_reload(pipeline(), renamed)
    assert plan.refused.startswith("it changes name:")
    assert "restart `omnipipe serve`" in plan.refused
    assert not plan.changes_anything


def test_the_router_rereads_a_changed_replicas_file(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    path.write_text('{"encode": ["http://a"]}')  # the older plain form still reads
    discovery = StaticDiscovery.from_file(str(path))
    assert asyncio.run(discovery.endpoints("encode")) == ["http://a"]
    assert discovery.preferred_revision() is None
    new = StaticReplicas(stages={"encode": ["http://b"]}, revision="r2", generation=7)
    tmp = tmp_path / "replicas.tmp"
    tmp.write_text(new.model_dump_json())
    os.replace(tmp, path)
    asyncio.run(discovery.refresh())
    assert asyncio.run(discovery.endpoints("encode")) == ["http://b"]
    assert (discovery.preferred_revision(), discovery.generation()) == ("r2", 7)
    # A torn or broken file keeps the last good one.
    path.write_text("{not json")
    asyncio.run(discovery.refresh())
    assert asyncio.run(discovery.endpoints("encode")) == ["http://b"]
