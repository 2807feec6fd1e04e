"""The ``speculative`` modifier of the optimized implementation: verify rounds on a layout.

The round's state machine is the core's (``kvrows.speculative.SpeculativeRounds``); this
class guards the layout's operations with it and forgets rejected tokens through the
geometry's own per-row trim: coverage on growing rows (the bytes stay and the next append
overwrites them), the retained block on ragged ring rows (a verify block keeps
``max_size - 1`` history tokens before it, so every accepted prefix keeps its whole
window, also across the window boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvrows.optimized.rows import Layout, RowWindow, Serial
from kvrows.protocols import Cache, Mask
from kvrows.speculative import SpeculativeRounds

__all__ = ["SpeculativeLayout"]

# A mixin over whatever layout follows it: at run time it must not bring ``Layout`` ahead
# of the geometry in the method order (the geometry overrides ``Layout``'s hooks).
if TYPE_CHECKING:
    _LayoutBase = Layout
else:
    _LayoutBase = object


class SpeculativeLayout(SpeculativeRounds, _LayoutBase):
    """A layout with the round protocol (``spec/speculative.md``); listed first among a
    public class's bases so it sees every call before the layout does."""

    def _spec_forget(self, counts: Sequence[int]) -> None:
        # Rows of one write column roll right (MLA's rollback); ragged rows just forget.
        self._trim_rows(counts, justify=self.composition.shared_column)

    # -- appends and reads ----------------------------------------------------------------
    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        append = super().update_and_fetch
        return self._spec_append(lambda: append(keys, values))

    def fetch(self) -> tuple[Any, Any]:
        self._spec_usable()
        return super().fetch()

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        self._spec_usable()
        return super().make_mask(n, return_array=return_array, window_size=window_size)

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """``False`` while a round is open (the row's newest tokens are unverified)."""
        self._spec_usable()
        published = super().can_publish_row(row, tokens)
        return published and not self.spec_round_open

    # -- row operations refuse in the middle of a round -----------------------------------
    def _merge_plan(self, rows: Sequence[Cache]) -> tuple[list[RowWindow], Any, list[int]]:
        self._spec_guard("merge_rows")  # merge_rows and check_merge
        return super()._merge_plan(rows)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self._spec_guard("filter_rows")
        super().filter_rows(keep)

    def extract_row(self, row: int) -> Serial:
        self._spec_guard("extract_row")
        return super().extract_row(row)

    def _row_windows(self) -> list[RowWindow]:
        self._spec_guard("merging this layout's rows into another")
        return super()._row_windows()

    def trim(self, n: int) -> int:
        self._spec_guard("trim (use spec_round_rollback)")
        return super().trim(n)

    def trim_rows(self, counts: Sequence[int]) -> int:
        self._spec_guard("trim_rows (use spec_round_rollback)")
        return super().trim_rows(counts)

    def _state(self) -> tuple[Any, ...]:
        self._spec_guard("saving state")
        return super()._state()
