"""Paged rings: the paged placement under the ring geometry (``PagedRotatingKVCache``,
``PagedRotatingRows``; ``spec/PagedRotatingKVCache.md``). Small shapes, both
implementations: every read and mask equals the contiguous ring's of the same window
(``RotatingKVCache``, ``RaggedRotatingRows``), the twins hold the same block tables, and
a row keeps only the blocks of its sinks and window."""

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
from kvrows.schemes import Affine, Ring

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
    with pytest.raises(LayoutStateError, match="prefix caching"):
        cache.register_prefix(list(range(4)))
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
