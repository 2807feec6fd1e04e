"""The speculative family's conformance machines, and mlx-lm's B10.

Each verify layout (``BatchedKVCache``, ``BatchedQuantizedKVCache``,
``SpeculativeRotatingKVCache``, ``SpeculativeRotatingAffineLayout``) runs its machine
(the storage's rules with ``kvrows.conformance.rules.RoundRules``) under the selected profile, scaled by the family's
example budget: random verify rounds between the base machine's operations, against the
reference, a solo replay of each row's accepted tokens and mlx-lm's own speculative
rollback. The tests check that nothing was skipped silently (every kind of round, the
misuse and invalidation checks, rounds across the window on rings), and the divergence
test reproduces, on mlx-lm as installed, the behaviour the parity oracle skips as B10.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conformance_helpers import (
    BASE_QUANTITIES,
    OPS_CHECKED,
    ROW_OPS,
    assert_compared,
    assert_skips_documented,
    run_family,
)
from mlx_lm.models import cache as mlx_lm_cache

import kvrows.optimized as O
import kvrows.reference as R
from kvrows import table
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import BASE_CHECKS, UNEVEN_TRIM
from kvrows.conformance.rules import (
    ACCEPTANCE,
    FULL_RING_ROLLBACK,
    RING_TRIM_REFUSED,
    SPECULATIVE_CHECKS,
)
from kvrows.protocols import SpeculativeRowLayout

#: mlx-lm is untyped; reach its classes through ``Any``.
LM: Any = mlx_lm_cache

FAMILY = FAMILIES["speculative"]
LAYOUTS = [spec.name for spec in FAMILY.layouts]

#: Operations every speculative machine must have exercised.
EXPECTED_OPS = ROW_OPS | {
    "row_rounds",
    "failed_round",
    "round misuse",
    "round:d0",
    *(f"round:{kind}" for kind in ACCEPTANCE),
}

pytestmark = pytest.mark.usefixtures("cpu_stream")


#: Layouts whose CI examples (derandomized) reach every operation, oracle and state by
#: their 6th (plain), 8th (affine) and 10th (plain ring) example: they run fewer than the
#: family's budget (27), the affine ring (round:equal at 26) the whole of it.
CI_EXAMPLES = {
    "BatchedKVCache": 14,
    "BatchedQuantizedKVCache": 16,
    "SpeculativeRotatingKVCache": 22,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_speculative_family(layout: str) -> None:
    stats, settings = run_family(FAMILY, layout, ci_examples=CI_EXAMPLES.get(layout))
    spec = FAMILY.layout(layout)
    stats.require(
        settings.max_examples // 2,
        ops=EXPECTED_OPS,
        oracles=(*BASE_CHECKS, *SPECULATIVE_CHECKS, "solo attention", "RowRound"),
    )
    assert_skips_documented(stats)
    stats.require(0, ops=OPS_CHECKED, oracles=("leases", "save_load across implementations"))
    if not layout.startswith("SpeculativeRotating"):  # (a ring's rows wrap: its own states)
        stats.require(0, states=(UNEVEN_TRIM,))  # equal rows trimmed unequally, then a step
    if spec.serial_peer:
        # Every row's mlx-lm twin ran mlx-lm's own round (block, then trim_prompt_cache).
        assert stats.checks["mlx-lm speculative twin"] > 0, dict(stats.checks)
    assert_compared(stats, BASE_QUANTITIES | ({"kv.mlx_lm"} if spec.serial_peer else set()))
    if layout.startswith("SpeculativeRotating"):
        # Rounds rolled back rows that had passed the window, and rows the block took
        # across it.
        assert stats.checks["rollback on a wrapped row"] > 0, dict(stats.checks)
        assert stats.checks["round across the window"] > 0, dict(stats.checks)
        # Rows holding exactly max_size rolled back; trims past the window refused.
        stats.require(0, states=(FULL_RING_ROLLBACK, RING_TRIM_REFUSED))
        if spec.serial_peer:
            assert stats.skips["B10"] > 0, dict(stats.skips)
    else:
        assert "B10" not in stats.skips, "B10 is a ring divergence"


def test_the_family_drives_every_verify_layout() -> None:
    """The family's layouts are exactly the row-layout table's verify role of every landed
    serial storage that has one, in both implementations, each a SpeculativeRowLayout."""
    serials = {spec.serial for spec in FAMILY.layouts}
    assert serials == {
        "ChunkedKVCache",
        "ChunkedQuantizedKVCache",
        "KVCache",
        "QuantizedKVCache",
        "RotatingKVCache",
        "RotatingMxKVCache",
        "RotatingQuantizedKVCache",
    }
    for mod in (R, O):
        for spec in FAMILY.layouts:
            serial = getattr(mod, spec.serial)(*_params(spec.serial))
            layout = table.target_cache_layout(serial)
            assert type(layout).__name__ == spec.name
            assert isinstance(layout, SpeculativeRowLayout)
    assert {spec.tolerance_key for spec in FAMILY.layouts} == {
        "plain",
        "affine",
        "rotating",
        "rotating-affine",
    }


def _params(serial: str) -> tuple[int, ...]:
    ring = (6,) if "Rotating" in serial or "Chunked" in serial else ()
    return ring + ((32, 4) if "Quantized" in serial or "Mx" in serial else ())


# ------------------------------------------------- the mlx-lm divergence the oracle skips


def _tags(tags: list[int]) -> Any:
    return np.broadcast_to(np.array(tags, np.float32)[None, None, :, None], (1, 1, len(tags), 4))


def test_divergence_b10_a_full_ring_keeps_rejected_drafts() -> None:
    """mlx-lm's speculative decoding rolls back with ``trim_prompt_cache``, which trims
    nothing once a ``RotatingKVCache`` reached its window: after three tokens of a window
    of 4 and a verify block [4, 5, 6] whose drafts are both rejected, mlx-lm's ring still
    holds 5 and 6; kvrows' verify layout keeps [1, 2, 3, 4]."""
    ring = LM.RotatingKVCache(4)
    ring.update_and_fetch(mx.array(_tags([1, 2, 3])), mx.array(_tags([1, 2, 3])))
    ring.update_and_fetch(mx.array(_tags([4, 5, 6])), mx.array(_tags([4, 5, 6])))
    assert not LM.can_trim_prompt_cache([ring])
    assert LM.trim_prompt_cache([ring], 2) == 0
    assert ring.offset == 6
    held = np.array(ring.keys_and_values()[0])[0, 0, :, 0].astype(int).tolist()
    assert {5, 6} <= set(held)
    for mod, arr in ((R, np.array), (O, mx.array)):
        serial = mod.RotatingKVCache(4)
        serial.update_and_fetch(arr(_tags([1, 2, 3])), arr(_tags([1, 2, 3])))
        layout: Any = table.target_cache_layout(serial)
        layout.merge_rows([serial])
        layout.spec_round_begin()
        layout.update_and_fetch(arr(_tags([4, 5, 6])), arr(_tags([4, 5, 6])))
        layout.spec_round_rollback(1)
        assert layout.row_offsets == (4,)
        extracted: Any = layout.extract_row(0)
        window = extracted.window()
        assert np.array(window[0][0])[0, 0, :, 0].astype(int).tolist() == [1, 2, 3, 4]
