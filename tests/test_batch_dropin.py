"""mlx-lm's batch API on kvrows classes (``spec/mlx-lm-batch-api.md``).

Every operation is run on a kvrows cache and on an oracle fed the same tokens: mlx-lm's
own ``KVCache.merge`` / ``BatchKVCache`` / ``BatchRotatingKVCache`` where mlx-lm is right,
and a solo replay (each row's tokens through its own kvrows serial cache, the conformance
suite's reference semantics) where mlx-lm has a bug or no such class. What is compared
is what attention reads: for every real query, the set of tokens its mask lets it see in
the keys the update returned (physical columns differ between designs, so tokens are
identified by their key vectors). Refused calls must leave every cache unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import numpy as np
import pytest

import kvrows.optimized as kv
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    RowIndexError,
)
from kvrows.optimized.geometries.ring import RingGeometry
from kvrows.optimized.rows import Layout, Serial

peer: Any = mlx_lm_cache  # untyped

HEADS, DIM, WINDOW = 2, 32, 6
#: Token ``t``'s key (and value) vector; channel [0, 0] holds ``t`` so a fetched column
#: names its token.
TABLE = mx.random.normal((1024, HEADS, DIM), key=mx.random.key(7))
TABLE[:, 0, 0] = mx.arange(1024).astype(mx.float32)

Sets = list[list[list[Any]]]  # row -> query -> sorted visible tokens


pytestmark = pytest.mark.usefixtures("cpu_stream")


class Tokens:
    """Fresh token ids, so every token of a test is distinguishable."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))


def block(ids: Sequence[Sequence[int]], dtype: mx.Dtype = mx.float32) -> mx.array:
    return mx.transpose(TABLE[mx.array([list(r) for r in ids])], (0, 2, 1, 3)).astype(dtype)


def _signatures(keys: Any) -> list[list[Any]]:
    """Each fetched column's token: its id (plain) or its bytes (affine)."""
    if isinstance(keys, mx.array):
        ids = np.array(keys[:, 0, :, 0].astype(mx.float32))
        return [[round(float(x)) for x in row] for row in ids]
    planes = [np.array(p) for p in keys]
    rows, columns = planes[0].shape[0], planes[0].shape[2]
    return [
        [b"".join(p[b, :, j].tobytes() for p in planes) for j in range(columns)]
        for b in range(rows)
    ]


def feed(cache: Any, ids: Sequence[Sequence[int]], dtype: mx.Dtype = mx.float32) -> Sets:
    """One forward's worth on ``cache``: mask first, then the update; the tokens each
    query sees."""
    n = len(ids[0])
    mask = cache.make_mask(n, return_array=False, window_size=None)
    keys, _ = cache.update_and_fetch(block(ids, dtype), block(ids, dtype))
    signatures = _signatures(keys)
    rows, columns = len(signatures), len(signatures[0])
    if mask is None:
        visible = np.ones((rows, n, columns), dtype=bool)
    elif isinstance(mask, str):
        assert mask == "causal"
        grid = np.arange(columns)[None, :] <= (columns - n + np.arange(n))[:, None]
        visible = np.broadcast_to(grid, (rows, n, columns))
    else:
        visible = np.array(mx.broadcast_to(mask, (rows, 1, n, columns)))[:, 0]
    return [
        [sorted(signatures[b][j] for j in range(columns) if visible[b, i, j]) for i in range(n)]
        for b in range(rows)
    ]


def real(sets: Sets, queries: Sequence[range]) -> Sets:
    """Only the real queries of each row (a padded block's pads see garbage by design)."""
    return [[row[i] for i in wanted] for row, wanted in zip(sets, queries, strict=True)]


def offsets(cache: Any) -> list[int]:
    return [int(x) for x in np.array(cache.offset).reshape(-1)]


def snapshot(cache: Any) -> tuple[Any, ...]:
    """Everything observable about a cache (for 'a refused call changes nothing')."""
    if isinstance(cache, Layout):
        rows = []
        for b in range(cache.batch_size):
            held = cache.row_planes(b)
            rows.append(None if held is None else [np.array(p).tobytes() for p in held[0]])
        return (repr(cache), offsets(cache), tuple(cache.pending_left_padding), rows)  # type: ignore[attr-defined]
    held = cache.planes()
    planes = None if held is None else [np.array(p).tobytes() for p in held[0] + held[1]]
    return (repr(cache), cache.offset, planes)


class Solo:
    """The oracle for one batch: each row's tokens replayed through its own serial cache."""

    def __init__(self, make: Callable[[], Any], histories: Sequence[Sequence[Sequence[int]]]):
        self.make = make
        self.rows: list[Any] = []
        for chunks in histories:
            self.rows.append(self._fresh(chunks))

    def _fresh(self, chunks: Sequence[Sequence[int]]) -> Any:
        cache = self.make()
        for chunk in chunks:
            feed(cache, [chunk])
        return cache

    def feed(self, per_row: Sequence[Sequence[int]]) -> Sets:
        """Row ``b`` gets ``per_row[b]`` (its real tokens only; may be empty)."""
        return [
            feed(cache, [ids])[0] if ids else []
            for cache, ids in zip(self.rows, per_row, strict=True)
        ]

    def keep(self, order: Sequence[int]) -> None:
        self.rows = [self.rows[i] for i in order]


def serials(make: Callable[[], Any], histories: Sequence[Sequence[Sequence[int]]]) -> list[Any]:
    out = []
    for chunks in histories:
        cache = make()
        for chunk in chunks:
            feed(cache, [chunk])
        out.append(cache)
    return out


def history(tokens: Tokens, lengths: Sequence[int], *, singles: int = 0) -> list[list[list[int]]]:
    """Per row: one block of ``length - singles`` tokens then ``singles`` one-token steps."""
    out = []
    for length in lengths:
        chunks = []
        if length:
            head = max(length - singles, 1) if length > singles else length
            chunks.append(tokens.take(head))
            chunks += [tokens.take(1) for _ in range(length - head)]
        out.append(chunks)
    return out


def decode_and_block(
    tokens: Tokens, ours: Any, oracle: Any, rows: int, steps: int, then_block: int = 0
) -> None:
    """``steps`` one-token steps, then a ``then_block``-token step, on both: equal sets."""
    for _ in range(steps):
        ids = [tokens.take(1) for _ in range(rows)]
        expected = oracle.feed(ids) if isinstance(oracle, Solo) else feed(oracle, ids)
        assert feed(ours, ids) == expected
    if then_block:
        ids = [tokens.take(then_block) for _ in range(rows)]
        expected = oracle.feed(ids) if isinstance(oracle, Solo) else feed(oracle, ids)
        assert feed(ours, ids) == expected


# -- merge ---------------------------------------------------------------------------------


def test_merge_of_plain_caches_is_mlx_lm_batch_kv_cache() -> None:
    tokens = Tokens()
    chunks = history(tokens, [3, 0, 5], singles=1)
    ours_sources = serials(kv.KVCache, chunks)
    theirs_sources = serials(peer.KVCache, chunks)
    before = [snapshot(c) for c in ours_sources]
    merged = ours_sources[0].merge(ours_sources)  # through an instance, as mlx-lm calls it
    theirs = peer.KVCache.merge(theirs_sources)
    assert type(merged) is kv.BatchKVCache and isinstance(merged, kv.BatchedKVCache)
    assert offsets(merged) == offsets(theirs) == [3, 0, 5]
    decode_and_block(tokens, merged, theirs, 3, steps=3, then_block=3)
    assert [snapshot(c) for c in ours_sources] == before  # sources borrowed, not changed


def test_merge_of_rings_is_mlx_lm_batch_rotating_kv_cache() -> None:
    tokens = Tokens()
    chunks = history(tokens, [9, 2, 0], singles=4)  # row 0 has wrapped its window
    ours = kv.RotatingKVCache.merge(serials(lambda: kv.RotatingKVCache(WINDOW), chunks))
    theirs = peer.RotatingKVCache.merge(serials(lambda: peer.RotatingKVCache(WINDOW), chunks))
    assert type(ours) is kv.BatchRotatingKVCache and isinstance(ours, kv.BatchedRotatingCache)
    assert offsets(ours) == offsets(theirs) == [9, 2, 0]
    decode_and_block(tokens, ours, theirs, 3, steps=8)


def test_ring_block_after_a_wrap_matches_solo_replay_not_mlx_lm_b9() -> None:
    # The note's B9 repro: window 8, rows of 6 and 1, three steps, then a 2-token step.
    tokens = Tokens()
    chunks = history(tokens, [6, 1])
    ours = kv.RotatingKVCache.merge(serials(lambda: kv.RotatingKVCache(8), chunks))
    solo = Solo(lambda: kv.RotatingKVCache(8), chunks)
    decode_and_block(tokens, ours, solo, 2, steps=3, then_block=2)


@pytest.mark.parametrize(
    ("make", "lengths", "layout"),
    [
        (lambda: kv.QuantizedKVCache(32, 4), [3, 0, 5], kv.BatchedQuantizedKVCache),
        (lambda: kv.RotatingQuantizedKVCache(WINDOW, 32, 4), [9, 2, 0], kv.RotatingAffineLayout),
    ],
    ids=["affine", "affine-ring"],
)
def test_merge_of_affine_caches_batches_them(
    make: Callable[[], Any], lengths: list[int], layout: type
) -> None:
    # mlx-lm cannot batch quantized caches at all; the oracle is the solo replay.
    tokens = Tokens()
    chunks = history(tokens, lengths, singles=4)
    merged = make().merge(serials(make, chunks))
    assert type(merged) is layout
    decode_and_block(tokens, merged, Solo(make, chunks), 3, steps=8, then_block=3)


def test_merge_refuses_mismatched_caches_and_changes_nothing() -> None:
    tokens = Tokens()
    f32, f16 = kv.KVCache(), kv.KVCache()
    feed(f32, [tokens.take(3)])
    feed(f16, [tokens.take(2)], mx.float16)
    ring_a, ring_b = kv.RotatingKVCache(4), kv.RotatingKVCache(5)
    before = [snapshot(c) for c in (f32, f16)]
    with pytest.raises(IncompatibleRowsError, match="geometry"):
        kv.KVCache.merge([f32, f16])  # mlx-lm casts the float16 row to float32 (B5)
    with pytest.raises(IncompatibleRowsError):
        kv.KVCache.merge([f32, kv.QuantizedKVCache()])
    with pytest.raises(IncompatibleRowsError):
        kv.KVCache.merge([f32, peer.KVCache()])
    with pytest.raises(IncompatibleRowsError):
        kv.KVCache.merge([peer.KVCache()])
    with pytest.raises(IncompatibleRowsError):
        kv.RotatingKVCache.merge([ring_a, ring_b])
    with pytest.raises(IncompatibleRowsError):
        kv.KVCache.merge([f32, f32])
    with pytest.raises(InvalidInputError):
        kv.KVCache.merge([])
    with pytest.raises(InvalidInputError):
        kv.KVCache.merge(f32)  # type: ignore[arg-type]
    assert [snapshot(c) for c in (f32, f16)] == before


def test_merge_of_empty_caches_gives_empty_rows() -> None:
    tokens = Tokens()
    merged = kv.KVCache.merge([kv.KVCache(), kv.KVCache()])
    theirs = peer.KVCache.merge([peer.KVCache(), peer.KVCache()])
    assert merged.batch_size == 2 and offsets(merged) == offsets(theirs) == [0, 0]
    decode_and_block(tokens, merged, theirs, 2, steps=0, then_block=3)
    decode_and_block(tokens, merged, theirs, 2, steps=2)


def test_layout_merge_classmethod() -> None:
    tokens = Tokens()
    chunks = history(tokens, [2, 4])
    layout = kv.BatchKVCache.merge(serials(kv.KVCache, chunks))
    assert type(layout) is kv.BatchKVCache and offsets(layout) == [2, 4]
    decode_and_block(tokens, layout, Solo(kv.KVCache, chunks), 2, steps=2)


# -- construction with left padding --------------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "theirs", "steps"),
    [
        (lambda lp: kv.BatchKVCache(lp), lambda lp: peer.BatchKVCache(lp), 3),
        (
            lambda lp: kv.BatchRotatingKVCache(4, lp),
            lambda lp: peer.BatchRotatingKVCache(4, lp),
            6,
        ),
    ],
    ids=["plain", "ring"],
)
def test_left_padded_construction_matches_mlx_lm(
    ours: Callable[[list[int]], Any], theirs: Callable[[list[int]], Any], steps: int
) -> None:
    tokens = Tokens()
    pads = [1, 0, 3]
    mine, peers = ours(pads), theirs(pads)
    assert offsets(mine) == offsets(peers) == [-1, 0, -3]  # RoPE: real tokens start at 0
    ids = [tokens.take(4) for _ in pads]
    queries = [range(p, 4) for p in pads]
    assert real(feed(mine, ids), queries) == real(feed(peers, ids), queries)
    assert offsets(mine) == offsets(peers) == [3, 4, 1]
    assert mine.row_offsets == (3, 4, 1)
    decode_and_block(tokens, mine, peers, 3, steps=steps)


def test_left_padding_longer_than_the_first_block() -> None:
    tokens = Tokens()
    mine, peers = kv.BatchKVCache([5, 0]), peer.BatchKVCache([5, 0])
    first, second = [tokens.take(3) for _ in range(2)], [tokens.take(3) for _ in range(2)]
    assert real(feed(mine, first), [range(0), range(3)]) == real(
        feed(peers, first), [range(0), range(3)]
    )
    assert offsets(mine) == offsets(peers) == [-2, 3]
    assert real(feed(mine, second), [range(2, 3), range(3)]) == real(
        feed(peers, second), [range(2, 3), range(3)]
    )
    decode_and_block(tokens, mine, peers, 2, steps=2)


LAYOUTS = [
    (kv.KVCache, kv.BatchKVCache),
    (kv.KVCache, kv.PaddedKVRows),
    (lambda: kv.RotatingKVCache(WINDOW), kv.BatchRotatingKVCache),
    (lambda: kv.RotatingKVCache(WINDOW), kv.BatchedRotatingCache),
    (lambda: kv.QuantizedKVCache(32, 4), kv.BatchedQuantizedKVCache),
    (lambda: kv.RotatingQuantizedKVCache(WINDOW, 32, 4), kv.RotatingAffineLayout),
]
LAYOUT_IDS = ["ragged", "shared", "ragged-ring", "shared-ring", "affine", "affine-ring"]


@pytest.mark.parametrize(("make", "layout"), LAYOUTS, ids=LAYOUT_IDS)
def test_left_padded_blocks_on_every_layout_match_solo_replay(
    make: Callable[[], Any], layout: Any
) -> None:
    # Two rows with history, joined by two fresh rows whose first blocks are left-padded
    # (the pads travel with their rows through extend).
    tokens = Tokens()
    chunks = history(tokens, [5, 0], singles=2)
    cache = layout.from_specs(make().codec_spec, make().token_geometry)
    cache.merge_rows(serials(make, chunks))
    padded = layout.from_specs(make().codec_spec, make().token_geometry)
    padded.merge_rows([make(), make()])
    padded.prepare(left_padding=[1, 3])
    cache.extend(padded)
    assert offsets(cache) == [5, 0, -1, -3]
    solo = Solo(make, [*chunks, [], []])
    ids = [tokens.take(4) for _ in range(4)]
    got = real(feed(cache, ids), [range(4), range(4), range(1, 4), range(3, 4)])
    assert got == solo.feed([ids[0], ids[1], ids[2][1:], ids[3][3:]])
    assert offsets(cache) == [9, 4, 3, 1]
    decode_and_block(tokens, cache, solo, 4, steps=7, then_block=2)


@pytest.mark.parametrize(
    "bad",
    [[-1], [True], 3, [1.5], "12", [[1]]],
)
def test_left_padding_is_validated(bad: Any) -> None:
    with pytest.raises(InvalidInputError):
        kv.BatchKVCache(bad)
    with pytest.raises(InvalidInputError):
        kv.BatchRotatingKVCache(4, bad)


def test_constructors_take_mlx_lm_arguments() -> None:
    assert kv.BatchKVCache().batch_size == 0
    assert kv.BatchKVCache(left_padding=mx.array([2, 0])).pending_left_padding == (2, 0)
    ring = kv.BatchRotatingKVCache(max_size=5, left_padding=[1])
    assert ring.max_size == 5 and ring.batch_size == 1
    with pytest.raises(InvalidInputError):
        kv.BatchRotatingKVCache(0, [0])
    with pytest.raises(InvalidInputError):
        kv.BatchRotatingKVCache(4.5, [0])  # type: ignore[arg-type]


# -- extend, filter, extract ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("serial", "peer_serial", "lengths_a", "lengths_b"),
    [
        (kv.KVCache, peer.KVCache, [3, 5], [2]),
        (kv.KVCache, peer.KVCache, [], [2, 4]),
        (kv.KVCache, peer.KVCache, [3], []),
        (lambda: kv.RotatingKVCache(WINDOW), lambda: peer.RotatingKVCache(WINDOW), [9, 1], [4]),
    ],
    ids=["plain", "empty-self", "empty-other", "ring"],
)
def test_extend_matches_mlx_lm(
    serial: Callable[[], Any],
    peer_serial: Callable[[], Any],
    lengths_a: list[int],
    lengths_b: list[int],
) -> None:
    tokens = Tokens()
    chunks_a = history(tokens, lengths_a, singles=4)
    chunks_b = history(tokens, lengths_b, singles=1)

    def batch(make: Callable[[], Any], chunks: list[list[list[int]]], empty: Any) -> Any:
        return make().merge(serials(make, chunks)) if chunks else empty

    ring = serial is not kv.KVCache
    ours_empty: Callable[[], Any] = (
        (lambda: kv.BatchRotatingKVCache(WINDOW, [])) if ring else kv.BatchKVCache
    )
    peer_empty: Callable[[], Any] = (
        (lambda: peer.BatchRotatingKVCache(WINDOW, [])) if ring else (lambda: peer.BatchKVCache([]))
    )
    mine = batch(serial, chunks_a, ours_empty())
    other = batch(serial, chunks_b, ours_empty())
    peers = batch(peer_serial, chunks_a, peer_empty())
    peers.extend(batch(peer_serial, chunks_b, peer_empty()))
    before = snapshot(other)
    mine.extend(other)
    assert snapshot(other) == before
    assert offsets(mine) == offsets(peers) == lengths_a + lengths_b
    decode_and_block(tokens, mine, peers, len(lengths_a + lengths_b), steps=7)


def test_extend_refuses_and_changes_nothing() -> None:
    tokens = Tokens()
    mine = kv.KVCache.merge(serials(kv.KVCache, history(tokens, [3])))
    half = kv.KVCache()
    feed(half, [tokens.take(2)], mx.float16)
    before = snapshot(mine)
    for bad in (kv.KVCache.merge([half]), kv.RotatingKVCache(4), peer.BatchKVCache([0]), mine):
        with pytest.raises(IncompatibleRowsError):
            mine.extend(bad)
    running = kv.KVCache.merge([kv.KVCache()])
    running.prepare(lengths=[1], right_padding=[1])
    with pytest.raises(LayoutStateError):
        mine.extend(running)
    assert snapshot(mine) == before


@pytest.mark.parametrize("as_array", [False, True], ids=["list", "mx.array"])
def test_filter_matches_mlx_lm(as_array: bool) -> None:
    tokens = Tokens()
    chunks = history(tokens, [3, 5, 1, 4], singles=1)
    mine = kv.KVCache.merge(serials(kv.KVCache, chunks))
    peers = peer.KVCache.merge(serials(peer.KVCache, chunks))
    keep = [3, 1]
    mine.filter(mx.array(keep) if as_array else keep)
    peers.filter(keep)
    assert offsets(mine) == offsets(peers) == [4, 5]
    decode_and_block(tokens, mine, peers, 2, steps=2, then_block=2)


def test_filter_of_a_padded_empty_batch_is_exact_b2() -> None:
    # mlx-lm: BatchKVCache([2, 3]).filter([1]) drives its cursor to -3 (B2); kvrows keeps
    # row 1 as a fresh BatchKVCache([3]) would be.
    tokens = Tokens()
    mine = kv.BatchKVCache([2, 3])
    mine.filter([1])
    fresh = peer.BatchKVCache([3])
    assert offsets(mine) == offsets(fresh) == [-3]
    ids = [tokens.take(5)]
    assert real(feed(mine, ids), [range(3, 5)]) == real(feed(fresh, ids), [range(3, 5)])
    decode_and_block(tokens, mine, fresh, 1, steps=2)


def test_filter_to_nothing_then_extend() -> None:
    tokens = Tokens()
    chunks = history(tokens, [2, 3])
    mine = kv.KVCache.merge(serials(kv.KVCache, chunks))
    mine.filter([])
    assert mine.batch_size == 0 and offsets(mine) == []
    more = history(tokens, [4])
    mine.extend(kv.KVCache.merge(serials(kv.KVCache, more)))
    decode_and_block(tokens, mine, Solo(kv.KVCache, more), 1, steps=2)


@pytest.mark.parametrize(
    "bad", [[-1], [3], [0, 0], [True], "0", 1, mx.array([0.0]), mx.array([[0]])]
)
def test_filter_refuses_and_changes_nothing(bad: Any) -> None:
    tokens = Tokens()
    mine = kv.KVCache.merge(serials(kv.KVCache, history(tokens, [2, 3, 1])))
    before = snapshot(mine)
    with pytest.raises((InvalidInputError, RowIndexError)):
        mine.filter(bad)
    assert snapshot(mine) == before


@pytest.mark.parametrize(
    ("serial", "peer_serial", "singles"),
    [
        (kv.KVCache, peer.KVCache, 1),
        (lambda: kv.RotatingKVCache(WINDOW), lambda: peer.RotatingKVCache(WINDOW), 4),
    ],
    ids=["plain", "ring"],
)
def test_extract_matches_mlx_lm(
    serial: Callable[[], Any], peer_serial: Callable[[], Any], singles: int
) -> None:
    tokens = Tokens()
    chunks = history(tokens, [3, 9, 5], singles=singles)
    mine = serial().merge(serials(serial, chunks))
    peers = peer_serial().merge(serials(peer_serial, chunks))
    decode_and_block(tokens, mine, peers, 3, steps=3)
    rows = [mine.extract(b) for b in range(3)]
    for row, theirs in zip(rows, [peers.extract(b) for b in range(3)], strict=True):
        assert type(row).__name__ == type(theirs).__name__ and isinstance(row, Serial)
        assert row.offset == theirs.offset
        keys = theirs.keys[..., -min(theirs.offset, theirs.keys.shape[2]) :, :]
        held = row.planes()
        assert held is not None
        assert np.array_equal(np.array(held[0][0]), np.array(keys))
    kept = [snapshot(row) for row in rows]
    feed(mine, [tokens.take(1) for _ in range(3)])  # the layout moves on, the rows do not
    assert [snapshot(row) for row in rows] == kept


def test_extract_of_an_empty_row_b3() -> None:
    row = kv.BatchKVCache([0, 2]).extract(1)  # mlx-lm raises TypeError here (B3)
    assert type(row) is kv.KVCache and row.offset == 0
    ring_row = kv.BatchRotatingKVCache(4, [1]).extract(0)
    assert type(ring_row) is kv.RotatingKVCache and ring_row.offset == 0
    with pytest.raises(RowIndexError):
        kv.BatchKVCache([0]).extract(1)
    with pytest.raises(InvalidInputError):
        kv.BatchKVCache([0]).extract(-1)


# -- prepare / finalize: right-padded prefill ----------------------------------------------


@pytest.mark.parametrize(
    ("serial", "peer_serial", "lengths"),
    [
        (kv.KVCache, peer.KVCache, [3, 5, 0]),
        (lambda: kv.RotatingKVCache(WINDOW), lambda: peer.RotatingKVCache(WINDOW), [7, 2, 0]),
    ],
    ids=["plain", "ring"],
)
def test_right_padded_prefill_matches_mlx_lm(
    serial: Callable[[], Any], peer_serial: Callable[[], Any], lengths: list[int]
) -> None:
    tokens = Tokens()
    chunks = history(tokens, lengths, singles=3)
    mine = serial().merge(serials(serial, chunks))
    peers = peer_serial().merge(serials(peer_serial, chunks))
    chunk = [4, 1, 2]
    padding = [4 - c for c in chunk]
    ids = [tokens.take(c) + [0] * p for c, p in zip(chunk, padding, strict=True)]
    queries = [range(c) for c in chunk]
    for cache in (mine, peers):
        cache.prepare(lengths=chunk, right_padding=padding)
    assert real(feed(mine, ids), queries) == real(feed(peers, ids), queries)
    mine.finalize()
    peers.finalize()
    assert offsets(mine) == offsets(peers) == [a + c for a, c in zip(lengths, chunk, strict=True)]
    decode_and_block(tokens, mine, peers, 3, steps=6)


def _padded_run(
    tokens: Tokens, cache: Any, solo: Solo, chunk: list[int], width: int, pieces: list[int]
) -> None:
    """One right-padded run of ``width`` columns fed in ``pieces``; real queries equal."""
    ids = [tokens.take(c) + [0] * (width - c) for c in chunk]
    cache.prepare(lengths=chunk, right_padding=[width - c for c in chunk])
    start = 0
    for piece in pieces:
        part = [row[start : start + piece] for row in ids]
        got = feed(cache, part)
        reals = [row[: max(0, min(piece, c - start))] for row, c in zip(part, chunk, strict=True)]
        assert [g[: len(r)] for g, r in zip(got, reals, strict=True)] == solo.feed(reals)
        start += piece
    cache.finalize()


@pytest.mark.parametrize(("make", "layout"), LAYOUTS, ids=LAYOUT_IDS)
def test_right_padded_runs_match_solo_replay(make: Callable[[], Any], layout: Any) -> None:
    """Every layout forgets its pads exactly, over runs of one or several updates."""
    tokens = Tokens()
    chunks = history(tokens, [8, 2, 0], singles=3)
    cache = layout.from_specs(make().codec_spec, make().token_geometry)
    cache.merge_rows(serials(make, chunks))
    solo = Solo(make, chunks)
    _padded_run(tokens, cache, solo, [4, 1, 2], 4, [4])
    decode_and_block(tokens, cache, solo, 3, steps=2)
    if not isinstance(cache, RingGeometry):
        # A run in two updates (rows 0 and 2 get a pad-only second piece). Rings refuse
        # that for a row holding a full window (the next test).
        _padded_run(tokens, cache, solo, [2, 5, 1], 5, [3, 2])
    decode_and_block(tokens, cache, solo, 3, steps=7, then_block=2)


def test_ring_run_that_would_evict_for_a_pad_is_refused() -> None:
    tokens = Tokens()
    chunks = history(tokens, [2, 1])
    cache = kv.RotatingKVCache.merge(serials(lambda: kv.RotatingKVCache(4), chunks))
    solo = Solo(lambda: kv.RotatingKVCache(4), chunks)
    # Row 1 holds 1 token: its pad-only second piece is fine.
    _padded_run(tokens, cache, solo, [4, 1], 4, [2, 2])
    # Row 0 now holds a full window: a pad-only piece would evict one of its tokens.
    ids = [[*tokens.take(1), 0], tokens.take(2)]
    cache.prepare(lengths=[1, 4], right_padding=[3, 0])
    feed(cache, ids)
    before = snapshot(cache)
    with pytest.raises(LayoutStateError, match="evict"):
        cache.update_and_fetch(block([[0, 0], [0, 0]]), block([[0, 0], [0, 0]]))
    assert snapshot(cache) == before


def test_prepare_is_validated_and_refusals_change_nothing() -> None:
    tokens = Tokens()
    cache = kv.KVCache.merge(serials(kv.KVCache, history(tokens, [2, 3])))
    before = snapshot(cache)
    for kwargs in (
        {"lengths": [1], "right_padding": [0, 1]},
        {"lengths": [1, 1], "right_padding": [-1, 1]},
        {"right_padding": [0, True]},
        {"right_padding": "01"},
        {"left_padding": [1, 0]},  # rows already hold tokens
    ):
        with pytest.raises((InvalidInputError, LayoutStateError)):
            cache.prepare(**kwargs)
        assert snapshot(cache) == before
    cache.prepare(lengths=[1, 2], right_padding=[1, 0])
    with pytest.raises(LayoutStateError):
        cache.prepare(right_padding=[1, 0])
    with pytest.raises(LayoutStateError):
        cache.merge_rows([kv.KVCache()])
    with pytest.raises(InvalidInputError, match="past"):
        cache.update_and_fetch(block([[0, 0, 0]] * 2), block([[0, 0, 0]] * 2))
    assert snapshot(cache) == before
    cache.finalize()
    cache.finalize()  # a second finalize, like mlx-lm's, does nothing
    shared = kv.RotatingKVCache.merge([kv.RotatingKVCache(4)])
    ring = kv.BatchedRotatingCache(4)
    ring.merge_rows([kv.RotatingKVCache(4), kv.RotatingKVCache(4)])
    ring.prepare(lengths=[1, 0], right_padding=[0, 1])
    with pytest.raises(LayoutStateError, match="one-token"):
        ring.update_and_fetch(block([[1], [2]]), block([[1], [2]]))
    assert shared.batch_size == 1


# -- what else BatchGenerator does with a batch --------------------------------------------


def test_uniform_trim_never_drives_a_row_negative_b4() -> None:
    tokens = Tokens()
    chunks = history(tokens, [3, 7, 1])
    cache = kv.KVCache.merge(serials(kv.KVCache, chunks))
    before = snapshot(cache)
    with pytest.raises(NotTrimmableError):
        cache.trim(3)  # mlx-lm: offsets [0, 4, -2]
    assert snapshot(cache) == before
    assert cache.trim(1) == 1 and cache.row_offsets == (2, 6, 0)


def test_deepcopy_then_filter_both_like_split() -> None:
    tokens = Tokens()
    chunks = history(tokens, [3, 5, 2])
    cache = kv.KVCache.merge(serials(kv.KVCache, chunks))
    other = copy.deepcopy(cache)
    cache.filter([0, 2])
    other.filter([1])
    solo = Solo(kv.KVCache, chunks)
    kept = Solo(kv.KVCache, [chunks[0], chunks[2]])
    decode_and_block(tokens, cache, kept, 2, steps=2)
    solo.keep([1])
    decode_and_block(tokens, other, solo, 1, steps=2)
