"""Files written by earlier versions keep loading (issue 23).

``tests/data/saved_v1/`` holds prompt-cache files and prefix-store entries that kvrows'
format 1 wrote (``tools/write_saved_files.py``): every class either implementation saves,
every codec, from both implementations. Oracle: ``manifest.json``, whose facts (class,
offsets, signature) and content digest were taken from the live caches before they were
saved, never read back from a file. Each file must load, with the current loaders, into
both implementations and read what the live caches of that implementation read; a
damaged copy must be refused. A format change keeps a reader for these files
(``spec/persistence-files.md``, "Files written by earlier versions").
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import mlx.core as mx
import numpy as np
import pytest

from kvrows.errors import CorruptStateError
from kvrows.persist.prefix_store import PrefixStore
from kvrows.persist.prompt_cache import load_prompt_cache

DATA = Path(__file__).parent / "data" / "saved_v1"
MANIFEST: dict[str, Any] = json.loads((DATA / "manifest.json").read_text())
CASES: list[dict[str, Any]] = MANIFEST["cases"]
Implementation = Literal["optimized", "reference"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("optimized", "reference")

#: Files today's loader cannot read: a bug, not a format change (empty: the turbo lego's
#: record, which holds k_bits and v_bits, loads since the lego class names its codec).
#: Strict, so a fix must drop its entry here.
UNLOADABLE: dict[str, str] = {}

#: The seed's 26 classes and the three bf16-first legos: each must have a saved file.
SEED_CLASSES = {
    "KVCache", "PaddedKVRows", "BatchedKVCache", "QuantizedKVCache", "PaddedQuantKVRows",
    "BatchedQuantizedKVCache", "TurboQuantKVCache", "BatchedTurboQuantKVCache",
    "RotatingKVCache", "BatchedRotatingCache", "RaggedRotatingRows",
    "SpeculativeRotatingKVCache", "RotatingQuantizedKVCache", "BatchedRotatingQuantCache",
    "RotatingAffineLayout", "SpeculativeRotatingAffineLayout", "DelayedQuantizedKVCache",
    "DelayedRotatingQuantizedKVCache", "DelayedTurboQuantKVCache", "MLACache",
    "EncodedLatentCache", "SSMCache", "BatchedSSMCache", "PagedKVCache", "PagedKvRows",
    "PagedLatentCache", "Bf16FirstQuantizedKVCache", "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
}  # fmt: skip


def _load_writer() -> ModuleType:
    """``tools/write_saved_files.py``: its ``layer_facts`` and ``content_digest`` are the
    manifest's definitions (tools/ is not a package)."""
    path = Path(__file__).parent.parent / "tools" / "write_saved_files.py"
    spec = importlib.util.spec_from_file_location("write_saved_files", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


writer = _load_writer()


def _files() -> list[Any]:
    params = []
    for case in CASES:
        for saved_by in IMPLEMENTATIONS:
            marks = []
            if case["name"] in UNLOADABLE:
                reason = UNLOADABLE[case["name"]]
                marks.append(
                    pytest.mark.xfail(raises=CorruptStateError, strict=True, reason=reason)
                )
            params.append(
                pytest.param(case, saved_by, id=f"{saved_by}-{case['name']}", marks=marks)
            )
    return params


def _check(caches: list[Any], live: dict[str, Any]) -> None:
    """``caches`` hold what the live caches held: facts, then the digest (which probes)."""
    assert [writer.layer_facts(cache) for cache in caches] == live["layers"]
    assert writer.content_digest(caches) == live["content_digest"]


def test_the_folder_is_this_format_and_covers_every_class() -> None:
    assert MANIFEST["prompt_cache_format"] == 1 and MANIFEST["prefix_store_format"] == "1"
    for implementation in IMPLEMENTATIONS:
        saved = {
            layer["class"] for case in CASES for layer in case["live"][implementation]["layers"]
        }
        assert saved >= SEED_CLASSES
    assert any("prefix_store" in case for case in CASES)


@pytest.mark.parametrize(("case", "saved_by"), _files())
def test_a_saved_prompt_cache_file_loads_into_both_implementations(
    case: dict[str, Any], saved_by: Implementation
) -> None:
    path = DATA / case["prompt_cache"][saved_by]
    with mx.stream(mx.cpu):
        for implementation in IMPLEMENTATIONS:
            caches, metadata = load_prompt_cache(
                path, return_metadata=True, implementation=implementation
            )
            assert metadata == {"fixture": case["name"]}
            _check(list(caches), case["live"][implementation])


#: Shared-column ring layouts: ``left_pad`` is mlx-lm's ``left_padding``, negative once a
#: wrapped ring overwrote a row's pads (a ragged ring reports 0: its rows are left-aligned).
SHARED_RINGS = {
    "BatchedRotatingCache", "BatchedRotatingQuantCache", "RotatingAffineLayout",
    "SpeculativeRotatingAffineLayout",
}  # fmt: skip


@pytest.mark.parametrize(
    ("case", "saved_by"),
    [
        param
        for param in _files()
        if any(
            layer["class"] in SHARED_RINGS
            for layer in param.values[0]["live"][param.values[1]]["layers"]
        )
    ],
)
def test_a_loaded_ring_layout_reports_the_saved_pads_raw(
    case: dict[str, Any], saved_by: Implementation
) -> None:
    """The manifest records pads clamped at 0 (a file saved before the fix holds 0 where
    the live pad was negative); a load must give back the file's ``left_padding`` (state
    field 3) itself, negative entries included, in either implementation."""
    path = DATA / case["prompt_cache"][saved_by]
    arrays = mx.load(str(path))
    assert isinstance(arrays, dict)
    layers = case["live"][saved_by]["layers"]
    with mx.stream(mx.cpu):
        for implementation in IMPLEMENTATIONS:
            caches = load_prompt_cache(path, implementation=implementation)
            for i, (layer, cache) in enumerate(zip(layers, caches, strict=True)):
                if layer["class"] in SHARED_RINGS:
                    saved = tuple(int(p) for p in np.asarray(arrays[f"{i}.3"]))
                    assert cache.left_pad == saved, (implementation, i)


@pytest.mark.parametrize("saved_by", IMPLEMENTATIONS)
def test_saved_prefix_store_entries_are_found_and_load(
    tmp_path: Path, saved_by: Implementation
) -> None:
    directory = tmp_path / "store"  # a lookup refreshes recency: a copy, not the fixture
    shutil.copytree(DATA / f"prefix_store_{saved_by}", directory)
    settings = MANIFEST["prefix_store"]
    store = PrefixStore(
        directory,
        byte_budget=1 << 30,
        block_tokens=settings["block_tokens"],
        fingerprint=settings["fingerprint"],
    )
    stored = [case for case in CASES if "prefix_store" in case]
    assert len(store) == len(stored)
    with mx.stream(mx.cpu):
        for case in stored:
            tokens = case["prefix_store"]["tokens"]
            hit = store.longest(tokens)
            assert hit is not None, case["name"]
            matched, caches = hit
            assert matched == len(tokens)
            _check(caches, case["live"]["optimized"])  # the store loads optimized caches
    assert len(store) == len(stored)  # none taken for corrupt and removed


def _flipped(source: Path, target: Path) -> Path:
    """A copy of ``source`` with one bit flipped in the middle of its array data."""
    data = bytearray(source.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # after the safetensors header
    data[(start + len(data)) // 2] ^= 0x10
    target.write_bytes(bytes(data))
    return target


@pytest.mark.parametrize("saved_by", IMPLEMENTATIONS)
def test_an_altered_file_is_refused_by_its_checksum(
    tmp_path: Path, saved_by: Implementation
) -> None:
    for case in CASES:
        path = _flipped(DATA / case["prompt_cache"][saved_by], tmp_path / "flipped.safetensors")
        with pytest.raises(CorruptStateError, match="checksum mismatch"):
            load_prompt_cache(path)


def test_an_altered_store_entry_is_a_miss(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    shutil.copytree(DATA / "prefix_store_optimized", directory)
    settings = MANIFEST["prefix_store"]
    store = PrefixStore(
        directory, byte_budget=1 << 30, block_tokens=settings["block_tokens"],
        fingerprint=settings["fingerprint"],
    )  # fmt: skip
    case = next(case for case in CASES if "prefix_store" in case)
    tokens = case["prefix_store"]["tokens"]
    entry = directory / "entries" / f"{store.chain(tokens)[-1]}.safetensors"
    _flipped(entry, entry)
    assert store.longest(tokens) is None


def test_the_digest_sees_one_changed_value() -> None:
    """The check can fail: a load that differs in one element of one token (offsets and
    class the same) does not match the manifest."""
    case = next(case for case in CASES if case["name"] == "KVCache-default-float16")
    live = case["live"]["optimized"]
    with mx.stream(mx.cpu):
        (cache,) = load_prompt_cache(DATA / case["prompt_cache"]["optimized"])
        keys, values = cache.fetch()
        last_keys, last_values = keys[:, :, -1:, :], values[:, :, -1:, :]
        cache.trim(1)
        changed = np.array(last_keys)
        changed[0, 0, 0, 0] += 1
        cache.update_and_fetch(mx.array(changed), last_values)
        assert [writer.layer_facts(cache)] == live["layers"]
        assert writer.content_digest([cache]) != live["content_digest"]
