"""The paged families' conformance machines (``conformance.rules.PagedRules``).

``PagedKvRows`` (the layout of ``PagedKVCache``'s rows in all three roles) runs the
paged rules composed with the verify rounds under the selected profile, scaled by the family's example budget:
serial caches and layout rows merged, joined, stepped, verified in rounds, filtered,
extracted, published, trimmed and saved, against the reference, the contiguous model
(the same bytes as ``KVCache``) and a solo replay per row, with the pools' invariants
after every rule, in byte-limited pools that run out at random points (a refusal must
be the same in both implementations and change nothing). The test checks nothing was
skipped silently.
"""

from __future__ import annotations

import pytest
from conformance_helpers import assert_compared, run_family

from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import BASE_CHECKS, UNEVEN_TRIM
from kvrows.conformance.rules import (
    BLOCK_TABLE_GAPS,
    SPECULATIVE_CHECKS,
    WHOLE_BLOCK_HIT,
    AffineRules,
    PagedRules,
    RoundRules,
)

#: Issue 24's hard states every paged family reaches (a growing pool's prefix hits too).
STATES = (UNEVEN_TRIM, BLOCK_TABLE_GAPS, WHOLE_BLOCK_HIT)

FAMILY = FAMILIES["paged"]

#: Operations the paged machine must have exercised.
EXPECTED_OPS = {
    "new_request",
    "prefill_chunk",
    "merge",
    "decode_step",
    "extract",
    "publish",
    "trim_rows",
    "invalid",
}


pytestmark = pytest.mark.usefixtures("cpu_stream")


#: The CI profile's examples (drawn from the machine's own seed,
#: ``profiles.machine_seed``) first reach a round that goes on after a refused block
#: past the family's 15: 40 reach every requirement (about 15 s on one core).
CI_EXAMPLES = 40


def test_paged_family() -> None:
    assert [spec.name for spec in FAMILY.layouts] == ["PagedKvRows"]
    spec = FAMILY.layout("PagedKvRows")
    assert spec.roles == ("decode", "prefill", "verify") and spec.trim_rows
    assert FAMILY.machine is not None
    assert issubclass(FAMILY.machine(), PagedRules) and issubclass(FAMILY.machine(), RoundRules)
    stats, settings = run_family(FAMILY, "PagedKvRows", ci_examples=CI_EXAMPLES)
    oracles = (*BASE_CHECKS, *SPECULATIVE_CHECKS, "state", "save_restore")
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS, oracles=oracles)
    assert stats.ops["spec_rounds"] + stats.ops["row_rounds"] > 0, dict(stats.ops)
    rollbacks = ("round:none", "round:equal", "round:unequal")
    assert sum(stats.ops[op] for op in rollbacks) > 0, dict(stats.ops)
    assert_compared(stats, {"kv.stored", "kv.fetched", "kv.solo", "attention"})
    assert not stats.skips, dict(stats.skips)
    # Byte-limited pools: appends (verify blocks included) were refused, alike and with
    # nothing changed, and the rounds went on.
    assert stats.ops["exhausted:append"] > 0, dict(stats.ops)
    stats.require(
        0,
        oracles=(
            "pool invariants",
            "exhaustion refused",
            "round usable after a refused block",
            "save_load into the pool",
        ),
    )
    stats.require(0, states=STATES)


def test_paged_affine_family() -> None:
    """The same rows over affine pools (one codec per example): codes exact."""
    family = FAMILIES["paged-affine"]
    assert family.machine is not None
    assert [c for c in family.machine().__mro__ if c in (RoundRules, PagedRules, AffineRules)] == [
        RoundRules,
        PagedRules,
        AffineRules,
    ]
    stats, settings = run_family(family, "PagedKvRows")
    oracles = ("reference vs optimized", "solo replay", "state", "admission")
    stats.require(settings.max_examples // 2, oracles=oracles)
    assert len(stats.variants) >= 3 and all(v.startswith("bits=") for v in stats.variants)
    assert_compared(stats, {"kv.stored", "kv.solo"})
    # Its few examples (quantized attention is slow) trim rows seldom: the uneven trim is
    # the paged family's.
    stats.require(0, states=(BLOCK_TABLE_GAPS, WHOLE_BLOCK_HIT))
