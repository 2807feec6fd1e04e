"""How the optimized implementation stores one token's vector: the codec axis.

Mirrors ``kvrows.reference.codecs`` on MLX arrays: a codec turns a
``[B, H, T, D]`` block into planes whose axis 2 is the token axis, so token
surgery (slice, pad, gather, scatter) is written once over planes.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from kvrows.errors import InvalidInputError

__all__ = ["Codec", "PlainCodec", "Planes", "dtype_name", "mlx_dtype"]

Planes = tuple[mx.array, ...]

_DTYPES: dict[str, mx.Dtype] = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}


def mlx_dtype(name: str) -> mx.Dtype:
    """The MLX dtype for a dtype name."""
    return _DTYPES[name]


def dtype_name(array: object) -> str:
    """``array``'s dtype name, refusing anything that is not an MLX array."""
    if not isinstance(array, mx.array):
        raise InvalidInputError(
            f"the optimized implementation takes mlx arrays, got "
            f"{type(array).__module__}.{type(array).__name__}"
        )
    return str(array.dtype).rsplit(".", 1)[-1]


class Codec(Protocol):
    """Encode a block into planes, and describe the planes' shapes."""

    @property
    def key(self) -> str: ...

    def encode(self, block: mx.array) -> Planes: ...

    def fetched(self, planes: Planes) -> Any: ...

    def zeros(self, rows: int, heads: int, columns: int, dim: int, dtype: str) -> Planes:
        """Zero planes of ``columns`` tokens."""
        ...

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int: ...


class PlainCodec:
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    key = "plain"

    def encode(self, block: mx.array) -> Planes:
        return (block,)

    def fetched(self, planes: Planes) -> Any:
        return planes[0]

    def zeros(self, rows: int, heads: int, columns: int, dim: int, dtype: str) -> Planes:
        return (mx.zeros((rows, heads, columns, dim), dtype=mlx_dtype(dtype)),)

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int:
        return heads * dim * mlx_dtype(dtype).size
