"""The row-layout table, its functions and row admission (spec/contract.md)."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows.errors import InvalidInputError, NoRowLayoutError, NotBatchableError
from kvrows.table import (
    extract_sole_row,
    filter_layout_rows,
    is_batchable,
    owned_cache_layout,
    owned_cache_layout_factory,
    prefill_cache_layout,
    publish_row,
    register_row_layouts,
    registered_entries,
    row_admission,
    target_cache_layout,
    target_row_layout_factory,
)

IMPLEMENTATIONS = [pytest.param(reference, id="reference"), pytest.param(optimized, id="optimized")]


def _filled(impl: ModuleType, tokens: int, heads: int = 2, dim: int = 4) -> Any:
    cache = impl.KVCache()
    block = np.ones((1, heads, tokens, dim), np.float16)
    data = mx.array(block) if impl is optimized else block
    cache.update_and_fetch(data, data)
    return cache


class _Foreign:
    """A cache-like object no table entry covers."""

    offset = 0

    def signature(self) -> str:
        return "test:foreign"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_roles_of_a_plain_cache(impl: ModuleType) -> None:
    cache = impl.KVCache()
    assert type(owned_cache_layout(cache)) is impl.PaddedKVRows
    assert type(prefill_cache_layout(cache)) is impl.BatchedKVCache
    assert type(target_cache_layout(cache)) is impl.BatchedKVCache
    assert not is_batchable(cache)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_running_decode_layout_has_no_verify_sibling(impl: ModuleType) -> None:
    layouts: tuple[Any, ...] = (impl.PaddedKVRows(), impl.PaddedQuantKVRows(64, 4))
    for layout in layouts:
        kind = type(layout)
        assert type(owned_cache_layout(layout)) is kind
        assert type(prefill_cache_layout(layout)) is kind
        assert target_row_layout_factory(layout) is None
        with pytest.raises(NoRowLayoutError, match="padded-rows"):
            target_cache_layout(layout)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_layouts_are_their_own_siblings(impl: ModuleType) -> None:
    for layout in (impl.BatchedKVCache(), impl.BatchedQuantizedKVCache(64, 4)):
        assert is_batchable(layout)
        for made in (
            owned_cache_layout(layout),
            prefill_cache_layout(layout),
            target_cache_layout(layout),
        ):
            assert made is not None and type(made) is type(layout) and made is not layout
            assert made.batch_size == 0


def test_foreign_storage_has_no_layout() -> None:
    foreign: Any = _Foreign()
    assert owned_cache_layout_factory(foreign) is None
    assert target_row_layout_factory(foreign) is None
    with pytest.raises(NoRowLayoutError, match="test:foreign"):
        prefill_cache_layout(foreign)
    with pytest.raises(NoRowLayoutError, match="test:foreign"):
        target_cache_layout(foreign)


def test_the_factory_does_not_allocate() -> None:
    made: list[int] = []

    class Probe(optimized.KVCache):
        pass

    def decode(cache: Any) -> Any:
        made.append(1)
        return optimized.PaddedKVRows()

    register_row_layouts(
        Probe,
        decode=decode,
        prefill=lambda cache: optimized.BatchedKVCache(),
        verify=lambda cache: optimized.BatchedKVCache(),
    )
    factory = owned_cache_layout_factory(Probe())
    assert factory is not None and made == []
    factory()
    assert made == [1]


def test_subclasses_come_before_their_bases() -> None:
    order = [entry.storage for entry in registered_entries()]
    for i, earlier in enumerate(order):
        for later in order[i + 1 :]:
            assert not issubclass(later, earlier) or later is earlier, (later, earlier)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_sole_row_publish_and_filter(impl: ModuleType) -> None:
    serial = _filled(impl, 3)
    assert extract_sole_row(serial) is None
    with pytest.raises(NotBatchableError, match="kv:plain"):
        filter_layout_rows(serial, [0])
    layout = impl.PaddedKVRows()
    layout.merge_rows([serial])
    sole = extract_sole_row(layout)
    assert sole is not None and sole.offset == 3 and layout.batch_size == 1
    layout.merge_rows([_filled(impl, 5)])
    assert extract_sole_row(layout) is None
    published = publish_row(layout, 1, 5)
    assert published is not None and published.offset == 5
    assert publish_row(layout, 0, 4) is None  # row 0 holds only 3 positions
    filter_layout_rows(layout, [1])
    assert layout.row_offsets == (5,)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_row_admission(impl: ModuleType) -> None:
    assert row_admission([impl.KVCache()]) is None
    empty = row_admission([])
    assert empty is not None and empty.bytes(100) == 0 and empty.max_tokens == math.inf
    layouts = []
    for heads in (2, 4):
        layout = impl.PaddedKVRows()
        layout.merge_rows([_filled(impl, 2, heads=heads)])
        layouts.append(layout)
    admission = row_admission(layouts)
    assert admission is not None
    # float16 keys and values: 2 bytes x (D=4 keys + 4 values) x heads, per token
    assert admission.bytes(10) == 10 * 2 * 8 * (2 + 4)
    assert admission.bytes(0) == 0 and admission.max_tokens == math.inf
    with pytest.raises(InvalidInputError):
        admission.bytes(-1)
    assert row_admission([layouts[0], impl.KVCache()]) is None


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("max_size", "keep", "block_size"), [(16, 0, 16), (6, 2, 4), (7, 1, 3)])
def test_row_admission_reserves_a_paged_rings_most_blocks(
    impl: ModuleType, max_size: int, keep: int, block_size: int
) -> None:
    """``most_bytes(t)``: the most bytes a row holds at any length up to ``t``, counted by
    brute force from a ring row's held blocks at each length (its sinks and newest
    positions, ``max_size`` in all), beside a growing layer's and a contiguous ring's, which grow
    with the length."""
    pairs = [
        (impl.PagedRotatingRows(max_size, keep, block_size=block_size),
         impl.PagedRotatingKVCache(max_size, keep, block_size=block_size)),
        (impl.PagedKvRows(block_size=block_size), impl.PagedKVCache(block_size=block_size)),
        (impl.RaggedRotatingRows(max_size, keep), impl.RotatingKVCache(max_size, keep)),
    ]  # fmt: skip
    block = np.ones((1, 2, 1, 4), np.float16)
    data = mx.array(block) if impl is optimized else block
    layouts = []
    for layout, serial in pairs:  # one row each: the layouts learn the KV geometry
        serial.update_and_fetch(data, data)
        layout.merge_rows([serial])
        layouts.append(layout)
    admission = row_admission(layouts)
    assert admission is not None
    per_token = 2 * 2 * 4 * 2  # float16 keys and values, two heads of four

    def held_blocks(t: int) -> int:
        head = min(keep, t)  # the sinks, then the newest: ``max_size`` in all
        positions = [*range(head), *range(max(head, t - max_size + head), t)]
        return len({p // block_size for p in positions})

    for tokens in range(0, 4 * max_size + 2 * block_size):
        ring = max(held_blocks(t) for t in range(tokens + 1)) * block_size * per_token
        growing = -(-tokens // block_size) * block_size * per_token
        contiguous = min(tokens, max_size) * per_token
        assert admission.most_bytes(tokens) == ring + growing + contiguous, tokens
        assert admission.most_bytes(tokens) >= admission.bytes(tokens)
    # somewhere the window straddled one more block boundary a step before: fewer blocks
    assert any(admission.most_bytes(t) > admission.bytes(t) for t in range(4 * max_size))
    with pytest.raises(InvalidInputError):
        admission.most_bytes(-1)
