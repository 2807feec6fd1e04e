"""The one benchmark runner: every family's header, interleaved timing, checks and tables.

A family (:mod:`.plain`, :mod:`.ring`, :mod:`.affine`, :mod:`.engine`, ...) supplies
only its cases: a :class:`Case` is a group of :class:`Workload` s timed together
(interleaved, so drift in the machine's state does not favour whichever runs first) and a
function that turns their timings into table lines, each a mapping of column header to
cell (a table's header is its lines' keys). :func:`run_family` prints the header, times every
case, checks each workload's last result (a fast wrong operation is reported, never
tabulated as a win), prints the tables, the family's notes and verdict, and returns 1 if
any result was wrong.

Method: every timed call ends with ``mx.eval`` of everything it produced. Setup is not
timed. The figure is the median of ``repeats`` timed calls after warm-ups.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TextIO

import ml_dtypes
import mlx.core as mx
import numpy as np
import numpy.typing as npt

from kvrows.errors import InvalidInputError

__all__ = [
    "BenchCheckError",
    "Case",
    "Family",
    "Line",
    "Result",
    "Table",
    "Timing",
    "Workload",
    "check_equal",
    "check_same",
    "format_gbps",
    "parity_verdict",
    "ratio",
    "run_family",
    "to_numpy",
]

NP = npt.NDArray[Any]

#: Ratios within this fraction below 1 are reported as parity (run-to-run noise).
PARITY_BAND = 0.05


class BenchCheckError(AssertionError):
    """A benchmarked operation produced a wrong result."""


def to_numpy(array: Any) -> NP:
    """A NumPy copy of an MLX array; bfloat16 becomes ``ml_dtypes.bfloat16`` (NumPy has none)."""
    if isinstance(array, mx.array) and array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(array)


def check_same(what: str, got: NP, expected: NP) -> None:
    """``got`` equals ``expected`` exactly, shape included."""
    if got.shape != expected.shape:
        raise BenchCheckError(f"{what}: shape {got.shape}, expected {expected.shape}")
    if not np.array_equal(got, expected):
        bad = int(np.count_nonzero(got != expected))
        raise BenchCheckError(f"{what}: {bad} of {got.size} values differ from the input data")


def check_equal(what: str, got: object, expected: object) -> None:
    if got != expected:
        raise BenchCheckError(f"{what}: got {got!r}, expected {expected!r}")


@dataclass
class Workload:
    """One operation by one implementation.

    ``run(setup())`` performs the operation and evaluates what it produced;
    ``check(result)`` raises :class:`BenchCheckError` if the result is wrong.
    ``shape`` is the family's shape object (for labels), ``bytes_moved`` what counts.
    """

    op: str
    impl: str
    shape: Any
    bytes_moved: int
    setup: Callable[[], Any]
    run: Callable[[Any], Any]
    check: Callable[[Any], None]


@dataclass
class Timing:
    """Median milliseconds of one workload (``None``: not run, with ``note`` saying why)."""

    ms: float | None
    note: str = ""

    @property
    def cell(self) -> str:
        return self.note or "-" if self.ms is None else format_ms(self.ms)


# -- timing ---------------------------------------------------------------------------------


def _time_once(workload: Workload) -> tuple[float, Any]:
    state = workload.setup()
    # The collector is off while timing; collect what the last runs left (young
    # generations: a full pass over a test process's heap cost more than the timings).
    gc.collect(1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        result = workload.run(state)
        elapsed = time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed, result


def time_workloads(
    workloads: Sequence[Workload], *, repeats: Sequence[int], warmups: int
) -> list[float | BenchCheckError]:
    """Median milliseconds of each workload's timed runs, the workloads interleaved.

    Round ``r`` runs every workload once (while it has runs left), so drift of
    the machine's state (allocator, caches, neighbours) spreads over all of
    them instead of favouring whichever runs first. The last run of each is
    checked; a wrong result comes back as its :class:`BenchCheckError`.
    """
    times: list[list[float]] = [[] for _ in workloads]
    outcome: list[BenchCheckError | None] = [None] * len(workloads)
    for r in range(warmups + max(repeats, default=0)):
        for i, workload in enumerate(workloads):
            total = warmups + repeats[i]
            if r >= total:
                continue
            elapsed, result = _time_once(workload)
            if r >= warmups:
                times[i].append(elapsed)
            if r == total - 1:
                try:
                    workload.check(result)
                except BenchCheckError as error:
                    outcome[i] = error
            del result
    return [
        error if error is not None else 1e3 * statistics.median(t)
        for error, t in zip(outcome, times, strict=True)
    ]


# -- formatting -----------------------------------------------------------------------------


def format_ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def format_gbps(moved: int, ms: float | None) -> str:
    return "-" if not ms else f"{moved / (ms * 1e-3) / 1e9:.1f}"


def ratio(numerator: float | None, denominator: float | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator and denominator else "-"


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A right-aligned Markdown table of ``header`` and the ``body`` lines."""
    lines = [tuple(header), *(tuple(line) for line in body)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([fmt(lines[0]), rule, *(fmt(line) for line in lines[1:])])


def package_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


# -- cases, tables, families ------------------------------------------------------------------


#: One table line: each column's header and its cell, in column order.
Line = dict[str, str]


@dataclass
class Case:
    """Workloads timed together, and the table lines their timings make.

    ``label`` names the case in progress lines, failures and verdicts; ``key`` is the
    family's own handle on it (for its verdict); ``skipped`` names implementations that
    do not run here (their cells say so); ``max_repeats`` caps a slow workload's timed runs.
    ``release`` runs once the case is timed (drop sources the next case does not share).
    """

    label: str
    workloads: Mapping[str, Workload]
    lines: Callable[[Mapping[str, Timing]], list[Line]]
    key: Any = None
    skipped: tuple[str, ...] = ()
    max_repeats: Mapping[str, int] = field(default_factory=dict)
    release: Callable[[], None] | None = None


@dataclass(frozen=True)
class Result:
    """A timed case, as the family's verdict sees it (the workloads themselves are released)."""

    label: str
    key: Any
    timings: Mapping[str, Timing]

    def ms(self, impl: str) -> float | None:
        timing = self.timings.get(impl)
        return None if timing is None else timing.ms


@dataclass
class Table:
    """The cases that fill a table (built lazily, one at a time, to bound memory); its
    header is their lines' keys (``header``: for a table whose cases may give no line)."""

    cases: Iterable[Case]
    title: str = ""
    header: Sequence[str] = ()


@dataclass
class Family:
    """What one ``kvrows bench --family`` prints: its tables, notes and verdict."""

    name: str
    subject: str
    tables: Sequence[Table]
    notes: str
    verdict: Callable[[Sequence[Result]], list[str]] | None = None
    #: Timed runs and warm-ups: (quick, full).
    repeats: tuple[int, int] = (2, 7)
    warmups: tuple[int, int] = (1, 2)


def parity_verdict(results: Sequence[Result]) -> list[str]:
    """Where kvrows is slower than mlx-lm in this run (information, never an exit status)."""
    misses: list[str] = []
    parity: list[str] = []
    for result in results:
        kv, lm = result.ms("kvrows"), result.ms("mlx-lm")
        if kv and lm and lm / kv < 1:
            entry = f"{result.label} ({lm / kv:.2f}x)"
            (parity if lm / kv >= 1 - PARITY_BAND else misses).append(entry)
    lines = [
        "target: every operation at least as fast as mlx-lm: "
        + ("met" if not misses else "missed by " + ", ".join(misses))
    ]
    if parity:
        lines.append(f"  within {PARITY_BAND:.0%} (noise) below parity: " + ", ".join(parity))
    return lines


def run_family(
    family: Family, *, quick: bool = False, repeats: int | None = None, out: TextIO | None = None
) -> int:
    """Time every case of ``family``, print its tables; 0 unless a result was wrong."""
    stream = out if out is not None else sys.stdout
    timed = repeats if repeats is not None else family.repeats[not quick]
    if timed < 1:
        raise InvalidInputError(f"repeats must be >= 1, got {timed}")
    warmups = family.warmups[not quick]
    print(
        f"kvrows bench: {family.name} family, {family.subject}, mlx {package_version('mlx')}, "
        f"mlx-lm {package_version('mlx-lm')}, on {mx.default_device()}; "
        f"median of {timed} after {warmups} warm-up(s)",
        file=stream,
        flush=True,
    )
    failures: list[str] = []
    results: list[Result] = []
    for table in family.tables:
        lines: list[Line] = []
        for case in table.cases:
            if not quick:
                print(f"  {case.label}", file=sys.stderr, flush=True)
            names = list(case.workloads)
            outcomes = time_workloads(
                [case.workloads[n] for n in names],
                repeats=[min(timed, case.max_repeats.get(n, timed)) for n in names],
                warmups=warmups,
            )
            timings = {n: Timing(None, "skipped") for n in case.skipped}
            for name, outcome in zip(names, outcomes, strict=True):
                if isinstance(outcome, BenchCheckError):
                    failures.append(f"{case.label} {name}: {outcome}")
                    timings[name] = Timing(None, "wrong")
                else:
                    timings[name] = Timing(outcome)
            lines += case.lines(timings)
            results.append(Result(case.label, case.key, timings))
            if case.release is not None:
                case.release()
            del case  # its sources go before the next case builds its own
            gc.collect()
            mx.clear_cache()
        if table.title:
            print(f"\n{table.title}:", file=stream)
        header = list(table.header or (lines[0] if lines else ()))
        if any(list(line) != header for line in lines):
            raise ValueError(f"{family.name}: a line's columns are not the table's {header}")
        body = [[line[column] for column in header] for line in lines]
        print(markdown_table(header, body), file=stream, flush=True)
    print(family.notes, file=stream)
    for line in family.verdict(results) if family.verdict else []:
        print(line, file=stream)
    for failure in failures:
        print(f"WRONG RESULT: {failure}", file=stream)
    stream.flush()
    return 1 if failures else 0
