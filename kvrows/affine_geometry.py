"""Geometry and validation of MLX affine group quantization (``mx.quantize``, mode "affine").

Shared by ``kvrows.reference.affine_codec`` (NumPy) and ``kvrows.optimized.affine_codec``
(MLX), so that both accept exactly the same parameters and report the same errors.

A head of ``D`` values quantized at ``bits`` bits with groups of ``group_size`` values is
stored as ``D * bits / 32`` uint32 words of codes (a continuous LSB-first bitstream, so for
3, 5 and 6 bits a code may straddle two words) plus one scale and one bias per group.

Note: mlx-lm sizes its quantized KV buffers as ``D // (32 // bits)`` words, which is the true
width only when ``bits`` divides 32; for 3, 5 and 6 bits it over-allocates (e.g. D=128,
bits=5: 21 words instead of 20). :func:`packed_width` is the width ``mx.quantize`` produces.
"""

from __future__ import annotations

from kvrows.errors import InvalidInputError

__all__ = [
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "groups",
    "packed_width",
    "validate_codec",
    "validate_params",
]

SUPPORTED_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
"""Bit widths ``mx.quantize`` accepts in mode "affine"."""

SUPPORTED_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
"""Group sizes ``mx.quantize`` accepts in mode "affine"."""


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def validate_params(group_size: int, bits: int) -> None:
    """Raise :class:`InvalidInputError` unless ``bits`` and ``group_size`` are supported."""
    group_size = _check_int("group_size", group_size)
    bits = _check_int("bits", bits)
    if bits not in SUPPORTED_BITS:
        raise InvalidInputError(
            f"affine quantization bits must be one of {SUPPORTED_BITS}, got {bits}"
        )
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InvalidInputError(
            f"affine quantization group size must be one of {SUPPORTED_GROUP_SIZES}, "
            f"got {group_size}"
        )


def validate_codec(head_dim: int, group_size: int, bits: int) -> None:
    """Raise :class:`InvalidInputError` unless ``(head_dim, group_size, bits)`` is a valid codec.

    Valid: ``bits`` in {2, 3, 4, 5, 6, 8}, ``group_size`` in {32, 64, 128}, ``head_dim`` a
    positive multiple of ``group_size`` (which makes ``head_dim * bits`` a multiple of 32).
    """
    head_dim = _check_int("head_dim", head_dim)
    validate_params(group_size, bits)
    if head_dim <= 0 or head_dim % group_size != 0:
        raise InvalidInputError(
            f"head dim must be a positive multiple of the group size {group_size}, got {head_dim}"
        )
    if (head_dim * bits) % 32 != 0:  # unreachable while group sizes are multiples of 32
        raise InvalidInputError(
            f"head dim * bits must be a multiple of 32 to pack into uint32 words, "
            f"got {head_dim} * {bits}"
        )


def packed_width(head_dim: int, bits: int) -> int:
    """Number of uint32 words holding the codes of ``head_dim`` values: ``head_dim*bits/32``."""
    head_dim = _check_int("head_dim", head_dim)
    bits = _check_int("bits", bits)
    if bits not in SUPPORTED_BITS:
        raise InvalidInputError(
            f"affine quantization bits must be one of {SUPPORTED_BITS}, got {bits}"
        )
    if head_dim <= 0 or (head_dim * bits) % 32 != 0:
        raise InvalidInputError(
            f"head dim * bits must be a positive multiple of 32, got {head_dim} * {bits}"
        )
    return head_dim * bits // 32


def groups(head_dim: int, group_size: int) -> int:
    """Number of quantization groups (scales, biases) per head: ``head_dim / group_size``."""
    head_dim = _check_int("head_dim", head_dim)
    group_size = _check_int("group_size", group_size)
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise InvalidInputError(
            f"affine quantization group size must be one of {SUPPORTED_GROUP_SIZES}, "
            f"got {group_size}"
        )
    if head_dim <= 0 or head_dim % group_size != 0:
        raise InvalidInputError(
            f"head dim must be a positive multiple of the group size {group_size}, got {head_dim}"
        )
    return head_dim // group_size
