"""TurboQuant on MLX: the same float32 steps as ``kvrows.reference.turbo_codec``, in the
same order, so the codes and scales agree bit for bit on the CPU (``spec/turbo-codec.md``).

The value transform is ``mx.hadamard_transform``: on the CPU it computes the reference's
float32 butterfly bit for bit (``tests/test_turbo_codec.py`` checks it, since the codes are
decided by comparisons that one ulp could flip).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.codec import TURBO_GROUP, check_turbo_dim
from kvrows.errors import (
    InvalidInputError,
    turbo_bits_message,
    turbo_input_dtype_message,
    turbo_scalar_input_message,
)
from kvrows.optimized.host import (
    RowDecoder,
    code_runs,
    decode_groups,
    fresh_host,
    group_rows,
    on_cpu,
)
from kvrows.schemes import TURBO_KEY_BITS, TURBO_VALUE_BITS
from kvrows.turbo_tables import BOUNDARIES, CENTROIDS, SIGN_BITS

__all__ = [
    "centroid_runs",
    "decode_keys",
    "decode_values",
    "encode_keys",
    "encode_values",
    "hadamard",
    "host_key_rows",
    "host_rotated_rows",
    "pack_codes",
    "rotated_values",
    "signs",
    "unpack_codes",
    "unrotate",
]

EPSILON = 1e-8
#: The reference's ``HALF_MAX`` (largest finite float16) and ``HALF_OVERFLOW`` (the
#: smallest magnitude float16 rounds to ±inf).
HALF_MAX, HALF_OVERFLOW = 65504.0, 65520.0
_FLOATS = (mx.float32, mx.float16, mx.bfloat16)


@cache
def signs(dim: int) -> mx.array:
    """The fixed sign vector of head dim ``dim`` (float32 ±1)."""
    check_turbo_dim(dim)
    return mx.array([1.0 if c == "1" else -1.0 for c in SIGN_BITS[dim]], dtype=mx.float32)


@cache
def codebook(bits: int) -> tuple[mx.array, mx.array]:
    """``(centroids, boundaries)`` float32 of the ``bits``-bit Lloyd-Max table."""
    if bits not in TURBO_VALUE_BITS:
        raise InvalidInputError(turbo_bits_message("v_bits", TURBO_VALUE_BITS, bits))
    return (
        mx.array(CENTROIDS[bits], dtype=mx.float32),
        mx.array(BOUNDARIES[bits], dtype=mx.float32),
    )


def _floats(x: object, name: str) -> mx.array:
    if not isinstance(x, mx.array):
        raise InvalidInputError(f"{name} must be an mlx array, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise InvalidInputError(turbo_input_dtype_message(name, x.dtype))
    if x.ndim < 1:
        raise InvalidInputError(turbo_scalar_input_message(name))
    check_turbo_dim(int(x.shape[-1]))
    return x.astype(mx.float32)


def hadamard(x: mx.array) -> mx.array:
    """Orthonormal Walsh-Hadamard transform of float32 ``[..., D]`` (Sylvester order,
    scale ``1/√D``): equal, bit for bit, to the reference's butterfly."""
    return mx.hadamard_transform(x, scale=1 / math.sqrt(int(x.shape[-1])))


def _group_sum(x: mx.array) -> mx.array:
    width = int(x.shape[-1])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def _half(x: mx.array) -> mx.array:
    """float32 -> float16, every NaN as the reference's ``NAN16`` (0x7D00)."""
    return mx.where(
        mx.isnan(x), mx.array(0x7D00, dtype=mx.uint16).view(mx.float16), x.astype(mx.float16)
    )


def _grouped(x: mx.array) -> mx.array:
    return x.reshape(*x.shape[:-1], int(x.shape[-1]) // TURBO_GROUP, TURBO_GROUP)


def _chunk_word(bits: int) -> mx.Dtype:
    """The unsigned word that holds 8 codes of ``bits`` (``bits`` bytes of the stream)."""
    return mx.uint32 if bits * 8 <= 32 else mx.uint64


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """``[..., D]`` codes as a little-endian bitstream of ``D·bits/8`` bytes (8 bits: as is).

    Word-wise, not bit-wise: 8 codes fill ``bits`` bytes exactly, so each run of 8 codes is
    shifted into one word whose little-endian bytes are that run's share of the stream."""
    codes = codes.astype(mx.uint8)
    if bits == 8:
        return codes
    dim = int(codes.shape[-1])
    word = _chunk_word(bits)
    runs = codes.reshape(*codes.shape[:-1], dim // 8, 8).astype(word)
    packed = mx.sum(mx.left_shift(runs, mx.arange(0, 8 * bits, bits, dtype=word)), axis=-1)
    shifts = mx.arange(0, 8 * bits, 8, dtype=word)
    stream = (mx.right_shift(packed[..., None], shifts) & 0xFF).astype(mx.uint8)
    return stream.reshape(*codes.shape[:-1], dim * bits // 8)


def _fields(packed: mx.array, bits: int, field: int, dtype: mx.Dtype) -> mx.array:
    """A stream of ``bits``-bit codes as consecutive ``field``-bit fields (``field`` a
    multiple of ``bits`` dividing a run of 8 codes; the first field in the low bits), as
    ``dtype``. Fields that divide a byte shift each byte once per field; others gather each
    run of ``bits`` bytes into one word first (an OR per byte: cheaper than a reduction)."""
    width = int(packed.shape[-1])
    count = width * 8 // field
    if field == 8:
        return packed.astype(dtype)
    mask = (1 << field) - 1
    if 8 % field == 0:
        fields = mx.right_shift(packed[..., None], mx.arange(0, 8, field, dtype=mx.uint8)) & mask
        return fields.astype(dtype).reshape(*packed.shape[:-1], count)
    word = _chunk_word(bits)
    chunks = packed.reshape(*packed.shape[:-1], width // bits, bits)
    run = chunks[..., 0].astype(word)
    for byte in range(1, bits):
        run = run | mx.left_shift(chunks[..., byte].astype(word), mx.array(8 * byte, dtype=word))
    fields = mx.right_shift(run[..., None], mx.arange(0, 8 * bits, field, dtype=word)) & mask
    return fields.astype(dtype).reshape(*packed.shape[:-1], count)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """The uint8 codes of a ``pack_codes`` bitstream (one field per code)."""
    return _fields(packed, bits, bits, mx.uint8)


def encode_keys(x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """``(kIdx, kScales, kZeros)`` of float ``[..., D]`` keys at ``bits`` ∈ {2, 4, 5, 8}."""
    if bits not in TURBO_KEY_BITS:
        raise InvalidInputError(turbo_bits_message("k_bits", TURBO_KEY_BITS, bits))
    groups = _grouped(_floats(x, "keys"))
    zero_f = mx.array(0.0, dtype=mx.float32)
    high = mx.max(groups, axis=-1) + zero_f
    low = mx.min(groups, axis=-1) + zero_f
    epsilon = mx.array(EPSILON, dtype=mx.float32)
    if bits == 8:
        scale = (high - low) / mx.array(254.0, dtype=mx.float32)
        step = scale + epsilon
        zero = mx.round((high + low) / (mx.array(2.0, dtype=mx.float32) * step))
        least, most = -127, 127
    else:
        most = 2**bits - 1
        scale = (high - low) / mx.array(float(most), dtype=mx.float32)
        step = scale + epsilon
        zero = mx.round(low / step)
        least = 0
    codes = mx.clip(mx.round(groups / step[..., None] - zero[..., None]), least, most)
    # The reference's guards: constant or float16-overflowing-zero groups are stored flat
    # at their midpoint; a finite scale beyond float16 saturates.
    constant = high == low
    flat = constant | (mx.abs(zero) >= HALF_OVERFLOW)
    middle = mx.where(constant, low, low + (high - low) / mx.array(2.0, dtype=mx.float32))
    codes = mx.where(flat[..., None] | mx.isnan(codes), zero_f, codes)
    scale = mx.where(flat, middle, scale)
    zero = mx.where(flat, mx.array(1.0, dtype=mx.float32), zero)
    scale = mx.where(mx.isfinite(scale), mx.clip(scale, -HALF_MAX, HALF_MAX), scale)
    flat = codes.reshape(x.shape)
    stored = flat.astype(mx.int8) if bits == 8 else pack_codes(flat.astype(mx.uint8), bits)
    return stored, _half(scale), _half(zero)


def decode_keys(codes: mx.array, scales: mx.array, zeros: mx.array, bits: int) -> mx.array:
    """Keys ``(idx + zero)·scale`` in float32 (the caller casts)."""
    idx = codes.astype(mx.float32) if bits == 8 else unpack_codes(codes, bits).astype(mx.float32)
    groups = _grouped(idx)
    out = (groups + zeros.astype(mx.float32)[..., None]) * scales.astype(mx.float32)[..., None]
    return out.reshape(idx.shape)


def encode_values(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """``(vPacked, vScales)`` of float ``[..., D]`` values at ``bits`` ∈ {2, 3, 4, 5, 8}."""
    _, boundaries = codebook(bits)
    floats = _floats(x, "values")
    rotated = _grouped(hadamard(floats * signs(int(x.shape[-1]))))
    scale = mx.sqrt(_group_sum(rotated * rotated) * mx.array(1 / TURBO_GROUP, dtype=mx.float32))
    # The reference's guard: a group of finite values saturates its scale to HALF_MAX.
    finite = mx.all(mx.isfinite(floats), axis=-1)[..., None]
    scale = mx.where(finite, mx.minimum(scale, mx.array(HALF_MAX, dtype=mx.float32)), scale)
    normal = rotated / (scale + mx.array(EPSILON, dtype=mx.float32))[..., None]
    codes = mx.sum(normal[..., None] > boundaries, axis=-1).astype(mx.uint8)
    return pack_codes(codes.reshape(x.shape), bits), _half(scale)


#: Codes MLX gathers together per ``bits`` (:func:`centroid_runs`): the index of ``k`` codes
#: has at most 12 bits, so the table stays small on any device.
_GATHERED = {2: 4, 3: 4, 4: 2, 5: 2, 8: 1}


@cache
def centroid_runs(bits: int) -> mx.array:
    """``[2^(k·bits), k]`` float32: for each index of ``k`` codes (the first in the low
    bits), their centroids (:func:`code_runs`); one gather then reads ``k`` centroids."""
    centroids, _ = codebook(bits)
    return mx.array(code_runs(np.asarray(centroids), bits, _GATHERED[bits]))


def _lookup_indices(packed: mx.array, bits: int) -> mx.array:
    """The stream as indices of ``_GATHERED[bits]`` codes each, in order."""
    return _fields(packed, bits, _GATHERED[bits] * bits, mx.uint32)


def rotated_values(packed: mx.array, scales: mx.array, bits: int) -> mx.array:
    """Values still rotated, ``centroids[idx]·scale`` in float32 (the deferred-V read).

    The centroids are gathered several codes at a time (:func:`centroid_runs`): the same
    float32 values as one gather per code, in a fraction of the gathers. On the CPU NumPy
    looks them up and scales them in a fresh MLX buffer (MLX's CPU gather costs per
    element: about 4x slower at decode shapes); the same float32 products either way."""
    table = centroid_runs(bits)  # checks ``bits``
    dim = int(packed.shape[-1]) * 8 // bits
    shape = (*packed.shape[:-1], dim)
    if not on_cpu():
        values = table[_lookup_indices(packed, bits)].reshape(shape)
        groups = _grouped(values)
        return (groups * scales.astype(mx.float32)[..., None]).reshape(shape)
    image, target = fresh_host(shape, mx.float32)
    scales32 = np.asarray(scales.astype(mx.float32))[..., None]
    decode_groups(np.asarray(packed), bits, np.asarray(table), TURBO_GROUP, target, scales32)
    return image


#: :func:`_host_runs`' tables, each with the codebook array it was built from.
_HOST_RUNS: dict[tuple[int, bool], tuple[mx.array | None, np.ndarray[Any, Any]]] = {}


def _host_runs(bits: int, identity: bool) -> np.ndarray[Any, Any]:
    """:func:`code_runs` of the codes themselves (``identity``: packed key codes) or of the
    value centroids, as NumPy float32; rebuilt when :func:`codebook` gives another array
    (its cache cleared), as :func:`centroid_runs` is."""
    source = None if identity else codebook(bits)[0]
    known = _HOST_RUNS.get((bits, identity))
    if known is None or known[0] is not source:
        levels = np.arange(2**bits) if source is None else np.asarray(source)
        known = _HOST_RUNS[bits, identity] = (source, code_runs(levels, bits))
    return known[1]


def host_key_rows(codes: mx.array, scales: mx.array, zeros: mx.array, bits: int) -> RowDecoder:
    """The keys ``(idx + zero)·scale`` of batch rows ``[lo, hi)``, float32 in NumPy (the host
    attention's key decoder: :func:`decode_keys`' values; 8-bit ``int8`` codes cast)."""
    stream = np.asarray(codes).view(np.int8 if bits == 8 else np.uint8)
    scales32, zeros32 = (np.asarray(p.astype(mx.float32))[..., None] for p in (scales, zeros))
    runs = None if bits == 8 else _host_runs(bits, True)
    return group_rows(stream, bits, runs, TURBO_GROUP, "keys", scales32, offsets=zeros32)


def host_rotated_rows(packed: mx.array, scales: mx.array, bits: int) -> RowDecoder:
    """The still-rotated values ``centroids[idx]·scale`` of batch rows ``[lo, hi)``, float32
    in NumPy (the host attention's value decoder: :func:`rotated_values`' values)."""
    if bits not in TURBO_VALUE_BITS:
        raise InvalidInputError(turbo_bits_message("v_bits", TURBO_VALUE_BITS, bits))
    stream = np.asarray(packed).view(np.uint8)
    scales32 = np.asarray(scales.astype(mx.float32))[..., None]
    return group_rows(stream, bits, _host_runs(bits, False), TURBO_GROUP, "values", scales32)


def unrotate(x: mx.array) -> mx.array:
    """Undo the value rotation on ``[..., D]``: float32 Hadamard, then the signs; ``x``'s dtype."""
    return (hadamard(x.astype(mx.float32)) * signs(int(x.shape[-1]))).astype(x.dtype)


def decode_values(packed: mx.array, scales: mx.array, bits: int) -> mx.array:
    """Values fully decoded (eager), float32."""
    rotated = rotated_values(packed, scales, bits)
    return hadamard(rotated) * signs(int(rotated.shape[-1]))
