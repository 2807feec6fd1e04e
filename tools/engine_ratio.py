"""kvrows' engine against mlx-lm's ``BatchGenerator`` where prefix reuse does not help: the
demo trace (16 requests arriving at once, no shared prefix, the embedded llama, greedy,
prefill chunk 64, prefix cache off) at each max batch, the two interleaved ``--runs`` times
(3); the median tokens/s of each and their ratio (the same tokens checked), by wall clock
and by this process's CPU time (every thread's: less sensitive to other processes on a
shared machine).

    .venv/bin/python tools/engine_ratio.py [--max-batch 1] [--max-batch 4] [--max-batch 16]
                                           [--runs 3]"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from kvrows.app.bench.engine import mlx_lm_generate
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine, Request
from kvrows.app.models import tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-batch", type=int, action="append")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    model = tiny_model("llama")
    mx.eval(model.parameters())
    trace = [Request(r.rid, r.prompt, r.max_tokens) for r in builtin_trace(16, seed=3)]
    for rows in args.max_batch or [1, 4, 16]:
        engine = Engine(model, max_batch=rows, prefill_chunk=64, use_prefix_cache=False)
        engine.run(trace[:2])  # warm-ups
        mlx_lm_generate(model, trace[:2], rows, 64)
        ours, theirs, ours_cpu, theirs_cpu = [], [], [], []
        for _ in range(args.runs):
            started, cpu = time.perf_counter(), time.process_time()
            results, _ = engine.run(trace)
            ours.append(time.perf_counter() - started)
            ours_cpu.append(time.process_time() - cpu)
            started, cpu = time.perf_counter(), time.process_time()
            tokens, _ = mlx_lm_generate(model, trace, rows, 64)
            theirs.append(time.perf_counter() - started)
            theirs_cpu.append(time.process_time() - cpu)
            if {r.rid: r.tokens for r in results} != tokens:
                raise SystemExit(f"max batch {rows}: the two generated different tokens")
        generated = sum(len(r.tokens) for r in results)
        rate, their_rate = (generated / statistics.median(t) for t in (ours, theirs))
        cpu_ratio = statistics.median(theirs_cpu) / statistics.median(ours_cpu)
        print(
            f"max batch {rows:2d}: kvrows {rate:6.1f} tok/s, BatchGenerator {their_rate:6.1f} "
            f"tok/s, ratio {rate / their_rate:.2f}, by CPU time {cpu_ratio:.2f} "
            f"({generated} tokens)"
        )


if __name__ == "__main__":
    main()
