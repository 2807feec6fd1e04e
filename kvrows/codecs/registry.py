"""The codec registry: every codec spec kind, by its ``kind`` (``spec/contract.md`` §0.2).

Each module of ``kvrows.codecs`` registers its spec with :func:`register_codec`; the
package imports every module it holds, so a new codec is a new module and edits no
registry. These lookups are the only place a codec kind is looked up by its name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, ClassVar, Self, TypeGuard, TypeVar

from kvrows.codec import CodecSpec, Role
from kvrows.errors import InvalidInputError, no_array_codec_message
from kvrows.kinds import Implementations, KindRegistry

__all__ = [
    "CODECS",
    "KV_TENSORS",
    "SpecParts",
    "array_codecs",
    "codec_from_tail",
    "is_codec_spec",
    "is_kv_codec",
    "kv_codecs",
    "parse_codec",
    "register_codec",
]

#: Every registered codec spec class by its ``kind``, in the order of their ``tag``s (so
#: the order never depends on which module was imported first).
_REGISTRY: KindRegistry[CodecSpec] = KindRegistry(
    "codec", "codec", order=lambda spec: spec.tag, order_name="tag"
)
CODECS: dict[str, type[CodecSpec]] = _REGISTRY.classes

#: The tensors of a KV codec: what attention caches hand in per token.
KV_TENSORS: tuple[str, ...] = ("keys", "values")

#: A codec spec class (the decorator hands the class back, its type kept).
SpecClass = TypeVar("SpecClass", bound=type[CodecSpec])


def register_codec(spec: SpecClass) -> SpecClass:
    """Class decorator: register ``spec`` under its ``kind`` (a kind and a tag register
    once)."""
    return _REGISTRY.register(spec)


def is_codec_spec(value: object) -> TypeGuard[CodecSpec]:
    """Whether ``value`` is a spec of a registered codec kind."""
    return _REGISTRY.holds(value)


def is_kv_codec(spec: type[CodecSpec] | CodecSpec) -> bool:
    """Whether ``spec`` (a class or an instance) stores ``keys`` and ``values`` (a KV
    scheme, what a block pool stores), asked of its tensors, never of its kind."""
    return spec.tensors() == KV_TENSORS


def kv_codecs() -> dict[str, type[CodecSpec]]:
    """The registered KV codecs (:func:`is_kv_codec`) by kind, in ``CODECS`` order."""
    return {kind: spec for kind, spec in CODECS.items() if is_kv_codec(spec)}


def parse_codec(text: str) -> CodecSpec:
    """The KV codec spec one scheme word names (``plain``, ``affine4:32``, ``turbo-k4v3``)."""
    schemes = kv_codecs().values()
    for spec in schemes:
        parsed = spec.parse(text)
        if parsed is not None:
            return parsed
    raise InvalidInputError(
        f"unknown KV scheme {text!r}: expected {', '.join(s.syntax for s in schemes)}"
    )


def codec_from_tail(kind: str, values: Mapping[str, Any]) -> CodecSpec:
    """The ``kind`` codec spec a saved state's tail fields (``values``) describe."""
    return _REGISTRY.lookup(kind).from_tail(values)


class SpecParts:
    """What every codec spec derives from its dataclass fields and ``state_tail``."""

    state_tail: ClassVar[tuple[str, ...]]

    @property
    def key(self) -> str:
        raise NotImplementedError

    def signature_part(self) -> str:
        return self.key

    @classmethod
    def tensors(cls, shapes: object = None) -> tuple[str, ...]:
        """The tensors a caller hands in (a KV codec's: ``keys``, ``values``)."""
        return KV_TENSORS

    def tail(self) -> dict[str, int]:
        values: dict[str, int] = {name: getattr(self, name) for name in self.state_tail}
        return values

    @classmethod
    def from_tail(cls, values: Mapping[str, Any]) -> Self:
        return cls(**{name: values[name] for name in cls.state_tail})

    @classmethod
    def from_parameters(cls, numbers: Mapping[str, Any]) -> Self:
        return cls(**{field.name: numbers[field.name] for field in fields(cls)})  # type: ignore[arg-type]

    def check_head_dim(self, dim: int) -> None:
        return None

    def check_plane_width(self, label: str, width: int, role: Role) -> None:
        return None

    def check_stored_head_dim(self, side: str, dim: int) -> None:
        return None

    def check_token_geometry(self, owner: str, token_geometry: object) -> None:
        return None


def array_codecs(implementation: str) -> Implementations:
    """One implementation's array codec classes by codec kind: each codec module of the
    implementation registers its class with ``implements``, and ``build`` makes the one a
    spec names (the one registry mechanism, :class:`kvrows.kinds.Implementations`)."""
    return Implementations(
        implementation,
        "array codec",
        missing=lambda kind: no_array_codec_message(implementation, kind),
    )
