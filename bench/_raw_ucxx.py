"""ucxx's low-level API with nothing of ours (the transfer benchmarks' anchor): one
context and worker, and a busy-polling wait."""

from __future__ import annotations


def worker() -> tuple[object, object]:
    """(the libucxx module, a worker of a fresh tag-matching context)."""
    import ucxx._lib.libucxx as lib

    context = lib.UCXContext(feature_flags=(lib.Feature.TAG,))
    return lib, lib.UCXWorker(context)


def wait(ucx_worker: object, requests: list[object]) -> None:
    """Progresses the worker until every request completes, then raises their errors."""
    while not all(r.completed for r in requests):  # type: ignore[attr-defined]
        ucx_worker.progress()  # type: ignore[attr-defined]
    for r in requests:
        r.check_error()  # type: ignore[attr-defined]
