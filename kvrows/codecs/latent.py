"""The latent codec's spec: MLA's per-token state (``spec/MLACache.md``, contract §0.2).

A latent cache holds, per token, the compressed KV latent (``kv_lora_rank`` wide), the
decoupled RoPE key (``rope_head_dim``) and, for a DeepSeek-sparse-attention target, the
indexer's key (``index_head_dim``): the tensors ``latent``, ``rope`` (and ``index``).
:class:`Latent` is a composite: ``latent`` is stored through the ``inner`` codec's
``values`` planes, ``rope`` and ``index`` plain. Reads are dense (a decoded latent); there
is no ``attend`` (MLA attention is the model's). What a storage learns from its first
append, or is told up front, is :class:`LatentShapes`.

The widths the spec declares are optional (``None``: learned from the first append); the
declaration's ``role`` (``"target"`` or ``"mtp"``; an MTP cache has no DSA) and
``index_head_dim`` are part of the codec's key: rows join only rows declared alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Self, TypeAlias

from kvrows.codec import DTYPE_SIZES, CodecLayout, CodecSpec, PlaneSpec, Reads, Role
from kvrows.codecs.plain import Plain
from kvrows.codecs.registry import SpecParts, register_codec
from kvrows.errors import InvalidInputError
from kvrows.validation import FLOAT_DTYPES, as_count

__all__ = [
    "DEEPSEEK_V3_BF16_BYTES",
    "FLASHMLA_FP8_BYTES",
    "LATENT_FIELDS",
    "LATENT_FIELDS_V1",
    "LATENT_ROLE",
    "PAGED_LATENT_FIELDS",
    "Latent",
    "LatentLayout",
    "LatentRole",
    "LatentShapes",
    "latent_token_bytes",
]

LatentRole: TypeAlias = Literal["target", "mtp"]

#: The role the latent tensor takes in its inner codec (TurboQuant's rotated values).
LATENT_ROLE: Role = "values"

#: DeepSeek-V3 caches 576 values (512 latent + 64 rope) per token per layer: 1,152 bytes in
#: bf16; FlashMLA's FP8 layout stores them in 656 (512 fp8 + 4 fp32 scales + 64 bf16).
DEEPSEEK_V3_BF16_BYTES = 1152
FLASHMLA_FP8_BYTES = 656

#: A latent cache's saved state (form version 1), in order (``spec/persistence.md``):
#: planes, rows, the declaration, the codec. The latent caches keep it until their family
#: switches to the §0.6 rule.
LATENT_FIELDS_V1 = (
    "latent", "rope", "index", "exact", "offset", "converted",
    "kv_lora_rank", "rope_head_dim", "index_head_dim", "max_tokens", "role",
    "bits", "group_size", "k_bits", "v_bits", "start",
)  # fmt: skip
#: Today's: the v1 fields, then the inner codec's ``tag`` (the microscaling modes fill the
#: same tail as affine: the tag tells them apart). A v1 state still loads (its codec told
#: by its tail: plain, affine or TurboQuant).
LATENT_FIELDS = (*LATENT_FIELDS_V1, "codec")

#: ``PagedLatentCache``'s saved state: the latent fields, then its block size.
PAGED_LATENT_FIELDS = (*LATENT_FIELDS, "block_size")

#: The widths a :class:`Latent` may declare, in the constructors' order.
_WIDTHS = ("kv_lora_rank", "rope_head_dim", "index_head_dim")


#: The tensors a latent row stores plain, whatever its inner codec.
PLAIN_TENSORS = ("rope", "index")


@dataclass(frozen=True)
class LatentShapes:
    """What every row of one latent cache holds per token: the latent, rope and (DSA)
    index widths and the activations' dtype."""

    rank: int
    rope: int
    index: int | None
    dtype: str

    @property
    def tensors(self) -> tuple[str, ...]:
        """The tensors a read returns: the latent, the rope and (DSA) the index."""
        return ("latent", "rope") if self.index is None else ("latent", "rope", "index")

    def describe(self) -> str:
        index = "" if self.index is None else f", index={self.index}"
        return f"kv_lora_rank={self.rank}, rope_head_dim={self.rope}{index}, dtype={self.dtype}"

    def tensor_image(self, tensor: str) -> tuple[int, int, str]:
        """``(heads, width, dtype)`` of ``tensor`` in the image a read returns (one head)."""
        widths = {"latent": self.rank, "rope": self.rope, "index": self.index or 0}
        return 1, widths[tensor], self.dtype


def _optional_width(value: object, name: str) -> int | None:
    return None if value is None else as_count(value, name, minimum=1)


@register_codec
@dataclass(frozen=True, kw_only=True)
class Latent(SpecParts):
    """MLA's latent state: ``latent`` through ``inner``, ``rope`` / ``index`` plain.

    Built with checked arguments (``InvalidInputError`` for a wrong width or role); the
    widths stay ``None`` until declared.
    """

    inner: CodecSpec = field(default_factory=Plain)
    kv_lora_rank: int | None = None
    rope_head_dim: int | None = None
    index_head_dim: int | None = None
    role: LatentRole = "target"
    kind: ClassVar[str] = "latent"
    names: ClassVar[tuple[str, ...]] = ()  # no scheme word: a model's layer is latent or not
    syntax: ClassVar[str] = ""
    state_tail: ClassVar[tuple[str, ...]] = ()
    # The bf16-first warm-up converts to ``inner`` (the delayed modifier asks the inner's).
    encodes: ClassVar[bool] = False
    reads: ClassVar[Reads] = "dense"
    tag: ClassVar[int] = 4
    paged_fields: ClassVar[tuple[str, ...]] = ()
    dtype_plane: ClassVar[int | None] = None
    plane_labels: ClassVar[tuple[str, ...]] = ()
    #: The saved-state fields of a contiguous latent cache (its own form, version 1).
    form_fields: ClassVar[tuple[str, ...]] = LATENT_FIELDS

    def __post_init__(self) -> None:
        if self.role not in ("target", "mtp"):
            raise InvalidInputError(f"role must be 'target' or 'mtp', got {self.role!r}")
        for name in _WIDTHS:
            object.__setattr__(self, name, _optional_width(getattr(self, name), name))
        if self.role == "mtp" and self.index_head_dim is not None:
            raise InvalidInputError("an MTP latent cache has no DSA index plane")

    # -- identity ------------------------------------------------------------------------
    @property
    def dsa(self) -> bool:
        """Whether the cache keeps the DSA indexer's keys (an ``index`` tensor)."""
        return self.index_head_dim is not None

    @property
    def signature_role(self) -> str:
        return f"{self.role}:dsa" if self.dsa else self.role

    @property
    def key(self) -> str:
        """Rows join only rows of the same inner codec, role and index width (the latent
        and rope widths are learned, and checked when rows join)."""
        return f"latent:{self.inner.key}:{self.role}:{self.index_head_dim}"

    @property
    def name(self) -> str:
        return f"latent-{self.inner.name}"

    def parameters(self) -> dict[str, int]:
        return {name: value for name in _WIDTHS if (value := getattr(self, name)) is not None}

    def signature_part(self) -> str:
        return f"{self.signature_role}:{self.inner.key}"

    @classmethod
    def from_parameters(cls, numbers: Mapping[str, Any]) -> Self:
        return cls(**{name: numbers[name] for name in _WIDTHS if name in numbers})

    @classmethod
    def tensors(cls, shapes: object = None) -> tuple[str, ...]:
        """``latent``, ``rope`` and, when ``shapes`` (a :class:`LatentShapes`) has an
        index width, ``index``."""
        if isinstance(shapes, LatentShapes):
            return shapes.tensors
        return ("latent", "rope")

    @classmethod
    def parse(cls, text: str) -> Latent | None:
        return None

    # -- planes --------------------------------------------------------------------------
    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        """The planes of one tensor: ``rope`` / ``index`` (named by ``role``, as the
        machinery's byte count asks) one plain plane, the latent the inner codec's."""
        if role in PLAIN_TENSORS:
            return (PlaneSpec(name, 2, dtype, dim),)
        return self.inner.plane_specs(name, dim, dtype, LATENT_ROLE)

    def tensor_planes(self, shapes: LatentShapes) -> tuple[PlaneSpec, ...]:
        """Every plane a row holds for ``shapes`` (token axis 2): the latent's through the
        inner codec, then rope and index plain."""
        planes = (
            *self.plane_specs("latent", shapes.rank, shapes.dtype),
            PlaneSpec("rope", 2, shapes.dtype, shapes.rope),
        )
        if shapes.index is None:
            return planes
        return (*planes, PlaneSpec("index", 2, shapes.dtype, shapes.index))

    def token_bytes(self, shapes: LatentShapes) -> int:
        """Bytes one token of one row takes."""
        return sum(DTYPE_SIZES[p.dtype] * p.width for p in self.tensor_planes(shapes))

    def check_head_dim(self, dim: int) -> None:
        """Raise ``InvalidInputError`` unless the inner codec stores a latent of ``dim``."""
        self.inner.check_head_dim(dim)

    def head_dim(self, width: int, role: Role) -> int:
        return self.inner.head_dim(width, LATENT_ROLE)

    # -- blocks --------------------------------------------------------------------------
    def check_blocks(
        self,
        owner: str,
        blocks: Sequence[tuple[str, tuple[int, ...], str]],
        rows: int | None,
        known: LatentShapes | None,
    ) -> LatentShapes:
        """The shapes of ``blocks`` (``(tensor, [B, 1, N, W] shape, dtype)``, latent and
        rope first, then index when given), checked against the declaration, the ``rows``
        the cache holds (``None``: any) and what it already learned (``known``); raises
        ``InvalidInputError``."""
        shapes = [shape for _, shape, _ in blocks]
        dtypes = [dtype for _, _, dtype in blocks]
        if len(set(dtypes)) != 1 or dtypes[0] not in FLOAT_DTYPES:
            raise InvalidInputError(
                f"{owner}: every block must have one float dtype of {FLOAT_DTYPES}, got {dtypes}"
            )
        dtype = dtypes[0]
        if known is not None and dtype != known.dtype:
            raise InvalidInputError(f"{owner}: this cache stores {known.dtype}, got {dtype}")
        rank, rope = shapes[0][3], shapes[1][3]
        declared = (known.rank, known.rope) if known is not None else None
        declared = declared or (self.kv_lora_rank or rank, self.rope_head_dim or rope)
        if (rank, rope) != declared:
            raise InvalidInputError(
                f"{owner}: latent and rope widths must be {declared}, got {(rank, rope)}"
            )
        if len(shapes) > 2 and shapes[2][3] != self.index_head_dim:
            raise InvalidInputError(
                f"{owner}: index width must be {self.index_head_dim}, got {shapes[2][3]}"
            )
        if rows is not None and shapes[0][0] != rows:
            raise InvalidInputError(
                f"{owner}: the cache holds {rows} rows, the block has {shapes[0][0]}"
            )
        try:
            self.check_head_dim(rank)
        except InvalidInputError as error:
            raise InvalidInputError(f"{owner}: kv_lora_rank {rank}: {error}") from None
        return LatentShapes(rank, rope, self.index_head_dim, dtype)


def latent_token_bytes(
    codec: CodecSpec, rank: int, rope: int, index: int | None, dtype: str
) -> int:
    """Bytes one token of one row takes with the latent through ``codec``."""
    return Latent(inner=codec).token_bytes(LatentShapes(rank, rope, index, dtype))


class LatentLayout(CodecLayout):
    """What both implementations' latent array codecs answer from the spec alone: a
    block pool of the paged placement asks it whether it stores ``shapes``."""

    spec: Latent

    def check(self, geometry: Any) -> None:
        """Raise ``InvalidInputError`` unless the spec stores ``geometry`` (a
        ``LatentShapes``): its widths as declared, its latent through the inner codec."""
        shapes: LatentShapes = geometry
        self.spec.check_blocks(
            "the latent pool",
            [(t, (1, 1, 1, shapes.tensor_image(t)[1]), shapes.dtype) for t in shapes.tensors],
            None,
            None,
        )
