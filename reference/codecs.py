"""How the reference stores one token's vector: the codec axis.

A codec turns a ``[B, H, T, D]`` block into a tuple of *planes*, each an
array whose axis 2 is the token axis. Every codec groups along the feature
axis only, so slicing, padding and concatenating planes along tokens never
re-encodes a byte: the row arrangements below are written once, over planes.
"""

from __future__ import annotations

from typing import Any, Protocol

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kvrows.affine_geometry import groups, packed_width, validate_codec, validate_params
from kvrows.errors import InvalidInputError
from kvrows.reference import affine_codec
from kvrows.validation import KvGeometry

__all__ = ["AffineCodec", "Codec", "PlainCodec", "Planes", "dtype_name", "numpy_dtype"]

Planes = tuple[npt.NDArray[Any], ...]

_DTYPES: dict[str, Any] = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
}


def numpy_dtype(name: str) -> Any:
    """The NumPy dtype for a dtype name (bf16 via ``ml_dtypes``)."""
    return np.dtype(_DTYPES[name])


def dtype_name(array: object) -> str:
    """``array``'s dtype name, refusing anything that is not a NumPy array."""
    if not isinstance(array, np.ndarray):
        raise InvalidInputError(
            f"the reference takes NumPy arrays, got {type(array).__module__}.{type(array).__name__}"
        )
    return str(array.dtype.name)


class Codec(Protocol):
    """Encode a block into planes, and read planes back."""

    @property
    def key(self) -> str:
        """Identity of the codec and its parameters (rows of different keys never mix)."""
        ...

    def check(self, geometry: KvGeometry) -> None:
        """Raise ``InvalidInputError`` if this codec cannot store heads of ``geometry``."""
        ...

    def encode(self, block: npt.NDArray[Any]) -> Planes: ...

    def decode(self, planes: Planes, dtype: str) -> npt.NDArray[Any]:
        """The stored values as a ``dtype`` array."""
        ...

    def dense(self, fetched: Any) -> npt.NDArray[Any]:
        """What ``fetched`` (an ``update_and_fetch`` result) holds, as a dense array."""
        ...

    def fetched(self, planes: Planes) -> Any:
        """What ``update_and_fetch`` hands to attention for these planes."""
        ...

    def empty(self, rows: int, heads: int, dim: int, dtype: str) -> Planes:
        """Zero-token planes of this geometry."""
        ...

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int:
        """Bytes one token of one row occupies."""
        ...


class PlainCodec:
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    key = "plain"

    def check(self, geometry: KvGeometry) -> None:
        return None

    def encode(self, block: npt.NDArray[Any]) -> Planes:
        return (np.array(block, copy=True),)

    def decode(self, planes: Planes, dtype: str) -> npt.NDArray[Any]:
        return planes[0]

    def dense(self, fetched: Any) -> npt.NDArray[Any]:
        array: npt.NDArray[Any] = fetched
        return array

    def fetched(self, planes: Planes) -> Any:
        return planes[0]

    def empty(self, rows: int, heads: int, dim: int, dtype: str) -> Planes:
        return (np.zeros((rows, heads, 0, dim), dtype=numpy_dtype(dtype)),)

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int:
        return heads * dim * int(numpy_dtype(dtype).itemsize)


class AffineCodec:
    """MLX affine group quantization: planes ``(packed uint32, scales, biases)``.

    Quantizes each new token once, on append; row operations move codes, scales and
    biases without re-quantizing anything. ``update_and_fetch`` hands out the three
    planes as a tuple, mlx-lm's quantized-cache convention.
    """

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

    def encode(self, block: npt.NDArray[Any]) -> Planes:
        return affine_codec.quantize(block, self.group_size, self.bits)

    def decode(self, planes: Planes, dtype: str) -> npt.NDArray[Any]:
        packed, scales, biases = planes
        return affine_codec.dequantize(packed, scales, biases, self.group_size, self.bits)

    def dense(self, fetched: Any) -> npt.NDArray[Any]:
        return self.decode(tuple(fetched), "")

    def fetched(self, planes: Planes) -> Any:
        return tuple(planes)

    def empty(self, rows: int, heads: int, dim: int, dtype: str) -> Planes:
        scale_dtype = numpy_dtype(dtype)
        return (
            np.zeros((rows, heads, 0, packed_width(dim, self.bits)), dtype=np.uint32),
            np.zeros((rows, heads, 0, groups(dim, self.group_size)), dtype=scale_dtype),
            np.zeros((rows, heads, 0, groups(dim, self.group_size)), dtype=scale_dtype),
        )

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int:
        itemsize = int(numpy_dtype(dtype).itemsize)
        return heads * (
            4 * packed_width(dim, self.bits) + 2 * itemsize * groups(dim, self.group_size)
        )
