"""Attention over encoded planes on the CPU, in NumPy (``spec/host-attention.md``): every
codec's host path and its MLX-op path against the reference's attention, the host code
lookup against MLX's unpacking, and the dispatch (which path a call took)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from dispatch_helpers import CallLog
from hypothesis import given
from hypothesis import strategies as st

from kvrows.codecs import parse_codec
from kvrows.errors import InvalidInputError
from kvrows.optimized import turbo_codec
from kvrows.optimized.codecs import affine, host_attention
from kvrows.optimized.codecs import make_codec as optimized_codec
from kvrows.optimized.host import (
    CODES_PER_LOOKUP,
    E4M3_BIAS_SHIFT,
    PlacedE4m3,
    code_runs,
    e4m3_floats,
    e8m0_scales,
    host_fields,
    lookup_codes,
)
from kvrows.reference.codecs import make_codec as reference_codec

#: Every encoded codec family with attention on its planes, at the widths that differ in
#: how the host reads them (bytes, byte pairs, cross-byte fields; FP4, FP8; 8-bit keys).
CODECS = (
    "affine2:32", "affine3:64", "affine4:64", "affine5:32", "affine6:128", "affine8:64",
    "mxfp4", "nvfp4", "mxfp8", "turbo:k8v3", "turbo:k4v2", "turbo:k5v4", "turbo:k2v8",
    "turbo:k8v5",
)  # fmt: skip
DIM = 128


def _mask(kind: str, rng: np.random.Generator, batch: int, n: int, columns: int) -> Any:
    if kind == "none":
        return None
    if kind == "causal":
        return "causal"
    shape = (batch, 1, n, columns) if kind == "rows" else (n, columns)
    visible = rng.random(shape) < 0.7
    visible[..., -1] = True  # every query sees one column at least
    return visible


@given(
    name=st.sampled_from(CODECS),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 2),
    repeat=st.sampled_from((1, 2, 4)),
    n=st.integers(1, 3),
    extra=st.integers(0, 9),
    start=st.integers(0, 3),
    mask_kind=st.sampled_from(("none", "causal", "rows", "shared")),
    row_chunks=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_host_and_op_paths_agree_with_the_reference(
    name: str,
    batch: int,
    kv_heads: int,
    repeat: int,
    n: int,
    extra: int,
    start: int,
    mask_kind: str,
    row_chunks: bool,
    seed: int,
) -> None:
    """Both paths of every encoded codec's attention (the host's a row chunk at a time, or
    one row per chunk and one query per slice) over strided reads of longer planes, GQA and every mask form, equal
    the reference's float32 attention over the same planes within float32 rounding."""
    rng = np.random.default_rng(seed)
    columns = n + extra
    spec = parse_codec(name)
    fast, oracle = optimized_codec(spec), reference_codec(spec)
    shape = (batch + 1, kv_heads, start + columns + 2, DIM)
    keys = rng.standard_normal(shape).astype(np.float32)
    values = rng.standard_normal(shape).astype(np.float32)
    queries = rng.standard_normal((batch, kv_heads * repeat, n, DIM)).astype(np.float32)
    mask = _mask(mask_kind, rng, batch, n, columns)

    def read(planes: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
        # A read is a slice of a longer buffer: rows and columns both strided.
        return tuple(p[:batch, :, start : start + columns] for p in planes)

    key_planes = read(fast.encode(mx.array(keys), "keys"))
    value_planes = read(fast.encode(mx.array(values), "values"))
    mlx_mask = mask if mask is None or isinstance(mask, str) else mx.array(mask)
    with pytest.MonkeyPatch.context() as patch:
        if row_chunks:  # one row a chunk, one query a slice
            patch.setattr(host_attention, "CHUNK_BYTES", 1)
            patch.setattr(host_attention, "SCORES_BYTES", 1)
        host = np.array(fast.attend(mx.array(queries), key_planes, value_planes, mlx_mask, 0.1))
    with host_attention.op_attention():
        ops = np.array(fast.attend(mx.array(queries), key_planes, value_planes, mlx_mask, 0.1))
    want = oracle.attend(
        queries,
        tuple(np.array(p) for p in key_planes),
        tuple(np.array(p) for p in value_planes),
        mask,
        0.1,
    )
    assert host.shape == want.shape == (batch, kv_heads * repeat, n, DIM)
    np.testing.assert_allclose(host, want, atol=2e-5, rtol=1e-4)
    # quantized_matmul sums in its own order: coarser on the CPU than NumPy's float32 BLAS.
    np.testing.assert_allclose(ops, want, atol=1e-3, rtol=1e-3)


@given(
    name=st.sampled_from(CODECS),
    tokens=st.integers(1, 300),
    trailing=st.integers(1, 200),
    n=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_query_attends_alike_whatever_follows_its_span(
    name: str, tokens: int, trailing: int, n: int, seed: int
) -> None:
    """A block's queries over their own columns (causal) give the same bits as the same
    queries inside a wider read whose later columns they cannot see (a longer chunk
    around a reused prefix, a shorter row in a ragged batch), and a block's queries under
    a sliding window the bits of each alone over its window: the columns outside a
    query's span are neither scored nor summed. Lengths reach NumPy's pairwise blocks
    (128) and BLAS's tails."""
    rng = np.random.default_rng(seed)
    codec = optimized_codec(parse_codec(name))
    width = tokens + trailing
    kv = mx.array(rng.standard_normal((1, 2, width, DIM)).astype(np.float32))
    keys, values = codec.encode(kv, "keys"), codec.encode(kv, "values")
    queries = mx.array(rng.standard_normal((1, 4, n, DIM)).astype(np.float32))
    n = min(n, tokens)
    queries = queries[:, :, :n]
    own = tuple(p[:, :, :tokens] for p in keys), tuple(p[:, :, :tokens] for p in values)
    alone = codec.attend(queries, *own, "causal", 0.1)
    mask = np.zeros((1, 1, n, width), dtype=bool)
    for i in range(n):
        mask[0, 0, i, : tokens - n + i + 1] = True
    wider = codec.attend(queries, keys, values, mx.array(mask), 0.1)
    assert np.array(alone).tobytes() == np.array(wider).tobytes()
    # A sliding window: each query of the block alone over its own window, the same bits.
    window = max(1, tokens // 2)
    for i in range(n):
        end = tokens - n + i + 1
        mask[0, 0, i] = False
        mask[0, 0, i, max(0, end - window) : end] = True
    windowed = np.array(codec.attend(queries, keys, values, mx.array(mask), 0.1))
    for i in range(n):
        end = tokens - n + i + 1
        cut = slice(max(0, end - window), end)
        own = tuple(p[:, :, cut] for p in keys), tuple(p[:, :, cut] for p in values)
        single = np.array(codec.attend(queries[:, :, i : i + 1], *own, None, 0.1))
        assert windowed[:, :, i : i + 1].tobytes() == single.tobytes(), i


@given(
    name=st.sampled_from(CODECS),
    pads=st.lists(st.integers(0, 9), min_size=1, max_size=3),
    tokens=st.integers(1, 12),
    n=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_left_padded_row_attends_as_it_does_alone(
    name: str, pads: list[int], tokens: int, n: int, seed: int
) -> None:
    """Batch invariance on the host path: a row behind left padding (columns holding other
    codes, hidden from its every query) gets the bits it gets alone, whatever the other
    rows hold."""
    rng = np.random.default_rng(seed)
    codec = optimized_codec(parse_codec(name))
    width = max(pads) + tokens + n
    batch = len(pads)
    keys = rng.standard_normal((batch, 2, width, DIM)).astype(np.float32)
    values = rng.standard_normal((batch, 2, width, DIM)).astype(np.float32)
    queries = mx.array(rng.standard_normal((batch, 4, n, DIM)).astype(np.float32))
    key_planes, value_planes = (
        codec.encode(mx.array(keys)),
        codec.encode(mx.array(values), "values"),
    )
    column = np.arange(width)[None, :]
    own = np.arange(n)[:, None] + width - n  # each query's own column
    # Row b holds ``width - pads[b]`` tokens (at least ``tokens``) after its padding.
    visible = np.stack([(column >= pad) & (column <= own) for pad in pads])
    out = np.array(codec.attend(queries, key_planes, value_planes, mx.array(visible[:, None]), 0.1))
    for b, pad in enumerate(pads):
        cut = pad
        solo = np.array(codec.attend(
            queries[b : b + 1],
            tuple(p[b : b + 1, :, cut:] for p in key_planes),
            tuple(p[b : b + 1, :, cut:] for p in value_planes),
            "causal", 0.1,
        ))  # fmt: skip
        assert out[b : b + 1].tobytes() == solo.tobytes(), (b, pad)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_output_has_the_queries_dtype(dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(1)
    for name in ("affine4:64", "mxfp8", "turbo:k8v3"):
        codec = optimized_codec(parse_codec(name))
        kv = mx.array(rng.standard_normal((2, 2, 5, DIM)).astype(np.float32))
        q = mx.array(rng.standard_normal((2, 4, 1, DIM)).astype(np.float32)).astype(dtype)
        out = codec.attend(q, codec.encode(kv, "keys"), codec.encode(kv, "values"), None, 0.1)
        assert out.dtype == dtype and out.shape == (2, 4, 1, DIM)


@pytest.mark.parametrize("bits", sorted(CODES_PER_LOOKUP))
@given(seed=st.integers(0, 2**32 - 1), runs=st.integers(1, 6), rows=st.integers(1, 3))
def test_the_host_lookup_reads_the_codes_mlx_packs(
    bits: int, seed: int, runs: int, rows: int
) -> None:
    """``lookup_codes`` of a stream MLX packed (the TurboQuant bitstream, which is MLX's
    affine packing) gives each code's level, and ``host_fields`` each field's codes, exactly;
    on strided rows too."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 2**bits, (rows, 2, 8 * runs), dtype=np.uint8)
    stream = np.array(turbo_codec.pack_codes(mx.array(codes), bits))[::-1]
    codes = codes[::-1]
    levels = rng.standard_normal(2**bits).astype(np.float32)
    looked_up = lookup_codes(stream, bits, code_runs(levels, bits))
    assert looked_up.dtype == np.float32 and looked_up.tobytes() == levels[codes].tobytes()
    fields = host_fields(stream, bits, bits)
    assert fields.shape == codes.shape and np.array_equal(fields, codes)


@given(pairs=st.lists(st.tuples(st.integers(0, 255), st.integers(0, 255)), min_size=1))
def test_placed_e4m3_bits_are_the_e4m3_levels(pairs: list[tuple[int, int]]) -> None:
    """Every E4M3 code placed in float32 bits reads as its level (ml_dtypes' E4M3) times
    ``2**-120``, subnormals and zeros included; a chunk holding a NaN code (0x7F, 0xFF)
    reads every level right, the NaNs as NaN."""
    import ml_dtypes

    stream = np.array(pairs, dtype=np.uint8).reshape(-1)  # a plane's rows hold code pairs
    levels = stream.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    runs = code_runs(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn), 8)
    every = np.arange(256, dtype=np.uint8)
    out = np.full(stream.shape, np.float32(7.0))
    PlacedE4m3(runs).levels(stream, out)
    assert np.array_equal(out * np.float32(2.0**E4M3_BIAS_SHIFT), levels, equal_nan=True)
    finite = every[(every & 0x7F) != 0x7F]  # every code but the NaNs: the placement alone
    placed = np.empty(finite.shape, dtype=np.float32)
    PlacedE4m3(runs).levels(finite, placed)
    expected = finite.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert (placed * np.float32(2.0**E4M3_BIAS_SHIFT)).tobytes() == expected.tobytes()


def test_scale_bytes_read_as_ml_dtypes_reads_them() -> None:
    """Every E8M0 and E4M3 scale byte (NaN and the subnormals included) as float32, bit for
    bit ml_dtypes' cast, in any shape."""
    import ml_dtypes

    every = np.arange(256, dtype=np.uint8).reshape(4, 8, 8)
    e8m0 = every.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    assert np.array_equal(e8m0_scales(every), e8m0, equal_nan=True)
    assert e8m0_scales(every).tobytes() == e8m0.tobytes()  # (2**-127: a subnormal)
    runs = code_runs(every.reshape(-1).view(ml_dtypes.float8_e4m3fn), 8)
    e4m3 = every.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    assert np.array_equal(e4m3_floats(every, runs), e4m3, equal_nan=True)
    finite = every[(every & 0x7F) != 0x7F]
    assert e4m3_floats(finite, runs).tobytes() == e4m3[(every & 0x7F) != 0x7F].tobytes()
    assert e8m0_scales(every[:0]).shape == (0, 8, 8)


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_the_fp4_host_decodes_are_mlx_dequantize(mode: str) -> None:
    """mxfp4 and nvfp4 decoded on the host (their scales placed in float32 bits) give
    ``mx.dequantize``'s float32s bit for bit."""
    group = 16 if mode == "nvfp4" else 32
    rng = np.random.default_rng(12)
    kv = mx.array((rng.standard_normal((2, 2, 9, DIM)) * 3).astype(np.float32))
    codes, scales, *_ = mx.quantize(kv, group_size=group, bits=4, mode=mode)
    expected = mx.dequantize(codes, scales, group_size=group, bits=4, mode=mode, dtype=mx.float32)
    decoded = affine._host_rows((codes, scales), group, 4, mode, "test")(0, 2, 0)
    assert decoded.tobytes() == np.array(expected).tobytes()


@pytest.mark.parametrize("magnitude", [1.0, 2.0**-20, 2.0**20])
def test_the_mxfp8_host_decode_is_mlx_dequantize(magnitude: float, call_log: CallLog) -> None:
    """The mxfp8 host decoder gives ``mx.dequantize``'s float32s bit for bit: by bit
    placement where the E8M0 scales can carry ``2**120`` (small and tiny values), by the
    table where one cannot (values past ``2**16``)."""
    call_log.watch(PlacedE4m3, "levels")
    rng = np.random.default_rng(11)
    kv = mx.array((rng.standard_normal((2, 2, 9, DIM)) * magnitude).astype(np.float32))
    codes, scales, *_ = mx.quantize(kv, group_size=32, bits=8, mode="mxfp8")
    expected = mx.dequantize(codes, scales, group_size=32, bits=8, mode="mxfp8", dtype=mx.float32)
    decoded = affine._host_rows((codes, scales), 32, 8, "mxfp8", "test")(0, 2, 0)
    assert decoded.tobytes() == np.array(expected).tobytes()
    assert call_log.names == ([] if magnitude > 2.0**16 else ["levels"])


def test_mlx_affine_packing_is_the_little_endian_stream() -> None:
    """The host reads affine codes as TurboQuant's little-endian bitstream: MLX's packing of
    every width is that stream (its dequantize of known codes round-trips the lookup)."""
    rng = np.random.default_rng(5)
    for bits in (2, 3, 4, 5, 6, 8):
        codes = rng.integers(0, 2**bits, (3, 64), dtype=np.uint8)
        stream = np.array(turbo_codec.pack_codes(mx.array(codes), bits))
        packed = mx.array(stream.view(np.uint32))
        ones, zeros = mx.ones((3, 2), dtype=mx.float32), mx.zeros((3, 2), dtype=mx.float32)
        plain = mx.dequantize(packed, ones, zeros, group_size=32, bits=bits)
        assert np.array_equal(np.array(plain), codes.astype(np.float32)), bits


def test_the_cpu_takes_the_host_path_and_op_attention_the_mlx_ops(call_log: CallLog) -> None:
    """The dispatch: on the CPU every encoded codec attends in NumPy (no
    ``quantized_matmul``, no decoded MLX copy); inside ``op_attention`` it scores on the
    codes with ``quantized_matmul``, as on every other backend."""
    call_log.watch(mx, "quantized_matmul")
    call_log.watch(mx, "dequantize")
    call_log.watch(turbo_codec, "rotated_values")
    for module in ("affine", "turbo"):
        call_log.watch(__import__(f"kvrows.optimized.codecs.{module}", fromlist=["_"]),
                       "host_attention")  # fmt: skip
    rng = np.random.default_rng(2)
    kv = mx.array(rng.standard_normal((2, 2, 7, DIM)).astype(np.float32))
    q = mx.array(rng.standard_normal((2, 4, 1, DIM)).astype(np.float32))
    for name in ("affine4:64", "mxfp4", "mxfp8", "turbo:k8v3"):
        codec = optimized_codec(parse_codec(name))
        planes = codec.encode(kv, "keys"), codec.encode(kv, "values")
        with mx.stream(mx.cpu):
            codec.attend(q, *planes, "causal", 0.1)
            assert call_log.names == ["host_attention"], name
            call_log.names.clear()
            with host_attention.op_attention():
                codec.attend(q, *planes, "causal", 0.1)
        ops = ["quantized_matmul"] * (1 if name.startswith("turbo") else 2)
        assert call_log.names == ops + (["rotated_values"] if name.startswith("turbo") else [])
        call_log.names.clear()


def test_bad_inputs_raise() -> None:
    codec = optimized_codec(parse_codec("affine4:64"))
    kv = mx.zeros((1, 2, 3, DIM))
    planes = codec.encode(kv, "keys"), codec.encode(kv, "values")
    with pytest.raises(InvalidInputError, match="heads"):
        codec.attend(mx.zeros((1, 3, 1, DIM)), *planes, None, 0.1)
    with pytest.raises(InvalidInputError, match="boolean"):
        codec.attend(mx.zeros((1, 2, 1, DIM)), *planes, mx.zeros((1, 3)), 0.1)


def test_no_rows_attend_to_no_output() -> None:
    codec: Any = optimized_codec(parse_codec("affine4:64"))
    keys, values = (codec.zeros(0, 2, 3, DIM, "float32", role) for role in ("keys", "values"))
    out = codec.attend(mx.zeros((0, 4, 1, DIM)), keys, values, None, 0.1)
    assert out.shape == (0, 4, 1, DIM)
