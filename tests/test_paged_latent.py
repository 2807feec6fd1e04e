"""``PagedLatentCache`` (``spec/PagedLatentCache.md``): MLA latent planes in a block pool.

Oracles: ``MLACache`` of the same implementation given the same tokens and row
operations (every read bit-exact), the pool's ledger (counts, invariants, bytes copied),
mlx-lm's own caches in the MLA models (logits bit for bit), the saved cache (round trip).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.conformance.arrays import as_numpy
from kvrows.errors import (
    CorruptStateError,
    IncompatibleRowsError,
    InvalidInputError,
    PoolExhaustedError,
    SpeculativeRoundError,
)
from kvrows.latent import PAGED_LATENT_FIELDS, latent_token_bytes
from kvrows.schemes import Affine, Turbo

IMPLS = [ref, opt]
IDS = ["reference", "optimized"]
WIDTHS = (64, 16, 32)  # kv_lora_rank, rope_head_dim, index_head_dim


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _native(impl: Any) -> Callable[[Any], Any]:
    return (lambda a: a) if impl is ref else mx.array


class Twins:
    """A paged cache and an ``MLACache`` driven alike; every read compared bit for bit."""

    def __init__(self, impl: Any, paged: Any, mla: Any, rng: np.random.Generator) -> None:
        self.impl, self.paged, self.mla, self.rng = impl, paged, mla, rng

    def append(self, n: int) -> None:
        rows = max(1, self.mla.batch_size)
        blocks = [self.rng.standard_normal((rows, 1, n, w)).astype(np.float32) for w in WIDTHS]
        native = _native(self.impl)
        got = self.paged.append(*(native(b) for b in blocks))
        want = self.mla.append(*(native(b) for b in blocks))
        self.same(got, want)

    def same(self, got: Any = None, want: Any = None) -> None:
        paged, mla = self.paged, self.mla
        assert (paged.row_offsets, paged.left_pad) == (mla.row_offsets, mla.left_pad)
        assert paged.converted == mla.converted
        paged.check_valid()
        if paged.pool is not None:
            paged.pool.check_valid()
        if not mla.width:
            return
        got = got or paged.current()
        want = want or mla.current()
        for g, w in zip(got, want, strict=True):
            for b, pad in enumerate(mla.left_pad):  # padding columns are unspecified
                assert np.array_equal(as_numpy(g)[b, :, pad:], as_numpy(w)[b, :, pad:])
        mask = (paged.make_mask(2, return_array=True), mla.make_mask(2, return_array=True))
        assert as_numpy(mask[0]).tolist() == as_numpy(mask[1]).tolist()


def _requests(impl: Any, pool: Any, prompts: tuple[int, ...], seed: int = 0) -> list[Twins]:
    rng = np.random.default_rng(seed)
    out = []
    for n in prompts:
        twins = Twins(impl, impl.PagedLatentCache(*WIDTHS, pool=pool), impl.MLACache(*WIDTHS), rng)
        if n:
            twins.append(n)
        out.append(twins)
    return out


def _merged(rows: list[Twins]) -> Twins:
    paged = rows[0].paged.make_empty_batch()
    paged.merge_rows([r.paged for r in rows])
    mla = rows[0].mla.make_empty_batch()
    mla.merge_rows([r.mla for r in rows])
    return Twins(rows[0].impl, paged, mla, rows[0].rng)


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_rows_equal_mla_cache_and_move_no_byte(impl: Any) -> None:
    pool = impl.LatentBlockPool(block_size=3, index_head_dim=WIDTHS[2])
    rows = _requests(impl, pool, (5, 2, 0, 7))
    written = pool.bytes_written
    layout = _merged(rows)
    assert pool.bytes_copied == 0 and pool.bytes_written == written  # tables shared
    assert layout.paged.projected_bytes(5) == 6 * sum(WIDTHS) * 4  # whole blocks
    assert layout.paged.nbytes == (2 + 1 + 0 + 3) * pool.bytes_per_block
    assert layout.paged.block_tables()[:2] == (rows[0].paged.block_tables()[0],
                                               rows[1].paged.block_tables()[0])  # fmt: skip
    layout.same()
    for n in (1, 2):
        layout.append(n)
    # rows 0 and 1 shared partly filled tails with their requests: copied on write, once each
    assert pool.bytes_copied == (5 % 3 + 2 % 3 + 7 % 3) * pool.token_bytes
    for twins in rows:  # the requests never see the layout's writes
        twins.same()
    for keep in ([1, 3, 2, 3], [2, 2, 2, 2]):  # a ragged rollback, then a uniform one
        layout.paged.spec_round_begin()
        layout.mla.spec_round_begin()
        layout.append(3)
        copied = pool.bytes_copied
        layout.paged.spec_round_rollback(keep)
        layout.mla.spec_round_rollback(keep)
        assert pool.bytes_copied == copied
        layout.same()
    copied = pool.bytes_copied
    layout.paged.filter_rows([2, 0, 3])
    layout.mla.filter_rows([2, 0, 3])
    layout.same()
    extracted = Twins(impl, layout.paged.extract_row(1), layout.mla.extract_row(1), layout.rng)
    extracted.same()
    assert extracted.paged.block_tables()[0] == layout.paged.block_tables()[1]
    assert pool.bytes_copied == copied  # filter and extract edit tables only
    layout.paged.trim_rows([1, 0, 2])
    layout.mla.trim_rows([1, 0, 2])
    layout.same()
    extracted.append(2)
    layout.append(1)  # the shared row diverged: each wrote its own tail
    layout.same()
    extracted.same()
    held = pool.ledger.referenced_count
    for twins in (*rows, layout, extracted):
        twins.paged.release()
    assert pool.ledger.referenced_count == 0 < held
    pool.check_valid()


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_rows_of_other_pools_are_copied_and_nothing_changes_when_refused(impl: Any) -> None:
    a, b = (impl.LatentBlockPool(block_size=2, index_head_dim=WIDTHS[2]) for _ in range(2))
    rows = _requests(impl, a, (3,)) + _requests(impl, b, (4,), seed=1)
    layout = _merged(rows)
    assert a.bytes_copied == 4 * a.token_bytes and b.bytes_copied == 0
    layout.same()
    layout.append(1)
    other_size = impl.PagedLatentCache(*WIDTHS, block_size=4)
    other_size.append(*(_native(impl)(np.zeros((1, 1, 1, w), np.float32)) for w in WIDTHS))
    empty = layout.paged.make_empty_batch()
    held = [a.ledger.ref(block) for block in range(a.num_blocks)]
    with pytest.raises(IncompatibleRowsError):
        empty.merge_rows([rows[0].paged, other_size])
    assert empty.batch_size == 0 and [a.ledger.ref(x) for x in range(a.num_blocks)] == held
    with pytest.raises(InvalidInputError):
        impl.PagedLatentCache(*WIDTHS, pool=a, block_size=4)
    with pytest.raises(InvalidInputError):
        impl.PagedLatentCache(64, 16, None, pool=a)  # the pool holds index planes
    half = _native(impl)(np.zeros((1, 1, 1, 64), np.float16))
    fresh = impl.PagedLatentCache(*WIDTHS, pool=a)
    assert fresh.dtype == "float32"  # the pool's widths and dtype are the cache's
    with pytest.raises(InvalidInputError):
        fresh.append(half, half[..., :16], half[..., :32])
    assert fresh.batch_size == 0


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_an_exhausted_pool_refuses_with_nothing_changed(impl: Any) -> None:
    per_block = 2 * (64 + 16 + 32) * 4  # two float32 tokens of latent, rope and index
    pool = impl.LatentBlockPool(block_size=2, index_head_dim=WIDTHS[2], max_bytes=3 * per_block)
    twins = _requests(impl, pool, (3,))[0]
    before = as_numpy(twins.paged.current()[0])
    with pytest.raises(PoolExhaustedError):
        twins.append(4)  # 7 tokens need 4 blocks
    assert twins.paged.row_offsets == (3,) and np.array_equal(
        as_numpy(twins.paged.current()[0]), before
    )
    assert pool.bytes_per_block == per_block
    pool.check_valid()


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_an_exhausted_pool_refuses_a_first_append_and_a_verify_block(impl: Any) -> None:
    """A pool without widths refuses a first append past its byte limit before it learns
    them and before the cache takes a row; in a round the refused block leaves the round
    open before its block (a shorter block then goes in and commits)."""
    per_block = 2 * (64 + 16 + 32) * 4
    pool = impl.LatentBlockPool(block_size=2, index_head_dim=WIDTHS[2], max_bytes=3 * per_block)
    twins = _requests(impl, pool, (0,))[0]
    with pytest.raises(PoolExhaustedError):
        twins.append(7)  # 4 blocks (the paged cache refuses before its twin appends)
    assert (twins.paged.batch_size, pool.geometry, pool.live_tables()) == (0, None, ())
    twins.append(3)
    twins.paged.spec_round_begin()
    twins.mla.spec_round_begin()
    held = (pool.ledger.free_order(), pool.num_blocks, twins.paged.block_tables())
    with pytest.raises(PoolExhaustedError):
        twins.append(4)  # 4 blocks in all, the limit is 3
    assert (pool.ledger.free_order(), pool.num_blocks, twins.paged.block_tables()) == held
    assert twins.paged.spec_round_open
    twins.same()
    twins.append(1)
    twins.paged.spec_round_commit()
    twins.mla.spec_round_commit()
    twins.same()


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_prefix_blocks_are_hashed_and_shared(impl: Any) -> None:
    pool = impl.LatentBlockPool(block_size=2, index_head_dim=WIDTHS[2])
    twins = _requests(impl, pool, (5,))[0]
    ids = [3, 1, 4, 1, 5]
    assert twins.paged.register_prefix(0, ids) == 2
    hit = pool.lookup_prefix([*ids[:4], 9])
    assert hit is not None and hit.row_offsets == (4,)
    assert hit.block_tables()[0] == twins.paged.block_tables()[0][:2]
    for got, want in zip(hit.current(), twins.paged.current(), strict=True):
        assert np.array_equal(as_numpy(got), as_numpy(want)[:, :, :4])
    assert pool.lookup_prefix([7, 7, 7]) is None
    twins.paged.spec_round_begin()
    with pytest.raises(SpeculativeRoundError):
        twins.paged.register_prefix(0, ids)


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_state_round_trip_and_refusals(impl: Any, tmp_path: Path) -> None:
    from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache

    pool = impl.LatentBlockPool(block_size=3, index_head_dim=WIDTHS[2])
    layout = _merged(_requests(impl, pool, (5, 2, 0)))
    state = layout.paged.state
    assert len(state) == len(PAGED_LATENT_FIELDS) and state[-1] == 3
    back = Twins(impl, impl.PagedLatentCache.from_state(state), layout.mla, layout.rng)
    back.same()
    assert back.paged.pool is not pool and back.paged.block_size == 3
    back.append(2)  # it continues as the saved cache would
    layout.paged.state = back.paged.state  # the setter: into the cache's own pool
    Twins(impl, layout.paged, layout.mla, layout.rng).same()
    assert layout.paged.pool is pool
    tight = impl.LatentBlockPool(block_size=3, index_head_dim=WIDTHS[2], max_bytes=1)
    with pytest.raises(PoolExhaustedError):
        impl.PagedLatentCache.from_state(state, pool=tight)
    tight.check_valid()
    assert tight.ledger.referenced_count == 0
    ints = (lambda v: np.array(v, np.int32)) if impl is ref else (lambda v: mx.array(v, mx.int32))
    fields = dict(zip(PAGED_LATENT_FIELDS, state, strict=True))
    for bad in (
        {"block_size": 0},
        {"offset": ints([5, 2, 9])},
        {"bits": 4, "group_size": 32},
        {"latent": (fields["latent"][0], fields["latent"][0])},
        {"rope": fields["index"]},
    ):
        corrupt = tuple({**fields, **bad}[name] for name in PAGED_LATENT_FIELDS)
        with pytest.raises(InvalidInputError):
            impl.PagedLatentCache.from_state(corrupt)
    before = layout.paged.row_offsets
    with pytest.raises(InvalidInputError):
        layout.paged.state = impl.MLACache(*WIDTHS).state  # another form: unchanged
    assert layout.paged.row_offsets == before
    if impl is opt:  # prompt-cache files (MLX arrays)
        path = tmp_path / "paged_latent.safetensors"
        save_prompt_cache(path, [layout.paged])
        for implementation in ("optimized", "reference"):
            loaded = load_prompt_cache(path, implementation=implementation)[0]
            assert loaded.row_offsets == layout.paged.row_offsets
            for got, want in zip(loaded.current(), layout.paged.current(), strict=True):
                for b, pad in enumerate(layout.paged.left_pad):
                    assert np.array_equal(as_numpy(got)[b, :, pad:], as_numpy(want)[b, :, pad:])
        data = bytearray(path.read_bytes())
        data[-20] ^= 0x01
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptStateError):
            load_prompt_cache(path)


@pytest.mark.parametrize(
    ("codec", "start"),
    [(Affine(bits=4, group_size=32), 3), (Turbo(k_bits=8, v_bits=3), 0)],
    ids=["affine4-start3", "turbo3-start0"],
)
@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_an_encoded_latent_equals_encoded_latent_cache(impl: Any, codec: Any, start: int) -> None:
    """The latent through a codec, bf16-first at ``start``: every read, converted flag and
    saved state as ``EncodedLatentCache``'s; the blocks hold codes, the warm-up exact
    latent lives beside the pool only while a row reads exact."""
    pool = impl.LatentBlockPool(codec, block_size=3, index_head_dim=WIDTHS[2])
    rng = np.random.default_rng(3)
    rows = []
    for n in (5, 2, 0, 1):
        paged = impl.PagedLatentCache(*WIDTHS, pool=pool, codec=codec, start=start)
        twins = Twins(impl, paged, impl.EncodedLatentCache(*WIDTHS, codec=codec, start=start), rng)
        if n:
            twins.append(n)
        rows.append(twins)
    assert rows[0].paged.signature() == f"kv:mla-paged:target:dsa:{codec.key}:{start}"
    layout = _merged(rows)
    layout.same()
    for step in (1, 2):
        layout.append(step)
    layout.paged.spec_round_begin()
    layout.mla.spec_round_begin()
    layout.append(3)
    layout.paged.spec_round_rollback([1, 3, 2, 1])
    layout.mla.spec_round_rollback([1, 3, 2, 1])
    layout.same()
    assert any(layout.paged.converted)
    layout.paged.filter_rows([3, 1])
    layout.mla.filter_rows([3, 1])
    layout.same()
    extracted = Twins(impl, layout.paged.extract_row(1), layout.mla.extract_row(1), layout.rng)
    extracted.same()
    extracted.append(1)
    back = Twins(impl, impl.PagedLatentCache.from_state(layout.paged.state), layout.mla, rng)
    back.same()
    back.append(2)
    with pytest.raises(InvalidInputError):
        impl.PagedLatentCache(*WIDTHS, pool=pool)  # the pool stores the encoded latent
    plain = impl.PagedLatentCache(*WIDTHS, pool=impl.LatentBlockPool(index_head_dim=WIDTHS[2]))
    with pytest.raises(IncompatibleRowsError):
        layout.paged.make_empty_batch().merge_rows([plain])
    later = impl.PagedLatentCache(*WIDTHS, pool=pool, codec=codec, start=start + 1)
    with pytest.raises(IncompatibleRowsError):  # the pool's codec, another bf16-first start
        layout.paged.make_empty_batch().merge_rows([later])


# -- an encoded latent's warm rows: a contiguous stage 0 beside the pool --------------------

AFFINE = Affine(bits=4, group_size=32)


def _flat(value: Any) -> list[Any]:
    """A saved state's fields as host values (arrays as NumPy), tuples flattened."""
    if value is None or isinstance(value, int | str):
        return [value]
    if isinstance(value, tuple | list):
        return [v for item in value for v in _flat(item)]
    return [as_numpy(value)]


def _same_bytes(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        x == y if not isinstance(x, np.ndarray) else (
            isinstance(y, np.ndarray) and x.dtype == y.dtype and x.tobytes() == y.tobytes()
        )
        for x, y in zip(a, b, strict=True)
    )  # fmt: skip


class Pair:
    """The same encoded paged latent cache in both implementations (pools ``pools[impl]``),
    driven alike: rows, stages, block tables, reads, saved states and pool accounting
    compared twin against twin."""

    def __init__(self, caches: dict[Any, Any], rng: np.random.Generator) -> None:
        self.caches, self.rng = caches, rng

    @property
    def ref(self) -> Any:
        return self.caches[ref]

    @property
    def opt(self) -> Any:
        return self.caches[opt]

    def both(self, call: Callable[[Any], Any]) -> dict[Any, Any]:
        return {impl: call(cache) for impl, cache in self.caches.items()}

    def append(self, n: int) -> None:
        rows = max(1, self.ref.batch_size)
        blocks = [self.rng.standard_normal((rows, 1, n, w)).astype(np.float32) for w in WIDTHS]
        got = {
            impl: c.append(*(_native(impl)(b) for b in blocks)) for impl, c in self.caches.items()
        }
        for a, b in zip(got[ref], got[opt], strict=True):
            assert np.array_equal(as_numpy(a), as_numpy(b))
        self.same()

    def same(self) -> None:
        r, o = self.ref, self.opt
        assert (o.row_offsets, o.left_pad, o.converted) == (r.row_offsets, r.left_pad, r.converted)
        assert o.block_tables() == r.block_tables()
        for b, (table, done) in enumerate(zip(r.block_tables(), r.converted, strict=True)):
            assert done or table == (), f"warm row {b} holds no block"
        r.check_valid()
        o.check_valid()
        for cache in (r, o):
            if cache.pool is not None:
                cache.pool.check_valid()
        if r.pool is not None:
            counters = [(c.pool.bytes_written, c.pool.bytes_copied) for c in (r, o)]
            assert counters[0] == counters[1]
        if r.width:
            for a, b in zip(r.current(), o.current(), strict=True):
                if a is not None:
                    assert np.array_equal(as_numpy(a), as_numpy(b))
        if not r.spec_round_open:
            assert _same_bytes(_flat(o.state), _flat(r.state))


def _pair(pools: dict[Any, Any], n: int, rng: np.random.Generator, start: int = 4) -> Pair:
    pair = Pair(
        {
            impl: impl.PagedLatentCache(*WIDTHS, pool=pool, codec=AFFINE, start=start)
            for impl, pool in pools.items()
        },
        rng,
    )
    if n:
        pair.append(n)
    return pair


def _pools(**kwargs: Any) -> dict[Any, Any]:
    return {
        impl: impl.LatentBlockPool(AFFINE, block_size=3, index_head_dim=WIDTHS[2], **kwargs)
        for impl in IMPLS
    }


def test_warm_and_converted_rows_twin_against_twin() -> None:
    """Warm rows (stage 0, beside the pool, no block) and converted rows (blocks of the
    pool) through merges from the pool and another one, conversions inside a round, a
    ragged rollback, a filter, extractions and a state round trip: both implementations
    hold the same tables, reads, states and pool counters."""
    rng = np.random.default_rng(7)
    here, there = _pools(), _pools()
    rows = [_pair(here, n, rng) for n in (6, 2, 0)] + [_pair(there, n, rng) for n in (1, 5)]
    assert [r.ref.converted for r in rows] == [(True,), (False,), (), (False,), (True,)]
    assert rows[1].ref.block_tables() == ((),) and here[ref].bytes_written > 0
    written = {impl: pool.bytes_written for impl, pool in here.items()}
    layout = Pair({impl: rows[0].caches[impl].make_empty_batch() for impl in IMPLS}, rows[0].rng)
    layout.both(lambda c: c.merge_rows([r.caches[ref if c.pool is here[ref] else opt]
                                        for r in rows]))  # fmt: skip
    layout.same()
    assert layout.ref.converted == (True, False, False, False, True)
    # Only the converted row of the other pool is copied; the warm rows' bytes moved.
    copied = here[ref].bytes_copied
    assert copied == 5 * here[ref].token_bytes and here[opt].bytes_copied == copied
    assert all(here[i].bytes_written == written[i] for i in IMPLS)
    layout.append(1)
    layout.both(lambda c: c.spec_round_begin())
    layout.append(2)  # rows 1 and 3 reach start inside the round and convert
    assert layout.ref.converted == (True, True, False, True, True)
    layout.both(lambda c: c.spec_round_rollback([1, 1, 2, 1, 2]))
    layout.same()
    assert layout.ref.converted == (True, True, False, True, True)  # no un-conversion
    layout.both(lambda c: c.filter_rows([4, 2, 0, 1]))
    layout.same()
    for row in (1, 0):  # a warm row, then a converted one
        single = Pair({impl: c.extract_row(row) for impl, c in layout.caches.items()}, layout.rng)
        single.same()
        single.append(2)
    layout.both(lambda c: c.trim(1))
    layout.same()
    states = layout.both(lambda c: c.state)
    back = Pair({impl: impl.PagedLatentCache.from_state(states[impl]) for impl in IMPLS}, rng)
    back.same()
    assert back.ref.converted == layout.ref.converted
    back.append(3)


def test_a_load_whose_pooled_rows_hold_no_token_reads() -> None:
    """A converted row trimmed to nothing beside a warm row: its saved form loads into a
    private pool that never takes a block (no pooled row holds a token), and the load
    still reads (zeros in the pool's part) and saves the same form, in both
    implementations (the deep profile's paged-latent machine: the read found no plane)."""
    rng = np.random.default_rng(3)
    here = _pools()
    rows = [_pair(here, n, rng) for n in (6, 2)]
    layout = Pair({impl: rows[0].caches[impl].make_empty_batch() for impl in IMPLS}, rng)
    layout.both(lambda c: c.merge_rows([r.caches[ref if c.pool is here[ref] else opt]
                                        for r in rows]))  # fmt: skip
    layout.both(lambda c: c.trim_rows([6, 0]))
    assert layout.ref.row_offsets == (0, 2) and layout.ref.converted == (True, False)
    states = layout.both(lambda c: c.state)
    back = Pair({impl: impl.PagedLatentCache.from_state(states[impl]) for impl in IMPLS}, rng)
    back.same()  # reads, saved forms and tables twin against twin
    assert back.ref.converted == (True, False) and back.ref.block_tables() == ((), ())
    for impl in IMPLS:
        assert _same_bytes(_flat(back.caches[impl].state), _flat(states[impl]))
    back.append(2)


def test_a_warm_row_registers_no_prefix_block() -> None:
    rng = np.random.default_rng(1)
    pair = _pair(_pools(), 7, rng, start=9)
    assert pair.ref.converted == (False,)
    assert pair.both(lambda c: c.register_prefix(0, [1, 2, 3, 4, 5, 6])) == {ref: 0, opt: 0}
    assert all(c.pool.ledger.cached_count == 0 for c in (pair.ref, pair.opt))
    pair.append(2)  # converts at 9: its full blocks can be registered then
    assert pair.both(lambda c: c.register_prefix(0, list(range(9)))) == {ref: 3, opt: 3}


class SkipsTheReservation(opt.PagedLatentCache):
    """A conversion whose blocks the append does not reserve: the append writes, then its
    conversion runs out of blocks after the cache changed."""

    def _converts_after(self, stages: Any, offsets: Any, n: int) -> list[int]:
        return []  # the converting append reserves nothing


def _refused_conversion_changes_nothing(impl: Any, cls: Any) -> bool:
    """A warm row of 3 tokens whose append of 1 converts it (2 blocks of 2) in a pool that
    holds 1 block: refused; whether nothing changed (rows, tables, pool, read)."""
    token = latent_token_bytes(AFFINE, *WIDTHS, "float32")
    pool = impl.LatentBlockPool(AFFINE, block_size=2, index_head_dim=WIDTHS[2], max_bytes=2 * token)
    cache = cls(*WIDTHS, pool=pool, codec=AFFINE, start=4)
    rng = np.random.default_rng(5)
    native = _native(impl)

    def blocks(n: int) -> list[Any]:
        return [native(rng.standard_normal((1, 1, n, w)).astype(np.float32)) for w in WIDTHS]

    cache.append(*blocks(3))
    assert cache.block_tables() == ((),) and pool.ledger.held_count == 0

    def held() -> tuple[Any, ...]:
        read = [as_numpy(a).tobytes() for a in cache.current() if a is not None]
        counters = (pool.bytes_written, pool.ledger.held_count, pool.num_blocks)
        return (cache.row_offsets, cache.converted, cache.block_tables(), counters, read)

    before = held()
    with pytest.raises(PoolExhaustedError):
        cache.append(*blocks(1))
    return held() == before


@pytest.mark.parametrize("impl", IMPLS, ids=IDS)
def test_a_refused_conversion_changes_nothing(impl: Any) -> None:
    """The append whose read makes a warm row due reserves the conversion's blocks before
    it writes: a pool that cannot hold them refuses with nothing changed."""
    assert _refused_conversion_changes_nothing(impl, impl.PagedLatentCache)


def test_a_conversion_refused_after_its_append_changes_nothing() -> None:
    """Without the reservation the refusal comes from the conversion, after the append
    wrote: the pool's journal and the host record put the append back (contract §9; the
    reservation only makes the refusal come first, before any write)."""
    assert _refused_conversion_changes_nothing(opt, SkipsTheReservation)


# -- the MLA models ---------------------------------------------------------------------

PROMPT = [5, 7, 9, 11, 13, 2, 3, 4, 5, 6, 7, 8]  # past index_topk = 8: the sparse path


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


def test_mla_models_give_mlx_lm_logits() -> None:
    """deepseek_v32 (DSA, CacheList pairs) and deepseek_v3 (one KVCache per layer) on paged
    latent caches of shared pools: mlx-lm's logits serial, and MLACache's merged."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvrows.app.models import (
        latent_pools,
        make_latent_cache,
        make_paged_latent_cache,
        tiny_model,
    )

    for arch in ("deepseek_v32", "deepseek_v3"):
        model = tiny_model(arch)
        pools = latent_pools(model, block_size=4)
        prompts = [PROMPT, [9, 8, 7]]
        theirs = [make_prompt_cache(model) for _ in prompts]
        mine = [make_paged_latent_cache(model, pools) for _ in prompts]
        oracle = [make_latent_cache(model) for _ in prompts]
        for p, t, m, o in zip(prompts, theirs, mine, oracle, strict=True):
            got = model(mx.array([p]), cache=m)
            assert _same(got, model(mx.array([p]), cache=t))
            model(mx.array([p]), cache=o)
            step = mx.array([[3]])
            assert _same(model(step, cache=m), model(step, cache=t))
            model(step, cache=o)
        dsa = arch == "deepseek_v32"

        def merged(caches: list[list[Any]], dsa: bool = dsa) -> list[Any]:
            layers = []
            for per_row in zip(*caches, strict=True):
                layout = per_row[0].cache.make_empty_batch()
                layout.merge_rows([c.cache for c in per_row])
                pair = opt.LatentCacheList(layout)
                layers.append(pair if dsa else pair[0])
            return layers

        batch_mine, batch_oracle = merged(mine), merged(oracle)
        for tokens in ([[3], [4]], [[5], [6]]):
            step = mx.array(tokens)
            assert _same(model(step, cache=batch_mine), model(step, cache=batch_oracle))
        for pool in pools:
            pool.check_valid()


def test_an_encoded_paged_latent_in_the_model_equals_encoded_latent_cache() -> None:
    from kvrows.app.models import (
        latent_pools,
        make_latent_cache,
        make_paged_latent_cache,
        tiny_model,
    )

    model = tiny_model("deepseek_v32")
    codec = Affine(bits=4, group_size=32)
    mine = make_paged_latent_cache(model, latent_pools(model, 4, codec), start=5)
    oracle = make_latent_cache(model, codec, start=5)
    assert mine[0].signature() == "kv:mla-paged:target:dsa:affine:4:32:5"
    for tokens in (PROMPT, [3], [4, 5]):
        block = mx.array([tokens])
        assert _same(model(block, cache=mine), model(block, cache=oracle))
    assert mine[0].cache.converted == (True,)
