"""The microscaling codecs in the reference: ``mx.quantize`` / ``mx.dequantize`` modes
``mxfp8``, ``mxfp4`` and ``nvfp4`` in NumPy, bit for bit what mlx 0.32.4 computes on its
CPU backend (``spec/mx-codec.md`` derives each step and the special values).

Quantize a group of ``g`` values of dtype ``T`` (float32, float16 or bfloat16), every
operation rounded to ``T`` as MLX's ops are (``maxval``: 448 for FP8, 6 for FP4)::

    scale = T(max|w| / maxval)                        # a NaN propagates
    mxfp8, mxfp4 (g = 32): e = 0 if scale == 0 else ceil(log2(scale))   # exact, from the bits
                           e = INT32_MIN if scale is inf or NaN
                           w' = T(w / T(2**e)) ;  scale byte = uint8(int32(T(e + 127)) & 0xFF)
    nvfp4 (g = 16):        s8 = E4M3(float32(scale)) ;  w' = float32(T(w / T(E4M3⁻¹(s8))))
    FP8 elements:  E4M3(w') (round to nearest even, |w'| >= 448, inf and NaN saturate to
                   ±448, the sign kept)
    FP4 elements:  the first index of the least |w' - LUT[i]| over the E2M1 table (computed
                   in w''s dtype; a NaN difference is least), packed 8 per uint32, LSB first

Dequantize (``T`` the output dtype): ``T(element * scale)`` with ``scale = T(2**(s - 127))``
(``mx``) or ``T(E4M3⁻¹(s))`` (``nvfp4``). A NaN that bfloat16 arithmetic makes loses its
sign in MLX (float16 and float32 keep it), which decides the sign an FP8 element saturates
to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kvrows.codec import Role
from kvrows.codecs.mx import Microscaled
from kvrows.protocols import Mask
from kvrows.reference.codecs.common import Planes, ZeroPlanes, attention
from kvrows.reference.codecs.registry import implements

__all__ = ["FP4_VALUES", "MicroscaledCodec", "dequantize", "from_fp8", "quantize", "to_fp8"]

Array = npt.NDArray[Any]

#: The E2M1 values by code (bit 3 the sign): MLX's table, ``-0.0`` at code 8.
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_U32 = np.uint32


def _rounded(dtype: np.dtype[Any], values: Any) -> Array:
    """float32 ``values`` rounded to ``dtype`` as MLX rounds (a bfloat16 NaN is ``+NaN``)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.asarray(values, dtype=np.float32).astype(dtype)
    if dtype == _BF16:
        out = np.where(np.isnan(out), np.array(np.nan, dtype=np.float32).astype(_BF16), out)
    return out


def _op(dtype: np.dtype[Any], fn: Callable[..., Any], *args: Any) -> Array:
    """``fn`` of ``args`` in ``dtype``: computed in float32, rounded once (for +, -, *, /
    the correctly rounded float16 / bfloat16 result, as 24 >= 2 * 11 + 2)."""
    with np.errstate(all="ignore"):
        return _rounded(dtype, fn(*(np.asarray(a).astype(np.float32) for a in args)))


def to_fp8(values: Any) -> npt.NDArray[np.uint8]:
    """FP8 E4M3 bytes of float32 ``values``: round to nearest even; ``|x| >= 448``, inf and
    NaN saturate to ``0x7E`` (448) with the sign kept (MLX's ``ToFP8``, bit for bit)."""
    bits = np.asarray(values, dtype=np.float32).view(_U32)
    sign = bits & _U32(0x80000000)
    bits = bits ^ sign
    with np.errstate(over="ignore", invalid="ignore"):  # (inf and NaN take the saturation)
        # Below 2**-6 (subnormal E4M3): adding 2**14 rounds to a multiple of 2**-9.
        low = (bits.view(np.float32) + np.float32(2.0**14)).view(_U32) - _U32(141 << 23)
    odd = (bits >> _U32(20)) & _U32(1)
    rebias = _U32((((7 - 127) << 23) + 0x7FFFF) & 0xFFFFFFFF)  # (wraps as uint32 does)
    high = (bits + rebias + odd) >> _U32(20)
    out = np.where(bits < _U32(121 << 23), low, high) & _U32(0xFF)
    out = np.where(bits >= _U32(543 << 21), _U32(0x7E), out)
    return (out | (sign >> _U32(24))).astype(np.uint8)


def from_fp8(codes: Any) -> npt.NDArray[np.float32]:
    """The float32 values of FP8 E4M3 bytes (every one exact; ``0x7F`` and ``0xFF`` are
    NaN, signed, though no quantize writes them)."""
    codes = np.asarray(codes, dtype=np.uint8)
    magnitude = ((codes & 127).astype(np.uint16) << 7).view(np.float16).astype(np.float32)
    magnitude = np.where(codes & 127 == 127, np.float32(np.nan), magnitude * np.float32(256))
    return np.where(codes & 128, -magnitude, magnitude).astype(np.float32)


def _ceil_log2(scales: Array, dtype: np.dtype[Any]) -> Array:
    """The group exponents in ``dtype``: ``ceil(log2(s))`` exactly, 0 for a zero scale,
    ``INT32_MIN`` for an inf or NaN one."""
    s32 = scales.astype(np.float32)
    finite = np.isfinite(s32) & (s32 > 0)
    mantissa, exponent = np.frexp(np.where(finite, s32, np.float32(1)))
    ceil = np.where(mantissa == 0.5, exponent - 1, exponent).astype(np.float32)
    ceil = np.where(np.isfinite(s32), ceil, np.float32(-(2.0**31)))
    return np.where(s32 == 0, np.zeros_like(scales), _rounded(dtype, ceil))


def quantize(values: Array, group_size: int, bits: int) -> tuple[Array, Array]:
    """``mx.quantize(values, group_size, bits, mode)`` of the mode ``(group_size, bits)``
    names, along the last axis: ``(codes uint32, scales uint8)``."""
    dtype, shape = values.dtype, values.shape
    groups = values.reshape(-1, group_size)
    with np.errstate(invalid="ignore"):
        largest = np.abs(groups.astype(np.float32)).max(axis=-1, keepdims=True)
    scales = _op(dtype, np.divide, _rounded(dtype, largest), 6.0 if bits == 4 else 448.0)
    if group_size == 16:  # nvfp4: an E4M3 scale; the elements then in float32
        scale_bytes = to_fp8(scales.astype(np.float32))
        elements = _op(dtype, np.divide, groups, from_fp8(scale_bytes)).astype(np.float32)
    else:  # mxfp8, mxfp4: a power-of-two scale, E8M0 (biased by 127)
        exponent = _ceil_log2(scales, dtype)
        elements = _op(dtype, np.divide, groups, _op(dtype, np.power, 2.0, exponent))
        with np.errstate(invalid="ignore"):
            biased = _op(dtype, np.add, exponent, 127.0).astype(np.float32).astype(np.int32)
        scale_bytes = (biased & 0xFF).astype(np.uint8)
    if bits == 4:
        table = _rounded(elements.dtype, FP4_VALUES)
        distance = _op(elements.dtype, lambda a, b: np.abs(a - b), elements[..., None], table)
        nibbles = np.argmin(distance, axis=-1).astype(_U32).reshape(-1, 8)
        shifts = np.arange(8, dtype=_U32) * _U32(4)
        codes = (nibbles << shifts).sum(axis=-1, dtype=_U32)
    else:
        codes = np.ascontiguousarray(to_fp8(elements.astype(np.float32))).view(_U32)
    width, count = shape[-1] * bits // 32, shape[-1] // group_size  # (explicit: 0 rows)
    return codes.reshape(*shape[:-1], width), scale_bytes.reshape(*shape[:-1], count)


def dequantize(
    codes: Array, scales: Array, group_size: int, bits: int, dtype: np.dtype[Any]
) -> Array:
    """``mx.dequantize(codes, scales, group_size, bits, mode, dtype=dtype)``."""
    lead, width = codes.shape[:-1], codes.shape[-1] * 32 // bits
    raw = np.ascontiguousarray(codes, dtype=_U32).view(np.uint8).reshape(*lead, width * bits // 8)
    if bits == 4:
        nibbles = np.stack([raw & 15, raw >> 4], axis=-1).reshape(*lead, width)
        elements = _rounded(dtype, FP4_VALUES[nibbles])
    else:
        elements = _rounded(dtype, from_fp8(raw))
    byte = np.asarray(scales, dtype=np.uint8).reshape(-1, 1)
    if group_size == 16:
        scale = _rounded(dtype, from_fp8(byte))
    else:
        scale = _op(dtype, np.power, 2.0, _op(dtype, np.subtract, byte, 127.0))
    out = _op(dtype, np.multiply, elements.reshape(-1, group_size), scale)
    return out.reshape(*lead, width)


@implements("mx")
class MicroscaledCodec(ZeroPlanes):
    """MLX's microscaling modes: planes ``(codes uint32, scales uint8)``, encoded once on
    append; reads hand the planes out (mlx-lm's quantized-cache convention), and
    attention runs over their float32 decode."""

    spec: Microscaled
    defers_values = True  # the reads are codes: only this codec's attend is right

    def __init__(self, spec: Microscaled) -> None:
        self.spec = spec
        self.group_size, self.bits = spec.group_size, spec.bits

    def encode(self, block: Array, role: Role = "keys") -> Planes:
        return quantize(block, self.group_size, self.bits)

    def decode(self, planes: Planes, role: Role = "keys") -> Array:
        """The stored values in float32 (every one exact there)."""
        codes, scales = planes
        return dequantize(codes, scales, self.group_size, self.bits, np.dtype(np.float32))

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        return tuple(planes)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float) -> Array:
        return attention(queries, self.decode(keys), self.decode(values), mask, scale)
