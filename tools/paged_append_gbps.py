"""Append GB/s into a reused MLX block pool vs NumPy memcpy of the same bytes (issue 13).

Usage: ``.venv/bin/python tools/paged_append_gbps.py [tokens]`` (default 4096; H=8, D=128,
float16, block size 16). Each append opens a table in a pool allocated once, writes the
block through ``BlockPool.append`` (plain codec) and releases the table, so every write
lands in memory the pool already owns.
"""

from __future__ import annotations

import sys
import time

import mlx.core as mx
import numpy as np

from kvrows.optimized.paged import BlockPool
from kvrows.validation import KvGeometry

HEADS, DIM, BLOCK, REPEATS = 8, 128, 16, 20


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    geometry = KvGeometry(HEADS, DIM, DIM, "float16")
    pool = BlockPool(block_size=BLOCK, num_blocks=2 * tokens // BLOCK, geometry=geometry)
    keys = mx.random.normal((1, HEADS, tokens, DIM)).astype(mx.float16)
    values = mx.random.normal((1, HEADS, tokens, DIM)).astype(mx.float16)
    mx.eval(keys, values)
    nbytes = 2 * keys.nbytes

    def append() -> None:
        table = pool.open([])
        pool.append([table], [0], {"keys": (keys,), "values": (values,)}, tokens)
        pool.close([table])

    source = np.random.default_rng(0).standard_normal(nbytes // 2).astype(np.float16)
    target = np.empty_like(source)

    def memcpy() -> None:
        np.copyto(target, source)

    for name, step in (("paged append into a reused MLX pool", append), ("numpy memcpy", memcpy)):
        for _ in range(3):
            step()
        start = time.perf_counter()
        for _ in range(REPEATS):
            step()
        seconds = (time.perf_counter() - start) / REPEATS
        print(
            f"{name}: {nbytes / seconds / 1e9:.2f} GB/s ({nbytes / 1e6:.1f} MB in {seconds * 1e3:.2f} ms)"
        )


if __name__ == "__main__":
    main()
