"""Affine storages and layouts: bytes, codec errors and row moves without re-quantizing."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest

import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows.errors import IncompatibleRowsError, InvalidInputError
from kvrows.table import owned_cache_layout, prefill_cache_layout, target_cache_layout

IMPLEMENTATIONS = [pytest.param(reference, id="reference"), pytest.param(optimized, id="optimized")]
RNG = np.random.default_rng(7)


def _to(impl: ModuleType, array: npt.NDArray[Any]) -> Any:
    return mx.array(array) if impl is optimized else array


def _block(rows: int, tokens: int, heads: int = 2, dim: int = 64) -> npt.NDArray[Any]:
    return RNG.standard_normal((rows, heads, tokens, dim)).astype(np.float16)


def _filled(impl: ModuleType, tokens: int, group: int = 64, bits: int = 4, dim: int = 64) -> Any:
    cache = impl.QuantizedKVCache(group, bits)
    block = _to(impl, _block(1, tokens, dim=dim))
    cache.update_and_fetch(block, block)
    return cache


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("group", "bits"), [(32, 2), (64, 3), (64, 4), (128, 5), (32, 6), (64, 8)])
def test_bytes_follow_the_formula(impl: ModuleType, group: int, bits: int) -> None:
    dim = max(64, group)
    layout = impl.PaddedQuantKVRows(group, bits)
    layout.merge_rows([_filled(impl, 3, group, bits, dim), _filled(impl, 5, group, bits, dim)])
    # per element: bits/8 bytes of codes + a float16 scale and bias per group of `group`
    per_token = 2 * 2 * dim * (bits / 8 + 2 * 2 / group)  # K and V, 2 heads
    assert layout.projected_bytes(100) == pytest.approx(100 * per_token)
    arrays = layout.held_arrays()
    held = sum(int(np.array(p).nbytes) for p in arrays)
    assert layout.nbytes == held
    if impl is optimized:
        # capacity slack: slots x capacity columns, each column costing per_token
        assert held == layout.slots * layout.capacity * per_token
    else:
        assert held == (3 + 5) * per_token  # the reference holds compact rows


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_signatures_and_table(impl: ModuleType) -> None:
    cache = impl.QuantizedKVCache(32, 4)
    assert cache.signature() == "kv:quant:4:32"
    decode, prefill, verify = (
        owned_cache_layout(cache),
        prefill_cache_layout(cache),
        target_cache_layout(cache),
    )
    assert decode is not None and type(decode) is impl.PaddedQuantKVRows
    assert decode.signature() == "kv:padded-rows-quant:4:32"
    assert type(prefill) is impl.BatchedQuantizedKVCache
    assert type(verify) is impl.BatchedQuantizedKVCache
    assert prefill.signature() == "kv:batched-quant:4:32"


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_codec_mismatch_and_bad_head_dims(impl: ModuleType) -> None:
    layout = impl.PaddedQuantKVRows(64, 4)
    layout.merge_rows([_filled(impl, 2)])
    before = (layout.row_offsets, layout.left_pad)
    with pytest.raises(IncompatibleRowsError, match="kv:quant:8:64"):
        layout.merge_rows([_filled(impl, 2, 64, 8)])
    with pytest.raises(IncompatibleRowsError, match="kv:plain"):
        layout.merge_rows([impl.KVCache()])
    assert (layout.row_offsets, layout.left_pad) == before
    cache = impl.QuantizedKVCache(64, 4)
    odd = _to(impl, _block(1, 2, dim=96))
    with pytest.raises(InvalidInputError, match="multiple of the group size 64"):
        cache.update_and_fetch(odd, odd)
    assert cache.offset == 0
    with pytest.raises(InvalidInputError, match="bits"):
        impl.QuantizedKVCache(64, 7)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_row_moves_keep_codes(impl: ModuleType) -> None:
    source = _filled(impl, 4, 32, 3)
    codes_before = [np.array(p) for p in source.fetch()[0]]
    layout = impl.BatchedQuantizedKVCache(32, 3)
    layout.merge_rows([_filled(impl, 6, 32, 3), source])
    layout.filter_rows([1])
    extracted = layout.extract_row(0)
    assert extracted.signature() == "kv:quant:3:32" and extracted.bits == 3
    for before, after in zip(codes_before, extracted.fetch()[0], strict=True):
        assert np.array_equal(before.view(np.uint8), np.array(after).view(np.uint8))
