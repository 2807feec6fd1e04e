"""Engine throughput against mlx-lm's own ``BatchGenerator`` on the same model and trace.

Both run the embedded tiny llama (float32, greedy) over the same requests, all arriving at
once (``BatchGenerator`` has no arrival model), with the same prefill chunk and the same
cap on rows decoding at once. Reported: generated tokens per second for each, their ratio,
and whether every request's greedy tokens are identical.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvrows.demo import builtin_trace
from kvrows.engine import Engine, Request
from kvrows.models import tiny_model

__all__ = ["EngineBench", "mlx_lm_generate", "run_engine_bench"]


@dataclass
class EngineBench:
    max_batch: int
    generated: int
    kvrows_tps: float
    mlx_lm_tps: float
    same_tokens: bool

    @property
    def ratio(self) -> float:
        return self.kvrows_tps / self.mlx_lm_tps if self.mlx_lm_tps else 0.0


def mlx_lm_generate(
    model: Any, requests: Sequence[Request], max_batch: int, chunk: int
) -> tuple[dict[str, list[int]], float]:
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


def run_engine_bench(
    max_batches: Sequence[int] = (1, 4, 16), requests: int = 16, chunk: int = 64
) -> list[EngineBench]:
    model = tiny_model("llama")
    trace = [Request(r.rid, r.prompt, r.max_tokens) for r in builtin_trace(requests, seed=3)]
    mx.eval(model.parameters())
    rows = []
    for max_batch in max_batches:
        engine = Engine(model, max_batch=max_batch, prefill_chunk=chunk, use_prefix_cache=False)
        engine.run(trace[:2])  # warm-up
        results, stats = engine.run(trace)
        mlx_lm_generate(model, trace[:2], max_batch, chunk)  # warm-up
        theirs, seconds = mlx_lm_generate(model, trace, max_batch, chunk)
        generated = sum(len(t) for t in theirs.values())
        rows.append(
            EngineBench(
                max_batch,
                stats.generated,
                stats.tokens_per_second,
                generated / seconds if seconds else 0.0,
                all(r.tokens == theirs[r.rid] for r in results),
            )
        )
    return rows


def print_engine_bench(rows: Sequence[EngineBench]) -> None:
    print("max batch  generated  kvrows tok/s  mlx-lm tok/s  ratio  same greedy tokens")
    for row in rows:
        print(
            f"{row.max_batch:>9}  {row.generated:>9}  {row.kvrows_tps:>12.1f}  "
            f"{row.mlx_lm_tps:>12.1f}  {row.ratio:>5.2f}  {row.same_tokens}"
        )
