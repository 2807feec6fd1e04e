"""What a draft's proposals cost on one ring layer (``spec/engine.md`` §11, issue 28).

A speculative round's draft proposes ``d`` tokens per row: ``d - 1`` single-token forwards
on its ring verify layout (``SpeculativeRotatingKVCache``, ``B`` rows past a window of
``W``). Two ways, side by side, the cache's work only (appends and reads, evaluated; the
attention over the read is the same in both):

* ``scratch`` (before issue 28): a copy of the whole batch (``make_empty_batch`` +
  ``merge_rows``), the proposals appended to the copy (each one, on a full window, slides
  every row left by a column: another pass over the batch), the copy dropped;
* ``round``: a proposal round on the layout itself (``spec_round_propose``: the rows drop
  nothing), the proposals appended, ``spec_round_discard`` (each row forgets them).

fp16, 8 KV heads, head dim 128, ``d = 3``; median of ``--repeats`` rounds after one
warm-up, the two ways interleaved.

``--layout``: ``ring`` (``SpeculativeRotatingKVCache``, the default), ``delayed-ring``
(``DelayedRotatingQuantizedKVCache``, affine 8-bit group 64, start ``W / 2``: every row
converted, as a bf16-first scheme's sliding layer past its start), ``paged-ring``
(``PagedRotatingRows``, 16-token blocks: its rows' tables share the serial rows' pool).

Run: ``.venv/bin/python tools/draft_round_cost.py [--repeats 7] [--layout L]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx

import kvrows.optimized as opt

HEADS, DIM, DRAFTS = 8, 128, 3


def full_rings(cls: Any, rows: int, window: int, serial_cls: Any = None) -> Any:
    """A ring verify layout (``cls(window)``, or ``cls`` itself when it is a layout
    factory) of ``rows`` rows of ``serial_cls(window)`` (default ``RotatingKVCache``), each
    holding a full window."""
    serial = []
    for _ in range(rows):
        ring = (serial_cls or opt.RotatingKVCache)(window)
        block = mx.random.normal((1, HEADS, window + 8, DIM)).astype(mx.float16)
        ring.update_and_fetch(block, block)
        serial.append(ring)
    layout = cls(window)
    layout.merge_rows(serial)
    mx.eval(layout.held_arrays())
    return layout


#: ``--layout``: the verify layout and its serial rows' class, each of the window.
LAYOUTS: dict[str, tuple[Any, Any]] = {
    "ring": (opt.SpeculativeRotatingKVCache, opt.RotatingKVCache),
    "delayed-ring": (
        lambda w: opt.DelayedRotatingQuantizedKVCache(w, 64, 8, 0, w // 2),
        opt.RotatingKVCache,
    ),
    "paged-ring": (
        lambda w: opt.PagedRotatingRows(w, block_size=16),
        lambda w: opt.PagedRotatingKVCache(w, block_size=16),
    ),
}


def _proposals(cache: Any, token: mx.array) -> None:
    for _ in range(DRAFTS - 1):
        keys, values = cache.update_and_fetch(token, token)
        mx.eval(keys, values)


def _scratch(layout: Any, token: mx.array) -> float:
    start = time.perf_counter()
    scratch = layout.make_empty_batch()
    scratch.merge_rows([layout])
    _proposals(scratch, token)
    del scratch
    return time.perf_counter() - start


def _round(layout: Any, token: mx.array) -> float:
    start = time.perf_counter()
    layout.spec_round_propose()
    _proposals(layout, token)
    layout.spec_round_discard()
    mx.eval(layout.held_arrays())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", default="1x1024,16x1024,1x4096,16x4096", help="BxW,...")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="ring")
    args = parser.parse_args()
    print(f"{args.layout}\nB   W     scratch ms  round ms  round/scratch")
    for shape in args.shapes.split(","):
        rows, window = (int(x) for x in shape.split("x"))
        cls, serial_cls = LAYOUTS[args.layout]
        layout = full_rings(cls, rows, window, serial_cls)
        token = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.float16)
        mx.eval(token)
        _scratch(layout, token), _round(layout, token)  # warm-up
        times: dict[str, list[float]] = {"scratch": [], "round": []}
        for _ in range(args.repeats):
            times["scratch"].append(_scratch(layout, token))
            times["round"].append(_round(layout, token))
        a, b = (1e3 * statistics.median(times[k]) for k in ("scratch", "round"))
        print(f"{rows:<3} {window:<5} {a:<11.3f} {b:<9.3f} {b / a:.3f}")


if __name__ == "__main__":
    main()
