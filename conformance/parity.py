"""Where kvrows and mlx-lm knowingly differ, so the parity oracle skips exactly those cases.

Every skip the machines take names one entry of :data:`DIVERGENCES`; the runner
counts and prints them and ``tests/test_conformance.py`` fails on a skip
without an entry. In each case kvrows follows the reference (and the spec);
``spec/tolerances.md`` lists the same table with a minimal reproduction of
each mlx-lm behaviour (``B``-codes are ``notes/mlx-lm.md`` §7's; ``N``-codes
were found by this suite).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DIVERGENCES", "Divergence"]


@dataclass(frozen=True)
class Divergence:
    code: str
    operation: str
    mlx_lm: str
    kvrows: str


DIVERGENCES: dict[str, Divergence] = {
    d.code: d
    for d in (
        Divergence(
            "B2",
            "filter of a batch that has no keys yet but has left padding",
            "BatchKVCache.filter moves _idx below zero; the next mask has zero width",
            "drops the shared padding of the survivors; positions never go negative",
        ),
        Divergence(
            "B3",
            "extract from a batch whose rows hold no tokens yet (keys is None)",
            "BatchKVCache.extract raises TypeError ('NoneType' object is not subscriptable)",
            "returns an empty serial KVCache",
        ),
        Divergence(
            "B4",
            "uniform trim(n) with n larger than some row's tokens",
            "BatchKVCache.trim makes that row's offset negative",
            "raises NotTrimmableError and changes nothing",
        ),
        Divergence(
            "B5",
            "merge or join of rows of different dtypes",
            "BatchKVCache.merge casts every row to the first row's dtype; extend promotes",
            "raises IncompatibleRowsError and changes nothing",
        ),
        Divergence(
            "N1",
            "filter keeping no row (keep = [])",
            "BatchKVCache.filter([]) raises ValueError ([gather] indices must be integral: "
            "mx.array([]) is float32)",
            "the layout becomes empty (batch_size 0) and can form a new batch",
        ),
        Divergence(
            "N2",
            "merge of rows with different KV head counts",
            "BatchKVCache.merge broadcasts a 1-head row into every head of an H-head batch",
            "raises IncompatibleRowsError and changes nothing",
        ),
        Divergence(
            "V0",
            "invalid input (bad shape, dtype, index, keep list, count, foreign source)",
            "not validated by mlx-lm (fails later, differently, or silently)",
            "raises a KvRowsError subclass before changing anything; not a parity case",
        ),
    )
}
