"""``kvrows conform``: run every family's machines, with a progress bar and a summary table."""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import hypothesis
import mlx.core as mx
from hypothesis import seed as hypothesis_seed
from hypothesis.stateful import run_state_machine_as_test

from kvrows.conformance.families import FAMILIES, Family, LayoutSpec
from kvrows.conformance.machines import Limits, machine_class
from kvrows.conformance.parity import DIVERGENCES
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.conformance.stats import Stats

__all__ = [
    "MachineResult",
    "ProgressBar",
    "family_settings",
    "format_report",
    "run_conformance",
    "run_machines",
]


class ProgressBar:
    """A one-line text bar on ``stream`` (no dependency; quiet when not a terminal)."""

    def __init__(self, total: int, stream: TextIO, width: int = 30) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream
        self.width = width
        self.label = ""
        self.started = time.monotonic()
        self.interactive = bool(getattr(stream, "isatty", lambda: False)())
        self._last_line = -1
        self._last_done = -1

    def tick(self, label: str) -> None:
        self.done += 1
        self.label = label
        self.draw()

    def draw(self, final: bool = False) -> None:
        done = min(self.done, self.total)
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        line = (
            f"[{bar}] {done}/{self.total} examples  {time.monotonic() - self.started:5.0f}s  "
            f"{self.label}"
        )
        if self.interactive:
            self.stream.write("\r" + line.ljust(100) + ("\n" if final else ""))
            self.stream.flush()
        else:
            # Not a terminal (CI logs): a line every tenth of the way, and the last one.
            tenth = 10 * done // self.total
            if tenth != self._last_line or (final and self._last_done != done):
                self._last_line, self._last_done = tenth, done
                self.stream.write(line + "\n")
                self.stream.flush()

    def finish(self) -> None:
        self.draw(final=True)


@dataclass
class MachineResult:
    family: str
    layout: str
    stats: Stats
    seconds: float
    failure: BaseException | None = None
    details: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.failure is None


def family_settings(
    family: Family, profile: str | None = None, **overrides: object
) -> hypothesis.settings:
    """``profile``'s settings for ``family``'s machines: ``max_examples`` scaled by
    ``family.examples`` and the steps per example by ``family.steps``, each unless
    ``overrides`` name it."""
    base = profile_settings(profile, **overrides)
    if "max_examples" not in overrides and family.examples != 1.0:
        scaled = max(1, round(base.max_examples * family.examples))
        base = hypothesis.settings(base, max_examples=scaled)
    if "stateful_step_count" not in overrides and family.steps != 1.0:
        steps = max(1, round(base.stateful_step_count * family.steps))
        base = hypothesis.settings(base, stateful_step_count=steps)
    return base


def run_machines(
    families: Sequence[str] | None = None,
    *,
    profile: str | None = None,
    seed: int | None = None,
    stream: TextIO | None = None,
    enforce: bool = True,
    limits: Limits | None = None,
    **settings_overrides: object,
) -> list[MachineResult]:
    """Run every (family, layout) machine under ``profile``; never raises on a failure."""
    chosen = list(families) if families else list(FAMILIES)
    unknown = [name for name in chosen if name not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown families {unknown}; known: {sorted(FAMILIES)}")
    prof = active_profile(profile)
    jobs: list[tuple[Family, LayoutSpec]] = [
        (FAMILIES[name], spec) for name in chosen for spec in FAMILIES[name].layouts
    ]
    budgets = {
        name: family_settings(FAMILIES[name], prof.name, **settings_overrides) for name in chosen
    }
    total = sum(budgets[family.name].max_examples for family, _ in jobs)
    bar = ProgressBar(total, stream) if stream is not None else None
    results: list[MachineResult] = []
    for family, spec in jobs:
        label = f"{family.name}/{spec.name}"
        stats = Stats(family.name, spec.name)
        if bar is not None:
            stats.on_example = lambda _stats, label=label: bar.tick(label)
        cls = machine_class(
            family, spec.name, stats=stats, enforce=enforce, limits=limits, profile=prof.name
        )
        if seed is not None:
            cls = hypothesis_seed(seed)(cls)
        started = time.monotonic()
        failure: BaseException | None = None
        try:
            # Parity with mlx-lm (and the tolerance table) is defined on the CPU backend.
            with mx.stream(mx.cpu):
                run_state_machine_as_test(cls, settings=budgets[family.name])
        except Exception as error:
            failure = error
        results.append(
            MachineResult(family.name, spec.name, stats, time.monotonic() - started, failure)
        )
    if bar is not None:
        bar.finish()
    return results


def _worst(stats: Stats) -> str:
    """The compared quantity closest to its tolerance, as ``error / tolerance``."""
    worst = None
    for record in stats.errors.values():
        if record.tolerance.exact:
            continue
        if worst is None or record.max_ratio > worst.max_ratio:
            worst = record
    if worst is None:
        return "-"
    return f"{worst.max_ratio:.0%} ({worst.quantity} {worst.dtype})"


def format_report(results: Sequence[MachineResult], profile: str) -> str:
    """The summary table, then per machine: operations, errors vs tolerances, parity skips."""
    lines = [f"kvrows conformance, profile {profile!r}", ""]
    header = (
        "family",
        "layout",
        "operations",
        "examples",
        "steps",
        "worst error/tol",
        "time",
        "result",
    )
    rows = [
        (
            r.family,
            r.layout,
            f"{len(r.stats.ops)} kinds, {sum(r.stats.ops.values())} calls",
            str(r.stats.examples),
            str(r.stats.steps),
            _worst(r.stats),
            f"{r.seconds:.0f}s",
            "PASS" if r.passed else "FAIL",
        )
        for r in results
    ]
    widths = [
        max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
        for i, h in enumerate(header)
    ]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)
    for r in results:
        lines += ["", f"{r.family}/{r.layout}:"]
        ops = ", ".join(f"{name} {count}" for name, count in sorted(r.stats.ops.items()))
        lines.append(f"  operations exercised: {ops or '-'}")
        checks = ", ".join(f"{name} {count}" for name, count in sorted(r.stats.checks.items()))
        lines.append(f"  oracle checks: {checks or '-'}")
        if r.stats.variants:
            variants = ", ".join(f"{v} x{n}" for v, n in sorted(r.stats.variants.items()))
            lines.append(f"  examples per variant: {variants}")
        lines.append("  max error seen vs tolerance:")
        for (quantity, dtype), record in sorted(r.stats.errors.items()):
            lines.append(
                f"    {quantity:<17} {dtype:<9} max |diff| {record.max_error:<10.3g} "
                f"tolerance {record.tolerance.describe():<22} "
                f"({record.comparisons} comparisons)"
            )
        if r.stats.skips:
            lines.append("  mlx-lm parity skips (kvrows follows the reference):")
            for code, count in sorted(r.stats.skips.items()):
                known = DIVERGENCES.get(code)
                what = known.operation if known is not None else "UNKNOWN SKIP REASON"
                lines.append(f"    {code} x{count}: {what}")
        if r.failure is not None:
            lines.append("  FAILED:")
            text = "".join(traceback.format_exception(r.failure))
            lines.extend("    " + line for line in text.rstrip().splitlines())
    return "\n".join(lines)


def run_conformance(
    profile: str | None = None,
    families: list[str] | None = None,
    seed: int | None = None,
) -> int:
    """Run the conformance machines; print the table; 0 when every machine passed, else 1."""
    prof = active_profile(profile)
    try:
        results = run_machines(families, profile=prof.name, seed=seed, stream=sys.stderr)
    except ValueError as error:
        print(f"kvrows conform: {error}", file=sys.stderr)
        return 2
    print(format_report(results, prof.name))
    return 0 if all(r.passed for r in results) else 1
