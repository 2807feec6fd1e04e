"""The optimized row machinery: composition plumbing and the issue-8 defects, each with a test.

Self-merge refused, one message for an empty fetch, extracted rows that own compact
evaluated arrays (active memory), ``offset`` cached until the next change, and caches that
never keep or write into the caller's arrays.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from stage_helpers import Request, TwoStages, drawn_steps, planes_of

import kvrows.optimized as kv
from kvrows.codec import Codec
from kvrows.compositions import composition, landed
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.delayed import DelayedLayout, row_reads
from kvrows.errors import (
    EMPTY_LAYOUT_UPDATE,
    NOTHING_TO_FETCH,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    self_merge_message,
)
from kvrows.optimized.paging import PagedLayout
from kvrows.optimized.rows import DECLARED, Layout, Serial, Store, arrays
from kvrows.schemes import Affine, Growing, Plain, Ring
from kvrows.validation import KvGeometry

pytestmark = pytest.mark.usefixtures("cpu_stream")


def _block(rows: int, tokens: int, heads: int = 2, dim: int = 64, seed: int = 0) -> mx.array:
    return mx.random.normal((rows, heads, tokens, dim), key=mx.random.key(seed)).astype(mx.float16)


#: Every public class by composition name: the row storages and the delayed layouts.
CLASSES = kv.declared_classes()


def _args(name: str) -> tuple[int, ...]:
    """Positional constructor arguments (mlx-lm's order) for a small instance (a delayed
    layout's rows convert from their fifth token)."""
    values = {"max_size": 8, "group_size": 32, "bits": 4, "keep": 0, "start": 5}
    values |= {"k_bits": 4, "v_bits": 2, "chunk_size": 8}
    return tuple(values[p] for p in composition(name).params)


def _serial(name: str, tokens: int, seed: int = 0) -> Serial:
    entry = composition(name)
    serial = entry.serial or entry.name
    if "delayed" in entry.modifiers:  # its rows arrive plain and convert at their start
        plain = CLASSES[name].lego_class.plain_class
        cache = plain(*_args(plain.composition.name))
    else:
        cache = CLASSES[serial](*_args(serial))
    assert isinstance(cache, Serial)
    if tokens:
        block = _block(1, tokens, seed=seed)
        cache.update_and_fetch(block, block)
    return cache


#: Token KV storages (latent and recurrent state have their own row machinery:
#: tests/test_latent.py, tests/test_recurrent.py).
KV_LANDED = [
    c for c in landed() if c.geometry not in ("latent", "recurrent") and c.codec != "latent"
]  # (and the paged latent: tests/test_paged_latent.py)
LAYOUTS = [c.name for c in KV_LANDED if c.is_layout]


def test_every_landed_composition_is_one_declared_class() -> None:
    assert sorted(CLASSES) == sorted(c.name for c in landed())
    delayed = {c.name for c in landed() if "delayed" in c.modifiers and c.is_layout}
    assert delayed == {
        "DelayedQuantizedKVCache",
        "DelayedRotatingQuantizedKVCache",
        "DelayedTurboQuantKVCache",
        "DelayedMxKVCache",
        "DelayedRotatingMxKVCache",
        "DelayedChunkedQuantizedKVCache",
        "DelayedChunkedMxKVCache",
    }
    for name in delayed:
        layout_cls = getattr(kv, name)
        assert layout_cls is CLASSES[name] and layout_cls.composition is composition(name)
        # A layout of stage stores under the modifier's mixin (growing, the ragged ring,
        # chunked).
        entry = composition(name)
        assert (entry.geometry, entry.arrangement) in kv.classes.STAGED
        assert issubclass(layout_cls, DelayedLayout) and name in DECLARED
        layout = layout_cls(*_args(name))
        assert layout.signature() == composition(name).signature.format(
            start=5, **layout.codec_spec.parameters(), **layout.token_geometry.parameters()
        )
        built = layout_cls.from_specs(layout.codec_spec, layout.token_geometry, start=5)
        assert type(built) is layout_cls and built.signature() == layout.signature()
    # The paged placement (optimized/paging.py): the row machinery over block tables; built
    # from a pool or keyword arguments (kvrows.paged.bind_paged), not from_specs.
    paged = {c.name for c in KV_LANDED if c.placement == "paged"}
    for name in paged:
        assert CLASSES[name] is getattr(kv, name) is DECLARED[name]
        assert issubclass(CLASSES[name], Layout if composition(name).is_layout else Serial)
    recurrent = {c.name for c in landed() if c.geometry == "recurrent"}  # the state geometry
    # The latent codec on the growing geometry, plain and encoded (two stages), and on the
    # paged placement (one stage, its pool a BlockPool of the Latent codec).
    latent = {"MLACache", "EncodedLatentCache", "PagedLatentCache"}
    assert issubclass(DECLARED["PagedLatentCache"], PagedLayout)
    assert sorted(DECLARED) == sorted([*(c.name for c in KV_LANDED), *recurrent, *latent])
    # The legos (the delayed modifier's serial mixin, tests/test_lego.py) show their
    # current stage's surface; every other storage here is one codec's.
    legos = {c.name for c in landed() if "delayed" in c.modifiers and not c.is_layout}
    assert all(issubclass(getattr(kv, name), Serial) for name in legos)
    for name in latent:
        assert CLASSES[name] is getattr(kv, name) is DECLARED[name]
        assert issubclass(CLASSES[name], Layout)
    for entry in (c for c in KV_LANDED if c.name not in delayed | paged | legos):
        cls = getattr(kv, entry.name)
        assert cls is DECLARED[entry.name] and cls.composition is entry
        assert issubclass(cls, Layout if entry.is_layout else Serial)
        instance = cls(*_args(entry.name))
        assert isinstance(instance.codec, Codec)
        assert hasattr(instance, "bits") == ("bits" in entry.params)  # affine, microscaling
        assert hasattr(instance, "max_size") == (entry.geometry == "ring")
        assert instance.signature() == entry.signature_for(
            instance.codec_spec, instance.token_geometry
        )
        again = cls.from_specs(instance.codec_spec, instance.token_geometry)
        assert type(again) is cls and again.signature() == instance.signature()
        assert instance.plane_specs() == ()


def test_specs_and_declared_geometry() -> None:
    geometry = KvGeometry(heads=2, key_dim=64, value_dim=64, dtype="float16")
    layout = kv.PaddedQuantKVRows(32, 4, geometry=geometry)
    assert layout.codec_spec == Affine(bits=4, group_size=32)
    assert layout.token_geometry == Growing()
    assert (layout.bits, layout.group_size) == (4, 32)
    assert layout.projected_bytes(10) == 10 * 2 * layout.codec.token_bytes(2, 64, "float16")
    assert [p.name for p in layout.plane_specs()] == [
        "keys",
        "keys.scales",
        "keys.biases",
        "values",
        "values.scales",
        "values.biases",
    ]
    ring = kv.RotatingKVCache(token_geometry=Ring(max_size=16), codec=Plain())
    assert (ring.max_size, ring.keep, ring.signature()) == (16, 0, "kv:rotating-plain")
    ring_layout = kv.RaggedRotatingRows.from_specs(Plain(), Ring(max_size=16), geometry=geometry)
    assert ring_layout.projected_bytes(100) == ring_layout.projected_bytes(16)
    with pytest.raises(LayoutStateError):
        kv.PaddedKVRows().projected_bytes(1)
    with pytest.raises(InvalidInputError):
        kv.KVCache.from_specs(Affine(), Growing())


@pytest.mark.parametrize("name", LAYOUTS)
def test_self_merge_and_a_source_twice_are_refused(name: str) -> None:
    layout = CLASSES[name](*_args(name))
    first, second = _serial(name, 3, seed=1), _serial(name, 5, seed=2)
    layout.merge_rows([first, second])
    before = (layout.row_offsets, layout.left_pad, [np.array(p) for p in layout.held_arrays()])
    message = self_merge_message(layout.signature())
    with pytest.raises(IncompatibleRowsError) as caught:
        layout.merge_rows([layout])
    assert str(caught.value) == message
    with pytest.raises(IncompatibleRowsError, match="given twice"):
        layout.merge_rows([first, first])
    other = layout.make_empty_batch()
    other.merge_rows([first])
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([other, other])
    assert other.batch_size == 1
    after = (layout.row_offsets, layout.left_pad, [np.array(p) for p in layout.held_arrays()])
    assert after[:2] == before[:2] and layout.batch_size == 2
    for a, b in zip(after[2], before[2], strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("name", [c.name for c in KV_LANDED])
def test_one_message_for_an_empty_fetch(name: str) -> None:
    cache = CLASSES[name](*_args(name))
    with pytest.raises(LayoutStateError) as caught:
        cache.fetch()
    assert str(caught.value) == NOTHING_TO_FETCH
    if composition(name).is_layout:
        block = _block(1, 1)
        with pytest.raises(LayoutStateError) as caught:
            cache.update_and_fetch(block, block)
        assert str(caught.value) == EMPTY_LAYOUT_UPDATE


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n in DECLARED])
def test_offset_is_cached_until_the_next_change(name: str) -> None:
    layout = DECLARED[name](*_args(name))
    assert isinstance(layout, Layout)
    layout.merge_rows([_serial(name, 3, seed=1), _serial(name, 5, seed=2)])
    first = layout.offset
    assert layout.offset is first and first.tolist() == [3, 5]
    block = _block(2, 1)
    with row_reads():  # a delayed layout's rows are mixed now (one converted at 5)
        layout.update_and_fetch(block, block)
    assert layout.offset is not first and layout.offset.tolist() == [4, 6]
    assert first.tolist() == [3, 5]  # rebound, never mutated
    for change in (
        lambda: layout.merge_rows([_serial(name, 2, seed=3)]),
        lambda: layout.filter_rows([2, 0]),
        lambda: layout.trim(1),
    ):
        held = layout.offset
        change()
        assert layout.offset is not held
        assert layout.offset.tolist() == list(layout.row_offsets)


def test_extracted_rows_own_compact_evaluated_arrays() -> None:
    """Six extracts from a B=16 layout, each followed by a step, keep only their own bytes
    alive (a lazy slice would pin the batch buffer, and the step would copy it)."""
    layout = kv.PaddedKVRows()
    layout.merge_rows([_serial("PaddedKVRows", 200 - 4 * b, seed=b) for b in range(16)])
    step = _block(16, 1)
    layout.update_and_fetch(step, step)
    mx.eval(layout.held_arrays())
    start = mx.get_active_memory()
    kept = []
    for row in range(6):
        kept.append(layout.extract_row(row))
        layout.update_and_fetch(step, step)
        mx.eval(layout.held_arrays())
    extracted = sum(cache.nbytes for cache in kept)
    assert extracted == sum(2 * 2 * 64 * 2 * (201 - 3 * b) for b in range(6))  # b + 1 steps
    assert mx.get_active_memory() - start <= extracted + 64 * 1024
    assert layout.nbytes > 10 * extracted / 6  # the batch buffer was not what was kept


@pytest.mark.parametrize("name", [c.name for c in KV_LANDED])
def test_caches_never_keep_or_write_the_callers_arrays(name: str) -> None:
    """The first block of exactly ``max_size`` tokens into a ring used to become the ring's
    buffer itself; the next single-token write then changed the caller's array."""
    cache = CLASSES[name](*_args(name))
    rows = 1
    if composition(name).is_layout:
        cache.merge_rows([_serial(name, 0), _serial(name, 0)])
        rows = 2
    keys, values = _block(rows, 8, seed=1), _block(rows, 8, seed=2)
    saved = (np.array(keys), np.array(values))
    cache.update_and_fetch(keys, values)
    for seed in range(3, 12):
        token = _block(rows, 1, seed=seed)
        cache.update_and_fetch(token, token)
        mx.eval(cache.held_arrays())
    assert np.array_equal(np.array(keys), saved[0])
    assert np.array_equal(np.array(values), saved[1])


@pytest.mark.parametrize("name", ["KVCache", "QuantizedKVCache"])
def test_attention_returns_the_queries_dtype(name: str) -> None:
    cache = _serial(name, 5)
    queries = _block(1, 1, heads=4)
    out = kv.attend(queries, cache, None, 0.125)
    assert out.dtype == mx.float16 and out.shape == (1, 4, 1, 64)


def test_a_shared_column_rollback_rolls_rows_right_in_both_implementations() -> None:
    """The machinery's shared-column rollback (``justify=True``, contract §0.3: MLA's
    roll): rows of one write column forget different counts and end at one column again,
    the reference and the optimized rows alike; without ``justify`` unequal counts are
    refused and nothing changes."""
    import kvrows.reference as ref

    twins = []
    for impl, convert in ((ref, lambda a: np.asarray(a)), (kv, lambda a: a)):
        layout = impl.PaddedKVRows()
        rows = []
        for b, tokens in enumerate((5, 3, 4)):
            serial = impl.KVCache()
            block = convert(_block(1, tokens, seed=b))
            serial.update_and_fetch(block, block)
            rows.append(serial)
        layout.merge_rows(rows)
        step = convert(_block(3, 2, seed=9))
        layout.update_and_fetch(step, step)
        with pytest.raises(NotTrimmableError, match="rows sharing one write column"):
            layout.trim_rows([2, 0, 1])
        assert layout.row_offsets == (7, 5, 6) and layout.left_pad == (0, 2, 1)
        trim = layout._trim if impl is ref else layout._trim_rows
        assert trim([2, 0, 1], justify=True) == 2
        layout.check_valid()
        assert layout.row_offsets == (5, 5, 5) and layout.left_pad == (0, 0, 0)
        assert trim([1, 0, 3], justify=True) == 3
        layout.check_valid()
        assert layout.row_offsets == (4, 5, 2) and layout.left_pad == (1, 0, 3)
        twins.append(layout)
    (ref_keys, _), (opt_keys, _) = (layout.fetch() for layout in twins)
    assert np.array_equal(np.asarray(ref_keys), np.array(opt_keys))


def test_some_rows_of_a_layout_convert_as_in_the_reference() -> None:
    """The stage hook on a layout of two stages (contract §0.5), twin against twin: no row
    changes nothing, and every row moved (a row given twice counts once) holds what a
    layout of the target codec fed the same tokens holds (reads and bytes). Some rows only:
    ``test_rows_of_two_stages_hold_what_each_stage_layout_holds``."""
    import kvrows.reference as ref

    target = Affine(bits=4, group_size=64)
    twins = []
    for impl, convert in ((ref, lambda a: np.asarray(a)), (kv, lambda a: a)):
        layout, packed = impl.BatchedKVCache(), impl.BatchedQuantizedKVCache(64, 4)
        layout._use_stages((Plain(), target))
        for into, serial_class in ((layout, impl.KVCache), (packed, impl.QuantizedKVCache)):
            rows = []
            for b, tokens in enumerate((5, 3, 4)):
                serial = serial_class() if into is layout else serial_class(64, 4)
                block = convert(_block(1, tokens, seed=b))
                serial.update_and_fetch(block, block)
                rows.append(serial)
            into.merge_rows(rows)

        def seen(storage: object) -> tuple[object, ...]:
            keys, values = storage.fetch()  # type: ignore[attr-defined]
            read = (*keys, *values) if isinstance(keys, tuple) else (keys, values)
            planes = tuple(np.array(p) for p in read)
            pads = storage.left_pad  # type: ignore[attr-defined]
            for plane in planes:
                for b, pad in enumerate(pads):
                    plane[b, :, :pad] = 0  # pad columns: masked, whatever they hold
            return (
                storage.row_offsets,  # type: ignore[attr-defined]
                storage.left_pad,  # type: ignore[attr-defined]
                storage.nbytes,  # type: ignore[attr-defined]
                storage.codec_spec,  # type: ignore[attr-defined]
                planes,
            )

        def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
            *meta_a, planes_a = a
            *meta_b, planes_b = b
            return meta_a == meta_b and all(
                np.array_equal(x, y)
                for x, y in zip(planes_a, planes_b, strict=True)  # type: ignore[call-overload]
            )

        before = seen(layout)
        layout._convert_rows([])
        assert same(seen(layout), before)
        layout._convert_rows([2, 0, 1, 0])
        layout.check_valid()
        assert layout.codec_spec == target and same(seen(layout), seen(packed))
        step = convert(_block(3, 1, seed=7))
        for storage in (layout, packed):
            storage.update_and_fetch(step, step)
        assert same(seen(layout), seen(packed))
        twins.append(seen(layout))
    (*ref_meta, ref_planes), (*opt_meta, opt_planes) = twins
    assert ref_meta[:2] == opt_meta[:2] and ref_meta[3] == opt_meta[3]
    for x, y in zip(ref_planes, opt_planes, strict=True):  # type: ignore[call-overload]
        np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), atol=1e-2)


# -- per-row stages (contract §0.5) over the growing geometry's stage stores (§0.4) ----------

STAGED = Affine(bits=4, group_size=64)


def _oracle_classes(arrangement: str) -> tuple[type[Layout], Any]:
    """The two-stage layout's class (also its one-stage plain shadow) and a factory of the
    one-stage public layout of the target codec: what the oracle of each stage is."""
    if arrangement == "ragged":
        return kv.BatchedKVCache, lambda: kv.BatchedQuantizedKVCache(64, 4)
    return kv.PaddedKVRows, lambda: kv.PaddedQuantKVRows(64, 4)


class _Staged(TwoStages):
    """A two-stage growing layout (plain, then affine), its one-stage plain shadow given the
    same operations (stages move no padding: the shadow's offsets and pads are the
    layout's) and the rows' record, checked against the public one-stage layouts."""

    def __init__(self, arrangement: str, seed: int) -> None:
        self.cls, self.packed = _oracle_classes(arrangement)
        self.shared = arrangement == "shared"
        self.layout = self.cls()
        self.layout._use_stages((Plain(), STAGED))
        self.shadow = self.cls()
        self.requests: list[Request] = []
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def native(array: np.ndarray) -> Any:
        return mx.array(array)

    def serial(self, request: Request, stage: int | None = None, twin: bool = False) -> Serial:
        stage = request.stage if stage is None else stage
        cache = kv.KVCache() if stage == 0 else kv.QuantizedKVCache(64, 4)
        for k, v in zip(request.keys, request.values, strict=True):
            cache.update_and_fetch(mx.array(k), mx.array(v))
        return cache

    def oracle(self, stage: int, rows: list[int]) -> Layout:
        """The one-stage public layout of ``stage``'s codec holding rows ``rows`` (each a
        serial storage of that codec fed the row's chunks, merged in order)."""
        layout = self.cls() if stage == 0 else self.packed()
        layout.merge_rows([self.serial(self.requests[b]) for b in rows])
        return layout

    def meta(self) -> tuple[Any, ...]:
        layout = self.layout
        return (layout.row_stages, layout.row_offsets, layout.left_pad, layout.nbytes)

    def check(self) -> None:
        layout, requests = self.layout, self.requests
        checked = self.check_rows((Plain(), STAGED))
        if checked is None:
            return
        parts, stages = checked
        # Bytes: each store holds its rows' slots plus spare slots, at the layout's columns;
        # a slot of the stage's codec costs what a slot of the oracle layout of that codec
        # costs per column (a stage without rows holds nothing).
        rows = list(range(len(requests)))
        stores = layout._stores or [Store(stages[0], layout._planes, rows, layout.codec)]
        expected = 0
        for (rows, codec, reads), stage, store in zip(parts, stages, stores, strict=True):
            assert codec.spec == (Plain(), STAGED)[stage] and store.stage == stage
            held = [b for b in rows if requests[b].offset]
            if not held:
                continue
            oracle = self.oracle(stage, rows)
            slots = int(arrays(store.planes)[0].shape[0])
            per_column = oracle.nbytes // (oracle.slots * oracle.capacity)  # type: ignore[attr-defined]
            expected += slots * layout.capacity * per_column
            want = oracle._read()
            for tensor, planes in reads.items():
                got, oracle_planes = planes_of(planes), planes_of(want[tensor])
                for i, b in enumerate(rows):
                    pad, pad_oracle, n = layout.left_pad[b], oracle.left_pad[i], requests[b].offset
                    for mine, theirs in zip(got, oracle_planes, strict=True):
                        assert np.array_equal(
                            mine[i, :, pad : pad + n], theirs[i, :, pad_oracle : pad_oracle + n]
                        ), (b, tensor, stage)
        if all(any(requests[b].offset for b in rows) for rows, _, _ in parts):
            assert layout.nbytes == expected
        self.check_reads(parts, stages)


@pytest.mark.parametrize("arrangement", ["ragged", "shared"])
def test_rows_of_two_stages_hold_what_each_stage_layout_holds(arrangement: str) -> None:
    """Per-row stages over the growing geometry's stage stores (contract §0.4, §0.5): rows
    merged from serial storages of both codecs and of different lengths join in their
    codec's stage; some rows convert; appends, filters (reorder, drop), merges, trims and
    extractions act on rows of any stage. After every step each stage's rows read what the
    public one-stage layout of that codec holding them reads (bit for bit, pads aside), the
    offsets and pads are a one-stage layout's, the bytes are each store's slots at the
    layout's columns, a mixed read is refused, and refusals change nothing."""
    staged = _Staged(arrangement, seed=1)
    staged.join([(0, 5), (0, 3), (0, 4)])
    staged.convert([])
    staged.convert([2, 0, 2])  # a row given twice moves once
    staged.refusals()
    staged.append(2)
    staged.append(1)
    staged.join([(1, 6), (0, 2), (1, 1)])
    staged.refusals()
    staged.filter([4, 1, 0, 3])  # reorder, drop rows of both stages
    staged.extract(0)
    staged.extract(1)
    staged.append(3)
    counts = [2] * 4 if staged.shared else [3, 0, 2, 1]
    staged.trim(counts)
    staged.convert([0, 1])  # every plain row: one store again
    assert staged.layout._stores is None
    staged.append(1)
    staged.join([(0, 4)])
    staged.filter([4, 0])
    staged.extract(1)
    staged.filter([])


@pytest.mark.parametrize("arrangement", ["ragged", "shared"])
@profile_settings(max_examples=max(5, active_profile().max_examples // 10))
@given(data=st.data())
def test_drawn_operations_on_rows_of_two_stages(arrangement: str, data: st.DataObject) -> None:
    """A drawn sequence of the operations above on random rows, checked after every step
    against the oracle."""
    staged = _Staged(arrangement, seed=data.draw(st.integers(0, 2**16), label="seed"))

    def trim(requests: list[Any]) -> list[int]:
        if staged.shared:
            return [data.draw(st.integers(0, min(r.offset for r in requests)))] * len(requests)
        return [data.draw(st.integers(0, r.offset)) for r in requests]

    drawn_steps(staged, data, longest=6, trim=trim)


def test_a_shared_ring_layout_keeps_its_rows_in_one_stage() -> None:
    """A shared-column ring holds no stage stores (contract §0.5: its rows share one ring
    index): converting some rows, or merging a row of the other stage into a running
    layout, is refused before anything changes; every row converting together still
    works. (The ragged ring has stage stores: ``test_ring_rows_of_two_stages_...``.)"""
    layout = kv.BatchedRotatingCache(8)
    layout._use_stages((Plain(), STAGED))
    rows = []
    for n in (5, 3, 9):
        serial = kv.RotatingKVCache(8)
        block = _block(1, n, seed=n)
        serial.update_and_fetch(block, block)
        rows.append(serial)
    layout.merge_rows(rows)
    packed = kv.RotatingQuantizedKVCache(8, 64, 4)
    block = _block(1, 4, seed=4)
    packed.update_and_fetch(block, block)
    keys, _ = layout.fetch()
    before = (layout.row_offsets, layout.left_pad, layout.nbytes, np.array(keys))
    for attempt in range(2):
        with pytest.raises(LayoutStateError, match="convert together"):
            if attempt:
                layout.merge_rows([packed])
            else:
                layout._convert_rows([0, 2])
        keys, _ = layout.fetch()
        assert (layout.row_offsets, layout.left_pad, layout.nbytes) == before[:3]
        assert np.array_equal(np.array(keys), before[3]) and layout.row_stages == (0, 0, 0)
    layout._convert_rows([0, 1, 2])
    layout.check_valid()
    assert layout.row_stages == (1, 1, 1) and layout.codec_spec == STAGED


# -- per-row stages over the ragged ring's stage stores (contract §0.4, §0.5) ---------------

RING = 8
RING_STAGED = Affine(bits=4, group_size=32)


def _window_columns(held: int, offset: int, keep: int, lead: int = 0) -> list[int]:
    """The columns of a ragged ring row holding ``held`` columns at ``offset`` from read
    column ``lead`` (its dropped tokens before it: spec/RaggedRotatingRows.md §1) that its
    window reads, in time order: its sinks, then its newest positions."""
    count = min(held, offset, RING)
    sinks = min(keep, offset, count)
    if sinks == 0 or count == held:
        return list(range(lead + held - count, lead + held))
    return [*range(sinks), *range(held - count + sinks, held)]  # (sinks: no lead)


class _StagedRing(TwoStages):
    """A two-stage ragged ring (plain, then affine), its reference twin and a one-stage
    plain shadow given the same operations (a stage moves no column: the shadow's offsets,
    retained columns and masks are the layout's), and the rows' record; each stage's rows
    checked against the public one-stage ring layout of that codec holding them (a ring
    read is per row from column 0: each row's window is compared)."""

    def __init__(self, seed: int, keep: int = 0) -> None:
        import kvrows.reference as ref

        self.ref, self.keep = ref, keep
        self.layout = kv.SpeculativeRotatingKVCache(RING, keep)
        self.layout._use_stages((Plain(), RING_STAGED))
        self.twin = ref.SpeculativeRotatingKVCache(RING, keep)
        self.twin._use_stages((Plain(), RING_STAGED))
        self.shadow = kv.SpeculativeRotatingKVCache(RING, keep)
        self.requests: list[Request] = []
        self.rng = np.random.default_rng(seed)

    @staticmethod
    def native(array: np.ndarray) -> Any:
        return mx.array(array)

    def serial(self, request: Request, stage: int | None = None, twin: bool = False) -> Any:
        stage = request.stage if stage is None else stage
        impl, keep = (self.ref if twin else kv), self.keep
        cache = (
            impl.RotatingKVCache(RING, keep)
            if stage == 0
            else impl.RotatingQuantizedKVCache(RING, 32, 4, keep)
        )
        wrap = np.asarray if twin else mx.array
        for k, v in zip(request.keys, request.values, strict=True):
            cache.update_and_fetch(wrap(k), wrap(v))
        return cache

    def oracle(self, stage: int, rows: list[int]) -> Layout:
        layout = (
            kv.SpeculativeRotatingKVCache(RING, self.keep)
            if stage == 0
            else (kv.SpeculativeRotatingAffineLayout(RING, 32, 4, self.keep))
        )
        layout.merge_rows([self.serial(self.requests[b]) for b in rows])
        return layout

    def meta(self) -> tuple[Any, ...]:
        layout = self.layout
        return (layout.row_stages, layout.row_offsets, layout.retained, layout.nbytes)

    def check(self) -> None:
        layout, twin, requests = self.layout, self.twin, self.requests
        layout.check_valid()
        twin.check_valid()
        stages = tuple(r.stage for r in requests)
        assert layout.row_stages == twin.row_stages == stages
        offsets = tuple(r.offset for r in requests)
        assert layout.row_offsets == twin.row_offsets == self.shadow.row_offsets == offsets
        retained = layout.retained
        assert retained == self.shadow.retained
        if not requests:
            assert layout.nbytes == 0
            return
        for n in (1, 3):  # the masks over every row: the shadow's, and the twin's
            mask = np.array(layout.make_mask(n, return_array=True))
            assert np.array_equal(mask, np.array(self.shadow.make_mask(n, return_array=True)))
            assert np.array_equal(mask, np.asarray(twin.make_mask(n, return_array=True)))
        held = sorted(set(stages))
        assert layout.codec_spec == (Plain(), RING_STAGED)[held[-1]]
        parts, twin_parts = layout._stage_parts(), twin._stage_parts()
        assert [rows for rows, _, _ in parts] == [
            [b for b, s in enumerate(stages) if s == stage] for stage in held
        ]
        assert [rows for rows, _, _ in twin_parts] == [rows for rows, _, _ in parts]
        expected = 0
        for (rows, codec, reads), (_, _, twin_reads), stage in zip(
            parts, twin_parts, held, strict=True
        ):
            assert codec.spec == (Plain(), RING_STAGED)[stage]
            if not any(offsets[b] for b in rows):
                continue  # the oracle of rows holding no token holds nothing to read
            oracle = self.oracle(stage, rows)
            ((_, _, want),) = oracle._stage_parts()
            if oracle.nbytes:  # a store's slots at the layout's columns, the oracle's per slot
                per_column = oracle.nbytes // (len(rows) * oracle.buffer_length)  # type: ignore[attr-defined]
                expected += len(rows) * layout.buffer_length * per_column
            for tensor, planes in reads.items():
                got, theirs = planes_of(planes), planes_of(want[tensor])
                twins = [np.asarray(p) for p in planes_of(twin_reads[tensor])]
                for i, b in enumerate(rows):
                    lead = layout._lead[b] - layout._read_start()
                    mine = _window_columns(retained[b], offsets[b], self.keep, lead)
                    other = _window_columns(oracle.retained[i], offsets[b], self.keep)  # type: ignore[attr-defined]
                    for x, y, z in zip(got, theirs, twins, strict=True):
                        window = x[i][:, mine]
                        assert np.array_equal(window, y[i][:, other]), (b, stage)
                        np.testing.assert_allclose(
                            window.astype(np.float32), z[i][:, mine].astype(np.float32), atol=1e-2
                        )
        if all(offsets):
            assert layout.nbytes == expected
        self.check_reads(parts, held)

    def trim(self, counts: list[int]) -> None:
        """Trim as the shadow may (a ring forgets only what it keeps its window before):
        a refusal of the shadow's is the layout's and the twin's, with its message."""
        try:
            self.shadow.trim_rows(counts)
        except NotTrimmableError as refused:
            before = self.look()
            for layout in (self.layout, self.twin):
                with pytest.raises(NotTrimmableError) as again:
                    layout.trim_rows(counts)
                assert str(again.value) == str(refused)
            self.unchanged(before)
        else:
            self.layout.trim_rows(counts)
            self.twin.trim_rows(counts)
            for request, count in zip(self.requests, counts, strict=True):
                request.trimmed(count)
        self.check()


@pytest.mark.parametrize("keep", [0, 2])
def test_ring_rows_of_two_stages_hold_what_each_stage_layout_holds(keep: int) -> None:
    """Per-row stages over the ragged ring's stage stores (contract §0.4, §0.5): rows of
    both codecs and of lengths past the window join in their codec's stage; some rows
    convert; appends (single tokens and blocks, past the window), filters, merges, trims
    and extractions act on rows of any stage. After every step each row's window reads
    what the public one-stage ring of its codec holding the stage's rows reads, the
    offsets, retained columns and masks are a one-stage ring's and the reference twin's,
    the bytes are each store's slots at the layout's columns, a mixed read is refused, and
    refusals change nothing."""
    staged = _StagedRing(seed=3, keep=keep)
    staged.join([(0, 5), (0, 3), (0, 10)])
    staged.convert([2, 0, 2])
    staged.refusals()
    staged.append(2)
    staged.append(1)
    staged.join([(1, 6), (0, 2), (1, 9)])
    staged.refusals()
    staged.append(4)
    staged.trim([1, 0, 2, 1, 0, 1])
    staged.filter([4, 1, 0, 3])
    staged.extract(0)
    staged.extract(1)
    for _ in range(3):
        staged.append(1)
    staged.convert([0, 1])  # every plain row: one store again
    assert staged.layout._stores is None
    staged.append(3)
    staged.join([(0, 4)])
    staged.filter([4, 0])
    staged.extract(1)
    staged.filter([])


@profile_settings(max_examples=max(5, active_profile().max_examples // 10))
@given(data=st.data())
def test_drawn_operations_on_ring_rows_of_two_stages(data: st.DataObject) -> None:
    """A drawn sequence of the operations above on random ragged ring rows, checked after
    every step against the oracle and the twin."""
    sinks = data.draw(st.integers(0, 2), label="keep")
    staged = _StagedRing(seed=data.draw(st.integers(0, 2**16), label="seed"), keep=sinks)
    drawn_steps(
        staged,
        data,
        longest=11,
        trim=lambda requests: [data.draw(st.integers(0, min(r.offset, 3))) for r in requests],
    )
