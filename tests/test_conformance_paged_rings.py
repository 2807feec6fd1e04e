"""The paged rings' conformance machines (the paged placement under the ring geometry:
``conformance.rules.PagedRules`` over ``RingRules``, rounds across the window).

``PagedRotatingRows`` (the layout of ``PagedRotatingKVCache``'s rows in all three roles)
runs the paged rules, the ring's rules and the verify rounds under the selected profile:
requests and layout rows merged, joined, stepped, verified in rounds (across the
window), filtered, extracted, published, trimmed and saved, their prefixes registered
and looked up (``PagedRules.prefix_hit``: inside the window, or nothing past it), against the reference, the
contiguous ring's model (what ``RotatingKVCache`` / ``RaggedRotatingRows`` hold) and a
solo replay per row, with the pools' invariants (every row holds exactly the blocks of
its positions) after every rule, in byte-limited pools.
"""

from __future__ import annotations

import pytest
from conformance_helpers import assert_compared, run_family

from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import BASE_CHECKS
from kvrows.conformance.rules import (
    BLOCK_TABLE_GAPS,
    FULL_RING_ROLLBACK,
    RING_TRIM_REFUSED,
    PagedRules,
    RingRoundRules,
    RingRules,
    RoundRules,
)

pytestmark = pytest.mark.usefixtures("cpu_stream")

EXPECTED_OPS = {"new_request", "prefill_chunk", "merge", "decode_step", "extract", "invalid"}


def test_paged_rotating_family() -> None:
    family = FAMILIES["paged-rotating"]
    assert [spec.name for spec in family.layouts] == ["PagedRotatingRows"]
    spec = family.layout("PagedRotatingRows")
    assert spec.roles == ("decode", "prefill", "verify") and spec.trim_rows
    assert family.machine is not None
    machine = family.machine()
    assert all(issubclass(machine, r) for r in (PagedRules, RingRules, RingRoundRules))
    stats, settings = run_family(family, "PagedRotatingRows")
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS, oracles=(*BASE_CHECKS, "state"))
    assert stats.ops["spec_rounds"] + stats.ops["row_rounds"] > 0, dict(stats.ops)
    assert_compared(stats, {"kv.stored", "kv.fetched", "kv.solo", "attention"})
    stats.require(0, oracles=("pool invariants", "save_restore", "save_load into the pool"))
    assert stats.variants["sink tokens"] and stats.variants["no sink tokens"], stats.variants
    # Issue 24's hard states: rows at exactly max_size rolled back, trims past the window
    # refused, blocks out of the window given back (FREE entries) under read.
    stats.require(0, states=(FULL_RING_ROLLBACK, RING_TRIM_REFUSED, BLOCK_TABLE_GAPS))
    assert not stats.skips, dict(stats.skips)
    # Rings publish their prefix: registered inside the window, nothing past it.
    assert stats.ops["prefix:register"] and stats.ops["prefix:past the window"], dict(stats.ops)


def test_paged_rotating_affine_family() -> None:
    """The same rows over affine pools (one codec per example): codes exact."""
    family = FAMILIES["paged-rotating-affine"]
    assert family.machine is not None
    assert issubclass(family.machine(), RoundRules)
    stats, settings = run_family(family, "PagedRotatingRows")
    stats.require(settings.max_examples // 2, oracles=("reference vs optimized", "state"))
    assert sum(v.startswith("bits=") for v in stats.variants) >= 3, stats.variants
    # Its six examples trim rows seldom: the ring's trim states are the plain pools'.
    stats.require(0, states=(BLOCK_TABLE_GAPS,))
