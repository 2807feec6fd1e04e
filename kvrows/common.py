"""Pieces every storage and layout shares, whatever its array library.

They read only Python ints, shapes and ``nbytes``, so the NumPy reference and the MLX
implementation use the same code for bookkeeping that is not the subject of the
conformance suite (byte projections, count validation, codec parameters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvrows.errors import InvalidInputError, LayoutStateError
from kvrows.validation import KvGeometry, as_count

__all__ = ["AffineParameters", "PlaneHolder", "check_counts", "row_bytes"]


class PlaneHolder:
    """A cache whose state is its key and value planes (``None`` while it holds nothing)."""

    _keys: tuple[Any, ...] | None
    _values: tuple[Any, ...] | None

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held, capacity slack included."""
        return sum(int(p.nbytes) for p in (self._keys or ()) + (self._values or ()))

    @property
    def state(self) -> tuple[Any, ...]:
        """The arrays to evaluate at a chunk boundary (borrowed)."""
        return (self._keys or ()) + (self._values or ())

    @property
    def state_needs_dispose(self) -> bool:
        return False


class AffineParameters:
    """``group_size`` and ``bits`` of a cache over the affine codec (mlx-lm reads both)."""

    codec: Any

    @property
    def group_size(self) -> int:
        return int(self.codec.group_size)

    @property
    def bits(self) -> int:
        return int(self.codec.bits)


def row_bytes(
    codec: Any, geometry: KvGeometry | None, tokens: int, cap: float | None = None
) -> int:
    """Bytes one row needs to hold ``tokens`` positions (at most ``cap`` of them stored)."""
    count = as_count(tokens, "tokens")
    if geometry is None:
        raise LayoutStateError(
            "projected_bytes needs the KV geometry: declare it at construction "
            "(geometry=KvGeometry(...)) or append a token first"
        )
    per_token = codec.token_bytes(
        geometry.heads, geometry.key_dim, geometry.dtype
    ) + codec.token_bytes(geometry.heads, geometry.value_dim, geometry.dtype)
    stored = count if cap is None else int(min(count, cap))
    return int(per_token) * stored


def check_counts(counts: object, batch_size: int) -> list[int]:
    """One non-negative count per row (``trim_rows``)."""
    if isinstance(counts, str | bytes) or not isinstance(counts, Sequence):
        raise InvalidInputError("trim_rows takes one count per row")
    if len(counts) != batch_size:
        raise InvalidInputError(
            f"trim_rows needs {batch_size} counts (one per row), got {len(counts)}"
        )
    return [as_count(c, f"counts[{i}]") for i, c in enumerate(counts)]
