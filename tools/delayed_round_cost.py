"""What a verify round's rollback costs on a delayed layer (issue 28, ``spec/speculative.md``
§8a): before and after the rollback dropped the layer's last read first.

A delayed layout keeps its last read (views of its planes) for ``attend_last_read``. A
rollback trims each row in place, clearing the forgotten columns (a delayed layout's masked
columns read zeros); while the views were alive, MLX could not donate the planes to that
clear and copied every plane of the batch, every round. ``held``: the machinery's forget
alone (the read still held, the layout before the fix); ``dropped``: the layout's own
``_spec_forget`` (the read dropped first). A round: ``spec_round_begin``, a block of
``d + 1 = 4`` tokens appended (its read evaluated and dropped by the caller),
``spec_round_rollback(1)``, the held arrays evaluated. Layouts: ``DelayedRotatingQuantizedKVCache``
(window ``W``) and ``DelayedQuantizedKVCache`` (``W`` tokens), affine 8-bit group 64, every
row converted (start ``W / 2``), ``B`` rows; fp16, 8 KV heads, head dim 128; median of
``--repeats`` rounds, the two ways interleaved.

Run: ``.venv/bin/python tools/delayed_round_cost.py [--repeats 7] [--shapes 16x1024,16x4096]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from draft_round_cost import DIM, HEADS, full_rings
from draft_round_cost import LAYOUTS as DRAFT_LAYOUTS  # (the tools folder is the script's path)

import kvrows.optimized as opt
from kvrows.delayed import DelayedLayout

DROPPED = DelayedLayout._spec_forget


def _held(layout: Any, counts: Sequence[int]) -> None:
    super(DelayedLayout, layout)._spec_forget(counts)


LAYOUTS: dict[str, tuple[Any, Any]] = {
    "delayed ring": DRAFT_LAYOUTS["delayed-ring"],  # (the draft tool's: the same layer)
    "delayed growing": (
        lambda w: opt.DelayedQuantizedKVCache(64, 8, w // 2),
        lambda w: opt.KVCache(),
    ),
}


def _round(layout: Any, block: mx.array) -> float:
    start = time.perf_counter()
    layout.spec_round_begin()
    mx.eval(*layout.update_and_fetch(block, block))
    layout.spec_round_rollback(1)
    mx.eval(layout.held_arrays())
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", default="1x1024,16x1024,16x4096", help="BxW,...")
    args = parser.parse_args()
    print("layout           B   W     held ms  dropped ms  dropped/held")
    for name, (cls, serial_cls) in LAYOUTS.items():
        for shape in args.shapes.split(","):
            rows, window = (int(x) for x in shape.split("x"))
            layout = full_rings(cls, rows, window, serial_cls)
            block = mx.random.normal((rows, HEADS, 4, DIM)).astype(mx.float16)
            mx.eval(block)
            times: dict[str, list[float]] = {"held": [], "dropped": []}
            for repeat in range(args.repeats + 1):  # (the first warms up)
                for way, forget in (("held", _held), ("dropped", DROPPED)):
                    DelayedLayout._spec_forget = forget  # type: ignore[method-assign]
                    took = _round(layout, block)
                    times[way] += [took] if repeat else []
            DelayedLayout._spec_forget = DROPPED  # type: ignore[method-assign]
            a, b = (1e3 * statistics.median(times[k]) for k in ("held", "dropped"))
            print(f"{name:<16} {rows:<3} {window:<5} {a:<8.2f} {b:<11.2f} {b / a:.3f}", flush=True)


if __name__ == "__main__":
    main()
