"""Saved state of the delayed layouts: the form, prompt-cache files, and the refusals.

Oracles: the layout that was saved (its rows, bit for bit, through ``rows_of_state``; its
row record; what it reads and attends next when both are driven alike), the other
implementation (a file saved from one loads into the other with the same rows), and the
rows' own legos (a layout built from legos hands rows back as legos after a load).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows import forms_v1
from kvrows.compositions import composition
from kvrows.conformance.arrays import as_numpy
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.delayed import RowAttentionPending, row_reads
from kvrows.errors import (
    CorruptStateError,
    InvalidInputError,
    NotTrimmableError,
    SpeculativeRoundError,
    UnsupportedStateError,
)
from kvrows.forms import DELAYED_PLAIN, rows_of_state, state_form, unpack_state, written_form
from kvrows.lego import Bf16First
from kvrows.persist.files import read_safetensors, write_atomic
from kvrows.persist.prompt_cache import KVROWS_KEY, load_prompt_cache, save_prompt_cache

IMPLS: dict[str, Any] = {"optimized": optimized, "reference": reference}
WINDOW, CHUNK, DIM = 6, 4, 64
#: The token geometries of the delayed layouts (full attention, rings, chunked-local).
GEOMETRIES = ("growing", "ring", "chunked")
#: A delayed layout of either twin (the public classes are built at run time).
Delayed = Any

FILES = profile_settings(max_examples=25 if active_profile().name == "ci" else 300)


def _native(impl: Any, array: np.ndarray[Any, Any]) -> Any:
    half = array.astype(np.float16)
    return mx.array(half) if impl is optimized else half


def _arguments(geometry: str, start: int) -> tuple[int, ...]:
    """A delayed layout's (and its lego's) arguments on ``geometry``, affine 4 bits in 32."""
    return {
        "growing": (32, 4, start),
        "ring": (WINDOW, 32, 4, 0, start),
        "chunked": (CHUNK, 32, 4, start),
    }[geometry]


def _empty(impl: Any, geometry: str, start: int) -> Delayed:
    name = {
        "growing": "DelayedQuantizedKVCache",
        "ring": "DelayedRotatingQuantizedKVCache",
        "chunked": "DelayedChunkedQuantizedKVCache",
    }[geometry]
    layout: Delayed = getattr(impl, name)(*_arguments(geometry, start))
    return layout


def _row(impl: Any, geometry: str, start: int, tokens: int, seed: int, lego: bool) -> Any:
    """One row to merge: a lego of the layout's parameters, or its plain serial storage."""
    cls = type(_empty(impl, geometry, start))
    if lego:
        cache = cls.lego_class(*_arguments(geometry, start))
    else:
        size = {"growing": (), "ring": (WINDOW,), "chunked": (CHUNK,)}[geometry]
        cache = cls.lego_class.plain_class(*size)
    block = _native(impl, np.random.default_rng(seed).standard_normal((1, 2, tokens, DIM)))
    cache.update_and_fetch(block, block)
    return cache


def rows(layout: Any) -> list[tuple[int, Any, Any]]:
    """Every row the state holds: its position and every plane's bytes."""
    entry = layout.composition

    def concat(parts: list[Any]) -> Any:
        if isinstance(parts[0], mx.array):
            return mx.concatenate(parts, axis=2)
        return np.concatenate(parts, axis=2)

    def raw(planes: Any) -> Any:
        return None if planes is None else [as_numpy(p).tobytes() for p in planes]

    held = rows_of_state(entry, unpack_state(entry, layout.state), concat)
    return [(offset, raw(k), raw(v)) for k, v, offset in held]


def record(layout: Delayed) -> tuple[Any, ...]:
    """What the layout knows beyond its rows, as both implementations report it."""
    return (
        type(layout).__name__,
        layout.signature(),
        layout.phase,
        layout.row_offsets,
        layout.left_pad,
        layout.converted_at,
        layout.prefilling,
        layout.minimum_reusable_offset,
        layout.max_append_tokens(),
    )


def _read(
    impl: Any, layout: Delayed, seed: int, tokens: int = 1, *, seen: bool = False
) -> list[bytes]:
    """One append to every row (inside a row-attention scope), as bytes: the reads (``seen``:
    each row's columns its queries see, by the layout's own mask), or for mixed rows the
    attention of fixed queries through ``attend_rows``."""
    rng = np.random.default_rng(seed)
    shape = (layout.batch_size, 2, tokens, DIM)
    keys, values = (_native(impl, rng.standard_normal(shape)) for _ in range(2))
    mask = as_numpy(layout.make_mask(tokens, return_array=True)) if seen else None
    with row_reads():
        got = layout.update_and_fetch(keys, values)
    if isinstance(got[0], RowAttentionPending):
        queries = _native(impl, rng.standard_normal(shape))
        return [as_numpy(layout.attend_rows(queries, 0.125)).tobytes()]
    planes = [p for side in got for p in (side if isinstance(side, tuple) else (side,))]
    if mask is None:
        return [as_numpy(p).tobytes() for p in planes]
    columns = [mask[b, 0].any(axis=0) for b in range(layout.batch_size)]
    return [as_numpy(p)[b][:, c].tobytes() for p in planes for b, c in enumerate(columns)]


def _drive(impl: Any, layout: Delayed, data: st.DataObject, steps: int) -> None:
    """Random boundaries: appends, verify rounds, filters, trims, prefills."""
    for step in range(steps):
        if not layout.batch_size:
            return
        op = data.draw(st.sampled_from(["append", "round", "filter", "trim", "prefill"]))
        if op == "append":
            limit = layout.max_append_tokens()
            tokens = data.draw(st.integers(1, int(min(3, limit))))
            _read(impl, layout, seed=step, tokens=tokens)
        elif op == "round":
            layout.spec_round_begin()
            _read(impl, layout, seed=step, tokens=2)
            keep = data.draw(st.lists(st.integers(1, 2), min_size=1, max_size=1))
            layout.spec_round_rollback(keep * layout.batch_size)
        elif op == "filter":
            order = data.draw(st.permutations(range(layout.batch_size)))
            layout.filter_rows(order[: data.draw(st.integers(0, layout.batch_size))])
        elif op == "trim":
            counts = [data.draw(st.integers(0, min(2, t))) for t in layout.row_offsets]
            # A wrapped ring row, a chunked row holding fewer: refused.
            with contextlib.suppress(NotTrimmableError):
                layout.trim_rows(counts)
        elif layout.prefilling:
            layout.end_prefill()
        else:
            layout.begin_prefill()
            _read(impl, layout, seed=step, tokens=data.draw(st.integers(1, 3)))


@FILES
@given(
    geometry=st.sampled_from(GEOMETRIES),
    start=st.integers(0, 8),
    lengths=st.lists(st.integers(1, 9), max_size=3),
    legos=st.booleans(),
    source=st.sampled_from(sorted(IMPLS)),
    target=st.sampled_from(sorted(IMPLS)),
    data=st.data(),
)
def test_a_saved_delayed_layout_loads_bit_exact_and_goes_on_alike(
    tmp_path_factory: pytest.TempPathFactory,
    geometry: str,
    start: int,
    lengths: list[int],
    legos: bool,
    source: str,
    target: str,
    data: st.DataObject,
) -> None:
    impl = IMPLS[source]
    layout = _empty(impl, geometry, start)
    if lengths:
        layout.merge_rows(
            [_row(impl, geometry, start, n, seed, legos) for seed, n in enumerate(lengths)]
        )
    _drive(impl, layout, data, data.draw(st.integers(0, 4)))
    path = tmp_path_factory.mktemp("delayed") / "layout.safetensors"
    save_prompt_cache(path, [layout])
    (loaded,) = load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]
    assert type(loaded) is getattr(IMPLS[target], type(layout).__name__)
    assert record(loaded) == record(layout)
    assert rows(loaded) == rows(layout)
    loaded.check_valid()
    if target != source or not layout.batch_size:
        return
    # The loaded layout goes on as the saved one does. A load lays every ring row from
    # column 0 (spec/RaggedRotatingRows.md §1: the tokens a row dropped in place are not
    # saved): its queries see the same tokens, maybe at other columns.
    ring = geometry == "ring"
    for seed in (100, 101):
        assert _read(impl, loaded, seed, seen=ring) == _read(impl, layout, seed, seen=ring)
        assert record(loaded) == record(layout) and rows(loaded) == rows(layout)
    for b in range(layout.batch_size):
        mine, theirs = loaded.extract_row(b), layout.extract_row(b)
        assert type(mine) is type(theirs)
        assert isinstance(mine, Bf16First) == (legos and bool(lengths))
        assert mine.offset == theirs.offset and mine.signature() == theirs.signature()


def _saved_and_loaded(impl: Any, layout: Delayed, folder: Path) -> Delayed:
    path = folder / f"{type(layout).__name__}.safetensors"
    save_prompt_cache(path, [layout])
    (loaded,) = load_prompt_cache(path, implementation=impl.__name__.rsplit(".", 1)[-1])
    return loaded


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_a_converted_padded_row_loads_bit_exact_masked_columns_included(
    tmp_path: Path, geometry: str
) -> None:
    """The deep profile's case (``start=0``, rows of 1 and 2 tokens): the merge converts
    both rows, the shorter one padded (full attention: column 0; ring: its column 2). Its
    masked column reads the target's zeros (scale and bias 0, not the encoding of a zero
    vector) in both twins, live and loaded alike (contract §0.5, ``spec/bf16-first.md``)."""
    reads: dict[str, list[list[bytes]]] = {}
    for name, impl in IMPLS.items():
        layout = _empty(impl, geometry, 0)
        layout.merge_rows(
            [_row(impl, geometry, 0, n, seed, False) for seed, n in enumerate([1, 2])]
        )
        assert layout.phase == "packed"
        loaded = _saved_and_loaded(impl, layout, tmp_path)
        assert record(loaded) == record(layout) and rows(loaded) == rows(layout)
        reads[name] = [_read(impl, loaded, seed) for seed in (100, 101)]
        assert [_read(impl, layout, seed) for seed in (100, 101)] == reads[name]
        scales = np.frombuffer(reads[name][0][1], np.float16).reshape(2, 2, 3, -1)
        masked = scales[0, :, 2 if geometry == "ring" else 0]
        assert masked.view(np.uint16).tolist() == np.zeros_like(masked).view(np.uint16).tolist()
    assert reads["reference"] == reads["optimized"]


#: Row operations that leave a column a row does not hold inside the read: a ragged trim
#: (its forgotten columns), a merge into a spare slot after a filter (the new row's pads),
#: conversions of padded rows at a boundary; each read and the loaded layout's next one are
#: compared between the twins and with the live layout, byte for byte.
_SEQUENCES = [
    ("growing", 0, [1, 1, 2], [("trim", [0, 0, 2])]),
    ("ring", 1, [2, 8], [("trim", [2, 0])]),
    ("growing", 4, [1, 4, 5], [("round", 1), ("trim", [0, 2, 0]), ("append", 1)]),
    ("growing", 2, [9, 9, 7], [("merge", 3), ("filter", [0, 2, 3]), ("merge", 2)]),
    ("growing", 8, [1, 7], [("round", 1), ("merge", 4)]),
    ("growing", 3, [1, 3], [("append", 2), ("trim", [1, 0]), ("append", 1)]),
    # Chunked rows of 7, 2 and 5 (chunk 4): the first append forgets the fronts of the
    # rows of 7 and 5 (their pads grow) while the row of 2 converts at start 3.
    ("chunked", 3, [7, 2, 5], [("append", 1), ("round", 1), ("trim", [0, 1, 2]), ("append", 2)]),
]


def _read_planes(impl: Any, layout: Delayed, seed: int, tokens: int = 1) -> list[Any]:
    """``_read``'s append, as every plane the read returns (a mixed read: each stage's
    rows and planes, as ``attend_rows`` hands them to an ``attend``), as bytes."""
    rng = np.random.default_rng(seed)
    shape = (layout.batch_size, 2, tokens, DIM)
    keys, values = (_native(impl, rng.standard_normal(shape)) for _ in range(2))

    def planes(read: Any) -> list[bytes]:
        sides = [p for side in read for p in (side if isinstance(side, tuple) else (side,))]
        return [as_numpy(p).tobytes() for p in sides]

    with row_reads():
        got = layout.update_and_fetch(keys, values)
    if not isinstance(got[0], RowAttentionPending):
        return planes(got)
    parts: list[Any] = []

    def attend(queries: Any, part: Any, k: Any, v: Any, mask: Any, scale: float) -> Any:
        parts.append((part.rows, planes((k, v))))
        return queries

    layout.attend_rows(_native(impl, rng.standard_normal(shape)), 0.125, attend)
    return parts


@pytest.mark.parametrize(("geometry", "start", "lengths", "steps"), _SEQUENCES)
def test_masked_columns_read_zeros_after_every_row_operation(
    tmp_path: Path, geometry: str, start: int, lengths: list[int], steps: list[tuple[str, Any]]
) -> None:
    seen: dict[str, list[list[Any]]] = {}
    for name, impl in IMPLS.items():
        layout = _empty(impl, geometry, start)
        layout.merge_rows(
            [_row(impl, geometry, start, n, seed, False) for seed, n in enumerate(lengths)]
        )
        reads = []
        for step, (op, arg) in enumerate(steps):
            if op == "trim":
                layout.trim_rows(arg)
            elif op == "filter":
                layout.filter_rows(arg)
            elif op == "merge":
                layout.merge_rows([_row(impl, geometry, start, arg, 50 + step, False)])
            elif op == "append":
                reads.append(_read_planes(impl, layout, seed=step, tokens=arg))
            else:
                layout.spec_round_begin()
                reads.append(_read_planes(impl, layout, seed=step, tokens=2))
                layout.spec_round_rollback([arg] * layout.batch_size)
        loaded = _saved_and_loaded(impl, layout, tmp_path)
        reads.append(_read_planes(impl, loaded, 100))
        assert _read_planes(impl, layout, 100) == reads[-1]
        seen[name] = reads
    assert seen["reference"] == seen["optimized"]


@pytest.mark.parametrize("name", sorted(IMPLS))
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_every_phase_round_trips_through_from_state(name: str, geometry: str) -> None:
    """Empty, all plain, mixed, packed: ``from_state(state)`` holds the same rows and
    record, and the ``state`` setter restores in place."""
    impl = IMPLS[name]
    layout = _empty(impl, geometry, start=5)
    seen = []
    for tokens in (None, 2, 6, 3):
        if tokens is not None:
            layout.merge_rows([_row(impl, geometry, 5, tokens, tokens, lego=True)])
        if tokens == 3:  # the plain rows (2 and 3 tokens) reach start: packed
            _read(impl, layout, seed=1, tokens=2)
            _read(impl, layout, seed=2, tokens=1)
        seen.append(layout.phase)
        keep = 0 if geometry == "ring" else None
        again = type(layout).from_state(layout.state, keep=keep, geometry=layout.geometry)
        assert record(again) == record(layout) and rows(again) == rows(layout)
        target = _empty(impl, geometry, start=9)
        target.state = layout.state
        assert record(target) == record(layout) and rows(target) == rows(layout)
    assert seen == ["empty", "plain", "mixed", "packed"]


def test_the_form_is_the_one_rule_with_the_modifier_record() -> None:
    """Form 2 (contract §0.6): each stage's planes, the geometry's layout fields (a ring's
    ``keep`` too, a chunk's size), the target's codec tail, the modifier record; form 1 (two groups) is
    ``kvrows.forms_v1``'s."""
    full = state_form(composition("DelayedQuantizedKVCache"))
    assert full.file_class == "DelayedQuantizedKVCache"
    record = ("start", "converted_at", "left_pad", "prefilling", "composed")
    stages = ("stage0.keys", "stage0.values", "stage1.keys", "stage1.values")
    assert full.fields == (*stages, "offset", "left_padding", "idx", "group_size", "bits", *record)
    ring = state_form(composition("DelayedRotatingQuantizedKVCache")).fields
    frame = ("offset", "left_padding", "max_size", "total", "idx", "rotated", "keep")
    assert ring == (*stages, *frame, "group_size", "bits", *record)
    chunked = state_form(composition("DelayedChunkedQuantizedKVCache")).fields
    chunk_frame = ("offset", "left_padding", "idx", "chunk_size")
    assert chunked == (*stages, *chunk_frame, "group_size", "bits", *record)
    turbo = state_form(composition("DelayedTurboQuantKVCache")).fields
    assert turbo == (*stages, "offset", "left_padding", "idx", "k_bits", "v_bits", *record)
    old = forms_v1.delayed_form(composition("DelayedRotatingQuantizedKVCache")).fields
    assert old[0] == "plain.keys" and old[-1] == "keep" and len(old) == 8 + 10 + 6
    assert written_form(composition("DelayedQuantizedKVCache")) == 2
    assert written_form(composition("BatchedQuantizedKVCache")) == 1


def test_every_stage_is_in_one_column_frame() -> None:
    """Rows of 6 (converted), 2 and 3 tokens (plain): the frame is 6 columns, each row's
    window ends at ``idx``; stage 0's planes hold the frame's newest 3 columns only."""
    layout = _mixed()
    fields = dict(zip(state_form(layout.composition).fields, layout.state, strict=True))
    assert fields["idx"] == 6
    assert np.asarray(fields["offset"]).tolist() == [6, 2, 3]
    assert np.asarray(fields["left_padding"]).tolist() == [0, 4, 3]
    assert fields["stage0.keys"].shape == (2, 2, 3, DIM)
    assert fields["stage1.keys"][0].shape[:3] == (1, 2, 6)
    narrow = dict(fields, **{"left_padding": mx.array([0, 2, 3], mx.int32)})
    with pytest.raises(InvalidInputError, match="stage 0's planes hold 3 columns"):
        type(layout).from_state(tuple(narrow.values()))


def _mixed(impl: Any = optimized, ring: bool = False) -> Delayed:
    """Rows of 6 (converted at 6), 2 and 3 tokens (plain), start 5."""
    geometry = "ring" if ring else "growing"
    layout = _empty(impl, geometry, start=5)
    layout.merge_rows([_row(impl, geometry, 5, n, n, lego=False) for n in (6, 2, 3)])
    assert layout.converted_at == (6, None, None) and layout.phase == "mixed"
    return layout


def _replaced(layout: Delayed, **fields: Any) -> tuple[Any, ...]:
    names = state_form(layout.composition).fields
    state = list(layout.state)
    for name, value in fields.items():
        state[names.index(name)] = value
    return tuple(state)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"converted_at": mx.array([6, 4, DELAYED_PLAIN], mx.int32)}, "2 converted rows"),
        ({"converted_at": mx.array([6, DELAYED_PLAIN], mx.int32)}, "1 plain and 1 converted"),
        ({"converted_at": mx.array([6, -2, DELAYED_PLAIN], mx.int32)}, "an offset >= 0"),
        ({"left_pad": mx.array([1, 5, 4], mx.int32)}, "the smallest 0"),
        ({"left_pad": mx.array([0, 4], mx.int32)}, "one pad >= 0 per row"),
        ({"start": 2}, "past start 2, outside a prefill"),
        ({"start": -1}, "negative"),
        ({"prefilling": 2}, "must be a bool"),
        ({"composed": "yes"}, "must be a bool"),
        ({"bits": 7}, "bits"),
        ({"offset": mx.array([6, 2], mx.int32)}, "one of each per row"),
    ],
)
def test_from_state_refuses_an_inconsistent_state(fields: dict[str, Any], message: str) -> None:
    layout = _mixed()
    with pytest.raises(InvalidInputError, match=message):
        type(layout).from_state(_replaced(layout, **fields))
    before = (record(layout), rows(layout))
    with pytest.raises(InvalidInputError, match=message):
        layout.state = _replaced(layout, **fields)
    assert (record(layout), rows(layout)) == before  # a refused setter changed nothing


def test_from_state_refuses_malformed_states_and_ring_records() -> None:
    layout = _mixed()
    with pytest.raises(InvalidInputError, match="14 fields"):
        type(layout).from_state(layout.state[:-1])
    with pytest.raises(InvalidInputError, match="meta_state"):
        type(layout).from_state(layout.state, ("0",))
    ring = _mixed(ring=True)
    with pytest.raises(InvalidInputError, match="no position record"):
        type(ring).from_state(_replaced(ring, left_pad=mx.array([0, 0, 0], mx.int32)))
    with pytest.raises(InvalidInputError, match="keep 0, but 2"):
        type(ring).from_state(ring.state, keep=2)
    # Form 1: the plain group's window must be the affine group's (a ring of another size).
    wider = optimized.RotatingKVCache(WINDOW + 1)
    block = _native(optimized, np.ones((1, 2, 2, DIM)))
    wider.update_and_fetch(block, block)
    other_plain = type(ring).plain_group_class(WINDOW + 1)
    other_plain.merge_rows([wider])
    affine = type(ring).affine_group_class(WINDOW, 32, 4)
    affine.merge_rows([ring.extract_row(0)])
    record = (5, mx.array([6, DELAYED_PLAIN], mx.int32), mx.array([], mx.int32), False, False, 0)
    mixed = (*other_plain.state, *affine.state, *record)
    with pytest.raises(InvalidInputError, match="windows differ"):
        type(ring).from_state(mixed)


def _replaced_record(layout: Delayed, state: tuple[Any, ...], **fields: Any) -> tuple[Any, ...]:
    names = state_form(layout.composition).fields
    values = list(state)
    for name, value in fields.items():
        values[names.index(name)] = value
    return tuple(values)


def test_a_prefilling_layout_keeps_its_unconverted_rows() -> None:
    layout = _mixed()
    layout.begin_prefill()
    _read(optimized, layout, seed=3, tokens=4)  # rows of 2 and 3 pass start, unconverted
    assert layout.converted_at == (6, None, None) and layout.row_offsets == (10, 6, 7)
    again = type(layout).from_state(layout.state)
    assert again.prefilling and record(again) == record(layout)
    again.end_prefill()
    layout.end_prefill()
    assert again.converted_at == layout.converted_at
    assert list(layout.converted_at) == [6, 6, 7]  # each converted at its own end
    assert rows(again) == rows(layout)


def _rewritten(path: Path, edit: Any) -> None:
    """``edit(arrays, description)`` applied to a saved file, re-checksummed (whole, but
    inconsistent)."""
    arrays, metadata = read_safetensors(path)
    description = json.loads(metadata[KVROWS_KEY])
    edit(arrays, description)
    metadata[KVROWS_KEY] = json.dumps(description)
    write_atomic(path, arrays, metadata)


def _field(name: str, ring: bool = False) -> str:
    entry = composition("DelayedRotatingQuantizedKVCache" if ring else "DelayedQuantizedKVCache")
    return f"0.{state_form(entry).fields.index(name)}"


def _set_array(name: str, value: Any, ring: bool = False) -> Any:
    def edit(arrays: dict[str, Any], _: Any) -> None:
        arrays[_field(name, ring)] = value

    return edit


def _set_layer(key: str, value: Any) -> Any:
    def edit(_: Any, description: dict[str, Any]) -> None:
        layer = description["layers"][0]
        if "." in key:
            outer, inner = key.split(".")
            layer[outer][inner] = value
        else:
            layer[key] = value

    return edit


@pytest.mark.parametrize(
    ("ring", "edit", "message"),
    [
        (False, _set_array("converted_at", mx.array([6, 6, DELAYED_PLAIN], mx.int32)), "rows"),
        (False, _set_array("left_pad", mx.array([2, 6, 5], mx.int32)), "smallest 0"),
        (False, _set_array("left_pad", mx.array([0, 4, 3, 0], mx.int32)), "per row"),
        (True, _set_array("left_pad", mx.array([0], mx.int32), ring=True), "position record"),
        (False, _set_array("start", mx.array(6)), "restored kv:delayed-quant:4:32:6"),
        (False, _set_layer("signature", "kv:delayed-quant:4:32:5:1"), "the file says"),
        (False, _set_layer("signature", "kv:delayed-quant:8:32:5"), "the file says"),
        (True, _set_layer("token_geometry.keep", 2), "keep 0, but 2"),
    ],
)
def test_a_corrupt_file_is_refused(tmp_path: Path, ring: bool, edit: Any, message: str) -> None:
    path = tmp_path / "delayed.safetensors"
    save_prompt_cache(path, [_mixed(ring=ring)])
    _rewritten(path, edit)
    for implementation in ("optimized", "reference"):
        with pytest.raises(CorruptStateError, match=message):
            load_prompt_cache(path, implementation=implementation)


def test_a_trimmed_row_may_sit_below_its_conversion() -> None:
    """Trimming keeps a converted row converted, so ``converted_at`` may exceed the row's
    offset: a valid state, restored as it is."""
    layout = _mixed()
    layout.trim_rows([3, 0, 0])
    assert layout.row_offsets == (3, 2, 3) and layout.converted_at == (6, None, None)
    again = type(layout).from_state(layout.state)
    assert record(again) == record(layout) and rows(again) == rows(layout)


def _lego_reads(impl: Any, lego: Any, seed: int, tokens: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    keys, values = (_native(impl, rng.standard_normal((1, 2, tokens, DIM))) for _ in range(2))
    got = lego.update_and_fetch(keys, values)
    planes = [p for side in got for p in (side if isinstance(side, tuple) else (side,))]
    return [as_numpy(p).tobytes() for p in planes]


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("tokens", [3, 6])  # saved plain (start 5), saved converted at 6
@pytest.mark.parametrize("source", sorted(IMPLS))
def test_a_lego_saves_as_its_storage_and_loads_as_the_lego(
    tmp_path: Path, geometry: str, tokens: int, source: str
) -> None:
    impl = IMPLS[source]
    lego = _row(impl, geometry, 5, tokens, 4, lego=True)
    path = tmp_path / "lego.safetensors"
    save_prompt_cache(path, [lego])
    for target in sorted(IMPLS):
        (loaded,) = load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]
        assert type(loaded) is getattr(IMPLS[target], type(lego).__name__)
        assert (loaded.converted, loaded.start, loaded.minimum_reusable_offset) == (
            lego.converted,
            5,
            lego.minimum_reusable_offset,
        )
        assert rows(loaded.storage) == rows(lego.storage)
    (again,) = load_prompt_cache(path, implementation=source)  # type: ignore[arg-type]
    for seed, count in ((7, 2), (8, 1)):  # the plain one converts on the first of these
        assert _lego_reads(impl, again, seed, count) == _lego_reads(impl, lego, seed, count)
        assert again.converted == lego.converted
    assert again.minimum_reusable_offset == lego.minimum_reusable_offset == {3: 5, 6: 6}[tokens]
    assert rows(again.storage) == rows(lego.storage)


def _set_lego(key: str, value: Any) -> Any:
    def edit(_: Any, description: dict[str, Any]) -> None:
        description["layers"][0]["lego"][key] = value

    return edit


@pytest.mark.parametrize(
    ("tokens", "edit", "error", "message"),
    [
        (3, _set_lego("class", "FancyLego"), UnsupportedStateError, "FancyLego"),
        (3, _set_lego("class", "KVCache"), UnsupportedStateError, "KVCache"),
        (3, _set_lego("minimum_reusable_offset", 2), CorruptStateError, "plain storage"),
        (6, _set_lego("bits", 8), CorruptStateError, "converts to affine8"),
        (6, _set_lego("start", -1), CorruptStateError, "start"),
        (6, _set_lego("class", "Bf16FirstRotatingQuantizedKVCache"), CorruptStateError, "fit"),
    ],
)
def test_a_corrupt_lego_record_is_refused(
    tmp_path: Path, tokens: int, edit: Any, error: type[Exception], message: str
) -> None:
    path = tmp_path / "lego.safetensors"
    save_prompt_cache(path, [_row(optimized, "growing", 5, tokens, 4, lego=True)])
    _rewritten(path, edit)
    with pytest.raises(error, match=message):
        load_prompt_cache(path)


def test_no_state_inside_a_round() -> None:
    layout = _mixed()
    layout.spec_round_begin()
    with pytest.raises(SpeculativeRoundError):
        layout.state  # noqa: B018  (the read itself is refused)
    with pytest.raises(SpeculativeRoundError):
        layout.state = _mixed().state


@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_a_lego_saved_as_a_one_row_layout_comes_back_as_the_lego(
    tmp_path: Path, geometry: str
) -> None:
    """The form that keeps ``start`` and the conversion point of one request."""
    # 6 tokens: within the window (a longer first block would leave the serial ring more
    # columns than a layout row keeps); a chunked row holds them all until its next append.
    lego = _row(optimized, geometry, 5, 6, 3, lego=True)
    solo = _row(optimized, geometry, 5, 6, 3, lego=True)  # the oracle: the same lego, kept
    assert lego.minimum_reusable_offset == 6
    layout = _empty(optimized, geometry, start=5)
    layout.merge_rows([lego])
    save_prompt_cache(tmp_path / "one.safetensors", [layout])
    (loaded,) = load_prompt_cache(tmp_path / "one.safetensors", implementation="reference")
    back = loaded.extract_row(0)
    held = type(_empty(reference, geometry, 5))
    assert type(back) is held.lego_class and back.converted
    assert back.minimum_reusable_offset == solo.minimum_reusable_offset
    assert back.signature() == solo.signature() and back.offset == solo.offset
    assert rows(back.storage) == rows(solo.storage)
    assert rows(back.storage) == rows(layout.extract_row(0).storage)


SAVED_V1 = Path(__file__).parent / "data" / "saved_v1"
V1_CASES = [
    case
    for case in json.loads((SAVED_V1 / "manifest.json").read_text())["cases"]
    if str(case["built"].get("class", "")).startswith("Delayed")
]


@pytest.mark.parametrize("saved_by", sorted(IMPLS))
@pytest.mark.parametrize("case", V1_CASES, ids=[case["name"] for case in V1_CASES])
def test_a_file_of_form_1_loads_and_equals_its_form_2_copy(
    tmp_path: Path, case: dict[str, Any], saved_by: str
) -> None:
    """A delayed layout saved by kvrows' format 1 (two groups, ``tests/data/saved_v1/``)
    loads through ``kvrows.forms_v1``; saved again it is form 2, and that file loads into
    the same rows and record, in either implementation."""
    path = SAVED_V1 / case["prompt_cache"][saved_by]
    _, metadata = read_safetensors(path)
    assert "form" not in json.loads(metadata[KVROWS_KEY])["layers"][0]  # form 1
    for target in sorted(IMPLS):
        (old,) = load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]
        assert old.batch_size == len(case["built"]["rows_of_legos"]) and old.phase == "mixed"
        copy = tmp_path / f"{target}.safetensors"
        save_prompt_cache(copy, [old])
        _, metadata = read_safetensors(copy)
        assert json.loads(metadata[KVROWS_KEY])["layers"][0]["form"] == 2
        (new,) = load_prompt_cache(copy, implementation=target)  # type: ignore[arg-type]
        assert record(new) == record(old) and rows(new) == rows(old)
        for a, b in zip(new.state, old.state, strict=True):
            for x, y in zip(*(v if isinstance(v, tuple) else (v,) for v in (a, b)), strict=True):
                assert np.array_equal(as_numpy(x), as_numpy(y)) if hasattr(x, "shape") else x == y
        new.check_valid()


def test_a_file_mixing_form_1_and_form_2_layers_loads(tmp_path: Path) -> None:
    """Each layer is read by its own form: a delayed layout (form 2) beside a serial
    storage (form 1, mlx-lm's), in either implementation."""
    layout = _mixed()
    plain = _row(optimized, "growing", 5, 4, 9, lego=False)
    path = tmp_path / "mixed.safetensors"
    save_prompt_cache(path, [layout, plain])
    _, metadata = read_safetensors(path)
    assert [layer["form"] for layer in json.loads(metadata[KVROWS_KEY])["layers"]] == [2, 1]
    for target in sorted(IMPLS):
        loaded, serial = load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]
        assert record(loaded) == record(layout) and rows(loaded) == rows(layout)
        assert rows(serial) == rows(plain)
