"""The paged-latent family's conformance machine (``kvrows.conformance.paged_latent``).

``PagedLatentCache`` runs the latent machine with every row in one block pool per
implementation: against the reference, a reference ``MLACache`` per row (the oracle) and
mlx-lm's ``KVCache`` / ``BatchKVCache`` pairs, the pool's invariants after every rule; bad
inputs raise the same error in both implementations and change nothing; pools limited
at random points refuse alike and change nothing. The test checks that nothing was
skipped silently.
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
    "invalid",
    "bad:dsa mismatch",
    "bad:other block size",
}


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


def test_paged_latent_family() -> None:
    stats = Stats(FAMILY.name, "PagedLatentCache")
    cls = machine_class(FAMILY, "PagedLatentCache", stats=stats)
    run_state_machine_as_test(cls, settings=family_settings(FAMILY))
    assert stats.examples > 0
    missing_ops = EXPECTED_OPS - set(stats.ops)
    assert not missing_ops, f"operations never exercised: {sorted(missing_ops)}"
    oracles = {*LATENT_CHECKS, "MLACache oracle", "pool invariants", "mlx-lm"}
    missing = oracles - set(stats.checks)
    assert not missing, f"oracles never reached: {sorted(missing)}"
    assert any("dsa=True" in v for v in stats.variants)
    assert any("dsa=False" in v for v in stats.variants)
    assert {v.split()[0].split(":")[0] for v in stats.variants} == {"plain", "affine", "turbo"}
    assert stats.checks["mixed conversion"] > 0
    # Byte-limited pools: appends were refused alike, with nothing changed.
    assert stats.checks["exhaustion refused"] > 0, dict(stats.checks)


class ForgetsTheTailBlock(opt.PagedLatentCache):
    """A rollback that trims each row's table but keeps its emptied tail block: the next
    append writes past it (a read then shows the stale block)."""

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        return None  # MUTATION: the emptied tail blocks are never released


def test_the_paged_latent_machine_catches_a_leaky_rollback() -> None:
    stats = Stats(FAMILY.name, "PagedLatentCache")
    optimized = optimized_impl().with_classes({"PagedLatentCache": ForgetsTheTailBlock})
    machine = machine_class(
        FAMILY, "PagedLatentCache", stats=stats, optimized=optimized,
        name="TeethForgetsTheTailBlock", profile="teeth",
    )  # fmt: skip
    with pytest.raises(AssertionError) as caught:
        run_state_machine_as_test(
            machine, settings=settings(profile_settings("teeth"), max_examples=12)
        )
    assert "Failing test case" in "\n".join(getattr(caught.value, "__notes__", []))
