"""NumPy views of MLX buffers on the CPU backend, where NumPy's copies run near memcpy's
speed and MLX's slice updates and per-element gathers do not (``spec/paged.md``,
``spec/turbo-codec.md``): the paged pool writes and gathers through them, the TurboQuant
value read looks its centroids up through them. Every helper returns ``None`` (or is not
called) on other backends, which keep the MLX ops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = ["fresh_host", "host_readable", "host_views", "on_cpu"]


def on_cpu() -> bool:
    """Whether MLX computes on the CPU backend (NumPy and MLX then share memory)."""
    return bool(mx.default_device() == mx.cpu)


#: NumPy dtype strings of the plane dtypes the CPU write path serves.
_MX_DTYPES = {
    np.dtype(np.float16).str: mx.float16,
    np.dtype(np.float32).str: mx.float32,
    np.dtype(np.uint32).str: mx.uint32,
    np.dtype(np.uint8).str: mx.uint8,
    np.dtype(np.int8).str: mx.int8,
    np.dtype(np.uint16).str: mx.uint16,
    np.dtype(np.int32).str: mx.int32,
}


def host_views(planes: Sequence[mx.array]) -> list[np.ndarray[Any, Any]] | None:
    """Writable NumPy views of the pool's planes on the CPU backend (``None`` elsewhere, or
    for a dtype NumPy lacks): the planes are evaluated, owned by the pool alone and read
    only through evaluated copies (gathers), so writing their buffers in place is what an
    MLX slice update with buffer donation does, without its slow copy kernel."""
    if not on_cpu() or any(p.dtype == mx.bfloat16 for p in planes):
        return None
    views = [np.asarray(p) for p in planes]
    if not all(
        v.flags.writeable and v.flags.c_contiguous and v.dtype.str in _MX_DTYPES for v in views
    ):
        return None
    return views


def host_readable(plane: mx.array) -> np.ndarray[Any, Any] | None:
    """A NumPy view of an evaluated plane's buffer on the CPU backend (bfloat16 as its
    ``uint16`` bits: a gather moves bits), ``None`` elsewhere or for a dtype NumPy lacks."""
    if not on_cpu():
        return None
    if plane.dtype == mx.bfloat16:
        plane = plane.view(mx.uint16)
        mx.eval(plane)
    view = np.asarray(plane)
    return view if view.flags.c_contiguous and view.dtype.str in _MX_DTYPES else None


def fresh_host(shape: tuple[int, ...], dtype: mx.Dtype) -> tuple[mx.array, np.ndarray[Any, Any]]:
    """A fresh evaluated MLX array of ``shape`` and ``dtype`` and a writable NumPy view of
    its buffer (bfloat16 through its ``uint16`` bits)."""
    bits = mx.uint16 if dtype == mx.bfloat16 else dtype
    image = mx.zeros(shape, dtype=bits)
    mx.eval(image)
    target = np.asarray(image)
    if not (target.flags.writeable and target.flags.c_contiguous):  # not its own buffer
        image = mx.array(np.zeros(target.shape, dtype=target.dtype))
        target = np.asarray(image)
    if dtype == mx.bfloat16:
        image = image.view(mx.bfloat16)
    return image, target
