"""The state codec on MLX: recurrent planes stored as the layer writes them.

``encode`` is the identity (MLX arrays are immutable: keeping the layer's array is
keeping its value); there is no attention over state (the layer reads its planes)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.codec import CodecLayout, Role
from kvrows.codecs.state import PlaneShape, State
from kvrows.errors import STATE_NOT_ATTENDED, InvalidInputError
from kvrows.optimized.codecs.common import AsWritten, Planes, mlx_dtype
from kvrows.optimized.codecs.registry import implements

__all__ = ["StateCodec"]


@implements("state")
class StateCodec(AsWritten, CodecLayout):
    """``state.i`` planes ``[B, *row_shape]``, one array each, as written."""

    def __init__(self, spec: State | None = None) -> None:
        self.spec = spec or State()

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        raise InvalidInputError(STATE_NOT_ATTENDED)  # no token planes: zeros_of(rows, kind)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        raise InvalidInputError(STATE_NOT_ATTENDED)

    @staticmethod
    def zeros_of(rows: int, kind: PlaneShape) -> mx.array:
        """Zero rows of one plane (a row that joined before the layer wrote it)."""
        shape, dtype = kind
        return mx.zeros((rows, *shape), dtype=mlx_dtype(dtype))
