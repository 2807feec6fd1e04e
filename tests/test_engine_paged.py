"""The engine's paged option: the contiguous engine's tokens, solo-run logits, prefix
blocks shared by reference, admission counting shared blocks once."""

from __future__ import annotations

from typing import Any

import pytest

import kvrows.optimized as kv
from kvrows.app.demo import builtin_trace, check_invariance, follow_ups, shared_prefix_trace
from kvrows.app.engine import Engine, Request, pageable
from kvrows.errors import InvalidInputError
from kvrows.optimized.paged import BlockPool
from kvrows.schemes import KvStorageScheme


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
        ("RotatingKVCache", (8,), False),  # a sliding window
        ("RotatingQuantizedKVCache", (8,), False),
        ("Bf16FirstQuantizedKVCache", (), False),  # hands its storage over at the boundary
        ("Bf16FirstTurboQuantKVCache", (), False),
        ("SSMCache", (), False),  # recurrent state: no token axis, no KV codec
    ],
)
def test_only_full_attention_kv_layers_go_paged(
    name: str, args: tuple[int, ...], paged: bool
) -> None:
    assert pageable(getattr(kv, name)(*args)) is paged
