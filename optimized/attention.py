"""Attention over a cache, dispatched through the cache's codec (which owns the kernel)."""

from __future__ import annotations

import mlx.core as mx

from kvrows.codec import Codec
from kvrows.errors import InvalidInputError, attend_storage_message, mask_message
from kvrows.protocols import Cache, HasCodec, LastReadAttention, Mask

__all__ = ["attend"]


def attend(queries: mx.array, cache: Cache, mask: Mask, scale: float) -> mx.array:
    """Attention of ``[B, Hq, N, D]`` queries over everything ``cache`` holds now (a
    delayed layout: what its last append returned, a mixed read row group by row group)."""
    if not isinstance(queries, mx.array):
        raise InvalidInputError(f"queries must be an mlx array, got {type(queries).__name__}")
    if isinstance(cache, LastReadAttention):
        last: mx.array | None = cache.attend_last_read(queries, mask, scale)
        if last is not None:
            return last
    if isinstance(mask, str) and mask != "causal":
        raise InvalidInputError(mask_message(mask))
    if not isinstance(cache, HasCodec):
        raise InvalidInputError(attend_storage_message(cache))
    codec: Codec = cache.codec
    keys, values = cache.fetch()
    out: mx.array = codec.attend(queries, keys, values, mask, scale)
    return out
