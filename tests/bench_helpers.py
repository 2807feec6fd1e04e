"""What the benchmark test files share: reading the runner's Markdown tables, and the
plausible wrong results that prove a workload's check can fail."""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.app.bench.plain import ShapeBench


def tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table of ``text``: its lines (header first, rule dropped) as cells."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            current.append([cell.strip() for cell in line.strip("|").split("|")])
        elif current:
            found.append([current[0], *current[2:]])
            current = []
    return found


def column(table: list[list[str]], name: str) -> list[str]:
    """The cells of column ``name`` below the header."""
    index = table[0].index(name)
    return [line[index] for line in table[1:]]


def rows(table: list[list[str]]) -> list[dict[str, str]]:
    """The lines below the header, each as a dict by column name."""
    return [dict(zip(table[0], line, strict=True)) for line in table[1:]]


def reverse_merge(monkeypatch: pytest.MonkeyPatch, bench_class: type[Any], impl: str) -> None:
    """Plant a bug in ``bench_class``: ``impl``'s merge workload merges the rows in
    reverse (same shape, wrong order)."""
    original = bench_class.workload

    def broken(self: Any, op: str, name: str) -> Any:
        workload = original(self, op, name)
        if op == "merge" and name == impl:
            run = workload.run
            workload.run = lambda rows: run(list(reversed(rows)))
        return workload

    monkeypatch.setattr(bench_class, "workload", broken)


def wrong_result(bench: ShapeBench, op: str, impl: str) -> Any:
    """A plausible but wrong result of ``op``: right kind, wrong rows, order or step."""
    adapter = bench.adapter(impl)
    workload = bench.workload(op, impl)
    state = workload.setup()
    if op == "merge":
        return adapter.merge(list(reversed(state)))
    if op == "join":
        return state[0]  # the batch without the new row
    if op in ("filter-half", "filter-one"):
        return adapter.filter(state, list(reversed(bench.keep(op))))
    if op == "extract":
        return adapter.extract(state, 0)  # the workload extracts row B//2
    result = workload.run(state)
    if op == "update":
        result.steps += 1  # claims one step more than the batch took
        return result
    out, steps, offsets = result
    return out, steps + 1, tuple(n + 1 for n in offsets)
