"""kvrows.optimized: the MLX implementation of every landed composition.

``classes`` builds one class per composition on the row machinery from the table (the
bf16-first legos among them); this module registers every declared class
(``declared_classes()``) in the row-layout table with one call (the roles come from the
composition table).
"""

from collections.abc import Mapping
from typing import Any

from kvrows.compositions import register_compositions
from kvrows.optimized import classes
from kvrows.optimized.attention import attend
from kvrows.optimized.cache_list import CacheListDropIn, CacheListLayout
from kvrows.optimized.classes import *  # noqa: F403
from kvrows.optimized.latent import EncodedLatentCache
from kvrows.optimized.latent_dropin import LatentCacheList
from kvrows.optimized.mlxlm_batch import BatchKVCache, BatchRotatingKVCache
from kvrows.optimized.paged import (
    BlockPool,
    LatentBlockPool,
    PagedChunkedKVCache,
    PagedChunkedRows,
    PagedKVCache,
    PagedKvRows,
    PagedLatentCache,
    PagedRotatingKVCache,
    PagedRotatingRows,
)
from kvrows.optimized.rows import DECLARED

__all__ = [
    *classes.__all__,
    "BatchKVCache",
    "CacheListDropIn",
    "CacheListLayout",
    "BatchRotatingKVCache",
    "BlockPool",
    "EncodedLatentCache",
    "LatentCacheList",
    "PagedChunkedKVCache",
    "PagedChunkedRows",
    "PagedKVCache",
    "PagedKvRows",
    "LatentBlockPool",
    "PagedLatentCache",
    "PagedRotatingKVCache",
    "PagedRotatingRows",
    "attend",
    "declared_classes",
]


def declared_classes() -> Mapping[str, type[Any]]:
    """Every public class, by composition name: the row storages (``rows.DECLARED``, the
    delayed layouts among them) and the latent and paged classes (what this module
    registers)."""
    latent = (EncodedLatentCache,)  # latent state: its own row machinery
    paged = (  # block tables into a pool
        PagedKVCache,
        PagedKvRows,
        PagedLatentCache,
        PagedRotatingKVCache,
        PagedRotatingRows,
        PagedChunkedKVCache,
        PagedChunkedRows,
    )
    found = (*latent, *paged)
    return {**DECLARED, **{cls.composition.name: cls for cls in found}}


register_compositions(declared_classes())
