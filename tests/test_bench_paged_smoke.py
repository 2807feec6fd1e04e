"""The paged bench family runs end to end at tiny shapes, and its checks can fail."""

from __future__ import annotations

import io

import pytest

from kvrows.app.bench import paged
from kvrows.app.bench.paged import OPERATIONS, PagedShape, shape_cases
from kvrows.app.bench.runner import BenchCheckError, run_family

TINY = (PagedShape(3, 40, heads=2, head_dim=32),)


def test_paged_bench_prints_every_operation_with_zero_bytes_for_row_ops() -> None:
    out = io.StringIO()
    assert run_family(paged.family(shapes=TINY), quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    assert "WRONG RESULT" not in text
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("|")]
    ops = [r for r in rows if r[0].strip() in OPERATIONS]
    assert [r[0].strip() for r in ops] == list(OPERATIONS)
    moved = {r[0].strip(): int(r[6]) for r in ops}
    token = TINY[0].token_bytes
    # row operations move no KV byte; decode writes 3 tokens and first copies each row's
    # shared 8-token tail (40 = 2 blocks of 16 + 8): copy on write
    assert moved == {"merge": 0, "filter": 0, "extract": 0, "join": 0, "decode": 3 * token * 9}


def test_the_paged_checks_catch_a_copy_and_a_wrong_row() -> None:
    cases = {case.key[0]: case for case in shape_cases(TINY[0])}
    workload = cases["merge"].workloads["paged"]
    layout, moved = workload.run(workload.setup())
    workload.check((layout, moved))
    with pytest.raises(BenchCheckError, match="bytes moved"):
        workload.check((layout, moved + 1))  # a merge that copied a byte
    layout.filter_rows([2, 1, 0])  # row 0 is no longer the input's row 0
    with pytest.raises(BenchCheckError, match="not the input data"):
        workload.check((layout, moved))
