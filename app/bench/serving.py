"""A serving trace where row operations matter, run by the engine and by mlx-lm.

:func:`serving_trace`: long shared contexts (documents of 2-8 k tokens that several
requests ask about: prefix sharing), short private questions, Poisson arrivals (in engine
steps), mixed output lengths, 32+ requests. Rows join, leave and publish all the time.

:func:`serve_kvrows` runs it through :class:`kvrows.app.engine.Engine` (its prefix cache
on), :func:`serve_mlx_lm` through mlx-lm's ``BatchGenerator`` with the ``LRUPromptCache``
its server uses for prefix reuse (``fetch_nearest_cache`` at arrival, ``insert_cache`` of
each finished row). Both count a step the same way: one prefill chunk and one decode step
(``BatchGenerator.next``; one ``Engine`` loop iteration), and a request becomes visible at
the step its arrival names. Each returns the greedy tokens and a :class:`ServingMetrics`:
tokens/s, time to first token from arrival (p50/p99), time per output token, end-to-end
latency per request, peak MLX memory over the run's baseline.

:func:`histogram` draws a latency distribution as text; :func:`plot_latencies` writes a
PNG where matplotlib is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from kvrows.app.engine import Engine, Request
from kvrows.schemes import KvStorageScheme

__all__ = [
    "ServingMetrics",
    "histogram",
    "percentile",
    "plot_latencies",
    "serve_kvrows",
    "serve_mlx_lm",
    "serving_model",
    "serving_trace",
]

Tokens = dict[str, list[int]]


def serving_model(seed: int = 0) -> Any:
    """The serving trace's model: a random-weight float32 llama smaller than the demo's
    (2 layers, hidden 64, 2 query heads over 1 KV head of 64 dims: 1 KiB of KV a token),
    so that contexts of 2-8 k tokens prefill in minutes on a 2-core CPU backend."""
    from mlx.utils import tree_map
    from mlx_lm.models import llama

    model: Any = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            rms_norm_eps=1e-5,
            vocab_size=256,
            tie_word_embeddings=True,
        )
    )
    mx.random.seed(seed)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def serving_trace(
    count: int = 32,
    *,
    contexts: tuple[int, int] = (2048, 8192),
    documents: int = 4,
    questions: tuple[int, int] = (16, 128),
    outputs: Sequence[int] = (16, 32, 64, 128),
    mean_gap: float = 3.0,
    vocab: int = 256,
    seed: int = 0,
) -> list[Request]:
    """``count`` requests: request ``i`` reads document ``i % documents`` (its length drawn
    from ``contexts``) followed by its own question (``questions`` tokens); it arrives a
    Poisson gap (exponential, mean ``mean_gap`` steps) after the one before and asks for
    one of ``outputs`` tokens."""
    rng = random.Random(seed)
    docs = [
        tuple(rng.randrange(vocab) for _ in range(rng.randint(*contexts))) for _ in range(documents)
    ]
    requests: list[Request] = []
    clock = 0.0
    for i in range(count):
        question = tuple(rng.randrange(vocab) for _ in range(rng.randint(*questions)))
        requests.append(
            Request(
                rid=f"s{i:02d}",
                prompt=docs[i % documents] + question,
                max_tokens=rng.choice(tuple(outputs)),
                arrival=int(clock),
            )
        )
        clock += rng.expovariate(1.0 / mean_gap)
    return requests


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass
class ServingMetrics:
    """One system's run of a serving trace."""

    generated: int = 0
    seconds: float = 0.0
    #: Per request, seconds: arrival to first token, first token to last (per token after
    #: the first), arrival to last token.
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    #: ``mx.get_peak_memory()`` over the active memory when the run started (weights).
    peak_memory: int = 0
    prefix_hit_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0


class _Progress:
    """A one-line progress display on stderr for a long run (at most twice a second)."""

    def __init__(self, label: str, total: int, enabled: bool) -> None:
        self.label, self.total, self.enabled = label, total, enabled
        self.started = time.perf_counter()
        self.shown = 0.0

    def update(self, done: int, generated: int, *, last: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not last and now - self.shown < 0.5):
            return
        self.shown = now
        elapsed = now - self.started
        width = 24
        filled = width * done // max(self.total, 1)
        sys.stderr.write(
            f"\r  {self.label}: [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}"
            f" requests, {generated} tok, {generated / max(elapsed, 1e-9):.1f} tok/s,"
            f" {elapsed:.1f} s" + ("\n" if last else "")
        )
        sys.stderr.flush()


def _baseline() -> int:
    mx.synchronize()
    mx.reset_peak_memory()
    return int(mx.get_active_memory())


def serve_kvrows(
    model: Any,
    requests: Sequence[Request],
    scheme: KvStorageScheme,
    *,
    max_batch: int,
    chunk: int,
    progress: bool = False,
    pipelined: bool = True,
) -> tuple[Tokens, ServingMetrics]:
    """The trace through a fresh engine (prefix cache on); tokens and metrics."""
    engine = Engine(model, scheme, max_batch=max_batch, prefill_chunk=chunk, pipelined=pipelined)
    engine.run(requests[:1])  # warm-up, then a fresh engine: no published rows carried over
    engine = Engine(model, scheme, max_batch=max_batch, prefill_chunk=chunk, pipelined=pipelined)
    engine.progress = progress
    baseline = _baseline()
    started = time.perf_counter()
    results, stats = engine.run(requests)
    seconds = time.perf_counter() - started
    metrics = ServingMetrics(
        generated=stats.generated,
        seconds=seconds,
        peak_memory=int(mx.get_peak_memory()) - baseline,
        prefix_hit_tokens=stats.prefix_hit_tokens,
    )
    for result in results:
        first = result.time_to_first_token  # from arrival
        metrics.ttft.append(first)
        after = len(result.tokens) - 1
        decode = after / result.tokens_per_second if result.tokens_per_second else 0.0
        metrics.tpot.append(decode / after if after else 0.0)
        metrics.latency.append(first + decode)
    return {r.rid: r.tokens for r in results}, metrics


def serve_mlx_lm(
    model: Any,
    requests: Sequence[Request],
    *,
    max_batch: int,
    chunk: int,
    progress: bool = False,
) -> tuple[Tokens, ServingMetrics]:
    """The trace through mlx-lm's ``BatchGenerator`` and ``LRUPromptCache`` (its server's
    prefix reuse); a request is inserted at the ``next()`` call its arrival names."""
    generate = importlib.import_module("mlx_lm.generate")
    peer = importlib.import_module("mlx_lm.models.cache")

    def generator() -> Any:
        return generate.BatchGenerator(
            model,
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            prefill_step_size=chunk,
        )

    warm = generator()  # warm-up on the first request
    warm.insert([list(requests[0].prompt)], max_tokens=[2])
    while warm.next_generated():
        pass
    warm.close()
    lru = peer.LRUPromptCache(max_size=4 * len(requests))
    gen = generator()
    waiting = sorted(requests, key=lambda r: r.arrival)
    by_uid: dict[int, Request] = {}
    tokens: Tokens = {r.rid: [] for r in requests}
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    metrics = ServingMetrics()
    shown = _Progress("mlx-lm", len(requests), progress)
    baseline = _baseline()
    started = time.perf_counter()
    step = 0
    while waiting or len(done) < len(by_uid):
        while waiting and waiting[0].arrival <= step:
            request = waiting.pop(0)
            prompt = list(request.prompt)
            cache, rest = lru.fetch_nearest_cache("model", prompt)
            if cache is None or not rest:
                cache, rest = None, prompt
            hit = len(prompt) - len(rest)
            metrics.prefix_hit_tokens += hit
            (uid,) = gen.insert(
                [rest],
                max_tokens=[request.max_tokens],
                caches=None if cache is None else [cache],
                all_tokens=[prompt[:hit]],
            )
            by_uid[uid] = request
            arrived[request.rid] = time.perf_counter()
        _, responses = gen.next()
        now = time.perf_counter()
        for response in responses:
            rid = by_uid[response.uid].rid
            tokens[rid].append(int(response.token))
            first.setdefault(rid, now)
            if response.finish_reason is not None:
                done[rid] = now
                lru.insert_cache("model", list(response.all_tokens), response.prompt_cache)
        step += 1
        shown.update(len(done), sum(len(t) for t in tokens.values()))
    metrics.seconds = time.perf_counter() - started
    metrics.peak_memory = int(mx.get_peak_memory()) - baseline
    gen.close()
    shown.update(len(done), sum(len(t) for t in tokens.values()), last=True)
    for request in requests:
        rid = request.rid
        metrics.generated += len(tokens[rid])
        metrics.ttft.append(first[rid] - arrived[rid])
        after = len(tokens[rid]) - 1
        metrics.tpot.append((done[rid] - first[rid]) / after if after else 0.0)
        metrics.latency.append(done[rid] - arrived[rid])
    return tokens, metrics


def histogram(values: Sequence[float], *, bins: int = 8, width: int = 40, unit: str = "s") -> str:
    """A text histogram of ``values``: one line per bin, its range, a bar and its count."""
    if not values:
        return "  (no values)"
    low, high = min(values), max(values)
    span = (high - low) or 1.0
    counts = [0] * bins
    for value in values:
        counts[min(bins - 1, int((value - low) / span * bins))] += 1
    most = max(counts)
    lines = []
    for i, count in enumerate(counts):
        start, stop = low + span * i / bins, low + span * (i + 1) / bins
        bar = "#" * round(width * count / most) if most else ""
        lines.append(f"  {start:8.3f}-{stop:8.3f} {unit} | {bar:<{width}} {count}")
    return "\n".join(lines)


def plot_latencies(path: str, series: Mapping[str, Sequence[float]]) -> bool:
    """A PNG of each system's per-request latency distribution at ``path``; ``False``
    (nothing written) when matplotlib is not installed."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    matplotlib = importlib.import_module("matplotlib")
    matplotlib.use("Agg")
    pyplot = importlib.import_module("matplotlib.pyplot")
    figure, axes = pyplot.subplots(figsize=(8, 4))
    for name, values in series.items():
        axes.hist(list(values), bins=20, alpha=0.5, label=name)
    axes.set_xlabel("request latency, arrival to last token (s)")
    axes.set_ylabel("requests")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)
    return True
