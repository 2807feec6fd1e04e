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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, Self, TypeAlias, cast, runtime_checkable

from kvrows.errors import InvalidInputError, head_dim_message
from kvrows.validation import KvGeometry

__all__ = [
    "DTYPE_SIZES",
    "KV_TENSORS",
    "TURBO_GROUP",
    "TURBO_HEAD_DIMS",
    "Codec",
    "CodecLayout",
    "CodecSpec",
    "PlaneSet",
    "PlaneSpec",
    "Reads",
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

#: The tensors of a KV codec, in the order a block hands them in (``update_and_fetch``).
KV_TENSORS: tuple[Role, ...] = ("keys", "values")

#: What the row machinery moves: each tensor's planes, in ``plane_specs`` order (contract
#: §0.1). It never looks at a plane's meaning; each implementation's arrays fill it.
PlaneSet: TypeAlias = dict[str, tuple[Any, ...]]


def as_role(tensor: str) -> Role:
    """A plane set's tensor name as the array codecs' tensor parameter (typed ``Role``
    for the KV codecs; the latent and state codecs take their own tensor names)."""
    return cast(Role, tensor)


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


#: How attention over a read goes (``spec/contract.md`` §0.2): ``"dense"`` one array per
#: tensor, any kernel; ``"affine"`` mlx-lm's quantized path, which finds ``bits`` /
#: ``group_size`` on the cache; ``"own"`` only the codec's ``attend`` is right.
Reads: TypeAlias = Literal["dense", "affine", "own"]


class CodecSpec(Protocol):
    """A frozen codec spec: what one codec kind and its parameters are, array-free.

    Each kind lives in its own module of ``kvrows.codecs`` and registers itself there
    (``register_codec``); nothing outside the codec modules tests which kind a spec is:
    callers ask these members (``spec/contract.md`` §0.2, §0.10)."""

    #: Registry key (``CODECS[kind]``) and the composition table's codec kind.
    kind: ClassVar[str]
    #: Scheme names it parses (examples for the CLI; each parses to this kind).
    names: ClassVar[tuple[str, ...]]
    #: How its scheme names are written, for the message refusing an unknown one.
    syntax: ClassVar[str]
    #: The fields a saved state appends after its planes, in order.
    state_tail: ClassVar[tuple[str, ...]]
    #: Stores something other than the activations (what a bf16-first row converts to).
    encodes: ClassVar[bool]
    #: How attention over its reads goes (:data:`Reads`).
    reads: ClassVar[Reads]
    #: The kind's integer tag: stable, unique, in the order the kinds were added (the
    #: registry's order). A paged state saves it, with the parameters of
    #: ``paged_fields`` in two integer slots (an unused slot holds 0).
    tag: ClassVar[int]
    paged_fields: ClassVar[tuple[str, ...]]
    #: The plane of a stored tensor whose dtype is the activations' (``None``: no plane
    #: carries it, so a saved state's dtype comes from elsewhere).
    dtype_plane: ClassVar[int | None]
    #: The names a saved state's planes go by in messages, keys' then values' (empty:
    #: the plane specs' names).
    plane_labels: ClassVar[tuple[str, ...]]

    @property
    def key(self) -> str:
        """The codec identity rows must share to join one layout."""
        ...

    @property
    def name(self) -> str:
        """The scheme's name on the command line."""
        ...

    def parameters(self) -> dict[str, int]:
        """Its constructor parameters (a preset's signature formats with them)."""
        ...

    def signature_part(self) -> str:
        """What a signature says of this codec (``"affine:8:64"``)."""
        ...

    @classmethod
    def tensors(cls, shapes: Any = None) -> tuple[str, ...]:
        """The tensors a caller hands in per token or row (``keys``, ``values``; recurrent
        state's ``state.0`` … one per plane of ``shapes``, the codec's own ``Shapes``)."""
        ...

    def tail(self) -> dict[str, int]:
        """The :attr:`state_tail` fields' values, in order."""
        ...

    @classmethod
    def from_tail(cls, fields: Mapping[str, Any]) -> Self:
        """The spec a saved state's tail fields describe (validated on construction)."""
        ...

    @classmethod
    def from_parameters(cls, numbers: Mapping[str, Any]) -> Self:
        """The spec of these :meth:`parameters` (extra keys ignored; ``KeyError`` if one
        is missing)."""
        ...

    @classmethod
    def parse(cls, text: str) -> Self | None:
        """The spec one scheme word names, ``None`` when the word is not of this kind."""
        ...

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        """The planes a ``[·, H, T, dim]`` ``role`` tensor of ``dtype`` is stored as
        (token axis 2)."""
        ...

    def check_head_dim(self, dim: int) -> None:
        """Raise ``InvalidInputError`` unless this codec stores heads of ``dim``."""
        ...

    def head_dim(self, width: int, role: Role) -> int:
        """The head dim of a ``role`` tensor whose first plane is ``width`` wide."""
        ...

    def check_plane_width(self, label: str, width: int, role: Role) -> None:
        """Raise ``InvalidInputError`` if a first ``role`` plane (``label``) of ``width``
        is no head dim's."""
        ...

    def check_stored_head_dim(self, side: str, dim: int) -> None:
        """Raise ``InvalidInputError`` if saved planes of a ``side`` (key, value) head dim
        of ``dim`` cannot be this codec's (when the planes alone do not rule it out)."""
        ...

    def check_token_geometry(self, owner: str, token_geometry: object) -> None:
        """Raise ``InvalidInputError`` (naming ``owner``) unless rows of this token
        geometry may be stored with this codec."""
        ...

    def __hash__(self) -> int:  # frozen: specs key caches (one array codec per spec)
        ...


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

    def decode(self, planes: tuple[Any, ...], role: Role = "keys") -> Any:
        """``role``'s stored tokens, decoded (TurboQuant: values un-rotated, float32)."""
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
    return spec.plane_specs(name, dim, dtype, role)


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

    def attends_itself(self) -> bool:
        """Whether attention over this codec's reads runs through its own ``attend`` now:
        where the values are deferred (required), or where its ``attend`` is the faster
        path (an encoding codec on the CPU's host path, ``spec/host-attention.md``). A
        caller with an attention kernel of its own then routes through ``attend``
        (``kvrows.app.attention.dispatch``)."""
        return self.defers_values

    @property
    def key(self) -> str:
        """Identity of the codec and its parameters (rows of different keys never mix)."""
        return self.spec.key

    def check(self, geometry: KvGeometry) -> None:
        """Raise ``InvalidInputError`` if the spec cannot store heads of ``geometry``."""
        for name, dim in (("key", geometry.key_dim), ("value", geometry.value_dim)):
            try:
                self.spec.check_head_dim(dim)
            except InvalidInputError as error:
                raise InvalidInputError(head_dim_message(name, dim, error)) from None

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        return codec_plane_specs(self.spec, name, dim, dtype, role)

    def token_bytes(self, heads: int, dim: int, dtype: str, role: Role = "keys") -> int:
        """Bytes one token of one row occupies."""
        return codec_token_bytes(self.spec, heads, dim, dtype, role)
