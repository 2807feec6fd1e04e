"""The reference's geometry hooks by geometry kind (``kvrows.kinds.Implementations``):
each geometry module registers its class with ``@implements(kind)``, and :func:`build`
makes the one a spec names (contract §0.3)."""

from __future__ import annotations

from kvrows.kinds import Implementations

__all__ = ["IMPLEMENTATIONS", "build", "implements"]

_GEOMETRIES = Implementations("reference", "geometry")
#: The hooks class of each geometry kind.
IMPLEMENTATIONS = _GEOMETRIES.classes
implements = _GEOMETRIES.implements
build = _GEOMETRIES.build
