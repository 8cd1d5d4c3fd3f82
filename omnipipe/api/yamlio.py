"""YAML people write and read. Output: multi-line strings as literal blocks, keys in given
order. Input: safe YAML whose aliases may not expand it past MAX_EXPANDED_NODES (a 1 KB
file of nested anchors otherwise expands to gigabytes once anything walks it), nested at
most MAX_DEPTH deep (past Python's recursion limit, PyYAML crashes)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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


# A pipeline file of every stage with every option is a few hundred nodes.
MAX_EXPANDED_NODES = 100_000


class RefusedYaml(yaml.YAMLError):
    """YAML that parses but is refused for its shape; its message says why."""


class ExpandsTooFar(RefusedYaml):
    """A document whose aliases would expand it past MAX_EXPANDED_NODES."""


# A pipeline file nests about eight levels; PyYAML composes a node recursively.
MAX_DEPTH = 64


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes in the document once every alias is copied out; a shared node is counted
    each time it is used, but walked once."""
    if id(node) in sizes:
        return sizes[id(node)]
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = size
    return size


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise RefusedYaml(f"nested deeper than {MAX_DEPTH} levels; not a pipeline file")
            node: yaml.Node | None = super().compose_node(parent, index)
            return node
        finally:
            self._depth -= 1

    def compose_document(self) -> yaml.Node | None:
        node: yaml.Node | None = super().compose_document()
        if node is not None and _expanded_size(node, {}) > MAX_EXPANDED_NODES:
            raise ExpandsTooFar(
                f"its aliases expand it past {MAX_EXPANDED_NODES} YAML nodes; not a pipeline file"
            )
        return node


def load(text: str) -> Any:
    """One safe YAML document, bounded as the module says."""
    return yaml.load(text, Loader=_BoundedLoader)


def load_all(text: str) -> Iterator[Any]:
    """Every document of a safe YAML stream, each bounded as the module says."""
    return yaml.load_all(text, Loader=_BoundedLoader)
