"""The codec axis on MLX: how one token's vector is stored, read and attended over.

Both codecs implement ``kvrows.codec.Codec``: a ``[B, H, T, D]`` block becomes planes whose
axis 2 is the token axis, so the row machinery moves planes without re-encoding a byte, and
``attend`` dispatches through the codec that owns its kernel (``mx.fast`` SDPA for plain
planes, ``mx.quantized_matmul`` straight over affine planes, as mlx-lm's quantized attention
does: no dequantized copy of the cache is made).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx

from kvrows.affine_geometry import groups, packed_width, validate_codec
from kvrows.codec import CodecLayout, Role, check_turbo_dim
from kvrows.errors import InvalidInputError, head_dim_message, head_grouping_message
from kvrows.optimized import turbo_codec
from kvrows.protocols import Mask
from kvrows.schemes import Affine, CodecSpec, Plain, Turbo
from kvrows.validation import KvGeometry

__all__ = [
    "AffineCodec",
    "PlainCodec",
    "Planes",
    "TurboCodec",
    "dtype_name",
    "eager_attention",
    "make_codec",
    "mlx_dtype",
    "quantized_attention",
]

Planes = tuple[mx.array, ...]

_DTYPES: dict[str, mx.Dtype] = {
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}


def mlx_dtype(name: str) -> mx.Dtype:
    """The MLX dtype for a dtype name."""
    return _DTYPES[name]


def dtype_name(array: object) -> str:
    """``array``'s dtype name, refusing anything that is not an MLX array."""
    if not isinstance(array, mx.array):
        raise InvalidInputError(
            f"the optimized implementation takes mlx arrays, got "
            f"{type(array).__module__}.{type(array).__name__}"
        )
    return str(array.dtype).rsplit(".", 1)[-1]


class PlainCodec(CodecLayout):
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    def __init__(self, spec: Plain | None = None) -> None:
        self.spec = spec or Plain()

    def check(self, geometry: KvGeometry) -> None:
        return None

    def encode(self, block: Any, role: Role = "keys") -> Planes:
        return (block,)

    def fetched(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        return planes[0]

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        return (mx.zeros((rows, heads, columns, dim), dtype=mlx_dtype(dtype)),)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


class AffineCodec(CodecLayout):
    """MLX affine group quantization (``mx.quantize``): planes ``(packed, scales, biases)``."""

    spec: Affine

    def __init__(self, spec: Affine) -> None:
        self.spec = spec
        self.group_size = spec.group_size
        self.bits = spec.bits

    def check(self, geometry: KvGeometry) -> None:
        for name, dim in (("key", geometry.key_dim), ("value", geometry.value_dim)):
            try:
                validate_codec(dim, self.group_size, self.bits)
            except InvalidInputError as error:
                raise InvalidInputError(head_dim_message(name, dim, error)) from None

    def encode(self, block: Any, role: Role = "keys") -> Planes:
        packed, scales, biases = mx.quantize(
            block, group_size=self.group_size, bits=self.bits, mode="affine"
        )
        return packed, scales, biases

    def fetched(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        return tuple(planes)

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        scale_dtype = mlx_dtype(dtype)
        width, count = packed_width(dim, self.bits), groups(dim, self.group_size)
        return (
            mx.zeros((rows, heads, columns, width), dtype=mx.uint32),
            mx.zeros((rows, heads, columns, count), dtype=scale_dtype),
            mx.zeros((rows, heads, columns, count), dtype=scale_dtype),
        )

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        return quantized_attention(queries, keys, values, mask, scale, self.group_size, self.bits)


_PLANE_DTYPES: dict[str, mx.Dtype] = {**_DTYPES, "uint8": mx.uint8, "int8": mx.int8}


class TurboCodec(CodecLayout):
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

    def check(self, geometry: KvGeometry) -> None:
        for name, dim in (("key", geometry.key_dim), ("value", geometry.value_dim)):
            try:
                check_turbo_dim(dim)
            except InvalidInputError as error:
                raise InvalidInputError(head_dim_message(name, dim, error)) from None

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

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        return tuple(
            mx.zeros((rows, heads, columns, p.width), dtype=_PLANE_DTYPES[p.dtype])
            for p in self.plane_specs("t", dim, dtype, role)
        )

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        """Deferred V: SDPA over the keys and the rotated values, then the output
        un-rotated (float32 Hadamard, then the signs, cast back to the queries' dtype)."""
        out = _sdpa(queries, keys, values, mask, scale)
        return turbo_codec.unrotate(out)


def _sdpa(queries: mx.array, keys: mx.array, values: mx.array, mask: Any, scale: float) -> Any:
    dtype = queries.dtype
    return mx.fast.scaled_dot_product_attention(
        queries, keys.astype(dtype), values.astype(dtype), scale=scale, mask=mask
    )


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
    out: mx.array = _sdpa(queries, keys, values, mask, scale)
    return out


@cache
def make_codec(spec: CodecSpec) -> PlainCodec | AffineCodec | TurboCodec:
    """The codec a spec names (one shared instance per spec: codecs hold no state)."""
    if isinstance(spec, Plain):
        return PlainCodec(spec)
    if isinstance(spec, Affine):
        return AffineCodec(spec)
    if isinstance(spec, Turbo):
        return TurboCodec(spec)
    raise InvalidInputError(f"the optimized implementation has no {spec.kind} codec yet")


def _boolean_mask(mask: Mask, queries: int, keys: int) -> mx.array | None:
    if mask is None:
        return None
    if isinstance(mask, str):
        rows = mx.arange(queries)[:, None] + (keys - queries)
        return mx.arange(keys)[None, :] <= rows
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        raise InvalidInputError("a mask array must be a boolean mlx array")
    return mask


def quantized_attention(
    queries: mx.array,
    keys: tuple[mx.array, ...],
    values: tuple[mx.array, ...],
    mask: Mask,
    scale: float,
    group_size: int,
    bits: int,
) -> mx.array:
    """Attention over affine planes with ``mx.quantized_matmul`` (GQA by a head-group axis).

    On the CPU backend ``quantized_matmul`` accumulates half-precision inputs in low
    precision (about 7% off, and 5x slower than float32 there): the queries go in as
    float32 and the output comes back in their dtype.
    """
    dtype = queries.dtype
    if dtype != mx.float32 and mx.default_device() == mx.cpu:
        out = quantized_attention(
            queries.astype(mx.float32), keys, values, mask, scale, group_size, bits
        )
        return out.astype(dtype)
    batch, q_heads, n, dim = queries.shape
    kv_heads, s = keys[0].shape[1], keys[0].shape[2]
    if q_heads % kv_heads:
        raise InvalidInputError(head_grouping_message(q_heads, kv_heads))
    repeat = q_heads // kv_heads
    q = (queries * scale).reshape(batch, kv_heads, repeat, n, dim)
    k_packed, k_scales, k_biases = (mx.expand_dims(p, 2) for p in keys)
    v_packed, v_scales, v_biases = (mx.expand_dims(p, 2) for p in values)
    scores = mx.quantized_matmul(
        q, k_packed, k_scales, k_biases, transpose=True, group_size=group_size, bits=bits
    )
    visible = _boolean_mask(mask, n, s)
    if visible is not None:
        if visible.ndim == 4:  # [B, 1, N, S] -> [B, 1, 1, N, S] over the head-group axis
            visible = mx.expand_dims(visible, 2)
        scores = mx.where(visible, scores, mx.finfo(scores.dtype).min)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(
        weights, v_packed, v_scales, v_biases, transpose=False, group_size=group_size, bits=bits
    )
    return out.reshape(batch, q_heads, n, -1)
