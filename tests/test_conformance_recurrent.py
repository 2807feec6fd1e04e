"""The recurrent family's conformance machine (``kvrows.conformance.recurrent``).

``BatchedSSMCache`` (the layout of ``SSMCache``'s rows in all three roles) runs its machine
under the selected profile, scaled by the family's example budget: requests prefilled by a
gated DeltaNet layer or a toy layer over 1 to 4 planes of ranks 2 to 4, merged, joined,
stepped (decode, blocks, right-padded runs), filtered, extracted, published, verified in
rounds (commit, uniform and unequal rollback), saved, leased and loaded across
implementations (``machines.OpsChecks``), against the reference, a solo replay per row and
mlx-lm's ``ArraysCache``. The tests check that nothing was skipped
silently: every operation, every oracle, every compared quantity, every activation dtype,
every layer and plane count, and the bad inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from conformance_helpers import OPS_CHECKED, assert_compared, run_family
from hypothesis.stateful import run_state_machine_as_test

from kvrows.conformance.families import FAMILIES, optimized_impl
from kvrows.conformance.machines import OpsChecks, WriterRules, machine_class
from kvrows.conformance.recurrent import RECURRENT_CHECKS, RecurrentMachine
from kvrows.conformance.runner import family_settings
from kvrows.optimized.recurrent import BatchedSSMCache

FAMILY = FAMILIES["recurrent"]

EXPECTED_OPS = {
    "new_request",
    "prefill_chunk",
    "merge",
    "join",
    "decode_step",
    "multi_step",
    "padded_step",
    "filter",
    "filter:longest left",
    "extract",
    "publish",
    "publish:cut refused",
    "spec_rounds",
    "round:commit",
    "round:unequal",
    "state",
    "invalid",
    "invalid:trim",
    # the layers: gated DeltaNet, and the toy layer over 1 to 4 planes of ranks 2 to 4
    "layer:gated delta",
    *(f"layer:{n} planes" for n in (1, 2, 3, 4)),
    *(f"plane rank {r}" for r in (2, 3, 4)),
    # leases and save/load across implementations (``machines.OpsChecks``' cadence)
    *OPS_CHECKED,
}

pytestmark = pytest.mark.usefixtures("cpu_stream")


#: The CI profile's examples (drawn from the machine's own seed,
#: ``profiles.machine_seed``) first compare the recurrent state plane past 60 (the
#: family's budget is 30; examples also draw the toy layer's planes, and a layer of other
#: shapes has no plane of that name); 80 reach every requirement: about 3 s on one core.
CI_EXAMPLES = 80


def test_recurrent_family() -> None:
    stats, settings = run_family(FAMILY, "BatchedSSMCache", ci_examples=CI_EXAMPLES)
    oracles = (*RECURRENT_CHECKS, "leases", "save_load across implementations")
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS, oracles=oracles)
    states = ("state.conv", "state.recurrent", "state.solo", "state.mlx_lm")
    assert_compared(stats, {*states, "output", "output.solo"})
    assert set(stats.variants) == {"bfloat16", "float16", "float32"}, dict(stats.variants)
    assert not stats.skips, dict(stats.skips)
    # No hard state of spec/contract.md §0.11 applies: a recurrent state has no token
    # axis, so ``trim``/``trim_rows`` are refused ("invalid:trim", required above) and no
    # trim builder (``_build_uneven``, a ring's fill) has a row to cut; a row gives tokens
    # back only through a verify round's rollback, whose per-row form (rows replaying
    # unequal counts, "round:unequal") is the uneven trim's equivalent and is required.


def test_the_family_drives_both_recurrent_classes() -> None:
    assert [spec.name for spec in FAMILY.layouts] == ["BatchedSSMCache"]
    spec = FAMILY.layout("BatchedSSMCache")
    assert spec.roles == ("decode", "prefill", "verify") and spec.serial == "SSMCache"
    assert FAMILY.machine is not None
    # the recurrent writer's rules, then the operation checks (their hooks the writer's)
    assert FAMILY.machine().__mro__[1:4] == (RecurrentMachine, WriterRules, OpsChecks)


# -- teeth: planted bugs in the optimized layout are caught ------------------------------


class _NoReplay(BatchedSSMCache):
    """Rollback restores the snapshot and moves the positions, but replays nothing."""

    def _spec_replay(self, replay: Any, inputs: tuple[Any, ...], keep: list[int]) -> None:
        self._offsets = [o + k for o, k in zip(self._offsets, keep, strict=True)]


class _PublishesCutRows(BatchedSSMCache):
    """A row publishes at any coverage it has reached."""

    def can_publish_row(self, row: int, tokens: int) -> bool:
        return self[0] is not None and self.row_offsets[row] >= tokens


class _FilterKeepsOrder(BatchedSSMCache):
    """Filter keeps the named rows in ascending order, not the order asked."""

    def filter_rows(self, keep: Sequence[int]) -> None:
        super().filter_rows(sorted(keep))


class _FilterMovesTwoPlanes(BatchedSSMCache):
    """Filter moves the rows of the first two planes only (a two-plane machinery's bug):
    planes 2 and 3 keep the rows they had."""

    def filter_rows(self, keep: Sequence[int]) -> None:
        later = {t: p for t, p in (self._planes or {}).items() if t not in ("state.0", "state.1")}
        super().filter_rows(keep)
        if keep and self._planes is not None:
            self._planes = {**self._planes, **later}


#: The teeth profile's 12 examples reorder no filter the mutant sorts: 40 do (about 1 s);
#: a filter changing the rows of a 3- or 4-plane layer takes 60 (about 1 s).
@pytest.mark.parametrize(
    ("mutant", "examples"),
    [
        (_NoReplay, None),
        (_PublishesCutRows, None),
        (_FilterKeepsOrder, 40),
        (_FilterMovesTwoPlanes, 60),
    ],
)
def test_the_machine_catches_planted_bugs(
    mutant: type[BatchedSSMCache], examples: int | None
) -> None:
    impl = optimized_impl().with_classes({"BatchedSSMCache": mutant}, name=mutant.__name__)
    machine = machine_class(
        FAMILY,
        "BatchedSSMCache",
        optimized=impl,
        name=f"Teeth{mutant.__name__}",
        profile="teeth",
    )
    settings = family_settings(FAMILY, "teeth")
    if examples is not None:
        settings = family_settings(FAMILY, "teeth", max_examples=examples)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=settings)
