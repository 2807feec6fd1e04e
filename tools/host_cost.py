"""Host cost per layer of one decode step, before evaluation: the mask, the append and the
attention call (``make_mask``, ``update_and_fetch``, ``mx.fast`` SDPA on what it returned),
kvrows' layout side by side with mlx-lm's batch cache, rows of ragged lengths:
``--layout padded`` (the default) is ``PaddedKVRows`` against ``BatchKVCache``, ``--layout
ring`` is ``BatchedRotatingCache`` against ``BatchRotatingKVCache`` (a window of
``--window`` tokens, which the rows fill and wrap during the runs).

    .venv/bin/python tools/host_cost.py [--batch 16] [--layout padded|ring] [--window 256]
                                        [--parts]

Prints microseconds per layer call (the best of 5 runs of 200 calls, evaluated between
runs; wall clock and, less sensitive to other processes on the machine, this process's CPU
time), for each path and the ratio; ``--parts`` adds each call's CPU time."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

from kvrows.optimized.classes import (
    BatchedRotatingCache,
    KVCache,
    PaddedKVRows,
    RotatingKVCache,
)

HEADS, DIM, CALLS = 8, 64, 200


def _per_call_us(step: Callable[[], mx.array]) -> tuple[float, float]:
    """The best wall-clock and CPU time per call, microseconds."""
    wall = cpu = float("inf")
    for _ in range(5):
        started, used = time.perf_counter(), time.process_time()
        for _ in range(CALLS):
            out = step()
        wall = min(wall, (time.perf_counter() - started) / CALLS)
        cpu = min(cpu, (time.process_time() - used) / CALLS)
        mx.eval(out)
    return 1e6 * wall, 1e6 * cpu


def _parts_us(cache: object, step_kv: mx.array, queries: mx.array) -> list[float]:
    """CPU time per call of ``make_mask``, ``update_and_fetch`` and SDPA, best of 15 runs
    of 200 calls (each figure includes one read of the clock)."""
    best = [float("inf")] * 3
    clock = time.process_time
    for _ in range(15):
        spent = [0.0, 0.0, 0.0]
        for _ in range(CALLS):
            started = clock()
            mask = cache.make_mask(1)  # type: ignore[attr-defined]
            masked = clock()
            keys, values = cache.update_and_fetch(step_kv, step_kv)  # type: ignore[attr-defined]
            fetched = clock()
            out = mx.fast.scaled_dot_product_attention(
                queries, keys, values, scale=0.125, mask=mask
            )
            spent[0] += masked - started
            spent[1] += fetched - masked
            spent[2] += clock() - fetched
        best = [min(b, 1e6 * s / CALLS) for b, s in zip(best, spent, strict=True)]
        mx.eval(out)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layout", choices=("padded", "ring"), default="padded")
    parser.add_argument("--window", type=int, default=256, help="the ring's max_size")
    parser.add_argument(
        "--parts", action="store_true", help="also each call's CPU time: mask, append, SDPA"
    )
    args = parser.parse_args()
    rows = args.batch
    lengths = [64 + 8 * b for b in range(rows)]
    block = [mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16) for n in lengths]
    step_kv = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.float16)
    queries = mx.random.normal((rows, 4 * HEADS, 1, DIM)).astype(mx.float16)
    mx.eval(block, step_kv, queries)

    ring = args.layout == "ring"
    serial = []
    for piece in block:
        cache = RotatingKVCache(args.window) if ring else KVCache()
        cache.update_and_fetch(piece, piece)
        serial.append(cache)
    ours = (BatchedRotatingCache if ring else PaddedKVRows).merge(serial)
    pads = [max(lengths) - n for n in lengths]
    theirs = BatchRotatingKVCache(args.window, pads) if ring else BatchKVCache(pads)
    width = max(lengths)
    padded = mx.concatenate(
        [mx.pad(p, [(0, 0), (0, 0), (width - p.shape[2], 0), (0, 0)]) for p in block]
    )
    theirs.update_and_fetch(padded, padded)
    names = ("BatchedRotatingCache", "BatchRotatingKVCache") if ring else ("kvrows", "BatchKVCache")

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
        (kvrows, kvrows_cpu), (mlx_lm, mlx_lm_cpu) = (
            _per_call_us(step(ours)),
            _per_call_us(step(theirs)),
        )
        print(
            f"B={rows} {args.layout}: {names[0]} {kvrows:.1f} us, mlx-lm {names[1]} "
            f"{mlx_lm:.1f} us per layer ({kvrows / mlx_lm:.2f}x); CPU time {kvrows_cpu:.1f} "
            f"vs {mlx_lm_cpu:.1f} us ({kvrows_cpu / mlx_lm_cpu:.2f}x)"
        )

    if args.parts:
        for name, cache in zip(names, (ours, theirs), strict=True):
            mask, append, sdpa = _parts_us(cache, step_kv, queries)
            print(
                f"  {name}: make_mask {mask:.1f} us, update_and_fetch {append:.1f} us, "
                f"SDPA {sdpa:.1f} us (CPU time)"
            )


if __name__ == "__main__":
    main()
