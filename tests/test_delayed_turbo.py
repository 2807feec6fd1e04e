"""DelayedTurboQuantKVCache and Bf16FirstTurboQuantKVCache: both implementations agree, each
row converts where its solo turbo lego does, extracted rows equal the solo lego's bytes,
mixed attention equals each row's solo attention within the turbo tolerance."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvrows import optimized as opt
from kvrows import reference as ref
from kvrows.delayed import row_reads
from kvrows.errors import InvalidInputError

IMPLS = ((opt, mx.array, np.asarray), (ref, lambda x: x, np.asarray))
SCALE = 0.125


def _block(rng: np.random.Generator, rows: int, n: int, heads: int = 2) -> Any:
    return rng.standard_normal((rows, heads, n, 64)).astype(np.float32)


def _planes(storage: Any) -> list[np.ndarray]:
    """The encoded planes of a serial turbo storage (or a plain one's tokens), time order,
    up to its offset: the reference keeps them per row, the optimized in buffers."""
    storage = getattr(storage, "storage", storage)
    offset = int(storage.offset)
    rows = getattr(storage, "_rows", None)
    if rows is not None:
        return [np.asarray(p)[..., :offset, :] for p in rows[0].arrays()]
    return [np.asarray(p)[..., :offset, :] for p in storage.held_arrays()]


@pytest.mark.parametrize("start", [0, 5])
def test_rows_convert_where_their_solo_legos_do(start: int) -> None:
    rng = np.random.default_rng(start)
    prompts = [2, 6, 4]
    steps = 5
    prompt_blocks = [(_block(rng, 1, n), _block(rng, 1, n)) for n in prompts]
    step_blocks = [
        (_block(rng, 3, 1), _block(rng, 3, 1), _block(rng, 3, 1, 4)) for _ in range(steps)
    ]
    outputs = []
    for module, native, back in IMPLS:
        solo = [module.Bf16FirstTurboQuantKVCache(8, 3, start) for _ in prompts]
        rows = [module.Bf16FirstTurboQuantKVCache(8, 3, start) for _ in prompts]
        for lego, twin, (k, v) in zip(solo, rows, prompt_blocks, strict=True):
            lego.update_and_fetch(native(k), native(v))
            twin.update_and_fetch(native(k), native(v))
        layout = module.DelayedTurboQuantKVCache(8, 3, start)
        assert layout.signature() == f"kv:delayed-turboquant:8:3:{start}"
        layout.merge_rows(rows)
        assert layout.converted_at == tuple(
            lego.minimum_reusable_offset if lego.converted else None for lego in solo
        )
        assert not hasattr(layout, "bits") and not hasattr(solo[1], "bits")
        outs = []
        for k, v, q in step_blocks:
            with row_reads():
                phase = layout.phase
                mask = layout.make_mask(1, return_array=True)  # the ragged rows' padding
                layout.update_and_fetch(native(k), native(v))
                got = back(module.attend(native(q), layout, mask, SCALE))
            for b, lego in enumerate(solo):
                kb, vb, qb = (native(a[b : b + 1]) for a in (k, v, q))
                before = lego.converted
                rk, rv = lego.update_and_fetch(kb, vb)
                codec = lego.storage.codec if before else opt_or_ref_plain(module)
                want = back(codec.attend(qb, rk, rv, None, SCALE))
                tol = 0 if phase == "plain" and module is opt else 2e-2
                np.testing.assert_allclose(got[b : b + 1], want, atol=tol + 1e-6, rtol=tol)
            assert layout.converted_at == tuple(
                (lego.minimum_reusable_offset if start else 0) if lego.converted else None
                for lego in solo
            )
            outs.append(got)
        layout.check_valid()
        for b, lego in enumerate(solo):
            row = layout.extract_row(b)
            assert type(row) is type(lego) and row.converted == lego.converted
            assert row.minimum_reusable_offset == lego.minimum_reusable_offset
            assert row.signature() == lego.signature() == "kv:turboquant:8:3"
            for mine, theirs in zip(_planes(row), _planes(lego), strict=True):
                np.testing.assert_array_equal(mine, theirs)
        outputs.append((outs, [_planes(layout.extract_row(b)) for b in range(3)]))
    (o_out, o_rows), (r_out, r_rows) = outputs
    for o_step, r_step in zip(o_out, r_out, strict=True):
        np.testing.assert_allclose(o_step, r_step, atol=2e-2, rtol=2e-2)
    for o_row, r_row in zip(o_rows, r_rows, strict=True):
        for o_plane, r_plane in zip(o_row, r_row, strict=True):
            np.testing.assert_array_equal(o_plane, r_plane)  # codes and scales: bit-exact


def opt_or_ref_plain(module: Any) -> Any:
    return module.KVCache().codec


def test_lego_converts_once_and_hides_affine_parameters() -> None:
    rng = np.random.default_rng(1)
    for module, native, _ in IMPLS:
        lego = module.Bf16FirstTurboQuantKVCache(8, 3, 4)
        assert lego.max_append_tokens() == 4
        k, v = _block(rng, 1, 5), _block(rng, 1, 5)
        keys, _ = lego.update_and_fetch(native(k), native(v))
        np.testing.assert_array_equal(np.asarray(keys), k)  # the converting append reads plain
        assert lego.converted and lego.minimum_reusable_offset == 5
        assert lego.last_read_codec.defers_values is False
        lego.update_and_fetch(native(k[:, :, :1]), native(v[:, :, :1]))
        assert lego.last_read_codec.defers_values is True
        assert not hasattr(lego, "bits") and not hasattr(lego, "group_size")
        lego.trim(3)
        assert lego.converted  # irreversible
        fed = module.TurboQuantKVCache(8, 3)
        fed.update_and_fetch(native(k), native(v))
        fed.update_and_fetch(native(k[:, :, :1]), native(v[:, :, :1]))
        fed.trim(3)
        for a, b in zip(_planes(lego.storage), _planes(fed), strict=True):
            np.testing.assert_array_equal(a, b)  # conversion == a turbo storage fed the tokens


def test_refusals() -> None:
    for module, native, _ in IMPLS:
        with pytest.raises(InvalidInputError, match="Bf16FirstTurboQuantKVCache"):
            module.Bf16FirstTurboQuantKVCache(7, 3)
        with pytest.raises(InvalidInputError, match="DelayedTurboQuantKVCache"):
            module.DelayedTurboQuantKVCache(8, 9)
        lego = module.Bf16FirstTurboQuantKVCache(8, 3, 9)
        bad = native(np.zeros((1, 1, 2, 48), dtype=np.float32))
        with pytest.raises(InvalidInputError, match="head dim 48"):
            lego.update_and_fetch(bad, bad)
        assert lego.offset == 0
        layout = module.DelayedTurboQuantKVCache(8, 3, 2)
        layout.merge_rows([module.Bf16FirstTurboQuantKVCache(8, 3, 2)])
        affine = module.Bf16FirstQuantizedKVCache(64, 8, 2)
        with pytest.raises(Exception, match="cannot merge"):
            layout.merge_rows([affine])


def test_make_kvrows_cache_and_maintenance_give_turbo_legos_and_layouts() -> None:
    from kvrows.app.models import make_kvrows_cache, tiny_model
    from kvrows.maintenance import create_kv_maintenance
    from kvrows.schemes import KvStorageScheme, Turbo

    model = tiny_model("llama")
    scheme = KvStorageScheme(codec=Turbo(k_bits=8, v_bits=3), quantized_kv_start=3)
    caches = make_kvrows_cache(model, scheme)
    assert all(isinstance(c, opt.Bf16FirstTurboQuantKVCache) for c in caches)
    prepared = create_kv_maintenance(scheme).prepare_batch(caches)
    assert all(isinstance(c, opt.DelayedTurboQuantKVCache) for c in prepared)


def test_engine_runs_turbo_with_a_start_as_solo_lego_runs_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvrows.app.demo import solo_logits
    from kvrows.app.engine import Engine, Request
    from kvrows.app.models import tiny_model
    from kvrows.delayed import DelayedLayout
    from kvrows.optimized.codecs import TurboCodec
    from kvrows.schemes import KvStorageScheme

    calls = {"mixed": 0, "turbo": 0}
    attend_rows, turbo_attend = DelayedLayout.attend_rows, TurboCodec.attend

    def counted_rows(layout: DelayedLayout, *args: Any, **kwargs: Any) -> Any:
        calls["mixed"] += 1
        return attend_rows(layout, *args, **kwargs)

    def counted_turbo(codec: TurboCodec, *args: Any) -> Any:
        calls["turbo"] += 1
        return turbo_attend(codec, *args)

    monkeypatch.setattr(DelayedLayout, "attend_rows", counted_rows)
    monkeypatch.setattr(TurboCodec, "attend", counted_turbo)
    scheme = KvStorageScheme.parse("turbo-k8v3@6")
    shapes = [(3, 8, 0), (9, 6, 0), (14, 5, 1), (5, 9, 2)]
    trace = [
        Request(f"r{i}", tuple((5 * i + 3 * j + 1) % 256 for j in range(length)), tokens, at)
        for i, (length, tokens, at) in enumerate(shapes)
    ]
    with mx.stream(mx.cpu):
        model = tiny_model("llama")
        engine = Engine(model, scheme, max_batch=2, prefill_chunk=4, keep_logits=True)
        results, _ = engine.run(trace)
        assert calls["mixed"] > 0 and calls["turbo"] > 0  # mixed rows; turbo reads
        solo_turbo = calls["turbo"]
        worst = 0.0
        for request, result in zip(trace, results, strict=True):
            cuts = np.cumsum([result.prefix_hit_tokens, *result.prefill_chunks])
            if len(request.prompt) > 6:
                assert 6 in cuts  # cut at the boundary
            solo = solo_logits(
                model, scheme, request, result.tokens, 4,
                cuts=result.prefill_chunks, prefix=result.prefix_hit_tokens,
            )  # fmt: skip
            assert result.tokens == [int(np.argmax(step)) for step in solo], request.rid
            for batch, alone in zip(result.logits, solo, strict=True):
                worst = max(worst, float(np.abs(batch - alone).max()))
        assert calls["turbo"] > solo_turbo  # the solo legos read turbo too
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_state_round_trip_of_mixed_rows(dtype: type) -> None:
    """The saved form holds both groups and the row record; the restored layout takes the
    plain group's activation dtype for its TurboQuant group, and both go on identically."""
    rng = np.random.default_rng(3)
    blocks: list[Any] = [rng.standard_normal((1, 2, n, 64)).astype(dtype) for n in (2, 6)]
    step: Any = rng.standard_normal((2, 2, 1, 64)).astype(dtype)
    for module, native, _ in IMPLS:
        legos = [module.Bf16FirstTurboQuantKVCache(8, 3, 5) for _ in blocks]
        for lego, block in zip(legos, blocks, strict=True):
            lego.update_and_fetch(native(block), native(block))
        layout = module.DelayedTurboQuantKVCache(8, 3, 5)
        layout.merge_rows(legos)
        restored = type(layout).from_state(layout.state)
        assert restored.phase == layout.phase == "mixed"
        assert restored.row_offsets == layout.row_offsets
        assert restored.converted_at == layout.converted_at == (None, 6)
        with row_reads():
            for cache in (layout, restored):
                cache.update_and_fetch(native(step), native(step))
        for a, b in zip(_leaves(layout.state), _leaves(restored.state), strict=True):
            if hasattr(a, "shape"):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            else:
                assert a == b


def _leaves(state: Any) -> list[Any]:
    """A nested state's arrays and scalars, in order."""
    if isinstance(state, tuple | list):
        return [leaf for part in state for leaf in _leaves(part)]
    return [state]
