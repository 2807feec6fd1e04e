"""kvrows.reference: the NumPy executable specification of every storage and layout."""

from kvrows.reference.attention import attend, attention
from kvrows.reference.plain import BatchedKVCache, KVCache, PaddedKVRows
from kvrows.reference.quantized import (
    BatchedQuantizedKVCache,
    PaddedQuantKVRows,
    QuantizedKVCache,
)
from kvrows.reference.ring import (
    BatchedRotatingCache,
    BatchedRotatingQuantCache,
    RaggedRotatingRows,
    RotatingAffineLayout,
    RotatingKVCache,
    RotatingQuantizedKVCache,
)
from kvrows.table import register_own_empty_batch, register_row_layouts

__all__ = [
    "BatchedKVCache",
    "BatchedQuantizedKVCache",
    "BatchedRotatingCache",
    "BatchedRotatingQuantCache",
    "KVCache",
    "PaddedKVRows",
    "PaddedQuantKVRows",
    "QuantizedKVCache",
    "RaggedRotatingRows",
    "RotatingAffineLayout",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "attend",
    "attention",
]

# The decode layouts are reached through their storage's entry and serve as their own
# decode and prefill siblings through the batchable fallback; like the seed, they have no
# verify sibling (a running shared-column batch cannot hold per-row drafts).
register_row_layouts(
    KVCache,
    decode=lambda cache: PaddedKVRows(),
    prefill=lambda cache: BatchedKVCache(),
    verify=lambda cache: BatchedKVCache(),
)
register_row_layouts(
    QuantizedKVCache,
    decode=lambda cache: PaddedQuantKVRows(cache.group_size, cache.bits),
    prefill=lambda cache: BatchedQuantizedKVCache(cache.group_size, cache.bits),
    verify=lambda cache: BatchedQuantizedKVCache(cache.group_size, cache.bits),
)
register_own_empty_batch(BatchedQuantizedKVCache)
register_own_empty_batch(BatchedKVCache)

# Rings: the seed's entries, subclasses first (the table keeps that order itself).
register_row_layouts(
    RotatingQuantizedKVCache,
    decode=lambda cache: BatchedRotatingQuantCache(cache.max_size, cache.group_size, cache.bits),
    prefill=lambda cache: RotatingAffineLayout(cache.max_size, cache.group_size, cache.bits),
    verify=lambda cache: RotatingAffineLayout(cache.max_size, cache.group_size, cache.bits),
)
register_row_layouts(
    RotatingKVCache,
    decode=lambda cache: BatchedRotatingCache(cache.max_size),
    prefill=lambda cache: RaggedRotatingRows(cache.max_size),
    verify=lambda cache: RaggedRotatingRows(cache.max_size),
)
register_own_empty_batch(RotatingAffineLayout)
register_row_layouts(
    BatchedRotatingQuantCache,
    decode=lambda cache: cache.make_empty_batch(),
    prefill=lambda cache: cache.make_empty_batch(),
    verify=lambda cache: RotatingAffineLayout(cache.max_size, cache.group_size, cache.bits),
)
register_own_empty_batch(RaggedRotatingRows)
