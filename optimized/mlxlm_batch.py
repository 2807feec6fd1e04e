"""mlx-lm's batch cache classes, built on kvrows' ragged layouts.

``BatchKVCache(left_padding)`` and ``BatchRotatingKVCache(max_size, left_padding)`` take
mlx-lm's constructor arguments and are what ``KVCache.merge`` / ``RotatingKVCache.merge``
return, so code (and saved files) that name mlx-lm's classes find them. They are
``BatchedKVCache`` / ``RaggedRotatingRows`` (each row appends at its own end), so a
right-padded prefill is forgotten exactly by trimming each row. The batch operations
themselves are ``LayoutBatchOps`` (``batch_dropin.py``); the semantics and the mlx-lm
bugs they avoid are ``spec/mlx-lm-batch-api.md``.

This module is separate from ``batch_dropin.py`` because ``classes.py`` imports the
mixins from there, and these classes subclass ``classes.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from kvrows.compositions import Composition
from kvrows.errors import InvalidInputError, KvRowsError
from kvrows.optimized.batch_dropin import LayoutBatchOps, _counts
from kvrows.optimized.classes import BatchedKVCache, RaggedRotatingRows
from kvrows.optimized.rows import DECLARED, Layout, Serial

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


class _PaddedRows:
    """Construction of ``len(left_padding)`` empty rows whose first blocks are left-padded."""

    def _start_rows(self, lead: list[int]) -> None:
        assert isinstance(self, Layout)
        if not lead:
            return
        serial = DECLARED[self.composition.serial or self.composition.name]
        assert issubclass(serial, Serial)
        self.merge_rows([serial._spawn(self) for _ in lead])
        self.prepare(left_padding=lead)  # type: ignore[attr-defined]


class BatchKVCache(_PaddedRows, BatchedKVCache):
    """mlx-lm's ``BatchKVCache``: ragged full-attention rows (``spec/mlx-lm-batch-api.md``).

    ``BatchKVCache(left_padding)``: ``len(left_padding)`` rows that hold nothing yet; the
    first ``left_padding[b]`` tokens row ``b`` receives are padding (``offset`` reads
    ``-left_padding`` until then)."""

    def __init__(
        self, left_padding: Sequence[int] | mx.array | None = None, **specs: object
    ) -> None:
        lead = _left_padding(left_padding)
        super().__init__(**specs)
        self._start_rows(lead)


class BatchRotatingKVCache(_PaddedRows, RaggedRotatingRows):
    """mlx-lm's ``BatchRotatingKVCache``: ragged ring rows, each with its own window.

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
    layout = _MLXLM_NAMED.get(name) or DECLARED[name]
    assert issubclass(layout, LayoutBatchOps)
    return layout
