"""Measure the errors the tolerance table has to cover (how ``spec/tolerances.md`` was made).

Runs the conformance machines with attention tolerances *recorded, not
enforced* (everything exact stays enforced) and prints, per quantity and dtype,
the largest absolute error seen and the tolerance the table holds it to::

    python -m kvrows.conformance.calibrate --examples 400 --seed 1 [--family affine|rotating]

A tolerance is chosen as a round number at least twice the largest error seen
over several seeds, and no looser than the dtype's rounding needs (see the spec).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvrows.conformance.families import FAMILIES
from kvrows.conformance.runner import run_machines
from kvrows.conformance.stats import Stats
from kvrows.conformance.tolerances import tolerance

__all__ = ["main", "measure"]


def measure(examples: int, seed: int | None, steps: int, family: str = "plain") -> list[Stats]:
    """Every machine of ``family``: its statistics (errors per quantity and dtype)."""
    results = run_machines(
        [family],
        profile="deep",
        seed=seed,
        stream=sys.stderr,
        enforce=False,
        max_examples=examples,
        stateful_step_count=steps,
        database=None,
    )
    for result in results:
        if result.failure is not None:
            raise result.failure
    return [result.stats for result in results]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--family", default="plain", choices=sorted(FAMILIES))
    args = parser.parse_args(argv)
    family = FAMILIES[args.family]
    print(
        f"{'layout':<26} {'quantity':<18} {'dtype':<9} {'max |diff|':<12} {'max diff/tol':<13} "
        f"{'compared':<9} tolerance"
    )
    for stats in measure(args.examples, args.seed, args.steps, args.family):
        key = family.layout(stats.layout).tolerance_key or family.tolerance_key
        for (quantity, dtype), record in sorted(stats.errors.items()):
            chosen = tolerance(key, quantity, dtype)
            print(
                f"{stats.layout:<26} {quantity:<18} {dtype:<9} {record.max_error:<12.4g} "
                f"{record.max_ratio:<13.3f} {record.comparisons:<9} {chosen.describe()}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
