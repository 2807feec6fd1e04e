"""The affine, rotating and engine benchmarks run end to end, and their result checks can fail."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from bench_helpers import column, reverse_merge, tables, wrong_result

import kvrows.app.bench as bench
import kvrows.optimized as optimized
from kvrows.app import cli
from kvrows.app.bench import affine, engine, ring
from kvrows.app.bench.affine import (
    AFFINE_BITS,
    AFFINE_OPERATIONS,
    ATTENTION_STORAGES,
    QUANTIZE_IMPLEMENTATIONS,
    AffineShapeBench,
    AffineShapes,
    AttentionBench,
    QuantizeBench,
)
from kvrows.app.bench.plain import Shape
from kvrows.app.bench.ring import RING_OPERATIONS, RingShape, RingShapeBench, ring_rows
from kvrows.app.bench.runner import (
    BenchCheckError,
    Case,
    Family,
    Line,
    Table,
    Timing,
    Workload,
    run_family,
    to_numpy,
)

TINY_AFFINE = AffineShapes(
    quantize=Shape(2, 16, heads=2),
    rows=(Shape(3, 40, heads=2, dtype="bfloat16"),),
    attention=Shape(3, 40, heads=2, query_heads=4, dtype="bfloat16"),
)
TINY_RING = RingShape(3, 20, heads=2, head_dim=8, query_heads=4, window=16)


# -- the runs -------------------------------------------------------------------------------


def test_affine_bench_prints_every_operation() -> None:
    out = io.StringIO()
    assert run_family(affine.family(shapes=TINY_AFFINE), quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    assert "WRONG RESULT" not in text
    quantize, rows, attention = tables(text)

    assert column(quantize, "quantize") == [*QUANTIZE_IMPLEMENTATIONS] * len(AFFINE_BITS)
    assert all(float(ms) > 0 for ms in column(quantize, "ms"))

    expected = [(op, str(bits)) for op in AFFINE_OPERATIONS for bits in AFFINE_BITS]
    assert list(zip(column(rows, "op"), column(rows, "bits"), strict=True)) == expected
    for quantized, plain, ratio in zip(
        column(rows, "affine ms"),
        column(rows, "plain ms"),
        column(rows, "plain/affine"),
        strict=True,
    ):
        assert float(quantized) > 0 and float(plain) > 0
        assert float(ratio) == pytest.approx(float(plain) / float(quantized), rel=0.05, abs=0.01)
    # The quantized planes are smaller than the bf16 ones, 4-bit smaller than 8-bit.
    moved = [float(x) for x in column(rows, "MB moved")]
    plain_moved = [float(x) for x in column(rows, "MB plain")]
    for eight, four, bf16 in zip(moved[::2], moved[1::2], plain_moved[::2], strict=True):
        assert four <= eight <= bf16

    assert column(attention, "storage") == list(ATTENTION_STORAGES)
    assert all(float(ms) > 0 for ms in column(attention, "kvrows ms"))
    assert all(float(ms) > 0 for ms in column(attention, "mlx-lm ms"))


def test_ring_bench_prints_every_operation() -> None:
    out = io.StringIO()
    assert run_family(ring.family(shapes=[TINY_RING]), quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    assert "WRONG RESULT" not in text
    (table,) = tables(text)
    assert column(table, "op") == list(RING_OPERATIONS)
    for kv, lm, ratio in zip(
        column(table, "kvrows ms"),
        column(table, "mlx-lm ms"),
        column(table, "ratio"),
        strict=True,
    ):
        assert float(kv) > 0 and float(lm) > 0
        assert float(ratio) == pytest.approx(float(lm) / float(kv), rel=0.05, abs=0.01)
    assert "every operation at least as fast as mlx-lm" in text


def test_engine_bench_runs_both_and_compares_tokens() -> None:
    out = io.StringIO()
    family = engine.family(max_batches=(2,), requests=3, serving=False)
    assert run_family(family, quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    (table,) = tables(text)
    assert column(table, "max batch") == ["2"]
    assert column(table, "same tokens") == ["True"]
    assert int(column(table, "generated")[0]) > 0
    assert "WRONG RESULT" not in text


def test_engine_bench_check_refuses_different_tokens() -> None:
    (case,) = engine.family(max_batches=(1,), requests=2).tables[0].cases
    case.workloads["kvrows"].check({"r00": [1, 2]})
    with pytest.raises(BenchCheckError, match="r00"):
        case.workloads["mlx-lm"].check({"r00": [1, 3]})


def test_cli_bench_all_runs_every_family(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--family all`` runs each family once, through the one runner, and fails if any of
    them found a wrong result."""
    calls: list[str] = []

    def check(result: Any) -> None:
        if result == "affine":
            raise BenchCheckError("planted")

    def fake(name: str, *, quick: bool = False) -> Family:
        calls.append(name)
        assert quick
        workload = Workload("op", "kvrows", None, 0, lambda: name, lambda s: s, check)

        def lines(t: Mapping[str, Timing]) -> list[Line]:
            return [{"family": name, "kvrows ms": t["kvrows"].cell}]

        case = Case(f"op {name}", {"kvrows": workload}, lines)
        return Family(name, "fake", [Table([case])], "notes")

    monkeypatch.setattr(bench, "family", fake)
    assert cli.main(["bench", "--family", "all", "--quick", "--repeats", "1"]) == 1
    assert calls == [
        "plain", "affine", "rotating", "engine", "speculative", "delayed", "turbo", "paged"
    ]  # fmt: skip
    text = capsys.readouterr().out
    assert "WRONG RESULT: op affine kvrows: planted" in text
    assert [line[0] for table in tables(text) for line in table[1:]] == calls


def test_run_affine_bench_reports_awrong_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong affine merge makes the run fail (exit status 1) and says so."""
    reverse_merge(monkeypatch, AffineShapeBench, "affine")
    out = io.StringIO()
    family = affine.family(shapes=TINY_AFFINE, parts=("rows",))
    assert run_family(family, quick=True, repeats=1, out=out) == 1
    assert "WRONG RESULT: merge B=3 L=40 affine8" in out.getvalue()


def test_run_ring_bench_reports_awrong_result(monkeypatch: pytest.MonkeyPatch) -> None:
    reverse_merge(monkeypatch, RingShapeBench, "kvrows")
    out = io.StringIO()
    assert run_family(ring.family(shapes=[TINY_RING]), quick=True, repeats=1, out=out) == 1
    assert "WRONG RESULT: merge B=3 L=20 W=16 kvrows" in out.getvalue()


# -- the checks can fail ----------------------------------------------------------------------


@pytest.mark.parametrize("bits", AFFINE_BITS)
@pytest.mark.parametrize("op", AFFINE_OPERATIONS)
def test_affine_row_checks_catch_awrong_result(op: str, bits: int) -> None:
    bench = AffineShapeBench(Shape(4, 24, heads=2, head_dim=64, dtype="bfloat16"), bits)
    right = bench.workload(op, "affine")
    right.check(right.run(right.setup()))
    with pytest.raises(BenchCheckError):
        right.check(wrong_result(bench, op, "affine"))


@pytest.mark.parametrize(
    "shape",
    [
        RingShape(4, 24, heads=2, head_dim=8, query_heads=4, window=16),  # wrapped
        RingShape(4, 12, heads=2, head_dim=8, query_heads=4, window=16),  # not wrapped
    ],
    ids=["wrapped", "short"],
)
@pytest.mark.parametrize("impl", ["kvrows", "mlx-lm"])
@pytest.mark.parametrize("op", RING_OPERATIONS)
def test_ring_checks_catch_awrong_result(op: str, impl: str, shape: RingShape) -> None:
    bench = RingShapeBench(shape)
    right = bench.workload(op, impl)
    right.check(right.run(right.setup()))
    with pytest.raises(BenchCheckError):
        right.check(wrong_result(bench, op, impl))


@pytest.mark.parametrize("impl", QUANTIZE_IMPLEMENTATIONS)
@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_quantize_check_catches_awrong_result(bits: int, impl: str) -> None:
    """Codes of another token (the input rolled by one token) are refused."""
    bench = QuantizeBench(Shape(2, 8, heads=2, head_dim=128))
    right = bench.workload(impl, bits)
    result = right.run(right.setup())
    right.check(result)
    wrong = tuple(mx.roll(mx.array(np.asarray(p)), 1, 2) for p in result)
    with pytest.raises(BenchCheckError):
        right.check(wrong)


@pytest.mark.parametrize("impl", ["kvrows", "mlx-lm"])
@pytest.mark.parametrize("storage", ATTENTION_STORAGES)
def test_attention_check_catches_awrong_result(storage: str, impl: str) -> None:
    """Attending the padding (no mask) or another row's output is refused."""
    bench = AttentionBench(Shape(4, 64, heads=2, query_heads=4, dtype="bfloat16"))
    right = bench.workload(storage, impl)
    layout, mask = right.setup()
    right.check(right.run((layout, mask)))
    with pytest.raises(BenchCheckError):
        right.check(right.run((layout, None)))
    with pytest.raises(BenchCheckError):
        right.check(right.run((layout, mask))[::-1])


def test_mlx_lm_quantized_attention_leaves_the_queries_alone() -> None:
    """mlx-lm scales its queries in place; the workload hands it a copy."""
    bench = AttentionBench(Shape(2, 16, heads=2, query_heads=4, dtype="bfloat16"))
    before = to_numpy(bench.data.queries).copy()
    workload = bench.workload("8-bit", "mlx-lm")
    first = to_numpy(workload.run(workload.setup()))
    second = to_numpy(workload.run(workload.setup()))
    np.testing.assert_array_equal(to_numpy(bench.data.queries), before)
    np.testing.assert_array_equal(first, second)


# -- bytes and ring order ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", AFFINE_BITS)
def test_affine_bytes_match_the_planes_held(bits: int) -> None:
    """The benchmark's bytes per token equal what a quantized cache's planes hold."""
    shape = Shape(2, 10, heads=2, head_dim=128, dtype="bfloat16")
    bench = AffineShapeBench(shape, bits)
    cache = optimized.QuantizedKVCache(64, bits)
    keys, values = cache.update_and_fetch(bench.data.keys[:1], bench.data.values[:1])
    held = sum(p.nbytes for p in (*keys, *values))
    assert bench.token_bytes * shape.tokens == held
    assert bench.bytes_moved("extract") == 2 * (shape.tokens + 1) * bench.token_bytes

    attention = AttentionBench(shape, data=bench.data)
    for storage in ("bf16", f"{bits}-bit"):
        layout, _ = attention.live(storage)
        k, v = layout.fetch()
        planes = (k, v) if storage == "bf16" else (*k, *v)
        assert attention.bytes_read(storage) == sum(p.nbytes for p in planes)


def test_ring_rows_reads_temporal_order() -> None:
    """A hand-made wrapped ring: column 1 is the oldest; pads and window bound each row."""
    columns = np.arange(4, dtype=np.float32)  # physical columns c0..c3
    keys = np.broadcast_to(columns[None, None, :, None], (2, 1, 4, 1)).copy()
    values = -keys
    rows = ring_rows(keys, values, pads=[-1, 2], offsets=[9, 2], index=1, rotated=True, window=4)
    assert rows[0][0][0, :, 0].tolist() == [1, 2, 3, 0]
    assert rows[1][0][0, :, 0].tolist() == [3, 0]
    assert rows[1][1][0, :, 0].tolist() == [-3, 0]
    # Not wrapped: columns [0, index) in order; a short row starts at its pad.
    rows = ring_rows(keys, values, pads=[0, 1], offsets=[3, 2], index=3, rotated=False, window=4)
    assert rows[0][0][0, :, 0].tolist() == [0, 1, 2]
    assert rows[1][0][0, :, 0].tolist() == [1, 2]
