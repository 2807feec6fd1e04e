"""Proposal rounds (``kvrows.speculative``: ``spec_round_propose`` / ``spec_round_discard``):
a draft model's single-token proposals on its own verify layouts, every column kept while
the round is open, all forgotten by the discard (``spec/speculative.md`` §9)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.conformance.arrays import as_numpy
from kvrows.errors import SpeculativeRoundError

WINDOW = 4


def _block(position: int, rows: int, offsets: list[int] | None = None) -> np.ndarray:
    """Row ``b``'s key and value at ``offsets[b] + position``: ``1000 * b + that``."""
    starts = offsets or [0] * rows
    tags = np.array([1000.0 * b + starts[b] + position for b in range(rows)], np.float32)
    return np.broadcast_to(tags.reshape(rows, 1, 1, 1), (rows, 1, 1, 8)).copy()


def _layout(package: ModuleType, lengths: list[int], *, paged: bool = False) -> Any:
    """A ring verify layout of rows holding ``lengths`` tokens (windows of ``WINDOW``;
    ``paged``: block-table rows of 2-token blocks)."""
    serial = []
    for b, length in enumerate(lengths):
        ring = (
            package.PagedRotatingKVCache(WINDOW, block_size=2)
            if paged
            else package.RotatingKVCache(WINDOW)
        )
        for p in range(length):
            x = _block(p, 1) + 1000.0 * b
            ring.update_and_fetch(_native(package, x), _native(package, x))
        serial.append(ring)
    layout = (
        package.PagedRotatingRows(WINDOW, block_size=2)
        if paged
        else package.SpeculativeRotatingKVCache(WINDOW)
    )
    layout.merge_rows(serial)
    return layout


def _native(package: ModuleType, array: np.ndarray) -> Any:
    if package is opt:
        import mlx.core as mx

        return mx.array(array)
    return array


def _windows(layout: Any) -> list[list[int]]:
    held = [layout.row_window(b) for b in range(layout.batch_size)]
    return [[int(v) for v in as_numpy(h[0][0])[0, 0, :, 0]] for h in held]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
def test_a_ring_holds_its_proposals_and_the_discard_restores_every_window(
    package: ModuleType, paged: bool
) -> None:
    lengths = [9, 5]  # both rows past their window: a single token would evict
    layout = _layout(package, lengths, paged=paged)
    tables = layout.block_tables() if paged else None
    windows = _windows(layout)
    assert windows == [[5, 6, 7, 8], [1001, 1002, 1003, 1004]]
    assert layout.holds_proposals
    layout.spec_round_propose()
    for i in range(3):
        mask = as_numpy(layout.make_mask(1, return_array=True))
        x = _block(i, 2, lengths)
        keys, _ = layout.update_and_fetch(_native(package, x), _native(package, x))
        seen = [
            sorted(
                int(v) for v, m in zip(as_numpy(keys)[b, 0, :, 0], mask[b, 0, 0], strict=True) if m
            )
            for b in range(2)
        ]
        # Each proposal sees its own window: the newest WINDOW positions, itself included.
        assert seen == [
            [1000 * b + p for p in range(lengths[b] + i + 1 - WINDOW, lengths[b] + i + 1)]
            for b in range(2)
        ]
        if paged:  # nothing dropped: no block left a window
            held = [[t for t in table if t >= 0] for table in layout.block_tables()]
            # (the blocks of positions ``length - WINDOW .. length + i``)
            assert [len(h) for h in held] == [(n + i) // 2 - (n - WINDOW) // 2 + 1 for n in lengths]
    if not paged:
        assert layout.retained == (WINDOW + 3, WINDOW + 3)  # nothing dropped
    layout.spec_round_discard()
    assert not layout.spec_round_open
    assert layout.row_offsets == tuple(lengths)
    assert _windows(layout) == windows
    if paged:  # each row's table is as it was (the proposals' blocks went back)
        assert layout.block_tables() == tables


@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
def test_a_proposal_round_ends_only_with_a_discard(package: ModuleType) -> None:
    layout = _layout(package, [6, 6])
    with pytest.raises(SpeculativeRoundError, match="without spec_round_propose"):
        layout.spec_round_discard()
    layout.spec_round_propose()
    with pytest.raises(SpeculativeRoundError, match="already open"):
        layout.spec_round_begin()
    x = _block(0, 2, [6, 6])
    layout.update_and_fetch(_native(package, x), _native(package, x))
    for end in (layout.spec_round_commit, lambda: layout.spec_round_rollback(1)):
        with pytest.raises(SpeculativeRoundError, match="spec_round_discard"):
            end()
    assert layout.spec_round_open
    layout.spec_round_discard()
    assert layout.row_offsets == (6, 6)


@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
def test_a_layout_that_cannot_hold_proposals_refuses_unchanged(package: ModuleType) -> None:
    layout = package.PagedChunkedRows(WINDOW, block_size=2)
    serial = package.PagedChunkedKVCache(WINDOW, block_size=2)
    x = _block(0, 1)
    serial.update_and_fetch(_native(package, x), _native(package, x))
    layout.merge_rows([serial])
    assert not layout.holds_proposals
    with pytest.raises(SpeculativeRoundError, match="cannot hold a proposal round"):
        layout.spec_round_propose()
    assert not layout.spec_round_open


@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
def test_an_exhausted_pool_refuses_a_proposal_and_the_round_discards(package: ModuleType) -> None:
    """A held paged ring keeps every block its proposals take (none leaves a window), so
    a small pool runs out inside the round: the append refuses with ``PoolExhaustedError``
    before anything changes, the round stays open, and the discard gives every row its
    window back."""
    from kvrows.errors import PoolExhaustedError

    pool = package.BlockPool(block_size=2, max_bytes=8 * 2 * 2 * 8 * 4 * 2)  # 8 blocks
    serial = []
    for b in range(2):
        ring = package.PagedRotatingKVCache(WINDOW, block_size=2, pool=pool)
        for p in range(7):  # one token at a time: each write gives back what left
            x = _block(p, 1) + 1000.0 * b
            x = np.broadcast_to(x, (1, 2, 1, 8)).copy()
            ring.update_and_fetch(_native(package, x), _native(package, x))
        serial.append(ring)
    layout = package.PagedRotatingRows(WINDOW, block_size=2, pool=pool)
    layout.merge_rows(serial)
    for ring in serial:
        ring.release()
    windows = _windows(layout)
    layout.spec_round_propose()
    refused = None
    for i in range(4):
        x = np.broadcast_to(_block(i, 2, [7, 7]), (2, 2, 1, 8)).copy()
        before = (layout.row_offsets, layout.block_tables())
        try:
            layout.update_and_fetch(_native(package, x), _native(package, x))
        except PoolExhaustedError as error:
            refused = error
            assert (layout.row_offsets, layout.block_tables()) == before
            break
    assert refused is not None and layout.spec_round_open
    layout.spec_round_discard()
    assert layout.row_offsets == (7, 7)
    assert _windows(layout) == windows
