"""Sliding window: the ring token geometry's hooks (``spec/RotatingKVCache.md``,
``spec/BatchedRotatingCache.md``, ``spec/RaggedRotatingRows.md``).

The reference keeps no ring: a row holds the tokens it retains in temporal order. Before
it appends ``n`` tokens it keeps its newest ``max_size - 1`` (so one token leaves the
newest ``max_size``, and a block's first query still sees a whole window while the row
briefly holds ``max_size - 1 + n``). A row's window is its newest
``min(offset, max_size)`` tokens: what extraction and merging keep.

Two placements: **shared** (one ring of ``active`` columns every row writes at once,
mlx-lm's ``BatchRotatingKVCache``: row ``b``'s newest ``min(retained, active)`` tokens
fill the last columns of the temporal image, which the physical one rolls by ``phase``;
``left_pad`` follows mlx-lm's bookkeeping and goes negative once pads are overwritten),
and **ragged** (each row left-aligned at column 0, appending at its own end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrows.compositions import Arrangement
from kvrows.errors import NotTrimmableError, trim_past_row_message, wrapped_ring_message
from kvrows.protocols import Mask
from kvrows.reference.rows import Placement, Row
from kvrows.schemes import GeometrySpec, Ring

__all__ = ["RaggedRing", "RingAxis", "RingParameters", "SharedRing"]


def _visible(
    ends: Sequence[int], firsts: Sequence[int], n: int, window: int, size: int
) -> npt.NDArray[np.bool_]:
    """``[B, 1, n, size]``: row ``b``'s query ``i`` sits at column ``ends[b] - n + i`` and
    sees the columns of its window from ``firsts[b]`` on (temporal order)."""
    end = np.array(ends, dtype=np.int64)[:, None, None, None]
    first = np.array(firsts, dtype=np.int64)[:, None, None, None]
    queries = end - n + np.arange(n)[None, None, :, None]
    columns = np.arange(size)[None, None, None, :]
    visible: npt.NDArray[np.bool_] = (
        (columns <= queries) & (columns > queries - window) & (columns >= first)
    )
    return visible


class RingParameters:
    """``max_size`` and ``keep`` of a storage over the ring geometry (mlx-lm reads both)."""

    _token_geometry: Any

    @property
    def max_size(self) -> int:
        return int(self._token_geometry.max_size)

    @property
    def keep(self) -> int:
        return int(self._token_geometry.keep)


class RingAxis:
    """The newest ``max_size`` positions are kept (``max_size - 1 + n`` right after a block)."""

    def __init__(self, spec: Ring) -> None:
        self.spec: GeometrySpec = spec
        self.max_size = spec.max_size
        self.cap: int | None = spec.max_size

    def history(self, row: Row, n: int) -> int:
        return self.max_size - 1

    def after(self, retained: int, n: int) -> int:
        """Tokens a row retaining ``retained`` holds after it appends ``n``."""
        return min(retained, self.max_size - 1) + n

    def window(self, row: Row) -> int:
        return min(row.offset, self.max_size)

    def cuttable(self, offset: int) -> bool:
        return offset < self.max_size

    def serial_mask(self, offset: int, n: int, window: int | None, return_array: bool) -> Mask:
        """mlx-lm's ring policy: ``None`` / ``"causal"`` while every query sees its whole
        history, else (or with ``return_array``) the windowed causal array ``[n, S]``."""
        win = window or self.max_size
        after = self.after(offset, n)  # a serial ring retains at least min(offset, max_size - 1)
        if after <= win and not return_array:
            return None if n == 1 else "causal"
        visible: npt.NDArray[np.bool_] = _visible([after], [0], n, win, after)[0, 0]
        return visible

    def place(self, arrangement: Arrangement) -> Placement:
        return SharedRing(self) if arrangement == "shared" else RaggedRing(self)


class SharedRing:
    """One ring every row writes at once, from three integers: ``active`` (columns a read
    returns), ``phase`` (the physical column of the oldest once the ring has wrapped) and
    ``total`` (columns written since the last merge)."""

    def __init__(self, axis: RingAxis) -> None:
        self.axis = axis
        self.active = self.phase = self.total = 0
        self.holds = False  # a ring exists (some row held a token since the merge)

    def _phase_after(self, n: int) -> int:
        if n > 1:
            return 0
        if self.active >= self.axis.max_size:  # full: the write replaces the oldest column
            start = 0 if self.active > self.axis.max_size else self.phase
            return (start + 1) % self.axis.max_size
        return self.phase

    def columns(self, rows: Sequence[Row]) -> tuple[int, list[tuple[int, int]], int]:
        spans = []
        for row in rows:
            shown = min(row.retained, self.active)
            spans.append((self.active - shown, shown))
        return self.active, spans, self.phase

    def fetchable(self, rows: Sequence[Row]) -> bool:
        return self.holds

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        """Query ``i`` sees the keys of its window that hold its row's real tokens."""
        size = self.axis.after(self.active, n)
        real = [min(self.axis.after(row.retained, n), size) for row in rows]
        visible = _visible([size] * len(rows), [size - r for r in real], n,
                           window or self.axis.max_size, size)  # fmt: skip
        rolled: npt.NDArray[np.bool_] = np.roll(visible, self._phase_after(n), axis=3)
        return rolled

    def advance(self, rows: Sequence[Row], n: int) -> None:
        dropped = max(0, self.active - self.axis.max_size + 1)
        for row in rows:
            row.pad -= dropped
        self.active, self.phase = self.axis.after(self.active, n), self._phase_after(n)
        self.total += n
        self.holds = True

    def join(self, rows: Sequence[Row], running: int) -> None:
        """Every row is re-aligned to the longest window."""
        width = max(row.retained for row in rows)
        for row in rows:
            row.pad = width - row.retained
        self.active = self.total = width
        self.phase = 0
        self.holds = width > 0

    def filter(self, rows: Sequence[Row]) -> None:
        if not rows:
            self.active = self.phase = self.total = 0
            self.holds = False

    def check_trim(self, rows: Sequence[Row], counts: Sequence[int]) -> None:
        # The optimized implementation's order: the wrap, each row's count, then equal counts.
        if not any(counts):
            return
        if not self.trimmable(rows):
            raise NotTrimmableError(
                wrapped_ring_message(
                    f"a ring with {self.total} columns written", self.axis.max_size
                )
            )
        for b, (count, row) in enumerate(zip(counts, rows, strict=True)):
            if count > row.offset:
                raise NotTrimmableError(trim_past_row_message(count, b, row.offset))
        if len(set(counts)) > 1:
            raise NotTrimmableError("rows sharing one write column must trim together")
        if counts[0] > self.total:
            raise NotTrimmableError(
                f"cannot trim {counts[0]} tokens from a ring with {self.total} columns written"
            )

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int]) -> None:
        count = max(counts, default=0)
        self.active -= count
        self.total -= count

    def trimmable(self, rows: Sequence[Row]) -> bool:
        return self.total < self.axis.max_size

    def check(self, rows: Sequence[Row]) -> None:
        """The mlx-lm style pads agree with the rows' retained tokens."""
        for row in rows:
            shown = min(row.retained, self.active)
            assert max(0, row.pad) == self.active - shown, (row, self.active)


class RaggedRing:
    """Each row its own ring, left-aligned: row ``b`` at columns ``[0, retained[b])``."""

    def __init__(self, axis: RingAxis) -> None:
        self.axis = axis
        self.holds = False  # a buffer exists (some row held a token since the merge)

    def columns(self, rows: Sequence[Row]) -> tuple[int, list[tuple[int, int]], int]:
        width = max((row.retained for row in rows), default=0)
        return width, [(0, row.retained) for row in rows], 0

    def fetchable(self, rows: Sequence[Row]) -> bool:
        return bool(rows) and self.holds

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        """Row ``b``'s query ``i`` sits at column ``after[b] - n + i`` and sees its window."""
        after = [self.axis.after(row.retained, n) for row in rows]
        return _visible(after, [0] * len(rows), n, window or self.axis.max_size,
                        max(after, default=0))  # fmt: skip

    def advance(self, rows: Sequence[Row], n: int) -> None:
        self.holds = True

    def join(self, rows: Sequence[Row], running: int) -> None:
        for row in rows:
            row.pad = 0
        self.holds = any(row.retained for row in rows)

    def filter(self, rows: Sequence[Row]) -> None:
        self.holds = self.holds and bool(rows)

    def check_trim(self, rows: Sequence[Row], counts: Sequence[int]) -> None:
        for b, (count, row) in enumerate(zip(counts, rows, strict=True)):
            if count and not self.axis.cuttable(row.offset):
                raise NotTrimmableError(
                    wrapped_ring_message(f"row {b} at offset {row.offset}", self.axis.max_size)
                )
            if count > row.offset:
                raise NotTrimmableError(trim_past_row_message(count, b, row.offset))

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int]) -> None:
        return None

    def trimmable(self, rows: Sequence[Row]) -> bool:
        return all(self.axis.cuttable(row.offset) for row in rows)

    def check(self, rows: Sequence[Row]) -> None:
        return None
