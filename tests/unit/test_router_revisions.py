"""The router pins each request to one pipeline revision for every stage it uses."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import pytest

from omnipipe.api import parse_resource, resolve
from omnipipe.api.loading import pipeline_yaml
from omnipipe.api.revision import pipeline_revision
from omnipipe.api.wire import StaticReplicas, WorkerStatus
from omnipipe.router.discovery import StaticDiscovery
from omnipipe.router.errors import StageUnavailable
from omnipipe.router.metrics import RouterMetrics
from omnipipe.router.orchestrator import Orchestrator
from omnipipe.router.replicas import ReplicaPool
from omnipipe.router.routing import ReplicaLoad, choose_revision

STAGES = ("encode", "denoise", "decode")
PIPELINE = resolve(
    parse_resource(
        {
            "apiVersion": "omnipipe.io/v1alpha1",
            "kind": "OmniPipeline",
            "metadata": {"name": "p"},
            "spec": {"model": "tiny://qwen-image", "pipeline": "qwen-image"},
        }
    )
)
NEW = pipeline_revision(PIPELINE)


def rl(url: str, revision: str, load: int = 0, ready: bool = True) -> ReplicaLoad:
    return ReplicaLoad(url, ready, load, f"tcp://{url}", revision)


def test_prefers_the_newest_whole_revision() -> None:
    stages = {s: [rl(f"{s}-old", "old"), rl(f"{s}-new", "new")] for s in STAGES}
    assert choose_revision(stages, ["new"], 8) == "new"
    assert choose_revision(stages, ["old"], 8) == "old"


def test_a_revision_missing_a_stage_is_not_whole() -> None:
    stages = {s: [rl(f"{s}-old", "old"), rl(f"{s}-new", "new")] for s in STAGES}
    stages["decode"] = [rl("decode-old", "old"), rl("decode-new", "new", ready=False)]
    assert choose_revision(stages, ["new"], 8) == "old"
    stages["decode"] = [rl("decode-new", "new", ready=False)]
    assert choose_revision(stages, ["new"], 8) is None  # nothing whole: the caller waits


def test_a_full_preferred_revision_gives_way_to_one_with_room() -> None:
    stages = {s: [rl(f"{s}-old", "old"), rl(f"{s}-new", "new")] for s in STAGES}
    stages["denoise"] = [rl("denoise-old", "old"), rl("denoise-new", "new", load=8)]
    assert choose_revision(stages, ["new"], 8) == "old"


def _orchestrator(
    replicas: dict[str, list[tuple[str, str]]],
    wake_wait: float = 0,
    client: httpx.AsyncClient | None = None,
) -> Orchestrator:
    discovery = StaticDiscovery({s: [url for url, _ in rs] for s, rs in replicas.items()})
    pool = ReplicaPool(PIPELINE, discovery, client or httpx.AsyncClient(), 1.0, 1.0)
    asyncio.run(pool._discover())
    for stage, rs in replicas.items():
        for url, revision in rs:
            replica = pool._replicas[stage][url]
            replica.ready, replica.revision = True, revision
            replica.transfer_address = f"tcp://{url}"
    return Orchestrator(PIPELINE, pool, 5.0, 8, RouterMetrics.create(), wake_wait)


def test_every_stage_of_a_request_is_chosen_from_one_revision() -> None:
    both = {s: [(f"http://{s}-old", "old"), (f"http://{s}-new", NEW)] for s in STAGES}
    orch = _orchestrator(both)
    for _ in range(20):
        chosen = asyncio.run(orch._choose(list(STAGES)))
        assert {r.revision for r in chosen.values()} == {NEW}
    # The router's own revision gone from one stage: whole requests go to the old one.
    only_old = {**both, "decode": [("http://decode-old", "old")]}
    orch = _orchestrator(only_old)
    for _ in range(20):
        chosen = asyncio.run(orch._choose(list(STAGES)))
        assert {r.revision for r in chosen.values()} == {"old"}


def test_no_whole_revision_is_a_clean_503_never_a_mix() -> None:
    split = {
        "encode": [("http://encode-new", NEW)],
        "denoise": [("http://denoise-new", NEW)],
        "decode": [("http://decode-old", "old")],
    }
    orch = _orchestrator(split)
    with pytest.raises(StageUnavailable, match=f"no ready replica of revision {NEW}"):
        asyncio.run(orch._choose(list(STAGES)))


def test_a_request_moves_to_the_new_revision_when_the_old_one_loses_a_stage() -> None:
    # The switch of a rollout on a real node: the old revision's decode pod went while
    # the router still pinned new requests to the old revision, and they waited for it
    # (60 s) instead of taking the new revision, whole by then.
    assert rollout_choice(decode_new_ready_after=0, wake_wait=5, limit=2) == dict.fromkeys(
        STAGES, NEW
    )


def test_a_request_waiting_on_a_lost_stage_moves_once_the_new_revision_is_whole() -> None:
    # The same switch, one moment earlier (CI, the real node): when the old revision's
    # denoise went, the new revision was not whole yet either, so the request waited for
    # the old revision's replica, which never came back, until its 60 s were up. It must
    # take the new revision as soon as that one is whole.
    assert rollout_choice(decode_new_ready_after=0.8, wake_wait=10, limit=4) == dict.fromkeys(
        STAGES, NEW
    )


def rollout_choice(decode_new_ready_after: float, wake_wait: float, limit: float) -> dict[str, str]:
    """The revision of each stage a request is given in the middle of a rollout. What the
    router last saw: the new decode still starting (so old was the revision requests
    started on), the old decode just marked down, and the new encode and denoise busier,
    so the first pick pins the old revision. The old decode is gone for good; the new one
    reports ready `decode_new_ready_after` seconds after the request comes."""
    started = [time.monotonic()]

    def worker(request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}"
        stage, name = request.url.host.split("-")
        if url == "http://decode-old":
            raise httpx.ConnectError("refused", request=request)
        late = url == "http://decode-new" and (
            time.monotonic() < started[0] + decode_new_ready_after
        )
        status = WorkerStatus(
            pipeline="p",
            stage=stage,
            ready=not late,
            draining=False,
            running=0,
            waiting=0,
            transfer_address=f"tcp://{url}",
            revision=NEW if name == "new" else "old",
        )
        return httpx.Response(200, content=status.model_dump_json())

    both = {s: [(f"http://{s}-old", "old"), (f"http://{s}-new", NEW)] for s in STAGES}
    orch = _orchestrator(
        both, wake_wait=wake_wait, client=httpx.AsyncClient(transport=httpx.MockTransport(worker))
    )
    pool = orch.pool
    pool._replicas["decode"]["http://decode-new"].ready = False
    pool.mark_down(pool._replicas["decode"]["http://decode-old"])
    for stage in ("encode", "denoise"):
        pool._replicas[stage][f"http://{stage}-new"].reported_load = 1

    async def choose() -> dict[str, str]:
        started[0] = time.monotonic()
        chosen = await asyncio.wait_for(orch._choose(list(STAGES)), limit)
        return {stage: r.revision for stage, r in chosen.items()}

    return asyncio.run(choose())


def test_the_served_model_follows_the_revision_new_requests_start_on(tmp_path: Path) -> None:
    # `omnipipe serve` after a model change: the replicas file names the new revision and
    # its snapshot; the router answers for that model once the revision is whole.
    v2 = PIPELINE.model_copy(update={"model": "/models/qwen-image-v2"})
    snapshot = tmp_path / "pipeline-v2.yaml"
    snapshot.write_text(pipeline_yaml(v2))
    v2_rev = pipeline_revision(v2)
    replicas = {s: [(f"http://{s}-old", NEW), (f"http://{s}-new", v2_rev)] for s in STAGES}
    path = tmp_path / "replicas.json"
    path.write_text(
        StaticReplicas(
            stages={s: [u for u, _ in rs] for s, rs in replicas.items()},
            revision=v2_rev,
            generation=1,
            pipeline_file=str(snapshot),
        ).model_dump_json()
    )
    pool = ReplicaPool(PIPELINE, StaticDiscovery.from_file(str(path)), httpx.AsyncClient(), 1, 1)
    asyncio.run(pool._discover())
    for stage, rs in replicas.items():
        for url, revision in rs:
            replica = pool._replicas[stage][url]
            replica.ready, replica.revision = True, revision
            replica.transfer_address = f"tcp://{url}"
    orch = Orchestrator(PIPELINE, pool, 5.0, 8, RouterMetrics.create(), 0)
    assert orch.serving_pipeline().model == "/models/qwen-image-v2"
    # Not whole yet: new requests still start on the old revision, with the old model.
    pool._replicas["decode"]["http://decode-new"].ready = False
    assert orch.serving_pipeline().model == "tiny://qwen-image"
    # A snapshot that is not the revision the file names is refused: the last file stays.
    path.write_text(
        StaticReplicas(
            stages={s: [f"http://{s}-old"] for s in STAGES},
            revision="0123456789",
            generation=2,
            pipeline_file=str(snapshot),
        ).model_dump_json()
    )
    os.utime(path, ns=(1, 1))
    asyncio.run(pool._discover())
    assert pool.generation == 1
    assert pool._discovery.preferred_pipeline() == v2
