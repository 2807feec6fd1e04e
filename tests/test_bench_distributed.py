"""``kvrows bench --family distributed --quick`` end to end (one two-process launch, about
12 s here): every table filled, the bytes per scheme those of the stored forms, the sharded
run's tokens equal one process's; and the family stays out of ``--family all``."""

from __future__ import annotations

import io

from bench_helpers import column, tables

from kvrows.app import cli
from kvrows.app.bench import FAMILIES, IN_PROCESS, distributed
from kvrows.app.bench.runner import run_family


def test_the_distributed_family_measures_every_part_in_one_launch() -> None:
    out = io.StringIO()
    assert run_family(distributed.family(quick=True), quick=True, out=out) == 0
    text = out.getvalue()
    transfer, records, parallel = tables(text)
    assert column(transfer, "scheme") == [
        "plain", "affine8:64", "affine4:64", "mxfp4", "turbo-k8v3",
    ]  # fmt: skip
    sizes = [int(b) for b in column(transfer, "bytes")]
    tokens, layers = 256, 1  # --quick: bf16 keys and values, 8 heads of 128
    assert sizes[0] == tokens * layers * 2 * 8 * 128 * 2
    assert all(size < sizes[0] for size in sizes[1:]), sizes
    assert column(records, "record") == ["empty", "2000-token submission"]
    assert column(parallel, "same tokens") == ["yes"]


def test_the_distributed_family_is_not_part_of_all() -> None:
    assert FAMILIES["distributed"] == "distributed" and "distributed" not in IN_PROCESS
    assert "distributed" in cli.BENCH_FAMILIES
