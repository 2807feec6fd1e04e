"""Bf16-first storages ("legos"): the delayed modifier's serial mixin (contract §0.5).

A lego is the serial storage a quantized scheme with a bf16-first boundary composes for
one layer (``spec/bf16-first.md``). It is a serial preset of the composition table with
``modifiers={"delayed"}``: one storage of the row machinery holding two stages,
``(Plain(), target)``. Its rows stay in the plain stage until an append leaves them holding
``offset >= start and offset != 0`` tokens, then ``_convert_rows`` re-encodes them into
the target stage (affine or TurboQuant). The converting append is read in plain precision
(what it returns); the rows convert before the append returns; every later append is
encoded. The first append is therefore always plain, even with ``start == 0`` (mlx-lm
converts after the forward that filled the cache). The conversion is irreversible:
trimming below ``start`` keeps the target stage.

What a lego reports as a storage (``signature()``, ``state``, ``storage``) is the serial
preset of its current stage (``KVCache`` / ``RotatingKVCache`` while plain,
``QuantizedKVCache`` / ``RotatingQuantizedKVCache`` / ``TurboQuantKVCache`` once
converted), so a saved lego is that storage's form plus its lego record.

This module holds the array-free logic once; each implementation's row machinery
supplies the stage hooks (``reference/rows.py``, ``optimized/rows.py``) and its
``classes.py`` builds the presets from the table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeAlias

from kvrows.codec import CodecSpec
from kvrows.codecs import is_codec_spec
from kvrows.conversion import Conversion, conversion_due
from kvrows.errors import InvalidInputError, UnsupportedStateError, not_a_geometry_message
from kvrows.geometries import is_geometry_spec
from kvrows.protocols import RowAttention, TimeOrderedReads
from kvrows.schemes import Affine, GeometrySpec, Growing, Plain, Ring, Turbo
from kvrows.validation import KvGeometry, as_count

__all__ = [
    "Bf16First",
    "ConversionBoundary",
    "LegoComposition",
    "Target",
    "check_target_dims",
    "conversion_due",
    "delayed_arguments",
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
        storage = lego.storage  # shares the rows, which the reset below lets go of
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
    def converts_to_deferred_values(self) -> bool:
        """Whether the target codec's reads defer their values (TurboQuant: attention goes
        through the codec, ``kvrows.app.attention.dispatch``)."""
        return self._conversion.target.reads == "own"

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
    """The delayed modifier's serial mixin (contract §0.5): a serial storage of the row
    machinery holding ``stages = (Plain(), target)`` (see the module docstring).

    It is listed first among a lego preset's bases, over the implementation's serial
    storage, which supplies the stage hooks (``reference/rows.py``, ``optimized/rows.py``):
    ``_setup(codec, token_geometry, geometry)`` (an empty storage of those specs),
    ``_use_stages(specs)`` (the codecs of the stages; rows start in stage 0),
    ``_convert_rows(rows)`` (re-encode rows from their stage into the next),
    ``_stage_view(cls, view)`` (an instance of the serial preset ``cls`` sharing this
    storage's rows: borrowed) and ``_take_rows(storage)`` (hold what ``storage`` holds).
    The lego surface (``storage``, ``composed``, ``signature()``, ``state``) shows the
    serial preset of the current stage (``plain_class`` / ``affine_class``, read off the
    table by ``kvrows.compositions.stage_presets``). Arguments follow the converted class's
    positional order, then ``start``.
    """

    #: The serial presets of the two stages (set from the table by ``classes.build``).
    plain_class: ClassVar[type[Any]]
    affine_class: ClassVar[type[Any]]
    composition: ClassVar[Any]
    codec: Any

    def __init__(self, *args: object, geometry: KvGeometry | None = None, **kwargs: object) -> None:
        spec, tokens, first = delayed_arguments(
            type(self).__name__, self.composition.params, args, kwargs
        )
        self._init_lego(spec, tokens, first, geometry)

    @classmethod
    def from_specs(
        cls,
        codec_spec: CodecSpec,
        token_geometry: GeometrySpec,
        *,
        geometry: KvGeometry | None = None,
        start: int = 0,
    ) -> Self:
        """An empty lego converting to ``codec_spec`` (the delayed layouts' ``from_specs``:
        the target codec, the geometry, ``start``)."""
        return cls.from_parts(codec_spec, token_geometry, start, geometry)

    @classmethod
    def from_parts(
        cls,
        quantization: Target,
        token_geometry: GeometrySpec,
        start: int,
        geometry: KvGeometry | None = None,
    ) -> Self:
        """An empty lego from its specs (a saved lego's record, ``composed.over``)."""
        fresh = cls.__new__(cls)
        fresh._init_lego(quantization, token_geometry, start, geometry)
        return fresh

    def _init_lego(
        self,
        quantization: Target,
        token_geometry: GeometrySpec,
        start: int,
        geometry: KvGeometry | None,
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

    if TYPE_CHECKING:  # the row machinery's stage hooks (the mixin comes first in the MRO)
        _stage: int
        offset: Any
        rows: int
        token_geometry: GeometrySpec

        def _setup(
            self, codec_spec: CodecSpec, token_geometry: GeometrySpec, geometry: KvGeometry | None
        ) -> None: ...

        def _use_stages(self, specs: Sequence[CodecSpec]) -> None: ...

        def _convert_rows(self, rows: Sequence[int]) -> None: ...

        def _stage_view(self, cls: type[Any], view: Any = None) -> Any: ...

        def _take_rows(self, storage: Any) -> None: ...

    # -- state ---------------------------------------------------------------------------------
    def _reset(self) -> None:
        """Empty, plain (stage 0), the constructed parameters."""
        self._setup(Plain(), self._token_geometry, self._declared)
        self._use_stages((Plain(), self.quantization))
        #: One row: plain, no append read yet.
        self._conversion = self.conversion_class(self.quantization, self.start, [None])
        #: The codec of what the last append returned (``None``: no append yet).
        self._read_codec: Any = None
        #: The plain storage the converting append read from (``None``: the current one).
        self._read_from: Any = None
        #: What ``storage`` returns while the stage lasts (``None``: none made yet).
        self._view: Any = None

    def _like(self) -> Bf16First:
        """An empty lego of the same parameters."""
        return self.from_parts(self.quantization, self._token_geometry, self.start, self._declared)

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
        self._take_rows(storage)
        converted_at = minimum if converted else None
        self._conversion = self.conversion_class(self.quantization, self.start, [converted_at])
        self._conversion.note_read(converted)
        self._read_codec = None
        self._read_from = None
        self._view = storage  # ``storage`` stays the object handed over

    @staticmethod
    def _check_dims(key_dim: int, value_dim: int, quantization: Target) -> None:
        check_target_dims(key_dim, value_dim, quantization)

    # -- what the lego is ----------------------------------------------------------------------
    def _stage_class(self) -> type[Any]:
        return self.affine_class if self._stage else self.plain_class

    @property
    def storage(self) -> Any:
        """The current stage as its serial preset (borrowed: it shares this lego's rows,
        brought up to date on every access; one object while the stage lasts, the one
        ``composed.release()`` hands out)."""
        self._view = self._stage_view(self._stage_class(), self._view)
        return self._view

    @property
    def last_read_codec(self) -> Any:
        """The codec of what the last append returned (the converting append read plain;
        ``None`` before any append): attention of that read goes through it (a TurboQuant
        read defers its values, ``kvrows.app.attention.dispatch``)."""
        return self._read_codec

    @property
    def read_storage(self) -> Any:
        """The storage the last append's read came from (borrowed): the plain one on the
        converting append (kept until the next append), else the current one. A ring's
        read order is that storage's phase (``kvrows.app.ring_order``)."""
        return self.storage if self._read_from is None else self._read_from

    @property
    def needs_row_attention(self) -> bool:
        """Whether a forward must run inside ``kvrows.app.attention.row_attention``: the
        storage needs it (a shared ring reads in time order there) or the lego converts to a
        codec whose reads defer their values (the codec's own attention)."""
        storage = self.storage
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
        """Whether the rows are in the target stage (irreversible)."""
        return self._conversion.phase == "packed"

    def max_append_tokens(self) -> float:
        """Tokens the next append may add without passing the conversion point:
        ``start - offset`` while plain below ``start``, else unlimited."""
        return self._conversion.max_append_tokens([int(self.offset)])

    @property
    def composed(self) -> LegoComposition:
        """``release()`` / ``over(storage)`` (``spec/bf16-first.md``)."""
        return LegoComposition(self)

    # -- the storage's surface -----------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        """Append a block; plain while below ``start``, converting before returning when
        this append reaches it (its reads stay plain), quantized afterwards. A refused
        block changes nothing."""
        reads: tuple[Any, Any]
        if self.converted:
            reads = super().update_and_fetch(keys, values)  # type: ignore[misc]
            self._conversion.note_read(True)
            self._read_codec = self.codec
            self._read_from = None
            return reads
        key_shape: tuple[int, ...] = tuple(getattr(keys, "shape", ()))
        value_shape: tuple[int, ...] = tuple(getattr(values, "shape", ()))
        if len(key_shape) == 4 and len(value_shape) == 4:
            # Refuse head dims the codec cannot take before the plain append happens.
            self._check_dims(int(key_shape[3]), int(value_shape[3]), self.quantization)
        reads = super().update_and_fetch(keys, values)  # type: ignore[misc]
        plain = self.codec
        offsets = [int(self.offset)]
        self._read_from = None
        if due := self._conversion.due(offsets):
            self._read_from = self.storage  # the plain stage, as the read saw it
            self._view = None
            self._convert_rows(list(range(int(self.rows))))  # a serial storage's rows move together
            self._conversion.mark(due, offsets)
        self._conversion.note_read(False)
        self._read_codec = plain
        return reads

    def _state(self) -> tuple[Any, ...]:
        """The current stage's serial preset's state (a saved lego is its storage's form)."""
        return tuple(self.storage.state)

    @classmethod
    def _restore(
        cls, state: Any, meta_state: Any, keep: int | None, geometry: KvGeometry | None
    ) -> Self:
        # A lego's state is its current storage's form, which does not say the lego's
        # parameters: the storage's class restores it, ``composed.over`` wraps it.
        raise UnsupportedStateError(
            f"{cls.__name__} state is its current storage's form: restore it with that "
            "storage's class (from_state) and wrap it with composed.over(storage)"
        )

    def signature(self) -> str:
        """The current stage's serial preset's signature."""
        identity: str = self._stage_class().composition.signature_for(
            self.codec.spec, self._token_geometry
        )
        return identity

    def __repr__(self) -> str:
        phase = "converted" if self.converted else "plain"
        return (
            f"{type(self).__name__}({self.quantization.name}, {self._token_geometry}, "
            f"start={self.start}, {phase}, offset={self.offset})"
        )


#: A lego constructor's defaults (the converted class's, then ``start``).
_DEFAULTS: dict[str, object] = {
    "group_size": 64, "bits": 8, "keep": 0, "k_bits": 8, "v_bits": 3, "start": 0,
}  # fmt: skip


def _bound(
    name: str, params: tuple[str, ...], args: tuple[object, ...], kwargs: dict[str, object]
) -> dict[str, object]:
    """A lego constructor's arguments by parameter name (positional in ``params``' order)."""
    if len(args) > len(params):
        raise TypeError(f"{name} takes at most {len(params)} positional arguments")
    values = dict(zip(params, args, strict=False))
    for key, value in kwargs.items():
        if key not in params or key in values:
            raise TypeError(f"{name} got an unexpected or repeated argument {key!r}")
        values[key] = value
    for key in params:
        if key not in values:
            if key not in _DEFAULTS:
                raise TypeError(f"{name} is missing its {key} argument")
            values[key] = _DEFAULTS[key]
    return values


def delayed_arguments(
    name: str, params: tuple[str, ...], args: tuple[object, ...], kwargs: dict[str, object]
) -> tuple[Target, GeometrySpec, int]:
    """A delayed storage's constructor arguments (a lego's, a delayed layout's: the
    converted class's positional order, then ``start``) as its target, token geometry and
    ``start``; a refused argument names the class."""
    values = _bound(name, params, args, kwargs)
    if "k_bits" in values:  # TurboQuant: full attention only
        spec, first = turbo_lego_arguments(
            name, values["k_bits"], values["v_bits"], values["start"]
        )
        return spec, Growing(), first
    return lego_arguments(
        name,
        values.get("max_size"),
        values["group_size"],
        values["bits"],
        values.get("keep", 0),
        values["start"],
    )


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
