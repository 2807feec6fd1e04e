"""The reference's public classes, built from the composition table.

``build`` makes each class from its entry: the parameters' mixins (``AffineParameters``,
``TurboParameters``, ``RingParameters``: what mlx-lm reads off an instance), the surface
its geometry adds in its arrangement, the modifier (``SpeculativeLayout``) and ``rows.py``'s
``SerialStorage`` / ``RowLayout``, which builds the geometry's hooks from the spec
(``geometries/registry.py``). mypy cannot see a class built at run time: ``TYPE_CHECKING``
declares each with the bases ``build`` gives it (``tests/test_compositions.py`` checks that
they agree).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from kvrows.common import AffineParameters, TurboParameters
from kvrows.compositions import (
    Composition,
    landed,
    lego_preset,
    preset_class,
    presets_on_rows,
    stage_presets,
)
from kvrows.errors import KvRowsError, speculative_modifier_message
from kvrows.forms import delayed_groups
from kvrows.lego import Bf16First
from kvrows.recurrent import SerialRounds
from kvrows.reference.delayed import DelayedLayout
from kvrows.reference.geometries.chunked import ChunkedSurface
from kvrows.reference.geometries.growing import RowAlignment
from kvrows.reference.geometries.recurrent import ArraysCacheSurface, StateLayout
from kvrows.reference.geometries.registry import IMPLEMENTATIONS
from kvrows.reference.geometries.ring import RingParameters
from kvrows.reference.latent import LatentSurface
from kvrows.reference.rows import SERIAL_PRESETS, RowLayout, SerialStorage
from kvrows.reference.speculative import SpeculativeLayout

__all__ = [
    "BatchedChunkedKVCache",
    "BatchedChunkedMxKVCache",
    "BatchedChunkedQuantizedKVCache",
    "BatchedKVCache",
    "BatchedMxKVCache",
    "BatchedQuantizedKVCache",
    "BatchedRotatingCache",
    "BatchedRotatingMxCache",
    "BatchedRotatingQuantCache",
    "BatchedSSMCache",
    "BatchedTurboQuantKVCache",
    "Bf16FirstChunkedMxKVCache",
    "Bf16FirstChunkedQuantizedKVCache",
    "Bf16FirstMxKVCache",
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingMxKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
    "ChunkedKVCache",
    "ChunkedMxKVCache",
    "ChunkedQuantizedKVCache",
    "DelayedChunkedMxKVCache",
    "DelayedChunkedQuantizedKVCache",
    "DelayedMxKVCache",
    "DelayedQuantizedKVCache",
    "DelayedRotatingMxKVCache",
    "DelayedRotatingQuantizedKVCache",
    "DelayedTurboQuantKVCache",
    "KVCache",
    "MLACache",
    "MxKVCache",
    "PaddedChunkedQuantRows",
    "PaddedChunkedRows",
    "PaddedKVRows",
    "PaddedQuantKVRows",
    "QuantizedKVCache",
    "RaggedRotatingRows",
    "RotatingAffineLayout",
    "RotatingKVCache",
    "RotatingMxKVCache",
    "RotatingQuantizedKVCache",
    "SSMCache",
    "SpeculativeRotatingAffineLayout",
    "SpeculativeRotatingKVCache",
    "SpeculativeRotatingMxLayout",
    "TurboQuantKVCache",
    "build",
    "declared_classes",
]

#: The mixin a constructor parameter calls for (what mlx-lm reads off the instance).
PARAMETER_SURFACES = (
    ("bits", AffineParameters),
    ("k_bits", TurboParameters),
    ("max_size", RingParameters),
    ("chunk_size", ChunkedSurface),
)
#: What a geometry adds in an arrangement beyond its hooks: ragged growing rows align
#: their writes; recurrent state is mlx-lm's ``ArraysCache`` surface.
GEOMETRY_SURFACES: dict[tuple[str, str], tuple[type, ...]] = {
    ("growing", "ragged"): (RowAlignment,),
    ("recurrent", "serial"): (ArraysCacheSurface, SerialRounds),
    ("recurrent", "ragged"): (StateLayout,),
}
#: What a codec adds to the machinery's surface, first among the bases (the latent
#: caches' ``append`` / ``fetch_index`` / 3-D blocks / v1 state).
CODEC_SURFACES: dict[str, tuple[type, ...]] = {"latent": (LatentSurface,)}
#: The classes a modifier puts ahead of the arrangement (they wrap a layout; the delayed
#: one is ``kvrows.lego.Bf16First`` on a serial storage of two stages, the layout mixin
#: ``DelayedLayout`` on a layout).
MODIFIERS: dict[str, type] = {"speculative": SpeculativeLayout, "delayed": Bf16First}
DELAYED_LAYOUT: type = DelayedLayout
#: The entries ``build`` makes here: every layout holds rows of several stages, so the
#: delayed layouts are presets too.
PRESETS = presets_on_rows(IMPLEMENTATIONS, staged=IMPLEMENTATIONS)
#: The parameter mixins a delayed storage leaves out: ``bits`` / ``group_size`` show under
#: the delayed modifier's rule (``Conversion.read_parameter``), not always.
CODEC_PARAMETERS = (AffineParameters, TurboParameters)


def build(entries: Iterable[Composition]) -> dict[str, type[Any]]:
    """The public class of each of ``entries``, by name (serial storages first: a layout
    names the one its rows extract into, ``serial_class``; a delayed storage the serial
    presets of its stages, ``plain_class`` / ``affine_class``)."""
    built: dict[str, type[Any]] = {}
    # Serial storages, then layouts, each with fewer modifiers first (a delayed layout names
    # its stages' ragged presets and its lego).
    for entry in sorted(entries, key=lambda entry: (entry.is_layout, len(entry.modifiers))):
        delayed = "delayed" in entry.modifiers
        parameters = tuple(
            mixin
            for name, mixin in PARAMETER_SURFACES
            if name in entry.params and not (delayed and mixin in CODEC_PARAMETERS)
        )
        surface = GEOMETRY_SURFACES.get((entry.geometry, entry.arrangement), ())
        modifiers = tuple(MODIFIERS[name] for name in sorted(entry.modifiers))
        arrangement = RowLayout if entry.is_layout else SerialStorage
        serial = entry.serial
        members: dict[str, object] = {}
        if entry.is_layout and serial:
            members["serial_class"] = built[serial]
        if delayed and entry.is_layout:
            plain_group, affine_group = delayed_groups(entry)
            members.update(
                plain_group_class=built[plain_group.name],
                affine_group_class=built[affine_group.name],
                lego_class=built[lego_preset(entry).name],
            )
        elif delayed:
            plain, target = stage_presets(entry)
            members.update(plain_class=built[plain.name], affine_class=built[target.name])
        # The delayed mixin comes first (its surface is the lego's); a codec's surface
        # (the latent append) leads the others; the speculative one wraps the arrangement.
        if delayed and entry.is_layout:
            # The layout mixin ahead of the speculative layout; no geometry surface (its
            # rows keep the record's columns: no align_rows).
            bases: tuple[type, ...] = (DELAYED_LAYOUT, *parameters, SpeculativeLayout, RowLayout)
        elif delayed:
            bases = (*modifiers, *parameters, *surface, arrangement)
        else:
            codec_surface = CODEC_SURFACES.get(entry.codec, ())
            bases = (*codec_surface, *parameters, *surface, *modifiers, arrangement)
        built[entry.name] = preset_class(entry, bases, __name__, **members)
        if entry.is_layout and not serial:  # its own serial storage (MLACache)
            built[entry.name].serial_class = built[entry.name]
        if not entry.is_layout and not entry.modifiers:
            SERIAL_PRESETS[entry.name] = built[entry.name]
    return built


if TYPE_CHECKING:
    # -- full attention ----------------------------------------------------------------
    class KVCache(SerialStorage): ...

    class PaddedKVRows(RowLayout): ...

    class BatchedKVCache(RowAlignment, SpeculativeLayout, RowLayout): ...

    class QuantizedKVCache(AffineParameters, SerialStorage): ...

    class PaddedQuantKVRows(AffineParameters, RowLayout): ...

    class BatchedQuantizedKVCache(AffineParameters, RowAlignment, SpeculativeLayout, RowLayout): ...

    class TurboQuantKVCache(TurboParameters, SerialStorage): ...

    class BatchedTurboQuantKVCache(TurboParameters, RowAlignment, SpeculativeLayout, RowLayout): ...

    class MxKVCache(AffineParameters, SerialStorage): ...

    class BatchedMxKVCache(AffineParameters, RowAlignment, SpeculativeLayout, RowLayout): ...

    # -- sliding window ----------------------------------------------------------------
    class RotatingKVCache(RingParameters, SerialStorage): ...

    class RotatingMxKVCache(AffineParameters, RingParameters, SerialStorage): ...

    class BatchedRotatingMxCache(AffineParameters, RingParameters, RowLayout): ...

    class SpeculativeRotatingMxLayout(
        AffineParameters, RingParameters, SpeculativeLayout, RowLayout
    ): ...

    class ChunkedKVCache(ChunkedSurface, SerialStorage): ...

    class PaddedChunkedRows(ChunkedSurface, RowLayout): ...

    class BatchedChunkedKVCache(ChunkedSurface, SpeculativeLayout, RowLayout): ...

    class ChunkedQuantizedKVCache(AffineParameters, ChunkedSurface, SerialStorage): ...

    class ChunkedMxKVCache(AffineParameters, ChunkedSurface, SerialStorage): ...

    class BatchedChunkedMxKVCache(
        AffineParameters, ChunkedSurface, SpeculativeLayout, RowLayout
    ): ...

    class PaddedChunkedQuantRows(AffineParameters, ChunkedSurface, RowLayout): ...

    class BatchedChunkedQuantizedKVCache(
        AffineParameters, ChunkedSurface, SpeculativeLayout, RowLayout
    ): ...

    class BatchedRotatingCache(RingParameters, RowLayout): ...

    class RaggedRotatingRows(RingParameters, RowLayout): ...

    class SpeculativeRotatingKVCache(RingParameters, SpeculativeLayout, RowLayout): ...

    class RotatingQuantizedKVCache(AffineParameters, RingParameters, SerialStorage): ...

    class BatchedRotatingQuantCache(AffineParameters, RingParameters, RowLayout): ...

    class RotatingAffineLayout(AffineParameters, RingParameters, RowLayout): ...

    class SpeculativeRotatingAffineLayout(
        AffineParameters, RingParameters, SpeculativeLayout, RowLayout
    ): ...

    # -- bf16-first legos (the delayed modifier on a serial storage) --------------------
    class Bf16FirstQuantizedKVCache(Bf16First, SerialStorage): ...

    class Bf16FirstTurboQuantKVCache(Bf16First, SerialStorage): ...

    class Bf16FirstMxKVCache(Bf16First, SerialStorage): ...

    class Bf16FirstRotatingQuantizedKVCache(Bf16First, RingParameters, SerialStorage): ...

    class Bf16FirstRotatingMxKVCache(Bf16First, RingParameters, SerialStorage): ...

    class Bf16FirstChunkedQuantizedKVCache(Bf16First, ChunkedSurface, SerialStorage): ...

    class Bf16FirstChunkedMxKVCache(Bf16First, ChunkedSurface, SerialStorage): ...

    # -- delayed layouts (the delayed modifier on a ragged layout) --------------------
    class DelayedQuantizedKVCache(DelayedLayout, SpeculativeLayout, RowLayout): ...

    class DelayedTurboQuantKVCache(DelayedLayout, SpeculativeLayout, RowLayout): ...

    class DelayedMxKVCache(DelayedLayout, SpeculativeLayout, RowLayout): ...

    class DelayedRotatingQuantizedKVCache(
        DelayedLayout, RingParameters, SpeculativeLayout, RowLayout
    ): ...

    class DelayedRotatingMxKVCache(DelayedLayout, RingParameters, SpeculativeLayout, RowLayout): ...

    class DelayedChunkedQuantizedKVCache(
        DelayedLayout, ChunkedSurface, SpeculativeLayout, RowLayout
    ): ...

    class DelayedChunkedMxKVCache(DelayedLayout, ChunkedSurface, SpeculativeLayout, RowLayout): ...

    # -- latent ------------------------------------------------------------------------
    class MLACache(LatentSurface, SpeculativeLayout, RowLayout): ...

    # -- recurrent state ---------------------------------------------------------------
    class SSMCache(ArraysCacheSurface, SerialRounds, SerialStorage): ...

    class BatchedSSMCache(StateLayout, SpeculativeLayout, RowLayout): ...

else:
    globals().update(build(PRESETS))


#: The parameters a surface mixin exposes (``AffineParameters``: ``bits``;
#: ``RingParameters``: ``max_size``): a class has each iff its table entry takes it.
_SURFACE_PARAMETERS = ("bits", "max_size", "chunk_size")


def _checked(cls: type[Any]) -> type[Any]:
    """``cls`` as its composition wants it: the declaration agrees with the table, and the
    composition's modifiers are applied (speculative: ``SpeculativeLayout`` wraps a
    layout; delayed: the lego's serial mixin on a serial storage, the layout mixin
    ``kvrows.delayed.DelayedLayout`` on a layout, whose saved form's group classes
    ``register_compositions`` checks)."""
    entry = cls.composition
    if "delayed" in entry.modifiers and not entry.is_layout:
        if not callable(getattr(getattr(cls, "composed", None), "fget", None)):
            raise KvRowsError(f"{cls.__name__}: the delayed modifier's serial mixin is missing")
        return cls
    delayed_layout = "delayed" in entry.modifiers
    # The class's surface, not its bases: a layout merges rows, a parameter mixin
    # (``AffineParameters``, ``RingParameters``) exposes the table's parameters, the
    # speculative modifier opens rounds.
    agrees = (
        callable(getattr(cls, "merge_rows", None)) == entry.is_layout
        and all(
            hasattr(cls, name) == (name in entry.params)
            for name in _SURFACE_PARAMETERS
            if not (delayed_layout and name == "bits")  # shown under the conversion's rule
        )
        and (
            not entry.is_layout or cls.serial_class.composition.name == (entry.serial or entry.name)
        )
    )
    if delayed_layout and not (agrees and callable(getattr(cls, "attend_rows", None))):
        raise KvRowsError(
            f"{cls.__name__}: the delayed modifier's layout does not declare its composition "
            f"{entry}"
        )
    if not agrees:
        raise KvRowsError(f"{cls.__name__} does not declare its composition {entry}")
    if callable(getattr(cls, "spec_round_begin", None)) != ("speculative" in entry.modifiers):
        raise KvRowsError(speculative_modifier_message(cls.__name__))
    return cls


def declared_classes() -> Mapping[str, type[Any]]:
    """Every public class of the reference, by composition name (what ``__init__``
    registers): this module's, the latent and the paged ones."""
    candidates = list(globals().values())
    # A public class declares its table entry (``composition``); its bases do not.
    found = {
        entry.name: _checked(value)
        for value in candidates
        if isinstance(value, type) and (entry := vars(value).get("composition")) is not None
    }
    from kvrows.reference import latent  # latent state: its own row machinery

    found[latent.EncodedLatentCache.composition.name] = latent.EncodedLatentCache
    from kvrows.reference import paged  # the paged placement's storages

    found.update(
        {
            cls.composition.name: cls
            for cls in (
                paged.PagedKVCache,
                paged.PagedKvRows,
                paged.PagedLatentCache,
                paged.PagedRotatingKVCache,
                paged.PagedRotatingRows,
                paged.PagedChunkedKVCache,
                paged.PagedChunkedRows,
            )
        }
    )
    missing = [c.name for c in landed() if c.name not in found]
    if missing:
        raise KvRowsError(f"the reference lacks {', '.join(missing)}")
    return found
