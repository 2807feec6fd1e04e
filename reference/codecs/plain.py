"""The plain codec in the reference: one plane, the block itself."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvrows.codec import Role
from kvrows.codecs import Plain
from kvrows.protocols import Mask
from kvrows.reference.codecs.common import Planes, ZeroPlanes, attention
from kvrows.reference.codecs.registry import implements

__all__ = ["PlainCodec"]


@implements("plain")
class PlainCodec(ZeroPlanes):
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    def __init__(self, spec: Plain | None = None) -> None:
        self.spec = Plain() if spec is None else spec

    def encode(self, block: npt.NDArray[Any], role: Role = "keys") -> Planes:
        return (np.array(block, copy=True),)

    def decode(self, planes: Planes, role: Role = "keys") -> npt.NDArray[Any]:
        """The stored values."""
        return planes[0]

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        return planes[0]

    def attend(
        self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float
    ) -> npt.NDArray[Any]:
        return attention(queries, keys, values, mask, scale)
