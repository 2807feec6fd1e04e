"""The TurboQuant codec's spec (``spec/turbo-codec.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvrows.codec import TURBO_GROUP, TURBO_HEAD_DIMS, PlaneSpec, Reads, Role, check_turbo_dim
from kvrows.codecs.registry import SpecParts, register_codec
from kvrows.errors import InvalidInputError, turbo_bits_message

__all__ = ["TURBO_KEY_BITS", "TURBO_PLANES", "TURBO_VALUE_BITS", "Turbo"]

#: TurboQuant key and value bit widths (``spec/turbo-codec.md``).
TURBO_KEY_BITS: tuple[int, ...] = (2, 4, 5, 8)
TURBO_VALUE_BITS: tuple[int, ...] = (2, 3, 4, 5, 8)

#: A TurboQuant state's planes in the order it holds them (``keys``, then ``values``): the
#: persistence contract of ``spec/turbo-codec.md`` (semantics §2.3).
TURBO_PLANES = ("kIdx", "kScales", "kZeros", "vPacked", "vScales")


@register_codec
@dataclass(frozen=True, kw_only=True)
class Turbo(SpecParts):
    """TurboQuant: affine keys at ``k_bits``, rotated Lloyd-Max values at ``v_bits``.

    The defaults (k8v3) are what the bare scheme name ``turbo`` means.
    """

    k_bits: int = 8
    v_bits: int = 3
    kind: ClassVar[str] = "turbo"
    names: ClassVar[tuple[str, ...]] = ("turbo", "turbo-k4v3", "turbo:k4v3")
    syntax: ClassVar[str] = "turbo (k8v3) or turbo-k<bits>v<bits> / turbo:k<bits>v<bits>"
    state_tail: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits")
    encodes: ClassVar[bool] = True
    # Reads hold the values still rotated: only this codec's attention is right over them.
    reads: ClassVar[Reads] = "own"
    tag: ClassVar[int] = 2
    paged_fields: ClassVar[tuple[str, ...]] = ("k_bits", "v_bits")
    # Its planes do not record the activations' dtype (reads are bfloat16).
    dtype_plane: ClassVar[int | None] = None
    plane_labels: ClassVar[tuple[str, ...]] = TURBO_PLANES

    def __post_init__(self) -> None:
        if self.k_bits not in TURBO_KEY_BITS or isinstance(self.k_bits, bool):
            raise InvalidInputError(turbo_bits_message("k_bits", TURBO_KEY_BITS, self.k_bits))
        if self.v_bits not in TURBO_VALUE_BITS or isinstance(self.v_bits, bool):
            raise InvalidInputError(turbo_bits_message("v_bits", TURBO_VALUE_BITS, self.v_bits))

    @property
    def key(self) -> str:
        return f"turbo:{self.k_bits}:{self.v_bits}"

    @property
    def name(self) -> str:
        return f"turbo-k{self.k_bits}v{self.v_bits}"

    def parameters(self) -> dict[str, int]:
        return {"k_bits": self.k_bits, "v_bits": self.v_bits}

    @classmethod
    def parse(cls, text: str) -> Turbo | None:
        """``turbo`` (k8v3), ``turbo-k<bits>v<bits>`` (its name) or ``turbo:k<bits>v<bits>``."""
        if text == "turbo":
            return cls()
        for prefix in ("turbo-k", "turbo:k"):
            if text.startswith(prefix) and "v" in text[len(prefix) :]:
                k_bits, _, v_bits = text[len(prefix) :].partition("v")
                if k_bits.isdigit() and v_bits.isdigit():
                    return cls(k_bits=int(k_bits), v_bits=int(v_bits))
        return None

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        count = dim // TURBO_GROUP
        if role == "keys":  # kIdx, kScales, kZeros (8-bit: int8 unpacked)
            codes = "int8" if self.k_bits == 8 else "uint8"
            return (
                PlaneSpec(name, 2, codes, dim * self.k_bits // 8),
                PlaneSpec(f"{name}.scales", 2, "float16", count),
                PlaneSpec(f"{name}.zeros", 2, "float16", count),
            )
        return (  # vPacked, vScales
            PlaneSpec(name, 2, "uint8", dim * self.v_bits // 8),
            PlaneSpec(f"{name}.scales", 2, "float16", count),
        )

    def check_head_dim(self, dim: int) -> None:
        check_turbo_dim(dim)

    def check_token_geometry(self, owner: str, token_geometry: object) -> None:
        # Sliding layers stay plain rings under TurboQuant (full attention only).
        if getattr(token_geometry, "kind", None) != "growing":
            raise InvalidInputError(
                f"{owner}: TurboQuant is full attention only (a Growing() token geometry), "
                f"got {token_geometry!r}"
            )

    def _bits(self, role: Role) -> int:
        return self.k_bits if role == "keys" else self.v_bits

    def head_dim(self, width: int, role: Role) -> int:
        # ``D * bits / 8`` code bytes per token (8-bit keys: one int8 per element).
        return width * 8 // self._bits(role)

    def check_plane_width(self, label: str, width: int, role: Role) -> None:
        bits = self._bits(role)
        if width * 8 % bits:
            raise InvalidInputError(
                f"state plane {label} holds {width} bytes per token: not a head dim at "
                f"{bits} bits (D x {bits} / 8 bytes)"
            )

    def check_stored_head_dim(self, side: str, dim: int) -> None:
        if dim not in TURBO_HEAD_DIMS:
            raise InvalidInputError(
                f"state planes hold a {side} head dim of {dim}; TurboQuant stores {TURBO_HEAD_DIMS}"
            )
