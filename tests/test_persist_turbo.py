"""Saved state of TurboQuantKVCache and BatchedTurboQuantKVCache, both implementations.

Oracles: the reference codec's own encoding of the appended tokens (the §2.3 plane tuple
``kIdx, kScales, kZeros, vPacked, vScales``, byte for byte), the live cache that was
saved (what its next append fetches, its rows through ``rows_of_state``), and the other
implementation (a file written by one loads into the other with the same bytes).
Refusals: each corrupt state changes nothing and names its fault.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.compositions import composition
from kvrows.errors import (
    CorruptStateError,
    InvalidInputError,
    SpeculativeRoundError,
)
from kvrows.forms import TURBO_STATE_DTYPE, rows_of_state, state_form, unpack_state
from kvrows.persist.files import read_safetensors, write_atomic
from kvrows.persist.prefix_store import PrefixStore
from kvrows.persist.prompt_cache import KVROWS_KEY, load_prompt_cache, save_prompt_cache
from kvrows.reference import turbo_codec
from kvrows.validation import KvGeometry

HEADS = 2
IMPLS = {"reference": ref, "optimized": opt}
#: The §2.3 planes, in the order a state (and a file) holds them.
PLANES = ("kIdx", "kScales", "kZeros", "vPacked", "vScales")


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _block(rows: int, tokens: int, dim: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, HEADS, tokens, dim)).astype(np.float32)


def _native(impl: Any, block: np.ndarray[Any, Any], dtype: str) -> Any:
    if dtype == "bfloat16":
        cast = block.astype(ml_dtypes.bfloat16)
        return mx.array(cast.view(np.uint16)).view(mx.bfloat16) if impl is opt else cast
    return mx.array(block.astype(dtype)) if impl is opt else block.astype(dtype)


def _numpy(array: Any) -> np.ndarray[Any, Any]:
    if isinstance(array, mx.array):
        return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    return np.asarray(array)


def _bytes(planes: Any) -> list[tuple[str, tuple[int, ...], bytes]]:
    """Each plane's dtype, shape and bytes."""
    return [(str(_numpy(p).dtype), tuple(p.shape), _numpy(p).tobytes()) for p in planes]


def _concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=2)
    return mx.concatenate(parts, axis=2)


def state_rows(cache: Any) -> list[tuple[int, Any, Any]]:
    """The rows a cache's state holds: position and each plane's bytes."""
    entry = cache.composition
    rows = rows_of_state(entry, unpack_state(entry, cache.state), _concat)
    return [
        (offset, None if k is None else _bytes(k), None if v is None else _bytes(v))
        for k, v, offset in rows
    ]


def serial(
    impl: Any,
    sizes: list[int],
    seed: int,
    *,
    bits: tuple[int, int] = (8, 3),
    dim: int = 64,
    dtype: str = "float32",
) -> Any:
    cache = impl.TurboQuantKVCache(*bits)
    for i, n in enumerate(sizes):
        keys, values = _block(1, n, dim, seed + i), _block(1, n, dim, seed + 100 + i)
        cache.update_and_fetch(_native(impl, keys, dtype), _native(impl, values, dtype))
    return cache


def layout(impl: Any, rows: list[list[int]], seed: int, bits: tuple[int, int] = (8, 3)) -> Any:
    built = impl.BatchedTurboQuantKVCache(*bits)
    built.merge_rows(
        [serial(impl, sizes, seed + 10 * b, bits=bits) for b, sizes in enumerate(rows)]
    )
    return built


def _fetch_equal(a: Any, b: Any) -> bool:
    """Two reads hold the same planes (keys' then values'), byte for byte."""
    return _bytes([*a[0], *a[1]]) == _bytes([*b[0], *b[1]])


# -- the form ----------------------------------------------------------------------------


def test_the_forms_follow_the_axes() -> None:
    serial_form = state_form(composition("TurboQuantKVCache"))
    layout_form = state_form(composition("BatchedTurboQuantKVCache"))
    assert serial_form.fields == ("keys", "values", "offset", "k_bits", "v_bits")
    assert layout_form.fields == (
        "keys", "values", "offset", "left_padding", "idx", "k_bits", "v_bits",
    )  # fmt: skip
    # mlx-lm has no TurboQuant class: the file names the composition
    assert serial_form.file_class == "TurboQuantKVCache"
    assert layout_form.file_class == "BatchedTurboQuantKVCache"


@pytest.mark.parametrize(("k_bits", "v_bits", "dim"), [(8, 3, 64), (4, 2, 128), (5, 5, 64)])
@pytest.mark.parametrize("name", sorted(IMPLS))
def test_the_state_is_the_section_2_3_planes_of_the_tokens(
    name: str, k_bits: int, v_bits: int, dim: int
) -> None:
    """``state`` = ``((kIdx, kScales, kZeros), (vPacked, vScales), offset, k_bits, v_bits)``
    sliced to the offset: exactly the reference codec's encoding of the appended tokens."""
    impl = IMPLS[name]
    cache = serial(impl, [3, 1, 2], seed=5, bits=(k_bits, v_bits), dim=dim)
    keys, values, offset, *tail = cache.state
    assert (offset, tail) == (6, [k_bits, v_bits])
    assert isinstance(offset, int) and all(isinstance(t, int) for t in tail)
    appended_keys = np.concatenate([_block(1, n, dim, 5 + i) for i, n in enumerate([3, 1, 2])], 2)
    appended_values = np.concatenate(
        [_block(1, n, dim, 105 + i) for i, n in enumerate([3, 1, 2])], 2
    )
    expected = [
        *turbo_codec.encode_keys(appended_keys, k_bits),
        *turbo_codec.encode_values(appended_values, v_bits),
    ]
    got = [*keys, *values]
    assert len(got) == len(PLANES)
    assert _bytes(got) == _bytes(expected)
    code = "int8" if k_bits == 8 else "uint8"
    widths = [dim * k_bits // 8, dim // 32, dim // 32, dim * v_bits // 8, dim // 32]
    dtypes = [code, "float16", "float16", "uint8", "float16"]
    for plane, width, dtype in zip(got, widths, dtypes, strict=True):
        assert tuple(plane.shape) == (1, HEADS, 6, width)
        assert str(_numpy(plane).dtype) == dtype


def test_an_optimized_state_holds_only_the_offset_and_evaluates() -> None:
    """The optimized cache grows its buffers in 256-token steps; its state is the held
    columns only (never the capacity), and ``mx.eval`` takes it whole."""
    cache = serial(opt, [5], seed=1)
    assert cache.capacity >= 256
    state = cache.state
    mx.eval(state)
    assert all(p.shape[2] == 5 for p in (*state[0], *state[1]))


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("target", sorted(IMPLS))
@pytest.mark.parametrize("source", sorted(IMPLS))
@pytest.mark.parametrize(
    ("bits", "dim", "dtype"),
    [((8, 3), 64, "bfloat16"), ((4, 2), 128, "float16"), ((2, 8), 64, "float32")],
)
def test_serial_files_round_trip_bit_exact(
    tmp_path: Path, source: str, target: str, bits: tuple[int, int], dim: int, dtype: str
) -> None:
    cache = serial(IMPLS[source], [4, 1, 2], seed=3, bits=bits, dim=dim, dtype=dtype)
    path = tmp_path / "turbo.safetensors"
    save_prompt_cache(path, [cache], {"who": "turbo"})
    (loaded,), metadata = load_prompt_cache(path, return_metadata=True, implementation=target)  # type: ignore[arg-type]
    assert metadata == {"who": "turbo"}
    assert type(loaded).__name__ == "TurboQuantKVCache"
    assert type(loaded).__module__.startswith(f"kvrows.{target}")
    assert loaded.signature() == cache.signature() == f"kv:turboquant:{bits[0]}:{bits[1]}"
    assert loaded.offset == cache.offset == 7
    assert loaded.geometry == cache.geometry  # the file's record carries the dtype
    assert _bytes([*loaded.state[0], *loaded.state[1]]) == _bytes(
        [*cache.state[0], *cache.state[1]]
    )
    # the next append fetches what the saved cache's would (same implementation: bytes)
    if source == target:
        impl = IMPLS[target]
        keys, values = _block(1, 2, dim, 77), _block(1, 2, dim, 78)
        got = loaded.update_and_fetch(_native(impl, keys, dtype), _native(impl, values, dtype))
        want = cache.update_and_fetch(_native(impl, keys, dtype), _native(impl, values, dtype))
        assert _fetch_equal(got, want)


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_from_state_and_the_setter_round_trip(name: str) -> None:
    impl = IMPLS[name]
    cache = serial(impl, [3, 2], seed=11, dtype="bfloat16")
    restored = impl.TurboQuantKVCache.from_state(cache.state)
    # nothing in the planes says bfloat16: it is the default; a declared geometry wins
    assert restored.geometry == cache.geometry
    assert restored.geometry.dtype == TURBO_STATE_DTYPE
    assert state_rows(restored) == state_rows(cache)
    as_f32 = KvGeometry(HEADS, 64, 64, "float32")
    assert impl.TurboQuantKVCache.from_state(cache.state, geometry=as_f32).geometry == as_f32
    other = serial(impl, [5], seed=12, dtype="bfloat16")
    other.state = cache.state
    assert other.offset == 5 and state_rows(other) == state_rows(cache)
    keys, values = _block(1, 1, 64, 40), _block(1, 1, 64, 41)
    got = other.update_and_fetch(_native(impl, keys, "bfloat16"), _native(impl, values, "bfloat16"))
    want = cache.update_and_fetch(
        _native(impl, keys, "bfloat16"), _native(impl, values, "bfloat16")
    )
    assert _fetch_equal(got, want)


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_an_empty_cache_round_trips_with_its_declared_geometry(tmp_path: Path, name: str) -> None:
    impl = IMPLS[name]
    geometry = KvGeometry(HEADS, 128, 128, "float16")
    empty = impl.TurboQuantKVCache(4, 3, geometry=geometry)
    assert empty.state == (None, None, 0, 4, 3)
    save_prompt_cache(tmp_path / "empty.safetensors", [empty, impl.BatchedTurboQuantKVCache(4, 3)])
    for target in IMPLS:
        caches = load_prompt_cache(tmp_path / "empty.safetensors", implementation=target)  # type: ignore[arg-type]
        assert caches[0].offset == 0 and caches[0].geometry == geometry
        assert caches[0].signature() == "kv:turboquant:4:3"
        assert caches[1].batch_size == 0 and caches[1].signature() == "kv:batched-turboquant:4:3"


@pytest.mark.parametrize("target", sorted(IMPLS))
@pytest.mark.parametrize("source", sorted(IMPLS))
def test_layout_files_keep_every_row(tmp_path: Path, source: str, target: str) -> None:
    """Ragged rows (one of them empty) come back with the same positions and bytes; each
    extracted row equals the saved layout's extracted row."""
    saved = layout(IMPLS[source], [[3, 2], [], [6]], seed=20, bits=(4, 3))
    path = tmp_path / "layout.safetensors"
    save_prompt_cache(path, [saved])
    (loaded,) = load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]
    assert type(loaded).__name__ == "BatchedTurboQuantKVCache"
    assert loaded.signature() == saved.signature() == "kv:batched-turboquant:4:3"
    assert loaded.row_offsets == saved.row_offsets == (5, 0, 6)
    assert state_rows(loaded) == state_rows(saved)
    for b in (0, 2):
        assert state_rows(loaded.extract_row(b)) == state_rows(saved.extract_row(b))


def test_a_restored_layout_decodes_as_the_saved_one(tmp_path: Path) -> None:
    saved = layout(opt, [[4], [2, 1]], seed=30)
    save_prompt_cache(tmp_path / "l.safetensors", [saved])
    (loaded,) = load_prompt_cache(tmp_path / "l.safetensors")
    for step in range(2):
        keys, values = _block(2, 1, 64, 50 + step), _block(2, 1, 64, 60 + step)
        got = loaded.update_and_fetch(mx.array(keys), mx.array(values))
        want = saved.update_and_fetch(mx.array(keys), mx.array(values))
        assert _fetch_equal(got, want)
        assert mx.array_equal(loaded.make_mask(1), saved.make_mask(1)).item()


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_no_state_inside_a_verify_round(name: str) -> None:
    """Inside a round ``state`` and its setter refuse; after a rollback the state holds
    what a layout that appended only the kept tokens holds (the oracle)."""
    impl = IMPLS[name]
    built, oracle = layout(impl, [[3], [4]], seed=40), layout(impl, [[3], [4]], seed=40)
    block = _block(2, 3, 64, 41)
    built.spec_round_begin()
    built.update_and_fetch(_native(impl, block, "float32"), _native(impl, block, "float32"))
    with pytest.raises(SpeculativeRoundError):
        _ = built.state
    with pytest.raises(SpeculativeRoundError):
        built.state = oracle.state
    built.spec_round_rollback(1)
    kept = _native(impl, block[:, :, :1], "float32")
    oracle.update_and_fetch(kept, kept)
    assert built.row_offsets == oracle.row_offsets == (4, 5)
    assert state_rows(built) == state_rows(oracle)
    again = type(built).from_state(built.state)
    assert state_rows(again) == state_rows(oracle)


def test_the_prefix_store_serves_turbo_rows(tmp_path: Path) -> None:
    """A stored turbo row cut at a block boundary comes back as the bytes of a cache that
    appended only that prefix (the oracle), ready to go on."""
    keys, values = _block(1, 10, 64, 70), _block(1, 10, 64, 71)
    full, prefix = opt.TurboQuantKVCache(), opt.TurboQuantKVCache()
    full.update_and_fetch(mx.array(keys), mx.array(values))
    prefix.update_and_fetch(mx.array(keys[:, :, :8]), mx.array(values[:, :, :8]))
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=4)
    tokens = list(range(10))
    assert store.put(tokens, [full]) == 8
    found = store.longest(tokens)
    assert found is not None
    matched, (loaded,) = found
    assert matched == 8 and type(loaded) is opt.TurboQuantKVCache
    assert loaded.geometry == full.geometry and state_rows(loaded) == state_rows(prefix)
    step = (mx.array(keys[:, :, 8:9]), mx.array(values[:, :, 8:9]))
    assert _fetch_equal(loaded.update_and_fetch(*step), prefix.update_and_fetch(*step))


# -- refusals ----------------------------------------------------------------------------


def _replace(planes: tuple[Any, ...], index: int, plane: Any) -> tuple[Any, ...]:
    return (*planes[:index], plane, *planes[index + 1 :])


def _shaped(impl: Any, dtype: str, shape: tuple[int, ...]) -> Any:
    return mx.zeros(shape, dtype=getattr(mx, dtype)) if impl is opt else np.zeros(shape, dtype)


Corruption = Callable[[Any, tuple[Any, ...]], tuple[Any, ...]]


def _serial_corruptions() -> dict[str, tuple[Corruption, str]]:
    """State edits of a k8v3, D = 64, 2-head, 5-token serial state, each with the
    message it must raise."""

    def keys_as(edit: Callable[[Any, tuple[Any, ...]], tuple[Any, ...]]) -> Corruption:
        return lambda impl, s: (edit(impl, s[0]), *s[1:])

    def values_as(edit: Callable[[Any, tuple[Any, ...]], tuple[Any, ...]]) -> Corruption:
        return lambda impl, s: (s[0], edit(impl, s[1]), *s[2:])

    return {
        "two key planes": (keys_as(lambda impl, k: k[:2]), "3"),
        "three value planes": (values_as(lambda impl, v: (*v, v[1])), "2"),
        "plain keys": (keys_as(lambda impl, k: k[0]), "3"),
        "kIdx of 7 bits": (  # 8-bit codes: D bytes; 63 is no head dim TurboQuant stores
            keys_as(lambda impl, k: _replace(k, 0, _shaped(impl, "int8", (1, 2, 5, 63)))),
            "head dim",
        ),
        "head dim 96": (
            lambda impl, s: (
                (
                    _shaped(impl, "int8", (1, 2, 5, 96)),
                    _shaped(impl, "float16", (1, 2, 5, 3)),
                    _shaped(impl, "float16", (1, 2, 5, 3)),
                ),
                (_shaped(impl, "uint8", (1, 2, 5, 36)), _shaped(impl, "float16", (1, 2, 5, 3))),
                *s[2:],
            ),
            "96",
        ),
        "vPacked of another width": (  # v3 packs 24 bytes at D = 64
            values_as(lambda impl, v: _replace(v, 0, _shaped(impl, "uint8", (1, 2, 5, 25)))),
            "vPacked",
        ),
        "v_bits 4 over v3 planes": (  # 24 bytes at 4 bits: D = 48
            lambda impl, s: (*s[:4], 4),
            "48",
        ),
        "kScales of another width": (
            keys_as(lambda impl, k: _replace(k, 1, _shaped(impl, "float16", (1, 2, 5, 3)))),
            "kScales",
        ),
        "kIdx unsigned at 8 bits": (
            keys_as(lambda impl, k: _replace(k, 0, _shaped(impl, "uint8", (1, 2, 5, 64)))),
            "int8",
        ),
        "kZeros float32": (
            keys_as(lambda impl, k: _replace(k, 2, _shaped(impl, "float32", (1, 2, 5, 2)))),
            "float16",
        ),
        "vScales bfloat16": (
            values_as(lambda impl, v: _replace(v, 1, v[1].astype(
                mx.bfloat16 if impl is opt else ml_dtypes.bfloat16
            ))),
            "float16",
        ),
        "planes of other lengths": (
            values_as(lambda impl, v: (v[0][:, :, :4], v[1][:, :, :4])),
            "[1, 2, 5",
        ),
        "offset beyond the planes": (lambda impl, s: (s[0], s[1], 7, *s[3:]), "offset 7"),
        "negative offset": (lambda impl, s: (s[0], s[1], -1, *s[3:]), "offset -1"),
        "k_bits 3": (lambda impl, s: (*s[:3], 3, s[4]), "k_bits"),
        "v_bits a float": (lambda impl, s: (*s[:4], 3.0), "v_bits"),
        "keys without values": (lambda impl, s: (s[0], None, *s[2:]), "both"),
        "a field short": (lambda impl, s: s[:4], "5 fields"),
        "another library's planes": (
            keys_as(lambda impl, k: tuple(np.asarray(_numpy(p)) if impl is opt else mx.array(p)
                                          for p in k)),
            "plane",
        ),
    }  # fmt: skip


SERIAL_CORRUPTIONS = _serial_corruptions()


@pytest.mark.parametrize("fault", sorted(SERIAL_CORRUPTIONS))
@pytest.mark.parametrize("name", sorted(IMPLS))
def test_from_state_and_the_setter_refuse_corrupt_states(name: str, fault: str) -> None:
    impl = IMPLS[name]
    cache = serial(impl, [5], seed=2)
    edit, message = SERIAL_CORRUPTIONS[fault]
    bad = edit(impl, cache.state)
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        impl.TurboQuantKVCache.from_state(bad)
    target = serial(impl, [3], seed=4)
    before = state_rows(target), target.geometry
    with pytest.raises(InvalidInputError):
        target.state = bad
    assert (state_rows(target), target.geometry) == before  # a refused setter changed nothing


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_a_declared_geometry_must_agree_with_the_planes(name: str) -> None:
    impl = IMPLS[name]
    state = serial(impl, [2], seed=6).state
    for wrong in (KvGeometry(4, 64, 64, "float32"), KvGeometry(HEADS, 128, 64, "float32")):
        with pytest.raises(InvalidInputError, match="declared"):
            impl.TurboQuantKVCache.from_state(state, geometry=wrong)
    with pytest.raises(InvalidInputError, match="int8 activations"):
        impl.TurboQuantKVCache.from_state(state, geometry=KvGeometry(HEADS, 64, 64, "int8"))


@pytest.mark.parametrize("name", sorted(IMPLS))
def test_layout_states_beyond_their_planes_are_refused(name: str) -> None:
    impl = IMPLS[name]
    built = layout(impl, [[3], [5]], seed=8)
    keys, values, offsets, pads, idx, k_bits, v_bits = built.state
    assert (offsets.tolist(), pads.tolist(), idx) == ([3, 5], [2, 0], 5)

    def int32(values: list[int]) -> Any:
        return mx.array(values, dtype=mx.int32) if impl is opt else np.array(values, np.int32)

    one_row = (tuple(p[:1] for p in keys), tuple(p[:1] for p in values))
    cases = {
        "idx 7 outside the 5 columns": (
            keys, values, int32([5, 7]), int32([2, 0]), 7, k_bits, v_bits,
        ),
        "offset 4 disagrees with its columns": (
            keys, values, int32([4, 5]), pads, idx, k_bits, v_bits,
        ),
        "keys hold 2 rows, offsets 1": (keys, values, int32([5]), int32([0]), idx, k_bits, v_bits),
        "keys hold 1 rows, offsets 2": (*one_row, offsets, pads, idx, k_bits, v_bits),
        "vPacked holds 24 bytes per token": (keys, values, offsets, pads, idx, k_bits, 5),
    }  # fmt: skip
    before = state_rows(built)
    for message, bad in cases.items():
        with pytest.raises(InvalidInputError, match=message):
            impl.BatchedTurboQuantKVCache.from_state(bad)
        with pytest.raises(InvalidInputError, match=message):
            built.state = bad
    assert state_rows(built) == before


# -- corrupt files -----------------------------------------------------------------------


def _rewrite(path: Path, edit: Callable[[dict[str, Any], dict[str, str]], None]) -> None:
    """Edit a saved file's arrays / metadata and write it back with a valid checksum (the
    file is consistent bytes; only its content is wrong)."""
    arrays, metadata = read_safetensors(path)
    edit(arrays, metadata)
    write_atomic(path, arrays, metadata)


def _record(
    edit: Callable[[dict[str, Any]], None],
) -> Callable[[dict[str, Any], dict[str, str]], None]:
    def apply(arrays: dict[str, Any], metadata: dict[str, str]) -> None:
        description = json.loads(metadata[KVROWS_KEY])
        edit(description["layers"][0])
        metadata[KVROWS_KEY] = json.dumps(description)

    return apply


def _array(name: str, value: Any) -> Callable[[dict[str, Any], dict[str, str]], None]:
    def apply(arrays: dict[str, Any], metadata: dict[str, str]) -> None:
        arrays[name] = value(arrays[name]) if callable(value) else value

    return apply


def _drop(name: str) -> Callable[[dict[str, Any], dict[str, str]], None]:
    return lambda arrays, metadata: arrays.pop(name)


FILE_CORRUPTIONS: dict[str, Callable[[dict[str, Any], dict[str, str]], None]] = {
    # arrays "0.<field>[.<plane>]": 0.0.* keys, 0.1.* values, 0.2 offset, 0.3/0.4 bits
    "a missing kZeros plane": _drop("0.0.2"),
    "a missing vScales plane": _drop("0.1.1"),
    "kIdx as uint8": _array("0.0.0", lambda a: a.astype(mx.uint8)),
    "kScales as float32": _array("0.0.1", lambda a: a.astype(mx.float32)),
    "a wider vPacked": _array("0.1.0", lambda a: mx.concatenate([a, a[..., :1]], axis=3)),
    "an offset past the planes": _array("0.2", mx.array(9)),
    "k_bits 4 over 8-bit codes": _array("0.3", mx.array(4)),
    "v_bits 6": _array("0.4", mx.array(6)),
    "head dim 96 throughout": lambda arrays, metadata: arrays.update(
        {
            "0.0.0": mx.zeros((1, 2, 5, 96), dtype=mx.int8),
            "0.0.1": mx.zeros((1, 2, 5, 3), dtype=mx.float16),
            "0.0.2": mx.zeros((1, 2, 5, 3), dtype=mx.float16),
            "0.1.0": mx.zeros((1, 2, 5, 36), dtype=mx.uint8),
            "0.1.1": mx.zeros((1, 2, 5, 3), dtype=mx.float16),
        }
    ),
    "a signature with an unknown parameter": _record(
        lambda layer: layer.update(signature=layer["signature"] + ":7")
    ),
    "a signature of other widths": _record(
        lambda layer: layer.update(signature="kv:turboquant:4:3")
    ),
    "a record of other head dims": _record(lambda layer: layer["kv"].update(key_dim=128)),
    "a record of an integer dtype": _record(lambda layer: layer["kv"].update(dtype="int8")),
    "a record with an unknown kv field": _record(lambda layer: layer["kv"].update(bias=1)),
    "the layout's class name": lambda arrays, metadata: metadata.update(
        {"1.0": "BatchedTurboQuantKVCache"}
    ),
}


@pytest.mark.parametrize("target", sorted(IMPLS))
@pytest.mark.parametrize("fault", sorted(FILE_CORRUPTIONS))
def test_corrupt_files_are_refused(tmp_path: Path, fault: str, target: str) -> None:
    path = tmp_path / "bad.safetensors"
    save_prompt_cache(path, [serial(opt, [5], seed=9)])
    load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]  # sound before
    _rewrite(path, FILE_CORRUPTIONS[fault])
    with pytest.raises(CorruptStateError):
        load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]


def test_a_flipped_plane_byte_fails_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "flip.safetensors"
    save_prompt_cache(path, [serial(opt, [5], seed=9)])
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptStateError, match="checksum"):
        load_prompt_cache(path)


def test_a_corrupt_layout_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "layout.safetensors"
    save_prompt_cache(path, [layout(opt, [[3], [5]], seed=10)])
    # arrays: 0.2 offset, 0.3 left_padding, 0.4 idx
    _rewrite(path, _array("0.2", mx.array([3, 6], dtype=mx.int32)))
    with pytest.raises(CorruptStateError, match="offset"):
        load_prompt_cache(path)
