"""Speculative verify rounds on every recurrent model mlx-lm builds an ``ArraysCache``
for: the layers that take a recurrent ``cache`` are found generically
(``record_recurrent_layers``), a round over every layer (``RowRound``) with unequal
per-row acceptance rolls back by replaying each row's accepted tokens, and every layer's
state then equals a solo run fed only those tokens, bit for bit. Models whose recurrent
layers cannot replay (they never ``advance`` the cache, or read it out of another cache)
are refused up front (``check_speculative_rounds``)."""

from __future__ import annotations

import importlib
from typing import Any, cast

import mlx.core as mx
import mlx_lm.models.cache as peer
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from model_helpers import cache_parts, merged_layers, prefilled_rows, same

import kvrows.optimized as kv
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine
from kvrows.app.models import (
    check_speculative_rounds,
    draft_model,
    make_kvrows_cache,
    record_recurrent_layers,
    tiny_model,
)
from kvrows.errors import NotTrimmableError
from kvrows.protocols import StateWritten
from kvrows.speculative import RowRound
from kvrows.table import target_cache_layout

mlx_cache: Any = peer  # mlx-lm is untyped
nn: Any = importlib.import_module("mlx.nn")  # its stubs do not export Module

#: Recurrent models whose layers replay (they mask per row and advance the cache).
REPLAYABLE = ("lfm2", "kimi_linear", "falcon_h1", "qwen3_next", "mamba2")
#: Recurrent models refused, with what the refusal must say.
REFUSED = {
    "rwkv7": "2 layers write it",
    "bailing_moe_linear": "never calls cache.advance",
    "baichuan_m1": "no layer of the model takes it",
}


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _model(arch: str) -> Any:
    return tiny_model(arch, vocab=128)


def _state_arrays(cache: Any) -> list[mx.array]:
    """Every array a serial cache holds: a recurrent cache's planes and offset, a KV
    cache's ``state``."""
    if isinstance(cache, kv.SSMCache):
        return [*cache, mx.array(cache.offset)]
    flat = cast(list[tuple[str, Any]], tree_flatten(cache.state))
    return [value for _, value in flat if isinstance(value, mx.array)]


@pytest.mark.parametrize("arch", REPLAYABLE)
def test_verify_round_rolls_back_every_layer_to_the_accepted_run(arch: str) -> None:
    """Three rows verify three drafts each and keep 1, 4 and 2 tokens: after the rollback
    every layer's row (recurrent planes and offset, KV state) and the next logits equal a
    solo run that saw only the prompt and the kept tokens."""
    model = _model(arch)
    check_speculative_rounds(model)  # finds and wraps the recurrent layers
    assert record_recurrent_layers(model) == 0  # wrapping twice wraps nothing
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, (1, n)) for n in (5, 9, 3)]
    layers = merged_layers(prefilled_rows(model, prompts), target_cache_layout)
    assert any(isinstance(p, StateWritten) for layer in layers for p in cache_parts(layer))
    drafts, accepted = 3, [0, 3, 1]
    block = rng.integers(0, 128, (3, drafts + 1))
    round_ = RowRound([part for layer in layers for part in cache_parts(layer)])
    round_.begin(drafts)
    model(mx.array(block), cache=layers)
    round_.resolve(accepted)
    following = rng.integers(0, 128, (3, 1))
    for b, (prompt, count) in enumerate(zip(prompts, accepted, strict=True)):
        solo = make_kvrows_cache(model)
        model(mx.array(prompt), cache=solo)
        model(mx.array(block[b : b + 1, : count + 1]), cache=solo)
        for layer, alone in zip(layers, solo, strict=True):
            for part, alone_part in zip(cache_parts(layer), cache_parts(alone), strict=True):
                mine, theirs = _state_arrays(part.extract_row(b)), _state_arrays(alone_part)
                assert len(mine) == len(theirs)
                assert all(same(x, y) for x, y in zip(mine, theirs, strict=True)), (b, part)
        expected = model(mx.array(following[b : b + 1]), cache=solo)
        row = [mlx_cache.CacheList(*(p.extract_row(b) for p in cache_parts(layer)))
               if isinstance(layer, mlx_cache.CacheList) else layer.extract_row(b)
               for layer in layers]  # fmt: skip
        assert same(model(mx.array(following[b : b + 1]), cache=row), expected)


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_models_whose_recurrent_layers_cannot_replay_are_refused(arch: str) -> None:
    model = _model(arch)
    with pytest.raises(NotTrimmableError) as refused:
        check_speculative_rounds(model)
    message = str(refused.value)
    assert arch in message and "cannot run speculative rounds" in message, message
    assert REFUSED[arch] in message, message


def test_only_the_layers_a_recurrent_state_reaches_are_wrapped() -> None:
    """The probe keeps the wrapper on qwen3_next's gated DeltaNet layer and takes it off
    the attention layer beside it; the parameter tree does not change."""
    draft = draft_model(tiny_model("qwen3_next"))  # a fresh instance: unwrapped
    before = list(dict(tree_flatten(draft.parameters())))
    assert record_recurrent_layers(draft) == 1
    assert record_recurrent_layers(draft) == 0
    assert not isinstance(draft.layers[0].linear_attn, nn.Module)  # the recording wrapper
    assert isinstance(draft.layers[1].self_attn, nn.Module)
    assert list(dict(tree_flatten(draft.parameters()))) == before


def _noisy_copy(arch: str, scale: float) -> Any:
    """``arch``'s tiny model with ``scale`` noise on every weight: a draft that agrees
    with the target often, not always."""
    draft = tiny_model(arch, vocab=128)
    mx.random.seed(5)
    draft.update(tree_map(lambda p: p + mx.random.normal(p.shape) * scale, draft.parameters()))
    return draft


@pytest.mark.parametrize("arch", ["lfm2", "kimi_linear"])
def test_engine_rounds_on_the_new_recurrent_models_equal_plain_decoding(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's verify rounds (target and draft layouts, rows accepting different
    counts) give the greedy tokens of the engine without a draft."""
    model = tiny_model(arch, vocab=128)
    trace = builtin_trace(3, vocab=128)
    plain, _ = Engine(model, max_batch=3, prefill_chunk=8).run(trace)
    verdicts: list[list[int]] = []
    resolve = RowRound.resolve

    def recording(self: RowRound, accepted: Any) -> None:
        verdicts.append(list(accepted))
        resolve(self, accepted)

    monkeypatch.setattr(RowRound, "resolve", recording)
    draft = _noisy_copy(arch, 0.01)
    engine = Engine(model, max_batch=3, prefill_chunk=8, draft_model=draft, draft_tokens=3)
    results, stats = engine.run(trace)
    assert [r.tokens for r in results] == [r.tokens for r in plain]
    assert 0 < stats.accepted < stats.drafted
    assert any(len(set(v)) > 1 for v in verdicts), "no round kept unequal counts per row"


def test_engine_refuses_a_draft_on_a_model_that_cannot_replay() -> None:
    model = tiny_model("rwkv7", vocab=128)
    with pytest.raises(NotTrimmableError, match="rwkv7 cannot run speculative rounds"):
        Engine(model, draft_model=model)
