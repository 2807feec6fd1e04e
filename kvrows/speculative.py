"""The speculative round protocol (``spec/speculative.md``): array-free bookkeeping.

A verify layout (``SpeculativeRowLayout``) runs rounds: ``spec_round_begin()`` before the
verify block ``[pending, draft_1 … draft_d]`` (``d + 1`` tokens for every row) is
appended, then ``spec_round_commit()`` (every row accepted every draft) or
``spec_round_rollback(keep)`` (row ``b`` keeps the first ``keep[b]`` tokens of the block,
``1 <= keep[b] <= d + 1``; the rest leave no trace).

:class:`SpeculativeRounds` is the round's state machine, shared by both implementations:
it reads and writes only Python ints and bools. How a row forgets its rejected tokens is
each implementation's own (``_spec_forget``: coverage on growing rows, the ring's
retained block on ring rows), or, where the geometry cannot forget (recurrent state), a
snapshot restored and the kept tokens replayed through the layer (``_spec_snapshot``,
``_spec_restore``, ``_spec_replay``, with the record ``spec_round_record``), and that is
what the conformance suite compares.

:class:`RowRound` is the seed's row transaction (``bindRowCacheRollback``) over every
layer's verify layout: ``begin(d)`` opens a round on every layer only when ``d > 0``,
``resolve(accepted)`` commits or rolls back with ``keep = accepted + 1``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from kvrows.errors import (
    NO_PROPOSALS,
    NOTHING_TO_RECORD,
    ONE_VERIFY_BLOCK,
    PROPOSAL_ROUND_ENDS,
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
    ``_spec_usable()`` at the top of every read, brackets an append with
    :meth:`_spec_append` (and a write that belongs to the next append with
    :meth:`_spec_write`), and supplies ``row_offsets`` and how a row forgets its rejected
    tokens, one of two ways:

    * a storage whose geometry can forget supplies ``_spec_forget(counts)`` (forget
      ``counts[b]`` newest tokens of row ``b``, bypassing the guards);
    * a storage whose geometry cannot (recurrent state: a running summary of every token)
      rolls back by **snapshot and replay**: ``_spec_snapshot()`` keeps what a rollback
      restores when the round begins (refusing, before anything changes, a round it cannot
      open), ``_spec_restore(kept)`` puts it back, ``_spec_input_span(j, x)`` checks one
      per-position input the layer records and ``_spec_replay(replay, inputs, keep)`` runs
      the layer over the first ``keep[b]`` positions of row ``b`` (the geometry's array
      work). The layer's verify forward records its inputs and the replay
      (:meth:`spec_round_record`) while :attr:`spec_round_awaits_record`.
    """

    _spec_before: tuple[int, ...] | None = None  # row offsets when the round began
    _spec_block: tuple[int, ...] | None = None  # tokens each row took in the verify block
    _spec_invalid: bool = False
    #: What ``_spec_snapshot`` kept when the round began (``None``: the storage forgets).
    _spec_kept: object | None = None
    #: The verify forward's replay, its per-position inputs and their span.
    _spec_record: tuple[Callable[..., object], tuple[Any, ...], int] | None = None
    #: A rollback's replay is running (its append and writes are the rollback's own).
    _spec_replaying: bool = False
    #: A proposal round is open (``spec_round_propose``: any number of appends, every
    #: column kept, all forgotten by ``spec_round_discard``).
    _spec_proposing: bool = False

    if TYPE_CHECKING:  # the layout's (declared here only for the type checker)

        @property
        def row_offsets(self) -> tuple[int, ...]: ...

        @property
        def holds_proposals(self) -> bool: ...

        def _spec_hold(self, on: bool) -> None: ...

    def _spec_forget(self, counts: Sequence[int]) -> None:
        raise NotImplementedError

    # -- snapshot + replay hooks (a storage whose geometry cannot forget) ---------------
    def _spec_snapshot(self) -> object | None:
        """What a rollback restores (``None``: the storage forgets by ``_spec_forget``)."""
        return None

    def _spec_restore(self, kept: Any) -> None:
        raise NotImplementedError

    def _spec_input_span(self, index: int, value: Any) -> int:
        """Check the per-position input ``inputs[index]`` (``[B, S, ...]``); its ``S``."""
        raise NotImplementedError

    def _spec_replay(
        self, replay: Callable[..., object], inputs: tuple[Any, ...], keep: list[int]
    ) -> None:
        """Run ``replay`` over the first ``keep[b]`` positions of row ``b`` of ``inputs``."""
        raise NotImplementedError

    # -- the protocol --------------------------------------------------------------------
    @property
    def spec_round_open(self) -> bool:
        """Whether a round has begun and is not yet committed or rolled back."""
        return self._spec_before is not None

    def spec_round_begin(self) -> None:
        """Open a round: call before the verify block is appended."""
        kept = self._spec_snapshot()
        self._spec_can_open()
        self._spec_before, self._spec_block = self.row_offsets, None
        self._spec_kept, self._spec_record = kept, None

    def _spec_can_open(self) -> None:
        """Refuse to open a round (verify or proposal) on this layout now."""
        self._spec_usable()
        if self._spec_before is not None:
            raise SpeculativeRoundError(
                "a speculative round is already open: commit or roll it back before the next"
            )
        if not self.row_offsets:
            raise LayoutStateError("an empty layout has no row to verify: merge rows first")

    def spec_round_propose(self) -> None:
        """Open a **proposal round** (a draft model's proposals on its own layouts): any
        number of appends, during which the rows keep every column they write (a ring
        drops none: ``holds_proposals``), then :meth:`spec_round_discard` forgets every
        token the round appended. A layout that cannot hold them refuses before anything
        changes (the caller proposes on a copy)."""
        self._spec_can_open()
        if not self.holds_proposals:
            raise SpeculativeRoundError(NO_PROPOSALS)
        self._spec_hold(True)
        self._spec_before, self._spec_block, self._spec_proposing = self.row_offsets, None, True

    def spec_round_discard(self) -> None:
        """End a proposal round: every row forgets every token the round appended (the
        columns it kept for this), as if the round had not been."""
        self._spec_usable()
        if not self._spec_proposing:
            raise SpeculativeRoundError(
                "spec_round_discard without spec_round_propose: no proposal round is open"
            )
        assert self._spec_before is not None
        counts = [a - b for a, b in zip(self.row_offsets, self._spec_before, strict=True)]

        def discard() -> None:
            self._spec_hold(False)  # (the forget checks what the rows hold, held or not)
            if any(counts):
                self._spec_forget(counts)

        self._spec_failing(discard)
        self._spec_before = self._spec_block = None
        self._spec_proposing = False

    @property
    def spec_round_awaits_record(self) -> bool:
        """Whether the layer's next forward is a round's verify block that should record
        its inputs (a snapshot round is open, nothing appended or recorded, no replay
        running)."""
        return (
            self._spec_kept is not None
            and self.spec_round_open
            and self._spec_block is None
            and self._spec_record is None
            and not self._spec_replaying
        )

    def spec_round_record(self, replay: Callable[..., object], *inputs: Any) -> None:
        """The verify forward's per-position inputs (each ``[B, S, ...]``) and the replay
        that runs the layer over a prefix of them."""
        self._spec_usable()
        if not self.spec_round_open:
            raise SpeculativeRoundError("spec_round_record without spec_round_begin")
        if self._spec_kept is None:
            raise SpeculativeRoundError(NOTHING_TO_RECORD)
        if self._spec_record is not None:
            raise SpeculativeRoundError("the round's verify forward already recorded its inputs")
        if not callable(replay):
            raise InvalidInputError(f"replay must be callable, got {type(replay).__name__}")
        if not inputs:
            raise InvalidInputError("spec_round_record needs the layer's per-position inputs")
        spans = [self._spec_input_span(j, x) for j, x in enumerate(inputs)]
        self._spec_record = (replay, tuple(inputs), spans[0])

    def spec_round_commit(self) -> None:
        """Every row accepted every draft: keep the whole block."""
        self._spec_block_of("spec_round_commit")
        self._spec_before = self._spec_block = None
        self._spec_kept = self._spec_record = None

    def spec_round_rollback(self, keep: int | Sequence[int]) -> None:
        """Row ``b`` keeps the first ``keep[b]`` tokens of the verify block (an int: every
        row the same); the rejected tokens are forgotten. Invalid ``keep`` changes nothing
        and leaves the round open."""
        blocks = self._spec_block_of("spec_round_rollback")
        counts = check_keep_vector(keep, blocks)
        rejected = [block - k for block, k in zip(blocks, counts, strict=True)]
        if any(rejected):
            if self._spec_kept is None:
                self._spec_failing(lambda: self._spec_forget(rejected))
            else:
                self._spec_check_record(blocks)
                self._spec_failing(lambda: self._spec_roll_back(counts))
        self._spec_before = self._spec_block = None
        self._spec_kept = self._spec_record = None

    def can_publish_row(self, row: int, tokens: int) -> bool:
        """``False`` while a round is open (the row's newest tokens are unverified)."""
        self._spec_usable()
        published: bool = super().can_publish_row(row, tokens)  # type: ignore[misc]
        return published and not self.spec_round_open

    # -- what the implementation calls ------------------------------------------------------
    def _spec_usable(self) -> None:
        if self._spec_invalid:
            raise SpeculativeStateInvalidError(SPECULATIVE_INVALID)

    def _spec_guard(self, what: str) -> None:
        """Refuse a row operation in the middle of a round (and on an invalid layout, as
        ``_spec_usable``: inline, every row operation and merge source asks)."""
        if self._spec_invalid:
            raise SpeculativeStateInvalidError(SPECULATIVE_INVALID)
        if self._spec_before is not None:
            raise SpeculativeRoundError(
                f"{what} in the middle of a speculative round: commit or roll back the round "
                "first (its verify block holds unverified drafts)"
            )

    def _spec_append(self, append: Callable[[], _R]) -> _R:
        """Run an append; inside a round it is the round's one verify block, and a failure
        invalidates the layout (a rollback's replay appends as the rollback's own)."""
        if self._spec_replaying:
            return append()
        self._spec_usable()
        if self._spec_before is None:
            return append()
        if self._spec_proposing:  # any number of appends, each kept until the discard
            return self._spec_failing(append)
        if self._spec_block is not None:
            raise SpeculativeRoundError(ONE_VERIFY_BLOCK)
        before = self.row_offsets
        result = self._spec_failing(append)
        self._spec_block = tuple(a - b for a, b in zip(self.row_offsets, before, strict=True))
        return result

    def _spec_write(self) -> None:
        """Refuse a write for an append the round cannot take (after its verify block)."""
        self._spec_usable()
        if self._spec_proposing:
            return
        if self.spec_round_open and self._spec_block is not None and not self._spec_replaying:
            raise SpeculativeRoundError(ONE_VERIFY_BLOCK)

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
        if self._spec_proposing:
            raise SpeculativeRoundError(PROPOSAL_ROUND_ENDS)
        if self._spec_block is None:
            raise SpeculativeRoundError(
                f"{what} before the round's verify block was appended: append "
                "[pending, drafts…] through update_and_fetch first"
            )
        return self._spec_block

    # -- snapshot + replay -------------------------------------------------------------------
    def _spec_check_record(self, blocks: tuple[int, ...]) -> None:
        """A snapshot rollback needs the verify forward's record, over the whole block."""
        if self._spec_record is None:
            raise SpeculativeRoundError(
                "spec_round_rollback before the verify forward recorded its inputs "
                "(spec_round_record): nothing to replay"
            )
        span = self._spec_record[2]
        if span != max(blocks):
            raise SpeculativeRoundError(
                f"the recorded inputs cover {span} positions, the verify block {max(blocks)}"
            )

    def _spec_roll_back(self, keep: list[int]) -> None:
        """Restore the snapshot and replay each row's kept tokens through the layer."""
        assert self._spec_before is not None and self._spec_record is not None
        before = self._spec_before
        replay, inputs, _ = self._spec_record
        self._spec_restore(self._spec_kept)
        self._spec_replaying = True
        try:
            self._spec_replay(replay, inputs, keep)
        finally:
            self._spec_replaying = False
        expected = [o + k for o, k in zip(before, keep, strict=True)]
        if list(self.row_offsets) != expected:
            raise LayoutStateError(
                f"the replay left rows at {list(self.row_offsets)}, expected {expected} "
                "(it must advance over the inputs it was given)"
            )


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
