"""One decode step's attention over each codec's planes, side by side in one run: plain SDPA,
then for affine-4, affine-8, the microscaling modes and TurboQuant k8v3, k4v3, k8v4 three
paths: ``host`` (the CPU's default: NumPy over a few decoded rows at a time,
``spec/host-attention.md``), ``ops`` (the MLX ops other backends run: ``quantized_matmul`` on
the codes; ``op_attention``) and ``eager`` (K and V decoded to the activations' dtype, then
SDPA: the path each replaces).

    .venv/bin/python tools/turbo_decode.py [--batch 16] [--length 1024] [--dtype bfloat16]

For each path: the median of 3 timed calls (after one warm-up), in ms; the ratio to affine-4
on the same path; the bytes the step reads (every K and V plane, and the queries); what it
materializes besides (a decoded copy, in bytes: 0 where scores and weights run on the codes;
the host path's row chunk); the effective GB/s (bytes read / time); and a memcpy of the same
bytes (NumPy, into a touched buffer) in ms and GB/s, for scale."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from kvrows.optimized import turbo_codec as tc
from kvrows.optimized.codecs import make_codec
from kvrows.optimized.codecs.affine import quantized_attention
from kvrows.optimized.codecs.common import sdpa
from kvrows.optimized.codecs.host_attention import CHUNK_BYTES, op_attention
from kvrows.optimized.codecs.turbo import TurboCodec, eager_attention, turbo_attention
from kvrows.schemes import Turbo

Q_HEADS, KV_HEADS, DIM, SCALE = 32, 8, 128, 0.088
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}
TURBO: dict[tuple[int, int], TurboCodec] = {
    (k, v): make_codec(Turbo(k_bits=k, v_bits=v))  # type: ignore[misc]
    for k, v in ((8, 3), (4, 3), (8, 4))
}


def _median_ms(work: Callable[[], object], calls: int = 3) -> float:
    work()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return 1e3 * sorted(times)[len(times) // 2]


def _evaluated(work: Callable[[], mx.array]) -> Callable[[], object]:
    return lambda: mx.eval(work())


def _memcpy_ms(size: int) -> float:
    source = np.ones(size, dtype=np.uint8)
    target = np.zeros(size, dtype=np.uint8)
    return _median_ms(lambda: np.copyto(target, source))


def _nbytes(*planes: mx.array) -> int:
    return sum(int(p.nbytes) for p in planes)


def step_arguments(doc: str) -> argparse.ArgumentParser:
    """The decode step's shape options (``--batch``, ``--length``, ``--dtype``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    return parser


def step_inputs(args: argparse.Namespace) -> tuple[mx.array, mx.array, mx.array]:
    """Random keys, values ``[B, 8, L, 128]`` and one query per row ``[B, 32, 1, 128]``."""
    dtype = DTYPES[args.dtype]
    shape = (args.batch, KV_HEADS, args.length, DIM)
    keys = mx.random.normal(shape).astype(dtype)
    values = mx.random.normal(shape).astype(dtype)
    queries = mx.random.normal((args.batch, Q_HEADS, 1, DIM)).astype(dtype)
    mx.eval(keys, values, queries)
    return keys, values, queries


def main() -> None:
    args = step_arguments(__doc__).parse_args()
    dtype = DTYPES[args.dtype]
    keys, values, queries = step_inputs(args)
    elements = args.batch * KV_HEADS * args.length * DIM
    rows: list[tuple[str, float, int, int, str]] = []

    def add(name: str, work: Callable[[], mx.array], read: int, made: int, note: str) -> float:
        took = _median_ms(_evaluated(work))
        rows.append((name, took, read + _nbytes(queries), made, note))
        return took

    def ops(work: Callable[[], mx.array]) -> Callable[[], mx.array]:
        def on_ops() -> mx.array:
            with op_attention():
                return work()

        return on_ops

    # A row chunk's decoded K and V: what the host path makes at a time.
    chunk = 2 * min(elements * 4, max(CHUNK_BYTES, elements * 4 // args.batch))
    host_note = "a row chunk of K, V decoded (float32)"
    # Each path once first: its one-time set-up (tables, a BLAS controller) is not timed.
    for mode in ("affine", "mxfp8"):
        warm = tuple(mx.quantize(keys[:1], group_size=32, bits=8, mode=mode))
        mx.eval(quantized_attention(queries[:1], warm, warm, None, SCALE, 32, 8, mode))
    add("plain SDPA", lambda: sdpa(queries, keys, values, None, SCALE), _nbytes(keys, values),
        0, "")  # fmt: skip
    for mode, group, bits in (("affine", 64, 4), ("affine", 32, 8), ("mxfp8", 32, 8),
                              ("mxfp4", 32, 4), ("nvfp4", 16, 4)):  # fmt: skip
        planes_k = tuple(mx.quantize(keys, group_size=group, bits=bits, mode=mode))
        planes_v = tuple(mx.quantize(values, group_size=group, bits=bits, mode=mode))
        mx.eval(planes_k, planes_v)

        def quantized(
            k: tuple[mx.array, ...] = planes_k, v: tuple[mx.array, ...] = planes_v,
            group: int = group, bits: int = bits, mode: str = mode,
        ) -> mx.array:  # fmt: skip
            return quantized_attention(queries, k, v, None, SCALE, group, bits, mode)

        def eager(
            k: tuple[mx.array, ...] = planes_k, v: tuple[mx.array, ...] = planes_v,
            group: int = group, bits: int = bits, mode: str = mode,
        ) -> mx.array:  # fmt: skip
            def decoded(planes: tuple[mx.array, ...]) -> mx.array:
                codes, scales, *biases = planes
                return mx.dequantize(codes, scales, biases[0] if biases else None,
                                     group_size=group, bits=bits, mode=mode, dtype=dtype)  # fmt: skip

            out: mx.array = sdpa(queries, decoded(k), decoded(v), None, SCALE)
            return out

        read = _nbytes(*planes_k, *planes_v)
        name = f"{mode}-{bits}"
        add(f"{name} host", quantized, read, chunk, host_note)
        add(f"{name} ops", ops(quantized), read, 0, "quantized_matmul on the codes")
        add(f"{name} eager", eager, read, 2 * elements * 2, "K, V decoded, then SDPA")
    for k_bits, v_bits in ((8, 3), (4, 3), (8, 4)):
        kp, vp = tc.encode_keys(keys, k_bits), tc.encode_values(values, v_bits)
        mx.eval(kp, vp)

        def current(kp: tuple[mx.array, ...] = kp, vp: tuple[mx.array, ...] = vp,
                    k_bits: int = k_bits, v_bits: int = v_bits) -> mx.array:  # fmt: skip
            return turbo_attention(queries, kp, vp, None, SCALE, k_bits, v_bits)

        def decoded_turbo(kp: tuple[mx.array, ...] = kp, vp: tuple[mx.array, ...] = vp,
                  codec: TurboCodec = TURBO[k_bits, v_bits]) -> mx.array:  # fmt: skip
            return eager_attention(codec, queries, kp, vp, None, SCALE)

        read = _nbytes(*kp, *vp)
        name = f"turbo k{k_bits}v{v_bits}"
        add(f"{name} host", current, read, chunk, host_note)
        add(f"{name} ops", ops(current), read, elements * 4,
            "keys on the codes; V rotated (float32)")  # fmt: skip
        add(f"{name} eager", decoded_turbo, read, 2 * elements * 2,
            "K, V decoded (bfloat16), then SDPA")  # fmt: skip
    baseline = {path: took for name, took, *_ in rows if name.startswith("affine-4")
                for path in (name.rsplit(" ", 1)[1],)}  # fmt: skip

    print(f"B={args.batch} L={args.length} {Q_HEADS}/{KV_HEADS} heads D={DIM} {args.dtype}:")
    print(
        f"  {'path':24} {'ms':>7} {'x aff4':>6} {'MB read':>8} {'GB/s':>6} "
        f"{'memcpy ms':>9} {'memcpy GB/s':>11} {'MB made':>8}  made"
    )
    for name, took, read, made, note in rows:
        copy = _memcpy_ms(read)
        affine = baseline.get(name.rsplit(" ", 1)[-1], baseline["host"])
        print(
            f"  {name:24} {took:7.1f} {took / affine:6.2f} {read / 1e6:8.1f} "
            f"{read / took / 1e6:6.2f} {copy:9.2f} {read / copy / 1e6:11.1f} "
            f"{made / 1e6:8.1f}  {note}"
        )


if __name__ == "__main__":
    main()
