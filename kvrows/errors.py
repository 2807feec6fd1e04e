"""The kvrows error hierarchy.

Every public operation validates its input before it changes anything, and
raises one of these with a message that says what was wrong and what was
expected. A call that raises leaves every cache it touched unchanged.
"""

from __future__ import annotations

__all__ = [
    "EMPTY_LAYOUT_UPDATE",
    "NOTHING_TO_FETCH",
    "SPECULATIVE_INVALID",
    "CapacityError",
    "CorruptStateError",
    "IncompatibleRowsError",
    "InvalidInputError",
    "KvRowsError",
    "LayoutStateError",
    "MixedPrecisionReadError",
    "NoRowLayoutError",
    "NotBatchableError",
    "NotTrimmableError",
    "PoolExhaustedError",
    "RowIndexError",
    "SpeculativeRoundError",
    "SpeculativeStateInvalidError",
    "StateReadError",
    "StateWriteError",
    "UnsupportedStateError",
    "incompatible_merge_message",
    "ring_rollback_message",
    "self_merge_message",
    "trim_past_row_message",
    "wrapped_ring_message",
]


class KvRowsError(Exception):
    """Base of every error kvrows raises on purpose."""


class InvalidInputError(KvRowsError, ValueError):
    """An argument has the wrong type, rank, shape, dtype or value."""


class IncompatibleRowsError(KvRowsError):
    """Rows of different geometry, dtype, codec or family cannot share a layout."""


class RowIndexError(KvRowsError, IndexError):
    """A row index (or a keep list) names a row the layout does not hold."""


class CapacityError(KvRowsError):
    """An append or join needs more positions than the storage may hold."""


class NotTrimmableError(KvRowsError):
    """A trim asks for more than the cache can give back."""


class MixedPrecisionReadError(KvRowsError):
    """A read would mix rows held at different precisions."""


class CorruptStateError(KvRowsError):
    """Restored or adopted state violates the storage's invariants."""


class UnsupportedStateError(KvRowsError):
    """Saved state this version cannot read: an unknown class or signature, or a newer format."""


class StateWriteError(KvRowsError, OSError):
    """Saving state to a file failed (no space, no permission, an I/O error); ``errno``
    is the OS's. The target file is unchanged and no temporary file is left."""


class StateReadError(KvRowsError, OSError):
    """A saved-state file could not be opened or read (missing, no permission, an I/O
    error); ``errno`` is the OS's. A file that opens but is damaged is a
    ``CorruptStateError``."""


class LayoutStateError(KvRowsError):
    """The operation is not valid in the layout's current state."""


class SpeculativeRoundError(LayoutStateError):
    """The speculative round protocol was used out of order: a second ``spec_round_begin``,
    a commit or rollback without a round or without its verify block, a second block, or
    a row operation (merge, filter, extract, trim) in the middle of a round. Nothing
    changed."""


class SpeculativeStateInvalidError(KvRowsError):
    """An append or a rollback failed inside a speculative round: the layout's state is
    undefined and every later call refuses (discard the layout)."""


class NoRowLayoutError(KvRowsError):
    """The row-layout table has no layout of the asked role for this storage."""


class NotBatchableError(KvRowsError):
    """A row operation was asked of serial (non-batchable) state."""


# Messages both implementations raise word for word (conformance compares them).

#: ``fetch()`` before any token is stored, on a serial cache or a layout.
NOTHING_TO_FETCH = "the cache holds no tokens yet: nothing to fetch"

#: ``update_and_fetch`` on a layout that holds no rows.
EMPTY_LAYOUT_UPDATE = "an empty layout takes no update: merge rows into it first"


#: Every call on a layout whose speculative round failed half-way.
SPECULATIVE_INVALID = "speculative state is invalid and must be discarded"


def self_merge_message(layout: str) -> str:
    """``merge_rows`` given the layout itself, or a cache it already holds."""
    return (
        f"{layout} cannot merge itself or a source given twice: "
        "merge_rows takes caches the layout does not already hold"
    )


def incompatible_merge_message(
    layout: str, source: object, codec_key: str, token_geometry: object
) -> str:
    """``merge_rows`` given a source whose rows cannot join the layout."""
    signature = getattr(source, "signature", None)
    described = signature() if callable(signature) else type(source).__name__
    source_geometry = getattr(source, "token_geometry", None)
    if source_geometry is not None:
        described = f"{described} ({source_geometry})"
    return (
        f"{layout} cannot merge {described}: rows join a layout of the same codec "
        f"({codec_key}) and token geometry ({token_geometry})"
    )


def wrapped_ring_message(what: str, window: int) -> str:
    """A trim or rollback of ring tokens that the window has already overwritten."""
    return (
        f"{what} has wrapped past its window of {window}: "
        "the overwritten tokens are gone and cannot be trimmed"
    )


def trim_past_row_message(count: int, row: int, holds: int) -> str:
    """A trim or rollback of more tokens than a row holds."""
    return f"cannot trim {count} tokens from row {row}, which holds {holds}"


def ring_rollback_message(row: int, offset: int, retained: int, count: int, window: int) -> str:
    """A per-row trim of a ragged ring that would leave the row short of its window."""
    return (
        f"cannot trim {count} tokens from row {row} at offset {offset}: it retains its "
        f"newest {retained}, and its window of {window} before them is already overwritten "
        "(a ring rolls back only tokens of its latest block)"
    )


class PoolExhaustedError(CapacityError):
    """A block pool cannot take the blocks an append asks for without growing past its
    byte limit (``kvrows.paged``); nothing changed."""
