"""Latent caches inside unmodified mlx-lm MLA models (``deepseek_v32``, ``glm_moe_dsa``).

Oracles: mlx-lm's own caches (``CacheList(KVCache, KVCache)`` per layer, and its
``CacheList.merge`` into ``BatchKVCache`` pairs), bit for bit; a solo run of each row;
``MLACache`` for an ``EncodedLatentCache`` that never converts.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import CacheList

from kvrows.app.models import (
    LATENT_ARCHITECTURES,
    make_latent_cache,
    tiny_model,
)
from kvrows.errors import InvalidInputError, LayoutStateError
from kvrows.optimized import LatentCacheList, MLACache
from kvrows.schemes import Affine, Turbo

PROMPT = [5, 7, 9, 11, 13, 2, 3, 4, 5, 6, 7, 8]  # past index_topk = 8: the sparse path


pytestmark = pytest.mark.usefixtures("cpu_stream")


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {arch: tiny_model(arch) for arch in LATENT_ARCHITECTURES}


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


@pytest.mark.parametrize("arch", LATENT_ARCHITECTURES)
def test_serial_logits_equal_mlx_lm(models: dict[str, Any], arch: str) -> None:
    model = models[arch]
    theirs, mine = model.make_cache(), make_latent_cache(model)
    assert _same(model(mx.array([PROMPT]), cache=theirs), model(mx.array([PROMPT]), cache=mine))
    for token in (3, 4, 5, 6):
        step = mx.array([[token]])
        assert _same(model(step, cache=theirs), model(step, cache=mine))
    latent = mine[0].cache
    assert latent.row_offsets == (len(PROMPT) + 4,) and latent.signature() == "kv:mla:target:dsa"
    # what mlx-lm holds, we hold: latent as its keys, rope as its values, index keys
    held = latent.current()
    assert _same(held[0], theirs[0][0].keys[:, :, : theirs[0][0].offset])
    assert _same(held[1], theirs[0][0].values[:, :, : theirs[0][0].offset])
    assert _same(held[2], theirs[0][1].keys[:, :, : theirs[0][1].offset])


def _merged(caches: list[list[LatentCacheList]]) -> list[LatentCacheList]:
    layers = []
    for per_row in zip(*caches, strict=True):
        layout = per_row[0].cache.make_empty_batch()
        layout.merge_rows([c.cache for c in per_row])
        layers.append(LatentCacheList(layout))
    return layers


def test_batched_logits_equal_mlx_lm_and_solo(models: dict[str, Any]) -> None:
    """Two prompts of different lengths merged (left padding): the same logits as mlx-lm's
    CacheList.merge (BatchKVCache pairs) and as each row run alone."""
    model = models["deepseek_v32"]
    prompts = [PROMPT, [9, 8, 7]]
    theirs = [model.make_cache() for _ in prompts]
    mine = [make_latent_cache(model) for _ in prompts]
    solo = [make_latent_cache(model) for _ in prompts]
    for p, t, m, s in zip(prompts, theirs, mine, solo, strict=True):
        model(mx.array([p]), cache=t)
        model(mx.array([p]), cache=m)
        model(mx.array([p]), cache=s)
    merge: Any = CacheList.merge
    batch_theirs = [merge(list(layer)) for layer in zip(*theirs, strict=True)]
    batch_mine = _merged(mine)
    assert batch_mine[0].cache.left_pad == (0, 9)
    for tokens in ([[3], [4]], [[5], [6]]):
        step = mx.array(tokens)
        got = model(step, cache=batch_mine)
        assert _same(got, model(step, cache=batch_theirs))
        for b, s in enumerate(solo):
            assert _same(got[b : b + 1], model(step[b : b + 1], cache=s))


def test_verify_round_in_the_model_equals_the_accepted_run(models: dict[str, Any]) -> None:
    """A verify block of 3 rolled back per row (keep 1 and 3), then a decode step: each row's
    logits equal a solo run that only ever saw the accepted tokens."""
    model = models["glm_moe_dsa"]
    prompts = [PROMPT, [9, 8, 7, 6]]
    rows = [make_latent_cache(model) for _ in prompts]
    for p, c in zip(prompts, rows, strict=True):
        model(mx.array([p]), cache=c)
    batch = _merged(rows)
    block = [[21, 22, 23], [31, 32, 33]]
    from kvrows.speculative import RowRound

    round_ = RowRound(batch)  # the seed's row transaction over every layer's list
    round_.begin(2)
    model(mx.array(block), cache=batch)
    round_.resolve([0, 2])  # accepted drafts: keep 1 and 3 tokens of the block
    got = model(mx.array([[40], [41]]), cache=batch)
    for b, (p, keep, nxt) in enumerate(zip(prompts, (1, 3), (40, 41), strict=True)):
        alone = make_latent_cache(model)
        model(mx.array([p + block[b][:keep]]), cache=alone)
        want = model(mx.array([[nxt]]), cache=alone)
        assert mx.allclose(got[b : b + 1], want, atol=1e-5).item()


def test_encoded_latent_in_the_model(models: dict[str, Any]) -> None:
    """An EncodedLatentCache that never converts is MLACache bit for bit; converting at 0
    reads the prompt exact (same logits) and then decodes the latent (close, not equal)."""
    model = models["deepseek_v32"]
    plain = make_latent_cache(model)
    late = make_latent_cache(model, Affine(bits=8, group_size=64), start=10**6)
    early = make_latent_cache(model, Affine(bits=8, group_size=64), start=0)
    turbo = make_latent_cache(model, Turbo(k_bits=8, v_bits=4), start=0)
    prompt = mx.array([PROMPT])
    first = model(prompt, cache=plain)
    assert _same(first, model(prompt, cache=late))
    assert _same(first, model(prompt, cache=early))
    assert _same(first, model(prompt, cache=turbo))
    step = mx.array([[3]])
    want = model(step, cache=plain)
    assert _same(want, model(step, cache=late))
    for cache in (early, turbo):
        got = model(step, cache=cache)
        assert not _same(got, want)
        error: Any = mx.abs(got - want).max().item()
        scale: Any = mx.abs(want).max().item()
        assert error < 0.05 * scale
    # The codes take fewer bytes than the plain latent; while it decodes, the cache also
    # holds its decoded window (counted: spec/EncodedLatentCache.md §5).
    encoded = early[0].cache
    assert encoded.window_nbytes > 0
    assert encoded.nbytes - encoded.window_nbytes < plain[0].cache.nbytes


def test_the_list_refuses_misuse(models: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError):
        LatentCacheList(object())  # type: ignore[arg-type]
    caches = LatentCacheList(MLACache(64, 16, 32))
    with pytest.raises(LayoutStateError, match="latent block first"):
        caches[1].update_and_fetch(mx.zeros((1, 1, 1, 32)), mx.zeros((1, 1, 1, 32)))
    caches[0].update_and_fetch(mx.zeros((1, 1, 1, 64)), mx.zeros((1, 1, 1, 16)))
    with pytest.raises(LayoutStateError, match="waits"):
        caches.trim(1)
    assert caches.cache.width == 0  # nothing is stored until the index block arrives
    with pytest.raises(InvalidInputError, match="DSA"):
        LatentCacheList(MLACache())[1]


def test_the_mla_demo_runs_through_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvrows demo --mla``: the engine serves the trace (rows together), and every request
    alone gives its batch tokens, under the plain and an encoded latent (bf16-first at 4)."""
    from kvrows.app.demo import run_latent_demo

    status = run_latent_demo(
        schemes=["plain", "affine4"],
        requests=4,
        max_batch=2,
        kv_start=4,
        architectures=["deepseek_v32"],
    )
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith("deepseek_v32")]
    assert [row[1] for row in rows] == ["plain", "affine4"]
    for row in rows:
        generated, peak_rows = int(row[3]), int(row[5])
        assert peak_rows == 2 and row[-2] == f"0/{generated}" and row[-1] == "PASS"
        assert float(row[-3]) < 1e-5  # max |dlogit|: the last bits only


def test_make_kvrows_cache_serves_mla_models(models: dict[str, Any]) -> None:
    """The app's one entry point builds latent caches for an MLA model, per scheme."""
    from kvrows.app.models import make_kvrows_cache
    from kvrows.schemes import KvStorageScheme

    model = models["glm_moe_dsa"]
    plain = make_kvrows_cache(model)
    assert all(isinstance(c, LatentCacheList) for c in plain)
    assert _same(
        model(mx.array([PROMPT]), cache=plain), model(mx.array([PROMPT]), cache=model.make_cache())
    )
    encoded = make_kvrows_cache(model, KvStorageScheme.parse("affine4"))
    assert encoded[0].signature() == "kv:mla-encoded:target:dsa:affine:4:64:0"


def test_deepseek_v3_layers_take_the_plain_latent(models: dict[str, Any]) -> None:
    """deepseek_v3 caches the latent and the rope key in one KVCache per layer: an MLACache
    without DSA (item 0 of its list) gives mlx-lm's logits, serial and merged."""
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from kvrows.app.models import make_kvrows_cache

    model = tiny_model("deepseek_v3")
    prompts = [PROMPT, [9, 8, 7]]
    theirs = [make_prompt_cache(model) for _ in prompts]
    mine = [make_kvrows_cache(model) for _ in prompts]
    assert mine[0][0].signature() == "kv:mla:target"
    for p, t, m in zip(prompts, theirs, mine, strict=True):
        assert _same(model(mx.array([p]), cache=t), model(mx.array([p]), cache=m))
    merge: Any = BatchKVCache.merge
    batch_theirs = [merge(list(layer)) for layer in zip(*theirs, strict=True)]
    batch_mine = []
    for layer in zip(*mine, strict=True):
        layout = layer[0].cache.make_empty_batch()
        layout.merge_rows([view.cache for view in layer])
        batch_mine.append(LatentCacheList(layout)[0])
    for tokens in ([[3], [4]], [[5], [6]]):
        step = mx.array(tokens)
        assert _same(model(step, cache=batch_mine), model(step, cache=batch_theirs))
