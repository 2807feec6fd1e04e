"""One decode step's attention over each codec's planes, side by side in one run: plain SDPA,
affine-4 and affine-8 (``quantized_matmul``), the microscaling modes, TurboQuant now and its
previous read (keys decoded to bfloat16, one centroid gather per code, bfloat16 SDPA, then the
un-rotation).

    .venv/bin/python tools/turbo_decode.py [--batch 16] [--length 1024] [--dtype bfloat16]

For each path: the median of 3 timed calls (after one warm-up), in ms; the ratio to affine-4;
the bytes the step reads (every K and V plane, and the queries); what it materializes besides
(a decoded copy, in bytes: 0 where scores and weights run on the codes); the effective GB/s
(bytes read / time); and a memcpy of the same bytes (NumPy, into a touched buffer) in ms and
GB/s, for scale. TurboQuant rows also give the largest difference between the previous read and
the current one."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from kvrows.optimized import turbo_codec as tc
from kvrows.optimized.codecs.affine import DECODED_ON_CPU, quantized_attention
from kvrows.optimized.codecs.common import sdpa
from kvrows.optimized.codecs.turbo import turbo_attention
from kvrows.optimized.host import on_cpu

Q_HEADS, KV_HEADS, DIM, SCALE = 32, 8, 128, 0.088
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16}


def _previous_rotated(packed: mx.array, scales: mx.array, bits: int) -> mx.array:
    """The previous value read: every code unpacked, then one gather per code."""
    centroids, _ = tc.codebook(bits)
    idx = tc.unpack_codes(packed, bits)
    groups = idx.reshape(*idx.shape[:-1], -1, 32)
    return (centroids[groups] * scales.astype(mx.float32)[..., None]).reshape(idx.shape)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    shape = (args.batch, KV_HEADS, args.length, DIM)
    keys = mx.random.normal(shape).astype(dtype)
    values = mx.random.normal(shape).astype(dtype)
    queries = mx.random.normal((args.batch, Q_HEADS, 1, DIM)).astype(dtype)
    mx.eval(keys, values, queries)
    elements = args.batch * KV_HEADS * args.length * DIM
    rows: list[tuple[str, float, int, int, str]] = []

    def add(name: str, work: Callable[[], mx.array], read: int, made: int, note: str) -> float:
        took = _median_ms(_evaluated(work))
        rows.append((name, took, read + _nbytes(queries), made, note))
        return took

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

        decoded = mode in DECODED_ON_CPU and on_cpu()
        add(f"{mode}-{bits}", quantized, _nbytes(*planes_k, *planes_v),
            2 * elements * 4 if decoded else 0,
            "K, V decoded (float32)" if decoded else "")  # fmt: skip
    affine = rows[1][1]
    for k_bits, v_bits in ((8, 3), (4, 3), (8, 4)):
        kp, vp = tc.encode_keys(keys, k_bits), tc.encode_values(values, v_bits)
        mx.eval(kp, vp)

        def previous(kp: tuple[mx.array, ...] = kp, vp: tuple[mx.array, ...] = vp,
                     k_bits: int = k_bits, v_bits: int = v_bits) -> mx.array:  # fmt: skip
            decoded = tc.decode_keys(kp[0], kp[1], kp[2], k_bits).astype(mx.bfloat16)
            rotated = _previous_rotated(vp[0], vp[1], v_bits).astype(mx.bfloat16)
            return tc.unrotate(sdpa(queries, decoded, rotated, None, SCALE))

        def current(kp: tuple[mx.array, ...] = kp, vp: tuple[mx.array, ...] = vp,
                    k_bits: int = k_bits, v_bits: int = v_bits) -> mx.array:  # fmt: skip
            return turbo_attention(queries, kp, vp, None, SCALE, k_bits, v_bits)

        gap = float(mx.max(mx.abs(previous().astype(mx.float32) - current().astype(mx.float32))))
        read = _nbytes(*kp, *vp)
        add(f"turbo k{k_bits}v{v_bits} previous", previous, read, 2 * elements * 2,
            "K, V decoded (bfloat16)")  # fmt: skip
        add(f"turbo k{k_bits}v{v_bits}", current, read, elements * 4,
            f"V rotated (float32); max |diff| to previous {gap:.2g}")  # fmt: skip

    print(f"B={args.batch} L={args.length} {Q_HEADS}/{KV_HEADS} heads D={DIM} {args.dtype}:")
    print(
        f"  {'path':24} {'ms':>7} {'x aff4':>6} {'MB read':>8} {'GB/s':>6} "
        f"{'memcpy ms':>9} {'memcpy GB/s':>11} {'MB made':>8}  made"
    )
    for name, took, read, made, note in rows:
        copy = _memcpy_ms(read)
        print(
            f"  {name:24} {took:7.1f} {took / affine:6.2f} {read / 1e6:8.1f} "
            f"{read / took / 1e6:6.2f} {copy:9.2f} {read / copy / 1e6:11.1f} "
            f"{made / 1e6:8.1f}  {note}"
        )


if __name__ == "__main__":
    main()
