"""Engine throughput against mlx-lm's own ``BatchGenerator`` on the same model and traces.

The demo trace: the embedded tiny llama (float32, greedy) over the same requests, all
arriving at once, with the same prefill chunk and the same cap on rows decoding at once;
the engine pipelined (default) and synchronous. Reported: generated tokens per second for
each, their ratios, and whether every request's greedy tokens are identical (a difference
is a wrong result). Each timed run is one whole trace; its setup (not timed) warms the
implementation up on the trace's first two requests.

The serving trace (:mod:`.serving`): long shared contexts, Poisson arrivals, prefix
sharing; the engine under each scheme against ``BatchGenerator`` with its server's prompt
cache: tokens/s, TTFT p50/p99, TPOT, peak MLX memory, and a latency histogram per system.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import mlx.core as mx

from kvrows.app.bench.runner import (
    BenchCheckError,
    Case,
    Family,
    Line,
    Result,
    Table,
    Timing,
    Workload,
)
from kvrows.app.bench.serving import (
    ServingMetrics,
    histogram,
    percentile,
    plot_latencies,
    serve_kvrows,
    serve_mlx_lm,
    serving_model,
    serving_trace,
)
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine, Request
from kvrows.app.models import tiny_model
from kvrows.schemes import KvStorageScheme

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

    def engine(pipelined: bool) -> Callable[[], Engine]:
        def made() -> Engine:
            built = Engine(
                model,
                max_batch=max_batch,
                prefill_chunk=chunk,
                use_prefix_cache=False,
                pipelined=pipelined,
            )
            built.run(trace[:2])  # warm-up
            return built

        return made

    def tokens_of(e: Engine) -> Tokens:
        return {r.rid: r.tokens for r in e.run(trace)[0]}

    workloads = {
        "kvrows": workload("kvrows", engine(True), tokens_of),
        "kvrows sync": workload("kvrows sync", engine(False), tokens_of),
        "mlx-lm": workload(
            "mlx-lm",
            lambda: mlx_lm_generate(model, trace[:2], max_batch, chunk),  # warm-up
            lambda _: mlx_lm_generate(model, trace, max_batch, chunk)[0],
        ),
    }

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        generated = {n: sum(len(x) for x in seen.get(n, {}).values()) for n in workloads}
        rate = {n: generated[n] / (ms * 1e-3) if (ms := t[n].ms) else 0.0 for n in workloads}
        ours, sync, theirs = rate["kvrows"], rate["kvrows sync"], rate["mlx-lm"]
        same = len(seen) == 3 and seen["kvrows"] == seen["mlx-lm"] == seen["kvrows sync"]
        return [
            {
                "max batch": str(max_batch),
                "generated": str(generated["kvrows"]),
                "kvrows tok/s": f"{ours:.1f}",
                "kvrows sync tok/s": f"{sync:.1f}",
                "mlx-lm tok/s": f"{theirs:.1f}",
                "ratio": f"{ours / theirs:.2f}" if theirs else "-",
                "sync ratio": f"{sync / theirs:.2f}" if theirs else "-",
                "same tokens": str(same),
            }
        ]

    return Case(f"engine max batch {max_batch}", workloads, lines, key=max_batch)


#: The scheme whose greedy tokens must be mlx-lm's: the default one, storing the
#: activations as they are.
EXACT_SCHEME = KvStorageScheme().name
#: The schemes the serving trace runs kvrows under (mlx-lm's BatchGenerator batches plain
#: caches only: its side is always plain).
SERVING_SCHEMES = (EXACT_SCHEME, "affine8", "affine4", "turbo")


def _serving_case(
    model: Any,
    trace: list[Request],
    max_batch: int,
    chunk: int,
    schemes: Sequence[str],
    summary: dict[str, ServingMetrics],
    progress: bool,
) -> Case:
    """mlx-lm's BatchGenerator (plain) and the engine under each scheme on the serving
    trace; the plain engine's greedy tokens must be mlx-lm's."""
    seen: dict[str, Tokens] = {}

    def check(name: str) -> Callable[[Tokens], None]:
        def checked(tokens: Tokens) -> None:
            seen[name] = tokens
            pair = {"mlx-lm", EXACT_SCHEME}
            if name in pair and pair <= set(seen) and seen["mlx-lm"] != seen[EXACT_SCHEME]:
                differ = sorted(r for r in tokens if seen["mlx-lm"][r] != seen[EXACT_SCHEME][r])
                raise BenchCheckError(f"plain greedy tokens differ from mlx-lm's for {differ}")

        return checked

    def run_mlx_lm(_: object) -> Tokens:
        tokens, metrics = serve_mlx_lm(
            model, trace, max_batch=max_batch, chunk=chunk, progress=progress
        )
        summary[f"mlx-lm (batch {max_batch})"] = metrics
        return tokens

    def run_kvrows(scheme: str) -> Callable[[object], Tokens]:
        def run(_: object) -> Tokens:
            tokens, metrics = serve_kvrows(
                model,
                trace,
                KvStorageScheme.parse(scheme),
                max_batch=max_batch,
                chunk=chunk,
                progress=progress,
            )
            summary[f"kvrows {scheme} (batch {max_batch})"] = metrics
            return tokens

        return run

    workloads = {
        "mlx-lm": Workload(
            "serving", "mlx-lm", max_batch, 0, lambda: None, run_mlx_lm, check("mlx-lm")
        )
    }
    for scheme in schemes:
        workloads[scheme] = Workload(
            "serving", scheme, max_batch, 0, lambda: None, run_kvrows(scheme), check(scheme)
        )

    def lines(_: Mapping[str, Timing]) -> list[Line]:
        theirs = summary.get(f"mlx-lm (batch {max_batch})")
        out: list[list[str]] = []
        for scheme in schemes:
            ours = summary.get(f"kvrows {scheme} (batch {max_batch})")
            if ours is None or theirs is None:
                continue
            same = "-"
            if scheme == EXACT_SCHEME and EXACT_SCHEME in seen and "mlx-lm" in seen:
                same = str(seen[EXACT_SCHEME] == seen["mlx-lm"])
            out.append(
                [
                    str(max_batch),
                    scheme,
                    str(ours.generated),
                    f"{ours.tokens_per_second:.1f}",
                    f"{theirs.tokens_per_second:.1f}",
                    f"{ours.tokens_per_second / theirs.tokens_per_second:.2f}"
                    if theirs.tokens_per_second
                    else "-",
                    f"{percentile(ours.ttft, 50):.2f} / {percentile(ours.ttft, 99):.2f}",
                    f"{percentile(theirs.ttft, 50):.2f} / {percentile(theirs.ttft, 99):.2f}",
                    f"{1e3 * percentile(ours.tpot, 50):.1f}",
                    f"{1e3 * percentile(theirs.tpot, 50):.1f}",
                    f"{ours.peak_memory / 1e6:.1f}",
                    f"{theirs.peak_memory / 1e6:.1f}",
                    f"{ours.prefix_hit_tokens} / {theirs.prefix_hit_tokens}",
                    same,
                ]
            )
        return [dict(zip(SERVING_HEADER, line, strict=True)) for line in out]

    return Case(f"serving max batch {max_batch}", workloads, lines, key=("serving", max_batch))


SERVING_HEADER = [
    "max batch",
    "scheme",
    "generated",
    "kvrows tok/s",
    "mlx-lm tok/s",
    "ratio",
    "kvrows TTFT p50/p99 s",
    "mlx-lm TTFT p50/p99 s",
    "kvrows TPOT ms",
    "mlx-lm TPOT ms",
    "kvrows peak MB",
    "mlx-lm peak MB",
    "prefix hit tok kvrows / mlx-lm",
    "same tokens",
]


def _summary(summary: dict[str, ServingMetrics], plot: str | None) -> list[str]:
    """Per system: the latency distribution as a text histogram; a PNG with ``plot``."""
    out = ["", "serving trace, per-request latency (arrival to last token):"]
    for name, metrics in summary.items():
        out.append(
            f"{name}: {len(metrics.latency)} requests, p50 {percentile(metrics.latency, 50):.2f} s,"
            f" p99 {percentile(metrics.latency, 99):.2f} s, {metrics.seconds:.1f} s in all"
        )
        out.append(histogram(metrics.latency))
    if plot is not None:
        series = {name: m.latency for name, m in summary.items()}
        if plot_latencies(plot, series):
            out.append(f"latency plot written to {plot}")
        else:
            out.append(f"--plot {plot}: matplotlib is not installed, text only")
    return out


def family(
    *,
    quick: bool = False,
    max_batches: Sequence[int] | None = None,
    requests: int | None = None,
    chunk: int = 64,
    serving: bool = True,
    serving_batches: Sequence[int] | None = None,
    serving_requests: int | None = None,
    serving_contexts: tuple[int, int] | None = None,
    schemes: Sequence[str] | None = None,
    plot: str | None = None,
) -> Family:
    """Engine against ``BatchGenerator``: the demo trace at each cap on rows ((1, 4, 16) x
    16 requests, all arriving at once), then the serving trace (32 requests over 2-8 k
    token contexts, Poisson arrivals, prefix sharing, :func:`serving_model`) at max batch
    16 under each scheme and at max batch 1 under the first (plain). ``quick``: small
    shapes (the serving trace: 4 requests of 64-128 tokens at max batch 2)."""
    batches = max_batches or ((1, 4) if quick else (1, 4, 16))
    count = requests or (4 if quick else 16)
    serving_count = serving_requests or (4 if quick else 32)
    contexts = serving_contexts or ((64, 128) if quick else (2048, 8192))
    serving_chunk = 64 if quick else 512
    outputs = (2, 4, 8) if quick else (16, 32, 64)
    rows = serving_batches or ((2,) if quick else (16, 1))
    chosen = tuple(schemes or ((EXACT_SCHEME, "affine4") if quick else SERVING_SCHEMES))
    summary: dict[str, ServingMetrics] = {}

    def model() -> Any:
        built = tiny_model("llama")
        mx.eval(built.parameters())
        return built

    def cases() -> Iterator[Case]:
        tiny = model()
        trace = [Request(r.rid, r.prompt, r.max_tokens) for r in builtin_trace(count, seed=3)]
        for max_batch in batches:
            yield _case(tiny, trace, max_batch, chunk)

    def serving_cases() -> Iterator[Case]:
        small = serving_model()
        trace = serving_trace(serving_count, contexts=contexts, outputs=outputs)
        for max_batch in rows:
            # at one row the trace is serial and long: plain only
            kinds = chosen if max_batch > 1 else chosen[:1]
            yield _serving_case(
                small, trace, max_batch, serving_chunk, kinds, summary, progress=not quick
            )

    tables = [Table(cases(), "demo trace (all requests at once, no prefix cache)")]
    notes = (
        f"demo trace: the embedded llama (float32, greedy), {count} requests arriving at once,\n"
        f"  prefill chunk {chunk}, prefix cache off; tok/s = generated tokens / the run's median\n"
        "  time; kvrows = the pipelined engine (default), kvrows sync = pipelined=False; ratio =\n"
        "  kvrows tok/s / mlx-lm tok/s (> 1: kvrows faster); each timed run is the whole trace,\n"
        "  after an untimed warm-up on its first two requests."
    )
    if serving:
        tables.append(
            Table(
                serving_cases(),
                header=SERVING_HEADER,
                title=(
                    f"serving trace ({serving_count} requests, {contexts[0]}-{contexts[1]} token"
                    " contexts, Poisson arrivals, prefix sharing)"
                ),
            )
        )
        notes += (
            "\nserving trace: serving_model() (a 2-layer float32 llama, 1 KV head of 64 dims),"
            f" {serving_count} requests\n  over {min(4, serving_count)} shared"
            f" documents of {contexts[0]}-{contexts[1]} tokens,\n"
            "  plus a private question each, Poisson arrivals (mean gap 3 steps), outputs of"
            f" {'/'.join(map(str, outputs))} tokens;\n"
            f"  prefill chunk {serving_chunk}; kvrows: the pipelined engine with its prefix cache"
            " under each scheme;\n"
            "  mlx-lm: BatchGenerator (plain caches: it batches nothing else) with its server's\n"
            "  LRUPromptCache; one run each (a trace is long), after a warm-up on its first\n"
            "  request; tok/s = generated / wall time; TTFT from arrival; TPOT = per-request\n"
            "  (last - first token) / (tokens - 1), median; peak MB = mx.get_peak_memory()\n"
            "  over the active memory at the start (weights); ratio = kvrows / mlx-lm tok/s."
        )

    def verdict(_: Sequence[Result]) -> list[str]:
        return _summary(summary, plot) if summary else []

    return Family(
        "engine",
        "continuous batching",
        tables,
        notes,
        verdict=verdict,
        repeats=(1, 1),
        warmups=(0, 0),
    )
