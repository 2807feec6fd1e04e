"""The TurboQuant codec on MLX (``spec/turbo-codec.md``)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.codec import TURBO_GROUP, Role
from kvrows.codecs import Turbo
from kvrows.optimized import turbo_codec
from kvrows.optimized.codecs.affine import attention_weights, compute_dtype, grouped_queries
from kvrows.optimized.codecs.common import Planes, ZeroPlanes, sdpa
from kvrows.optimized.codecs.host_attention import host_attention, takes_host_path
from kvrows.optimized.codecs.registry import implements
from kvrows.protocols import Mask

__all__ = ["TurboCodec", "eager_attention", "turbo_attention"]


@implements("turbo")
class TurboCodec(ZeroPlanes):
    """TurboQuant (``spec/turbo-codec.md``): keys as planes ``(kIdx, kScales, kZeros)``,
    values as ``(vPacked, vScales)``; codes and scales bit-identical to the reference's.

    A read returns the planes (as the affine and microscaling codecs do); ``attend`` scores
    the keys on their codes (``mx.quantized_matmul``: a TurboQuant key group is affine), sums
    the values still rotated and un-rotates the output once per query row, so neither a
    decoded K nor an un-rotated V is made. :func:`eager_attention` decodes both first (the
    oracle).
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
        return tuple(planes)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        return turbo_attention(queries, keys, values, mask, scale, self.k_bits, self.v_bits)


def turbo_attention(
    queries: mx.array,
    keys: Planes,
    values: Planes,
    mask: Mask,
    scale: float,
    k_bits: int,
    v_bits: int,
) -> mx.array:
    """Attention over TurboQuant planes (GQA by a head-group axis): scores on the key codes
    (``mx.quantized_matmul``), softmax, the weights times the still-rotated values, then
    one un-rotation of the output.

    The arithmetic runs in the compute dtype :func:`compute_dtype` names (float32 on the
    CPU, where half-precision matmuls are slow and accumulate coarsely), the output in the
    queries' dtype. On the CPU the same steps run in NumPy a few rows at a time (the keys
    and the rotated values decoded by :func:`turbo_codec.host_key_rows` and
    :func:`turbo_codec.host_rotated_rows`; :mod:`host_attention
    <kvrows.optimized.codecs.host_attention>`)."""
    dtype = queries.dtype
    if takes_host_path():
        rotated_out = host_attention(
            queries, int(keys[0].shape[1]), int(keys[0].shape[2]),
            turbo_codec.host_key_rows(keys[0], keys[1], keys[2], k_bits),
            turbo_codec.host_rotated_rows(values[0], values[1], v_bits), mask, scale,
        )  # fmt: skip
        return turbo_codec.unrotate(rotated_out).astype(dtype)
    work = compute_dtype(dtype)
    batch, q_heads, n, _ = queries.shape
    q = grouped_queries(queries, int(keys[0].shape[1]), scale, work)
    # Every key width's stored bitstream is MLX's affine packing (the first code in the low
    # bits; 8 bits: int8 codes, read as uint8 ``idx + 128``), and (idx + zero)·scale is
    # q·scale + bias with q the stored code as MLX reads it.
    codes, k_scales, k_zeros = keys
    offset = 128.0 if k_bits == 8 else 0.0
    stored = codes.view(mx.uint8) ^ 0x80 if k_bits == 8 else codes
    scales32 = k_scales.astype(mx.float32)
    biases = ((k_zeros.astype(mx.float32) - offset) * scales32).astype(work)
    scores = mx.quantized_matmul(
        q, mx.expand_dims(stored.view(mx.uint32), 2), mx.expand_dims(scales32.astype(work), 2),
        mx.expand_dims(biases, 2), transpose=True, group_size=TURBO_GROUP, bits=k_bits,
    )  # fmt: skip
    weights = attention_weights(scores, mask)
    rotated = turbo_codec.rotated_values(values[0], values[1], v_bits).astype(work)
    out = (weights @ mx.expand_dims(rotated, 2)).reshape(batch, q_heads, n, -1)
    return turbo_codec.unrotate(out).astype(dtype)


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
