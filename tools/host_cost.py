"""Host cost per layer of one decode step, before evaluation: the mask, the append and the
attention call (``make_mask``, ``update_and_fetch``, ``mx.fast`` SDPA on what it returned),
kvrows' ``PaddedKVRows`` side by side with mlx-lm's ``BatchKVCache``, rows of ragged lengths.

    .venv/bin/python tools/host_cost.py [--batch 16]

Prints microseconds per layer call (the best of 5 runs of 200 calls, evaluated between
runs), for each path and the ratio."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from kvrows.optimized.classes import KVCache, PaddedKVRows

HEADS, DIM, CALLS = 8, 64, 200


def _per_call_us(step: Callable[[], mx.array]) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(CALLS):
            out = step()
        best = min(best, (time.perf_counter() - started) / CALLS)
        mx.eval(out)
    return 1e6 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    rows = args.batch
    lengths = [64 + 8 * b for b in range(rows)]
    block = [mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16) for n in lengths]
    step_kv = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.float16)
    queries = mx.random.normal((rows, 4 * HEADS, 1, DIM)).astype(mx.float16)
    mx.eval(block, step_kv, queries)

    serial = []
    for piece in block:
        cache = KVCache()
        cache.update_and_fetch(piece, piece)
        serial.append(cache)
    ours = PaddedKVRows.merge(serial)
    theirs = BatchKVCache([max(lengths) - n for n in lengths])
    width = max(lengths)
    padded = mx.concatenate(
        [mx.pad(p, [(0, 0), (0, 0), (width - p.shape[2], 0), (0, 0)]) for p in block]
    )
    theirs.update_and_fetch(padded, padded)

    def step(cache: object) -> Callable[[], mx.array]:
        def one() -> mx.array:
            mask = cache.make_mask(1)  # type: ignore[attr-defined]
            keys, values = cache.update_and_fetch(step_kv, step_kv)  # type: ignore[attr-defined]
            return mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=0.125, mask=mask
            )

        return one

    mx.eval(step(ours)(), step(theirs)())
    for _ in range(2):
        kvrows, mlx_lm = _per_call_us(step(ours)), _per_call_us(step(theirs))
        print(
            f"B={rows}: kvrows {kvrows:.1f} us, mlx-lm BatchKVCache {mlx_lm:.1f} us per layer "
            f"({kvrows / mlx_lm:.2f}x)"
        )


if __name__ == "__main__":
    main()
