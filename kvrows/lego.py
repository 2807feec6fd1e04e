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

This module holds what is serial only: the lego surface (the ``Handover``:
``composed.release()`` / ``over(storage)``, ``storage``, ``read_storage``, the state and
signature of the current stage). The conversion itself (the record, the append that
converts after its read, the constructor's arguments) is the delayed modifier's one code
path, ``kvrows.delayed.ConversionBoundary``, which the delayed layouts run too (a serial
storage is its one-row case); each implementation's row machinery supplies the stage hooks
(``reference/rows.py``, ``optimized/rows.py``) and its ``classes.py`` builds the presets
from the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Self

from kvrows.conversion import (
    Phase,
    Target,
    check_target_dims,
    conversion_due,
    delayed_arguments,
)
from kvrows.delayed import ConversionBoundary
from kvrows.errors import InvalidInputError, UnsupportedStateError
from kvrows.protocols import RowAttention, TimeOrderedReads
from kvrows.schemes import GeometrySpec
from kvrows.validation import KvGeometry, as_count

# The constructor's arguments and the target's checks are the modifier's
# (``kvrows.conversion``), named here too, where they were written first.
__all__ = [
    "Bf16First",
    "ConversionBoundary",
    "LegoComposition",
    "Target",
    "check_target_dims",
    "conversion_due",
    "delayed_arguments",
]


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


class Bf16First(ConversionBoundary):
    """The delayed modifier's serial mixin (contract §0.5): a serial storage of the row
    machinery holding ``stages = (Plain(), target)`` (see the module docstring), whose
    conversion is :class:`kvrows.delayed.ConversionBoundary`'s with a one-row record.

    Besides the hooks the conversion asks, the machinery supplies ``_stage_view(cls,
    view)`` (an instance of the serial preset ``cls`` sharing this storage's rows:
    borrowed) and ``_take_rows(storage)`` (hold what ``storage`` holds). The lego surface
    (``storage``, ``composed``, ``signature()``, ``state``) shows the serial preset of the
    current stage (``plain_class`` / ``affine_class``, read off the table by
    ``kvrows.compositions.stage_presets``). Arguments follow the converted class's
    positional order, then ``start``.
    """

    #: The serial presets of the two stages (set from the table by ``classes.build``).
    plain_class: ClassVar[type[Any]]
    affine_class: ClassVar[type[Any]]
    _one_row = True

    @classmethod
    def from_parts(
        cls,
        quantization: Target,
        token_geometry: GeometrySpec,
        start: int,
        geometry: KvGeometry | None = None,
    ) -> Self:
        """An empty lego from its specs (a saved lego's record, ``composed.over``)."""
        return cls.from_specs(quantization, token_geometry, geometry=geometry, start=start)

    if TYPE_CHECKING:  # the row machinery's (the mixin comes first in the MRO)
        _stage: int
        offset: Any
        rows: int
        token_geometry: GeometrySpec

        def _update(self, keys: Any, values: Any) -> None: ...

        def fetch(self) -> tuple[Any, Any]: ...

        def _stage_view(self, cls: type[Any], view: Any = None) -> Any: ...

        def _take_rows(self, storage: Any) -> None: ...

    # -- the one-row record ----------------------------------------------------------------------
    def _record_offsets(self) -> Sequence[int]:
        return [int(self.offset)]

    def _storage_rows(self, rows: Sequence[int]) -> Sequence[int]:
        return range(int(self.rows))  # a serial storage's rows move together

    def _forget_reads(self) -> None:
        #: The codec of what the last append returned (``None``: no append yet).
        self._read_codec: Any = None
        #: The plain storage the converting append read from (``None``: the current one).
        self._read_from: Any = None
        #: What ``storage`` returns while the stage lasts (``None``: none made yet).
        self._view: Any = None

    def _append_read(self, keys: Any, values: Any, phase: Phase) -> tuple[Any, Any]:
        if phase != "packed":  # converted: the target's own append refuses them
            self._check_convertible(keys, values)
        self._update(keys, values)  # a serial storage's rows are in one stage
        reads = self.fetch()
        self._read_codec = self.codec
        self._read_from = None
        return reads

    def _converting(self) -> None:
        self._read_from = self.storage  # the plain stage, as the converting append read it
        self._view = None

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
        self._forget_reads()
        self._view = storage  # ``storage`` stays the object handed over

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

    @property
    def composed(self) -> LegoComposition:
        """``release()`` / ``over(storage)`` (``spec/bf16-first.md``)."""
        return LegoComposition(self)

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
