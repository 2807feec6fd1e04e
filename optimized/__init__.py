"""kvrows.optimized: the MLX implementation of every storage and layout."""

from kvrows.optimized.attention import attend
from kvrows.optimized.plain import BatchedKVCache, KVCache, PaddedKVRows

from kvrows.table import register_own_empty_batch, register_row_layouts

__all__ = ["BatchedKVCache", "KVCache", "PaddedKVRows", "attend"]

register_row_layouts(
    KVCache,
    decode=lambda cache: PaddedKVRows(),
    prefill=lambda cache: BatchedKVCache(),
    verify=lambda cache: BatchedKVCache(),
)
register_own_empty_batch(PaddedKVRows)
register_own_empty_batch(BatchedKVCache)
