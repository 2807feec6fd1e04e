"""mlx-lm's batch API on kvrows classes: what ``BatchGenerator`` and the server call.

Two mixins (``classes.py`` mixes them into every optimized class):

* :class:`SerialMerge` gives every serial storage mlx-lm's ``merge(caches)`` classmethod
  (``_merge_caches`` calls it through an instance). It returns the storage's *prefill*
  layout (ragged rows for the growing geometry), which supports everything the
  generator then does: right-padded prefill, decode, join, leave. Plain full attention
  and plain rings get :class:`~kvrows.optimized.mlxlm_batch.BatchKVCache` /
  :class:`~kvrows.optimized.mlxlm_batch.BatchRotatingKVCache` (a shared ring), which
  carry mlx-lm's names and columns.
* :class:`LayoutBatchOps` gives every layout ``extend``, ``filter``, ``extract``,
  ``prepare`` and ``finalize`` under mlx-lm's names, on top of kvrows' row operations
  (``merge_rows``, ``filter_rows``, ``extract_row``).

Padding. mlx-lm feeds a batch *padded* blocks in two ways, and kvrows forgets every pad
exactly (``spec/mlx-lm-batch-api.md`` §3):

* **left padding** (``BatchKVCache(left_padding)``, ``prepare(left_padding=…)``): the
  first ``lead[b]`` tokens row ``b`` receives are pads. Each layout keeps those counts
  (``_pending_pads``) on rows that hold nothing yet; ``offset`` reads ``-lead`` like mlx-lm's, so
  the real tokens' RoPE positions start at 0; ``make_mask`` hides the pad columns of the
  block; after the update the pads are forgotten from the front of the row (the growing
  geometry marks them as left padding, a shared ring as columns before the oldest token,
  a ragged ring slides the row left).
* **right padding** (``prepare(lengths=…, right_padding=…)`` then ``finalize()``): row
  ``b``'s next ``lengths[b]`` tokens are real and the ``right_padding[b]`` after them are
  pads (the *run*). Causality already hides a row's trailing pads from its real queries;
  after each update the pads it carried are forgotten from the end of the row (ragged
  rows: per-row trim; shared-column rows: each row rolled right by its pads, which become
  left padding). A ring would have to evict a real token for a pad when a row holding a
  full window receives only padding: that update is refused before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
)
from kvrows.optimized.rows import Layout, RowWindow, Serial, Storage
from kvrows.protocols import Cache, Composed, Mask
from kvrows.validation import as_count, check_keep, check_window

__all__ = ["LayoutBatchOps", "SerialMerge"]

# The mixins are plain classes at run time, so that in a public class they come before
# the geometry without dragging ``Layout`` / ``Serial`` ahead of it in the MRO; the type
# checker sees the arrangement they are mixed into.
if TYPE_CHECKING:
    _LayoutBase = Layout
    _SerialBase = Serial
else:
    _LayoutBase = _SerialBase = object


def _counts(values: object, name: str, rows: int) -> list[int]:
    """One non-negative int per row (a list, tuple or 1-D integer ``mx.array``)."""
    if isinstance(values, mx.array):
        if values.ndim != 1 or (values.size and not mx.issubdtype(values.dtype, mx.integer)):
            raise InvalidInputError(f"{name} must be a 1-D integer array, got {values!r}")
        values = values.tolist()
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise InvalidInputError(f"{name} must be a sequence of ints (one per row), got {values!r}")
    if len(values) != rows:
        raise InvalidInputError(f"{name} needs {rows} entries (one per row), got {len(values)}")
    return [as_count(v, f"{name}[{i}]") for i, v in enumerate(values)]


def _row_count(source: Storage) -> int:
    """Rows ``source`` contributes to a merge (an empty serial cache still is one row)."""
    rows = len(source._offsets)
    return rows if source.composition.is_layout else max(1, rows)


def _pending_pads(source: Storage) -> list[int]:
    """The left pads each row of a merged ``source`` still receives (none but a padded
    layout's)."""
    pending = getattr(source, "pending_left_padding", None)  # a layout taking padded blocks
    return [0] * _row_count(source) if pending is None else list(pending)


def _sources(caches: object) -> Sequence[object]:
    """``caches`` as mlx-lm's ``merge`` takes them: a non-empty list, one cache per request."""
    if isinstance(caches, Cache | str | bytes) or not isinstance(caches, Sequence):
        raise InvalidInputError(
            f"merge takes a list of caches (one per request), got {type(caches).__name__}"
        )
    if not caches:
        raise InvalidInputError("merge needs at least one cache")
    return caches


class SerialMerge(_SerialBase):
    """``merge(caches)`` from a serial class, as mlx-lm's generator calls it."""

    @classmethod
    def merge(cls, caches: Sequence[object]) -> LayoutBatchOps:
        """A new layout holding the rows of ``caches`` (each left unchanged), in order.

        Every cache must be a ``cls`` with the same codec, token geometry and KV geometry
        (``IncompatibleRowsError`` otherwise: mlx-lm casts them to the first one's dtype,
        B5). Empty caches merge too, as rows that hold nothing."""
        from kvrows.optimized.mlxlm_batch import merge_layout_class

        first = _sources(caches)[0]
        # Like mlx-lm's (whose ``merge`` ignores the class it is called on), the caches
        # decide: ``KVCache.merge(rings)`` batches rings.
        # A cache of the other implementation, or no kvrows cache, is refused here or by
        # the layout's merge (``IncompatibleRowsError`` both).
        if not isinstance(first, Composed) or first.composition.is_layout:
            raise IncompatibleRowsError(
                f"{cls.__name__}.merge takes kvrows serial caches, got {type(first).__name__}"
            )
        layout = merge_layout_class(first.composition).from_specs(
            first.codec_spec, first.token_geometry, geometry=first.geometry
        )
        layout.merge_rows(cast(Sequence[Cache], caches))
        return layout


@dataclass
class _Run:
    """A right-padded run (``prepare(lengths=…, right_padding=…)``), per row: real tokens
    still to come (``None``: the first update's length minus its pads) and pads still to
    come after them."""

    real: list[int] | None
    pads: list[int]

    def kept(self, order: list[int]) -> _Run:
        real = None if self.real is None else [self.real[i] for i in order]
        return _Run(real, [self.pads[i] for i in order])


@dataclass(frozen=True)
class _Plan:
    """What one update is, per row: ``front`` left pads, then ``real``
    tokens, then ``tail`` right pads."""

    front: list[int]
    real: list[int]
    tail: list[int]


class LayoutBatchOps(_LayoutBase):
    """mlx-lm's in-place batch operations on a layout, and its padded blocks."""

    _pending_pads: list[int]
    _run: _Run | None

    # -- per-row padding state, kept aligned with the rows ------------------------------
    def _clear(self) -> None:
        super()._clear()
        self._pending_pads, self._run = [], None

    def _leads(self) -> list[int]:
        """The pending left pads, one per row (re-synchronised if a row operation outside
        this mixin replaced the rows)."""
        lead = getattr(self, "_pending_pads", [])
        if len(lead) != len(self._offsets):
            self._pending_pads, self._run = [0] * len(self._offsets), None
        return self._pending_pads

    @property
    def pending_left_padding(self) -> tuple[int, ...]:
        """Left pads each row will still receive before its first real token."""
        return tuple(self._leads())

    @property
    def offset(self) -> mx.array:
        """Per-row positions; ``-pending_left_padding`` on a row that holds nothing yet,
        so the first real token of a left-padded block gets RoPE position 0 (mlx-lm)."""
        if self._offset_array is None:
            positions = [t - p for t, p in zip(self._offsets, self._leads(), strict=True)]
            self._offset_array = mx.array(positions, dtype=mx.int32)
        return self._offset_array

    # -- kvrows' row operations keep the padding state ----------------------------------
    def _merge_plan(self, rows: Sequence[Cache]) -> tuple[list[RowWindow], Any, list[int]]:
        self._refuse_during_run("rows cannot join")  # merge_rows and check_merge
        return super()._merge_plan(rows)

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        lead, before = self._leads(), self.batch_size
        super().merge_rows(rows)  # every source is a storage of this implementation now
        added = self.batch_size - before
        incoming = [pad for source in rows for pad in _pending_pads(cast(Storage, source))]
        self._pending_pads = lead + (incoming if len(incoming) == added else [0] * added)
        self._changed()

    def _row_windows(self) -> list[RowWindow]:
        # Checked by the merging layout before it changes anything.
        if getattr(self, "_run", None) is not None:
            raise LayoutStateError(
                "a layout inside a prepared run cannot be merged: finalize() it first"
            )
        return super()._row_windows()

    def filter_rows(self, keep: Sequence[int]) -> None:
        lead, run = self._leads(), self._run
        super().filter_rows(keep)
        if self.batch_size:
            order = check_keep(keep, len(lead))
            self._pending_pads = [lead[i] for i in order]
            self._run = None if run is None else run.kept(order)
            self._changed()

    # -- mlx-lm's names -----------------------------------------------------------------
    @classmethod
    def merge(cls, caches: Sequence[object]) -> LayoutBatchOps:
        """A new layout of this class holding the rows of ``caches`` (serial caches or
        layouts of the same codec, token geometry and KV geometry), each left unchanged."""
        first = _sources(caches)[0]
        if not isinstance(first, Composed):
            raise IncompatibleRowsError(
                f"{cls.__name__}.merge takes kvrows caches, got {type(first).__name__}"
            )
        layout = cls.from_specs(first.codec_spec, first.token_geometry, geometry=first.geometry)
        layout.merge_rows(cast(Sequence[Cache], caches))
        return layout

    def extend(self, other: object) -> None:
        """Append ``other``'s rows after this layout's, in place (``other`` is unchanged;
        either side may hold no rows). ``other`` is a layout or serial cache of the same
        codec, token geometry and KV geometry (``IncompatibleRowsError`` otherwise)."""
        if not isinstance(other, Composed):
            raise IncompatibleRowsError(
                f"{type(self).__name__}.extend takes a kvrows cache, got {type(other).__name__}"
            )
        self.merge_rows([cast(Cache, other)])

    def filter(self, batch_indices: object) -> None:
        """Keep rows ``batch_indices`` (a list or 1-D integer ``mx.array`` of distinct
        row indices, any order) in place; an empty selection leaves no rows. Negative or
        out-of-range indices raise ``RowIndexError`` (mlx-lm indexes from the end, and on
        an empty cache drives its cursor negative, B2)."""
        if isinstance(batch_indices, mx.array):
            if batch_indices.ndim != 1 or (
                batch_indices.size and not mx.issubdtype(batch_indices.dtype, mx.integer)
            ):
                raise InvalidInputError(
                    f"filter takes a 1-D integer array of row indices, got {batch_indices!r}"
                )
            batch_indices = batch_indices.tolist()
        if isinstance(batch_indices, str | bytes) or not isinstance(batch_indices, Sequence):
            raise InvalidInputError(f"filter takes row indices, got {batch_indices!r}")
        self.filter_rows(list(batch_indices))

    def extract(self, idx: int) -> Serial:
        """Row ``idx`` as an independent serial cache: owned, compact, evaluated arrays
        (an empty row gives an empty cache; mlx-lm raises ``TypeError``, B3)."""
        return self.extract_row(idx)

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | mx.array | None = None,
        lengths: Sequence[int] | mx.array | None = None,
        right_padding: Sequence[int] | mx.array | None = None,
    ) -> None:
        """Announce padded blocks.

        ``left_padding``: row ``b``'s next ``left_padding[b]`` tokens are pads (only while
        the layout holds no token, as in mlx-lm). ``right_padding`` (with ``lengths``):
        row ``b``'s next ``lengths[b]`` tokens are real and the ``right_padding[b]`` after
        them pads, until ``finalize()``; without ``lengths`` the run is the next update.
        """
        rows = self.batch_size
        lead = None if left_padding is None else _counts(left_padding, "left_padding", rows)
        real = None if lengths is None else _counts(lengths, "lengths", rows)
        right = None if right_padding is None else _counts(right_padding, "right_padding", rows)
        padded_right = right is not None and any(right)
        if lead is not None and any(lead) and any(self._offsets):
            raise LayoutStateError(
                "left padding can only be added while the layout holds no tokens "
                f"(row positions {self.row_offsets})"
            )
        if (padded_right or (lead is not None and any(lead))) and self._run is not None:
            raise LayoutStateError("a right-padded run is in progress: call finalize() first")
        if lead is not None and any(lead):
            self._pending_pads = [a + b for a, b in zip(self._leads(), lead, strict=True)]
            self._changed()
        if padded_right:
            assert right is not None
            self._run = _Run(real, right)

    def finalize(self) -> None:
        """End a right-padded run (its pads were forgotten as they arrived)."""
        self._run = None

    # -- padded updates -----------------------------------------------------------------
    def _refuse_during_run(self, what: str) -> None:
        if getattr(self, "_run", None) is not None:
            raise LayoutStateError(f"{what} during a right-padded run: call finalize() first")

    def _padded(self) -> bool:
        return self._run is not None or any(self._leads())

    def _plan(self, n: int) -> _Plan:
        """The update's pads per row; refuses (before any change) what cannot be exact."""
        front = [min(n, p) for p in self._leads()]
        run = self._run
        real: list[int] = []
        tail: list[int] = []
        for b, f in enumerate(front):
            rest = n - f
            if run is None:
                r, t = rest, 0
            else:
                want = run.real[b] if run.real is not None else rest - run.pads[b]
                if want < 0:
                    raise InvalidInputError(
                        f"row {b}: right padding {run.pads[b]} is longer than the update "
                        f"of {n} tokens"
                    )
                r = min(rest, want)
                t = rest - r
                if t > run.pads[b]:
                    raise InvalidInputError(
                        f"row {b}: an update of {n} tokens runs past its prepared "
                        f"{want} real tokens and {run.pads[b]} pads"
                    )
            real.append(r)
            tail.append(t)
        self._check_padded_update(n, real, tail)
        return _Plan(front, real, tail)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        # A decode step first: no run and no pending pad (``_padded`` without its calls).
        plain = self._run is None and not any(getattr(self, "_pending_pads", ()))
        if plain or not self._offsets or not self._padded():
            return super().update_and_fetch(keys, values)
        shape = keys.shape if isinstance(keys, mx.array) else ()
        if len(shape) != 4 or int(shape[2]) < 1:
            return super().update_and_fetch(keys, values)  # raises InvalidInputError
        plan = self._plan(int(shape[2]))
        fetched = super().update_and_fetch(keys, values)
        self._forget_pads(plan)
        return fetched

    def _forget_pads(self, plan: _Plan) -> None:
        """Forget each row's pads of the update just appended (front, then tail)."""
        front, tail = plan.front, plan.tail
        if any(tail):
            self._forget_tail_pads(tail)
        if any(front):
            self._forget_front_pads(front)
        self._offsets = [t - f - r for t, f, r in zip(self._offsets, front, tail, strict=True)]
        self._pending_pads = [p - f for p, f in zip(self._leads(), front, strict=True)]
        run = self._run
        if run is not None:
            real = (
                None
                if run.real is None
                else [w - r for w, r in zip(run.real, plan.real, strict=True)]
            )
            pads = [p - t for p, t in zip(run.pads, tail, strict=True)]
            self._run = _Run(real if real is not None else [0] * len(pads), pads)
        self._changed()

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        count = as_count(n, "n", minimum=1)
        if count == 1 or not any(self._leads()):
            # (``Storage.make_mask``'s checks and a layout's mask, inline: every decode
            # step asks.)
            return self._layout_mask(count, return_array, check_window(window_size))
        lead = self._leads()
        # Hide the block's left pads from every query. With the plain codec a pad query
        # then sees nothing, as in mlx-lm (MLX's fused attention answers such a row with
        # finite values, discarded anyway); the affine codec's attention is a softmax over
        # -inf there (NaN, which a later layer's masked pad values would spread), so with
        # it a pad query sees its own column.
        visible = super().make_mask(count, return_array=True, window_size=window_size)
        assert isinstance(visible, mx.array)
        width = int(visible.shape[-1])
        starts = mx.array(self._block_starts(count))[:, None, None]
        front = mx.array([min(count, p) for p in lead])[:, None, None]
        columns = mx.arange(width)[None, None, :]
        queries = mx.arange(count)[None, :, None]
        hidden = (columns >= starts) & (columns < starts + front)
        if self.codec_spec.encodes:
            hidden = hidden & (columns != starts + queries)
        return visible & ~hidden[:, None]
