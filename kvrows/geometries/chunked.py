"""The chunked-local geometry's spec: attention within fixed chunks of positions
(llama4's local layers, mlx-lm's ``ChunkedKVCache``; ``spec/ChunkedKVCache.md``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvrows.geometries.registry import SpecParts, register_geometry
from kvrows.validation import as_count

__all__ = ["Chunked", "chunk_visible"]


@register_geometry
@dataclass(frozen=True, kw_only=True)
class Chunked(SpecParts):
    """Chunked-local attention: position ``q`` sees the positions ``k <= q`` of its own
    chunk (``k // chunk_size == q // chunk_size``). A row keeps its newest ``chunk_size``
    tokens before each append (mlx-lm's ``maybe_trim_front``), then the block."""

    chunk_size: int
    kind: ClassVar[str] = "chunked"
    evicts: ClassVar[bool] = True
    # mlx-lm's ChunkedKVCache state after keys, values.
    serial_fields: ClassVar[tuple[str, ...]] = ("offset", "chunk_size", "start_position")
    layout_fields: ClassVar[tuple[str, ...]] = ("offset", "left_padding", "idx", "chunk_size")

    def __post_init__(self) -> None:
        as_count(self.chunk_size, "chunk_size", minimum=1)

    def cap(self) -> int:
        # What a row holds between steps; a block of n tokens reads chunk_size + n.
        return self.chunk_size


def chunk_visible(query: int, key: int, chunk_size: int, window: int | None) -> bool:
    """Whether position ``query`` sees position ``key`` (the rule both twins restate with
    their own arrays; conformance's model calls this one)."""
    seen = key <= query and key // chunk_size == query // chunk_size
    return seen and (window is None or query - key < window)
