"""The token-geometry specs, one module per kind, and their registry (``spec/contract.md``
§0.3).

``GEOMETRIES`` maps each kind to its spec class; :func:`geometry_class` looks one up by
the kind a composition names. Importing the package imports every module it holds, so a
geometry added as a new module registers itself.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvrows.geometries.growing import Growing
from kvrows.geometries.recurrent import Recurrent, Replay, valid_counts
from kvrows.geometries.registry import (
    GEOMETRIES,
    GeometrySpec,
    geometry_class,
    is_geometry_spec,
    register_geometry,
)
from kvrows.geometries.ring import Ring

__all__ = [
    "GEOMETRIES",
    "GeometrySpec",
    "Growing",
    "Recurrent",
    "Replay",
    "Ring",
    "geometry_class",
    "is_geometry_spec",
    "register_geometry",
    "valid_counts",
]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
