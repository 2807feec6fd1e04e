"""The growing geometry's spec: full attention, the token axis grows with every append."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvrows.geometries.registry import SpecParts, register_geometry

__all__ = ["Growing"]


@register_geometry
@dataclass(frozen=True, kw_only=True)
class Growing(SpecParts):
    """Full attention: the token axis grows with every append."""

    kind: ClassVar[str] = "growing"
    serial_fields: ClassVar[tuple[str, ...]] = ("offset",)
    layout_fields: ClassVar[tuple[str, ...]] = ("offset", "left_padding", "idx")
