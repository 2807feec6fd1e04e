"""What a conformance run exercised: operations, examples, errors seen, parity skips."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvrows.conformance.tolerances import Tolerance

__all__ = ["ErrorRecord", "Stats"]


@dataclass
class ErrorRecord:
    """The largest error seen for one (quantity, dtype) and the tolerance it was held to."""

    quantity: str
    dtype: str
    tolerance: Tolerance
    max_error: float = 0.0
    #: The largest ``error / (atol + rtol * |expected|)`` seen (0 for exact quantities).
    max_ratio: float = 0.0
    comparisons: int = 0


@dataclass
class Stats:
    """Counters one machine (family x layout) accumulates across its examples."""

    family: str
    layout: str
    examples: int = 0
    steps: int = 0
    ops: Counter[str] = field(default_factory=Counter)
    checks: Counter[str] = field(default_factory=Counter)
    skips: Counter[str] = field(default_factory=Counter)
    #: Examples per family parameter choice (e.g. the affine codec's ``bits=4 group=64``).
    variants: Counter[str] = field(default_factory=Counter)
    #: Examples' visits to the hard states a family must reach (spec/contract.md §0.11).
    states: Counter[str] = field(default_factory=Counter)
    errors: dict[tuple[str, str], ErrorRecord] = field(default_factory=dict)
    on_example: Callable[[Stats], None] | None = None

    def require(
        self,
        min_examples: int,
        *,
        ops: Iterable[str] = (),
        ran: Iterable[str] | None = None,
        oracles: Iterable[str] = (),
        states: Iterable[str] = (),
    ) -> None:
        """Fail (``AssertionError``) unless the run did what a family's CI test expects: at
        least ``min_examples`` examples, every one of ``ops`` exercised (``ran``: the ops as
        the test counts them, default :attr:`ops`), every one of ``oracles`` checked, every one of ``states`` (:attr:`states`) reached."""
        assert self.examples >= min_examples, f"only {self.examples} examples ran"
        missing = set(ops) - set(self.ops if ran is None else ran)
        assert not missing, f"operations never exercised: {sorted(missing)} (ran {dict(self.ops)})"
        for oracle in oracles:
            assert self.checks[oracle] > 0, f"oracle {oracle!r} never ran: {dict(self.checks)}"
        for state in states:
            assert self.states[state] > 0, f"state {state!r} never reached: {dict(self.states)}"

    def op(self, name: str) -> None:
        self.ops[name] += 1
        self.steps += 1

    def check(self, oracle: str, count: int = 1) -> None:
        self.checks[oracle] += count

    def skip(self, reason: str) -> None:
        self.skips[reason] += 1

    def variant(self, name: str) -> None:
        self.variants[name] += 1

    def state(self, name: str) -> None:
        self.states[name] += 1

    def error(
        self, quantity: str, dtype: str, tolerance: Tolerance, error: float, ratio: float
    ) -> None:
        record = self.errors.get((quantity, dtype))
        if record is None:
            record = self.errors[(quantity, dtype)] = ErrorRecord(quantity, dtype, tolerance)
        record.comparisons += 1
        record.max_error = max(record.max_error, error)
        record.max_ratio = max(record.max_ratio, ratio)

    def example_done(self) -> None:
        self.examples += 1
        if self.on_example is not None:
            self.on_example(self)

    def merge(self, other: Stats) -> None:
        """Fold ``other`` (same family and layout) into this one."""
        self.examples += other.examples
        self.steps += other.steps
        self.ops.update(other.ops)
        self.checks.update(other.checks)
        self.skips.update(other.skips)
        self.variants.update(other.variants)
        self.states.update(other.states)
        for key, record in other.errors.items():
            mine = self.errors.get(key)
            if mine is None:
                self.errors[key] = ErrorRecord(
                    record.quantity,
                    record.dtype,
                    record.tolerance,
                    record.max_error,
                    record.max_ratio,
                    record.comparisons,
                )
            else:
                mine.comparisons += record.comparisons
                mine.max_error = max(mine.max_error, record.max_error)
                mine.max_ratio = max(mine.max_ratio, record.max_ratio)
