"""The oracle of a bf16-first conversion in the reference, written apart from the row
machinery's ``_convert_rows``: a plain serial storage's rows encoded token by token with
the target's reference codec (groups run along the head dim, so each token's encoding is
independent of its neighbours and equals what a storage of the target fed the same tokens
holds)."""

from __future__ import annotations

from typing import Any

from kvrows.codec import KV_TENSORS, CodecSpec, PlaneSet
from kvrows.reference.rows import Row, SerialStorage


def to_affine(storage: SerialStorage, spec: CodecSpec, affine_class: type[SerialStorage]) -> Any:
    """A new ``affine_class`` storage (affine or TurboQuant, over ``spec``) holding
    ``storage``'s tokens at the same positions, each row's retained planes encoded with
    ``spec``'s codec; ``storage`` (plain) is unchanged."""
    assert not storage.codec_spec.encodes, "only a plain storage converts"
    fresh = affine_class.from_specs(spec, storage.token_geometry, geometry=storage.geometry)
    rows = []
    for row in storage._rows:
        planes: PlaneSet = {
            t: fresh.codec.encode(row.planes[t][0], t) for t in KV_TENSORS if row.held
        }
        rows.append(Row(planes, row.offset, row.pad, row.sinks))
    fresh._rows = rows
    return fresh
