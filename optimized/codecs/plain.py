"""The plain codec on MLX: one plane, the block itself; ``mx.fast`` SDPA over it."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.codec import CodecLayout, Role
from kvrows.codecs import Plain
from kvrows.optimized.codecs.common import AsWritten, Planes, mlx_dtype
from kvrows.optimized.codecs.registry import implements

__all__ = ["PlainCodec"]


@implements("plain")
class PlainCodec(AsWritten, CodecLayout):
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    def __init__(self, spec: Plain | None = None) -> None:
        self.spec = spec or Plain()

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        return (mx.zeros((rows, heads, columns, dim), dtype=mlx_dtype(dtype)),)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
