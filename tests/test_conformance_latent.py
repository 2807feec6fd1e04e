"""The latent family's conformance machine (``kvrows.conformance.latent``).

``MLACache`` and ``EncodedLatentCache`` run their machine under the selected profile,
scaled by the family's example budget: requests prefilled, merged, stepped, verified in
rounds with per-row acceptance, filtered, extracted and trimmed, against the reference,
a solo replay per row and (``MLACache``) mlx-lm's ``KVCache`` / ``BatchKVCache`` pairs;
bad inputs raise the same error in both implementations and change nothing. The test
checks that nothing was skipped silently: every operation, oracle and case the family
exists for was reached.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import mlx.core as mx
import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import kvrows.optimized as opt
from kvrows.conformance.families import FAMILIES, optimized_impl
from kvrows.conformance.latent import LATENT_CHECKS
from kvrows.conformance.machines import machine_class
from kvrows.conformance.profiles import profile_settings
from kvrows.conformance.runner import family_settings
from kvrows.conformance.stats import Stats
from kvrows.conversion import Conversion

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
    "invalid",
    "bad:dsa mismatch",
}


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


@pytest.mark.parametrize("layout", LAYOUTS)
def test_latent_family(layout: str) -> None:
    stats = Stats(FAMILY.name, layout)
    cls = machine_class(FAMILY, layout, stats=stats)
    run_state_machine_as_test(cls, settings=family_settings(FAMILY))
    assert stats.examples > 0
    missing_ops = EXPECTED_OPS - set(stats.ops)
    assert not missing_ops, f"operations never exercised: {sorted(missing_ops)}"
    missing = set(LATENT_CHECKS) - set(stats.checks)
    assert not missing, f"oracles never reached: {sorted(missing)}"
    if layout == "MLACache":
        assert stats.checks["mlx-lm"] > 0
        assert stats.checks["mlx-lm rollback rebuild"] > 0
    assert any("dsa=True" in v for v in stats.variants)
    assert any("dsa=False" in v for v in stats.variants)
    if layout == "EncodedLatentCache":
        assert stats.checks["mixed conversion"] > 0
        assert {v.split()[0].split(":")[0] for v in stats.variants} == {"affine", "turbo"}


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


@pytest.mark.parametrize(
    ("layout", "mutant"),
    [("MLACache", RollbackCutsTheShortestCount), ("EncodedLatentCache", ConvertsBeforeStart)],
)
def test_the_latent_machine_catches(layout: str, mutant: type) -> None:
    stats = Stats(FAMILY.name, layout)
    optimized = optimized_impl().with_classes({layout: mutant})
    machine = machine_class(
        FAMILY,
        layout,
        stats=stats,
        optimized=optimized,
        name=f"Teeth{mutant.__name__}",
        profile="teeth",
    )
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(
            machine, settings=settings(profile_settings("teeth"), max_examples=12)
        )
    assert "Failing test case" in "\n".join(getattr(caught.value, "__notes__", []))
