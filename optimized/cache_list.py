"""Several kvrows caches as one layer's cache of an unmodified mlx-lm model.

mlx-lm gives each layer of some models a ``CacheList`` of several caches: falcon_h1 a
Mamba2 ``ArraysCache`` beside the attention's ``KVCache``, baichuan_m1 an ``ArraysCache(2)``
(the last key and value of its short convolution) beside a ``KVCache`` or a
``RotatingKVCache``. The model indexes the list (``cache[0]``, ``cache[1]``) and hands each
part to the module that writes it; it never writes the list itself.

:class:`CacheListDropIn` is that list over kvrows caches (``make_kvrows_cache`` builds one
per such layer), with mlx-lm's ``CacheList`` names (its ``BatchGenerator`` runs on it). It
is a ``kvrows.protocols.DropInParts``: the row-layout table gives it, per role, each part's
own layout grouped in a new drop-in (``regroup``). Over row layouts that drop-in is a
:class:`CacheListLayout`, a row layout (``BatchableCache``, ``SpeculativeRowLayout``) whose
operations are its parts', in order; over serial caches it answers no row-layout member,
as its parts do not. An operation that changes rows is checked by every part before any
part changes (a refusal leaves every part as it was): ``merge_rows`` is each part's
``check_merge`` (its machinery's checks of the rows, without joining them: a
``kvrows.protocols.MergeChecking``), then each part's ``merge_rows``; ``filter_rows``
checks the rows and the rounds first; a round begins only where every part is a verify
layout.

The engine's paged option pages such a layer part by part (its attention part a paged
cache, regrouped here), and its disk prefix store saves the parts, each through its own
persistence form, regrouping them on load (``spec/engine.md`` §16): the store's files have
no record for a list of caches, and need none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrows.errors import (
    MERGE_NEEDS_SEQUENCE,
    IncompatibleRowsError,
    InvalidInputError,
    NotTrimmableError,
    SpeculativeRoundError,
    self_merge_message,
)
from kvrows.protocols import (
    BatchableCache,
    Cache,
    MergeChecking,
    SpeculativeRowLayout,
    StateDisposer,
)
from kvrows.validation import as_count, check_keep

__all__ = ["CacheListDropIn", "CacheListLayout"]


def cache_list_of(parts: Sequence[Any]) -> CacheListDropIn:
    """The drop-in over ``parts``: a row layout (:class:`CacheListLayout`) where every part
    is one, else the serial form (a serial drop-in answers no row-layout members, as its
    parts do not)."""
    if all(isinstance(part, BatchableCache) for part in parts):
        return CacheListLayout(*parts)
    return CacheListDropIn(*parts)


def _check_part_merge(part: Any, rows: list[Any]) -> None:
    """Raise what ``part.merge_rows(rows)`` would raise, changing nothing: the part's own
    check, or for a part without one (a batchable cache of no kvrows row machinery: every
    kvrows layout has ``check_merge`` since ``LatentRows`` went) a trial merge into a fresh
    empty layout of the part, which checks the rows but not what the running part adds
    (its pool's room)."""
    if isinstance(part, MergeChecking):
        part.check_merge(rows)
    else:
        part.make_empty_batch().merge_rows(rows)


class CacheListDropIn:
    """mlx-lm's ``CacheList`` over kvrows caches (``parts``, in the model's order)."""

    def __init__(self, *parts: Any) -> None:
        if not parts:
            raise InvalidInputError("CacheListDropIn needs at least one cache")
        for index, part in enumerate(parts):
            if not isinstance(part, Cache):
                raise InvalidInputError(
                    f"CacheListDropIn part {index} must be a kvrows cache, got "
                    f"{type(part).__name__}"
                )
        self.caches: tuple[Any, ...] = tuple(parts)

    # -- DropInParts ----------------------------------------------------------------------
    @property
    def parts(self) -> tuple[Any, ...]:
        return self.caches

    def regroup(self, parts: Sequence[Any]) -> CacheListDropIn:
        """A new drop-in of this form over ``parts`` (one per part of this one): a row
        layout where every part is one."""
        if len(parts) != len(self.caches):
            raise InvalidInputError(
                f"this CacheList has {len(self.caches)} parts, got {len(parts)} caches"
            )
        return cache_list_of(parts)

    # -- what the model reads ---------------------------------------------------------------
    def __getitem__(self, index: int) -> Any:
        return self.caches[index]

    def __len__(self) -> int:
        return len(self.caches)

    def __bool__(self) -> bool:
        return True

    @property
    def offset(self) -> Any:
        """The last part's offset (the models read their parts' offsets, never the
        list's; the attention part comes last in every mlx-lm ``CacheList``)."""
        return self.caches[-1].offset

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        return self.caches[-1].make_mask(n, return_array=return_array, window_size=window_size)

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        raise InvalidInputError(
            "a CacheList takes no keys and values itself: the model writes its parts "
            "(cache[0], cache[1], …)"
        )

    def fetch(self) -> tuple[Any, Any]:
        raise InvalidInputError("a CacheList holds no keys and values itself: read its parts")

    # -- Cache ----------------------------------------------------------------------------
    @property
    def state(self) -> tuple[Any, ...]:
        """Each part's state, in order (what mlx-lm's generate evaluates)."""
        return tuple(part.state for part in self.caches)

    def held_arrays(self) -> tuple[Any, ...]:
        return tuple(array for part in self.caches for array in part.held_arrays())

    @property
    def state_needs_dispose(self) -> bool:
        return any(part.state_needs_dispose for part in self.caches)

    def dispose_state(self, state: tuple[Any, ...]) -> None:
        """Hand each part's state back to the part that built it."""
        for part, held in zip(self.caches, state, strict=True):
            if part.state_needs_dispose and isinstance(part, StateDisposer):
                part.dispose_state(held)

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self.caches)

    def signature(self) -> str:
        return f"CacheList({', '.join(part.signature() for part in self.caches)})"

    def is_trimmable(self) -> bool:
        return all(part.is_trimmable() for part in self.caches)

    def trim(self, n: int) -> int:
        """Trim every part by ``n``; refused, changing nothing, unless every part is
        trimmable (recurrent state is not: ``trim(0)`` only)."""
        count = as_count(n, "n")
        if count and not self.is_trimmable():
            raise NotTrimmableError(
                f"{self.signature()} cannot trim: some part cannot forget tokens"
            )
        return min(int(part.trim(count)) for part in self.caches)

    def size(self) -> int:
        """mlx-lm's ``size``: the longest part."""
        return max(int(part.size()) for part in self.caches)

    def empty(self) -> bool:
        return all(part.empty() for part in self.caches)

    # -- mlx-lm's CacheList names (its BatchGenerator merges, filters, extends) -----------
    @classmethod
    def merge(cls, caches: Sequence[Any]) -> CacheListDropIn:
        """mlx-lm's ``CacheList.merge``: per part, that part's class's ``merge``."""
        if isinstance(caches, str | bytes) or not isinstance(caches, Sequence) or not caches:
            raise InvalidInputError("CacheList.merge needs a non-empty sequence of caches")
        width = len(caches[0].caches)
        return cache_list_of(
            [caches[0].caches[i].merge([cache.caches[i] for cache in caches]) for i in range(width)]
        )

    def extract(self, idx: int) -> CacheListDropIn:
        return self.regroup([part.extract(idx) for part in self.caches])

    def filter(self, batch_indices: Any) -> None:
        for part in self.caches:
            part.filter(batch_indices)

    def extend(self, other: Any) -> None:
        for part, joined in zip(self.caches, other.caches, strict=True):
            part.extend(joined)

    def prepare(self, **kwargs: Any) -> None:
        for part in self.caches:
            part.prepare(**kwargs)

    def finalize(self) -> None:
        for part in self.caches:
            part.finalize()


class CacheListLayout(CacheListDropIn):
    """A ``CacheListDropIn`` over row layouts: a row layout (``BatchableCache``) and a
    verify layout whose operations are its parts', in order."""

    def __init__(self, *parts: Any) -> None:
        super().__init__(*parts)
        for index, part in enumerate(self.caches):
            if not isinstance(part, BatchableCache):
                raise InvalidInputError(
                    f"CacheListLayout part {index} must be a row layout, got {type(part).__name__}"
                )

    # -- BatchableCache: every part's, in order -------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self.caches[0].batch_size)

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Per row, the most tokens any part counts (recurrent state that never advances,
        baichuan_m1's, counts none)."""
        return tuple(
            max(offsets) for offsets in zip(*(p.row_offsets for p in self.caches), strict=True)
        )

    @property
    def left_pad(self) -> tuple[int, ...]:
        return tuple(max(pads) for pads in zip(*(p.left_pad for p in self.caches), strict=True))

    @property
    def max_tokens(self) -> float:
        return min(float(part.max_tokens) for part in self.caches)

    def make_empty_batch(self) -> CacheListDropIn:
        return self.regroup([part.make_empty_batch() for part in self.caches])

    def _sources(self, rows: Sequence[Any]) -> list[list[Any]]:
        """Per part, that part of every row (each row a CacheList of this form)."""
        if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
            raise InvalidInputError(MERGE_NEEDS_SEQUENCE)
        if any(row is self for row in rows) or len({id(row) for row in rows}) != len(rows):
            raise IncompatibleRowsError(self_merge_message(self.signature()))
        width = len(self.caches)
        for index, row in enumerate(rows):
            parts = getattr(row, "parts", None)
            if parts is None or len(parts) != width:
                raise InvalidInputError(
                    f"merge_rows: rows[{index}] must be a CacheList of {width} parts, got "
                    f"{type(row).__name__}"
                )
        return [[row.parts[i] for row in rows] for i in range(width)]

    def check_merge(self, rows: Sequence[Any]) -> None:
        """Raise what ``merge_rows(rows)`` would raise, changing no part: each part's own
        check of its share of the rows (a ``MergeChecking``)."""
        sources = self._sources(rows)
        self._no_open_round("merge_rows")
        for part, part_rows in zip(self.caches, sources, strict=True):
            _check_part_merge(part, part_rows)

    def merge_rows(self, rows: Sequence[Any]) -> None:
        """Join ``rows`` (CacheLists of this form) part by part: every part checks its
        share first (:meth:`check_merge`), so a refusal changes no part; then each part's
        own ``merge_rows`` joins it."""
        self.check_merge(rows)
        for part, part_rows in zip(self.caches, self._sources(rows), strict=True):
            part.merge_rows(part_rows)

    def extend(self, other: Any) -> None:
        """mlx-lm's ``extend``: each part's ``extend`` with ``other``'s part, once every part
        has checked its share (a refusal changes no part); a part without mlx-lm's name
        (a paged layout) joins by its ``merge_rows``."""
        self.check_merge([other])
        for part, joined in zip(self.caches, self._sources([other]), strict=True):
            own = getattr(part, "extend", None)
            if callable(own):
                own(joined[0])
            else:
                part.merge_rows(joined)

    def filter_rows(self, keep: Sequence[int]) -> None:
        """Keep the rows ``keep`` in every part; keeping none leaves empty parts."""
        rows = check_keep(keep, self.batch_size)
        self._no_open_round("filter_rows")
        if not rows:
            self.caches = tuple(part.make_empty_batch() for part in self.caches)
            return
        for part in self.caches:
            part.filter_rows(rows)

    def extract_row(self, row: int) -> CacheListDropIn:
        return self.regroup([part.extract_row(row) for part in self.caches])

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """Only where every part can (recurrent state: at exactly its coverage)."""
        return all(part.can_publish_row(row, tokens) for part in self.caches)

    def projected_bytes(self, tokens: int) -> int:
        return sum(int(part.projected_bytes(tokens)) for part in self.caches)

    # -- SpeculativeRowLayout: only where every part runs rounds --------------------------
    def _no_open_round(self, operation: str) -> None:
        if self.spec_round_open:
            raise SpeculativeRoundError(
                f"{operation} in the middle of a speculative round: commit or roll back the "
                "round first"
            )

    def _rounds(self) -> list[Any]:
        parts = [part for part in self.caches if isinstance(part, SpeculativeRowLayout)]
        if len(parts) != len(self.caches):
            raise SpeculativeRoundError(
                f"{self.signature()} cannot run speculative rounds: some part has no "
                "verify rounds (not a verify layout)"
            )
        return parts

    @property
    def spec_round_open(self) -> bool:
        return any(
            bool(part.spec_round_open)
            for part in self.caches
            if isinstance(part, SpeculativeRowLayout)
        )

    def spec_round_begin(self) -> None:
        parts = self._rounds()
        self._no_open_round("spec_round_begin")
        for part in parts:
            part.spec_round_begin()

    def spec_round_commit(self) -> None:
        for part in self._rounds():
            part.spec_round_commit()

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        for part in self._rounds():
            part.spec_round_rollback(keep)
