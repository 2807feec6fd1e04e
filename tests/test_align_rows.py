"""``align_rows`` on the ragged growing layouts (``BatchedKVCache``,
``BatchedQuantizedKVCache``), both implementations (``spec/BatchedKVCache.md`` §3).

Oracles: the other implementation (bit for bit), a NumPy image built from each row's
extracted serial planes placed at the new pads (zero padding), the mask formula
``pads[b] <= j <= end[b] + i``, and a solo replay (the extracted row's serial storage
that took the same next block) for the append after an alignment.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvrows.optimized as O
import kvrows.reference as R
from kvrows.compositions import composition
from kvrows.conformance.arrays import as_numpy, random_block, to_mlx
from kvrows.conformance.profiles import profile_settings
from kvrows.errors import InvalidInputError, KvRowsError, SpeculativeRoundError

IMPLS = (R, O)
HEADS, DIM = 2, 32
#: (bits, group_size) of the affine codec, or ``None`` for plain storage.
CODECS: tuple[tuple[int, int] | None, ...] = (None, (4, 32), (8, 32))
DTYPES = ("float16", "bfloat16")

Planes = tuple[npt.NDArray[Any], ...]


def _layout(impl: ModuleType, codec: tuple[int, int] | None) -> Any:
    if codec is None:
        return impl.BatchedKVCache()
    bits, group = codec
    return impl.BatchedQuantizedKVCache(group, bits)


def _serial(impl: ModuleType, codec: tuple[int, int] | None) -> Any:
    if codec is None:
        return impl.KVCache()
    bits, group = codec
    return impl.QuantizedKVCache(group, bits)


def _feed(impl: ModuleType, cache: Any, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> Any:
    if impl is O:
        return cache.update_and_fetch(to_mlx(keys), to_mlx(values))
    return cache.update_and_fetch(keys, values)


def _planes(read: Any) -> Planes:
    """A fetched keys or values read (an array, or an affine triple) as NumPy planes."""
    return tuple(as_numpy(p) for p in (read if isinstance(read, tuple) else (read,)))


def _bytes(planes: Planes) -> list[bytes]:
    return [np.ascontiguousarray(p).tobytes() for p in planes]


def _same(a: Planes, b: Planes) -> bool:
    return all(
        x.shape == y.shape and x.dtype == y.dtype and xb == yb
        for x, y, xb, yb in zip(a, b, _bytes(a), _bytes(b), strict=True)
    )


def _same_row(a: tuple[Planes, Planes] | None, b: tuple[Planes, Planes] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return _same(a[0], b[0]) and _same(a[1], b[1])


def _row_planes(layout: Any, row: int) -> tuple[Planes, Planes] | None:
    """Row ``row``'s extracted serial planes (``None`` when it holds no token)."""
    serial = layout.extract_row(row)
    if serial.offset == 0:
        return None
    keys, values = serial.fetch()
    return _planes(keys), _planes(values)


def _image(rows: list[tuple[Planes, Planes] | None], pads: list[int], which: int) -> Planes:
    """The read a layout must return: row ``b``'s planes at ``[pads[b], …)``, zeros elsewhere."""
    lengths = [0 if r is None else int(r[which][0].shape[2]) for r in rows]
    width = max(p + t for p, t in zip(pads, lengths, strict=True))
    like = next(r[which] for r in rows if r is not None)
    out = tuple(np.zeros((len(rows), HEADS, width, p.shape[3]), dtype=p.dtype) for p in like)
    for b, (row, pad, length) in enumerate(zip(rows, pads, lengths, strict=True)):
        if row is not None:
            for dst, src in zip(out, row[which], strict=True):
                dst[b, :, pad : pad + length] = src[0]
    return out


def _covered_only(planes: Planes, pads: list[int], offsets: tuple[int, ...]) -> Planes:
    """``planes`` with the columns outside every row's span zeroed."""
    columns = np.arange(int(planes[0].shape[2]))[None, :]
    start, count = np.array(pads)[:, None], np.array(offsets)[:, None]
    covered = ((columns >= start) & (columns < start + count))[:, None, :, None]
    return tuple(np.where(covered, p, np.zeros((), dtype=p.dtype)) for p in planes)


def _expected_mask(pads: list[int], offsets: tuple[int, ...], n: int) -> npt.NDArray[np.bool_]:
    ends = np.array([p + t for p, t in zip(pads, offsets, strict=True)])[:, None, None, None]
    columns = np.arange(int(ends.max()) + n)[None, None, None, :]
    queries = ends + np.arange(n)[None, None, :, None]
    visible: npt.NDArray[np.bool_] = (columns <= queries) & (
        columns >= np.array(pads)[:, None, None, None]
    )
    return visible


def _build(
    codec: tuple[int, int] | None,
    dtype: str,
    lengths: list[int],
    extra: int,
    trims: list[int],
    seed: int,
) -> tuple[Any, Any]:
    """The same ragged layout in both implementations: rows of ``lengths`` tokens merged,
    ``extra`` tokens appended to every row, then row ``b`` trimmed by ``trims[b]`` (so rows
    end at different columns and the optimized planes hold stale bytes past some ends)."""
    rng = np.random.default_rng(seed)
    blocks = [
        (random_block(rng, (1, HEADS, t, DIM), dtype), random_block(rng, (1, HEADS, t, DIM), dtype))
        for t in lengths
    ]
    step = (
        random_block(rng, (len(lengths), HEADS, extra, DIM), dtype),
        random_block(rng, (len(lengths), HEADS, extra, DIM), dtype),
    )
    built = []
    for impl in IMPLS:
        sources = []
        for keys, values in blocks:
            serial = _serial(impl, codec)
            if keys.shape[2]:
                _feed(impl, serial, keys, values)
            sources.append(serial)
        layout = _layout(impl, codec)
        layout.merge_rows(sources)
        if extra:
            _feed(impl, layout, *step)
        layout.trim_rows([min(c, t) for c, t in zip(trims, layout.row_offsets, strict=True)])
        built.append(layout)
    return built[0], built[1]


@st.composite
def _scenarios(draw: st.DrawFn) -> tuple[list[int], int, list[int], list[int], int]:
    rows = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 9), min_size=rows, max_size=rows))
    if not any(lengths):
        lengths[0] = 1
    extra = draw(st.integers(0, 3))
    trims = draw(st.lists(st.integers(0, 4), min_size=rows, max_size=rows))
    trims[lengths.index(max(lengths))] = 0  # some row keeps a token (the image has a dtype)
    raw = draw(st.lists(st.integers(0, 12), min_size=rows, max_size=rows))
    pads = [p - min(raw) for p in raw]
    return lengths, extra, trims, pads, draw(st.integers(0, 2**16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS, ids=["plain", "affine4", "affine8"])
@given(scenario=_scenarios())
@profile_settings(max_examples=25)
def test_align_rows_relays_rows_bit_exactly(
    codec: tuple[int, int] | None,
    dtype: str,
    scenario: tuple[list[int], int, list[int], list[int], int],
) -> None:
    lengths, extra, trims, pads, seed = scenario
    ref, opt = _build(codec, dtype, lengths, extra, trims, seed)
    offsets, before = ref.row_offsets, ref.left_pad
    assert opt.row_offsets == offsets and opt.left_pad == before
    rows = {
        impl: [_row_planes(lay, b) for b in range(len(offsets))]
        for impl, lay in ((R, ref), (O, opt))
    }
    for ref_row, opt_row in zip(rows[R], rows[O], strict=True):
        assert _same_row(ref_row, opt_row)

    for layout in (ref, opt):
        layout.align_rows(pads)
        layout.check_valid()
        assert layout.left_pad == tuple(pads) and layout.row_offsets == offsets

    width = max(p + t for p, t in zip(pads, offsets, strict=True))
    reads = {impl: [_planes(r) for r in lay.fetch()] for impl, lay in ((R, ref), (O, opt))}
    if tuple(pads) == before:
        # A no-op: columns no row covers stay unspecified (stale bytes of trimmed tokens).
        reads[O] = [_covered_only(planes, pads, offsets) for planes in reads[O]]
    for which in (0, 1):  # keys, values
        expected = _image(rows[R], pads, which)
        assert expected[0].shape[2] == width
        assert _same(reads[R][which], expected)
        assert _same(reads[O][which], expected)

    for n in (1, 3):
        want = _expected_mask(pads, offsets, n)
        ref_mask = np.asarray(ref.make_mask(n, return_array=True))
        opt_mask = as_numpy(opt.make_mask(n, return_array=True))
        assert np.array_equal(ref_mask, want) and np.array_equal(opt_mask, want)

    for impl, layout in ((R, ref), (O, opt)):  # extraction is unchanged
        for row, held in enumerate(rows[impl]):
            assert _same_row(_row_planes(layout, row), held)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", CODECS, ids=["plain", "affine4", "affine8"])
def test_an_append_after_align_lands_after_each_row_end(
    codec: tuple[int, int] | None, dtype: str
) -> None:
    """Solo replay: row ``b``'s read after the append equals the extracted row (taken
    before the alignment) that appended the same tokens, placed at ``pads[b]``."""
    ref, opt = _build(codec, dtype, [5, 2, 7], 2, [1, 0, 3], seed=3)
    pads = [0, 6, 1]
    rng = np.random.default_rng(11)
    block = (
        random_block(rng, (3, HEADS, 2, DIM), dtype),
        random_block(rng, (3, HEADS, 2, DIM), dtype),
    )
    replayed: dict[ModuleType, list[tuple[Planes, Planes] | None]] = {}
    for impl, layout in ((R, ref), (O, opt)):
        solos: list[tuple[Planes, Planes] | None] = []
        for b in range(layout.batch_size):
            solo = layout.extract_row(b)
            keys, values = _feed(impl, solo, block[0][b : b + 1], block[1][b : b + 1])
            solos.append((_planes(keys), _planes(values)))
        replayed[impl] = solos
        layout.align_rows(pads)
        _feed(impl, layout, *block)
        layout.check_valid()
    assert ref.row_offsets == opt.row_offsets == (8, 6, 8)  # (6, 4, 6) + 2
    for which in (0, 1):
        ref_read = _planes(ref.fetch()[which])
        opt_read = _planes(opt.fetch()[which])
        assert ref_read[0].shape[2] == 6 + 6  # max(pad + offset)
        assert _same(ref_read, _image(replayed[R], pads, which))
        assert _same(opt_read, _image(replayed[O], pads, which))
        assert _same(ref_read, opt_read)


def _snapshot(layout: Any) -> tuple[Any, ...]:
    reads = tuple(tuple(_bytes(_planes(r))) for r in layout.fetch())
    return layout.row_offsets, layout.left_pad, reads


@pytest.mark.parametrize("impl", IMPLS, ids=["reference", "optimized"])
@pytest.mark.parametrize("codec", [None, (4, 32)], ids=["plain", "affine4"])
def test_bad_pads_raise_and_change_nothing(impl: ModuleType, codec: tuple[int, int] | None) -> None:
    layout = _build(codec, "float16", [3, 5], 0, [0, 0], seed=5)[IMPLS.index(impl)]
    before = _snapshot(layout)
    assert layout.left_pad == (2, 0)
    bad: list[tuple[object, str]] = [
        ("02", "sequence of integers"),
        (b"\x00\x02", "sequence of integers"),
        (2, "sequence of integers"),
        (np.array([0, 2]), "sequence of integers"),
        ([0], "needs 2 left pads"),
        ([0, 1, 2], "needs 2 left pads"),
        ([0, 1.0], "must be an integer"),
        ([True, 0], "bool"),
        ([0, None], "must be an integer"),
        ([0, -1], "must be >= 0"),
        ([1, 2], "some row must start at column 0"),
    ]
    for pads, message in bad:
        with pytest.raises(InvalidInputError, match=message):
            layout.align_rows(pads)
        assert _snapshot(layout) == before, pads
    layout.check_valid()
    layout.align_rows((np.int64(0), np.int64(4)))  # integers of any kind are taken
    assert layout.left_pad == (0, 4)


@pytest.mark.parametrize("impl", IMPLS, ids=["reference", "optimized"])
def test_refused_in_a_speculative_round(impl: ModuleType) -> None:
    layout = _build(None, "float16", [3, 5], 0, [0, 0], seed=7)[IMPLS.index(impl)]
    layout.spec_round_begin()
    block = random_block(np.random.default_rng(1), (2, HEADS, 2, DIM), "float16")
    _feed(impl, layout, block, block)
    before = _snapshot(layout)
    with pytest.raises(SpeculativeRoundError, match="align_rows in the middle of a speculative"):
        layout.align_rows([0, 1])
    assert _snapshot(layout) == before
    layout.spec_round_rollback([1, 2])
    layout.align_rows([0, 1])
    assert layout.left_pad == (0, 1) and layout.row_offsets == (4, 7)


@pytest.mark.parametrize("impl", IMPLS, ids=["reference", "optimized"])
def test_empty_layout_takes_only_no_pads(impl: ModuleType) -> None:
    layout = impl.BatchedKVCache()
    layout.align_rows(())
    layout.align_rows([])
    assert layout.batch_size == 0 and layout.left_pad == ()
    with pytest.raises(InvalidInputError, match="needs 0 left pads"):
        layout.align_rows([0])
    layout.check_valid()


def test_current_pads_are_a_no_op_and_a_move_copies_once() -> None:
    """Optimized internals: equal pads keep the planes; a move builds fresh ones at
    origin 0 with a spare slot and a spare column."""
    opt = _build((4, 32), "bfloat16", [6, 2, 4], 1, [0, 0, 2], seed=9)[1]
    opt.filter_rows([1, 2])  # the shared padding moves the origin
    assert opt._origin > 0
    planes = opt._planes
    opt.align_rows(opt.left_pad)
    assert opt._planes is planes
    opt.align_rows([3, 0])
    assert opt._planes is not planes and opt._origin == 0
    assert opt.slots > opt.batch_size and opt.capacity > opt.width == 6


def test_only_the_ragged_growing_layouts_have_it() -> None:
    for impl in IMPLS:
        assert callable(impl.BatchedKVCache.align_rows)
        assert callable(impl.BatchedQuantizedKVCache.align_rows)
        for name in (
            "PaddedKVRows",
            "PaddedQuantKVRows",
            "BatchedRotatingCache",
            "RaggedRotatingRows",
            "SpeculativeRotatingKVCache",
            "SpeculativeRotatingAffineLayout",
            "KVCache",
        ):
            assert not hasattr(getattr(impl, name), "align_rows"), (impl.__name__, name)
    # The mixin refuses a shared-column composition before the class is registered.
    with pytest.raises(KvRowsError, match="ragged growing layouts only"):

        class SharedAligned(R.BatchedKVCache):
            composition = composition("PaddedKVRows")

    with pytest.raises(KvRowsError, match="ragged growing layouts only"):

        class RingAligned(O.BatchedKVCache):
            composition = composition("SpeculativeRotatingKVCache")


def test_mlx_planes_stay_mlx() -> None:
    opt = _build(None, "float16", [2, 3], 0, [0, 0], seed=2)[1]
    opt.align_rows([2, 0])
    keys, _ = opt.fetch()
    assert isinstance(keys, mx.array) and keys.shape == (2, HEADS, 4, DIM)
