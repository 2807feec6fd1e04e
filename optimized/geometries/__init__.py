"""The optimized implementation's geometries: one module per geometry kind (``growing``,
``ring``), each a class of hooks over ``kvrows.optimized.rows.Storage`` that the public
classes inherit, registered with ``@implements(kind)``. Importing the package imports
every module it holds, so a new geometry edits no registry file."""

from __future__ import annotations

import importlib
import pkgutil

from kvrows.optimized.geometries.registry import IMPLEMENTATIONS, geometry_class, implements

__all__ = ["IMPLEMENTATIONS", "geometry_class", "implements"]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
