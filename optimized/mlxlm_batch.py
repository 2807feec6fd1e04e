"""mlx-lm's batch cache classes, built on kvrows' layouts, in mlx-lm's columns.

``BatchKVCache(left_padding)`` and ``BatchRotatingKVCache(max_size, left_padding)`` take
mlx-lm's constructor arguments and are what ``KVCache.merge`` / ``RotatingKVCache.merge``
return, so code (and saved files) that name mlx-lm's classes find them.
``BatchKVCache`` is a ``BatchedKVCache`` (ragged rows, so a right-padded prefill is
forgotten by trimming each row) that keeps the pad columns every row shares, as
mlx-lm's does; ``BatchRotatingKVCache`` is a ``BatchedRotatingCache`` (one shared ring,
mlx-lm's bookkeeping). Both present mlx-lm's physical columns where mlx-lm's own tests
look (``spec/mlx-lm-batch-api.md`` §3.3). The batch operations themselves are
``LayoutBatchOps`` (``batch_dropin.py``); the semantics and the mlx-lm bugs they avoid
are ``spec/mlx-lm-batch-api.md``.

This module is separate from ``batch_dropin.py`` because ``classes.py`` imports the
mixins from there, and these classes subclass ``classes.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from kvrows.compositions import Composition
from kvrows.errors import InvalidInputError, KvRowsError
from kvrows.forms import parse_state
from kvrows.optimized.batch_dropin import LayoutBatchOps, _counts
from kvrows.optimized.classes import BatchedKVCache, BatchedRotatingCache
from kvrows.optimized.rows import DECLARED
from kvrows.protocols import Cache
from kvrows.validation import KvGeometry

__all__ = ["BatchKVCache", "BatchRotatingKVCache", "merge_layout_class"]


def _left_padding(left_padding: object) -> list[int]:
    if left_padding is None:
        return []
    if isinstance(left_padding, int | bool):
        raise InvalidInputError(
            f"left_padding must be a list with one pad count per row, got {left_padding!r}"
        )
    if isinstance(left_padding, mx.array):
        length = left_padding.size
    else:
        length = len(left_padding) if isinstance(left_padding, Sequence) else 0
    return _counts(left_padding, "left_padding", length)


def _listed(rows: object) -> bool:
    return isinstance(rows, Sequence) and not isinstance(rows, str | bytes)


class _PaddedRows:
    """Construction of ``len(left_padding)`` empty rows whose first blocks are left-padded."""

    def _start_rows(self, lead: list[int]) -> None:
        if not lead:
            return
        layout = cast(LayoutBatchOps, self)  # the mixin of mlx-lm's batch layouts
        entry = layout.composition
        serial = DECLARED[entry.serial or entry.name]
        layout.merge_rows([cast(Cache, serial._spawn(layout)) for _ in lead])
        layout.prepare(left_padding=lead)


class BatchKVCache(_PaddedRows, BatchedKVCache):
    """mlx-lm's ``BatchKVCache``: ragged full-attention rows (``spec/mlx-lm-batch-api.md``).

    ``BatchKVCache(left_padding)``: ``len(left_padding)`` rows that hold nothing yet; the
    first ``left_padding[b]`` tokens row ``b`` receives are padding (``offset`` reads
    ``-left_padding`` until then).

    Unlike the core layouts, it keeps the pad columns every row shares, as mlx-lm's class
    does, until a ``filter`` drops them: a left-padded block's pads stay columns of the
    batch (``left_padding``, ``keys``, ``size()``, ``state`` and masks count them), and
    ``extend`` right-aligns both batches at the wider one, shared pads included
    (``spec/mlx-lm-batch-api.md`` §3.3)."""

    def __init__(
        self, left_padding: Sequence[int] | mx.array | None = None, **specs: object
    ) -> None:
        lead = _left_padding(left_padding)
        super().__init__(**specs)
        self._start_rows(lead)

    def _forget_front_pads(self, front: list[int]) -> None:
        # The pads become each row's left padding; the columns all rows share stay.
        self._pads = [p + f for p, f in zip(self._pads, front, strict=True)]

    def _shared_width(self) -> int:
        """The columns mlx-lm's batch would span: the shared pad columns and the longest
        row (``width`` when the rows end together, as in mlx-lm's batches)."""
        tokens = max(self._offsets, default=0)
        return min(self._pads, default=0) + tokens if tokens else 0

    def _widen(self, width: int) -> None:
        """Add shared pad columns on the left until the batch spans ``width`` columns
        (taken left of the origin when there is room, else one re-lay of the rows)."""
        extra = width - self.width
        if extra <= 0 or not any(self._offsets):
            return
        pads = [p + extra for p in self._pads]
        if self._planes is not None and extra <= self._origin:
            self._origin -= extra
            self._pads = pads
        else:
            self._align(pads)
        self._changed()

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        # mlx-lm's extend right-aligns both batches at the wider one, each counting its
        # shared pad columns; kvrows' merge aligns the incoming rows at their longest.
        # (Only this class's batches keep shared pad columns: ``_shared_width``.)
        widths = [getattr(s, "_shared_width", None) for s in rows] if _listed(rows) else []
        widest = max((width() for width in widths if width is not None), default=0)
        super().merge_rows(rows)
        self._widen(widest)

    def _check_geometry(self) -> None:
        # The core invariant "some row starts at column 0" does not hold here: the shared
        # pad columns are kept. The rest does.
        assert all(p >= 0 for p in self._pads)
        if self._planes is not None:
            assert len(self._offsets) <= self.slots
            assert self._origin + self.width <= self.capacity

    @classmethod
    def _restore(
        cls, state: Any, meta_state: Any, keep: int | None, geometry: KvGeometry | None
    ) -> BatchKVCache:
        fresh = super()._restore(state, meta_state, keep, geometry)
        # The rows come back right-aligned at the longest; the state's ``idx`` counts the
        # shared pad columns too.
        fields = parse_state(fresh.composition, state, meta_state).fields
        idx = fields["idx"]
        if (
            fields["keys"] is not None
            and isinstance(idx, int | mx.array)
            and not isinstance(idx, bool)
        ):
            fresh._widen(int(idx))
        return fresh


class BatchRotatingKVCache(_PaddedRows, BatchedRotatingCache):
    """mlx-lm's ``BatchRotatingKVCache``: one shared ring (every row writes the same
    physical column), so its keys, values, ``left_padding`` and masks are in mlx-lm's
    physical columns; kvrows' masks stay exact where mlx-lm's hide a real token (B9).

    ``BatchRotatingKVCache(max_size, left_padding)``: as :class:`BatchKVCache`, with a
    window of ``max_size`` tokens per row."""

    def __init__(
        self,
        max_size: int | None = None,
        left_padding: Sequence[int] | mx.array | None = None,
        **specs: object,
    ) -> None:
        lead = _left_padding(left_padding)
        if max_size is not None:
            specs["max_size"] = max_size
        super().__init__(**specs)
        self._start_rows(lead)


#: The layouts ``merge`` returns instead of a composition's own prefill layout.
_MLXLM_NAMED: dict[str, type[LayoutBatchOps]] = {
    "BatchedKVCache": BatchKVCache,
    "RaggedRotatingRows": BatchRotatingKVCache,
}


def merge_layout_class(entry: Composition) -> type[LayoutBatchOps]:
    """The layout a serial storage's ``merge`` returns: its prefill layout (mlx-lm's name
    where mlx-lm has the class)."""
    if entry.roles is None:
        raise KvRowsError(f"{entry.name} has no row layouts to merge into")
    name = entry.roles.prefill
    # Every layout of the table takes mlx-lm's batch operations (``classes.py``).
    return cast(type[LayoutBatchOps], _MLXLM_NAMED.get(name) or DECLARED[name])
