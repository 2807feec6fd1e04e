"""Benchmarks of the affine family (issue 3): quantize, row operations, decode attention.

Shared by ``kvrows bench --family affine`` and
``benchmarks/test_bench_affine.py``; built on :mod:`kvrows.app.bench.plain` (its workloads,
copy/memcpy baselines and result checks).

Three parts, one layer, 8 KV heads, head dim 128, group size 64, 8 and 4 bits:

* ``quantize``: throughput of ``kvrows.reference.affine_codec.quantize`` (NumPy),
  ``kvrows.optimized.affine_codec.quantize`` and bare ``mx.quantize`` on a float16
  ``[16, 8, 4096, 128]`` array; GB/s of input read. The NumPy reference runs on the
  first row only (``[1, 8, 4096, 128]``, :data:`REFERENCE_QUANTIZE_ROWS`): at about
  15 MB/s the whole array would take 9 s a call. Check: every result, unpacked
  independently here, reconstructs its input within half a quantization step (plus
  the rounding of scales and biases to float16).
* ``rows``: ``merge``, ``join``, ``filter-half``, ``filter-one``, ``extract`` and
  ``update`` (the operations of :mod:`kvrows.app.bench.plain`, same definitions) performed by
  ``kvrows.optimized.PaddedQuantKVRows`` over bfloat16 activations, against the plain
  ``PaddedKVRows`` doing the same on the same data, and against an MLX copy and a
  ``numpy.copyto`` of the *quantized* bytes. Bytes moved count the quantized planes
  (codes, scales and biases): ``T = 2·H·(D·bits/8 + 2·2·D/group)`` bytes per token
  instead of ``2·H·D·2``. Check: every row holds exactly ``mx.quantize`` of its
  generated tokens (codes, scales and biases, byte for byte).
* ``attention``: one decode step's attention at ``B = 16``, ``L = 4096`` (ragged rows,
  ``L`` down to ``L/2``, so a padding mask applies), 32 query heads over 8 KV heads:
  ``kvrows.optimized.attend`` on a ``PaddedKVRows`` (bf16: ``mx.fast`` SDPA) and on
  a ``PaddedQuantKVRows`` at 8 and 4 bits (``mx.quantized_matmul``), and, side by
  side, mlx-lm's own kernels on the same planes (``mx.fast.scaled_dot_product_attention``
  for bf16, ``mlx_lm.models.base.quantized_scaled_dot_product_attention`` for affine;
  it scales its queries in place, so it gets a copy). Timed: attention alone, on a
  live batch after its ``make_mask(1)`` and ``update_and_fetch``. Bytes read: the K and
  V planes over the layout's width, scales and biases included. Check: the output
  against a float32 NumPy attention over the dequantized (``mx.dequantize``) tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

import kvrows.optimized as optimized
from kvrows.app.bench.plain import BenchData, KvrowsImpl, Shape, ShapeBench
from kvrows.app.bench.runner import (
    NP,
    BenchCheckError,
    Case,
    Family,
    Line,
    Table,
    Timing,
    Workload,
    check_equal,
    format_gbps,
    ratio,
    to_numpy,
)
from kvrows.app.bench.turbo import DecodeBench
from kvrows.optimized import affine_codec as optimized_codec
from kvrows.reference import affine_codec as reference_codec

__all__ = [
    "AFFINE_BITS",
    "AFFINE_OPERATIONS",
    "ATTENTION_IMPLEMENTATIONS",
    "ATTENTION_STORAGES",
    "CI_AFFINE",
    "FULL_AFFINE",
    "QUANTIZE_IMPLEMENTATIONS",
    "AffineShapeBench",
    "AffineShapes",
    "AttentionBench",
    "QuantizeBench",
    "family",
]


#: Bit widths benchmarked, in table order.
AFFINE_BITS = (8, 4)
#: Group size of every affine benchmark.
GROUP_SIZE = 64
#: Row operations of the affine table (``kvrows.app.bench.plain`` definitions).
AFFINE_OPERATIONS = ("merge", "join", "filter-half", "filter-one", "extract", "update")
#: Who quantizes.
QUANTIZE_IMPLEMENTATIONS = ("reference", "optimized", "mx.quantize")
#: Storages of the attention table, and who attends over them.
ATTENTION_STORAGES = ("bf16", "8-bit", "4-bit")
ATTENTION_IMPLEMENTATIONS = ("kvrows", "mlx-lm")
#: Largest relative L2 error of a row's attention output against float32 NumPy over the
#: same (dequantized) tokens. bf16 SDPA stays near 0.5%; MLX's CPU ``quantized_matmul``
#: with bfloat16 inputs accumulates in low precision (about 3% at L = 128, 7% at 4096, the
#: same in kvrows and mlx-lm), so the affine rows get a looser bound. A wrong row, order
#: or padding mask is off by 30% to 140%.
ATTENTION_TOLERANCE = {"bf16": 0.02, "8-bit": 0.15, "4-bit": 0.15}
#: Rows of the quantize input the NumPy reference gets (it runs at about 15 MB/s).
REFERENCE_QUANTIZE_ROWS = 1


@dataclass(frozen=True)
class AffineShapes:
    """The shapes of one run: quantize input, row-operation shapes, attention shape."""

    quantize: Shape
    rows: tuple[Shape, ...]
    attention: Shape


#: The realistic shapes of the issue.
FULL_AFFINE = AffineShapes(
    quantize=Shape(16, 4096),
    rows=tuple(Shape(b, t, dtype="bfloat16") for b in (4, 16) for t in (1024, 4096)),
    attention=Shape(16, 4096, dtype="bfloat16"),
)
#: ``kvrows bench --family affine --quick``: a smoke run.
QUICK_AFFINE = AffineShapes(
    quantize=Shape(4, 128),
    rows=(Shape(4, 128, dtype="bfloat16"),),
    attention=Shape(4, 128, dtype="bfloat16"),
)
#: ``benchmarks/`` without ``KVROWS_BENCH_FULL=1``: small, odd sizes.
CI_AFFINE = AffineShapes(
    quantize=Shape(2, 64),
    rows=(Shape(3, 300, dtype="bfloat16"),),
    attention=Shape(3, 200, dtype="bfloat16"),
)


def _bits_of(storage: str) -> int | None:
    return None if storage == "bf16" else int(storage.split("-")[0])


def stored_bytes(planes: Sequence[Any]) -> NP:
    """Affine planes ``(packed, scales, biases)`` as one byte array ``[..., bytes per token]``.

    The codes' bytes, then the scales', then the biases' (NumPy copies): two rows hold
    the same quantized tokens exactly when these arrays are equal.
    """
    parts = [np.ascontiguousarray(to_numpy(p)) for p in planes]
    return np.concatenate([p.view(np.uint8) for p in parts], axis=-1)


def _affine_token_bytes(shape: Shape, bits: int, group_size: int) -> int:
    """Bytes of one token's quantized keys and values (codes + scales + biases)."""
    itemsize = shape.mx_dtype.size
    per_head = shape.head_dim * bits // 8 + 2 * itemsize * (shape.head_dim // group_size)
    return 2 * shape.heads * per_head


def _unpack(packed: NP, bits: int, dim: int) -> NP:
    """Codes ``[..., dim]`` of LSB-first packed uint32 words (bits dividing 32)."""
    if 32 % bits:
        raise ValueError(f"the benchmark check unpacks only bits dividing 32, got {bits}")
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits).astype(np.uint32)
    codes = (packed.astype(np.uint32)[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], per_word * packed.shape[-1])[..., :dim]


def _check_quantized(what: str, x: NP, result: Sequence[Any], bits: int, group: int) -> None:
    """``result`` reconstructs ``x`` within half a step, plus the scale/bias rounding."""
    packed, scales, biases = (to_numpy(p) for p in result)
    dim = x.shape[-1]
    groups = dim // group
    expected = (*x.shape[:-1], groups)
    check_equal(f"{what}: scales shape", tuple(scales.shape), expected)
    check_equal(f"{what}: biases shape", tuple(biases.shape), expected)
    check_equal(f"{what}: packed shape", tuple(packed.shape), (*x.shape[:-1], dim * bits // 32))
    codes = _unpack(packed, bits, dim).astype(np.float32).reshape(*x.shape[:-1], groups, group)
    s = scales.astype(np.float32)[..., None]
    b = biases.astype(np.float32)[..., None]
    w = x.astype(np.float32).reshape(codes.shape)
    error = np.abs(codes * s + b - w)
    # Half a step, or a full step at the top code (the edge lands on the grid, so the far
    # extreme can be clipped: tests/test_affine_codec.py derives this), plus the rounding
    # of the stored float16/bfloat16 scale (times the code) and bias.
    top = (1 << bits) - 1
    step = np.where(codes == top, 1.0, 0.5)
    ulp = 2.0**-8  # relative rounding of bfloat16; float16's is smaller
    bound = np.abs(s) * (step + top * ulp / 2) + ulp / 2 * (np.abs(b) + np.abs(w)) + 1e-6
    if not np.all(error <= bound):
        worst = float(np.max(error - bound))
        raise BenchCheckError(
            f"{what}: dequantized codes miss the input by {worst:.4g} beyond half a step"
        )


# -- quantize -----------------------------------------------------------------------------


class QuantizeBench:
    """Quantize throughput of the reference, the optimized wrapper and bare ``mx.quantize``."""

    def __init__(self, shape: Shape, group_size: int = GROUP_SIZE) -> None:
        self.shape = shape
        self.group_size = group_size
        dims = (shape.batch, shape.heads, shape.tokens, shape.head_dim)
        self.input = mx.random.normal(dims, key=mx.random.key(11)).astype(shape.mx_dtype)
        mx.eval(self.input)
        self.reference_input = to_numpy(self.input[:REFERENCE_QUANTIZE_ROWS])
        self._numpy: NP | None = None

    def input_numpy(self) -> NP:
        if self._numpy is None:
            self._numpy = to_numpy(self.input)
        return self._numpy

    def rows(self, impl: str) -> int:
        """Rows of the input ``impl`` quantizes."""
        return (
            min(REFERENCE_QUANTIZE_ROWS, self.shape.batch)
            if impl == "reference"
            else (self.shape.batch)
        )

    def bytes_read(self, impl: str) -> int:
        s = self.shape
        return self.rows(impl) * s.heads * s.tokens * s.head_dim * s.mx_dtype.size

    def workload(self, impl: str, bits: int) -> Workload:
        group = self.group_size
        if impl == "reference":
            source: Any = self.reference_input

            def run(x: Any) -> Any:
                return reference_codec.quantize(x, group, bits)

            def expected() -> NP:
                return self.reference_input
        elif impl in ("optimized", "mx.quantize"):
            source = self.input
            quantize: Callable[[mx.array], Any] = (
                (lambda x: optimized_codec.quantize(x, group, bits))
                if impl == "optimized"
                else (lambda x: mx.quantize(x, group_size=group, bits=bits, mode="affine"))
            )

            def run(x: Any) -> Any:
                result = quantize(x)
                mx.eval(result)
                return result

            expected = self.input_numpy
        else:
            raise ValueError(f"unknown implementation {impl!r}")

        def check(result: Any) -> None:
            _check_quantized(f"quantize {bits}-bit {impl}", expected(), result, bits, group)

        shape = Shape(self.rows(impl), self.shape.tokens, self.shape.heads, self.shape.head_dim)
        return Workload(
            f"quantize {bits}-bit", impl, shape, self.bytes_read(impl), lambda: source, run, check
        )


# -- row operations -----------------------------------------------------------------------


class _EncodedData(BenchData):
    """Generated inputs shared with a plain bench; ``np(name)`` gives their quantized bytes."""

    def __init__(self, source: BenchData, group_size: int, bits: int) -> None:
        # Same arrays as ``source`` (no new data): only the NumPy view differs.
        self.keys, self.values = source.keys, source.values
        self.join_keys, self.join_values = source.join_keys, source.join_values
        self.step_keys, self.step_values = source.step_keys, source.step_values
        self.queries, self.scale = source.queries, source.scale
        self._source = source
        self._numpy: dict[str, NP] = {}
        self.group_size, self.bits = group_size, bits

    def np(self, name: str) -> NP:
        """``queries`` as generated; keys and values as ``mx.quantize`` stores them (bytes)."""
        if name == "queries":
            return self._source.np(name)
        if name not in self._numpy:
            planes = mx.quantize(
                getattr(self, name), group_size=self.group_size, bits=self.bits, mode="affine"
            )
            self._numpy[name] = stored_bytes(planes)
        return self._numpy[name]


class AffineShapeBench(ShapeBench):
    """The row operations of ``PaddedQuantKVRows`` at one shape and bit width.

    ``data`` shares the generated inputs with a plain :class:`ShapeBench` of the same
    shape, so both layouts move the same tokens.
    """

    operations = AFFINE_OPERATIONS
    implementations = ("affine", "copy", "memcpy")

    def __init__(
        self, shape: Shape, bits: int, group_size: int = GROUP_SIZE, data: BenchData | None = None
    ) -> None:
        self.bits, self.group_size = bits, group_size
        # ``kvrows.optimized``'s ``QuantizedKVCache`` / ``PaddedQuantKVRows``, read back
        # as their stored bytes.
        self.impls = {
            "affine": KvrowsImpl(
                f"affine{bits}",
                make_serial=lambda: optimized.QuantizedKVCache(group_size, bits),
                make_batch=lambda: optimized.PaddedQuantKVRows(group_size, bits),
                planes=stored_bytes,
            )
        }
        source = data if data is not None else BenchData(shape)
        super().__init__(shape, _EncodedData(source, group_size, bits))

    @property
    def token_bytes(self) -> int:
        return _affine_token_bytes(self.shape, self.bits, self.group_size)


# -- decode attention ---------------------------------------------------------------------


class AttentionBench(DecodeBench):
    """One decode step's attention over a live ragged batch, per storage (bf16, 8-bit,
    4-bit: plain and affine schemes) and implementation (kvrows, mlx-lm): the shared
    decode bench of :mod:`kvrows.app.bench.turbo`, every row checked."""

    def __init__(
        self, shape: Shape, group_size: int = GROUP_SIZE, data: BenchData | None = None
    ) -> None:
        schemes = {
            label: "plain" if bits is None else f"affine{bits}:{group_size}"
            for label in ATTENTION_STORAGES
            for bits in [_bits_of(label)]
        }
        super().__init__(
            shape,
            data,
            storages=schemes,
            tolerance=ATTENTION_TOLERANCE,
            all_rows=True,
            op="attention",
        )


NOTES = """\
quantize: GB/s = input bytes read / time. The NumPy reference quantizes only the first
  {ref_rows} row(s) of the input (it runs at ~15 MB/s); optimized = kvrows.optimized.affine_codec
  (validated mx.quantize), mx.quantize = the bare op.
rows: the plain family's operations (live batch = merged + one decode step; filter-half keeps
  the odd rows, filter-one drops row 0, extract takes row B//2, update = make_mask(1) +
  update_and_fetch of one token per row) on bf16 activations, group {group}.
  affine = PaddedQuantKVRows, plain = PaddedKVRows on the same tokens;
  plain/affine = plain ms / affine ms (> 1: the quantized layout is faster).
  MB moved counts the quantized planes (codes + scales + biases), MB plain the bf16 bytes
  of the same operation; copy / memcpy move the quantized bytes (MLX concatenate / numpy.copyto).
attention: one decode step at B={att_b}, L={att_l} (rows L down to ~L/2, padding mask), 32 query
  heads over 8 KV heads; kvrows = kvrows.optimized.attend (bf16: mx.fast SDPA, affine:
  mx.quantized_matmul); mlx-lm = mx.fast.scaled_dot_product_attention (bf16) or
  mlx_lm.models.base.quantized_scaled_dot_product_attention (affine) on the same planes.
  ratio = mlx-lm ms / kvrows ms; MB read = K+V planes over the layout's width, scales and biases
  included; bf16/this = kvrows bf16 ms / this storage's kvrows ms."""


def _quantize_cases(shape: Shape) -> Iterator[Case]:
    bench = QuantizeBench(shape)
    for bits in AFFINE_BITS:
        workloads = {impl: bench.workload(impl, bits) for impl in QUANTIZE_IMPLEMENTATIONS}

        def lines(
            t: Mapping[str, Timing], bits: int = bits, workloads: dict[str, Workload] = workloads
        ) -> list[Line]:
            return [
                {
                    "bits": str(bits),
                    "quantize": impl,
                    "input": f"[{w.shape.batch}, {w.shape.heads}, {w.shape.tokens}, {w.shape.head_dim}]",
                    "ms": t[impl].cell,
                    "MB read": f"{w.bytes_moved / 1e6:.1f}",
                    "GB/s": format_gbps(w.bytes_moved, t[impl].ms),
                }
                for impl, w in workloads.items()
            ]

        yield Case(f"quantize {bits}-bit", workloads, lines, max_repeats={"reference": 3})


def _row_cases(shapes: Sequence[Shape]) -> Iterator[Case]:
    for shape in shapes:
        yield from _shape_row_cases(shape)


def _shape_row_cases(shape: Shape) -> Iterator[Case]:
    """The affine layouts and the plain one on the same tokens, one case per operation."""
    plain = ShapeBench(shape)
    affine = {bits: AffineShapeBench(shape, bits, data=plain.data) for bits in AFFINE_BITS}

    def release() -> None:
        plain.release()
        for bench in affine.values():
            bench.release()

    for op in AFFINE_OPERATIONS:
        workloads = {"plain": plain.workload(op, "kvrows")}
        for bits, bench in affine.items():
            for impl in ("affine", "copy", "memcpy"):
                workloads[f"{impl}{bits}"] = bench.workload(op, impl)

        def lines(t: Mapping[str, Timing], op: str = op) -> list[Line]:
            out = []
            plain_ms, plain_bytes = t["plain"].ms, plain.bytes_moved(op)
            for bits, bench in affine.items():
                moved, affine_ms = bench.bytes_moved(op), t[f"affine{bits}"].ms
                out.append(
                    {
                        "op": op,
                        **shape.cells,
                        "bits": str(bits),
                        "affine ms": t[f"affine{bits}"].cell,
                        "plain ms": t["plain"].cell,
                        "plain/affine": ratio(plain_ms, affine_ms),
                        "copy ms": t[f"copy{bits}"].cell,
                        "memcpy ms": t[f"memcpy{bits}"].cell,
                        "MB moved": f"{moved / 1e6:.1f}",
                        "MB plain": f"{plain_bytes / 1e6:.1f}",
                        "GB/s affine": format_gbps(moved, affine_ms),
                        "GB/s plain": format_gbps(plain_bytes, plain_ms),
                        "GB/s copy": format_gbps(moved, t[f"copy{bits}"].ms),
                    }
                )
            return out

        yield Case(f"{op} {shape.label}", workloads, lines, release=release)


def _attention_cases(shape: Shape) -> Iterator[Case]:
    bench = AttentionBench(shape)
    workloads = {
        f"{impl} {storage}": bench.workload(storage, impl)
        for storage in ATTENTION_STORAGES
        for impl in ATTENTION_IMPLEMENTATIONS
    }

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        out = []
        for storage in ATTENTION_STORAGES:
            kv, lm = t[f"kvrows {storage}"].ms, t[f"mlx-lm {storage}"].ms
            read = bench.bytes_read(storage)
            out.append(
                {
                    "storage": storage,
                    **shape.cells,
                    "kvrows ms": t[f"kvrows {storage}"].cell,
                    "mlx-lm ms": t[f"mlx-lm {storage}"].cell,
                    "ratio": ratio(lm, kv),
                    "MB read": f"{read / 1e6:.1f}",
                    "GB/s kvrows": format_gbps(read, kv),
                    "GB/s mlx-lm": format_gbps(read, lm),
                    "bf16/this": ratio(t["kvrows bf16"].ms, kv),
                }
            )
        return out

    yield Case(f"attention {shape.label}", workloads, lines, release=bench.release)


#: The parts of the affine family, in table order.
PARTS = ("quantize", "rows", "attention")


def family(
    *, quick: bool = False, shapes: AffineShapes | None = None, parts: Sequence[str] = PARTS
) -> Family:
    """The affine family's three tables: quantize, row operations, decode attention."""
    chosen = shapes if shapes is not None else QUICK_AFFINE if quick else FULL_AFFINE
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}")
    tables = {
        "quantize": Table(_quantize_cases(chosen.quantize), "quantize"),
        "rows": Table(_row_cases(chosen.rows), "rows"),
        "attention": Table(_attention_cases(chosen.attention), "attention"),
    }
    notes = NOTES.format(
        ref_rows=REFERENCE_QUANTIZE_ROWS,
        group=GROUP_SIZE,
        att_b=chosen.attention.batch,
        att_l=chosen.attention.tokens,
    )
    return Family("affine", "one layer", [tables[p] for p in PARTS if p in parts], notes)
