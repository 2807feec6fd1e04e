"""The reference's geometries: one module per geometry kind (``growing``, ``ring``), each
registering its hooks class (``kvrows.reference.rows.TokenAxis``) with
``@implements(kind)``; :func:`build` makes the one a spec names. Importing the package
imports every module it holds, so a new geometry edits no registry file."""

from __future__ import annotations

import importlib
import pkgutil

from kvrows.reference.geometries.registry import IMPLEMENTATIONS, build, implements

__all__ = ["IMPLEMENTATIONS", "build", "implements"]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
