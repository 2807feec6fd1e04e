"""A latent decode step: ``MLACache`` vs ``EncodedLatentCache`` (``spec/EncodedLatentCache.md`` §5).

One layer, bf16, DeepSeek-V3's 512 latent + 64 rope per token, on the CPU: ``B`` rows of
lengths ``L`` down to ``L / 2`` (``benchmarks/test_bench_latent.py``'s rows) merged into
one layout, then decode steps, each an append of one token per row and the read it
returns (``update_and_fetch``), evaluated with the held arrays as the engine does at a
step's end (an encoded latent's codes are not part of its read). ``mla``: ``MLACache``;
``window``: ``EncodedLatentCache`` (affine 8-bit, group 64) reading its decoded window;
``eager``: the same cache reading the eager way (every read decodes the whole latent, as
before the window). Each layout takes one step first (``after merge``: the window is
built by that step, one decode of every column), then each run times ``STEPS`` steps of
every implementation in turn (interleaved); ``step`` is the median over ``RUNS`` runs of
each run's median step. Then, once per layout: the step that outgrows the 256-column
buffers (``grow``: new buffers; the window moves with the codes, one copy), and a
request of ``L / 2`` tokens joining into a free slot with the step after it (``join``:
the window decodes the joining row alone).

Run: ``.venv/bin/python tools/latent_decode.py [B,L ...]`` (default: 4,1024 16,1024
4,4096 16,4096); milliseconds. ``--paged``: the same steps of ``PagedLatentCache`` (affine
8-bit, group 64, 16-token blocks, one pool) reading through its decoded window and the
eager way (``spec/PagedLatentCache.md`` §7), beside ``MLACache``. ``--ab``: ``mla`` and
``window`` only, 6 interleaved runs of 25 steps, each step's median and 10th percentile
(microseconds): for two checkouts compared in alternating processes on a shared CPU,
where a median alone moves with the load (run the tool with ``PYTHONPATH`` at the other
checkout's package to measure its classes). ``--floor``: beside ``mla`` and ``window``
steps (interleaved, as ``--ab``), what any encoded step adds at the least: one evaluation
of nothing but an add (``eval``: MLX's per-evaluation cost), of the step's block
quantized (``quantize``), and quantized then decoded (``quantize + decode``: the codes
and the window's new column). ``mla + quantize + decode - eval`` bounds an encoded step
from below.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from kvrows.optimized import EncodedLatentCache, LatentBlockPool, MLACache, PagedLatentCache
from kvrows.optimized.codecs.registry import build
from kvrows.schemes import Affine

RANK, ROPE = 512, 64
RUNS, STEPS = 3, 15
CODEC = Affine(bits=8, group_size=64)
SHAPES = ((4, 1024), (16, 1024), (4, 4096), (16, 4096))


class EagerLatentCache(EncodedLatentCache):
    """The eager path the window replaces: every read decodes the whole latent."""

    keeps_window = False


class EagerPagedLatentCache(PagedLatentCache):
    """The paged eager path: every read gathers and decodes the whole latent."""

    keeps_window = False


IMPLEMENTATIONS: dict[str, Any] = {
    "mla": MLACache,
    "window": EncodedLatentCache,
    "eager": EagerLatentCache,
}
PAGED: dict[str, Any] = {
    "mla": MLACache,
    "paged window": PagedLatentCache,
    "paged eager": EagerPagedLatentCache,
}


def _row(cls: Any, tokens: int, seed: int, pool: Any = None) -> Any:
    """One request's cache of ``tokens`` prompt tokens (a paged one in ``pool``)."""
    key = mx.random.key(seed)
    latent = mx.random.normal((1, 1, tokens, RANK), key=key).astype(mx.bfloat16)
    rope = mx.random.normal((1, 1, tokens, ROPE), key=key).astype(mx.bfloat16)
    if cls is MLACache:
        cache = cls()
    else:
        cache = cls(codec=CODEC) if pool is None else cls(codec=CODEC, pool=pool)
    cache.update_and_fetch(latent, rope)
    mx.eval(cache.held_arrays())
    return cache


def _layout(cls: Any, batch: int, tokens: int) -> Any:
    """``batch`` rows of lengths ``tokens`` down to ``tokens / 2``, merged (paged: in one
    pool, by reference)."""
    pool = LatentBlockPool(CODEC, block_size=16) if issubclass(cls, PagedLatentCache) else None
    lengths = [tokens - (tokens // 2) * b // max(1, batch - 1) for b in range(batch)]
    rows = [_row(cls, n, b, pool) for b, n in enumerate(lengths)]
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    mx.eval(layout.held_arrays())
    return layout


def _block(rows: int, tokens: int = 1) -> tuple[mx.array, ...]:
    return tuple(mx.zeros((rows, 1, tokens, d), mx.bfloat16) for d in (RANK, ROPE))


def _step(layout: Any) -> float:
    block = _block(layout.batch_size)
    start = time.perf_counter()
    mx.eval(layout.update_and_fetch(*block), layout.held_arrays())
    return 1e3 * (time.perf_counter() - start)


def _grow(layout: Any) -> float:
    """Fill the buffers (untimed), then time the step that outgrows them."""
    room = layout.capacity - layout.width  # (the rows start at column 0 after a merge)
    if room > 0:
        mx.eval(*layout.update_and_fetch(*_block(layout.batch_size, room)))
    capacity = layout.capacity
    took = _step(layout)
    assert layout.capacity > capacity  # the step did outgrow the buffers
    return took


def _join(layout: Any, row: Any) -> float:
    start = time.perf_counter()
    layout.merge_rows([row])
    return 1e3 * (time.perf_counter() - start) + _step(layout)


def measure(
    batch: int, tokens: int, implementations: dict[str, Any] = IMPLEMENTATIONS
) -> dict[str, dict[str, float]]:
    layouts = {name: _layout(cls, batch, tokens) for name, cls in implementations.items()}
    figures: dict[str, dict[str, float]] = {name: {} for name in layouts}
    for name, layout in layouts.items():
        figures[name]["after merge"] = _step(layout)
    runs: dict[str, list[float]] = {name: [] for name in layouts}
    for _ in range(RUNS):
        for name, layout in layouts.items():
            runs[name].append(statistics.median(_step(layout) for _ in range(STEPS)))
    for name in layouts:
        figures[name]["step"] = statistics.median(runs[name])
    if implementations is PAGED:  # (no buffers to outgrow; joins: the paged tools')
        return figures
    for name, layout in layouts.items():
        figures[name]["grow"] = _grow(layout)
        figures[name]["join"] = _join(layout, _row(IMPLEMENTATIONS[name], tokens // 2, batch))
    return figures


def _each(figures: dict[str, dict[str, float]], what: str) -> str:
    return " / ".join(f"{figures[name][what]:.1f}" for name in IMPLEMENTATIONS)


def main() -> None:
    flags = {arg for arg in sys.argv[1:] if arg.startswith("--")}
    args = [arg for arg in sys.argv[1:] if arg not in flags]
    shapes = [tuple(int(x) for x in arg.split(",")) for arg in args] or list(SHAPES)
    if "--ab" in flags:
        ab(shapes)
        return
    if "--paged" in flags:
        paged(shapes)
        return
    if "--floor" in flags:
        floor(shapes)
        return
    print(
        "| B | L | step: mla | window | eager | window / mla | eager / mla "
        "| after merge: mla / window / eager | grow | join + step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---|---|---|")
    with mx.stream(mx.cpu):
        for batch, tokens in shapes:
            f = measure(batch, tokens)
            mla, window, eager = (f[n]["step"] for n in IMPLEMENTATIONS)
            print(
                f"| {batch} | {tokens} | {mla:.2f} | {window:.2f} | {eager:.1f} "
                f"| {window / mla:.2f}x | {eager / mla:.0f}x | {_each(f, 'after merge')} "
                f"| {_each(f, 'grow')} | {_each(f, 'join')} |",
                flush=True,
            )


def ab(shapes: list[tuple[int, ...]]) -> None:
    pair = {name: IMPLEMENTATIONS[name] for name in ("mla", "window")}
    with mx.stream(mx.cpu):
        for batch, tokens in shapes:
            layouts = {name: _layout(cls, batch, tokens) for name, cls in pair.items()}
            times: dict[str, list[float]] = {name: [] for name in layouts}
            for run in range(7):  # (the first run warms up)
                for name, layout in layouts.items():
                    steps = [_step(layout) for _ in range(25)]
                    times[name] += steps if run else []
            cells = [
                f"{name} {1e3 * statistics.median(t):.0f} / {1e3 * sorted(t)[len(t) // 10]:.0f} us"
                for name, t in times.items()
            ]
            print(f"B={batch} L={tokens}: " + ", ".join(cells), flush=True)


def _timed(build: Any) -> float:
    start = time.perf_counter()
    mx.eval(build())
    return 1e3 * (time.perf_counter() - start)


def floor(shapes: list[tuple[int, ...]]) -> None:
    """The least an encoded step adds to an ``MLACache`` step (module docstring)."""
    inner = build(CODEC)  # the encoded stage's codec (affine 8-bit, group 64)
    with mx.stream(mx.cpu):
        for batch, tokens in shapes:
            layouts = {
                name: _layout(IMPLEMENTATIONS[name], batch, tokens) for name in ("mla", "window")
            }
            block = _block(batch)[0]
            mx.eval(block)
            parts: dict[str, Any] = {
                "eval": lambda x=block: x + 1,
                "quantize": lambda x=block: inner.encode(x, "values"),
                "quantize + decode": lambda x=block: inner.decode(
                    inner.encode(x, "values"), "values"
                ),
            }
            times: dict[str, list[float]] = {name: [] for name in [*layouts, *parts]}
            for run in range(7):  # (the first run warms up)
                for name, layout in layouts.items():
                    steps = [_step(layout) for _ in range(25)]
                    times[name] += steps if run else []
                for name, part in parts.items():
                    steps = [_timed(part) for _ in range(25)]
                    times[name] += steps if run else []
            us = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            bound = us["mla"] + us["quantize + decode"] - us["eval"]
            cells = ", ".join(f"{name} {value:.0f}" for name, value in us.items())
            print(
                f"B={batch} L={tokens}: {cells} us; lower bound {bound:.0f} us "
                f"({bound / us['mla']:.2f}x mla), window {us['window'] / us['mla']:.2f}x mla",
                flush=True,
            )


def paged(shapes: list[tuple[int, ...]]) -> None:
    print("| B | L | step: mla | paged window | paged eager | window / mla | eager / window |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with mx.stream(mx.cpu):
        for batch, tokens in shapes:
            f = measure(batch, tokens, PAGED)
            mla, window, eager = (f[n]["step"] for n in PAGED)
            print(
                f"| {batch} | {tokens} | {mla:.2f} | {window:.2f} | {eager:.1f} "
                f"| {window / mla:.1f}x | {eager / window:.1f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
