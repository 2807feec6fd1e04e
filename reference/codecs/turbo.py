"""The TurboQuant codec in the reference (``spec/turbo-codec.md``)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy.typing as npt

from kvrows.codec import Role
from kvrows.codecs import Turbo
from kvrows.protocols import Mask
from kvrows.reference import turbo_codec
from kvrows.reference.codecs.common import Planes, ZeroPlanes, attention
from kvrows.reference.codecs.registry import implements

__all__ = ["TurboCodec", "eager_attention"]


@implements("turbo")
class TurboCodec(ZeroPlanes):
    """TurboQuant (``spec/turbo-codec.md``): keys as planes ``(kIdx, kScales, kZeros)``,
    values as ``(vPacked, vScales)``.

    A read returns the planes; ``attend`` decodes the keys and the values still rotated
    (float32), runs attention over them and un-rotates the output once per query row. :func:`eager_attention` is the oracle that decodes V first.
    """

    spec: Turbo
    defers_values = True

    def __init__(self, spec: Turbo) -> None:
        self.spec = spec
        self.k_bits = spec.k_bits
        self.v_bits = spec.v_bits

    def encode(self, block: npt.NDArray[Any], role: Role = "keys") -> Planes:
        if role == "keys":
            return turbo_codec.encode_keys(block, self.k_bits)
        return turbo_codec.encode_values(block, self.v_bits)

    def decode(self, planes: Planes, role: Role = "keys") -> npt.NDArray[Any]:
        """``role``'s tokens fully decoded, float32 (values un-rotated: the eager path)."""
        if role == "keys":
            return turbo_codec.decode_keys(planes[0], planes[1], planes[2], self.k_bits)
        return turbo_codec.decode_values(planes[0], planes[1], self.v_bits)

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        return tuple(planes)

    def attend(
        self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float
    ) -> npt.NDArray[Any]:
        """Deferred V over the read's planes: keys decoded and values decoded but still
        rotated, float32 (as the optimized attention reads them: on the codes, nothing
        rounded); attention over them, then the output un-rotated (float32 Hadamard, then
        the signs, cast back to the queries' dtype)."""
        decoded = turbo_codec.decode_keys(keys[0], keys[1], keys[2], self.k_bits)
        rotated = turbo_codec.rotated_values(values[0], values[1], self.v_bits)
        return turbo_codec.unrotate(attention(queries, decoded, rotated, mask, scale))


def eager_attention(
    codec: TurboCodec,
    queries: npt.NDArray[Any],
    key_planes: Planes,
    value_planes: Planes,
    mask: Mask,
    scale: float,
) -> npt.NDArray[Any]:
    """The eager oracle of :meth:`TurboCodec.attend`: keys and values fully decoded
    (bfloat16, as a read returns them), then plain attention."""
    keys = codec.decode(key_planes, "keys").astype(ml_dtypes.bfloat16)
    values = codec.decode(value_planes, "values").astype(ml_dtypes.bfloat16)
    return attention(queries, keys, values, mask, scale)
