"""The ``speculative`` modifier of the reference: verify rounds on a row layout.

The round's state machine is the core's (``kvrows.speculative.SpeculativeRounds``). A
rollback is the layout's own per-row trim, which makes its meaning plain: row ``b``
forgets the ``block - keep[b]`` newest tokens it retains, and the geometry refuses unless
the row still holds the whole window of the position it goes back to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrows.protocols import Mask
from kvrows.reference.rows import RowLayout, SerialStorage
from kvrows.speculative import SpeculativeRounds

__all__ = ["SpeculativeLayout"]


class SpeculativeLayout(SpeculativeRounds, RowLayout):
    """A row layout with the round protocol (``spec/speculative.md``)."""

    def _spec_forget(self, counts: Sequence[int]) -> None:
        # Rows of one write column roll right (MLA's rollback); ragged rows just forget.
        self._trim(counts, justify=self.composition.shared_column)

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
        return super().can_publish_row(row, tokens) and not self.spec_round_open

    def _merge_plan(self, rows: Sequence[Any]) -> Any:
        self._spec_guard("merge_rows")  # merge_rows and check_merge
        return super()._merge_plan(rows)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self._spec_guard("filter_rows")
        super().filter_rows(keep)

    def extract_row(self, row: int) -> SerialStorage:
        self._spec_guard("extract_row")
        return super().extract_row(row)

    def lend_rows(self) -> None:
        self._spec_guard("merging this layout's rows into another")

    def trim(self, n: int) -> int:
        self._spec_guard("trim (use spec_round_rollback)")
        return super().trim(n)

    def trim_rows(self, counts: Sequence[int]) -> int:
        self._spec_guard("trim_rows (use spec_round_rollback)")
        return super().trim_rows(counts)

    def _state(self) -> tuple[Any, ...]:
        self._spec_guard("saving state")
        return super()._state()
