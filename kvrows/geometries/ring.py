"""The ring geometry's spec: a sliding window with sink tokens (``spec/RotatingKVCache.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvrows.errors import InvalidInputError
from kvrows.geometries.registry import SpecParts, register_geometry
from kvrows.validation import as_count

__all__ = ["Ring", "held_positions"]


@register_geometry
@dataclass(frozen=True, kw_only=True)
class Ring(SpecParts):
    """Sliding window of ``max_size`` positions, the first ``keep`` of them sink tokens.

    A row's first ``keep`` positions (mlx-lm's ``keep``, StreamingLLM's attention sinks)
    are never evicted; the window slides over the rest, so a row holds its sinks and its
    newest ``max_size - keep`` other positions (``spec/RotatingKVCache.md`` §1).
    ``0 <= keep < max_size``.
    """

    max_size: int
    keep: int = 0
    kind: ClassVar[str] = "ring"
    wraps: ClassVar[bool] = True
    # mlx-lm's RotatingKVCache and BatchRotatingKVCache state after keys, values.
    serial_fields: ClassVar[tuple[str, ...]] = ("offset", "keep", "max_size", "idx")
    layout_fields: ClassVar[tuple[str, ...]] = (
        "offset", "left_padding", "max_size", "total", "idx", "rotated",
    )  # fmt: skip
    layout_form_omits: ClassVar[tuple[str, ...]] = ("keep",)

    def __post_init__(self) -> None:
        size = as_count(self.max_size, "max_size", minimum=1)
        keep = as_count(self.keep, "keep")
        if keep >= size:
            raise InvalidInputError(
                f"keep (sink tokens) must be smaller than max_size: got keep={keep}, "
                f"max_size={size}; expected 0 <= keep < max_size"
            )

    def cap(self) -> int:
        return self.max_size


def held_positions(offset: int, retained: int, sinks: int) -> list[int]:
    """The positions a row of ``offset`` positions holding ``retained`` tokens keeps, oldest
    first: its first ``min(sinks, offset, retained)`` (a ring's sink tokens), then a run of
    its newest. A growing row (``retained == offset``) keeps every position."""
    head = min(sinks, offset, retained)
    return [*range(head), *range(offset - retained + head, offset)]
