"""The microscaling codecs (``spec/mx-codec.md``): the NumPy formats against MLX bit for
bit, the spec's parameters and errors, and the codec where the axes take it (presets,
bf16-first, paged, saved states, the engine's scheme words)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest
from dispatch_helpers import CallLog
from hypothesis import given, settings
from hypothesis import strategies as st

import kvrows.optimized as O
import kvrows.reference as R
from kvrows.app import attention, demo
from kvrows.app.engine import Engine, Request
from kvrows.app.models import make_kvrows_cache
from kvrows.codecs import parse_codec
from kvrows.codecs.mx import MX_MODES, Microscaled
from kvrows.errors import IncompatibleRowsError, InvalidInputError
from kvrows.optimized.codecs import make_codec as optimized_codec
from kvrows.optimized.codecs.host_attention import op_attention
from kvrows.reference.codecs import make_codec as reference_codec
from kvrows.reference.codecs.mx import FP4_VALUES, dequantize, from_fp8, quantize, to_fp8
from kvrows.schemes import Affine, KvStorageScheme

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": BF16}
MLX = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
#: Values that sit on the formats' edges: zeros, subnormals, ties, saturation, non-finite.
SPECIAL = (
    0.0, -0.0, 0.25, -0.25, 0.75, 448.0, 464.0, 500.0, 6.0, 7.0, 65504.0, 1e-8, 6e-8,
    1e-40, 3e38, -3e38, np.inf, -np.inf, np.nan, -np.nan,
)  # fmt: skip


def _bits(array: Any) -> bytes:
    return np.ascontiguousarray(array).tobytes()


def _to_mlx(values: np.ndarray, dtype: str) -> mx.array:
    return mx.array(values.astype(np.float32)).astype(MLX[dtype])


def _from_mlx(array: mx.array) -> np.ndarray:
    if array.dtype == mx.bfloat16:
        return np.array(array.astype(mx.float32)).astype(BF16)
    return np.array(array)


@st.composite
def _groups(draw: st.DrawFn) -> tuple[str, str, np.ndarray]:
    """A mode, a dtype and ``[rows, D]`` values of every magnitude, with special values."""
    mode = draw(st.sampled_from(sorted(MX_MODES)))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    rows, groups = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    shape = (rows, groups * 32)  # (head dims of 32s: MLX packs FP4 32 values at a time)
    seed, exponent = draw(st.integers(0, 2**16)), draw(st.integers(-30, 20))
    values = np.random.default_rng(seed).normal(size=shape).astype(np.float32) * 2.0**exponent
    kind = draw(st.sampled_from(("normal", "specials", "grid", "zeros")))
    if kind == "specials":
        mask = np.random.default_rng(seed + 1).random(shape) < 0.3
        values[mask] = np.random.default_rng(seed + 2).choice(SPECIAL, size=int(mask.sum()))
    elif kind == "grid":  # element values on and between the FP4 grid (rounding ties)
        values = np.random.default_rng(seed).integers(-14, 15, shape).astype(np.float32) / 2
    elif kind == "zeros":
        values[:] = 0.0
    with np.errstate(over="ignore"):
        return mode, dtype, values.astype(DTYPES[dtype])


@settings(max_examples=150, deadline=None)
@given(case=_groups())
def test_the_formats_are_mlx_bit_for_bit(case: tuple[str, str, np.ndarray]) -> None:
    """``quantize`` / ``dequantize`` against ``mx.quantize`` / ``mx.dequantize`` on the CPU:
    the same bytes for every mode and dtype, special values included."""
    mode, dtype, values = case
    group, bits = MX_MODES[mode]
    codes, scales, *_ = mx.quantize(_to_mlx(values, dtype), group_size=group, bits=bits, mode=mode)
    ours = quantize(values, group, bits)
    assert _bits(ours[0]) == _bits(np.array(codes)) and ours[0].dtype == np.uint32
    assert _bits(ours[1]) == _bits(np.array(scales)) and ours[1].dtype == np.uint8
    back = mx.dequantize(codes, scales, None, group_size=group, bits=bits, mode=mode,
                         dtype=MLX[dtype])  # fmt: skip
    assert _bits(dequantize(np.array(codes), np.array(scales), group, bits, DTYPES[dtype])) == (
        _bits(_from_mlx(back))
    )


def test_fp8_elements_round_to_nearest_even_and_saturate() -> None:
    # E4M3: 1.0625 lies halfway between 1 and 1.125 (mantissa 0 even), 1.1875 between
    # 1.125 and 1.25 (rounds to 1.25); 464 and above, inf and NaN saturate to 448.
    assert from_fp8(to_fp8([1.0625, 1.1875, 2.0**-9, 2.0**-10])).tolist() == [
        1.0, 1.25, 2.0**-9, 0.0,
    ]  # fmt: skip
    assert to_fp8([448.0, 464.0, 1e9, np.inf, -np.inf, -np.nan]).tolist() == [
        0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE,
    ]  # fmt: skip
    every = from_fp8(np.arange(256, dtype=np.uint8))
    assert np.nanmax(every) == 448.0 and np.isnan(every[[0x7F, 0xFF]]).all()  # E4M3 NaN
    assert FP4_VALUES[8] == 0 and np.signbit(FP4_VALUES[8])  # the -0 code


def test_the_scale_is_the_exact_ceiling_of_log2() -> None:
    # 6152 / 6 rounds to 1025 in float16: log2 is 10.0014, 10.0 once rounded to float16;
    # MLX takes the exact ceiling, 11 (the elements never exceed 6 but by rounding).
    values = np.full((1, 32), 6152.0, np.float16)
    _, scales = quantize(values, 32, 4)
    assert int(scales[0, 0]) - 127 == 11


def test_a_non_finite_group_is_lost_as_mlx_loses_it() -> None:
    values = np.zeros((1, 32), np.float32)
    values[0, :3] = [np.inf, 1.0, -1.0]
    codes, scales = quantize(values, 32, 8)
    assert scales.tolist() == [[128]]  # int32 of float32(INT32_MIN + 127), & 0xFF
    assert codes.view(np.uint8)[0, :4].tolist() == [0x7E, 0x7E, 0xFE, 0xFE]  # 0/0: -NaN
    half = values.astype(np.float16)
    assert quantize(half, 32, 8)[1].tolist() == [[0]]


def test_the_spec_names_the_three_modes_and_refuses_others() -> None:
    assert [parse_codec(m).key for m in ("mxfp8", "mxfp4", "nvfp4")] == list(MX_MODES)
    assert Microscaled() == parse_codec("mxfp4") and Microscaled().key == "mxfp4"
    assert KvStorageScheme.parse("nvfp4,0=plain@64").codec == Microscaled(group_size=16, bits=4)
    with pytest.raises(InvalidInputError, match="no microscaling mode has group_size=16, bits=8"):
        Microscaled(group_size=16, bits=8)
    with pytest.raises(InvalidInputError, match="multiples of 32, got 48"):
        O.MxKVCache(32, 4).update_and_fetch(*(mx.zeros((1, 1, 1, 48)),) * 2)
    with pytest.raises(InvalidInputError, match="multiples of 32, got 16"):  # even nvfp4
        R.MxKVCache(16, 4).update_and_fetch(*(np.zeros((1, 1, 1, 16), np.float16),) * 2)
    spec = Microscaled(group_size=16, bits=4)
    assert [(p.dtype, p.width) for p in spec.plane_specs("keys", 64, "bfloat16")] == [
        ("uint32", 8), ("uint8", 4),
    ]  # fmt: skip


@pytest.mark.parametrize("mode", sorted(MX_MODES))
def test_both_codecs_store_and_attend_alike(mode: str) -> None:
    spec = parse_codec(mode)
    rng = np.random.default_rng(3)
    keys, values = (rng.normal(size=(2, 2, 5, 64)).astype(np.float16) for _ in range(2))
    queries = rng.normal(size=(2, 4, 3, 64)).astype(np.float16)
    ref, opt = reference_codec(spec), optimized_codec(spec)
    stored = ref.encode(keys), ref.encode(values, "values")
    planes = opt.encode(mx.array(keys)), opt.encode(mx.array(values), "values")
    for ours, theirs in zip((*stored[0], *stored[1]), (*planes[0], *planes[1]), strict=True):
        assert _bits(ours) == _bits(np.array(theirs))
    assert _bits(ref.decode(stored[0])) == _bits(np.array(opt.decode(planes[0])))
    out_ref = ref.attend(queries, *stored, "causal", 0.125)
    out_opt = np.array(opt.attend(mx.array(queries), *planes, "causal", 0.125))
    assert out_opt.dtype == np.float16
    np.testing.assert_allclose(out_opt.astype(np.float32), out_ref.astype(np.float32), atol=2e-3)
    assert ref.defers_values and opt.defers_values  # reads are codes: the codec attends


@pytest.mark.parametrize("impl", [R, O], ids=["reference", "optimized"])
def test_the_presets_hold_rows_and_persist(impl: Any) -> None:
    native = (lambda a: a) if impl is R else mx.array
    block = native(np.random.default_rng(0).normal(size=(1, 2, 7, 32)).astype(np.float16))
    cache = impl.MxKVCache(16, 4)
    keys, _ = cache.update_and_fetch(block, block)
    assert [tuple(p.shape) for p in keys] == [(1, 2, 7, 4), (1, 2, 7, 2)]
    assert cache.signature() == "kv:mx:16:4" and cache.bits == 4 and cache.group_size == 16
    layout = impl.BatchedMxKVCache(16, 4)
    layout.merge_rows([cache, impl.MxKVCache(16, 4)])
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([impl.MxKVCache(32, 4)])  # another mode
    again = impl.MxKVCache.from_state(cache.state)
    assert again.state[2:] == (7, 16, 4)
    assert _bits(np.array(again.state[0][0])) == _bits(np.array(cache.state[0][0]))
    lego = impl.Bf16FirstMxKVCache(32, 8, start=4)
    lego.update_and_fetch(block, block)
    assert lego.codec_spec == Microscaled(group_size=32, bits=8)  # converted at the append


def test_a_paged_pool_stores_the_codec() -> None:
    spec = Microscaled(group_size=16, bits=4)
    cache = O.PagedKVCache(codec=spec)
    block = mx.random.normal((1, 2, 20, 32)).astype(mx.bfloat16)
    cache.update_and_fetch(block, block)
    rows = O.PagedKvRows(codec=spec)
    rows.merge_rows([cache])
    serial = O.MxKVCache(16, 4)
    serial.update_and_fetch(block, block)
    # The pool's planes are the contiguous cache's, byte for byte.
    for paged, contiguous in zip(rows.fetch()[0], serial.fetch()[0], strict=True):
        assert _bits(np.array(paged)) == _bits(np.array(contiguous))
    loaded = O.PagedKVCache.from_state(cache.state)
    assert loaded.codec_spec == spec and loaded.offset == 20


@pytest.mark.parametrize("scheme", ["mxfp4", "turbo"])
def test_a_draft_of_its_own_model_is_always_accepted(models: dict[str, Any], scheme: str) -> None:
    """The engine's drafter prefills joining rows through the codec's attention too: with
    the target as its own draft every proposal is accepted. (Its prefill once called the
    model outside the row-attention hook: mlx-lm's attention raised over microscaling
    planes and read TurboQuant's rotated values as values.)"""
    model = models["llama"]
    trace = [Request(f"r{i}", (3 + i, 7, 11, 13, 17 + i), max_tokens=6) for i in range(3)]
    engine = Engine(
        model, KvStorageScheme.parse(scheme), max_batch=3, draft_model=model, draft_tokens=2
    )
    results, stats = engine.run(trace)
    assert stats.drafted > 0 and stats.accepted == stats.drafted, (stats.accepted, stats.drafted)
    plain_run = Engine(model, KvStorageScheme.parse(scheme), max_batch=3).run(trace)[0]
    assert [r.tokens for r in results] == [r.tokens for r in plain_run]


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_a_microscaled_latent_saves_its_mode_and_loads_back(mode: str) -> None:
    """An encoded latent through a microscaling mode (its tail is affine's: the state's
    ``codec`` tag tells them apart) restores that mode in both implementations; a v1 state
    (no tag) still loads, its codec told by its tail."""
    group, bits = MX_MODES[mode]
    spec = Microscaled(group_size=group, bits=bits)
    rng = np.random.default_rng(3)
    latent = rng.standard_normal((2, 1, 5, 64)).astype(np.float32)
    rope = rng.standard_normal((2, 1, 5, 16)).astype(np.float32)
    for impl, to in ((O, mx.array), (R, np.asarray)):
        cache = impl.EncodedLatentCache(codec=spec, start=0)
        cache.append(to(latent), to(rope))
        state = cache.state
        loaded = impl.EncodedLatentCache.from_state(state)
        assert loaded.latent_codec == spec
        for a, b in zip(cache.fetch(), loaded.fetch(), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
        affine = impl.EncodedLatentCache(codec=Affine(bits=4, group_size=32), start=0)
        affine.append(to(latent), to(rope))
        v1 = impl.EncodedLatentCache.from_state(tuple(affine.state)[:-1])
        assert v1.latent_codec == Affine(bits=4, group_size=32)


def _mx_ring_invariance(model: Any) -> Any:
    scheme = KvStorageScheme.parse("mxfp4")
    requests = demo.builtin_trace(4)
    engine = Engine(model, scheme, max_batch=3, prefill_chunk=16, keep_logits=True)
    results, _ = engine.run(requests)
    return demo.check_invariance(model, scheme, requests, results, 16)


def test_sliding_layers_take_the_microscaling_ring_bit_identical(
    models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """gemma3's sliding layers are microscaling rings under an mx scheme, and the batch is
    bit-identical to its solo runs: the codec's own attention reads a wrapped ring in time
    order, as mlx-lm's does. Read in physical order instead, it is not."""
    model = models["gemma3"]
    kinds = [type(c).__name__ for c in make_kvrows_cache(model, KvStorageScheme.parse("mxfp4"))]
    assert kinds == ["RotatingMxKVCache", "MxKVCache"] * 2
    report = _mx_ring_invariance(model)
    assert report.steps > 0 and report.mismatches == 0 and report.beyond_tolerance == 0
    monkeypatch.setattr(attention, "in_time_order", lambda cache, k, v, m: (k, v, m))
    assert _mx_ring_invariance(model).beyond_tolerance > 0


@pytest.mark.parametrize("mode", sorted(MX_MODES))
def test_the_op_attention_path_per_mode(mode: str, call_log: CallLog) -> None:
    """Every mode's MLX-op path (other backends', and the CPU's in ``op_attention``)
    scores on the codes with ``quantized_matmul``, mxfp8 included, and agrees with the
    reference's attention (float32 over the decoded planes); the CPU's host path is
    ``tests/test_host_attention.py``'s."""
    call_log.watch(mx, "quantized_matmul")
    call_log.watch(mx, "dequantize")
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 3, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 9, 64)).astype(np.float32)
    spec = parse_codec(mode)
    fast, oracle = optimized_codec(spec), reference_codec(spec)
    with mx.stream(mx.cpu), op_attention():
        out = fast.attend(
            mx.array(q), fast.encode(mx.array(k)), fast.encode(mx.array(v), "values"),
            "causal", 0.125,
        )  # fmt: skip
    assert call_log.names == ["quantized_matmul"] * 2
    want = oracle.attend(q, oracle.encode(k), oracle.encode(v, "values"), "causal", 0.125)
    np.testing.assert_allclose(np.array(out), want, atol=1e-3, rtol=1e-3)
