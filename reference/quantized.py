"""Affine-quantized full-attention KV: the serial storage and its two layouts.

The same storage and arrangements as the plain family (``kvrows.reference.storage``) over
the affine codec: keys and values are quantized once, on append, and every row
operation moves codes, scales and biases without re-quantizing.
"""

from __future__ import annotations

from kvrows.common import AffineParameters
from kvrows.reference.codecs import AffineCodec
from kvrows.reference.storage import FullAttentionCache, RowLayout

__all__ = ["BatchedQuantizedKVCache", "PaddedQuantKVRows", "QuantizedKVCache"]


class QuantizedKVCache(AffineParameters, FullAttentionCache):
    """Serial affine-quantized full-attention cache (``spec/QuantizedKVCache.md``)."""

    codec: AffineCodec

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        super().__init__()
        self.codec = AffineCodec(group_size, bits)

    def signature(self) -> str:
        return f"kv:quant:{self.bits}:{self.group_size}"


class _QuantizedRows(AffineParameters, RowLayout):
    """What both affine layouts share: the codec parameters and the serial storage."""

    codec: AffineCodec
    serial_class = QuantizedKVCache
    prefix = ""

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        super().__init__()
        self.codec = AffineCodec(group_size, bits)

    def signature(self) -> str:
        return f"{self.prefix}:{self.bits}:{self.group_size}"

    def make_empty_batch(self) -> RowLayout:
        return type(self)(self.group_size, self.bits)

    def blank_row(self) -> FullAttentionCache:
        return QuantizedKVCache(self.group_size, self.bits)


class PaddedQuantKVRows(_QuantizedRows):
    """Decode layout of ``QuantizedKVCache``: one write column (``spec/PaddedQuantKVRows.md``)."""

    shared_column = True
    prefix = "kv:padded-rows-quant"


class BatchedQuantizedKVCache(_QuantizedRows):
    """Prefill/verify layout of ``QuantizedKVCache``: ragged (``spec/BatchedQuantizedKVCache.md``)."""

    shared_column = False
    prefix = "kv:batched-quant"
