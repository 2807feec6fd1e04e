"""What the two-stage drivers share (contract §0.4, §0.5: rows of a plain and an affine
stage in one layout): the rows' record, the operations given to the layout, its one-stage
plain shadow and a twin of the other implementation, the checks every driver makes, and a
drawn sequence of operations."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import strategies as st

from kvrows.conversion import MIXED_READ
from kvrows.errors import (
    IncompatibleRowsError,
    LayoutStateError,
    MixedPrecisionReadError,
    NotTrimmableError,
    RowIndexError,
    last_stage_message,
)


@dataclass
class Request:
    """What the oracle knows of a row: its tokens (``[1, H, n, D]`` chunks, in order) and
    its stage."""

    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    stage: int = 0

    @property
    def offset(self) -> int:
        return sum(int(k.shape[2]) for k in self.keys)

    def trimmed(self, count: int) -> None:
        kept = self.offset - count
        if count:
            keys = np.concatenate(self.keys, axis=2)[:, :, :kept]
            values = np.concatenate(self.values, axis=2)[:, :, :kept]
            self.keys, self.values = ([keys], [values]) if kept else ([], [])


def planes_of(read: Any) -> list[np.ndarray]:
    """A read's planes (one array, or an affine triple) as NumPy copies."""
    return [np.array(p) for p in (read if isinstance(read, tuple) else (read,))]


def same_planes(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


class TwoStages:
    """A two-stage layout, its one-stage plain shadow (a stage moves no column: the
    shadow's offsets and columns are the layout's), an optional ``twin`` (the reference
    layout, given NumPy arrays) and the rows' record; each operation is given to all of
    them, and the whole checked after each that changes the rows (``check``). A driver
    supplies its serial storages, its oracle (the one-stage public layout of a stage's
    codec holding some rows), its ``meta`` and its ``check``."""

    shared = False
    layout: Any
    shadow: Any
    twin: Any = None
    requests: list[Request]
    rng: np.random.Generator

    @staticmethod
    def native(array: np.ndarray) -> Any:
        """A token block as the layout's implementation takes it."""
        return array

    def tokens(self, rows: int, n: int) -> np.ndarray:
        return self.rng.standard_normal((rows, 2, n, 64)).astype(np.float16)

    def serial(self, request: Request, stage: int | None = None, twin: bool = False) -> Any:
        """A serial storage of the row's stage codec (or ``stage``'s) fed its chunks (the
        twin's implementation where ``twin``)."""
        raise NotImplementedError

    def oracle(self, stage: int, rows: list[int]) -> Any:
        raise NotImplementedError

    def meta(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def check(self) -> None:
        raise NotImplementedError

    def look(self) -> tuple[Any, ...]:
        """What a refusal must leave as it was (every part's reads, bit for bit)."""
        layout = self.layout
        parts = [
            (rows, codec.spec, [planes_of(r) for r in reads.values()])
            for rows, codec, reads in (layout._stage_parts() if self.requests else [])
        ]
        return self.meta(), layout.codec_spec, parts

    def unchanged(self, before: tuple[Any, ...]) -> None:
        (meta, spec, parts), (meta_now, spec_now, parts_now) = before, self.look()
        assert meta == meta_now and spec == spec_now and len(parts) == len(parts_now)
        for (rows, codec, reads), (rows_now, codec_now, reads_now) in zip(
            parts, parts_now, strict=True
        ):
            assert rows == rows_now and codec == codec_now
            assert all(same_planes(a, b) for a, b in zip(reads, reads_now, strict=True))

    def check_rows(self, specs: tuple[Any, Any]) -> tuple[Any, list[int]] | None:
        """The checks of a growing driver before its own: valid, the rows' stages, offsets
        and pads (the shadow's), the codec of the last stage held (``specs``: each stage's)
        and the stages' rows; the stage parts and the stages held (``None``: no row)."""
        layout, requests = self.layout, self.requests
        layout.check_valid()
        assert layout.row_stages == tuple(r.stage for r in requests)
        assert layout.row_offsets == tuple(r.offset for r in requests) == self.shadow.row_offsets
        assert layout.left_pad == self.shadow.left_pad
        if not requests:
            assert layout.nbytes == 0
            return None
        stages = sorted({r.stage for r in requests})
        assert layout.codec_spec == specs[stages[-1]]
        parts = layout._stage_parts()
        assert [rows for rows, _, _ in parts] == [
            [b for b, r in enumerate(requests) if r.stage == s] for s in stages
        ]
        return parts, stages

    def check_reads(self, parts: Any, stages: Any) -> None:
        """Rows of two stages: a read is refused, changing nothing; of one: it reads the
        stage's part."""
        if len(stages) > 1:
            before = self.look()
            with pytest.raises(MixedPrecisionReadError) as refused:
                self.layout.fetch()
            assert str(refused.value) == MIXED_READ
            self.unchanged(before)
        else:
            ((_, _, reads),) = parts
            for got, want in zip(self.layout.fetch(), reads.values(), strict=True):
                assert same_planes(planes_of(got), planes_of(want))

    # -- the operations -------------------------------------------------------------------
    def join(self, rows: list[tuple[int, int]]) -> None:
        """Merge rows of ``(stage, tokens)`` (serial storages of each stage's codec)."""
        joined = []
        for stage, n in rows:
            tokens = self.tokens(1, n)
            joined.append(Request([tokens], [tokens * 0.5], stage))
        self.layout.merge_rows([self.serial(r) for r in joined])
        if self.twin is not None:
            self.twin.merge_rows([self.serial(r, twin=True) for r in joined])
        self.shadow.merge_rows([self.serial(r, 0) for r in joined])
        self.requests.extend(joined)
        self.check()

    def append(self, n: int) -> None:
        keys, values = self.tokens(len(self.requests), n), self.tokens(len(self.requests), n)
        native = self.native
        self.shadow.update_and_fetch(native(keys), native(values))
        if len({r.stage for r in self.requests}) == 1:
            self.layout.update_and_fetch(native(keys), native(values))
            if self.twin is not None:
                self.twin.update_and_fetch(keys, values)
        else:  # refused before the write (nothing changes); the write alone is ``_update``
            before = self.look()
            with pytest.raises(MixedPrecisionReadError):
                self.layout.update_and_fetch(native(keys), native(values))
            self.unchanged(before)
            self.layout._update(native(keys), native(values))
            if self.twin is not None:
                self.twin._update(keys, values)
        for b, request in enumerate(self.requests):
            request.keys.append(keys[b : b + 1])
            request.values.append(values[b : b + 1])
        self.check()

    def convert(self, rows: list[int]) -> None:
        self.layout._convert_rows(rows)
        if self.twin is not None:
            self.twin._convert_rows(rows)
        for b in set(rows):
            self.requests[b].stage = 1
        self.check()

    def filter(self, keep: list[int]) -> None:
        for layout in (self.layout, self.twin, self.shadow):
            if layout is not None:
                layout.filter_rows(keep)
        self.requests = [self.requests[b] for b in keep]
        self.check()

    def trim(self, counts: list[int]) -> None:
        for layout in (self.layout, self.twin, self.shadow):
            if layout is not None:
                layout.trim_rows(counts)
        for request, count in zip(self.requests, counts, strict=True):
            request.trimmed(count)
        self.check()

    def extract(self, b: int) -> Any:
        request = self.requests[b]
        serial = self.layout.extract_row(b)
        rows = [i for i, r in enumerate(self.requests) if r.stage == request.stage]
        oracle = self.oracle(request.stage, rows).extract_row(rows.index(b))
        assert type(serial) is type(oracle) and serial.codec_spec == oracle.codec_spec
        assert serial.offset == oracle.offset == request.offset
        serial.check_valid()
        if request.offset:
            for got, want in zip(serial.fetch(), oracle.fetch(), strict=True):
                assert same_planes(planes_of(got), planes_of(want))
        if self.twin is not None:
            assert self.twin.extract_row(b).codec_spec == serial.codec_spec
        return serial

    def refusals(self) -> None:
        """Refused calls change nothing: a row in the last stage, a row out of range (with
        rows that could move), and on a shared column a trim of unequal counts."""
        before = self.look()
        converted = [b for b, r in enumerate(self.requests) if r.stage == 1]
        plain = [b for b, r in enumerate(self.requests) if r.stage == 0]
        for b in converted[:1]:
            with pytest.raises(LayoutStateError) as last:
                self.layout._convert_rows([*plain, b])
            assert str(last.value) == last_stage_message(b, 1)
        with pytest.raises(RowIndexError):
            self.layout._convert_rows([*plain, len(self.requests)])
        if self.shared and len(self.requests) > 1 and self.requests[0].offset:
            with pytest.raises(NotTrimmableError):
                self.layout.trim_rows([1] + [0] * (len(self.requests) - 1))
        with pytest.raises(IncompatibleRowsError):
            self.layout.merge_rows([self.layout])
        self.unchanged(before)


def drawn_steps(
    staged: TwoStages,
    data: st.DataObject,
    longest: int,
    trim: Callable[[list[Request]], list[int]],
    rows_first: tuple[int, int] = (1, 4),
    steps: tuple[int, int] = (2, 8),
) -> None:
    """Draws rows (stage, length up to ``longest``; ``rows_first`` of them first) to join,
    then ``steps`` operations, each checked; ``trim`` draws the trim counts."""

    def rows(count: int) -> list[tuple[int, int]]:
        return [
            (data.draw(st.integers(0, 1), label="stage"), data.draw(st.integers(1, longest)))
            for _ in range(count)
        ]

    staged.join(rows(data.draw(st.integers(*rows_first), label="rows")))
    for _ in range(data.draw(st.integers(*steps), label="steps")):
        requests = staged.requests
        operation = data.draw(
            st.sampled_from(("append", "convert", "filter", "merge", "trim", "extract", "refuse"))
        )
        if not requests:
            operation = "merge"
        if operation == "append":
            staged.append(data.draw(st.integers(1, 3), label="n"))
        elif operation == "convert":
            plain = [b for b, r in enumerate(requests) if r.stage == 0]
            staged.convert(data.draw(st.lists(st.sampled_from(plain), max_size=3)) if plain else [])
        elif operation == "filter":
            keep = data.draw(st.permutations(range(len(requests))), label="order")
            staged.filter(keep[: data.draw(st.integers(0, len(keep)), label="kept")])
        elif operation == "merge":
            staged.join(rows(data.draw(st.integers(1, 2), label="joining")))
        elif operation == "trim":
            staged.trim(trim(requests))
        elif operation == "extract":
            staged.extract(data.draw(st.integers(0, len(requests) - 1), label="row"))
            staged.check()
        else:
            staged.refusals()
            staged.check()
