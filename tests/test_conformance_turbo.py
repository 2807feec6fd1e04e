"""The turbo family's conformance machine (``rules.TurboRules`` with the verify rounds).

``BatchedTurboQuantKVCache`` (the layout of ``TurboQuantKVCache``'s rows in all three
roles) runs its machine under the selected profile, scaled by the family's example
budget: serial caches and layout rows at one TurboQuant codec per example, merged,
joined, stepped, verified in rounds, filtered, extracted, published and trimmed, against
the reference (codes and scales exact), a solo replay per row and the eager-V oracle.
The tests check that nothing was skipped silently: every operation, every oracle, every
compared quantity, and the cases the family exists for (several codecs, packed and
8-bit keys, head dims past 128, key and value dims that differ, the eager oracle over a
read with padding columns, rolled-back rounds).
"""

from __future__ import annotations

import pytest
from conformance_helpers import BASE_QUANTITIES, OPS_CHECKED, ROW_OPS, assert_compared, run_family

from kvrows.codec import TURBO_HEAD_DIMS
from kvrows.codecs import Turbo
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.hooks import CODEC_HOOKS
from kvrows.conformance.machines import BASE_CHECKS, UNEVEN_TRIM
from kvrows.conformance.rules import SPECULATIVE_CHECKS, TURBO_CHECKS, RoundRules, TurboRules
from kvrows.conformance.runner import family_settings

FAMILY = FAMILIES["turbo"]
#: Every supported codec, ``(k_bits, v_bits)`` (the turbo codec's draw).
CODECS = CODEC_HOOKS[Turbo].draw.params
LAYOUTS = [spec.name for spec in FAMILY.layouts]

#: Operations the turbo machine must have exercised.
EXPECTED_OPS = ROW_OPS | {"prefill_chunk", "round:none", "round:unequal"}

pytestmark = pytest.mark.usefixtures("cpu_stream")


#: The 8-bit-key codecs: the family's seeded CI examples first draw one past 26 of them,
#: so a short second run holds the codec there (the family's budget stays its own).
EIGHT_BIT_KEYS = tuple((k, v) for k, v in CODECS if k == 8)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_turbo_family(layout: str) -> None:
    stats, settings = run_family(FAMILY, layout)
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS)
    eight, _ = run_family(
        FAMILY,
        layout,
        family_settings(FAMILY, max_examples=max(2, settings.max_examples // 4)),
        codecs=EIGHT_BIT_KEYS,
        name=f"{layout}EightBitKeys",
    )
    assert eight.checks["8-bit keys"] == eight.examples > 0, dict(eight.checks)
    stats.checks["8-bit keys"] += eight.checks["8-bit keys"]
    # Saved states too: both implementations describe the same rows, and the machine goes
    # on with the restored caches.
    oracles = (*BASE_CHECKS, *SPECULATIVE_CHECKS, *TURBO_CHECKS, "solo attention", "state")
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS, oracles=(*oracles, "save_restore"))
    assert_compared(stats, BASE_QUANTITIES | {"attention.eager"})
    stats.require(0, states=(UNEVEN_TRIM,))  # equal rows trimmed unequally, then a step
    stats.require(0, ops=OPS_CHECKED, oracles=("leases", "save_load across implementations"))
    # Every example ran at one supported codec, and not always the same one.
    names = {f"turbo k{k}v{v}" for k, v in CODECS}
    assert set(stats.variants) <= names, set(stats.variants) - names
    assert sum(stats.variants.values()) == stats.examples
    assert len(stats.variants) >= 3, dict(stats.variants)
    # Head dims: only the codec's, and past 128 too.
    dims = {int(name.split()[-1]) for name in stats.checks if name.startswith("head dim ")}
    assert dims <= set(TURBO_HEAD_DIMS), dims
    assert max(dims) > 128, dims
    # No mlx-lm peer: nothing to skip.
    assert not stats.skips, dict(stats.skips)


def test_the_family_drives_both_turbo_storages() -> None:
    """One layout, ``BatchedTurboQuantKVCache``, in every role of ``TurboQuantKVCache``'s
    rows, on the turbo machine (verify rounds included), without an mlx-lm peer."""
    assert LAYOUTS == ["BatchedTurboQuantKVCache"]
    spec = FAMILY.layout("BatchedTurboQuantKVCache")
    assert spec.roles == ("decode", "prefill", "verify")
    assert spec.trim_rows and not spec.shared_column
    assert FAMILY.serial == "TurboQuantKVCache"
    assert FAMILY.peer is None and not spec.peer and not spec.serial_peer
    assert FAMILY.machine is not None
    machine = FAMILY.machine()
    assert issubclass(machine, TurboRules) and issubclass(machine, RoundRules)
    # No other family drives a turbo class (but the delayed turbo layout, whose converted
    # rows extract into TurboQuantKVCache: the delayed-turbo family).
    for name, family in FAMILIES.items():
        if name not in ("turbo", "delayed-turbo"):
            serials = {s.serial or family.serial for s in family.layouts}
            assert "TurboQuantKVCache" not in serials, name
