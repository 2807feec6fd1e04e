"""The optimized implementation's geometry classes by geometry kind
(``kvrows.kinds.Implementations``): each geometry module registers its base class with
``@implements(kind)``; :func:`geometry_class` answers the one a composition names."""

from __future__ import annotations

from kvrows.kinds import Implementations

__all__ = ["IMPLEMENTATIONS", "geometry_class", "implements"]

_GEOMETRIES = Implementations("optimized implementation", "geometry")
#: The geometry base class of each geometry kind (public classes inherit it).
IMPLEMENTATIONS = _GEOMETRIES.classes
implements = _GEOMETRIES.implements


def geometry_class(kind: str) -> type:
    """The geometry class registered for ``kind`` (``InvalidInputError`` when none)."""
    return _GEOMETRIES.lookup(kind)
