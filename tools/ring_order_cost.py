"""What reading a wrapped ring in time order costs (``spec/engine.md`` §8).

One ring layer's decode step (fp16, 8 KV heads, head dim 128, one query token, 16 query
heads) on a wrapped shared-column ring (``RotatingKVCache`` of ``W`` columns holding ``B``
rows at one offset: a shared ring as a batch that joined at once; no mask), the token's write, the read and ``mx.fast.scaled_dot_product_attention`` over it,
evaluated, three ways side by side:

* ``physical``: the ring's physical read as it is (mlx-lm's column order, no time order:
  what a step costs without batch invariance);
* ``old``: the physical form's read re-ordered into time order (``reordered_reads``: one
  copy of the window's keys and values per step; ``ordered_reads`` off);
* ``new``: the ordered form (``reads_in_time_order``: a slice of the window kept in time
  order, its ``slack`` spare columns written in turn, the window moved to the front once
  per ``slack + 1`` tokens).

Each round runs the variants in turn (interleaved), ``--steps`` timed steps each (their
median); ``new`` also times the one step of its cycle that moves the window (``move ms``,
reached by writing tokens without attention) and reports the mean step of a whole cycle of
``slack + 1`` tokens, ``(slack * median + move) / (slack + 1)``. The table gives each
variant's median over the rounds and its ratio to ``physical``, and the ring's bytes
(``nbytes``: the ordered form holds ``slack`` more columns).

Run: ``.venv/bin/python tools/ring_order_cost.py [--rounds 3] [--shapes 1x1024,16x1024,...]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx

import kvrows.optimized as opt

HEADS, QUERY_HEADS, DIM = 8, 16, 128
VARIANTS = ("physical", "old", "new")


def _wrapped_ring(rows: int, window: int, *, ordered: bool) -> Any:
    """A ring of ``rows`` rows holding a full window (one block), then one token: wrapped."""
    ring = opt.RotatingKVCache(window)
    ring.ordered_reads = ordered
    block = mx.random.normal((rows, HEADS, window, DIM)).astype(mx.float16)
    ring.update_and_fetch(block, block)
    token = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.float16)
    ring.update_and_fetch(token, token)
    mx.eval(ring.state)
    return ring


def _step(ring: Any, variant: str, queries: mx.array, token: mx.array) -> float:
    """Seconds of one decode step (write, read, attention, evaluated)."""
    start = time.perf_counter()
    keys, values = ring.update_and_fetch(token, token)
    if variant != "physical":
        keys, values, _ = ring.reads_in_time_order(keys, values, None)
    mx.eval(mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.1))
    return time.perf_counter() - start


def _to_the_move(ring: Any, token: mx.array) -> None:
    """Write tokens (no attention) until the next one moves the window to the front."""
    while ring._ordered_end < ring.span + ring.slack:
        ring.update_and_fetch(token, token)
        mx.eval(ring.held_arrays())


def measure(rows: int, window: int, rounds: int, steps: int) -> dict[str, Any]:
    rings = {v: _wrapped_ring(rows, window, ordered=v == "new") for v in VARIANTS}
    assert rings["new"].time_ordered and not rings["old"].time_ordered
    queries = mx.random.normal((rows, QUERY_HEADS, 1, DIM)).astype(mx.float16)
    token = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.float16)
    mx.eval(queries, token)
    slack = rings["new"].slack
    for variant in VARIANTS:  # warm-up
        _step(rings[variant], variant, queries, token)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    moves: list[float] = []
    for _ in range(rounds):
        for variant in VARIANTS:
            ring = rings[variant]
            move = 0.0
            if variant == "new":  # the one step of a cycle that moves the window
                _to_the_move(ring, token)
                move = _step(ring, variant, queries, token)
                moves.append(move)
            regular = statistics.median(_step(ring, variant, queries, token) for _ in range(steps))
            if variant == "new":  # the mean step of a whole cycle of slack + 1 tokens
                regular = (slack * regular + move) / (slack + 1)
            times[variant].append(regular)
    median = {v: statistics.median(t) for v, t in times.items()}
    return {
        "rows": rows,
        "window": window,
        "slack": slack,
        "ms": {v: 1e3 * m for v, m in median.items()},
        "move_ms": 1e3 * statistics.median(moves),
        "ratio": {v: median[v] / median["physical"] for v in VARIANTS},
        "bytes": {v: rings[v].nbytes for v in VARIANTS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="steps per variant and round")
    parser.add_argument("--shapes", default="1x1024,16x1024,1x4096,16x4096", help="BxW,...")
    args = parser.parse_args()
    print(
        "B   W     slack  physical ms  old ms   new ms   move ms  old/phys  new/phys  "
        "ring MB (phys -> new)"
    )
    for shape in args.shapes.split(","):
        rows, window = (int(x) for x in shape.split("x"))
        r = measure(rows, window, args.rounds, args.steps)
        ms, ratio, held = r["ms"], r["ratio"], r["bytes"]
        print(
            f"{rows:<3} {window:<5} {r['slack']:<6} {ms['physical']:<12.3f} {ms['old']:<8.3f} "
            f"{ms['new']:<8.3f} {r['move_ms']:<8.3f} {ratio['old']:<9.2f} {ratio['new']:<9.2f} "
            f"{held['physical'] / 2**20:.1f} -> {held['new'] / 2**20:.1f}"
        )


if __name__ == "__main__":
    main()
