"""The paged storages in both implementations, against independent oracles: the contiguous
``KVCache`` / ``BatchedKVCache`` of the same implementation hold the same bytes, so reads,
attention and extracted rows must be equal (bit-exact); refusals change nothing."""

from __future__ import annotations

from typing import Any, Literal

import mlx.core as mx
import numpy as np
import pytest

from kvrows import optimized, reference
from kvrows.conformance.arrays import from_mlx
from kvrows.errors import (
    CorruptStateError,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    PoolExhaustedError,
    SpeculativeRoundError,
)
from kvrows.optimized import paged as opaged
from kvrows.reference import paged as rpaged
from kvrows.schemes import Affine, CodecSpec, Plain, Turbo
from kvrows.validation import KvGeometry

IMPLS = [
    pytest.param((reference, rpaged, np.asarray, lambda a: np.asarray(a)), id="reference"),
    pytest.param((optimized, opaged, mx.array, from_mlx), id="optimized"),
]
CODECS = [Plain(), Affine(bits=4, group_size=32), Turbo(k_bits=8, v_bits=3)]
SERIAL = {"plain": "KVCache", "affine": "QuantizedKVCache", "turbo": "TurboQuantKVCache"}
LAYOUT = {
    "plain": "BatchedKVCache",
    "affine": "BatchedQuantizedKVCache",
    "turbo": "BatchedTurboQuantKVCache",
}
H, D = 2, 64


def _block(rng: np.random.Generator, rows: int, n: int) -> tuple[Any, Any]:
    return (
        rng.standard_normal((rows, H, n, D)).astype(np.float32),
        rng.standard_normal((rows, H, n, D)).astype(np.float32),
    )


def _same(got: Any, want: Any, numpy: Any) -> bool:
    if want is None or got is None:
        return got is None and want is None
    if isinstance(want, tuple):
        return len(got) == len(want) and all(
            _same(g, w, numpy) for g, w in zip(got, want, strict=True)
        )
    return bool(np.array_equal(numpy(got), numpy(want)))


def _flat(planes: Any) -> list[Any]:
    return [planes] if not isinstance(planes, tuple) else [p for q in planes for p in _flat(q)]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.kind)
def test_serial_reads_what_kvcache_reads(impl: Any, codec: CodecSpec) -> None:
    package, module, native, numpy = impl
    rng = np.random.default_rng(1)
    pool = module.BlockPool(codec, block_size=4)
    paged = module.PagedKVCache(pool=pool)
    contiguous = getattr(package, SERIAL[codec.kind])(codec=codec)
    for n in (3, 1, 5, 4, 1):
        k, v = _block(rng, 1, n)
        got = paged.update_and_fetch(native(k), native(v))
        want = contiguous.update_and_fetch(native(k), native(v))
        assert _same(got, want, numpy)
    assert paged.trim(6) == contiguous.trim(6) == 6
    assert paged.block_table == tuple(paged.block_table[:2]) and len(paged.block_table) == 2
    k, v = _block(rng, 1, 2)
    assert _same(
        paged.update_and_fetch(native(k), native(v)),
        contiguous.update_and_fetch(native(k), native(v)),
        numpy,
    )
    for n, array in ((1, False), (3, False), (2, True)):
        want_mask = contiguous.make_mask(n, return_array=array)
        got_mask = paged.make_mask(n, return_array=array)
        if want_mask is None or isinstance(want_mask, str):
            assert got_mask == want_mask
        else:
            assert _same(got_mask, want_mask, numpy)
    pool.check_valid()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", CODECS[:2], ids=lambda c: c.kind)
def test_layout_rows_match_the_contiguous_layout(impl: Any, codec: CodecSpec) -> None:
    """Merge, append, per-row rollback, filter, extract: every row holds what the
    contiguous ragged layout's row holds, and row operations copy no byte."""
    package, module, native, numpy = impl
    rng = np.random.default_rng(2)
    pool = module.BlockPool(codec, block_size=4)
    serial_cls = getattr(package, SERIAL[codec.kind])
    sources_paged, sources_flat = [], []
    for n in (5, 8, 3):
        k, v = _block(rng, 1, n)
        a, b = module.PagedKVCache(pool=pool), serial_cls(codec=codec)
        a.update_and_fetch(native(k), native(v))
        b.update_and_fetch(native(k), native(v))
        sources_paged.append(a)
        sources_flat.append(b)
    paged = module.PagedKvRows(pool=pool)
    flat = getattr(package, LAYOUT[codec.kind])(codec=codec)
    copied = pool.bytes_copied
    paged.merge_rows(sources_paged)
    flat.merge_rows(sources_flat)
    assert pool.bytes_copied == copied
    assert paged.left_pad == flat.left_pad and paged.row_offsets == flat.row_offsets
    k, v = _block(rng, 3, 1)
    assert _same(
        paged.update_and_fetch(native(k), native(v)),
        flat.update_and_fetch(native(k), native(v)),
        numpy,
    )
    assert pool.bytes_copied > copied  # rows 0 and 2 wrote into tails shared with their sources
    paged.spec_round_begin()
    flat.spec_round_begin()
    k, v = _block(rng, 3, 4)
    paged.update_and_fetch(native(k), native(v))
    flat.update_and_fetch(native(k), native(v))
    with pytest.raises(SpeculativeRoundError):
        paged.register_prefix(0, list(range(8)))
    with pytest.raises(SpeculativeRoundError):
        paged.filter_rows([0])
    paged.spec_round_rollback([1, 4, 2])
    flat.spec_round_rollback([1, 4, 2])
    assert paged.row_offsets == flat.row_offsets
    copied = pool.bytes_copied
    paged.filter_rows([2, 0])
    flat.filter_rows([2, 0])
    for row in range(2):
        got, want = paged.extract_row(row), flat.extract_row(row)
        assert got.offset == want.offset
        assert _same(got.planes(), want.planes(), numpy)
    assert pool.bytes_copied == copied
    with pytest.raises(NotTrimmableError):
        paged.trim_rows([0, 99])
    paged.trim_rows([1, 0])
    flat.trim_rows([1, 0])
    for row in range(2):
        assert _same(paged.row_window(row), flat.extract_row(row).planes(), numpy)
    pool.check_valid()


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_over_the_layout_equals_the_contiguous_layout(impl: Any) -> None:
    package, module, native, numpy = impl
    rng = np.random.default_rng(3)
    pool = module.BlockPool(block_size=4)
    paged, flat = module.PagedKvRows(pool=pool), package.BatchedKVCache()
    rows_p, rows_f = [], []
    for n in (6, 2):
        k, v = _block(rng, 1, n)
        a, b = module.PagedKVCache(pool=pool), package.KVCache()
        a.update_and_fetch(native(k), native(v))
        b.update_and_fetch(native(k), native(v))
        rows_p.append(a)
        rows_f.append(b)
    paged.merge_rows(rows_p)
    flat.merge_rows(rows_f)
    queries = native(rng.standard_normal((2, H, 3, D)).astype(np.float32))
    mask_p, mask_f = paged.make_mask(3), flat.make_mask(3)
    k, v = _block(rng, 2, 3)
    paged.update_and_fetch(native(k), native(v))
    flat.update_and_fetch(native(k), native(v))
    got = package.attend(queries, paged, mask_p, 0.125)
    want = package.attend(queries, flat, mask_f, 0.125)
    assert _same(got, want, numpy)


@pytest.mark.parametrize("impl", IMPLS)
def test_prefix_sharing_holds_a_shared_prompt_once(impl: Any) -> None:
    _, module, native, numpy = impl
    rng = np.random.default_rng(4)
    pool = module.BlockPool(block_size=4)
    system = list(range(100, 112))  # three full blocks
    first = module.PagedKVCache(pool=pool)
    k, v = _block(rng, 1, 14)
    first.update_and_fetch(native(k), native(v))
    assert pool.lookup_prefix([*system, 7, 8]) is None  # nothing published yet
    assert first.register_prefix([*system, 1, 2]) == 3
    hit = pool.lookup_prefix([*system, 7, 8])
    assert hit is not None and hit.offset == 12
    assert hit.block_table == first.block_table[:3]
    assert all(pool.ledger.ref(b) == 2 for b in hit.block_table)
    assert _same(
        hit.planes(), tuple(tuple(p[:, :, :12] for p in side) for side in first.planes()), numpy
    )
    exact = pool.lookup_prefix(system)  # capped at len - 1: the last block is recomputed
    assert exact is not None and exact.offset == 8
    with pytest.raises(InvalidInputError):
        first.register_prefix(list(range(15)))  # more ids than positions
    written = pool.bytes_written
    k, v = _block(rng, 1, 1)
    hit.update_and_fetch(native(k), native(v))  # a fresh tail block, the shared ones untouched
    assert pool.bytes_written - written == pool.token_bytes and pool.bytes_copied == 0
    prefix = first.block_table[:3]
    for cache in (first, hit, exact):
        cache.release()
    pool.check_valid()
    assert pool.ledger.referenced_count == 0 and pool.ledger.cached_count == 3
    # Released tail first: the cached blocks are evicted tail first, after every block
    # that caches nothing.
    order = pool.ledger.free_order()
    cached = [b for b in order if pool.ledger.hash_of(b) is not None]
    assert cached == [prefix[2], prefix[1], prefix[0]]
    assert order[-3:] == tuple(cached)
    taken = pool.ledger.allocate(len(order) - 2)  # takes every uncached block, then evicts
    assert pool.ledger.hash_of(prefix[2]) is None and prefix[2] in taken
    assert pool.ledger.cached_count == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_pool_exhaustion_changes_nothing(impl: Any) -> None:
    _, module, native, _ = impl
    rng = np.random.default_rng(5)
    geometry = KvGeometry(H, D, D, "float32")
    per_block = 4 * 2 * H * D * 4
    pool = module.BlockPool(block_size=4, num_blocks=2, max_bytes=3 * per_block, geometry=geometry)
    cache = module.PagedKVCache(pool=pool)
    k, v = _block(rng, 1, 10)
    cache.update_and_fetch(native(k), native(v))
    assert pool.num_blocks == 3
    before = (cache.offset, cache.block_table, pool.ledger.free_order(), pool.bytes_written)
    k, v = _block(rng, 1, 3)
    with pytest.raises(PoolExhaustedError):
        cache.update_and_fetch(native(k), native(v))
    assert (cache.offset, cache.block_table, pool.ledger.free_order(), pool.bytes_written) == before
    pool.check_valid()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", (False, True), ids=("serial", "layout"))
def test_a_paged_storage_holds_one_stage(impl: Any, layout: bool) -> None:
    """Stages (the delayed modifier's hook, contract §0.5) are refused by the paged
    placement before anything changes: a conversion would re-encode the rows but not the
    pool's blocks the reads gather from."""
    _, module, native, numpy = impl
    rng = np.random.default_rng(6)
    cache = module.PagedKvRows() if layout else module.PagedKVCache()
    if layout:
        serial = module.PagedKVCache(pool=cache.pool)
        k, v = _block(rng, 1, 5)
        serial.update_and_fetch(native(k), native(v))
        cache.merge_rows([serial])
    else:
        k, v = _block(rng, 1, 5)
        cache.update_and_fetch(native(k), native(v))
    before = cache.fetch()
    with pytest.raises(LayoutStateError, match="holds one stage"):
        cache._use_stages((Plain(), Affine(bits=4, group_size=32)))
    assert cache.stages == (Plain(),) and _same(cache.fetch(), before, numpy)
    empty = module.PagedKVCache()
    empty._use_stages((Plain(),))  # one stage: its own codec, taken
    assert empty.stages == (Plain(),) and empty.codec_spec == Plain()


def _accounting(pool: Any) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was in a pool."""
    ledger = pool.ledger
    return (
        pool.geometry, ledger.num_blocks, ledger.free_order(), ledger.held_count,
        [ledger.ref(b) for b in range(ledger.num_blocks)], ledger.cached_count,
        len(pool.live_tables()), pool.bytes_written, pool.bytes_copied,
    )  # fmt: skip


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("declared", [True, False], ids=["geometry", "no-geometry"])
def test_a_refused_first_append_opens_no_table(impl: Any, declared: bool) -> None:
    """The first append of a block that does not fit is refused before any table opens
    (and before a pool without geometry learns one): the cache still holds no row, and
    the next block sets ``B``."""
    _, module, native, _ = impl
    rng = np.random.default_rng(9)
    per_block = 4 * 2 * H * D * 4
    geometry = KvGeometry(H, D, D, "float32") if declared else None
    pool = module.BlockPool(block_size=4, max_bytes=2 * per_block, geometry=geometry)
    cache = module.PagedKVCache(pool=pool)
    before = _accounting(pool)
    k, v = _block(rng, 1, 9)  # 3 blocks
    with pytest.raises(PoolExhaustedError):
        cache.update_and_fetch(native(k), native(v))
    fresh = module.PagedKVCache(pool=pool)
    assert (cache.rows, cache.offset, repr(cache)) == (0, 0, repr(fresh))
    assert _accounting(pool) == before
    k, v = _block(rng, 2, 3)  # two rows of one block each: fits
    cache.update_and_fetch(native(k), native(v))
    assert (cache.rows, cache.offset) == (2, 3)
    pool.check_valid()


@pytest.mark.parametrize("impl", IMPLS)
def test_a_refused_verify_block_keeps_the_round(impl: Any) -> None:
    """An exhausted pool refuses a round's verify block with nothing changed and the round
    still open before its block: a shorter block then goes in and the round resolves."""
    _, module, native, numpy = impl
    rng = np.random.default_rng(10)
    per_block = 4 * 2 * H * D * 4
    pool = module.BlockPool(block_size=4, max_bytes=5 * per_block)
    rows = [module.PagedKVCache(pool=pool) for _ in range(2)]
    for cache, n in zip(rows, (5, 2), strict=True):
        cache.update_and_fetch(*(native(x) for x in _block(rng, 1, n)))
    layout = module.PagedKvRows(pool=pool)
    layout.merge_rows(rows)  # 3 blocks held, 2 more may grow
    for resolve in ("rollback", "commit"):
        layout.spec_round_begin()
        before, held = _accounting(pool), (layout.row_offsets, repr(layout))
        fetched = layout.fetch()
        k, v = _block(rng, 2, 8)  # 4 new blocks (and, while shared, 2 tails copied)
        with pytest.raises(PoolExhaustedError):
            layout.update_and_fetch(native(k), native(v))
        assert _accounting(pool) == before and (layout.row_offsets, repr(layout)) == held
        assert layout.spec_round_open and _same(layout.fetch(), fetched, numpy)
        with pytest.raises(SpeculativeRoundError):  # the round still waits for its block
            layout.spec_round_commit()
        k, v = _block(rng, 2, 1)
        layout.update_and_fetch(native(k), native(v))
        if resolve == "rollback":
            layout.spec_round_rollback(1)
        else:
            layout.spec_round_commit()
        assert not layout.spec_round_open and layout.row_offsets == (
            (6, 3) if resolve == "rollback" else (7, 4)
        )
        for cache in rows:  # the second pass: the layout's tails are its own now
            cache.release()
        rows = []
    pool.check_valid()


@pytest.mark.parametrize("impl", IMPLS)
def test_refused_copies_into_a_pool_change_nothing(impl: Any) -> None:
    """A merge of another pool's rows and a state loaded into a given pool take every block
    first: past the byte limit they are refused with the pool as it was (a pool without
    geometry does not learn one, no table is left open)."""
    _, module, native, _ = impl
    from kvrows.paged_forms import restore_state

    rng = np.random.default_rng(11)
    per_block = 4 * 2 * H * D * 4
    other = module.BlockPool(block_size=4)
    sources = [module.PagedKVCache(pool=other) for _ in range(2)]
    for cache in sources:
        cache.update_and_fetch(*(native(x) for x in _block(rng, 1, 6)))  # 2 blocks each
    tight = module.BlockPool(block_size=4, max_bytes=3 * per_block)
    layout = module.PagedKvRows(pool=tight)
    before = _accounting(tight)
    with pytest.raises(PoolExhaustedError):
        layout.merge_rows(sources)
    assert _accounting(tight) == before and layout.batch_size == 0
    state = module.PagedKvRows.from_state(_merged(module, sources).state).state
    with pytest.raises(PoolExhaustedError):
        restore_state(module.PagedKvRows, state, None, tight)
    assert _accounting(tight) == before
    layout.merge_rows(sources[:1])  # one row fits
    assert layout.row_offsets == (6,) and tight.geometry is not None
    tight.check_valid()


def _merged(module: Any, sources: list[Any]) -> Any:
    layout = module.PagedKvRows(block_size=4)
    layout.merge_rows(sources)
    return layout


@pytest.mark.parametrize("impl", IMPLS)
def test_merges_copy_foreign_pools_and_refuse_contiguous_rows(impl: Any) -> None:
    package, module, native, numpy = impl
    rng = np.random.default_rng(6)
    home, other = module.BlockPool(block_size=4), module.BlockPool(block_size=4)
    k, v = _block(rng, 1, 6)
    mine, theirs = module.PagedKVCache(pool=home), module.PagedKVCache(pool=other)
    mine.update_and_fetch(native(k), native(v))
    theirs.update_and_fetch(native(k), native(v))
    layout = module.PagedKvRows(pool=home)
    layout.merge_rows([mine, theirs])
    assert home.bytes_copied == 6 * home.token_bytes  # the foreign row, not the own one
    assert _same(layout.row_window(0), layout.row_window(1), numpy)
    flat = package.KVCache()
    flat.update_and_fetch(native(k), native(v))
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([flat])
    assert layout.batch_size == 2
    private = module.PagedKVCache()  # a private pool, made on its first write
    private.update_and_fetch(native(k), native(v))
    assert private.pool is not None and private.pool is not home


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.kind)
def test_state_round_trip_is_bit_exact_and_corrupt_states_are_refused(
    impl: Any, codec: CodecSpec
) -> None:
    _, module, native, numpy = impl
    rng = np.random.default_rng(7)
    pool = module.BlockPool(codec, block_size=4)
    cache = module.PagedKVCache(pool=pool)
    k, v = _block(rng, 1, 7)
    cache.update_and_fetch(native(k), native(v))
    loaded = module.PagedKVCache.from_state(cache.state)
    assert loaded.offset == 7 and loaded.pool is not pool
    assert _same(loaded.planes(), cache.planes(), numpy)
    assert _same(loaded.fetch(), cache.fetch(), numpy)
    other = module.PagedKVCache(pool=module.BlockPool(codec, block_size=4))
    other.update_and_fetch(*(native(x) for x in _block(rng, 1, 3)))
    layout = module.PagedKvRows(pool=pool)
    layout.merge_rows([cache, module.PagedKVCache(pool=pool)])
    layout.merge_rows([other])
    restored = module.PagedKvRows.from_state(layout.state)
    assert restored.row_offsets == layout.row_offsets
    for row in range(3):
        assert _same(restored.row_window(row), layout.row_window(row), numpy)
    state = list(cache.state)
    for corrupt in (
        (*state[:2], 8, *state[3:]),  # offset past the planes
        (*state[:4], (1, 3, 7)),  # a codec that does not exist (affine 3 bits)
        (*state[:4], "plain"),  # not a (kind, a, b) field
        (*state[:3], 0, state[4]),  # block size 0
        (state[1], state[0], *state[2:]) if codec.kind == "turbo" else tuple(state[:4]),
    ):
        with pytest.raises(CorruptStateError):
            module.PagedKVCache.from_state(corrupt)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_state_loads_into_a_given_pool(impl: Any) -> None:
    """``from_state(state, pool=pool)``: the rows in fresh blocks of that pool (serial and
    layout), read as saved; a pool of another block size is refused, and one too small
    refuses with every count as it was."""
    _, module, native, numpy = impl
    rng = np.random.default_rng(11)
    pool = module.BlockPool(block_size=4)
    rows = [module.PagedKVCache(pool=pool) for _ in range(2)]
    for row, n in zip(rows, (7, 3), strict=True):
        row.update_and_fetch(*(native(x) for x in _block(rng, 1, n)))
    layout = module.PagedKvRows(pool=pool)
    layout.merge_rows(rows)
    into = module.BlockPool(block_size=4)
    for cache, cls in ((rows[0], module.PagedKVCache), (layout, module.PagedKvRows)):
        loaded = cls.from_state(cache.state, pool=into)
        assert loaded.pool is into and repr(loaded) == repr(cache)
        assert _same(loaded.fetch(), cache.fetch(), numpy)
        into.check_valid()
    with pytest.raises(CorruptStateError, match="not the pool's"):
        module.PagedKVCache.from_state(rows[0].state, pool=module.BlockPool(block_size=8))
    per_block = 4 * 2 * H * D * 4
    small = module.BlockPool(block_size=4, max_bytes=2 * per_block)
    before = _accounting(small)
    with pytest.raises(PoolExhaustedError):
        module.PagedKvRows.from_state(layout.state, pool=small)  # 2 + 1 blocks
    assert _accounting(small) == before


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bits", [3, 5, 6])
def test_states_of_codes_that_cross_words_round_trip(impl: Any, bits: int) -> None:
    """Affine codes of 3, 5 and 6 bits are packed across uint32 words: a state's key width
    is ``words * 32 / bits``, not ``words * (32 // bits)``."""
    _, module, native, numpy = impl
    codec = Affine(bits=bits, group_size=32)
    cache = module.PagedKVCache(pool=module.BlockPool(codec, block_size=4))
    cache.update_and_fetch(*(native(x) for x in _block(np.random.default_rng(12), 1, 5)))
    loaded = module.PagedKVCache.from_state(cache.state)
    assert loaded.geometry == cache.geometry == KvGeometry(H, D, D, "float32")
    assert _same(loaded.planes(), cache.planes(), numpy)


@pytest.mark.parametrize("impl", IMPLS)
def test_invalid_arguments_are_refused(impl: Any) -> None:
    _, module, native, _ = impl
    pool = module.BlockPool(block_size=4)
    with pytest.raises(InvalidInputError):
        module.PagedKVCache(pool=pool, block_size=8)
    with pytest.raises(InvalidInputError):
        module.PagedKVCache(pool=pool, codec=Affine(bits=4, group_size=32))
    with pytest.raises(InvalidInputError):
        module.PagedKVCache(4)
    cache = module.PagedKVCache(pool=pool)
    two = native(np.ones((2, H, 5, D), np.float32))
    cache.update_and_fetch(two, two)  # shape-generic in B: one table per row
    assert cache.rows == 2 and pool.bytes_written == 2 * 5 * pool.token_bytes
    with pytest.raises(LayoutStateError):  # a prefix is one request's
        cache.register_prefix([1, 2, 3, 4])
    with pytest.raises(InvalidInputError):  # B is fixed by the first block
        one = native(np.ones((1, H, 1, D), np.float32))
        cache.update_and_fetch(one, one)
    assert cache.offset == 5
    assert module.PagedKvRows(pool=pool).projected_bytes(5) == 2 * 4 * pool.token_bytes


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.kind)
def test_prompt_cache_files_round_trip(tmp_path: Any, codec: CodecSpec) -> None:
    from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache

    rng = np.random.default_rng(8)
    pool = opaged.BlockPool(codec, block_size=4)
    cache = opaged.PagedKVCache(pool=pool)
    k, v = _block(rng, 1, 9)
    cache.update_and_fetch(mx.array(k), mx.array(v))
    layout = opaged.PagedKvRows(pool=pool)
    layout.merge_rows([cache, opaged.PagedKVCache(pool=pool)])
    path = tmp_path / "paged.safetensors"
    save_prompt_cache(path, [cache, layout])
    held, row = cache.planes(), layout.row_window(0)
    assert held is not None and row is not None
    impls: tuple[tuple[Literal["optimized", "reference"], Any], ...] = (
        ("optimized", from_mlx),
        ("reference", np.asarray),
    )
    for implementation, numpy in impls:
        serial, rows = load_prompt_cache(path, implementation=implementation)
        assert serial.offset == 9 and rows.row_offsets == (9, 0)
        assert _same(
            serial.planes(),
            tuple(tuple(from_mlx(p) for p in side) for side in held),
            numpy,
        )
        assert _same(
            rows.row_window(0),
            tuple(tuple(from_mlx(p) for p in side) for side in row),
            numpy,
        )


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.kind)
@pytest.mark.parametrize("name", ["PagedKVCache", "PagedRotatingKVCache"])
def test_rows_trimmed_to_nothing_keep_their_count_and_geometry(
    tmp_path: Any, codec: CodecSpec, name: str
) -> None:
    """A serial cache of two rows trimmed to no token saves zero-width planes: loaded (in
    memory, across implementations and from a prompt-cache file) it still holds two rows
    of that geometry, so a block of another row count or head width is refused as the
    cache itself refuses it (a state of no planes loaded as a fresh cache of any ``B``)."""
    from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache

    rng = np.random.default_rng(12)
    impls: dict[Literal["optimized", "reference"], tuple[Any, Any]] = {
        "reference": (reference, np.asarray),
        "optimized": (optimized, mx.array),
    }
    sources = {}
    args = (8,) if name == "PagedRotatingKVCache" else ()  # max_size
    for impl_name, (module, native) in impls.items():
        cache = getattr(module, name)(*args, pool=module.BlockPool(codec, block_size=4))
        cache.update_and_fetch(*(native(x) for x in _block(rng, 2, 5)))
        cache.trim(5)
        sources[impl_name] = cache
    path = tmp_path / "empty.safetensors"
    save_prompt_cache(path, [sources["optimized"]])
    half = list(sources["reference"].state)
    half[1] = None  # keys' zero-width planes without the values'
    with pytest.raises(CorruptStateError, match="both"):
        getattr(reference, name).from_state(tuple(half))

    def converted(value: Any, native: Any) -> Any:
        if isinstance(value, tuple | list):
            return type(value)(converted(v, native) for v in value)
        is_array = isinstance(value, np.ndarray | mx.array)
        return native(np.array(value)) if is_array else value

    loads = [
        getattr(module, name).from_state(converted(sources[source].state, native))
        for source in impls
        for module, native in impls.values()
    ]
    loads += [load_prompt_cache(path, implementation=impl)[0] for impl in impls]
    for cache in [*sources.values(), *loads]:
        native = np.asarray if isinstance(cache, getattr(reference, name)) else mx.array
        assert cache.offset == 0
        refused = [(3, D)]  # TurboQuant's planes do not carry the activations' dtype: a
        if codec.dtype_plane is not None or cache in sources.values():  # load learns none
            assert cache.geometry == KvGeometry(H, D, D, "float32")
            refused.append((2, D // 2))
        for rows, dim in refused:
            block = native(np.zeros((rows, H, 1, dim), np.float32))
            with pytest.raises(InvalidInputError):
                cache.update_and_fetch(block, block)
        cache.update_and_fetch(*(native(x) for x in _block(rng, 2, 1)))
        assert cache.offset == 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["PagedKVCache", "PagedKvRows"])
def test_bits_and_group_size_follow_the_codec(impl: Any, name: str) -> None:
    """mlx-lm's attention takes the quantized path iff the cache has ``bits``: a paged
    preset of any codec answers them for an affine pool only (``AnyCodecParameters``)."""
    _, module, _, _ = impl
    cls = getattr(module, name)
    affine = cls(codec=Affine(bits=4, group_size=32))
    assert (affine.bits, affine.group_size) == (4, 32)
    for codec in (Plain(), Turbo(k_bits=8, v_bits=3)):
        cache = cls(codec=codec)
        assert not hasattr(cache, "bits") and not hasattr(cache, "group_size")
