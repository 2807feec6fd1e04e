"""The composition table: every seed class name as a point on the three axes.

Each storage and layout the seed names is one **composition** of a codec (plain,
affine, TurboQuant…, latent), a token geometry (growing, ring, recurrent), a placement
(contiguous buffers, or paged: block tables into a shared pool) and a row arrangement (serial: one request; shared: rows share one write column; ragged: each
row appends at its own end), plus optional **modifiers** (``delayed``: rows convert from
bf16 to the codec at their own boundary; ``speculative``: verify rounds with per-row
acceptance), and, for a storage, the **roles** of the row-layout table: the layouts its
rows join to decode, to prefill and to verify.

Both implementations declare their public classes against this table (each class names
its composition) and register them with :func:`register_compositions`, so the
row-layout table, the conformance families and the mlx-lm drop-in are all derived from
one list. Entries with an ``issue`` are planned: named here so the table shows where
each coming class plugs in, registered by nobody yet.
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal, TypeAlias

from kvrows.codec import CodecSpec
from kvrows.codecs import CODECS, Affine, is_codec_spec, is_kv_codec
from kvrows.errors import (
    InvalidInputError,
    KvRowsError,
    given_twice_message,
    needs_parameters_message,
    not_a_geometry_message,
    not_an_integer_message,
    positional_arguments_message,
    wrong_geometry_message,
)
from kvrows.geometries import GEOMETRIES, GeometrySpec, is_geometry_spec
from kvrows.protocols import BatchableCache
from kvrows.table import own_empty_batch, register_row_layouts
from kvrows.validation import KvGeometry

__all__ = [
    "COMPOSITIONS",
    "SELF",
    "Arrangement",
    "Composition",
    "Roles",
    "affine_counterpart",
    "bind_arguments",
    "codec_spec_for",
    "composition",
    "geometry_spec_for",
    "landed",
    "layouts_of",
    "lego_preset",
    "parameter_defaults",
    "placed_geometries",
    "preset_class",
    "presets_on_rows",
    "register_compositions",
    "serial_for_peer",
    "serial_preset",
    "stage_presets",
]

Arrangement: TypeAlias = Literal["serial", "shared", "ragged"]
CodecKind: TypeAlias = Literal["plain", "affine", "turbo", "mx", "any", "state", "latent"]
GeometryKind: TypeAlias = Literal["growing", "ring", "chunked", "recurrent"]
#: Where a row's tokens live (contract §0.4): contiguous buffers, or block tables into a
#: shared pool (any geometry with a token axis).
PlacementKind: TypeAlias = Literal["contiguous", "paged"]
Modifier: TypeAlias = Literal["delayed", "speculative"]

#: A role naming ``SELF`` is the layout's own empty batch (``make_empty_batch``).
SELF = "self"


@dataclass(frozen=True)
class Roles:
    """The layouts a storage's rows join: to decode, to prefill, to verify."""

    decode: str
    prefill: str
    verify: str

    def items(self) -> Iterator[tuple[str, str]]:
        yield from (("decode", self.decode), ("prefill", self.prefill), ("verify", self.verify))


@dataclass(frozen=True, kw_only=True)
class Composition:
    """One seed class: its axes, its constructor parameters, its identity and its roles.

    ``params``: the constructor's parameters in positional order (mlx-lm's order);
    ``signature``: the ``signature()`` text, formatted with the codec's and geometry's
    parameters; ``serial``: the serial storage a layout's rows extract into; ``roles``:
    the storage's row-layout table entry (``None``: no entry, so the layout has no
    verify sibling and serves as its own decode and prefill layout); ``peers``: the
    mlx-lm cache classes whose layers this serial storage serves; ``parity``: the mlx-lm
    class that holds the same state, bit for bit (the conformance suite's third oracle);
    ``issue``: the issue that adds a planned class (``None``: landed); ``placement``:
    where its rows' tokens live (``paged``: block tables into a shared pool).
    """

    name: str
    codec: CodecKind
    geometry: GeometryKind
    arrangement: Arrangement
    placement: PlacementKind = "contiguous"
    signature: str
    params: tuple[str, ...] = ()
    serial: str | None = None
    roles: Roles | None = None
    modifiers: frozenset[Modifier] = field(default_factory=frozenset)
    peers: tuple[str, ...] = ()
    parity: str | None = None
    issue: int | None = None
    summary: str = ""

    @property
    def is_landed(self) -> bool:
        return self.issue is None

    @property
    def is_layout(self) -> bool:
        return self.arrangement != "serial"

    @property
    def shared_column(self) -> bool:
        return self.arrangement == "shared"

    def signature_for(self, codec: CodecSpec, geometry: GeometrySpec) -> str:
        """The ``signature()`` of an instance built from ``codec`` and ``geometry``."""
        return self.signature.format(**codec.parameters(), **geometry.parameters())


def _plain_growing(
    name: str, arrangement: Arrangement, signature: str, **extra: Any
) -> Composition:
    return Composition(
        name=name, codec="plain", geometry="growing", arrangement=arrangement,
        signature=signature, **extra,
    )  # fmt: skip


_AFFINE = ("group_size", "bits")
_RING = ("max_size", "keep")
_TURBO = ("k_bits", "v_bits")
_MX = ("group_size", "bits")
_RING_AFFINE = ("max_size", "group_size", "bits", "keep")
_RING_MX = _RING_AFFINE
_CHUNKED_AFFINE = ("chunk_size", "group_size", "bits")

#: The seed's classes in the seed's ``ROW_LAYOUTS`` order (subclasses first), landed and
#: planned. Layouts without ``serial`` name it through their storage's roles.
COMPOSITIONS: tuple[Composition, ...] = (
    # -- paged (issue 13) ------------------------------------------------------------
    Composition(name="PagedKVCache", codec="any", geometry="growing", placement="paged",
                arrangement="serial",
                signature="kv:paged", roles=Roles("PagedKvRows", "PagedKvRows", "PagedKvRows"),
                summary="one request's block table into a shared block pool"),
    Composition(name="PagedKvRows", codec="any", geometry="growing", placement="paged",
                arrangement="ragged",
                signature="kv:paged-rows", serial="PagedKVCache", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"speculative"}),
                summary="block-table rows: row operations move no KV bytes"),
    # -- paged rings (issue 23: the paged placement under the ring geometry) ---------
    Composition(name="PagedRotatingKVCache", codec="any", geometry="ring", placement="paged",
                arrangement="serial", signature="kv:paged-rotating:{max_size}:{keep}",
                params=_RING,
                roles=Roles("PagedRotatingRows", "PagedRotatingRows", "PagedRotatingRows"),
                summary="one request's sliding window as a block table into a shared block "
                        "pool: blocks that leave the window go back to the pool"),
    Composition(name="PagedRotatingRows", codec="any", geometry="ring", placement="paged",
                arrangement="ragged", signature="kv:paged-rotating-rows:{max_size}:{keep}",
                params=_RING, serial="PagedRotatingKVCache", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"speculative"}),
                summary="sliding-window block-table rows, all three roles: each row its own "
                        "window, row operations move no KV bytes"),
    # -- paged chunked-local attention (issue 25: the paged placement under the chunked
    # geometry) -----------------------------------------------------------------------
    Composition(name="PagedChunkedKVCache", codec="any", geometry="chunked", placement="paged",
                arrangement="serial", signature="kv:paged-chunked:{chunk_size}",
                params=("chunk_size",),
                roles=Roles("PagedChunkedRows", "PagedChunkedRows", "PagedChunkedRows"),
                summary="one request's chunked-local attention as a block table into a shared "
                        "block pool: blocks before the chunk go back to the pool"),
    Composition(name="PagedChunkedRows", codec="any", geometry="chunked", placement="paged",
                arrangement="ragged", signature="kv:paged-chunked-rows:{chunk_size}",
                params=("chunk_size",), serial="PagedChunkedKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="chunked-local block-table rows, all three roles: each row its own "
                        "chunk, row operations move no KV bytes"),
    # -- latent (issue 14) -----------------------------------------------------------
    Composition(name="MLACache", codec="latent", geometry="growing", arrangement="shared",
                signature="kv:mla:target", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"speculative"}),
                summary="latent + rope (+ DSA index) planes on one token axis, rows "
                        "right-justified, ragged rollback by roll"),
    Composition(name="EncodedLatentCache", codec="latent", geometry="growing",
                arrangement="shared", signature="kv:mla-encoded:target:affine:8:64:0",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="the latent plane through an affine or TurboQuant codec, bf16-first "
                        "per row; rope and index exact"),
    Composition(name="PagedLatentCache", codec="latent", geometry="growing", placement="paged",
                arrangement="ragged",
                signature="kv:mla-paged:target", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"speculative"}),
                summary="MLACache's rows as block tables into a latent block pool: row "
                        "operations move no byte"),
    # -- bf16-first legos: the delayed modifier on a serial storage (issue 23, step 4) --
    Composition(name="Bf16FirstRotatingQuantizedKVCache", codec="affine", geometry="ring",
                arrangement="serial", signature="kv:rotating-quant:{bits}:{group_size}",
                params=(*_RING_AFFINE, "start"), modifiers=frozenset({"delayed"}),
                summary="RotatingKVCache until the append that reaches start, then "
                        "RotatingQuantizedKVCache holding the same window (bf16-first)"),
    Composition(name="Bf16FirstTurboQuantKVCache", codec="turbo", geometry="growing",
                arrangement="serial", signature="kv:turboquant:{k_bits}:{v_bits}",
                params=(*_TURBO, "start"), modifiers=frozenset({"delayed"}),
                summary="KVCache until the append that reaches start, then TurboQuantKVCache "
                        "holding the same tokens (bf16-first)"),
    Composition(name="Bf16FirstQuantizedKVCache", codec="affine", geometry="growing",
                arrangement="serial", signature="kv:quant:{bits}:{group_size}",
                params=(*_AFFINE, "start"), modifiers=frozenset({"delayed"}),
                summary="KVCache until the append that reaches start, then QuantizedKVCache "
                        "(bf16-first)"),
    # -- delayed and speculative rings (issues 10, 11) -------------------------------
    Composition(name="DelayedRotatingQuantizedKVCache", codec="affine", geometry="ring",
                arrangement="ragged",
                signature="kv:delayed-rotating-quant:{max_size}:{bits}:{group_size}:{start}",
                params=(*_RING_AFFINE, "start"), serial="RotatingQuantizedKVCache",
                roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"delayed", "speculative"}),
                summary="ring rows that convert to affine at their own boundary"),
    # -- affine rings ----------------------------------------------------------------
    Composition(name="RotatingAffineLayout", codec="affine", geometry="ring",
                arrangement="shared", signature="kv:rotating-affine:{max_size}:{group_size}:{bits}",
                params=_RING_AFFINE, serial="RotatingQuantizedKVCache",
                roles=Roles(SELF, SELF, "SpeculativeRotatingAffineLayout"),
                summary="prefill layout of the affine ring"),
    Composition(name="BatchedRotatingQuantCache", codec="affine", geometry="ring",
                arrangement="shared", signature="kv:rotating-quant:{bits}:{group_size}",
                params=_RING_AFFINE, serial="RotatingQuantizedKVCache",
                roles=Roles(SELF, SELF, "SpeculativeRotatingAffineLayout"),
                summary="decode layout of the affine ring"),
    Composition(name="SpeculativeRotatingAffineLayout", codec="affine", geometry="ring",
                arrangement="ragged",
                signature="kv:speculative-rotating-affine:{max_size}:{group_size}:{bits}",
                params=_RING_AFFINE, serial="RotatingQuantizedKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="verify layout of the affine ring: per-row rollback across the window"),
    Composition(name="RotatingQuantizedKVCache", codec="affine", geometry="ring",
                arrangement="serial", signature="kv:rotating-quant:{bits}:{group_size}",
                params=_RING_AFFINE,
                roles=Roles("BatchedRotatingQuantCache", "RotatingAffineLayout",
                            "SpeculativeRotatingAffineLayout"),
                peers=("RotatingKVCache",), summary="serial affine sliding-window ring"),
    # -- microscaling rings (issue 25) ------------------------------------------------
    Composition(name="BatchedRotatingMxCache", codec="mx", geometry="ring",
                arrangement="shared", signature="kv:rotating-mx:{max_size}:{group_size}:{bits}",
                params=_RING_MX, serial="RotatingMxKVCache",
                roles=Roles(SELF, SELF, "SpeculativeRotatingMxLayout"),
                summary="decode and prefill layout of the microscaling ring"),
    Composition(name="SpeculativeRotatingMxLayout", codec="mx", geometry="ring",
                arrangement="ragged",
                signature="kv:speculative-rotating-mx:{max_size}:{group_size}:{bits}",
                params=_RING_MX, serial="RotatingMxKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="verify layout of the microscaling ring: per-row rollback across the "
                        "window"),
    Composition(name="RotatingMxKVCache", codec="mx", geometry="ring",
                arrangement="serial", signature="kv:rotating-mx:{max_size}:{group_size}:{bits}",
                params=_RING_MX,
                roles=Roles("BatchedRotatingMxCache", "BatchedRotatingMxCache",
                            "SpeculativeRotatingMxLayout"),
                peers=("RotatingKVCache",),
                summary="serial microscaling sliding-window ring (mxfp8, mxfp4, nvfp4)"),
    Composition(name="Bf16FirstRotatingMxKVCache", codec="mx", geometry="ring",
                arrangement="serial", signature="kv:rotating-mx:{max_size}:{group_size}:{bits}",
                params=(*_RING_MX, "start"), modifiers=frozenset({"delayed"}),
                summary="RotatingKVCache until the append that reaches start, then "
                        "RotatingMxKVCache holding the same window (bf16-first)"),
    Composition(name="DelayedRotatingMxKVCache", codec="mx", geometry="ring",
                arrangement="ragged",
                signature="kv:delayed-rotating-mx:{max_size}:{group_size}:{bits}:{start}",
                params=(*_RING_MX, "start"), serial="RotatingMxKVCache",
                roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"delayed", "speculative"}),
                summary="ring rows that convert to a microscaling codec at their own boundary"),
    # -- plain rings -----------------------------------------------------------------
    Composition(name="SpeculativeRotatingKVCache", codec="plain", geometry="ring",
                arrangement="ragged", signature="kv:speculative-rotating:{max_size}", params=_RING,
                serial="RotatingKVCache", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"speculative"}),
                summary="verify layout of the plain ring: per-row rollback across the window"),
    Composition(name="RaggedRotatingRows", codec="plain", geometry="ring", arrangement="ragged",
                signature="kv:ragged-rotating:{max_size}", params=_RING, serial="RotatingKVCache",
                roles=Roles(SELF, SELF, "SpeculativeRotatingKVCache"),
                summary="prefill layout of the plain ring: each row its own window"),
    Composition(name="BatchedRotatingCache", codec="plain", geometry="ring", arrangement="shared",
                signature="kv:rotating-plain", params=_RING, serial="RotatingKVCache",
                parity="BatchRotatingKVCache",
                summary="decode layout of the plain ring (mlx-lm BatchRotatingKVCache)"),
    Composition(name="RotatingKVCache", codec="plain", geometry="ring", arrangement="serial",
                signature="kv:rotating-plain", params=_RING,
                roles=Roles("BatchedRotatingCache", "RaggedRotatingRows",
                            "SpeculativeRotatingKVCache"),
                peers=("RotatingKVCache",), parity="RotatingKVCache",
                summary="serial plain sliding-window ring"),
    # -- TurboQuant and delayed full attention (issues 11, 12) -----------------------
    Composition(name="DelayedTurboQuantKVCache", codec="turbo", geometry="growing",
                arrangement="ragged", signature="kv:delayed-turboquant:{k_bits}:{v_bits}:{start}",
                params=(*_TURBO, "start"), serial="TurboQuantKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"delayed", "speculative"}),
                summary="rows that convert to TurboQuant at their own boundary"),
    Composition(name="DelayedQuantizedKVCache", codec="affine", geometry="growing",
                arrangement="ragged", signature="kv:delayed-quant:{bits}:{group_size}:{start}",
                params=(*_AFFINE, "start"),
                serial="QuantizedKVCache", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"delayed", "speculative"}),
                summary="rows that convert to affine at their own boundary"),
    Composition(name="BatchedTurboQuantKVCache", codec="turbo", geometry="growing",
                arrangement="ragged", signature="kv:batched-turboquant:{k_bits}:{v_bits}",
                params=_TURBO, serial="TurboQuantKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="TurboQuant rows, all three roles"),
    # -- microscaling float codecs (issue 25): mxfp8, mxfp4, nvfp4 --------------------
    Composition(name="Bf16FirstMxKVCache", codec="mx", geometry="growing",
                arrangement="serial", signature="kv:mx:{group_size}:{bits}",
                params=(*_MX, "start"), modifiers=frozenset({"delayed"}),
                summary="KVCache until the append that reaches start, then MxKVCache holding "
                        "the same tokens (bf16-first)"),
    Composition(name="DelayedMxKVCache", codec="mx", geometry="growing",
                arrangement="ragged", signature="kv:delayed-mx:{group_size}:{bits}:{start}",
                params=(*_MX, "start"), serial="MxKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"delayed", "speculative"}),
                summary="rows that convert to a microscaling codec at their own boundary"),
    Composition(name="BatchedMxKVCache", codec="mx", geometry="growing",
                arrangement="ragged", signature="kv:batched-mx:{group_size}:{bits}",
                params=_MX, serial="MxKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="microscaling rows (mxfp8, mxfp4, nvfp4), all three roles"),
    Composition(name="MxKVCache", codec="mx", geometry="growing", arrangement="serial",
                signature="kv:mx:{group_size}:{bits}", params=_MX,
                roles=Roles("BatchedMxKVCache", "BatchedMxKVCache", "BatchedMxKVCache"),
                peers=("KVCache",),
                summary="serial microscaling full attention (mxfp8, mxfp4, nvfp4)"),
    # -- chunked-local attention (issue 25): llama4's local layers --------------------
    Composition(name="BatchedChunkedKVCache", codec="plain", geometry="chunked",
                arrangement="ragged", signature="kv:batched-chunked:{chunk_size}",
                params=("chunk_size",), serial="ChunkedKVCache", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"speculative"}),
                summary="prefill/verify layout of ChunkedKVCache: ragged rows"),
    Composition(name="PaddedChunkedRows", codec="plain", geometry="chunked",
                arrangement="shared", signature="kv:padded-chunked:{chunk_size}",
                params=("chunk_size",), serial="ChunkedKVCache",
                summary="decode layout of ChunkedKVCache: rows sharing one write column"),
    Composition(name="ChunkedKVCache", codec="plain", geometry="chunked", arrangement="serial",
                signature="kv:chunked:{chunk_size}", params=("chunk_size",),
                roles=Roles("PaddedChunkedRows", "BatchedChunkedKVCache",
                            "BatchedChunkedKVCache"),
                peers=("ChunkedKVCache",), parity="ChunkedKVCache",
                summary="serial chunked-local attention (llama4's local layers)"),
    Composition(name="BatchedChunkedQuantizedKVCache", codec="affine", geometry="chunked",
                arrangement="ragged",
                signature="kv:batched-chunked-quant:{chunk_size}:{bits}:{group_size}",
                params=_CHUNKED_AFFINE, serial="ChunkedQuantizedKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="prefill/verify layout of ChunkedQuantizedKVCache: ragged rows"),
    Composition(name="PaddedChunkedQuantRows", codec="affine", geometry="chunked",
                arrangement="shared",
                signature="kv:padded-chunked-quant:{chunk_size}:{bits}:{group_size}",
                params=_CHUNKED_AFFINE, serial="ChunkedQuantizedKVCache",
                summary="decode layout of ChunkedQuantizedKVCache"),
    Composition(name="ChunkedQuantizedKVCache", codec="affine", geometry="chunked",
                arrangement="serial", signature="kv:chunked-quant:{chunk_size}:{bits}:{group_size}",
                params=_CHUNKED_AFFINE,
                roles=Roles("PaddedChunkedQuantRows", "BatchedChunkedQuantizedKVCache",
                            "BatchedChunkedQuantizedKVCache"),
                peers=("ChunkedKVCache",),
                summary="serial affine chunked-local attention"),
    Composition(name="BatchedChunkedMxKVCache", codec="mx", geometry="chunked",
                arrangement="ragged",
                signature="kv:batched-chunked-mx:{chunk_size}:{group_size}:{bits}",
                params=_CHUNKED_AFFINE, serial="ChunkedMxKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="microscaling chunked rows (mxfp8, mxfp4, nvfp4), all three roles"),
    Composition(name="ChunkedMxKVCache", codec="mx", geometry="chunked",
                arrangement="serial", signature="kv:chunked-mx:{chunk_size}:{group_size}:{bits}",
                params=_CHUNKED_AFFINE,
                roles=Roles("BatchedChunkedMxKVCache", "BatchedChunkedMxKVCache",
                            "BatchedChunkedMxKVCache"),
                peers=("ChunkedKVCache",),
                summary="serial microscaling chunked-local attention"),
    # -- bf16-first chunked-local attention (issue 25): the delayed modifier on the chunked
    # geometry ------------------------------------------------------------------------
    Composition(name="Bf16FirstChunkedQuantizedKVCache", codec="affine", geometry="chunked",
                arrangement="serial",
                signature="kv:chunked-quant:{chunk_size}:{bits}:{group_size}",
                params=(*_CHUNKED_AFFINE, "start"), modifiers=frozenset({"delayed"}),
                summary="ChunkedKVCache until the append that reaches start, then "
                        "ChunkedQuantizedKVCache holding the same chunk (bf16-first)"),
    Composition(name="DelayedChunkedQuantizedKVCache", codec="affine", geometry="chunked",
                arrangement="ragged",
                signature="kv:delayed-chunked-quant:{chunk_size}:{bits}:{group_size}:{start}",
                params=(*_CHUNKED_AFFINE, "start"), serial="ChunkedQuantizedKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"delayed", "speculative"}),
                summary="chunked rows that convert to affine at their own boundary"),
    Composition(name="Bf16FirstChunkedMxKVCache", codec="mx", geometry="chunked",
                arrangement="serial",
                signature="kv:chunked-mx:{chunk_size}:{group_size}:{bits}",
                params=(*_CHUNKED_AFFINE, "start"), modifiers=frozenset({"delayed"}),
                summary="ChunkedKVCache until the append that reaches start, then "
                        "ChunkedMxKVCache holding the same chunk (bf16-first)"),
    Composition(name="DelayedChunkedMxKVCache", codec="mx", geometry="chunked",
                arrangement="ragged",
                signature="kv:delayed-chunked-mx:{chunk_size}:{group_size}:{bits}:{start}",
                params=(*_CHUNKED_AFFINE, "start"), serial="ChunkedMxKVCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"delayed", "speculative"}),
                summary="chunked rows that convert to a microscaling codec at their own "
                        "boundary"),
    # -- plain and affine full attention ---------------------------------------------
    _plain_growing("BatchedKVCache", "ragged", "kv:batched-positions", serial="KVCache",
                   roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                   summary="prefill/verify layout of KVCache: ragged rows"),
    Composition(name="BatchedQuantizedKVCache", codec="affine", geometry="growing",
                arrangement="ragged", signature="kv:batched-quant:{bits}:{group_size}",
                params=_AFFINE, serial="QuantizedKVCache", roles=Roles(SELF, SELF, SELF),
                modifiers=frozenset({"speculative"}),
                summary="prefill/verify layout of QuantizedKVCache: ragged rows"),
    # -- recurrent (issue 14) --------------------------------------------------------
    Composition(name="BatchedSSMCache", codec="state", geometry="recurrent",
                arrangement="ragged", signature="ssm:batched", serial="SSMCache",
                roles=Roles(SELF, SELF, SELF), modifiers=frozenset({"speculative"}),
                summary="recurrent rows: snapshot + replay rollback"),
    Composition(name="TurboQuantKVCache", codec="turbo", geometry="growing", arrangement="serial",
                signature="kv:turboquant:{k_bits}:{v_bits}", params=_TURBO,
                roles=Roles("BatchedTurboQuantKVCache", "BatchedTurboQuantKVCache",
                            "BatchedTurboQuantKVCache"),
                peers=("KVCache",), summary="serial TurboQuant full attention"),
    Composition(name="SSMCache", codec="state", geometry="recurrent", arrangement="serial",
                signature="ssm", roles=Roles("BatchedSSMCache", "BatchedSSMCache", "BatchedSSMCache"),
                peers=("ArraysCache", "MambaCache"),
                summary="conv + recurrent state, updated by the layer"),
    Composition(name="PaddedQuantKVRows", codec="affine", geometry="growing", arrangement="shared",
                signature="kv:padded-rows-quant:{bits}:{group_size}", params=_AFFINE,
                serial="QuantizedKVCache", summary="decode layout of QuantizedKVCache"),
    Composition(name="QuantizedKVCache", codec="affine", geometry="growing", arrangement="serial",
                signature="kv:quant:{bits}:{group_size}", params=_AFFINE,
                roles=Roles("PaddedQuantKVRows", "BatchedQuantizedKVCache",
                            "BatchedQuantizedKVCache"),
                peers=("KVCache", "QuantizedKVCache"), parity="QuantizedKVCache",
                summary="serial affine full attention"),
    _plain_growing("PaddedKVRows", "shared", "kv:padded-rows", serial="KVCache",
                   parity="BatchKVCache",
                   summary="decode layout of KVCache (mlx-lm BatchKVCache)"),
    _plain_growing("KVCache", "serial", "kv:plain",
                   roles=Roles("PaddedKVRows", "BatchedKVCache", "BatchedKVCache"),
                   peers=("KVCache",), parity="KVCache", summary="serial plain full attention"),
)  # fmt: skip

_BY_NAME: dict[str, Composition] = {c.name: c for c in COMPOSITIONS}


def composition(name: str) -> Composition:
    """The table's entry for ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no composition named {name!r}") from None


#: Presets on the row machinery declared by hand: ``EncodedLatentCache`` (the latent
#: surface in two stages; its entry does not name the delayed modifier the families and
#: the delayed layouts' forms key on).
_OWN_MACHINERY = frozenset({"EncodedLatentCache"})


def presets_on_rows(
    geometries: Container[str], *, staged: Container[str | tuple[str, str]] = ()
) -> tuple[Composition, ...]:
    """The landed entries an implementation's ``classes.build`` makes, given the geometry
    kinds it has hooks for: no modifier but ``speculative``, a serial storage with the
    ``delayed`` one (the legos), and the ragged delayed layouts whose geometry kind, or
    ``(geometry, arrangement)``, is in ``staged`` (hooks holding rows of several stages);
    the latent classes and those of the paged placement are written by hand."""

    def built(c: Composition) -> bool:
        if c.modifiers <= {"speculative"}:
            return True
        if c.modifiers == {"delayed"}:
            return not c.is_layout
        holds_stages = c.geometry in staged or (c.geometry, c.arrangement) in staged
        return holds_stages and c.modifiers == {"delayed", "speculative"}

    return tuple(
        c
        for c in landed()
        if c.geometry in geometries
        and c.placement == "contiguous"
        and built(c)
        and c.name not in _OWN_MACHINERY
    )


def lego_preset(entry: Composition) -> Composition:
    """The serial lego (the delayed modifier on a serial storage) of a delayed layout's
    geometry and codec: rows joined from legos extract as legos again."""
    for c in landed():
        if (
            c.arrangement == "serial"
            and c.modifiers == {"delayed"}
            and (c.geometry, c.codec) == (entry.geometry, entry.codec)
        ):
            return c
    raise InvalidInputError(f"{entry.name} has no lego of its geometry and codec")


def serial_preset(geometry: str, codec: str) -> Composition:
    """The serial preset of ``codec`` (a codec kind) on ``geometry`` with no modifier
    (``QuantizedKVCache`` for ``("growing", "affine")``): what a row of that codec
    extracts into."""
    for entry in landed():
        if (
            entry.arrangement == "serial"
            and not entry.modifiers
            and entry.geometry == geometry
            and entry.codec == codec
        ):
            return entry
    raise InvalidInputError(f"no serial preset stores the {codec} codec on the {geometry} geometry")


def contiguous_preset(entry: Composition) -> Composition:
    """The contiguous preset a paged entry holds its stage 0 in, beside its pool (contract
    §0.5): the landed one of the same codec kind, geometry and modifiers that is its own
    serial storage and stores one stage (``MLACache`` for ``PagedLatentCache``)."""
    for c in landed():
        if (
            c.placement == "contiguous"
            and c.serial is None
            and c.name not in _OWN_MACHINERY
            and (c.codec, c.geometry, c.modifiers) == (entry.codec, entry.geometry, entry.modifiers)
        ):
            return c
    raise InvalidInputError(f"no contiguous preset holds {entry.name}'s stage 0")


def stage_presets(entry: Composition) -> tuple[Composition, Composition]:
    """The serial presets of a delayed serial storage's two stages: the plain one and the
    one of its codec, on its geometry, with no modifier (``KVCache`` and
    ``QuantizedKVCache`` for ``Bf16FirstQuantizedKVCache``): what it shows as its storage."""
    return serial_preset(entry.geometry, "plain"), serial_preset(entry.geometry, entry.codec)


#: Presets documented on a sibling's page (the affine verify ring shares the plain one's;
#: the legos share one).
_SHARED_PAGES = {
    "SpeculativeRotatingAffineLayout": "SpeculativeRotatingKVCache",
    "Bf16FirstQuantizedKVCache": "bf16-first",
    "Bf16FirstRotatingQuantizedKVCache": "bf16-first",
    "Bf16FirstTurboQuantKVCache": "bf16-first",
    "Bf16FirstMxKVCache": "bf16-first",
    "MxKVCache": "mx-codec",
    "BatchedMxKVCache": "mx-codec",
    "DelayedMxKVCache": "mx-codec",
    "BatchedChunkedKVCache": "ChunkedKVCache",
    "BatchedRotatingMxCache": "mx-codec",
    "SpeculativeRotatingMxLayout": "mx-codec",
    "RotatingMxKVCache": "mx-codec",
    "Bf16FirstRotatingMxKVCache": "bf16-first",
    "DelayedRotatingMxKVCache": "mx-codec",
    "PaddedChunkedRows": "ChunkedKVCache",
    "ChunkedQuantizedKVCache": "ChunkedKVCache",
    "BatchedChunkedQuantizedKVCache": "ChunkedKVCache",
    "PaddedChunkedQuantRows": "ChunkedKVCache",
    "ChunkedMxKVCache": "mx-codec",
    "BatchedChunkedMxKVCache": "mx-codec",
    "Bf16FirstChunkedQuantizedKVCache": "bf16-first",
    "Bf16FirstChunkedMxKVCache": "bf16-first",
    "DelayedChunkedQuantizedKVCache": "ChunkedKVCache",
    "DelayedChunkedMxKVCache": "ChunkedKVCache",
}


def preset_class(
    entry: Composition, bases: tuple[type, ...], module: str, **members: object
) -> type[Any]:
    """The public class of ``entry`` (what each implementation's ``classes.build`` makes):
    ``bases`` plus ``members``, named ``entry.name`` in ``module`` (pickles and saved files
    record that name), its docstring the entry's summary and spec page."""
    page = _SHARED_PAGES.get(entry.name, entry.name)
    namespace = {
        "__module__": module,
        "__qualname__": entry.name,
        "__doc__": f"{entry.summary[:1].upper()}{entry.summary[1:]} (``spec/{page}.md``).",
        "composition": entry,
        **members,
    }
    return types.new_class(entry.name, bases, exec_body=lambda body: body.update(namespace))


def placed_geometries(placement: PlacementKind) -> frozenset[str]:
    """The token geometries some landed preset of ``placement`` holds (paged: growing,
    ring and chunked)."""
    return frozenset(c.geometry for c in landed() if c.placement == placement)


def landed() -> tuple[Composition, ...]:
    """The compositions both implementations provide today, in table order."""
    return _LANDED


#: ``landed()`` (the table is a tuple of frozen entries: every request's fresh caches ask).
_LANDED: tuple[Composition, ...] = tuple(c for c in COMPOSITIONS if c.is_landed)


def layouts_of(serial: str) -> tuple[Composition, ...]:
    """The landed layouts whose rows extract into ``serial``, decode layout first."""
    order = {"shared": 0, "ragged": 1}
    rows = [c for c in landed() if c.serial == serial]
    roles = composition(serial).roles
    decode = None if roles is None else roles.decode
    return tuple(sorted(rows, key=lambda c: (c.name != decode, order.get(c.arrangement, 2))))


def parameter_defaults(entry: Composition) -> dict[str, Any]:
    """The parameters ``entry``'s codec and geometry specs default (affine's ``bits`` 8,
    ``group_size`` 64; a ring's ``keep`` 0): each spec's own dataclass defaults."""
    specs = (CODECS.get(entry.codec), GEOMETRIES.get(entry.geometry))
    return {
        name: value for spec in specs if spec is not None for name, value in _spec_defaults(spec)
    }


@functools.cache
def _spec_defaults(spec: type) -> tuple[tuple[str, Any], ...]:
    # Cached per class: a constructor binds its arguments on every call.
    return tuple(
        (spec_field.name, spec_field.default)
        for spec_field in fields(spec)
        if spec_field.default is not MISSING
    )


def bind_arguments(
    entry: Composition, args: Sequence[object], kwargs: Mapping[str, object]
) -> tuple[CodecSpec, GeometrySpec, KvGeometry | None]:
    """A constructor call's arguments as specs: ``QuantizedKVCache(32, 4)`` ->
    ``(Affine(bits=4, group_size=32), Growing(), None)``.

    Accepts the parameters of ``entry.params`` positionally (mlx-lm's order) or by
    keyword, ``codec=`` / ``token_geometry=`` specs instead of them, and ``geometry=`` (a
    ``KvGeometry``) to declare the KV heads before the first token.
    """
    values: dict[str, object] = dict(kwargs)
    declared = values.pop("geometry", None)
    if declared is not None and not isinstance(declared, KvGeometry):
        raise InvalidInputError(not_a_geometry_message(type(declared).__name__))
    codec_spec = values.pop("codec", None)
    geometry_spec = values.pop("token_geometry", None)
    if len(args) > len(entry.params):
        raise InvalidInputError(positional_arguments_message(entry.name, entry.params, len(args)))
    for name, value in zip(entry.params, args, strict=False):
        if name in values:
            raise InvalidInputError(given_twice_message(entry.name, name))
        values[name] = value
    unknown = sorted(set(values) - set(entry.params))
    if unknown:
        raise InvalidInputError(
            f"{entry.name} has no parameter {', '.join(unknown)}; "
            f"it takes {', '.join(entry.params) or 'no parameters'}"
        )
    implied: dict[str, int] = {}  # what the given specs already say
    if codec_spec is not None:
        if not is_codec_spec(codec_spec):
            raise InvalidInputError(f"{entry.name} cannot be built from {codec_spec!r}")
        implied.update(codec_spec.parameters())
    if geometry_spec is not None:
        if not is_geometry_spec(geometry_spec):
            raise InvalidInputError(f"{entry.name} cannot be built from {geometry_spec!r}")
        implied.update(geometry_spec.parameters())
    clash = sorted(set(values) & set(implied))
    if clash:
        raise InvalidInputError(given_twice_message(entry.name, ", ".join(clash), spec=True))
    given: dict[str, object] = {**parameter_defaults(entry), **implied, **values}
    numbers: dict[str, int] = {}
    for name in entry.params:
        if name not in given:
            raise InvalidInputError(needs_parameters_message(entry.name, name))
        value = given[name]
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise InvalidInputError(not_an_integer_message(name, value))
        numbers[name] = operator.index(value)
    if codec_spec is None:
        codec_spec = codec_spec_for(entry, numbers)
    if geometry_spec is None:
        geometry_spec = geometry_spec_for(entry, numbers)
    if not is_codec_spec(codec_spec) or codec_spec.kind != entry.codec:
        raise InvalidInputError(f"{entry.name} stores the {entry.codec} codec, got {codec_spec!r}")
    if not is_geometry_spec(geometry_spec) or geometry_spec.kind != entry.geometry:
        raise InvalidInputError(wrong_geometry_message(entry.name, entry.geometry, geometry_spec))
    return codec_spec, geometry_spec, declared


def codec_spec_for(entry: Composition, numbers: Mapping[str, int]) -> CodecSpec:
    """``entry``'s codec spec from its parameters (``numbers``: the codec's
    ``parameters()``, extra keys ignored); ``KeyError`` if one is missing."""
    codec = CODECS.get(entry.codec)
    if codec is None:
        raise InvalidInputError(f"{entry.name} ({entry.codec} codec) is not implemented yet")
    return codec.from_parameters(numbers)


def geometry_spec_for(entry: Composition, numbers: Mapping[str, int]) -> GeometrySpec:
    """``entry``'s geometry spec from its parameters (``numbers``: the geometry's
    ``parameters()``, extra keys ignored)."""
    geometry = GEOMETRIES.get(entry.geometry)
    if geometry is None:
        raise InvalidInputError(f"{entry.name} ({entry.geometry} geometry) is not implemented yet")
    return geometry.from_parameters(numbers)


def _role_factory(classes: Mapping[str, type], role: str) -> Callable[[Any], BatchableCache]:
    if role == SELF:
        return own_empty_batch
    target: Any = classes[role]

    def build(cache: Any) -> BatchableCache:
        placement = getattr(cache, "placement", None)
        if placement is not None:  # a paged storage's placement (its block size) goes too
            paged: BatchableCache = target(
                codec=cache.codec_spec, token_geometry=cache.token_geometry,
                geometry=cache.geometry, placement=placement,
            )  # fmt: skip
            return paged
        layout: BatchableCache = target.from_specs(
            cache.codec_spec, cache.token_geometry, geometry=cache.geometry
        )
        return layout

    return build


def register_compositions(classes: Mapping[str, type]) -> None:
    """Register an implementation's classes (by composition name) in the row-layout table.

    Every landed composition must be in ``classes``; each class must name its
    composition (``cls.composition.name``) and build from specs
    (``cls.from_specs(codec, token_geometry, geometry=…)``); a delayed layout's groups
    and lego must agree with its entry. A refused call registers nothing.
    """
    missing = [c.name for c in landed() if c.name not in classes]
    if missing:
        raise KvRowsError(f"the implementation lacks {', '.join(missing)}")
    for entry in landed():  # all checked before anything is registered
        cls: Any = classes[entry.name]
        if getattr(cls, "composition", None) is not entry:
            raise KvRowsError(f"{cls.__name__} does not declare the {entry.name} composition")
        if "delayed" in entry.modifiers and entry.is_layout:
            _check_delayed(entry, cls)
    for entry in reversed(landed()):  # the table keeps subclasses ahead of their bases
        cls = classes[entry.name]
        if entry.roles is None:
            continue
        register_row_layouts(
            cls,
            decode=_role_factory(classes, entry.roles.decode),
            prefill=_role_factory(classes, entry.roles.prefill),
            verify=_role_factory(classes, entry.roles.verify),
        )


def _check_delayed(entry: Composition, cls: Any) -> None:
    """A delayed layout's parts agree with its entry: a plain and an affine ragged group of
    its token geometry, the affine one holding rows of its serial storage, and the serial
    lego that converts into that serial storage."""
    plain = getattr(getattr(cls, "plain_group_class", None), "composition", None)
    affine = getattr(getattr(cls, "affine_group_class", None), "composition", None)
    lego = getattr(getattr(cls, "lego_class", None), "affine_class", None)
    agrees = (
        isinstance(plain, Composition)
        and isinstance(affine, Composition)
        and _stores_activations(plain.codec)
        and affine.codec == entry.codec
        and {(g.geometry, g.arrangement) for g in (plain, affine)} == {(entry.geometry, "ragged")}
        and affine.serial == entry.serial
        and getattr(lego, "composition", None) is _BY_NAME.get(str(entry.serial))
    )
    if not agrees:
        raise KvRowsError(
            f"{cls.__name__}: a delayed layout needs a plain and an {entry.codec} ragged "
            f"{entry.geometry} group and a lego converting to {entry.serial}"
        )


def _stores_activations(kind: str) -> bool:
    """Whether codec ``kind`` stores keys and values as they are (a delayed layout's first
    group: the plain codec)."""
    codec = CODECS.get(kind)
    return codec is not None and is_kv_codec(codec) and not codec.encodes


def serial_for_peer(peer: str, codec: CodecSpec) -> Composition:
    """The landed serial storage serving layers mlx-lm gives a ``peer`` cache, under ``codec``."""
    for entry in landed():
        if entry.arrangement == "serial" and peer in entry.peers and entry.codec == codec.kind:
            return entry
    raise InvalidInputError(f"no kvrows storage serves mlx-lm {peer} under the {codec.kind} codec")


def _roles_for_serial(entry: Composition) -> frozenset[str]:
    """The roles a layout fills for its serial storage (empty for a serial storage)."""
    owner = None if entry.serial is None else composition(entry.serial).roles
    if owner is None:
        return frozenset()
    return frozenset(role for role, target in owner.items() if target == entry.name)


def affine_counterpart(name: str) -> Composition | None:
    """The landed affine composition that holds what ``name`` holds, quantized
    (``to_quantized``): same token geometry, arrangement and modifiers, and, where
    several qualify, the one filling the same roles for its serial storage
    (``BatchedRotatingCache`` -> ``BatchedRotatingQuantCache``, both decode layouts).
    ``None`` when the table has no such composition."""
    entry = composition(name)
    candidates = [
        c
        for c in landed()
        if c.codec == Affine.kind  # what mlx-lm's ``to_quantized`` quantizes to
        and c.geometry == entry.geometry
        and c.arrangement == entry.arrangement
        and c.modifiers == entry.modifiers
    ]
    if len(candidates) > 1:
        roles = _roles_for_serial(entry)
        candidates = [c for c in candidates if _roles_for_serial(c) == roles]
    return candidates[0] if len(candidates) == 1 else None
