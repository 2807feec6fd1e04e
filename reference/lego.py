"""The reference's bf16-first storages (``kvrows.lego``; ``spec/bf16-first.md``).

Conversion encodes each row's retained plain planes with the reference affine codec
(``affine_codec.py``, ``mx.quantize`` in NumPy): groups run along the head dim, so each
token's encoding is independent of its neighbours and equals what an affine storage fed
the same tokens holds.
"""

from __future__ import annotations

from typing import Any

from kvrows.codec import KV_TENSORS, PlaneSet
from kvrows.errors import InvalidInputError
from kvrows.lego import Bf16First, FullAttentionLego, SlidingWindowLego, Target, TurboLego
from kvrows.reference.classes import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    TurboQuantKVCache,
)
from kvrows.reference.rows import Row, SerialStorage

__all__ = [
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
    "to_affine",
]


def to_affine(storage: SerialStorage, spec: Target, affine_class: type[SerialStorage]) -> Any:
    """A new ``affine_class`` storage (affine or TurboQuant, over ``spec``) holding
    ``storage``'s tokens at the same positions, each row's retained planes encoded with
    ``spec``'s codec; ``storage`` is unchanged."""
    if storage.codec_spec.kind != "plain":
        raise InvalidInputError(
            f"{type(storage).__name__} is {storage.codec_spec.name}: only a plain storage converts"
        )
    fresh = affine_class.from_specs(spec, storage.token_geometry, geometry=storage.geometry)
    rows = []
    for row in storage._rows:
        planes: PlaneSet = {
            t: fresh.codec.encode(row.planes[t][0], t) for t in KV_TENSORS if row.held
        }
        rows.append(Row(planes, row.offset, row.pad, row.sinks))
    fresh._rows = rows
    return fresh


class _ReferenceLego(Bf16First):
    def _convert(self, storage: Any) -> Any:
        return to_affine(storage, self.quantization, self.affine_class)


class Bf16FirstQuantizedKVCache(_ReferenceLego, FullAttentionLego):
    """Full attention: ``KVCache`` until the append that reaches ``start``, then
    ``QuantizedKVCache`` (arguments: ``QuantizedKVCache``'s, then ``start``)."""

    plain_class = KVCache
    affine_class = QuantizedKVCache


class Bf16FirstRotatingQuantizedKVCache(_ReferenceLego, SlidingWindowLego):
    """Sliding window: ``RotatingKVCache`` until the append that reaches ``start``, then
    ``RotatingQuantizedKVCache`` holding the same window (arguments:
    ``RotatingQuantizedKVCache``'s, then ``start``)."""

    plain_class = RotatingKVCache
    affine_class = RotatingQuantizedKVCache


class Bf16FirstTurboQuantKVCache(_ReferenceLego, TurboLego):
    """Full attention: ``KVCache`` until the append that reaches ``start``, then
    ``TurboQuantKVCache`` holding the same tokens (arguments: ``TurboQuantKVCache``'s, then
    ``start``)."""

    plain_class = KVCache
    affine_class = TurboQuantKVCache
