"""The plain codec in the reference: one plane, the block itself."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from kvrows.codecs import Plain
from kvrows.protocols import Mask
from kvrows.reference.codecs.common import AsWritten, ZeroPlanes, attention
from kvrows.reference.codecs.registry import implements

__all__ = ["PlainCodec"]


@implements("plain")
class PlainCodec(AsWritten, ZeroPlanes):
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    def __init__(self, spec: Plain | None = None) -> None:
        self.spec = Plain() if spec is None else spec

    def attend(
        self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float
    ) -> npt.NDArray[Any]:
        return attention(queries, keys, values, mask, scale)
