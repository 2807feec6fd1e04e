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

__all__ = ["Codec", "PlainCodec", "Planes", "dtype_name", "numpy_dtype"]

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
    from kvrows.errors import InvalidInputError

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

    def encode(self, block: npt.NDArray[Any]) -> Planes: ...

    def decode(self, planes: Planes, dtype: str) -> npt.NDArray[Any]:
        """The stored values as a ``dtype`` array."""
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

    def encode(self, block: npt.NDArray[Any]) -> Planes:
        return (np.array(block, copy=True),)

    def decode(self, planes: Planes, dtype: str) -> npt.NDArray[Any]:
        return planes[0]

    def fetched(self, planes: Planes) -> Any:
        return planes[0]

    def empty(self, rows: int, heads: int, dim: int, dtype: str) -> Planes:
        return (np.zeros((rows, heads, 0, dim), dtype=numpy_dtype(dtype)),)

    def token_bytes(self, heads: int, dim: int, dtype: str) -> int:
        return heads * dim * int(numpy_dtype(dtype).itemsize)
