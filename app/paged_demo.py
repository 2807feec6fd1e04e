"""``kvrows demo --paged``: the engine's paged option (``spec/engine.md`` §14).

Two parts, per model and scheme:

1. the main demo's trace (and its follow-ups) through ``Engine(paged=True)``, with the
   batch-invariance check (every logit bit-identical to the request's solo run through
   contiguous serial caches) and the contiguous engine's tokens as a second oracle;
2. a shared-prefix trace: one request warms a long system prompt, then ``requests`` more
   that share it arrive together; the contiguous engine copies the published prefix into
   every row, the paged engine's rows reference its blocks. Peak KV bytes (counted: the
   pools count a shared block once) and MLX active memory, and tokens/s, for both.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from kvrows.app.demo import (
    EXACT,
    HEADER,
    MODEL_TOLERANCES,
    _models,
    _print_table,
    _row,
    builtin_trace,
    check_invariance,
    follow_ups,
    parse_scheme,
    print_rejections,
    rejected,
    rejection_line,
    stage,
    verdict,
)
from kvrows.app.engine import Engine, EngineStats, Request, RequestResult

__all__ = ["PAGED_SCHEMES", "run_paged_demo", "shared_prefix_trace"]

#: The schemes ``--paged`` runs by default: every codec a block pool stores.
PAGED_SCHEMES = ("plain", "affine8", "turbo")

SHARED_HEADER = [
    "model",
    "scheme",
    "requests",
    "system tok",
    "peak KV B contiguous",
    "peak KV B paged",
    "paged/contiguous",
    "peak active B contiguous",
    "peak active B paged",
    "tok/s contiguous",
    "tok/s paged",
    "prefix hits (tok) contiguous",
    "prefix hits (tok) paged",
    "same tokens",
]


def shared_prefix_trace(
    requests: int = 8, *, system: int = 1000, vocab: int = 256, seed: int = 7
) -> list[Request]:
    """A warm-up request with a ``system``-token prompt, then ``requests`` that share that
    prompt (each its own short question) arriving together once the warm-up is done."""
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(vocab) for _ in range(system))
    out = [Request(rid="warm", prompt=(*prompt, 1, 2, 3), max_tokens=2, arrival=0)]
    for i in range(requests):
        question = tuple(rng.randrange(vocab) for _ in range(rng.choice((5, 11, 23))))
        out.append(
            Request(rid=f"s{i:02d}", prompt=prompt + question, max_tokens=8, arrival=64 + i % 2)
        )
    return out


def _shared_row(
    name: str,
    scheme_name: str,
    trace: Sequence[Request],
    runs: Sequence[tuple[list[RequestResult], EngineStats, float]],
) -> list[str]:
    (flat, flat_stats, flat_s), (paged, paged_stats, paged_s) = runs
    same = [r.tokens for r in flat] == [r.tokens for r in paged]
    generated = flat_stats.generated
    return [
        name,
        scheme_name,
        str(len(trace)),
        str(len(trace[0].prompt) - 3),
        str(flat_stats.peak_kv_bytes),
        str(paged_stats.peak_kv_bytes),
        f"{paged_stats.peak_kv_bytes / max(flat_stats.peak_kv_bytes, 1):.2f}",
        str(flat_stats.peak_active_kv_bytes),
        str(paged_stats.peak_active_kv_bytes),
        f"{generated / flat_s:.1f}",
        f"{paged_stats.generated / paged_s:.1f}",
        f"{flat_stats.prefix_hits} ({flat_stats.prefix_hit_tokens})",
        f"{paged_stats.prefix_hits} ({paged_stats.prefix_hit_tokens})",
        "PASS" if same else "FAIL",
    ]


def run_paged_demo(
    *,
    model_path: str | None = None,
    schemes: Sequence[str] | None = None,
    requests: int = 12,
    max_batch: int = 8,
    kv_budget: int | None = None,
    prefill_chunk: int = 16,
    progress: bool = True,
    system_tokens: int = 1000,
    shared_requests: int = 8,
) -> int:
    """Both parts for each model and scheme; 1 if an invariance check fails or the paged
    engine's tokens differ from the contiguous engine's."""
    rows: list[list[str]] = []
    shared_rows: list[list[str]] = []
    refusals: list[str] = []
    failed = False
    models = _models(model_path)
    names = list(schemes or PAGED_SCHEMES)
    for model_index, (name, model) in enumerate(models):
        vocab = min(int(model.args.vocab_size) if hasattr(model, "args") else 256, 256)
        first = builtin_trace(requests, vocab=vocab)
        for scheme_index, scheme_name in enumerate(names):
            scheme = parse_scheme(scheme_name)
            stage(
                model_index * len(names) + scheme_index + 1,
                len(models) * len(names),
                f"{name} {scheme.name}: the trace contiguous and paged, its solo replays, "
                f"then the {system_tokens}-token shared-prefix trace",
            )
            tokens: list[list[list[int]]] = []
            refused = 0
            for paged in (False, True):
                engine = Engine(
                    model,
                    scheme,
                    max_batch=max_batch,
                    kv_budget=kv_budget,
                    prefill_chunk=prefill_chunk,
                    keep_logits=paged,
                    progress=progress,
                    paged=paged,
                )
                results, stats = engine.run(first)
                second = follow_ups(results, first)
                more, more_stats = engine.run(second)
                stats.add(more_stats)
                tokens.append([r.tokens for r in results + more])
                refused = max(refused, len(rejected(results + more)))
                line = rejection_line(
                    name, f"{scheme.name} {'paged' if paged else 'contiguous'}", results + more
                )
                if line is not None:
                    refusals.append(line)
            # Paged admission reserves whole blocks: one token's share of a block is its cost,
            # as the contiguous tables count it (not a whole block per position).
            block = engine.paged.block_size if engine.paged is not None else 1
            stats.kv_bytes_per_token = engine.admission.bytes(block) // block
            # results, more, stats: the paged run's (the last)
            report = check_invariance(
                model,
                scheme,
                first + second,
                results + more,
                prefill_chunk,
                tolerance=MODEL_TOLERANCES.get(name, EXACT),
            )
            same = tokens[0] == tokens[1]
            failed |= not report.ok or not same or refused > 0
            row = _row(name, scheme, stats, report, refused)
            row[-1] = verdict(report.ok and same, refused)
            rows.append(row)
            trace = shared_prefix_trace(shared_requests, system=system_tokens, vocab=vocab)
            runs: list[tuple[list[RequestResult], EngineStats, float]] = []
            for paged in (False, True):
                engine = Engine(
                    model,
                    scheme,
                    max_batch=max(max_batch, shared_requests),
                    prefill_chunk=max(prefill_chunk, 256),
                    progress=progress,
                    paged=paged,
                )
                started = time.perf_counter()
                results, stats = engine.run(trace)
                runs.append((results, stats, time.perf_counter() - started))
            shared = _shared_row(name, scheme.name, trace, runs)
            failed |= shared[-1] != "PASS"
            shared_rows.append(shared)
    _print_table(rows, HEADER)
    print(
        "\npaged engine (Engine(paged=True)): one block pool per full-attention layer, rows in"
        " PagedKvRows, prefix hits from the pools' hash chains (whole blocks, referenced);"
        " sliding-window layers stay on their rings. invariance: every logit bit-identical to"
        " the solo run through contiguous serial caches, and every request's tokens the"
        " contiguous engine's."
    )
    print_rejections(refusals)
    print()
    _print_table(shared_rows, SHARED_HEADER)
    print(
        f"\nshared-prefix trace: a warm-up request publishes a {system_tokens}-token system"
        f" prompt, then {shared_requests} requests sharing it arrive together. peak KV B:"
        " bytes counted at step boundaries (contiguous: every layout's and published row's"
        " nbytes, capacity slack included; paged: the pools' referenced and cached blocks,"
        " each once, plus the ring layers' nbytes). peak active B: MLX active memory over the"
        " run's baseline (the pools' growth slack included). tok/s: generated tokens over"
        " the run's wall time (prefill included). same tokens: the paged engine's tokens are"
        " the contiguous engine's."
    )
    return 1 if failed else 0
