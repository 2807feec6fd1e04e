"""``tools/bench_compare.py``: old against new ``kvrows bench``, per operation."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import pytest

import kvrows.app.bench.runner as runner
from kvrows.app.bench.runner import Case, Family, Line, Table, Timing, Workload, run_family

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_compare.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvrows_tools_bench_compare", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_report_gives_medians_and_flags_a_slower_operation() -> None:
    tool = _tool()
    key_slow, key_same = ("plain", "merge B=4", "kvrows"), ("plain", "merge B=4", "copy")
    samples = {
        "old": {key_slow: [1.0, 2.0, 3.0], key_same: [1.0, 1.0, 1.0]},
        "new": {key_slow: [3.0, 2.5, 9.0], key_same: [1.05, None, 1.05]},
    }
    lines, flagged = tool.report(samples, 1.10)
    assert flagged == 1
    slow = next(line for line in lines if "kvrows" in line)
    assert slow.split()[-4:] == ["2.000", "3.000", "1.50", "SLOWER"]
    same = next(line for line in lines if " copy " in line)
    assert same.split()[-3:] == ["1.000", "1.050", "1.05"]


def test_every_timed_case_reaches_the_driver_through_runner_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The driver reads the runner's medians by wrapping ``runner.Result``: every case a
    family times must be built through that name (old and new code alike)."""
    seen: list[tuple[str, dict[str, float | None]]] = []

    class Recorded(runner.Result):
        def __init__(self, label: str, key: object, timings: Mapping[str, Timing]) -> None:
            super().__init__(label, key, timings)
            seen.append((label, {impl: t.ms for impl, t in timings.items()}))

    monkeypatch.setattr(runner, "Result", Recorded)

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        return [{"op": "op", "ms": t["kvrows"].cell}]

    def check(result: object) -> None:
        assert result == 0

    workload = Workload("op", "kvrows", None, 0, lambda: 0, abs, check)
    cases = [Case(f"op {n}", {"kvrows": workload}, lines) for n in (1, 2)]
    run_family(Family("fake", "fake", [Table(cases)], "notes"), quick=True, repeats=1)
    assert [label for label, _ in seen] == ["op 1", "op 2"]
    assert all(isinstance(t["kvrows"], float) for _, t in seen)
