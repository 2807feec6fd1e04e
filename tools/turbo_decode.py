"""One decode step's attention over TurboQuant planes, side by side with plain SDPA, affine-4
and affine-8 (``quantized_matmul``), the microscaling modes, and the previous TurboQuant read (keys decoded to bfloat16, one
centroid gather per code, bfloat16 SDPA, then the un-rotation), in one run.

    .venv/bin/python tools/turbo_decode.py [--batch 16] [--length 1024]

Prints the median of 3 timed calls (after one warm-up) per path, in ms, the ratio to
affine-4, and the largest difference between the previous read and the current one."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx

from kvrows.optimized import turbo_codec as tc
from kvrows.optimized.codecs.affine import quantized_attention
from kvrows.optimized.codecs.common import sdpa
from kvrows.optimized.codecs.turbo import turbo_attention

Q_HEADS, KV_HEADS, DIM, SCALE = 32, 8, 128, 0.088


def _previous_rotated(packed: mx.array, scales: mx.array, bits: int) -> mx.array:
    """The previous value read: every code unpacked, then one gather per code."""
    centroids, _ = tc.codebook(bits)
    idx = tc.unpack_codes(packed, bits)
    groups = idx.reshape(*idx.shape[:-1], -1, 32)
    return (centroids[groups] * scales.astype(mx.float32)[..., None]).reshape(idx.shape)


def _median_ms(work: Callable[[], mx.array], calls: int = 3) -> float:
    mx.eval(work())
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        mx.eval(work())
        times.append(time.perf_counter() - started)
    return 1e3 * sorted(times)[calls // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=1024)
    args = parser.parse_args()
    shape = (args.batch, KV_HEADS, args.length, DIM)
    keys = mx.random.normal(shape).astype(mx.bfloat16)
    values = mx.random.normal(shape).astype(mx.bfloat16)
    queries = mx.random.normal((args.batch, Q_HEADS, 1, DIM)).astype(mx.bfloat16)
    affine_k = mx.quantize(keys, group_size=64, bits=4)
    affine_v = mx.quantize(values, group_size=64, bits=4)
    mx.eval(keys, values, queries, affine_k, affine_v)
    print(f"B={args.batch} L={args.length} {Q_HEADS}/{KV_HEADS} heads D={DIM} bf16, ms:")
    print(f"  plain SDPA   {_median_ms(lambda: sdpa(queries, keys, values, None, SCALE)):7.0f}")
    affine = _median_ms(
        lambda: quantized_attention(queries, affine_k, affine_v, None, SCALE, 64, 4)
    )
    print(f"  affine-4     {affine:7.0f}")
    for mode, group, bits in (("affine", 32, 8), ("mxfp8", 32, 8), ("mxfp4", 32, 4),
                              ("nvfp4", 16, 4)):  # fmt: skip
        planes_k = tuple(mx.quantize(keys, group_size=group, bits=bits, mode=mode))
        planes_v = tuple(mx.quantize(values, group_size=group, bits=bits, mode=mode))
        mx.eval(planes_k, planes_v)

        def quantized(
            k: tuple[mx.array, ...] = planes_k, v: tuple[mx.array, ...] = planes_v,
            group: int = group,
            bits: int = bits, mode: str = mode,
        ) -> mx.array:  # fmt: skip
            return quantized_attention(queries, k, v, None, SCALE, group, bits, mode)

        took = _median_ms(quantized)
        print(f"  {mode}-{bits:<6} {took:7.0f}")
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
        before, now = _median_ms(previous), _median_ms(current)
        print(
            f"  turbo k{k_bits}v{v_bits}  previous {before:5.0f}  now {now:5.0f} "
            f"({now / affine:.2f}x affine-4; max |diff| {gap:.2g})"
        )


if __name__ == "__main__":
    main()
