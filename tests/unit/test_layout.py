"""The house rules that keep omnipipe/ readable as families are added (issue #41): no
import circle between its modules, counting imports made only for type checking, and no
module over 400 lines. A module still over is listed here with its size: it may shrink,
never grow, and leaves the list once it is within the limit."""

from __future__ import annotations

from pathlib import Path

import grimp

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "omnipipe"
MAX_LINES = 400
# Over the limit, to be split: the size each had when it was listed. Empty since issue #41
# split the last seven; a module may be listed here only with a reason in its commit.
STILL_OVER: dict[str, int] = {}


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm,
    iterative: the graph is deep enough to pass Python's recursion limit one day)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    imported = sorted(graph.find_modules_directly_imported_by(target))
                    work.append((target, iter(imported)))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_circles_finds_a_circle_and_only_the_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "b", "c", "d"):
        graph.add_module(module)
    graph.add_import(importer="a", imported="b")
    graph.add_import(importer="b", imported="c")
    graph.add_import(importer="c", imported="a")
    graph.add_import(importer="c", imported="d")
    assert circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_omnipipe() -> None:
    graph = grimp.build_graph("omnipipe", exclude_type_checking_imports=False)
    assert circles(graph) == []


def test_no_module_over_400_lines_and_the_listed_ones_only_shrink() -> None:
    sizes = {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    over = {path: lines for path, lines in sizes.items() if lines > MAX_LINES}
    assert {p: n for p, n in over.items() if p not in STILL_OVER} == {}, "split these"
    grown = {p: (sizes[p], STILL_OVER[p]) for p in over if p in STILL_OVER}
    assert {p: n for p, n in grown.items() if n[0] > n[1]} == {}, "(now, listed) grew"
    within = sorted(p for p in STILL_OVER if sizes.get(p, 0) <= MAX_LINES)
    assert within == [], "within the limit (or gone): take these off STILL_OVER"
