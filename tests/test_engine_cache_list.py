"""The engine serves the models whose layers keep mlx-lm ``CacheList``s of several caches:
falcon_h1 (a Mamba2 ``ArraysCache`` beside attention in every layer) and baichuan_m1 (an
``ArraysCache(2)`` and a KV cache or ring per layer). ``make_kvrows_cache`` gives each such
layer a ``CacheListDropIn`` over kvrows caches; the row-layout table batches it part by
part (``DropInParts``), so continuous batching, prefix hits and speculative rounds are the
engine's ordinary paths.

Oracles: each request alone (``check_invariance``), and the engine without the option under
test."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kvrows.app.demo import MODEL_TOLERANCES, builtin_trace, check_invariance
from kvrows.app.engine import Engine, Request, model_fingerprint
from kvrows.app.models import draft_model, make_kvrows_cache, tiny_model
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    NotTrimmableError,
    RowIndexError,
    SpeculativeRoundError,
)
from kvrows.optimized import CacheListDropIn, CacheListLayout
from kvrows.persist.prefix_store import PrefixStore
from kvrows.protocols import DropInParts, SpeculativeRowLayout
from kvrows.schemes import KvStorageScheme
from kvrows.table import (
    is_batchable,
    owned_cache_layout,
    prefill_cache_layout,
    target_cache_layout,
)

CACHE_LIST_MODELS = ("falcon_h1", "baichuan_m1")
CHUNK = 16


pytestmark = pytest.mark.usefixtures("cpu_stream")


def is_list_of_caches(cache: object) -> bool:
    return isinstance(cache, DropInParts)


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {arch: tiny_model(arch) for arch in CACHE_LIST_MODELS}


def test_the_table_gives_a_cache_list_its_parts_layouts(models: dict[str, Any]) -> None:
    """Every role's layout is a drop-in of the same form over each part's own layout of
    that role; the drop-in is a row layout and a verify layout by capability."""
    for arch in CACHE_LIST_MODELS:
        serial: Any = make_kvrows_cache(models[arch])[0]
        assert is_list_of_caches(serial) and len(serial.parts) == 2
        for role in (owned_cache_layout, prefill_cache_layout, target_cache_layout):
            layout: Any = role(serial)
            assert type(serial) is CacheListDropIn and not is_batchable(serial)
            assert type(layout) is CacheListLayout and is_list_of_caches(layout)
            assert is_batchable(layout) and isinstance(layout, SpeculativeRowLayout)
            for part, alone in zip(layout.parts, serial.parts, strict=True):
                expected = role(alone)
                assert expected is not None and type(part) is type(expected)
            assert layout.batch_size == 0


def test_batch_equals_solo_runs(models: dict[str, Any]) -> None:
    """falcon_h1 bit for bit; baichuan_m1 the same greedy tokens, logits within the
    recurrent models' tolerance (MODEL_TOLERANCES: 1.5e-8 measured)."""
    trace = builtin_trace(6)
    scheme = KvStorageScheme()
    for arch in CACHE_LIST_MODELS:
        model = models[arch]
        engine = Engine(model, scheme, max_batch=4, prefill_chunk=CHUNK, keep_logits=True)
        results, stats = engine.run(trace)
        assert stats.generated == sum(r.max_tokens for r in trace)
        assert stats.peak_rows > 1  # rows ran together
        tolerance = MODEL_TOLERANCES.get(arch, 0.0)
        report = check_invariance(model, scheme, trace, results, CHUNK, tolerance=tolerance)
        assert report.steps == stats.generated
        assert report.ok and report.mismatches == 0 and report.near_ties == 0, (arch, report)
        if arch == "falcon_h1":
            assert report.max_logit_diff == 0.0


def test_prefix_hits_where_every_part_publishes(models: dict[str, Any]) -> None:
    """falcon_h1's Mamba2 state advances with its attention, so a finished prompt row
    publishes at its exact length and a follow-up takes it (the cold run's tokens and
    logits). baichuan_m1's ``ArraysCache(2)`` never advances (its layer never calls
    ``advance``): its rows never publish, so no request hits and nothing is wrong."""
    first = Request("a", tuple(range(3, 14)), 4)
    second = Request("b", (*first.prompt, 40, 41, 42), 5, arrival=1)
    for arch, hit in (("falcon_h1", len(first.prompt)), ("baichuan_m1", 0)):
        model = models[arch]
        warm, stats = Engine(model, max_batch=2, keep_logits=True).run([first, second])
        assert warm[1].prefix_hit_tokens == hit and stats.prefix_hits == (1 if hit else 0)
        cold, _ = Engine(model, use_prefix_cache=False, keep_logits=True).run([first, second])
        assert [r.tokens for r in warm] == [r.tokens for r in cold]
        tolerance = MODEL_TOLERANCES.get(arch, 0.0)
        report = check_invariance(
            model, KvStorageScheme(), [first, second], warm, 64, tolerance=tolerance
        )
        assert report.ok and report.mismatches == 0, (arch, report)


def test_speculative_rounds_on_falcon_h1_and_refused_on_baichuan_m1(
    models: dict[str, Any],
) -> None:
    """falcon_h1's Mamba2 layer takes its state as its ``cache`` and advances it, so its
    verify rounds roll back by replay: the draft changes no token. baichuan_m1's state is
    read out of the layer's CacheList and never advanced: refused up front, naming why."""
    model = models["falcon_h1"]
    trace = builtin_trace(4)
    drafted, stats = Engine(
        model, max_batch=4, prefill_chunk=CHUNK, draft_model=draft_model(model)
    ).run(trace)
    plain, _ = Engine(model, max_batch=4, prefill_chunk=CHUNK).run(trace)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert stats.drafted > 0
    with pytest.raises(NotTrimmableError, match="baichuan_m1 cannot run speculative rounds"):
        Engine(models["baichuan_m1"], draft_model=models["baichuan_m1"])


def test_paged_attention_parts_give_the_contiguous_run(models: dict[str, Any]) -> None:
    """``paged=True``: a CacheList layer's attention part goes into its layer's block pool
    (a sliding-window part as a ``PagedRotatingKVCache``; the recurrent part stays), so the
    model's tokens are the contiguous engine's and the solo run's as before; its logits bit
    for bit on falcon_h1, within ``MODEL_TOLERANCES`` on baichuan_m1 (its paged ring rows
    are read in time order from column 0, the contiguous ragged ring's at other columns:
    the batch's attention reduces over another column layout)."""
    trace = builtin_trace(6)
    for arch in CACHE_LIST_MODELS:
        model = models[arch]
        flat, flat_stats = Engine(model, max_batch=4, prefill_chunk=CHUNK, keep_logits=True).run(
            trace
        )
        engine = Engine(
            model, max_batch=4, prefill_chunk=CHUNK, keep_logits=True, paged=True, block_size=8
        )
        paged, stats = engine.run(trace)
        assert engine.paged is not None
        paged_slots = [pool is not None for pool in engine.paged.pools]
        # per layer (recurrent part, attention part); baichuan_m1's second is a ring
        assert paged_slots == [False, True] * 2, arch
        rings = [g is not None for g in engine.paged.capped]
        assert rings == [False] * 4 if arch == "falcon_h1" else [False, False, False, True]
        assert stats.peak_rows > 1 and stats.peak_kv_bytes < flat_stats.peak_kv_bytes
        tolerance = MODEL_TOLERANCES.get(arch, 0.0)
        for a, b in zip(flat, paged, strict=True):
            assert a.tokens == b.tokens
            assert all(
                float(mx.abs(mx.array(x) - mx.array(y)).max()) <= tolerance
                for x, y in zip(a.logits, b.logits, strict=True)
            )
        report = check_invariance(
            model, KvStorageScheme(), trace, paged, CHUNK, tolerance=tolerance
        )
        assert report.ok and report.mismatches == 0, (arch, report)


def test_paged_cache_list_speculative_rounds(models: dict[str, Any]) -> None:
    """falcon_h1 paged with a draft: the paged attention part rolls back by trimming its
    table, the Mamba2 part by replay; the draft changes no token."""
    model = models["falcon_h1"]
    trace = builtin_trace(4)
    plain, _ = Engine(model, max_batch=4, prefill_chunk=CHUNK).run(trace)
    drafted, stats = Engine(
        model, max_batch=4, prefill_chunk=CHUNK, paged=True, block_size=8,
        draft_model=draft_model(model),
    ).run(trace)  # fmt: skip
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert stats.drafted > 0


def test_paged_cache_list_prefix_hits_at_whole_blocks(models: dict[str, Any]) -> None:
    """falcon_h1 paged: a follow-up takes a published prompt row when its length is a whole
    number of blocks (the attention part references the pool's blocks, the Mamba2 part is
    the ``PrefixCache``'s copy at exactly that length): the contiguous engine's hit, tokens
    and logits. A prompt ending inside a block gets no hit paged (the pool registers whole
    blocks, the recurrent state only its exact length), where the contiguous engine has
    one; the tokens are the same."""
    model = models["falcon_h1"]
    for length, paged_hit in ((16, 16), (11, 0)):
        first = Request("a", tuple(range(3, 3 + length)), 4)
        second = Request("b", (*first.prompt, 40, 41, 42), 5, arrival=1)
        flat, _ = Engine(model, max_batch=2, keep_logits=True).run([first, second])
        engine = Engine(model, max_batch=2, keep_logits=True, paged=True, block_size=8)
        paged, stats = engine.run([first, second])
        assert flat[1].prefix_hit_tokens == length
        assert paged[1].prefix_hit_tokens == paged_hit and stats.prefix_hits == (paged_hit > 0)
        for a, b in zip(flat, paged, strict=True):
            assert a.tokens == b.tokens
            assert all(
                mx.array_equal(mx.array(x), mx.array(y))
                for x, y in zip(a.logits, b.logits, strict=True)
            )


def test_the_paged_option_refuses_a_model_without_a_pageable_layer() -> None:
    with pytest.raises(InvalidInputError, match="paged: the model has no attention layer"):
        Engine(tiny_model("mamba2"), paged=True)


def _rows(model: Any, prompts: list[list[int]]) -> list[Any]:
    rows = []
    for prompt in prompts:
        caches = make_kvrows_cache(model)
        model(mx.array([prompt]), cache=caches)
        rows.append(caches[0])
    return rows


def test_row_operations_go_to_every_part_and_a_refusal_changes_nothing(
    models: dict[str, Any],
) -> None:
    model = models["falcon_h1"]
    first, second, third = _rows(model, [[1, 2, 3], [4, 5, 6, 7], [8, 9]])
    layout: Any = owned_cache_layout(first)
    layout.merge_rows([first, second])
    assert layout.batch_size == 2 and layout.row_offsets == (3, 4)
    assert all(part.batch_size == 2 for part in layout.parts)
    assert layout.can_publish_row(0, 3) and not layout.can_publish_row(0, 2)
    row: Any = layout.extract_row(1)
    assert type(row) is CacheListDropIn and not is_batchable(row)  # serial parts
    assert [type(part) for part in row.parts] == [type(part) for part in second.parts]
    assert layout.projected_bytes(5) == sum(p.projected_bytes(5) for p in layout.parts)

    before = [part.row_offsets for part in layout.parts]
    with pytest.raises(InvalidInputError, match="CacheList of 2 parts"):
        layout.merge_rows([third, third.parts[0]])
    # The contract's self-merge refusal: the layout itself, or a source given twice.
    for twice in ([layout], [third, third]):
        with pytest.raises(IncompatibleRowsError, match="cannot merge itself or a source given"):
            layout.merge_rows(twice)
    layout.merge_rows([])  # no row joins
    with pytest.raises(RowIndexError):
        layout.filter_rows([5])
    with pytest.raises(NotTrimmableError):
        layout.trim(1)  # the Mamba2 state cannot forget tokens
    assert [part.row_offsets for part in layout.parts] == before

    layout.merge_rows([third])
    layout.filter_rows([2, 0])
    assert layout.row_offsets == (2, 3)
    layout.filter_rows([])
    assert layout.batch_size == 0 and all(p.batch_size == 0 for p in layout.parts)


def test_a_verify_round_rolls_every_part_back(models: dict[str, Any]) -> None:
    """A round over the CacheList layouts: rows cannot move while it is open, and a
    rollback keeps the accepted tokens in every part (the attention trims, the Mamba2 state
    replays them), giving the state of a run that fed only those."""
    model = models["falcon_h1"]
    rows = make_kvrows_cache(model)
    model(mx.array([[1, 2, 3]]), cache=rows)
    layouts: list[Any] = []
    for cache in rows:
        layout: Any = target_cache_layout(cache)
        layout.merge_rows([cache])
        layouts.append(layout)
    for layout in layouts:
        layout.spec_round_begin()
    model(mx.array([[4, 5, 6]]), cache=layouts)
    with pytest.raises(SpeculativeRoundError):
        layouts[0].filter_rows([0])
    for layout in layouts:
        layout.spec_round_rollback([1])
    assert all(layout.row_offsets == (4,) and not layout.spec_round_open for layout in layouts)
    kept = model(mx.array([[7]]), cache=layouts)
    alone = make_kvrows_cache(model)
    model(mx.array([[1, 2, 3, 4]]), cache=alone)
    assert mx.allclose(kept, model(mx.array([[7]]), cache=alone), atol=1e-5).item()


def test_a_cache_list_takes_kvrows_caches_and_no_keys() -> None:
    with pytest.raises(InvalidInputError, match="at least one cache"):
        CacheListDropIn()
    with pytest.raises(InvalidInputError, match="part 0 must be a kvrows cache"):
        CacheListDropIn(object())
    serial: Any = make_kvrows_cache(tiny_model("baichuan_m1"))[0]
    with pytest.raises(InvalidInputError, match="takes no keys and values"):
        serial.update_and_fetch(mx.zeros((1, 1, 1, 1)), mx.zeros((1, 1, 1, 1)))


def test_the_disk_store_keeps_cache_list_rows(models: dict[str, Any], tmp_path: Any) -> None:
    """The store saves a CacheList layer part by part (each part's own record) and the
    engine regroups a loaded row's parts in the layer's form: a falcon_h1 row saved at a
    block boundary (its Mamba2 state serves exactly its length) loads into a new engine
    and gives the cold run's tokens and logits. A row that ends inside a block is not
    saved (its recurrent part cannot be cut), and nothing fails."""
    model = models["falcon_h1"]
    scheme = KvStorageScheme()

    def store() -> PrefixStore:
        return PrefixStore(
            tmp_path,
            byte_budget=1 << 24,
            block_tokens=4,
            fingerprint=model_fingerprint(model, scheme),
        )

    first = Request("a", tuple(range(3, 10)), 2)  # covers 7 + 1 = 8 tokens: two blocks
    results, stats = Engine(model, prefix_store=store()).run([first])
    assert stats.store_writes == 1 and stats.store_errors == 0
    follow = Request("b", (*first.prompt, results[0].tokens[0], 50, 60), 3)
    engine = Engine(model, prefix_store=store(), use_prefix_cache=False, keep_logits=True)
    loaded, stats = engine.run([follow])
    assert stats.store_hits == 1 and loaded[0].store_hit_tokens == 8
    cold, _ = Engine(model, use_prefix_cache=False, keep_logits=True).run([follow])
    assert loaded[0].tokens == cold[0].tokens
    assert all(
        mx.array_equal(mx.array(a), mx.array(b))
        for a, b in zip(loaded[0].logits, cold[0].logits, strict=True)
    )
    odd = Request("c", tuple(range(20, 26)), 2)  # covers 7 tokens: no whole block servable
    _, stats = Engine(model, prefix_store=store()).run([odd])
    assert stats.store_writes == 0 and stats.store_errors == 0
