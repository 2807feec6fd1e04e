"""The derandomized profiles draw the same examples whatever ran or was imported before
(``kvrows.conformance.profiles``): Hypothesis would otherwise mix in literals from the
source of every module imported so far, so a test's examples changed with test order."""

from __future__ import annotations

import importlib
import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import machine_class
from kvrows.conformance.profiles import profile_settings
from kvrows.conformance.runner import family_settings
from kvrows.conformance.stats import Stats

#: Fresh literals for each import: Hypothesis only ever adds to the literals it collected.
_IMPORTS = itertools.count()


@pytest.fixture
def import_new_literals(tmp_path: Path) -> Iterator[Callable[[], None]]:
    """A function that imports a module of literals no module imported before has
    (integers past Hypothesis's small-integer cut, floats), as a lazy import in a test
    run before would."""
    names: list[str] = []

    def import_one() -> None:
        number = next(_IMPORTS)
        base = 1_000_003 + 1_000 * number
        literals = [*range(base, base + 500), *(n / 7 + number for n in range(1, 200))]
        names.append(f"kvrows_profile_order_literals_{number}")
        (tmp_path / f"{names[-1]}.py").write_text(f"LITERALS = {tuple(literals)!r}\n")
        importlib.import_module(names[-1])

    sys.path.insert(0, str(tmp_path))
    try:
        yield import_one
    finally:
        sys.path.remove(str(tmp_path))
        for name in names:
            sys.modules.pop(name, None)


@pytest.mark.parametrize("profile", ["ci", "teeth"])
def test_plain_draws_ignore_a_later_import(
    profile: str, import_new_literals: Callable[[], None]
) -> None:
    drawn: list[tuple[int, float]] = []

    @profile_settings(profile, max_examples=150)
    @given(st.integers(0, 2**32 - 1), st.floats(-1e9, 1e9))
    def draw(integer: int, real: float) -> None:
        drawn.append((integer, real))

    draw()
    before = list(drawn)
    drawn.clear()
    import_new_literals()
    draw()
    assert len(before) == 150 and drawn == before


def _machine_run(family_name: str, examples: int) -> tuple[object, ...]:
    """What a family's first layout drew under the CI profile: operations, checks,
    variants and the largest error per compared quantity (sensitive to every value)."""
    family = FAMILIES[family_name]
    layout = family.layouts[0].name
    stats = Stats(family.name, layout)
    settings = family_settings(family, "ci", max_examples=examples)
    with mx.stream(mx.cpu):
        run_state_machine_as_test(machine_class(family, layout, stats=stats), settings=settings)
    errors = sorted((key, r.max_error, r.comparisons) for key, r in stats.errors.items())
    return (
        stats.examples,
        sorted(stats.ops.items()),
        sorted(stats.checks.items()),
        sorted(stats.variants.items()),
        errors,
    )


def test_a_machine_draws_the_same_after_another_family_and_an_import(
    import_new_literals: Callable[[], None],
) -> None:
    first = _machine_run("paged", examples=3)
    _machine_run("recurrent", examples=2)
    import_new_literals()
    assert _machine_run("paged", examples=3) == first
