"""The drop-in ``BatchKVCache`` / ``BatchRotatingKVCache`` in mlx-lm's physical columns.

mlx-lm's own tests observe its batch classes' columns: ``left_padding``, ``offset``, the
width of ``keys`` / ``state``, ``size()`` and the masks. Each test here drives kvrows'
drop-in and mlx-lm's class (the oracle) with the same blocks, tokens named by their key
(channel 0 holds the token id, pads are negative) and compares, at every step, those
members and the keys in every column some query's mask shows (where attention reads;
hidden pad columns may hold other bytes). The one place kvrows departs is mlx-lm's B9
(a block after the ring wrapped hides a real token): there the oracle is the row's own
window (``spec/mlx-lm-batch-api.md`` §3.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import numpy as np
import pytest

import kvrows.optimized as kv
from kvrows.errors import InvalidInputError

peer: Any = mlx_lm_cache  # untyped


pytestmark = pytest.mark.usefixtures("cpu_stream")


def block(ids: Sequence[Sequence[float]]) -> mx.array:
    """``[B, 1, n, 2]``: channel 0 is the token id, channel 1 its double."""
    ids_array = mx.array([list(r) for r in ids], dtype=mx.float32)[:, None, :, None]
    return mx.concatenate([ids_array, 2 * ids_array], axis=3)


class Ids:
    """Fresh token ids; pads are negative so a visible pad would show."""

    def __init__(self) -> None:
        self.next = 1

    def rows(self, lengths: Sequence[int], pads: Sequence[int] = ()) -> list[list[float]]:
        pads = list(pads) or [0] * len(lengths)
        out = []
        for n, p in zip(lengths, pads, strict=True):
            real = list(range(self.next, self.next + n - p))
            self.next += n
            out.append([-1.0 - i for i in range(p)] + [float(t) for t in real])
        return out


def _array(mask: Any, rows: int, n: int) -> np.ndarray:
    assert isinstance(mask, mx.array), mask
    return np.broadcast_to(np.array(mask), (rows, 1, n, mask.shape[-1]))


def _held(cache: Any) -> mx.array:
    """What mlx-lm's batch class holds, without its spare capacity."""
    keys: mx.array = cache.keys_and_values()[0]
    return keys


def check_members(ours: Any, theirs: Any) -> None:
    assert ours.left_padding.tolist() == theirs.left_padding.tolist()
    assert ours.offset.tolist() == theirs.offset.tolist()
    if theirs.keys is None:
        return
    held = _held(theirs)
    assert ours.keys.shape == held.shape
    assert ours.size() == theirs.size()


def step(ours: Any, theirs: Any, ids: list[list[float]], *, members: bool = True) -> None:
    """Mask, then update, on both; the masks are equal, and so are the keys in every
    column some query sees (and then ``check_members``, unless ``members`` is false)."""
    n, rows = len(ids[0]), len(ids)
    mine, peer_mask = ours.make_mask(n, return_array=True), theirs.make_mask(n)
    got, _ = ours.update_and_fetch(block(ids), block(ids))
    want, _ = theirs.update_and_fetch(block(ids), block(ids))
    mine_array, peer_array = _array(mine, rows, n), _array(peer_mask, rows, n)
    assert np.array_equal(mine_array, peer_array), (mine_array, peer_array)
    seen = mine_array[:, 0].any(axis=1)  # [B, S]: columns some query reads
    assert got.shape == want.shape
    np.testing.assert_array_equal(
        np.where(seen, np.array(got[:, 0, :, 0]), 0), np.where(seen, np.array(want[:, 0, :, 0]), 0)
    )
    if members:
        check_members(ours, theirs)


# -- BatchKVCache ------------------------------------------------------------------------


def test_left_padded_blocks_keep_the_shared_pad_columns() -> None:
    ids = Ids()
    ours, theirs = kv.BatchKVCache([2, 3, 4]), peer.BatchKVCache([2, 3, 4])
    check_members(ours, theirs)
    step(ours, theirs, ids.rows([4, 4, 4], [2, 3, 4]))
    assert ours.left_padding.tolist() == [2, 3, 4]  # two columns every row shares
    for _ in range(2):
        step(ours, theirs, ids.rows([1, 1, 1]))
    step(ours, theirs, ids.rows([3, 3, 3]))
    ours.filter([2, 0])
    theirs.filter([2, 0])  # drops the shared columns, as mlx-lm's does
    check_members(ours, theirs)
    step(ours, theirs, ids.rows([1, 1]))
    ours.check_valid()


@pytest.mark.parametrize("wider", ["self", "other", "empty"])
def test_extend_aligns_at_the_wider_batch_shared_pads_included(wider: str) -> None:
    ids = Ids()
    pads_a, length_a = ([3, 1], 7) if wider == "self" else ([0, 1], 3)
    pads_b, length_b = [4, 2, 3], 6
    ours_a, theirs_a = kv.BatchKVCache(pads_a), peer.BatchKVCache(pads_a)
    ours_b, theirs_b = kv.BatchKVCache(pads_b), peer.BatchKVCache(pads_b)
    if wider == "empty":
        ours_a, theirs_a = kv.BatchKVCache([]), peer.BatchKVCache([])
    else:
        step(ours_a, theirs_a, ids.rows([length_a] * 2, pads_a))
    step(ours_b, theirs_b, ids.rows([length_b] * 3, pads_b))
    before = ours_b.state
    ours_a.extend(ours_b)
    theirs_a.extend(theirs_b)
    check_members(ours_a, theirs_a)
    rows = ours_a.batch_size
    for n in (1, 1, 2):
        step(ours_a, theirs_a, ids.rows([n] * rows))
    # ``other`` is unchanged
    assert all(
        mx.array_equal(x, y).item() if isinstance(x, mx.array) else x == y
        for x, y in zip(ours_b.state, before, strict=True)
    )
    ours_a.check_valid()


def test_extend_into_a_batch_with_room_left_of_its_origin() -> None:
    """A filter leaves free columns left of the origin: widening takes them (no re-lay)."""
    ids = Ids()
    ours, theirs = kv.BatchKVCache([5, 0, 6]), peer.BatchKVCache([5, 0, 6])
    step(ours, theirs, ids.rows([8] * 3, [5, 0, 6]))
    ours.filter([0, 2])
    theirs.filter([0, 2])
    ours_b, theirs_b = kv.BatchKVCache([6]), peer.BatchKVCache([6])
    step(ours_b, theirs_b, ids.rows([8], [6]))
    ours.extend(ours_b)
    theirs.extend(theirs_b)
    check_members(ours, theirs)
    step(ours, theirs, ids.rows([1, 1, 1]))


def test_state_keeps_the_shared_pad_columns() -> None:
    ids = Ids()
    ours, theirs = kv.BatchKVCache([1, 3]), peer.BatchKVCache([1, 3])
    step(ours, theirs, ids.rows([5, 5], [1, 3]))
    state = ours.state
    assert state[0].shape == _held(theirs).shape
    assert state[3].tolist() == theirs.left_padding.tolist() and state[4] == theirs._idx
    ours.state = state
    check_members(ours, theirs)
    loaded = kv.BatchKVCache.from_state(theirs.state)  # mlx-lm's form, capacity included
    check_members(loaded, theirs)
    step(ours, theirs, ids.rows([2, 2]))


def test_a_block_of_other_rows_is_refused() -> None:
    """mlx-lm's ``BatchKVCache(left_padding=[1, 2])`` takes a 4-row block and ends with
    4 rows of keys and 2 offsets; kvrows refuses and changes nothing."""
    cache = kv.BatchKVCache([1, 2])
    with pytest.raises(InvalidInputError, match="B=4 rows but the cache holds 2"):
        cache.update_and_fetch(block([[1.0] * 3] * 4), block([[1.0] * 3] * 4))
    assert cache.left_padding.tolist() == [1, 2] and cache.keys is None
    theirs = peer.BatchKVCache([1, 2])
    theirs.update_and_fetch(block([[1.0] * 3] * 4), block([[1.0] * 3] * 4))
    assert theirs.keys.shape[0] == 4 and theirs.offset.shape == (2,)  # the state it accepts


# -- BatchRotatingKVCache ----------------------------------------------------------------


@pytest.mark.parametrize(("max_size", "pads"), [(4, [2, 0]), (6, [3, 1, 0]), (8, [4])])
def test_ring_in_mlx_lm_columns(max_size: int, pads: list[int]) -> None:
    ids = Ids()
    rows = len(pads)
    ours = kv.BatchRotatingKVCache(max_size, pads)
    theirs = peer.BatchRotatingKVCache(max_size, pads)
    check_members(ours, theirs)
    step(ours, theirs, ids.rows([max(pads) + 2] * rows, pads))
    step(ours, theirs, ids.rows([3] * rows))  # a block before the wrap
    for _ in range(max_size + 2):  # single tokens wrap the ring
        step(ours, theirs, ids.rows([1] * rows))
    keep = list(range(rows))[::-1][: max(1, rows - 1)]
    ours.filter(keep)
    theirs.filter(keep)
    check_members(ours, theirs)
    step(ours, theirs, ids.rows([1] * len(keep)))


def test_ring_block_after_a_wrap_shows_what_mlx_lm_hides() -> None:
    """mlx-lm's test: window 8, 4 pads, 4 tokens, one token (the ring wraps), a block of
    2. mlx-lm's mask hides the row's oldest real token (B9); kvrows' shows it, in mlx-lm's
    columns, and nothing else differs."""
    ours, theirs = kv.BatchRotatingKVCache(8, [4]), peer.BatchRotatingKVCache(8, [4])
    step(ours, theirs, [[-1.0, -2.0, -3.0, -4.0, 10.0, 11.0, 12.0, 13.0]])
    step(ours, theirs, [[14.0]])
    mine, bugged = ours.make_mask(2), theirs.make_mask(2)
    got, _ = ours.update_and_fetch(block([[15.0, 16.0]]), block([[15.0, 16.0]]))
    want, _ = theirs.update_and_fetch(block([[15.0, 16.0]]), block([[15.0, 16.0]]))
    assert np.array_equal(np.array(got), np.array(want))  # the same columns
    columns = np.array(got[0, 0, :, 0])

    def seen(mask: Any, query: int) -> list[float]:
        return sorted(columns[np.array(mask).reshape(2, -1)[query]].tolist())

    # The row's window (8 tokens, the query's own included) is the oracle.
    assert seen(mine, 0) == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    assert seen(mine, 1) == [10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0]
    assert seen(bugged, 0) == [11.0, 12.0, 13.0, 14.0, 15.0]  # B9: 10 hidden
    check_members(ours, theirs)


def test_ring_right_padded_prefill_in_mlx_lm_columns() -> None:
    """``merge`` of serial rings, a right-padded block, ``finalize``, decode: mlx-lm's
    columns (its finalize rolls each row right by its pads; kvrows rolls as they arrive)."""
    ids = Ids()
    ours_rows, their_rows = [], []
    for n in (5, 2, 3):
        tokens = ids.rows([n])
        mine, peer_ring = kv.RotatingKVCache(6), peer.RotatingKVCache(6)
        mine.update_and_fetch(block(tokens), block(tokens))
        peer_ring.update_and_fetch(block(tokens), block(tokens))
        ours_rows.append(mine)
        their_rows.append(peer_ring)
    ours = kv.RotatingKVCache.merge(ours_rows)
    theirs = peer.RotatingKVCache.merge(their_rows)
    assert isinstance(ours, kv.BatchRotatingKVCache)
    check_members(ours, theirs)
    lengths, right = [4, 2, 3], [0, 2, 1]
    for cache in (ours, theirs):
        cache.prepare(lengths=lengths, right_padding=right)
    padded = [
        r[:n] + [-50.0 - i for i in range(p)]
        for r, n, p in zip(ids.rows([4] * 3), lengths, right, strict=True)
    ]
    step(ours, theirs, padded, members=False)  # mlx-lm rolls at finalize, kvrows already did
    ours.finalize()
    theirs.finalize()
    check_members(ours, theirs)
    for _ in range(4):
        step(ours, theirs, ids.rows([1, 1, 1]))
