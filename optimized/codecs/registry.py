"""The optimized implementation's array codecs by codec kind: each codec module registers
its class with ``@implements(kind)``, and :func:`build` makes the one a spec names
(contract §0.2)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvrows.codec import CodecSpec
from kvrows.errors import InvalidInputError, KvRowsError

__all__ = ["IMPLEMENTATIONS", "build", "implements"]

#: The array codec class of each codec kind; it is built from the spec alone.
IMPLEMENTATIONS: dict[str, Callable[[Any], Any]] = {}

CodecClass = TypeVar("CodecClass", bound=type[Any])


def implements(kind: str) -> Callable[[CodecClass], CodecClass]:
    """Class decorator: the optimized implementation's array codec of the ``kind`` codec."""

    def register(codec: CodecClass) -> CodecClass:
        if IMPLEMENTATIONS.get(kind, codec) is not codec:
            raise KvRowsError(f"two optimized codecs implement the {kind} codec")
        IMPLEMENTATIONS[kind] = codec
        return codec

    return register


def build(spec: CodecSpec) -> Any:
    """The optimized implementation's array codec for ``spec``."""
    codec = IMPLEMENTATIONS.get(spec.kind)
    if codec is None:
        raise InvalidInputError(f"the optimized implementation has no {spec.kind} codec yet")
    return codec(spec)
