"""Per-row stages of the row machinery (contract §0.5), against one-stage storages.

A layout of two stages (plain, then affine) holds rows in either; each row must hold what
a serial storage of its stage's codec fed the same tokens holds (a conversion re-encodes
per token, so a converted row is what the affine storage fed its tokens holds). The oracle
is the public one-stage classes; the operations are drawn (append, convert, filter, merge,
trim, extract), and every refusal must leave the layout as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from array_helpers import to_mx
from hypothesis import given
from hypothesis import strategies as st

import kvrows.reference as ref
from kvrows.codecs.latent import Latent
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.conversion import MIXED_READ
from kvrows.errors import (
    LayoutStateError,
    MixedPrecisionReadError,
    RowIndexError,
    last_stage_message,
)
from kvrows.schemes import Affine, Plain

TARGET = Affine(bits=4, group_size=32)
HEADS, DIM = 2, 32


@dataclass
class Request:
    """What the oracle knows of a row: its tokens (``[1, H, n, D]`` keys and values, in
    order) and its stage."""

    keys: list[np.ndarray] = field(default_factory=list)
    values: list[np.ndarray] = field(default_factory=list)
    stage: int = 0

    @property
    def offset(self) -> int:
        return sum(int(k.shape[2]) for k in self.keys)

    def trimmed(self, count: int) -> None:
        if not count:
            return
        kept = self.offset - count
        keys = np.concatenate(self.keys, axis=2)[:, :, :kept]
        values = np.concatenate(self.values, axis=2)[:, :, :kept]
        self.keys, self.values = ([keys], [values]) if kept else ([], [])


def _tokens(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    return rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float16)


class Twin:
    """One implementation's view: its classes and its array conversions."""

    def __init__(self, impl: ModuleType, to_impl: Callable[[np.ndarray], Any]) -> None:
        self.impl, self.to_impl = impl, to_impl

    def serial(self, request: Request, stage: int | None = None) -> Any:
        """A serial storage of the request's stage codec (or ``stage``'s) fed its tokens."""
        stage = request.stage if stage is None else stage
        cache = self.impl.KVCache() if stage == 0 else self.impl.QuantizedKVCache(32, 4)
        for k, v in zip(request.keys, request.values, strict=True):
            cache.update_and_fetch(self.to_impl(k), self.to_impl(v))
        return cache


def _arrays(read: Any) -> list[np.ndarray]:
    return [np.asarray(p) for p in (read if isinstance(read, tuple) else (read,))]


def _row_columns(read: Any, row: int, pad: int, offset: int) -> list[np.ndarray]:
    """Row ``row``'s columns ``[pad, pad + offset)`` of a fetched read (every plane)."""
    return [p[row, :, pad : pad + offset] for p in _arrays(read)]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _look(layout: Any) -> tuple[Any, ...]:
    """What a refusal must leave unchanged."""
    parts = [
        (rows, codec.spec, [_arrays(r) for r in reads.values()])
        for rows, codec, reads in layout._stage_parts()
    ]
    return layout.row_stages, layout.row_offsets, layout.left_pad, layout.nbytes, parts


def _unchanged(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    *meta_a, parts_a = before
    *meta_b, parts_b = after
    return meta_a == meta_b and all(
        ra == rb and ca == cb and all(_same(x, y) for x, y in zip(pa, pb, strict=True))
        for (ra, ca, pa), (rb, cb, pb) in zip(parts_a, parts_b, strict=True)
    )


def _check(twin: Twin, layout: Any, shadow: Any, requests: list[Request]) -> None:
    """The layout holds what the oracle says, row by row, at the columns of ``shadow`` (a
    one-stage plain layout given the same operations: stages move no padding)."""
    layout.check_valid()
    assert layout.row_stages == tuple(r.stage for r in requests)
    assert layout.row_offsets == tuple(r.offset for r in requests) == shadow.row_offsets
    assert layout.left_pad == shadow.left_pad
    if not requests:
        return
    stages = {r.stage for r in requests}
    assert layout.codec_spec == (Plain(), TARGET)[max(stages)]
    parts = layout._stage_parts()
    assert [rows for rows, _, _ in parts] == [
        [b for b, r in enumerate(requests) if r.stage == s] for s in sorted(stages)
    ]
    for rows, codec, reads in parts:
        for i, b in enumerate(rows):
            if not requests[b].offset:
                continue  # a row trimmed to nothing: no column to compare
            expected = twin.serial(requests[b]).fetch()
            for tensor, want in zip(("keys", "values"), expected, strict=True):
                got = _row_columns(reads[tensor], i, layout.left_pad[b], requests[b].offset)
                assert _same(got, [p[0] for p in _arrays(want)]), (b, tensor, codec.spec)
    if len(stages) > 1:
        with pytest.raises(MixedPrecisionReadError, match="mixed precision"):
            layout.fetch()
    else:
        ((rows, _, reads),) = parts
        keys, values = layout.fetch()
        assert _same(_arrays(keys), _arrays(reads["keys"]))
        assert _same(_arrays(values), _arrays(reads["values"]))


OPERATIONS = ("append", "convert", "filter", "merge", "trim", "extract", "refused")


@profile_settings(max_examples=active_profile().max_examples // 6)  # ci 25, deep 100
@given(st.data())
def test_rows_of_two_stages_hold_what_each_stage_storage_holds(data: st.DataObject) -> None:
    twin = Twin(ref, lambda a: a)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    layout = ref.BatchedKVCache()
    layout._use_stages((Plain(), TARGET))
    shadow = ref.BatchedKVCache()
    requests: list[Request] = []

    def join(count: int) -> None:
        sources, joined = [], []
        for _ in range(count):
            request = Request(stage=data.draw(st.integers(0, 1), label="stage"))
            tokens = _tokens(rng, 1, data.draw(st.integers(1, 6), label="tokens"))
            request.keys, request.values = [tokens], [tokens * 0.5]
            sources.append(twin.serial(request))
            joined.append(request)
        layout.merge_rows(sources)
        shadow.merge_rows([twin.serial(request, 0) for request in joined])
        requests.extend(joined)

    join(data.draw(st.integers(2, 4), label="rows"))
    _check(twin, layout, shadow, requests)
    for _ in range(data.draw(st.integers(3, 10), label="steps")):
        operation = data.draw(st.sampled_from(OPERATIONS), label="operation")
        if not requests and operation != "merge":
            operation = "merge"
        if operation == "append":
            n = data.draw(st.integers(1, 3), label="n")
            keys, values = _tokens(rng, len(requests), n), _tokens(rng, len(requests), n)
            shadow.update_and_fetch(twin.to_impl(keys), twin.to_impl(values))
            if len({r.stage for r in requests}) == 1:
                layout.update_and_fetch(twin.to_impl(keys), twin.to_impl(values))
            else:  # refused before the write; the write alone is ``_update``
                before = _look(layout)
                with pytest.raises(MixedPrecisionReadError):
                    layout.update_and_fetch(twin.to_impl(keys), twin.to_impl(values))
                assert _unchanged(before, _look(layout))
                layout._update(twin.to_impl(keys), twin.to_impl(values))
            for b, request in enumerate(requests):
                request.keys.append(keys[b : b + 1])
                request.values.append(values[b : b + 1])
        elif operation == "convert":
            plain = [b for b, r in enumerate(requests) if r.stage == 0]
            rows = (
                data.draw(st.lists(st.sampled_from(plain), max_size=3), label="rows")
                if plain
                else []
            )
            layout._convert_rows(rows)
            for b in set(rows):
                requests[b].stage = 1
        elif operation == "filter":
            keep = data.draw(st.permutations(range(len(requests))), label="order")
            keep = keep[: data.draw(st.integers(0, len(keep)), label="kept")]
            layout.filter_rows(keep)
            shadow.filter_rows(keep)
            requests = [requests[b] for b in keep]
        elif operation == "merge":
            join(data.draw(st.integers(1, 2), label="joining"))
        elif operation == "trim":
            counts = [data.draw(st.integers(0, r.offset), label="count") for r in requests]
            layout.trim_rows(counts)
            shadow.trim_rows(counts)
            for request, count in zip(requests, counts, strict=True):
                request.trimmed(count)
        elif operation == "extract":
            b = data.draw(st.integers(0, len(requests) - 1), label="row")
            serial = layout.extract_row(b)
            assert serial.codec_spec == (Plain(), TARGET)[requests[b].stage]
            expected = twin.serial(requests[b])
            assert serial.offset == expected.offset
            pairs = zip(serial.fetch(), expected.fetch(), strict=True) if expected.offset else ()
            for got, want in pairs:
                assert _same(_arrays(got), _arrays(want))
        else:  # refusals change nothing
            before = _look(layout)
            converted = [b for b, r in enumerate(requests) if r.stage == 1]
            if converted:
                b = data.draw(st.sampled_from(converted), label="converted")
                with pytest.raises(LayoutStateError, match="the last"):
                    layout._convert_rows([b])
            with pytest.raises(RowIndexError):
                layout._convert_rows([len(requests)])
            assert _unchanged(before, _look(layout))
        _check(twin, layout, shadow, requests)


def test_a_mixed_read_is_refused_with_the_seed_words_and_a_serial_storage_moves_whole() -> None:
    """The messages: a mixed read is ``MIXED_READ``; converting a row in the last stage
    names it; a serial storage refuses to convert some of its rows."""
    rng = np.random.default_rng(3)
    layout = ref.BatchedKVCache()
    layout._use_stages((Plain(), TARGET))
    sources = []
    for n in (2, 4):
        cache = ref.KVCache()
        block = _tokens(rng, 1, n)
        cache.update_and_fetch(block, block)
        sources.append(cache)
    layout.merge_rows(sources)
    layout._convert_rows([1])
    with pytest.raises(MixedPrecisionReadError) as refused:
        layout.fetch()
    assert str(refused.value) == MIXED_READ
    with pytest.raises(LayoutStateError) as last:
        layout._convert_rows([0, 1])
    assert str(last.value) == last_stage_message(1, 1)
    assert layout.row_stages == (0, 1)
    serial = ref.KVCache()
    serial._use_stages((Plain(), TARGET))
    block = _tokens(rng, 2, 3)
    serial.update_and_fetch(block, block)
    with pytest.raises(LayoutStateError, match="convert together"):
        serial._convert_rows([0])
    serial._convert_rows([0, 1])
    assert serial.codec_spec == TARGET


@pytest.mark.parametrize("optimized", [False, True], ids=("reference", "optimized"))
def test_latent_rows_of_two_stages_read_one_dense_image(optimized: bool) -> None:
    """Stages whose codecs all read dense arrays (a plain and an encoded latent) read as one
    image (contract §0.5): each row's latent is what a cache of its stage's codec fed its
    tokens reads, at its columns; the rope plane is exact in every row; an append to rows
    of both stages reads the same way."""
    import kvrows.optimized as kv

    impl: Any = kv if optimized else ref
    native: Callable[[np.ndarray], Any] = to_mx if optimized else (lambda a: a)
    plain_spec = Latent(inner=Plain())
    target = Latent(inner=Affine(bits=8, group_size=32))
    rng = np.random.default_rng(5)
    lengths = (3, 6, 4)
    tokens = [
        (rng.standard_normal((1, 1, n, 64)), rng.standard_normal((1, 1, n, 16))) for n in lengths
    ]
    tokens = [(a.astype(np.float16), b.astype(np.float16)) for a, b in tokens]

    def solo(spec: Latent, b: int, steps: list[tuple[np.ndarray, np.ndarray]]) -> Any:
        cache = impl.MLACache(codec=spec)
        for latent, rope in [tokens[b], *steps]:
            cache.append(native(latent), native(rope))
        return cache

    layout = impl.MLACache()
    layout._use_stages((plain_spec, target))
    layout.merge_rows([solo(plain_spec, b, []) for b in range(len(lengths))])
    layout._convert_rows([0, 2])  # not a suffix: the stages' parts come out of batch order
    assert layout.row_stages == (1, 0, 1)
    steps: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in lengths]
    for step in range(2):
        latent, rope = layout.fetch()
        width = int(latent.shape[2])
        for b, stage in enumerate(layout.row_stages):
            want_latent, want_rope = solo((plain_spec, target)[stage], b, steps[b]).fetch()
            held = layout.row_offsets[b]
            got = [np.asarray(p)[b : b + 1, :, width - held :] for p in (latent, rope)]
            assert np.array_equal(got[0], np.asarray(want_latent)), (step, b)
            assert np.array_equal(got[1], np.asarray(want_rope)), (step, b)
        block = (
            rng.standard_normal((3, 1, 1, 64)).astype(np.float16),
            rng.standard_normal((3, 1, 1, 16)).astype(np.float16),
        )
        layout.append(native(block[0]), native(block[1]))
        for b in range(len(lengths)):
            steps[b].append((block[0][b : b + 1], block[1][b : b + 1]))
    layout.check_valid()
