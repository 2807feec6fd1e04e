"""Sliding window: the ring token geometry's hooks (``spec/RotatingKVCache.md``,
``spec/BatchedRotatingCache.md``, ``spec/RaggedRotatingRows.md``).

The reference keeps no ring: a row holds the tokens it retains in temporal order. Before
it appends ``n`` tokens it keeps ``max_size - 1`` of them (so one token leaves
``max_size``, and a block's first query still sees a whole window while the row briefly
holds ``max_size - 1 + n``): its first ``keep`` (sink tokens, never evicted) and its
newest others (``Row.newest``). A row's window is its sinks and newest, ``min(offset,
max_size)`` tokens: what extraction and merging keep. Masks are computed from the
positions each column holds: a query sees the sinks and its newest ``reach`` positions.

Two placements: **shared** (one ring of ``active`` columns every row writes at once,
mlx-lm's ``BatchRotatingKVCache``: row ``b``'s newest ``min(retained, active)`` non-sink
tokens fill the last columns of the temporal image, which the physical one rolls by
``phase``; with ``keep`` a sink block of each row's sinks comes first; ``left_pad``
follows mlx-lm's bookkeeping and goes negative once pads are overwritten), and
**ragged** (each row left-aligned at column 0, sinks first, appending at its own end).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrows.compositions import Arrangement
from kvrows.errors import (
    SHARED_COLUMN_TRIM,
    NotTrimmableError,
    ring_rollback_message,
    trim_past_row_message,
    wrapped_ring_message,
)
from kvrows.geometries.ring import held_positions, ragged_slack, ragged_step
from kvrows.protocols import Mask
from kvrows.reference.geometries.registry import implements
from kvrows.reference.rows import Placement, Row, TokenRows
from kvrows.schemes import GeometrySpec, Ring

__all__ = ["RaggedRing", "RingAxis", "RingParameters", "SharedRing"]


def reach(window: int | None, max_size: int, keep: int) -> int:
    """How many of its newest positions (itself included) a query sees besides the sinks:
    ``window_size or max_size`` counts the sinks, and a query always sees itself."""
    win = window or max_size
    return win if keep == 0 else max(1, win - keep)


def _sees(
    columns: Sequence[Sequence[int]],
    queries: Sequence[int],
    n: int,
    keep: int,
    recent: int,
    width: int | None = None,
) -> npt.NDArray[np.bool_]:
    """``[B, 1, n, S]``: row ``b``'s query ``i`` (position ``queries[b] + i``) sees column
    ``c`` holding position ``columns[b][c]`` (-1: no token) when that position is at most
    its own and is a sink (``< keep``) or among its newest ``recent``."""
    if width is None:
        width = len(columns[0]) if columns else 0
    held = np.array(columns, dtype=np.int64).reshape(len(columns), width)[:, None, None, :]
    query = (np.array(queries, dtype=np.int64)[:, None] + np.arange(n)[None, :])[:, None, :, None]
    visible: npt.NDArray[np.bool_] = (
        (held >= 0) & (held <= query) & ((held < keep) | (query - held < recent))
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


@implements("ring")
class RingAxis(TokenRows):
    """The newest ``max_size`` positions are kept (``max_size - 1 + n`` right after a
    block), the first ``keep`` of a row's positions (sinks) always among them."""

    def __init__(self, spec: Ring) -> None:
        self.spec: GeometrySpec = spec
        self.max_size = spec.max_size
        self.keep = spec.keep
        self.cap: int | None = spec.max_size
        self.sinks = spec.keep

    def history(self, row: Row, n: int) -> int:
        return row.retained if self.holding else self.max_size - 1

    def after(self, retained: int, n: int) -> int:
        """Tokens a row retaining ``retained`` holds after it appends ``n`` (all of them
        while a proposal round holds the rows)."""
        return retained + n if self.holding else min(retained, self.max_size - 1) + n

    def holds_proposals(self, arrangement: str) -> bool:
        """Ragged rows: a held row drops nothing (its queries still see their window);
        a shared ring's columns are overwritten in place."""
        return arrangement == "ragged"

    def window(self, row: Row) -> int:
        return min(row.offset, self.max_size)

    def cuttable(self, offset: int) -> bool:
        return offset < self.max_size

    def serial_mask(self, row: Row, n: int, window: int | None, return_array: bool) -> Mask:
        """mlx-lm's ring policy: ``None`` / ``"causal"`` while every query sees its whole
        history, else (or with ``return_array``) the array ``[n, S]`` (``[S]`` for one
        query, mlx-lm's shape), columns in temporal order."""
        offset, recent = row.offset, reach(window, self.max_size, self.keep)
        after = self.after(offset, n)  # a serial ring retains at least min(offset, max_size - 1)
        if after <= self.keep + recent and not return_array:
            return None if n == 1 else "causal"
        columns = held_positions(offset + n, after, self.keep)
        visible: npt.NDArray[np.bool_] = _sees([columns], [offset], n, self.keep, recent)[0, 0]
        return visible[0] if n == 1 else visible

    def place(self, arrangement: Arrangement) -> Placement:
        return SharedRing(self) if arrangement == "shared" else RaggedRing(self)


def _ring_held(row: Row) -> int:
    """A row's retained tokens that are not sinks (what a shared ring's columns hold)."""
    return row.retained - row.held_sinks


class SharedRing:
    """One ring every row writes at once, from three integers: ``active`` (ring columns a
    read returns), ``phase`` (the physical column of the oldest once the ring has wrapped)
    and ``total`` (ring columns written since the last merge).

    With ``keep`` the ring holds only the rows' non-sink tokens and has ``max_size - keep``
    columns; a sink block of ``lead`` columns (each row's sinks left-aligned) comes first.
    A block's tokens that are a row's sinks go to the sink block, and the ring takes
    ``n - min(sinks in the block)`` columns: a row with more sinks in the block leaves
    its first new ring columns empty (they count as its padding)."""

    def __init__(self, axis: RingAxis) -> None:
        self.axis = axis
        self.span = axis.max_size - axis.keep  # the ring's columns
        self.active = self.phase = self.total = 0
        self.holds = False  # a ring exists (some row held a token since the merge)

    def _sinks_in(self, row: Row, n: int) -> int:
        """How many of the next ``n`` tokens of ``row`` are sinks."""
        return max(0, min(n, self.axis.keep - row.offset))

    def _ring_step(self, rows: Sequence[Row], n: int) -> int:
        """Ring columns a block of ``n`` tokens writes."""
        return n - min((self._sinks_in(row, n) for row in rows), default=0)

    def _after(self, columns: int, written: int) -> int:
        return min(columns, self.span - 1) + written if written else columns

    def _phase_after(self, n: int, written: int) -> int:
        if not written:
            return self.phase
        if n > 1:
            return 0
        if self.active >= self.span:  # full: the write replaces the oldest column
            start = 0 if self.active > self.span else self.phase
            return (start + 1) % self.span
        return self.phase

    def lead(self, rows: Sequence[Row]) -> int:
        return max((row.held_sinks for row in rows), default=0)

    def columns(self, rows: Sequence[Row]) -> tuple[int, list[tuple[int, int]], int]:
        lead = self.lead(rows)
        spans = []
        for row in rows:
            shown = min(_ring_held(row), self.active)
            spans.append((lead + self.active - shown, shown))
        return lead + self.active, spans, self.phase

    def fetchable(self, rows: Sequence[Row]) -> bool:
        return self.holds

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        """Query ``i`` of row ``b`` sees the columns holding its row's sinks and newest
        positions (``reach``), in the physical order the next read returns."""
        keep = self.axis.keep
        written = self._ring_step(rows, n)
        active = self._after(self.active, written)
        afters = [(row.offset + n, self.axis.after(row.retained, n)) for row in rows]
        lead = max((min(keep, o, r) for o, r in afters), default=0)
        phase = self._phase_after(n, written)
        columns = []
        for offset, retained in afters:
            sinks = min(keep, offset, retained)
            shown = min(retained - sinks, active)
            ring = np.roll([-1] * (active - shown) + list(range(offset - shown, offset)), phase)
            columns.append([*range(sinks), *[-1] * (lead - sinks), *ring.tolist()])
        recent = reach(window, self.axis.max_size, keep)
        return _sees(columns, [row.offset for row in rows], n, keep, recent, lead + active)

    def advance(self, rows: Sequence[Row], n: int) -> None:
        written = self._ring_step(rows, n)
        fewest = n - written
        dropped = max(0, self.active - self.span + 1) if written else 0
        for row in rows:
            row.pad += self._sinks_in(row, n) - fewest - dropped
        self.active, self.phase = self._after(self.active, written), self._phase_after(n, written)
        self.total += written
        self.holds = True

    def join(self, rows: Sequence[Row], running: int) -> None:
        """Every row is re-aligned to the longest ring part; the sinks to the sink block."""
        width = max(_ring_held(row) for row in rows)
        for row in rows:
            row.pad = width - _ring_held(row)
        self.active = self.total = width
        self.phase = 0
        self.holds = any(row.retained for row in rows)

    def filter(self, rows: Sequence[Row]) -> None:
        if not rows:
            self.active = self.phase = self.total = 0
            self.holds = False

    def check_trim(
        self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False
    ) -> None:
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
            raise NotTrimmableError(SHARED_COLUMN_TRIM)
        if min(counts[0], self.active) > self.total:
            raise NotTrimmableError(
                f"cannot trim {counts[0]} tokens from a ring with {self.total} columns written"
            )

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False) -> None:
        """Every row's ring tokens end at the last column: the newest columns go (a row
        with fewer ring tokens than the count also loses sinks)."""
        count = min(max(counts, default=0), self.active)
        if not count:
            return
        self.active -= count
        self.total -= count
        for row in rows:
            row.pad = self.active - min(_ring_held(row), self.active)

    def trimmable(self, rows: Sequence[Row]) -> bool:
        return self.total < self.span

    def saved_image(self, rows: Sequence[Row]) -> tuple[int, list[Row], int] | None:
        """Without sinks, the state is mlx-lm's ``BatchRotatingKVCache`` form (the
        optimized one's, unrotated): the ring's ``active`` columns, each row's newest of
        them, and ``total``. ``None`` with sinks (the canonical form: each row's window)."""
        if self.axis.keep:
            return None
        newest = [row.newest(min(row.retained, self.active)) for row in rows]
        return self.active, newest, self.total

    def saved_pads(self, rows: Sequence[Row], pads: list[int]) -> list[int]:
        """The ``left_padding`` a state saves: ``pads`` (the image's), but a row's live
        pad where it is negative (the row fills the image; mlx-lm saves the pads its ring
        overwrote and restores them raw)."""
        return [row.pad if row.pad < 0 else p for p, row in zip(pads, rows, strict=True)]

    def restore_pads(
        self, rows: Sequence[Row], saved: Sequence[int], columns: int, held: Sequence[int]
    ) -> None:
        """After a load's merge: each row's pad goes on past 0 by what ``saved`` (over
        ``columns`` saved columns) says the ring overwrote, and down by the columns of the
        row the load dropped (a block's history past the window: mlx-lm's trim)."""
        for row, pad, count in zip(rows, saved, held, strict=True):
            row.pad += min(0, pad) - (columns - max(0, pad) - count)

    def check(self, rows: Sequence[Row]) -> None:
        """The mlx-lm style pads agree with the rows' retained tokens."""
        for row in rows:
            shown = min(_ring_held(row), self.active)
            assert max(0, row.pad) == self.active - shown, (row, self.active)


class RaggedRing:
    """Each row its own ring: row ``b``'s tokens at columns ``[lead[b], lead[b] +
    retained[b])`` (its sinks first), the tokens its retention dropped left in place
    before them (``Row.lead``) until the rows are compacted to column 0
    (:func:`~kvrows.geometries.ring.ragged_step`, ``slack`` spare columns). A read starts
    at the smallest lead."""

    def __init__(self, axis: RingAxis) -> None:
        self.axis = axis
        self.slack = ragged_slack(axis.max_size, axis.keep)
        self.holds = False  # a buffer exists (some row held a token since the merge)

    def columns(self, rows: Sequence[Row]) -> tuple[int, list[tuple[int, int]], int]:
        base = min((row.lead for row in rows), default=0)
        width = max((row.lead + row.retained for row in rows), default=0) - base
        return width, [(row.lead - base, row.retained) for row in rows], 0

    def lead(self, rows: Sequence[Row]) -> int:
        return 0

    def fetchable(self, rows: Sequence[Row]) -> bool:
        return bool(rows) and self.holds

    def _step(self, rows: Sequence[Row], n: int) -> tuple[int, ...]:
        """Each row's lead once it takes ``n`` tokens."""
        leads, held = [row.lead for row in rows], [row.retained for row in rows]
        axis = self.axis
        return ragged_step(leads, held, n, axis.max_size, self.slack, holding=axis.holding).leads

    def mask(self, rows: Sequence[Row], n: int, window: int | None, return_array: bool) -> Mask:
        """Row ``b``'s query ``i`` sits at column ``lead[b] + after[b] - n + i`` (leads after
        the block, less the smallest) and sees its sinks and its newest positions."""
        keep = self.axis.keep
        leads = self._step(rows, n)
        base = min(leads, default=0)
        held = [
            [-1] * (lead - base)
            + held_positions(row.offset + n, self.axis.after(row.retained, n), keep)
            for row, lead in zip(rows, leads, strict=True)
        ]
        width = max((len(h) for h in held), default=0)
        columns = [h + [-1] * (width - len(h)) for h in held]
        recent = reach(window, self.axis.max_size, keep)
        return _sees(columns, [row.offset for row in rows], n, keep, recent)

    def advance(self, rows: Sequence[Row], n: int) -> None:
        for row, lead in zip(rows, self._step(rows, n), strict=True):
            row.lead = lead
        self.holds = True

    def join(self, rows: Sequence[Row], running: int) -> None:
        for row in rows:  # a join lays every row from column 0 (a paged one is not cut)
            row.pad = row.lead = 0
        self.holds = any(row.retained for row in rows)

    def filter(self, rows: Sequence[Row]) -> None:
        self.holds = self.holds and bool(rows)

    def check_trim(
        self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False
    ) -> None:
        """A row may forget its newest tokens while what it retains still holds the whole
        window of the position it goes back to (after a block: the block's tokens but its
        first; never a token the ring already evicted)."""
        size = self.axis.max_size
        for b, (count, row) in enumerate(zip(counts, rows, strict=True)):
            if count > row.offset:
                raise NotTrimmableError(trim_past_row_message(count, b, row.offset))
            if count and row.retained - count < min(row.offset - count, size):
                raise NotTrimmableError(
                    ring_rollback_message(b, row.offset, row.retained, count, size)
                )

    def trimmed(self, rows: Sequence[Row], counts: Sequence[int], *, justify: bool = False) -> None:
        return None

    def trimmable(self, rows: Sequence[Row]) -> bool:
        return all(self.axis.cuttable(row.offset) for row in rows)

    def check(self, rows: Sequence[Row]) -> None:
        assert all(row.lead >= 0 for row in rows)
        assert self.slack or not any(row.lead for row in rows), "no slack: rows at column 0"
