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

import pytest
from conformance_helpers import (
    DELAYED_QUANTITIES,
    assert_compared,
    delayed_ops,
    run_family,
)

import kvrows.optimized as O
import kvrows.reference as R
from kvrows.codec import TURBO_HEAD_DIMS
from kvrows.conformance.delayed import DELAYED_CHECKS, DELAYED_TURBO_CHECKS, TURBO_CODECS
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import UNEVEN_TRIM
from kvrows.conformance.tolerances import EXACT, tolerance

FAMILY = FAMILIES["delayed-turbo"]
LAYOUT = "DelayedTurboQuantKVCache"

pytestmark = pytest.mark.usefixtures("cpu_stream")


#: The CI profile's examples (drawn from the machine's own seed,
#: ``profiles.machine_seed``) first read converted rows mixed with plain ones past the
#: family's 38 ("mixed read that converted rows"): 40 reach every requirement, the hard
#: state ``UNEVEN_TRIM`` included (about 12 s on one core; 50 before the hard-state
#: branch changed the draws).
CI_EXAMPLES = 40


def test_delayed_turbo_family() -> None:
    stats, settings = run_family(FAMILY, LAYOUT, ci_examples=CI_EXAMPLES)
    stats.require(
        settings.max_examples // 2,
        ops=delayed_ops("turbo"),
        oracles=(*DELAYED_CHECKS, *DELAYED_TURBO_CHECKS, "record mask"),
    )
    stats.require(0, states=(UNEVEN_TRIM,))  # equal rows trimmed unequally, then a step
    assert_compared(stats, {*DELAYED_QUANTITIES, "attention.eager"})
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
