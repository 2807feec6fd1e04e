"""The reference's public classes: one thin declaration per landed composition.

Each names its composition (``kvrows.compositions``): the codec, the token geometry and
the arrangement come from there, and the row machinery (``rows.py``) with the geometry's
hooks (``geometries/growing.py``, ``geometries/ring.py``, ``geometries/recurrent.py``) does the rest. The mixins add what mlx-lm reads off
an affine storage (``bits``, ``group_size``) or a ring (``max_size``, ``keep``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrows.common import AffineParameters, TurboParameters
from kvrows.compositions import composition, landed
from kvrows.delayed import DelayedRows, DelayedSlidingWindow
from kvrows.errors import KvRowsError, speculative_modifier_message
from kvrows.geometries import geometry_class
from kvrows.recurrent import SerialRounds
from kvrows.reference.geometries.growing import RowAlignment
from kvrows.reference.geometries.recurrent import ArraysCacheSurface, StateLayout
from kvrows.reference.geometries.ring import RingParameters
from kvrows.reference.rows import RowLayout, SerialStorage
from kvrows.reference.speculative import SpeculativeLayout

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
    "declared_classes",
]

# -- full attention ------------------------------------------------------------------------


class KVCache(SerialStorage):
    """Serial plain full attention (``spec/KVCache.md``)."""

    composition = composition("KVCache")


class PaddedKVRows(RowLayout):
    """Decode layout of ``KVCache``: one write column (``spec/PaddedKVRows.md``)."""

    composition = composition("PaddedKVRows")
    serial_class = KVCache


class BatchedKVCache(RowAlignment, SpeculativeLayout):
    """Prefill/verify layout of ``KVCache``: ragged rows with verify rounds
    (``spec/BatchedKVCache.md``)."""

    composition = composition("BatchedKVCache")
    serial_class = KVCache


class QuantizedKVCache(AffineParameters, SerialStorage):
    """Serial affine full attention (``spec/QuantizedKVCache.md``)."""

    composition = composition("QuantizedKVCache")


class PaddedQuantKVRows(AffineParameters, RowLayout):
    """Decode layout of ``QuantizedKVCache`` (``spec/PaddedQuantKVRows.md``)."""

    composition = composition("PaddedQuantKVRows")
    serial_class = QuantizedKVCache


class BatchedQuantizedKVCache(AffineParameters, RowAlignment, SpeculativeLayout):
    """Prefill/verify layout of ``QuantizedKVCache`` (``spec/BatchedQuantizedKVCache.md``)."""

    composition = composition("BatchedQuantizedKVCache")
    serial_class = QuantizedKVCache


class TurboQuantKVCache(TurboParameters, SerialStorage):
    """Serial TurboQuant full attention (``spec/TurboQuantKVCache.md``)."""

    composition = composition("TurboQuantKVCache")


class BatchedTurboQuantKVCache(TurboParameters, RowAlignment, SpeculativeLayout):
    """TurboQuant rows in all three roles: ragged, with verify rounds
    (``spec/BatchedTurboQuantKVCache.md``)."""

    composition = composition("BatchedTurboQuantKVCache")
    serial_class = TurboQuantKVCache


# -- sliding window ---------------------------------------------------------------------------


class RotatingKVCache(RingParameters, SerialStorage):
    """Serial plain ring (``spec/RotatingKVCache.md``)."""

    composition = composition("RotatingKVCache")


class BatchedRotatingCache(RingParameters, RowLayout):
    """Decode layout of ``RotatingKVCache`` (``spec/BatchedRotatingCache.md``)."""

    composition = composition("BatchedRotatingCache")
    serial_class = RotatingKVCache


class RaggedRotatingRows(RingParameters, RowLayout):
    """Prefill layout of ``RotatingKVCache`` (``spec/RaggedRotatingRows.md``)."""

    composition = composition("RaggedRotatingRows")
    serial_class = RotatingKVCache


class SpeculativeRotatingKVCache(RingParameters, SpeculativeLayout):
    """Verify layout of ``RotatingKVCache``: ragged rings with verify rounds that roll back
    across the window (``spec/SpeculativeRotatingKVCache.md``)."""

    composition = composition("SpeculativeRotatingKVCache")
    serial_class = RotatingKVCache


class RotatingQuantizedKVCache(AffineParameters, RingParameters, SerialStorage):
    """Serial affine ring (``spec/RotatingQuantizedKVCache.md``)."""

    composition = composition("RotatingQuantizedKVCache")


class BatchedRotatingQuantCache(AffineParameters, RingParameters, RowLayout):
    """Decode layout of ``RotatingQuantizedKVCache`` (``spec/BatchedRotatingQuantCache.md``)."""

    composition = composition("BatchedRotatingQuantCache")
    serial_class = RotatingQuantizedKVCache


class RotatingAffineLayout(AffineParameters, RingParameters, RowLayout):
    """Prefill layout of ``RotatingQuantizedKVCache`` (``spec/RotatingAffineLayout.md``)."""

    composition = composition("RotatingAffineLayout")
    serial_class = RotatingQuantizedKVCache


class SpeculativeRotatingAffineLayout(AffineParameters, RingParameters, SpeculativeLayout):
    """Verify layout of ``RotatingQuantizedKVCache``: ragged affine rings with verify rounds
    (``spec/SpeculativeRotatingKVCache.md``)."""

    composition = composition("SpeculativeRotatingAffineLayout")
    serial_class = RotatingQuantizedKVCache


# -- recurrent state ---------------------------------------------------------------------


class SSMCache(ArraysCacheSurface, SerialRounds, SerialStorage):
    """Serial recurrent state of one layer (planes written by the layer; not trimmable):
    ``spec/SSMCache.md``."""

    composition = composition("SSMCache")


class BatchedSSMCache(StateLayout, SpeculativeLayout):
    """The row layout of ``SSMCache`` in all three roles, with snapshot + replay verify
    rounds: ``spec/BatchedSSMCache.md``."""

    composition = composition("BatchedSSMCache")
    serial_class = SSMCache


#: The parameters a surface mixin exposes (``AffineParameters``: ``bits``;
#: ``RingParameters``: ``max_size``): a class has each iff its table entry takes it.
_SURFACE_PARAMETERS = ("bits", "max_size")


def _checked(cls: type[Any]) -> type[Any]:
    """``cls`` as its composition wants it: the declaration agrees with the table, and the
    composition's modifiers are applied (speculative: ``SpeculativeLayout`` wraps a
    layout; delayed: a ``kvrows.delayed.DelayedRows`` over two such layouts, whose parts
    ``register_compositions`` checks)."""
    entry = cls.composition
    if "delayed" in entry.modifiers:
        if not issubclass(cls, DelayedRows) or issubclass(cls, DelayedSlidingWindow) != (
            geometry_class(entry.geometry).wraps
        ):
            raise KvRowsError(f"{cls.__name__}: the delayed modifier is a DelayedRows layout")
        return cls
    # The class's surface, not its bases: a layout merges rows, a parameter mixin
    # (``AffineParameters``, ``RingParameters``) exposes the table's parameters, the
    # speculative modifier opens rounds.
    agrees = (
        callable(getattr(cls, "merge_rows", None)) == entry.is_layout
        and all(hasattr(cls, name) == (name in entry.params) for name in _SURFACE_PARAMETERS)
        and (not entry.is_layout or cls.serial_class.composition.name == entry.serial)
    )
    if not agrees:
        raise KvRowsError(f"{cls.__name__} does not declare its composition {entry}")
    if callable(getattr(cls, "spec_round_begin", None)) != ("speculative" in entry.modifiers):
        raise KvRowsError(speculative_modifier_message(cls.__name__))
    return cls


def declared_classes() -> Mapping[str, type[Any]]:
    """Every public class of the reference, by composition name (what ``__init__``
    registers): this module's and the delayed layouts (``reference/delayed.py``)."""
    from kvrows.reference import delayed  # it builds on this module's classes

    candidates = [*globals().values(), *vars(delayed).values()]
    # A public class declares its table entry (``composition``); its bases do not.
    found = {
        entry.name: _checked(value)
        for value in candidates
        if isinstance(value, type) and (entry := vars(value).get("composition")) is not None
    }
    from kvrows.reference import latent  # latent state: its own row machinery

    found |= {cls.composition.name: cls for cls in (latent.MLACache, latent.EncodedLatentCache)}
    from kvrows.reference import paged  # the paged storages (``kvrows.paged_storage``)

    found.update({cls.composition.name: cls for cls in (paged.PagedKVCache, paged.PagedKvRows)})
    from kvrows.reference import paged_latent  # MLA latent planes in a block pool

    found[paged_latent.PagedLatentCache.composition.name] = paged_latent.PagedLatentCache
    missing = [c.name for c in landed() if c.name not in found]
    if missing:
        raise KvRowsError(f"the reference lacks {', '.join(missing)}")
    return found
