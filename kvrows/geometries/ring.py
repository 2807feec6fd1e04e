"""The ring geometry's spec: a sliding window with sink tokens (``spec/RotatingKVCache.md``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvrows.errors import InvalidInputError
from kvrows.geometries.registry import SpecParts, register_geometry
from kvrows.validation import STEP, as_count

__all__ = [
    "RaggedStep",
    "Ring",
    "held_positions",
    "ragged_slack",
    "ragged_step",
    "retained_after",
]


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


def ragged_slack(max_size: int, keep: int) -> int:
    """Spare columns a ragged ring row's tokens may run past its window before the rows
    are compacted (``spec/RaggedRotatingRows.md`` §1): the serial ring's ``min(256,
    max_size)`` (``spec/RotatingKVCache.md`` §2.1); 0 with sinks (every drop compacts:
    a row's sinks stay at columns ``[0, keep)``). The same for every ragged ring layout of
    a window (plain, affine, MX, delayed, paged): a model builds every sliding layer's
    mask from one layer's, so their rows must stand at the same columns."""
    return 0 if keep else min(STEP, max_size)


@dataclass(frozen=True)
class RaggedStep:
    """What a ragged ring's next block does to its rows' columns (:func:`ragged_step`).

    ``drops[b]``: row ``b``'s oldest tokens its retention drops; ``moved[b]``: the column
    its first kept token stands at once they are dropped in place (its lead plus its
    drops); ``compact``: the rows then move to column 0 (each left by ``moved[b]``: one
    copy of the layout) before the block is written; ``leads``: where each row's tokens
    start after the block."""

    drops: tuple[int, ...]
    moved: tuple[int, ...]
    compact: bool

    @property
    def leads(self) -> tuple[int, ...]:
        return (0,) * len(self.moved) if self.compact else self.moved


def retained_after(retained: Sequence[int], n: int, max_size: int, *, holding: bool) -> list[int]:
    """Tokens each ragged ring row retaining ``retained[b]`` holds once it appends ``n``:
    it keeps ``max_size - 1`` before them (a single token: the newest ``max_size``), every
    one while a proposal round is ``holding`` the rows."""
    if holding:
        return [r + n for r in retained]
    return [min(r, max_size - 1) + n for r in retained]


def ragged_step(
    leads: Sequence[int],
    retained: Sequence[int],
    n: int,
    max_size: int,
    slack: int,
    *,
    holding: bool = False,
) -> RaggedStep:
    """The rule both implementations follow before a block of ``n`` tokens on ragged ring
    rows whose tokens sit at ``[leads[b], leads[b] + retained[b])``: each row drops its
    oldest ``max(0, retained + 1 - max_size)`` (a single token keeps the newest
    ``max_size``, a block the newest ``max_size - 1``) by moving its lead past them; when
    some row then has a lead and a row's end after the block would pass ``max_size +
    slack`` columns, every row moves to column 0. While a proposal round is ``holding``
    the rows nothing is dropped and nothing moves (its discard leaves the rows exactly as
    they were; the buffer grows instead)."""
    if holding:
        return RaggedStep((0,) * len(leads), tuple(leads), False)
    drops = tuple(max(0, r + 1 - max_size) for r in retained)
    moved = tuple(lead + d for lead, d in zip(leads, drops, strict=True))
    ends = (m + r - d + n for m, r, d in zip(moved, retained, drops, strict=True))
    compact = any(moved) and max(ends) > max_size + slack
    return RaggedStep(drops, moved, compact)
