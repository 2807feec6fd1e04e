"""The affine codec on MLX: ``mx.quantize`` planes, and attention straight over them with
``mx.quantized_matmul`` (as mlx-lm's quantized attention: no dequantized copy is made)."""

from __future__ import annotations

from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.codec import Role
from kvrows.codecs import Affine
from kvrows.errors import MLX_MASK_NOT_BOOLEAN, InvalidInputError, head_grouping_message
from kvrows.optimized.codecs.common import Planes, ZeroPlanes
from kvrows.optimized.codecs.host_attention import host_attention, takes_host_path
from kvrows.optimized.codecs.registry import implements
from kvrows.optimized.host import (
    E4M3_BIAS_SHIFT,
    PlacedE4m3,
    RowDecoder,
    code_runs,
    e4m3_floats,
    e8m0_scales,
    group_rows,
)
from kvrows.protocols import Mask

__all__ = [
    "BYTE_WIDTHS",
    "AffineCodec",
    "attention_weights",
    "boolean_mask",
    "byte_decoded",
    "compute_dtype",
    "grouped_queries",
    "quantized_attention",
]


@implements("affine")
class AffineCodec(ZeroPlanes):
    """MLX affine group quantization (``mx.quantize``): planes ``(packed, scales, biases)``."""

    spec: Affine

    def __init__(self, spec: Affine) -> None:
        self.spec = spec
        self.group_size = spec.group_size
        self.bits = spec.bits

    def encode(self, block: Any, role: Role = "keys") -> Planes:
        packed, scales, biases = mx.quantize(
            block, group_size=self.group_size, bits=self.bits, mode="affine"
        )
        return packed, scales, biases

    def fetched(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        return tuple(planes)

    def decode(self, planes: Planes, role: Role = "keys") -> mx.array:
        """The stored values, ``mx.dequantize``d; on the CPU, widths that pack whole codes
        into each byte (2, 4, 8 bits) unpack through a byte view (:func:`byte_codes`)."""
        packed, scales, biases = planes
        if self.bits in BYTE_WIDTHS and mx.default_device() == mx.cpu:
            return byte_decoded(packed, scales, biases, self.group_size, self.bits)
        return mx.dequantize(
            packed, scales, biases, group_size=self.group_size, bits=self.bits, mode="affine"
        )

    def attends_itself(self) -> bool:
        """On the CPU's host path: its attention there is faster than mlx-lm's kernel."""
        return takes_host_path()

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        return quantized_attention(queries, keys, values, mask, scale, self.group_size, self.bits)


def boolean_mask(mask: Mask, queries: int, keys: int) -> mx.array | None:
    if mask is None:
        return None
    if isinstance(mask, str):
        rows = mx.arange(queries)[:, None] + (keys - queries)
        return mx.arange(keys)[None, :] <= rows
    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_:
        raise InvalidInputError(MLX_MASK_NOT_BOOLEAN)
    return mask


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """The dtype attention over encoded planes computes in: float32 on the CPU (its
    half-precision matmuls, ``quantized_matmul`` included, are slow and accumulate
    coarsely there), the activations' dtype elsewhere."""
    return mx.float32 if mx.default_device() == mx.cpu else dtype


def grouped_queries(
    queries: mx.array, kv_heads: int, scale: float, dtype: mx.Dtype | None = None
) -> mx.array:
    """``queries · scale`` as ``[B, kv_heads, repeat, N, D]`` (GQA by a head-group axis),
    in ``dtype`` (default: theirs)."""
    batch, q_heads, n, dim = queries.shape
    if q_heads % kv_heads:
        raise InvalidInputError(head_grouping_message(q_heads, kv_heads))
    cast = queries if dtype is None else queries.astype(dtype)
    return (cast * scale).reshape(batch, kv_heads, q_heads // kv_heads, n, dim)


def attention_weights(scores: mx.array, mask: Mask) -> mx.array:
    """Softmax over ``[B, kv_heads, repeat, N, S]`` scores, the columns ``mask`` hides at
    the dtype's minimum first."""
    visible = boolean_mask(mask, int(scores.shape[-2]), int(scores.shape[-1]))
    if visible is not None:
        if visible.ndim == 4:  # [B, 1, N, S] -> [B, 1, 1, N, S] over the head-group axis
            visible = mx.expand_dims(visible, 2)
        scores = mx.where(visible, scores, mx.finfo(scores.dtype).min)
    return mx.softmax(scores, axis=-1, precise=True)


#: Code widths that fill whole bytes (no code straddles two): :func:`byte_decoded` reads them.
BYTE_WIDTHS = frozenset({2, 4, 8})
_SHIFTS = {bits: mx.array(list(range(0, 8, bits)), dtype=mx.uint8) for bits in BYTE_WIDTHS}


def byte_decoded(
    packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """``mx.dequantize(packed, scales, biases, group_size, bits)`` for ``bits`` in
    :data:`BYTE_WIDTHS`, bit for bit: the codes unpacked from a ``uint8`` view of the
    words (MLX packs code ``j`` of a word at bit ``bits * j``, lowest first; the words are
    little-endian), then the same ``astype``, ``multiply`` and ``add`` in the scales'
    dtype. MLX's CPU ``dequantize`` builds those from about 20 primitives (a shift pair per
    byte, a concatenation); this takes 5 to 8, which is most of a one-token decode."""
    codes = mx.view(packed, mx.uint8)
    if bits != 8:  # every code of a byte, lowest bits first
        mask = mx.array((1 << bits) - 1, dtype=mx.uint8)
        codes = mx.bitwise_and(mx.right_shift(codes[..., None], _SHIFTS[bits]), mask)
    values = codes.astype(scales.dtype).reshape(*scales.shape, group_size)
    decoded = values * scales[..., None] + biases[..., None]
    return decoded.reshape(*packed.shape[:-1], -1)


@cache
def _levels(mode: str, bits: int) -> np.ndarray[Any, Any]:
    """The runs table (:func:`~kvrows.optimized.host.code_runs`) of a mode's element codes:
    the codes themselves (affine: the scale and bias come after), FP4 E2M1 or FP8 E4M3."""
    codes = np.arange(2**bits)
    if mode == "affine":
        return code_runs(codes, bits)
    import ml_dtypes  # here: its import takes half a second of every process's start

    small = ml_dtypes.float8_e4m3fn if bits == 8 else ml_dtypes.float4_e2m1fn
    return code_runs(codes.astype(np.uint8).view(small).astype(np.float32), bits)


def _host_rows(
    planes: tuple[mx.array, ...], group_size: int, bits: int, mode: str, slot: str
) -> RowDecoder:
    """Batch rows of quantized planes decoded in NumPy, float32: ``mx.dequantize``'s values
    (affine: code·scale + bias; the microscaling modes: the small float times its E8M0 or,
    ``nvfp4``, E4M3 group scale)."""
    stream = np.asarray(planes[0]).view(np.uint8)
    if mode == "affine":
        scales = np.asarray(planes[1].astype(mx.float32))[..., None]
        biases: np.ndarray[Any, Any] | None = np.asarray(planes[2].astype(mx.float32))[..., None]
    else:
        scale_codes = np.asarray(planes[1]).view(np.uint8)
        if mode == "nvfp4":
            scales = e4m3_floats(scale_codes, _levels("mxfp8", 8))
        else:
            scales = e8m0_scales(scale_codes)
        scales, biases = scales[..., None], None
    # Affine 8-bit codes are their levels: a cast, not a take.
    runs: np.ndarray[Any, Any] | PlacedE4m3 | None = (
        None if mode == "affine" and bits == 8 else _levels(mode, bits)
    )
    if mode == "mxfp8":
        # E4M3 codes placed in float32 bits read as level x 2^-120: the E8M0 scales carry
        # the 2^120 where every one stays finite (a scale of 2^8 or more takes the table).
        with np.errstate(over="ignore"):
            carried = scales * np.float32(2.0**E4M3_BIAS_SHIFT)
        if np.isfinite(carried).all():
            runs, scales = PlacedE4m3(_levels(mode, bits)), carried
    return group_rows(stream, bits, runs, group_size, slot, scales, biases=biases)


def quantized_attention(
    queries: mx.array,
    keys: tuple[mx.array, ...],
    values: tuple[mx.array, ...],
    mask: Mask,
    scale: float,
    group_size: int,
    bits: int,
    mode: str = "affine",
) -> mx.array:
    """Attention over quantized planes with ``mx.quantized_matmul`` (GQA by a head-group
    axis): ``(codes, scales, biases)`` of the affine mode, ``(codes, scales)`` of a
    microscaling ``mode``.

    On the CPU backend the planes are decoded a few rows at a time and attended in NumPy
    (:mod:`~kvrows.optimized.codecs.host_attention`; in :func:`op_attention
    <kvrows.optimized.codecs.host_attention.op_attention>`, ``quantized_matmul`` there too,
    whose half-precision inputs accumulate coarsely on the CPU: the queries go in as float32
    and the output comes back in their dtype).
    """
    if takes_host_path():
        out = host_attention(
            queries, int(keys[0].shape[1]), int(keys[0].shape[2]),
            _host_rows(keys, group_size, bits, mode, "keys"),
            _host_rows(values, group_size, bits, mode, "values"),
            mask, scale,
        )  # fmt: skip
        return out.astype(queries.dtype)
    batch, q_heads, n, _ = queries.shape
    q = grouped_queries(queries, int(keys[0].shape[1]), scale, compute_dtype(queries.dtype))
    # Planes gain the head-group axis; a microscaling mode has no biases (``None``).
    k_packed, k_scales, k_biases, *_ = (*(mx.expand_dims(p, 2) for p in keys), None)
    v_packed, v_scales, v_biases, *_ = (*(mx.expand_dims(p, 2) for p in values), None)
    scores = mx.quantized_matmul(
        q, k_packed, k_scales, k_biases, transpose=True, group_size=group_size, bits=bits,
        mode=mode,
    )  # fmt: skip
    weights = attention_weights(scores, mask)
    out = mx.quantized_matmul(
        weights, v_packed, v_scales, v_biases, transpose=False, group_size=group_size,
        bits=bits, mode=mode,
    )  # fmt: skip
    return out.reshape(batch, q_heads, n, -1).astype(queries.dtype)
