"""The row-layout table: for each storage class, the layouts its rows join.

One table, shared by both implementations; each registers its classes into it
(``kvrows.reference`` and ``kvrows.optimized`` do so on import). Lookup is
``isinstance``, first match wins, and registration keeps a subclass ahead of
its bases, so the table reads like the seed's ``ROW_LAYOUTS``. A drop-in
(``kvrows.protocols.DropInWrapper``: the object an unmodified model takes as a
layer's cache, over one kvrows cache) joins the layouts of the cache it wraps,
each behind a new drop-in of its form; a drop-in over several caches
(``kvrows.protocols.DropInParts``: mlx-lm's ``CacheList``) joins, per role, its parts'
layouts grouped in a new drop-in of its form.

The functions below are the seed's, in Python spelling.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvrows.errors import InvalidInputError, NoRowLayoutError, NotBatchableError
from kvrows.protocols import BatchableCache, Cache, DropInParts, DropInWrapper, RingGeometry

__all__ = [
    "RowAdmission",
    "RowLayoutEntry",
    "extract_sole_row",
    "filter_layout_rows",
    "is_batchable",
    "own_empty_batch",
    "owned_cache_layout",
    "owned_cache_layout_factory",
    "prefill_cache_layout",
    "publish_row",
    "register_own_empty_batch",
    "register_row_layouts",
    "registered_entries",
    "row_admission",
    "target_cache_layout",
    "target_row_layout_factory",
]

LayoutFactory = Callable[[Any], BatchableCache]


@dataclass(frozen=True)
class RowLayoutEntry:
    """One storage class and its three roles' empty layouts.

    ``decode``: the layout a running batch keeps the rows in; ``prefill``: the
    layout a prefill cohort keeps them in; ``verify``: the layout that holds a
    speculative round. Each takes a cache of ``storage`` and returns a new
    empty layout whose ``merge_rows`` accepts that cache.
    """

    storage: type
    decode: LayoutFactory
    prefill: LayoutFactory
    verify: LayoutFactory


_ROW_LAYOUTS: list[RowLayoutEntry] = []


def register_row_layouts(
    storage: type, *, decode: LayoutFactory, prefill: LayoutFactory, verify: LayoutFactory
) -> None:
    """Add (or replace) ``storage``'s entry, ahead of any registered base class."""
    entry = RowLayoutEntry(storage, decode, prefill, verify)
    for i, existing in enumerate(_ROW_LAYOUTS):
        if existing.storage is storage:
            _ROW_LAYOUTS[i] = entry
            return
    position = len(_ROW_LAYOUTS)
    for i, existing in enumerate(_ROW_LAYOUTS):
        if issubclass(storage, existing.storage):
            position = i
            break
    _ROW_LAYOUTS.insert(position, entry)


def own_empty_batch(cache: Any) -> BatchableCache:
    """A batchable cache's own empty batch (the role of a layout in its own entry)."""
    layout: BatchableCache = cache.make_empty_batch()
    return layout


def register_own_empty_batch(storage: type) -> None:
    """A layout's own entry: all three roles are its empty batch."""
    register_row_layouts(
        storage, decode=own_empty_batch, prefill=own_empty_batch, verify=own_empty_batch
    )


def registered_entries() -> tuple[RowLayoutEntry, ...]:
    """The table in lookup order (for inspection and tests)."""
    return tuple(_ROW_LAYOUTS)


def _declared(cache: Cache) -> RowLayoutEntry | None:
    if isinstance(cache, DropInWrapper):
        return _behind_drop_in(cache)
    if isinstance(cache, DropInParts):
        return _behind_parts(cache)
    for entry in _ROW_LAYOUTS:
        if isinstance(cache, entry.storage):
            return entry
    return None


def _behind_drop_in(drop_in: DropInWrapper) -> RowLayoutEntry | None:
    """The entry of the cache behind ``drop_in``, each role's layout behind a new drop-in
    of its form (a wrapped layout is itself its own entry's)."""
    wrapped = drop_in.wrapped
    entry = _declared(wrapped)
    if entry is None:
        return None

    def behind(role: LayoutFactory) -> LayoutFactory:
        def build(_: Any) -> BatchableCache:
            layout: BatchableCache = drop_in.rewrap(role(wrapped))
            return layout

        return build

    return RowLayoutEntry(
        type(drop_in), behind(entry.decode), behind(entry.prefill), behind(entry.verify)
    )


def _behind_parts(drop_in: DropInParts) -> RowLayoutEntry | None:
    """Per role, the layouts of each part of ``drop_in`` (its own entry's), grouped in a
    new drop-in of its form; ``None`` when some part has no entry."""
    parts = drop_in.parts
    entries = [_declared(part) for part in parts]
    if any(entry is None for entry in entries):
        return None
    declared = [entry for entry in entries if entry is not None]

    def grouped(role: Callable[[RowLayoutEntry], LayoutFactory]) -> LayoutFactory:
        def build(_: Any) -> BatchableCache:
            layouts = [role(entry)(part) for entry, part in zip(declared, parts, strict=True)]
            layout: BatchableCache = drop_in.regroup(layouts)
            return layout

        return build

    return RowLayoutEntry(
        type(drop_in),
        grouped(lambda entry: entry.decode),
        grouped(lambda entry: entry.prefill),
        grouped(lambda entry: entry.verify),
    )


def is_batchable(cache: object) -> bool:
    """Structural detection of a row layout (all of ``BatchableCache``'s members)."""
    return isinstance(cache, BatchableCache)


def owned_cache_layout_factory(cache: Cache) -> Callable[[], BatchableCache] | None:
    """The decode layout's factory for ``cache``, or ``None`` when it cannot batch.

    Answers without allocating, so a caller can probe support.
    """
    entry = _declared(cache)
    if entry is not None:
        return lambda: entry.decode(cache)
    if isinstance(cache, BatchableCache):
        layout = cache
        return lambda: layout.make_empty_batch()
    return None


def owned_cache_layout(cache: Cache) -> BatchableCache | None:
    """A new empty decode layout for ``cache``'s rows, or ``None``."""
    factory = owned_cache_layout_factory(cache)
    return None if factory is None else factory()


def prefill_cache_layout(cache: Cache) -> BatchableCache:
    """A new empty prefill layout for ``cache``'s rows."""
    entry = _declared(cache)
    if entry is not None:
        return entry.prefill(cache)
    if isinstance(cache, BatchableCache):
        return cache.make_empty_batch()
    raise NoRowLayoutError(f"No prefill row layout for {cache.signature()}")


def target_row_layout_factory(cache: Cache) -> Callable[[], BatchableCache] | None:
    """The verify layout's factory; table entries only (no batchable fallback)."""
    entry = _declared(cache)
    if entry is None:
        return None
    return lambda: entry.verify(cache)


def target_cache_layout(cache: Cache) -> BatchableCache:
    """A new empty verify layout for ``cache``'s rows."""
    factory = target_row_layout_factory(cache)
    if factory is None:
        raise NoRowLayoutError(f"No target row layout for {cache.signature()}")
    return factory()


def extract_sole_row(cache: Cache) -> Cache | None:
    """A one-row layout's row as an owned serial cache; ``None`` for serial state."""
    if isinstance(cache, BatchableCache) and cache.batch_size == 1:
        return cache.extract_row(0)
    return None


def publish_row(layout: Cache, row: int, tokens: int) -> Cache | None:
    """Row ``row`` as an owned serial cache, or ``None`` when it cannot cover ``tokens``."""
    if isinstance(layout, BatchableCache) and layout.can_publish_row(row, tokens):
        return layout.extract_row(row)
    return None


def filter_layout_rows(layout: Cache, keep: Sequence[int]) -> None:
    """Keep only the rows ``keep`` of a running layout; serial state cannot be filtered."""
    if not isinstance(layout, BatchableCache):
        raise NotBatchableError(
            f"applyFilter: adopted {layout.signature()} state cannot be row-filtered"
        )
    layout.filter_rows(keep)


@dataclass(frozen=True)
class RowAdmission:
    """What a set of per-layer layouts says about admitting one more row."""

    layouts: tuple[BatchableCache, ...]

    def bytes(self, tokens: int) -> int:
        """Projected bytes of one row holding ``tokens`` positions, over all layers."""
        if tokens < 0:
            raise InvalidInputError(f"tokens must be >= 0, got {tokens}")
        return sum(layout.projected_bytes(tokens) for layout in self.layouts)

    def most_bytes(self, tokens: int) -> int:
        """The most bytes one row holds on its way to ``tokens`` positions, over all layers
        (what admission reserves). A paged ring's (or chunked layer's) blocks at a length
        may be fewer than a step before (its window straddled one more block boundary,
        ``kvrows.paged.projected_blocks``); its count repeats every ``block_size``
        positions once the window is full, so its last ``block_size`` lengths bound it.
        Every other layout's bytes grow with its length: its count at ``tokens``."""
        if tokens < 0:
            raise InvalidInputError(f"tokens must be >= 0, got {tokens}")
        total = 0
        for layout in self.layouts:
            # (a contiguous ring or chunked layout has no block size: its bytes grow up to
            # its window)
            geometry = getattr(layout, "token_geometry", None)
            capped = isinstance(layout, RingGeometry) or (
                geometry is not None and geometry.cap() is not None
            )
            span = int(getattr(layout, "block_size", 1)) if capped else 1
            first = max(tokens - span + 1, 0)
            total += max(layout.projected_bytes(t) for t in range(first, tokens + 1))
        return total

    @property
    def max_tokens(self) -> float:
        """Most positions a row may hold in every layer (``math.inf`` if unbounded)."""
        return min((layout.max_tokens for layout in self.layouts), default=math.inf)


def row_admission(caches: Sequence[Cache]) -> RowAdmission | None:
    """``None`` unless every cache is a row layout; else their admission projection."""
    if not all(isinstance(cache, BatchableCache) for cache in caches):
        return None
    return RowAdmission(tuple(cache for cache in caches if isinstance(cache, BatchableCache)))
