"""The microscaling families' conformance machines (``mx`` and ``delayed-mx``).

Both families come from the table's ``mx`` rows and the ``Microscaled`` row of
``conformance.hooks.CODEC_HOOKS`` alone (no rules of their own): ``BatchedMxKVCache`` in
every role of ``MxKVCache``'s rows (verify rounds included), ``DelayedMxKVCache`` and
``DelayedChunkedMxKVCache`` (rows of ``Bf16FirstMxKVCache`` / ``Bf16FirstChunkedMxKVCache``
legos converting at their own start). The model encodes
through the reference codec, so every stored, fetched and extracted plane is compared
byte for byte with both implementations. The tests check that nothing was skipped
silently and that every mode ran.
"""

from __future__ import annotations

import pytest
from conformance_helpers import (
    BASE_QUANTITIES,
    DELAYED_QUANTITIES,
    OPS_CHECKED,
    ROW_OPS,
    assert_compared,
    delayed_ops,
    run_family,
)

from kvrows.codecs.mx import MX_MODES, Microscaled
from kvrows.conformance.delayed import DELAYED_CHECKS
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.hooks import CODEC_HOOKS
from kvrows.conformance.machines import BASE_CHECKS
from kvrows.conformance.rules import SPECULATIVE_CHECKS
from kvrows.conformance.tolerances import EXACT, tolerance

pytestmark = pytest.mark.usefixtures("cpu_stream")

#: Every mode as the examples name it (``(bits, group_size)`` of the draw).
MODES = {f"bits={bits} group={group}" for group, bits in MX_MODES.values()}


def test_mx_family() -> None:
    family = FAMILIES["mx"]
    stats, settings = run_family(family, "BatchedMxKVCache")
    ops = ROW_OPS | {"prefill_chunk", "round:none", "round:unequal"}
    oracles = (*BASE_CHECKS, *SPECULATIVE_CHECKS, "solo attention", "state", "save_restore")
    stats.require(settings.max_examples // 2, ops=ops, oracles=oracles)
    stats.require(0, ops=OPS_CHECKED, oracles=("leases", "save_load across implementations"))
    assert_compared(stats, BASE_QUANTITIES)
    # Planes exact, attention under the affine rows of the tolerance table.
    for (quantity, dtype), record in stats.errors.items():
        assert record.tolerance == tolerance("affine", quantity, dtype), (quantity, dtype)
        if quantity.startswith("kv."):
            assert record.tolerance == EXACT and record.max_error == 0, (quantity, dtype)
    assert set(stats.variants) == MODES, dict(stats.variants)  # every mode, none other
    assert not stats.skips, dict(stats.skips)  # no mlx-lm peer: nothing to skip


@pytest.mark.parametrize("layout", ["DelayedMxKVCache", "DelayedChunkedMxKVCache"])
def test_delayed_mx_family(layout: str) -> None:
    family = FAMILIES["delayed-mx"]
    stats, settings = run_family(family, layout)
    stats.require(settings.max_examples // 2, ops=delayed_ops("mx"), oracles=DELAYED_CHECKS)
    assert_compared(stats, DELAYED_QUANTITIES)
    assert {"start 0", "start > 0"} <= set(stats.variants), dict(stats.variants)
    assert set(stats.variants) >= MODES, dict(stats.variants)
    assert not stats.skips, dict(stats.skips)


def test_the_families_come_from_the_table_and_one_hook_row() -> None:
    """The codec's row names its draw (every mode), the affine tolerance rows and the
    family; the layouts are the table's ``mx`` presets, without an mlx-lm peer."""
    hooks = CODEC_HOOKS[Microscaled]
    assert {(group, bits) for bits, group in hooks.draw.params} == set(MX_MODES.values())
    assert hooks.delayed is not None  # rows convert to it: the delayed-mx family
    mx, delayed = FAMILIES["mx"], FAMILIES["delayed-mx"]
    assert [s.name for s in mx.layouts] == ["BatchedMxKVCache"] and mx.serial == "MxKVCache"
    assert [s.name for s in delayed.layouts] == [
        "DelayedMxKVCache",
        "DelayedRotatingMxKVCache",
        "DelayedChunkedMxKVCache",
    ]
    assert mx.tolerance_key == "affine" and mx.peer is None and delayed.peer is None
    assert delayed.machine is FAMILIES["delayed"].machine  # the modifier's one machine


@pytest.mark.parametrize(
    ("family", "layout"), [("paged-mx", "PagedKvRows"), ("paged-rotating-mx", "PagedRotatingRows")]
)
def test_paged_mx_families(family: str, layout: str) -> None:
    """Block pools of the microscaling codecs (paging takes any codec): the paged machine
    with the example's codec, planes exact against the contiguous model, every mode."""
    stats, settings = run_family(FAMILIES[family], layout)
    oracles = ("reference vs optimized", "solo replay", "state", "admission")
    stats.require(settings.max_examples // 2, oracles=oracles)
    assert_compared(stats, {"kv.stored", "kv.solo"})
    codecs = {v for v in stats.variants if v.startswith("bits=")}  # (rings: windows too)
    assert codecs == MODES, dict(stats.variants)
    assert not stats.skips, dict(stats.skips)
