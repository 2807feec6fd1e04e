"""The on-disk prefix store: block-chain lookup, longest usable prefix, collision safety,
LRU under a byte budget, corrupt entries, and several processes sharing one directory.

Every hit is compared bit for bit with an independent oracle: the rows a position-by-
position generator gives for the matched tokens (each position's keys and values depend
only on the tokens up to it, as a model's KV does)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.persist.prefix_store as prefix_store
from kvrows.app.cli import main
from kvrows.app.demo import builtin_trace, check_invariance
from kvrows.app.engine import Engine, model_fingerprint
from kvrows.app.models import tiny_model
from kvrows.errors import CorruptStateError, InvalidInputError
from kvrows.optimized import KVCache, RotatingKVCache
from kvrows.persist.files import read_safetensors, write_atomic
from kvrows.persist.prefix_store import (
    FORMAT_VERSION,
    VERSION_KEY,
    PrefixStore,
    reusable_copies,
    servable_prefixes,
)
from kvrows.persist.prompt_cache import load_prompt_cache
from kvrows.protocols import Cache
from kvrows.schemes import KvStorageScheme

HEADS, DIM, LAYERS = 2, 4, 2


# -- the oracle: rows determined by their tokens ------------------------------------------
def _position(tokens: Sequence[int], layer: int) -> np.ndarray[Any, Any]:
    """Keys and values ``[2, HEADS, DIM]`` of the last of ``tokens`` in ``layer``."""
    digest = hashlib.sha256(f"{layer}:{','.join(map(str, tokens))}".encode()).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    return rng.standard_normal((2, HEADS, DIM)).astype(np.float32)


def _planes(tokens: Sequence[int], layer: int) -> np.ndarray[Any, Any]:
    """``[2, 1, HEADS, len(tokens), DIM]``: keys and values of every position."""
    per = [_position(tokens[: p + 1], layer) for p in range(len(tokens))]
    return np.stack(per, axis=2)[:, None]


def _row(tokens: Sequence[int], *, ring: int | None = None) -> list[Cache]:
    caches: list[Cache] = []
    for layer in range(LAYERS):
        planes = _planes(tokens, layer)
        cache: Any = KVCache() if ring is None else RotatingKVCache(max_size=ring)
        cache.update_and_fetch(mx.array(planes[0]), mx.array(planes[1]))
        caches.append(cache)
    return caches


def _held(cache: Cache) -> np.ndarray[Any, Any]:
    """The positions a plain serial cache holds, as ``[2, 1, HEADS, offset, DIM]``."""
    keys, values = cache.state[:2]
    offset = int(cache.offset)
    return np.stack([np.array(keys)[..., :offset, :], np.array(values)[..., :offset, :]])


def _identical(caches: Sequence[Cache], tokens: Sequence[int]) -> bool:
    """Bit for bit: the caches hold exactly the oracle's rows for ``tokens``."""
    if len(caches) != LAYERS:
        return False
    for layer, cache in enumerate(caches):
        if int(cache.offset) != len(tokens):
            return False
        held, expected = _held(cache), _planes(tokens, layer)
        if held.dtype != expected.dtype or held.shape != expected.shape:
            return False
        if not np.array_equal(held.view(np.uint32), expected.view(np.uint32)):
            return False
    return True


def _store(directory: Path, **kw: Any) -> PrefixStore:
    kw.setdefault("byte_budget", 1 << 30)
    return PrefixStore(directory, **kw)


class _Clock:
    """Recency stamps one second apart, so LRU order does not depend on timing."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _tokens(seed: int, length: int) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(t) for t in rng.integers(100, 1000, size=length))  # 3 digits: equal sizes


# -- semantics ----------------------------------------------------------------------------
def test_exact_blocks_match_and_a_hit_is_the_stored_rows(tmp_path: Path) -> None:
    store = _store(tmp_path, block_tokens=16)
    tokens = _tokens(0, 40)
    assert store.put(tokens, _row(tokens)) == 32  # the last block boundary
    hit = store.longest(tokens)
    assert hit is not None and hit[0] == 32 and _identical(hit[1], tokens[:32])
    # a longer prompt sharing the stored blocks: the same 32 tokens
    longer = (*tokens[:32], 5, 6, 7)
    hit = store.longest(longer)
    assert hit is not None and hit[0] == 32 and _identical(hit[1], tokens[:32])
    # a cut at an earlier boundary: limit, and a prompt that diverges in block 2
    hit = store.longest(tokens, limit=31)
    assert hit is not None and hit[0] == 16 and _identical(hit[1], tokens[:16])
    diverges = (*tokens[:20], 999, *tokens[21:])
    hit = store.longest(diverges)
    assert hit is not None and hit[0] == 16 and _identical(hit[1], tokens[:16])
    # one token off in block 1, a prompt shorter than a block, limit below a block: misses
    assert store.longest((tokens[0] + 1, *tokens[1:])) is None
    assert store.longest(tokens[:15]) is None
    assert store.longest(tokens, limit=15) is None
    assert store.longest(tokens, beyond=32) is None
    hit = store.longest(tokens, beyond=16)
    assert hit is not None and hit[0] == 32


def test_the_longest_usable_prefix_wins(tmp_path: Path) -> None:
    store = _store(tmp_path, block_tokens=8)
    base = _tokens(1, 8)
    short = base + _tokens(2, 8)  # 16
    long = base + _tokens(3, 40)  # 48
    other = base + _tokens(4, 16)  # 24: shares one block with both
    for tokens in (short, long, other):
        assert store.put(tokens, _row(tokens)) == len(tokens)
    query = (*long, 1, 2, 3)
    hit = store.longest(query)
    assert hit is not None and hit[0] == 48 and _identical(hit[1], long)
    # a prompt sharing 4 blocks of ``long``: cut from it
    query = long[:32] + (7,) * 20
    hit = store.longest(query)
    assert hit is not None and hit[0] == 32 and _identical(hit[1], long[:32])
    hit = store.longest((*short, 9))
    assert hit is not None and hit[0] == 16 and _identical(hit[1], short)
    # only the shared first block
    hit = store.longest(base + (0,) * 30)
    assert hit is not None and hit[0] == 8 and _identical(hit[1], base)


def test_a_hash_collision_never_returns_wrong_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prefix_store, "_block_hash", lambda previous, block: b"\0" * 32)
    store = _store(tmp_path, block_tokens=8)
    first, second = _tokens(5, 16), _tokens(6, 16)
    assert store.chain(first) == store.chain(second)  # every chain collides
    store.put(first, _row(first))
    assert store.longest(second) is None
    hit = store.longest(first)
    assert hit is not None and _identical(hit[1], first)
    store.put(second, _row(second))  # same key: the newer entry replaces the older
    assert len(store) == 1
    assert store.longest(first) is None
    hit = store.longest(second)
    assert hit is not None and hit[0] == 16 and _identical(hit[1], second)


def test_stores_of_other_fingerprints_do_not_match(tmp_path: Path) -> None:
    tokens = _tokens(7, 16)
    _store(tmp_path, block_tokens=8, fingerprint="llama|plain").put(tokens, _row(tokens))
    assert _store(tmp_path, block_tokens=8, fingerprint="llama|affine8").longest(tokens) is None
    hit = _store(tmp_path, block_tokens=8, fingerprint="llama|plain").longest(tokens)
    assert hit is not None and _identical(hit[1], tokens)


def test_a_wrapped_ring_is_stored_and_served_only_whole(tmp_path: Path) -> None:
    store = _store(tmp_path, block_tokens=8)
    wrapped = _tokens(8, 20)  # window 12: wrapped, and 20 is not a block boundary
    caches = _row(wrapped, ring=12)
    assert servable_prefixes(caches, [8, 16, 20]) == {20}
    assert store.put(wrapped, caches) == 0 and len(store) == 0
    unwrapped = _tokens(9, 20)  # window 32: any cut
    assert servable_prefixes(_row(unwrapped, ring=32), [8, 16, 20]) == {8, 16, 20}
    assert store.put(unwrapped, _row(unwrapped, ring=32)) == 16
    whole = _tokens(10, 24)  # window 12, wrapped at exactly three blocks
    assert store.put(whole, _row(whole, ring=12)) == 24
    assert store.longest(whole[:16] + (1,) * 10) is None  # would need a cut


class _DelayedKVCache(KVCache):
    """A plain cache whose prefix below 20 positions may not be reused."""

    @property
    def minimum_reusable_offset(self) -> int:
        return 20


def test_minimum_reusable_offset_bounds_the_cut(tmp_path: Path) -> None:
    tokens = _tokens(11, 32)
    planes = [_planes(tokens, layer) for layer in range(LAYERS)]
    delayed: list[Cache] = []
    for layer in range(LAYERS):
        cache = _DelayedKVCache()
        cache.update_and_fetch(mx.array(planes[layer][0]), mx.array(planes[layer][1]))
        delayed.append(cache)
    assert servable_prefixes(delayed, [8, 16, 24, 32]) == {24, 32}
    assert reusable_copies(delayed, 16) is None
    copies = reusable_copies(delayed, 24)
    assert copies is not None and _identical(copies, tokens[:24])
    assert _identical(delayed, tokens)  # the sources are unchanged
    store = _store(tmp_path, block_tokens=8)
    assert store.put(tokens, delayed) == 32
    assert store.longest(tokens[:16] + (0,) * 16) is None  # 16 < 20
    hit = store.longest(tokens[:24] + (0,) * 8)
    assert hit is not None and hit[0] == 24 and _identical(hit[1], tokens[:24])


def test_lru_under_the_byte_budget(tmp_path: Path) -> None:
    clock = _Clock()
    probe = _store(tmp_path / "probe", block_tokens=8)
    probe.put(_tokens(0, 16), _row(_tokens(0, 16)))
    size = probe.nbytes
    store = _store(tmp_path / "lru", block_tokens=8, byte_budget=3 * size, clock=clock)
    rows = [_tokens(20 + i, 16) for i in range(5)]
    for tokens in rows[:3]:
        assert store.put(tokens, _row(tokens)) == 16
    assert len(store) == 3 and store.nbytes == 3 * size
    assert store.longest(rows[0]) is not None  # refreshes rows[0]
    store.put(rows[3], _row(rows[3]))  # evicts the least recently used: rows[1]
    assert store.longest(rows[1]) is None
    assert store.longest(rows[2]) is not None  # now rows[0] is the oldest
    store.put(rows[4], _row(rows[4]))
    assert store.longest(rows[0]) is None
    for tokens in (rows[2], rows[3], rows[4]):
        hit = store.longest(tokens)
        assert hit is not None and _identical(hit[1], tokens)
    assert store.nbytes <= 3 * size
    # an entry larger than the whole budget is not kept
    tiny = _store(tmp_path / "tiny", block_tokens=8, byte_budget=size - 1)
    assert tiny.put(rows[0], _row(rows[0])) == 0 and len(tiny) == 0


def test_eviction_drops_the_markers_of_what_it_evicts(tmp_path: Path) -> None:
    probe = _store(tmp_path / "probe", block_tokens=8)
    probe.put(_tokens(0, 32), _row(_tokens(0, 32)))
    store = _store(tmp_path / "s", block_tokens=8, byte_budget=probe.nbytes, clock=_Clock())
    first, second = _tokens(30, 32), _tokens(31, 32)
    store.put(first, _row(first))
    assert len(os.listdir(tmp_path / "s" / "blocks")) == 3  # blocks 1..3 of 4 are marked
    store.put(second, _row(second))  # evicts ``first``
    assert len(store) == 1 and len(os.listdir(tmp_path / "s" / "blocks")) == 3
    assert store.longest(first[:16] + (0,) * 8) is None


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_corrupt_entry_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    store = _store(tmp_path, block_tokens=8)
    tokens = _tokens(12, 24)
    store.put(tokens, _row(tokens))
    (entry,) = store.entries()
    path = tmp_path / "entries" / f"{entry.key}.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x10
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError):
        load_prompt_cache(path)
    assert store.longest((*tokens[:16], 0)) is None  # through a marker
    assert store.longest(tokens) is None
    assert not path.exists() and len(store) == 0
    assert os.listdir(tmp_path / "blocks") == []  # its markers went with it
    store.put(tokens, _row(tokens))  # and the key is usable again
    hit = store.longest(tokens)
    assert hit is not None and _identical(hit[1], tokens)


@pytest.mark.parametrize(("version", "served"), [("1", True), ("2", True), ("3", False)])
def test_entries_of_the_readable_versions_are_served(
    tmp_path: Path, version: str, served: bool
) -> None:
    """Version 1 entries (written before the format-2 bump) keep their keys and hits; an
    entry of a version this kvrows does not know is a miss, and kept (another version's)."""
    store = _store(tmp_path, block_tokens=8)
    tokens = _tokens(13, 16)
    store.put(tokens, _row(tokens))
    (entry,) = store.entries()
    path = tmp_path / "entries" / f"{entry.key}.safetensors"
    arrays, metadata = read_safetensors(path)
    key = f"0.{VERSION_KEY}"  # user metadata: the first group of the flattened tree
    assert metadata[key] == FORMAT_VERSION == "2"
    metadata[key] = version
    write_atomic(path, arrays, metadata)
    hit = store.longest(tokens)
    assert (hit is not None) == served
    assert path.exists() and len(store) == 1


def test_a_reader_that_loses_a_race_with_eviction_misses(tmp_path: Path) -> None:
    def evicted_first(path: Path) -> tuple[list[Cache], dict[str, str]]:
        path.unlink()  # another process evicts the entry between lookup and load
        caches, metadata = load_prompt_cache(path, return_metadata=True)
        return caches, metadata

    tokens = _tokens(13, 16)
    _store(tmp_path, block_tokens=8).put(tokens, _row(tokens))
    racing = _store(tmp_path, block_tokens=8, load=evicted_first)
    assert racing.longest(tokens) is None
    # a lookup through the entry's marker finds it gone, and cleans the marker
    assert racing.longest(tokens[:8] + (1,) * 8) is None
    assert os.listdir(tmp_path / "blocks") == []


def test_put_and_lookup_validate_and_leave_the_caches_unchanged(tmp_path: Path) -> None:
    store = _store(tmp_path, block_tokens=8)
    tokens = _tokens(14, 20)
    caches = _row(tokens)
    with pytest.raises(InvalidInputError, match="covers 20 positions"):
        store.put(tokens[:16], caches)
    with pytest.raises(InvalidInputError, match="no caches"):
        store.put(tokens, [])
    with pytest.raises(InvalidInputError, match="integers"):
        store.put((1.5,) * 20, caches)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="integers"):
        store.longest(("a",))  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="byte_budget"):
        PrefixStore(tmp_path, byte_budget=-1)
    with pytest.raises(InvalidInputError, match="block_tokens"):
        PrefixStore(tmp_path, byte_budget=1, block_tokens=0)
    assert len(store) == 0
    assert store.put(tokens, caches) == 16
    assert _identical(caches, tokens)  # put cut a copy, not the caller's row


# -- several processes ------------------------------------------------------------------
WORKER = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
import test_prefix_store as t
while not os.path.exists({start!r}):  # start together, once every process has imported
    time.sleep(0.01)
print(json.dumps(t.worker({directory!r}, {seed}, {rounds}, {budget})), flush=True)
# Skip interpreter teardown: on this VM about one process in fifty aborted after its work
# was done ("terminate called without an active exception": a native thread, most likely
# MLX's, still joinable at exit), which says nothing about the store.
os._exit(0)
"""


def worker(directory: str, seed: int, rounds: int, budget: int) -> dict[str, int]:
    """Puts and lookups of overlapping prompts; every hit must be the oracle's rows."""
    store = _store(Path(directory), block_tokens=8, byte_budget=budget)
    rng = np.random.default_rng(seed)
    systems = [_tokens(100 + i, 8 * (i + 1)) for i in range(3)]  # shared by every process
    counts = {"puts": 0, "hits": 0, "misses": 0, "bad": 0}
    for _ in range(rounds):
        system = systems[int(rng.integers(len(systems)))]
        tail = _tokens(int(rng.integers(6)), int(rng.integers(1, 20)))
        tokens = system + tail
        if rng.random() < 0.5:
            counts["puts"] += store.put(tokens, _row(tokens)) > 0
        hit = store.longest(tokens)
        if hit is None:
            counts["misses"] += 1
        elif _identical(hit[1], tokens[: hit[0]]):
            counts["hits"] += 1
        else:
            counts["bad"] += 1
    return counts


def test_several_processes_share_one_store(tmp_path: Path) -> None:
    probe = _store(tmp_path / "probe", block_tokens=8)
    probe.put(_tokens(0, 32), _row(_tokens(0, 32)))
    budget = 4 * probe.nbytes  # small: eviction runs while others read
    directory = tmp_path / "shared"
    start = tmp_path / "start"
    tests = str(Path(__file__).parent)
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER.format(
                    tests=tests,
                    start=str(start),
                    directory=str(directory),
                    seed=s,
                    rounds=60,
                    budget=budget,
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for s in range(3)
    ]
    start.touch()
    reports = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, (out, err)
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(report["bad"] == 0 for report in reports), reports
    assert sum(report["hits"] for report in reports) > 0, reports
    assert sum(report["puts"] for report in reports) > 0, reports
    store = _store(directory, block_tokens=8, byte_budget=budget)
    assert store.nbytes <= budget
    assert len(store) < sum(report["puts"] for report in reports)  # eviction ran
    assert not [n for n in os.listdir(directory / "entries") if n.startswith(".")]


# -- the engine across restarts ----------------------------------------------------------
@pytest.mark.parametrize("scheme_name", ["plain", "affine8:32@6"])
def test_the_engine_reuses_stored_rows_after_a_restart(tmp_path: Path, scheme_name: str) -> None:
    """Also under a bf16-first start: stored legos (converted past the start) come back as
    legos and stand in for fresh ones."""
    model = tiny_model("llama")
    scheme = KvStorageScheme.parse(scheme_name)
    trace = builtin_trace(6)

    def engine() -> Engine:  # a fresh engine: an empty in-memory prefix cache
        store = _store(tmp_path, fingerprint=model_fingerprint(model, scheme))
        return Engine(
            model, scheme, max_batch=4, prefill_chunk=16, keep_logits=True, prefix_store=store
        )

    first, cold = engine().run(trace)
    assert cold.store_writes > 0 and cold.store_hits == 0
    second, warm = engine().run(trace)
    assert warm.store_hits > 0 and warm.store_hit_tokens > 0
    assert warm.prefill_tokens == cold.prefill_tokens - (
        warm.prefix_hit_tokens - cold.prefix_hit_tokens
    )
    assert [r.tokens for r in second] == [r.tokens for r in first]
    report = check_invariance(model, scheme, trace, second, 16)  # against solo runs
    assert report.steps > 0 and report.mismatches == 0 and report.beyond_tolerance == 0


def test_kvrows_demo_twice_with_one_prefix_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["demo", "--quiet", "--scheme", "plain", "--requests", "4"]
    argv += ["--prefix-store", str(tmp_path)]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0  # a new engine: only the disk remembers the first run
    second = capsys.readouterr().out

    def store_rows(out: str) -> dict[str, list[str]]:
        table = out.split("prefix store ")[1].splitlines()[3:]
        return {line.split()[0]: line.split() for line in table[:2]}

    assert store_rows(first)["llama"][2] == "0"  # nothing on disk yet
    llama = store_rows(second)["llama"]
    # disk hits, fewer prompt tokens computed, and the saving measured against run one
    assert int(llama[2]) > 0 and int(llama[5]) < int(store_rows(first)["llama"][5])
    assert float(llama[7]) - float(llama[6]) == pytest.approx(float(llama[8]), abs=2e-3)
    for out in (first, second):
        assert out.count("PASS") == 2 and "FAIL" not in out  # tokens are the solo runs'
