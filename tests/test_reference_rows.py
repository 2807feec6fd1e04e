"""The reference's row machinery: one class per arrangement over the geometry's hooks, the
composition table's interface, and the defects issue 8 fixed (self-merge, one message)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

import kvrows.reference as reference
from kvrows.codec import DTYPE_SIZES, Codec, PlaneSpec
from kvrows.compositions import composition, landed, register_compositions
from kvrows.delayed import DelayedLayout
from kvrows.errors import (
    EMPTY_LAYOUT_UPDATE,
    NOTHING_TO_FETCH,
    IncompatibleRowsError,
    KvRowsError,
    LayoutStateError,
    NotTrimmableError,
    self_merge_message,
)
from kvrows.lego import Bf16First
from kvrows.reference.classes import _checked, declared_classes
from kvrows.reference.rows import RowLayout, SerialStorage
from kvrows.schemes import Affine, Growing, Plain, Ring
from kvrows.validation import KvGeometry

RNG = np.random.default_rng(11)
#: Token KV storages (latent and recurrent state have their own row machinery:
#: tests/test_latent.py, tests/test_recurrent.py).
KV_LANDED = [
    c for c in landed() if c.geometry not in ("latent", "recurrent") and c.codec != "latent"
]  # (and the paged latent: tests/test_paged_latent.py)
LAYOUTS = [c.name for c in KV_LANDED if c.is_layout]
SERIALS = [c.name for c in KV_LANDED if not c.is_layout]


def _args(name: str) -> tuple[int, ...]:
    return (6,) if composition(name).geometry in ("ring", "chunked") else ()


def _make(name: str) -> Any:
    # A delayed layout's rows convert from their fifth token (rows of 3 and 5: mixed).
    start = {"start": 5} if "delayed" in composition(name).modifiers else {}
    return getattr(reference, name)(*_args(name), **start)


def _block(rows: int, tokens: int, dim: int = 64) -> npt.NDArray[Any]:
    return RNG.standard_normal((rows, 2, tokens, dim)).astype(np.float16)


def _serial(layout: Any, tokens: int) -> Any:
    if isinstance(layout, DelayedLayout):  # its rows arrive plain
        cache = layout.lego_class.plain_class.from_specs(Plain(), layout.token_geometry)
    else:
        cache = layout.serial_class.from_specs(layout.codec_spec, layout.token_geometry)
    if tokens:
        block = _block(1, tokens)
        cache.update_and_fetch(block, block)
    return cache


def test_every_landed_composition_is_one_declared_class() -> None:
    classes = declared_classes()
    assert sorted(classes) == sorted(c.name for c in landed())
    for name, cls in classes.items():
        assert cls is getattr(reference, name)
        assert cls.composition is composition(name)
        if "delayed" in cls.composition.modifiers and not cls.composition.is_layout:
            # A lego: the delayed modifier's serial mixin over a serial storage of two stages.
            assert issubclass(cls, Bf16First) and issubclass(cls, SerialStorage)
            sizes = {p: 8 for p in ("max_size", "chunk_size") if p in cls.composition.params}
            lego = cls(**sizes)  # a ring's window, a chunk; the codec's defaults
            assert lego.stages == (Plain(), lego.quantization) and lego.codec_spec == Plain()
            continue
        if "delayed" in cls.composition.modifiers:  # a layout of two stages
            assert issubclass(cls, DelayedLayout) and issubclass(cls, RowLayout)
            assert issubclass(cls.plain_group_class, RowLayout)
            assert issubclass(cls.affine_group_class, RowLayout)
            continue
        if cls.composition.geometry in ("latent", "recurrent") or cls.composition.codec == "latent":
            continue
        assert issubclass(cls, RowLayout) == composition(name).is_layout
        assert issubclass(cls, SerialStorage) != composition(name).is_layout


def test_the_delayed_modifier_is_checked() -> None:
    class Misdeclared(reference.DelayedQuantizedKVCache):
        composition = composition("DelayedRotatingQuantizedKVCache")

    with pytest.raises(KvRowsError, match="delayed modifier"):
        _checked(Misdeclared)
    with pytest.raises(KvRowsError, match="plain and an affine ragged ring group"):
        register_compositions({**declared_classes(), Misdeclared.composition.name: Misdeclared})


def test_delayed_signature_and_specs() -> None:
    for name in ("DelayedQuantizedKVCache", "DelayedRotatingQuantizedKVCache"):
        cache = _make(name)
        assert cache.signature() == composition(name).signature.format(
            start=5, **cache.codec_spec.parameters(), **cache.token_geometry.parameters()
        )
        geometry = KvGeometry(2, 64, 64, "float16")
        again = type(cache).from_specs(
            cache.codec_spec, cache.token_geometry, geometry=geometry, start=5
        )
        assert again.signature() == cache.signature() and again.geometry == geometry
        with pytest.raises(LayoutStateError):
            cache.projected_bytes(1)


# The row storages' interface (plane specs); the delayed layouts hold no planes themselves.
@pytest.mark.parametrize("name", [c.name for c in KV_LANDED if "delayed" not in c.modifiers])
def test_specs_signature_and_planes(name: str) -> None:
    cache = _make(name)
    entry = composition(name)
    assert cache.signature() == entry.signature_for(cache.codec_spec, cache.token_geometry)
    assert isinstance(cache.codec, Codec)
    assert cache.plane_specs() == ()
    geometry = KvGeometry(2, 64, 64, "float16")
    again = type(cache).from_specs(cache.codec_spec, cache.token_geometry, geometry=geometry)
    assert again.signature() == cache.signature() and again.geometry == geometry
    specs = again.plane_specs()
    assert all(isinstance(p, PlaneSpec) and p.token_axis == 2 for p in specs)
    # plain: K, V; affine: codes, scales, biases each; TurboQuant: 3 + 2; microscaling: 2 + 2.
    assert len(specs) == {"plain": 2, "affine": 6, "turbo": 5, "mx": 4}[cache.codec_spec.kind]
    if entry.is_layout:
        stored = min(10, 6) if entry.geometry in ("ring", "chunked") else 10  # a cap of 6
        if entry.placement == "paged":  # whole blocks
            stored = -(-10 // again.block_size) * again.block_size
        per_token = 2 * sum(DTYPE_SIZES[p.dtype] * p.width for p in specs)  # 2 heads
        assert again.projected_bytes(10) == stored * per_token
        with pytest.raises(LayoutStateError):
            cache.projected_bytes(1)


def test_constructor_forms_agree() -> None:
    assert reference.QuantizedKVCache(32, 4).codec_spec == Affine(bits=4, group_size=32)
    assert reference.QuantizedKVCache(codec=Affine(bits=4, group_size=32)).bits == 4
    ring = reference.RotatingQuantizedKVCache(8, 32, 4)
    assert (ring.max_size, ring.keep, ring.group_size, ring.bits) == (8, 0, 32, 4)
    assert ring.token_geometry == Ring(max_size=8)
    assert reference.KVCache().codec_spec == Plain()
    assert reference.BatchedKVCache().token_geometry == Growing()
    assert not hasattr(reference.KVCache(), "bits")
    assert not hasattr(reference.PaddedKVRows(), "max_size")


@pytest.mark.parametrize("name", LAYOUTS)
def test_self_merge_raises_and_changes_nothing(name: str) -> None:
    layout = _make(name)
    first, second = _serial(layout, 3), _serial(layout, 5)
    layout.merge_rows([first, second])
    before = (layout.row_offsets, layout.left_pad, [p.copy() for p in layout.held_arrays()])
    for sources in ([layout], [first, layout], [first, first]):
        with pytest.raises(IncompatibleRowsError) as caught:
            layout.merge_rows(sources)
        assert str(caught.value) == self_merge_message(layout.signature())
        assert (layout.row_offsets, layout.left_pad) == before[:2]
        assert all(
            np.array_equal(a, b) for a, b in zip(layout.held_arrays(), before[2], strict=True)
        )
    assert layout.batch_size == 2 and first.offset == 3


@pytest.mark.parametrize("name", LAYOUTS)
def test_one_message_for_an_empty_layout(name: str) -> None:
    layout = _make(name)
    with pytest.raises(LayoutStateError, match=NOTHING_TO_FETCH):
        layout.fetch()
    block = _block(1, 1)
    with pytest.raises(LayoutStateError, match=EMPTY_LAYOUT_UPDATE):
        layout.update_and_fetch(block, block)
    layout.merge_rows([_serial(layout, 0)])  # rows, but no token and no geometry yet
    with pytest.raises(LayoutStateError, match=NOTHING_TO_FETCH):
        layout.fetch()


@pytest.mark.parametrize("name", SERIALS)
def test_one_message_for_an_empty_serial_cache(name: str) -> None:
    with pytest.raises(LayoutStateError, match=NOTHING_TO_FETCH):
        _make(name).fetch()


@pytest.mark.parametrize("name", SERIALS)
def test_a_serial_cache_is_the_one_row_case(name: str) -> None:
    """Two rows appended together read as the rows appended apart, stacked."""
    together = _make(name)
    apart = [_make(name), _make(name)]
    for tokens in (4, 1, 5, 1, 1):
        block = _block(2, tokens)
        got = together.update_and_fetch(block, block)
        parts = [
            c.update_and_fetch(block[b : b + 1], block[b : b + 1]) for b, c in enumerate(apart)
        ]
        for whole, *rows in zip(
            got if isinstance(got[0], tuple) else (got,),
            *(p if isinstance(p[0], tuple) else (p,) for p in parts),
            strict=True,
        ):
            assert np.array_equal(np.asarray(whole[0]), np.concatenate([r[0] for r in rows]))
    assert together.offset == apart[0].offset == 12
    together.check_valid()


def test_shared_ring_trims_together_and_attention_keeps_the_queries_dtype() -> None:
    layout = reference.BatchedRotatingQuantCache(8, 64, 4)
    first, second = _serial(layout, 3), _serial(layout, 3)
    layout.merge_rows([first, second])
    with pytest.raises(NotTrimmableError):
        layout.trim_rows([1, 2])
    assert layout.trim_rows([1, 1]) == 1 and layout.row_offsets == (2, 2)
    queries = _block(2, 1).astype(np.float32)
    block = _block(2, 1)
    layout.update_and_fetch(block, block)
    out = reference.attend(queries, layout, None, 0.125)
    assert out.dtype == np.float32 and out.shape == (2, 2, 1, 64)


# Paged rows share their pool's planes by design (extraction moves no byte); that an
# extracted row keeps its KV while the layout writes is the pool machine's invariant
# (tests/test_paged_pool.py).
@pytest.mark.parametrize("name", [n for n in LAYOUTS if composition(n).placement != "paged"])
def test_rows_own_their_arrays(name: str) -> None:
    """Neither the caller's blocks nor an extracted row share memory with the layout."""
    layout = _make(name)
    layout.merge_rows([_serial(layout, 6), _serial(layout, 6)])
    block = _block(2, 6)
    layout.update_and_fetch(block, block)
    extracted = layout.extract_row(0)
    before = [p.copy() for p in layout.held_arrays()]
    held = [p.copy() for p in extracted.held_arrays()]
    block[...] = 0
    assert all(np.array_equal(a, b) for a, b in zip(layout.held_arrays(), before, strict=True))
    step = _block(2, 1)
    layout.update_and_fetch(step, step)
    for array in extracted.held_arrays():
        assert not any(np.shares_memory(array, p) for p in layout.held_arrays())
    assert all(np.array_equal(a, b) for a, b in zip(extracted.held_arrays(), held, strict=True))
