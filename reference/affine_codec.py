"""MLX affine group quantization (``mx.quantize`` / ``mx.dequantize``, mode "affine") in NumPy.

Bit for bit what mlx 0.32.4 computes on its CPU backend: the C++ loop ``quantize`` of
``mlx/backend/cpu/quantized.cpp`` (``fast::Quantize::eval_cpu``) and the op-level fallback
``affine_dequantize`` of ``mlx/ops.cpp`` (the CPU has no dequantize kernel). The GPU kernels
differ (``w_max`` starts at 0, ``round`` ties away from zero, dequantize in float32), so this
is *not* a model of the Metal/CUDA results.

Input ``x`` has shape ``[..., D]`` and dtype float32, float16 or ``ml_dtypes.bfloat16``; it is
quantized along the last axis in groups of ``group_size`` consecutive values.

Quantize, per group, everything in float32 (``T`` is the input dtype)::

    n_bins = 2**bits - 1 ;  eps = float32(1e-7)
    w_max, w_min = max, min over the group       # NaN values are skipped (see below)
    mask  = |w_min| > |w_max|                    # the larger-magnitude edge is w_min
    scale = (w_max - w_min) / n_bins
    scale = eps if scale < eps else scale        # std::max(scale, eps): a NaN stays NaN
    scale = scale if mask else -scale            # negative step when w_max is the edge
    edge  = w_min if mask else w_max
    q0    = rint(edge / scale)                   # rint: round half to even
    if q0 != 0 (true for NaN):  scale = edge / q0 ; bias = edge    # edge lands on the grid
    else:                       bias = 0
    q     = clip(rint((w - bias) / scale), 0, n_bins)    # with the float32 scale, not T(scale)
    scales, biases = T(scale), T(bias)

So the larger-magnitude extreme is reproduced exactly (``q = 0`` there), the other extreme
maps to ``n_bins`` up to rounding, and zero lies on the grid (at code ``-q0``) whenever
``q0 != 0``.

Packing: the codes of a row form one continuous LSB-first bitstream: code ``j`` occupies bits
``[j*bits, (j+1)*bits)`` of the little-endian stream of uint32 words (for 3, 5, 6 bits a code
may straddle two words; MLX writes 8, 8, 4 codes per 3, 5, 3 bytes, which is the same stream).
The packed last axis has ``D * bits / 32`` words.

Dequantize (the op-level fallback, two roundings in ``T``; ``T`` = the scales' dtype)::

    w_hat = T( T(q * scale) + bias )     # each op computed in float32, rounded to T

(computing a float16/bfloat16 product or sum in float32 and rounding once is the correctly
rounded result, since 24 >= 2*11+2, so this equals MLX's per-op arithmetic.)

Float32 -> T conversions follow MLX's own, which differ from NumPy/ml_dtypes only on NaN:
bfloat16 NaN becomes ``0x7FC0`` (sign dropped), float16 NaN becomes ``sign | 0x7D00``.

Edge cases (all follow from the formulas; verified against mx.quantize on the CPU):

* constant group ``c != 0``: ``scale = ±1e-7`` gives ``q0 = c/∓1e-7`` (huge, nonzero), so
  ``scale = c / q0`` (tiny), ``bias = c``, all codes 0; dequantize returns ``c`` exactly.
  A constant with ``|c| < 5e-8`` has ``q0 = 0``: ``scale = ±1e-7``, ``bias = 0``.
* all-zero group: ``scale = -1e-7``, ``bias = 0``, codes 0; dequantize gives ``+0``.
* tiny (subnormal) values: the range is below ``eps``, so ``scale = ±1e-7``, ``q0 = 0``,
  ``bias = 0`` and every code is 0 (dequantize gives 0) -- the values are lost.
* huge values: ``w_max - w_min`` may overflow float32 to ``inf`` (float32/bfloat16 inputs
  near the dtype max with both signs): then ``scale = ±inf``, ``q0 = 0``, ``bias = 0``,
  codes 0, and dequantize gives ``0 * inf = NaN`` for every element of the group.
  In float16 the range cannot overflow, but the dequantize product ``T(q * scale)`` can:
  a group whose range exceeds 65504 (both signs near the max) gives ``±inf`` for its far
  values although input and stored scale/bias are finite.
* NaN elements are skipped by the min/max (``std::max(acc, nan)`` keeps ``acc``), so the
  group's scale/bias come from its other values; the NaN element's own code is
  ``(uint64)NaN`` truncated, which is 0 on x86-64, so it dequantizes to the group's bias
  (its larger-magnitude extreme, or 0). An all-NaN group has ``w_max = -inf``,
  ``w_min = +inf``: ``scale = NaN``, ``bias = -inf``, codes 0; dequantize gives NaN.
* ``±inf`` elements: the range is infinite, ``q0 = rint(±inf/∓inf) = NaN`` (nonzero), so
  ``scale = NaN`` and ``bias = edge = ±inf``; every code of the group is 0 and dequantize
  gives NaN for the whole group. (NaN scales keep their float32 sign in float16, lose it in
  bfloat16.)
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kvrows.affine_geometry import groups, packed_width, validate_codec, validate_params
from kvrows.errors import (
    AFFINE_SCALAR_INPUT,
    PACKED_SCALAR_INPUT,
    InvalidInputError,
    affine_input_dtype_message,
    packed_codes_dtype_message,
    packed_shapes_message,
    packed_width_message,
    scales_biases_dtype_message,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "dequantize",
    "groups",
    "packed_width",
    "quantize",
    "validate_codec",
    "validate_params",
]

SUPPORTED_DTYPES: tuple[np.dtype[Any], ...] = (
    np.dtype(np.float32),
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
)
"""Input dtypes of :func:`quantize` (and dtypes of the scales/biases)."""

_EPS = np.float32(1e-7)
_BF16_NAN = np.uint16(0x7FC0)  # MLX's _MLX_BFloat16(float) for any NaN
_F16_NAN = np.uint16(0x7D00)  # MLX's _MLX_Float16(float) for a NaN, plus the sign bit


def _check_dtype(name: str, dtype: np.dtype[Any]) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidInputError(affine_input_dtype_message(name, dtype))


def _to_mlx_dtype(x: npt.NDArray[np.float32], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Round float32 ``x`` to ``dtype`` as MLX's CPU conversion does (RNE; MLX's NaN bits)."""
    if dtype == np.float32:
        return x
    out = x.astype(dtype)
    nan = np.isnan(x)
    if nan.any():
        bits = out.view(np.uint16)
        if dtype == np.float16:
            sign = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16) & np.uint16(0x8000)
            bits[nan] = sign[nan] | _F16_NAN
        else:
            bits[nan] = _BF16_NAN
    return out


def _pack(codes: npt.NDArray[np.uint32], bits: int) -> npt.NDArray[np.uint32]:
    """Pack codes ``[..., D]`` (each < 2**bits) into an LSB-first uint32 bitstream."""
    shifts = np.arange(bits, dtype=np.uint32)
    stream = ((codes[..., None] >> shifts) & np.uint32(1)).astype(np.uint8)
    stream = stream.reshape(*codes.shape[:-1], codes.shape[-1] * bits)
    packed_bytes = np.packbits(stream, axis=-1, bitorder="little")
    return packed_bytes.view("<u4").astype(np.uint32)


def _unpack(packed: npt.NDArray[np.uint32], bits: int) -> npt.NDArray[np.uint32]:
    """Inverse of :func:`_pack`: uint32 words ``[..., W]`` -> codes ``[..., W*32/bits]``."""
    packed_bytes = np.ascontiguousarray(packed, dtype="<u4").view(np.uint8)
    stream = np.unpackbits(packed_bytes, axis=-1, bitorder="little")
    stream = stream.reshape(*packed.shape[:-1], packed.shape[-1] * 32 // bits, bits)
    shifts = np.arange(bits, dtype=np.uint32)
    codes: npt.NDArray[np.uint32] = (stream.astype(np.uint32) << shifts).sum(
        axis=-1, dtype=np.uint32
    )
    return codes


def quantize(
    x: npt.ArrayLike, group_size: int, bits: int
) -> tuple[npt.NDArray[np.uint32], npt.NDArray[Any], npt.NDArray[Any]]:
    """Quantize ``x`` ``[..., D]`` along its last axis exactly as ``mx.quantize`` on the CPU.

    Returns ``(packed, scales, biases)``: packed uint32 ``[..., D*bits/32]``, scales and
    biases ``[..., D/group_size]`` in the dtype of ``x``.
    """
    w = np.asarray(x)
    _check_dtype("x", w.dtype)
    if w.ndim < 1:
        raise InvalidInputError(AFFINE_SCALAR_INPUT)
    head_dim = w.shape[-1]
    validate_codec(head_dim, group_size, bits)
    lead = w.shape[:-1]
    n_groups = groups(head_dim, group_size)

    wf = w.astype(np.float32).reshape(*lead, n_groups, group_size)
    n_bins = np.float32((1 << bits) - 1)
    with np.errstate(all="ignore"):
        # std::max / std::min from +-inf: NaN elements never replace the accumulator.
        w_max = np.fmax.reduce(wf, axis=-1, initial=-np.inf)
        w_min = np.fmin.reduce(wf, axis=-1, initial=np.inf)
        mask = np.abs(w_min) > np.abs(w_max)
        scale = (w_max - w_min) / n_bins
        scale = np.where(scale < _EPS, _EPS, scale)
        scale = np.where(mask, scale, -scale)
        edge = np.where(mask, w_min, w_max)
        q0 = np.rint(edge / scale)
        on_grid = q0 != 0
        scale = np.where(on_grid, edge / q0, scale)
        bias = np.where(on_grid, edge, np.float32(0))

        q = np.rint((wf - bias[..., None]) / scale[..., None])
        q = np.where(q < 0, np.float32(0), q)
        q = np.where(n_bins < q, n_bins, q)
        q = np.where(np.isnan(q), np.float32(0), q)  # (uint64)NaN -> 0 once truncated
    codes = q.astype(np.uint32).reshape(*lead, head_dim)

    packed = _pack(codes, bits)
    return packed, _to_mlx_dtype(scale, w.dtype), _to_mlx_dtype(bias, w.dtype)


def dequantize(
    packed: npt.ArrayLike,
    scales: npt.ArrayLike,
    biases: npt.ArrayLike,
    group_size: int,
    bits: int,
) -> npt.NDArray[Any]:
    """Dequantize as ``mx.dequantize`` on the CPU: ``T(T(q*scale) + bias)``, ``T`` = scales' dtype.

    ``packed`` uint32 ``[..., D*bits/32]``; ``scales`` and ``biases`` ``[..., D/group_size]``
    of one dtype (float32, float16, bfloat16). Returns ``[..., D]`` in that dtype.
    """
    wq = np.asarray(packed)
    s = np.asarray(scales)
    b = np.asarray(biases)
    if wq.dtype != np.uint32:
        raise InvalidInputError(packed_codes_dtype_message(wq.dtype))
    _check_dtype("scales", s.dtype)
    if b.dtype != s.dtype:
        raise InvalidInputError(scales_biases_dtype_message(s.dtype, b.dtype))
    if wq.ndim < 1 or s.ndim < 1:
        raise InvalidInputError(PACKED_SCALAR_INPUT)
    if s.shape != b.shape or wq.shape[:-1] != s.shape[:-1]:
        raise InvalidInputError(packed_shapes_message(wq.shape, s.shape, b.shape))
    validate_params(group_size, bits)
    head_dim = group_size * s.shape[-1]
    validate_codec(head_dim, group_size, bits)
    if wq.shape[-1] != packed_width(head_dim, bits):
        raise InvalidInputError(
            packed_width_message(
                wq.shape[-1], s.shape[-1], group_size, bits, packed_width(head_dim, bits)
            )
        )

    lead = s.shape[:-1]
    q = _unpack(wq, bits).astype(np.float32).reshape(*lead, s.shape[-1], group_size)
    with np.errstate(all="ignore"):
        prod = _to_mlx_dtype(q * s.astype(np.float32)[..., None], s.dtype)
        out = prod.astype(np.float32) + b.astype(np.float32)[..., None]
    return _to_mlx_dtype(out, s.dtype).reshape(*lead, head_dim)
