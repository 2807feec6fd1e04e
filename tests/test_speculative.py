"""Speculative rounds (``spec/speculative.md``, ``spec/SpeculativeRotatingKVCache.md``) on
every verify layout, both implementations, as fixed tests.

Tokens carry tags: a token's key is its tag on every channel (its value the negated tag),
so an extracted row reads back as the list of tags it holds. Every expected value comes
from the tag arithmetic: each row's accepted history (the tokens it kept), never from
the code under test. Rejected tokens get tags no accepted token ever has, so a leaked
one shows. The affine rings (whose codes do not read back as tags) are compared byte for
byte with a serial ring that saw only the accepted tokens (solo replay).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import count
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvrows
import kvrows.optimized as O
import kvrows.reference as R
from kvrows.conformance.arrays import as_numpy, expand_mask
from kvrows.conformance.profiles import profile_settings
from kvrows.errors import (
    NOTHING_TO_RECORD,
    SPECULATIVE_INVALID,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    NotTrimmableError,
    SpeculativeRoundError,
    SpeculativeStateInvalidError,
)
from kvrows.speculative import RowRound
from kvrows.table import target_cache_layout

IMPLS = {"reference": R, "optimized": O}
W = 8  # the seed vectors' window


pytestmark = pytest.mark.usefixtures("cpu_stream")


# -- tagged tokens -----------------------------------------------------------------------


def _array(impl: Any, array: np.ndarray[Any, Any]) -> Any:
    return array if impl is R else mx.array(array)


def _tagged(impl: Any, tags: Sequence[Sequence[int]], dim: int = 2, dtype: Any = np.float32) -> Any:
    """``[rows, 1, n, dim]``: every channel of row ``b``'s token ``i`` is ``tags[b][i]``,
    plus a ramp on affine-sized rows (so groups do not quantize to a constant)."""
    block = np.array(tags, dtype=np.float32)[:, None, :, None].repeat(dim, axis=-1)
    if dim > 2:
        block = block + np.linspace(0.0, 1.0, dim, dtype=np.float32)
    return _array(impl, block.astype(dtype))


def _append(impl: Any, cache: Any, tags: Sequence[Sequence[int]], dim: int = 2) -> Any:
    keys = _tagged(impl, tags, dim)
    values = _tagged(impl, [[-t for t in row] for row in tags], dim)
    return cache.update_and_fetch(keys, values)


def _tags(planes: Any) -> list[int]:
    """The tags of a one-row plain serial cache's key planes (``[1, 1, T, 2]``)."""
    return [round(float(x)) for x in as_numpy(planes[0])[0, 0, :, 0]]


def _held_tags(serial: Any) -> list[int]:
    """Every token an extracted plain row holds, in time order (keys; values agree)."""
    planes = serial.planes()
    if planes is None:
        return []
    keys, values = _tags(planes[0]), _tags(planes[1])
    assert values == [-t for t in keys], "a token's value is its negated key"
    return keys


def _serial(impl: Any, kind: str, tags: Sequence[int], dim: int = 2) -> Any:
    """A serial cache of ``kind`` that saw ``tags`` (one block)."""
    cache = _make_serial(impl, kind)
    if tags:
        _append(impl, cache, [list(tags)], dim)
    return cache


def _make_serial(impl: Any, kind: str, window: int = W) -> Any:
    return {
        "KVCache": lambda: impl.KVCache(),
        "QuantizedKVCache": lambda: impl.QuantizedKVCache(64, 8),
        "RotatingKVCache": lambda: impl.RotatingKVCache(window),
        "RotatingQuantizedKVCache": lambda: impl.RotatingQuantizedKVCache(window, 64, 8),
    }[kind]()


def _visible(layout: Any, mask: Any, keys: Any, rows: int) -> list[list[int]]:
    """The tags the one query of each row attends (``mask`` made before the append)."""
    keys_np = as_numpy(keys[0] if isinstance(keys, tuple) else keys)
    width = keys_np.shape[2]
    grid = expand_mask(mask, rows, 1, width)
    return [
        [round(float(keys_np[b, 0, j, 0])) for j in range(width) if grid[b, 0, 0, j]]
        for b in range(rows)
    ]


class Tagger:
    """Fresh tags: accepted tokens count up from 1, rejected ones down from -1000 (a
    rejected tag never equals an accepted one)."""

    def __init__(self) -> None:
        self._accepted = count(1)
        self._rejected = count(1000)

    def accepted(self) -> int:
        return next(self._accepted)

    def rejected(self) -> int:
        return -next(self._rejected)


def _verify_layout(serial: Any) -> Any:
    """The verify role's empty layout for ``serial``'s rows (the row-layout table)."""
    return target_cache_layout(serial)


# -- the seed's vectors (semantics.md §4.11) ---------------------------------------------

HISTORIES = ([0, 0, 0], [0, 5, 7], [2, 5, 7], [9, 15, 21])
ROUNDS = 36
BLOCK = 4  # [pending, draft_1, draft_2, draft_3]


def _keeps() -> list[list[int]]:
    """A fixed pseudo-random sequence of per-row keep counts in ``1..BLOCK`` (this seed
    draws every count, full commits, equal rollbacks and unequal ones)."""
    rng = np.random.default_rng(14)
    keeps = [[int(k) for k in rng.integers(1, BLOCK + 1, size=3)] for _ in range(ROUNDS)]
    assert {k for keep in keeps for k in keep} == set(range(1, BLOCK + 1))
    assert any(keep == [BLOCK] * 3 for keep in keeps)
    assert any(len(set(keep)) == 1 and keep[0] < BLOCK for keep in keeps)
    assert any(len(set(keep)) > 1 for keep in keeps)
    return keeps


def _round(
    impl: Any, layout: Any, histories: list[list[int]], keep: list[int], tagger: Tagger, dim: int
) -> None:
    """One verify round: every row appends ``BLOCK`` tokens, row ``b`` keeps ``keep[b]``
    (rejected tokens get rejected tags: the history says which tokens are kept)."""
    block = [
        [tagger.accepted() if i < k else tagger.rejected() for i in range(BLOCK)] for k in keep
    ]
    layout.spec_round_begin()
    _append(impl, layout, block, dim)
    if all(k == BLOCK for k in keep):
        layout.spec_round_commit()
    elif len(set(keep)) == 1:
        layout.spec_round_rollback(keep[0])
    else:
        layout.spec_round_rollback(keep)
    assert not layout.spec_round_open
    for history, row, k in zip(histories, block, keep, strict=True):
        history.extend(row[:k])


def _history_rows(tagger: Tagger, lengths: Sequence[int]) -> list[list[int]]:
    return [[tagger.accepted() for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("lengths", HISTORIES, ids=str)
@pytest.mark.parametrize("impl_name", IMPLS)
def test_seed_vectors_plain_ring(impl_name: str, lengths: list[int]) -> None:
    """36 rounds with per-row keeps, each followed by a clone through merge and a decode:
    every extracted row is the newest ``<= 8`` tags of its accepted history, and the
    decode query of every row attends exactly those."""
    impl = IMPLS[impl_name]
    tagger = Tagger()
    histories = _history_rows(tagger, lengths)
    sources = [_serial(impl, "RotatingKVCache", h) for h in histories]
    layout = _verify_layout(sources[0])
    assert isinstance(layout, impl.SpeculativeRotatingKVCache)
    layout.merge_rows(sources)
    for keep in _keeps():
        _round(impl, layout, histories, keep, tagger, dim=2)
        clone = _verify_layout(sources[0])
        clone.merge_rows([layout])
        layout = clone
        decode = [[tagger.accepted()] for _ in histories]
        mask = layout.make_mask(1, return_array=True)
        keys, _ = _append(impl, layout, decode)
        for history, token in zip(histories, decode, strict=True):
            history.extend(token)
        assert _visible(layout, mask, keys, 3) == [h[-W:] for h in histories]
        assert layout.row_offsets == tuple(len(h) for h in histories)
        for b, history in enumerate(histories):
            row = layout.extract_row(b)
            assert _held_tags(row) == history[-W:]
            assert row.offset == len(history)
    layout.filter_rows([2, 0])
    kept = [histories[2], histories[0]]
    assert layout.row_offsets == tuple(len(h) for h in kept)
    assert [_held_tags(layout.extract_row(b)) for b in range(2)] == [h[-W:] for h in kept]


def _affine_bytes(serial: Any) -> list[bytes]:
    """A one-row affine ring's retained tokens (codes, scales, biases; keys and values)."""
    planes = serial.planes()
    return [] if planes is None else [as_numpy(p).tobytes() for side in planes for p in side]


def _affine_window_bytes(serial: Any) -> list[bytes]:
    window = serial.window()
    return [] if window is None else [as_numpy(p).tobytes() for side in window for p in side]


def _solo(impl: Any, history: Sequence[int]) -> Any:
    """The oracle: a serial affine ring that saw only the accepted tokens, one at a time."""
    ring = _make_serial(impl, "RotatingQuantizedKVCache")
    for tag in history:
        _append(impl, ring, [[tag]], dim=64)
    return ring


@pytest.mark.parametrize("lengths", [HISTORIES[1], HISTORIES[3]], ids=str)
@pytest.mark.parametrize("impl_name", IMPLS)
def test_seed_vectors_affine_ring(impl_name: str, lengths: list[int]) -> None:
    """The same rounds on ``SpeculativeRotatingAffineLayout``: every extracted row holds the
    bytes of a serial affine ring that saw only its accepted tokens (its newest window)."""
    impl = IMPLS[impl_name]
    tagger = Tagger()
    histories = _history_rows(tagger, lengths)
    sources = [_serial(impl, "RotatingQuantizedKVCache", h, dim=64) for h in histories]
    layout = _verify_layout(sources[0])
    assert isinstance(layout, impl.SpeculativeRotatingAffineLayout)
    layout.merge_rows(sources)
    for step, keep in enumerate(_keeps()[:12]):
        _round(impl, layout, histories, keep, tagger, dim=64)
        clone = _verify_layout(sources[0])
        clone.merge_rows([layout])
        layout = clone
        decode = [[tagger.accepted()] for _ in histories]
        _append(impl, layout, decode, 64)
        for history, token in zip(histories, decode, strict=True):
            history.extend(token)
        if step % 3 == 2:
            for b, history in enumerate(histories):
                row = layout.extract_row(b)
                assert row.offset == len(history)
                assert _affine_bytes(row) == _affine_window_bytes(_solo(impl, history)), (step, b)
    layout.filter_rows([2, 0])
    for b, history in enumerate([histories[2], histories[0]]):
        assert _affine_bytes(layout.extract_row(b)) == _affine_window_bytes(_solo(impl, history))


@pytest.mark.parametrize("impl_name", IMPLS)
def test_singleton_before_the_wrap(impl_name: str) -> None:
    """Prompt [1, 2], block [3, 99, 98, 97], keep 1: offset 3, no padding; token 4 reads
    [1, 2, 3, 4]."""
    impl = IMPLS[impl_name]
    source = _serial(impl, "RotatingKVCache", [1, 2])
    layout = _verify_layout(source)
    layout.merge_rows([source])
    layout.spec_round_begin()
    _append(impl, layout, [[3, 99, 98, 97]])
    layout.spec_round_rollback(1)
    assert layout.row_offsets == (3,) and layout.left_pad == (0,)
    assert np.asarray(layout.offset).tolist() == [3]
    mask = layout.make_mask(1, return_array=True)
    keys, _ = _append(impl, layout, [[4]])
    assert _visible(layout, mask, keys, 1) == [[1, 2, 3, 4]]
    assert _held_tags(layout.extract_row(0)) == [1, 2, 3, 4]


@pytest.mark.parametrize("prompt", [7, 9])
@pytest.mark.parametrize("kind", ["RotatingKVCache", "RotatingQuantizedKVCache"])
@pytest.mark.parametrize("impl_name", IMPLS)
def test_singleton_across_the_window_boundary(impl_name: str, kind: str, prompt: int) -> None:
    """A round that crosses the window (7 + 4 > 8) or starts past it (9): after keep 1 and
    one decode the ring holds exactly the 8 newest accepted tokens, never a rejected one."""
    impl = IMPLS[impl_name]
    dim = 64 if "Quantized" in kind else 2
    history = list(range(1, prompt + 1))
    source = _serial(impl, kind, history, dim)
    layout = _verify_layout(source)
    layout.merge_rows([source])
    layout.spec_round_begin()
    _append(impl, layout, [[prompt + 1, -1, -2, -3]], dim)
    layout.spec_round_rollback(1)
    mask = layout.make_mask(1, return_array=True)
    keys, _ = _append(impl, layout, [[prompt + 2]], dim)
    history += [prompt + 1, prompt + 2]
    row = layout.extract_row(0)
    assert row.offset == len(history) == layout.row_offsets[0]
    if dim == 2:
        assert _visible(layout, mask, keys, 1) == [history[-W:]]
        assert _held_tags(row) == history[-W:]
    else:
        assert _affine_bytes(row) == _affine_window_bytes(_solo(impl, history))


@pytest.mark.parametrize("prompt", [3, 9])
@pytest.mark.parametrize("impl_name", IMPLS)
def test_rounds_keep_the_sink_tokens(impl_name: str, prompt: int) -> None:
    """``RotatingKVCache(6, keep=2)``: a rollback across the window keeps the row's two
    sinks and its newest 4 accepted tokens."""
    impl = IMPLS[impl_name]
    source = impl.RotatingKVCache(6, keep=2)
    history = list(range(1, prompt + 1))
    _append(impl, source, [history])
    layout = _verify_layout(source)
    assert isinstance(layout, impl.SpeculativeRotatingKVCache) and layout.keep == 2
    layout.merge_rows([source])
    for rejected in ([-1, -2, -3], [-4, -5], [-6, -7, -8]):
        token = history[-1] + 1
        layout.spec_round_begin()
        _append(impl, layout, [[token, *rejected]])
        layout.spec_round_rollback(1)
        mask = layout.make_mask(1, return_array=True)
        keys, _ = _append(impl, layout, [[token + 1]])
        history += [token, token + 1]
        newest = [history[0], history[1], *history[2:][-4:]]
        assert _visible(layout, mask, keys, 1) == [newest]
        assert _held_tags(layout.extract_row(0)) == newest


# -- the example: a ragged ring trims while it keeps its window --------------------


@pytest.mark.parametrize("impl_name", IMPLS)
def test_ragged_ring_trims_back_inside_its_latest_block(impl_name: str) -> None:
    """W = 4, a row at offset 6 takes a 3-token block: forgetting 2 of the block keeps the
    whole window of offset 7; forgetting 3 would need a token the ring already evicted."""
    impl = IMPLS[impl_name]
    source = _make_serial(impl, "RotatingKVCache", window=4)
    _append(impl, source, [[1, 2, 3, 4, 5, 6]])
    layout = impl.RaggedRotatingRows(4)
    layout.merge_rows([source])
    _append(impl, layout, [[7, 8, 9]])
    assert layout.trim_rows([2]) == 2
    assert layout.row_offsets == (7,)
    assert _held_tags(layout.extract_row(0)) == [4, 5, 6, 7]
    mask = layout.make_mask(1, return_array=True)
    keys, _ = _append(impl, layout, [[10]])
    assert _visible(layout, mask, keys, 1) == [[5, 6, 7, 10]]


def _refused_trim(impl: Any) -> tuple[str, Any, Any]:
    source = _make_serial(impl, "RotatingKVCache", window=4)
    _append(impl, source, [[1, 2, 3, 4, 5, 6]])
    layout = impl.RaggedRotatingRows(4)
    layout.merge_rows([source])
    _append(impl, layout, [[7, 8, 9]])
    before = _snapshot(layout)
    with pytest.raises(NotTrimmableError) as caught:
        layout.trim_rows([3])  # back to offset 6: its window [3..6] lost token 3
    return str(caught.value), before, layout


def test_a_trim_past_the_retained_window_is_refused_alike() -> None:
    messages = []
    for impl in IMPLS.values():
        message, before, layout = _refused_trim(impl)
        assert _snapshot(layout) == before
        assert _held_tags(layout.extract_row(0)) == [6, 7, 8, 9]
        messages.append(message)
    assert messages[0] == messages[1]
    assert "row 0" in messages[0]


# -- the protocol: misuse refused, nothing changes ------------------------------------------

VERIFY_KINDS = ("KVCache", "QuantizedKVCache", "RotatingKVCache", "RotatingQuantizedKVCache")
DIM = 64
ROWS = ([1, 2, 3], [11, 12, 13, 14, 15])


def _layout(impl: Any, kind: str, window: int = 4) -> Any:
    """A verify layout of two rows (3 and 5 tokens; the ring's window is 4, so the second
    row has wrapped)."""
    sources = []
    for tags in ROWS:
        cache = _make_serial(impl, kind, window)
        _append(impl, cache, [tags], DIM)
        sources.append(cache)
    layout = _verify_layout(sources[0])
    layout.merge_rows(sources)
    return layout


def _block(impl: Any, tokens: int = 3, dim: int = DIM) -> list[Any]:
    return [_tagged(impl, [[90 + i for i in range(tokens)]] * 2, dim) for _ in range(2)]


def _snapshot(layout: Any) -> tuple[Any, ...]:
    """Everything a refused call must leave alone: positions, round state, every held
    byte."""
    held = tuple((a.shape, str(a.dtype), a.tobytes()) for a in map(as_numpy, layout.held_arrays()))
    return (
        layout.row_offsets,
        layout.left_pad,
        getattr(layout, "spec_round_open", None),
        held,
    )


def _extracted(layout: Any) -> list[list[bytes]]:
    rows = []
    for b in range(layout.batch_size):
        planes = layout.extract_row(b).planes()
        rows.append([] if planes is None else [as_numpy(p).tobytes() for s in planes for p in s])
    return rows


Misuse = tuple[str, type[KvRowsError], Callable[[Any, Any], object]]

BAD_KEEPS: list[tuple[str, object]] = [
    ("one count", [1]),
    ("three counts", [1, 1, 1]),
    ("zero", 0),
    ("a zero", [1, 0]),
    ("negative", -1),
    ("above the block", 4),
    ("one above the block", [1, 4]),
    ("a float", 1.5),
    ("a float count", [1, 2.0]),
    ("a bool", True),
    ("a bool count", [True, 1]),
    ("a str", "1"),
    ("a str count", ["1", 1]),
    ("None", None),
]


def _merged_into_another(impl: Any, kind: str, layout: Any) -> None:
    """Merge ``layout``'s rows into a fresh verify layout, which a refusal leaves empty."""
    other = _verify_layout(_make_serial(impl, kind, 4))
    try:
        other.merge_rows([layout])
    finally:
        assert other.batch_size == 0 and other.row_offsets == ()


def _row_operations(kind: str) -> list[Misuse]:
    """Row operations a layout in a round refuses."""
    return [
        ("merge_rows", SpeculativeRoundError, lambda impl, lay: lay.merge_rows([])),
        ("filter_rows", SpeculativeRoundError, lambda impl, lay: lay.filter_rows([0])),
        ("extract_row", SpeculativeRoundError, lambda impl, lay: lay.extract_row(0)),
        ("trim", SpeculativeRoundError, lambda impl, lay: lay.trim(1)),
        ("trim_rows", SpeculativeRoundError, lambda impl, lay: lay.trim_rows([1, 0])),
        ("state", SpeculativeRoundError, lambda impl, lay: lay.state),
        (
            "restoring state",
            SpeculativeRoundError,
            lambda impl, lay: setattr(lay, "state", _layout(impl, kind).state),
        ),
        (
            "a merge source",
            SpeculativeRoundError,
            lambda impl, lay: _merged_into_another(impl, kind, lay),
        ),
    ]


_SERIAL = {
    "BatchedKVCache": "KVCache",
    "BatchedQuantizedKVCache": "QuantizedKVCache",
    "SpeculativeRotatingKVCache": "RotatingKVCache",
    "SpeculativeRotatingAffineLayout": "RotatingQuantizedKVCache",
}


def _misuses(phase: str, kind: str) -> list[Misuse]:
    """What each phase refuses: ``idle`` (no round), ``begun`` (before the block),
    ``blocked`` (after the block)."""
    commit: Misuse = ("commit", SpeculativeRoundError, lambda impl, lay: lay.spec_round_commit())
    rollback: Misuse = (
        "rollback",
        SpeculativeRoundError,
        lambda impl, lay: lay.spec_round_rollback(1),
    )
    begin: Misuse = (
        "second begin",
        SpeculativeRoundError,
        lambda impl, lay: lay.spec_round_begin(),
    )
    if phase == "idle":
        return [commit, rollback]
    if phase == "begun":
        return [begin, commit, rollback, *_row_operations(kind)]
    bad_keeps: list[Misuse] = [
        (f"keep {name}", InvalidInputError, _rollback_with(keep)) for name, keep in BAD_KEEPS
    ]
    second_block: Misuse = (
        "a second block",
        SpeculativeRoundError,
        lambda impl, lay: lay.update_and_fetch(*_block(impl, 1)),
    )
    return [begin, second_block, *bad_keeps, *_row_operations(kind)]


def _rollback_with(keep: object) -> Callable[[Any, Any], object]:
    return lambda impl, lay: lay.spec_round_rollback(keep)


def _to_phase(impl: Any, layout: Any, phase: str) -> None:
    if phase != "idle":
        layout.spec_round_begin()
    if phase == "blocked":
        layout.update_and_fetch(*_block(impl))


@pytest.mark.parametrize("phase", ["idle", "begun", "blocked"])
@pytest.mark.parametrize("kind", VERIFY_KINDS)
def test_misuse_is_refused_alike_and_changes_nothing(kind: str, phase: str) -> None:
    messages: dict[str, list[str]] = {}
    for impl in IMPLS.values():
        layout = _layout(impl, kind)
        assert isinstance(layout, kvrows.SpeculativeRowLayout)
        assert type(layout).__name__ in _SERIAL and _SERIAL[type(layout).__name__] == kind
        extracted = _extracted(layout)
        _to_phase(impl, layout, phase)
        assert layout.can_publish_row(0, 1) == (phase == "idle")
        for name, error, call in _misuses(phase, kind):
            before = _snapshot(layout)
            with pytest.raises(error) as caught:
                call(impl, layout)
            assert not isinstance(caught.value, SpeculativeStateInvalidError), name
            assert _snapshot(layout) == before, name
            messages.setdefault(name, []).append(str(caught.value))
        # the round is still usable: close it, and the rows are what they were
        if phase == "blocked":
            layout.spec_round_rollback(1)
        elif phase == "begun":
            layout.update_and_fetch(*_block(impl))
            layout.spec_round_rollback([1, 1])
        assert not layout.spec_round_open
        if phase == "idle":
            assert _extracted(layout) == extracted
        else:
            assert layout.row_offsets == (4, 6)
    for name, both in messages.items():
        assert both[0] == both[1], f"{name}: {both}"


INVALID_LATER: list[Callable[[Any, Any], object]] = [
    lambda impl, lay: lay.spec_round_commit(),
    lambda impl, lay: lay.spec_round_rollback(1),
    lambda impl, lay: lay.spec_round_begin(),
    lambda impl, lay: lay.update_and_fetch(*_block(impl)),
    lambda impl, lay: lay.fetch(),
    lambda impl, lay: lay.make_mask(1),
    lambda impl, lay: lay.merge_rows([]),
    lambda impl, lay: lay.filter_rows([0]),
    lambda impl, lay: lay.extract_row(0),
    lambda impl, lay: lay.trim(1),
    lambda impl, lay: lay.trim_rows([1, 0]),
    lambda impl, lay: lay.can_publish_row(0, 1),
    lambda impl, lay: lay.state,
    lambda impl, lay: setattr(lay, "state", lay.make_empty_batch().state),
]


@pytest.mark.parametrize("kind", VERIFY_KINDS)
def test_a_failed_append_in_a_round_invalidates_the_layout(kind: str) -> None:
    """Every later call says the state must be discarded."""
    first_errors = []
    for impl in IMPLS.values():
        layout = _layout(impl, kind)
        layout.spec_round_begin()
        with pytest.raises(KvRowsError) as caught:
            layout.update_and_fetch(*_block(impl, 3, dim=DIM // 2))  # the wrong head dim
        first_errors.append((type(caught.value).__name__, str(caught.value)))
        assert not isinstance(caught.value, SpeculativeStateInvalidError)
        for call in INVALID_LATER:
            with pytest.raises(SpeculativeStateInvalidError) as refused:
                call(impl, layout)
            assert str(refused.value) == SPECULATIVE_INVALID
    assert first_errors[0] == first_errors[1]


# -- random invalid calls (Hypothesis) -------------------------------------------------------


@given(
    kind=st.sampled_from(VERIFY_KINDS),
    impl_name=st.sampled_from(sorted(IMPLS)),
    phase=st.sampled_from(["idle", "begun", "blocked"]),
    picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=6),
)
@profile_settings(max_examples=12)
def test_random_invalid_calls_leave_the_layout_unchanged(
    kind: str, impl_name: str, phase: str, picks: list[int]
) -> None:
    impl = IMPLS[impl_name]
    layout = _layout(impl, kind)
    _to_phase(impl, layout, phase)
    before = _snapshot(layout)
    choices = _misuses(phase, kind)
    for pick in picks:
        name, error, call = choices[pick % len(choices)]
        with pytest.raises(error):
            call(impl, layout)
        assert _snapshot(layout) == before, name


# -- RowRound: the transaction over every layer ----------------------------------------------


class Recorder:
    """A layer that records the round calls it forwards to a real verify layout."""

    def __init__(self, layout: Any) -> None:
        self.layout = layout
        self.calls: list[tuple[str, object]] = []

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return tuple(self.layout.row_offsets)

    def spec_round_begin(self) -> None:
        self.calls.append(("begin", None))
        self.layout.spec_round_begin()

    def spec_round_commit(self) -> None:
        self.calls.append(("commit", None))
        self.layout.spec_round_commit()

    def spec_round_rollback(self, keep: Any) -> None:
        self.calls.append(("rollback", keep))
        self.layout.spec_round_rollback(keep)


def _layers(impl: Any) -> list[Recorder]:
    return [Recorder(_layout(impl, kind)) for kind in ("KVCache", "RotatingKVCache")]


def _verify_block(impl: Any, layers: Sequence[Recorder], tokens: int) -> None:
    for layer in layers:
        layer.layout.update_and_fetch(*_block(impl, tokens))


@pytest.mark.parametrize("impl_name", IMPLS)
def test_row_round_with_no_draft_opens_no_round(impl_name: str) -> None:
    """d = 0: coverage advances by exactly the pending token and nothing is rolled back
    (semantics.md §9.5, bug 2)."""
    impl = IMPLS[impl_name]
    layers = _layers(impl)
    transaction = RowRound(layers)
    transaction.begin(0)
    assert not any(layer.layout.spec_round_open for layer in layers)
    _verify_block(impl, layers, 1)
    transaction.resolve([0, 0])
    for layer in layers:
        assert layer.calls == []
        assert layer.row_offsets == (4, 6)


@pytest.mark.parametrize("impl_name", IMPLS)
def test_row_round_commits_rolls_back_and_keeps_per_row(impl_name: str) -> None:
    impl = IMPLS[impl_name]
    layers = _layers(impl)
    transaction = RowRound(layers)
    expected = [3, 5]
    for accepted, call in (
        ([2, 2], ("commit", None)),  # all accepted
        ([1, 1], ("rollback", 2)),  # equal: one scalar keep
        ([0, 2], ("rollback", [1, 3])),  # unequal: one keep per row
    ):
        transaction.begin(2)
        _verify_block(impl, layers, 3)
        transaction.resolve(accepted)
        expected = [e + a + 1 for e, a in zip(expected, accepted, strict=True)]
        for layer in layers:
            assert layer.calls[-1] == call and type(layer.calls[-1][1]) is type(call[1])
            assert layer.row_offsets == tuple(expected)
            assert not layer.layout.spec_round_open
            layer.calls.clear()


@pytest.mark.parametrize("impl_name", IMPLS)
def test_row_round_refuses_bad_acceptance_before_anything_changes(impl_name: str) -> None:
    impl = IMPLS[impl_name]
    layers = _layers(impl)
    transaction = RowRound(layers)
    with pytest.raises(SpeculativeRoundError):
        transaction.resolve([0, 0])
    with pytest.raises(InvalidInputError):
        transaction.begin(-1)
    transaction.begin(2)
    with pytest.raises(SpeculativeRoundError):
        transaction.begin(2)
    _verify_block(impl, layers, 3)
    before = [_snapshot(layer.layout) for layer in layers]
    for accepted in ([1], [1, 1, 1], [-1, 0], [0, 3], [0.5, 1], ["1", 1], [True, 1], "11", 1):
        with pytest.raises(InvalidInputError):
            transaction.resolve(accepted)  # type: ignore[arg-type]
        assert [_snapshot(layer.layout) for layer in layers] == before
        assert all(layer.calls == [("begin", None)] for layer in layers)
    transaction.resolve([1, 0])  # still open and usable
    assert [layer.row_offsets for layer in layers] == [(5, 6), (5, 6)]


@pytest.mark.parametrize("impl_name", IMPLS)
def test_row_round_failing_after_validation_is_invalid(impl_name: str) -> None:
    """A layer whose rollback fails (its verify block never came) invalidates the
    transaction: every later call refuses."""
    impl = IMPLS[impl_name]
    layers = _layers(impl)
    transaction = RowRound(layers)
    transaction.begin(2)
    layers[0].layout.update_and_fetch(*_block(impl, 3))  # the second layer gets no block
    with pytest.raises(SpeculativeRoundError):
        transaction.resolve([1, 0])
    with pytest.raises(SpeculativeStateInvalidError, match=SPECULATIVE_INVALID):
        transaction.resolve([1, 0])
    with pytest.raises(SpeculativeStateInvalidError, match=SPECULATIVE_INVALID):
        transaction.begin(1)


def test_row_round_takes_only_verify_layouts() -> None:
    with pytest.raises(InvalidInputError):
        RowRound([])
    with pytest.raises(InvalidInputError):
        RowRound([R.RaggedRotatingRows(4)])
    for impl in IMPLS.values():
        for kind in VERIFY_KINDS:
            layout = _verify_layout(_make_serial(impl, kind))
            assert isinstance(layout, kvrows.SpeculativeRowLayout)
            RowRound([layout])
        assert not isinstance(impl.RaggedRotatingRows(4), kvrows.SpeculativeRowLayout)


def test_an_empty_verify_layout_opens_no_round() -> None:
    messages = []
    for impl in IMPLS.values():
        layout = _verify_layout(_make_serial(impl, "KVCache"))
        with pytest.raises(LayoutStateError) as caught:
            layout.spec_round_begin()
        assert not layout.spec_round_open
        messages.append(str(caught.value))
    assert messages[0] == messages[1]


@pytest.mark.parametrize("impl_name", IMPLS)
@pytest.mark.parametrize("kind", ["KVCache", "RotatingKVCache"])
def test_a_layout_that_forgets_records_no_replay(impl_name: str, kind: str) -> None:
    """Snapshot + replay is for storages that cannot forget (recurrent state): a KV verify
    layout's round awaits no record and refuses one, changing nothing."""
    impl = IMPLS[impl_name]
    layout = _layout(impl, kind)
    assert not layout.spec_round_awaits_record
    layout.spec_round_begin()
    assert not layout.spec_round_awaits_record
    before = _snapshot(layout)
    with pytest.raises(SpeculativeRoundError) as caught:
        layout.spec_round_record(lambda cache, *inputs: None, _block(impl, 2)[0])
    assert str(caught.value) == NOTHING_TO_RECORD
    assert _snapshot(layout) == before and layout.spec_round_open
    layout.update_and_fetch(*_block(impl, 2))
    layout.spec_round_rollback(1)
    assert layout.row_offsets == (4, 6)
