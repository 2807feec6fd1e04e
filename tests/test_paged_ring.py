"""Paged rings: the paged placement under the ring geometry (``PagedRotatingKVCache``,
``PagedRotatingRows``; ``spec/PagedRotatingKVCache.md``). Small shapes, both
implementations: every read and mask equals the contiguous ring's of the same window
(``RotatingKVCache``, ``RaggedRotatingRows``), the twins hold the same block tables, and
a row keeps only the blocks of its sinks and window; a ring's prefix is cached and reused
while it is inside the window (the growing geometry's register / lookup, capped)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
)
from kvrows.paged import FREE, projected_blocks
from kvrows.schemes import Affine, Growing, Ring

H, D = 2, 32
#: (max_size, keep, block_size): windows across, inside and beyond one block.
CASES = [(6, 0, 4), (7, 2, 3), (8, 1, 2), (5, 0, 16)]


def _blocks(seed: int, sizes: list[int], rows: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, H, n, D)).astype(np.float32) for n in sizes]


def _same_mask(a: Any, b: Any) -> bool:
    if a is None or isinstance(a, str):
        return bool(a == b)
    return bool(np.array_equal(np.array(a), np.array(b)))


Twin = tuple[Any, Callable[[np.ndarray], Any]]
TWINS: list[Twin] = [(ref, lambda x: x), (opt, mx.array)]


@pytest.mark.parametrize(("max_size", "keep", "block_size"), CASES)
def test_a_paged_ring_reads_what_the_contiguous_ring_reads(
    max_size: int, keep: int, block_size: int
) -> None:
    steps = [3, 1, 1, 5, 1, 1, 1, 9, 1, 2, 1, 1, 1, 1]
    data = _blocks(0, [n for n in steps for _ in (0, 1)])
    caches = [m.PagedRotatingKVCache(max_size, keep, block_size=block_size) for m, _ in TWINS]
    contiguous = ref.RotatingKVCache(max_size, keep)
    for i, n in enumerate(steps):
        keys, values = data[2 * i], data[2 * i + 1]
        want_mask = contiguous.make_mask(n)
        want = contiguous.update_and_fetch(keys, values)
        for cache, (_, convert) in zip(caches, TWINS, strict=True):
            assert _same_mask(cache.make_mask(n), want_mask), (i, n)
            got = cache.update_and_fetch(convert(keys), convert(values))
            assert np.array_equal(np.array(got[0]), want[0]) and np.array_equal(
                np.array(got[1]), want[1]
            ), (i, n)
            cache.check_valid()
            cache.pool.check_valid()
        tables = [c.block_table for c in caches]
        assert tables[0] == tables[1]
        # Only the blocks of the sinks and of the retained newest positions are held.
        held = [b for b in tables[0] if b != FREE]
        assert len(held) * block_size >= min(contiguous.offset, max_size)
        assert caches[0].nbytes == caches[1].nbytes
    assert caches[0].offset == contiguous.offset == sum(steps)
    # Between single-token steps a row holds at most its sinks' blocks and its window's.
    most = projected_blocks(sum(steps), max_size, keep, block_size)
    assert len([b for b in caches[0].block_table if b != FREE]) <= most
    assert (max_size, keep) == (caches[1].max_size, caches[1].keep)


@pytest.mark.parametrize(("max_size", "keep", "block_size"), CASES[:3])
def test_paged_ring_rows_are_the_ragged_ring_s_rows(
    max_size: int, keep: int, block_size: int
) -> None:
    prompts = [5, 11, 2]
    data = _blocks(1, [p for p in prompts for _ in (0, 1)])
    rng = np.random.default_rng(2)
    layouts: list[tuple[Any, Callable[[np.ndarray], Any]]] = []
    for module, convert in [*TWINS, (ref, lambda x: x)]:
        contiguous = module is ref and len(layouts) == 2
        serials = []
        for i in range(len(prompts)):
            if contiguous:
                serial = ref.RotatingKVCache(max_size, keep)
            else:
                serial = module.PagedRotatingKVCache(max_size, keep, block_size=block_size)
            serial.update_and_fetch(convert(data[2 * i]), convert(data[2 * i + 1]))
            serials.append(serial)
        if contiguous:
            layout = ref.RaggedRotatingRows(max_size, keep)
        else:
            layout = module.PagedRotatingRows(max_size, keep, block_size=block_size)
        layout.merge_rows(serials)
        layouts.append((layout, convert))

    def step(n: int) -> None:
        rows = layouts[0][0].batch_size
        keys, values = (rng.standard_normal((rows, H, n, D)).astype(np.float32) for _ in "kv")
        masks = [lay.make_mask(n) for lay, _ in layouts]
        reads = [lay.update_and_fetch(c(keys), c(values)) for lay, c in layouts]
        for j in (0, 1):
            assert _same_mask(masks[j], masks[2])
            assert np.array_equal(np.array(reads[j][0]), np.array(reads[2][0]))
            assert layouts[j][0].retained == layouts[2][0].retained
            layouts[j][0].check_valid()
            layouts[j][0].pool.check_valid()
        assert layouts[0][0].block_tables() == layouts[1][0].block_tables()

    for _ in range(6):
        step(1)
    step(4)  # a verify block, then each row's rollback
    for lay, _ in layouts:
        lay.trim_rows([1, 3, 0])
    step(1)
    for lay, _ in layouts:
        lay.filter_rows([2, 0])
    step(1)
    extracted = [lay.extract_row(1) for lay, _ in layouts]
    for cache in extracted:
        cache.check_valid()
    want = extracted[2].window()
    for cache in extracted[:2]:
        got = cache.window()
        assert np.array_equal(np.array(got[0][0]), want[0][0])
    for (lay, _), cache in zip(layouts, extracted, strict=True):
        lay.merge_rows([cache])
    step(4)
    for _ in range(5):
        step(1)


@pytest.mark.parametrize(("module", "convert"), TWINS, ids=["reference", "optimized"])
def test_blocks_out_of_the_window_go_back_to_the_pool(module: Any, convert: Any) -> None:
    pool = module.BlockPool(block_size=4)
    cache = module.PagedRotatingKVCache(8, pool=pool)
    (keys,) = _blocks(3, [1])
    for _ in range(40):
        cache.update_and_fetch(convert(keys), convert(keys))
    table = cache.block_table
    # The window holds positions 32..39: blocks 8 and 9; the eight before went back.
    assert len(table) == 10 and table[:8] == (FREE,) * 8 and FREE not in table[8:]
    assert pool.ledger.referenced_count == 2
    # One block more while a step opens a block, before the oldest one goes back.
    assert pool.num_blocks <= 4
    cache.release()
    assert pool.ledger.referenced_count == 0


@pytest.mark.parametrize(("module", "convert"), TWINS, ids=["reference", "optimized"])
def test_a_paged_ring_round_trips_its_state(module: Any, convert: Any) -> None:
    codec = Affine(bits=4, group_size=32)
    serial = module.PagedRotatingKVCache(6, 2, block_size=3, codec=codec)
    (prompt,) = _blocks(4, [9])
    serial.update_and_fetch(convert(prompt), convert(prompt))
    again = type(serial).from_state(serial.state)
    again.check_valid()
    assert again.token_geometry == Ring(max_size=6, keep=2) and again.offset == 9
    assert again.block_size == 3 and again.codec_spec == codec
    layout = module.PagedRotatingRows(6, 2, block_size=3, codec=codec)
    layout.merge_rows([again])
    restored = type(layout).from_state(layout.state, keep=2)
    restored.check_valid()
    assert restored.row_offsets == (9,) and restored.retained == layout.retained


@pytest.mark.parametrize(("module", "convert"), TWINS, ids=["reference", "optimized"])
def test_what_a_paged_ring_refuses(module: Any, convert: Any) -> None:
    cache = module.PagedRotatingKVCache(4, block_size=2)
    (block,) = _blocks(5, [6])
    cache.update_and_fetch(convert(block), convert(block))
    with pytest.raises(NotTrimmableError):
        cache.trim(1)  # wrapped past its window
    with pytest.raises(InvalidInputError, match="more positions"):
        cache.register_prefix(list(range(7)))  # more ids than positions, as a growing row
    with pytest.raises(LayoutStateError, match="no block"):
        module.PagedRotatingKVCache(4, block_size=2).register_prefix([1])
    growing = module.PagedKVCache(pool=cache.pool)
    growing.update_and_fetch(convert(block), convert(block))
    layout = module.PagedRotatingRows(4, block_size=2)
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([growing])  # a growing row is not a ring row
    with pytest.raises(InvalidInputError):
        module.PagedRotatingKVCache(4, 4)  # keep < max_size
    with pytest.raises(InvalidInputError):
        module.PagedRotatingKVCache()  # max_size is needed


def test_a_paged_ring_goes_through_a_prompt_cache_file(tmp_path: Any) -> None:
    from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache

    (prompt,) = _blocks(6, [9])
    serial = opt.PagedRotatingKVCache(6, 2, block_size=3)
    serial.update_and_fetch(mx.array(prompt), mx.array(prompt))
    path = tmp_path / "rings.safetensors"
    save_prompt_cache(path, [serial])
    for implementation in ("optimized", "reference"):
        (loaded,) = load_prompt_cache(path, implementation=implementation)
        assert type(loaded).__name__ == "PagedRotatingKVCache"
        assert (loaded.offset, loaded.max_size, loaded.keep) == (9, 6, 2)
        assert np.array_equal(np.array(loaded.fetch()[0]), np.array(serial.fetch()[0]))


def _fed(module: Any, convert: Any, cache: Any, block: np.ndarray) -> Any:
    """``cache`` after ``block`` (``[1, H, n, D]``) appended one token at a time."""
    for i in range(block.shape[2]):
        token = convert(block[:, :, i : i + 1])
        cache.update_and_fetch(token, token)
    return cache


@pytest.mark.parametrize("keep", [0, 1])
def test_a_ring_prefix_is_shared_while_inside_the_window(keep: int) -> None:
    """Both twins: a ring row that holds every position registers the full blocks of its
    window; a lookup of a ring's geometry references them (a ``PagedRotatingKVCache``
    reading what the contiguous ring fed those tokens reads); the hit goes on past its
    window (its shared blocks leave it: released by count, the publisher's still held),
    the publisher goes past its own (a publish then registers nothing), and once every
    row is released no block is referenced; evicting the index leaves no hash."""
    (data,) = _blocks(7, [30])
    ids = list(range(100, 130))
    ring = Ring(max_size=8, keep=keep)
    tables, reads, counts = [], [], []
    for module, convert in TWINS:
        pool = module.BlockPool(block_size=4)
        publisher = module.PagedRotatingKVCache(8, keep, pool=pool)
        publisher.update_and_fetch(convert(data[:, :, :6]), convert(data[:, :, :6]))
        assert publisher.register_prefix(ids[:6]) == 1  # one full block of six positions
        hit = pool.lookup_prefix(ids[:12], ring)
        assert type(hit).__name__ == "PagedRotatingKVCache"
        assert hit.token_geometry == ring and (hit.offset, hit.block_table) == (
            4,
            publisher.block_table[:1],
        )
        assert pool.ledger.ref(hit.block_table[0]) == 2  # referenced, nothing copied
        assert pool.bytes_copied == 0
        contiguous = ref.RotatingKVCache(8, keep)
        contiguous.update_and_fetch(data[:, :, :4], data[:, :, :4])
        assert np.array_equal(np.array(hit.fetch()[0]), contiguous.fetch()[0])
        shared = hit.block_table[0]
        _fed(module, convert, hit, data[:, :, 4:20])  # past its window
        _fed(ref, lambda x: x, contiguous, data[:, :, 4:20])
        assert np.array_equal(np.array(hit.fetch()[0]), contiguous.fetch()[0])
        # Block 0 left the hit's window (unless it holds a sink): one holder fewer.
        assert pool.ledger.ref(shared) == (2 if keep else 1)
        _fed(module, convert, publisher, data[:, :, 6:12])  # past its window too
        cached = pool.ledger.cached_count
        assert publisher.register_prefix(ids[:12]) == 0  # it dropped a position: nothing
        assert pool.ledger.cached_count == cached
        for cache in (hit, publisher):
            cache.check_valid()
        pool.check_valid()
        tables.append((hit.block_table, publisher.block_table))
        reads.append(np.array(hit.fetch()[1]))
        hit.release()
        publisher.release()
        assert pool.ledger.referenced_count == 0
        counts.append(pool.ledger.cached_count)
        pool.evict_cached(pool.num_blocks)
        assert pool.ledger.cached_count == 0
        pool.check_valid()
    assert tables[0] == tables[1] and counts[0] == counts[1] == 1
    assert np.array_equal(reads[0], reads[1])


@pytest.mark.parametrize(("module", "convert"), TWINS, ids=["reference", "optimized"])
def test_a_ring_hit_is_at_most_its_window(module: Any, convert: Any) -> None:
    """A growing row's blocks in the same pool: a ring's lookup takes at most its window's
    whole blocks, a growing lookup every one; a ring row that held every position after a
    block longer than its window registers only its window's blocks."""
    (data,) = _blocks(8, [20])
    ids = list(range(20))
    pool = module.BlockPool(block_size=4)
    growing = module.PagedKVCache(pool=pool)
    growing.update_and_fetch(convert(data), convert(data))
    assert growing.register_prefix(ids) == 5
    ring = pool.lookup_prefix(ids, Ring(max_size=10))
    assert ring.offset == 8 and ring.block_table == growing.block_table[:2]
    assert pool.lookup_prefix(ids, Growing()).offset == 16
    assert type(pool.lookup_prefix(ids)).__name__ == "PagedKVCache"
    assert pool.lookup_prefix(ids, Ring(max_size=3)) is None  # no whole block in 3 positions
    other = module.BlockPool(block_size=4)
    wide = module.PagedRotatingKVCache(10, pool=other)
    wide.update_and_fetch(convert(data[:, :, :13]), convert(data[:, :, :13]))
    assert wide.retained == 13  # a block keeps its history
    assert wide.register_prefix(ids[:13]) == 2  # its window's whole blocks
    assert other.ledger.cached_count == 2


@pytest.mark.parametrize(("module", "convert"), TWINS, ids=["reference", "optimized"])
def test_ring_rows_publish_from_a_layout_and_copy_a_shared_tail(module: Any, convert: Any) -> None:
    """``PagedRotatingRows.register_prefix``: a row inside its window caches its blocks, a
    row past it none; a hit cut inside a block (a trim: the ring has not wrapped) copies
    that shared block on its next write, the publisher's left as it was."""
    prompts = [7, 13]
    data = _blocks(9, prompts)
    ids = list(range(50, 70))
    pool = module.BlockPool(block_size=3)
    serials = []
    for block in data:
        serial = module.PagedRotatingKVCache(10, 1, pool=pool)
        serial.update_and_fetch(convert(block), convert(block))
        serials.append(serial)
    layout = module.PagedRotatingRows(10, 1, pool=pool)
    layout.merge_rows(serials)
    step = convert(_blocks(10, [1], rows=2)[0])
    for _ in range(2):
        layout.update_and_fetch(step, step)  # row 0 at 9 (inside), row 1 at 15 (past)
    assert layout.register_prefix(1, ids[:15]) == 0
    assert layout.register_prefix(0, ids[:9]) == 3
    hit = pool.lookup_prefix([*ids[:9], 0], Ring(max_size=10, keep=1))
    assert hit.offset == 9 and list(hit.block_table) == list(layout.block_tables()[0])
    before = np.array(layout.row_window(0)[0])
    hit.trim(2)  # a cut inside block 2: still shared
    copied = pool.bytes_copied
    (token,) = _blocks(11, [1])
    hit.update_and_fetch(convert(token), convert(token))
    assert pool.bytes_copied > copied  # copy on write of the shared tail
    assert hit.block_table[2] != layout.block_tables()[0][2]
    assert np.array_equal(np.array(layout.row_window(0)[0]), before)
    hit.check_valid()
    layout.check_valid()
    pool.check_valid()
    for cache in (hit, layout, *serials):
        cache.release()
    assert pool.ledger.referenced_count == 0
