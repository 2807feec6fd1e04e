"""A latent decode step: ``MLACache`` vs ``EncodedLatentCache`` (``spec/EncodedLatentCache.md`` §5).

One layer, bf16, DeepSeek-V3's 512 latent + 64 rope per token, on the CPU: ``B`` rows of
lengths ``L`` down to ``L / 2`` merged into one layout (``benchmarks/test_bench_latent.py``'s
rows), then decode steps, each an append of one token per row and the read it returns
(``update_and_fetch``, evaluated with the held arrays, as the engine does at a step's end). ``mla``: ``MLACache``; ``window``:
``EncodedLatentCache`` (affine 8-bit, group 64) reading its decoded window; ``eager``:
the same cache reading the eager way (every read decodes the whole latent, as before the
window). Each layout takes one warm-up step first (the window built), then each run
times ``STEPS`` steps of every implementation in turn (interleaved); the figure is the
median over ``RUNS`` runs of each run's median step. Also measured once per shape: the
first step after a merge (``rebuild``: the window is built at that read) and a step that
outgrows the 256-column buffers (``grow``: new buffers, so the window is rebuilt too).

Run: ``.venv/bin/python tools/latent_decode.py [B,L ...]`` (default: 4,1024 16,1024
4,4096 16,4096).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from kvrows.optimized import EncodedLatentCache, MLACache
from kvrows.schemes import Affine

RANK, ROPE = 512, 64
RUNS, STEPS = 3, 15
CODEC = Affine(bits=8, group_size=64)
SHAPES = ((4, 1024), (16, 1024), (4, 4096), (16, 4096))


class EagerLatentCache(EncodedLatentCache):
    """The eager path the window replaces: every read decodes the whole latent."""

    keeps_window = False


IMPLEMENTATIONS: dict[str, Any] = {
    "mla": MLACache,
    "window": EncodedLatentCache,
    "eager": EagerLatentCache,
}


def _layout(cls: Any, batch: int, tokens: int) -> Any:
    """``batch`` rows of lengths ``tokens`` down to ``tokens / 2``, merged."""
    rows = []
    for b in range(batch):
        n = tokens - (tokens // 2) * b // max(1, batch - 1)
        key = mx.random.key(b)
        latent = mx.random.normal((1, 1, n, RANK), key=key).astype(mx.bfloat16)
        rope = mx.random.normal((1, 1, n, ROPE), key=key).astype(mx.bfloat16)
        cache = cls() if cls is MLACache else cls(codec=CODEC)
        cache.update_and_fetch(latent, rope)
        mx.eval(cache.held_arrays())
        rows.append(cache)
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    mx.eval(layout.held_arrays())
    return layout


def _step(layout: Any, block: tuple[mx.array, mx.array]) -> float:
    start = time.perf_counter()
    # The read and every buffer the step wrote (the engine evaluates held arrays at each
    # step's end): an encoded latent's codes are not part of its read.
    mx.eval(layout.update_and_fetch(*block), layout.held_arrays())
    return 1e3 * (time.perf_counter() - start)


def _to_the_boundary(layout: Any) -> None:
    """Append until the buffers are full: the next append outgrows them (untimed)."""
    room = layout.capacity - layout.width  # (the rows start at column 0 after a merge)
    if room > 0:
        rows = layout.batch_size
        filler = (mx.zeros((rows, 1, room, d), mx.bfloat16) for d in (RANK, ROPE))
        mx.eval(*layout.update_and_fetch(*filler))


def measure(batch: int, tokens: int) -> dict[str, dict[str, float]]:
    block = (mx.zeros((batch, 1, 1, RANK), mx.bfloat16), mx.zeros((batch, 1, 1, ROPE), mx.bfloat16))
    layouts = {name: _layout(cls, batch, tokens) for name, cls in IMPLEMENTATIONS.items()}
    figures: dict[str, dict[str, float]] = {name: {} for name in layouts}
    for name, layout in layouts.items():  # the first step after the merge
        figures[name]["rebuild"] = _step(layout, block)
    runs: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(RUNS):
        for name, layout in layouts.items():
            runs[name].append(statistics.median(_step(layout, block) for _ in range(STEPS)))
    for name, layout in layouts.items():
        figures[name]["step"] = statistics.median(runs[name])
        _to_the_boundary(layout)
        capacity = layout.capacity
        figures[name]["grow"] = _step(layout, block)
        assert layout.capacity > capacity  # the step did outgrow the buffers
    return figures


def main() -> None:
    shapes = [tuple(int(x) for x in arg.split(",")) for arg in sys.argv[1:]] or list(SHAPES)
    print(
        "| B | L | mla step | window step | eager step | window / mla | eager / mla "
        "| rebuild (window) | grow: mla / window |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with mx.stream(mx.cpu):
        for batch, tokens in shapes:
            f = measure(batch, tokens)
            mla, window, eager = (f[n]["step"] for n in ("mla", "window", "eager"))
            print(
                f"| {batch} | {tokens} | {mla:.2f} | {window:.2f} | {eager:.1f} "
                f"| {window / mla:.2f}x | {eager / mla:.0f}x | {f['window']['rebuild']:.1f} "
                f"| {f['mla']['grow']:.1f} / {f['window']['grow']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
