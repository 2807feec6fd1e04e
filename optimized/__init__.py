"""kvrows.optimized: the MLX implementation of every storage and layout."""

from kvrows.optimized.attention import attend
from kvrows.optimized.plain import BatchedKVCache, KVCache, PaddedKVRows
from kvrows.optimized.quantized import (
    BatchedQuantizedKVCache,
    PaddedQuantKVRows,
    QuantizedKVCache,
)
from kvrows.table import register_own_empty_batch, register_row_layouts

__all__ = [
    "BatchedKVCache",
    "BatchedQuantizedKVCache",
    "KVCache",
    "PaddedKVRows",
    "PaddedQuantKVRows",
    "QuantizedKVCache",
    "attend",
]

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
register_own_empty_batch(PaddedKVRows)
register_own_empty_batch(PaddedQuantKVRows)
register_own_empty_batch(BatchedQuantizedKVCache)
register_own_empty_batch(BatchedKVCache)
