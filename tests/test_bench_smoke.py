"""The benchmark runner and the plain family run end to end, and their checks can fail."""

from __future__ import annotations

import io

import pytest
from bench_helpers import column, reverse_merge, tables, wrong_result

from kvrows.app.bench import plain
from kvrows.app.bench.plain import IMPLEMENTATIONS, OPERATIONS, Shape, ShapeBench
from kvrows.app.bench.runner import BenchCheckError, run_family

TINY = Shape(3, 16, heads=2, head_dim=8, query_heads=4)


def test_plain_bench_prints_every_operation() -> None:
    out = io.StringIO()
    assert run_family(plain.family(shapes=[TINY]), quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    (table,) = tables(text)
    assert table[0][:6] == ["op", "B", "L", "kvrows ms", "mlx-lm ms", "ratio"]
    assert {"copy ms", "MB moved"} <= set(table[0])
    assert column(table, "op") == list(OPERATIONS)
    for cells in table[1:]:
        kvrows_ms, mlx_lm_ms = float(cells[3]), float(cells[4])
        assert kvrows_ms > 0 and mlx_lm_ms > 0
        assert float(cells[5]) == pytest.approx(mlx_lm_ms / kvrows_ms, rel=0.05, abs=0.01)
    assert "WRONG RESULT" not in text


def test_run_bench_reports_a_wrong_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A workload whose result is wrong makes the run fail (exit status 1) and says so."""
    reverse_merge(monkeypatch, ShapeBench, "kvrows")
    out = io.StringIO()
    assert run_family(plain.family(shapes=[TINY]), quick=True, repeats=1, out=out) == 1
    assert "WRONG RESULT: merge B=3 L=16 kvrows" in out.getvalue()


@pytest.mark.parametrize("impl", ["kvrows", "mlx-lm", "reference"])
@pytest.mark.parametrize("op", ["join", "filter-half", "filter-one", "extract", "update", "decode"])
def test_checks_catch_a_wrong_result(op: str, impl: str) -> None:
    """Each check accepts the real result and refuses a wrong one (so it can fail)."""
    bench = ShapeBench(Shape(4, 24, heads=2, head_dim=8, query_heads=4))
    right = bench.workload(op, impl)
    right.check(right.run(right.setup()))
    wrong = wrong_result(bench, op, impl)
    with pytest.raises(BenchCheckError):
        right.check(wrong)


def test_copy_baselines_move_the_operation_bytes() -> None:
    bench = ShapeBench(Shape(2, 16, heads=2, head_dim=8))
    for impl in ("copy", "memcpy"):
        workload = bench.workload("merge", impl)
        assert workload.bytes_moved == 2 * 2 * 16 * (2 * 2 * 8 * 2)
        workload.check(workload.run(workload.setup()))
    assert set(IMPLEMENTATIONS) >= {"kvrows", "mlx-lm", "copy"}
