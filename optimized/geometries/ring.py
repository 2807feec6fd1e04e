"""The ring geometry (sliding window): the newest ``max_size`` positions are kept.

Two physical designs, one per arrangement family (``spec/RotatingKVCache.md``,
``spec/BatchedRotatingCache.md``, ``spec/RaggedRotatingRows.md`` have the diagrams):

* :class:`SharedRing` (serial rings and shared-column ring layouts, mlx-lm's
  ``RotatingKVCache`` / ``BatchRotatingKVCache``): one buffer per plane
  ``[B, H, Sbuf, ·]`` and one ring index ``idx`` for every row. Single tokens are
  written in place at ``idx``; once the ring is full the index wraps and the oldest
  column is overwritten (``rotated``: physical order is no longer temporal order). A
  multi-token block puts the buffer in temporal order, keeps its newest
  ``max_size - 1`` columns (so the block's first query still sees a full window) and
  appends the block: the buffer can briefly hold more than ``max_size`` columns. Per
  row, ``left_pad`` counts the columns before its oldest token (negative once the ring
  has overwritten them); a join re-aligns every row (the rings' phases must agree). A
  serial ring is the same with every row at pad 0 and ``total == offset``.
* :class:`RaggedRing` (ragged ring layouts): every row keeps its retained tokens
  left-aligned in temporal order and appends at its own end, with the serial ring's
  retention rule per row, so rows advance (and roll back) independently.

Sink tokens (``Ring(max_size, keep)``, ``spec/RotatingKVCache.md`` §1.1): a row's first
``keep`` positions are never evicted. :class:`SharedRing` keeps them in a sink block of
``lead`` columns before the ring (each row's left-aligned; the ring has ``max_size -
keep`` columns and its index wraps to ``keep`` in buffer terms, mlx-lm's serial layout);
:class:`RaggedRing` keeps them at the start of each row and slides only the rest. Every
ring mask, sinks or not, serial or batched, is built one way (:func:`ring_mask`): the
position each column holds after the update, computed on the device from a few integers
per row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from kvrows.codec import PlaneSet, as_role
from kvrows.common import row_bytes
from kvrows.errors import (
    SHARED_COLUMN_TRIM,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    ring_rollback_message,
    ring_state_index_message,
    trim_past_row_message,
    wrapped_ring_message,
)
from kvrows.geometries.ring import ragged_slack, ragged_step, retained_after
from kvrows.optimized.codecs import Codec, Planes
from kvrows.optimized.geometries.registry import implements
from kvrows.optimized.rows import (
    LayoutImage,
    RowWindow,
    Storage,
    Store,
    arrays,
    joined,
    mapped,
    owned,
    paired,
    row_of,
    token_count,
    write_columns,
)
from kvrows.protocols import Mask
from kvrows.schemes import Ring
from kvrows.validation import STEP, KvGeometry, as_count, check_row, round_up

__all__ = ["RaggedRing", "RingGeometry", "SharedRing", "ring_mask"]


def _columns(planes: PlaneSet, start: int, stop: int | None = None) -> PlaneSet:
    # Every ring read slices: a comprehension, no per-plane call.
    return {t: tuple(p[:, :, start:stop] for p in held) for t, held in planes.items()}


_concat = joined


def _stacked(
    fresh: PlaneSet, rows: list[RowWindow], lengths: list[int], *, right_aligned: bool
) -> PlaneSet:
    """``fresh`` (zero planes of ``columns`` tokens) holding ``rows`` (their windows in
    time order), each right-aligned to ``columns`` or left-aligned at column 0."""
    columns = token_count(fresh)
    for row, ((held, _), length) in enumerate(zip(rows, lengths, strict=True)):
        if held is None or length == 0:
            continue
        start = columns - length if right_aligned else 0
        for plane, piece in paired(fresh, held):
            plane[row : row + 1, :, start : start + length] = piece
    return fresh


def _split(rows: list[RowWindow], heads: list[int], *, sinks: bool) -> list[RowWindow]:
    """Each row's first ``heads[b]`` tokens (``sinks``) or the rest."""
    parts: list[RowWindow] = []
    for (held, offset), head in zip(rows, heads, strict=True):
        if held is None:
            parts.append((None, offset))
        elif sinks:
            parts.append((_columns(held, 0, head), offset))
        else:
            parts.append((_columns(held, head), offset))
    return parts


@implements("ring")
class RingGeometry(Storage):
    """What both ring designs share: the window, and what a ring layout answers."""

    geometry_kind = "ring"

    @property
    def max_size(self) -> int:
        assert isinstance(self._token_geometry, Ring)
        return self._token_geometry.max_size

    @property
    def keep(self) -> int:
        assert isinstance(self._token_geometry, Ring)
        return self._token_geometry.keep

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """A prefix is publishable only before the ring wraps (a wrapped ring cannot be cut
        back)."""
        offset = self._offsets[check_row(row, len(self._offsets))]
        count = as_count(tokens, "tokens")
        return count == offset or (count < offset < self.max_size)

    def projected_bytes(self, tokens: int) -> int:
        return row_bytes(self.codec, self._geometry, tokens, self.max_size)

    @property
    def buffer_length(self) -> int:
        if self._stores is not None:  # every store at the same columns
            return max((token_count(s.planes) for s in self._stores if s.planes), default=0)
        return 0 if self._planes is None else token_count(self._planes)

    def window(self) -> tuple[Planes, Planes] | None:
        """A serial ring's newest ``min(offset, max_size)`` tokens in temporal order."""
        return self._window_pair(None)

    def row_window(self, row: int) -> tuple[Planes, Planes] | None:
        """Row ``row``'s newest ``min(offset, max_size)`` tokens in temporal order (views)."""
        return self._window_pair(check_row(row, len(self._offsets)))

    def _check_geometry(self) -> None:
        return None

    def _layout_image(self) -> LayoutImage | None:
        return None

    def _check_padded_update(self, n: int, real: list[int], tail: list[int]) -> None:
        """A row that would receive only pads must not hold a full window: the pads would
        evict a real token."""
        for b, (r, t) in enumerate(zip(real, tail, strict=True)):
            if r or not t:
                continue
            held = self._held_window(b)
            if held is not None and token_count(held) >= self.max_size:
                raise LayoutStateError(
                    f"row {b} holds a full window of {self.max_size} tokens and would "
                    "receive only padding: its window would evict a real token for a pad"
                )

    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """mlx-lm's ring policy: ``None`` / ``"causal"`` while every query sees its whole
        history, else (or with ``return_array``) the one row's mask (``[S]`` for one query,
        mlx-lm's shape) in the ring's physical column order."""
        offset = self._offsets[0] if self._offsets else 0
        recent = reach(window, self.max_size, self.keep)
        if min(offset, self.max_size - 1) + n <= self.keep + recent and not return_array:
            return None if n == 1 else "causal"
        if self._offsets:
            visible = cast(mx.array, self._layout_mask(n, True, window))[0, 0]
        else:  # before the first block: the block's own columns, in time order
            visible = ordered_mask([0], [n], n, self.keep, recent)[0, 0]
        return visible[0] if n == 1 else visible

    def _ordered_layout_mask(self, after: Sequence[int], n: int, window: int | None) -> mx.array:
        """``[B, 1, n, S]``: rows from column 0 in time order, row ``b`` holding ``after[b]``
        positions once it appends ``n`` (its sinks, then its newest)."""
        recent = reach(window, self.max_size, self.keep)
        return ordered_mask(self._offsets, after, n, self.keep, recent)

    def _ragged_mask(
        self, after: Sequence[int], leads: Sequence[int], n: int, window: int | None
    ) -> mx.array:
        """``[B, 1, n, S]`` of ragged rows in time order, row ``b`` holding ``after[b]``
        positions from column ``leads[b]`` (less the smallest) once it appends ``n``
        (``spec/RaggedRotatingRows.md`` §2; leads are 0 with sinks)."""
        if not any(leads):  # every row from column 0 (with sinks, always)
            return RingGeometry._ordered_layout_mask(self, after, n, window)
        base = min(leads)
        firsts = [lead - base for lead in leads]
        ends = [first + a for first, a in zip(firsts, after, strict=True)]
        recent = reach(window, self.max_size, self.keep)
        return ring_mask(
            self._offsets, n, self.keep, recent,
            heads=firsts, firsts=firsts, ends=ends, lead=0, width=max(ends),
        )  # fmt: skip

    def _keeps_at_once(self, order: list[int]) -> bool:
        return self._stores is None  # one store: one gather, rebound once built

    def _keep(self, order: list[int]) -> None:
        """Gather the kept rows (each stage store its own); a ring keeps its padding (its
        columns are its window)."""
        if self._stores is None:
            if self._planes is not None and order != list(range(len(self._pads))):
                index = mx.array(order)
                self._planes = {t: tuple(p[index] for p in ps) for t, ps in self._planes.items()}
        else:
            new_row = {old: new for new, old in enumerate(order)}
            kept: list[Store] = []
            for store in self._stores:
                slots = [store.rows.index(old) for old in order if old in store.rows]
                if not slots:
                    continue  # a stage left without rows holds no planes
                if store.planes is not None:
                    store.planes = self._gather_slots(store.planes, slots)
                store.rows = [new_row[store.rows[slot]] for slot in slots]  # in batch order
                kept.append(store)
            self._put_stores(kept)
        self._pads = [self._pads[i] for i in order]


def ring_mask(
    offsets: Sequence[int],
    n: int,
    keep: int,
    recent: int,
    *,
    heads: npt.ArrayLike,
    firsts: npt.ArrayLike,
    ends: Sequence[int],
    lead: int,
    width: int,
    shift: int = 0,
) -> mx.array:
    """``[B, 1, n, width]``: row ``b``'s query ``i`` (position ``offsets[b] + i``) sees a column
    holding a position at most its own that is a sink or among its newest ``recent``.

    Row ``b``'s columns: its sinks in columns ``[0, heads[b])`` (column ``c`` holds position
    ``c``); nothing in the rest of the first ``lead`` (a shared ring's sink block); after
    them, ring column ``t = c - lead`` (physical column ``c`` is ``t`` rolled by ``shift``:
    a ring written in place) holds the row's newest positions in time order, from column
    ``firsts[b]`` to column ``ends[b] - 1``, which holds ``offsets[b] + n - 1``. A query's
    positions are consecutive ring columns, so what it sees is a range of them: bounds
    worked out on the host, compared with each column on the device."""
    rows = len(offsets)
    if shift:  # physical ring column p holds ring column (p - shift) mod its columns
        active, shift = width - lead, shift % (width - lead)
        parts = [(-lead, 0), (active - shift, active), (0, active - shift)]
        ring = np.concatenate([np.arange(a, b, dtype=np.int32) for a, b in parts])
    else:
        ring = np.arange(-lead, width - lead, dtype=np.int32)
    query = np.arange(n, dtype=np.int32)
    end = np.array(ends, dtype=np.int32)[:, None]
    # A block on rows that end at one column (a shared ring): the queries' window is every
    # row's, compared once, and only each row's first column per row.
    shared_window = n > 1 and rows > 0 and min(ends) == max(ends)
    if shared_window:
        end = end[:1]
        floor: Any = 0
    else:
        floor = np.array(firsts, dtype=np.int32)[:, None]
    newest = end - n + query  # the ring column of each query's own position
    oldest = np.maximum(np.maximum(newest - recent + 1, floor), 0)
    # Every array reaches the device in its final shape ``[B, 1, n, S]``: on the CPU each
    # primitive of the graph costs an eval dispatch, far more than the columns it compares.
    bounds = (len(end), 1, n, 1)
    column = mx.array(ring.reshape(1, 1, 1, width))
    visible = column >= mx.array(oldest.reshape(bounds))
    if n > 1 or min(ends, default=width - lead) < width - lead:
        # (One query whose column is the last of every row has nothing after it to hide.)
        visible = visible & (column <= mx.array(newest.reshape(bounds)))
    if shared_window:
        first = np.array(firsts, dtype=np.int32).reshape(rows, 1, 1, 1)
        visible = visible & (column >= mx.array(first))
    if keep:
        # A sink is seen by every query at or after it.
        position = np.array(offsets, dtype=np.int32)[:, None] + query
        last_sink = np.minimum(np.array(heads, dtype=np.int32)[:, None] - 1, position)
        physical = mx.array(np.arange(width, dtype=np.int32).reshape(1, 1, 1, width))
        visible = visible | (physical <= mx.array(last_sink.reshape(rows, 1, n, 1)))
    return visible


def ordered_mask(
    offsets: Sequence[int], after: Sequence[int], n: int, keep: int, recent: int
) -> mx.array:
    """:func:`ring_mask` of rows from column 0 in time order, row ``b`` holding ``after[b]``
    positions once it appends ``n``: its sinks, then its newest."""
    heads = [min(keep, o + n, a) for o, a in zip(offsets, after, strict=True)]
    width = max(after, default=0)
    return ring_mask(
        offsets, n, keep, recent, heads=heads, firsts=heads, ends=after, lead=0, width=width
    )


def reach(window: int | None, max_size: int, keep: int) -> int:
    """Newest positions (itself included) a query sees besides the sinks: ``window_size or
    max_size`` counts the sinks, and a query always sees itself."""
    win = window or max_size
    return win if keep == 0 else max(1, win - keep)


def _in_time_order(array: Any, lead: int, idx: int, axis: int) -> Any:
    """Columns ``[sinks | ring[idx:] | ring[:idx]]`` of ``array`` along ``axis``."""
    width = int(array.shape[axis])

    def cut(start: int, stop: int) -> mx.array:
        index = [slice(None)] * array.ndim
        index[axis] = slice(start, stop)
        part: mx.array = array[tuple(index)]
        return part

    parts = [cut(lead + idx, width), cut(lead, lead + idx)]
    if lead:
        parts.insert(0, cut(0, lead))
    return mx.concatenate(parts, axis=axis)


class SharedRing(RingGeometry):
    """One ring index for every row: serial rings and shared-column ring layouts.

    Host-side state: per-row ``offsets`` and ``pads``, the ring index ``idx``, the
    columns written since the last merge ``total``, and ``rotated``. With ``keep`` the
    buffer starts with a sink block of ``lead`` columns (row ``b``'s first
    ``min(keep, offset)`` tokens, left-aligned) and the ring after it has
    ``max_size - keep`` columns (mlx-lm's serial layout: its index wraps to ``keep``);
    ``idx``, ``total`` and the pads count ring columns."""

    arrangements = frozenset({"serial", "shared"})

    _idx: int
    _total: int
    _rotated: bool
    _lead: int
    #: A wrapped ring without sinks keeps its window in time order (``_ordered``): the
    #: planes hold the window then spare columns, the window's newest token at column
    #: ``_ordered_end - 1``; a token goes to the next spare column, and when none is left
    #: the newest ``span - 1`` columns move to the front (one copy per ``slack`` tokens).
    #: The mlx-lm physical form is then derived (``_planes``, lazily: a step that only
    #: attends in time order never computes it). ``None``: the physical form is held.
    _ordered: PlaneSet | None = None
    #: Whether a wrapped ring (no sinks) keeps the ordered form: ``None`` (the default)
    #: once a reader has asked for reads in time order (``reads_in_time_order``: kvrows'
    #: attention), so a reader of the physical form (mlx-lm's attention through the
    #: drop-in) keeps mlx-lm's in-place ring and never pays for the physical read's
    #: re-derivation; ``True`` from the wrap on; ``False`` never (the physical form, and
    #: ``reads_in_time_order`` re-orders a copy at every read: the eager oracle).
    ordered_reads: bool | None = None
    #: A reader asked for reads in time order (``ordered_reads`` ``None``).
    _asked_in_time_order: bool = False
    _ordered_end: int = 0
    _physical: PlaneSet | None = None

    @property
    def _planes(self) -> PlaneSet | None:
        """The buffer in mlx-lm's physical form, what every hook but the token write and the
        reads works on: derived from the ordered form (lazily, read-only: reading changes
        nothing); a hook that writes in place leaves the ordered form first (``_settle``),
        one that rebinds the planes leaves it by doing so."""
        if self._ordered is not None:
            return self._unordered(self._ordered)
        return self._physical

    @_planes.setter
    def _planes(self, planes: PlaneSet | None) -> None:
        self._ordered, self._physical = None, planes

    def _settle(self) -> None:
        """Hold the physical form (before a write in place: the next wrapped token write
        re-orders, one copy; a drop-in's ``keys`` / ``values`` written back, a hook over
        stores)."""
        if self._ordered is not None:
            self._planes = self._unordered(self._ordered)

    def _store_list(self) -> list[Store]:
        self._settle()  # (the hooks over stores write them in place)
        return super()._store_list()

    @property
    def time_ordered(self) -> bool:
        """Whether the ordered form is held (a wrapped ring without sinks, ``ordered_reads``)."""
        return self._ordered is not None

    @property
    def slack(self) -> int:
        """Spare columns of the time-ordered form (its memory cost beyond the window): the
        window moves to the front once per ``slack`` tokens, ``span - 1`` columns."""
        return min(STEP, self.span)

    @property
    def buffer_length(self) -> int:
        if self._ordered is not None:
            return self._lead + self.span  # the physical form's columns
        return super().buffer_length

    def _ordered_window(self, ordered: PlaneSet) -> PlaneSet:
        """The window in time order: a slice of the ordered form, no copy."""
        return _columns(ordered, self._ordered_end - self.span, self._ordered_end)

    def _unordered(self, ordered: PlaneSet) -> PlaneSet:
        """The physical form of the ordered window: ring column ``c < idx`` holds the newest
        ``idx`` tokens, the rest the older ones (a copy, lazy)."""
        window, older = self._ordered_window(ordered), self.span - self._idx
        if older == 0:
            return window
        return _concat(_columns(window, older), _columns(window, 0, older))

    def _held_planes(self) -> tuple[Any, ...]:
        """The ordered form while held (its spare columns counted in ``nbytes``)."""
        if self._ordered is not None:
            return arrays(self._ordered)
        return super()._held_planes()

    def _read(self) -> dict[str, Any]:
        """The physical form, derived from the ordered one (lazy: an attention in time order
        reads the ordered window instead, ``reads_in_time_order``)."""
        if self._ordered is None:
            return super()._read()
        visible = self._unordered(self._ordered)
        return {t: self.codec.fetched(planes, as_role(t)) for t, planes in visible.items()}

    def _enter_ordered(self) -> None:
        """Put the full, wrapped ring (no sinks) in time order with ``slack`` spare columns:
        one copy, once per window (until a merge, a filter or another hook re-aligns it)."""
        physical = self._physical
        assert physical is not None and not self.keep and self._idx < self.span
        ring, spare = _columns(physical, self._idx), _columns(physical, 0, self._idx)
        room = self._zeros(len(self._offsets), self.slack, self._geometry)
        self._ordered, self._physical = _concat(_concat(ring, spare), room), None
        self._ordered_end = self.span

    def _write_ordered(self, block: PlaneSet) -> None:
        """One token after the ordered window: its next spare column, or (none left) after
        the newest ``span - 1`` columns moved to the front."""
        ordered = self._ordered
        assert ordered is not None
        end = self._ordered_end
        if end == self.span + self.slack:
            newest = _columns(ordered, end - self.span + 1, end)
            room = self._zeros(len(self._offsets), self.slack + 1, self._geometry)
            ordered = self._ordered = _concat(newest, room)
            end = self.span - 1
        for plane, encoded in paired(ordered, block):
            plane[:, :, end : end + 1] = encoded
        self._ordered_end = end + 1

    def _reset_geometry(self) -> None:
        self._idx = self._total = self._lead = 0
        self._rotated = False

    @property
    def span(self) -> int:
        """The ring's columns (the sinks have their own)."""
        return self.max_size - self.keep

    @property
    def ring_state(self) -> tuple[int, int, bool]:
        """``(idx, total, rotated)``: the ring's write index, columns written, wrapped."""
        return self._idx, self._total, self._rotated

    @property
    def ring_index(self) -> int:
        """The write column in the buffer (mlx-lm's ``_idx``)."""
        return self._lead + self._idx

    @property
    def ring_length(self) -> int:
        return self.buffer_length - self._lead

    @property
    def needs_row_attention(self) -> bool:
        """Always: a forward over a shared ring attends inside ``row_attention``, which puts
        a wrapped ring's reads in time order (``reads_in_time_order``)."""
        return True

    def reads_in_time_order(self, keys: Any, values: Any, mask: Any) -> tuple[Any, Any, Any]:
        """``keys``, ``values`` (arrays or tuples of planes) and ``mask`` as the last read
        returned them, in time order (sinks first) once the ring has wrapped: a row sums its
        window in one order alone and in a batch (``spec/engine.md`` §8). Unchanged when
        not wrapped, and for a read of more columns than the ring holds (a block: already
        in order). The ordered form (no sinks) answers with a slice of its window, no copy
        (the mask, a bool per column, is re-ordered); the physical form re-orders a copy
        (``reordered_reads``: sinks, ``ordered_reads`` off)."""
        self._asked_in_time_order = True  # the next wrapped token keeps the ordered form
        if not self._rotated_read(keys):
            return keys, values, mask
        if self._ordered is None:
            return self.reordered_reads(keys, values, mask)
        if isinstance(mask, mx.array) and mask.ndim >= 1:
            mask = _in_time_order(mask, 0, self._idx, mask.ndim - 1)
        window = self._ordered_window(self._ordered)
        ordered_keys, ordered_values = (
            self.codec.fetched(planes, as_role(t)) for t, planes in window.items()
        )
        return ordered_keys, ordered_values, mask

    def reordered_reads(self, keys: Any, values: Any, mask: Any) -> tuple[Any, Any, Any]:
        """``reads_in_time_order`` by a re-ordered copy of the read (the mask's too): the
        physical form's path, and the ordered form's oracle in conformance."""
        if not self._rotated_read(keys):
            return keys, values, mask
        idx, lead = self._idx, self._lead
        if isinstance(mask, mx.array) and mask.ndim >= 1:
            mask = _in_time_order(mask, lead, idx, mask.ndim - 1)

        def planes(x: Any) -> Any:
            if isinstance(x, tuple):
                return tuple(_in_time_order(p, lead, idx, 2) for p in x)
            return _in_time_order(x, lead, idx, 2)

        return planes(keys), planes(values), mask

    def _rotated_read(self, keys: Any) -> bool:
        """Whether ``keys``, the last read, is the whole wrapped ring out of time order (a
        block reads more columns, in order)."""
        first = keys[0] if isinstance(keys, tuple) else keys
        whole = int(first.shape[2]) == self._lead + self.ring_length
        return self._rotated and whole and self._idx != 0

    def is_trimmable(self) -> bool:
        return self._total < self.span

    def _check_padded_update(self, n: int, real: list[int], tail: list[int]) -> None:
        """One write column: a one-token block that is a pad for some row cannot be
        forgotten for that row alone."""
        if n == 1 and any(tail):
            raise LayoutStateError(
                "a one-token update that is right padding for some row cannot be "
                "forgotten from a shared-column ring: pad to at least two tokens"
            )
        super()._check_padded_update(n, real, tail)

    def _serial_form_fields(self) -> dict[str, Any]:
        """mlx-lm's ``idx``: the write column, sinks counted (0 before the first write)."""
        return {"idx": self.ring_index if self._planes is not None else 0}

    def _layout_image(self) -> LayoutImage | None:
        """Without sinks the buffers are mlx-lm's batch ring: its physical form, the live
        pads and the ring's ``total``, ``idx``, ``rotated``."""
        if self.keep:
            return None
        visible = None if self._planes is None else self._visible(self._planes)
        fields = {"total": self._total, "idx": self._idx, "rotated": self._rotated}
        return fields, list(self._pads), visible

    def _resume_serial(self, fields: dict[str, Any], held: int) -> None:
        """The saved write index: ``idx`` counts the sink columns (mlx-lm's); the ring's
        own index does not, and the ring has wrapped when it stops short of ``held``."""
        idx = fields["idx"]
        if not 0 <= idx <= held:
            raise InvalidInputError(ring_state_index_message(idx, held))
        if idx < self._lead:
            raise InvalidInputError(f"ring state: idx {idx} inside the {self._lead} sink columns")
        self._idx, self._rotated = idx - self._lead, idx < held

    def saved_pads(self, pads: list[int]) -> list[int]:
        """The ``left_padding`` a canonical (right-aligned) state saves: ``pads`` where a
        row's live pad is negative is that pad (the row fills the image; mlx-lm saves the
        pads its ring overwrote and restores them raw)."""
        return [o if o < 0 else p for p, o in zip(pads, self._pads, strict=True)]

    def restore_pads(self, saved: Sequence[int], columns: int, held: Sequence[int]) -> None:
        """After a load's merge: each row's pad goes on past 0 by what ``saved`` (over
        ``columns`` saved columns) says the ring overwrote, and down by the columns of the
        row the load dropped (a block's history past the window: mlx-lm's trim)."""
        self._pads = [
            p + min(0, s) - (columns - max(0, s) - h)
            for p, s, h in zip(self._pads, saved, held, strict=True)
        ]

    def _sinks_of(self, offset: int) -> int:
        return min(self.keep, offset)

    def _ring(self, planes: PlaneSet, start: int = 0, stop: int | None = None) -> PlaneSet:
        """Columns ``[start, stop)`` of the ring (after the sink block)."""
        end = None if stop is None else self._lead + stop
        return _columns(planes, self._lead + start, end)

    def _ring_chronological(self, planes: PlaneSet) -> PlaneSet:
        """The ring's used columns in temporal order."""
        if self._rotated:
            return _concat(self._ring(planes, self._idx), self._ring(planes, 0, self._idx))
        return self._ring(planes, 0, self._idx)

    def _chronological(self, planes: PlaneSet) -> PlaneSet:
        """The buffer's used columns in temporal order (the sinks, then the ring)."""
        return self._with_sinks(self._sinks(planes), self._ring_chronological(planes))

    def _with_sinks(self, sinks: PlaneSet, ring: PlaneSet) -> PlaneSet:
        return _concat(sinks, ring) if token_count(sinks) else ring

    def _shown(self) -> int:
        """Ring columns a read returns."""
        return min(self._total, self.ring_length)

    def _visible(self, planes: PlaneSet) -> PlaneSet:
        return _columns(planes, 0, self._lead + self._shown())

    def _window(self, planes: PlaneSet, row: int | None) -> PlaneSet | None:
        index = 0 if row is None else row
        # Cut the row out first: reordering the whole ring would copy every row.
        if self._ordered is not None:  # already in time order: a slice
            ordered = self._ordered if row is None else row_of(self._ordered, row)
            mine, held = ordered, self._ordered_window(ordered)
        else:
            mine = planes if row is None else row_of(planes, row)
            held = self._ring_chronological(mine)
        active = token_count(held)
        offset = self._offsets[index]
        sinks = self._sinks_of(offset)
        start = max(0, self._pads[index], active - (min(offset, self.max_size) - sinks))
        if sinks == 0:
            return None if start >= active else _columns(held, start, active)
        return self._with_sinks(_columns(mine, 0, sinks), _columns(held, start, active))

    def _append(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        keep = self.keep
        if not keep or min(self._offsets, default=keep) >= keep:  # no row takes a sink
            if n == 1:
                self._write_token(block, geometry)
            else:
                self._write_block(block)
            self._total += n
            return
        sinks = [max(0, min(n, keep - o)) for o in self._offsets]
        fewest = min(sinks)
        if any(sinks):
            self._write_sinks(block, n, sinks, geometry)
        if fewest == n:
            return  # every row's tokens were sinks: the ring does not move
        if fewest:
            block = self._ring_part(block, sinks, fewest)
        if n == 1:
            self._write_token(block, geometry)
        else:
            self._write_block(block)
        if any(s > fewest for s in sinks):
            self._pads = [p + s - fewest for p, s in zip(self._pads, sinks, strict=True)]
        self._total += n - fewest

    def _ring_part(self, planes: PlaneSet, sinks: list[int], fewest: int) -> PlaneSet:
        """The block's columns from ``fewest`` on; a row's own sinks among them zeroed (a
        row with more sinks in the block leaves its first new ring columns empty)."""
        cut = _columns(planes, fewest)
        if all(s == fewest for s in sinks):
            return cut
        empty = mx.arange(token_count(cut))[None, :] < (mx.array(sinks) - fewest)[:, None]
        empty = empty[:, None, :, None]
        return mapped(cut, lambda p: mx.where(empty, mx.zeros_like(p), p))

    def _write_sinks(self, block: PlaneSet, n: int, sinks: list[int], geometry: KvGeometry) -> None:
        """Row ``b``'s first ``sinks[b]`` new tokens go to its sink columns."""
        self._settle()
        lead = max(min(self.keep, o + n) for o in self._offsets)
        if lead > self._lead:
            self._widen_sinks(lead, geometry)
        assert self._planes is not None
        if len(set(self._offsets)) == 1:  # one write for every row (a serial ring)
            start, count = self._offsets[0], sinks[0]
            for plane, encoded in paired(self._planes, block):
                plane[:, :, start : start + count] = encoded[:, :, :count]
            return
        for b, (start, count) in enumerate(zip(self._offsets, sinks, strict=True)):
            if count:
                for plane, encoded in paired(self._planes, block):
                    plane[b : b + 1, :, start : start + count] = encoded[b : b + 1, :, :count]

    def _widen_sinks(self, lead: int, geometry: KvGeometry) -> None:
        """Grow the sink block to ``lead`` columns (only while every row is shorter than
        ``keep``: rare and small)."""
        zeros = self._zeros(len(self._offsets), lead - self._lead, geometry)
        if self._planes is None:
            self._planes = zeros
        else:
            cut = self._lead
            self._planes = _concat(
                _concat(_columns(self._planes, 0, cut), zeros), _columns(self._planes, cut)
            )
        self._lead = lead

    def _narrow_sinks(self) -> None:
        """Drop sink columns no row holds any more (after a filter or a trim)."""
        lead = max((self._sinks_of(o) for o in self._offsets), default=0)
        if lead < self._lead and self._planes is not None:
            self._planes = _concat(
                _columns(self._planes, 0, lead), _columns(self._planes, self._lead)
            )
        self._lead = min(lead, self._lead)

    def _write_token(self, block: PlaneSet, geometry: KvGeometry) -> None:
        if self._ordered is not None:  # a wrapped ring in time order: the next column
            self._idx = self._idx % self.span
            self._pads = [p - 1 for p in self._pads]
            self._write_ordered(block)
            self._idx += 1
            return
        prev, span = self._total, self.span
        held = self._planes
        length = 0 if held is None else self.ring_length
        if held is None or (prev >= length and length < span):
            grow = min(STEP, span - prev)
            zeros = self._zeros(len(self._offsets), grow, geometry)
            if held is None:
                self._planes = zeros
            else:
                self._planes = _concat(_columns(held, 0, self._lead + prev), zeros)
            self._idx = prev
            length = self.ring_length
        assert self._planes is not None
        overshoot = length - span
        if overshoot > 0:
            self._planes = self._with_sinks(
                self._sinks(self._planes), self._ring(self._planes, overshoot)
            )
            self._idx = span
            self._pads = [p - overshoot for p in self._pads]
        if self._idx == span:
            self._rotated = True
            self._idx = 0
        if self._rotated:
            self._pads = [p - 1 for p in self._pads]
            keeps_order = self.ordered_reads
            if keeps_order is None:
                keeps_order = self._asked_in_time_order
            if not self.keep and keeps_order:
                self._enter_ordered()  # from now on a token write keeps the time order
                self._write_ordered(block)
                self._idx += 1
                return
        column = self._lead + self._idx
        for plane, encoded in paired(self._planes, block):
            plane[:, :, column : column + 1] = encoded
        self._idx += 1

    def _sinks(self, planes: PlaneSet) -> PlaneSet:
        return _columns(planes, 0, self._lead)

    def _write_block(self, block: PlaneSet) -> None:
        if self._planes is None:
            # The block starts the buffer: an owned copy, never the caller's array (a
            # later in-place token write would change it).
            self._planes = mapped(block, owned)
        else:
            ordered = self._ordered
            ring = (
                self._ring_chronological(self._planes)
                if ordered is None
                else self._ordered_window(ordered)
            )
            drop = max(0, token_count(ring) - self.span + 1)
            sinks = self._sinks(self._planes)
            self._planes = self._with_sinks(sinks, _concat(_columns(ring, drop), block))
            self._pads = [p - drop for p in self._pads]
        self._rotated = False
        self._idx = self.ring_length

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        """Every row (running and new) is re-aligned: each contributes its window in
        temporal order, its sinks left-aligned in the sink block and the rest right-aligned
        to the longest; the ring restarts unrotated at that width."""
        everything = self._each_row() + incoming
        lengths = [0 if held is None else token_count(held) for held, _ in everything]
        heads = [
            min(self.keep, offset, length)
            for (_, offset), length in zip(everything, lengths, strict=True)
        ]
        lead = max(heads)
        tails = [length - head for length, head in zip(lengths, heads, strict=True)]
        width = max(tails)
        rows = len(everything)
        if lead + width == 0 or geometry is None:
            self._planes = None
        else:
            ring = _split(everything, heads, sinks=False)
            self._planes = _stacked(
                self._zeros(rows, width, geometry), ring, tails, right_aligned=True
            )
            if lead:
                sinks = _split(everything, heads, sinks=True)
                sink_block = _stacked(
                    self._zeros(rows, lead, geometry), sinks, heads, right_aligned=False
                )
                self._planes = _concat(sink_block, self._planes)
        self._lead = lead
        self._pads = [width - n for n in tails]
        self._idx = self._total = width
        self._rotated = False

    def _keeps_at_once(self, order: list[int]) -> bool:
        return not self.keep and super()._keeps_at_once(order)  # (sinks: a narrowing after)

    def _keep(self, order: list[int]) -> None:
        super()._keep(order)
        if self.keep:  # the offsets are already the survivors'
            self._narrow_sinks()

    def _forget_tail_pads(self, tail: list[int]) -> None:
        self._roll_right(0, self.buffer_length, tail)
        self._pads = [p + t for p, t in zip(self._pads, tail, strict=True)]

    def _forget_front_pads(self, front: list[int]) -> None:
        self._pads = [p + f for p, f in zip(self._pads, front, strict=True)]

    def _block_starts(self, n: int) -> list[int]:
        return [min(self.max_size - 1, self._total)] * len(self._offsets)

    def _check_trim(self, counts: Sequence[int]) -> None:
        if not self.is_trimmable():
            # A serial ring counts every position it was written; a layout its ring columns.
            serial = self.composition.arrangement == "serial"
            written = self._total + (self._lead if serial else 0)
            raise NotTrimmableError(
                wrapped_ring_message(f"a ring with {written} columns written", self.max_size)
            )

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        if justify and len(set(counts)) > 1:  # a ring cannot roll rows right (nothing changed)
            raise NotTrimmableError(SHARED_COLUMN_TRIM)
        count = counts[0]
        if not self.keep:
            self._total -= count
            self._idx -= count
            return
        # Every row's ring tokens end at the last ring column: the newest columns go, and
        # a row with fewer ring tokens than the count loses sinks too.
        ring = min(count, self._shown())
        self._total -= ring
        self._idx -= ring
        after = [o - count for o in self._offsets]
        self._pads = [self._shown() - min(o - self._sinks_of(o), self._shown()) for o in after]
        if self._planes is not None and any(self._sinks_of(o) < self._lead for o in after):
            keep_column = (
                mx.arange(self._lead)[None, :]
                < mx.array([self._sinks_of(o) for o in after])[:, None]
            )
            keep_column = keep_column[:, None, :, None]
            self._planes = self._zero_sinks(self._planes, keep_column)
            lead = max((self._sinks_of(o) for o in after), default=0)
            if lead < self._lead:
                self._planes = _concat(
                    _columns(self._planes, 0, lead), _columns(self._planes, self._lead)
                )
                self._lead = lead

    def _zero_sinks(self, planes: PlaneSet, kept: mx.array) -> PlaneSet:
        sinks = mapped(self._sinks(planes), lambda p: mx.where(kept, p, mx.zeros_like(p)))
        return _concat(sinks, self._ring(planes))

    def _adopt(self, planes: PlaneSet, offset: int) -> None:
        length = token_count(planes)
        self._lead = min(self.keep, offset, length)
        self._idx, self._total, self._rotated = length - self._lead, offset - self._lead, False

    def _check_geometry(self) -> None:
        assert 0 <= self._idx <= max(self.ring_length, self._total)
        assert self._lead == max((self._sinks_of(o) for o in self._offsets), default=0)
        # (Checked without leaving the ordered form: a check must not change the storage.)
        held = self._physical if self._ordered is None else self._ordered
        if held is not None:
            assert int(arrays(held)[0].shape[0]) == len(self._offsets)
        if self._ordered is not None:
            assert self._rotated and not self.keep and 0 < self._idx <= self.span
            assert self.span <= self._ordered_end <= self.span + self.slack
            assert token_count(self._ordered) == self.span + self.slack

    # -- masks ------------------------------------------------------------------------
    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """The mask for the next ``n`` tokens in the ring's physical column order: the sink
        block, then the ring (rolled once a token is written in place on a full ring); row
        ``b`` holds its sinks and its newest ring positions."""
        keep, span, offsets = self.keep, self.span, self._offsets
        if n == 1 and not keep and max(self._pads, default=1) <= 0:
            # A decode step once no row has padding left: every row holds every ring column,
            # and the query sees them all when its window covers them (the steady state of
            # a full ring: no host arrays to build).
            active = min(self._shown(), span - 1) + 1
            if reach(window, self.max_size, keep) >= active:
                return mx.ones((len(offsets), 1, 1, active), dtype=mx.bool_)
        # Each row's sinks among the block, and what it holds of the sink block after it
        # (host arrays: a decode step's mask costs no Python loop over the rows).
        at = np.array(offsets, dtype=np.int32)
        sinks = np.clip(keep - at, 0, n) if keep else np.zeros_like(at)
        heads = np.minimum(at + n, keep) if keep else sinks
        written = n - (int(sinks.min()) if len(sinks) else 0)
        shown = self._shown()
        active = min(shown, span - 1) + written if written else shown
        if written and n == 1:
            rotated = self._rotated or self._idx >= span
            index = (0 if self._idx >= span else self._idx) + 1
        else:
            rotated, index = self._rotated and not written, self._idx
        have = shown - np.maximum(np.array(self._pads, dtype=np.int32), 0)  # ring tokens now
        firsts = active - (np.minimum(have, span - 1) + n - sinks if written else have)
        lead = int(heads.max()) if len(heads) else 0
        return ring_mask(
            offsets,
            n,
            keep,
            reach(window, self.max_size, keep),
            heads=heads,
            firsts=firsts,
            ends=[active] * len(offsets),
            lead=lead,
            width=lead + active,
            shift=index if rotated else 0,
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, keep={self.keep}, "
            f"row_offsets={tuple(self._offsets)}, left_pad={tuple(self._pads)}, "
            f"idx={self._idx}, total={self._total}, rotated={self._rotated}, lead={self._lead})"
        )


class RaggedRing(RingGeometry):
    """Ragged ring rows: each row's retained tokens in temporal order from its lead.

    A single token keeps the newest ``max_size``, a block keeps the newest
    ``max_size - 1`` and appends. The tokens a row drops stay where they are (its lead
    moves past them) until a block would end past ``max_size + slack`` columns; then every
    row moves to column 0 in one gather (``kvrows.geometries.ring.ragged_step``, the rule
    the reference follows too). This is the explicit stand-in for the delayed rotating
    layout the seed uses as this role.

    Rows may be in several stages (contract §0.4), one store each holding exactly its
    rows' slots, every store at the same columns: each hook runs per store.
    """

    arrangements = frozenset({"ragged"})
    #: A layout's rows may be in several stages, one store each (the delayed ring's).
    _stage_stores = True

    _retained: list[int]
    #: Row ``b``'s tokens sit at columns ``[_lead[b], _lead[b] + _retained[b])``.
    _lead: list[int]

    def _reset_geometry(self) -> None:
        self._retained = []
        self._lead = []

    @property
    def _slack(self) -> int:
        return ragged_slack(self.max_size, self.keep)

    def _extent(self) -> int:
        """Columns up to the end of the row that ends last."""
        return max(lead + r for lead, r in zip(self._lead, self._retained, strict=True))

    def _read_start(self) -> int:
        return min(self._lead, default=0)

    @property
    def left_pad(self) -> tuple[int, ...]:
        return (0,) * len(self._offsets)

    @property
    def retained(self) -> tuple[int, ...]:
        """Tokens each row holds (its newest ones)."""
        return tuple(self._retained)

    def is_trimmable(self) -> bool:
        return all(o < self.max_size for o in self._offsets)

    def _visible(self, planes: PlaneSet) -> PlaneSet:
        return _columns(planes, self._read_start(), self._extent())

    def _window(self, planes: PlaneSet, row: int | None) -> PlaneSet | None:
        assert row is not None
        return self._window_slot(planes, row, row)

    def _window_slot(self, planes: PlaneSet, row: int, slot: int) -> PlaneSet | None:
        held, offset, lead = self._retained[row], self._offsets[row], self._lead[row]
        if held == 0:
            return None
        count = min(held, offset, self.max_size)
        sinks = min(self.keep, offset, count)
        if sinks == 0 or count == held:  # (every join reads each row: no per-plane call)
            end, first, last = slot + 1, lead + held - count, lead + held
            return {t: tuple(p[slot:end, :, first:last] for p in ps) for t, ps in planes.items()}
        # (With sinks every drop compacts: the row starts at column 0.)
        return mapped(
            planes,
            lambda p: mx.concatenate(
                [p[slot : slot + 1, :, :sinks], p[slot : slot + 1, :, held - count + sinks : held]],
                axis=2,
            ),
        )

    def _visible_rows(self, store: Store) -> PlaneSet:
        assert store.planes is not None
        return _columns(store.planes, self._read_start(), self._extent())

    def _held_columns(self, rows: list[int], columns: int) -> mx.array:
        """Row ``b``'s retained tokens sit at ``[lead, lead + retained)``."""
        first = mx.array([self._lead[b] for b in rows])[:, None]
        end = first + mx.array([self._retained[b] for b in rows])[:, None]
        column = mx.arange(columns)[None, :]
        return ((column >= first) & (column < end))[:, None, :, None]

    def _gather_slots(self, planes: PlaneSet, slots: list[int]) -> PlaneSet:
        """Exactly ``slots`` (the hooks write every slot of a store: no spare ones)."""
        if slots == list(range(int(arrays(planes)[0].shape[0]))):
            return planes
        index = mx.array(slots)
        return mapped(planes, lambda p: mx.take(p, index, axis=0))

    #: A proposal round is open: rows drop nothing (``_spec_hold``).
    _holding: bool = False

    @property
    def holds_proposals(self) -> bool:
        """Yes: while a proposal round holds the rows, they drop nothing (the mask still
        shows each query its window), so the discard forgets the round's tokens and every
        row keeps the window it had: no copy of the layout."""
        return True

    def _spec_hold(self, on: bool) -> None:
        self._holding = on

    def _after(self, n: int) -> list[int]:
        return retained_after(self._retained, n, self.max_size, holding=self._holding)

    def _step(self, n: int) -> Any:
        """What an ``n``-token block does to the rows' columns (the shared rule)."""
        holding = self._holding
        return ragged_step(
            self._lead, self._retained, n, self.max_size, self._slack, holding=holding
        )

    def _drop(self, n: int) -> list[int]:
        """Drop what the rows' retention drops before an ``n``-token block (the shared
        rule): in place, each row's lead moving past its dropped tokens, or with every row
        moved to column 0 (one gather per store) once the block would end past the slack.
        A layout whose masked columns read zeros (delayed) clears what it leaves behind.
        Returns the column each row's block starts at."""
        step = self._step(n)
        width = self._extent() if self._retained else 0
        before = self._lead
        self._retained = [r - d for r, d in zip(self._retained, step.drops, strict=True)]
        self._lead = list(step.leads)
        if step.compact:
            stores = self._store_list()
            for store in stores:
                moved = [step.moved[b] for b in store.rows]
                if store.planes is not None and any(moved):
                    offsets = [self._offsets[b] for b in store.rows]
                    store.planes = self._slide(store.planes, moved, offsets, width)
            self._put_stores(stores)
            if self._masked_read_zeros:  # past each row's end: the slide's leftovers
                self._clear_rows(self._retained, [max(0, width - r) for r in self._retained])
        elif self._masked_read_zeros and any(step.drops):
            self._clear_rows(before, list(step.drops))
        return [lead + r for lead, r in zip(self._lead, self._retained, strict=True)]

    def _append(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        ends = self._drop(n)
        needed = max(ends) + n
        if self._planes is None or needed > self.buffer_length:
            store = Store(0, self._planes, list(range(len(self._offsets))), self.codec)
            self._grow([store], round_up(needed), geometry, max(ends))
            self._planes = store.planes
        assert self._planes is not None
        write_columns(self._planes, block, ends, n)
        self._retained = [r + n for r in self._retained]

    def _append_stores(self, shares: list[PlaneSet], n: int, geometry: KvGeometry) -> None:
        """``_append`` per store: the rows drop (``_drop``: one gather per store when they
        compact), every store grows to one capacity when the block does not fit, then each
        row writes its share at its own end."""
        assert self._stores is not None
        ends = self._drop(n)
        needed = max(ends) + n
        if any(s.planes is None for s in self._stores) or needed > self.buffer_length:
            self._grow(self._stores, round_up(needed), geometry, max(ends))
        for store, share in zip(self._stores, shares, strict=True):
            assert store.planes is not None
            write_columns(store.planes, share, [ends[b] for b in store.rows], n)
        self._retained = [r + n for r in self._retained]

    def _slide(
        self, planes: PlaneSet, drops: list[int], offsets: list[int], width: int
    ) -> PlaneSet:
        """Slide slot ``i``'s row left by ``drops[i]`` in one gather (a row's sinks, the
        first ``min(keep, offsets[i])`` columns, stay where they are: with sinks every
        drop compacts, so a row's lead is only its drops)."""
        column = mx.arange(width)[None, :]
        moved = column + mx.array(drops)[:, None]
        if self.keep:
            sinks = mx.array([min(self.keep, o) for o in offsets])[:, None]
            moved = mx.where(column < sinks, column, moved)
        index = mx.minimum(moved, width - 1)
        return self._slid(planes, index[:, None, :, None], width)

    @staticmethod
    def _slid(planes: PlaneSet, index: mx.array, width: int) -> PlaneSet:
        for plane in arrays(planes):
            plane[:, :, :width] = mx.take_along_axis(plane[:, :, :width], index, axis=2)
        return planes

    def _grow(self, stores: list[Store], capacity: int, geometry: KvGeometry, width: int) -> None:
        """Every store into fresh planes of ``capacity`` columns (one capacity), their first
        ``width`` columns kept."""
        for store in stores:
            fresh = self._zeros(len(store.rows), capacity, geometry, store.codec)
            if store.planes is not None and width:
                for new, plane in paired(fresh, store.planes):
                    new[:, :, :width] = plane[:, :, :width]
            store.planes = fresh

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        if self._stores is not None:
            self._place_stages(incoming, [self._stage_of(self.codec)] * len(incoming), geometry)
            return
        # Every row in one stage (every merge of a one-stage ring): the one store's planes,
        # without the stages' bookkeeping.
        everything = self._each_row() + incoming
        lengths = [0 if held is None else token_count(held) for held, _ in everything]
        self._planes = self._left_aligned(everything, lengths, geometry, self.codec)
        self._retained = lengths
        self._lead = [0] * len(everything)
        self._pads = [0] * len(everything)

    def _place_stages(
        self, incoming: list[RowWindow], stages: list[int], geometry: KvGeometry | None
    ) -> None:
        """Each row (running and new) keeps its newest window, left-aligned, in its stage's
        store (every store one capacity)."""
        everything = self._each_row() + incoming
        lengths = [0 if held is None else token_count(held) for held, _ in everything]
        width = max(lengths)
        row_stages = [*self.row_stages, *stages]
        stores = []
        for stage in sorted(set(row_stages)):
            store = self._new_store(stage)
            store.rows = [b for b, s in enumerate(row_stages) if s == stage]
            rows = [everything[b] for b in store.rows]
            held = [lengths[b] for b in store.rows]
            store.planes = self._left_aligned(rows, held, geometry, store.codec, width)
            stores.append(store)
        self._planes = None
        self._put_stores(stores)
        self._retained = lengths
        self._lead = [0] * len(everything)
        self._pads = [0] * len(everything)

    def _left_aligned(
        self,
        rows: list[RowWindow],
        lengths: list[int],
        geometry: KvGeometry | None,
        codec: Codec,
        width: int | None = None,
    ) -> PlaneSet | None:
        """Fresh planes of ``codec`` holding ``rows`` (of ``lengths`` tokens) left-aligned,
        with room for ``width`` tokens (default: the longest row's); ``None`` when there is
        nothing to hold."""
        width = max(lengths) if width is None else width
        if geometry is None or not width:
            return None
        fresh = self._zeros(len(rows), round_up(width + 1), geometry, codec)
        return _stacked(fresh, rows, lengths, right_aligned=False)

    def _keep(self, order: list[int]) -> None:
        super()._keep(order)
        self._retained = [self._retained[i] for i in order]
        self._lead = [self._lead[i] for i in order]

    def _forget_tail_pads(self, tail: list[int]) -> None:
        self._forget(tail)

    def _forget_front_pads(self, front: list[int]) -> None:
        """Slide each row to column 0 over its lead and its leading pads (each store its
        rows)."""
        width = self._extent()
        stores = self._store_list()
        for store in stores:
            assert store.planes is not None
            moved = mx.array([self._lead[b] + front[b] for b in store.rows])[:, None]
            index = mx.minimum(mx.arange(width)[None, :] + moved, width - 1)
            store.planes = self._slid(store.planes, index[:, None, :, None], width)
        self._put_stores(stores)
        self._lead = [0] * len(self._lead)
        self._forget(front)

    def _block_starts(self, n: int) -> list[int]:
        leads = self._step(n).leads
        base = min(leads, default=0)
        return [lead - base + a - n for lead, a in zip(leads, self._after(n), strict=True)]

    def _check_trim(self, counts: Sequence[int]) -> None:
        """A row may forget tokens while it keeps its whole window before them: always
        before it wraps, and after a block for the block's tokens but its first (a block
        keeps ``max_size - 1`` history tokens: what a speculative rollback needs)."""
        rows = zip(counts, self._offsets, self._retained, strict=True)
        for b, (count, offset, held) in enumerate(rows):
            if count > offset:
                raise NotTrimmableError(trim_past_row_message(count, b, offset))
            if count and held - count < min(offset - count, self.max_size):
                raise NotTrimmableError(
                    ring_rollback_message(b, offset, held, count, self.max_size)
                )

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        # The forgotten columns stay in the read (before a longer row's end): they read
        # zeros, as a load lays them (contract §0.5).
        if self._masked_read_zeros:
            ends = [lead + r for lead, r in zip(self._lead, self._retained, strict=True)]
            self._clear_rows([e - c for e, c in zip(ends, counts, strict=True)], counts)
        self._retained = [r - c for r, c in zip(self._retained, counts, strict=True)]

    def _check_geometry(self) -> None:
        assert len(self._retained) == len(self._offsets) == len(self._lead)
        assert all(0 <= r <= o for r, o in zip(self._retained, self._offsets, strict=True))
        assert all(lead >= 0 for lead in self._lead)
        assert self._slack or not any(self._lead), "no slack: every row at column 0"
        assert not self._retained or self._extent() <= self.buffer_length
        for store in self._stores or []:  # every slot written: no spare ones
            assert store.planes is None or len(store.rows) == int(arrays(store.planes)[0].shape[0])

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """Each row in time order from its lead after the block (less the smallest)."""
        leads = self._step(n).leads if self._offsets else ()
        return self._ragged_mask(self._after(n), leads, n, window)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_size={self.max_size}, keep={self.keep}, "
            f"row_offsets={tuple(self._offsets)}, retained={self.retained}, "
            f"lead={tuple(self._lead)})"
        )
