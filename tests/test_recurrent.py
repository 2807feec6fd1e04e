"""SSMCache and BatchedSSMCache in both implementations (``spec/SSMCache.md``,
``spec/BatchedSSMCache.md``): the layer-driven update against the reference, rows against
their solo runs, snapshot + replay rollback bit for bit against a run that saw only the
accepted tokens, and bad inputs that raise and change nothing."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.conformance.arrays import from_mlx, to_mlx
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    NotTrimmableError,
    RowIndexError,
    SpeculativeRoundError,
)
from kvrows.optimized import recurrent as opt_rec
from kvrows.recurrent import StateShapes
from kvrows.reference import recurrent as ref_rec
from kvrows.table import owned_cache_layout, prefill_cache_layout, publish_row, target_cache_layout

HK, DK, HV, DV, K = 1, 8, 2, 4, 4
C = 2 * HK * DK + HV * DV
BF16 = ml_dtypes.bfloat16


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _params(seed: int = 0) -> tuple[ref_rec.GatedDeltaParams, opt_rec.GatedDeltaParams]:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((C, K)).astype(np.float32) * 0.5
    a_log = rng.standard_normal(HV).astype(np.float32) * 0.3
    dt_bias = rng.standard_normal(HV).astype(np.float32) * 0.3
    dims = (HK, DK, HV, DV)
    return (
        ref_rec.GatedDeltaParams(w, a_log, dt_bias, *dims),
        opt_rec.GatedDeltaParams(mx.array(w), mx.array(a_log), mx.array(dt_bias), *dims),
    )


def _inputs(rng: np.random.Generator, rows: int, n: int) -> tuple[np.ndarray, ...]:
    qkv = rng.standard_normal((rows, n, C)).astype(BF16)
    a = rng.standard_normal((rows, n, HV)).astype(BF16)
    b = rng.standard_normal((rows, n, HV)).astype(BF16)
    return qkv, a, b


IMPLS = ("reference", "optimized")


class Side:
    """One implementation: its classes, its layer and its arrays."""

    def __init__(self, name: str) -> None:
        self.name = name
        p_ref, p_opt = _params()
        self.module: Any = ref if name == "reference" else opt
        self.forward: Any = (
            ref_rec.gated_delta_forward if name == "reference" else opt_rec.gated_delta_forward
        )
        self.params: Any = p_ref if name == "reference" else p_opt

    def give(self, array: np.ndarray) -> Any:
        return np.array(array, copy=True) if self.name == "reference" else to_mlx(array)

    def run(self, cache: Any, inputs: tuple[np.ndarray, ...]) -> Any:
        return self.forward(self.params, cache, *(self.give(x) for x in inputs))

    @staticmethod
    def np(array: Any) -> np.ndarray:
        return from_mlx(array) if isinstance(array, mx.array) else np.asarray(array)


def _planes(side: Side, cache: Any) -> tuple[np.ndarray, np.ndarray]:
    return side.np(cache[0]), side.np(cache[1])


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _solo(side: Side, blocks: list[tuple[np.ndarray, ...]]) -> Any:
    cache = side.module.SSMCache()
    for block in blocks:
        side.run(cache, block)
    return cache


def test_serial_layer_matches_the_reference() -> None:
    rng = np.random.default_rng(1)
    blocks = [_inputs(rng, 1, n) for n in (5, 1, 1, 3)]
    caches = {name: _solo(Side(name), blocks) for name in IMPLS}
    r_conv, r_state = _planes(Side("reference"), caches["reference"])
    o_conv, o_state = _planes(Side("optimized"), caches["optimized"])
    assert _bits_equal(r_conv, o_conv)  # the conv plane is copied inputs: exact
    assert r_conv.dtype == BF16 and r_state.dtype == np.float32
    np.testing.assert_allclose(r_state, o_state, rtol=1e-5, atol=1e-6)
    assert caches["reference"].offset == caches["optimized"].offset == 10
    assert r_conv.shape == (1, K - 1, C) and r_state.shape == (1, HV, DV, DK)


@pytest.mark.parametrize("impl", IMPLS)
def test_padded_prefill_rows_equal_their_solo_runs(impl: str) -> None:
    side = Side(impl)
    rng = np.random.default_rng(2)
    lengths = [6, 2, 0, 4]
    block = _inputs(rng, 4, 6)
    layout = side.module.BatchedSSMCache()
    layout.merge_rows([side.module.SSMCache() for _ in lengths])
    layout.prepare(lengths=lengths, right_padding=[6 - n for n in lengths])
    side.run(layout, block)
    layout.finalize()
    assert layout.row_offsets == tuple(lengths)
    layout.check_valid()
    for b, n in enumerate(lengths):
        solo = _solo(side, [tuple(x[b : b + 1, :n] for x in block)] if n else [])
        row = layout.extract_row(b)
        if n == 0:
            # a row that saw nothing holds the zero state, as its solo cache (which holds none)
            assert not np.any(_planes(side, row)[1]) and row.offset == 0
            continue
        for got, want in zip(_planes(side, row), _planes(side, solo), strict=True):
            assert _bits_equal(got, want), (impl, b)
        assert row.offset == solo.offset == n


@pytest.mark.parametrize("impl", IMPLS)
def test_merge_filter_extract_against_solo_rows(impl: str) -> None:
    side = Side(impl)
    rng = np.random.default_rng(3)
    blocks = [[_inputs(rng, 1, n)] for n in (3, 7, 1)]
    solos = [_solo(side, bl) for bl in blocks]
    empty = side.module.SSMCache()
    layout: Any = owned_cache_layout(solos[0])
    assert type(layout).__name__ == "BatchedSSMCache"
    layout.merge_rows([solos[0], empty])
    layout.merge_rows([solos[1], solos[2]])
    assert layout.row_offsets == (3, 0, 7, 1) and layout.group_offset == 7
    # the empty source joined as zero rows of the known geometry
    assert not np.any(_planes(side, layout)[1][1])
    # a decode step for every row, then the same step solo
    step = _inputs(rng, 4, 1)
    side.run(layout, step)
    for b, solo in zip((0, 2, 3), (solos[0], solos[1], solos[2]), strict=True):
        side.run(solo, tuple(x[b : b + 1] for x in step))
        for got, want in zip(
            _planes(side, layout.extract_row(b)), _planes(side, solo), strict=True
        ):
            assert _bits_equal(got[0:1], want)
    # the longest row leaves: the group's offset drops to the survivors' longest
    layout.filter_rows([3, 0])
    assert layout.row_offsets == (2, 4) and layout.group_offset == 4
    extracted = layout.extract_row(1)
    for got, want in zip(_planes(side, extracted), _planes(side, solos[0]), strict=True):
        assert _bits_equal(got, want)
    # extraction is independent of the layout
    before = _planes(side, extracted)
    side.run(layout, _inputs(rng, 2, 1))
    layout.filter_rows([])
    assert layout.batch_size == 0 and layout[0] is None
    assert all(_bits_equal(a, b) for a, b in zip(_planes(side, extracted), before, strict=True))
    assert extracted.offset == 4


@pytest.mark.parametrize("impl", IMPLS)
def test_rollback_replays_bit_identical_to_the_accepted_run(impl: str) -> None:
    side = Side(impl)
    rng = np.random.default_rng(4)
    prompts = [_inputs(rng, 1, n) for n in (4, 2, 5)]
    layout: Any = target_cache_layout(side.module.SSMCache())
    layout.merge_rows([_solo(side, [p]) for p in prompts])
    d = 3
    verify = _inputs(rng, 3, d + 1)
    layout.spec_round_begin()
    side.run(layout, verify)
    assert layout.row_offsets == (8, 6, 9)
    assert not layout.can_publish_row(0, 8)  # unverified tokens
    keep = [1, 4, 2]
    layout.spec_round_rollback(keep)
    assert layout.row_offsets == (5, 6, 7) and not layout.spec_round_open
    for b, (prompt, k) in enumerate(zip(prompts, keep, strict=True)):
        solo = _solo(side, [prompt, tuple(x[b : b + 1, :k] for x in verify)])
        for got, want in zip(
            _planes(side, layout.extract_row(b)), _planes(side, solo), strict=True
        ):
            assert _bits_equal(got, want), (impl, b)
        assert layout.can_publish_row(b, solo.offset)
        assert not layout.can_publish_row(b, solo.offset - 1)
    # a committed round keeps everything; a uniform rollback works too
    layout.spec_round_begin()
    side.run(layout, _inputs(rng, 3, 2))
    layout.spec_round_commit()
    assert layout.row_offsets == (7, 8, 9)
    layout.spec_round_begin()
    side.run(layout, _inputs(rng, 3, 3))
    layout.spec_round_rollback(1)
    assert layout.row_offsets == (8, 9, 10)


def test_rollback_ref_and_opt_agree() -> None:
    rng = np.random.default_rng(5)
    prompt = _inputs(rng, 2, 3)
    verify = _inputs(rng, 2, 4)
    got = []
    for name in IMPLS:
        side = Side(name)
        layout = side.module.BatchedSSMCache()
        layout.merge_rows([side.module.SSMCache(), side.module.SSMCache()])
        side.run(layout, prompt)
        layout.spec_round_begin()
        side.run(layout, verify)
        layout.spec_round_rollback([2, 3])
        got.append(_planes(side, layout))
    assert _bits_equal(got[0][0], got[1][0])
    np.testing.assert_allclose(got[0][1], got[1][1], rtol=1e-5, atol=1e-6)


def _snapshot(side: Side, cache: Any) -> tuple[Any, ...]:
    planes = tuple(None if p is None else side.np(p).tobytes() for p in cache.cache)
    return planes, tuple(getattr(cache, "row_offsets", (cache.offset,)))


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_inputs_raise_and_change_nothing(impl: str) -> None:
    side = Side(impl)
    rng = np.random.default_rng(6)
    serial = _solo(side, [_inputs(rng, 1, 3)])
    layout = side.module.BatchedSSMCache()
    layout.merge_rows([serial, _solo(side, [_inputs(rng, 1, 5)])])
    cases: list[tuple[Any, Any, type[KvRowsError]]] = [
        (serial, lambda c: c.trim(1), NotTrimmableError),
        (layout, lambda c: c.trim(1), NotTrimmableError),
        (
            serial,
            lambda c: c.__setitem__(0, side.give(np.zeros((1, K, C), BF16))),
            InvalidInputError,
        ),
        (
            serial,
            lambda c: c.__setitem__(0, side.give(np.zeros((1, K - 1, C), np.float32))),
            InvalidInputError,
        ),
        (
            serial,
            lambda c: c.__setitem__(1, side.give(np.zeros((2, HV, DV, DK), np.float32))),
            InvalidInputError,
        ),
        (
            serial,
            lambda c: c.__setitem__(2, side.give(np.zeros((1, 2), np.float32))),
            InvalidInputError,
        ),
        (
            layout,
            lambda c: c.__setitem__(1, side.give(np.zeros((2, HV, DK, DV + 1), np.float32))),
            InvalidInputError,
        ),
        (
            layout,
            lambda c: c.__setitem__(
                0, np.zeros((2, K - 1, C)) if impl == "optimized" else mx.zeros((2, K - 1, C))
            ),
            InvalidInputError,
        ),
        (layout, lambda c: c.filter_rows([0, 0]), RowIndexError),
        (layout, lambda c: c.extract_row(2), RowIndexError),
        (layout, lambda c: c.merge_rows([layout]), IncompatibleRowsError),  # contract: self-merge
        (layout, lambda c: c.merge_rows([serial, serial]), IncompatibleRowsError),  # given twice
        (
            layout,
            lambda c: c.merge_rows([(ref if impl == "optimized" else opt).SSMCache()]),
            IncompatibleRowsError,
        ),
        (layout, lambda c: c.prepare(lengths=[1]), InvalidInputError),
        (layout, lambda c: c.update_and_fetch(None, None), InvalidInputError),
        (layout, lambda c: c.spec_round_rollback(1), SpeculativeRoundError),
        (layout, lambda c: c.spec_round_commit(), SpeculativeRoundError),
    ]
    for target, call, error in cases:
        before = _snapshot(side, target)
        with pytest.raises(error):
            call(target)
        assert _snapshot(side, target) == before
    # a geometry clash on merge
    other = side.module.SSMCache()
    other[0] = side.give(np.zeros((1, K - 1, C + 1), BF16))
    before = _snapshot(side, layout)
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([other])
    assert _snapshot(side, layout) == before
    # publishing a cut recurrent row: refused, nothing changes
    assert publish_row(layout, 1, 4) is None and publish_row(layout, 1, 5) is not None
    assert _snapshot(side, layout) == before
    # rollback before the forward recorded its inputs: refused, the round stays open
    layout.spec_round_begin()
    with pytest.raises(SpeculativeRoundError):
        layout.merge_rows([side.module.SSMCache()])
    with pytest.raises(SpeculativeRoundError):
        layout.extract_row(0)
    layout[0] = layout[0]  # a layer writing planes without recording
    layout[1] = layout[1]
    layout.advance(2)
    with pytest.raises(SpeculativeRoundError, match="recorded"):
        layout.spec_round_rollback([1, 2])
    assert layout.spec_round_open and layout.row_offsets == (5, 7)
    layout.spec_round_commit()


@pytest.mark.parametrize("impl", IMPLS)
def test_state_round_trip_and_corrupt_states(impl: str) -> None:
    side = Side(impl)
    rng = np.random.default_rng(7)
    serial = _solo(side, [_inputs(rng, 1, 3)])
    layout = side.module.BatchedSSMCache()
    layout.merge_rows([serial, side.module.SSMCache(), _solo(side, [_inputs(rng, 1, 2)])])
    for cache in (serial, layout, side.module.SSMCache(), side.module.BatchedSSMCache()):
        back = type(cache).from_state(cache.state)
        assert _snapshot(side, back) == _snapshot(side, cache)
        assert back.signature() == cache.signature()
    conv, state, offset = layout.state
    for bad in (
        (offset,),  # no plane
        (conv, state),  # the last field is the offsets: a plane is not one count per row
        (conv, None, offset),
        (conv, state[:2], offset),
        (conv, state, [1, 2]),
        (conv[:, 0, 0], state, offset),  # a plane without a per-row axis
    ):
        with pytest.raises(InvalidInputError):
            type(layout).from_state(bad)


@pytest.mark.parametrize("impl", IMPLS)
def test_table_roles_and_geometry(impl: str) -> None:
    side = Side(impl)
    g = StateShapes.from_v1((K - 1, C), "bfloat16", (HV, DV, DK))
    serial = side.module.SSMCache(geometry=g)
    for role in (owned_cache_layout, prefill_cache_layout, target_cache_layout):
        layout: Any = role(serial)
        assert type(layout) is side.module.BatchedSSMCache
        assert layout.geometry == g
        assert layout.projected_bytes(0) == layout.projected_bytes(10_000) == g.row_bytes()
    assert (
        serial.signature() == "ssm" and side.module.BatchedSSMCache().signature() == "ssm:batched"
    )
    assert not serial.is_trimmable()
    with pytest.raises(LayoutStateError):
        side.module.BatchedSSMCache().projected_bytes(1)


def test_an_extracted_row_does_not_pin_the_batch() -> None:
    """(semantics §9.4.5) After extracting the last row of B in {1, 2, 4, 8} and dropping the
    layout, what stays alive is the row's own bytes: an extract is an owned copy."""
    import gc

    for rows in (1, 2, 4, 8):
        layout = opt.BatchedSSMCache()
        serials = []
        for _ in range(rows):
            serial = opt.SSMCache()
            serial[0] = mx.ones((1, K - 1, 512), mx.bfloat16)
            serial[1] = mx.ones((1, 8, 64, 64), mx.float32)
            serials.append(serial)
        layout.merge_rows(serials)
        del serials, serial
        gc.collect()
        mx.eval(layout.held_arrays())
        start = mx.get_active_memory()
        row = layout.extract_row(rows - 1)
        batch_bytes = layout.nbytes
        del layout
        gc.collect()
        assert mx.get_active_memory() - start <= row.nbytes + 4096 - batch_bytes, rows
        assert row.nbytes == (K - 1) * 512 * 2 + 8 * 64 * 64 * 4


# -- any number of planes of any rank (mlx-lm's ArraysCache(size=n)) --------------------

#: rwkv7's planes: two token shifts ``[B, 1, D]`` and a state ``[B, H, D, D]``.
RWKV = StateShapes(planes=(((1, 8), "bfloat16"), ((2, 4, 4), "float32"), ((1, 8), "bfloat16")))


def _written(side: Side, shapes: StateShapes, rows: int, seed: int, tokens: int) -> Any:
    """A serial cache of ``rows`` rows holding random planes of ``shapes``, ``tokens`` seen."""
    rng = np.random.default_rng(seed)
    cache = side.module.SSMCache(len(shapes.planes))
    for i, (shape, dtype) in enumerate(shapes.planes):
        plane = rng.standard_normal((rows, *shape)).astype(np.float32)
        cache[i] = side.give(plane.astype(BF16 if dtype == "bfloat16" else np.dtype(dtype)))
    cache.advance(tokens)
    return cache


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("count", [1, 3, 4])
def test_any_plane_count_merges_filters_extracts_and_round_trips(impl: str, count: int) -> None:
    """``SSMCache(n)``: ``n`` planes unpack, merge (a row without planes joins as zeros),
    filter in the asked order, extract an owned row and round-trip ``state`` bit for bit,
    in both implementations."""
    side = Side(impl)
    shapes = StateShapes(planes=tuple(((2, 3)[: 1 + i % 2], "float32") for i in range(count)))
    first, second = _written(side, shapes, 1, 1, 3), _written(side, shapes, 1, 2, 5)
    assert len(list(first)) == count and first.geometry == shapes
    owned = owned_cache_layout(first)
    assert owned is not None and first.nbytes == shapes.row_bytes() == owned.projected_bytes(9)
    layout = side.module.BatchedSSMCache(count)
    layout.merge_rows([first, side.module.SSMCache(count), second])
    assert layout.row_offsets == (3, 0, 5) and layout.geometry == shapes
    for i in range(count):
        plane = side.np(layout[i])
        assert _bits_equal(plane[0:1], side.np(first[i])) and not np.any(plane[1])
        assert _bits_equal(plane[2:3], side.np(second[i]))
    layout.filter_rows([2, 0])
    row = layout.extract_row(0)
    assert row.offset == 5 and all(
        _bits_equal(side.np(row[i]), side.np(second[i])) for i in range(count)
    )
    back = type(layout).from_state(layout.state)
    assert len(layout.state) == count + 1 and back.row_offsets == (5, 3)
    assert all(_bits_equal(side.np(back[i]), side.np(layout[i])) for i in range(count))
    back.check_valid()


@pytest.mark.parametrize("impl", IMPLS)
def test_left_padding_at_construction_masks_like_mlx_lm(impl: str) -> None:
    """``BatchedSSMCache(n, left_padding=...)`` (mlx-lm's ``ArraysCache(n, left_padding=...)``):
    one row per count at offset 0, the first ``left_padding[b]`` positions masked, each row
    advancing by its real tokens; ``finalize`` ends the padding."""
    import mlx_lm.models.cache as peer

    side = Side(impl)
    ours = side.module.BatchedSSMCache(3, [2, 0, 3])
    theirs: Any = peer.ArraysCache(3, left_padding=[2, 0, 3])
    assert ours.batch_size == 3 and ours.row_offsets == (0, 0, 0)
    mask = np.asarray(ours.make_mask(4))
    assert mask.tolist() == np.asarray(theirs.make_mask(4)).tolist()
    for i, (shape, dtype) in enumerate(RWKV.planes):
        ours[i] = side.give(np.zeros((3, *shape), BF16 if dtype == "bfloat16" else np.float32))
    ours.advance(4)
    theirs.advance(4)
    assert ours.row_offsets == (2, 4, 1) and ours.geometry == RWKV
    assert np.asarray(ours.make_mask(2)).tolist() == np.asarray(theirs.make_mask(2)).tolist()
    ours.finalize()
    assert ours.make_mask(2) is None and ours.left_padding is None
    assert side.module.BatchedSSMCache(2, []).batch_size == 0  # mlx-lm: [] is no padding


@pytest.mark.parametrize("impl", IMPLS)
def test_plane_count_errors_change_nothing(impl: str) -> None:
    """Bad plane counts and indices raise the contract's errors and change nothing."""
    side = Side(impl)
    three = _written(side, RWKV, 1, 3, 2)
    before = [side.np(p).tobytes() for p in three]
    cases: list[tuple[Any, type[KvRowsError], str]] = [
        (lambda: three.__setitem__(3, three[0]), InvalidInputError, "planes 0 to 2"),
        (lambda: three.__setitem__(-1, three[0]), InvalidInputError, "planes 0 to 2"),
        (lambda: three.__setitem__(2, three[1]), InvalidInputError, "state.2"),
        (lambda: side.module.SSMCache(0), InvalidInputError, "size"),
        (lambda: side.module.SSMCache(2, geometry=RWKV), InvalidInputError, "3 planes"),
        (lambda: side.module.SSMCache(3, [1]), InvalidInputError, "layout"),
        (lambda: side.module.BatchedSSMCache(3, [1, -1]), InvalidInputError, "left_padding"),
        (lambda: type(three).from_state((None, 0), geometry=RWKV), InvalidInputError, "3"),
        (lambda: StateShapes(planes=()), InvalidInputError, "at least one"),
        (lambda: StateShapes(planes=(((0,), "float32"),)), InvalidInputError, "positive"),
        (lambda: StateShapes(planes=(((2,), "int8"),)), InvalidInputError, "dtype"),
    ]
    for call, error, named in cases:
        with pytest.raises(error, match=named):
            call()
    layout = side.module.BatchedSSMCache(3)
    layout.merge_rows([three])
    with pytest.raises(IncompatibleRowsError, match="plane counts: 3 vs 2"):
        layout.merge_rows([_written(side, StateShapes.from_v1((3, 4), "float32", (2, 2)), 1, 4, 1)])
    assert layout.row_offsets == (2,) and [side.np(p).tobytes() for p in three] == before
    with pytest.raises(LayoutStateError, match="every plane"):
        partial = side.module.SSMCache(3)
        partial[0] = three[0]
        partial.advance(1)


@pytest.mark.parametrize("impl", IMPLS)
def test_table_roles_take_rows_of_any_plane_count(impl: str) -> None:
    """Each table role's layout for an unwritten ``SSMCache(n)`` (its geometry unknown)
    takes that row and written ones, as mlx-lm's ``ArraysCache.merge`` takes the first
    cache's plane count; a layout that knows its planes still refuses another count."""
    side = Side(impl)
    for role in (owned_cache_layout, prefill_cache_layout, target_cache_layout):
        layout: Any = role(side.module.SSMCache(3))
        layout.merge_rows([side.module.SSMCache(3), _written(side, RWKV, 1, 5, 2)])
        assert layout.row_offsets == (0, 2) and layout.geometry == RWKV
        layout.check_valid()
        with pytest.raises(IncompatibleRowsError, match="plane counts: 3 vs 1"):
            layout.merge_rows([side.module.SSMCache(1)])
