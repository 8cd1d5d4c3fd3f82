"""YAML output people read: multi-line strings as literal blocks, keys in given order."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _BlockDumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_BlockDumper.add_representer(str, _str)


def dump(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_BlockDumper, sort_keys=False, width=100)


def dump_all(docs: Iterable[Any]) -> str:
    return yaml.dump_all(docs, Dumper=_BlockDumper, sort_keys=False, width=100)
