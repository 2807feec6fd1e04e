"""Old against new ``kvrows bench``: per operation, median of N interleaved runs of each.

The measure of issue 23 ("``kvrows bench --family all``: no operation more than 10 %
slower than before, median of 5 interleaved runs of old and new code")::

    python tools/bench_compare.py /work/wt-base . --runs 5
    python tools/bench_compare.py /work/wt-base . --runs 3 --families rotating --quick

Each checkout runs with its own ``.venv`` (``make install`` there first). A run is one
``kvrows bench --family F`` in a fresh process of that checkout's interpreter; the runs
alternate old/new and the order flips every round (old, new, new, old, ...), so drift of
the machine's state does not favour either side.

What is read: every timed case's median milliseconds per implementation, as the bench's
one runner (``kvrows.app.bench.runner.run_family``) records them in its ``Result`` s,
the same figures the tables print. The driver wraps that class in the child process, so
the old code needs no machine-readable output of its own and both sides are read by the
same mechanism (the tables themselves are discarded). An operation is one
(family, case label, implementation); baselines (``copy``, ``memcpy``, ``reference``)
are listed like the rest. ``ratio`` = median new / median old; above ``--threshold``
(default 1.10) the line is flagged ``SLOWER``. Exit status 1 if any line is flagged or
a run failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

#: Every family of ``kvrows bench --family all``, in its run order.
ALL_FAMILIES = ("plain", "affine", "rotating", "engine", "speculative", "delayed", "turbo", "paged")

#: Run in the checkout's interpreter: ``kvrows bench`` with the runner's results recorded.
DRIVER = """
import contextlib, json, sys
import kvrows.app.bench.runner as runner
from kvrows.app.cli import main

family, out, quick = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
records = []

class Recorded(runner.Result):
    def __init__(self, label, key, timings):
        super().__init__(label, key, timings)
        for impl, timing in timings.items():
            records.append([label, impl, timing.ms])

runner.Result = Recorded
argv = ["bench", "--family", family] + (["--quick"] if quick else [])
with contextlib.redirect_stdout(sys.stderr):
    status = main(argv)
with open(out, "w") as handle:
    json.dump({"status": status, "records": records}, handle)
"""

#: (family, case label, implementation) -> milliseconds of each run (None: not timed).
Samples = dict[tuple[str, str, str], list[float | None]]
#: What one run recorded: [case label, implementation, milliseconds or None].
Records = list[tuple[str, str, float | None]]


def run_once(checkout: Path, family: str, *, quick: bool, log: Path) -> tuple[int, Records]:
    """One ``kvrows bench --family family`` in ``checkout``: exit status and records."""
    python = checkout / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: run `make install` in {checkout}")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    try:
        with log.open("a") as stderr:
            done = subprocess.run(
                [str(python), "-c", DRIVER, family, str(out), "1" if quick else "0"],
                # Not the checkout: its top-level kvrows/ folder would shadow the
                # installed package (whose kvrows.app etc. map to other folders).
                cwd=tempfile.gettempdir(),
                stdout=stderr,
                stderr=stderr,
                env={**os.environ, "PYTHONPATH": ""},
                check=False,
            )
        if done.returncode != 0 and out.stat().st_size == 0:
            return done.returncode, []
        data = json.loads(out.read_text())
        records = [(str(label), str(impl), ms) for label, impl, ms in data["records"]]
        return int(data["status"]) or done.returncode, records
    finally:
        out.unlink(missing_ok=True)


def median(values: Sequence[float | None]) -> float | None:
    timed = [v for v in values if v is not None]
    return statistics.median(timed) if timed else None


def compare(
    old: Path, new: Path, families: Sequence[str], *, runs: int, quick: bool, log: Path
) -> tuple[dict[str, Samples], list[str]]:
    """Every family's samples on each side (``"old"``, ``"new"``) and the failed runs."""
    samples: dict[str, Samples] = {"old": {}, "new": {}}
    failed: list[str] = []
    for family in families:
        for round_ in range(runs):
            sides = [("old", old), ("new", new)]
            for side, checkout in sides if round_ % 2 == 0 else sides[::-1]:
                print(f"  {family} run {round_ + 1}/{runs} {side}", file=sys.stderr, flush=True)
                status, records = run_once(checkout, family, quick=quick, log=log)
                if status != 0:
                    failed.append(f"{family} run {round_ + 1} {side}: exit status {status}")
                for label, impl, ms in records:
                    samples[side].setdefault((family, label, impl), []).append(ms)
    return samples, failed


def report(samples: dict[str, Samples], threshold: float) -> tuple[list[str], int]:
    """The table lines (operation, median old, median new, ratio, flag) and the flag count."""
    keys = list(samples["new"]) + [k for k in samples["old"] if k not in samples["new"]]
    rows = [("family", "case", "impl", "old ms", "new ms", "new/old", "")]
    flagged = 0
    for key in keys:
        before = median(samples["old"].get(key, []))
        after = median(samples["new"].get(key, []))
        ratio = after / before if before and after else None
        flag = ""
        if ratio is not None and ratio > threshold:
            flag, flagged = "SLOWER", flagged + 1
        elif key not in samples["old"] or key not in samples["new"]:
            flag = "only " + ("new" if key not in samples["old"] else "old")
        rows.append(
            (
                *key,
                "-" if before is None else f"{before:.3f}",
                "-" if after is None else f"{after:.3f}",
                "-" if ratio is None else f"{ratio:.2f}",
                flag,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return [line.rstrip() for line in lines], flagged


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="checkout of the old code (with its .venv)")
    parser.add_argument("new", type=Path, help="checkout of the new code (with its .venv)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each side (default 5)")
    parser.add_argument(
        "--families",
        default="all",
        help="comma-separated families, or all (default): " + ",".join(ALL_FAMILIES),
    )
    parser.add_argument("--quick", action="store_true", help="kvrows bench --quick shapes")
    parser.add_argument("--threshold", type=float, default=1.10, help="flag new/old above")
    parser.add_argument(
        "--log", type=Path, default=Path("bench_compare.log"), help="the runs' own output"
    )
    args = parser.parse_args(argv)
    families = ALL_FAMILIES if args.families == "all" else tuple(args.families.split(","))
    unknown = [f for f in families if f not in ALL_FAMILIES]
    if unknown or args.runs < 1:
        parser.error(f"unknown families {unknown}" if unknown else "--runs must be >= 1")
    args.log.write_text("")
    samples, failed = compare(
        args.old.resolve(),
        args.new.resolve(),
        families,
        runs=args.runs,
        quick=args.quick,
        log=args.log,
    )
    lines, flagged = report(samples, args.threshold)
    print(
        f"kvrows bench old {args.old} vs new {args.new}: median of {args.runs} interleaved "
        f"runs each{' (--quick)' if args.quick else ''}; SLOWER: new/old > {args.threshold:.2f}"
    )
    print("\n".join(lines))
    for failure in failed:
        print(f"FAILED RUN: {failure} (see {args.log})")
    print(f"{flagged} operation(s) slower than {args.threshold:.2f}x; {len(failed)} failed run(s)")
    return 1 if flagged or failed else 0


if __name__ == "__main__":
    sys.exit(main())
