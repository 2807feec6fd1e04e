"""What every optimized codec shares: plane dtypes and ``mx.fast`` attention."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.codec import CodecLayout, Role
from kvrows.errors import InvalidInputError

__all__ = [
    "FLOAT_DTYPE_NAMES",
    "PLANE_DTYPES",
    "AsWritten",
    "Planes",
    "ZeroPlanes",
    "dtype_name",
    "mlx_dtype",
    "sdpa",
]

Planes = tuple[mx.array, ...]

_DTYPES: dict[str, mx.Dtype] = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}

#: The names of :data:`_DTYPES`, by MLX dtype (a dict lookup: no string made, no call).
FLOAT_DTYPE_NAMES: dict[mx.Dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


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


PLANE_DTYPES: dict[str, mx.Dtype] = {
    **_DTYPES, "uint32": mx.uint32, "uint8": mx.uint8, "int8": mx.int8,
}  # fmt: skip


def sdpa(queries: mx.array, keys: mx.array, values: mx.array, mask: Any, scale: float) -> Any:
    dtype = queries.dtype
    return mx.fast.scaled_dot_product_attention(
        queries, keys.astype(dtype), values.astype(dtype), scale=scale, mask=mask
    )


class AsWritten:
    """A codec that stores each tensor as written: one plane, the block itself (MLX arrays
    are immutable: keeping the caller's array keeps its value; the plain and state
    codecs)."""

    def encode(self, block: Any, role: Role = "keys") -> tuple[Any, ...]:
        return (block,)

    def decode(self, planes: tuple[Any, ...], role: Role = "keys") -> mx.array:
        """The stored values."""
        result: mx.array = planes[0]
        return result

    def fetched(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        return planes[0]


class ZeroPlanes(CodecLayout):
    """Zero planes from the spec's plane layout (the reference's ``ZeroPlanes`` twin): the
    codecs whose planes are other than the block itself."""

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        """Zero planes of ``columns`` tokens (the padding a read shows)."""
        return tuple(
            mx.zeros((rows, heads, columns, p.width), dtype=PLANE_DTYPES[p.dtype])
            for p in self.plane_specs("t", dim, dtype, role)
        )
