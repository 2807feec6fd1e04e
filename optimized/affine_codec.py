"""MLX affine group quantization: thin, validated wrappers of ``mx.quantize`` / ``mx.dequantize``.

Same parameters, shapes and errors as ``kvrows.reference.affine_codec`` (both validate with
:func:`kvrows.affine_geometry.validate_codec`); on the CPU stream the results are bit-identical
to the NumPy reference. Unlike the bare MLX ops these also accept a 1-D head ``[D]``.
"""

from __future__ import annotations

import mlx.core as mx

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

SUPPORTED_DTYPES: tuple[mx.Dtype, ...] = (mx.float32, mx.float16, mx.bfloat16)
"""Input dtypes of :func:`quantize` (and dtypes of the scales/biases)."""


def _check_dtype(name: str, dtype: mx.Dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise InvalidInputError(affine_input_dtype_message(name, dtype))


def quantize(x: mx.array, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """``mx.quantize(x, group_size, bits, mode="affine")`` along the last axis of ``x``.

    Returns ``(packed, scales, biases)``: packed uint32 ``[..., D*bits/32]``, scales and
    biases ``[..., D/group_size]`` in the dtype of ``x``.
    """
    if not isinstance(x, mx.array):
        raise InvalidInputError(f"x must be an mx.array, got {type(x).__name__}")
    _check_dtype("x", x.dtype)
    if x.ndim < 1:
        raise InvalidInputError(AFFINE_SCALAR_INPUT)
    validate_codec(x.shape[-1], group_size, bits)
    w = x[None] if x.ndim == 1 else x
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits, mode="affine")
    if x.ndim == 1:
        return packed[0], scales[0], biases[0]
    return packed, scales, biases


def dequantize(
    packed: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int
) -> mx.array:
    """``mx.dequantize(..., mode="affine")``: ``[..., D]`` in the scales' dtype."""
    for name, a in (("packed", packed), ("scales", scales), ("biases", biases)):
        if not isinstance(a, mx.array):
            raise InvalidInputError(f"{name} must be an mx.array, got {type(a).__name__}")
    if packed.dtype != mx.uint32:
        raise InvalidInputError(packed_codes_dtype_message(packed.dtype))
    _check_dtype("scales", scales.dtype)
    if biases.dtype != scales.dtype:
        raise InvalidInputError(scales_biases_dtype_message(scales.dtype, biases.dtype))
    if packed.ndim < 1 or scales.ndim < 1:
        raise InvalidInputError(PACKED_SCALAR_INPUT)
    if scales.shape != biases.shape or packed.shape[:-1] != scales.shape[:-1]:
        raise InvalidInputError(packed_shapes_message(packed.shape, scales.shape, biases.shape))
    validate_params(group_size, bits)
    head_dim = group_size * scales.shape[-1]
    validate_codec(head_dim, group_size, bits)
    if packed.shape[-1] != packed_width(head_dim, bits):
        raise InvalidInputError(
            packed_width_message(
                packed.shape[-1], scales.shape[-1], group_size, bits, packed_width(head_dim, bits)
            )
        )
    if packed.ndim == 1:
        return dequantize(packed[None], scales[None], biases[None], group_size, bits)[0]
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits, mode="affine")
