"""The microscaling codecs on MLX: ``mx.quantize`` planes of the ``mxfp8``, ``mxfp4`` and
``nvfp4`` modes, and attention straight over them with ``mx.quantized_matmul`` in the same
mode (no dequantized copy is made)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.codec import Role
from kvrows.codecs.mx import Microscaled
from kvrows.optimized.codecs.affine import quantized_attention
from kvrows.optimized.codecs.common import Planes, ZeroPlanes
from kvrows.optimized.codecs.registry import implements

__all__ = ["MicroscaledCodec"]


@implements("mx")
class MicroscaledCodec(ZeroPlanes):
    """MLX's microscaling modes: planes ``(codes uint32, scales uint8)``."""

    spec: Microscaled
    defers_values = True  # the reads are codes: only this codec's attend is right

    def __init__(self, spec: Microscaled) -> None:
        self.spec = spec
        self.group_size, self.bits, self.mode = spec.group_size, spec.bits, spec.mode

    def encode(self, block: Any, role: Role = "keys") -> Planes:
        # (codes, scales): a microscaling mode has no biases
        return tuple(mx.quantize(block, group_size=self.group_size, bits=self.bits, mode=self.mode))

    def fetched(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        return tuple(planes)

    def decode(self, planes: Planes, role: Role = "keys") -> mx.array:
        """The stored values in float32 (every one exact there)."""
        codes, scales = planes
        return mx.dequantize(
            codes, scales, None, group_size=self.group_size, bits=self.bits, mode=self.mode,
            dtype=mx.float32,
        )  # fmt: skip

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        return quantized_attention(
            queries, keys, values, mask, scale, self.group_size, self.bits, self.mode
        )
