"""KV maintenance (``kvrows.maintenance``, ``spec/kv-maintenance.md``): which layout each
layer of a request joins under a scheme, and where prefill chunks must stop.

Oracles: the legos' own conversion state and ``max_append_tokens`` (serial runs), and the
§9.3.2 vector of semantics.md.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.errors import InvalidInputError
from kvrows.lego import Bf16First
from kvrows.maintenance import create_kv_maintenance
from kvrows.schemes import Affine, KvStorageScheme, Plain


def _step(caches: list[Any], rng: np.random.Generator, n: int = 1, heads: int = 2) -> None:
    for cache in caches:
        block = mx.array(rng.standard_normal((1, heads, n, 64)).astype(np.float32))
        cache.update_and_fetch(block, block)


def _prefilled(scheme: KvStorageScheme, tokens: int) -> list[Any]:
    model = tiny_model("llama")
    caches = make_kvrows_cache(model, scheme)
    _step(caches, np.random.default_rng(tokens), tokens)
    return caches


def test_plain_scheme_leaves_every_layer() -> None:
    maintenance = create_kv_maintenance(KvStorageScheme())
    caches = _prefilled(KvStorageScheme(), 4)
    for prepared in (maintenance.prepare_prefill(caches), maintenance.prepare_batch(caches)):
        assert prepared == caches and prepared is not caches
        assert all(a is b for a, b in zip(prepared, caches, strict=True))
    assert maintenance.max_append_tokens(caches) == math.inf


def test_start_zero_releases_legos_in_the_batch_and_delays_in_prefill() -> None:
    scheme = KvStorageScheme(codec=Affine(bits=8, group_size=32), quantized_kv_start=0)
    maintenance = create_kv_maintenance(scheme)
    caches = _prefilled(scheme, 3)
    assert all(isinstance(c, opt.Bf16FirstQuantizedKVCache) and c.converted for c in caches)
    planes = [c.storage for c in caches]
    batch = maintenance.prepare_batch(caches)
    assert [type(c) for c in batch] == [opt.QuantizedKVCache] * len(caches)
    assert all(a is b for a, b in zip(batch, planes, strict=True))
    assert all(int(c.offset) == 0 and not c.converted for c in caches)  # released
    fresh = _prefilled(scheme, 3)
    prefill = maintenance.prepare_prefill(fresh)
    assert all(isinstance(c, opt.DelayedQuantizedKVCache) for c in prefill)
    assert all(c.row_offsets == (3,) and c.converted_at == (0,) for c in prefill)


def test_start_above_zero_makes_delayed_layouts() -> None:
    scheme = KvStorageScheme(codec=Affine(bits=4, group_size=32), quantized_kv_start=5)
    maintenance = create_kv_maintenance(scheme)
    caches = _prefilled(scheme, 3)
    kept = list(caches)
    assert maintenance.max_append_tokens(caches) == 2
    batch = maintenance.prepare_batch(caches)
    assert caches == kept  # the input list is not changed
    assert all(isinstance(c, opt.DelayedQuantizedKVCache) for c in batch)
    assert all(c.row_offsets == (3,) and c.converted_at == (None,) for c in batch)
    assert maintenance.max_append_tokens(batch) == 2
    _step(batch, np.random.default_rng(0), 2)
    assert all(c.converted_at == (5,) for c in batch)
    assert maintenance.max_append_tokens(batch) == math.inf


@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
@pytest.mark.parametrize("prepared", [False, True], ids=["serial", "prepare_prefill"])
def test_section_9_3_2_vector(impl: Any, prepared: bool) -> None:
    scheme = KvStorageScheme(
        codec=Plain(),
        layers=((0, Affine(bits=4, group_size=32)), (1, Affine(bits=8, group_size=64))),
        quantized_kv_start=3,
    )
    maintenance = create_kv_maintenance(scheme)
    caches: list[Any] = [
        impl.Bf16FirstQuantizedKVCache(32, 4, 3),
        impl.Bf16FirstRotatingQuantizedKVCache(8, 64, 8, 0, 3),
        impl.KVCache(),
    ]
    if prepared:
        caches = maintenance.prepare_prefill(caches)
        assert [type(c) for c in caches] == [
            impl.DelayedQuantizedKVCache,
            impl.DelayedRotatingQuantizedKVCache,
            impl.KVCache,
        ]
    rng = np.random.default_rng(1)

    def step(n: int) -> None:
        for cache in caches:
            block = rng.standard_normal((1, 2, n, 64)).astype(np.float32)
            data = mx.array(block) if impl is opt else block
            cache.update_and_fetch(data, data)

    def converted() -> list[bool]:
        return [
            bool(getattr(c, "converted", False))
            or getattr(c, "converted_at", (None,))[0] is not None
            for c in caches
        ]

    assert maintenance.max_append_tokens(caches) == 3
    step(2)
    assert maintenance.max_append_tokens(caches) == 1
    assert converted() == [False, False, False]
    step(1)
    assert converted() == [True, True, False]
    assert maintenance.max_append_tokens(caches) == math.inf
    step(1)
    assert converted() == [True, True, False]


def test_bad_input_is_refused() -> None:
    with pytest.raises(InvalidInputError):
        create_kv_maintenance("affine8@3")  # type: ignore[arg-type]
    maintenance = create_kv_maintenance(KvStorageScheme.parse("affine8@3"))
    for bad in (5, "caches", None):
        for operation in (
            maintenance.prepare_prefill,
            maintenance.prepare_batch,
            maintenance.max_append_tokens,
        ):
            with pytest.raises(InvalidInputError):
                operation(bad)  # type: ignore[arg-type]


def test_prepare_batch_keeps_non_lego_layers() -> None:
    scheme = KvStorageScheme.parse("affine8:32,0=plain@4")
    maintenance = create_kv_maintenance(scheme)
    caches = _prefilled(scheme, 2)
    assert not isinstance(caches[0], Bf16First)
    batch = maintenance.prepare_batch(caches)
    assert batch[0] is caches[0]
    assert all(isinstance(c, opt.DelayedQuantizedKVCache) for c in batch[1:])


@pytest.mark.parametrize("impl", [ref, opt], ids=["ref", "opt"])
def test_plain_rings_join_the_delayed_rings_columns(impl: Any) -> None:
    """A model shares one sliding mask: with a delayed ring in the list, a plain serial ring
    goes into a one-row ragged ring of the delayed ring's plain rows (its rows copied, the
    input untouched); without one, it stays as it is."""
    scheme = KvStorageScheme.parse("affine8:32,1=plain@6")
    maintenance = create_kv_maintenance(scheme)
    rng = np.random.default_rng(2)
    ring = impl.RotatingKVCache(8)
    block = rng.standard_normal((1, 2, 3, 64)).astype(np.float32)
    data = mx.array(block) if impl is opt else block
    ring.update_and_fetch(data, data)
    caches = [impl.Bf16FirstRotatingQuantizedKVCache(8, 32, 8, 0, 6), ring, impl.KVCache()]
    for prepared in (maintenance.prepare_prefill(caches), maintenance.prepare_batch(caches)):
        assert type(prepared[1]) is impl.DelayedRotatingQuantizedKVCache.plain_group_class
        assert prepared[1].row_offsets == (3,) and int(ring.offset) == 3
        assert prepared[2] is caches[2]
    alone = [impl.Bf16FirstQuantizedKVCache(32, 8, 6), ring]
    assert maintenance.prepare_batch(alone)[1] is ring
