"""The TurboQuant codec on MLX (``spec/turbo-codec.md``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.codec import Role
from kvrows.codecs import Turbo
from kvrows.optimized import turbo_codec
from kvrows.optimized.codecs.common import Planes, ZeroPlanes, sdpa
from kvrows.optimized.codecs.registry import implements

__all__ = ["TurboCodec", "eager_attention"]


@implements("turbo")
class TurboCodec(ZeroPlanes):
    """TurboQuant (``spec/turbo-codec.md``): keys as planes ``(kIdx, kScales, kZeros)``,
    values as ``(vPacked, vScales)``; codes and scales bit-identical to the reference's.

    A read returns keys dequantized and values **still rotated**, both bfloat16; ``attend``
    runs ``mx.fast`` SDPA over them and un-rotates the output once per query row, so no
    full-precision copy of V is made. :func:`eager_attention` decodes V first (the oracle).
    """

    spec: Turbo
    defers_values = True

    def __init__(self, spec: Turbo) -> None:
        self.spec = spec
        self.k_bits = spec.k_bits
        self.v_bits = spec.v_bits

    def encode(self, block: Any, role: Role = "keys") -> Planes:
        if role == "keys":
            return turbo_codec.encode_keys(block, self.k_bits)
        return turbo_codec.encode_values(block, self.v_bits)

    def decode(self, planes: Planes, role: Role = "keys") -> mx.array:
        """``role``'s tokens fully decoded, float32 (values un-rotated: the eager path)."""
        if role == "keys":
            return turbo_codec.decode_keys(planes[0], planes[1], planes[2], self.k_bits)
        return turbo_codec.decode_values(planes[0], planes[1], self.v_bits)

    def fetched(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        if role == "keys":
            return turbo_codec.decode_keys(planes[0], planes[1], planes[2], self.k_bits).astype(
                mx.bfloat16
            )
        return turbo_codec.rotated_values(planes[0], planes[1], self.v_bits).astype(mx.bfloat16)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        """Deferred V: SDPA over the keys and the rotated values, then the output
        un-rotated (float32 Hadamard, then the signs, cast back to the queries' dtype)."""
        out = sdpa(queries, keys, values, mask, scale)
        return turbo_codec.unrotate(out)


def eager_attention(
    codec: TurboCodec,
    queries: mx.array,
    key_planes: Planes,
    value_planes: Planes,
    mask: Any,
    scale: float,
) -> mx.array:
    """The eager oracle of :meth:`TurboCodec.attend`: keys and values fully decoded
    (bfloat16, as a read returns them), then SDPA."""
    keys = codec.decode(key_planes, "keys").astype(mx.bfloat16)
    values = codec.decode(value_planes, "values").astype(mx.bfloat16)
    out: mx.array = sdpa(queries, keys, values, mask, scale)
    return out
