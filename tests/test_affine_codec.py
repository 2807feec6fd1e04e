"""The NumPy affine codec against ``mx.quantize`` / ``mx.dequantize`` on MLX's CPU backend.

Everything the reference returns is compared to MLX as raw bytes (so NaN bit patterns and
signed zeros count), over random normal data at many scales, constant groups, zeros, huge and
subnormal magnitudes, inf/NaN, exact rounding ties and raw random bit patterns, for every
supported bits / group size / dtype and head dims 32..256.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import numpy.typing as npt
import pytest
from array_helpers import NP_DTYPES, to_mx, to_np
from dispatch_helpers import CallLog
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrows.affine_geometry import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from kvrows.codecs import Affine
from kvrows.errors import InvalidInputError
from kvrows.optimized import affine_codec as opt
from kvrows.optimized.codecs import affine
from kvrows.reference import affine_codec as ref

KINDS = ("normal", "offset", "constant", "zeros", "huge", "tiny", "special", "ties", "bits")


pytestmark = pytest.mark.usefixtures("cpu_stream")


# ---------------------------------------------------------------------------- helpers


def raw(a: npt.NDArray[Any]) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def unpack_codes(packed: npt.NDArray[np.uint32], bits: int) -> npt.NDArray[np.int64]:
    """Independent LSB-first bitstream reader: code j = bits [j*bits, (j+1)*bits)."""
    words = packed.astype(np.uint64)
    nxt = np.concatenate([words[..., 1:], np.zeros_like(words[..., :1])], axis=-1)
    pairs = words | (nxt << np.uint64(32))  # word i and i+1, so a straddling code is whole
    j = np.arange(packed.shape[-1] * 32 // bits)
    start = j * bits
    codes = (pairs[..., start // 32] >> (start % 32).astype(np.uint64)) & np.uint64((1 << bits) - 1)
    return codes.astype(np.int64)


def finfo(dtype: np.dtype[Any]) -> Any:
    return ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]


def ulp(y: npt.NDArray[np.float64], dtype: np.dtype[Any]) -> npt.NDArray[np.float64]:
    """Spacing of ``dtype`` at the (``dtype``-representable) values ``y``; subnormal-aware."""
    info = finfo(dtype)
    _, e = np.frexp(np.abs(y))  # |y| = m * 2**e, m in [0.5, 1)
    exponent = np.where(y == 0, info.minexp, np.maximum(e - 1, info.minexp))
    out: npt.NDArray[np.float64] = np.ldexp(1.0, exponent - info.nmant)
    return out


def make_input(
    kind: str,
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    group_size: int,
    seed: int,
    log_scale: float,
) -> npt.NDArray[Any]:
    rng = np.random.default_rng(seed)
    info = finfo(dtype)
    scale = 10.0**log_scale
    x: npt.NDArray[Any]
    if kind == "normal":
        x = rng.standard_normal(shape) * scale
    elif kind == "offset":  # one-signed groups: the edge is far from zero
        x = (rng.standard_normal(shape) + 20.0 * rng.choice([-1.0, 1.0])) * scale
    elif kind == "constant":  # a constant per group, of any magnitude, occasionally zero
        g_shape = (*shape[:-1], shape[-1] // group_size)
        consts = rng.standard_normal(g_shape) * 10.0 ** rng.uniform(-10, 4, g_shape)
        consts[rng.random(g_shape) < 0.1] = 0.0
        x = np.repeat(consts, group_size, axis=-1)
    elif kind == "zeros":
        x = np.where(rng.random(shape) < 0.5, -0.0, 0.0)
    elif kind == "huge":  # near the dtype max; float32/bfloat16 ranges can overflow float32
        x = rng.uniform(-1.0, 1.0, shape) * float(info.max)
        if rng.random() < 0.5:
            x = np.abs(x)
    elif kind == "tiny":  # subnormal magnitudes of the dtype
        x = rng.integers(-20, 21, shape) * float(info.smallest_subnormal)
    elif kind == "special":  # NaN and +-inf among normal values, sometimes a whole NaN group
        x = rng.standard_normal(shape) * scale
        u = rng.random(shape)
        x[u < 0.04] = np.nan
        x[(u >= 0.04) & (u < 0.06)] = np.inf
        x[(u >= 0.06) & (u < 0.08)] = -np.inf
        if rng.random() < 0.3:
            x[..., :32] = np.nan
    elif kind == "ties":  # halves: exact .5 ties in the code rounding
        x = rng.integers(-16, 17, shape) / 2.0
    elif kind == "bits":  # every bit pattern of the dtype: NaN payloads, infs, subnormals
        ut = np.uint32 if dtype.itemsize == 4 else np.uint16
        return rng.integers(0, np.iinfo(ut).max, shape, dtype=ut, endpoint=True).view(dtype)
    else:  # pragma: no cover
        raise AssertionError(kind)
    with np.errstate(over="ignore"):
        return x.astype(dtype)


@st.composite
def cases(
    draw: st.DrawFn, kinds: tuple[str, ...] = KINDS
) -> tuple[npt.NDArray[Any], str, int, int]:
    """(x [T?, H?, D], dtype name, group_size, bits) with D in 32..256 a multiple of the group."""
    dtype = draw(st.sampled_from(sorted(NP_DTYPES)))
    bits = draw(st.sampled_from(SUPPORTED_BITS))
    group_size = draw(st.sampled_from(SUPPORTED_GROUP_SIZES))
    head_dim = group_size * draw(st.integers(1, 256 // group_size))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    kind = draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**32 - 1))
    log_scale = draw(st.floats(-8.0, 4.0))
    x = make_input(kind, (*lead, head_dim), NP_DTYPES[dtype], group_size, seed, log_scale)
    return x, dtype, group_size, bits


def mlx_codec(
    x: npt.NDArray[Any], group_size: int, bits: int
) -> tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]:
    """(packed, scales, biases, dequantized) from the bare MLX ops, as NumPy arrays."""
    xm = to_mx(x)
    if x.ndim == 1:
        xm = xm[None]
    wq, s, b = mx.quantize(xm, group_size=group_size, bits=bits, mode="affine")
    w = mx.dequantize(wq, s, b, group_size=group_size, bits=bits, mode="affine")
    if x.ndim == 1:
        wq, s, b, w = wq[0], s[0], b[0], w[0]
    return to_np(wq), to_np(s), to_np(b), to_np(w)


# ---------------------------------------------------------------------------- bit-exactness


@settings(max_examples=400, deadline=None)
@given(cases())
def test_reference_matches_mlx_bit_for_bit(case: tuple[npt.NDArray[Any], str, int, int]) -> None:
    x, dtype, group_size, bits = case
    packed, scales, biases = ref.quantize(x, group_size, bits)
    mx_packed, mx_scales, mx_biases, mx_deq = mlx_codec(x, group_size, bits)

    head_dim = x.shape[-1]
    assert packed.dtype == np.uint32
    assert packed.shape == (*x.shape[:-1], head_dim * bits // 32)
    assert scales.shape == biases.shape == (*x.shape[:-1], head_dim // group_size)
    assert scales.dtype == biases.dtype == NP_DTYPES[dtype]
    assert raw(packed) == raw(mx_packed)
    assert raw(scales) == raw(mx_scales)
    assert raw(biases) == raw(mx_biases)

    deq = ref.dequantize(packed, scales, biases, group_size, bits)
    assert deq.dtype == NP_DTYPES[dtype]
    assert deq.shape == x.shape
    assert raw(deq) == raw(mx_deq)


@settings(max_examples=200, deadline=None)
@given(cases())
def test_byte_decode_matches_mlx_dequantize_bit_for_bit(
    case: tuple[npt.NDArray[Any], str, int, int],
) -> None:
    """The CPU decode of byte-filling widths (``affine.byte_decoded``) returns the raw bytes
    ``mx.dequantize`` does (NaN patterns and signed zeros included); other widths are not
    its to decode."""
    x, _, group_size, bits = case
    xm = to_mx(x if x.ndim > 1 else x[None])
    packed, scales, biases = mx.quantize(xm, group_size=group_size, bits=bits, mode="affine")
    want = mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits, mode="affine")
    if bits not in affine.BYTE_WIDTHS:
        return
    got = affine.byte_decoded(packed, scales, biases, group_size, bits)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert raw(to_np(got)) == raw(to_np(want))


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_the_cpu_decode_takes_the_byte_path(bits: int, call_log: CallLog) -> None:
    """Dispatch: on the CPU, ``AffineCodec.decode`` of 2, 4 and 8 bits goes through
    ``byte_decoded``; 3, 5 and 6 bits (codes straddling bytes) through ``mx.dequantize``."""
    call_log.watch(affine, "byte_decoded")
    codec = affine.AffineCodec(Affine(bits=bits, group_size=64))
    x = mx.random.normal((2, 1, 3, 128), key=mx.random.key(bits)).astype(mx.bfloat16)
    packed, scales, biases = planes = codec.encode(x)
    got = codec.decode(planes)
    want = mx.dequantize(packed, scales, biases, group_size=64, bits=bits, mode="affine")
    assert call_log.names == (["byte_decoded"] if bits in (2, 4, 8) else [])
    assert raw(to_np(got)) == raw(to_np(want))


@settings(max_examples=60, deadline=None)
@given(cases())
def test_optimized_matches_reference(case: tuple[npt.NDArray[Any], str, int, int]) -> None:
    x, _, group_size, bits = case
    packed, scales, biases = opt.quantize(to_mx(x), group_size, bits)
    r_packed, r_scales, r_biases = ref.quantize(x, group_size, bits)
    assert raw(to_np(packed)) == raw(r_packed)
    assert raw(to_np(scales)) == raw(r_scales)
    assert raw(to_np(biases)) == raw(r_biases)
    deq = opt.dequantize(packed, scales, biases, group_size, bits)
    assert raw(to_np(deq)) == raw(ref.dequantize(r_packed, r_scales, r_biases, group_size, bits))


@settings(max_examples=40, deadline=None)
@given(cases(), st.data())
def test_slicing_tokens_commutes_with_quantize(
    case: tuple[npt.NDArray[Any], str, int, int], data: st.DataObject
) -> None:
    x, _, group_size, bits = case
    x = np.stack([x, x[..., ::-1], np.negative(x)])  # a token axis of 3
    lo = data.draw(st.integers(0, 2))
    hi = data.draw(st.integers(lo + 1, 3))
    whole = ref.quantize(x, group_size, bits)
    part = ref.quantize(x[lo:hi], group_size, bits)
    mx_part = opt.quantize(to_mx(x)[lo:hi], group_size, bits)
    for w, p, m in zip(whole, part, mx_part, strict=True):
        assert raw(w[lo:hi]) == raw(p) == raw(to_np(m))


# ---------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("group_size", SUPPORTED_GROUP_SIZES)
def test_packing_is_an_lsb_first_bitstream(bits: int, group_size: int) -> None:
    """Codes ``n - v`` from values ``v`` with min 0 and max n in every group (then the edge is
    n, scale = -1, bias = n exactly); the packed words must be the LSB-first bitstream of the
    codes, built here with Python integers. For 3, 5, 6 bits codes straddle word boundaries."""
    n = (1 << bits) - 1
    head_dim = 256
    rng = np.random.default_rng(bits * 1000 + group_size)
    codes = rng.integers(0, n + 1, (2, head_dim))
    codes[:, ::group_size] = 0
    codes[:, 1::group_size] = n
    x = (n - codes).astype(np.float32)

    stream = [sum(int(c) << (j * bits) for j, c in enumerate(row)) for row in codes]
    width = head_dim * bits // 32
    expected = np.array(
        [[(s >> (32 * i)) & 0xFFFFFFFF for i in range(width)] for s in stream], dtype=np.uint32
    )
    packed, scales, biases = ref.quantize(x, group_size, bits)
    mx_packed, *_ = mlx_codec(x, group_size, bits)
    assert np.array_equal(packed, expected)
    assert np.array_equal(mx_packed, expected)
    assert np.array_equal(unpack_codes(packed, bits), codes)
    assert np.all(scales == -1.0) and np.all(biases == n)


@pytest.mark.parametrize(("head_dim", "bits"), [(128, 5), (128, 6), (256, 3), (256, 5), (256, 6)])
def test_packed_width_is_not_mlx_lm_formula(head_dim: int, bits: int) -> None:
    """mlx-lm sizes buffers as ``D // (32 // bits)``; the true width is ``D * bits / 32``."""
    width = ref.packed_width(head_dim, bits)
    assert width == head_dim * bits // 32
    assert width != head_dim // (32 // bits)
    x = np.ones((1, head_dim), np.float32)
    assert ref.quantize(x, 64, bits)[0].shape == (1, width)
    assert mx.quantize(mx.array(x), group_size=64, bits=bits)[0].shape == (1, width)
    assert opt.packed_width(head_dim, bits) == width


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_geometry(bits: int, head_dim: int) -> None:
    assert ref.packed_width(head_dim, bits) * 32 == head_dim * bits
    if 32 % bits == 0:  # where bits divides 32, mlx-lm's formula happens to agree
        assert ref.packed_width(head_dim, bits) == head_dim // (32 // bits)
    for g in SUPPORTED_GROUP_SIZES:
        if head_dim % g == 0:
            assert ref.groups(head_dim, g) == head_dim // g
            ref.validate_codec(head_dim, g, bits)


# ---------------------------------------------------------------------------- accuracy


@settings(max_examples=200, deadline=None)
@given(cases(kinds=("normal", "offset", "constant", "zeros", "huge", "tiny", "ties", "bits")))
def test_round_trip_error_bound(case: tuple[npt.NDArray[Any], str, int, int]) -> None:
    """|dequantize(quantize(x)) - x| <= k*|scale| + rounding, per element of a finite group.

    Write s for the float32 scale MLX computes and ŝ = T(s) for the stored one, b = edge (an
    input value, stored exactly), p = (w - b)/s in [0, P] and q = clip(rint(p), 0, n).

    * Code choice: |q - p| <= 1/2 when q < n. At q = n the far extreme may be clipped: with
      e = |edge|/s0 >= n/2 (the edge is the larger-magnitude extreme, so the range is at most
      2|edge|) and |q0| <= e + 1/2, P = n|q0|/e <= n + 1, so |q - p| <= 1 -- a FULL step, not
      half (see test_clipping_can_cost_a_full_step). k = 1/2 for q < n, 1 for q = n, plus
      2**-12 for the float32 evaluation of p (relative error ~3 * 2**-24 on p <= 256).
    * Scale rounding: |s| <= |ŝ| + ulp(ŝ)/2 and q|ŝ - s| <= n * ulp(ŝ)/2.
    * Product rounding: |T(q ŝ) - q ŝ| <= ulp(T(q ŝ))/2 (round to nearest; the spacing at the
      result bounds the error even when it rounds up to a power of two).
    * Sum rounding: float32 sum then T is one correct rounding (24 >= 2p + 2 for p = 8, 11),
      so |ŵ - (T(q ŝ) + b)| <= ulp(ŵ)/2.
    Sum: (k + 2**-12)(|ŝ| + ulp(ŝ)/2) + n ulp(ŝ)/2 + ulp(T(q ŝ))/2 + ulp(ŵ)/2.

    Skipped: groups that are not all finite, and groups whose range exceeds half the max of
    T, where MLX's arithmetic overflows although the input is finite: the float32 range
    (float32/bfloat16 near the max: scale = inf, dequantized NaN) or, in float16, the product
    T(q ŝ) (dequantized -inf/+inf). Otherwise q|s| <= range + |s| <= max(T), nothing overflows.
    """
    x, dtype, group_size, bits = case
    t = NP_DTYPES[dtype]
    n = (1 << bits) - 1
    packed, scales, biases = ref.quantize(x, group_size, bits)
    deq = ref.dequantize(packed, scales, biases, group_size, bits)

    g_shape = (*x.shape[:-1], x.shape[-1] // group_size, group_size)
    q = unpack_codes(packed, bits).reshape(g_shape)
    with np.errstate(all="ignore"):
        w = x.astype(np.float64).reshape(g_shape)
        w_hat = deq.astype(np.float64).reshape(g_shape)
        s_hat = scales.astype(np.float64)[..., None]
        span = w.max(axis=-1) - w.min(axis=-1)
        # T(q ŝ) as MLX computes it: a float32 product rounded to T
        prod = (q.astype(np.float32) * scales.astype(np.float32)[..., None]).astype(t)
        prod = prod.astype(np.float64)
    ok = np.all(np.isfinite(w), axis=-1) & (span <= float(finfo(t).max) / 2)

    k = np.where(q == n, 1.0, 0.5) + 2.0**-12
    with np.errstate(invalid="ignore"):  # inf/NaN only in the skipped groups
        bound = (
            k * (np.abs(s_hat) + ulp(s_hat, t) / 2)
            + n * ulp(s_hat, t) / 2
            + ulp(prod, t) / 2
            + ulp(w_hat, t) / 2
        )
        err = np.abs(w_hat - w)
    ok_elems = np.broadcast_to(ok[..., None], err.shape)
    assert np.all(np.isfinite(w_hat[ok_elems]))
    assert np.all(err[ok_elems] <= bound[ok_elems]), float(np.max((err - bound)[ok_elems]))


def test_clipping_can_cost_a_full_step() -> None:
    """A symmetric group [-7.5, 7.5] at 4 bits: s0 = 1, q0 = rint(-7.5) = -8 (ties to even),
    scale = 7.5 / -8 = -0.9375 so -7.5 sits at code 16, clipped to 15: error = |scale|."""
    x = np.linspace(-7.5, 7.5, 32, dtype=np.float32)[None]
    packed, scales, biases = ref.quantize(x, 32, 4)
    deq = ref.dequantize(packed, scales, biases, 32, 4)
    assert scales[0, 0] == -0.9375 and biases[0, 0] == 7.5
    assert abs(float(deq[0, 0]) - float(x[0, 0])) == 0.9375
    assert raw(deq) == raw(mlx_codec(x, 32, 4)[3])


# ---------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("dtype", sorted(NP_DTYPES))
@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_documented_edge_cases(dtype: str, bits: int) -> None:
    t = NP_DTYPES[dtype]
    rows = np.zeros((6, 64))
    rows[0] = 0.75  # constant: reproduced exactly
    rows[1] = 0.0  # zeros: scale -1e-7, bias 0
    rows[2, 5] = np.nan  # a NaN among zeros: ignored by min/max, code 0 -> the edge value
    rows[3] = np.nan  # all NaN: scale NaN, bias -inf
    rows[4, 7] = np.inf  # inf: scale NaN, bias inf, whole group NaN
    rows[5] = np.linspace(-1, 1, 64) * float(finfo(t).max)  # both signs near the max
    x = rows.astype(t)
    packed, scales, biases = ref.quantize(x, 64, bits)
    deq = ref.dequantize(packed, scales, biases, 64, bits).astype(np.float64)
    s, b = scales.astype(np.float64)[:, 0], biases.astype(np.float64)[:, 0]

    assert np.all(deq[0] == 0.75) and b[0] == 0.75
    assert s[1] == np.float32(-1e-7).astype(t) and b[1] == 0 and np.all(deq[1] == 0)
    assert np.all(packed[2] == 0) and b[2] == 0 and np.all(deq[2] == 0)
    assert np.isnan(s[3]) and b[3] == -np.inf and np.all(np.isnan(deq[3]))
    assert np.isnan(s[4]) and b[4] == np.inf and np.all(np.isnan(deq[4]))
    if dtype == "float16":  # the float32 range is finite, but q*scale overflows float16
        assert np.isfinite(s[5]) and b[5] == 65504 and deq[5, 0] == -np.inf
    else:  # the range overflows float32: scale = +-inf, bias 0, dequantized 0*inf = NaN
        assert np.isinf(s[5]) and b[5] == 0 and np.all(np.isnan(deq[5]))
    mx_packed, mx_scales, mx_biases, mx_deq = mlx_codec(x, 64, bits)
    assert raw(packed) == raw(mx_packed)
    assert raw(scales) == raw(mx_scales)
    assert raw(biases) == raw(mx_biases)
    assert raw(ref.dequantize(packed, scales, biases, 64, bits)) == raw(mx_deq)


def test_one_dimensional_head() -> None:
    x = np.random.default_rng(0).standard_normal(128).astype(np.float32)
    packed, scales, biases = ref.quantize(x, 64, 4)
    assert packed.shape == (16,) and scales.shape == biases.shape == (2,)
    o_packed, o_scales, o_biases = opt.quantize(mx.array(x), 64, 4)
    assert raw(to_np(o_packed)) == raw(packed)
    deq = opt.dequantize(o_packed, o_scales, o_biases, 64, 4)
    assert raw(to_np(deq)) == raw(ref.dequantize(packed, scales, biases, 64, 4))


# ---------------------------------------------------------------------------- validation

BAD_CODECS = [
    (64, 64, 1),
    (64, 64, 7),
    (64, 64, 16),
    (64, 64, 0),
    (64, 16, 4),
    (64, 48, 4),
    (256, 256, 4),
    (96, 64, 4),
    (48, 32, 4),
    (0, 32, 4),
    (-64, 64, 4),
]


@pytest.mark.parametrize(("head_dim", "group_size", "bits"), BAD_CODECS)
def test_bad_codec_raises(head_dim: int, group_size: int, bits: int) -> None:
    with pytest.raises(InvalidInputError):
        ref.validate_codec(head_dim, group_size, bits)
    if head_dim > 0:
        x = np.zeros((2, head_dim), np.float32)
        with pytest.raises(InvalidInputError):
            ref.quantize(x, group_size, bits)
        with pytest.raises(InvalidInputError):
            opt.quantize(mx.array(x), group_size, bits)


@pytest.mark.parametrize("value", [4.0, "4", True, None])
def test_non_int_parameters_raise(value: Any) -> None:
    with pytest.raises(InvalidInputError):
        ref.validate_codec(64, 64, value)
    with pytest.raises(InvalidInputError):
        ref.validate_codec(64, value, 4)
    with pytest.raises(InvalidInputError):
        ref.validate_codec(value, 64, 4)


def test_bad_arrays_raise() -> None:
    x = np.zeros((2, 64), np.float32)
    packed, scales, biases = ref.quantize(x, 64, 4)
    with pytest.raises(InvalidInputError):
        ref.quantize(x.astype(np.float64), 64, 4)
    with pytest.raises(InvalidInputError):
        ref.quantize(np.zeros((2, 64), np.int32), 64, 4)
    with pytest.raises(InvalidInputError):
        opt.quantize(mx.zeros((2, 64), mx.int32), 64, 4)
    with pytest.raises(InvalidInputError):
        ref.dequantize(packed, scales, biases, 64, 8)  # width 8 words is 4 bits, not 8
    with pytest.raises(InvalidInputError):
        ref.dequantize(packed, scales, biases.astype(np.float16), 64, 4)
    with pytest.raises(InvalidInputError):
        ref.dequantize(packed[:1], scales, biases, 64, 4)
    with pytest.raises(InvalidInputError):
        ref.dequantize(packed.astype(np.int32), scales, biases, 64, 4)
    with pytest.raises(InvalidInputError):
        ref.dequantize(packed, scales, biases, 48, 4)
    m_packed, m_scales, m_biases = opt.quantize(mx.array(x), 64, 4)
    with pytest.raises(InvalidInputError):
        opt.dequantize(m_packed, m_scales, m_biases, 64, 8)
    with pytest.raises(InvalidInputError):
        opt.dequantize(m_packed, m_scales, m_biases, 32, 4)
    with pytest.raises(InvalidInputError):
        opt.dequantize(m_packed, m_scales, m_biases.astype(mx.float16), 64, 4)
