"""mlx-lm's per-cache surface beyond the model protocol (filled by issue 9's drop-in work)."""

from __future__ import annotations

__all__ = ["LayoutDropIn", "SerialDropIn"]


class SerialDropIn:
    """mlx-lm's single-sequence cache methods on a serial storage."""


class LayoutDropIn:
    """mlx-lm's cache methods on a layout."""
