"""The optimized paged storages: the paged placement (``optimized/paging.py``) on the
optimized row machinery (``spec/PagedKVCache.md``, ``spec/PagedKvRows.md``,
``spec/paged-pool.md``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvrows.compositions import composition
from kvrows.errors import PoolExhaustedError
from kvrows.optimized.paging import BlockPool, PagedLayout, PagedSerial
from kvrows.optimized.speculative import SpeculativeLayout
from kvrows.paged import AnyCodecParameters

__all__ = ["BlockPool", "PagedKVCache", "PagedKvRows"]


class PagedKVCache(AnyCodecParameters, PagedSerial):
    """One request's block table into a ``BlockPool`` (``spec/PagedKVCache.md``)."""

    composition = composition("PagedKVCache")


class PagedKvRows(AnyCodecParameters, SpeculativeLayout, PagedLayout):
    """Block-table rows, all three roles (``spec/PagedKvRows.md``)."""

    composition = composition("PagedKvRows")

    #: An exhausted pool refuses before any block or table changes: the round stays open,
    #: before its block (free blocks or append a shorter one, then resolve it).
    _spec_refused_unchanged = (PoolExhaustedError,)

    def register_prefix(self, row: int, token_ids: Sequence[int]) -> int:
        """Refused in a round: the row's newest positions are unverified drafts."""
        self._spec_guard("register_prefix")
        return super().register_prefix(row, token_ids)


BlockPool.cache_class = PagedKVCache
