"""A decode step of a wrapped batch ring the way mlx-lm's attention runs it through the
drop-in: ``make_mask(1)``, ``update_and_fetch`` and ``mx.fast`` SDPA over what it returned
(physical order), evaluated. ``BatchedRotatingCache`` in the ordered form
(``ordered_reads = True``, what kvrows' attention keeps), in the physical form (the
default for a ring no reader asks for time order) and mlx-lm's ``BatchRotatingKVCache``,
interleaved; the median step of each (``spec/RotatingKVCache.md`` §2.1).

    .venv/bin/python tools/ring_dropin_cost.py [--batch 16] [--window 1024] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache

from kvrows.optimized.classes import BatchedRotatingCache, RotatingKVCache

HEADS, DIM = 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    rows, window = args.batch, args.window
    lengths = [window + 8 * b for b in range(rows)]  # every row past its window
    blocks = [mx.random.normal((1, HEADS, n, DIM)).astype(mx.float16) for n in lengths]
    token = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.float16)
    queries = mx.random.normal((rows, 4 * HEADS, 1, DIM)).astype(mx.float16)

    def ours(ordered: bool | None) -> Any:
        serial = []
        for block in blocks:
            ring = RotatingKVCache(window)
            ring.update_and_fetch(block, block)
            serial.append(ring)
        layout = BatchedRotatingCache.merge(serial)
        layout.ordered_reads = ordered
        return layout

    width = max(lengths)
    padded = mx.concatenate(
        [mx.pad(b, [(0, 0), (0, 0), (width - b.shape[2], 0), (0, 0)]) for b in blocks]
    )
    theirs = BatchRotatingKVCache(window, [width - n for n in lengths])
    theirs.update_and_fetch(padded, padded)
    caches = {"ordered form": ours(True), "physical form": ours(None), "mlx-lm": theirs}

    def step(cache: Any) -> float:
        started = time.perf_counter()
        mask = cache.make_mask(1)
        keys, values = cache.update_and_fetch(token, token)
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.1, mask=mask)
        mx.eval(out)
        return 1e3 * (time.perf_counter() - started)

    for cache in caches.values():  # warm-ups (the ordered form is entered on the first)
        for _ in range(3):
            step(cache)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for _ in range(args.rounds):
        for name, cache in caches.items():
            times[name].append(step(cache))
    medians = {name: statistics.median(taken) for name, taken in times.items()}
    print(f"B={rows} W={window} float16, {HEADS} KV heads x {DIM}, median of {args.rounds}:")
    for name, ms in medians.items():
        print(f"  {name:14s} {ms:8.2f} ms  x mlx-lm {ms / medians['mlx-lm']:.2f}")


if __name__ == "__main__":
    main()
