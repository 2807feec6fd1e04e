"""Chunked-local attention: the chunked token geometry's hooks (``spec/ChunkedKVCache.md``).

A row keeps its newest ``chunk_size`` tokens before it appends (mlx-lm's
``maybe_trim_front``), so a block of ``n`` reads ``min(retained, chunk_size) + n``; a
query sees the earlier positions of its own chunk. Layouts place rows as the growing
geometry does (right-aligned, left pads); a front trim leaves a row's end where it was and
grows its pad, and the padding every row then shares leaves the read (as a filter drops
it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvrows.compositions import Arrangement, Composition
from kvrows.geometries.chunked import Chunked
from kvrows.protocols import Mask
from kvrows.reference.geometries.growing import GrowingAxis, PaddedRows, padded_visible
from kvrows.reference.geometries.registry import implements
from kvrows.reference.rows import Placement, Row

__all__ = ["ChunkedAxis", "ChunkedRows", "ChunkedSurface", "chunk_mask"]


def chunk_mask(
    rows: Sequence[Row], pads: Sequence[int], n: int, size: int, window: int | None,
    return_array: bool,
) -> Mask:  # fmt: skip
    """What ``rows`` (at ``pads``) see in their next ``n``-token append, as it lays them
    (after their front trims): ``None`` / ``"causal"`` while nothing is padded, the rows
    end together and each row's keys and queries are one chunk; else ``[B, 1, n, S]``,
    row ``b``'s column ``c`` holding position ``offset[b] + c - end[b]``."""
    kept = [min(r.retained, size) for r in rows]
    moved = [p + r.retained - k for p, r, k in zip(pads, rows, kept, strict=True)]
    shared = min(moved, default=0)
    moved = [p - shared for p in moved]
    ends = [p + k for p, k in zip(moved, kept, strict=True)]
    one_chunk = all((r.offset - k) // size == (r.offset + n - 1) // size
                    for r, k in zip(rows, kept, strict=True))  # fmt: skip
    uniform = not any(moved) and len(set(ends)) <= 1
    if uniform and one_chunk and window is None and not return_array:
        return None if n == 1 else "causal"
    seen = padded_visible(moved, ends, n, window)
    offset = np.array([r.offset for r in rows], dtype=np.int64)[:, None, None, None]
    end = np.array(ends, dtype=np.int64)[:, None, None, None]
    keys = offset + np.arange(seen.shape[-1])[None, None, None, :] - end
    queries = offset + np.arange(n)[None, None, :, None]
    visible: npt.NDArray[np.bool_] = seen & (keys // size == queries // size)
    return visible


@implements("chunked")
class ChunkedAxis(GrowingAxis):
    """The newest ``chunk_size`` tokens are kept before each append; the window is what
    the row holds."""

    def holds_proposals(self, arrangement: str) -> bool:
        return False  # a full chunk evicts the one before it

    def __init__(self, spec: Chunked) -> None:
        self.spec = spec
        self.size = spec.chunk_size
        self.cap = spec.chunk_size

    def history(self, row: Row, n: int) -> int:
        return min(row.retained, self.size)

    def trim_front(self, row: Row) -> int:
        """Forget all but the row's newest ``chunk_size`` tokens; how many it forgot."""
        evicted = row.retained - self.history(row, 0)
        if evicted:
            row.planes = row.newest(row.retained - evicted).planes
        return evicted

    def serial_mask(self, row: Row, n: int, window: int | None, return_array: bool) -> Mask:
        """The one-row case of the layouts' mask, ``[n, S]`` as an array."""
        mask = chunk_mask([row], [0], n, self.size, window, return_array)
        return mask[0, 0] if isinstance(mask, np.ndarray) else mask

    def place(self, arrangement: Arrangement) -> Placement:
        return ChunkedRows(self, shared=arrangement == "shared")


class ChunkedRows(PaddedRows):
    """Growing's padded rows; before every append each row trims its front (its pad
    grows by what it forgot) and the padding every row shares leaves the read."""

    def __init__(self, axis: ChunkedAxis, *, shared: bool) -> None:
        super().__init__(shared=shared)
        self.axis = axis

    def advance(self, rows: Sequence[Row], n: int) -> None:
        for row in rows:
            row.pad += self.axis.trim_front(row)
        self.filter(rows)

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        pads = [r.pad for r in rows]
        return chunk_mask(rows, pads, n, self.axis.size, window, return_array)


class ChunkedSurface:
    """mlx-lm's ``ChunkedKVCache`` surface: ``chunk_size``, ``start_position`` (the first
    position held: one int, or one per row of a layout) and ``maybe_trim_front``."""

    _token_geometry: Any
    _rows: list[Row]
    _axis: Any
    if TYPE_CHECKING:  # the storage's, which every public class of it inherits
        composition: ClassVar[Composition]
        offset: Any
        retained: Any

        def _advance(self, n: int) -> None: ...

    @property
    def chunk_size(self) -> int:
        return int(self._token_geometry.chunk_size)

    @property
    def start_position(self) -> Any:
        starts = np.asarray(self.offset) - np.asarray(self.retained)
        return int(starts) if starts.ndim == 0 else starts.astype(np.int32)

    def maybe_trim_front(self) -> None:
        """Keep each row's newest ``chunk_size`` tokens (what the next append does first;
        llama4 calls it before it builds its mask from ``start_position``)."""
        if self.composition.is_layout:
            self._advance(0)  # the placement's front trims
        else:
            for row in self._rows:
                self._axis.trim_front(row)
