"""The growing geometry's spec: full attention, the token axis grows with every append."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from kvrows.geometries.registry import SpecParts, register_geometry
from kvrows.validation import as_count

__all__ = ["Growing"]


@register_geometry
@dataclass(frozen=True, kw_only=True)
class Growing(SpecParts):
    """Full attention: the token axis grows with every append, up to ``max_tokens``
    positions a row (``None``: unbounded; a latent cache's context bound)."""

    max_tokens: int | None = None
    kind: ClassVar[str] = "growing"
    serial_fields: ClassVar[tuple[str, ...]] = ("offset",)
    layout_fields: ClassVar[tuple[str, ...]] = ("offset", "left_padding", "idx")

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            object.__setattr__(
                self, "max_tokens", as_count(self.max_tokens, "max_tokens", minimum=1)
            )

    def parameters(self) -> dict[str, int]:
        # Unbounded (every KV preset) adds nothing to a signature or a constructor.
        return {} if self.max_tokens is None else {"max_tokens": self.max_tokens}

    def cap(self) -> int | None:
        return self.max_tokens

    @classmethod
    def from_parameters(cls, numbers: Mapping[str, Any]) -> Self:
        return cls(max_tokens=numbers.get("max_tokens"))

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> Self:
        return cls(max_tokens=values.get("max_tokens"))
