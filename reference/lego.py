"""The reference's bf16-first storages (``kvrows.lego``; ``spec/bf16-first.md``): the
presets are built by ``classes.py`` from the table (re-exported here, where they were
written before); ``to_affine`` is the delayed layouts' conversion of a whole serial storage.

Conversion encodes each row's retained plain planes with the reference affine codec
(``affine_codec.py``, ``mx.quantize`` in NumPy): groups run along the head dim, so each
token's encoding is independent of its neighbours and equals what an affine storage fed
the same tokens holds.
"""

from __future__ import annotations

from typing import Any

from kvrows.codec import KV_TENSORS, PlaneSet
from kvrows.errors import InvalidInputError
from kvrows.lego import Target
from kvrows.reference.classes import (
    Bf16FirstQuantizedKVCache,
    Bf16FirstRotatingQuantizedKVCache,
    Bf16FirstTurboQuantKVCache,
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
    if storage.codec_spec.encodes:
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
