"""The plain codec's spec: unquantized storage in the activation dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvrows.codec import PlaneSpec, Reads, Role
from kvrows.codecs.registry import SpecParts, register_codec

__all__ = ["Plain"]


@register_codec
@dataclass(frozen=True, kw_only=True)
class Plain(SpecParts):
    """Unquantized storage in the activation dtype."""

    kind: ClassVar[str] = "plain"
    names: ClassVar[tuple[str, ...]] = ("plain",)
    syntax: ClassVar[str] = "plain"
    state_tail: ClassVar[tuple[str, ...]] = ()
    encodes: ClassVar[bool] = False
    reads: ClassVar[Reads] = "dense"
    tag: ClassVar[int] = 0
    paged_fields: ClassVar[tuple[str, ...]] = ()
    dtype_plane: ClassVar[int | None] = 0
    plane_labels: ClassVar[tuple[str, ...]] = ()

    @property
    def key(self) -> str:
        """The codec identity rows must share to join one layout."""
        return "plain"

    @property
    def name(self) -> str:
        """The scheme's name on the command line."""
        return "plain"

    def parameters(self) -> dict[str, int]:
        return {}

    @classmethod
    def parse(cls, text: str) -> Plain | None:
        return cls() if text == "plain" else None

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        return (PlaneSpec(name, 2, dtype, dim),)

    def head_dim(self, width: int, role: Role) -> int:
        return width
