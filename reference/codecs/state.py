"""The state codec in the reference: recurrent planes stored as the layer writes them.

``encode`` is the identity, as an owned copy (a caller writing into its array later must
not reach the cache); there is no attention over state (the layer reads its planes)."""

from __future__ import annotations

from typing import Any

from kvrows.codec import CodecLayout, Role
from kvrows.codecs.state import State
from kvrows.errors import STATE_NOT_ATTENDED, InvalidInputError
from kvrows.reference.codecs.common import AsWritten, Planes
from kvrows.reference.codecs.registry import implements

__all__ = ["StateCodec"]


@implements("state")
class StateCodec(AsWritten, CodecLayout):
    """``state.i`` planes ``[B, *row_shape]``, one array each, as written."""

    def __init__(self, spec: State | None = None) -> None:
        self.spec = State() if spec is None else spec

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        raise InvalidInputError(STATE_NOT_ATTENDED)  # no token planes: zeros_of(rows, kind)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        raise InvalidInputError(STATE_NOT_ATTENDED)
