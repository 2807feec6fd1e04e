"""The optimized implementation's public classes: one declaration per landed composition.

Each class is a geometry (``geometries/growing.py``, ``geometries/ring.py``) plus an
arrangement (``rows.py``), plus ``bits``/``group_size`` when its codec is affine; it names
its entry of the composition table (``kvrows.compositions``), which gives its constructor parameters, its
signature and its roles. ``Storage.__init_subclass__`` checks that the bases agree with
the entry, and ``kvrows.optimized`` registers every declared class with one call.
"""

from __future__ import annotations

from kvrows.common import AffineParameters, TurboParameters
from kvrows.compositions import composition
from kvrows.optimized.batch_dropin import LayoutBatchOps, SerialMerge
from kvrows.optimized.dropin import LayoutDropIn, SerialDropIn
from kvrows.optimized.geometries.growing import GrowingGeometry, RowAlignment
from kvrows.optimized.geometries.recurrent import (
    ArraysCacheSurface,
    StateGeometry,
    StateLayout,
)
from kvrows.optimized.geometries.ring import RaggedRing, SharedRing
from kvrows.optimized.rows import Layout, Serial
from kvrows.optimized.speculative import SpeculativeLayout
from kvrows.recurrent import SerialRounds

__all__ = [
    "BatchedKVCache",
    "BatchedQuantizedKVCache",
    "BatchedRotatingCache",
    "BatchedRotatingQuantCache",
    "BatchedSSMCache",
    "BatchedTurboQuantKVCache",
    "KVCache",
    "PaddedKVRows",
    "PaddedQuantKVRows",
    "QuantizedKVCache",
    "RaggedRotatingRows",
    "RotatingAffineLayout",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "SSMCache",
    "SpeculativeRotatingAffineLayout",
    "SpeculativeRotatingKVCache",
    "TurboQuantKVCache",
]

# -- full attention ----------------------------------------------------------------------


class KVCache(SerialDropIn, SerialMerge, GrowingGeometry, Serial):
    """Serial plain full-attention cache (``spec/KVCache.md``)."""

    composition = composition("KVCache")


class PaddedKVRows(LayoutDropIn, LayoutBatchOps, GrowingGeometry, Layout):
    """Decode layout of ``KVCache``: rows share one write column (``spec/PaddedKVRows.md``)."""

    composition = composition("PaddedKVRows")


class BatchedKVCache(
    RowAlignment, SpeculativeLayout, LayoutDropIn, LayoutBatchOps, GrowingGeometry, Layout
):
    """Prefill/verify layout of ``KVCache``: ragged rows with verify rounds
    (``spec/BatchedKVCache.md``)."""

    composition = composition("BatchedKVCache")


class QuantizedKVCache(SerialDropIn, SerialMerge, AffineParameters, GrowingGeometry, Serial):
    """Serial affine-quantized full-attention cache (``spec/QuantizedKVCache.md``)."""

    composition = composition("QuantizedKVCache")


class PaddedQuantKVRows(LayoutDropIn, LayoutBatchOps, AffineParameters, GrowingGeometry, Layout):
    """Decode layout of ``QuantizedKVCache``: one write column (``spec/PaddedQuantKVRows.md``)."""

    composition = composition("PaddedQuantKVRows")


class BatchedQuantizedKVCache(
    RowAlignment,
    SpeculativeLayout,
    LayoutDropIn,
    LayoutBatchOps,
    AffineParameters,
    GrowingGeometry,
    Layout,
):
    """Prefill/verify layout of ``QuantizedKVCache``: ragged (``spec/BatchedQuantizedKVCache.md``)."""

    composition = composition("BatchedQuantizedKVCache")


class TurboQuantKVCache(SerialDropIn, SerialMerge, TurboParameters, GrowingGeometry, Serial):
    """Serial TurboQuant full attention (``spec/TurboQuantKVCache.md``)."""

    composition = composition("TurboQuantKVCache")


class BatchedTurboQuantKVCache(
    RowAlignment,
    SpeculativeLayout,
    LayoutDropIn,
    LayoutBatchOps,
    TurboParameters,
    GrowingGeometry,
    Layout,
):
    """TurboQuant rows in all three roles: ragged, with verify rounds
    (``spec/BatchedTurboQuantKVCache.md``)."""

    composition = composition("BatchedTurboQuantKVCache")


# -- sliding window ----------------------------------------------------------------------


class RotatingKVCache(SerialDropIn, SerialMerge, SharedRing, Serial):
    """Serial plain sliding-window cache (``spec/RotatingKVCache.md``)."""

    composition = composition("RotatingKVCache")


class BatchedRotatingCache(LayoutDropIn, LayoutBatchOps, SharedRing, Layout):
    """Decode layout of ``RotatingKVCache`` (``spec/BatchedRotatingCache.md``)."""

    composition = composition("BatchedRotatingCache")


class RaggedRotatingRows(LayoutDropIn, LayoutBatchOps, RaggedRing, Layout):
    """Prefill layout of ``RotatingKVCache``: ragged rings (``spec/RaggedRotatingRows.md``)."""

    composition = composition("RaggedRotatingRows")


class SpeculativeRotatingKVCache(
    SpeculativeLayout, LayoutDropIn, LayoutBatchOps, RaggedRing, Layout
):
    """Verify layout of ``RotatingKVCache``: ragged rings with verify rounds that roll back
    across the window (``spec/SpeculativeRotatingKVCache.md``)."""

    composition = composition("SpeculativeRotatingKVCache")


class RotatingQuantizedKVCache(SerialDropIn, SerialMerge, AffineParameters, SharedRing, Serial):
    """Serial affine-quantized ring (``spec/RotatingQuantizedKVCache.md``)."""

    composition = composition("RotatingQuantizedKVCache")


class BatchedRotatingQuantCache(LayoutDropIn, LayoutBatchOps, AffineParameters, SharedRing, Layout):
    """Decode layout of ``RotatingQuantizedKVCache`` (``spec/BatchedRotatingQuantCache.md``)."""

    composition = composition("BatchedRotatingQuantCache")


class RotatingAffineLayout(LayoutDropIn, LayoutBatchOps, AffineParameters, SharedRing, Layout):
    """Prefill layout of ``RotatingQuantizedKVCache``: aligned rotating rows
    (``spec/RotatingAffineLayout.md``)."""

    composition = composition("RotatingAffineLayout")


class SpeculativeRotatingAffineLayout(
    SpeculativeLayout, LayoutDropIn, LayoutBatchOps, AffineParameters, RaggedRing, Layout
):
    """Verify layout of ``RotatingQuantizedKVCache``: ragged affine rings with verify rounds
    (``spec/SpeculativeRotatingKVCache.md``)."""

    composition = composition("SpeculativeRotatingAffineLayout")


# -- recurrent state -----------------------------------------------------------------------


class SSMCache(ArraysCacheSurface, SerialRounds, StateGeometry, Serial):
    """Serial recurrent state of one layer (``N`` planes written by the layer; not
    trimmable); mlx-lm's ``ArraysCache(N)`` drop-in: ``spec/SSMCache.md``."""

    composition = composition("SSMCache")


class BatchedSSMCache(StateLayout, SpeculativeLayout, StateGeometry, Layout):
    """The row layout of ``SSMCache`` in all three roles, with snapshot + replay verify
    rounds: ``spec/BatchedSSMCache.md``. The surface comes first: its refusals
    (``update_and_fetch``, ``trim``) and guards answer before the round's wrappers."""

    composition = composition("BatchedSSMCache")
