"""The CPU's host attention path of several affine and microscaling codecs, interleaved: each
round times one decode step of every codec in turn, and each codec's figure is its median
over the rounds (a machine's load then weighs on every codec alike), in this process's CPU
time (the host path runs on the calling thread, BLAS held to one: less sensitive than the
wall clock to other processes on the machine). Ratios are to affine at the same bits
(``spec/host-attention.md``).

    .venv/bin/python tools/host_codec_ab.py [--batch 16] [--length 1024] [--dtype bfloat16]
        [--rounds 9]

``mxfp8 (table)`` is mxfp8 decoded by the table take of code pairs (the bit placement,
``PlacedE4m3``, turned off: no scale can carry ``2**200``), the path it replaced.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from turbo_decode import step_arguments, step_inputs  # (the tools folder is the script's path)

from kvrows.optimized.codecs import affine
from kvrows.optimized.codecs.affine import quantized_attention

SCALE = 0.088
#: (mode, group size, bits), and the affine codec each is compared with.
CODECS = {
    "affine-4": ("affine", 64, 4),
    "affine-8": ("affine", 32, 8),
    "mxfp8": ("mxfp8", 32, 8),
    "mxfp8 (table)": ("mxfp8", 32, 8),
    "mxfp4": ("mxfp4", 32, 4),
    "nvfp4": ("nvfp4", 16, 4),
}
BASELINE = {"affine-4": "affine-4", "affine-8": "affine-8", "mxfp8": "affine-8",
            "mxfp8 (table)": "affine-8", "mxfp4": "affine-4", "nvfp4": "affine-4"}  # fmt: skip
PLACED_SHIFT = affine.E4M3_BIAS_SHIFT


def main() -> None:
    parser = step_arguments(__doc__)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    keys, values, queries = step_inputs(args)
    planes: dict[str, tuple[tuple[mx.array, ...], tuple[mx.array, ...]]] = {}
    for name, (mode, group, bits) in CODECS.items():
        k = tuple(mx.quantize(keys, group_size=group, bits=bits, mode=mode))
        v = tuple(mx.quantize(values, group_size=group, bits=bits, mode=mode))
        mx.eval(k, v)
        planes[name] = (k, v)

    def step(name: str) -> float:
        mode, group, bits = CODECS[name]
        k, v = planes[name]
        affine.E4M3_BIAS_SHIFT = 200 if name == "mxfp8 (table)" else PLACED_SHIFT
        started = time.process_time()
        mx.eval(quantized_attention(queries, k, v, None, SCALE, group, bits, mode))
        return 1e3 * (time.process_time() - started)

    for name in CODECS:  # one-time set-up (tables, the BLAS controller) untimed
        step(name)
    times: dict[str, list[float]] = {name: [] for name in CODECS}
    for _ in range(args.rounds):
        for name in CODECS:
            times[name].append(step(name))
    print(f"B={args.batch} L={args.length} {args.dtype}, CPU ms, median of {args.rounds} rounds:")
    medians = {name: statistics.median(taken) for name, taken in times.items()}
    for name, ms in medians.items():
        base = BASELINE[name]
        print(f"  {name:13s} {ms:8.1f} ms  x {base}: {ms / medians[base]:.2f}")


if __name__ == "__main__":
    main()
