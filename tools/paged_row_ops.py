"""Paged row-operation bookkeeping, old checkout against new: interleaved processes.

``kvrows bench --family paged`` times each row operation a few times inside one long
process, where a 10 µs operation moves by as much between runs as the change being judged.
This measures only the bookkeeping (no evaluation): per process, the median of 1,000 runs
of each operation on a fresh merge of ``B`` rows of 256 tokens; the processes alternate
old/new ``--rounds`` times (``PYTHONHASHSEED=0``) and each side reports its fastest
median (the machine's quiet state)::

    python tools/paged_row_ops.py /tmp/old . --batch 4 --rounds 4

Each checkout runs with its own ``.venv``.
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
from kvrows.app.bench.paged import PagedShape, _Data
from kvrows.optimized import PagedKvRows
b, runs = int(sys.argv[1]), int(sys.argv[2])
rows = _Data(PagedShape(b, 256, heads=4, head_dim=64)).rows["paged"]
kept = list(range(1, b, 2))
def merged():
    layout = PagedKvRows()
    layout.merge_rows(rows[:b])
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


def _run(checkout: Path, batch: int, runs: int) -> dict[str, float]:
    python = checkout / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [str(python), "-c", CHILD, str(batch), str(runs)],
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
    args = parser.parse_args(argv)
    best: dict[str, dict[str, float]] = {"old": {}, "new": {}}
    for _ in range(args.rounds):
        for side in ("old", "new"):
            for name, us in _run(getattr(args, side), args.batch, args.runs).items():
                best[side][name] = min(us, best[side].get(name, us))
    print(f"B={args.batch}, L=256: fastest per-process median, µs (old -> new, ratio)")
    for name in OPERATIONS:
        old, new = best["old"][name], best["new"][name]
        print(f"  {name:8s} {old:7.1f} -> {new:7.1f}  {new / old:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
