"""Hand-computed vectors for the plain family (spec/PaddedKVRows.md, spec/BatchedKVCache.md).

Each vector runs in both implementations; expected values are worked out by
hand from the spec, never read back from the code.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest

import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    RowIndexError,
)

IMPLEMENTATIONS = [pytest.param(reference, id="reference"), pytest.param(optimized, id="optimized")]


def _to(impl: ModuleType, array: npt.NDArray[Any]) -> Any:
    return mx.array(array) if impl is optimized else array


def _tagged(rows: int, tokens: int, first: int, heads: int = 2, dim: int = 4) -> npt.NDArray[Any]:
    """Row ``b``'s token ``t`` holds ``(b + 1) * 1000 + first + t`` in every lane."""
    tags = (np.arange(rows)[:, None] + 1) * 1000 + first + np.arange(tokens)[None, :]
    return np.broadcast_to(tags[:, None, :, None], (rows, heads, tokens, dim)).astype(np.float32)


def _serial(impl: ModuleType, tokens: int, first: int = 0) -> Any:
    cache = impl.KVCache()
    if tokens:
        block = _to(impl, _tagged(1, tokens, first))
        cache.update_and_fetch(block, block)
    return cache


def _tags(cache: Any) -> list[int]:
    keys = np.array(cache.fetch()[0])
    return [int(x) for x in keys[0, 0, :, 0]]


def _mask(mask: Any) -> Any:
    return mask if mask is None or isinstance(mask, str) else np.array(mask).astype(int).tolist()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_padded_merge_decode_join(impl: ModuleType) -> None:
    layout = impl.PaddedKVRows()
    layout.merge_rows([_serial(impl, 5), _serial(impl, 3)])
    assert layout.left_pad == (0, 2) and layout.row_offsets == (5, 3)
    assert _mask(layout.make_mask(1)) == [[[[1] * 6]], [[[0, 0, 1, 1, 1, 1]]]]
    assert np.array(layout.offset).tolist() == [5, 3]
    for step in range(2):
        block = _to(impl, _tagged(2, 1, 500 + step))
        layout.update_and_fetch(block, block)
    assert layout.row_offsets == (7, 5)
    layout.merge_rows([_serial(impl, 4)])
    assert layout.row_offsets == (7, 5, 4) and layout.left_pad == (0, 2, 3)
    assert _tags(layout.extract_row(1)) == [1000, 1001, 1002, 2500, 2501]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_equal_rows_use_the_serial_mask(impl: ModuleType) -> None:
    layout = impl.PaddedKVRows()
    layout.merge_rows([_serial(impl, 3), _serial(impl, 3)])
    assert layout.left_pad == (0, 0)
    assert layout.make_mask(1) is None and layout.make_mask(4) == "causal"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_filter_drops_shared_padding_and_reorders(impl: ModuleType) -> None:
    layout = impl.PaddedKVRows()
    layout.merge_rows([_serial(impl, 2), _serial(impl, 5), _serial(impl, 1)])
    assert layout.left_pad == (3, 0, 4)
    layout.filter_rows([2, 0])  # the longest row leaves; the survivors share 3 columns of pad
    assert layout.row_offsets == (1, 2) and layout.left_pad == (1, 0)
    assert _mask(layout.make_mask(1)) == [[[[0, 1, 1]]], [[[1, 1, 1]]]]
    assert _tags(layout.extract_row(0)) == [1000] and _tags(layout.extract_row(1)) == [1000, 1001]
    layout.filter_rows([1])
    assert layout.left_pad == (0,) and layout.make_mask(1) is None


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_ragged_rows_roll_back_per_row(impl: ModuleType) -> None:
    layout = impl.BatchedKVCache()
    layout.merge_rows([_serial(impl, 2), _serial(impl, 4, first=10)])
    assert layout.row_offsets == (2, 4) and layout.left_pad == (2, 0)
    draft = _to(impl, _tagged(2, 3, 100))
    layout.update_and_fetch(draft, draft)
    layout.trim_rows([3, 1])  # accept 0 and 2 of the 3 drafted tokens
    assert layout.row_offsets == (2, 6) and np.array(layout.offset).tolist() == [2, 6]
    mask = _mask(layout.make_mask(2))
    # row 0 ends at column 4, row 1 at column 6; 2 queries over 6 + 2 columns
    assert mask == [
        [[[0, 0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0, 0]]],
        [[[1, 1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]]],
    ]
    block = _to(impl, _tagged(2, 2, 300))
    layout.update_and_fetch(block, block)
    assert _tags(layout.extract_row(0)) == [1000, 1001, 1300, 1301]
    assert _tags(layout.extract_row(1)) == [1010, 1011, 1012, 1013, 2100, 2101, 2300, 2301]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_empty_rows_join_and_filter(impl: ModuleType) -> None:
    layout = impl.BatchedKVCache()
    layout.merge_rows([_serial(impl, 0), _serial(impl, 0)])
    assert layout.batch_size == 2 and layout.row_offsets == (0, 0)
    with pytest.raises(LayoutStateError):  # geometry unknown before the first token
        layout.projected_bytes(10)
    layout.filter_rows([1])
    assert layout.extract_row(0).offset == 0
    padded = impl.PaddedKVRows()
    padded.merge_rows([_serial(impl, 3), _serial(impl, 0)])
    assert padded.left_pad == (0, 3)
    padded.filter_rows([1])
    assert padded.left_pad == (0,) and padded.row_offsets == (0,)
    assert padded.extract_row(0).offset == 0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_merge_borrows_its_sources(impl: ModuleType) -> None:
    donor = _serial(impl, 3)
    layout = impl.PaddedKVRows()
    layout.merge_rows([donor])
    block = _to(impl, _tagged(1, 1, 900))
    layout.update_and_fetch(block, block)
    assert donor.offset == 3 and _tags(donor) == [1000, 1001, 1002]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_bad_input_raises_and_changes_nothing(impl: ModuleType) -> None:
    layout = impl.PaddedKVRows()
    layout.merge_rows([_serial(impl, 3), _serial(impl, 2)])
    before = (layout.row_offsets, layout.left_pad, _tags(layout.extract_row(0)))
    wrong_dim = _to(impl, np.zeros((2, 2, 1, 8), np.float32))
    with pytest.raises(InvalidInputError, match="D=8"):
        layout.update_and_fetch(wrong_dim, wrong_dim)
    wrong_rows = _to(impl, np.zeros((3, 2, 1, 4), np.float32))
    with pytest.raises(InvalidInputError, match="B=3"):
        layout.update_and_fetch(wrong_rows, wrong_rows)
    half = _to(impl, np.zeros((2, 2, 1, 4), np.float16))
    with pytest.raises(InvalidInputError, match="float16"):
        layout.update_and_fetch(half, half)
    with pytest.raises(RowIndexError):
        layout.filter_rows([0, 2])
    with pytest.raises(RowIndexError):
        layout.filter_rows([1, 1])
    with pytest.raises(RowIndexError):
        layout.extract_row(2)
    with pytest.raises(NotTrimmableError):
        layout.trim(3)
    other = impl.KVCache()
    odd = _to(impl, np.zeros((1, 4, 2, 4), np.float32))
    other.update_and_fetch(odd, odd)
    with pytest.raises(IncompatibleRowsError, match="H=4"):
        layout.merge_rows([_serial(impl, 1), other])
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([layout.make_empty_batch(), object()])
    assert (layout.row_offsets, layout.left_pad, _tags(layout.extract_row(0))) == before
    with pytest.raises(LayoutStateError):
        impl.PaddedKVRows().update_and_fetch(wrong_dim, wrong_dim)
    foreign = np.zeros((2, 2, 1, 4), np.float32) if impl is optimized else mx.zeros((2, 2, 1, 4))
    with pytest.raises(InvalidInputError, match="takes"):
        layout.update_and_fetch(foreign, foreign)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_serial_trim_clamps_and_reports(impl: ModuleType) -> None:
    cache = _serial(impl, 4)
    assert cache.trim(1) == 1 and cache.offset == 3
    assert cache.trim(10) == 3 and cache.offset == 0
    with pytest.raises(InvalidInputError):
        cache.trim(-1)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_a_keys_only_cache_holds_values_of_width_zero(impl: ModuleType) -> None:
    """Values of width 0 (minimax_m3's indexer keeps keys only in a ``KVCache``): a plain
    storage holds the keys and answers values of width 0; an encoding one refuses the
    block with the value head dim named, and holds nothing."""
    block = np.arange(2 * 64, dtype=np.float32).reshape(1, 1, 2, 64)
    keys, values = _to(impl, block), _to(impl, np.zeros((1, 1, 2, 0), np.float32))
    cache = impl.KVCache()
    cache.update_and_fetch(keys, values)
    fetched_keys, fetched_values = cache.update_and_fetch(keys, values)
    assert tuple(fetched_values.shape) == (1, 1, 4, 0) and cache.offset == 4
    assert np.array_equal(np.asarray(fetched_keys), np.concatenate([block, block], axis=2))
    quantized = impl.QuantizedKVCache()
    with pytest.raises(InvalidInputError, match="value head dim 0"):
        quantized.update_and_fetch(keys, values)
    assert quantized.offset == 0
