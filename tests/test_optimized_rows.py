"""The optimized row machinery: composition plumbing and the issue-8 defects, each with a test.

Self-merge refused, one message for an empty fetch, extracted rows that own compact
evaluated arrays (active memory), ``offset`` cached until the next change, and caches that
never keep or write into the caller's arrays.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as kv
from kvrows.codec import Codec
from kvrows.compositions import composition, landed
from kvrows.delayed import DelayedRows
from kvrows.errors import (
    EMPTY_LAYOUT_UPDATE,
    NOTHING_TO_FETCH,
    IncompatibleRowsError,
    InvalidInputError,
    LayoutStateError,
    NotTrimmableError,
    self_merge_message,
)
from kvrows.optimized.rows import DECLARED, Layout, Serial
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
    values |= {"k_bits": 4, "v_bits": 2}
    return tuple(values[p] for p in composition(name).params)


def _serial(name: str, tokens: int, seed: int = 0) -> Serial:
    entry = composition(name)
    serial = entry.serial or entry.name
    if "delayed" in entry.modifiers:  # its rows arrive plain and convert at their start
        cache = CLASSES[name].lego_class.plain_class(
            *_args(serial)[:1] if "max_size" in entry.params else ()
        )
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
    }
    for name in delayed:  # two groups of row storages (kvrows.delayed), no storage itself
        layout_cls = getattr(kv, name)
        assert layout_cls is CLASSES[name] and layout_cls.composition is composition(name)
        assert issubclass(layout_cls, DelayedRows) and name not in DECLARED
        layout = layout_cls(*_args(name))
        assert layout.signature() == composition(name).signature.format(
            start=5, **layout.codec_spec.parameters(), **layout.token_geometry.parameters()
        )
        built = layout_cls.from_specs(layout.codec_spec, layout.token_geometry, start=5)
        assert type(built) is layout_cls and built.signature() == layout.signature()
    # The paged placement (optimized/paging.py): the row machinery over block tables; built
    # from a pool or keyword arguments (kvrows.paged.bind_paged), not from_specs.
    paged = {c.name for c in KV_LANDED if c.geometry == "paged"}
    for name in paged:
        assert CLASSES[name] is getattr(kv, name) is DECLARED[name]
        assert issubclass(CLASSES[name], Layout if composition(name).is_layout else Serial)
    recurrent = {c.name for c in landed() if c.geometry == "recurrent"}  # the state geometry
    # The latent codec on the growing geometry (the encoded one still has its own rows).
    latent = {"MLACache"}
    assert sorted(DECLARED) == sorted(
        [*(c.name for c in KV_LANDED if c.name not in delayed), *recurrent, *latent]
    )
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
        assert hasattr(instance, "bits") == (entry.codec == "affine")
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


# Not the delayed layouts: their ``offset`` is built from the groups' rows on each read
# (kvrows.delayed), not a cached array of the row machinery.
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n in DECLARED])
def test_offset_is_cached_until_the_next_change(name: str) -> None:
    layout = DECLARED[name](*_args(name))
    assert isinstance(layout, Layout)
    layout.merge_rows([_serial(name, 3, seed=1), _serial(name, 5, seed=2)])
    first = layout.offset
    assert layout.offset is first and first.tolist() == [3, 5]
    block = _block(2, 1)
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
    """The stage hook on a layout of two stages (contract §0.5), twin against twin: rows
    that would leave the storage in two stages are refused with nothing changed (reads,
    offsets, pads, bytes, stage), no row changes nothing, and every row moves together to
    what a layout of the target codec fed the same tokens holds (reads and bytes)."""
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
        # The reference converts rows one by one (contract §0.5's per-row stages).
        for rows in ([0], [0, 2], [1, 1]) if impl is kv else ():
            with pytest.raises(LayoutStateError, match="convert together"):
                layout._convert_rows(rows)
            assert same(seen(layout), before)
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
