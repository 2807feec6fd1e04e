"""kvrows.reference: the NumPy executable specification of every storage and layout.

``classes.py`` builds the public classes from the composition table, ``rows.py`` is
the row machinery they share, ``geometries/`` the geometries' hooks (one module per kind),
``codecs/`` the codecs (one module per kind) and attention, ``affine_codec.py`` ``mx.quantize`` in NumPy; ``delayed.py`` the delayed modifier's array
helpers for layouts.
"""

from kvrows.compositions import register_compositions
from kvrows.reference.classes import *  # noqa: F403  (the public classes)
from kvrows.reference.classes import __all__ as _classes
from kvrows.reference.classes import declared_classes
from kvrows.reference.codecs import attend, attention
from kvrows.reference.latent import EncodedLatentCache
from kvrows.reference.paged import (
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

__all__ = [
    *_classes,
    "EncodedLatentCache",
    "BlockPool",
    "PagedChunkedKVCache",
    "PagedChunkedRows",
    "PagedKVCache",
    "PagedKvRows",
    "LatentBlockPool",
    "PagedLatentCache",
    "PagedRotatingKVCache",
    "PagedRotatingRows",
    "attend",
    "attention",
]

register_compositions(declared_classes())
