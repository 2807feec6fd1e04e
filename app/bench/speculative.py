"""Speculative decoding: kvrows' engine with a draft against itself without one, and
against mlx-lm's serial speculative generation, on the same models, draft and prompts.

The target is an embedded tiny model (float32, greedy), the draft ``draft_model(target)``
(its first layers). Every request arrives at once, prefix cache off. Workloads:

* ``kvrows spec`` / ``kvrows plain``: ``Engine(draft_model=..., draft_tokens=d)`` and
  ``Engine()`` over the whole trace at ``max_batch`` rows;
* ``mlx-lm spec`` / ``mlx-lm plain``: only at ``max_batch`` 1, one request after the
  other: ``mlx_lm.generate.speculative_generate_step(prompt, model, draft, num_draft_tokens
  = d)`` and ``generate_step``. mlx-lm has no batched speculative decoding (its
  ``BatchGenerator`` takes no draft), so the batched rows have no mlx-lm figure.

Checks: kvrows with a draft must give kvrows' plain greedy tokens, and those must be
mlx-lm's plain ``generate_step`` tokens (a difference is a wrong result). mlx-lm's own
speculative tokens are compared and reported (``mlx-lm spec same``), not failed: on a
sliding-window model its ring stops trimming once full and keeps rejected drafts
(``shared/notes/mlx-lm.md`` B10), so its output there drifts from its own greedy output.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import mlx.core as mx

from kvrows.app.bench.runner import BenchCheckError, Case, Family, Line, Table, Timing, Workload
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine, EngineStats, Request
from kvrows.app.models import draft_model, tiny_model

__all__ = ["family", "mlx_lm_generate_serial"]

Tokens = dict[str, list[int]]


def mlx_lm_generate_serial(
    model: Any, requests: Sequence[Request], chunk: int, draft: Any = None, drafts: int = 3
) -> tuple[Tokens, int]:
    """Each request alone through mlx-lm (``speculative_generate_step`` with ``draft``,
    else ``generate_step``), greedy; the tokens, and the target's forwards after the
    prefill (mlx-lm verifies its first token in a round too)."""
    generate: Any = importlib.import_module("mlx_lm.generate")
    out: Tokens = {}
    forwards = 0
    for request in requests:
        prompt = mx.array(list(request.prompt), dtype=mx.uint32)
        tokens: list[int] = []
        if draft is None:
            steps = generate.generate_step(
                prompt, model, max_tokens=request.max_tokens, prefill_step_size=chunk
            )
            for token, _ in steps:
                tokens.append(int(token))
            forwards += len(tokens)
        else:
            steps = generate.speculative_generate_step(
                prompt,
                model,
                draft,
                num_draft_tokens=drafts,
                max_tokens=request.max_tokens,
                prefill_step_size=chunk,
            )
            from_draft = []
            for token, _, drafted in steps:
                tokens.append(int(token))
                from_draft.append(bool(drafted))
            # a round yields its accepted drafts then one target token (a round cut by
            # max_tokens may end on a draft)
            forwards += from_draft.count(False) + (1 if from_draft and from_draft[-1] else 0)
        out[request.rid] = tokens
    return out, forwards


def _compare(what: str, got: Tokens, expected: Tokens) -> None:
    differ = sorted(rid for rid in expected if got.get(rid) != expected[rid])
    if differ:
        raise BenchCheckError(f"{what}: greedy tokens differ for {differ}")


def _case(
    arch: str,
    model: Any,
    draft: Any,
    trace: list[Request],
    max_batch: int,
    drafts: int,
    chunk: int,
    expected: Tokens,
) -> Case:
    seen: dict[str, Tokens] = {}
    stats: dict[str, EngineStats] = {}
    mlx_forwards: dict[str, int] = {}

    def engine(with_draft: bool) -> Workload:
        name = "kvrows spec" if with_draft else "kvrows plain"

        def setup() -> Engine:
            made = Engine(
                model,
                max_batch=max_batch,
                prefill_chunk=chunk,
                use_prefix_cache=False,
                draft_model=draft if with_draft else None,
                draft_tokens=drafts,
            )
            made.run(trace[:2])  # warm-up
            return made

        def run(made: Engine) -> Tokens:
            results, run_stats = made.run(trace)
            stats[name] = run_stats
            return {r.rid: r.tokens for r in results}

        def check(tokens: Tokens) -> None:
            seen[name] = tokens
            _compare(f"{name} against mlx-lm generate_step", tokens, expected)

        return Workload("speculative", name, max_batch, 0, setup, run, check)

    def mlx_lm(with_draft: bool) -> Workload:
        name = "mlx-lm spec" if with_draft else "mlx-lm plain"
        chosen = draft if with_draft else None

        def setup() -> None:
            mlx_lm_generate_serial(model, trace[:2], chunk, chosen, drafts)  # warm-up

        def run(_: None) -> Tokens:
            tokens, forwards = mlx_lm_generate_serial(model, trace, chunk, chosen, drafts)
            mlx_forwards[name] = forwards
            return tokens

        def check(tokens: Tokens) -> None:
            seen[name] = tokens
            if not with_draft:
                _compare(name, tokens, expected)

        return Workload("speculative", name, max_batch, 0, setup, run, check)

    workloads = {"kvrows spec": engine(True), "kvrows plain": engine(False)}
    skipped: tuple[str, ...] = ("mlx-lm spec", "mlx-lm plain")
    if max_batch == 1:
        workloads |= {"mlx-lm spec": mlx_lm(True), "mlx-lm plain": mlx_lm(False)}
        skipped = ()
    generated = sum(len(tokens) for tokens in expected.values())

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        def rate(name: str) -> str:
            timing = t.get(name)
            ms = None if timing is None else timing.ms
            return f"{generated / (ms * 1e-3):.1f}" if ms else "-"

        spec = stats.get("kvrows spec", EngineStats())
        lm_same = "-"
        if "mlx-lm spec" in seen:
            lm_same = str(seen["mlx-lm spec"] == expected)
        lm_per_forward = "-"
        if mlx_forwards.get("mlx-lm spec"):
            lm_per_forward = f"{generated / mlx_forwards['mlx-lm spec']:.2f}"
        return [
            {
                "model": arch,
                "draft layers": str(len(draft.layers)) if draft is not None else "-",
                "max batch": str(max_batch),
                "d": str(drafts),
                "generated": str(generated),
                "kvrows accepted": f"{spec.acceptance_rate:.0%}",
                "kvrows tok/row-forward": f"{spec.tokens_per_row_forward:.2f}",
                "mlx-lm tok/forward": lm_per_forward,
                "kvrows spec tok/s": rate("kvrows spec"),
                "kvrows plain tok/s": rate("kvrows plain"),
                "mlx-lm spec tok/s": rate("mlx-lm spec"),
                "mlx-lm plain tok/s": rate("mlx-lm plain"),
                "kvrows same": str(seen.get("kvrows spec") == expected),
                "mlx-lm spec same": lm_same,
            }
        ]

    layers = len(draft.layers) if draft is not None else 0
    return Case(
        f"speculative {arch} draft {layers} layers max batch {max_batch}",
        workloads,
        lines,
        key=(arch, layers, max_batch),
        skipped=skipped,
    )


#: Draft layers per model in the full run: the default truncated copy (``None``), and for
#: llama the whole target as its own draft (every draft accepted: the verify path's
#: best case).
FULL_DRAFTS: dict[str, tuple[int | None, ...]] = {"llama": (None, 4), "gemma3": (None,)}


def family(
    *,
    quick: bool = False,
    archs: Sequence[str] = ("llama", "gemma3"),
    max_batches: Sequence[int] | None = None,
    requests: int | None = None,
    max_tokens: int | None = None,
    drafts: int = 3,
    chunk: int = 64,
    draft_layers: Mapping[str, Sequence[int | None]] | None = None,
) -> Family:
    """Speculative decoding at max batch 1 (against mlx-lm) and 8 (kvrows only)."""
    batches = tuple(max_batches or ((1,) if quick else (1, 8)))
    count = requests or (3 if quick else 8)
    length = max_tokens or (8 if quick else 32)
    layer_choices = draft_layers or ({} if quick else FULL_DRAFTS)

    def cases() -> Iterator[Case]:
        trace = [Request(r.rid, r.prompt, length) for r in builtin_trace(count, seed=3)]
        for arch in archs:
            model = tiny_model(arch)
            expected, _ = mlx_lm_generate_serial(model, trace, chunk)
            for layers in layer_choices.get(arch, (None,)):
                draft = draft_model(model, layers)
                for max_batch in batches:
                    yield _case(arch, model, draft, trace, max_batch, drafts, chunk, expected)

    notes = (
        f"the embedded tiny models (float32, greedy), draft = the target's first layers\n"
        f"  (llama 1 of 4, gemma3 2 of 4; llama 4 of 4: the target as its own draft),\n"
        f"  d = {drafts} drafts per round, {count} requests of {length} tokens arriving at\n"
        f"  once, prefill chunk {chunk}, prefix cache off; tok/s = generated tokens /\n"
        "  the run's median time (kvrows: the whole trace at max batch rows;\n"
        "  mlx-lm: one request after the other, batch 1). kvrows accepted = accepted /\n"
        "  proposed drafts; tok/row-forward = tokens a row gains per target decode forward\n"
        "  (1 without a draft; first tokens come from the prefill); mlx-lm tok/forward =\n"
        "  tokens per verify forward of speculative_generate_step. mlx-lm has no batched\n"
        "  speculative decoding: its columns are '-' above max batch 1. kvrows same: the\n"
        "  speculative engine's tokens equal mlx-lm generate_step's (checked, a difference\n"
        "  fails the run); mlx-lm spec same: mlx-lm's own speculative tokens do (reported:\n"
        "  False on gemma3, whose full rings keep rejected drafts, B10)."
    )
    table = Table(cases())
    return Family(
        "speculative", "speculative decoding", [table], notes, repeats=(1, 3), warmups=(0, 1)
    )
