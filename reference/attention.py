"""Reference attention: ``softmax(where(mask, q·kᵀ·scale, min)) · v`` in float32."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvrows.errors import InvalidInputError
from kvrows.protocols import Cache, Mask
from kvrows.reference.codecs import Codec, dtype_name

__all__ = ["attend", "attention"]


def _visible(mask: Mask, batch: int, queries: int, keys: int) -> npt.NDArray[np.bool_]:
    if mask is None:
        return np.ones((1, 1, queries, keys), dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            raise InvalidInputError(f"mask must be None, 'causal' or a boolean array, got {mask!r}")
        rows = np.arange(queries)[:, None] + (keys - queries)
        return (np.arange(keys)[None, :] <= rows)[None, None]
    array = np.asarray(mask)
    if array.dtype != np.bool_:
        raise InvalidInputError(f"a mask array must be boolean, got {array.dtype}")
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
        raise InvalidInputError(f"{q_heads} query heads do not group over {kv_heads} KV heads")
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
    """Attention of ``queries`` over everything ``cache`` holds now, decoded by its codec.

    A quantized cache is dequantized (bit-exactly as ``mx.dequantize``) and attended densely.
    """
    keys, values = cache.fetch()
    codec: Codec | None = getattr(cache, "codec", None)
    if codec is not None:
        keys, values = codec.dense(keys), codec.dense(values)
    return attention(queries, keys, values, mask, scale)
