"""The microscaling codecs' spec: MLX's ``mxfp8``, ``mxfp4`` and ``nvfp4`` quantization
modes (``spec/mx-codec.md``).

Each group of ``group_size`` values along the head dim shares one scale; each value is a
small float: FP8 E4M3 (``mxfp8``) or FP4 E2M1 (``mxfp4``, ``nvfp4``). The ``mx`` modes
scale by a power of two (an E8M0 byte, 32 values a group), ``nvfp4`` by an FP8 E4M3 byte
(16 values a group). A tensor is two planes: the codes packed in ``uint32`` words and the
``uint8`` scales. The three modes are the three ``(group_size, bits)`` pairs MLX accepts,
so the pair names the mode (the constructor parameters of the presets, as the affine
codec's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvrows.codec import PlaneSpec, Reads, Role
from kvrows.codecs.registry import SpecParts, register_codec
from kvrows.errors import InvalidInputError

__all__ = ["MX_HEAD_DIM_STEP", "MX_MODES", "Microscaled"]

#: Each mode's ``(group_size, bits)``, as ``mx.quantize`` requires them.
MX_MODES: dict[str, tuple[int, int]] = {"mxfp8": (32, 8), "mxfp4": (32, 4), "nvfp4": (16, 4)}
#: Head dims every mode stores: multiples of 32.
MX_HEAD_DIM_STEP = 32


@register_codec
@dataclass(frozen=True, kw_only=True)
class Microscaled(SpecParts):
    """A microscaling float mode of ``mx.quantize``: ``bits``-bit float elements (8: E4M3,
    4: E2M1), one ``uint8`` scale per ``group_size`` values (32: a power of two, E8M0;
    16: FP8 E4M3). The default is ``mxfp4``."""

    group_size: int = 32
    bits: int = 4
    kind: ClassVar[str] = "mx"
    names: ClassVar[tuple[str, ...]] = tuple(MX_MODES)
    syntax: ClassVar[str] = "mxfp8, mxfp4 or nvfp4"
    state_tail: ClassVar[tuple[str, ...]] = ("group_size", "bits")
    encodes: ClassVar[bool] = True
    # Reads are the codes and scales: only this codec's attention (its quantized_matmul
    # mode) is right over them.
    reads: ClassVar[Reads] = "own"
    tag: ClassVar[int] = 5
    paged_fields: ClassVar[tuple[str, ...]] = ("group_size", "bits")
    # Codes and uint8 scales: no plane carries the activations' dtype.
    dtype_plane: ClassVar[int | None] = None
    plane_labels: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        pair = (self.group_size, self.bits)
        if pair not in MX_MODES.values() or any(isinstance(n, bool) for n in pair):
            modes = ", ".join(f"{m} (group_size={g}, bits={b})" for m, (g, b) in MX_MODES.items())
            raise InvalidInputError(
                f"no microscaling mode has group_size={self.group_size!r}, "
                f"bits={self.bits!r}: the modes are {modes}"
            )

    @property
    def mode(self) -> str:
        """The ``mx.quantize`` mode: ``mxfp8``, ``mxfp4`` or ``nvfp4``."""
        return next(m for m, pair in MX_MODES.items() if pair == (self.group_size, self.bits))

    @property
    def key(self) -> str:
        return self.mode

    @property
    def name(self) -> str:
        return self.mode

    def parameters(self) -> dict[str, int]:
        return {"group_size": self.group_size, "bits": self.bits}

    @classmethod
    def parse(cls, text: str) -> Microscaled | None:
        if text not in MX_MODES:
            return None
        group_size, bits = MX_MODES[text]
        return cls(group_size=group_size, bits=bits)

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        return (
            PlaneSpec(name, 2, "uint32", dim * self.bits // 32),
            PlaneSpec(f"{name}.scales", 2, "uint8", dim // self.group_size),
        )

    def check_head_dim(self, dim: int) -> None:
        # MLX packs FP4 codes 32 values at a time across rows: a head dim of 16 (nvfp4's
        # group) fails in mx.quantize for an odd count of rows, so 32 for every mode.
        if dim < 1 or dim % MX_HEAD_DIM_STEP:
            raise InvalidInputError(
                f"{self.mode} stores head dims that are multiples of {MX_HEAD_DIM_STEP}, got {dim}"
            )

    def head_dim(self, width: int, role: Role) -> int:
        return width * 32 // self.bits

    def check_plane_width(self, label: str, width: int, role: Role) -> None:
        dim = self.head_dim(width, role)
        if dim % MX_HEAD_DIM_STEP:
            raise InvalidInputError(
                f"state plane {label} holds {width} code words per token: {dim} values, "
                f"not a multiple of {MX_HEAD_DIM_STEP} ({self.mode})"
            )

    def check_stored_head_dim(self, side: str, dim: int) -> None:
        self.check_head_dim(dim)
