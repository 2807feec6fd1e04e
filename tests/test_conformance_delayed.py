"""The delayed family's conformance machines (``kvrows.conformance.delayed``).

Each delayed layout (``DelayedQuantizedKVCache``, ``DelayedRotatingQuantizedKVCache``,
``DelayedChunkedQuantizedKVCache``) runs
its machine under the selected profile, scaled by the family's example budget: rows of
legos and serial storages that convert to affine at their own ``start`` while they are
merged, stepped, prefilled, verified in rounds, filtered, extracted and trimmed, against
the reference, a model of the layout and a solo lego per row. The tests check that
nothing was skipped silently: every operation, every oracle, and each case the family
exists for (mixed reads, a row converting while others stay plain, conversion at a
round's end, at a merge, a crossing chunk inside prefill maintenance, packed reads).
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
from kvrows.conformance.delayed import DELAYED_CHECKS
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import FULL_RING_ROLLBACK, RING_TRIM_REFUSED, UNEVEN_TRIM

FAMILY = FAMILIES["delayed"]
LAYOUTS = [spec.name for spec in FAMILY.layouts]

pytestmark = pytest.mark.usefixtures("cpu_stream")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_delayed_family(layout: str) -> None:
    # The chunked layout's seed reaches a row converting mid-batch at its 80th example.
    chunked = layout == "DelayedChunkedQuantizedKVCache"
    stats, settings = run_family(FAMILY, layout, ci_examples=80 if chunked else None)
    stats.require(settings.max_examples // 2, ops=delayed_ops("affine"), oracles=DELAYED_CHECKS)
    assert_compared(stats, DELAYED_QUANTITIES)
    assert {"start 0", "start > 0"} <= set(stats.variants), dict(stats.variants)
    if layout != "DelayedChunkedQuantizedKVCache":  # (chunked rows refuse proposal rounds)
        # A draft's proposals on the layout itself, discarded; some past a row's start.
        required = ("proposal round discarded", "proposal past start (no conversion)")
        assert all(stats.checks[c] > 0 for c in required), dict(stats.checks)
        if layout == "DelayedRotatingQuantizedKVCache":
            assert stats.checks["proposal round on a full window"] > 0, dict(stats.checks)
    if layout in ("DelayedQuantizedKVCache", "DelayedChunkedQuantizedKVCache"):
        stats.require(0, states=(UNEVEN_TRIM,))  # equal rows trimmed unequally, then a step
        # Mixed full-attention or chunked rows answer make_mask with the position record's
        # mask (a chunked row's as its front trim lays it).
        assert stats.checks["record mask"] > 0, dict(stats.checks)
        if layout == "DelayedChunkedQuantizedKVCache":
            # Rows forgot their oldest tokens (their pads grew), and a row that forgot
            # some refused a publish of a shorter prefix.
            assert stats.checks["front trim"] > 0, dict(stats.checks)
            assert stats.checks["publish refused"] > 0, dict(stats.checks)
    else:
        stats.require(0, states=(FULL_RING_ROLLBACK, RING_TRIM_REFUSED))
        # A wrapped ring row refused a publish of a shorter prefix.
        assert stats.checks["publish refused"] > 0, dict(stats.checks)
    assert not stats.skips, dict(stats.skips)


def test_the_family_drives_every_affine_delayed_layout() -> None:
    """The family's layouts are both implementations' affine delayed layouts, each holding
    rows of its lego class."""
    assert LAYOUTS == [
        "DelayedQuantizedKVCache",
        "DelayedRotatingQuantizedKVCache",
        "DelayedChunkedQuantizedKVCache",
    ]
    for mod in (R, O):
        assert mod.DelayedQuantizedKVCache.lego_class is mod.Bf16FirstQuantizedKVCache
        assert (
            mod.DelayedRotatingQuantizedKVCache.lego_class is mod.Bf16FirstRotatingQuantizedKVCache
        )
        assert mod.DelayedChunkedQuantizedKVCache.lego_class is mod.Bf16FirstChunkedQuantizedKVCache
    assert {spec.tolerance_key for spec in FAMILY.layouts} == {"affine", "rotating-affine"}
    # No other family drives a delayed layout (their rows change codec).
    for name, family in FAMILIES.items():
        if name != "delayed":
            assert not {spec.name for spec in family.layouts} & set(LAYOUTS), name
