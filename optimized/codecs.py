"""How the optimized implementation stores one token's vector: the codec axis.

Mirrors ``kvrows.reference.codecs`` on MLX arrays: a codec turns a
``[B, H, T, D]`` block into planes whose axis 2 is the token axis, so token
surgery (slice, pad, gather, scatter) is written once over planes.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from kvrows.affine_geometry import groups, packed_width, validate_codec, validate_params
from kvrows.errors import InvalidInputError
from kvrows.validation import KvGeometry

__all__ = ["AffineCodec", "Codec", "PlainCodec", "Planes", "dtype_name", "mlx_dtype"]

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

    def check(self, geometry: KvGeometry) -> None:
        """Raise ``InvalidInputError`` if this codec cannot store heads of ``geometry``."""
        ...

    def encode(self, block: mx.array) -> Planes: ...

    def fetched(self, planes: Planes) -> Any: ...

    def zeros(self, rows: int, heads: int, columns: int, dim: int, dtype: str) -> Planes:
        """Zero planes of ``columns`` tokens."""
        ...

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int: ...


class PlainCodec:
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    key = "plain"

    def check(self, geometry: KvGeometry) -> None:
        return None

    def encode(self, block: mx.array) -> Planes:
        return (block,)

    def fetched(self, planes: Planes) -> Any:
        return planes[0]

    def zeros(self, rows: int, heads: int, columns: int, dim: int, dtype: str) -> Planes:
        return (mx.zeros((rows, heads, columns, dim), dtype=mlx_dtype(dtype)),)

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int:
        return heads * dim * mlx_dtype(dtype).size


class AffineCodec:
    """MLX affine group quantization (``mx.quantize``): planes ``(packed, scales, biases)``."""

    def __init__(self, group_size: int, bits: int) -> None:
        validate_params(group_size, bits)
        self.group_size = group_size
        self.bits = bits
        self.key = f"affine:{bits}:{group_size}"

    def check(self, geometry: KvGeometry) -> None:
        for name, dim in (("key", geometry.key_dim), ("value", geometry.value_dim)):
            try:
                validate_codec(dim, self.group_size, self.bits)
            except InvalidInputError as error:
                raise InvalidInputError(f"{name} head dim {dim}: {error}") from None

    def encode(self, block: mx.array) -> Planes:
        packed, scales, biases = mx.quantize(
            block, group_size=self.group_size, bits=self.bits, mode="affine"
        )
        return packed, scales, biases

    def fetched(self, planes: Planes) -> Any:
        return tuple(planes)

    def zeros(self, rows: int, heads: int, columns: int, dim: int, dtype: str) -> Planes:
        scale_dtype = mlx_dtype(dtype)
        width, count = packed_width(dim, self.bits), groups(dim, self.group_size)
        return (
            mx.zeros((rows, heads, columns, width), dtype=mx.uint32),
            mx.zeros((rows, heads, columns, count), dtype=scale_dtype),
            mx.zeros((rows, heads, columns, count), dtype=scale_dtype),
        )

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int:
        itemsize = mlx_dtype(dtype).size
        return heads * (
            4 * packed_width(dim, self.bits) + 2 * itemsize * groups(dim, self.group_size)
        )
