"""The latent family's conformance machine (``kvrows.conformance.latent``).

``MLACache`` and ``EncodedLatentCache`` run their machine under the selected profile,
scaled by the family's example budget: requests prefilled, merged, stepped, verified in
rounds with per-row acceptance, filtered, extracted and trimmed, leased, saved and loaded
across implementations (``machines.OpsChecks``), against the reference,
a solo replay per row and (``MLACache``) mlx-lm's ``KVCache`` / ``BatchKVCache`` pairs;
bad inputs raise the same error in both implementations and change nothing. The test
checks that nothing was skipped silently: every operation, oracle and case the family
exists for was reached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from conformance_helpers import OPS_CHECKED, caught, run_family

import kvrows.optimized as opt
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.latent import LATENT_CHECKS
from kvrows.conformance.machines import UNEVEN_TRIM
from kvrows.conversion import Conversion
from kvrows.optimized.rows import Layout, Storage

FAMILY = FAMILIES["latent"]
LAYOUTS = [spec.name for spec in FAMILY.layouts]

EXPECTED_OPS = {
    "new_request",
    "prefill_chunk",
    "merge",
    "join",
    "decode_step",
    "spec_rounds",
    "round:unequal",
    "filter",
    "extract",
    "trim",
    "trim_rows",
    "trim_rows:uneven",
    "invalid",
    "bad:dsa mismatch",
    # leases and save/load across implementations (``machines.OpsChecks``' cadence)
    *OPS_CHECKED,
}


pytestmark = pytest.mark.usefixtures("cpu_stream")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_latent_family(layout: str) -> None:
    stats, _ = run_family(FAMILY, layout)
    assert stats.examples > 0
    missing_ops = EXPECTED_OPS - set(stats.ops)
    assert not missing_ops, f"operations never exercised: {sorted(missing_ops)}"
    missing = {*LATENT_CHECKS, "leases", "save_load across implementations"} - set(stats.checks)
    assert not missing, f"oracles never reached: {sorted(missing)}"
    stats.require(0, states=(UNEVEN_TRIM,))  # equal rows trimmed unequally, then a step
    if layout == "MLACache":
        assert stats.checks["mlx-lm"] > 0
        assert stats.checks["mlx-lm rollback rebuild"] > 0
    assert any("dsa=True" in v for v in stats.variants)
    assert any("dsa=False" in v for v in stats.variants)
    if layout == "EncodedLatentCache":
        assert stats.checks["mixed conversion"] > 0
        kinds = {v.split()[0].split(":")[0] for v in stats.variants}
        assert kinds == {"affine", "turbo", "mxfp4", "nvfp4"}  # every codec family drawn
        # the decoded window and the eager path it replaces (the optimized class's reads)
        assert {v.endswith(" eager") for v in stats.variants} == {True, False}


# -- teeth: planted bugs the machine must catch ------------------------------------------


class RollbackCutsTheShortestCount(opt.MLACache):
    """A ragged rollback that forgets the smallest rejected count on every row: the rows
    that rejected more keep rejected tokens."""

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        super()._forget([min(counts)] * len(counts), justify=justify)  # MUTATION


class ConversionIgnoringStart(Conversion):
    def row_due(self, offset: int) -> bool:
        return offset != 0  # MUTATION


class ConvertsBeforeStart(opt.EncodedLatentCache):
    """Reads a row's latent decoded from its first append on, whatever ``start`` says."""

    conversion_class = ConversionIgnoringStart


class KeepsAStaleWindow(opt.EncodedLatentCache):
    """A decoded window that row operations do not drop and a join does not bring up to
    date: a join written into a spare slot in place (the codes plane the same array)
    reads the window's stale columns there."""

    def _changed(self) -> None:
        Storage._changed(self)  # MUTATION: the window is kept

    def _join(self, *args: Any) -> None:
        Layout._join(self, *args)  # MUTATION: ... and not brought up to date


@pytest.mark.parametrize(
    ("layout", "mutant"),
    [
        ("MLACache", RollbackCutsTheShortestCount),
        ("EncodedLatentCache", ConvertsBeforeStart),
        ("EncodedLatentCache", KeepsAStaleWindow),
    ],
)
def test_the_latent_machine_catches(layout: str, mutant: type) -> None:
    caught(layout, mutant, 12, family_name=FAMILY.name)
