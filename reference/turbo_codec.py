"""TurboQuant in NumPy: the executable definition of the codec (``spec/turbo-codec.md``).

Keys: asymmetric affine per 32-element group, in float32 (no rotation). Values: sign flip,
orthonormal Walsh-Hadamard transform, per-group RMS scale, Lloyd-Max codes of a unit
normal. Every step is written as explicit float32 operations in a fixed order (a butterfly
for the transform, a halving tree for the group sums) so that ``kvrows.optimized``'s MLX
codec computes the same bits on the CPU.

Functions take ``[..., D]`` arrays (D in ``TURBO_HEAD_DIMS``); codes and scales come back
with the leading axes unchanged.

The sign vectors and the value codebooks are derived here from their definitions
(:func:`sign_bits`, :func:`lloyd_max`), not read from ``kvrows.turbo_tables``, which the MLX
codec reads: a wrong entry in that shared table then makes the two implementations
disagree instead of agreeing with itself (issue 24).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kvrows.codec import TURBO_GROUP, check_turbo_dim
from kvrows.errors import (
    InvalidInputError,
    turbo_bits_message,
    turbo_input_dtype_message,
    turbo_scalar_input_message,
)
from kvrows.schemes import TURBO_KEY_BITS, TURBO_VALUE_BITS

__all__ = [
    "decode_keys",
    "decode_values",
    "encode_keys",
    "encode_values",
    "hadamard",
    "lloyd_max",
    "pack_codes",
    "rotated_values",
    "sign_bits",
    "signs",
    "unpack_codes",
    "unrotate",
]

Array = npt.NDArray[Any]

#: Added to every scale before dividing by it (vllm-metal's reference constant).
EPSILON = np.float32(1e-8)
#: The float16 a NaN scale or zero is stored as (MLX's conversion of a positive NaN):
#: one NaN bit pattern whatever sign or payload the float32 NaN had.
NAN16 = np.uint16(0x7D00).view(np.float16)
#: The largest finite float16 (a finite key scale beyond it saturates to it).
HALF_MAX = np.float32(65504)
#: The smallest magnitude float16 rounds to ±inf (a key zero this large is not stored).
HALF_OVERFLOW = np.float32(65520)
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


#: The sign vectors' seed (spec §3: ``mx.random.key(42)``).
SIGN_SEED = 42
#: Threefry-2x32's rotation distances (20 rounds, 8 distances in turn) and its key-schedule
#: parity constant (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", 2011).
_ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
_PARITY = np.uint32(0x1BD11BDA)


def _threefry(key: tuple[int, int], first: Array, second: Array) -> tuple[Array, Array]:
    """Threefry-2x32 (20 rounds) of the uint32 counter pairs ``(first, second)``."""
    u32 = np.uint32
    schedule = (u32(key[0]), u32(key[1]), _PARITY ^ u32(key[0]) ^ u32(key[1]))
    with np.errstate(over="ignore"):  # uint32 arithmetic wraps, as it must
        x0, x1 = first + schedule[0], second + schedule[1]
        for done in range(20):
            turn = u32(_ROTATIONS[done % 8])
            x0 = x0 + x1
            x1 = ((x1 << turn) | (x1 >> (u32(32) - turn))) ^ x0
            if done % 4 == 3:  # a key injection after every 4 rounds
                s = (done + 1) // 4
                x0 = x0 + schedule[s % 3]
                x1 = x1 + schedule[(s + 1) % 3] + u32(s)
    return x0, x1


def sign_bits(dim: int) -> Array:
    """``mx.random.randint(0, 2, (dim,), key=mx.random.key(42))`` as MLX 0.32 computes it
    (spec §3), in NumPy: ``dim`` random uint32 words of the key ``(0, 42)`` (words ``i`` and
    ``dim/2 + i`` are the Threefry-2x32 hash of the counters ``(i, dim/2 + i)``), each a
    float32 uniform ``min(word / (2^32 - 1), 1 - 2^-24)``, times 2, floored: 0 or 1."""
    half = dim // 2
    counters = np.arange(half, dtype=np.uint32)
    words = np.concatenate(
        _threefry((SIGN_SEED >> 32, SIGN_SEED & 0xFFFFFFFF), counters, counters + np.uint32(half))
    )
    uniform = np.minimum(
        words.astype(np.float32) / np.float32(2**32 - 1), np.nextafter(np.float32(1), np.float32(0))
    )
    out: Array = np.floor(uniform * np.float32(2)).astype(np.uint8)
    return out


@cache
def signs(dim: int) -> Array:
    """The fixed sign vector of head dim ``dim`` (float32 ±1: bit 1 -> +1, 0 -> -1)."""
    check_turbo_dim(dim)
    out: Array = sign_bits(dim).astype(np.float32) * np.float32(2) - np.float32(1)
    out.setflags(write=False)
    return out


#: Decimals the codebooks keep (centroids, then the midpoints between them).
CODEBOOK_DECIMALS = 5
#: A Newton iteration of :func:`lloyd_max` stops once no cell's centroid condition is off
#: by more than this (the float64 cell integrals agree to about 1e-14).
_CONVERGED = 1e-12
_SQRT2 = math.sqrt(2.0)


def _density(x: Array) -> Array:
    """The unit normal's density (0 at ±inf)."""
    out: Array = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return out


def _tail(x: Array) -> Array:
    """``P(Z > x)`` of a unit normal, by ``erfc``: no cancellation in the upper tail."""
    out: Array = np.array([0.5 * math.erfc(float(v) / _SQRT2) for v in x.ravel()])
    return out.reshape(x.shape)


def _tail_inverse(p: Array) -> Array:
    """``x`` with ``P(Z > x) = p`` (bisection to float64 resolution; ``p`` in (0, 1/2])."""
    low, high = np.zeros_like(p), np.full_like(p, 40.0)
    for _ in range(64):
        mid = (low + high) / 2
        above = _tail(mid) > p
        low, high = np.where(above, mid, low), np.where(above, high, mid)
    out: Array = (low + high) / 2
    return out


def lloyd_max(bits: int) -> Array:
    """The ``2**bits`` Lloyd-Max centroids of a unit normal, float64, unrounded.

    The Lloyd-Max conditions (spec §3): every boundary is the midpoint of its two
    centroids, every centroid the normal's mean over its cell, ``(φ(a) - φ(b)) / (P(Z > a)
    - P(Z > b))`` on ``(a, b]``. The codebook is symmetric (a boundary at 0), so the upper
    half is solved, by Newton's method on those conditions (the Jacobian is tridiagonal),
    from the Panter-Dite start ``√3 · Φ⁻¹`` of evenly spaced probabilities.
    """
    half = 2 ** (bits - 1)
    centroids = math.sqrt(3) * _tail_inverse(1 - (half + np.arange(half) + 0.5) / (2 * half))
    for _ in range(100):
        midpoints = (centroids[1:] + centroids[:-1]) / 2
        low = np.concatenate([[0.0], midpoints])
        high = np.concatenate([midpoints, [np.inf]])
        mass = _tail(low) - _tail(high)
        mean = (_density(low) - _density(high)) / mass
        residual = centroids - mean
        if float(np.max(np.abs(residual))) <= _CONVERGED:
            break
        # d mean / d low = φ(low)(mean - low)/mass; d mean / d high = φ(high)(high - mean)/mass
        # (0 at high = inf); each edge moves by half of each of its two centroids' steps.
        by_low = _density(low) * (mean - low) / mass
        finite = np.where(np.isinf(high), 0.0, high)
        by_high = _density(high) * (finite - mean) / mass
        index = np.arange(half)
        jacobian = np.eye(half)
        jacobian[index, index] -= 0.5 * (by_low * (index > 0) + by_high)
        jacobian[index[1:], index[1:] - 1] -= 0.5 * by_low[1:]
        jacobian[index[:-1], index[:-1] + 1] -= 0.5 * by_high[:-1]
        centroids = centroids - np.linalg.solve(jacobian, residual)
    out: Array = np.concatenate([-centroids[::-1], centroids])
    return out


@cache
def codebook(bits: int) -> tuple[Array, Array]:
    """``(centroids, boundaries)`` float32 of the ``bits``-bit Lloyd-Max table: the
    centroids of :func:`lloyd_max` rounded to 5 decimals, each boundary the midpoint of two
    rounded centroids, rounded to 5 decimals (spec §3)."""
    if bits not in TURBO_VALUE_BITS:
        raise InvalidInputError(turbo_bits_message("v_bits", TURBO_VALUE_BITS, bits))
    rounded = np.round(lloyd_max(bits), CODEBOOK_DECIMALS) + 0.0  # + 0.0: no -0
    midpoints = np.round((rounded[1:] + rounded[:-1]) / 2, CODEBOOK_DECIMALS) + 0.0
    centroids = rounded.astype(np.float32)
    boundaries = midpoints.astype(np.float32)
    centroids.setflags(write=False)
    boundaries.setflags(write=False)
    return centroids, boundaries


def _floats(x: object, name: str) -> Array:
    if not isinstance(x, np.ndarray):
        raise InvalidInputError(f"{name} must be a NumPy array, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise InvalidInputError(turbo_input_dtype_message(name, x.dtype))
    if x.ndim < 1:
        raise InvalidInputError(turbo_scalar_input_message(name))
    check_turbo_dim(int(x.shape[-1]))
    return x.astype(np.float32)


def hadamard(x: Array) -> Array:
    """Orthonormal Walsh-Hadamard transform (Sylvester order) of float32 ``[..., D]``:
    a radix-2 butterfly (pairs ``i``, ``i + h`` for ``h = 1, 2, 4, …``), then ``* 1/√D``
    rounded to float32 once. An involution up to rounding."""
    dim = int(x.shape[-1])
    lead = x.shape[:-1]
    h = 1
    while h < dim:
        blocks = x.reshape(*lead, dim // (2 * h), 2, h)
        a, b = blocks[..., 0, :], blocks[..., 1, :]
        x = np.stack([a + b, a - b], axis=-2).reshape(*lead, dim)
        h *= 2
    out: Array = x * np.float32(1 / math.sqrt(dim))
    return out


def _group_sum(x: Array) -> Array:
    """Sum over the last axis (32) by halving: ``x[:16] + x[16:]``, then 8, 4, 2, 1."""
    width = int(x.shape[-1])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def _half(x: Array) -> Array:
    """float32 -> float16, every NaN as :data:`NAN16`."""
    out: Array = np.where(np.isnan(x), NAN16, x.astype(np.float16))
    return out


def _grouped(x: Array) -> Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // TURBO_GROUP, TURBO_GROUP)


def pack_codes(codes: Array, bits: int) -> Array:
    """``[..., D]`` codes below ``2**bits`` as a little-endian bitstream, ``D·bits/8`` bytes
    (code ``i`` in bits ``[i·bits, i·bits + bits)``); 8 bits: the codes as uint8."""
    codes = codes.astype(np.uint8)
    if bits == 8:
        return codes
    # Each code's low ``bits`` bits, lowest first, then the stream 8 bits to a byte.
    stream = np.unpackbits(codes[..., None], axis=-1, count=bits, bitorder="little")
    stream = stream.reshape(*codes.shape[:-1], int(codes.shape[-1]) * bits)
    packed: Array = np.packbits(stream, axis=-1, bitorder="little")
    return packed


def unpack_codes(packed: Array, bits: int) -> Array:
    """The uint8 codes of a ``pack_codes`` bitstream."""
    if bits == 8:
        return packed.astype(np.uint8)
    stream = np.unpackbits(packed, axis=-1, bitorder="little")
    stream = stream.reshape(*packed.shape[:-1], int(packed.shape[-1]) * 8 // bits, bits)
    # Code = sum of bit i << i, a shift per bit (packbits along a 2-5 wide axis is ten
    # times slower).
    codes: Array = stream[..., 0].copy()
    for i in range(1, bits):
        codes |= stream[..., i] << i
    return codes


# -- keys ----------------------------------------------------------------------------------


def encode_keys(x: Array, bits: int) -> tuple[Array, Array, Array]:
    """``(kIdx, kScales, kZeros)`` of float ``[..., D]`` keys at ``bits`` ∈ {2, 4, 5, 8}."""
    if bits not in TURBO_KEY_BITS:
        raise InvalidInputError(turbo_bits_message("k_bits", TURBO_KEY_BITS, bits))
    groups = _grouped(_floats(x, "keys"))
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return _encode_keys(x, groups, bits)


def _encode_keys(x: Array, groups: Array, bits: int) -> tuple[Array, Array, Array]:
    zero_f = np.float32(0)
    # ``+ 0``: a -0 extreme becomes +0, whatever order the reduction met the zeros in.
    high = groups.max(axis=-1) + zero_f
    low = groups.min(axis=-1) + zero_f
    if bits == 8:
        scale = (high - low) / np.float32(254)
        step = scale + EPSILON
        zero = np.round((high + low) / (np.float32(2) * step))
        least, most = -127, 127
    else:
        most = 2**bits - 1
        scale = (high - low) / np.float32(most)
        step = scale + EPSILON
        zero = np.round(low / step)
        least = 0
    codes = np.clip(np.round(groups / step[..., None] - zero[..., None]), least, most)
    # Guarded (spec §2): a constant group, or a nearly constant one whose zero would
    # overflow float16 (its keys would decode to inf, its attention to NaN), is stored
    # flat: scale = its midpoint, zero 1, codes 0, decoding to float16(midpoint).
    constant = high == low
    flat = constant | (np.abs(zero) >= HALF_OVERFLOW)
    middle = np.where(constant, low, low + (high - low) / np.float32(2))
    codes = np.where(flat[..., None] | np.isnan(codes), np.float32(0), codes)
    scale = np.where(flat, middle, scale)
    zero = np.where(flat, np.float32(1), zero)
    # A finite scale beyond float16 (keys beyond its range) saturates instead of inf.
    scale = np.where(np.isfinite(scale), np.clip(scale, -HALF_MAX, HALF_MAX), scale)
    flat = codes.reshape(*x.shape)
    stored = flat.astype(np.int8) if bits == 8 else pack_codes(flat.astype(np.uint8), bits)
    return stored, _half(scale), _half(zero)


def decode_keys(codes: Array, scales: Array, zeros: Array, bits: int) -> Array:
    """Keys ``(idx + zero)·scale`` in float32 (the caller casts)."""
    idx = codes.astype(np.float32) if bits == 8 else unpack_codes(codes, bits).astype(np.float32)
    groups = _grouped(idx)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/inf scales decode to NaN/inf
        out = (groups + zeros.astype(np.float32)[..., None]) * scales.astype(np.float32)[..., None]
    result: Array = out.reshape(idx.shape)
    return result


# -- values --------------------------------------------------------------------------------


def encode_values(x: Array, bits: int) -> tuple[Array, Array]:
    """``(vPacked, vScales)`` of float ``[..., D]`` values at ``bits`` ∈ {2, 3, 4, 5, 8}."""
    _, boundaries = codebook(bits)
    floats = _floats(x, "values")
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return _encode_values(x, floats, bits, boundaries)


def _encode_values(x: Array, floats: Array, bits: int, boundaries: Array) -> tuple[Array, Array]:
    rotated = _grouped(hadamard(floats * signs(int(x.shape[-1]))))
    scale = np.sqrt(_group_sum(rotated * rotated) * np.float32(1 / TURBO_GROUP))
    # A group of a finite vector whose RMS float16 cannot hold (float16 values near its
    # maximum gathered by the rotation, or larger float32 / bfloat16 values, whose squares
    # may overflow float32) saturates to HALF_MAX, as key scales do: clipped but finite,
    # never an inf scale that decodes to inf and attends to NaN. A vector holding NaN or
    # ±inf keeps its scales (the rotation spreads them over the whole vector).
    finite = np.all(np.isfinite(floats), axis=-1)[..., None]
    scale = np.where(finite, np.minimum(scale, HALF_MAX), scale)
    normal = rotated / (scale + EPSILON)[..., None]
    codes = np.asarray(np.sum(normal[..., None] > boundaries, axis=-1, dtype=np.uint8))
    return pack_codes(codes.reshape(x.shape), bits), _half(scale)


def rotated_values(packed: Array, scales: Array, bits: int) -> Array:
    """Values still rotated, ``centroids[idx]·scale`` in float32 (the deferred-V read)."""
    centroids, _ = codebook(bits)
    idx = unpack_codes(packed, bits)
    groups = _grouped(centroids[idx])
    out: Array = (groups * scales.astype(np.float32)[..., None]).reshape(idx.shape)
    return out


def unrotate(x: Array) -> Array:
    """Undo the value rotation on ``[..., D]``: float32 Hadamard, then the signs; returns
    ``x``'s dtype."""
    floats = x.astype(np.float32)
    out: Array = (hadamard(floats) * signs(int(x.shape[-1]))).astype(x.dtype)
    return out


def decode_values(packed: Array, scales: Array, bits: int) -> Array:
    """Values fully decoded (eager): Hadamard of the rotated values, then the signs, float32."""
    rotated = rotated_values(packed, scales, bits)
    out: Array = hadamard(rotated) * signs(int(rotated.shape[-1]))
    return out
