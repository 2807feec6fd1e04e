"""The paged-latent family's conformance machine (``kvrows.conformance.paged_latent``).

``PagedLatentCache`` runs the latent machine with every row in one block pool per
implementation: against the reference, a reference ``MLACache`` per row (the oracle) and
mlx-lm's ``KVCache`` / ``BatchKVCache`` pairs, the pool's invariants after every rule; bad
inputs raise the same error in both implementations and change nothing; pools limited
at random points refuse alike and change nothing; requests and layouts leased, saved and
loaded across implementations into private pools and into the example's pools, released
with every block back (``machines.OpsChecks``' cadence). The test checks that nothing was
skipped silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conformance_helpers import OPS_CHECKED, caught, run_family

import kvrows.optimized as opt
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.latent import LATENT_CHECKS
from kvrows.conformance.machines import UNEVEN_TRIM
from kvrows.conformance.rules import BLOCK_TABLE_GAPS, WHOLE_BLOCK_HIT

FAMILY = FAMILIES["paged-latent"]

EXPECTED_OPS = {
    "new_request",
    "prefill_chunk",
    "merge",
    "decode_step",
    "spec_rounds",
    "round:unequal",
    "filter",
    "extract",
    "trim",
    "trim_rows",
    "trim_rows:uneven",
    "prefix:register",
    "prefix:lookup",
    "prefix:hit",
    "invalid",
    "bad:dsa mismatch",
    "bad:other block size",
    # leases and save/load across implementations (``machines.OpsChecks``' cadence)
    *OPS_CHECKED,
}


pytestmark = pytest.mark.usefixtures("cpu_stream")


def test_paged_latent_family() -> None:
    stats, _ = run_family(FAMILY, "PagedLatentCache")
    assert stats.examples > 0
    missing_ops = EXPECTED_OPS - set(stats.ops)
    assert not missing_ops, f"operations never exercised: {sorted(missing_ops)}"
    oracles = {
        *LATENT_CHECKS,
        *("MLACache oracle", "pool invariants", "mlx-lm", "leases"),
        *("save_load across implementations", "save_load into the pool"),
    }
    missing = oracles - set(stats.checks)
    assert not missing, f"oracles never reached: {sorted(missing)}"
    stats.require(0, states=(UNEVEN_TRIM, WHOLE_BLOCK_HIT, BLOCK_TABLE_GAPS))
    assert any("dsa=True" in v for v in stats.variants)
    assert any("dsa=False" in v for v in stats.variants)
    kinds = {v.split()[0].split(":")[0] for v in stats.variants}
    assert kinds == {"plain", "affine", "turbo", "mxfp4", "nvfp4"}  # every codec family drawn
    assert stats.checks["mixed conversion"] > 0
    # an encoded latent's decoded window and the eager path it replaces (optimized reads)
    encoded = [v for v in stats.variants if not v.startswith("plain")]
    assert {v.endswith(" eager") for v in encoded} == {True, False}
    # Byte-limited pools: appends were refused alike, with nothing changed.
    assert stats.checks["exhaustion refused"] > 0, dict(stats.checks)


class ForgetsTheTailBlock(opt.PagedLatentCache):
    """A rollback that trims each row's table but keeps its emptied tail block: the next
    append writes past it (a read then shows the stale block)."""

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        return None  # MUTATION: the emptied tail blocks are never released


def test_the_paged_latent_machine_catches_a_leaky_rollback() -> None:
    caught("PagedLatentCache", ForgetsTheTailBlock, 12, family_name=FAMILY.name)


class KeepsTheWindowThroughRaggedRollbacks(opt.PagedLatentCache):
    """A window kept through every rollback, as it may be through one of equal counts: a
    ragged rollback moves the rows' columns (each right-justified to the longest), and the
    window's columns go stale."""

    def _trim_rows(self, counts: Sequence[int], *, justify: bool = False) -> int:
        kept = self._dense_window
        trimmed = super()._trim_rows(counts, justify=justify)
        self._dense_window = kept  # MUTATION: whatever the counts
        return trimmed


def test_the_paged_latent_machine_catches_a_stale_window() -> None:
    caught("PagedLatentCache", KeepsTheWindowThroughRaggedRollbacks, 12, family_name=FAMILY.name)
