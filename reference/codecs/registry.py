"""The reference's array codecs by codec kind (``kvrows.codecs.array_codecs``): each codec
module registers its class with ``@implements(kind)``, and :func:`build` makes the one a
spec names (contract §0.2)."""

from __future__ import annotations

from kvrows.codecs.registry import array_codecs

__all__ = ["IMPLEMENTATIONS", "build", "implements"]

_CODECS = array_codecs("reference")
#: The array codec class of each codec kind.
IMPLEMENTATIONS = _CODECS.classes
implements = _CODECS.implements
build = _CODECS.build
