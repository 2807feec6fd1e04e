"""The block pools' conformance helpers, shared by the paged placement's rules
(``rules.PagedRules``) and the paged latent machine (``paged_latent``): a pool's
accounting, the garbage-collector discipline of examples with byte-limited pools, and
the byte limits themselves (see ``rules.PagedRules`` for what the machines check).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = [
    "HEADROOMS",
    "FrozenCollector",
    "accounting",
    "byte_limited",
    "collector_paused",
    "held_blocks",
    "hit_accounting_problem",
]

#: Blocks a pool may grow by while an operation runs at its byte limit (0: none), and
#: ``None``: an example without a limit.
HEADROOMS = (0, 1, 2, None)


def accounting(pool: Any) -> tuple[Any, ...]:
    """Everything a refused operation must leave as it was in a pool."""
    ledger = pool.ledger
    return (
        repr(pool.geometry), ledger.num_blocks, ledger.free_order(), ledger.held_count,
        tuple(ledger.ref(b) for b in range(ledger.num_blocks)), ledger.cached_count,
        len(pool.live_tables()), pool.bytes_written, pool.bytes_copied,
    )  # fmt: skip


def held_blocks(pool: Any) -> tuple[Any, ...]:
    """What a pool lends (each referenced block's count, the live tables): caches loaded
    into it and released give back what they took. (Not what it keeps: their writes may
    take a free block the prefix cache kept, and blocks it grew stay free.)"""
    ledger = pool.ledger
    refs = tuple((b, ledger.ref(b)) for b in range(ledger.num_blocks) if ledger.ref(b))
    return refs, len(pool.live_tables())


def hit_accounting_problem(pool: Any, blocks: Sequence[int], before: tuple[Any, ...]) -> str | None:
    """What is wrong with ``pool``'s accounting after a prefix hit that shares ``blocks``
    (``before``: its :func:`accounting` ahead of the lookup): each hit block referenced
    once more, nothing written or copied (``None``: nothing)."""
    counts = list(before[4])
    for block in blocks:
        counts[block] += 1
    after = accounting(pool)
    if list(after[4]) != counts:
        return f"each hit block referenced once more: got {list(after[4])}, expected {counts}"
    if after[7:] != before[7:]:
        return f"nothing written or copied: got {after[7:]}, expected {before[7:]}"
    return None


class FrozenCollector:
    """A paged machine's garbage-collector discipline (mixed in before the machine class).

    An example with a byte limit leaves every object alive at its start out of later
    collections (:meth:`_freeze_collector`; thawed at teardown), so that the collection
    before each limited operation (:func:`collector_paused`) scans only the example's own
    objects. It collects the young generations first, not the whole heap (0.2 s with the
    test session's objects): older garbage is an earlier example's, holding blocks of that
    example's pools only, and is collected once thawed."""

    _frozen = False

    def _freeze_collector(self, limited: bool) -> None:
        if limited:
            gc.collect(1)
            gc.freeze()
            self._frozen = True

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[misc]  # the machine class after this mixin
        finally:
            if self._frozen:
                gc.unfreeze()
                self._frozen = False


@contextmanager
def collector_paused(collect: bool = True) -> Iterator[None]:
    """Collect now (unless ``collect`` is false), then keep the collector off for the block:
    whether a pool runs out never depends on when the collector gives back an unreachable
    cache's blocks (a collected cache's finalizer would release them in between), and a
    pool's invariants are checked on one state (no finalizer releases tables mid-check)."""
    if collect:
        gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextmanager
def byte_limited(
    pools: Sequence[Any], headroom: int, block_bytes: Callable[[Any], int]
) -> Iterator[None]:
    """Each pool may hold ``headroom`` blocks more than it holds now (a pool without
    geometry: ``headroom`` blocks of ``block_bytes(pool)`` bytes in all) until the block
    exits; the machines' pools have no byte limit otherwise."""
    for pool in pools:
        assert pool.max_bytes is None and pool.ledger.max_blocks is None
        if pool.geometry is None:  # it learns its limit from max_bytes with its geometry
            pool.max_bytes = headroom * block_bytes(pool)
        else:
            pool.ledger.max_blocks = pool.num_blocks + headroom
            pool.max_bytes = pool.ledger.max_blocks * pool.bytes_per_block
    try:
        yield
    finally:
        for pool in pools:
            pool.max_bytes = pool.ledger.max_blocks = None
