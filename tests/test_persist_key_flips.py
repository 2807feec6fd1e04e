"""A kvrows prompt-cache file with one flipped bit anywhere, its checksum key's name
included, is refused by ``load_prompt_cache`` and is a miss (and removed) in the prefix
store; a kvrows file never passes for an mlx-lm file (which carries no checksum).

Every test here compares against the file as saved: flips are applied to its bytes and
the loaders must refuse; nothing is derived from the code under test."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvrows.conformance.profiles import active_profile
from kvrows.errors import CorruptStateError, InvalidInputError
from kvrows.optimized import KVCache, QuantizedKVCache, RotatingKVCache
from kvrows.persist.files import CHECKSUM_KEY, read_safetensors, write_atomic
from kvrows.persist.prefix_store import PrefixStore
from kvrows.persist.prompt_cache import KVROWS_KEY, load_prompt_cache, save_prompt_cache
from kvrows.protocols import Cache

#: mlx-lm's cache module (untyped).
lm: Any = mlx_lm_cache

TOKENS = (101, 102)


def _cache() -> KVCache:
    """One tiny layer (so an exhaustive sweep of the file's bits takes a second or two)."""
    cache = KVCache()
    cache.update_and_fetch(*_planes())
    return cache


def _planes() -> tuple[mx.array, mx.array]:
    """Keys and values ``[1, 1, 2, 2]`` (float16) of the two stored tokens."""
    keys = mx.array(np.arange(4, dtype=np.float16).reshape(1, 1, 2, 2))
    return keys, keys + 1


def _flipped(data: bytes, position: int, bit: int) -> bytes:
    damaged = bytearray(data)
    damaged[position] ^= 1 << bit
    return bytes(damaged)


def _header_length(data: bytes) -> int:
    return 8 + int(struct.unpack("<Q", data[:8])[0])


def _key_name_bits(data: bytes, key: str) -> list[tuple[int, int]]:
    """Every (byte, bit) of the name of metadata ``key`` in the file's header."""
    start = data.index(f'"{key}"'.encode()) + 1
    return [(p, b) for p in range(start, start + len(key.encode())) for b in range(8)]


def _all_bits(data: bytes) -> list[tuple[int, int]]:
    """Every bit of the file: header length, header JSON and data."""
    return [(p, b) for p in range(len(data)) for b in range(8)]


def _rows(kind: str) -> list[Cache]:
    """``one layer``: the tiny plain layer (CI sweeps every bit of its file in a second
    or two). ``three kinds`` (deep profile): plain, quantized and ring layers, so more
    forms' metadata and planes are flipped."""
    if kind == "one layer":
        return [_cache()]
    keys = mx.array(np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 1, 2, 32))
    layers: list[Any] = [KVCache(), QuantizedKVCache(32, 4), RotatingKVCache(4)]
    for layer in layers:
        layer.update_and_fetch(keys, -keys)
    return layers


#: The files the exhaustive sweeps flip: more in the deep profile.
KINDS = ["one layer"] + (["three kinds"] if active_profile().name == "deep" else [])


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("saved") / "cache.safetensors"
    save_prompt_cache(path, [_cache()], {"model": "tiny"})
    return path.read_bytes()


@pytest.mark.parametrize("kind", KINDS)
def test_every_single_bit_flip_is_refused_by_load_prompt_cache(tmp_path: Path, kind: str) -> None:
    """Every bit of the file flipped alone: ``CorruptStateError``. Before the fix, 105 of
    the 136 flips of the checksum key's name loaded, unverified."""
    path = tmp_path / "damaged.safetensors"
    save_prompt_cache(path, _rows(kind), {"model": "tiny"})
    saved = path.read_bytes()
    messages: set[str] = set()
    for position, bit in _all_bits(saved):
        path.write_bytes(_flipped(saved, position, bit))
        with pytest.raises(CorruptStateError) as caught:
            load_prompt_cache(path, return_metadata=True)
        messages.add(str(caught.value))
    # The checksum key's own name is among the flips, and its damage is named.
    assert any(f"one bit from kvrows' {CHECKSUM_KEY!r}" in m for m in messages)
    assert any("checksum mismatch" in m for m in messages)


def test_reserved_key_name_flips_are_refused_by_the_reference_loader_too(
    saved: bytes, tmp_path: Path
) -> None:
    path = tmp_path / "damaged.safetensors"
    for key in (KVROWS_KEY, CHECKSUM_KEY):
        for position, bit in _key_name_bits(saved, key):
            path.write_bytes(_flipped(saved, position, bit))
            with pytest.raises(CorruptStateError):
                load_prompt_cache(path, implementation="reference")


def test_a_damaged_checksum_key_lets_no_damaged_data_through(saved: bytes, tmp_path: Path) -> None:
    """The issue's case: the checksum key's name flipped and one more bit of the data: before
    the fix the damaged keys plane came back (105 of 136 name flips)."""
    path = tmp_path / "damaged.safetensors"
    header = json.loads(saved[8 : _header_length(saved)])
    data_bit = (_header_length(saved) + header["0.0"]["data_offsets"][0] + 1, 3)  # a key
    for position, bit in _key_name_bits(saved, CHECKSUM_KEY):
        path.write_bytes(_flipped(_flipped(saved, position, bit), *data_bit))
        with pytest.raises(CorruptStateError):
            load_prompt_cache(path)


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_kvrows_metadata_without_its_checksum_is_refused(saved: bytes, tmp_path: Path) -> None:
    """The checksum entry removed whole (not a one-bit damage): still not an mlx-lm file."""
    arrays, metadata = mx.load(_write(tmp_path / "a.safetensors", saved), return_metadata=True)
    assert isinstance(arrays, dict) and isinstance(metadata, dict)
    del metadata[CHECKSUM_KEY]
    path = str(tmp_path / "stripped.safetensors")
    mx.save_safetensors(path, arrays, metadata)
    with pytest.raises(CorruptStateError, match="without its checksum"):
        load_prompt_cache(path)


def test_mlx_lm_files_load_unless_a_checksum_is_required(tmp_path: Path) -> None:
    """mlx-lm's files (user metadata included, even keys that start like kvrows') still
    load; ``require_checksum`` refuses them; a key one bit from a kvrows key does not."""
    theirs = lm.KVCache()
    planes = mx.array(np.arange(8, dtype=np.float32).reshape(1, 1, 2, 4))
    theirs.update_and_fetch(planes, planes)
    path = str(tmp_path / "mlx-lm.safetensors")
    user = {"model": "tiny", "kvrows_note": "x", "kvrow": "y"}
    lm.save_prompt_cache(path, [theirs], user)
    (loaded,), metadata = load_prompt_cache(path, return_metadata=True)
    assert metadata == user and loaded.offset == 2
    with pytest.raises(CorruptStateError, match="no checksum"):
        load_prompt_cache(path, require_checksum=True)
    with pytest.raises(InvalidInputError, match="require_checksum"):
        load_prompt_cache(path, require_checksum=1)  # type: ignore[arg-type]
    lm.save_prompt_cache(path, [theirs], {"kvrowr": "y"})  # "kvrows" with one bit flipped
    with pytest.raises(CorruptStateError, match="one bit from kvrows'"):
        load_prompt_cache(path)


@pytest.mark.parametrize(
    "key", ["kvrows", "kvrows_checksum", "kvrowr", "kvrows_checksuo", "jvrows"]
)
def test_reserved_and_near_reserved_user_keys_are_refused(tmp_path: Path, key: str) -> None:
    """kvrows never writes a key it would take for a damaged one of its own."""
    path = tmp_path / "refused.safetensors"
    with pytest.raises(InvalidInputError, match="reserved"):
        save_prompt_cache(path, [_cache()], {key: "x"})
    assert not path.exists()


# -- the prefix store ------------------------------------------------------------------
def _entry(store: PrefixStore) -> Path:
    (entry,) = store.entries()
    return store.directory / "entries" / f"{entry.key}.safetensors"


def _same_rows(found: list[Cache], expected: list[Cache]) -> bool:
    """Every array of every layer's state equal (quantized planes are nested tuples)."""
    flat_found = cast(list[tuple[str, Any]], tree_flatten([c.state for c in found]))
    flat_expected = cast(list[tuple[str, Any]], tree_flatten([c.state for c in expected]))
    return [name for name, _ in flat_found] == [name for name, _ in flat_expected] and all(
        mx.array_equal(a, b).item()
        for (_, a), (_, b) in zip(flat_found, flat_expected, strict=True)
    )


@pytest.mark.parametrize("kind", KINDS)
def test_every_single_bit_flip_of_an_entry_is_a_miss_and_removed(tmp_path: Path, kind: str) -> None:
    """Each bit of a stored entry flipped alone: the lookup misses and the entry is
    deleted as corrupt (a miss alone could be a token mismatch; the deletion says the
    loader refused it). Before the fix a flip in the checksum key's name was a hit, the
    file unverified."""
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=2)
    assert store.put(TOKENS, _rows(kind)) == 2
    path = _entry(store)
    saved = path.read_bytes()
    hit = store.longest(TOKENS)
    assert hit is not None and hit[0] == 2 and _same_rows(hit[1], _rows(kind))
    for position, bit in _all_bits(saved):
        path.write_bytes(_flipped(saved, position, bit))
        assert store.longest(TOKENS) is None, (position, bit)
        assert not path.exists(), (position, bit)


def test_an_entry_without_a_checksum_is_a_miss(tmp_path: Path) -> None:
    """An entry replaced by an mlx-lm file of the same rows and metadata: the store reads
    through the verified path, so it is not served."""
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=2)
    store.put(TOKENS, [_cache()])
    path = _entry(store)
    _, metadata = load_prompt_cache(path, return_metadata=True)
    theirs = lm.KVCache()
    theirs.update_and_fetch(*_planes())
    lm.save_prompt_cache(str(path), [theirs], metadata)
    caches = load_prompt_cache(path)  # a whole, valid mlx-lm file with the same rows
    assert _same_rows(caches, [_cache()])
    assert store.longest(TOKENS) is None and not path.exists()


@pytest.mark.parametrize(
    "layers", [None, "KVCache", ["KVCache"], [{"token_geometry": "ring"}]], ids=repr
)
def test_a_checksummed_description_of_the_wrong_shape_is_corrupt(
    saved: bytes, tmp_path: Path, layers: object
) -> None:
    """A whole file (valid checksum) whose description's layers are not records: refused
    as ``CorruptStateError``, not a ``KeyError`` / ``AttributeError`` that a prefix store
    lookup would let out."""
    path = tmp_path / "odd.safetensors"
    path.write_bytes(saved)
    arrays, metadata = read_safetensors(path)
    description = json.loads(metadata[KVROWS_KEY])
    if layers is None:
        del description["layers"]
    else:
        description["layers"] = layers
    metadata[KVROWS_KEY] = json.dumps(description)
    write_atomic(path, arrays, metadata)  # stamped with a valid checksum
    with pytest.raises(CorruptStateError, match="layers"):
        load_prompt_cache(path)
