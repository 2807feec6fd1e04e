"""``kvrows.app.attention.row_attention``: mlx-lm's attention dispatch for mixed rows.

Oracles: the same model run without the scope (bit-identical for every cache that is not
a mixed delayed layout), mlx-lm's own function object (restored exactly), and each row's
solo run over its serial lego (mixed decode within the conformance tolerance).
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
from kvrows.app.attention import (
    _HOOKABLE,
    attention_scope,
    dispatch,
    gains_from_hook,
    hookable_modules,
    row_attention,
)
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.conformance.arrays import as_numpy
from kvrows.conformance.tolerances import compare, tolerance
from kvrows.errors import InvalidInputError
from kvrows.maintenance import create_kv_maintenance
from kvrows.schemes import Affine, KvStorageScheme, Plain

base: Any = importlib.import_module("mlx_lm.models.base")
nn: Any = importlib.import_module("mlx.nn")
llama: Any = importlib.import_module("mlx_lm.models.llama")
ORIGINAL = base.scaled_dot_product_attention


@pytest.fixture(scope="module")
def model() -> Any:
    return tiny_model("llama")


def _tokens(seed: int, n: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 256, size=(1, n)))


def _serial_logits(model: Any, scoped: bool) -> np.ndarray:
    caches = make_kvrows_cache(model)
    steps = [_tokens(1, 5), _tokens(2, 1), _tokens(3, 1)]
    out = []
    for tokens in steps:
        if scoped:
            with row_attention(model):
                logits = model(tokens, cache=caches)
        else:
            logits = model(tokens, cache=caches)
        out.append(as_numpy(logits[:, -1]))
    return np.concatenate(out)


def _batched_logits(model: Any, scoped: bool) -> np.ndarray:
    rows = []
    for seed, n in ((4, 3), (5, 7)):
        caches = make_kvrows_cache(model)
        model(_tokens(seed, n), cache=caches)
        rows.append(caches)
    layers = []
    for index in range(len(rows[0])):
        layout = opt.BatchedKVCache.from_specs(Plain(), rows[0][index].token_geometry)
        layout.merge_rows([row[index] for row in rows])
        layers.append(layout)
    step = mx.array([[7], [9]])
    if scoped:
        with row_attention(model):
            logits = model(step, cache=layers)
    else:
        logits = model(step, cache=layers)
    return as_numpy(logits)


def test_scope_leaves_plain_runs_bit_identical(model: Any) -> None:
    plain = _serial_logits(model, scoped=False)
    assert plain.tobytes() == _serial_logits(model, scoped=True).tobytes()
    batched = _batched_logits(model, scoped=False)
    assert batched.tobytes() == _batched_logits(model, scoped=True).tobytes()


def test_affine_layers_attend_on_the_host_path_inside_the_scope(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatch: on the CPU an affine cache's attention inside ``attention_scope`` goes
    through its codec (the host path, faster than mlx-lm's quantized kernel there); inside
    ``op_attention``, and for a plain cache, the scope is not entered for it and mlx-lm's
    own function runs."""
    from kvrows.optimized.codecs import affine as affine_module
    from kvrows.optimized.codecs.host_attention import op_attention

    calls: list[str] = []
    from kvrows.optimized.codecs.host_attention import host_attention as real

    def logged(*args: Any, **kwargs: Any) -> Any:
        calls.append("host_attention")
        return real(*args, **kwargs)

    monkeypatch.setattr(affine_module, "host_attention", logged)
    caches = make_kvrows_cache(model, KvStorageScheme(codec=Affine(bits=4, group_size=64)))
    with mx.stream(mx.cpu):
        assert gains_from_hook(caches)
        with attention_scope(model, caches):
            mx.eval(model(_tokens(3, 5), cache=caches))
        assert calls and set(calls) == {"host_attention"}
        calls.clear()
        with op_attention():
            assert not gains_from_hook(caches)
            with attention_scope(model, caches):
                mx.eval(model(_tokens(4, 1), cache=caches))
        assert calls == []
    assert not gains_from_hook(make_kvrows_cache(model, KvStorageScheme(codec=Plain())))


def test_nested_scopes_restore_mlx_lm_once_the_last_closes(model: Any) -> None:
    assert llama.scaled_dot_product_attention is ORIGINAL
    with row_attention(model):
        assert llama.scaled_dot_product_attention is dispatch
        assert base.scaled_dot_product_attention is dispatch
        with row_attention(model):
            assert llama.scaled_dot_product_attention is dispatch
        assert llama.scaled_dot_product_attention is dispatch
    assert llama.scaled_dot_product_attention is ORIGINAL
    assert base.scaled_dot_product_attention is ORIGINAL
    with pytest.raises(RuntimeError, match="inside"), row_attention(model), row_attention(model):
        raise RuntimeError("inside")
    assert llama.scaled_dot_product_attention is ORIGINAL
    assert base.scaled_dot_product_attention is ORIGINAL


def test_model_without_mlx_lm_attention_is_refused() -> None:
    with pytest.raises(InvalidInputError), row_attention(nn.Linear(2, 2)):
        pass  # pragma: no cover - never entered
    assert base.scaled_dot_product_attention is ORIGINAL


def test_a_model_is_scanned_for_hookable_modules_once_while_it_lives() -> None:
    """Every hooked forward asks which modules to rebind: the scan (every module of the
    model) runs once per live model, and its entry goes with the model."""
    import gc

    calls: list[int] = []

    def counting_model() -> Any:
        fresh = tiny_model("llama")
        real = fresh.modules

        def counted() -> Any:
            calls.append(1)
            return real()

        fresh.modules = counted  # (the scan walks model.modules())
        return fresh

    fresh = counting_model()
    first = hookable_modules(fresh)
    assert first == [llama] and hookable_modules(fresh) == first and len(calls) == 1
    key = id(fresh)
    assert key in _HOOKABLE
    del fresh
    gc.collect()
    assert key not in _HOOKABLE


def _prefill(model: Any, caches: list[Any], tokens: mx.array, scheme: KvStorageScheme) -> Any:
    """Prefill in chunks cut at the maintenance limit (as the engine does)."""
    maintenance = create_kv_maintenance(scheme)
    position, logits = 0, None
    total = int(tokens.shape[1])
    while position < total:
        limit = maintenance.max_append_tokens(caches)
        end = total if limit == float("inf") else min(total, position + int(limit))
        logits = model(tokens[:, position:end], cache=caches)
        position = end
    return logits


def test_full_attention_mixed_decode_equals_solo_runs(model: Any) -> None:
    scheme = KvStorageScheme(codec=Affine(bits=8, group_size=32), quantized_kv_start=6)
    maintenance = create_kv_maintenance(scheme)
    prompts = [_tokens(10, 3), _tokens(11, 9)]
    solo_logits: list[list[np.ndarray]] = []
    solo_tokens: list[list[int]] = []
    for prompt in prompts:
        caches = make_kvrows_cache(model, scheme)
        # Solo runs attend as kvrows' forwards do, inside the scope (on the CPU an affine
        # layer's attention takes the host path there).
        with attention_scope(model, caches):
            logits = _prefill(model, caches, prompt, scheme)
        rows, picks = [], []
        for _ in range(6):
            token = int(np.argmax(as_numpy(logits[0, -1])))
            picks.append(token)
            with attention_scope(model, caches):
                logits = model(mx.array([[token]]), cache=caches)
            rows.append(as_numpy(logits[0, -1]))
        solo_logits.append(rows)
        solo_tokens.append(picks)
    batch_rows = []
    for prompt in prompts:
        caches = make_kvrows_cache(model, scheme)
        _prefill(model, caches, prompt, scheme)
        batch_rows.append(maintenance.prepare_batch(caches))
    layers = batch_rows[0]
    for index, layout in enumerate(layers):
        layout.merge_rows([batch_rows[1][index]])
    assert layers[0].phase == "mixed" and layers[0].converted_at == (None, 6)
    tol = tolerance("affine", "attention.solo", "float32")
    with row_attention(model):
        for step in range(6):
            tokens = mx.array([[solo_tokens[0][step]], [solo_tokens[1][step]]])
            logits = as_numpy(model(tokens, cache=layers)[:, -1])
            for b in range(2):
                ok, error = compare(logits[b], solo_logits[b][step], tol)
                assert ok, (step, b, error)
                assert int(np.argmax(logits[b])) == int(np.argmax(solo_logits[b][step]))
    assert layers[0].phase == "packed" and layers[0].converted_at == (6, 6)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_multi_token_blocks_over_mixed_rows_equal_solo_runs(arch: str) -> None:
    """Blocks of 3, 2, 1 and 4 tokens to rows of 3 and 9 tokens (start 10): every
    position's logits equal each row's solo lego run, from the plain phase through the
    mixed one (row 1 converts at 12 after the first block, row 0 at 13 after the last)."""
    model = tiny_model(arch)
    scheme = KvStorageScheme.parse("affine4:32@10")
    maintenance = create_kv_maintenance(scheme)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12]]
    solos, rows = [], []
    for prompt in prompts:
        solo = make_kvrows_cache(model, scheme)
        _prefill(model, solo, mx.array([prompt]), scheme)
        solos.append(solo)
        caches = make_kvrows_cache(model, scheme)
        _prefill(model, caches, mx.array([prompt]), scheme)
        rows.append(maintenance.prepare_batch(caches))
    layers = rows[0]
    for index, layout in enumerate(layers):
        layout.merge_rows([rows[1][index]])
    tol = tolerance("affine", "attention.solo", "float32")
    phases = []
    with row_attention(model):
        for step, n in enumerate((3, 2, 1, 4)):
            phases.append(layers[0].phase)
            block = [[20 + step + j for j in range(n)], [40 + step + j for j in range(n)]]
            logits = as_numpy(model(mx.array(block), cache=layers))
            for b in range(2):
                expected = as_numpy(model(mx.array([block[b]]), cache=solos[b])[0])
                ok, error = compare(logits[b], expected, tol)
                assert ok, (step, b, error)
    assert phases == ["plain", "mixed", "mixed", "mixed"]
    assert layers[0].converted_at == (13, 12) and layers[0].phase == "packed"
