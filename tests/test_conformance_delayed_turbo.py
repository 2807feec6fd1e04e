"""The delayed-turbo family's conformance machine (``kvrows.conformance.delayed``).

``DelayedTurboQuantKVCache`` runs the delayed machine under the selected profile, scaled
by the family's example budget: rows of TurboQuant legos and serial storages (plain,
TurboQuant) that convert at their own ``start`` while they are merged, stepped,
prefilled, verified in rounds, filtered, extracted and trimmed, against the reference
(codes and scales exact), a model of the layout, a solo lego per row and the eager-V
oracle. The tests check that nothing was skipped silently: every operation, every
oracle, every compared quantity, and the cases the family exists for (mixed rows attended
per group, a row converting while others stay plain, conversion at a round's end and at a
merge, several codecs and head dims past 64).
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest
from hypothesis.stateful import run_state_machine_as_test

import kvrows.optimized as O
import kvrows.reference as R
from kvrows.codec import TURBO_HEAD_DIMS
from kvrows.conformance.delayed import DELAYED_CHECKS, DELAYED_TURBO_CHECKS, TURBO_CODECS
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import machine_class
from kvrows.conformance.profiles import active_profile
from kvrows.conformance.runner import family_settings, format_report, run_machines
from kvrows.conformance.stats import Stats
from kvrows.conformance.tolerances import EXACT, tolerance

FAMILY = FAMILIES["delayed-turbo"]
LAYOUT = "DelayedTurboQuantKVCache"

#: Operations the machine must have exercised.
EXPECTED_OPS = {
    "new_request:lego",
    "new_request:plain",
    "new_request:turbo",
    "lego_append",
    "merge",
    "join",
    "decode_step",
    "multi_step",
    "prefill_crossing",
    "extract",
    "publish",
    "trim_rows",
    "invalid",
    "round:all",
    "round:none",
    "round:equal",
    "round:unequal",
    "filter:reorder",
}


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


#: The CI profile's examples (drawn from the machine's own seed,
#: ``profiles.machine_seed``) first read converted rows mixed with plain ones past the
#: family's 38: 50 reach every requirement (about 14 s on one core).
CI_EXAMPLES = 50


def test_delayed_turbo_family() -> None:
    settings = family_settings(FAMILY)
    if active_profile().name == "ci":
        settings = family_settings(FAMILY, max_examples=CI_EXAMPLES)
    stats = Stats(FAMILY.name, LAYOUT)
    run_state_machine_as_test(machine_class(FAMILY, LAYOUT, stats=stats), settings=settings)
    stats.require(
        settings.max_examples // 2,
        ops=EXPECTED_OPS,
        oracles=(*DELAYED_CHECKS, *DELAYED_TURBO_CHECKS, "record mask"),
    )
    compared = {quantity for quantity, _ in stats.errors}
    expected = {"kv.fetched", "kv.solo", "attention", "attention.solo", "attention.solo.plain"}
    expected |= {"attention.eager"}
    assert expected <= compared, f"quantities never compared: {expected - compared}"
    # Every comparison used the turbo rows of the tolerance table (the plain solo check:
    # byte for byte).
    for (quantity, dtype), record in stats.errors.items():
        chosen = (
            EXACT if quantity == "attention.solo.plain" else tolerance("turbo", quantity, dtype)
        )
        assert record.tolerance == chosen, (quantity, dtype, record.tolerance)
    assert {"start 0", "start > 0"} <= set(stats.variants), dict(stats.variants)
    # Several TurboQuant codecs, and head dims past 64 (never an affine variant).
    codecs = {name for name in stats.variants if name.startswith("turbo ")}
    assert codecs <= {f"turbo k{k}v{v}" for k, v in TURBO_CODECS}, codecs
    assert len(codecs) >= 3, dict(stats.variants)
    assert not any(name.startswith("bits=") for name in stats.variants), dict(stats.variants)
    dims = {int(name.split()[-1]) for name in stats.checks if name.startswith("head dim ")}
    assert dims <= set(TURBO_HEAD_DIMS) and max(dims) > 64, dims
    assert not stats.skips, dict(stats.skips)


def test_the_family_drives_the_delayed_turbo_layout() -> None:
    """One layout, rows of the TurboQuant lego, compared with the turbo tolerances; no
    other family drives it."""
    assert [spec.name for spec in FAMILY.layouts] == [LAYOUT]
    spec = FAMILY.layout(LAYOUT)
    assert spec.tolerance_key == FAMILY.tolerance_key == "turbo"
    assert spec.serial == "TurboQuantKVCache" and not spec.peer and FAMILY.peer is None
    assert FAMILY.machine is FAMILIES["delayed"].machine
    for mod in (R, O):
        assert mod.DelayedTurboQuantKVCache.lego_class is mod.Bf16FirstTurboQuantKVCache
    for name, family in FAMILIES.items():
        if name != "delayed-turbo":
            assert LAYOUT not in {s.name for s in family.layouts}, name


def test_runner_runs_the_delayed_turbo_family() -> None:
    results = run_machines(["delayed-turbo"], profile="ci", max_examples=2, stateful_step_count=6)
    assert [(r.family, r.layout) for r in results] == [("delayed-turbo", LAYOUT)]
    assert all(r.passed for r in results), [r.failure for r in results]
    assert LAYOUT in format_report(results, "ci")
