"""Plain (unquantized) full-attention KV: the serial storage and its two layouts."""

from __future__ import annotations

from kvrows.optimized.codecs import PlainCodec
from kvrows.optimized.storage import FullAttentionCache, RowLayout

__all__ = ["BatchedKVCache", "KVCache", "PaddedKVRows"]


class KVCache(FullAttentionCache):
    """Serial plain full-attention cache (``spec/KVCache.md``)."""

    codec = PlainCodec()
    signature_text = "kv:plain"


class PaddedKVRows(RowLayout):
    """Decode layout of ``KVCache``: rows share one write column (``spec/PaddedKVRows.md``)."""

    codec = PlainCodec()
    serial_class = KVCache
    shared_column = True
    signature_text = "kv:padded-rows"


class BatchedKVCache(RowLayout):
    """Prefill/verify layout of ``KVCache``: ragged rows (``spec/BatchedKVCache.md``)."""

    codec = PlainCodec()
    serial_class = KVCache
    shared_column = False
    signature_text = "kv:batched-positions"
