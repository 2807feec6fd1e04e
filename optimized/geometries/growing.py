"""The growing geometry (full attention): the token axis grows with every append.

Physical design (``spec/PaddedKVRows.md`` has the diagrams):

* one preallocated buffer per plane, ``[slots, H, capacity, ·]``; rows live in
  slots ``0 .. B-1``; a layout keeps a few spare slots so a join writes only the new
  row (a serial storage keeps none: its slots are its block's rows);
* a column *origin*: logical column 0 is physical column ``origin``. Dropping the
  padding every survivor shares (filter) moves the origin instead of the bytes, and a
  join that needs more left padding takes it from the columns left of the origin when
  there are enough;
* appends are slice writes (every row at the same column) or one scatter (ragged
  rows), in place when MLX can donate the buffer; capacity grows in steps of 256
  columns with one copy of the used columns.

A serial storage is the one-arrangement case of the same hooks: no padding, origin 0.
The ragged layouts also take :class:`RowAlignment` (``align_rows``: re-lay rows at given
pads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from kvrows.codec import PlaneSet
from kvrows.errors import KvRowsError, align_rows_message
from kvrows.optimized.geometries.registry import implements
from kvrows.optimized.rows import (
    LayoutImage,
    RowWindow,
    Serial,
    Storage,
    Store,
    arrays,
    paired,
    spare_slots,
    token_count,
    write_columns,
)
from kvrows.protocols import Mask
from kvrows.validation import KvGeometry, check_left_pad, round_up

if TYPE_CHECKING:
    from kvrows.optimized.speculative import SpeculativeLayout

__all__ = ["GrowingGeometry", "RowAlignment"]


@implements("growing")
class GrowingGeometry(Storage):
    """Hooks of the growing geometry, for the serial, shared and ragged arrangements."""

    @property
    def holds_proposals(self) -> bool:
        """Always: rows drop nothing, a proposal round's columns are forgotten as any."""
        return True

    geometry_kind = "growing"
    arrangements = frozenset({"serial", "shared", "ragged"})
    #: A layout's rows may be in several stages, one store each, all at the same columns
    #: (``_origin`` and the capacity are the storage's): contract §0.4.
    _stage_stores = True

    _origin: int
    _ends_of: tuple[list[int], list[int], tuple[int, list[int], bool]] | None = None

    def _reset_geometry(self) -> None:
        self._origin = 0

    # -- what it holds ----------------------------------------------------------------
    @property
    def width(self) -> int:
        """Columns from the origin to the furthest row end."""
        return self._ends()[0]

    def _ends(self) -> tuple[int, list[int], bool]:
        """``(width, each row's end column from the origin, whether they are all one)``,
        kept while the pads and positions stay the same lists (every change rebinds one;
        a decode step reads them several times per layer)."""
        pads, held = self._pads, self._tokens_held
        known = self._ends_of
        if known is not None and known[0] is pads and known[1] is held:
            return known[2]
        ends = [p + n for p, n in zip(pads, held, strict=True)]
        value = max(ends, default=0), ends, len(set(ends)) <= 1
        self._ends_of = (pads, held, value)
        return value

    def _advanced(self, n: int) -> None:
        # Every row's end moves ``n`` on with its position (the tokens a row holds are its
        # positions here; a geometry holding fewer keeps another list and rebuilds).
        known = self._ends_of
        carried = known is not None and known[0] is self._pads and known[1] is self._offsets
        super()._advanced(n)
        if carried:
            assert known is not None
            width, ends, aligned = known[2]
            moved = [width + n] * len(ends) if aligned else [e + n for e in ends]
            self._ends_of = (self._pads, self._offsets, (width + n, moved, aligned))

    @property
    def slots(self) -> int:
        return 0 if self._planes is None else int(arrays(self._planes)[0].shape[0])

    @property
    def capacity(self) -> int:
        """The columns every store holds."""
        if self._stores is not None:
            return max((token_count(s.planes) for s in self._stores if s.planes), default=0)
        return 0 if self._planes is None else token_count(self._planes)

    def is_trimmable(self) -> bool:
        return True

    def _read_start(self) -> int:
        return self._origin

    # -- hooks ------------------------------------------------------------------------
    def _visible(self, planes: PlaneSet) -> PlaneSet:
        start = self._origin
        index = (slice(len(self._offsets)), slice(None), slice(start, start + self._ends()[0]))
        # Every decode step reads this: a loop, no comprehension call for a one-plane tensor.
        visible: PlaneSet = {}
        for t, held in planes.items():
            visible[t] = (held[0][index],) if len(held) == 1 else tuple([p[index] for p in held])
        return visible

    def _window(self, planes: PlaneSet, row: int | None) -> PlaneSet | None:
        # Every merge reads its sources' rows: comprehensions, no per-plane call.
        if row is None:
            start, stop = self._origin, self._origin + self.width
            return {t: tuple(p[:, :, start:stop] for p in held) for t, held in planes.items()}
        return self._window_slot(planes, row, row)

    def _window_slot(self, planes: PlaneSet, row: int, slot: int) -> PlaneSet | None:
        first = self._origin + self._pads[row]
        last = first + self._tokens_held[row]
        end = slot + 1
        return {t: tuple(p[slot:end, :, first:last] for p in held) for t, held in planes.items()}

    def _visible_rows(self, store: Store) -> PlaneSet:
        assert store.planes is not None
        start, batch = self._origin, len(store.rows)
        stop = start + self.width
        return {t: tuple(p[:batch, :, start:stop] for p in h) for t, h in store.planes.items()}

    def _held_columns(self, rows: list[int], columns: int) -> mx.array:
        """Row ``b``'s tokens sit at ``[origin + pad, origin + pad + offset)``."""
        first = mx.array([self._origin + self._pads[b] for b in rows])[:, None]
        last = first + mx.array([self._tokens_held[b] for b in rows])[:, None]
        column = mx.arange(columns)[None, :]
        return ((column >= first) & (column < last))[:, None, :, None]

    def _append(self, block: PlaneSet, n: int, geometry: KvGeometry) -> None:
        width, ends, aligned = self._ends()
        planes = self._planes
        if planes is None or self._origin + width + n > token_count(planes):
            # A layout keeps one spare column; the origin is 0 afterwards.
            spare = 0 if isinstance(self, Serial) else 1
            self._reallocate(round_up(width + n + spare), shift=0)
            planes = self._planes
        assert planes is not None
        origin = self._origin
        if aligned:  # ``write_columns``, inline: every decode step runs it (no generator)
            start = origin + width
            index = (slice(len(ends)), slice(None), slice(start, start + n))
            for tensor, encoded in block.items():
                for plane, part in zip(planes[tensor], encoded, strict=True):
                    plane[index] = part
        else:
            write_columns(planes, block, [origin + e for e in ends], n)

    def _append_stores(self, shares: list[PlaneSet], n: int, geometry: KvGeometry) -> None:
        assert self._stores is not None
        origin = self._origin
        ends = [origin + p + t for p, t in zip(self._pads, self._tokens_held, strict=True)]
        width = max(ends) - origin
        if any(s.planes is None for s in self._stores) or origin + width + n > self.capacity:
            self._reallocate(round_up(width + n + 1), shift=0)  # every store, one capacity
            ends = [p + t for p, t in zip(self._pads, self._tokens_held, strict=True)]
        for store, share in zip(self._stores, shares, strict=True):
            assert store.planes is not None
            write_columns(store.planes, share, [ends[b] for b in store.rows], n)

    def _reallocate(
        self, capacity: int, *, shift: int, slots: dict[int, int] | None = None
    ) -> None:
        """New buffers of ``capacity`` columns, every store; active rows move right by
        ``shift`` columns (``slots``: the slots a stage's store needs at least)."""
        stores = self._store_list()
        self._reallocated(stores, capacity, shift, slots or {})
        self._put_stores(stores)

    def _reallocated(
        self, stores: list[Store], capacity: int, shift: int, slots: dict[int, int]
    ) -> None:
        """``_reallocate`` over ``stores`` (changed in place)."""
        geometry = self._geometry
        assert geometry is not None
        width, origin = self.width, self._origin
        for store in stores:
            batch = len(store.rows)
            least = batch if isinstance(self, Serial) else spare_slots(batch)
            count = max(slots.get(store.stage, 0), least)
            fresh = self._zeros(count, capacity, geometry, store.codec)
            if store.planes is not None and width and batch:
                for new, plane in paired(fresh, store.planes):
                    new[:batch, :, shift : shift + width] = plane[
                        :batch, :, origin : origin + width
                    ]
            store.planes = fresh
        self._origin = 0

    def _place(self, incoming: list[RowWindow], geometry: KvGeometry | None) -> None:
        """Rows of the one store's stage join (``_place_stages`` when several stores hold
        rows). Rows are right-aligned to ``W = max(width, longest new row)``; a join writes
        only the new rows when a slot is free and the left padding it needs fits left of the
        origin, otherwise the running rows are copied once into larger buffers."""
        if self._stores is not None:
            self._place_stages(incoming, [self._stage_of(self.codec)] * len(incoming), geometry)
            return
        width = self.width
        tokens = [0 if held is None else token_count(held) for held, _ in incoming]
        target = max([width, *tokens])
        grow = target - width
        batch = len(self._offsets)
        joined = batch + len(incoming)
        if geometry is not None:
            fits = self._planes is not None and joined <= self.slots and grow <= self._origin
            if fits:
                self._origin -= grow
            else:  # the one store (of the running rows, none yet on a first join)
                stage = self._stage_of(self.codec)
                store = Store(stage, self._planes, list(range(batch)), self.codec)
                wanted = {stage: spare_slots(joined)}
                self._reallocated([store], round_up(target + 1), grow, wanted)
                self._planes = store.planes
            assert self._planes is not None
            end = self._origin + target
            if fits and self._masked_read_zeros:  # a spare slot may hold a copy of a row
                for plane in arrays(self._planes):
                    plane[batch:joined] = 0
            for slot, ((held, _), count) in enumerate(
                zip(incoming, tokens, strict=True), start=batch
            ):
                if held is None or count == 0:
                    continue  # nothing to write (and MLX faults on empty scatters)
                for plane, src in paired(self._planes, held):
                    plane[slot : slot + 1, :, end - count : end] = src
        self._pads = [p + grow for p in self._pads] + [target - t for t in tokens]

    def _place_stages(
        self, incoming: list[RowWindow], stages: list[int], geometry: KvGeometry | None
    ) -> None:
        """Rows are right-aligned to ``W = max(width, longest new row)``, each into its
        stage's store. A join writes only the new rows when every store has a free slot for
        them and the left padding it needs fits left of the origin; otherwise the running
        rows are copied once into larger buffers (every store, one capacity)."""
        width = self.width
        tokens = [0 if held is None else token_count(held) for held, _ in incoming]
        target = max([width, *tokens])
        grow = target - width
        batch = len(self._offsets)
        stores = {store.stage: store for store in self._store_list()}
        joining = {s: stages.count(s) for s in set(stages)}
        for stage in joining:
            stores.setdefault(stage, self._new_store(stage))
        if geometry is not None:
            need = {s: len(store.rows) + joining.get(s, 0) for s, store in stores.items()}
            running = [store for store in stores.values() if store.rows]
            fits = (
                bool(running)
                and grow <= self._origin
                and all(
                    store.planes is not None and need[s] <= int(arrays(store.planes)[0].shape[0])
                    for s, store in stores.items()
                    if store.rows
                )
            )
            if fits:
                self._origin -= grow
                capacity = self.capacity
                for s, store in stores.items():
                    if store.planes is None:  # a stage joining: a store at the same columns
                        count = spare_slots(need[s])
                        store.planes = self._zeros(count, capacity, geometry, store.codec)
                    elif need[s] > len(store.rows) and self._masked_read_zeros:
                        # A spare slot may hold a copy of a row: the new rows' pads read zeros.
                        for plane in arrays(store.planes):
                            plane[len(store.rows) : need[s]] = 0
            else:
                wanted = {s: spare_slots(count) for s, count in need.items()}
                self._reallocated(list(stores.values()), round_up(target + 1), grow, wanted)
            end = self._origin + target
        for b, ((held, _), count, stage) in enumerate(
            zip(incoming, tokens, stages, strict=True), start=batch
        ):
            store = stores[stage]
            slot = len(store.rows)
            store.rows.append(b)
            if geometry is None or held is None or count == 0:
                continue  # nothing to write (and MLX faults on empty scatters)
            assert store.planes is not None
            for plane, src in paired(store.planes, held):
                plane[slot : slot + 1, :, end - count : end] = src
        self._put_stores(list(stores.values()))
        self._pads = [p + grow for p in self._pads] + [target - t for t in tokens]

    def _keeps_at_once(self, order: list[int]) -> bool:
        # One store and no slots to release: one gather, rebound once built.
        return self._stores is None and self.slots <= 2 * spare_slots(len(order))

    def _keep(self, order: list[int]) -> None:
        """The shared left padding is dropped by moving the origin."""
        shared = min(self._pads[i] for i in order)
        if self._stores is None:  # one store: old row ``b`` at slot ``b``
            held = self._planes
            if held is not None:
                self._planes = self._gather_slots(held, order)
            self._pads = [self._pads[i] - shared for i in order]
            self._origin += shared
            # Release the slots a large retirement left behind (a gather keeps only a few
            # spare slots: only kept leading rows can leave many).
            kept_whole = held is not None and self._planes is held
            if kept_whole and self.slots > 2 * spare_slots(len(order)):
                self._reallocate(round_up(self.width + 1), shift=0)
            return
        stores = self._stores
        new_row = {old: new for new, old in enumerate(order)}
        kept: list[Store] = []
        for store in stores:
            slots = [store.rows.index(old) for old in order if old in store.rows]
            if not slots:
                continue  # a stage left without rows holds no planes
            if store.planes is not None:
                # Gather whole slots (contiguous) into fresh planes, keeping a few spare
                # slots for the next join; a scatter into the live planes would copy them
                # anyway.
                store.planes = self._gather_slots(store.planes, slots)
            store.rows = sorted(new_row[store.rows[slot]] for slot in slots)
            kept.append(store)
        self._put_stores(kept)
        self._pads = [self._pads[i] - shared for i in order]
        self._origin += shared
        if any(
            store.planes is not None
            and int(arrays(store.planes)[0].shape[0]) > 2 * spare_slots(len(store.rows))
            for store in kept
        ):
            # Release the slots a large retirement left behind.
            self._reallocate(round_up(self.width + 1), shift=0)

    def _align(self, pads: list[int], tokens: list[int] | None = None) -> None:
        """Re-lay row ``b`` at column ``pads[b]`` (positions unchanged): each row's tokens
        copied by one slice into fresh planes (spare slots and a spare column, as
        ``_reallocate``), so the columns a row does not cover read as zeros; the origin is 0
        afterwards. ``tokens``: how many of each row's oldest tokens move (default: all it
        holds). (A slice per row is several times faster than one gather of every row's
        columns: the gather reads an index per element.)"""
        held = self._tokens_held if tokens is None else tokens
        geometry = self._geometry
        stores = self._store_list()
        if geometry is None or all(store.planes is None for store in stores):
            self._pads = pads  # no planes yet: only the bookkeeping moves
            return
        origin = self._origin
        width = max((p + t for p, t in zip(pads, held, strict=True)), default=0)
        for store in stores:  # each store: its rows at their slots
            assert store.planes is not None
            moves = [
                (slot, origin + self._pads[b], pads[b], held[b])
                for slot, b in enumerate(store.rows)
                if held[b]  # nothing to copy (and MLX faults on empty slices)
            ]
            slots = spare_slots(len(store.rows))
            fresh = self._zeros(slots, round_up(width + 1), geometry, store.codec)
            for new_plane, plane in paired(fresh, store.planes):
                for b, source, target, count in moves:
                    new_plane[b : b + 1, :, target : target + count] = plane[
                        b : b + 1, :, source : source + count
                    ]
            store.planes = fresh
        self._put_stores(stores)
        self._origin = 0
        self._pads = pads

    def _forget_tail_pads(self, tail: list[int]) -> None:
        if self.composition.shared_column:
            # Width before the trim: the rows still share one end column.
            self._roll_right(self._origin, self._origin + self.width, tail)
            self._pads = [p + t for p, t in zip(self._pads, tail, strict=True)]
        # Ragged rows: the trim of the row positions is all there is to do.

    def _forget_front_pads(self, front: list[int]) -> None:
        pads = [p + f for p, f in zip(self._pads, front, strict=True)]
        # Keep some row at the origin: the padding every row shares moves the origin.
        shared = min(pads)
        self._pads = [p - shared for p in pads]
        self._origin += shared

    def _block_starts(self, n: int) -> list[int]:
        return [p + t for p, t in zip(self._pads, self._tokens_held, strict=True)]

    def _check_padded_update(self, n: int, real: list[int], tail: list[int]) -> None:
        return None  # every pad column is forgotten by moving positions and pads

    # -- saved forms ------------------------------------------------------------------
    def _serial_form_fields(self) -> dict[str, Any]:
        return {}

    def _layout_image(self) -> LayoutImage | None:
        """Rows sharing one end column are right-aligned in the buffers already: the
        form is a view of them (``idx``: that column)."""
        ends = {p + t for p, t in zip(self._pads, self._tokens_held, strict=True)}
        if self._planes is None or len(ends) != 1:
            return None
        return {"idx": ends.pop()}, list(self._pads), self._visible(self._planes)

    def _resume_serial(self, fields: dict[str, Any], held: int) -> None:
        return None

    def _check_trim(self, counts: Sequence[int]) -> None:
        return None

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        if not (justify and self.composition.shared_column and len(set(counts)) > 1):
            # The rows keep their columns; the offsets move afterwards. A ragged row's
            # forgotten columns stay in the read (before a longer row's end): they read
            # zeros, as a load lays them (contract §0.5).
            if self.composition.arrangement == "ragged" and self._masked_read_zeros:
                ends = [
                    self._origin + p + t for p, t in zip(self._pads, self._tokens_held, strict=True)
                ]
                self._clear_rows([e - c for e, c in zip(ends, counts, strict=True)], counts)
            return
        # A shared-column rollback: each row rolls right so every row ends at the longest
        # kept row's end again (what MLA's seed does with a roll).
        kept = [t - c for t, c in zip(self._tokens_held, counts, strict=True)]
        width = max(kept, default=0)
        self._align([width - k for k in kept], kept)

    def _adopt(self, planes: PlaneSet, offset: int) -> None:
        self._origin = 0

    def _check_geometry(self) -> None:
        assert all(p >= 0 for p in self._pads)
        if self._offsets:
            assert min(self._pads) == 0, "some row must start at column 0"
        if self.composition.shared_column:
            ends = {p + t for p, t in zip(self._pads, self._tokens_held, strict=True)}
            assert len(ends) <= 1, "rows must share the write column"
        if self._planes is not None:
            assert len(self._offsets) <= self.slots
        if self._planes is not None or self._stores is not None:
            assert self._origin + self.width <= self.capacity

    # -- masks ------------------------------------------------------------------------
    def _serial_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        """mlx-lm's policy: ``None`` for one token, ``"causal"`` for a block, an array when
        a window or ``return_array`` asks for one."""
        if window is None and not return_array:
            return None if n == 1 else "causal"
        offset = self._offsets[0] if self._offsets else 0
        columns = mx.arange(offset + n)[None, :]
        queries = mx.arange(offset, offset + n)[:, None]
        visible = columns <= queries
        if window is not None:
            visible = visible & (queries < columns + window)
        return visible

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Mask:
        width, ends, aligned = self._ends()
        if aligned and window is None and not return_array and not any(self._pads):
            return None if n == 1 else "causal"
        # Every row's pad test, sliced from the array kept while the pads stay: a decode
        # step's mask on rows sharing one write column is that slice alone.
        visible = self._pad_columns(width + n)
        if aligned and n == 1 and window is None:
            return visible
        columns = mx.arange(width + n)
        if aligned:
            # One write column: the pad test, and one causal block all rows share.
            queries = mx.arange(width, width + n)[:, None]
            if n > 1:
                visible = visible & (columns[None, :] <= queries)
            if window is not None:
                visible = visible & (queries < columns[None, :] + window)
            return visible
        grid = columns[None, None, :]
        queries = (mx.array(ends)[:, None] + mx.arange(n)[None, :])[:, :, None]
        ragged = grid <= queries
        if window is not None:
            ragged = ragged & (queries < grid + window)
        return visible & ragged[:, None]


# A mixin over a speculative ragged growing layout: at run time it must not bring the
# layout's bases ahead of the public class's own order.
if TYPE_CHECKING:

    class _RaggedGrowingLayout(SpeculativeLayout):
        def _align(self, pads: list[int], tokens: list[int] | None = None) -> None: ...
else:
    _RaggedGrowingLayout = object


class RowAlignment(_RaggedGrowingLayout):
    """``align_rows`` for the ragged growing layouts (``BatchedKVCache``,
    ``BatchedQuantizedKVCache``); listed first among a public class's bases. Shared-column
    layouts and rings do not take it (``__init_subclass__`` refuses them)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        entry = cls.__dict__.get("composition")
        if entry is not None and (entry.geometry != "growing" or entry.arrangement != "ragged"):
            # Checked before the class is registered (a refused class leaves no trace).
            raise KvRowsError(align_rows_message(cls.__name__))
        super().__init_subclass__(**kwargs)

    def align_rows(self, left_pad: Sequence[int]) -> None:
        """Re-lay every row so that its first token sits at column ``left_pad[b]``: its
        tokens' bytes and its position are unchanged (``spec/BatchedKVCache.md`` §3).

        Raises ``InvalidInputError`` (not one non-negative int per row, or no row at column
        0) and ``SpeculativeRoundError`` (a round is open) before anything changes."""
        self._spec_guard("align_rows")
        pads = check_left_pad(left_pad, self.batch_size)
        if pads != self._pads:
            self._align(pads)
