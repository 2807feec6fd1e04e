"""``kvrows example``: continuous batching of four requests through one layer's KV cache.

A narrated walk through the plain family's row operations with the optimized
(MLX) implementation. Every request also keeps its own serial ``KVCache``
(its prefill cache, which the merge only borrows) that sees exactly the same
appends; at every decode step each row's attention output is compared with
its solo one, and at the end every row leaving the batch (published or
extracted) must equal its solo cache byte for byte (``spec/PaddedKVRows.md``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

import kvrows.optimized as kv
from kvrows.table import owned_cache_layout, publish_row

__all__ = ["run_example"]

HEADS, Q_HEADS, DIM = 2, 4, 16  # 2 KV heads shared by 4 query heads (GQA)
SCALE = DIM**-0.5
ATTENTION_ATOL = 1e-5  # float32: the padded batch and the solo cache reduce in other orders


class Request:
    """One request: a seeded stream of key/value/query vectors and its solo cache."""

    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.solo = kv.KVCache()

    def block(self, n: int) -> tuple[mx.array, mx.array]:
        k, v = self.rng.standard_normal((2, 1, HEADS, n, DIM), dtype=np.float32)
        return mx.array(k), mx.array(v)

    def query(self) -> mx.array:
        return mx.array(self.rng.standard_normal((1, Q_HEADS, 1, DIM), dtype=np.float32))


def _mask_text(mask: Any) -> str:
    return repr(mask) if mask is None or isinstance(mask, str) else f"bool {tuple(mask.shape)}"


def _describe(layout: Any) -> str:
    return (
        f"rows={layout.batch_size} row_offsets={layout.row_offsets} left_pad={layout.left_pad} "
        f"width={layout.width} nbytes={layout.nbytes:,}"
    )


def _prefill(request: Request, tokens: int, chunk: int = 8) -> None:
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        request.solo.update_and_fetch(*request.block(n))
        done += n
    print(f"  prefill {request.name}: {tokens} tokens in chunks of <= {chunk} -> {request.solo!r}")


def _decode(layout: Any, requests: list[Request], step: int) -> float:
    """One decode step for every row; returns the largest |batched - solo| attention error."""
    positions = np.array(layout.offset).tolist()  # RoPE positions, read once before the append
    mask = layout.make_mask(1)
    blocks = [r.block(1) for r in requests]
    queries = [r.query() for r in requests]
    keys, _ = layout.update_and_fetch(
        mx.concatenate([k for k, _ in blocks]), mx.concatenate([v for _, v in blocks])
    )
    out = kv.attend(mx.concatenate(queries), layout, mask, SCALE)
    error = 0.0
    for b, (request, (k, v), q) in enumerate(zip(requests, blocks, queries, strict=True)):
        solo_mask = request.solo.make_mask(1)
        request.solo.update_and_fetch(k, v)
        solo_out = kv.attend(q, request.solo, solo_mask, SCALE)
        error = max(error, float(mx.max(mx.abs(out[b : b + 1] - solo_out))))
    print(
        f"  decode step {step}: positions {positions}, mask {_mask_text(mask)}, "
        f"keys read {tuple(keys.shape)}, max |attention - solo| = {error:.1e}"
    )
    return error


def _same(name: str, row: Any, request: Request) -> bool:
    """Same offset, and the same keys and values (shape, dtype and every byte)."""
    solo = request.solo
    same = row.offset == solo.offset and all(
        x.dtype == y.dtype and mx.array_equal(x, y).item()
        for x, y in zip(row.fetch(), solo.fetch(), strict=True)
    )
    print(f"  {name}: {row!r} vs solo {solo!r}: {'equal' if same else 'DIFFERENT'}")
    return same


def run_example() -> int:
    """Run the walk-through; 0 when every check passes, 1 otherwise."""
    requests = [Request(name, seed) for seed, name in enumerate("ABCD")]
    a, b, c, d = requests
    errors: list[float] = []

    print("1. Prefill three requests of different prompt lengths, each in its own KVCache")
    for request, tokens in ((a, 5), (b, 12), (c, 3)):
        _prefill(request, tokens)

    print("2. merge_rows: form the decode batch (the layout the row-layout table names)")
    layout = owned_cache_layout(a.solo)
    assert isinstance(layout, kv.PaddedKVRows)
    layout.merge_rows([a.solo, b.solo, c.solo])  # borrowed: the solo caches stay as they were
    running = [a, b, c]
    print(f"  {type(layout).__name__}: {_describe(layout)}")
    print(f"  one more token costs {layout.projected_bytes(1)} bytes per row (K + V)")

    print("3. Decode with attention (rows share one write column; the mask hides each pad)")
    errors += [_decode(layout, running, step) for step in (1, 2, 3)]
    print(f"  after decode: {_describe(layout)}")

    print("4. merge_rows on a running batch: D (20 tokens) joins; the others' pads grow")
    _prefill(d, 20)
    layout.merge_rows([d.solo])
    running.append(d)
    print(f"  after join: {_describe(layout)}")
    errors += [_decode(layout, running, step) for step in (4, 5)]

    print("5. D finishes: publish_row hands out its cache, filter_rows drops the row")
    published = publish_row(layout, 3, layout.row_offsets[3])
    if published is None:
        print("  publish_row refused row 3: FAIL")
        return 1
    print(f"  publish_row(layout, 3, {published.offset}) -> {published!r}")
    layout.filter_rows([0, 1, 2])
    running.pop()
    print(f"  after filter: {_describe(layout)} (the padding every survivor shared is gone)")
    errors.append(_decode(layout, running, 6))

    print("6. extract_row: every remaining row as an independent compact KVCache")
    rows = [layout.extract_row(i) for i in range(layout.batch_size)]
    for row, request in zip(rows, running, strict=True):
        print(f"  extract_row -> {request.name}: {row!r}")

    print("7. Solo replay: every row that left equals the serial cache that saw its tokens")
    checks = [_same("D (published)", published, d)]
    checks += [_same(r.name, row, r) for row, r in zip(rows, running, strict=True)]
    worst = max(errors)
    checks.append(worst <= ATTENTION_ATOL)
    print(f"  largest attention error {worst:.1e} (tolerance {ATTENTION_ATOL:.0e})")
    ok = all(checks)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
