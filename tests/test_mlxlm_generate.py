"""mlx-lm's own generation loops over kvrows caches: the same tokens as mlx-lm's caches.

``generate_step``, ``stream_generate`` and ``generate`` (plain, ``kv_bits``, prompt-cache
reuse, ``trim_prompt_cache``, speculative decoding) run unmodified on the embedded tiny
models, once with ``make_kvrows_cache(model)`` and once with mlx-lm's own cache list;
greedy sampling makes the token streams comparable exactly.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as cache_module
import numpy as np
import pytest

from kvrows.app.models import ARCHITECTURES, make_kvrows_cache, tiny_model

# mlx-lm is untyped; ``mlx_lm.generate`` the attribute is the function, not the module.
lm: Any = importlib.import_module("mlx_lm.generate")
peer: Any = cache_module
WINDOW = 16  # the tiny gemma3's sliding window


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A byte-level tokenizer over the tiny models' 256 ids, built in memory (no download)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    return TokenizerWrapper(fast)


def _prompt(seed: int, length: int) -> Any:
    return mx.array(np.random.default_rng(seed).integers(0, 256, length), dtype=mx.uint32)


def _tokens(model: Any, prompt: Any, cache: list[Any], **options: Any) -> list[int]:
    steps = lm.generate_step(prompt, model, prompt_cache=cache, **options)
    return [int(token) for token, _ in steps]


def _is_gemma(model: Any) -> bool:
    return any(isinstance(c, peer.RotatingKVCache) for c in model.make_cache())


def test_generate_step(model: Any) -> None:
    prompt = _prompt(0, 21)  # gemma3's rings wrap during the prompt and the decode
    ours, theirs = make_kvrows_cache(model), model.make_cache()
    expected = _tokens(model, prompt, theirs, max_tokens=12, prefill_step_size=8)
    assert _tokens(model, prompt, ours, max_tokens=12, prefill_step_size=8) == expected
    assert [c.offset for c in ours] == [c.offset for c in theirs]


def test_stream_generate_and_generate(model: Any, tokenizer: Any) -> None:
    prompt = _prompt(1, 9).tolist()
    runs = []
    for cache in (make_kvrows_cache(model), model.make_cache()):
        responses = list(lm.stream_generate(model, tokenizer, prompt, 10, prompt_cache=cache))
        runs.append(([r.token for r in responses], "".join(r.text for r in responses)))
    assert runs[0] == runs[1] and len(runs[0][0]) == 10
    texts = [
        lm.generate(model, tokenizer, prompt, max_tokens=10, prompt_cache=cache)
        for cache in (make_kvrows_cache(model), model.make_cache())
    ]
    assert texts[0] == texts[1] == runs[0][1]


class _QuantizedRingOracle:
    """mlx-lm's ring bookkeeping over affine planes: three mlx-lm ``RotatingKVCache``s in
    lockstep, holding ``mx.quantize``'s packed codes, scales and biases (mlx-lm has no
    quantized ring; its ring logic never looks at the values, so it carries them as well)."""

    def __init__(self, ring: Any, group_size: int, bits: int) -> None:
        self.group_size, self.bits = group_size, bits
        keys = mx.quantize(ring.keys, group_size=group_size, bits=bits)
        values = mx.quantize(ring.values, group_size=group_size, bits=bits)
        self.parts = []
        for k, v in zip(keys, values, strict=True):
            part = peer.RotatingKVCache(ring.max_size, ring.keep)
            part.keys, part.values, part.offset, part._idx = k, v, ring.offset, ring._idx
            self.parts.append(part)

    @property
    def offset(self) -> int:
        return int(self.parts[0].offset)

    @property
    def state(self) -> list[Any]:
        return [p.state for p in self.parts]

    def update_and_fetch(self, keys: Any, values: Any) -> tuple[Any, Any]:
        q = (self.group_size, self.bits)
        keys = mx.quantize(keys, group_size=q[0], bits=q[1])
        values = mx.quantize(values, group_size=q[0], bits=q[1])
        fetched = [
            p.update_and_fetch(k, v) for p, k, v in zip(self.parts, keys, values, strict=True)
        ]
        return tuple(f[0] for f in fetched), tuple(f[1] for f in fetched)

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.parts[0].make_mask(*args, **kwargs)


class _QuantizableRing(peer.RotatingKVCache):  # type: ignore[misc]
    def to_quantized(self, group_size: int = 64, bits: int = 4) -> Any:
        return _QuantizedRingOracle(self, group_size, bits)


def _their_quantizable_caches(model: Any) -> list[Any]:
    caches = model.make_cache()
    return [
        _QuantizableRing(c.max_size, c.keep) if isinstance(c, peer.RotatingKVCache) else c
        for c in caches
    ]


@pytest.mark.parametrize(("bits", "group_size", "start"), [(8, 64, 3), (4, 32, 3), (4, 64, 18)])
def test_kv_bits_converts_through_to_quantized(
    model: Any, bits: int, group_size: int, start: int
) -> None:
    """``kv_bits`` converts every cache at ``quantized_kv_start`` through ``to_quantized``,
    gemma3's rings included (mlx-lm's own ``RotatingKVCache.to_quantized`` raises; its
    oracle here is mlx-lm's ring logic carrying ``mx.quantize``'s planes). ``start`` 18 with
    chunks of 8 converts after 19 tokens: the rings (16) have wrapped."""
    options = {"kv_bits": bits, "kv_group_size": group_size, "quantized_kv_start": start}
    prompt = _prompt(2, 20)
    theirs = _their_quantizable_caches(model)
    expected = _tokens(model, prompt, theirs, max_tokens=8, prefill_step_size=8, **options)
    ours = make_kvrows_cache(model)
    assert _tokens(model, prompt, ours, max_tokens=8, prefill_step_size=8, **options) == expected
    assert [c.offset for c in ours] == [c.offset for c in theirs]
    names = {type(c).__name__ for c in ours}
    gemma = _is_gemma(model)
    assert names == (
        {"QuantizedKVCache", "RotatingQuantizedKVCache"} if gemma else {"QuantizedKVCache"}
    )
    assert all((c.bits, c.group_size) == (bits, group_size) for c in ours)


def test_mlx_lm_cannot_quantize_its_ring() -> None:
    model = tiny_model("gemma3")
    with pytest.raises(NotImplementedError):
        _tokens(
            model, _prompt(3, 6), model.make_cache(), max_tokens=2, kv_bits=8, quantized_kv_start=0
        )


def test_prompt_cache_reuse(model: Any) -> None:
    """Generate, then continue from the same cache list with a new prompt (a chat turn)."""
    first, second = _prompt(4, 7), _prompt(5, 5)
    runs = []
    for cache in (make_kvrows_cache(model), model.make_cache()):
        tokens = _tokens(model, first, cache, max_tokens=5)
        tokens += _tokens(model, second, cache, max_tokens=5)
        runs.append((tokens, [c.offset for c in cache]))
    assert runs[0] == runs[1]


def test_trim_then_regenerate(model: Any) -> None:
    prompt = _prompt(6, 8)
    runs = []
    for cache in (make_kvrows_cache(model), model.make_cache()):
        tokens = _tokens(model, prompt, cache, max_tokens=4)  # 11 tokens held (< window)
        assert peer.can_trim_prompt_cache(cache)
        trimmed = peer.trim_prompt_cache(cache, 3)
        tokens += _tokens(model, mx.array(tokens[-3:], dtype=mx.uint32), cache, max_tokens=4)
        runs.append((tokens, trimmed, [c.offset for c in cache]))
    assert runs[0] == runs[1] and runs[0][1] == 3


def test_a_wrapped_ring_is_not_trimmable() -> None:
    """Past the window neither mlx-lm nor kvrows trims (``trim_prompt_cache`` returns 0)."""
    model = tiny_model("gemma3")
    caches = []
    for cache in (make_kvrows_cache(model), model.make_cache()):
        _tokens(model, _prompt(7, WINDOW + 4), cache, max_tokens=2)
        assert not peer.can_trim_prompt_cache(cache)
        assert peer.trim_prompt_cache(cache, 2) == 0
        caches.append([c.offset for c in cache])
    assert caches[0] == caches[1]


def _perturbed(model: Any, arch: str) -> Any:
    """A draft model: ``model``'s architecture and weights plus small noise, so some
    drafts are accepted and some rejected (then both caches are trimmed)."""
    from mlx.utils import tree_map

    draft = tiny_model(arch)
    mx.random.seed(5)
    draft.update(tree_map(lambda p: p + mx.random.normal(p.shape) * 0.01, draft.parameters()))
    return draft


def test_speculative_decoding(model: Any, tokenizer: Any) -> None:
    draft = _perturbed(model, "gemma3" if _is_gemma(model) else "llama")
    prompt = _prompt(8, 5).tolist()  # 5 + 8 tokens + 2 drafts stay inside gemma3's window
    runs = []
    for ours in (True, False):
        make: Any = make_kvrows_cache if ours else (lambda m: m.make_cache())
        cache = make(model) + make(draft)
        responses = list(
            lm.stream_generate(
                model, tokenizer, prompt, 8, draft_model=draft, prompt_cache=cache,
                num_draft_tokens=2,
            )
        )  # fmt: skip
        offsets = [c.offset for c in cache]  # model and draft caches, after the trims
        runs.append(([r.token for r in responses], [r.from_draft for r in responses], offsets))
    assert runs[0] == runs[1]
    assert not all(runs[0][1]) and any(runs[0][1])  # some drafts accepted, some rejected
