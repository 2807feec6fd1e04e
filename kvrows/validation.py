"""Argument validation shared by both implementations.

Checks read only shapes, dtype names and Python ints, so the NumPy reference
and the MLX implementation raise the same error, with the same message, for
the same bad input. Every check runs before a cache changes anything.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from kvrows.errors import IncompatibleRowsError, InvalidInputError, RowIndexError

__all__ = [
    "FLOAT_DTYPES",
    "STEP",
    "KvGeometry",
    "as_count",
    "check_block",
    "check_keep",
    "check_left_pad",
    "check_row",
    "check_window",
    "common_geometry",
    "round_up",
]

#: Capacity grows in steps of this many token columns (mlx-lm's ``step``).
STEP = 256

#: Activation dtypes a plain cache stores.
FLOAT_DTYPES = ("float16", "bfloat16", "float32")


def round_up(value: int, step: int = STEP) -> int:
    """The smallest multiple of ``step`` that is ``>= value``."""
    return -(-value // step) * step


@dataclass(frozen=True)
class KvGeometry:
    """What every row of one layer's cache shares: KV heads, head dims, dtype."""

    heads: int
    key_dim: int
    value_dim: int
    dtype: str

    def describe(self) -> str:
        return f"H={self.heads}, D={self.key_dim}, Dv={self.value_dim}, dtype={self.dtype}"

    @property
    def tensors(self) -> tuple[str, ...]:
        """The tensors a read returns: keys and values."""
        return ("keys", "values")

    def tensor_image(self, tensor: str) -> tuple[int, int, str]:
        """``(heads, width, dtype)`` of ``tensor`` in the image a read returns."""
        return self.heads, self.key_dim if tensor == "keys" else self.value_dim, self.dtype


def as_count(value: object, name: str, *, minimum: int = 0) -> int:
    """``value`` as a Python int ``>= minimum`` (bools and floats are refused)."""
    if type(value) is int and value >= minimum:  # the common case, first (a hot path)
        return value
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be an integer, got bool {value!r}")
    if not hasattr(value, "__index__"):
        raise InvalidInputError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidInputError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}"
        ) from None
    if number < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}, got {number}")
    return int(number)


def check_block(
    key_shape: Sequence[int],
    value_shape: Sequence[int],
    key_dtype: str,
    value_dtype: str,
    *,
    rows: int | None,
    geometry: KvGeometry | None,
) -> KvGeometry:
    """Validate one ``update_and_fetch`` block and return its geometry.

    ``rows`` is the batch size the block must have (``None``: any); ``geometry``
    is what the cache already holds (``None``: the first append sets it).
    """
    if len(key_shape) != 4 or len(value_shape) != 4:
        raise InvalidInputError(
            f"keys and values must be [B, H, N, D]; got keys {tuple(key_shape)} "
            f"and values {tuple(value_shape)}"
        )
    b, h, n, d = (int(x) for x in key_shape)
    vb, vh, vn, dv = (int(x) for x in value_shape)
    if (b, h, n) != (vb, vh, vn):
        raise InvalidInputError(
            f"keys {tuple(key_shape)} and values {tuple(value_shape)} must agree on B, H and N"
        )
    if n < 1:
        raise InvalidInputError(f"an update must append at least one token, got N={n}")
    if b < 1 or h < 1 or d < 1 or dv < 0:
        raise InvalidInputError(
            f"B, H and D must be positive and Dv at least 0 (values of width 0: a keys-only "
            f"cache), got B={b}, H={h}, D={d}, Dv={dv} "
            f"(keys {tuple(key_shape)}, values {tuple(value_shape)})"
        )
    if key_dtype != value_dtype:
        raise InvalidInputError(f"keys are {key_dtype} but values are {value_dtype}")
    if key_dtype not in FLOAT_DTYPES:
        raise InvalidInputError(f"keys and values must be one of {FLOAT_DTYPES}, got {key_dtype}")
    if rows is not None and b != rows:
        raise InvalidInputError(f"the block has B={b} rows but the cache holds {rows}")
    block = kv_geometry(h, d, dv, key_dtype)
    if geometry is not None and block is not geometry:
        if block != geometry:
            raise InvalidInputError(
                f"the block has {block.describe()} but the cache holds {geometry.describe()}"
            )
        return geometry  # (the object the cache holds: merges compare by identity first)
    return block


_KV_GEOMETRIES: dict[tuple[int, int, int, str], KvGeometry] = {}


def kv_geometry(heads: int, key_dim: int, value_dim: int, dtype: str) -> KvGeometry:
    """The one ``KvGeometry`` object of these fields that writes learn (caches that learnt
    one geometry apart then share it: a merge of their rows compares by identity)."""
    fields = heads, key_dim, value_dim, dtype
    known = _KV_GEOMETRIES.get(fields)
    if known is None:
        known = _KV_GEOMETRIES[fields] = KvGeometry(*fields)
    return known


def common_geometry(geometries: Sequence[KvGeometry | None]) -> KvGeometry | None:
    """The one geometry all known entries share (``None`` if none is known)."""
    first: KvGeometry | None = None
    for g in geometries:  # rows of one pool share one geometry object: no hashing
        if g is None or g is first:
            continue
        if first is None:
            first = g
        elif g != first:
            break
    else:
        return first
    known = {g for g in geometries if g is not None}
    if len(known) > 1:
        described = "; ".join(sorted(g.describe() for g in known))
        raise IncompatibleRowsError(
            f"rows of different geometry cannot share a layout: {described}"
        )
    return next(iter(known), None)


def check_window(window_size: object) -> int | None:
    """A sliding-window width for a mask (``None``: no window)."""
    if window_size is None:
        return None
    return as_count(window_size, "window_size", minimum=1)


def check_row(row: object, batch_size: int) -> int:
    """A valid row index into a layout of ``batch_size`` rows (negative indices refused)."""
    index = as_count(row, "row", minimum=0)
    if index >= batch_size:
        raise RowIndexError(f"row {index} out of range for a layout of {batch_size} rows")
    return index


def check_keep(keep: object, batch_size: int) -> list[int]:
    """A list of distinct valid row indices (any order)."""
    if type(keep) not in (list, tuple) and (  # (a protocol check costs microseconds)
        isinstance(keep, str | bytes) or not isinstance(keep, Sequence)
    ):
        raise InvalidInputError(f"keep must be a sequence of row indices, got {keep!r}")
    rows = [check_row(r, batch_size) for r in cast(Sequence[object], keep)]
    if len(set(rows)) != len(rows):
        raise RowIndexError(f"keep names a row twice: {rows}")
    return rows


def check_left_pad(left_pad: object, batch_size: int) -> list[int]:
    """One left pad per row for ``align_rows``: non-negative integers, and some row at
    column 0 when there are rows (a layout keeps no column every row leaves empty)."""
    if isinstance(left_pad, str | bytes) or not isinstance(left_pad, Sequence):
        raise InvalidInputError(
            f"align_rows takes one left pad per row (a sequence of integers), got {left_pad!r}"
        )
    if len(left_pad) != batch_size:
        raise InvalidInputError(
            f"align_rows needs {batch_size} left pads (one per row), got {len(left_pad)}"
        )
    pads = [as_count(p, f"left_pad[{b}]") for b, p in enumerate(left_pad)]
    if pads and min(pads) != 0:
        raise InvalidInputError(
            f"some row must start at column 0: min(left_pad) must be 0, got {min(pads)}"
        )
    return pads
