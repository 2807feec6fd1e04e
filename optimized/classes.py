"""The optimized implementation's public classes, built from the composition table.

``build`` makes each class from its entry: the surface its geometry adds in its
arrangement, the modifier (``SpeculativeLayout``, wrapping the layout), the arrangement's
mlx-lm drop-ins (a KV codec's), the parameters' mixins (``AffineParameters``,
``TurboParameters``), the geometry's hooks class and ``rows.py``'s ``Serial`` / ``Layout``
(``Storage.__init_subclass__`` checks the result against the entry). mypy cannot see a
class built at run time: ``TYPE_CHECKING`` declares each with the bases ``build`` gives it
(``tests/test_compositions.py`` checks that they agree).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvrows.codecs import CODECS, is_kv_codec
from kvrows.common import AffineParameters, TurboParameters
from kvrows.compositions import (
    Composition,
    landed,
    lego_preset,
    preset_class,
    presets_on_rows,
    stage_presets,
)
from kvrows.forms import delayed_groups
from kvrows.lego import Bf16First
from kvrows.optimized.batch_dropin import LayoutBatchOps, SerialMerge
from kvrows.optimized.delayed import DelayedLayout
from kvrows.optimized.dropin import LayoutDropIn, SerialDropIn
from kvrows.optimized.geometries.chunked import ChunkedGeometry, ChunkedSurface
from kvrows.optimized.geometries.growing import GrowingGeometry, RowAlignment
from kvrows.optimized.geometries.recurrent import (
    ArraysCacheSurface,
    StateGeometry,
    StateLayout,
)
from kvrows.optimized.geometries.registry import IMPLEMENTATIONS, geometry_class
from kvrows.optimized.geometries.ring import RaggedRing, SharedRing
from kvrows.optimized.latent import LatentSurface
from kvrows.optimized.rows import Layout, Serial
from kvrows.optimized.speculative import SpeculativeLayout
from kvrows.recurrent import SerialRounds

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
]

#: The mixin a constructor parameter calls for (what mlx-lm reads off the instance).
PARAMETER_SURFACES = (
    ("bits", AffineParameters),
    ("k_bits", TurboParameters),
    ("chunk_size", ChunkedSurface),
)
#: The parameter mixins a delayed storage leaves out: ``bits`` / ``group_size`` show under
#: the delayed modifier's rule (``Conversion.read_parameter``), not always.
CODEC_PARAMETERS = (AffineParameters, TurboParameters)
#: What a geometry adds in an arrangement beyond its hooks, ahead of everything (the
#: recurrent surface's refusals and guards answer before a round's wrappers).
GEOMETRY_SURFACES: dict[tuple[str, str], tuple[type, ...]] = {
    ("growing", "ragged"): (RowAlignment,),
    ("recurrent", "serial"): (ArraysCacheSurface, SerialRounds),
    ("recurrent", "ragged"): (StateLayout,),
}
#: What a codec adds to the machinery's surface, first among the bases (the latent
#: caches' ``append`` / ``fetch_index`` / ``preview`` / 3-D blocks / v1 state).
CODEC_SURFACES: dict[str, tuple[type, ...]] = {"latent": (LatentSurface,)}

#: The classes a modifier puts ahead of the layout (they wrap it; the delayed one,
#: ``kvrows.lego.Bf16First``, a serial storage of two stages).
MODIFIERS: dict[str, type] = {"speculative": SpeculativeLayout, "delayed": Bf16First}
#: mlx-lm's KV drop-in mixins of a serial storage and of a layout (by ``is_layout``).
KV_DROP_INS = {False: (SerialDropIn, SerialMerge), True: (LayoutDropIn, LayoutBatchOps)}


def hooks_class(entry: Composition) -> type:
    """The geometry's hooks class for ``entry``'s arrangement: the registered class, or
    the subclass of it that declares the arrangement (a ring's ``SharedRing``,
    ``RaggedRing``)."""
    registered = geometry_class(entry.geometry)
    for hooks in (registered, *registered.__subclasses__()):
        if entry.arrangement in vars(hooks).get("arrangements", ()):
            return hooks
    raise KeyError(f"no {entry.geometry} hooks for the {entry.arrangement} arrangement")


#: The ``(geometry, arrangement)`` pairs whose hooks hold a layout's rows in several stages
#: (stage stores, contract §0.4: the growing geometry's, the ragged ring's): their
#: delayed layouts are presets.
STAGED = frozenset(
    (entry.geometry, entry.arrangement)
    for entry in landed()
    if entry.geometry in IMPLEMENTATIONS
    and entry.is_layout
    and getattr(hooks_class(entry), "_stage_stores", False)
)
#: The entries ``build`` makes here.
PRESETS = presets_on_rows(IMPLEMENTATIONS, staged=STAGED)


def build(entries: Iterable[Composition]) -> dict[str, type[Any]]:
    """The public class of each of ``entries``, by name (a delayed storage after the serial
    presets of its stages, ``plain_class`` / ``affine_class``)."""
    built: dict[str, type[Any]] = {}
    bases: tuple[type, ...]
    # A lego after the serial presets of its stages; a delayed layout after its stages'
    # ragged presets and its lego.
    for entry in sorted(entries, key=lambda e: ("delayed" in e.modifiers, e.is_layout)):
        codec = CODECS.get(entry.codec)
        delayed = "delayed" in entry.modifiers
        parameters = tuple(
            mixin
            for name, mixin in PARAMETER_SURFACES
            if name in entry.params and not (delayed and mixin in CODEC_PARAMETERS)
        )
        if delayed and entry.is_layout:
            # The layout mixin (with mlx-lm's reads of a layout) ahead of the rounds.
            plain_group, affine_group = delayed_groups(entry)
            members = {
                "plain_group_class": built[plain_group.name],
                "affine_group_class": built[affine_group.name],
                "lego_class": built[lego_preset(entry).name],
            }
            bases = (DelayedLayout, SpeculativeLayout, *parameters, hooks_class(entry), Layout)
            built[entry.name] = preset_class(entry, bases, __name__, **members)
            continue
        if delayed:
            # The lego's surface, then mlx-lm's reads of its current stage; ``bits`` shows
            # under the modifier's rule, and there is no ``to_quantized`` (it converts itself).
            plain, target = stage_presets(entry)
            bases = (Bf16First, SerialDropIn, *parameters, hooks_class(entry), Serial)
            members = {"plain_class": built[plain.name], "affine_class": built[target.name]}
            built[entry.name] = preset_class(entry, bases, __name__, **members)
            continue
        bases = (
            *CODEC_SURFACES.get(entry.codec, ()),
            *GEOMETRY_SURFACES.get((entry.geometry, entry.arrangement), ()),
            *(MODIFIERS[name] for name in sorted(entry.modifiers)),
            *(KV_DROP_INS[entry.is_layout] if codec and is_kv_codec(codec) else ()),
            *parameters,
            hooks_class(entry),
            Layout if entry.is_layout else Serial,
        )
        built[entry.name] = preset_class(entry, bases, __name__)
    return built


if TYPE_CHECKING:
    # -- full attention ----------------------------------------------------------------
    class KVCache(SerialDropIn, SerialMerge, GrowingGeometry, Serial): ...

    class PaddedKVRows(LayoutDropIn, LayoutBatchOps, GrowingGeometry, Layout): ...

    class BatchedKVCache(
        RowAlignment, SpeculativeLayout, LayoutDropIn, LayoutBatchOps, GrowingGeometry, Layout
    ): ...

    class QuantizedKVCache(
        SerialDropIn, SerialMerge, AffineParameters, GrowingGeometry, Serial
    ): ...

    class PaddedQuantKVRows(
        LayoutDropIn, LayoutBatchOps, AffineParameters, GrowingGeometry, Layout
    ): ...

    class BatchedQuantizedKVCache(
        RowAlignment,
        SpeculativeLayout,
        LayoutDropIn,
        LayoutBatchOps,
        AffineParameters,
        GrowingGeometry,
        Layout,
    ): ...

    class TurboQuantKVCache(
        SerialDropIn, SerialMerge, TurboParameters, GrowingGeometry, Serial
    ): ...

    class BatchedTurboQuantKVCache(
        RowAlignment,
        SpeculativeLayout,
        LayoutDropIn,
        LayoutBatchOps,
        TurboParameters,
        GrowingGeometry,
        Layout,
    ): ...

    class MxKVCache(SerialDropIn, SerialMerge, AffineParameters, GrowingGeometry, Serial): ...

    class BatchedMxKVCache(
        RowAlignment,
        SpeculativeLayout,
        LayoutDropIn,
        LayoutBatchOps,
        AffineParameters,
        GrowingGeometry,
        Layout,
    ): ...

    # -- sliding window ----------------------------------------------------------------
    class RotatingKVCache(SerialDropIn, SerialMerge, SharedRing, Serial): ...

    # -- chunked-local attention -------------------------------------------------------
    class ChunkedKVCache(SerialDropIn, SerialMerge, ChunkedSurface, ChunkedGeometry, Serial): ...

    class PaddedChunkedRows(
        LayoutDropIn, LayoutBatchOps, ChunkedSurface, ChunkedGeometry, Layout
    ): ...

    class BatchedChunkedKVCache(
        SpeculativeLayout, LayoutDropIn, LayoutBatchOps, ChunkedSurface, ChunkedGeometry, Layout
    ): ...

    class ChunkedQuantizedKVCache(
        SerialDropIn, SerialMerge, AffineParameters, ChunkedSurface, ChunkedGeometry, Serial
    ): ...

    class ChunkedMxKVCache(
        SerialDropIn, SerialMerge, AffineParameters, ChunkedSurface, ChunkedGeometry, Serial
    ): ...

    class BatchedChunkedMxKVCache(
        SpeculativeLayout,
        LayoutDropIn,
        LayoutBatchOps,
        AffineParameters,
        ChunkedSurface,
        ChunkedGeometry,
        Layout,
    ): ...

    class PaddedChunkedQuantRows(
        LayoutDropIn, LayoutBatchOps, AffineParameters, ChunkedSurface, ChunkedGeometry, Layout
    ): ...

    class BatchedChunkedQuantizedKVCache(
        SpeculativeLayout,
        LayoutDropIn,
        LayoutBatchOps,
        AffineParameters,
        ChunkedSurface,
        ChunkedGeometry,
        Layout,
    ): ...

    class BatchedRotatingCache(LayoutDropIn, LayoutBatchOps, SharedRing, Layout): ...

    class RaggedRotatingRows(LayoutDropIn, LayoutBatchOps, RaggedRing, Layout): ...

    class SpeculativeRotatingKVCache(
        SpeculativeLayout, LayoutDropIn, LayoutBatchOps, RaggedRing, Layout
    ): ...

    class RotatingQuantizedKVCache(
        SerialDropIn, SerialMerge, AffineParameters, SharedRing, Serial
    ): ...

    class BatchedRotatingQuantCache(
        LayoutDropIn, LayoutBatchOps, AffineParameters, SharedRing, Layout
    ): ...

    class RotatingAffineLayout(
        LayoutDropIn, LayoutBatchOps, AffineParameters, SharedRing, Layout
    ): ...

    class SpeculativeRotatingAffineLayout(
        SpeculativeLayout, LayoutDropIn, LayoutBatchOps, AffineParameters, RaggedRing, Layout
    ): ...

    class RotatingMxKVCache(SerialDropIn, SerialMerge, AffineParameters, SharedRing, Serial): ...

    class BatchedRotatingMxCache(
        LayoutDropIn, LayoutBatchOps, AffineParameters, SharedRing, Layout
    ): ...

    class SpeculativeRotatingMxLayout(
        SpeculativeLayout, LayoutDropIn, LayoutBatchOps, AffineParameters, RaggedRing, Layout
    ): ...

    # -- bf16-first legos (the delayed modifier on a serial storage) --------------------
    class Bf16FirstQuantizedKVCache(Bf16First, SerialDropIn, GrowingGeometry, Serial): ...

    class Bf16FirstTurboQuantKVCache(Bf16First, SerialDropIn, GrowingGeometry, Serial): ...

    class Bf16FirstMxKVCache(Bf16First, SerialDropIn, GrowingGeometry, Serial): ...

    class Bf16FirstRotatingQuantizedKVCache(Bf16First, SerialDropIn, SharedRing, Serial): ...

    class Bf16FirstRotatingMxKVCache(Bf16First, SerialDropIn, SharedRing, Serial): ...

    class Bf16FirstChunkedQuantizedKVCache(
        Bf16First, SerialDropIn, ChunkedSurface, ChunkedGeometry, Serial
    ): ...

    class Bf16FirstChunkedMxKVCache(
        Bf16First, SerialDropIn, ChunkedSurface, ChunkedGeometry, Serial
    ): ...

    # -- delayed layouts (the delayed modifier on a ragged layout of stage stores) -------
    class DelayedQuantizedKVCache(DelayedLayout, SpeculativeLayout, GrowingGeometry, Layout): ...

    class DelayedTurboQuantKVCache(DelayedLayout, SpeculativeLayout, GrowingGeometry, Layout): ...

    class DelayedMxKVCache(DelayedLayout, SpeculativeLayout, GrowingGeometry, Layout): ...

    class DelayedRotatingQuantizedKVCache(DelayedLayout, SpeculativeLayout, RaggedRing, Layout): ...

    class DelayedRotatingMxKVCache(DelayedLayout, SpeculativeLayout, RaggedRing, Layout): ...

    class DelayedChunkedQuantizedKVCache(
        DelayedLayout, SpeculativeLayout, ChunkedSurface, ChunkedGeometry, Layout
    ): ...

    class DelayedChunkedMxKVCache(
        DelayedLayout, SpeculativeLayout, ChunkedSurface, ChunkedGeometry, Layout
    ): ...

    # -- latent ------------------------------------------------------------------------
    class MLACache(LatentSurface, SpeculativeLayout, GrowingGeometry, Layout): ...

    # -- recurrent state ---------------------------------------------------------------
    class SSMCache(ArraysCacheSurface, SerialRounds, StateGeometry, Serial): ...

    class BatchedSSMCache(StateLayout, SpeculativeLayout, StateGeometry, Layout): ...

else:
    globals().update(build(PRESETS))
