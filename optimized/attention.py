"""Attention over a cache, dispatched through the cache's codec (which owns the kernel)."""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from kvrows.codec import Codec
from kvrows.errors import InvalidInputError
from kvrows.protocols import Mask

__all__ = ["attend"]


class _Attended(Protocol):
    @property
    def codec(self) -> Codec: ...

    def fetch(self) -> tuple[Any, Any]: ...


def attend(queries: mx.array, cache: _Attended, mask: Mask, scale: float) -> mx.array:
    """Attention of ``[B, Hq, N, D]`` queries over everything ``cache`` holds now."""
    if not isinstance(queries, mx.array):
        raise InvalidInputError(f"queries must be an mlx array, got {type(queries).__name__}")
    if isinstance(mask, str) and mask != "causal":
        raise InvalidInputError(f"mask must be None, 'causal' or a boolean array, got {mask!r}")
    keys, values = cache.fetch()
    out: mx.array = cache.codec.attend(queries, keys, values, mask, scale)
    return out
