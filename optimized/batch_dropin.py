"""mlx-lm's batch API on kvrows classes (filled by issue 9's batch drop-in work)."""

from __future__ import annotations

__all__ = ["LayoutBatchOps", "SerialMerge"]


class SerialMerge:
    """``merge(caches)`` from a serial class, as mlx-lm's generator calls it."""


class LayoutBatchOps:
    """mlx-lm's in-place batch operations on a layout."""
