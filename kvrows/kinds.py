"""One registry mechanism for spec classes keyed by their ``kind`` (``spec/contract.md``
§0.10): the codec specs (``kvrows.codecs``) and the geometry specs (``kvrows.geometries``)
each keep one. A kind registers once; the table's order is a fixed key of the classes,
never the order their modules were imported in. Lookups by kind happen here only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvrows.errors import InvalidInputError, KvRowsError

__all__ = ["KindRegistry"]

Spec = TypeVar("Spec")
#: A registered class (the decorator hands the class back, its type kept).
SpecClass = TypeVar("SpecClass", bound=type[Any])


class KindRegistry(Generic[Spec]):
    """Spec classes by ``kind``. ``what`` names them in messages ("codec", "geometry"),
    ``noun`` names one kind ("codec", "token geometry"); ``order`` (with ``order_name``) is
    a key the classes sort by, unique to each (default: the kind itself)."""

    def __init__(
        self,
        what: str,
        noun: str,
        order: Callable[[type[Any]], Any] | None = None,
        order_name: str = "kind",
    ) -> None:
        self.what, self.noun, self.order_name = what, noun, order_name
        self.order: Callable[[type[Any]], Any] = order or (lambda spec: spec.kind)
        #: Every registered class by its kind, in ``order``.
        self.classes: dict[str, type[Spec]] = {}

    def register(self, spec: SpecClass) -> SpecClass:
        """Class decorator: register ``spec`` under its ``kind`` (a kind, and an order key,
        registers once)."""
        kind, key = spec.kind, self.order(spec)
        if self.classes.get(kind, spec) is not spec:
            raise KvRowsError(f"two {self.what} specs register the kind {kind!r}")
        if any(self.order(other) == key for other in self.classes.values() if other is not spec):
            raise KvRowsError(f"two {self.what} specs register the {self.order_name} {key}")
        registered: dict[str, type[Spec]] = {**self.classes, kind: spec}
        self.classes.clear()
        self.classes.update(sorted(registered.items(), key=lambda item: self.order(item[1])))
        return spec

    def holds(self, value: object) -> bool:
        """Whether ``value`` is an instance of the class registered for its kind."""
        kind = getattr(type(value), "kind", None)
        return isinstance(kind, str) and self.classes.get(kind) is type(value)

    def lookup(self, kind: str) -> type[Spec]:
        """The class registered for ``kind`` (``InvalidInputError`` naming the known ones)."""
        spec = self.classes.get(kind)
        if spec is None:
            raise InvalidInputError(
                f"no {self.noun} of kind {kind!r}: expected one of {tuple(self.classes)}"
            )
        return spec
