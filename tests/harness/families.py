"""omnipipe's own families alone, as an image without plugins loads them: what the
committed CRD and README are generated from, whatever else the test venv has installed
(tests/plugins/sketch)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import distribution

import pytest

from omnipipe.api.families import ENTRY_POINT_GROUP, FAMILIES_ENV, installed_families


def own_family_names() -> list[str]:
    return [e.name for e in distribution("omnipipe").entry_points if e.group == ENTRY_POINT_GROUP]


@contextmanager
def only_families(monkeypatch: pytest.MonkeyPatch, names: list[str]) -> Iterator[None]:
    """The registry as a process with OMNIPIPE_FAMILIES=names would load it."""
    with monkeypatch.context() as patch:
        patch.setenv(FAMILIES_ENV, ",".join(names))
        installed_families.cache_clear()
        try:
            yield
        finally:
            installed_families.cache_clear()
    installed_families.cache_clear()
