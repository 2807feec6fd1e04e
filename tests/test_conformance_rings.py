"""The rotating family's conformance machines, and the ring vectors of the spec.

The machine tests run each ring layout's state machine (``conformance.rules.RingRules``)
under the selected profile, scaled by the family's example budget, and check that
nothing was skipped silently. The vector tests pin the spec's worked examples by
hand (the golden wrap-mask vector of ``spec/BatchedRotatingCache.md`` §3, the block
after the wrap of §4, the join at another phase of §6, the write sequences of
``spec/RotatingKVCache.md`` §6) against both implementations and mlx-lm, and the
divergence tests reproduce, on mlx-lm as installed, each behaviour the parity oracle
skips (B9, B11, R1, R2): if mlx-lm fixes one, its test fails and the skip should go.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conformance_helpers import (
    BASE_OPS,
    BASE_QUANTITIES,
    MLX_LM_BATCH_CHECKS,
    assert_compared,
    assert_skips_documented,
    run_base_family,
)
from mlx_lm.models import cache as mlx_lm_cache

import kvrows.optimized as O
import kvrows.reference as R
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import WRAPPED_RING_BLOCK, expected_visible
from kvrows.conformance.profiles import active_profile
from kvrows.conformance.rules import FULL_RING_ROLLBACK, RING_TRIM_REFUSED
from kvrows.conformance.runner import family_settings
from kvrows.conformance.strategies import Geometry
from kvrows.errors import IncompatibleRowsError, NotTrimmableError
from kvrows.forms import unpack_state
from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache

#: mlx-lm is untyped; reach its classes through ``Any``.
LM: Any = mlx_lm_cache

FAMILY = FAMILIES["rotating"]
LAYOUTS = [spec.name for spec in FAMILY.layouts]

pytestmark = pytest.mark.usefixtures("cpu_stream")


# ------------------------------------------------------------------ the machines


#: Layouts whose CI examples (drawn from the layout's own seed, ``profiles.machine_seed``)
#: reach every operation, oracle and state well inside the family's share (the block on a
#: wrapped ring is built, ``machines._build_wrapped``, and a mirrored layout's filters keep
#: rows first, ``strategies.keep_lists``: the decode ring meets everything by its 11th
#: example, where its first mlx-lm filter used to come at the 58th of 70), so they run
#: fewer (CI wall time).
CI_EXAMPLES = {
    "BatchedRotatingCache": 20,
    "RaggedRotatingRows": 16,
    "BatchedRotatingQuantCache": 18,
    "RotatingAffineLayout": 24,
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotating_family(layout: str) -> None:
    stats = run_base_family(FAMILY, layout, BASE_OPS, ci_examples=CI_EXAMPLES.get(layout))
    spec = FAMILY.layout(layout)
    assert_skips_documented(stats)
    # Rings with and without sink tokens (keep) both ran.
    assert stats.variants["sink tokens"] > 0 and stats.variants["no sink tokens"] > 0
    if spec.serial_peer:
        # Every plain machine drives mlx-lm's serial RotatingKVCache twins.
        assert stats.checks["mlx-lm serial"] > 0
    # A block on a wrapped ring holding a short row (the shared ring's B9 state).
    stats.require(0, states=(WRAPPED_RING_BLOCK,))
    if spec.trim_rows:
        # Rows holding exactly max_size rolled back; trims past the window refused.
        stats.require(0, states=(FULL_RING_ROLLBACK, RING_TRIM_REFUSED))
    mirrored = {"kv.mlx_lm", "attention.mlx_lm"} if spec.serial_peer else set()
    assert_compared(stats, BASE_QUANTITIES | mirrored)
    if spec.peer:
        stats.require(0, oracles=MLX_LM_BATCH_CHECKS)
        # Joins are re-synced (R1) and wrapped rings refuse trims (B11), every time.
        assert stats.skips["R1"] > 0 and stats.skips["B11"] > 0
        # mlx-lm's B9 mask was met (and only hid keys), yet most steps compared equal.
        assert 0 < stats.skips["B9"] < stats.checks["mlx-lm step"]
    elif not spec.serial_peer:
        assert not stats.skips, "the affine rings have no mlx-lm peer and cannot skip parity"


def test_the_family_budget_scales_the_profile() -> None:
    ci = active_profile("ci").max_examples
    assert 1 <= family_settings(FAMILY, "ci").max_examples < ci
    assert family_settings(FAMILY, "ci", max_examples=7).max_examples == 7


def test_expected_visible_matches_the_spec_examples() -> None:
    def seen(*args: int | None) -> list[list[int]]:
        return expected_visible(*args)  # type: ignore[arg-type]

    # spec/RotatingKVCache.md §2: the block t9 t10 t11 at window 6 (9 tokens before it).
    assert seen(9, 3, 6, 6) == [list(range(4, 10)), list(range(5, 11)), list(range(6, 12))]
    # One token on a full ring sees the whole window; a narrower window_size hides more.
    assert seen(8, 1, 6, 6) == [list(range(3, 9))]
    assert seen(8, 1, 2, 6) == [[7, 8]]
    # A window_size wider than the ring sees only what the ring keeps.
    assert seen(8, 1, 10, 6) == [list(range(3, 9))]
    # A fresh ring: a block sees its own causal prefix.
    assert seen(0, 3, 6, 6) == [[0], [0, 1], [0, 1, 2]]
    # Sinks (spec/RotatingKVCache.md §1.1): keep 2 of window 6, a block of 3 after 9 tokens.
    assert seen(9, 3, None, 6, 2) == [[0, 1, 6, 7, 8, 9], [0, 1, 7, 8, 9, 10], [0, 1, 8, 9, 10, 11]]
    # A window_size counts the sinks (and a query always sees itself).
    assert seen(9, 1, 3, 6, 2) == [[0, 1, 9]]


# ----------------------------------------------------------- tagged ring vectors

D = 4  # head dim of the plain vectors (float32, one head: 32 bytes a token)


def _tags_np(tags: list[int], dim: int = D) -> Any:
    return np.broadcast_to(
        np.array(tags, np.float32)[None, None, :, None], (1, 1, len(tags), dim)
    ).copy()


class _Impl:
    """Plain arrays in and tags out, for one implementation."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.mod: Any = R if name == "reference" else O

    def arr(self, tags: list[int] | list[list[int]], dim: int = D) -> Any:
        rows = tags if tags and isinstance(tags[0], list) else [tags]
        block = np.concatenate([_tags_np(list(r), dim) for r in rows], axis=0)  # type: ignore[arg-type]
        return block if self.name == "reference" else mx.array(block)

    def tags(self, keys: Any) -> list[list[int]]:
        array = np.asarray(keys if isinstance(keys, np.ndarray) else np.array(keys))
        return array[:, 0, :, 0].astype(np.int64).tolist()  # type: ignore[no-any-return]

    def mask(self, mask: Any) -> list[str]:
        array = np.asarray(mask if isinstance(mask, np.ndarray) else np.array(mask))
        return ["".join(str(int(x)) for x in row[0, -1]) for row in array]

    def ring(self, max_size: int, *blocks: list[int]) -> Any:
        cache = self.mod.RotatingKVCache(max_size)
        for block in blocks:
            cache.update_and_fetch(self.arr(block), self.arr(block))
        return cache


IMPLS = [
    pytest.param(_Impl("reference"), id="reference"),
    pytest.param(_Impl("optimized"), id="optimized"),
]


def _window_tags(impl: _Impl, ring: Any) -> list[int]:
    held = ring.window()
    return [] if held is None else impl.tags(held[0][0])[0]


def _golden_batch(impl: _Impl, steps: int = 0) -> Any:
    """The golden batch of §3, after ``steps`` of its decode steps."""
    layout = impl.mod.BatchedRotatingCache(6)
    layout.merge_rows([impl.ring(6, [1001, 1002, 1003, 1004]), impl.ring(6, [2001, 2002])])
    for step in range(steps):
        block = impl.arr([[1005 + step], [2003 + step]])
        layout.update_and_fetch(block, block)
    return layout


#: spec/BatchedRotatingCache.md §3, by hand: (mask before the step, offsets, left_pad,
#: physical columns after it, extracted windows after it).
GOLDEN = [
    ("11111|00111", (5, 3), (0, 2)),
    ("111111|001111", (6, 4), (0, 2)),
    ("111111|101111", (7, 5), (-1, 1)),
    ("111111|111111", (8, 6), (-2, 0)),
    ("111111|111111", (9, 7), (-3, -1)),
    ("111111|111111", (10, 8), (-4, -2)),
    ("111111|111111", (11, 9), (-5, -3)),
    ("111111|111111", (12, 10), (-6, -4)),
]
GOLDEN_COLUMNS = {
    2: [[1007, 1002, 1003, 1004, 1005, 1006], [2005, 0, 2001, 2002, 2003, 2004]],
    3: [[1007, 1008, 1003, 1004, 1005, 1006], [2005, 2006, 2001, 2002, 2003, 2004]],
    4: [[1007, 1008, 1009, 1004, 1005, 1006], [2005, 2006, 2007, 2002, 2003, 2004]],
    7: [[1007, 1008, 1009, 1010, 1011, 1012], [2005, 2006, 2007, 2008, 2009, 2010]],
}
GOLDEN_RING_STATE = {
    0: (5, 5, False),
    1: (6, 6, False),
    2: (1, 7, True),
    4: (3, 9, True),
    7: (6, 12, True),
}


def _newest(first: int, offset: int, keep: int = 6) -> list[int]:
    return list(range(first + max(0, offset - keep), first + offset))


@pytest.mark.parametrize("impl", IMPLS)
def test_golden_wrap_mask(impl: _Impl) -> None:
    layout = _golden_batch(impl)
    assert (layout.row_offsets, layout.left_pad) == ((4, 2), (0, 2))
    for step, (mask, offsets, pads) in enumerate(GOLDEN):
        assert "|".join(impl.mask(layout.make_mask(1))) == mask, f"step {step}"
        keys, _ = layout.update_and_fetch(
            impl.arr([[1005 + step], [2003 + step]]), impl.arr([[1005 + step], [2003 + step]])
        )
        assert (layout.row_offsets, layout.left_pad) == (offsets, pads), f"step {step}"
        if step in GOLDEN_COLUMNS:
            assert impl.tags(keys) == GOLDEN_COLUMNS[step], f"step {step}"
        if impl.name == "optimized" and step in GOLDEN_RING_STATE:
            assert layout.ring_state == GOLDEN_RING_STATE[step]
        for b, first in enumerate((1001, 2001)):
            extracted = layout.extract_row(b)
            assert extracted.offset == offsets[b]
            assert _window_tags(impl, extracted) == _newest(first, offsets[b])


def _lm_ring(max_size: int, *blocks: list[int]) -> Any:
    ring = LM.RotatingKVCache(max_size)
    for block in blocks:
        ring.update_and_fetch(mx.array(_tags_np(block)), mx.array(_tags_np(block)))
    return ring


def _lm_golden(steps: int = 0) -> Any:
    """mlx-lm's golden batch, after ``steps`` of its decode steps."""
    batch = LM.BatchRotatingKVCache.merge(
        [_lm_ring(6, [1001, 1002, 1003, 1004]), _lm_ring(6, [2001, 2002])]
    )
    for step in range(steps):
        block = mx.array(np.concatenate([_tags_np([1005 + step]), _tags_np([2003 + step])]))
        batch.update_and_fetch(block, block)
    return batch


def test_golden_wrap_mask_mlx_lm() -> None:
    impl = _Impl("optimized")
    batch = _lm_golden()
    for step, (mask, offsets, pads) in enumerate(GOLDEN):
        assert "|".join(impl.mask(batch.make_mask(1))) == mask, f"step {step}"
        block = mx.array(np.concatenate([_tags_np([1005 + step]), _tags_np([2003 + step])]))
        keys, _ = batch.update_and_fetch(block, block)
        assert np.array(batch.offset).tolist() == list(offsets)
        assert np.array(batch.left_padding).tolist() == list(pads)
        if step in GOLDEN_COLUMNS:
            assert impl.tags(keys) == GOLDEN_COLUMNS[step]
        if step in GOLDEN_RING_STATE:
            assert (batch._idx, batch._offset, batch.rotated) == GOLDEN_RING_STATE[step]


def test_golden_wrap_mask_affine() -> None:
    """The same vector over the affine codec (constant vectors quantize exactly)."""
    for impl in (_Impl("reference"), _Impl("optimized")):
        rows = []
        for tags in ([1001, 1002, 1003, 1004], [2001, 2002]):
            ring = impl.mod.RotatingQuantizedKVCache(6, 32, 8)
            ring.update_and_fetch(impl.arr(tags, 32), impl.arr(tags, 32))
            rows.append(ring)
        layout = impl.mod.BatchedRotatingQuantCache(6, 32, 8)
        layout.merge_rows(rows)
        for step, (mask, offsets, pads) in enumerate(GOLDEN):
            assert "|".join(impl.mask(layout.make_mask(1))) == mask, (impl.name, step)
            block = impl.arr([[1005 + step], [2003 + step]], 32)
            layout.update_and_fetch(block, block)
            assert (layout.row_offsets, layout.left_pad) == (offsets, pads)
        extracted = layout.extract_row(1)
        assert extracted.signature() == "kv:rotating-quant:8:32"
        packed, scales, biases = (np.asarray(np.array(p)) for p in extracted.window()[0])
        from kvrows.reference.affine_codec import dequantize

        values = dequantize(packed, scales, biases, 32, 8)
        assert values[0, 0, :, 0].astype(np.int64).tolist() == list(range(2005, 2011))


@pytest.mark.parametrize("impl", IMPLS)
def test_block_after_the_wrap(impl: _Impl) -> None:
    """spec/BatchedRotatingCache.md §4 (kvrows' fix of B9)."""
    layout = _golden_batch(impl, 3)
    mask = np.asarray(np.array(layout.make_mask(2)))
    rows = [["".join(str(int(x)) for x in q) for q in row[0]] for row in mask]
    assert rows == [["1111110", "0111111"], ["1111110", "0111111"]]
    block = impl.arr([[1008, 1009], [2006, 2007]])
    keys, _ = layout.update_and_fetch(block, block)
    # Each row in temporal order, the oldest column dropped (row 1's last pad), the block
    # appended: 7 columns, one over the window.
    assert impl.tags(keys) == [list(range(1003, 1010)), list(range(2001, 2008))]
    assert (layout.row_offsets, layout.left_pad) == ((9, 7), (-2, 0))
    if impl.name == "optimized":
        assert layout.ring_state == (7, 9, False) and layout.buffer_length == 7
    block = impl.arr([[1010], [2008]])
    layout.update_and_fetch(block, block)
    assert layout.left_pad == (-4, -2)
    if impl.name == "optimized":
        assert layout.ring_state[0] == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_join_at_another_phase(impl: _Impl) -> None:
    """spec/BatchedRotatingCache.md §6."""
    layout = _golden_batch(impl, 4)
    newcomer = impl.ring(6, [3001, 3002, 3003])
    layout.merge_rows([newcomer])
    assert (layout.row_offsets, layout.left_pad) == ((8, 6, 3), (0, 0, 3))
    if impl.name == "optimized":
        assert layout.ring_state == (6, 6, False)
    assert impl.mask(layout.make_mask(1)) == ["111111", "111111", "100111"]
    assert newcomer.offset == 3 and _window_tags(impl, newcomer) == [3001, 3002, 3003]
    with pytest.raises(NotTrimmableError):
        layout.trim(1)
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([impl.mod.RotatingKVCache(8)])
    assert layout.row_offsets == (8, 6, 3)
    assert (layout.projected_bytes(3), layout.projected_bytes(100)) == (96, 192)
    layout.filter_rows([2, 0])
    assert (layout.row_offsets, layout.left_pad) == ((3, 8), (3, 0))
    extracted = layout.extract_row(1)
    assert extracted.offset == 8 and _window_tags(impl, extracted) == list(range(1003, 1009))
    layout.filter_rows([0])
    assert layout.left_pad == (3,)


#: spec/RotatingKVCache.md §6 / semantics §9.2.5-6 at window 8: write sequences (and
#: trims) after which window() must hold the newest min(offset, 8) tokens.
SEQUENCES: list[list[int | str]] = [
    [13],
    [7],
    [8],
    [9],
    [5, 6, 9],
    [5, *[1] * 10],
    [5, *[1] * 6, 4],
    [13, 1, 1],
    [7, 1, 1],
    [3, 1, 12, 1, 1, 20, 1],
    [6, "trim 2", 1, 3, 4],
    [7, "trim 3", 1, 1, 6],
    [3, 1, 1, "trim 1", 5, 1],
    [2, 2, 2, "trim 4", 9],
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("sequence", SEQUENCES, ids=lambda s: "-".join(map(str, s)))
def test_write_sequences_keep_the_newest_window(impl: _Impl, sequence: list[int | str]) -> None:
    ring = impl.mod.RotatingKVCache(8)
    tokens: list[int] = []
    for op in sequence:
        if isinstance(op, str):
            count = int(op.split()[1])
            assert ring.trim(count) == count
            del tokens[-count:]
        else:
            block = list(range(len(tokens) + 1, len(tokens) + op + 1))
            ring.update_and_fetch(impl.arr(block), impl.arr(block))
            tokens += block
        assert ring.offset == len(tokens)
        assert _window_tags(impl, ring) == tokens[-8:]
        for layout_name in ("BatchedRotatingCache", "RaggedRotatingRows"):
            layout = getattr(impl.mod, layout_name)(8)
            layout.merge_rows([ring])
            assert _window_tags(impl, layout.extract_row(0)) == tokens[-8:]


# ------------------------------------------------- mlx-lm divergences the oracle skips


def test_divergence_b9_block_after_wrap_hides_the_oldest_token() -> None:
    batch = _lm_golden(3)
    rows = [
        ["".join(str(int(x)) for x in q) for q in row[0]] for row in np.array(batch.make_mask(2))
    ]
    assert rows == [["1111110", "0111111"], ["0111110", "0111111"]]  # kvrows: 1111110 for row 1


def test_divergence_b11_trim_of_a_wrapped_ring_mutates() -> None:
    ring = _lm_ring(6, [1, 2, 3, 4, 5, 6], [7], [8])
    assert not ring.is_trimmable()
    assert ring.trim(2) == 2 and ring.offset == 6
    batch = _lm_golden(3)
    assert not batch.is_trimmable()
    assert batch.trim(1) == 1 and np.array(batch.offset).tolist() == [6, 4]
    for impl in (_Impl("reference"), _Impl("optimized")):
        kv_ring = impl.ring(6, [1, 2, 3, 4, 5, 6], [7], [8])
        with pytest.raises(NotTrimmableError):
            kv_ring.trim(2)
        assert kv_ring.offset == 8


@pytest.mark.parametrize("impl", IMPLS)
def test_a_wrapped_ragged_ring_trims_inside_its_latest_block(impl: _Impl) -> None:
    """spec/RaggedRotatingRows.md §3: ``trim(n)`` is ``trim_rows([n] * B)``, so a layout
    whose ``is_trimmable()`` is ``False`` (a row has wrapped) still trims every row by a
    count each row can give back right after a block. The deep profile's failing example
    (window 9, rows at offsets 16, 4, 4, 6 holding 10, 4, 4, 6 after a block of 2: the
    machine expected ``trim(1)`` refused), in small; the conformance model's rule
    (``Geometry.may_forget``) agrees with both implementations on each count."""
    layout = impl.mod.RaggedRotatingRows(4)
    layout.merge_rows([impl.ring(4, [1, 2, 3, 4, 5, 6]), impl.ring(4, [11, 12])])
    block = impl.arr([[7, 8, 9], [13, 14, 15]])
    layout.update_and_fetch(block, block)
    assert (layout.row_offsets, layout.retained) == ((9, 5), (6, 5))
    assert not layout.is_trimmable()
    model = Geometry("float32", 1, 1, D, D, max_size=4)

    def allowed(count: int) -> bool:
        return all(
            model.may_forget(offset, held, count)
            for offset, held in zip(layout.row_offsets, layout.retained, strict=True)
        )

    # Back 3: offset 6's window needs position 2, which row 0 evicted (6 - 3 < 4).
    assert not allowed(3)
    with pytest.raises(NotTrimmableError, match="row 0"):
        layout.trim(3)
    assert (layout.row_offsets, layout.retained) == ((9, 5), (6, 5))
    assert allowed(2) and layout.trim(2) == 2
    assert (layout.row_offsets, layout.retained) == ((7, 3), (4, 3))
    assert [_window_tags(impl, layout.extract_row(b)) for b in (0, 1)] == [
        [4, 5, 6, 7],
        [11, 12, 13],
    ]
    # Now row 0 holds exactly its window: nothing more to give back once wrapped.
    assert not allowed(1)
    with pytest.raises(NotTrimmableError, match="row 0"):
        layout.trim(1)
    assert layout.row_offsets == (7, 3)


def test_divergence_r1_extend_keeps_the_running_geometry() -> None:
    batch = _lm_golden(4)
    batch.extend(LM.BatchRotatingKVCache.merge([_lm_ring(6, [3001, 3002, 3003])]))
    # kvrows re-merges: total 6 (spec §6); mlx-lm keeps _offset = max(8, 3).
    assert batch._offset == 8 and not batch.is_trimmable()


def test_divergence_r2_extract_keeps_the_oversized_buffer() -> None:
    batch = LM.BatchRotatingKVCache.merge([_lm_ring(6, [1, 2, 3, 4, 5, 6])])
    block = mx.array(_tags_np([7, 8, 9]))
    batch.update_and_fetch(block, block)
    extracted = batch.extract(0)
    assert extracted.keys.shape[2] == 8  # kvrows: the newest 6
    for impl in (_Impl("reference"), _Impl("optimized")):
        layout = impl.mod.BatchedRotatingCache(6)
        layout.merge_rows([impl.ring(6, [1, 2, 3, 4, 5, 6])])
        layout.update_and_fetch(impl.arr([7, 8, 9]), impl.arr([7, 8, 9]))
        assert _window_tags(impl, layout.extract_row(0)) == [4, 5, 6, 7, 8, 9]


def test_windows_must_match_in_mlx_lm_too() -> None:
    with pytest.raises(ValueError):
        LM.BatchRotatingKVCache.merge([_lm_ring(6, [1]), _lm_ring(8, [1])])


# ------------------------------------------------------- bugs the machine found


def _reference_ragged_with_an_empty_row() -> Any:
    layout = R.RaggedRotatingRows(4)
    layout.merge_rows([_Impl("reference").ring(4), _Impl("reference").ring(4, [1])])
    return layout


def _filtered_to_nothing(mod: Any) -> Any:
    layout = mod.BatchedRotatingCache(4)
    impl = _Impl("reference" if mod is R else "optimized")
    layout.merge_rows([impl.ring(4, [1, 2])])
    layout.filter_rows([])
    return layout


def test_fixed_reference_ring_bugs() -> None:
    """The two reference bugs this suite found (fixed): a ragged row that holds no token
    reads as padding, and a ring layout no row of which holds a token raises on fetch."""
    from kvrows.errors import LayoutStateError

    keys, _ = _reference_ragged_with_an_empty_row().fetch()
    assert keys.shape[0] == 2 and not keys[0].any()
    for mod in (R, O):
        with pytest.raises(LayoutStateError):
            _filtered_to_nothing(mod).fetch()


#: The shared-column ring layouts, with the serial ring each row comes from: (layout,
#: serial, constructor arguments). ``keep=1`` takes the canonical (right-aligned) form.
WRAPPED_LAYOUTS = [
    ("BatchedRotatingCache", "RotatingKVCache", {"max_size": 6}),
    ("BatchedRotatingQuantCache", "RotatingQuantizedKVCache", {"max_size": 6, "keep": 1}),
    ("RotatingAffineLayout", "RotatingQuantizedKVCache", {"max_size": 6, "keep": 1}),
]


def _wrapped(impl: _Impl, layout: str, serial: str, args: dict[str, int]) -> Any:
    """The golden batch of §3 after four steps: row 0 has overwritten two of its pads."""
    quant = "Quant" in serial
    extra = {"group_size": 32, "bits": 8} if quant else {}
    dim = 32 if quant else D
    rows = []
    for tags in ([1001, 1002, 1003, 1004], [2001, 2002]):
        ring = getattr(impl.mod, serial)(**args, **extra)
        ring.update_and_fetch(impl.arr(tags, dim), impl.arr(tags, dim))
        rows.append(ring)
    cache = getattr(impl.mod, layout)(**args, **extra)
    cache.merge_rows(rows)
    for step in range(4):
        block = impl.arr([[1005 + step], [2003 + step]], dim)
        cache.update_and_fetch(block, block)
    return cache


def _saved_pads(cache: Any) -> list[int]:
    state = unpack_state(cache.composition, cache.state)
    return np.asarray(np.array(state["left_padding"])).astype(np.int64).tolist()  # type: ignore[no-any-return]


@pytest.mark.parametrize(("layout", "serial", "args"), WRAPPED_LAYOUTS)
def test_a_wrapped_ring_layout_saves_and_restores_its_negative_pads(
    tmp_path: Path, layout: str, serial: str, args: dict[str, int]
) -> None:
    """mlx-lm's ``BatchRotatingKVCache`` saves ``left_padding`` raw (negative once the
    ring overwrote a row's pads: -2 here, ``GOLDEN`` step 3) and its state setter gives it
    back; both implementations save the same pads and a load, into either, restores them."""
    if layout == "BatchedRotatingCache":
        lm = LM.BatchRotatingKVCache(6, [0, 2])
        prompt = np.zeros((2, 1, 4, D), dtype=np.float32)
        lm.update_and_fetch(mx.array(prompt), mx.array(prompt))
        for _ in range(4):
            token = mx.zeros((2, 1, 1, D))
            lm.update_and_fetch(token, token)
        assert np.array(lm.state[3]).tolist() == [-2, 0]
    for name in ("reference", "optimized"):
        impl = _Impl(name)
        cache = _wrapped(impl, layout, serial, args)
        live = cache.left_pad
        assert live[0] < 0  # the case this test is about
        if layout == "BatchedRotatingCache":
            assert live == (-2, 0)
        assert _saved_pads(cache) == list(live), name
        keep = args.get("keep", 0)
        restored = type(cache).from_state(cache.state, keep=keep)
        assert restored.left_pad == live, name
        path = tmp_path / f"{name}.safetensors"
        save_prompt_cache(path, [cache])
        for into in ("reference", "optimized"):
            (loaded,) = load_prompt_cache(path, implementation=into)
            assert loaded.left_pad == live, (name, into)
            assert _saved_pads(loaded) == list(live), (name, into)
