"""Full observable snapshots of caches, for "a call that raises changes nothing".

A snapshot reads a cache only through its public surface (plus ``planes()`` /
``row_planes()``, the read-only views every implementation exposes for tests)
and turns everything into plain Python values and bytes, so two snapshots
compare with ``==``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy.typing as npt

__all__ = ["Snapshot", "snapshot"]

Snapshot = tuple[Any, ...]


def _planes_bytes(
    planes: tuple[tuple[Any, ...], tuple[Any, ...]] | None,
    to_numpy: Callable[[Any], npt.NDArray[Any]],
) -> Any:
    if planes is None:
        return None
    out = []
    for group in planes:
        for plane in group:
            array = to_numpy(plane)
            out.append((array.shape, str(array.dtype), array.tobytes()))
    return tuple(out)


def snapshot(cache: Any, to_numpy: Callable[[Any], npt.NDArray[Any]]) -> Snapshot:
    """Everything observable about ``cache`` (a serial cache or a row layout)."""
    base = (
        type(cache).__name__,
        cache.signature(),
        repr(cache.geometry),
        int(cache.nbytes),
    )
    if hasattr(cache, "row_planes"):
        rows = tuple(_planes_bytes(cache.row_planes(b), to_numpy) for b in range(cache.batch_size))
        return (
            *base,
            cache.batch_size,
            cache.row_offsets,
            cache.left_pad,
            cache.width,
            tuple(int(x) for x in to_numpy(cache.offset).tolist()),
            rows,
        )
    return (*base, int(cache.offset), _planes_bytes(cache.planes(), to_numpy))
