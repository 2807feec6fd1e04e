"""The recurrent geometry's spec: constant-size state per row, no token axis
(``spec/SSMCache.md``, ``spec/contract.md`` §0.3).

A recurrent row keeps no tokens, only the running state its layer computed from them
(the ``State`` codec's planes), so nothing of it can be cut: it is trimmable by 0 only and
published at exactly the coverage it holds. What the geometry adds to the row bookkeeping
is how a padded run advances each row (:func:`valid_counts`) and what a verify round
replays after restoring its snapshot (:data:`Replay`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from kvrows.geometries.registry import SpecParts, register_geometry

__all__ = ["Recurrent", "Replay", "valid_counts"]

#: ``replay(cache, *inputs)``: run the layer's forward over ``inputs`` (per-position
#: arrays ``[B, S, ...]``) on ``cache``, honouring ``cache.make_mask`` / ``cache.lengths``
#: (masked positions leave the state unchanged) and ending with ``cache.advance(S)``.
Replay = Callable[..., object]


@register_geometry
@dataclass(frozen=True, kw_only=True)
class Recurrent(SpecParts):
    """The recurrent geometry: constant-size state per row, no token axis."""

    kind: ClassVar[str] = "recurrent"
    token_axis: ClassVar[bool] = False
    # The saved form after the planes (state.0 … state.{N-1}): each row's coverage, an int
    # (serial) or one per row (a layout); mlx-lm's ArraysCache form has none.
    serial_fields: ClassVar[tuple[str, ...]] = ("offset",)
    layout_fields: ClassVar[tuple[str, ...]] = ("offset",)


def valid_counts(n: int, rows: int, lengths: list[int] | None, left: list[int] | None) -> list[int]:
    """Real tokens each row takes from a block of ``n``: positions ``t`` with
    ``left[b] <= t < lengths[b]`` (no padding: all ``n``)."""
    counts = []
    for b in range(rows):
        end = n if lengths is None else max(0, min(n, lengths[b]))
        start = 0 if left is None else max(0, min(n, left[b]))
        counts.append(max(0, end - start))
    return counts
