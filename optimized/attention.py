"""Optimized attention over a cache: ``mx.fast.scaled_dot_product_attention``."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.errors import InvalidInputError
from kvrows.protocols import Cache, Mask

__all__ = ["attend"]


def attend(queries: mx.array, cache: Cache, mask: Mask, scale: float) -> mx.array:
    """Attention of ``[B, Hq, N, D]`` queries over everything ``cache`` holds now (GQA native)."""
    if not isinstance(queries, mx.array):
        raise InvalidInputError(f"queries must be an mlx array, got {type(queries).__name__}")
    keys, values = cache.fetch()
    if isinstance(mask, str) and mask != "causal":
        raise InvalidInputError(f"mask must be None, 'causal' or a boolean array, got {mask!r}")
    fused_mask: Any = mask
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=fused_mask)
