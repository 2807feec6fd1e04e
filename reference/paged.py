"""The reference's paged KV storages: the declarations (``spec/PagedKVCache.md``,
``spec/PagedKvRows.md``, ``spec/paged-pool.md``).

Their machinery is the reference's row machinery with the paged placement of
``reference/paging.py``: compact rows whose tokens also live in a NumPy block pool.
"""

from __future__ import annotations

from kvrows.compositions import composition
from kvrows.paged import AnyCodecParameters
from kvrows.reference.paging import BlockPool, PagedLayout, PagedSerial

__all__ = ["BlockPool", "PagedKVCache", "PagedKvRows"]


class PagedKVCache(AnyCodecParameters, PagedSerial):
    """One request's block table into a ``BlockPool`` (``spec/PagedKVCache.md``)."""

    composition = composition("PagedKVCache")


class PagedKvRows(AnyCodecParameters, PagedLayout):
    """Block-table rows, all three roles (``spec/PagedKvRows.md``)."""

    composition = composition("PagedKvRows")
    serial_class = PagedKVCache


BlockPool.cache_class = PagedKVCache
