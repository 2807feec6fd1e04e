"""Pieces every storage and layout shares, whatever its array library.

They read only Python ints, shapes and ``nbytes``, so the NumPy reference and the MLX
implementation use the same code for bookkeeping that is not the subject of the
conformance suite (byte projections, count validation, codec parameters).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self, TypeVar

from kvrows.codec import PlaneSet, PlaneSpec
from kvrows.compositions import Composition
from kvrows.errors import PROJECTED_BYTES_NEEDS_GEOMETRY, InvalidInputError, LayoutStateError
from kvrows.schemes import CodecSpec, GeometrySpec
from kvrows.validation import KvGeometry, as_count

__all__ = [
    "AffineParameters",
    "ComposedIdentity",
    "PlaneHolder",
    "SavedState",
    "TurboParameters",
    "all_or_nothing",
    "check_counts",
    "row_bytes",
]


_R = TypeVar("_R")


def all_or_nothing(
    owner: Any, step: Callable[[], _R], *, copied: Sequence[str] = (), held: bool = False
) -> _R:
    """Run ``step``, a mutating operation of ``owner`` whose checks all passed; if anything
    in it raises (an MLX or NumPy op, a codec, an allocation: contract §9), put ``owner``'s
    host state back and re-raise the same exception. The record is shallow: the attributes
    (lists also by content, put back in place: some steps edit them in place; ``copied``:
    helper objects a step edits, recorded by ``copy.copy``) and what ``owner._fault_parts()`` returns (restored
    by ``owner._fault_restore``). No array is copied: an operation never writes an array
    in place before its last step that can raise; it builds new arrays and rebinds.
    ``held``: ``step`` writes held arrays in place and can raise after (an append a
    conversion follows): ``owner._fault_parts(held=True)`` also keeps what they hold (MLX:
    a second handle, so the write copies once instead of writing in place)."""
    record = dict(vars(owner))
    # Lists go back in place: a list may be held elsewhere by identity (a finalizer holds
    # a paged storage's tables).
    lists = [(v, list(v)) for v in record.values() if type(v) is list]
    for name in copied:
        record[name] = copy.copy(record[name])
    fault_parts = getattr(owner, "_fault_parts", None)
    parts = None if fault_parts is None else fault_parts(held=held)
    try:
        return step()
    except BaseException:
        vars(owner).clear()
        vars(owner).update(record)
        for held_list, items in lists:
            held_list[:] = items
        if parts is not None:
            owner._fault_restore(parts)
        raise


class PlaneHolder:
    """A cache whose state is its plane set (``None`` while it holds nothing)."""

    _planes: PlaneSet | None

    def _held_planes(self) -> tuple[Any, ...]:
        return () if self._planes is None else tuple(p for h in self._planes.values() for p in h)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held, capacity slack included."""
        return sum(int(p.nbytes) for p in self._held_planes())

    @property
    def state(self) -> tuple[Any, ...]:
        """The arrays to evaluate at a chunk boundary (borrowed)."""
        return self._held_planes()

    @property
    def state_needs_dispose(self) -> bool:
        return False


class ComposedIdentity:
    """What a storage is, read off its composition and specs (the ``Composed`` protocol).

    Both implementations' storages inherit it: it reads only the specs and the KV
    geometry, so sharing it keeps the reference an independent oracle of everything the
    conformance suite compares (``signature()`` is checked against the composition table
    and the contract page instead).
    """

    composition: ClassVar[Composition]
    codec: Any
    #: The codecs of the stages (contract §0.5): one, but under the delayed modifier.
    _stages: tuple[Any, ...]
    _token_geometry: GeometrySpec
    _geometry: KvGeometry | None

    # -- stages (the delayed modifier's int half; each twin's ``_use_stages`` makes codecs)
    @property
    def stages(self) -> tuple[CodecSpec, ...]:
        """The codec of each stage, in order (one but under the delayed modifier)."""
        return tuple(codec.spec for codec in self._stages)

    @property
    def _stage(self) -> int:
        """The stage every row is in (writes and reads go through its codec, ``codec``)."""
        return self._stages.index(self.codec)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Each implementation binds its arguments (``compositions.bind_arguments``)."""
        raise NotImplementedError

    @classmethod
    def from_specs(
        cls,
        codec_spec: CodecSpec,
        token_geometry: GeometrySpec,
        *,
        geometry: KvGeometry | None = None,
    ) -> Self:
        """An empty instance built from frozen specs (the row-layout table's factories)."""
        return cls(codec=codec_spec, token_geometry=token_geometry, geometry=geometry)

    @property
    def codec_spec(self) -> CodecSpec:
        spec: CodecSpec = self.codec.spec
        return spec

    @property
    def token_geometry(self) -> GeometrySpec:
        return self._token_geometry

    @property
    def geometry(self) -> KvGeometry | None:
        """The KV geometry, once declared or learnt from the first token."""
        return self._geometry

    def signature(self) -> str:
        return self.composition.signature_for(self.codec_spec, self._token_geometry)

    def plane_specs(self) -> tuple[PlaneSpec, ...]:
        """The planes every row holds: the keys' planes, then the values' (none before the
        KV geometry is known)."""
        g = self._geometry
        if g is None:
            return ()
        keys: tuple[PlaneSpec, ...] = self.codec.plane_specs("keys", g.key_dim, g.dtype)
        values: tuple[PlaneSpec, ...] = self.codec.plane_specs(
            "values", g.value_dim, g.dtype, "values"
        )
        return keys + values


class TurboParameters:
    """``k_bits`` and ``v_bits`` of a cache over the TurboQuant codec."""

    codec: Any

    @property
    def k_bits(self) -> int:
        return int(self.codec.k_bits)

    @property
    def v_bits(self) -> int:
        return int(self.codec.v_bits)


class AffineParameters:
    """``group_size`` and ``bits`` of a cache over the affine codec (mlx-lm reads both)."""

    codec: Any

    @property
    def group_size(self) -> int:
        return int(self.codec.group_size)

    @property
    def bits(self) -> int:
        return int(self.codec.bits)


def shapes_token_bytes(codec: Any, shapes: Any) -> int:
    """Bytes one token of one row takes under ``codec``: every tensor ``shapes`` (a KV
    geometry, a codec's ``Shapes``) names, at its heads, width and dtype."""
    total = 0
    for tensor in shapes.tensors:
        heads, dim, dtype = shapes.tensor_image(tensor)
        total += int(codec.token_bytes(heads, dim, dtype, tensor))
    return total


def row_bytes(
    codec: Any, geometry: KvGeometry | None, tokens: int, cap: float | None = None
) -> int:
    """Bytes one row needs to hold ``tokens`` positions (at most ``cap`` of them stored)."""
    count = as_count(tokens, "tokens")
    if geometry is None:
        raise LayoutStateError(PROJECTED_BYTES_NEEDS_GEOMETRY)
    per_token = shapes_token_bytes(codec, geometry)
    stored = count if cap is None else int(min(count, cap))
    return int(per_token) * stored


def check_counts(counts: object, batch_size: int) -> list[int]:
    """One non-negative count per row (``trim_rows``)."""
    if isinstance(counts, str | bytes) or not isinstance(counts, Sequence):
        raise InvalidInputError("trim_rows takes one count per row")
    if len(counts) != batch_size:
        raise InvalidInputError(
            f"trim_rows needs {batch_size} counts (one per row), got {len(counts)}"
        )
    return [as_count(c, f"counts[{i}]") for i, c in enumerate(counts)]


_Saved = TypeVar("_Saved", bound="SavedState")


class SavedState:
    """``state`` (getter and setter) and ``from_state``, over each implementation's
    ``_state()`` / ``_restore(...)`` (``optimized/forms.py``, ``reference/forms.py``; the
    forms are ``kvrows.forms``)."""

    _geometry: KvGeometry | None
    token_geometry: GeometrySpec

    def _state(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def _before_restore(self) -> None:
        """Called before the ``state`` setter replaces everything (a verify layout in the
        middle of a round, or invalidated, refuses)."""

    @classmethod
    def _restore(
        cls: type[_Saved],
        state: Any,
        meta_state: Any,
        keep: int | None,
        geometry: KvGeometry | None,
    ) -> _Saved:
        raise NotImplementedError

    @property
    def state(self) -> tuple[Any, ...]:
        """The cache's state in its class's form (``kvrows.forms``: mlx-lm's form where
        mlx-lm has the class); evaluable with ``mx.eval``."""
        return self._state()

    @state.setter
    def state(self, value: Any) -> None:
        """Hold ``value`` (a state of this class); a refused value changes nothing."""
        self._before_restore()
        keep = getattr(self.token_geometry, "keep", 0)
        fresh = type(self)._restore(value, None, keep, self._geometry)
        self.__dict__.clear()
        self.__dict__.update(fresh.__dict__)

    @classmethod
    def from_state(
        cls: type[_Saved],
        state: Any,
        meta_state: Any = None,
        *,
        keep: int | None = None,
        geometry: KvGeometry | None = None,
    ) -> _Saved:
        """A new cache holding ``state`` (mlx-lm's ``from_state``; ``meta_state`` reads
        mlx-lm's older two-part form; ``keep``: a ring layout's sink tokens, which mlx-lm's
        batch form lacks; ``geometry``: the KV geometry of an empty state)."""
        return cls._restore(state, meta_state, keep, geometry)
