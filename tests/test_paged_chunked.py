"""Paged chunked-local attention (``spec/ChunkedKVCache.md`` §7): ``PagedChunkedKVCache``
rows in ``PagedChunkedRows``, the paged placement under the chunked geometry. The
``paged-chunked`` conformance families (reference vs optimized vs the contiguous chunked
model and each row's solo replay, the pools' invariants, byte-limited pools), the blocks a
front trim gives back, saved forms, the engine's paged llama4 against its solo runs, and
mutants of the new bookkeeping that the machine catches."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conformance_helpers import assert_compared, caught, run_family, run_teeth

import kvrows.optimized as kv
import kvrows.reference as ref
from kvrows.app.demo import check_invariance
from kvrows.app.engine import Engine, Request
from kvrows.app.models import tiny_model
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import BASE_CHECKS
from kvrows.conformance.rules import BLOCK_TABLE_GAPS
from kvrows.paged import FREE
from kvrows.schemes import KvStorageScheme

pytestmark = pytest.mark.usefixtures("cpu_stream")

IMPLS = pytest.mark.parametrize("impl", [ref, kv], ids=["reference", "optimized"])


def _block(seed: int, rows: int, n: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).standard_normal((rows, 2, n, 8)).astype(np.float32)


def _to(impl: Any, array: np.ndarray[Any, Any]) -> Any:
    return array if impl is ref else mx.array(array)


# -- the storages against the contiguous chunked cache --------------------------------------


@IMPLS
def test_a_request_reads_what_chunked_kv_cache_reads_and_gives_blocks_back(impl: Any) -> None:
    """Every append returns ``ChunkedKVCache``'s keys for the same tokens; the blocks before
    the row's first held position go back to the pool (``FREE`` entries), the block of its
    first position stays; a trim to nothing gives its tail back, and the next append takes
    a fresh tail block."""
    paged, contiguous = impl.PagedChunkedKVCache(4, block_size=2), impl.ChunkedKVCache(4)
    for seed, n in enumerate((3, 1, 2, 5, 1, 1)):
        block = _to(impl, _block(seed, 1, n))
        got, want = paged.update_and_fetch(block, block), contiguous.update_and_fetch(block, block)
        assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
        assert paged.start_position == contiguous.start_position
        mask, expected = (c.make_mask(2, return_array=True) for c in (paged, contiguous))
        assert np.array_equal(np.asarray(mask), np.asarray(expected))
    # offset 13, start 8: positions 8..12 in logical blocks 4, 5, 6
    assert [b == FREE for b in paged.block_table] == [True] * 4 + [False] * 3
    paged.maybe_trim_front()  # start 9: block 4 still holds position 9
    assert paged.start_position == 9 and paged.block_table[4] != FREE
    assert paged.trim(10) == 4 and paged.offset == 9  # held 4: a trim to nothing
    assert set(paged.block_table) == {FREE}
    paged.pool.check_valid()
    block = _to(impl, _block(9, 1, 1))
    paged.update_and_fetch(block, block)
    assert paged.block_table[4] != FREE and paged.start_position == 9
    restored = type(paged).from_state(paged.state)
    assert (restored.offset, restored.start_position) == (10, 9)
    assert [b == FREE for b in restored.block_table] == [b == FREE for b in paged.block_table]


@IMPLS
def test_layout_rows_end_at_the_longest_held_run(impl: Any) -> None:
    """Rows of 11 and 3 tokens (chunk 4): ``maybe_trim_front`` keeps each row's newest 4,
    gives back the blocks before them, and the rows end at one column (pads by held)."""
    rows = []
    for seed, n in enumerate((11, 3)):
        serial = impl.PagedChunkedKVCache(4, block_size=2)
        block = _to(impl, _block(seed, 1, n))
        serial.update_and_fetch(block, block)
        rows.append(serial)
    layout = impl.PagedChunkedRows(4, block_size=2)
    layout.merge_rows(rows)
    assert layout.left_pad == (0, 8) and layout.width == 11
    layout.maybe_trim_front()
    assert np.asarray(layout.start_position).tolist() == [7, 0]
    assert layout.left_pad == (0, 1) and layout.width == 4
    assert [b == FREE for b in layout.block_tables()[0]] == [True] * 3 + [False] * 3
    step = _to(impl, _block(9, 2, 1))
    keys, _ = layout.update_and_fetch(step, step)
    assert int(np.asarray(keys).shape[2]) == 5
    layout.check_valid()
    layout.pool.check_valid()


def test_saved_forms_load_in_both_implementations_and_from_a_file(tmp_path: Any) -> None:
    """A serial request past its chunk and a layout whose row was trimmed to nothing save
    what they hold (``start_position`` / right-aligned held runs): loaded in either
    implementation and from a prompt-cache file they read the same, at the same offsets and
    starts, their blocks before each start ``FREE``."""
    from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache

    caches = {}
    for impl in (ref, kv):
        serial = impl.PagedChunkedKVCache(4, block_size=2)
        for seed, n in enumerate((6, 3)):
            block = _to(impl, _block(seed, 1, n))
            serial.update_and_fetch(block, block)
        other = impl.PagedChunkedKVCache(4, block_size=2)
        for seed, n in enumerate((3, 3, 1)):
            block = _to(impl, _block(5 + seed, 1, n))
            other.update_and_fetch(block, block)
        layout = impl.PagedChunkedRows(4, block_size=2)
        layout.merge_rows([serial, other])
        layout.trim_rows([0, 5])  # row 1: offset 2, holding nothing
        caches[impl] = (serial, layout)
    path = tmp_path / "paged-chunked.safetensors"
    save_prompt_cache(path, list(caches[kv]))
    loads = [load_prompt_cache(path, implementation=name) for name in ("reference", "optimized")]

    def numpy(value: Any) -> Any:
        return tuple(numpy(v) for v in value) if isinstance(value, tuple) else np.asarray(value)

    for impl in (ref, kv):
        serial, layout = caches[impl]
        assert (serial.offset, serial.start_position) == (9, 2)
        assert layout.retained == (7, 0) and np.asarray(layout.offset).tolist() == [9, 2]
        for copy_serial, copy_layout in [*loads, caches[kv], caches[ref]]:
            assert (copy_serial.offset, copy_serial.start_position) == (9, 2)
            assert [b == FREE for b in copy_serial.block_table] == [True] + [False] * 4
            assert np.array_equal(numpy(copy_serial.state[0]), numpy(serial.state[0]))
            assert copy_layout.left_pad == layout.left_pad
            assert copy_layout.left_pad == (0, 7)
            assert np.asarray(copy_layout.start_position).tolist() == [2, 2]
            assert [[b == FREE for b in t] for t in copy_layout.block_tables()] == [
                [True] + [False] * 4,
                [True],
            ]
            assert np.array_equal(numpy(copy_layout.state[0]), numpy(layout.state[0]))


# -- conformance ---------------------------------------------------------------------------------


def test_paged_chunked_family() -> None:
    family = FAMILIES["paged-chunked"]
    assert [spec.name for spec in family.layouts] == ["PagedChunkedRows"]
    spec = family.layout("PagedChunkedRows")
    assert spec.roles == ("decode", "prefill", "verify") and spec.trim_rows
    stats, settings = run_family(family, "PagedChunkedRows")
    ops = {"new_request", "prefill_chunk", "merge", "decode_step", "extract", "trim_rows"}
    stats.require(settings.max_examples // 2, ops=ops, oracles=(*BASE_CHECKS, "state"))
    assert stats.ops["spec_rounds"] + stats.ops["row_rounds"] > 0, dict(stats.ops)
    assert_compared(stats, {"kv.stored", "kv.fetched", "kv.solo", "attention"})
    stats.require(0, oracles=("pool invariants", "save_restore", "front trim"))
    stats.require(0, states=(BLOCK_TABLE_GAPS,))  # blocks before the chunk given back
    assert stats.ops["prefix:register"] and stats.ops["prefix:past the window"], dict(stats.ops)
    assert not stats.skips, dict(stats.skips)


@pytest.mark.parametrize("family", ["paged-chunked-affine", "paged-chunked-mx"])
def test_paged_chunked_codec_families(family: str) -> None:
    """The same rows over affine and microscaling pools (one codec per example): codes
    exact against the contiguous chunked model."""
    stats, settings = run_family(FAMILIES[family], "PagedChunkedRows")
    stats.require(settings.max_examples // 2, oracles=("reference vs optimized", "state"))
    assert any(v.startswith("bits=") for v in stats.variants), stats.variants


# -- the engine: llama4's chunked layers paged -----------------------------------------------------


def test_the_paged_engine_s_batch_is_bit_identical_to_solo_runs() -> None:
    """``Engine(paged=True)`` pages llama4's chunked layers as ``PagedChunkedKVCache`` rows
    (rows well past several chunks): every logit equals the request's solo run through
    contiguous serial caches, and the pools end with every block back."""
    llama4 = tiny_model("llama4")
    scheme = KvStorageScheme()
    trace = [
        Request(f"r{n}", tuple((5 * i + n) % 64 for i in range(n)), 10, arrival=i)
        for i, n in enumerate((5, 13, 21))
    ]
    engine = Engine(llama4, scheme, max_batch=3, prefill_chunk=6, keep_logits=True, paged=True)
    assert engine.paged is not None
    assert [type(c).__name__ for c in engine.paged.caches()] == ["PagedChunkedKVCache"] * 3 + [
        "PagedKVCache"
    ]
    results, stats = engine.run(trace)
    assert stats.generated == 3 * 10
    report = check_invariance(llama4, scheme, trace, results, 6)
    assert report.mismatches == 0 and report.max_logit_diff == 0.0, report
    for pool in engine.paged.pools:
        pool.check_valid()
        assert not pool.live_tables()


# -- the machine has teeth -------------------------------------------------------------------------


class BlocksStayAfterTheChunk(kv.PagedChunkedRows):
    """The blocks before each row's chunk are never given back."""

    def _release_outside(self) -> None:
        return None  # MUTATION (they should go back to the pool, their entries FREE)

    def _check_geometry(self) -> None:
        # Its own table check would say so: the machine's oracles must, independently.
        return None


class FrontTrimKeepsOneMore(kv.PagedChunkedRows):
    """A front trim keeps ``chunk_size + 1`` positions."""

    def _front_trimmed(self) -> list[int]:
        size = self._size + 1  # MUTATION (chunk_size)
        return [max(s, o - size) for s, o in zip(self._starts, self._offsets, strict=True)]


@pytest.mark.parametrize(
    "mutant", [BlocksStayAfterTheChunk, FrontTrimKeepsOneMore], ids=["blocks-stay", "keeps-more"]
)
def test_the_paged_chunked_machine_catches(mutant: type) -> None:
    message = caught("PagedChunkedRows", mutant, family_name="paged-chunked")
    if mutant is BlocksStayAfterTheChunk:  # the twins' tables and the model's held blocks
        assert "held blocks" in message, message


def test_the_unmutated_paged_chunked_layout_passes() -> None:
    assert run_teeth("PagedChunkedRows", None, 3, "paged-chunked").examples > 0
