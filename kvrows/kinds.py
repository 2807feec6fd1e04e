"""One registry mechanism for spec classes keyed by their ``kind`` (``spec/contract.md``
§0.10): the codec specs (``kvrows.codecs``) and the geometry specs (``kvrows.geometries``)
each keep one. A kind registers once; the table's order is a fixed key of the classes,
never the order their modules were imported in. Lookups by kind happen here only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from kvrows.errors import InvalidInputError, KvRowsError

__all__ = ["Implementations", "KindRegistry"]

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


#: A class an implementation registers for a kind (the decorator hands it back, typed).
ImplementationClass = TypeVar("ImplementationClass", bound=type[Any])


class Implementations:
    """One implementation's classes by spec kind (its geometry hooks, its array codecs):
    each module of the
    implementation's package registers its class with :meth:`implements`, and
    :meth:`build` makes the one a spec's ``kind`` names. Only kinds and classes move
    here, so the twins share the mechanism and keep their arrays apart."""

    def __init__(
        self, implementation: str, what: str, missing: Callable[[str], str] | None = None
    ) -> None:
        #: How messages name the implementation and what it registers.
        self.implementation, self.what = implementation, what
        #: The message for a kind nothing implements (``None``: the generic one).
        self._missing = missing
        #: The class of each kind; it is built from the spec alone.
        self.classes: dict[str, type[Any]] = {}

    def implements(self, kind: str) -> Callable[[ImplementationClass], ImplementationClass]:
        """Class decorator: this implementation's class of the ``kind`` spec."""

        def register(implementation: ImplementationClass) -> ImplementationClass:
            if self.classes.get(kind, implementation) is not implementation:
                raise KvRowsError(
                    f"two {self.implementation} {self.what} classes implement {kind!r}"
                )
            self.classes[kind] = implementation
            return implementation

        return register

    def lookup(self, kind: str) -> type[Any]:
        """The class registered for ``kind``."""
        implementation = self.classes.get(kind)
        if implementation is None:
            raise InvalidInputError(
                self._missing(kind)
                if self._missing is not None
                else f"the {self.implementation} has no {self.what} of kind {kind!r}: "
                f"expected one of {tuple(self.classes)}"
            )
        return implementation

    def build(self, spec: Any) -> Any:
        """This implementation's object for ``spec`` (by ``spec.kind``)."""
        return self.lookup(spec.kind)(spec)
