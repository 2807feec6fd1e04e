"""Exact array plumbing between NumPy and MLX, and masks as plain booleans.

Data is generated on the NumPy side and handed to MLX exactly (bfloat16 goes
through float32, which holds every bfloat16 value); MLX arrays come back as
NumPy arrays of the same dtype and bits (bfloat16 through its uint16 bits), so
"byte for byte" comparisons compare what the implementations stored.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import numpy.typing as npt

__all__ = [
    "MLX_DTYPES",
    "NUMPY_DTYPES",
    "as_numpy",
    "expand_mask",
    "from_mlx",
    "random_block",
    "to_mlx",
]

NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}

MLX_DTYPES: dict[str, mx.Dtype] = {
    "float32": mx.float32,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
}


def to_mlx(array: npt.NDArray[Any]) -> mx.array:
    """A NumPy array as an MLX array with the same values and dtype (bfloat16 via float32)."""
    if array.dtype == NUMPY_DTYPES["bfloat16"]:
        return mx.array(array.astype(np.float32)).astype(mx.bfloat16)
    return mx.array(array)


def from_mlx(array: mx.array) -> npt.NDArray[Any]:
    """An MLX array as a NumPy array with the same dtype and bits."""
    if array.dtype == mx.bfloat16:
        # NumPy has no bfloat16 buffer format: copy the bits of a row-contiguous buffer
        # (no new MLX op to evaluate), else of a contiguous uint16 view.
        # (MLX arrays export the buffer protocol; its stubs do not say so.)
        buffer = memoryview(array) if array.size else None  # type: ignore[arg-type]
        if buffer is not None and buffer.c_contiguous:
            bits = np.frombuffer(buffer.cast("B"), dtype=np.uint16).reshape(array.shape).copy()
        else:
            bits = np.array(mx.contiguous(array).view(mx.uint16))
        return bits.view(NUMPY_DTYPES["bfloat16"])
    return np.array(array)


def as_numpy(array: Any) -> npt.NDArray[Any]:
    """NumPy or MLX array → NumPy array (same dtype, same bits)."""
    if isinstance(array, mx.array):
        return from_mlx(array)
    if isinstance(array, np.ndarray):
        return array
    raise TypeError(f"expected a NumPy or MLX array, got {type(array).__name__}")


def random_block(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> npt.NDArray[Any]:
    """Standard-normal values rounded to ``dtype``."""
    return rng.standard_normal(shape, dtype=np.float32).astype(NUMPY_DTYPES[dtype])


def expand_mask(mask: Any, batch: int, queries: int, keys: int) -> npt.NDArray[np.bool_]:
    """A mask (``None``, ``"causal"``, a boolean ``[N, S]`` / ``[B, 1, N, S]`` array) as
    a ``[B, 1, N, S]`` boolean array: ``None`` is all True, ``"causal"`` is bottom-right
    aligned (query ``i`` sees keys ``j <= S - N + i``)."""
    shape = (batch, 1, queries, keys)
    if mask is None:
        return np.ones(shape, dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            raise AssertionError(f"a mask string must be 'causal', got {mask!r}")
        rows = np.arange(queries)[:, None] + (keys - queries)
        causal = np.arange(keys)[None, :] <= rows
        return np.broadcast_to(causal[None, None], shape).copy()
    array = as_numpy(mask)
    if array.dtype != np.bool_:
        raise AssertionError(f"a mask array must be boolean, got {array.dtype}")
    if array.ndim == 2:
        array = array[None, None]
    if array.ndim != 4 or array.shape[1] != 1 or array.shape[2:] != (queries, keys):
        raise AssertionError(
            f"mask of shape {array.shape} does not describe {queries} queries over {keys} keys"
        )
    if array.shape[0] not in (1, batch):
        raise AssertionError(f"mask of shape {array.shape} does not fit {batch} rows")
    return np.broadcast_to(array, shape).copy()
