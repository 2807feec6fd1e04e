"""The engine's paged option: the contiguous engine's tokens, solo-run logits, prefix
blocks shared by reference, admission counting shared blocks once; sliding-window layers
paged as rings (gemma3 fully paged; its rings share a prefix inside their window)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import kvrows.optimized as kv
from kvrows.app.demo import builtin_trace, check_invariance, follow_ups, shared_prefix_trace
from kvrows.app.engine import Engine, Request, pageable
from kvrows.app.models import draft_model
from kvrows.errors import InvalidInputError
from kvrows.optimized.paged import BlockPool
from kvrows.paged import projected_blocks
from kvrows.schemes import KvStorageScheme, Ring


def _run_twice(model: Any, scheme: str, paged: bool, **kw: Any) -> Any:
    storage = KvStorageScheme.parse(scheme)
    trace = builtin_trace(6)
    engine = Engine(model, storage, max_batch=4, prefill_chunk=16, paged=paged, **kw)
    first, stats = engine.run(trace)
    second = follow_ups(first, trace)
    more, more_stats = engine.run(second)
    stats.add(more_stats)
    return engine, trace + second, first + more, stats


@pytest.mark.parametrize("scheme", ["plain", "affine8"])
def test_paged_tokens_are_the_contiguous_engines(llama: Any, scheme: str) -> None:
    _, _, contiguous, _ = _run_twice(llama, scheme, paged=False)
    keep = scheme == "plain"
    engine, requests, paged, stats = _run_twice(llama, scheme, paged=True, keep_logits=keep)
    assert [r.tokens for r in paged] == [r.tokens for r in contiguous]
    assert stats.prefix_hits > 0  # the follow-ups reuse published blocks
    if scheme == "plain":  # every logit bit-identical to the solo run (contiguous caches)
        report = check_invariance(llama, KvStorageScheme.parse(scheme), requests, paged, 16)
        assert report.steps == stats.generated and report.max_logit_diff == 0.0 and report.ok
    assert engine.paged is not None
    for pool in engine.paged.pools:
        assert pool is not None
        pool.check_valid()
        assert not pool.live_tables()  # every finished row gave its blocks back
        assert pool.ledger.cached_count > 0  # ... and its full blocks stay cached


def test_a_shared_system_prompt_is_held_once(llama: Any) -> None:
    trace = shared_prefix_trace(3, system=64)
    flat, flat_stats = Engine(llama, max_batch=4, prefill_chunk=32).run(trace)
    engine = Engine(llama, max_batch=4, prefill_chunk=32, paged=True)
    paged, stats = engine.run(trace)
    assert [r.tokens for r in paged] == [r.tokens for r in flat]
    # every sharer starts from the 64 system tokens' four blocks, referenced: no KV byte
    # was copied into or inside a pool
    assert [r.prefix_hit_tokens for r in paged[1:]] == [64] * 3
    assert engine.paged is not None
    pools = [p for p in engine.paged.pools if p is not None]
    assert all(p.bytes_copied == 0 for p in pools)
    # the contiguous engine holds the prefix once per row (and the published copy)
    per_token = stats.kv_bytes_per_token
    assert stats.peak_kv_bytes < flat_stats.peak_kv_bytes
    assert stats.peak_kv_bytes <= per_token * (64 + 3 * (16 + 32))


def test_admission_counts_shared_prefix_blocks_once(llama: Any) -> None:
    engine = Engine(llama, max_batch=4, paged=True, block_size=16)
    assert engine.paged is not None
    prompt = tuple(range(40))
    request = Request("a", prompt, max_tokens=4)
    full = engine.projected_bytes(request)
    pools = [p for p in engine.paged.pools if p is not None]
    assert isinstance(pools[0], BlockPool)
    per_block = sum(p.bytes_per_block for p in pools)
    assert full == per_block * 3  # ceil(44 / 16) whole blocks per layer
    engine.run([request])  # published: two full blocks cached, referenced by no table
    assert engine.projected_bytes(Request("b", prompt, 4)) == full  # cached, not held
    held = [pool.lookup_prefix(list(prompt)) for pool in pools]  # a live row holds them
    assert engine.projected_bytes(Request("b", prompt, 4)) == full - 2 * per_block
    for cache in held:
        assert cache is not None
        cache.release()
    assert engine.projected_bytes(Request("b", prompt, 4)) == full


def test_paged_refuses_a_bf16_first_start(llama: Any) -> None:
    with pytest.raises(InvalidInputError, match="paged"):
        Engine(llama, KvStorageScheme.parse("affine8@8"), paged=True)


@pytest.mark.parametrize(
    ("name", "args", "paged"),
    [
        ("KVCache", (), True),
        ("QuantizedKVCache", (32, 4), True),
        ("TurboQuantKVCache", (4, 3), True),
        ("RotatingKVCache", (8,), True),  # a sliding window: a PagedRotatingKVCache
        ("RotatingQuantizedKVCache", (8,), True),
        ("Bf16FirstQuantizedKVCache", (), False),  # hands its storage over at the boundary
        ("Bf16FirstTurboQuantKVCache", (), False),
        ("SSMCache", (), False),  # recurrent state: no token axis, no KV codec
    ],
)
def test_only_kv_layers_with_a_token_axis_go_paged(
    name: str, args: tuple[int, ...], paged: bool
) -> None:
    assert pageable(getattr(kv, name)(*args)) is paged


@pytest.mark.parametrize("scheme", ["plain", "affine8"])
def test_gemma3_runs_fully_paged(gemma3: Any, scheme: str) -> None:
    """Every layer in a pool (the sliding-window ones as ``PagedRotatingKVCache``s): the
    contiguous engine's tokens, its logits bit for bit (both without a prefix cache: the
    same computation), the solo runs' logits, a lower peak. No prefix hit on this trace:
    a ring's 16-token window holds no whole 16-token block of a prompt that ends past it
    (chunks of 16 drop positions), so its pools cache nothing, and the full-attention
    layers publish no further than the rings (a hit needs every layer's prefix)."""
    storage = KvStorageScheme.parse(scheme)
    _, _, flat, flat_stats = _run_twice(
        gemma3, scheme, paged=False, use_prefix_cache=False, keep_logits=True
    )
    _, _, _, hit_stats = _run_twice(gemma3, scheme, paged=False)
    assert hit_stats.prefix_hits > 0  # the contiguous engine takes hits on this trace
    engine, trace, paged, stats = _run_twice(gemma3, scheme, paged=True, keep_logits=True)
    assert engine.paged is not None and not engine.paged.mixed
    kinds = [type(c).__name__ for c in engine.paged.caches()]
    assert kinds == ["PagedRotatingKVCache", "PagedKVCache"] * 2
    assert [r.tokens for r in paged] == [r.tokens for r in flat]
    for a, b in zip(flat, paged, strict=True):
        assert len(a.logits) == len(b.logits)
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    # the rings published no block, so neither did the full-attention layers (their
    # blocks past the rings' would never be hit): no hit is taken
    assert stats.prefix_hits == 0
    assert engine.prefix_cache is not None and engine.prefix_cache.nbytes == 0
    assert stats.peak_kv_bytes < flat_stats.peak_kv_bytes
    if scheme == "plain":
        report = check_invariance(gemma3, storage, trace, paged, 16)
        assert report.steps == stats.generated and report.max_logit_diff == 0.0 and report.ok
    for pool in engine.paged.pools:
        assert pool is not None
        pool.check_valid()
        assert not pool.live_tables()
        assert pool.ledger.cached_count == 0  # nothing published


@pytest.mark.parametrize("scheme", ["plain", "affine8"])
def test_gemma3_paged_rings_share_a_prefix_inside_the_window(gemma3: Any, scheme: str) -> None:
    """A system prompt shorter than the rings' 16-token window, blocks of 4: every layer's
    pool (rings included) caches its whole blocks, and the sharers start from them (the
    contiguous engine's hits, 12 tokens), referenced, nothing copied; the contiguous
    engine's tokens and logits bit for bit, the solo runs' logits."""
    storage = KvStorageScheme.parse(scheme)
    trace = shared_prefix_trace(3, system=12)
    flat, _ = Engine(gemma3, storage, max_batch=4, prefill_chunk=8, keep_logits=True).run(trace)
    engine = Engine(
        gemma3, storage, max_batch=4, prefill_chunk=8, paged=True, block_size=4, keep_logits=True
    )
    paged, stats = engine.run(trace)
    assert [r.prefix_hit_tokens for r in paged] == [r.prefix_hit_tokens for r in flat]
    assert [r.prefix_hit_tokens for r in paged[1:]] == [12] * 3
    assert [r.tokens for r in paged] == [r.tokens for r in flat]
    for a, b in zip(flat, paged, strict=True):
        assert len(a.logits) == len(b.logits)
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    if scheme == "plain":
        report = check_invariance(gemma3, storage, trace, paged, 16)
        assert report.steps == stats.generated and report.max_logit_diff == 0.0 and report.ok
    assert engine.paged is not None
    assert [g is not None for g in engine.paged.capped] == [True, False] * 2
    for pool in engine.paged.pools:
        assert pool is not None
        pool.check_valid()
        assert not pool.live_tables() and pool.bytes_copied == 0
        assert pool.ledger.cached_count >= 3  # the system prompt's blocks, rings' too
    # every layer published as far as the rings did: the same blocks counts
    assert len({pool.ledger.cached_count for pool in engine.paged.pools}) == 1


def test_admission_counts_a_ring_rows_most_blocks(gemma3: Any) -> None:
    """A paged ring's blocks at the row's last length may be fewer than a step before:
    admission counts the most (``projected_blocks`` over the last block's lengths)."""
    engine = Engine(gemma3, paged=True, block_size=16)
    assert engine.paged is not None
    per_block = [p.bytes_per_block for p in engine.paged.pools]
    rings = [g for g in engine.paged.capped if isinstance(g, Ring) or g is None]
    assert len(rings) == len(engine.paged.capped)
    windows = [None if g is None else (g.max_size, g.keep) for g in rings]
    for tokens in (2, 16, 17, 32, 44, 48, 64):
        want = 0
        for window, size in zip(windows, per_block, strict=True):
            if window is None:
                blocks = -(-tokens // 16)
            else:
                blocks = max(
                    projected_blocks(t, window[0], window[1], 16) for t in range(1, tokens + 1)
                )
            want += blocks * size
        assert engine.projected_bytes(Request("a", tuple(range(tokens - 1)), 1)) == want
    # at 48 tokens a 16-token window fills one block exactly; at 47 it straddled two
    assert engine.projected_bytes(Request("a", tuple(range(47)), 1)) > engine.admission.bytes(48)


def test_gemma3_paged_rings_roll_back_speculative_rounds(gemma3: Any) -> None:
    """A draft model's verify rounds over paged rings (``PagedRotatingRows``' trim): the
    plain engine's tokens."""
    trace = builtin_trace(4)
    plain, _ = Engine(gemma3, max_batch=4, prefill_chunk=16).run(trace)
    drafted, stats = Engine(
        gemma3, max_batch=4, prefill_chunk=16, paged=True, draft_model=draft_model(gemma3)
    ).run(trace)
    assert [r.tokens for r in drafted] == [r.tokens for r in plain]
    assert stats.drafted > 0
