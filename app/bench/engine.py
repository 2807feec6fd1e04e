"""Engine throughput against mlx-lm's own ``BatchGenerator`` on the same model and trace.

Both run the embedded tiny llama (float32, greedy) over the same requests, all arriving at
once (``BatchGenerator`` has no arrival model), with the same prefill chunk and the same
cap on rows decoding at once. Reported: generated tokens per second for each, their ratio,
and whether every request's greedy tokens are identical (a difference is a wrong result).
Each timed run is one whole trace; its setup (not timed) warms the implementation up on
the trace's first two requests.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import mlx.core as mx

from kvrows.app.bench.runner import BenchCheckError, Case, Family, Table, Timing, Workload
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine, Request
from kvrows.app.models import tiny_model

__all__ = ["family", "mlx_lm_generate"]

Tokens = dict[str, list[int]]


def mlx_lm_generate(
    model: Any, requests: Sequence[Request], max_batch: int, chunk: int
) -> tuple[Tokens, float]:
    """Greedy tokens per request from ``mlx_lm``'s ``BatchGenerator``, and the seconds taken."""
    generate = importlib.import_module("mlx_lm.generate")
    generator = generate.BatchGenerator(
        model,
        completion_batch_size=max_batch,
        prefill_batch_size=max_batch,
        prefill_step_size=chunk,
    )
    start = time.perf_counter()
    uids = generator.insert(
        [list(r.prompt) for r in requests], max_tokens=[r.max_tokens for r in requests]
    )
    by_uid: dict[int, list[int]] = {uid: [] for uid in uids}
    while True:
        responses = generator.next_generated()
        if not responses:
            break
        for response in responses:
            by_uid[response.uid].append(int(response.token))
    seconds = time.perf_counter() - start
    generator.close()
    return {r.rid: by_uid[uid] for r, uid in zip(requests, uids, strict=True)}, seconds


def _case(model: Any, trace: list[Request], max_batch: int, chunk: int) -> Case:
    """kvrows' engine and mlx-lm's generator on ``trace``; each checks the other's tokens."""
    seen: dict[str, Tokens] = {}

    def workload(name: str, setup: Callable[[], Any], run: Callable[[Any], Tokens]) -> Workload:
        def check(tokens: Tokens) -> None:
            seen[name] = tokens
            for other, theirs in seen.items():
                if theirs != tokens:
                    differ = sorted(rid for rid in tokens if tokens[rid] != theirs.get(rid))
                    raise BenchCheckError(f"greedy tokens differ from {other}'s for {differ}")

        return Workload("engine", name, max_batch, 0, setup, run, check)

    def engine() -> Engine:
        made = Engine(model, max_batch=max_batch, prefill_chunk=chunk, use_prefix_cache=False)
        made.run(trace[:2])  # warm-up
        return made

    workloads = {
        "kvrows": workload("kvrows", engine, lambda e: {r.rid: r.tokens for r in e.run(trace)[0]}),
        "mlx-lm": workload(
            "mlx-lm",
            lambda: mlx_lm_generate(model, trace[:2], max_batch, chunk),  # warm-up
            lambda _: mlx_lm_generate(model, trace, max_batch, chunk)[0],
        ),
    }

    def lines(t: Mapping[str, Timing]) -> list[list[str]]:
        generated = {n: sum(len(x) for x in seen.get(n, {}).values()) for n in workloads}
        ours, theirs = (generated[n] / (ms * 1e-3) if (ms := t[n].ms) else 0.0 for n in workloads)
        same = len(seen) == 2 and seen["kvrows"] == seen["mlx-lm"]
        ratio = f"{ours / theirs:.2f}" if theirs else "-"
        return [
            [
                str(max_batch),
                str(generated["kvrows"]),
                f"{ours:.1f}",
                f"{theirs:.1f}",
                ratio,
                str(same),
            ]
        ]

    return Case(f"engine max batch {max_batch}", workloads, lines, key=max_batch)


def family(
    *,
    quick: bool = False,
    max_batches: Sequence[int] | None = None,
    requests: int | None = None,
    chunk: int = 64,
) -> Family:
    """Engine against ``BatchGenerator`` at each cap on rows: (1, 4, 16) x 16 requests."""
    batches = max_batches or ((1, 4) if quick else (1, 4, 16))
    count = requests or (4 if quick else 16)

    def cases() -> Iterator[Case]:
        model = tiny_model("llama")
        mx.eval(model.parameters())
        trace = [Request(r.rid, r.prompt, r.max_tokens) for r in builtin_trace(count, seed=3)]
        for max_batch in batches:
            yield _case(model, trace, max_batch, chunk)

    header = ["max batch", "generated", "kvrows tok/s", "mlx-lm tok/s", "ratio", "same tokens"]
    notes = (
        f"the embedded llama (float32, greedy), {count} requests arriving at once, prefill\n"
        f"  chunk {chunk}, prefix cache off; tok/s = generated tokens / the run's median time;\n"
        "  ratio = kvrows tok/s / mlx-lm tok/s (> 1: kvrows faster); each timed run is the\n"
        "  whole trace, after an untimed warm-up on its first two requests."
    )
    tables = [Table(header, cases())]
    return Family("engine", "continuous batching", tables, notes, repeats=(1, 1), warmups=(0, 0))
