"""The benchmark runner and the plain family run end to end, and their checks can fail."""

from __future__ import annotations

import io
from typing import Any

import pytest

from kvrows.app.bench import plain
from kvrows.app.bench.plain import IMPLEMENTATIONS, OPERATIONS, Shape, ShapeBench
from kvrows.app.bench.runner import BenchCheckError, run_family

TINY = Shape(3, 16, heads=2, head_dim=8, query_heads=4)


def test_plain_bench_prints_every_operation() -> None:
    out = io.StringIO()
    assert run_family(plain.family(shapes=[TINY]), quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    table = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    assert header[:6] == ["op", "B", "L", "kvrows ms", "mlx-lm ms", "ratio"]
    assert {"copy ms", "MB moved"} <= set(header)
    ops = [line.strip("|").split("|")[0].strip() for line in table[2:]]
    assert ops == list(OPERATIONS)
    for line in table[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        kvrows_ms, mlx_lm_ms = float(cells[3]), float(cells[4])
        assert kvrows_ms > 0 and mlx_lm_ms > 0
        assert float(cells[5]) == pytest.approx(mlx_lm_ms / kvrows_ms, rel=0.05, abs=0.01)
    assert "WRONG RESULT" not in text


def test_run_bench_reports_a_wrong_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A workload whose result is wrong makes the run fail (exit status 1) and says so."""
    original = ShapeBench.workload

    def broken(self: ShapeBench, op: str, impl: str) -> Any:
        workload = original(self, op, impl)
        if op == "merge" and impl == "kvrows":
            # Merge the rows in reverse: same shape, wrong order.
            run = workload.run
            workload.run = lambda rows: run(list(reversed(rows)))
        return workload

    monkeypatch.setattr(ShapeBench, "workload", broken)
    out = io.StringIO()
    assert run_family(plain.family(shapes=[TINY]), quick=True, repeats=1, out=out) == 1
    assert "WRONG RESULT: merge B=3 L=16 kvrows" in out.getvalue()


def _wrong_result(bench: ShapeBench, op: str, impl: str) -> Any:
    """A plausible but wrong result of ``op``: right kind, wrong rows, order or step."""
    adapter = bench.adapter(impl)
    workload = bench.workload(op, impl)
    state = workload.setup()
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


@pytest.mark.parametrize("impl", ["kvrows", "mlx-lm", "reference"])
@pytest.mark.parametrize("op", ["join", "filter-half", "filter-one", "extract", "update", "decode"])
def test_checks_catch_a_wrong_result(op: str, impl: str) -> None:
    """Each check accepts the real result and refuses a wrong one (so it can fail)."""
    bench = ShapeBench(Shape(4, 24, heads=2, head_dim=8, query_heads=4))
    right = bench.workload(op, impl)
    right.check(right.run(right.setup()))
    wrong = _wrong_result(bench, op, impl)
    with pytest.raises(BenchCheckError):
        right.check(wrong)


def test_copy_baselines_move_the_operation_bytes() -> None:
    bench = ShapeBench(Shape(2, 16, heads=2, head_dim=8))
    for impl in ("copy", "memcpy"):
        workload = bench.workload("merge", impl)
        assert workload.bytes_moved == 2 * 2 * 16 * (2 * 2 * 8 * 2)
        workload.check(workload.run(workload.setup()))
    assert set(IMPLEMENTATIONS) >= {"kvrows", "mlx-lm", "copy"}
