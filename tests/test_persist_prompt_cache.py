"""Prompt-cache files: kvrows' round trip, both implementations, and mlx-lm interop both ways.

Oracles: the cache that was saved (its state rows, bit for bit, and what it fetches next),
the other implementation (a file saved from one loads into the other with the same rows),
and mlx-lm 0.32.2's own ``save_prompt_cache`` / ``load_prompt_cache`` and cache classes.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.errors import CorruptStateError, InvalidInputError, UnsupportedStateError
from kvrows.forms import FORM_VERSION, FORMAT_VERSION, rows_of_state, unpack_state
from kvrows.optimized.rows import DECLARED
from kvrows.persist.files import read_safetensors, write_atomic
from kvrows.persist.prompt_cache import KVROWS_KEY, load_prompt_cache, save_prompt_cache

#: mlx-lm's cache module (untyped).
lm: Any = mlx_lm_cache

SERIALS = [
    "KVCache",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "TurboQuantKVCache",
]
#: The KV layouts (recurrent state's round trips: tests/test_persist_recurrent.py; the
#: latent codec's: tests/test_persist_latent.py; the delayed layouts':
#: tests/test_persist_delayed.py).
LAYOUTS = [
    name
    for name, cls in DECLARED.items()
    if cls.composition.is_layout
    and cls.composition.geometry != "recurrent"
    and cls.composition.codec != "latent"
    and "delayed" not in cls.composition.modifiers
]
DIM = 64


def _args(name: str, keep: int = 0) -> tuple[int, ...]:
    entry = DECLARED[name].composition
    values = {"max_size": 6, "group_size": 32, "bits": 4, "keep": keep, "k_bits": 4, "v_bits": 3}
    values["chunk_size"] = 6
    return tuple(values[p] for p in entry.params)


def _concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=2)
    return mx.concatenate(parts, axis=2)


def _numpy(array: Any) -> np.ndarray[Any, Any]:
    if isinstance(array, mx.array):
        if array.dtype == mx.bfloat16:
            array = array.astype(mx.float32)
        return np.array(array)
    return np.asarray(array, dtype=np.float32) if array.dtype.name == "bfloat16" else array


def state_rows(cache: Any) -> list[tuple[int, Any, Any]]:
    """The rows a cache's state holds: position and every plane's bytes (the oracle)."""
    entry = cache.composition
    keep = getattr(cache.token_geometry, "keep", 0)
    rows = rows_of_state(entry, unpack_state(entry, cache.state), _concat, keep=keep)

    def raw(planes: Any) -> Any:
        return None if planes is None else [_numpy(p).tobytes() for p in planes]

    return [(offset, raw(k), raw(v)) for k, v, offset in rows]


def _blocks(rng: np.random.Generator, sizes: list[int], dtype: str) -> list[np.ndarray[Any, Any]]:
    return [rng.standard_normal((1, 2, n, DIM)).astype(np.float32) for n in sizes]


def _native(impl: Any, block: np.ndarray[Any, Any], dtype: str) -> Any:
    if impl is optimized:
        return mx.array(block).astype(getattr(mx, dtype))
    if dtype == "bfloat16":
        import ml_dtypes

        return block.astype(ml_dtypes.bfloat16)
    return block.astype(dtype)


def _filled(
    impl: Any, name: str, sizes: list[int], seed: int, dtype: str = "float32", keep: int = 0
) -> Any:
    """A serial cache of class ``name`` after appending blocks of ``sizes`` tokens."""
    cache = impl.__dict__[name](*_args(name, keep))
    for block in _blocks(np.random.default_rng(seed), sizes, dtype):
        native = _native(impl, block, dtype)
        cache.update_and_fetch(native, native)
    return cache


def _layout(
    impl: Any, name: str, rows: list[list[int]], seed: int, dtype: str, keep: int = 0
) -> Any:
    entry = DECLARED[name].composition
    serial = entry.serial or next(
        c.composition.name
        for c in DECLARED.values()
        if c.composition.roles and name in {role for _, role in c.composition.roles.items()}
    )
    layout = impl.__dict__[name](*_args(name, keep))
    layout.merge_rows(
        [_filled(impl, serial, sizes, seed + i, dtype, keep) for i, sizes in enumerate(rows)]
    )
    return layout


#: File round trips: a few dozen examples in CI, more in the deep profile.
FILES = profile_settings(max_examples=30 if active_profile().name == "ci" else 300)

sizes_strategy = st.lists(st.integers(1, 9), min_size=0, max_size=4)


@FILES
@given(
    name=st.sampled_from(SERIALS),
    sizes=sizes_strategy,
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    sinks=st.sampled_from([0, 0, 2]),
    source=st.sampled_from(["reference", "optimized"]),
    target=st.sampled_from(["reference", "optimized"]),
)
def test_serial_round_trip_is_bit_exact(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    sizes: list[int],
    seed: int,
    dtype: str,
    sinks: int,
    source: str,
    target: str,
) -> None:
    impls = {"reference": reference, "optimized": optimized}
    keep = sinks if "Rotating" in name else 0
    cache = _filled(impls[source], name, sizes, seed, dtype, keep)
    path = tmp_path_factory.mktemp("rt") / "cache.safetensors"
    save_prompt_cache(path, [cache], {"who": "test"})
    (loaded,), metadata = load_prompt_cache(path, return_metadata=True, implementation=target)  # type: ignore[arg-type]
    assert metadata == {"who": "test"}
    assert type(loaded).__name__ == name
    assert loaded.signature() == cache.signature()
    assert loaded.offset == cache.offset
    assert state_rows(loaded) == state_rows(cache)
    if sizes:
        assert repr(loaded.geometry) == repr(cache.geometry)


@FILES
@given(
    name=st.sampled_from(LAYOUTS),
    rows=st.lists(st.lists(st.integers(1, 8), min_size=0, max_size=3), min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    sinks=st.sampled_from([0, 0, 2]),
    source=st.sampled_from(["reference", "optimized"]),
    target=st.sampled_from(["reference", "optimized"]),
)
# The derandomized draws need not reach every layout: the TurboQuant one, always.
@example(
    name="BatchedTurboQuantKVCache",
    rows=[[3, 2], [], [4]],
    seed=1,
    sinks=0,
    source="reference",
    target="optimized",
)
def test_layout_round_trip_keeps_every_row(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    rows: list[list[int]],
    seed: int,
    sinks: int,
    source: str,
    target: str,
) -> None:
    impls = {"reference": reference, "optimized": optimized}
    keep = sinks if DECLARED[name].composition.geometry == "ring" else 0
    layout = _layout(impls[source], name, rows, seed, "float32", keep)
    path = tmp_path_factory.mktemp("rt") / "layout.safetensors"
    save_prompt_cache(path, [layout])
    (loaded,) = load_prompt_cache(path, implementation=target)  # type: ignore[arg-type]
    assert type(loaded).__name__ == name
    assert loaded.row_offsets == layout.row_offsets
    assert state_rows(loaded) == state_rows(layout)


def test_a_restored_serial_ring_fetches_what_the_saved_one_would(tmp_path: Path) -> None:
    """Column for column: after a wrap the next token lands where it would have."""
    ring = _filled(optimized, "RotatingKVCache", [4, 1, 1, 1, 1, 1], seed=3)
    save_prompt_cache(tmp_path / "ring.safetensors", [ring])
    (loaded,) = load_prompt_cache(tmp_path / "ring.safetensors")
    block = mx.array(np.random.default_rng(9).standard_normal((1, 2, 1, DIM)).astype(np.float32))
    for got, want in zip(
        loaded.update_and_fetch(block, block), ring.update_and_fetch(block, block), strict=True
    ):
        assert mx.array_equal(got, want).item()
    assert loaded.make_mask(1, window_size=3).tolist() == ring.make_mask(1, window_size=3).tolist()


# -- interop with mlx-lm ----------------------------------------------------------------


def _lm_pair(kind: str) -> tuple[Any, Any]:
    if kind == "plain":
        return lm.KVCache(), optimized.KVCache()
    if kind == "ring":
        return lm.RotatingKVCache(6), optimized.RotatingKVCache(6)
    if kind == "ring-sinks":
        return lm.RotatingKVCache(6, keep=2), optimized.RotatingKVCache(6, keep=2)
    return lm.QuantizedKVCache(32, 4), optimized.QuantizedKVCache(32, 4)


def _fetch_equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple | list):
        return all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))
    return bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("kind", ["plain", "ring", "ring-sinks", "quantized"])
@pytest.mark.parametrize("direction", ["kvrows->mlx-lm", "mlx-lm->kvrows"])
def test_files_interoperate_with_mlx_lm(tmp_path: Path, kind: str, direction: str) -> None:
    """Same appends into mlx-lm's class and kvrows'; one saves, the other's loader reads;
    the next appends fetch identical arrays from the loaded cache and the live peer."""
    theirs, ours = _lm_pair(kind)
    rng = np.random.default_rng(1)
    for n in (5, 1, 1, 3, 1, 1):
        block = mx.array(rng.standard_normal((1, 2, n, DIM)).astype(np.float32))
        theirs.update_and_fetch(block, block)
        ours.update_and_fetch(block, block)
    path = str(tmp_path / "cache.safetensors")
    if direction == "kvrows->mlx-lm":
        save_prompt_cache(path, [ours], {"note": "x"})
        (loaded,), metadata = lm.load_prompt_cache(path, return_metadata=True)
        live = theirs
        assert type(loaded) is type(theirs) and metadata["note"] == "x"
    else:
        lm.save_prompt_cache(path, [theirs], {"note": "x"})
        (loaded,), metadata = load_prompt_cache(path, return_metadata=True)
        live = ours
        assert type(loaded) is type(ours) and metadata == {"note": "x"}
    assert loaded.offset == live.offset
    for n in (1, 2, 1):
        block = mx.array(rng.standard_normal((1, 2, n, DIM)).astype(np.float32))
        got, want = loaded.update_and_fetch(block, block), live.update_and_fetch(block, block)
        assert _fetch_equal(got[0], want[0]) and _fetch_equal(got[1], want[1])


def test_batch_files_interoperate_with_mlx_lm(tmp_path: Path) -> None:
    rows = [_filled(optimized, "KVCache", sizes, seed=i) for i, sizes in enumerate([[3], [5, 1]])]
    layout = optimized.BatchedKVCache()
    layout.merge_rows(rows)
    path = str(tmp_path / "batch.safetensors")
    save_prompt_cache(path, [layout])
    (theirs,) = lm.load_prompt_cache(path)
    assert type(theirs).__name__ == "BatchKVCache"
    assert theirs.offset.tolist() == [3, 6] and theirs.left_padding.tolist() == [3, 0]
    for b, row in enumerate(rows):
        keys, _ = theirs.extract(b).keys_and_values()
        assert mx.array_equal(keys, row.planes()[0][0]).item()
    lm.save_prompt_cache(path, [theirs])
    (back,) = load_prompt_cache(path)
    assert back.row_offsets == (3, 6)
    assert state_rows(back) == state_rows(layout)


def test_an_mlx_lm_file_of_a_class_kvrows_lacks_is_refused(tmp_path: Path) -> None:
    arrays = lm.ArraysCache(2)
    arrays[0] = mx.zeros((1, 3, 4))
    arrays[1] = mx.zeros((1, 2, 4))
    path = str(tmp_path / "ssm.safetensors")
    lm.save_prompt_cache(path, [lm.KVCache(), arrays])
    with pytest.raises(UnsupportedStateError, match="ArraysCache"):
        load_prompt_cache(path)


def test_the_older_mlx_lm_format_is_read(tmp_path: Path) -> None:
    """mlx-lm before 0.32.2 kept the scalars in ``meta_state`` strings."""
    keys = mx.array(np.random.default_rng(2).standard_normal((1, 2, 4, DIM)).astype(np.float32))
    path = str(tmp_path / "old.safetensors")
    metadata = {
        "0.0": "",
        "0.1.0": "0",
        "0.1.1": "6",
        "0.1.2": "4",
        "0.1.3": "4",
        "1.who": "old",
        "2.0": "KVCache",
        "2.1": "RotatingKVCache",
    }
    mx.save_safetensors(path, {"0.0": keys, "0.1": keys, "1.0": keys, "1.1": keys}, metadata)
    (plain, ring), user = load_prompt_cache(path, return_metadata=True)
    assert user == {"who": "old"}
    assert plain.offset == 4 and ring.offset == 4 and ring.max_size == 6
    assert mx.array_equal(plain.planes()[0][0], keys).item()


# -- refusals ---------------------------------------------------------------------------


def _rewrite_description(path: Path, edit: Callable[[dict[str, Any]], object]) -> None:
    """Pass the kvrows description of the file at ``path`` through ``edit``, and write the
    file again with a valid checksum over the new description."""
    arrays, metadata = read_safetensors(path)
    description = json.loads(metadata[KVROWS_KEY])
    edit(description)
    metadata[KVROWS_KEY] = json.dumps(description)
    write_atomic(path, arrays, metadata)


def test_a_version_2_file_records_each_layer_form_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "v2.safetensors"
    plain = _filled(optimized, "KVCache", [3], seed=1)
    ring = _filled(optimized, "RotatingKVCache", [5], seed=2)
    save_prompt_cache(path, [plain, ring])
    _, metadata = read_safetensors(path)
    description = json.loads(metadata[KVROWS_KEY])
    assert FORMAT_VERSION == 2 and description["format"] == 2
    assert [layer["form"] for layer in description["layers"]] == [1, 1]  # form 1 is the rule
    for implementation in ("optimized", "reference"):
        loaded = load_prompt_cache(path, implementation=implementation)
        assert [c.signature() for c in loaded] == [plain.signature(), ring.signature()]
        assert [c.offset for c in loaded] == [plain.offset, ring.offset]
        for saved, back in zip((plain, ring), loaded, strict=True):
            for a, b in zip(saved.state, back.state, strict=True):
                assert np.array_equal(np.asarray(a), np.asarray(b)), implementation


def test_a_layer_without_a_form_version_is_form_1(tmp_path: Path) -> None:
    path = tmp_path / "formless.safetensors"
    save_prompt_cache(path, [_filled(optimized, "KVCache", [3], seed=1)])
    _rewrite_description(path, lambda description: description["layers"][0].pop("form"))
    assert load_prompt_cache(path)[0].offset == 3


def _layer(index: int, **fields: object) -> Callable[[dict[str, Any]], object]:
    return lambda description: description["layers"][index].update(fields)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (
            _layer(1, form=FORM_VERSION + 1),
            UnsupportedStateError,
            f"layer 1: .*form version {FORM_VERSION + 1}; this kvrows reads forms up",
        ),
        (_layer(1, form=0), CorruptStateError, "layer 1: .*form version must be 1 or more, got 0"),
        (
            _layer(1, form="1"),
            CorruptStateError,
            "layer 1: .*form version must be an integer, got '1'",
        ),
        (_layer(0, composition="FancyCache"), UnsupportedStateError, "FancyCache"),
        (
            lambda description: description.update(format=FORMAT_VERSION + 1),
            UnsupportedStateError,
            "upgrade kvrows",
        ),
    ],
    ids=["newer form", "form 0", "form text", "unknown class", "newer format"],
)
def test_an_unknown_format_form_or_class_is_refused(
    tmp_path: Path, edit: Callable[[dict[str, Any]], object], error: type[Exception], message: str
) -> None:
    path = tmp_path / "future.safetensors"
    save_prompt_cache(
        path, [_filled(optimized, "KVCache", [3], seed=1), _filled(optimized, "KVCache", [2], 2)]
    )
    _rewrite_description(path, edit)
    with pytest.raises(error, match=r"future\.safetensors: .*" + message):
        load_prompt_cache(path)


def test_a_file_whose_state_disagrees_with_its_class_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    save_prompt_cache(path, [_filled(optimized, "KVCache", [3], seed=1)])
    arrays, metadata = read_safetensors(path)
    arrays["0.2"] = mx.array(7)  # offset 7 over 3 columns
    write_atomic(path, arrays, metadata)
    with pytest.raises(CorruptStateError):
        load_prompt_cache(path)


def test_a_flipped_byte_is_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "flip.safetensors"
    save_prompt_cache(path, [_filled(optimized, "KVCache", [3], seed=1)])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptStateError):
        load_prompt_cache(path)


def test_refused_saves_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "none.safetensors"
    cache = _filled(optimized, "KVCache", [3], seed=1)
    with pytest.raises(InvalidInputError, match="not a kvrows cache"):
        save_prompt_cache(path, [cache, lm.KVCache()])
    with pytest.raises(InvalidInputError, match="reserved"):
        save_prompt_cache(path, [cache], {"kvrows": "mine"})
    with pytest.raises(InvalidInputError, match="str to str"):
        save_prompt_cache(path, [cache], {"n": 3})  # type: ignore[dict-item]
    assert not path.exists()
    assert not list(tmp_path.iterdir())


def test_from_state_refuses_malformed_states() -> None:
    cache = _filled(optimized, "KVCache", [3], seed=1)
    keys, values, offset = cache.state
    before = state_rows(cache)
    with pytest.raises(InvalidInputError, match="3 fields"):
        optimized.KVCache.from_state((keys, values))
    with pytest.raises(InvalidInputError):
        optimized.KVCache.from_state((keys, values, offset + 1))
    with pytest.raises(InvalidInputError):
        cache.state = (keys, None, offset)
    assert state_rows(cache) == before  # a refused setter changed nothing


def test_ring_batch_files_interoperate_with_mlx_lm(tmp_path: Path) -> None:
    """A shared-column ring layout saves as mlx-lm's ``BatchRotatingKVCache`` (same
    physical form): loaded by mlx-lm, its next decode steps read what kvrows' read."""
    rng = np.random.default_rng(4)
    rows = [
        _filled(optimized, "RotatingKVCache", sizes, seed=i) for i, sizes in enumerate([[8], [3]])
    ]
    layout = optimized.BatchedRotatingCache(6)
    layout.merge_rows(rows)
    for _ in range(4):  # wrap the shared ring
        block = mx.array(rng.standard_normal((2, 2, 1, DIM)).astype(np.float32))
        layout.update_and_fetch(block, block)
    path = str(tmp_path / "rings.safetensors")
    save_prompt_cache(path, [layout])
    (theirs,) = lm.load_prompt_cache(path)
    assert type(theirs).__name__ == "BatchRotatingKVCache"
    assert theirs.offset.tolist() == list(layout.row_offsets)
    # mlx-lm's own loaded BatchRotatingKVCache lacks ``_lengths`` and cannot update (its
    # from_state skips __init__; a file mlx-lm saved itself fails the same way).
    assert not hasattr(theirs, "_lengths")
    theirs._lengths = None
    for _ in range(3):
        ours = layout.make_mask(1)
        assert isinstance(ours, mx.array)
        assert mx.array_equal(theirs.make_mask(1), ours).item()
        block = mx.array(rng.standard_normal((2, 2, 1, DIM)).astype(np.float32))
        got, want = theirs.update_and_fetch(block, block), layout.update_and_fetch(block, block)
        assert _fetch_equal(got[0], want[0]) and _fetch_equal(got[1], want[1])
    lm.save_prompt_cache(path, [theirs])
    (back,) = load_prompt_cache(path)
    assert back.row_offsets == layout.row_offsets
    assert state_rows(back) == state_rows(layout)
