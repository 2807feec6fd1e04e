"""Issue 24, "strategies that reach the hard states": a planted bug that shows only in
one hard state is caught by the CI profile's machine of a family that requires that
state (``Stats.require(states=...)``): the machine runs with the CI profile's settings
and the layout's own seed (``profiles.machine_seed``: the very examples of the family's
CI test), without shrinking, and must fail with an oracle's ``AssertionError``. The
bugs (marked ``# MUTATION``), one per class:

* an uneven trim: equal rows trimmed unequally are all trimmed by the largest count
  (``KvRules.trim_rows``'s ``uneven`` branch, ``UNEVEN_TRIM``);
* a full ring row: a row holding exactly ``max_size`` is taken for one past its window,
  its rollback refused (``RingRules._build_fill``, ``FULL_RING_ROLLBACK``);
* a rollback past the window accepted as a no-op instead of refused
  (``RING_TRIM_REFUSED``);
* block-table gaps: a read takes a row's blocks as one run from its first held block
  (``PagedRules``, ``BLOCK_TABLE_GAPS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from conformance_helpers import run_family
from hypothesis import Phase, settings

import kvrows.optimized.paging as optimized_paging
from kvrows.conformance.families import FAMILIES, Impl, optimized_impl
from kvrows.conformance.runner import family_settings
from kvrows.errors import NotTrimmableError, wrapped_ring_message
from kvrows.optimized.classes import BatchedKVCache, RaggedRotatingRows
from kvrows.paged import FREE

pytestmark = pytest.mark.usefixtures("cpu_stream")


def caught_in_ci(
    family: str, layout: str, optimized: Impl, name: str, examples: int | None = None
) -> str:
    """Run ``family``'s CI machine of ``layout`` (its CI examples, or ``examples`` where
    its test runs more) on ``optimized``: an oracle must fail; its message."""
    fam = FAMILIES[family]
    base = family_settings(fam, "ci", **({} if examples is None else {"max_examples": examples}))
    no_shrink = settings(base, phases=[Phase.explicit, Phase.reuse, Phase.generate])
    with pytest.raises(AssertionError) as failure:
        run_family(fam, layout, no_shrink, optimized=optimized, name=name, profile="ci")
    assert "Failing test case" in "\n".join(getattr(failure.value, "__notes__", []))
    return str(failure.value)


class UnevenTrimTakesTheLargest(BatchedKVCache):
    """Rows of equal length trimmed by unequal counts all forget the largest count (as if
    the layout shared one column): wrong only in ``UNEVEN_TRIM``."""

    def trim_rows(self, counts: Sequence[int]) -> int:
        offsets = self.row_offsets
        if len(set(offsets)) == 1 and len(set(counts)) > 1:
            counts = [max(counts)] * len(counts)  # MUTATION (each row forgets its own count)
        return super().trim_rows(counts)


def test_an_uneven_trim_bug_is_caught() -> None:
    mutant = optimized_impl().with_classes({"BatchedKVCache": UnevenTrimTakesTheLargest})
    message = caught_in_ci("plain", "BatchedKVCache", mutant, "TeethStatesUnevenTrim")
    assert "trim_rows" in message or "offset" in message, message


class FullRingRowRefusesItsRollback(RaggedRotatingRows):
    """A row holding exactly ``max_size`` tokens is taken for one past its window (the
    serial ring's ``is_trimmable``), so its rollback is refused though it holds every
    token: wrong only in ``FULL_RING_ROLLBACK``."""

    def trim_rows(self, counts: Sequence[int]) -> int:
        for count, offset in zip(counts, self.row_offsets, strict=False):
            if count and offset == self.max_size:
                # MUTATION (the rule is retained - count >= min(offset - count, max_size))
                raise NotTrimmableError(wrapped_ring_message("row", self.max_size))
        return super().trim_rows(counts)


class RingRollbackPastTheWindowAccepted(RaggedRotatingRows):
    """A rollback past a wrapped row's window is accepted as a no-op instead of refused:
    wrong only in ``RING_TRIM_REFUSED``."""

    def trim_rows(self, counts: Sequence[int]) -> int:
        try:
            return super().trim_rows(counts)
        except NotTrimmableError:
            return max(counts)  # MUTATION (a ring cannot give back what it overwrote)


@pytest.mark.parametrize(
    "mutant",
    [FullRingRowRefusesItsRollback, RingRollbackPastTheWindowAccepted],
    ids=["full-ring-row", "ring-trim-refused"],
)
def test_a_ring_fill_and_rollback_bug_is_caught(mutant: type) -> None:
    optimized = optimized_impl().with_classes({"RaggedRotatingRows": mutant})
    caught_in_ci("rotating", "RaggedRotatingRows", optimized, f"TeethStates{mutant.__name__}")


_GATHER_RUNS = optimized_paging.gather_runs


def gather_one_run(
    planes: Any, rows: Sequence[tuple[Sequence[int], Any]], *args: Any, **kwargs: Any
) -> Any:
    """Reads each row's blocks as one run from its first held block (``FREE`` entries
    kept): right for a table without gaps, wrong for one with them."""
    runs, pool = [], int(planes[0].shape[0])
    for blocks, spans in rows:
        held = [j for j, block in enumerate(blocks) if block != FREE]
        first = held[0] if held else 0
        # MUTATION (a table's blocks are where it says, not one run from its first)
        one_run = [
            b if b == FREE else (blocks[first] + j - first) % pool for j, b in enumerate(blocks)
        ]
        runs.append((one_run, spans))
    return _GATHER_RUNS(planes, runs, *args, **kwargs)


@pytest.mark.parametrize(("family", "examples"), [("paged", 40), ("paged-rotating", None)])
def test_a_block_table_gap_bug_is_caught(
    monkeypatch: pytest.MonkeyPatch, family: str, examples: int | None
) -> None:
    monkeypatch.setattr(optimized_paging, "gather_runs", gather_one_run)
    layout = FAMILIES[family].layouts[0].name
    name = f"TeethStatesGaps{family.title().replace('-', '')}"
    caught_in_ci(family, layout, optimized_impl(), name, examples)


def uneven_trim_takes_the_largest(base: Any) -> type:
    """``base`` (a writer's layout) whose rows of equal length trimmed by unequal counts
    all forget the largest count: wrong only in ``UNEVEN_TRIM``."""

    def trim_rows(self: Any, counts: Sequence[int]) -> int:
        if len(set(self.row_offsets)) == 1 and len(set(counts)) > 1:
            counts = [max(counts)] * len(counts)  # MUTATION (each row forgets its own count)
        return int(base.trim_rows(self, counts))

    return type(f"UnevenTrimTakesTheLargest{base.__name__}", (base,), {"trim_rows": trim_rows})


@pytest.mark.parametrize(
    ("family", "layout", "examples"),
    [
        ("delayed", "DelayedQuantizedKVCache", None),
        ("delayed-turbo", "DelayedTurboQuantKVCache", 40),
        ("latent", "MLACache", None),
        ("latent", "EncodedLatentCache", None),
        ("paged-latent", "PagedLatentCache", None),
    ],
)
def test_an_uneven_trim_bug_is_caught_in_the_writers(
    family: str, layout: str, examples: int | None
) -> None:
    """The delayed and latent writers reach ``UNEVEN_TRIM`` through the shared builder
    (``machines._build_uneven``): their CI machines catch the uneven-trim bug too."""
    impl = optimized_impl()
    mutant = uneven_trim_takes_the_largest(impl.cls(layout))
    optimized = impl.with_classes({layout: mutant})
    caught_in_ci(family, layout, optimized, f"TeethStates{mutant.__name__}", examples)


def test_a_paged_latent_hit_of_one_block_too_many_is_caught() -> None:
    """The paged-latent machine drives prefix hits (``WHOLE_BLOCK_HIT``): a pool whose
    lookups adopt one block more than the cached run is caught."""
    impl = optimized_impl()
    layout: Any = impl.cls("PagedLatentCache")

    class HitAdoptsOneBlockTooMany(layout.pool_class):  # type: ignore[misc]
        def prefix_blocks(self, ids: Sequence[int], token_geometry: Any = None) -> list[int]:
            hits: list[int] = super().prefix_blocks(ids, token_geometry)
            return [*hits, hits[-1]] if hits else hits  # MUTATION (one block past the run)

    mutant = type(
        "PagedLatentHitOfOneBlockTooMany", (layout,), {"pool_class": HitAdoptsOneBlockTooMany}
    )
    optimized = impl.with_classes({"PagedLatentCache": mutant})
    caught_in_ci("paged-latent", "PagedLatentCache", optimized, f"TeethStates{mutant.__name__}")


def full_ring_row_refuses_its_rollback(base: Any) -> type:
    """``base`` (a ring layout) as :class:`FullRingRowRefusesItsRollback`: wrong only in
    ``FULL_RING_ROLLBACK``."""

    def trim_rows(self: Any, counts: Sequence[int]) -> int:
        for count, offset in zip(counts, self.row_offsets, strict=False):
            if count and offset == self.max_size:
                # MUTATION (the rule is retained - count >= min(offset - count, max_size))
                raise NotTrimmableError(wrapped_ring_message("row", self.max_size))
        return int(base.trim_rows(self, counts))

    return type(f"FullRingRowRefuses{base.__name__}", (base,), {"trim_rows": trim_rows})


def ring_rollback_past_the_window_accepted(base: Any) -> type:
    """``base`` (a ring layout) as :class:`RingRollbackPastTheWindowAccepted`: wrong only
    in ``RING_TRIM_REFUSED``."""

    def trim_rows(self: Any, counts: Sequence[int]) -> int:
        try:
            return int(base.trim_rows(self, counts))
        except NotTrimmableError:
            return max(counts)  # MUTATION (a ring cannot give back what it overwrote)

    return type(f"RingRollbackAccepted{base.__name__}", (base,), {"trim_rows": trim_rows})


@pytest.mark.parametrize(
    "make", [full_ring_row_refuses_its_rollback, ring_rollback_past_the_window_accepted]
)
def test_a_ring_fill_and_rollback_bug_is_caught_in_the_delayed_ring(make: Any) -> None:
    """The delayed ring reaches the ring states through the shared builder
    (``machines._build_fill``): its CI machine catches both ring bugs too."""
    impl = optimized_impl()
    layout = "DelayedRotatingQuantizedKVCache"
    mutant = make(impl.cls(layout))
    optimized = impl.with_classes({layout: mutant})
    caught_in_ci("delayed", layout, optimized, f"TeethStates{mutant.__name__}")
