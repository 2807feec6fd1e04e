"""kvrows caches inside unmodified mlx-lm models: the same logits as mlx-lm's own caches."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as peer
import numpy as np
import pytest
from model_helpers import merged_layers, peer_merged, prefilled_rows

import kvrows.optimized as kv
from kvrows.app.models import ARCHITECTURES, kv_geometry, make_kvrows_cache, tiny_model
from kvrows.schemes import Affine, CodecSpec, KvStorageScheme, Plain, Turbo

TOLERANCE = 1e-5  # float32 models; in practice the logits are bit-identical


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


def _peer_caches(model: Any, scheme: KvStorageScheme) -> list[Any]:
    caches = model.make_cache()
    codec = scheme.codec
    if isinstance(codec, Affine):
        return [
            peer.QuantizedKVCache(codec.group_size, codec.bits) if type(c) is peer.KVCache else c
            for c in caches
        ]
    return list(caches)


@pytest.mark.parametrize("scheme", ["plain", "affine8", "affine4:32"])
def test_serial_logits_match_mlx_lm(model: Any, scheme: str) -> None:
    storage = KvStorageScheme.parse(scheme)
    ours = make_kvrows_cache(model, storage)
    theirs = _peer_caches(model, storage)
    if any(isinstance(c, peer.RotatingKVCache) for c in theirs) and storage.codec != Plain():
        pytest.skip(
            "mlx-lm has no quantized ring (RotatingKVCache.to_quantized raises); the affine "
            "ring is checked by the engine's batch-vs-solo test and the conformance suite"
        )
    tokens = mx.array(np.random.default_rng(1).integers(0, 256, (1, 48)))
    position = 0
    for n in (7, 13, 1, 1, 5, 1, 1, 8, 1, 1, 1, 8):  # crosses the sliding window (16)
        a = model(tokens[:, position : position + n], cache=ours)
        b = model(tokens[:, position : position + n], cache=theirs)
        assert float(mx.abs(a - b).max()) <= TOLERANCE
        position += n
    assert all(int(c.offset) == position for c in ours)


def test_batched_logits_match_mlx_lm_batch(model: Any) -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, (1, length)) for length in (9, 21, 4)]
    ours_layers = merged_layers(prefilled_rows(model, prompts))
    their_layers = peer_merged(prefilled_rows(model, prompts, lambda m: m.make_cache()))
    for _ in range(20):  # the rings (window 16) wrap
        step = mx.array(rng.integers(0, 256, (3, 1)))
        a = model(step, cache=ours_layers)
        b = model(step, cache=their_layers)
        assert float(mx.abs(a - b).max()) <= TOLERANCE


def test_drop_in_surface() -> None:
    plain, quantized = kv.KVCache(), kv.QuantizedKVCache(64, 8)
    assert not hasattr(plain, "bits") and quantized.bits == 8 and quantized.group_size == 64
    assert bool(plain) and bool(kv.PaddedKVRows())  # truthy: mlx-lm treats falsy as "no cache"
    block = mx.zeros((1, 2, 3, 64))
    plain.update_and_fetch(block, block)
    assert isinstance(plain.offset, int)
    asked = plain.make_mask(2, return_array=True)
    assert isinstance(asked, mx.array) and asked.shape == (2, 5)
    windowed = plain.make_mask(1, window_size=2)
    assert isinstance(windowed, mx.array)
    assert windowed.tolist() == [[False, False, True, True]]
    layout = kv.PaddedKVRows()
    layout.merge_rows([plain])
    before = layout.offset
    layout.update_and_fetch(block[:, :, :1], block[:, :, :1])
    assert before.tolist() == [3] and layout.offset.tolist() == [4]  # rebound, not mutated


def test_caches_come_from_the_composition_table(model: Any) -> None:
    """Each layer's mlx-lm cache class names its kvrows storage; the codec spec arrives whole."""
    codec = Affine(bits=4, group_size=32)
    caches = make_kvrows_cache(model, KvStorageScheme(codec=codec, layers=((0, Plain()),)))
    for index, (ours, theirs) in enumerate(zip(caches, model.make_cache(), strict=True)):
        ring = isinstance(theirs, peer.RotatingKVCache)
        expected = ("Rotating" if ring else "") + ("KVCache" if index == 0 else "QuantizedKVCache")
        assert type(ours).__name__ == expected
        if index:
            assert (ours.bits, ours.group_size) == (4, 32)
        if ring:
            assert ours.max_size == theirs.max_size


def test_declared_geometry(model: Any) -> None:
    geometry = kv_geometry(model)
    assert geometry is not None
    assert (geometry.heads, geometry.key_dim, geometry.dtype) == (2, 64, "float32")


def test_turbo_schemes_store_full_attention_layers_only(model: Any) -> None:
    ours = make_kvrows_cache(model, KvStorageScheme.parse("turbo"))  # k8v3
    for cache, layer in zip(ours, model.make_cache(), strict=True):
        expected = (
            "RotatingKVCache" if isinstance(layer, peer.RotatingKVCache) else "TurboQuantKVCache"
        )
        assert type(cache).__name__ == expected


class _SinkRingModel:
    """A model whose ``make_cache()`` names a ring with sink tokens (``keep=2``), then a
    full-attention layer: what the tiny models (``keep=0``) never exercise."""

    layers = (None, None)

    def make_cache(self) -> list[Any]:
        return [peer.RotatingKVCache(max_size=8, keep=2), peer.KVCache()]  # type: ignore[no-untyped-call]

    def parameters(self) -> dict[str, Any]:
        return {}


_Q4 = Affine(bits=4, group_size=32)
_K4V3 = Turbo(k_bits=4, v_bits=3)


@pytest.mark.parametrize(
    ("text", "ring", "full"),
    [
        ("affine4:32", ("RotatingQuantizedKVCache", _Q4, None), ("QuantizedKVCache", _Q4, None)),
        (
            "affine4:32@5",
            ("Bf16FirstRotatingQuantizedKVCache", _Q4, 5),
            ("Bf16FirstQuantizedKVCache", _Q4, 5),
        ),
        # TurboQuant is full attention only: the ring stays a plain ring, start or not.
        (
            "turbo-k4v3@3",
            ("RotatingKVCache", Plain(), None),
            ("Bf16FirstTurboQuantKVCache", _K4V3, 3),
        ),
    ],
)
def test_layer_storages_take_the_ring_and_codec_parameters_whole(
    text: str, ring: tuple[str, CodecSpec, int | None], full: tuple[str, CodecSpec, int | None]
) -> None:
    """Each layer's storage class, its ring's ``max_size`` and ``keep`` read off the
    mlx-lm layer, its codec's parameters and its bf16-first ``start`` from the scheme."""
    caches = make_kvrows_cache(_SinkRingModel(), KvStorageScheme.parse(text))
    assert [type(c).__name__ for c in caches] == [ring[0], full[0]]
    assert (caches[0].max_size, caches[0].keep) == (8, 2)
    for cache, (_, codec, start) in zip(caches, (ring, full), strict=True):
        if start is None:
            assert cache.codec_spec == codec
        else:  # a bf16-first lego: plain until ``start`` tokens, then ``codec``
            assert (cache.quantization, cache.start) == (codec, start)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_weight_dtype_is_the_first_floating_parameter(arch: str) -> None:
    """``kv_geometry``'s dtype: the first floating-point array of ``tree_flatten(
    model.parameters())``, found without the whole tree, for a float model, a cast one and
    a quantized one (its packed ``uint32`` weights skipped)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from kvrows.app.models import _weight_dtype

    def flattened(model: Any) -> str:
        leaves: Any = tree_flatten(model.parameters())
        floating = (a for _, a in leaves if mx.issubdtype(a.dtype, mx.floating))
        return str(next(floating).dtype).rsplit(".", 1)[-1]

    model = tiny_model(arch)
    assert _weight_dtype(model) == flattened(model) == "float32"
    model.set_dtype(mx.float16)
    assert _weight_dtype(model) == flattened(model) == "float16"
    quantized = tiny_model(arch)
    nn.quantize(quantized, group_size=32, bits=4)  # type: ignore[attr-defined]
    assert _weight_dtype(quantized) == flattened(quantized)
