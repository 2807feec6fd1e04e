"""Bit-exact moves between NumPy and MLX arrays, for the codec tests that compare the
reference's bytes with MLX's (NaN bit patterns and signed zeros included)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import numpy.typing as npt

#: The NumPy dtype of each float dtype name the codecs take.
NP_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}


def to_mx(x: npt.NDArray[Any]) -> mx.array:
    """NumPy -> MLX, bit-exact (bfloat16 goes through its uint16 bits)."""
    if x.dtype == ml_dtypes.bfloat16:
        return mx.array(x.view(np.uint16)).view(mx.bfloat16)
    return mx.array(x)


def to_np(a: mx.array) -> npt.NDArray[Any]:
    """MLX -> NumPy, bit-exact."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(a)
