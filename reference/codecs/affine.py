"""The affine codec in the reference: ``mx.quantize``'s planes, bit-exact, in NumPy."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

from kvrows.codec import Role
from kvrows.codecs import Affine
from kvrows.protocols import Mask
from kvrows.reference import affine_codec
from kvrows.reference.codecs.common import Planes, ZeroPlanes, attention
from kvrows.reference.codecs.registry import implements

__all__ = ["AffineCodec"]


@implements("affine")
class AffineCodec(ZeroPlanes):
    """MLX affine group quantization: planes ``(packed uint32, scales, biases)``.

    Quantizes each new token once, on append; row operations move codes, scales and
    biases without re-quantizing anything. ``update_and_fetch`` hands out the three
    planes as a tuple, mlx-lm's quantized-cache convention.
    """

    spec: Affine

    def __init__(self, spec: Affine) -> None:
        self.spec = spec
        self.group_size = spec.group_size
        self.bits = spec.bits

    def encode(self, block: npt.NDArray[Any], role: Role = "keys") -> Planes:
        return affine_codec.quantize(block, self.group_size, self.bits)

    def decode(self, planes: Planes, role: Role = "keys") -> npt.NDArray[Any]:
        """The stored values, dequantized exactly as ``mx.dequantize`` on the CPU."""
        packed, scales, biases = planes
        return affine_codec.dequantize(packed, scales, biases, self.group_size, self.bits)

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        return tuple(planes)

    def attend(
        self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float
    ) -> npt.NDArray[Any]:
        return attention(queries, self.decode(keys), self.decode(values), mask, scale)
