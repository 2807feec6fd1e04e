"""The affine codec's spec: MLX affine group quantization (``spec/affine-codec.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvrows.affine_geometry import groups, packed_width, validate_codec, validate_params
from kvrows.codec import PlaneSpec, Reads, Role
from kvrows.codecs.registry import SpecParts, register_codec

__all__ = ["Affine"]


@register_codec
@dataclass(frozen=True, kw_only=True)
class Affine(SpecParts):
    """MLX affine group quantization (``mx.quantize``): ``bits`` per value, one scale and
    one bias per ``group_size`` values."""

    bits: int = 8
    group_size: int = 64
    kind: ClassVar[str] = "affine"
    names: ClassVar[tuple[str, ...]] = ("affine8", "affine4", "affine4:32")
    syntax: ClassVar[str] = "affine<bits>[:<group>] (affine8, affine4:32)"
    state_tail: ClassVar[tuple[str, ...]] = ("group_size", "bits")
    encodes: ClassVar[bool] = True
    reads: ClassVar[Reads] = "affine"
    tag: ClassVar[int] = 1
    paged_fields: ClassVar[tuple[str, ...]] = ("bits", "group_size")
    dtype_plane: ClassVar[int | None] = 1  # the scales
    plane_labels: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        validate_params(self.group_size, self.bits)

    @property
    def key(self) -> str:
        return f"affine:{self.bits}:{self.group_size}"

    @property
    def name(self) -> str:
        return f"affine{self.bits}:{self.group_size}"

    def parameters(self) -> dict[str, int]:
        return {"bits": self.bits, "group_size": self.group_size}

    @classmethod
    def parse(cls, text: str) -> Affine | None:
        """``affine<bits>[:<group>]``; bare ``affine`` is 8 bits, the group 64."""
        if not text.startswith("affine"):
            return None
        bits, _, group = (text[len("affine") :] or "8").partition(":")
        if bits.isdigit() and (group == "" or group.isdigit()):
            return cls(bits=int(bits), group_size=int(group or 64))
        return None

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        count = groups(dim, self.group_size)
        return (
            PlaneSpec(name, 2, "uint32", packed_width(dim, self.bits)),
            PlaneSpec(f"{name}.scales", 2, dtype, count),
            PlaneSpec(f"{name}.biases", 2, dtype, count),
        )

    def check_head_dim(self, dim: int) -> None:
        validate_codec(dim, self.group_size, self.bits)

    def head_dim(self, width: int, role: Role) -> int:
        # Codes packed bit after bit in uint32 words (3, 5 and 6 bits cross words).
        return width * 32 // self.bits
