"""Bf16-first storages ("legos"): plain storage that converts itself to affine once.

A lego is the serial storage a quantized scheme with a bf16-first boundary composes for
one layer (``spec/bf16-first.md``). It wraps one storage of the composition table at a
time: the plain serial storage (``KVCache`` / ``RotatingKVCache``) until an append leaves
it holding ``offset >= start and offset != 0`` tokens, then that storage's affine
counterpart (``QuantizedKVCache`` / ``RotatingQuantizedKVCache``). The converting append
is read in plain precision (what it returns); the storage converts before the append
returns; every later append is quantized. The first append is therefore always plain,
even with ``start == 0`` (mlx-lm converts after the forward that filled the cache). The
conversion is irreversible: trimming below ``start`` keeps the affine storage.

Legos are not composition-table entries: they are the seed's wrappers around table
storages, so everything a storage reports (``signature()``, ``state``, ``offset``,
``nbytes``, ...) is the current storage's, and a saved lego is its storage's form.

This module holds the array-free logic once; each implementation (``optimized/lego.py``,
``reference/lego.py``) supplies its two storage classes and its conversion.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, TypeAlias

from kvrows.codec import CodecSpec
from kvrows.codecs import is_codec_spec
from kvrows.conversion import Conversion, conversion_due
from kvrows.errors import InvalidInputError, not_a_geometry_message
from kvrows.geometries import is_geometry_spec
from kvrows.protocols import RowAttention, TimeOrderedReads
from kvrows.schemes import Affine, GeometrySpec, Growing, Plain, Ring, Turbo
from kvrows.validation import KvGeometry, as_count

__all__ = [
    "Bf16First",
    "ConversionBoundary",
    "FullAttentionLego",
    "LegoComposition",
    "SlidingWindowLego",
    "Target",
    "TurboLego",
    "check_target_dims",
    "conversion_due",
    "lego_arguments",
    "turbo_lego_arguments",
]

#: The codec a bf16-first row converts to: any that encodes (``CodecSpec.encodes``).
Target: TypeAlias = CodecSpec


def check_target_dims(key_dim: int, value_dim: int, target: Target) -> None:
    """Refuse head dims ``target`` cannot store (affine: a group size that divides them;
    TurboQuant: its head dims), naming the side."""
    for side, dim in (("key", key_dim), ("value", value_dim)):
        try:
            target.check_head_dim(dim)
        except InvalidInputError as error:
            raise InvalidInputError(
                f"{side} head dim {dim} cannot be converted to {target.name}: {error}"
            ) from None


def check_target(name: str, target: object, token_geometry: GeometrySpec) -> Target:
    """``target`` as a conversion codec of ``token_geometry`` (TurboQuant is full attention
    only: sliding layers stay plain rings under it)."""
    if not is_codec_spec(target) or not target.encodes:
        raise InvalidInputError(f"{name} converts to an affine or TurboQuant codec, got {target!r}")
    target.check_token_geometry(name, token_geometry)
    return target


class LegoComposition:
    """``lego.composed``: hand the storage out (``release``) or wrap one (``over``)."""

    def __init__(self, lego: Bf16First) -> None:
        self._lego = lego

    def release(self) -> Any:
        """The lego's current storage, now the caller's; the lego is back to its
        constructed, empty state (plain, nothing held)."""
        lego = self._lego
        storage = lego._storage
        lego._reset()
        return storage

    def over(self, storage: Any, *, minimum_reusable_offset: int | None = None) -> Bf16First:
        """A lego of the same parameters holding ``storage``: in its plain phase when
        ``storage`` is the plain serial class, converted when it is the affine one (same
        codec parameters and token geometry). ``minimum_reusable_offset`` of a converted
        storage defaults to its offset when ``start > 0`` (the conversion point is not
        recorded in a storage, and its offset is the conservative bound), else 0."""
        lego = self._lego
        fresh = lego._like()
        fresh._adopt(storage, minimum_reusable_offset)
        return fresh

    def storage_signatures(self) -> frozenset[str]:
        """The signatures of the storages ``over`` takes: the plain one (the lego's own)
        and the converted one (a stored row of either may stand in for a fresh lego)."""
        lego = self._lego
        converted = lego.affine_class.from_specs(lego.quantization, lego.token_geometry)
        return frozenset({lego.signature(), converted.signature()})


class ConversionBoundary:
    """What a lego and a delayed layout share: the conversion record of their rows
    (``kvrows.conversion.Conversion``: the codec they convert to, affine or TurboQuant, and
    the boundary ``start``), the token geometry, and ``bits`` / ``group_size`` under the
    record's rule: an affine target's, visible only while the last append returned
    quantized reads (mlx-lm's attention asks ``hasattr(cache, "bits")`` right after
    ``update_and_fetch`` to pick its quantized path, and a converting append returns plain
    keys and values). A TurboQuant target never shows them: its reads defer the values, so
    they go through the codec's own attention (``kvrows.app.attention.dispatch``), not
    mlx-lm's."""

    #: The record's class (a test plants a wrong rule through it).
    conversion_class: ClassVar[type[Conversion]] = Conversion
    _conversion: Conversion
    _token_geometry: GeometrySpec

    @property
    def start(self) -> int:
        """The bf16-first boundary: the offset at which a row converts."""
        return self._conversion.start

    @property
    def quantization(self) -> Target:
        """The codec rows convert to."""
        return self._conversion.target

    @property
    def token_geometry(self) -> GeometrySpec:
        return self._token_geometry

    @property
    def converts_to_deferred_values(self) -> bool:
        """Whether the target codec's reads defer their values (TurboQuant: attention goes
        through the codec, ``kvrows.app.attention.dispatch``)."""
        return self._conversion.target.reads != "affine"

    @property
    def bits(self) -> int:
        return self._conversion.read_parameter(type(self).__name__, "bits")

    @property
    def group_size(self) -> int:
        return self._conversion.read_parameter(type(self).__name__, "group_size")

    @property
    def minimum_reusable_offset(self) -> int:
        """The largest offset at which a row converted with ``start > 0`` (prefix reuse
        must not trim below it: that row would skip its conversion); 0 before any row
        converts and with ``start == 0``."""
        return self._conversion.minimum_reusable_offset


class Bf16First(ConversionBoundary):
    """The lego's wrapper logic over one storage (see the module docstring).

    Implementations set ``plain_class`` / ``affine_class`` per geometry and implement
    ``_convert``. Arguments follow the wrapped converted class's positional order, then
    ``start``.
    """

    #: The plain serial class and its converted counterpart (``affine_class``: the affine
    #: or TurboQuant serial class; set by each implementation).
    plain_class: ClassVar[type[Any]]
    affine_class: ClassVar[type[Any]]

    def __init__(
        self,
        quantization: Target,
        token_geometry: GeometrySpec,
        start: int,
        geometry: KvGeometry | None = None,
    ) -> None:
        if not is_geometry_spec(token_geometry) or not token_geometry.token_axis:
            raise InvalidInputError(
                f"{type(self).__name__} takes a Growing() or Ring(...) token geometry, "
                f"got {token_geometry!r}"
            )
        if geometry is not None and not isinstance(geometry, KvGeometry):
            raise InvalidInputError(
                f"{type(self).__name__}: {not_a_geometry_message(type(geometry).__name__)}"
            )
        quantization = check_target(type(self).__name__, quantization, token_geometry)
        if geometry is not None:
            self._check_dims(geometry.key_dim, geometry.value_dim, quantization)
        self._conversion = self.conversion_class(quantization, as_count(start, "start"))
        self._token_geometry = token_geometry
        self._declared = geometry
        self._reset()

    # -- the implementation's part ----------------------------------------------------------
    def _convert(self, storage: Any) -> Any:
        """``storage`` (plain) as its converted counterpart: same tokens, same positions."""
        raise NotImplementedError

    # -- state ---------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._storage: Any = self.plain_class.from_specs(
            Plain(), self._token_geometry, geometry=self._declared
        )
        #: One row: plain, no append read yet.
        self._conversion = self.conversion_class(self.quantization, self.start, [None])
        #: The codec of what the last append returned (``None``: the storage's).
        self._read_codec: Any = None
        #: The plain storage the converting append read from (``None``: the current one).
        self._read_from: Any = None

    def _like(self) -> Bf16First:
        """An empty lego of the same parameters."""
        fresh = object.__new__(type(self))
        Bf16First.__init__(
            fresh, self.quantization, self._token_geometry, self.start, self._declared
        )
        return fresh

    def _adopt(self, storage: Any, minimum_reusable_offset: int | None) -> None:
        name = type(self).__name__
        if type(storage) is self.affine_class:
            if storage.codec_spec != self.quantization:
                raise InvalidInputError(
                    f"{name}.composed.over: the storage is {storage.codec_spec.name}, "
                    f"this lego converts to {self.quantization.name}"
                )
            converted = True
        elif type(storage) is self.plain_class:
            converted = False
        else:
            raise InvalidInputError(
                f"{name}.composed.over takes a {self.plain_class.__name__} or a "
                f"{self.affine_class.__name__} of the same implementation, got "
                f"{type(storage).__module__}.{type(storage).__name__}"
            )
        if storage.token_geometry != self._token_geometry:
            raise InvalidInputError(
                f"{name}.composed.over: the storage's token geometry is "
                f"{storage.token_geometry!r}, this lego's is {self._token_geometry!r}"
            )
        if minimum_reusable_offset is None:
            minimum = self._conversion.point(int(storage.offset)) if converted else 0
        else:
            minimum = as_count(minimum_reusable_offset, "minimum_reusable_offset")
            if not converted and minimum:
                raise InvalidInputError(
                    f"{name}.composed.over: a plain storage has no minimum_reusable_offset "
                    f"(got {minimum}); only a converted one records it"
                )
        self._storage = storage
        converted_at = minimum if converted else None
        self._conversion = self.conversion_class(self.quantization, self.start, [converted_at])
        self._conversion.note_read(converted)
        self._read_codec = None
        self._read_from = None

    @staticmethod
    def _check_dims(key_dim: int, value_dim: int, quantization: Target) -> None:
        check_target_dims(key_dim, value_dim, quantization)

    # -- what the lego is ----------------------------------------------------------------------
    @property
    def storage(self) -> Any:
        """The current storage (borrowed: the lego keeps using it)."""
        return self._storage

    @property
    def last_read_codec(self) -> Any:
        """The codec of what the last append returned (the converting append read plain;
        ``None`` before any append): attention of that read goes through it (a TurboQuant
        read defers its values, ``kvrows.app.attention.dispatch``)."""
        return self._read_codec

    @property
    def read_storage(self) -> Any:
        """The storage the last append's read came from (borrowed): the plain one on the
        converting append (replaced by the converted one since; kept until the next
        append), else the current one. A ring's read order is that storage's phase
        (``kvrows.app.ring_order``)."""
        return self._storage if self._read_from is None else self._read_from

    @property
    def needs_row_attention(self) -> bool:
        """Whether a forward must run inside ``kvrows.app.attention.row_attention``: the
        storage needs it (a shared ring reads in time order there) or the lego converts to a
        codec whose reads defer their values (the codec's own attention)."""
        storage = self._storage
        return self.converts_to_deferred_values or (
            isinstance(storage, RowAttention) and storage.needs_row_attention
        )

    def reads_in_time_order(self, keys: Any, values: Any, mask: Any) -> tuple[Any, Any, Any]:
        """The last read in time order: through the storage it came from (``read_storage``,
        the plain ring on the converting append)."""
        storage = self.read_storage
        if isinstance(storage, TimeOrderedReads):
            return storage.reads_in_time_order(keys, values, mask)
        return keys, values, mask

    @property
    def converted(self) -> bool:
        """Whether the storage is the converted one (irreversible)."""
        return self._conversion.phase == "packed"

    def max_append_tokens(self) -> float:
        """Tokens the next append may add without passing the conversion point:
        ``start - offset`` while plain below ``start``, else unlimited."""
        return self._conversion.max_append_tokens([int(self._storage.offset)])

    @property
    def composed(self) -> LegoComposition:
        """``release()`` / ``over(storage)`` (``spec/bf16-first.md``)."""
        return LegoComposition(self)

    # -- the storage's surface -----------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append a block; plain while below ``start``, converting before returning when
        this append reaches it (its reads stay plain), quantized afterwards. A refused
        block changes nothing."""
        storage = self._storage
        reads: tuple[Any, Any]
        if self.converted:
            reads = storage.update_and_fetch(keys, values)
            self._conversion.note_read(True)
            self._read_codec = storage.codec
            self._read_from = None
            return reads
        key_shape: tuple[int, ...] = tuple(getattr(keys, "shape", ()))
        value_shape: tuple[int, ...] = tuple(getattr(values, "shape", ()))
        if len(key_shape) == 4 and len(value_shape) == 4:
            # Refuse head dims the codec cannot take before the plain append happens.
            self._check_dims(int(key_shape[3]), int(value_shape[3]), self.quantization)
        reads = storage.update_and_fetch(keys, values)
        offsets = [int(storage.offset)]
        self._read_from = None
        if due := self._conversion.due(offsets):
            self._storage = self._convert(storage)
            self._conversion.mark(due, offsets)
            self._read_from = storage
        self._conversion.note_read(False)
        self._read_codec = storage.codec
        return reads

    @property
    def offset(self) -> Any:
        return self._storage.offset

    @property
    def state(self) -> Any:
        """The current storage's state (a saved lego is its storage's form)."""
        return self._storage.state

    @property
    def state_needs_dispose(self) -> bool:
        return bool(self._storage.state_needs_dispose)

    @property
    def nbytes(self) -> int:
        return int(self._storage.nbytes)

    @property
    def geometry(self) -> KvGeometry | None:
        geometry: KvGeometry | None = self._storage.geometry
        return geometry

    def signature(self) -> str:
        return str(self._storage.signature())

    def fetch(self) -> tuple[Any, Any]:
        reads: tuple[Any, Any] = self._storage.fetch()
        return reads

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        return self._storage.make_mask(n, return_array=return_array, window_size=window_size)

    def is_trimmable(self) -> bool:
        return bool(self._storage.is_trimmable())

    def trim(self, n: int) -> int:
        """Forget the newest ``n`` tokens; a converted lego stays converted."""
        return int(self._storage.trim(n))

    def held_arrays(self) -> tuple[Any, ...]:
        held: tuple[Any, ...] = self._storage.held_arrays()
        return held

    def __repr__(self) -> str:
        phase = "converted" if self.converted else "plain"
        return (
            f"{type(self).__name__}({self.quantization.name}, {self._token_geometry}, "
            f"start={self.start}, {phase}, offset={self.offset})"
        )


class FullAttentionLego(Bf16First):
    """The full-attention lego's constructor: ``QuantizedKVCache``'s arguments, then
    ``start`` (each implementation names its storage classes)."""

    def __init__(
        self,
        group_size: int = 64,
        bits: int = 8,
        start: int = 0,
        *,
        geometry: KvGeometry | None = None,
    ) -> None:
        spec, tokens, first = lego_arguments(type(self).__name__, None, group_size, bits, 0, start)
        super().__init__(spec, tokens, first, geometry)


class SlidingWindowLego(Bf16First):
    """The sliding-window lego's constructor: ``RotatingQuantizedKVCache``'s arguments,
    then ``start``; ``max_size`` and ``keep`` read off the current ring."""

    def __init__(
        self,
        max_size: int,
        group_size: int = 64,
        bits: int = 8,
        keep: int = 0,
        start: int = 0,
        *,
        geometry: KvGeometry | None = None,
    ) -> None:
        spec, tokens, first = lego_arguments(
            type(self).__name__, max_size, group_size, bits, keep, start
        )
        super().__init__(spec, tokens, first, geometry)

    @property
    def max_size(self) -> int:
        return int(self._storage.max_size)

    @property
    def keep(self) -> int:
        return int(self._storage.keep)


class TurboLego(Bf16First):
    """The TurboQuant lego's constructor: ``TurboQuantKVCache``'s arguments (``k_bits``,
    ``v_bits``), then ``start``; full attention only."""

    def __init__(
        self,
        k_bits: int = 8,
        v_bits: int = 3,
        start: int = 0,
        *,
        geometry: KvGeometry | None = None,
    ) -> None:
        spec, first = turbo_lego_arguments(type(self).__name__, k_bits, v_bits, start)
        super().__init__(spec, Growing(), first, geometry)


def turbo_lego_arguments(
    name: str, k_bits: object, v_bits: object, start: object
) -> tuple[Turbo, int]:
    """A TurboQuant lego's (or delayed layout's) arguments as a spec and ``start``; a
    refused argument names the class."""
    with _naming(name):
        spec = Turbo(k_bits=_int(k_bits, "k_bits", name), v_bits=_int(v_bits, "v_bits", name))
        return spec, as_count(start, "start")


def lego_arguments(
    name: str, max_size: object, group_size: object, bits: object, keep: object, start: object
) -> tuple[Affine, GeometrySpec, int]:
    """The constructor arguments of a lego as specs (``max_size is None``: full attention);
    a refused argument names the class."""
    with _naming(name):
        quantization = Affine(
            bits=_int(bits, "bits", name), group_size=_int(group_size, "group_size", name)
        )
        geometry: GeometrySpec = Growing()
        if max_size is not None:
            geometry = Ring(
                max_size=_int(max_size, "max_size", name), keep=_int(keep, "keep", name)
            )
        return quantization, geometry, as_count(start, "start")


@contextmanager
def _naming(name: str) -> Iterator[None]:
    """A refused constructor argument's message starts with the class's name."""
    try:
        yield
    except InvalidInputError as error:
        message = str(error)
        if message.startswith(f"{name}:"):
            raise
        raise InvalidInputError(f"{name}: {message}") from None


def _int(value: object, what: str, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInputError(f"{name}: {what} must be an integer, got {value!r}")
    return value
