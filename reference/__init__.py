"""kvrows.reference: the NumPy executable specification of every storage and layout."""

from kvrows.reference.attention import attend, attention
from kvrows.reference.plain import BatchedKVCache, KVCache, PaddedKVRows

from kvrows.table import register_own_empty_batch, register_row_layouts

__all__ = ["BatchedKVCache", "KVCache", "PaddedKVRows", "attend", "attention"]

register_row_layouts(
    KVCache,
    decode=lambda cache: PaddedKVRows(),
    prefill=lambda cache: BatchedKVCache(),
    verify=lambda cache: BatchedKVCache(),
)
register_own_empty_batch(PaddedKVRows)
register_own_empty_batch(BatchedKVCache)
