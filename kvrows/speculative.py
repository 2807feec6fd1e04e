"""The speculative round protocol (``spec/speculative.md``): array-free bookkeeping.

A verify layout (``SpeculativeRowLayout``) runs rounds: ``spec_round_begin()`` before the
verify block ``[pending, draft_1 … draft_d]`` (``d + 1`` tokens for every row) is
appended, then ``spec_round_commit()`` (every row accepted every draft) or
``spec_round_rollback(keep)`` (row ``b`` keeps the first ``keep[b]`` tokens of the block,
``1 <= keep[b] <= d + 1``; the rest leave no trace).

:class:`SpeculativeRounds` is the round's state machine, shared by both implementations:
it reads and writes only Python ints. How a row forgets its rejected tokens is each
implementation's own (``_spec_forget``: coverage on growing rows, the ring's retained
block on ring rows), and that is what the conformance suite compares.

:class:`RowRound` is the seed's row transaction (``bindRowCacheRollback``) over every
layer's verify layout: ``begin(d)`` opens a round on every layer only when ``d > 0``,
``resolve(accepted)`` commits or rolls back with ``keep = accepted + 1``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvrows.errors import (
    ONE_VERIFY_BLOCK,
    SPECULATIVE_INVALID,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    SpeculativeRoundError,
    SpeculativeStateInvalidError,
    not_an_integer_message,
)

__all__ = ["RowRound", "SpeculativeRounds", "check_accepted", "check_keep_vector"]

_R = TypeVar("_R")


def _integer(value: object, what: str) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidInputError(not_an_integer_message(what, value))
    return operator.index(value)


def check_keep_vector(keep: Any, blocks: Sequence[int]) -> list[int]:
    """``keep`` (one int for every row, or one int per row) as one count per row, row
    ``b``'s in ``1..blocks[b]`` (the pending token is always kept; ``blocks[b]``: the
    tokens row ``b`` took in the round's verify block)."""
    rows = len(blocks)
    if isinstance(keep, str | bytes):
        raise InvalidInputError(f"keep must be an integer or one integer per row, got {keep!r}")
    if getattr(keep, "ndim", None) == 1 and hasattr(keep, "tolist"):
        keep = keep.tolist()  # a NumPy or MLX vector
    if isinstance(keep, Sequence):
        if len(keep) != rows:
            raise InvalidInputError(f"keep needs {rows} counts (one per row), got {len(keep)}")
        counts = [_integer(v, f"keep[{b}]") for b, v in enumerate(keep)]
    else:
        if getattr(keep, "ndim", None) == 0 and hasattr(keep, "item"):
            keep = keep.item()
        counts = [_integer(keep, "keep")] * rows
    for b, (count, block) in enumerate(zip(counts, blocks, strict=True)):
        if not 1 <= count <= block:
            raise InvalidInputError(
                f"keep[{b}] = {count} is outside 1..{block}: a row keeps the pending token and "
                f"at most every token of its {block}-token verify block"
            )
    return counts


def check_accepted(accepted: object, rows: int, drafts: int) -> list[int]:
    """Accepted drafts per row, each in ``0..drafts``."""
    if isinstance(accepted, str | bytes) or not isinstance(accepted, Sequence):
        raise InvalidInputError(f"accepted must be one integer per row, got {accepted!r}")
    if len(accepted) != rows:
        raise InvalidInputError(f"accepted needs {rows} counts (one per row), got {len(accepted)}")
    counts = [_integer(v, f"accepted[{b}]") for b, v in enumerate(accepted)]
    for b, count in enumerate(counts):
        if not 0 <= count <= drafts:
            raise InvalidInputError(f"accepted[{b}] = {count} is outside 0..{drafts}")
    return counts


class SpeculativeRounds:
    """The round state machine of a verify layout (mixed in ahead of the layout).

    The implementation calls ``_spec_guard(what)`` at the top of every row operation,
    ``_spec_usable()`` at the top of every read, and brackets an append with
    :meth:`_spec_append`; it supplies ``_spec_forget(counts)`` (forget ``counts[b]``
    newest tokens of row ``b``, bypassing the guards) and ``row_offsets``.
    """

    _spec_before: tuple[int, ...] | None = None  # row offsets when the round began
    _spec_block: tuple[int, ...] | None = None  # tokens each row took in the verify block
    _spec_invalid: bool = False

    if TYPE_CHECKING:  # the layout's (declared here only for the type checker)

        @property
        def row_offsets(self) -> tuple[int, ...]: ...

    def _spec_forget(self, counts: Sequence[int]) -> None:
        raise NotImplementedError

    # -- the protocol --------------------------------------------------------------------
    @property
    def spec_round_open(self) -> bool:
        """Whether a round has begun and is not yet committed or rolled back."""
        return self._spec_before is not None

    def spec_round_begin(self) -> None:
        """Open a round: call before the verify block is appended."""
        self._spec_usable()
        if self._spec_before is not None:
            raise SpeculativeRoundError(
                "a speculative round is already open: commit or roll it back before the next"
            )
        if not self.row_offsets:
            raise LayoutStateError("an empty layout has no row to verify: merge rows first")
        self._spec_before, self._spec_block = self.row_offsets, None

    def spec_round_commit(self) -> None:
        """Every row accepted every draft: keep the whole block."""
        self._spec_block_of("spec_round_commit")
        self._spec_before = self._spec_block = None

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        """Row ``b`` keeps the first ``keep[b]`` tokens of the verify block (an int: every
        row the same); the rejected tokens are forgotten. Invalid ``keep`` changes nothing
        and leaves the round open."""
        blocks = self._spec_block_of("spec_round_rollback")
        counts = check_keep_vector(keep, blocks)
        rejected = [block - k for block, k in zip(blocks, counts, strict=True)]
        if any(rejected):
            self._spec_failing(lambda: self._spec_forget(rejected))
        self._spec_before = self._spec_block = None

    # -- what the implementation calls ------------------------------------------------------
    def _spec_usable(self) -> None:
        if self._spec_invalid:
            raise SpeculativeStateInvalidError(SPECULATIVE_INVALID)

    def _spec_guard(self, what: str) -> None:
        """Refuse a row operation in the middle of a round."""
        self._spec_usable()
        if self._spec_before is not None:
            raise SpeculativeRoundError(
                f"{what} in the middle of a speculative round: commit or roll back the round "
                "first (its verify block holds unverified drafts)"
            )

    def _spec_append(self, append: Callable[[], _R]) -> _R:
        """Run an append; inside a round it is the round's one verify block, and a failure
        invalidates the layout."""
        self._spec_usable()
        if self._spec_before is None:
            return append()
        if self._spec_block is not None:
            raise SpeculativeRoundError(ONE_VERIFY_BLOCK)
        before = self.row_offsets
        result = self._spec_failing(append)
        self._spec_block = tuple(a - b for a, b in zip(self.row_offsets, before, strict=True))
        return result

    def _before_restore(self) -> None:
        """The ``state`` setter would silently drop an open round, or revive an invalid
        layout."""
        self._spec_guard("restoring state")

    #: Errors a layout raises before anything in it changes, so a round they interrupt
    #: stays usable (a paged layout's ``PoolExhaustedError``: its blocks are taken before
    #: any table or byte moves); every other failure inside a round invalidates it.
    _spec_refused_unchanged: ClassVar[tuple[type[BaseException], ...]] = ()

    def _spec_failing(self, step: Callable[[], _R]) -> _R:
        try:
            return step()
        except self._spec_refused_unchanged:
            raise
        except BaseException:
            self._spec_invalid = True
            raise

    def _spec_block_of(self, what: str) -> tuple[int, ...]:
        self._spec_usable()
        if self._spec_before is None:
            raise SpeculativeRoundError(f"{what} without spec_round_begin: no round is open")
        if self._spec_block is None:
            raise SpeculativeRoundError(
                f"{what} before the round's verify block was appended: append "
                "[pending, drafts…] through update_and_fetch first"
            )
        return self._spec_block


class RowRound:
    """One speculative round over every layer's verify layout (the seed's row transaction).

    ``begin(d)`` opens a round on every layer when ``d > 0`` (a zero-draft round appends
    only the pending token and needs no rollback state); ``resolve(accepted)`` (one count
    in ``0..d`` per row) commits when every row accepted all ``d``, else rolls back with
    ``keep = accepted + 1``. An invalid ``accepted`` is refused before anything changes;
    a failure after that marks the transaction invalid (every later call refuses).
    """

    def __init__(self, layouts: Sequence[Any]) -> None:
        if not layouts:
            raise InvalidInputError("a round needs at least one layer's verify layout")
        for layout in layouts:
            if not all(
                callable(getattr(layout, name, None))
                for name in ("spec_round_begin", "spec_round_commit", "spec_round_rollback")
            ):
                raise InvalidInputError(
                    f"{type(layout).__name__} is not a speculative row layout "
                    "(use target_cache_layout for the verify layout)"
                )
        self._layouts = tuple(layouts)
        self._drafts: int | None = None
        self._invalid = False

    @property
    def rows(self) -> int:
        return len(self._layouts[0].row_offsets)

    def _usable(self) -> None:
        if self._invalid:
            raise SpeculativeStateInvalidError(SPECULATIVE_INVALID)

    def begin(self, drafts: int) -> None:
        """Before the verify forward of ``drafts + 1`` tokens per row."""
        self._usable()
        if self._drafts is not None:
            raise SpeculativeRoundError("the round already began: resolve it first")
        d = _integer(drafts, "drafts")
        if d < 0:
            raise InvalidInputError(f"drafts must be >= 0, got {d}")
        if d > 0:
            self._all(lambda layout: layout.spec_round_begin())
        self._drafts = d

    def resolve(self, accepted: Sequence[int]) -> None:
        """After the verify forward: ``accepted[b]`` drafts of row ``b`` matched."""
        self._usable()
        if self._drafts is None:
            raise SpeculativeRoundError("resolve without begin: no round is open")
        d = self._drafts
        counts = check_accepted(accepted, self.rows, d)
        if d > 0:
            if all(c == d for c in counts):
                self._all(lambda layout: layout.spec_round_commit())
            elif len(set(counts)) == 1:
                self._all(lambda layout: layout.spec_round_rollback(counts[0] + 1))
            else:
                keep = [c + 1 for c in counts]
                self._all(lambda layout: layout.spec_round_rollback(keep))
        self._drafts = None

    def _all(self, call: Callable[[Any], object]) -> None:
        try:
            for layout in self._layouts:
                call(layout)
        except KvRowsError:
            self._invalid = True
            raise
