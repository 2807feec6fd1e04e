"""What every reference codec shares: plane dtypes, and the one dense attention kernel.

The reference's attention is ``softmax(where(mask, q·kᵀ·scale, min)) · v`` in float32 with
GQA by repeating heads; each codec (``plain``, ``affine``, ``turbo``: one module each)
hands it what its planes hold. ``attend`` dispatches through ``cache.codec.attend``.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kvrows.codec import CodecLayout, Role
from kvrows.errors import (
    InvalidInputError,
    attend_storage_message,
    head_grouping_message,
    mask_message,
)
from kvrows.protocols import Cache, HasCodec, LastReadAttention, Mask

__all__ = [
    "AsWritten",
    "Planes",
    "ZeroPlanes",
    "attend",
    "attention",
    "dtype_name",
    "numpy_dtype",
]

Planes = tuple[npt.NDArray[Any], ...]

_DTYPES: dict[str, Any] = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "uint32": np.uint32,
    "uint8": np.uint8,
    "int8": np.int8,
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


# -- attention ---------------------------------------------------------------------------


def _visible(mask: Mask, batch: int, queries: int, keys: int) -> npt.NDArray[np.bool_]:
    if mask is None:
        return np.ones((1, 1, queries, keys), dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            raise InvalidInputError(mask_message(mask))
        rows = np.arange(queries)[:, None] + (keys - queries)
        return (np.arange(keys)[None, :] <= rows)[None, None]
    array = np.asarray(mask)
    if array.dtype != np.bool_:
        raise InvalidInputError(f"a mask array must be boolean, got {array.dtype}")
    if array.ndim == 1:  # one query's mask ``[S]`` (a serial ring's, mlx-lm's shape)
        array = array[None]
    if array.ndim == 2:
        array = array[None, None]
    if array.ndim != 4 or array.shape[-2:] != (queries, keys) or array.shape[0] not in (1, batch):
        raise InvalidInputError(
            f"mask of shape {array.shape} does not fit {batch} rows, {queries} queries, {keys} keys"
        )
    return array


def attention(
    queries: npt.NDArray[Any],
    keys: npt.NDArray[Any],
    values: npt.NDArray[Any],
    mask: Mask,
    scale: float,
) -> npt.NDArray[Any]:
    """Attention of ``[B, Hq, N, D]`` queries over ``[B, Hkv, S, D]`` keys (GQA by repeating heads)."""
    dtype_name(queries)
    if queries.ndim != 4 or keys.ndim != 4 or values.ndim != 4:
        raise InvalidInputError("queries, keys and values must be [B, H, T, D]")
    batch, q_heads, n, _ = queries.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise InvalidInputError(head_grouping_message(q_heads, kv_heads))
    repeat = q_heads // kv_heads
    k = np.repeat(keys.astype(np.float32), repeat, axis=1)
    v = np.repeat(values.astype(np.float32), repeat, axis=1)
    scores = np.einsum("bhnd,bhsd->bhns", queries.astype(np.float32), k) * np.float32(scale)
    scores = np.where(_visible(mask, batch, n, s), scores, np.finfo(np.float32).min)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out: npt.NDArray[Any] = np.einsum("bhns,bhsd->bhnd", weights, v).astype(queries.dtype)
    return out


def attend(queries: npt.NDArray[Any], cache: Cache, mask: Mask, scale: float) -> npt.NDArray[Any]:
    """Attention of ``queries`` over everything ``cache`` holds now, through its codec (a
    delayed layout: what its last append returned, a mixed read row group by row group)."""
    dtype_name(queries)
    if isinstance(cache, LastReadAttention):
        last: npt.NDArray[Any] | None = cache.attend_last_read(queries, mask, scale)
        if last is not None:
            return last
    if not isinstance(cache, HasCodec):
        raise InvalidInputError(attend_storage_message(cache))
    out: npt.NDArray[Any] = cache.codec.attend(queries, *cache.fetch(), mask, scale)
    return out


# -- planes ------------------------------------------------------------------------------


class ZeroPlanes(CodecLayout):
    """Zero planes from the spec's plane layout, for every reference codec."""

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        """Zero planes of ``columns`` tokens (the padding a read shows)."""
        return tuple(
            np.zeros((rows, heads, columns, p.width), dtype=numpy_dtype(p.dtype))
            for p in self.plane_specs("t", dim, dtype, role)
        )


class AsWritten:
    """A codec that stores each tensor as written: one plane, an owned copy of the block
    (the plain and state codecs)."""

    def encode(self, block: npt.NDArray[Any], role: Role = "keys") -> Planes:
        return (np.array(block, copy=True),)

    def decode(self, planes: Planes, role: Role = "keys") -> npt.NDArray[Any]:
        """The stored values."""
        return planes[0]

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        return planes[0]
