"""The geometry registry: every token-geometry spec kind, by its ``kind`` (``spec/contract.md``
§0.3).

Each module of ``kvrows.geometries`` registers its spec with :func:`register_geometry`; the
package imports every module it holds, so a new geometry is a new module and edits no
registry. These lookups are the only place a geometry kind is looked up by its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, ClassVar, Protocol, Self, TypeGuard, TypeVar

from kvrows.kinds import KindRegistry

__all__ = [
    "GEOMETRIES",
    "GeometrySpec",
    "SpecParts",
    "geometry_class",
    "is_geometry_spec",
    "register_geometry",
]


class GeometrySpec(Protocol):
    """How a storage organises the token axis: the frozen, array-free part of a geometry
    (which tokens a row keeps and what a query sees are each implementation's hooks)."""

    #: Registry key: ``"growing"``, ``"ring"``.
    kind: ClassVar[str]
    #: ``False``: the planes have no token axis (recurrent state).
    token_axis: ClassVar[bool]
    #: A row's columns wrap around a buffer of ``cap()`` positions: saved forms hold them in
    #: buffer order with the write index ``idx`` (``kvrows.forms.chronological`` puts them
    #: in time order), and a ragged row starts at column 0 with no left pad.
    wraps: ClassVar[bool]
    #: A row forgets its oldest positions as it grows (chunked): a saved row may hold fewer
    #: columns than its offset without wrapping.
    evicts: ClassVar[bool]
    #: A serial storage's saved-form fields after its planes (mlx-lm's order).
    serial_fields: ClassVar[tuple[str, ...]]
    #: A layout's saved-form fields after its planes (mlx-lm's batch order).
    layout_fields: ClassVar[tuple[str, ...]]
    #: Parameters a layout's saved form leaves out (mlx-lm's batch ring has no ``keep``):
    #: files carry them in their metadata and ``from_state`` takes them.
    layout_form_omits: ClassVar[tuple[str, ...]]

    def parameters(self) -> dict[str, int]:
        """Constructor and signature parameters (``{"max_size": 8, "keep": 0}``)."""
        ...

    def cap(self) -> int | None:
        """Positions a row stores at most (``None``: unbounded)."""
        ...

    @classmethod
    def from_parameters(cls, numbers: Mapping[str, Any]) -> Self:
        """The spec of a constructor's parameters (``KeyError`` if one is missing)."""
        ...

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> Self:
        """The spec a saved state's fields describe (a missing parameter: its default)."""
        ...


#: Every registered geometry spec class by its ``kind``, in the order of their kinds (so the
#: order never depends on which module was imported first).
_REGISTRY: KindRegistry[GeometrySpec] = KindRegistry("geometry", "token geometry")
GEOMETRIES: dict[str, type[GeometrySpec]] = _REGISTRY.classes

#: A geometry spec class (the decorator hands the class back, its type kept).
SpecClass = TypeVar("SpecClass", bound=type[GeometrySpec])


def register_geometry(spec: SpecClass) -> SpecClass:
    """Class decorator: register ``spec`` under its ``kind`` (a kind registers once)."""
    return _REGISTRY.register(spec)


def is_geometry_spec(value: object) -> TypeGuard[GeometrySpec]:
    """Whether ``value`` is a spec of a registered geometry kind."""
    return _REGISTRY.holds(value)


def geometry_class(kind: str) -> type[GeometrySpec]:
    """The spec class registered for ``kind``."""
    return _REGISTRY.lookup(kind)


class SpecParts:
    """What every geometry spec derives from its dataclass fields."""

    token_axis: ClassVar[bool] = True
    wraps: ClassVar[bool] = False
    evicts: ClassVar[bool] = False
    layout_form_omits: ClassVar[tuple[str, ...]] = ()

    def parameters(self) -> dict[str, int]:
        values: dict[str, int] = {field.name: getattr(self, field.name) for field in fields(self)}  # type: ignore[arg-type]
        return values

    def cap(self) -> int | None:
        return None

    @classmethod
    def from_parameters(cls, numbers: Mapping[str, Any]) -> Self:
        return cls(**{field.name: numbers[field.name] for field in fields(cls)})  # type: ignore[arg-type]

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> Self:
        names = [field.name for field in fields(cls)]  # type: ignore[arg-type]
        return cls(**{name: values[name] for name in names if name in values})
