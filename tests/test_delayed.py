"""DelayedQuantizedKVCache in both implementations (``spec/DelayedQuantizedKVCache.md``).

Oracles: the other implementation, and per row a solo serial storage or lego driven with
the same committed tokens (plain storage converted by the lego's conversion after the
append or round that first leaves it holding ``start`` tokens): extracted bytes equal
exactly, attention within the conformance tolerances.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from types import ModuleType
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given
from lego_helpers import to_affine

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.conformance.arrays import NUMPY_DTYPES, as_numpy, to_mlx
from kvrows.conformance.profiles import profile_settings
from kvrows.conformance.tolerances import compare, tolerance
from kvrows.delayed import RowAttentionPending, row_reads
from kvrows.errors import KvRowsError, MixedPrecisionReadError, RowIndexError
from kvrows.schemes import Affine, Plain, Ring
from kvrows.table import publish_row

IMPLS: dict[str, ModuleType] = {"ref": ref, "opt": opt}
HEADS, DIM, GROUP = 2, 64, 32
WINDOW = 8


def _to(impl: ModuleType, array: np.ndarray) -> Any:
    return to_mlx(array) if impl is opt else array


def _block(rng: np.random.Generator, rows: int, n: int, dtype: str) -> np.ndarray:
    shape = (rows, HEADS, n, DIM)
    return rng.standard_normal(shape, dtype=np.float32).astype(NUMPY_DTYPES[dtype])


def _flat(node: Any) -> list[np.ndarray]:
    if isinstance(node, tuple | list):
        return [a for item in node for a in _flat(item)]
    if isinstance(node, int):
        return [np.asarray(node, dtype=np.int64)]
    if node is None:  # an empty storage's planes
        return [np.zeros(0, dtype=np.int8)]
    return [as_numpy(node)]


def _bytes(cache: Any) -> list[Any]:
    """A storage's (or a lego's storage's) codec and every plane, as comparable bytes (an
    empty storage: its codec only; how it holds nothing is its own business)."""
    storage = getattr(cache, "storage", cache)
    head = [storage.codec_spec.name]
    if int(storage.offset) == 0:
        return head
    return head + [(str(a.dtype), a.shape, a.tobytes()) for a in _flat(storage.state)]


def _append(impl: ModuleType, cache: Any, keys: np.ndarray, values: np.ndarray) -> Any:
    return cache.update_and_fetch(_to(impl, keys), _to(impl, values))


def _convert(impl: ModuleType, storage: Any, bits: int) -> Any:
    """The lego's conversion of a plain serial storage."""
    if impl is opt:
        return storage.to_quantized(group_size=GROUP, bits=bits)
    return to_affine(storage, Affine(bits=bits, group_size=GROUP), ref.QuantizedKVCache)


def _mixed_append(layout: Any, keys: Any, values: Any, queries: Any) -> Any:
    """One append inside ``row_reads``; a pending pair is attended at once."""
    with row_reads():
        k, _ = layout.update_and_fetch(keys, values)
        if isinstance(k, RowAttentionPending):
            return layout.attend_rows(queries, 0.125, pending=k)
    return None


# -- 1. the §4.15 vector ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_section_4_15_vector(dtype: str, bits: int) -> None:
    rng = np.random.default_rng(bits)
    first, second = _block(rng, 1, 2, dtype), _block(rng, 1, 6, dtype)
    rounds = [(_block(rng, 2, 2, dtype), [1, 2]), (_block(rng, 2, 3, dtype), [3, 1])]
    extracted: dict[str, list[Any]] = {}
    for name, impl in IMPLS.items():
        legos = [impl.Bf16FirstQuantizedKVCache(GROUP, bits, 5) for _ in range(2)]
        _append(impl, legos[0], first, first)
        _append(impl, legos[1], second, second)
        assert [lego.converted for lego in legos] == [False, True]
        layout = impl.DelayedQuantizedKVCache(GROUP, bits, 5)
        layout.merge_rows(legos)
        assert (layout.row_offsets, layout.left_pad) == ((2, 6), (4, 0))
        assert layout.converted_at == (None, 6) and layout.phase == "mixed"
        # Solo controls: the same committed tokens, converted after the round reaching 5.
        solo: list[Any] = [impl.KVCache(), impl.KVCache()]
        _append(impl, solo[0], first, first)
        _append(impl, solo[1], second, second)
        solo[1] = _convert(impl, solo[1], bits)
        for block, keep in rounds:
            layout.spec_round_begin()
            _mixed_append(layout, _to(impl, block), _to(impl, block), _to(impl, block))
            layout.spec_round_rollback(keep)
            for b in range(2):
                part = np.ascontiguousarray(block[b : b + 1, :, : keep[b]])
                _append(impl, solo[b], part, part)
                if solo[b].codec_spec.kind == "plain" and int(solo[b].offset) >= 5:
                    solo[b] = _convert(impl, solo[b], bits)
            layout.check_valid()
        assert (layout.row_offsets, layout.left_pad) == ((6, 9), (4, 0))
        assert layout.minimum_reusable_offset == 6 and layout.phase == "packed"
        assert layout.converted_at == (6, 6)
        layout.filter_rows([1, 0])
        assert (layout.row_offsets, layout.left_pad) == ((9, 6), (0, 4))
        layout.check_valid()
        rows = [layout.extract_row(b) for b in range(2)]
        assert [r.minimum_reusable_offset for r in rows] == [6, 6]
        assert _bytes(rows[0]) == _bytes(solo[1]) and _bytes(rows[1]) == _bytes(solo[0])
        extracted[name] = [_bytes(r) for r in rows]
    assert extracted["ref"] == extracted["opt"]


# -- 2. max_append_tokens ------------------------------------------------------------------
@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
def test_max_append_tokens_follows_the_plain_rows(impl: ModuleType) -> None:
    layout = _plain_layout(impl, [2, 4, 7], np.random.default_rng(2))
    assert layout.converted_at == (None, None, 7)  # the row at 7 converts at the merge
    assert layout.max_append_tokens() == 1
    layout.filter_rows([0, 2])
    assert layout.max_append_tokens() == 3
    layout.filter_rows([1])
    assert layout.max_append_tokens() == math.inf and layout.row_offsets == (7,)


# -- 3. prefill maintenance ----------------------------------------------------------------------
def _storages(impl: ModuleType, tokens: list[int], rng: np.random.Generator) -> list[Any]:
    """Plain serial storages holding ``tokens[b]`` float32 tokens each."""
    storages = [impl.KVCache() for _ in tokens]
    for storage, count in zip(storages, tokens, strict=True):
        block = _block(rng, 1, count, "float32")
        _append(impl, storage, block, block)
    return storages


def _plain_layout(impl: ModuleType, tokens: list[int], rng: np.random.Generator) -> Any:
    layout = impl.DelayedQuantizedKVCache(GROUP, 8, 5)
    layout.merge_rows(_storages(impl, tokens, rng))
    return layout


def _snapshot(layout: Any) -> tuple[Any, ...]:
    return (
        layout.row_offsets,
        layout.left_pad,
        layout.converted_at,
        layout.phase,
        layout.max_append_tokens(),
        layout.minimum_reusable_offset,
        [_bytes(layout.extract_row(b)) for b in range(layout.batch_size)],
    )


@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
def test_prefill_defers_conversion_until_end_prefill(impl: ModuleType) -> None:
    rng = np.random.default_rng(3)
    layout = _plain_layout(impl, [6, 3], rng)
    assert layout.converted_at == (6, None)  # outside a prefill a due row converts at the merge
    layout = impl.DelayedQuantizedKVCache(GROUP, 8, 5)
    layout.begin_prefill()
    layout.merge_rows(_storages(impl, [6, 3], rng))
    block = _block(rng, 2, 2, "float32")
    keys, _ = _append(impl, layout, block, block)
    assert layout.row_offsets == (8, 5) and layout.converted_at == (None, None)
    assert not isinstance(keys, RowAttentionPending) and as_numpy(keys).shape[2] >= 8
    layout.end_prefill()
    assert layout.converted_at == (8, 5) and layout.phase == "packed"
    keys, _ = _append(impl, layout, block, block)
    assert isinstance(keys, tuple) and len(keys) == 3 and layout.bits == 8


@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
def test_commit_prefill_converts_the_named_rows(impl: ModuleType) -> None:
    rng = np.random.default_rng(4)
    layout = impl.DelayedQuantizedKVCache(GROUP, 8, 5)
    layout.begin_prefill()
    layout.merge_rows(_storages(impl, [6, 1], rng))
    block = _block(rng, 2, 2, "float32")
    _append(impl, layout, block, block)
    assert layout.row_offsets == (8, 3)
    before = _snapshot(layout)
    for bad in ([2], [0, 0], [-1], ["0"]):
        with pytest.raises(RowIndexError):
            layout.commit_prefill(bad)
        assert _snapshot(layout) == before
    layout.commit_prefill([0])
    assert layout.converted_at == (8, None) and layout.phase == "mixed"
    before = _snapshot(layout)
    with pytest.raises(MixedPrecisionReadError):
        _append(impl, layout, block, block)
    assert _snapshot(layout) == before


# -- 4. plain-read refusals -------------------------------------------------------------------
@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
def test_plain_reads_refused_once_a_row_converted(impl: ModuleType) -> None:
    rng = np.random.default_rng(5)
    layout = _plain_layout(impl, [2, 6], rng)
    assert layout.converted_at == (None, 6)
    before = _snapshot(layout)
    block = _block(rng, 2, 1, "float32")
    with pytest.raises(MixedPrecisionReadError):
        _append(impl, layout, block, block)
    with pytest.raises(MixedPrecisionReadError):
        layout.fetch()
    assert _snapshot(layout) == before
    layout = _plain_layout(impl, [2, 4], rng)
    keys, _ = _append(impl, layout, block, block)
    assert not isinstance(keys, RowAttentionPending | tuple)
    assert layout.row_offsets == (3, 5) and layout.converted_at == (None, 5)
    before = _snapshot(layout)
    with pytest.raises(MixedPrecisionReadError):
        _append(impl, layout, block, block)
    assert _snapshot(layout) == before


# -- 5. bits / group_size visibility --------------------------------------------------------
@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
def test_bits_appear_on_the_first_quantized_read(impl: ModuleType) -> None:
    rng = np.random.default_rng(6)
    layout = _plain_layout(impl, [3, 4], rng)
    block = _block(rng, 2, 1, "float32")
    _append(impl, layout, block, block)  # row 1 converts at 5
    assert layout.phase == "mixed"
    _mixed_append(layout, _to(impl, block), _to(impl, block), _to(impl, block))
    assert layout.phase == "packed"  # row 0 reached 5 on this append
    assert not hasattr(layout, "bits") and not hasattr(layout, "group_size")
    keys, _ = _append(impl, layout, block, block)
    assert isinstance(keys, tuple)
    assert (layout.bits, layout.group_size) == (8, GROUP)


# -- 6. mixed reads ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_attention_equals_each_rows_solo_attention(dtype: str) -> None:
    rng = np.random.default_rng(7)
    prompts = [_block(rng, 1, 3, dtype), _block(rng, 1, 7, dtype)]
    steps = [(_block(rng, 2, 1, dtype), _block(rng, 2, 1, dtype)) for _ in range(3)]
    outputs: dict[str, list[np.ndarray]] = {}
    for name, impl in IMPLS.items():
        legos = [impl.Bf16FirstQuantizedKVCache(GROUP, 4, 6) for _ in range(2)]
        solos = [impl.Bf16FirstQuantizedKVCache(GROUP, 4, 6) for _ in range(2)]
        for b, prompt in enumerate(prompts):
            _append(impl, legos[b], prompt, prompt)
            _append(impl, solos[b], prompt, prompt)
        layout = impl.DelayedQuantizedKVCache(GROUP, 4, 6)
        layout.merge_rows(legos)
        assert layout.phase == "mixed"
        outputs[name] = []
        for block, queries in steps:
            out = _mixed_append(layout, _to(impl, block), _to(impl, block), _to(impl, queries))
            assert out is not None
            out_np = as_numpy(out)
            for b in range(2):
                row = np.ascontiguousarray(block[b : b + 1])
                k, v = _append(impl, solos[b], row, row)
                mask = None
                quantized = isinstance(k, tuple)  # the converting append reads plain
                codec = (solos[b].storage if quantized else impl.KVCache()).codec
                q = _to(impl, np.ascontiguousarray(queries[b : b + 1]))
                expected = as_numpy(codec.attend(q, k, v, mask, 0.125))
                family = "affine" if quantized else "plain"
                ok, error = compare(
                    out_np[b : b + 1], expected, tolerance(family, "attention.solo", dtype)
                )
                assert ok, (name, b, error)
            outputs[name].append(out_np)
        layout.check_valid()
    for mine, theirs in zip(outputs["opt"], outputs["ref"], strict=True):
        ok, error = compare(mine, theirs, tolerance("affine", "attention", dtype))
        assert ok, error


@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
def test_pending_pair_misuse_is_refused(impl: ModuleType) -> None:
    rng = np.random.default_rng(8)
    layout = _plain_layout(impl, [2, 6], rng)
    block = _to(impl, _block(rng, 2, 1, "float32"))
    with pytest.raises(MixedPrecisionReadError):
        layout.attend_rows(block, 0.125)  # no pending read yet
    with row_reads():
        stale, _ = layout.update_and_fetch(block, block)
        fresh, _ = layout.update_and_fetch(block, block)
    assert isinstance(stale, RowAttentionPending) and isinstance(fresh, RowAttentionPending)
    with pytest.raises(MixedPrecisionReadError):
        layout.attend_rows(block, 0.125, pending=stale)
    layout.attend_rows(block, 0.125, pending=fresh)
    with pytest.raises(MixedPrecisionReadError):
        _ = fresh.shape
    with pytest.raises(MixedPrecisionReadError):
        fresh.reshape(1)


# -- ring masks ---------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
@pytest.mark.parametrize("start", [4, 9])
def test_ring_mask_is_the_plain_ragged_rings_in_every_phase(impl: ModuleType, start: int) -> None:
    """A model shares its sliding mask among layers: the delayed ring's mask (plain, mixed
    and packed) equals a plain ragged ring's holding the same rows."""
    rng = np.random.default_rng(start)
    lengths = [7, 1, 10, 3] if start == 4 else [7, 1, 5, 3]
    rings = [impl.RotatingKVCache(WINDOW) for _ in range(2 * len(lengths))]
    for b, count in enumerate(lengths):
        block = _block(rng, 1, count, "float32")
        _append(impl, rings[b], block, block)
        _append(impl, rings[len(lengths) + b], block, block)
    layout = impl.DelayedRotatingQuantizedKVCache(WINDOW, GROUP, 8, 0, start)
    layout.merge_rows(rings[: len(lengths)])
    plain = impl.SpeculativeRotatingKVCache.from_specs(Plain(), Ring(max_size=WINDOW, keep=0))
    plain.merge_rows(rings[len(lengths) :])
    phases = set()
    for step in range(9):
        n = 2 if step % 3 == 0 else 1
        phases.add(layout.phase)
        mine = as_numpy(layout.make_mask(n, return_array=True))
        theirs = as_numpy(plain.make_mask(n, return_array=True))
        shape = (len(lengths), 1, n, theirs.shape[-1])
        assert np.array_equal(np.broadcast_to(mine, shape), np.broadcast_to(theirs, shape))
        block = _block(rng, len(lengths), n, "float32")
        _mixed_append(layout, _to(impl, block), _to(impl, block), _to(impl, block))
        _append(impl, plain, block, block)
    assert phases == ({"mixed", "packed"} if start == 4 else {"plain", "mixed", "packed"})


@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
@pytest.mark.parametrize(
    "start,lengths,converted",
    [(12, [10, 5, 14], [None, None, 14]), (4, [6, 10, 2], [6, 10, None])],
    ids=["plain-wrapped", "converted-wrapped"],
)
def test_ring_rows_publish_only_prefixes_their_solo_ring_can_be_cut_to(
    impl: ModuleType, start: int, lengths: list[int], converted: list[int | None]
) -> None:
    """``publish_row`` (contract §4) hands out a row only when it covers ``tokens``: cut
    back to ``tokens``, the published ring holds exactly them. A ring row that wrapped
    covers only its whole length (its solo ring refuses the trim), plain or converted;
    ``None`` otherwise."""
    rng = np.random.default_rng(start)
    rings: list[Any] = []
    solos: list[Any] = []
    for count in lengths:
        block = _block(rng, 1, count, "float32")
        for pool in (rings, solos):
            ring = impl.RotatingKVCache(WINDOW)
            _append(impl, ring, block, block)
            pool.append(ring)
    layout = impl.DelayedRotatingQuantizedKVCache(WINDOW, GROUP, 8, 0, start)
    layout.merge_rows(rings)
    assert layout.converted_at == tuple(converted)
    for b, (count, solo) in enumerate(zip(lengths, solos, strict=True)):
        for tokens in sorted({0, count - 1, count, count + 1, WINDOW - 1, WINDOW, WINDOW + 1}):
            coverable = tokens == count or (tokens < count and solo.is_trimmable())
            assert layout.can_publish_row(b, tokens) == coverable, (b, count, tokens)
            published = publish_row(layout, b, tokens)
            assert (published is not None) == coverable, (b, count, tokens)
            if published is not None:
                assert published.trim(count - tokens) == count - tokens
                assert published.offset == tokens


# -- 7. random operation sequences ---------------------------------------------------------------
class _Rows:
    """Both layouts and, per row, a solo reference lego fed the same committed tokens
    (``ring``: the sliding-window layout over rings of ``WINDOW``)."""

    def __init__(self, bits: int, start: int, ring: bool, keep: int = 0) -> None:
        self.bits, self.start, self.ring, self.keep = bits, start, ring, keep
        self.layouts = {name: self.layout(impl) for name, impl in IMPLS.items()}
        self.solo: list[Any] = []

    def layout(self, impl: ModuleType) -> Any:
        if self.ring:
            return impl.DelayedRotatingQuantizedKVCache(
                WINDOW, GROUP, self.bits, self.keep, self.start
            )
        return impl.DelayedQuantizedKVCache(GROUP, self.bits, self.start)

    def lego(self, impl: ModuleType) -> Any:
        if self.ring:
            return impl.Bf16FirstRotatingQuantizedKVCache(
                WINDOW, GROUP, self.bits, self.keep, self.start
            )
        return impl.Bf16FirstQuantizedKVCache(GROUP, self.bits, self.start)

    def plain(self, impl: ModuleType) -> Any:
        return impl.RotatingKVCache(WINDOW, self.keep) if self.ring else impl.KVCache()

    def affine(self, impl: ModuleType) -> Any:
        if self.ring:
            return impl.RotatingQuantizedKVCache(WINDOW, GROUP, self.bits, self.keep)
        return impl.QuantizedKVCache(GROUP, self.bits)

    def planes(self, cache: Any) -> list[Any]:
        """Growing: the stored bytes; rings: the window's planes in time order (a ring
        row of a layout may sit at another ring phase than its serial ring, and a serial
        ring holds extra tokens after a multi-token append)."""
        if not self.ring:
            return _bytes(cache)
        storage = getattr(cache, "storage", cache)
        head = [storage.codec_spec.name, int(storage.offset)]
        if int(storage.offset) == 0:
            return head
        planes = storage.window()  # the newest min(offset, WINDOW) tokens, time order
        return head + [(str(a.dtype), a.shape, a.tobytes()) for a in _flat(planes)]

    def snapshot(self) -> list[Any]:
        out = []
        for layout in self.layouts.values():
            summary = _snapshot(layout)[:-1]
            planes = [self.planes(layout.extract_row(b)) for b in range(layout.batch_size)]
            out.append((*summary, planes))
        return out

    def check(self) -> None:
        first, second = self.snapshot()
        assert first == second
        (offsets, _pads, converted, _phase, limit, reusable, planes) = first
        assert len(offsets) == len(self.solo)
        for b, solo in enumerate(self.solo):
            assert offsets[b] == int(solo.offset)
            assert converted[b] == (solo.minimum_reusable_offset if solo.converted else None)
            assert planes[b] == self.planes(solo)
        limits = [s.max_append_tokens() for s in self.solo]
        assert limit == min(limits, default=math.inf)
        assert reusable == max((c or 0 for c in converted), default=0)
        for layout in self.layouts.values():
            layout.check_valid()


def _merge_sources(rows: _Rows, data: st.DataObject, rng: np.random.Generator) -> None:
    sources: dict[str, list[Any]] = {name: [] for name in IMPLS}
    count = data.draw(st.integers(1, 2))
    for _ in range(count):
        kind = data.draw(st.sampled_from(["lego", "plain", "affine", "delayed"]))
        chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
        blocks = [_block(rng, 1, n, "float32") for n in chunks]
        solo = rows.lego(ref)
        if kind == "affine":
            storage = rows.affine(ref)
            for block in blocks:
                _append(ref, storage, block, block)
            solo = solo.composed.over(storage)
        elif kind == "plain":  # a plain storage past start converts at the merge
            storage = rows.plain(ref)
            for block in blocks:
                _append(ref, storage, block, block)
            solo = solo.composed.over(storage)
            if int(storage.offset) and int(storage.offset) >= rows.start:
                start = rows.start
                solo = solo.composed.over(
                    _convert_ring(storage, rows.bits) if rows.ring else
                    to_affine(storage, Affine(bits=rows.bits, group_size=GROUP),
                              ref.QuantizedKVCache),
                    minimum_reusable_offset=int(storage.offset) if start else 0,
                )  # fmt: skip
        else:
            for block in blocks:
                _append(ref, solo, block, block)
        for name, impl in IMPLS.items():
            if kind == "lego" or kind == "delayed":
                source: Any = rows.lego(impl)
            elif kind == "plain":
                source = rows.plain(impl)
            else:
                source = rows.affine(impl)
            for block in blocks:
                _append(impl, source, block, block)
            if kind == "delayed":
                layout = rows.layout(impl)
                layout.merge_rows([source])
                source = layout
            sources[name].append(source)
        rows.solo.append(solo)
    for name, layout in rows.layouts.items():
        layout.merge_rows(sources[name])


def _convert_ring(storage: Any, bits: int) -> Any:
    return to_affine(storage, Affine(bits=bits, group_size=GROUP), ref.RotatingQuantizedKVCache)


def _append_all(rows: _Rows, n: int, rng: np.random.Generator, keep: list[int] | None) -> None:
    block = _block(rng, len(rows.solo), n, "float32")
    for name, impl in IMPLS.items():
        layout = rows.layouts[name]
        if keep is not None:
            layout.spec_round_begin()
        _mixed_append(layout, _to(impl, block), _to(impl, block), _to(impl, block))
        if keep is not None:
            if keep == [n] * len(keep):
                layout.spec_round_commit()
            else:
                layout.spec_round_rollback(keep)
    for b, solo in enumerate(rows.solo):
        count = n if keep is None else keep[b]
        part = np.ascontiguousarray(block[b : b + 1, :, :count])
        _append(ref, solo, part, part)


def _prefill(rows: _Rows, data: st.DataObject, rng: np.random.Generator) -> None:
    """Prefill maintenance: appends past the boundary convert nothing until a row is
    committed or the prefill ends; each row's solo lego gets the tokens it received since
    its last conversion chance as one chunk (it converts at that chunk's end)."""
    size = len(rows.solo)
    held: list[list[np.ndarray]] = [[] for _ in range(size)]

    def flush(b: int) -> None:
        if held[b]:
            chunk = np.concatenate(held[b], axis=2)
            _append(ref, rows.solo[b], chunk, chunk)
            held[b] = []

    for layout in rows.layouts.values():
        layout.begin_prefill()
    for _ in range(data.draw(st.integers(1, 3))):
        n = data.draw(st.integers(1, 4))
        block = _block(rng, size, n, "float32")
        for name, impl in IMPLS.items():
            _mixed_append(rows.layouts[name], _to(impl, block), _to(impl, block), _to(impl, block))
        for b in range(size):
            held[b].append(np.ascontiguousarray(block[b : b + 1]))
        committed = data.draw(st.lists(st.integers(0, size - 1), unique=True, max_size=size))
        for layout in rows.layouts.values():
            layout.commit_prefill(committed)
        for b in committed:
            flush(b)
        first, second = rows.snapshot()
        assert first == second
    for layout in rows.layouts.values():
        layout.end_prefill()
        assert not layout.prefilling
    for b in range(size):
        flush(b)


def _call(name: str, argument: Any, layout: Any) -> Any:
    return getattr(layout, name)(argument)


def _refused(rows: _Rows, call: Callable[[Any], Any]) -> None:
    before = rows.snapshot()
    for layout in rows.layouts.values():
        with pytest.raises(KvRowsError):
            call(layout)
    assert rows.snapshot() == before


@given(
    bits=st.sampled_from([4, 8]),
    start=st.integers(0, 12),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
@profile_settings(max_examples=15, deadline=None)
@pytest.mark.parametrize("ring", [False, True], ids=["growing", "ring"])
def test_random_sequences_match_solo_legos(
    ring: bool, bits: int, start: int, seed: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    sinks = data.draw(st.sampled_from([0, 0, 2])) if ring else 0  # the ring's keep, sometimes
    rows = _Rows(bits, start, ring, sinks)
    _merge_sources(rows, data, rng)
    rows.check()
    for _ in range(data.draw(st.integers(1, 7))):
        op = data.draw(
            st.sampled_from(["merge", "append", "round", "filter", "trim", "prefill", "bad"])
        )
        size = len(rows.solo)
        limit = rows.layouts["ref"].max_append_tokens()
        if op == "merge":
            _merge_sources(rows, data, rng)
        elif op in ("append", "round") and size:
            n = data.draw(st.integers(1, int(min(limit, 4))))
            keep = None
            if op == "round":
                keep = data.draw(st.lists(st.integers(1, n), min_size=size, max_size=size))
            _append_all(rows, n, rng, keep)
        elif op == "filter" and size:
            keep_rows = data.draw(st.permutations(range(size)))[: data.draw(st.integers(0, size))]
            for layout in rows.layouts.values():
                layout.filter_rows(list(keep_rows))
            rows.solo = [rows.solo[b] for b in keep_rows]
        elif op == "trim" and size:
            # A serial ring trims only before it wraps; the layout's rule is wider.
            counts = [
                data.draw(st.integers(0, int(s.offset)))
                if not ring or int(s.offset) < WINDOW
                else 0
                for s in rows.solo
            ]
            for layout in rows.layouts.values():
                layout.trim_rows(counts)
            for solo, count in zip(rows.solo, counts, strict=True):
                solo.trim(count)
        elif op == "prefill" and size:
            _prefill(rows, data, rng)
        elif op == "bad" and size:
            over = [o + 1 for o in rows.layouts["ref"].row_offsets]
            _refused(rows, partial(_call, "trim_rows", over))
            _refused(rows, partial(_call, "filter_rows", [size]))
            _refused(rows, partial(_call, "commit_prefill", [size]))
            if rows.layouts["ref"].phase == "mixed":
                block = _block(rng, size, 1, "float32")
                for name, impl in IMPLS.items():
                    with pytest.raises(MixedPrecisionReadError):
                        _append(impl, rows.layouts[name], block, block)
        rows.check()
