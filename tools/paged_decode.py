"""Paged decode against contiguous decode, side by side: one step (``make_mask(1)``, the
append of one token per row, ``mx.fast`` SDPA over what the read returned) on the paged
family's live batch (``kvrows bench --family paged``: rows of L float16 tokens, 8 KV heads x
128, block size 16), interleaved with the same step on a contiguous ``PaddedKVRows``; the
median of 3 interleaved runs per shape after a first step each, the paged read (the batch
gather) alone, and the first steps (the paged read's buffers are fresh there, reused after).

    .venv/bin/python tools/paged_decode.py [--shape 16x4096] [--shape 64x4096]"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvrows.app.bench.paged import ADAPTERS, CONTIGUOUS, PAGED, PagedShape, _Data, _decode


def _ms(work: Callable[[], object]) -> float:
    started = time.perf_counter()
    work()
    return 1e3 * (time.perf_counter() - started)


def _step(batch: Any, data: _Data) -> Callable[[], object]:
    return lambda: _decode(batch, data)


def _read(batch: Any) -> Callable[[], object]:
    return lambda: mx.eval(batch._read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", help="BxL (default 16x4096 and 64x4096)")
    args = parser.parse_args()
    for text in args.shape or ["16x4096", "64x4096"]:
        rows, tokens = (int(x) for x in text.split("x"))
        data = _Data(PagedShape(rows, tokens))
        batches = {n: ADAPTERS[n].merge(data.rows[n][:rows]) for n in (PAGED, CONTIGUOUS)}
        # The warm-up: the paged step's read takes fresh buffers, which later steps reuse
        # (spec/paged-pool.md §6); a new buffer again about every L/32 steps.
        first = {n: _ms(_step(batch, data)) for n, batch in batches.items()}
        times: dict[str, list[float]] = {n: [] for n in batches}
        for _ in range(3):
            for name, batch in batches.items():
                times[name].append(_ms(_step(batch, data)))
        gather = statistics.median(_ms(_read(batches[PAGED])) for _ in range(3))
        paged, contiguous = (statistics.median(times[n]) for n in (PAGED, CONTIGUOUS))
        kv = 2 * rows * 8 * (tokens + 4) * 128 * 2
        print(
            f"B={rows} L={tokens}: paged {paged:.0f} ms, contiguous {contiguous:.0f} ms "
            f"(contiguous/paged {contiguous / paged:.2f}); the read's gather alone {gather:.0f} ms "
            f"for {kv / 1e6:.0f} MB of KV ({kv / gather / 1e6:.2f} GB/s); the first step "
            f"(fresh read buffers) paged {first[PAGED]:.0f} ms, "
            f"contiguous {first[CONTIGUOUS]:.0f} ms"
        )


if __name__ == "__main__":
    main()
