"""The TurboQuant codec: the NumPy reference (the definition) against the MLX codec on the
CPU, bit for bit on codes and scales, over shapes, dtypes, head dims, bit widths and the
edge cases (constant groups, zeros, ±inf, NaN); bit-packing round trips; the §2.3 golden
3-bit table; deferred-V attention against the eager oracle; bytes per token."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest
from array_helpers import NP_DTYPES, to_mx, to_np
from dispatch_helpers import CallLog
from hypothesis import given
from hypothesis import strategies as st

from kvrows.codec import TURBO_HEAD_DIMS, codec_token_bytes
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.errors import InvalidInputError
from kvrows.optimized import codecs as opt_codecs
from kvrows.optimized import turbo_codec as opt
from kvrows.optimized.codecs.host_attention import op_attention
from kvrows.reference import codecs as ref_codecs
from kvrows.reference import turbo_codec as ref
from kvrows.schemes import TURBO_KEY_BITS, TURBO_VALUE_BITS, Turbo
from kvrows.turbo_tables import BOUNDARIES, CENTROIDS

KINDS = ("normal", "offset", "constant", "zeros", "tiny", "huge", "special")


pytestmark = pytest.mark.usefixtures("cpu_stream")


def same_bytes(a: npt.NDArray[Any], b: mx.array) -> bool:
    other = to_np(b)
    return a.dtype == other.dtype and a.shape == other.shape and a.tobytes() == other.tobytes()


def sample(rng: np.random.Generator, shape: tuple[int, ...], kind: str, dtype: str) -> Any:
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "offset":
        x = x * np.float32(0.01) + np.float32(rng.uniform(-50, 50))
    elif kind == "constant":  # whole groups of one value (and one all-zero group)
        x[..., :32] = np.float32(rng.uniform(-3, 3))
        x[..., 32:64] = 0
    elif kind == "zeros":
        x[:] = 0
    elif kind == "tiny":
        x = x * np.float32(1e-9)
    elif kind == "huge":
        x = x * np.float32(3e4)
    elif kind == "special":
        flat = x.reshape(-1)
        picks = rng.choice(flat.size, size=max(1, flat.size // 50), replace=False)
        flat[picks] = rng.choice(np.array([np.nan, np.inf, -np.inf], dtype=np.float32), picks.size)
    with np.errstate(over="ignore"):  # huge values overflow float16 to inf: also a case
        return x.astype(NP_DTYPES[dtype])


@given(
    seed=st.integers(0, 2**32 - 1),
    dim=st.sampled_from(TURBO_HEAD_DIMS),
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    dtype=st.sampled_from(tuple(NP_DTYPES)),
    kind=st.sampled_from(KINDS),
    k_bits=st.sampled_from(TURBO_KEY_BITS),
    v_bits=st.sampled_from(TURBO_VALUE_BITS),
)
def test_optimized_codes_and_scales_equal_the_reference(
    seed: int, dim: int, lead: list[int], dtype: str, kind: str, k_bits: int, v_bits: int
) -> None:
    x = sample(np.random.default_rng(seed), (*lead, dim), kind, dtype)
    for mine, theirs in zip(
        ref.encode_keys(x, k_bits), opt.encode_keys(to_mx(x), k_bits), strict=True
    ):
        assert same_bytes(mine, theirs)
    for mine, theirs in zip(
        ref.encode_values(x, v_bits), opt.encode_values(to_mx(x), v_bits), strict=True
    ):
        assert same_bytes(mine, theirs)


@given(seed=st.integers(0, 2**32 - 1), dim=st.sampled_from(TURBO_HEAD_DIMS))
def test_mlx_hadamard_transform_is_the_reference_butterfly(seed: int, dim: int) -> None:
    x = np.random.default_rng(seed).standard_normal((3, dim)).astype(np.float32)
    assert same_bytes(ref.hadamard(x), opt.hadamard(mx.array(x)))
    # orthonormal and an involution up to rounding
    np.testing.assert_allclose(ref.hadamard(ref.hadamard(x)), x, atol=1e-5)


@pytest.mark.parametrize("bits", sorted({*TURBO_KEY_BITS, *TURBO_VALUE_BITS}))
def test_bit_packing_round_trips_as_a_little_endian_stream(bits: int) -> None:
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(2, 3, 64), dtype=np.uint8)
    packed = ref.pack_codes(codes, bits)
    assert packed.shape == (2, 3, 64 * bits // 8)
    assert np.array_equal(ref.unpack_codes(packed, bits), codes)
    assert same_bytes(packed, opt.pack_codes(mx.array(codes), bits))
    assert same_bytes(codes, opt.unpack_codes(mx.array(packed), bits))
    # independent oracle: code i occupies bits [i*b, i*b + b) of one little-endian integer
    stream = int.from_bytes(packed[0, 0].tobytes(), "little")
    assert [(stream >> (i * bits)) & (2**bits - 1) for i in range(64)] == codes[0, 0].tolist()


def test_three_bit_table_is_the_golden_one() -> None:
    assert CENTROIDS[3] == (
        -2.15195, -1.34391, -0.75601, -0.24509, 0.24509, 0.75601, 1.34391, 2.15195,
    )  # fmt: skip
    assert BOUNDARIES[3] == (-1.74793, -1.04996, -0.50055, 0.0, 0.50055, 1.04996, 1.74793)
    for bits in TURBO_VALUE_BITS:
        centroids = np.array(CENTROIDS[bits])
        assert len(centroids) == 2**bits and np.all(np.diff(centroids) > 0)
        assert np.allclose(centroids, -centroids[::-1])
        np.testing.assert_allclose(
            BOUNDARIES[bits], (centroids[1:] + centroids[:-1]) / 2, atol=1e-5
        )


def test_golden_value_codes_follow_the_boundaries() -> None:
    # A vector whose rotation is known: x = s ⊙ H(y) gives H(s ⊙ x) = y (H is an
    # involution up to rounding). Group 0 holds the 3-bit centroids, group 1 a constant.
    dim = 64
    y = np.zeros(dim, dtype=np.float32)
    y[:32] = np.tile(np.array(CENTROIDS[3], dtype=np.float32), 4)
    y[32:] = np.float32(2.0)
    x = (ref.hadamard(y) * ref.signs(dim)).astype(np.float32)
    packed, scales = ref.encode_values(x, 3)
    codes = ref.unpack_codes(packed, 3)
    rms = float(np.sqrt(np.mean(np.array(CENTROIDS[3]) ** 2)))
    expected = np.searchsorted(BOUNDARIES[3], np.array(CENTROIDS[3]) / rms, side="left")
    assert codes[:32].tolist() == expected.tolist() * 4
    assert codes[32:].tolist() == [5] * 32  # 2.0 / RMS 2.0 = 1: above 0.50055, below 1.04996
    np.testing.assert_allclose(scales.astype(np.float32), [rms, 2.0], rtol=1e-3)


def test_constant_groups_decode_to_their_value_and_nan_codes_are_zero() -> None:
    x = np.zeros((1, 128), dtype=np.float32)
    x[0, :32] = 0.37  # the seed's defect: zero would be round(0.37 / 1e-8) -> fp16 inf
    x[0, 64:96] = -5.0
    x[0, 96] = np.nan
    for bits in TURBO_KEY_BITS:
        codes, scales, zeros = ref.encode_keys(x, bits)
        assert np.all(np.isfinite(zeros[0, :3]))
        decoded = ref.decode_keys(codes, scales, zeros, bits)
        assert np.all(decoded[0, :32] == np.float32(np.float16(0.37)))
        assert np.all(decoded[0, 32:64] == 0)
        assert np.all(decoded[0, 64:96] == -5.0)
        assert np.isnan(scales[0, 3]) and np.isnan(zeros[0, 3])


@pytest.mark.parametrize("k_bits", TURBO_KEY_BITS)
@pytest.mark.parametrize("v_bits", TURBO_VALUE_BITS)
def test_decode_error_shrinks_with_bits(k_bits: int, v_bits: int) -> None:
    x = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    keys = ref.decode_keys(*ref.encode_keys(x, k_bits), k_bits)
    values = ref.decode_values(*ref.encode_values(x, v_bits), v_bits)
    key_error = float(np.mean((keys - x) ** 2))
    value_error = float(np.mean((values - x) ** 2))
    # uniform step over a ~5-sigma group range at k bits; Lloyd-Max Gaussian distortion
    assert key_error < (5 / 2**k_bits) ** 2 / 12 * 2
    assert value_error < {2: 0.13, 3: 0.04, 4: 0.012, 5: 0.004, 8: 1e-4}[v_bits]


def test_values_are_rotated_in_the_fetched_read() -> None:
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    packed, scales = ref.encode_values(x, 4)
    rotated = ref.rotated_values(packed, scales, 4)
    np.testing.assert_allclose(
        ref.unrotate(rotated), ref.decode_values(packed, scales, 4), atol=1e-5
    )
    assert same_bytes(rotated, opt.rotated_values(mx.array(packed), mx.array(scales), 4))


def ref_attention_or_sdpa(codecs: Any, q: Any, k: Any, v: Any) -> Any:
    if codecs is ref_codecs:
        return ref_codecs.attention(q, k, v, "causal", 0.1)
    return mx.fast.scaled_dot_product_attention(
        q, k.astype(q.dtype), v.astype(q.dtype), scale=0.1, mask="causal"
    )


@pytest.mark.parametrize(
    "spec", [Turbo(k_bits=8, v_bits=3), Turbo(k_bits=4, v_bits=2), Turbo(k_bits=8, v_bits=8)]
)
def test_deferred_attention_matches_the_eager_oracle(spec: Turbo) -> None:
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 4, 3, 128)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 128)).astype(np.float32)
    v = rng.standard_normal((2, 2, 9, 128)).astype(np.float32)
    for codecs, to in ((ref_codecs, lambda a: a), (opt_codecs, mx.array)):
        codec: Any = codecs.make_codec(spec)
        kp, vp = codec.encode(to(k), "keys"), codec.encode(to(v), "values")
        deferred = codec.attend(
            to(q), codec.fetched(kp, "keys"), codec.fetched(vp, "values"), "causal", 0.1
        )
        eager = codecs.eager_attention(codec, to(q), kp, vp, "causal", 0.1)
        deferred_np, eager_np = np.array(deferred), np.array(eager)
        assert deferred_np.dtype == np.float32
        # Not bit-identical (the rotated values are rounded to bf16 before attention)
        np.testing.assert_allclose(deferred_np, eager_np, atol=3e-2)
        # and the un-rotation is what makes them agree: attention over the rotated
        # values without it is far off
        module = ref if codecs is ref_codecs else opt
        rotated = module.rotated_values(vp[0], vp[1], spec.v_bits)
        skipped = ref_attention_or_sdpa(codecs, to(q), codec.decode(kp, "keys"), rotated)
        assert np.abs(np.array(skipped) - eager_np).max() > 0.3


def test_bytes_per_token_k8v3_at_128_is_200() -> None:
    spec = Turbo(k_bits=8, v_bits=3)
    per_head = codec_token_bytes(spec, 1, 128, "bfloat16", "keys") + codec_token_bytes(
        spec, 1, 128, "bfloat16", "values"
    )
    assert per_head == 200  # 128 + 4 + 4 key bytes, 48 + 4 value bytes
    assert 2 * 128 * 2 / per_head == 2.56


@pytest.mark.parametrize("dim", [32, 96, 100, 1024])
def test_other_head_dims_are_refused(dim: int) -> None:
    x = np.zeros((1, dim), dtype=np.float32)
    with pytest.raises(InvalidInputError, match="head dims"):
        ref.encode_keys(x, 8)
    with pytest.raises(InvalidInputError, match="head dims"):
        opt.encode_values(mx.array(x), 3)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(InvalidInputError, match="float32, float16 or bfloat16"):
        ref.encode_keys(np.zeros((1, 64), dtype=np.int32), 8)
    with pytest.raises(InvalidInputError, match="k_bits"):
        opt.encode_keys(mx.zeros((1, 64)), 3)
    with pytest.raises(InvalidInputError, match="v_bits"):
        ref.encode_values(np.zeros((1, 64), dtype=np.float32), 6)


@pytest.mark.parametrize("dim", TURBO_HEAD_DIMS)
def test_sign_tables_are_the_documented_derivation(dim: int) -> None:
    bits = np.array(mx.random.randint(0, 2, (dim,), key=mx.random.key(42)))
    assert np.array_equal(ref.signs(dim), np.where(bits == 1, 1.0, -1.0).astype(np.float32))
    assert same_bytes(ref.signs(dim), opt.signs(dim))


@pytest.mark.parametrize("bits", TURBO_VALUE_BITS)
def test_codebooks_are_lloyd_max_fixed_points_of_the_unit_normal(bits: int) -> None:
    # Independent oracle: each centroid is the normal's mean over its cell (closed form).
    def pdf(x: float) -> float:
        return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)

    def cdf(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    edges = [-math.inf, *BOUNDARIES[bits], math.inf]
    for centroid, lo, hi in zip(CENTROIDS[bits], edges[:-1], edges[1:], strict=True):
        mean = (pdf(lo) - pdf(hi)) / (cdf(hi) - cdf(lo))
        assert abs(mean - centroid) < 2e-4 * max(1.0, abs(centroid))


#: Magnitudes of the nearly constant key groups: float16's range, and far beyond it for
#: the dtypes that reach there (float32 / bfloat16 keys whose float16 scale must saturate).
_HALF_RANGE = 6e4


@st.composite
def nearly_constant_keys(draw: st.DrawFn) -> npt.NDArray[Any]:
    """``[1, 64]`` keys of one dtype: each 32-group a value ``c`` plus 0-3 ulps (of the
    dtype) per element, so the group's range is a few ulps of a possibly large mean."""
    dtype = NP_DTYPES[draw(st.sampled_from(tuple(NP_DTYPES)), label="dtype")]
    beyond = dtype != np.float16 and draw(st.booleans(), label="beyond float16")
    top = 1e37 if beyond else _HALF_RANGE
    groups = []
    for _ in range(2):
        magnitude = draw(st.floats(1e-3, top), label="magnitude")
        sign = draw(st.sampled_from([1.0, -1.0]), label="sign")
        ulps = draw(st.lists(st.integers(0, 3), min_size=32, max_size=32), label="ulps")
        base = np.full(32, sign * magnitude, dtype=np.float32).astype(dtype)
        word = np.uint32 if dtype == np.float32 else np.uint16
        # Adding to the bit pattern moves the magnitude up by that many ulps (same sign).
        nudged = base.view(word) + np.array(ulps, dtype=word)
        groups.append(nudged.view(dtype))
    return np.concatenate(groups)[None, :]


@profile_settings(max_examples=60 if active_profile().name == "ci" else 600)
@given(keys=nearly_constant_keys(), k_bits=st.sampled_from(TURBO_KEY_BITS))
def test_nearly_constant_key_groups_decode_finite_and_attend_without_nan(
    keys: npt.NDArray[Any], k_bits: int
) -> None:
    # The overflow this guards: {300, 300.25} in float16 at 8 bits has a zero of ~3e5,
    # stored as float16 inf; its keys decoded to inf and attention over them to NaN.
    encoded = ref.encode_keys(keys, k_bits)
    for mine, theirs in zip(encoded, opt.encode_keys(to_mx(keys), k_bits), strict=True):
        assert same_bytes(mine, theirs)
    _, scales, zeros = encoded
    assert np.all(np.isfinite(scales)) and np.all(np.isfinite(zeros))
    decoded = ref.decode_keys(*encoded, k_bits)
    assert np.all(np.isfinite(decoded))
    exact = keys.astype(np.float32)
    for group in (slice(0, 32), slice(32, 64)):
        original, got = exact[0, group], decoded[0, group]
        center = float(np.abs(original).max())
        if center <= _HALF_RANGE:
            # within the group's range plus float16's relative precision of the mean
            bound = float(original.max() - original.min()) + center / 512 + 1e-3
            assert float(np.abs(got - original).max()) <= bound
    # token 0 holds the nearly constant keys, token 1 ordinary ones; ordinary values
    ordinary = np.linspace(-1, 1, 64, dtype=np.float32)[None]
    key_block = np.concatenate([exact, ordinary])[None, None]
    value_block = np.concatenate([ordinary, -ordinary])[None, None]
    _assert_attends_finite(Turbo(k_bits=k_bits, v_bits=3), key_block, value_block)


def _assert_attends_finite(spec: Turbo, keys: npt.NDArray[Any], values: npt.NDArray[Any]) -> None:
    """Both implementations' codecs encode ``keys`` and ``values`` and attend small
    queries over them to finite outputs."""
    queries = np.full((1, 1, 1, 64), 1e-3, dtype=np.float32)
    for codecs, to in ((ref_codecs, lambda a: a), (opt_codecs, mx.array)):
        codec: Any = codecs.make_codec(spec)
        out = codec.attend(
            to(queries),
            codec.fetched(codec.encode(to(keys), "keys"), "keys"),
            codec.fetched(codec.encode(to(values), "values"), "values"),
            None,
            1.0,
        )
        assert np.all(np.isfinite(np.array(out)))


@st.composite
def large_values(draw: st.DrawFn) -> npt.NDArray[Any]:
    """``[1, 64]`` finite values of one dtype, large enough that a rotated group's RMS may
    pass float16's maximum (float16 near 65504), or its square float32's (up to 1e37)."""
    dtype = NP_DTYPES[draw(st.sampled_from(tuple(NP_DTYPES)), label="dtype")]
    top = 6.5e4 if dtype == np.float16 else 1e37
    magnitude = draw(st.floats(1e3, top), label="magnitude")
    signs_drawn = draw(st.lists(st.sampled_from([1.0, -1.0]), min_size=64, max_size=64))
    spread = draw(st.lists(st.floats(0.5, 1.0), min_size=64, max_size=64), label="spread")
    values = np.array(signs_drawn, np.float32) * np.array(spread, np.float32) * magnitude
    return values.astype(dtype)[None, :]


@profile_settings(max_examples=40 if active_profile().name == "ci" else 400)
@given(values=large_values(), v_bits=st.sampled_from(TURBO_VALUE_BITS))
def test_large_finite_values_keep_finite_scales_and_attend_without_nan(
    values: npt.NDArray[Any], v_bits: int
) -> None:
    # The overflow this guards: float16 values near 65504 that the rotation gathers into
    # one group have an RMS float16 rounds to inf; such values decoded to inf and attention
    # over them to NaN.
    encoded = ref.encode_values(values, v_bits)
    for mine, theirs in zip(encoded, opt.encode_values(to_mx(values), v_bits), strict=True):
        assert same_bytes(mine, theirs)
    assert np.all(np.isfinite(encoded[1]))
    assert np.all(np.isfinite(ref.decode_values(*encoded, v_bits)))
    keys = np.linspace(-1, 1, 64, dtype=np.float32)[None, None, None]
    _assert_attends_finite(Turbo(k_bits=8, v_bits=v_bits), keys, values[None, None])


def test_float16_values_near_the_maximum_once_overflowed_the_scale() -> None:
    # A hand-built case: 64 float16 values of 60000 whose signs match the rotation's
    # sign vector are, after it, one spike per 64-Hadamard: RMS 60000·√64/√32 ≈ 84853.
    values = (60000 * ref.signs(64)).astype(np.float16)[None, :]
    _, scales = ref.encode_values(values, 3)
    assert np.all(np.isfinite(scales)) and float(scales.max()) == 65504.0


@pytest.mark.parametrize("k_bits", sorted(TURBO_KEY_BITS))
def test_the_optimized_attention_scores_keys_on_their_codes(k_bits: int, call_log: CallLog) -> None:
    """The MLX-op path's dispatch (other backends', and the CPU's in ``op_attention``):
    keys of every width are scored by ``mx.quantized_matmul`` over the stored codes, never
    decoded; the output agrees with the reference's."""
    # The attention calls both through their modules (``mx``, ``turbo_codec``): watched there.
    call_log.watch(mx, "quantized_matmul")
    call_log.watch(opt, "decode_keys")
    rng = np.random.default_rng(k_bits)
    q = rng.standard_normal((2, 4, 3, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 9, 64)).astype(np.float32)
    spec = Turbo(k_bits=k_bits, v_bits=3)
    codec: Any = opt_codecs.make_codec(spec)
    with op_attention():
        out = codec.attend(
            mx.array(q),
            codec.fetched(codec.encode(mx.array(k), "keys"), "keys"),
            codec.fetched(codec.encode(mx.array(v), "values"), "values"),
            "causal",
            0.125,
        )
    assert call_log.names == ["quantized_matmul"]
    reference: Any = ref_codecs.make_codec(spec)
    want = reference.attend(
        q, reference.encode(k, "keys"), reference.encode(v, "values"), "causal", 0.125
    )
    np.testing.assert_allclose(np.array(out), want, atol=3e-2)


@pytest.mark.parametrize("v_bits", sorted(TURBO_VALUE_BITS))
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(1, 12), start=st.integers(0, 3))
def test_the_cpu_value_lookup_is_the_mlx_gather_bit_for_bit(
    v_bits: int, seed: int, tokens: int, start: int
) -> None:
    """The CPU's NumPy lookup of the rotated values (a strided read of a longer buffer
    included, as a read's planes are) gives the float32s of the MLX gather it replaces,
    and on the CPU the MLX lookup indices are never built."""
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((2, 3, start + tokens + 2, 128)).astype(np.float32))
    packed, scales = opt.encode_values(x, v_bits)
    packed, scales = packed[:, :, start : start + tokens], scales[:, :, start : start + tokens]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(opt, "on_cpu", lambda: False)
        gathered = np.array(opt.rotated_values(packed, scales, v_bits))
    with pytest.MonkeyPatch.context() as patch:

        def no_indices(*args: Any) -> mx.array:
            raise AssertionError("the CPU read built MLX lookup indices")

        patch.setattr(opt, "_lookup_indices", no_indices)
        looked_up = np.array(opt.rotated_values(packed, scales, v_bits))
    assert looked_up.dtype == np.float32 and looked_up.tobytes() == gathered.tobytes()
