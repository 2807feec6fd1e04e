"""What a target's verify round costs on one ring layer (issue 28, ``spec/RaggedRotatingRows.md``
§1 and §5).

A speculative round's target appends a block of ``d + 1`` tokens to its ring verify layout
(``SpeculativeRotatingKVCache``, ``B`` rows past a window of ``W``), attends over the read
and rolls back each row's rejected drafts. Two layouts, side by side in one process:

* ``slide`` (before issue 28's layout): every block on a full window slides every row left
  by what it drops (one gather of the whole layout per round): the layout with no slack
  (``_slack = 0``, the rule the sinks and the delayed rings keep);
* ``lead``: the dropped tokens stay in place (each row's lead moves past them) and the
  rows move to column 0 once per ``slack = min(256, W)`` columns.

A round: ``make_mask``, ``update_and_fetch`` (keys, values and mask evaluated), then
``spec_round_rollback`` with per-row keeps drawn in ``1..d + 1`` (seeded, the same for
both): the cache's work, what the layouts change. Each repeat runs ``--rounds`` rounds on
the same layout (so the ``lead`` layout's compactions count at their real rate), the two
layouts interleaved; the table gives the median over ``--repeats`` repeats of each
repeat's mean per round, the mean over every round (compactions amortized) and the slides
(whole-layout gathers) counted. Then MLX's SDPA over each layout's last read (GQA 4:1, 32 query
heads; median of 3): what a wider read (``lead``: up to ``slack`` columns) costs the
attention. fp16, 8 KV heads, head dim 128, ``d = 3``.

Run: ``.venv/bin/python tools/verify_round_cost.py [--repeats 3] [--rounds 40]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np
from draft_round_cost import full_rings  # (the tools folder is the script's path)

import kvrows.optimized as opt

HEADS, QUERY_HEADS, DIM, DRAFTS = 8, 32, 128, 3


class Leading(opt.SpeculativeRotatingKVCache):  # type: ignore[misc,valid-type]
    """The layout, counting its slides (compactions)."""

    slides = 0

    def _slide(self, *args: Any) -> Any:
        type(self).slides += 1
        return super()._slide(*args)


class Sliding(Leading):
    """The layout before issue 28's change: every drop compacts."""

    slides = 0

    @property
    def _slack(self) -> int:
        return 0


def _rounds(layout: Any, block: mx.array, keeps: list[list[int]]) -> float:
    """Seconds per round of the cache's work, the mean over ``len(keeps)`` rounds."""
    n = DRAFTS + 1
    start = time.perf_counter()
    for keep in keeps:
        layout.spec_round_begin()
        mask = layout.make_mask(n, return_array=True)
        keys, values = layout.update_and_fetch(block, block)
        mx.eval(keys, values, mask)
        layout.spec_round_rollback(keep)
    return (time.perf_counter() - start) / len(keeps)


def _attention(layout: Any, block: mx.array, queries: mx.array) -> tuple[float, int]:
    """SDPA over one verify block's read (median of 3 seconds) and the read's columns."""
    n = DRAFTS + 1
    layout.spec_round_begin()
    mask = layout.make_mask(n, return_array=True)
    keys, values = layout.update_and_fetch(block, block)
    mx.eval(keys, values, mask)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = mx.fast.scaled_dot_product_attention(
            queries, keys, values, scale=DIM**-0.5, mask=mask
        )
        mx.eval(out)
        times.append(time.perf_counter() - start)
    layout.spec_round_rollback([1] * layout.batch_size)
    return statistics.median(times), int(keys.shape[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--shapes", default="1x1024,16x1024,1x4096,16x4096", help="BxW,...")
    args = parser.parse_args()
    print(
        "B   W     slide ms  lead ms  lead/slide  mean slide  mean lead  slides  "
        "SDPA slide ms (cols)  SDPA lead ms (cols)"
    )
    rng = np.random.default_rng(28)
    for shape in args.shapes.split(","):
        rows, window = (int(x) for x in shape.split("x"))
        layouts = {
            "slide": full_rings(Sliding, rows, window),
            "lead": full_rings(Leading, rows, window),
        }
        block = mx.random.normal((rows, HEADS, DRAFTS + 1, DIM)).astype(mx.float16)
        queries = mx.random.normal((rows, QUERY_HEADS, DRAFTS + 1, DIM)).astype(mx.float16)
        mx.eval(block, queries)
        draw = [
            [[int(k) for k in rng.integers(1, DRAFTS + 2, rows)] for _ in range(args.rounds)]
            for _ in range(args.repeats + 1)
        ]
        for layout in layouts.values():  # warm-up
            _rounds(layout, block, draw[0][:2])
        Sliding.slides = Leading.slides = 0
        times: dict[str, list[float]] = {"slide": [], "lead": []}
        for keeps in draw[1:]:
            for name, layout in layouts.items():
                times[name].append(_rounds(layout, block, keeps))
        a, b = (1e3 * statistics.median(times[k]) for k in ("slide", "lead"))
        c, d = (1e3 * statistics.mean(times[k]) for k in ("slide", "lead"))
        slides = f"{Sliding.slides}/{Leading.slides}"
        sdpa = {k: _attention(v, block, queries) for k, v in layouts.items()}
        cells = [f"{1e3 * sdpa[k][0]:.2f} ({sdpa[k][1]})" for k in ("slide", "lead")]
        print(
            f"{rows:<3} {window:<5} {a:<9.2f} {b:<8.2f} {b / a:<11.3f} {c:<11.2f} {d:<10.2f} "
            f"{slides:<7} {cells[0]:<21} {cells[1]}"
        )


if __name__ == "__main__":
    main()
