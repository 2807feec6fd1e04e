"""Paged row-operation bookkeeping, old checkout against new: interleaved processes.

``kvrows bench --family paged`` times each row operation a few times inside one long
process, where a 10 µs operation moves by as much between runs as the change being judged.
This measures only the bookkeeping (no evaluation): per process, the median of 1,000 runs
of each operation on a fresh merge of ``B`` rows of 256 tokens; the processes alternate
old/new ``--rounds`` times (``PYTHONHASHSEED=0``) and each side reports its fastest
median (the machine's quiet state)::

    python tools/paged_row_ops.py /tmp/old . --batch 4 --rounds 4

Each checkout runs with its own ``.venv``. ``--layout NAME`` times another layout of the
table over rows of its serial storage (random blocks, a ring's window of 64), and
``--evaluated`` evaluates each fresh merge before the timed operation (a contiguous
layout's row operations then build their gathers over real buffers)::

    python tools/paged_row_ops.py /tmp/old . --layout BatchedKVCache --evaluated --batch 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

OPERATIONS = ("merge", "filter", "extract", "join")

#: Run in a checkout's interpreter: ``B`` and the runs per operation in argv.
CHILD = """
import gc, statistics, sys, time
import mlx.core as mx
from kvrows import optimized
from kvrows.compositions import composition
b, runs, kind, evaluated = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
if kind == "PagedKvRows":
    from kvrows.app.bench.paged import PagedShape, _Data
    rows = _Data(PagedShape(b, 256, heads=4, head_dim=64)).rows["paged"]
    make = optimized.PagedKvRows
else:
    entry = composition(kind)
    ring = {"max_size": 64} if entry.geometry == "ring" else {}
    make = lambda: getattr(optimized, kind)(**ring)
    rows = []
    for i in range(b + 1):
        cache = getattr(optimized, entry.serial or kind)(**ring)
        block = mx.random.normal((1, 4, 256 - 8 * i, 64)).astype(mx.float16)
        cache.update_and_fetch(block, block)
        mx.eval(*cache.held_arrays())
        rows.append(cache)
kept = list(range(1, b, 2))
def merged():
    layout = make()
    layout.merge_rows(rows[:b])
    if evaluated:
        mx.eval(*layout.held_arrays())
    return layout
ops = {
    "merge": lambda layout: merged(),
    "filter": lambda layout: layout.filter_rows(kept),
    "extract": lambda layout: layout.extract_row(b // 2),
    "join": lambda layout: layout.merge_rows([rows[b]]),
}
for name, op in ops.items():
    times = []
    for _ in range(runs):
        layout = None if name == "merge" else merged()
        gc.collect(1)
        gc.disable()
        start = time.perf_counter()
        out = op(layout)
        times.append(time.perf_counter() - start)
        gc.enable()
        out = layout = None
    print(name, 1e6 * statistics.median(times))
"""


def _run(checkout: Path, batch: int, runs: int, layout: str, evaluated: bool) -> dict[str, float]:
    python = checkout / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [str(python), "-c", CHILD, str(batch), str(runs), layout, "1" if evaluated else "0"],
        cwd=checkout, env=env, capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return {name: float(us) for name, us in (line.split() for line in done.stdout.splitlines())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--layout", default="PagedKvRows", help="a layout of the table")
    parser.add_argument("--evaluated", action="store_true", help="evaluate each merge first")
    args = parser.parse_args(argv)
    best: dict[str, dict[str, float]] = {"old": {}, "new": {}}
    for _ in range(args.rounds):
        for side in ("old", "new"):
            timed = _run(getattr(args, side), args.batch, args.runs, args.layout, args.evaluated)
            for name, us in timed.items():
                best[side][name] = min(us, best[side].get(name, us))
    print(
        f"{args.layout} B={args.batch}, L=256{', evaluated' if args.evaluated else ''}: "
        "fastest per-process median, µs (old -> new, ratio)"
    )
    for name in OPERATIONS:
        old, new = best["old"][name], best["new"][name]
        print(f"  {name:8s} {old:7.1f} -> {new:7.1f}  {new / old:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
