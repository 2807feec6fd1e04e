"""mlx-lm's ``ArraysCache`` surface of the reference's recurrent caches (NumPy).

The layer writes its planes (``cache[i] = plane``), reads them back (``cache[i]``,
``conv, state = cache``), announces a padded run (``prepare`` / ``finalize`` or
``left_padding`` at construction), masks it (``make_mask``, ``lengths``) and advances
(``advance(S)``: each row gains its real tokens). The checks are the core's
(``kvrows.recurrent.RecurrentRows``); the bookkeeping is written here, plainly, and
again in ``kvrows.optimized.recurrent_surface``, so the conformance suite compares two
derivations (``spec/twins.md``). Every plane the cache takes is an owned copy.

This module becomes the surface half of ``reference/geometries/recurrent.py`` when
recurrent moves onto the row machinery (``spec/machinery-migration.md`` §4).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from kvrows.recurrent import RecurrentRows
from kvrows.validation import as_count

__all__ = ["ArraysCacheSurface"]


class ArraysCacheSurface(RecurrentRows):
    """``cache``, ``empty``, ``size``, ``cache[i]``, ``cache[i] = plane``, ``lengths``,
    ``left_padding``, ``prepare``, ``finalize``, ``make_mask``, ``advance`` over NumPy."""

    @property
    def cache(self) -> list[Any]:
        """The planes, ``[state.0, …]`` (a copy of the list; ``None`` where unwritten)."""
        return list(self._planes)

    def empty(self) -> bool:
        """mlx-lm's ``empty()``: no plane written yet."""
        return self._planes[0] is None

    def size(self) -> int:
        return 0

    def __getitem__(self, index: int) -> Any:
        self._spec_usable()
        return self._planes[self._plane_index(index)]

    def __iter__(self) -> Iterator[Any]:
        """The planes, so ``conv, state = cache`` unpacks as on mlx-lm's ``ArraysCache``
        (kimi_k3's layer does; iterating through ``__getitem__`` would hit the refused
        index ``N`` instead of stopping)."""
        self._spec_usable()
        return iter(list(self._planes))

    def __setitem__(self, index: int, value: Any) -> None:
        """The layer writes plane ``index``: ``[B, ...]``, every row at once, with the
        per-row shape and dtype the cache already holds for that plane."""
        self._spec_usable()
        i = self._plane_index(index)
        kind = self._check_plane(i, value)
        self._spec_write()
        # Own the plane: a caller writing into its array later must not reach the cache.
        self._planes[i] = np.array(value, copy=True)
        self._kinds[i] = kind
        if not self.is_layout:
            self._serial_rows = int(value.shape[0])

    # -- a padded run --------------------------------------------------------------------
    @property
    def lengths(self) -> Any:
        """Per-row real tokens still to come in the padded run (``None``: no run)."""
        return None if self._lengths is None else np.asarray(self._lengths, dtype=np.int32)

    @property
    def left_padding(self) -> Any:
        """Per-row pad tokens still to come at the front of the run (``None``: none)."""
        return None if self._left is None else np.asarray(self._left, dtype=np.int32)

    def prepare(
        self,
        *,
        lengths: Sequence[int] | None = None,
        left_padding: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """A padded run follows: row ``b``'s tokens ``left_padding[b] <= t < lengths[b]``
        are real (``right_padding`` is implied by ``lengths`` and ignored)."""
        self._lengths, self._left = self._check_prepare(lengths, left_padding)

    def finalize(self) -> None:
        """The padded run is over."""
        self._spec_usable()
        self._lengths = self._left = None
        self._mask_every_row = False

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        """``[B, n]`` bool (``True``: a real token) during a padded run or after mlx-lm's
        ``merge`` of empty caches (all true, as mlx-lm's), else ``None``."""
        self._spec_usable()
        count = as_count(n, "n", minimum=1)
        padded = self._lengths is not None or self._left is not None
        if not padded and not return_array and not self._mask_every_row:
            return None
        rows = self._rows
        end = np.asarray(self._lengths or [count] * rows, dtype=np.int64).reshape(rows, 1)
        start = np.asarray(self._left or [0] * rows, dtype=np.int64).reshape(rows, 1)
        t = np.arange(count).reshape(1, count)
        return (start <= t) & (t < end)

    def advance(self, n: int) -> None:
        """The layer consumed ``n`` positions: each row gains its real ones."""
        count, gained = self._check_advance(n)

        def step() -> None:
            if self.is_layout:
                self._offsets = [o + g for o, g in zip(self._offsets, gained, strict=True)]
            else:
                self._offsets = [self._offsets[0] + gained[0]]
            if self._lengths is not None:
                self._lengths = [v - count for v in self._lengths]
            if self._left is not None:
                self._left = [v - count for v in self._left]

        self._spec_append(step)
