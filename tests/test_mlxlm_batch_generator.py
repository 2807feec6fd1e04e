"""mlx-lm's own ``BatchGenerator`` / ``batch_generate`` driving kvrows caches, unmodified.

The generator gets kvrows caches in the two ways mlx-lm offers without patching its
source: per request through ``insert(..., caches=...)`` (``batch_generate``'s
``prompt_caches``), or from the model's ``make_cache()`` (which ``make_prompt_cache``
calls). It then merges them (``KVCache.merge``), right-pads ragged prompt chunks
(``prepare`` / ``finalize``), joins cohorts (``extend``), retires finished rows
(``extract``, ``filter``) and splits prompt batches (``deepcopy`` + ``filter``).

Oracles: the same generator run with mlx-lm's own caches (plain llama and gemma3; the
generator decodes one token at a time, so mlx-lm's rotating batch bug B9, a multi-token
update after a wrap, is not reached), and for the affine codec, which mlx-lm cannot
batch, each request generated alone: with mlx-lm's own ``QuantizedKVCache`` (llama) or
kvrows' serial caches through mlx-lm's ``generate_step`` (gemma3: mlx-lm has no quantized
ring).
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import model_helpers
import pytest

import kvrows.optimized as kv
from kvrows.app.models import make_kvrows_cache
from kvrows.optimized.batch_dropin import LayoutBatchOps
from kvrows.schemes import KvStorageScheme

# ``mlx_lm.generate`` the module (the package re-exports a function of that name).
generate: Any = importlib.import_module("mlx_lm.generate")
peer: Any = mlx_lm_cache

LENGTHS = [5, 23, 2, 11, 30, 9]  # gemma3's window is 16: the long prompts wrap
MAX_TOKENS = [6, 3, 9, 4, 7, 5]
PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]


pytestmark = pytest.mark.usefixtures("cpu_stream")


class KvrowsModel:
    """A model whose ``make_cache()`` gives kvrows caches (what ``make_prompt_cache``
    and the server call); everything else is the wrapped model."""

    def __init__(self, model: Any, scheme: str = "plain") -> None:
        self.model, self.scheme = model, KvStorageScheme.parse(scheme)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    @property
    def layers(self) -> Any:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        return make_kvrows_cache(self.model, self.scheme)


def run_generator(model: Any, caches: list[list[Any]] | None = None) -> dict[str, Any]:
    """Greedy tokens per request, and each finished request's extracted caches."""
    return model_helpers.run_generator(model, PROMPTS, MAX_TOKENS, caches)


def solo_tokens(model: Any, make_cache: Any) -> list[list[int]]:
    """Each request generated alone through mlx-lm's ``generate_step``."""
    out = []
    for prompt, count in zip(PROMPTS, MAX_TOKENS, strict=True):
        steps = generate.generate_step(
            mx.array(prompt), model, max_tokens=count, prompt_cache=make_cache()
        )
        out.append([int(token) for token, _ in steps])
    return out


@pytest.fixture
def padded_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the right-padded runs kvrows layouts are asked to prepare."""
    seen: list[int] = []
    original = LayoutBatchOps.prepare

    def counting(self: LayoutBatchOps, **kwargs: Any) -> None:
        if any(kwargs.get("right_padding") or ()):
            seen.append(1)
        original(self, **kwargs)

    monkeypatch.setattr(LayoutBatchOps, "prepare", counting)
    return seen


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batch_generator_tokens_match_mlx_lm_caches(
    models: dict[str, Any], arch: str, padded_runs: list[int]
) -> None:
    model = models[arch]
    theirs = run_generator(model)
    ours = run_generator(model, caches=[make_kvrows_cache(model) for _ in PROMPTS])
    assert ours["tokens"] == theirs["tokens"]
    assert [len(t) for t in ours["tokens"]] == MAX_TOKENS
    assert padded_runs, "ragged prompt chunks must have gone through prepare/finalize"
    # The rows really lived in kvrows caches: each finished request extracts into them.
    kinds = {type(c) for caches in ours["caches"] for c in caches}
    assert kinds <= {kv.KVCache, kv.RotatingKVCache} and kinds
    for mine, peers in zip(ours["caches"], theirs["caches"], strict=True):
        assert [c.offset for c in mine] == [c.offset for c in peers]


def test_make_cache_route_and_server_batchability(models: dict[str, Any]) -> None:
    model = models["gemma3"]
    wrapped = KvrowsModel(model)
    caches = peer.make_prompt_cache(wrapped)
    assert {type(c) for c in caches} == {kv.KVCache, kv.RotatingKVCache}
    # mlx_lm.server's ModelProvider: batchable iff every cache make_prompt_cache gives
    # has ``merge`` (and there is no draft model).
    assert all(hasattr(c, "merge") for c in caches)
    assert run_generator(wrapped)["tokens"] == run_generator(model)["tokens"]


class _Tokenizer:
    """The two members ``batch_generate`` reads."""

    eos_token_ids: tuple[int, ...] = ()

    def decode(self, tokens: list[int]) -> str:
        return " ".join(map(str, tokens))


def test_batch_generate_with_kvrows_prompt_caches(models: dict[str, Any]) -> None:
    model = models["llama"]
    settings = {"completion_batch_size": 2, "prefill_batch_size": 2, "prefill_step_size": 8}
    theirs = generate.batch_generate(
        model, _Tokenizer(), PROMPTS, max_tokens=MAX_TOKENS, return_token_ids=True, **settings
    )
    ours = generate.batch_generate(
        model,
        _Tokenizer(),
        PROMPTS,
        prompt_caches=[make_kvrows_cache(model) for _ in PROMPTS],
        max_tokens=MAX_TOKENS,
        return_token_ids=True,
        return_prompt_caches=True,
        **settings,
    )
    assert ours.token_ids == theirs.token_ids
    assert all(type(c) is kv.KVCache for caches in ours.caches for c in caches)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_affine_batch_matches_solo_generation(models: dict[str, Any], arch: str) -> None:
    # mlx-lm's merge refuses quantized caches; kvrows batches them.
    model = models[arch]
    scheme = KvStorageScheme.parse("affine4")
    batched = run_generator(model, caches=[make_kvrows_cache(model, scheme) for _ in PROMPTS])
    if arch == "llama":
        layers = len(model.layers)
        oracle = solo_tokens(
            model, lambda: [peer.QuantizedKVCache(group_size=64, bits=4) for _ in range(layers)]
        )
    else:
        oracle = solo_tokens(model, lambda: make_kvrows_cache(model, scheme))
    assert batched["tokens"] == oracle
    kinds = {type(c) for caches in batched["caches"] for c in caches}
    assert kinds <= {kv.QuantizedKVCache, kv.RotatingQuantizedKVCache} and kinds
