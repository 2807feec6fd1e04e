"""The codec axis and the planes a storage holds, declared once for both implementations.

A **plane** is one array a storage keeps per row, with a named role, a token axis (or
none) and a dtype. KV storages hold key planes and value planes (one each when plain;
codes, scales and biases when affine); recurrent state holds a conv plane and a
recurrent plane with no token axis; latent state holds a latent and a rope plane on one
token axis. The row machinery moves planes, whatever they mean: token surgery (slice,
pad, concatenate, roll, gather) happens on the token axis, row surgery on axis 0, and
no byte is ever re-encoded by either.

A **codec** turns one ``[B, H, T, D]`` block into planes, says what attention reads from
them, and runs attention over them: ``attend`` dispatches through the codec, never
through ``isinstance``. Both implementations implement this protocol with their own
array type (NumPy in the reference, MLX in the optimized one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, TypeAlias, runtime_checkable

from kvrows.affine_geometry import groups, packed_width
from kvrows.errors import InvalidInputError
from kvrows.schemes import Affine, CodecSpec, Plain, Turbo
from kvrows.validation import KvGeometry

__all__ = [
    "DTYPE_SIZES",
    "TURBO_GROUP",
    "TURBO_HEAD_DIMS",
    "Codec",
    "CodecLayout",
    "PlaneSpec",
    "Role",
    "check_turbo_dim",
    "codec_plane_specs",
    "codec_token_bytes",
]

#: Bytes per element of every dtype a plane may have.
DTYPE_SIZES: dict[str, int] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "uint32": 4,
    "uint8": 1,
    "int8": 1,
}


#: Which tensor of a KV pair a block is. Plain and affine store both alike; TurboQuant
#: stores keys (asymmetric affine) and values (rotated Lloyd-Max) differently, so every
#: codec operation that depends on the layout takes the role (default ``"keys"``).
Role: TypeAlias = Literal["keys", "values"]

#: TurboQuant: head dims it stores, and the group size of its scales (``spec/turbo-codec.md``).
TURBO_HEAD_DIMS: tuple[int, ...] = (64, 128, 256, 512)
TURBO_GROUP = 32


def check_turbo_dim(dim: int) -> None:
    """Raise ``InvalidInputError`` unless TurboQuant stores heads of ``dim``."""
    if dim not in TURBO_HEAD_DIMS:
        raise InvalidInputError(f"TurboQuant stores head dims {TURBO_HEAD_DIMS}, got {dim}")


@dataclass(frozen=True)
class PlaneSpec:
    """One plane a storage holds for every row.

    ``name``: what it is (``"keys"``, ``"keys.scales"``, ``"conv"``, ``"latent"``…);
    ``token_axis``: the axis positions live on (``None`` for constant-size state, such
    as a recurrent state, which row operations move whole); ``dtype``: its dtype name;
    ``width``: the size of its last axis.
    """

    name: str
    token_axis: int | None
    dtype: str
    width: int


@runtime_checkable
class Codec(Protocol):
    """How one token's vector is stored, read and attended over.

    ``defers_values``: the values a read returns are not the values (TurboQuant returns
    them still rotated), so only this codec's ``attend`` computes attention over them
    correctly; a caller that runs its own attention kernel (mlx-lm's) must route through
    ``attend`` (``kvrows.app.attention.dispatch`` does)."""

    defers_values: bool

    @property
    def spec(self) -> CodecSpec:
        """The frozen codec spec this codec was built from."""
        ...

    @property
    def key(self) -> str:
        """The identity rows must share to join one layout (``spec.key``)."""
        ...

    def check(self, geometry: KvGeometry) -> None:
        """Raise ``InvalidInputError`` if this codec cannot store heads of ``geometry``."""
        ...

    def encode(self, block: Any, role: Role = "keys") -> tuple[Any, ...]:
        """The planes storing ``block`` (``[B, H, T, D]``) as ``role``, token axis 2."""
        ...

    def fetched(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        """What ``update_and_fetch`` returns for ``role``'s planes (an array, or the planes)."""
        ...

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[Any, ...]:
        """Zero planes of ``columns`` tokens for ``rows`` rows of ``role``."""
        ...

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        """The planes one ``[·, H, ·, dim]`` tensor named ``name`` of ``role`` is stored as."""
        ...

    def token_bytes(self, heads: int, dim: int, dtype: str, role: Role = "keys") -> int:
        """Bytes one token of one row takes for a ``role`` tensor of ``heads`` x ``dim``."""
        ...

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        """Attention of ``[B, Hq, N, D]`` queries over fetched ``keys``/``values``
        (this codec's fetched form); returns the queries' dtype."""
        ...


def codec_plane_specs(
    spec: CodecSpec, name: str, dim: int, dtype: str, role: Role = "keys"
) -> tuple[PlaneSpec, ...]:
    """The planes ``spec`` stores a ``[·, H, T, dim]`` ``role`` tensor of ``dtype`` as
    (token axis 2)."""
    if isinstance(spec, Plain):
        return (PlaneSpec(name, 2, dtype, dim),)
    if isinstance(spec, Affine):
        count = groups(dim, spec.group_size)
        return (
            PlaneSpec(name, 2, "uint32", packed_width(dim, spec.bits)),
            PlaneSpec(f"{name}.scales", 2, dtype, count),
            PlaneSpec(f"{name}.biases", 2, dtype, count),
        )
    if isinstance(spec, Turbo):
        count = dim // TURBO_GROUP
        if role == "keys":  # kIdx, kScales, kZeros (8-bit: int8 unpacked)
            codes = "int8" if spec.k_bits == 8 else "uint8"
            return (
                PlaneSpec(name, 2, codes, dim * spec.k_bits // 8),
                PlaneSpec(f"{name}.scales", 2, "float16", count),
                PlaneSpec(f"{name}.zeros", 2, "float16", count),
            )
        return (  # vPacked, vScales
            PlaneSpec(name, 2, "uint8", dim * spec.v_bits // 8),
            PlaneSpec(f"{name}.scales", 2, "float16", count),
        )
    raise InvalidInputError(f"no storage implements the {spec.kind} codec yet")


def codec_token_bytes(
    spec: CodecSpec, heads: int, dim: int, dtype: str, role: Role = "keys"
) -> int:
    """Bytes one token of one row takes under ``spec`` for ``heads`` x ``dim`` ``role``
    values."""
    return heads * sum(
        DTYPE_SIZES[plane.dtype] * plane.width
        for plane in codec_plane_specs(spec, name="t", dim=dim, dtype=dtype, role=role)
    )


class CodecLayout:
    """What a codec answers from its spec alone, whatever its array library: its key, its
    planes and its bytes per token (both implementations' codecs inherit it)."""

    spec: CodecSpec
    defers_values: ClassVar[bool] = False

    @property
    def key(self) -> str:
        """Identity of the codec and its parameters (rows of different keys never mix)."""
        return self.spec.key

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        return codec_plane_specs(self.spec, name, dim, dtype, role)

    def token_bytes(self, heads: int, dim: int, dtype: str, role: Role = "keys") -> int:
        """Bytes one token of one row occupies."""
        return codec_token_bytes(self.spec, heads, dim, dtype, role)
