"""``kvrows demo``: continuous batching on the embedded tiny models, under every scheme.

For each architecture and KV scheme it runs a built-in trace of requests (mixed prompt
lengths, staggered arrivals, shared prefixes and follow-up turns, mixed output lengths)
through ``kvrows.app.engine.Engine`` and prints throughput, KV bytes (counted, and measured
as MLX active memory) and prefix-cache hits,
then checks batch invariance: every request's logits in the batch are bit-identical to its
solo run with the same scheme and its greedy tokens are the solo run's. A step where the
solo run's top-two margin is below 1e-4 is a near-tie, counted apart.

With ``prefix_store`` (``kvrows demo --prefix-store DIR``) the engines also save their
published rows to an on-disk ``PrefixStore`` in DIR and load prefixes from it; a second
run with the same DIR reports the prefixes it loaded and the prefill time they saved.

``kvrows demo --speculative`` (:func:`run_speculative_demo`) runs the same trace with and
without a draft model (``draft_model``: a truncated copy of the target) and checks that
speculative decoding gives the plain engine's greedy tokens, token for token.

``kvrows demo --paged`` (:func:`run_paged_demo`, ``spec/engine.md`` §14), per model and
scheme: the main trace (and its follow-ups) through ``Engine(paged=True)``, with the
batch-invariance check and the contiguous engine's tokens as a second oracle; then a
shared-prefix trace (one request warms a long system prompt, then ``requests`` more that
share it arrive together), reporting peak KV bytes (counted: the pools count a shared
block once), MLX active memory and tokens/s, contiguous against paged.

``kvrows demo --mla`` (:func:`run_latent_demo`): for each tiny MLA architecture (mlx-lm
``deepseek_v32`` and ``glm_moe_dsa``, random weights, DSA indexer included) and each
latent scheme (``MLACache``, or ``EncodedLatentCache`` with an affine or TurboQuant latent,
bf16-first at ``--kv-start``), the trace (at most 8 new tokens a request) runs through the
same ``Engine`` (``spec/engine.md`` §15), then the same batch-invariance check: greedy
tokens equal to the solo runs', logits within ``LATENT_TOLERANCE``. ``--mla --paged``: the
same through ``Engine(paged=True)`` (one ``LatentBlockPool`` per layer), the plain latent's
tokens also the contiguous engine's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.app.attention import attention_scope
from kvrows.app.engine import Engine, EngineStats, Request, RequestResult, model_fingerprint
from kvrows.app.models import (
    ARCHITECTURES,
    BUILTIN_MODELS,
    HYBRID_ARCHITECTURES,
    LATENT_ARCHITECTURES,
    check_model,
    draft_model,
    make_kvrows_cache,
    record_recurrent_layers,
    text_config,
    tiny_model,
)
from kvrows.codecs import is_codec_spec, is_kv_codec
from kvrows.errors import InvalidInputError
from kvrows.latent import (
    DEEPSEEK_V3_BF16_BYTES,
    FLASHMLA_FP8_BYTES,
    LatentCodec,
    latent_token_bytes,
)
from kvrows.maintenance import create_kv_maintenance
from kvrows.persist.prefix_store import PrefixStore
from kvrows.protocols import RingGeometry
from kvrows.schemes import Affine, KvStorageScheme, Plain, Turbo

__all__ = [
    "LATENT_SCHEMES",
    "PAGED_SCHEMES",
    "InvarianceReport",
    "builtin_trace",
    "check_invariance",
    "latent_scheme",
    "latent_trace",
    "parse_scheme",
    "run_demo",
    "run_latent_demo",
    "run_paged_demo",
    "run_speculative_demo",
    "shared_prefix_trace",
    "solo_logits",
]

#: The speculative demo's logit tolerance (a verify forward computes ``d + 1`` positions in
#: one pass where the solo replay computes one: float32 results differ in the last bits),
#: and the top-two margin under which a token mismatch is a near-tie.
TOLERANCE = 1e-4
#: The main demo's: the batch must be bit-identical to the solo run (``spec/engine.md`` §8).
EXACT = 0.0
#: Models whose batch cannot be bit-identical to the solo run on the CPU backend, with the
#: tolerance they are held to instead and why. mamba2's SSD scan multiplies chunked
#: matrices (``mx.matmul`` over ``[B, ...]``): the CPU kernel blocks and sums differently at
#: another batch size, so float32 results differ in the last bits (1.5e-8 measured; tokens
#: equal). A batch-invariant matmul kernel would make it exact. baichuan_m1 likewise (its
#: batch differs from the solo run in the last bits: 1.5e-8 measured; tokens equal).
MODEL_TOLERANCES: dict[str, float] = {"mamba2": 1e-6, "baichuan_m1": 1e-6}
SCHEMES = ("plain", "affine8", "affine4")
#: The demo's default byte budget for ``--prefix-store``.
PREFIX_STORE_BYTES = 256 * 1024 * 1024


def parse_scheme(text: str, kv_start: int | None = None) -> KvStorageScheme:
    """The scheme named ``text``, with ``kv_start`` (``--kv-start``) as its
    ``quantized_kv_start`` when given (it replaces an ``@N`` in the name)."""
    scheme = KvStorageScheme.parse(text)
    if kv_start is None:
        return scheme
    return dataclasses.replace(scheme, quantized_kv_start=kv_start)


def builtin_trace(count: int = 12, *, vocab: int = 256, seed: int = 0) -> list[Request]:
    """Mixed prompt lengths, arrivals, shared system prompts, follow-ups and output lengths."""
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(vocab) for _ in range(n)) for n in (24, 40)]
    requests: list[Request] = []
    for i in range(count):
        system = systems[i % len(systems)]
        user = tuple(rng.randrange(vocab) for _ in range(rng.choice((3, 9, 17, 33))))
        requests.append(
            Request(
                rid=f"r{i:02d}",
                prompt=system + user if i % 3 else user,
                max_tokens=rng.choice((4, 8, 16, 24)),
                arrival=rng.randrange(0, 3 * count),
            )
        )
    return requests


def follow_ups(
    results: Sequence[RequestResult], requests: Sequence[Request], *, seed: int = 1, start: int = 0
) -> list[Request]:
    """Second turns: each extends an earlier request's prompt and answer."""
    rng = random.Random(seed)
    out: list[Request] = []
    for request, result in zip(requests, results, strict=True):
        if result.error or len(out) >= 4:
            continue
        extra = tuple(rng.randrange(256) for _ in range(rng.choice((2, 6))))
        out.append(
            Request(
                rid=f"{request.rid}+",
                prompt=request.prompt + tuple(result.tokens) + extra,
                max_tokens=6,
                arrival=len(out),
            )
        )
    return out


def solo_logits(
    model: Any,
    scheme: KvStorageScheme,
    request: Request,
    tokens: Sequence[int],
    chunk: int,
    *,
    cuts: Sequence[int] | None = None,
    prefix: int = 0,
    first_cut: int | None = None,
    prefix_cuts: Sequence[int] | None = None,
) -> list[np.ndarray[Any, Any]]:
    """The request alone, through serial caches (legos under a bf16-first scheme),
    teacher-forced with ``tokens``. The prompt's first ``prefix`` tokens (a prefix hit's)
    and, without ``cuts``, the rest go in chunks of ``chunk`` cut at the conversion boundary
    (``max_append_tokens``); ``cuts`` are the batch row's own chunks after the prefix
    (``RequestResult.prefill_chunks``). ``first_cut``: the first append of the row the
    prefix came from (under a start of 0 a lego's first append reads plain whatever its
    size, so the prefix's first chunk must be the one its tokens were computed in).
    ``prefix_cuts``: every append the prefix's tokens were computed in (the row it came
    from), which the prefix then follows instead (a paged encoded latent's hit takes blocks
    whose later layers' rows depend on every cut: each append reads its own tokens exact)."""
    caches = make_kvrows_cache(model, scheme)
    maintenance = create_kv_maintenance(scheme)
    prompt = request.prompt

    logits = None
    fed = 0
    plan = list(cuts) if cuts is not None else None
    before = list(prefix_cuts) if prefix_cuts is not None else []
    while fed < len(prompt):
        if fed < prefix and before:
            step = min(before.pop(0), prefix - fed)
        elif fed < prefix or plan is None:
            end = prefix if fed < prefix else len(prompt)
            step = int(min(chunk, end - fed, maintenance.max_append_tokens(caches)))
            if fed == 0 and first_cut is not None:
                step = min(step, first_cut)
        else:
            step = plan.pop(0)
        with attention_scope(model, caches):
            logits = model(mx.array([list(prompt[fed : fed + step])]), cache=caches)
        fed += step
    assert logits is not None
    out = [np.array(logits[0, -1].astype(mx.float32))]
    for token in tokens[:-1]:
        with attention_scope(model, caches):
            logits = model(mx.array([[token]]), cache=caches)
        out.append(np.array(logits[0, -1].astype(mx.float32)))
    return out


@dataclass
class InvarianceReport:
    """Batch vs solo: the worst logit difference, token mismatches and near-ties."""

    max_logit_diff: float = 0.0
    steps: int = 0
    beyond_tolerance: int = 0
    mismatches: int = 0
    near_ties: int = 0
    #: The model has sliding-window rings and the scheme quantizes some layer.
    quantized_with_rings: bool = False
    #: The tolerance the steps were held to (0: bit-identical).
    tolerance: float = EXACT

    @property
    def ok(self) -> bool:
        """Greedy tokens must match (near-ties aside) and every logit stay within the
        tolerance."""
        return self.mismatches == 0 and self.beyond_tolerance == 0


def _appends(
    requests: Sequence[Request], results: Sequence[RequestResult]
) -> list[list[int] | None]:
    """Per row, every append its KV's tokens were computed in (``None``: not known): under
    a prefix hit, those of the row admitted earlier (else, results of separate runs, earlier
    in trace order) sharing the longest
    prefix with it, whose cached tokens it reused, up to the hit; then its own prefill
    chunks; then one per token fed back."""
    order = sorted(range(len(results)), key=lambda i: (results[i].admitted_step, i))
    out: list[list[int] | None] = [None] * len(results)
    for at, row in enumerate(order):
        prompt, result = tuple(requests[row].prompt), results[row]
        before: list[int] | None = []
        if result.prefix_hit_tokens:
            # A row admitted in the same step published nothing yet, unless the results
            # come from separate runs (each starts at step 0): such a row is the source
            # only when no row admitted earlier shares the prefix.
            best, before = (-2, 0), None
            for index in order[:at]:
                tier = 0 if results[index].admitted_step < result.admitted_step else 1
                tokens = tuple(requests[index].prompt) + tuple(results[index].tokens)
                shared = 0
                for mine, theirs in zip(prompt, tokens, strict=False):
                    if mine != theirs:
                        break
                    shared += 1
                if shared >= result.prefix_hit_tokens and (-tier, shared) > best:
                    best = (-tier, shared)
                    before = _cut_at(out[index], result.prefix_hit_tokens)
        own = [*result.prefill_chunks, *[1] * max(len(result.tokens) - 1, 0)]
        out[row] = None if before is None else [*before, *own]
    return out


def _cut_at(appends: list[int] | None, tokens: int) -> list[int] | None:
    """``appends`` up to ``tokens`` tokens (the last one cut short where it crosses)."""
    if appends is None:
        return None
    out: list[int] = []
    for step in appends:
        if tokens <= 0:
            break
        out.append(min(step, tokens))
        tokens -= out[-1]
    return out if tokens <= 0 else None


def check_invariance(
    model: Any,
    scheme: KvStorageScheme,
    requests: Sequence[Request],
    results: Sequence[RequestResult],
    chunk: int,
    tolerance: float = EXACT,
) -> InvarianceReport:
    """Each request's logits in the batch against its solo run (:func:`solo_logits`),
    step by step, within ``tolerance`` (0: bit-identical)."""
    caches = make_kvrows_cache(model, scheme)
    rings = any(isinstance(cache, RingGeometry) for cache in caches)
    # What each layer stores (a TurboQuant scheme keeps its sliding layers plain); a
    # bf16-first lego names no codec of its own: the scheme's.
    stored = [
        getattr(cache, "codec_spec", None) or scheme.codec_for_layer(i, len(caches))
        for i, cache in enumerate(caches)
    ]
    # Recurrent state (no KV codec) is stored as written: it quantizes nothing.
    quantized = any(is_codec_spec(codec) and codec.encodes for codec in stored)
    report = InvarianceReport(
        quantized_with_rings=rings and quantized,
        tolerance=tolerance,
    )
    appends = _appends(requests, results)
    for request, result, made in zip(requests, results, appends, strict=True):
        if result.error:
            continue
        prefix_cuts = _cut_at(made, result.prefix_hit_tokens) if result.prefix_hit_tokens else None
        first_cut = made[0] if made else None
        solo = solo_logits(
            model,
            scheme,
            request,
            result.tokens,
            chunk,
            cuts=result.prefill_chunks,
            prefix=result.prefix_hit_tokens,
            first_cut=first_cut,
            prefix_cuts=prefix_cuts,
        )
        for batch, alone, token in zip(result.logits, solo, result.tokens, strict=True):
            report.steps += 1
            diff = float(np.abs(batch - alone).max())
            report.max_logit_diff = max(report.max_logit_diff, diff)
            report.beyond_tolerance += diff > tolerance
            if int(np.argmax(alone)) != token:
                top2 = np.sort(alone)[-2:]
                if top2[1] - top2[0] < TOLERANCE:
                    report.near_ties += 1
                else:
                    report.mismatches += 1
    return report


def rejected(results: Sequence[RequestResult]) -> list[RequestResult]:
    """The requests an engine refused (never ran: their work is not in the table)."""
    return [r for r in results if r.finish_reason == "rejected"]


def note_rejections(
    lines: list[str], arch: str, scheme: str, results: Sequence[RequestResult]
) -> int:
    """How many of ``results`` were rejected; if any, a line saying so and why (the first
    one's reason) goes to ``lines``."""
    refused = rejected(results)
    if refused:
        lines.append(
            f"{arch} {scheme}: {len(refused)} of {len(results)} requests rejected, "
            f"the first because {refused[0].error}"
        )
    return len(refused)


def print_rejections(lines: Sequence[str]) -> None:
    """After a table: each configuration's rejections, and that the run did not do them."""
    if not lines:
        return
    print("\nREJECTED requests (not run, so not checked; exit status 1):")
    for line in lines:
        print(f"  {line}")


def verdict(ok: bool, refused: int) -> str:
    """A row's verdict: a failed check, else rejected requests (work not done), else PASS."""
    return "FAIL" if not ok else "REJECTED" if refused else "PASS"


def stage(index: int, total: int, text: str) -> None:
    """One line on stderr as each configuration starts (also under ``--quiet``, which
    drops only the per-request progress bar): a long run shows where it is."""
    print(f"kvrows demo [{index}/{total}] {text}", file=sys.stderr, flush=True)


def _row(
    arch: str,
    scheme: KvStorageScheme,
    stats: EngineStats,
    report: InvarianceReport,
    refused: int = 0,
) -> list[str]:
    return [
        arch,
        scheme.name,
        f"{stats.requests} ({refused} rejected)" if refused else str(stats.requests),
        str(stats.generated),
        f"{stats.tokens_per_second:.1f}",
        str(stats.kv_bytes_per_token),
        str(stats.peak_kv_bytes),
        str(stats.peak_active_kv_bytes),
        f"{stats.prefix_hits} ({stats.prefix_hit_tokens} tok)",
        f"{report.max_logit_diff:.1e} ({report.beyond_tolerance} > tol)",
        f"{report.mismatches}/{report.steps} ({report.near_ties} ties)",
        verdict(report.ok, refused),
    ]


HEADER = [
    "model",
    "scheme",
    "requests",
    "generated",
    "tok/s",
    "KV B/token",
    "peak KV B",
    "peak active B",
    "prefix hits",
    "max |dlogit|",
    "token mismatches",
    "invariance",
]


#: The demo's record, in the store directory, of each configuration's last cold run.
COLD_RUNS = "demo-cold-prefill.json"


def _cold_runs(directory: str) -> dict[str, dict[str, float]]:
    try:
        with open(os.path.join(directory, COLD_RUNS)) as handle:
            loaded = json.load(handle)
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _record_cold_run(directory: str, key: str, stats: EngineStats) -> None:
    """Remember a run that loaded nothing from disk: the baseline of later runs."""
    runs = _cold_runs(directory)
    runs[key] = {"prefill_tokens": stats.prefill_tokens, "prefill_seconds": stats.prefill_seconds}
    temporary = os.path.join(directory, f".{COLD_RUNS}.{os.getpid()}")
    try:
        with open(temporary, "w") as handle:
            json.dump(runs, handle, indent=1, sort_keys=True)
        os.replace(temporary, os.path.join(directory, COLD_RUNS))
    except OSError:
        return  # a read-only store: no baseline kept (the store has said it is read-only)


def _store_row(
    arch: str, scheme: KvStorageScheme, stats: EngineStats, cold: Mapping[str, float] | None
) -> list[str]:
    if cold is not None and stats.store_hits:
        baseline = f"{cold['prefill_seconds']:.3f}"
        saved = f"{cold['prefill_seconds'] - stats.prefill_seconds:.3f}"
    else:
        baseline = saved = "-"
    return [
        arch,
        scheme.name,
        f"{stats.store_hits} ({stats.store_hit_tokens} tok)",
        str(stats.prefill_tokens),
        f"{stats.prefill_seconds:.3f}",
        baseline,
        saved,
        f"{stats.store_read_seconds:.3f}",
        f"{stats.store_writes} ({stats.store_write_seconds:.3f} s)",
    ]


STORE_HEADER = [
    "model",
    "scheme",
    "disk hits",
    "prefill tok",
    "prefill s",
    "cold prefill s",
    "saved s",
    "disk read s",
    "rows saved",
]


def _print_table(rows: list[list[str]], header: list[str] | None = None) -> None:
    header = header or HEADER
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def _models(model_path: str | None) -> list[tuple[str, Any]]:
    """The models to run: a checkpoint directory, one built-in tiny architecture by name
    (``llama``, ``gemma3``, ``qwen3_next``, ``mamba2``), ``hybrid`` (the two recurrent
    ones), or by default the attention ones (``llama``, ``gemma3``). Recurrent mixers are
    wrapped to record verify rounds (``record_recurrent_layers``; nothing else changes)."""
    if model_path is not None and model_path not in BUILTIN_MODELS:
        check_model(model_path)  # a local directory: mlx-lm never reaches for the Hub
        from mlx_lm import load

        try:
            loaded = load(model_path)
        except Exception as error:  # a damaged or unsupported checkpoint: say which
            first = (str(error).strip().splitlines() or [""])[0]
            raise InvalidInputError(
                f"cannot load the model in {model_path}: {type(error).__name__}: {first}"
            ) from error
        record_recurrent_layers(loaded[0])
        return [(model_path, loaded[0])]
    names = {None: ARCHITECTURES, "hybrid": HYBRID_ARCHITECTURES}.get(model_path, (model_path,))
    return [(str(name), tiny_model(str(name))) for name in names]


def _cells(
    models: Sequence[tuple[str, Any]],
    schemes: Sequence[str],
    requests: int,
    kv_start: int | None,
    doing: str,
    announce: bool = True,
) -> Iterator[tuple[str, Any, list[Request], KvStorageScheme]]:
    """Each model and scheme in turn, with the model's first wave of ``requests``; each
    announced on stderr (``doing``: what runs; ``announce=False``: silently)."""
    for model_index, (name, model) in enumerate(models):
        vocab = int(text_config(model).vocab_size) if hasattr(model, "args") else 256
        first = builtin_trace(requests, vocab=min(vocab, 256))
        for scheme_index, scheme_name in enumerate(schemes):
            scheme = parse_scheme(scheme_name, kv_start)
            at = model_index * len(schemes) + scheme_index + 1
            if announce:
                stage(at, len(models) * len(schemes), f"{name} {scheme.name}: {doing}")
            yield name, model, first, scheme


def _serve(
    engine: Engine, first: list[Request]
) -> tuple[list[Request], list[RequestResult], EngineStats]:
    """``first``, then its follow-ups, on ``engine``: every request, result and the totals."""
    results, stats = engine.run(first)
    second = follow_ups(results, first)
    more, more_stats = engine.run(second)
    stats.add(more_stats)
    return first + second, results + more, stats


SPECULATIVE_HEADER = [
    "model",
    "scheme",
    "draft layers",
    "d",
    "generated",
    "accepted",
    "tok/row-forward",
    "target forwards",
    "tok/s plain",
    "tok/s spec",
    "speedup",
    "max |dlogit|",
    "same tokens",
]


def run_speculative_demo(
    *,
    model_path: str | None = None,
    schemes: Sequence[str] | None = None,
    requests: int = 12,
    max_batch: int = 8,
    prefill_chunk: int = 16,
    draft_tokens: int = 3,
    draft_layers: int | None = None,
    progress: bool = True,
    kv_start: int | None = None,
) -> int:
    """The trace (first wave and follow-ups) with and without a draft, per model and scheme;
    1 if any request's greedy tokens differ or the speculative logits fail the solo check."""
    rows: list[list[str]] = []
    refusals: list[str] = []
    failed = False
    models = _models(model_path)
    drafts: dict[str, Any] = {}
    for name, model in models:
        try:
            drafts[name] = draft_model(model, draft_layers)
        except InvalidInputError as error:
            if draft_layers is None:
                raise
            raise InvalidInputError(f"--draft-layers {draft_layers}: {error}") from error
        record_recurrent_layers(drafts[name])
    doing = "the trace without, then with a draft"
    for name, model, first, scheme in _cells(
        models, list(schemes or SCHEMES), requests, kv_start, doing
    ):
        draft = drafts[name]
        runs: list[tuple[list[Request], list[RequestResult], EngineStats]] = []
        for speculative in (False, True):
            engine = Engine(
                model,
                scheme,
                max_batch=max_batch,
                prefill_chunk=prefill_chunk,
                keep_logits=speculative,
                progress=progress,
                draft_model=draft if speculative else None,
                draft_tokens=draft_tokens,
            )
            runs.append(_serve(engine, first))
        (_, plain, plain_stats), (served, spec, spec_stats) = runs
        same = [r.tokens for r in plain] == [r.tokens for r in spec]
        report = check_invariance(model, scheme, served, spec, prefill_chunk, tolerance=TOLERANCE)
        refused = note_rejections(refusals, name, scheme.name, plain + spec)
        failed |= not same or not report.ok or refused > 0
        speedup = spec_stats.tokens_per_second / max(plain_stats.tokens_per_second, 1e-9)
        rows.append(
            [
                name,
                scheme.name,
                str(len(draft.layers)),
                str(draft_tokens),
                str(spec_stats.generated),
                f"{spec_stats.accepted}/{spec_stats.drafted} ({spec_stats.acceptance_rate:.0%})",
                f"{spec_stats.tokens_per_row_forward:.2f}",
                f"{plain_stats.target_forwards} -> {spec_stats.target_forwards}",
                f"{plain_stats.tokens_per_second:.1f}",
                f"{spec_stats.tokens_per_second:.1f}",
                f"{speedup:.2f}",
                f"{report.max_logit_diff:.1e} ({report.beyond_tolerance} > tol)",
                verdict(same and report.ok, refused),
            ]
        )
    _print_table(rows, SPECULATIVE_HEADER)
    print(
        "\nspeculative decoding: each round the draft (the target's first layers, its own"
        f" verify layouts) proposes up to {draft_tokens} tokens per row and the target"
        " verifies [pending, drafts] in one forward through its verify layouts; a row keeps"
        " its drafts up to the first mismatch plus the target's own token. accepted: drafts"
        " accepted / proposed; tok/row-forward: tokens a row gains per target forward (1"
        " without a draft); target forwards: decode forwards without -> with the draft (the"
        " trace's arrivals spread them); same tokens: every request's greedy tokens equal"
        " the plain engine's, and every kept logit row is within the tolerance of a solo"
        " replay (affine sliding-window rows: counted, not failed, as in the main demo)."
    )
    print_rejections(refusals)
    return 1 if failed else 0


def run_demo(
    *,
    model_path: str | None = None,
    schemes: Sequence[str] | None = None,
    requests: int = 12,
    max_batch: int = 8,
    kv_budget: int | None = None,
    prefill_chunk: int = 16,
    progress: bool = True,
    prefix_store: str | None = None,
    prefix_store_bytes: int = PREFIX_STORE_BYTES,
    kv_start: int | None = None,
) -> int:
    """Run the trace under each scheme and print the table; 1 if any invariance check fails.

    With ``prefix_store`` (a directory) every engine also saves its published rows there
    and loads prefixes from it (one store per model and scheme, told apart by their
    fingerprints), and a second table reports what the store gave."""
    rows: list[list[str]] = []
    store_rows: list[list[str]] = []
    stores: list[PrefixStore] = []
    refusals: list[str] = []
    failed = False
    doing = "the trace, then its solo replays"
    for name, model, first, scheme in _cells(
        _models(model_path), list(schemes or SCHEMES), requests, kv_start, doing
    ):
        store = None
        if prefix_store is not None:
            store = PrefixStore(
                prefix_store,
                byte_budget=prefix_store_bytes,
                fingerprint=model_fingerprint(model, scheme),
            )
            stores.append(store)
        engine = Engine(
            model,
            scheme,
            max_batch=max_batch,
            kv_budget=kv_budget,
            prefill_chunk=prefill_chunk,
            keep_logits=True,
            prefix_store=store,
            progress=progress,
        )
        served, results, stats = _serve(engine, first)
        report = check_invariance(
            model,
            scheme,
            served,
            results,
            prefill_chunk,
            tolerance=MODEL_TOLERANCES.get(name, EXACT),
        )
        refused = note_rejections(refusals, name, scheme.name, results)
        failed |= not report.ok or refused > 0
        rows.append(_row(name, scheme, stats, report, refused))
        if prefix_store is not None:
            key = f"{name}|{scheme.name}|{requests}|{max_batch}|{kv_budget}|{prefill_chunk}"
            cold = _cold_runs(prefix_store).get(key)
            store_rows.append(_store_row(name, scheme, stats, cold))
            if not stats.store_hits:
                _record_cold_run(prefix_store, key, stats)
    _print_table(rows)
    print(
        "\nbatch invariance: each request's logits in the batch vs its solo run with the same"
        " scheme must be bit-identical (tolerance 0), and its greedy tokens the solo run's"
        f" (near-ties, where the solo top-two margin is below {TOLERANCE:g}, are counted"
        " apart). Sliding-window rings are read in time order alone and in a batch"
        " (kvrows.app.ring_order), so attention sums every window in one order, also on the"
        " step a bf16-first row converts."
        " mamba2 is held to 1e-6 instead: its chunked SSD"
        " scan multiplies matrices whose CPU kernel sums in another order at another batch"
        " size."
    )
    print_rejections(refusals)
    if prefix_store is not None:
        _print_store(prefix_store, prefix_store_bytes, stores, store_rows)
    return 1 if failed else 0


def _print_store(
    directory: str, budget: int, stores: list[PrefixStore], rows: list[list[str]]
) -> None:
    on_disk = stores[0].entries() if stores else []
    print(
        f"\nprefix store {directory}: {len(on_disk)} entries, "
        f"{sum(e.nbytes for e in on_disk)} bytes on disk (budget {budget})\n"
    )
    _print_table(rows, STORE_HEADER)
    print(
        "\ndisk hits: requests whose prefix was loaded from the store (memory holds nothing"
        " at start), and its tokens; prefill tok / prefill s: prompt tokens the model"
        " computed and the seconds that took (evaluated); cold prefill s: the same"
        " configuration's last run that loaded nothing from disk (recorded in"
        f" {COLD_RUNS}); saved s: cold prefill s - prefill s; disk read s: lookups and"
        " loads (outside the prefill time). Rows are saved at block boundaries (16 tokens); a"
        " sliding-window ring that has wrapped cannot be cut back to one, so the"
        " sliding-window model saves few rows and loads none here."
    )
    if all(row[2].startswith("0 ") for row in rows):
        print(f"Run again with --prefix-store {directory} to load these rows.")


# -- kvrows demo --paged ----------------------------------------------------------------

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
    doing = (
        "the trace contiguous and paged, its solo replays, "
        f"then the {system_tokens}-token shared-prefix trace"
    )
    for name, model, first, scheme in _cells(
        _models(model_path), list(schemes or PAGED_SCHEMES), requests, None, doing
    ):
        vocab = min(int(text_config(model).vocab_size) if hasattr(model, "args") else 256, 256)
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
            served, results, stats = _serve(engine, first)
            tokens.append([r.tokens for r in results])
            label = f"{scheme.name} {'paged' if paged else 'contiguous'}"
            refused = max(refused, note_rejections(refusals, name, label, results))
        # Paged admission reserves whole blocks: one token's share of a block is its cost,
        # as the contiguous tables count it (not a whole block per position).
        block = engine.paged.block_size if engine.paged is not None else 1
        stats.kv_bytes_per_token = engine.admission.bytes(block) // block
        # served, results, stats: the paged run's (the last)
        report = check_invariance(
            model,
            scheme,
            served,
            results,
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
        "\npaged engine (Engine(paged=True)): one block pool per attention layer, rows in"
        " PagedKvRows, prefix hits from the pools' hash chains (whole blocks, referenced);"
        " sliding-window layers in PagedRotatingRows, chunked-local layers in PagedChunkedRows"
        " (a hit inside the window or chunk only: such a row publishes while it holds every"
        " position). invariance: every logit bit-identical to"
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
        " each once, plus the unpaged layers' nbytes). peak active B: MLX active memory over the"
        " run's baseline (the pools' growth slack included). tok/s: generated tokens over"
        " the run's wall time (prefill included). same tokens: the paged engine's tokens are"
        " the contiguous engine's."
    )
    return 1 if failed else 0


# -- kvrows demo --mla -----------------------------------------------------------------

#: The ``--mla`` demo's logit tolerance: batched and solo matmuls over the latent round
#: differently in the last bits (6e-8 measured), so the latent batch is not bit-identical to
#: the solo run; its greedy tokens must be.
LATENT_TOLERANCE = TOLERANCE

#: Scheme name -> the latent codec (plain: ``MLACache``; else ``EncodedLatentCache``).
LATENT_SCHEMES: dict[str, LatentCodec] = {
    "plain": Plain(),
    "affine8": Affine(bits=8, group_size=64),
    "affine4": Affine(bits=4, group_size=32),
    "turbo-v4": Turbo(k_bits=8, v_bits=4),
}


def latent_codec(name: str) -> LatentCodec:
    """The latent codec of scheme ``name``: one of :data:`LATENT_SCHEMES` (the demo's
    default list), or any other encoding KV codec's scheme word (``mxfp4``, ``affine4:64``)."""
    if name in LATENT_SCHEMES:
        return LATENT_SCHEMES[name]
    try:
        codec = KvStorageScheme.parse(name).codec
    except InvalidInputError:
        codec = None
    if codec is None or not (codec.encodes and is_kv_codec(codec)):
        raise InvalidInputError(
            f"unknown latent scheme {name!r}: known {list(LATENT_SCHEMES)} or an encoding "
            "codec's word (affine<bits>[:<group>], mxfp8, mxfp4, nvfp4)"
        )
    latent: LatentCodec = codec
    return latent


def latent_scheme(name: str, kv_start: int | None = None) -> KvStorageScheme:
    """The engine's scheme for the latent scheme ``name`` (every layer's latent through its
    codec; an encoded latent bf16-first at ``kv_start``, else from its first token)."""
    return KvStorageScheme(codec=latent_codec(name), quantized_kv_start=kv_start)


def latent_trace(requests: int) -> list[Request]:
    """The main demo's trace (shared system prompts, follow-up lengths, staggered
    arrivals) with at most 8 new tokens a request."""
    return [
        dataclasses.replace(r, max_tokens=min(r.max_tokens, 8)) for r in builtin_trace(requests)
    ]


def run_latent_demo(
    *, schemes: Sequence[str] | None = None, requests: int = 8, max_batch: int = 4,
    kv_start: int | None = None, architectures: Sequence[str] = LATENT_ARCHITECTURES,
    prefill_chunk: int = 16, paged: bool = False,
) -> int:  # fmt: skip
    """Print the table; 1 if any request's batch tokens differ from its solo run (or its
    logits by more than ``LATENT_TOLERANCE``). ``paged`` (``--mla --paged``): the engine
    runs ``paged=True`` (one ``LatentBlockPool`` per layer) and each request's tokens must
    also be the contiguous engine's."""
    names = list(schemes or LATENT_SCHEMES)
    for name in names:
        latent_codec(name)  # refused before anything runs
    if paged and kv_start is not None:
        raise InvalidInputError(
            "--mla --paged: a bf16-first start (--kv-start) has no paged layout; run paged "
            "without --kv-start"
        )
    header = ["model", "scheme", "requests", "generated", "tok/s", "peak rows",
              "B/token/layer", "at DeepSeek-V3 (bf16)", "vs 1152 B", "vs 656 B",
              "prefix hits", "contiguous tokens", "max |dlogit|", "token mismatches",
              "invariance"]  # fmt: skip
    table: list[list[str]] = []
    failed = False
    for arch in architectures:
        model = tiny_model(arch)
        trace = latent_trace(requests)
        for name in names:
            codec = latent_codec(name)
            scheme = latent_scheme(name, kv_start)
            same = "-"
            if paged:  # the contiguous engine's tokens: the second oracle
                flat, _ = Engine(
                    model, scheme, max_batch=max_batch, prefill_chunk=prefill_chunk
                ).run(trace)
            engine = Engine(
                model, scheme, max_batch=max_batch, prefill_chunk=prefill_chunk,
                keep_logits=True, paged=paged,
            )  # fmt: skip
            results, stats = engine.run(trace)
            if engine.paged is not None:
                # Paged admission reserves whole blocks: one token's share of a block
                # (as --paged reports it), not a block per token.
                block = engine.paged.block_size
                stats.kv_bytes_per_token = engine.admission.bytes(block) // block
            if paged:
                same = (
                    "same" if [r.tokens for r in results] == [r.tokens for r in flat] else "differ"
                )
            report = check_invariance(
                model, scheme, trace, results, prefill_chunk, tolerance=LATENT_TOLERANCE
            )
            # The contiguous engine is an oracle for the plain latent only: an encoded
            # latent's values depend on the appends they were computed in (each reads its
            # own tokens exact), and a block hit brings its source row's appends.
            ok = report.ok and (same != "differ" or codec.encodes)
            failed |= not ok
            # what the same codec stores per token and layer at DeepSeek-V3's 512 + 64, bf16
            projected = latent_token_bytes(codec, 512, 64, None, "bfloat16")
            table.append(
                [
                    arch, name, str(len(trace)), str(stats.generated),
                    f"{stats.tokens_per_second:.1f}", str(stats.peak_rows),
                    str(stats.kv_bytes_per_token // len(model.layers)), f"{projected} B",
                    f"{projected / DEEPSEEK_V3_BF16_BYTES:.2f}x",
                    f"{projected / FLASHMLA_FP8_BYTES:.2f}x",
                    f"{stats.prefix_hits} ({stats.prefix_hit_tokens} tok)", same,
                    f"{report.max_logit_diff:.1e}", f"{report.mismatches}/{report.steps}",
                    "PASS" if ok else "FAIL",
                ]
            )  # fmt: skip
    _print_table(table, header)
    print(
        "\nMLA latent caches in unmodified mlx-lm MLA models (tiny random weights: latent 64,"
        " rope 16, DSA index 32 per token and layer, float32), served by the engine: rows"
        " prefill in cohorts, join one right-justified batch per layer, take prefix hits and"
        " are retired by filters."
        " B/token/layer: this model's bytes per token per layer; at DeepSeek-V3: what the"
        " same codec stores for 512 latent + 64 rope values in bf16, against DeepSeek-V3's"
        " 1152 B and FlashMLA FP8's 656 B. Invariance: every request alone, with its batch"
        " row's prefill chunks, teacher-forced, gives its batch tokens (required; near-ties"
        " aside) and logits within 1e-4 of the batch's (batched and solo matmuls may round"
        " differently in the last bits)."
    )
    if paged:
        print(
            "\npaged (--mla --paged): Engine(paged=True), one LatentBlockPool per layer shared"
            " by every request; prefix hits are whole blocks, referenced. The solo replay"
            " feeds a hit's tokens in the appends its source row computed them in."
            " contiguous tokens: every request's tokens against the contiguous engine's,"
            " required for the plain latent; an encoded latent's rows depend on the appends"
            " they were computed in (each reads its own tokens exact), so a hit computed in"
            " other appends may turn a near-tie: reported, not failed."
        )
    return 1 if failed else 0


TENSOR_PARALLEL_HEADER = [
    "model",
    "scheme",
    "ranks",
    "generated",
    "tok/s",
    "tok/s 1 process",
    "KV B/token per rank",
    "KV B/token 1 process",
    "peak KV B per rank",
    "max |dlogit|",
    "same tokens",
]


def _tensor_parallel_models(model_path: str | None, ranks: int) -> list[tuple[str, Any, Any]]:
    """Each model twice: to shard, and whole (rank 0's single-process run). The built-in
    attention models get 2 KV heads per rank (their own config has 2 in all)."""
    from kvrows.app.distributed import shard_model

    if model_path is not None and model_path not in BUILTIN_MODELS:
        ((name, whole),) = _models(model_path)
        ((_, sharded),) = _models(model_path)
        return [(name, shard_model(sharded), whole)]
    names = ARCHITECTURES if model_path is None else (model_path,)
    heads = {"num_key_value_heads": 2 * ranks, "num_attention_heads": 8 * ranks // 2}
    return [
        (name, shard_model(tiny_model(name, overrides=heads)), tiny_model(name, overrides=heads))
        for name in names
    ]


def run_tensor_parallel_demo(
    *,
    model_path: str | None = None,
    schemes: Sequence[str] | None = None,
    requests: int = 12,
    max_batch: int = 8,
    prefill_chunk: int = 16,
    progress: bool = True,
    paged: bool = False,
    kv_start: int | None = None,
    speculative: bool = False,
    draft_tokens: int = 3,
) -> int:
    """The trace (first wave and follow-ups) with the model sharded over the launch's group
    (``mlx.launch -n N``): every rank runs the same engine over its KV heads. Checked: the
    batch against its solo replays (bit-identical, on the sharded model), every rank's
    tokens alike, and rank 0's tokens against one process running the whole model. Rank 0
    prints; every rank returns 1 if any check failed."""
    from kvrows.app.distributed import agreed, any_rank, check_in_step

    group = mx.distributed.init()
    ranks, rank = group.size(), group.rank()
    if ranks < 2:
        raise InvalidInputError(
            "--tensor-parallel shards the model over the processes of a launch: run it as "
            "mlx.launch -n 2 --backend ring -- kvrows demo --tensor-parallel"
        )
    rows: list[list[str]] = []
    failed = False
    models = _tensor_parallel_models(model_path, ranks)
    doing = "the trace sharded, its solo replays, then one process"
    for name, sharded, first, scheme in _cells(
        [(n, s) for n, s, _ in models],
        list(schemes or SCHEMES),
        requests,
        kv_start,
        doing,
        announce=rank == 0,
    ):
        whole = next(w for n, _, w in models if n == name)
        options: dict[str, Any] = dict(
            max_batch=max_batch, prefill_chunk=prefill_chunk, paged=paged, progress=progress
        )
        drafts: dict[str, Any] = {}
        if speculative:  # each model's draft: its first layers (sharded like it)
            drafts = {"sharded": draft_model(sharded), "whole": draft_model(whole)}
            options["draft_tokens"] = draft_tokens
        guard = functools.partial(check_in_step, group=group)
        engine = Engine(
            sharded,
            scheme,
            keep_logits=True,
            step_guard=guard,
            draft_model=drafts.get("sharded"),
            **{**options, "progress": False},
        )
        served, results, stats = _serve(engine, first)
        report = check_invariance(sharded, scheme, served, results, prefill_chunk, tolerance=EXACT)
        tokens = [r.tokens for r in results]
        alike = agreed(json.dumps(tokens), group=group)
        same = alike
        single = None
        if rank == 0:
            _, single_results, single = _serve(
                Engine(whole, scheme, draft_model=drafts.get("whole"), **options), first
            )
            same = alike and tokens == [r.tokens for r in single_results]
        failed |= not (same and report.ok)
        if single is not None:
            rows.append(
                [
                    name,
                    scheme.name,
                    str(ranks),
                    str(stats.generated),
                    f"{stats.tokens_per_second:.1f}",
                    f"{single.tokens_per_second:.1f}",
                    str(stats.kv_bytes_per_token),
                    str(single.kv_bytes_per_token),
                    str(stats.peak_kv_bytes),
                    f"{report.max_logit_diff:.1e} ({report.beyond_tolerance} > tol)",
                    verdict(same and report.ok, 0),
                ]
            )
    failed = any_rank(failed, group=group)
    if rank == 0:
        _print_table(rows, TENSOR_PARALLEL_HEADER)
        print(
            f"\ntensor parallel: the model sharded over {ranks} processes (its attention heads"
            " and MLP split; each rank's caches hold its KV heads only), every rank running the"
            " same engine over the same trace. max |dlogit|: the sharded batch against its solo"
            " replays (bit-identical); same tokens: every rank's greedy tokens alike and equal"
            " to one process running the whole model. tok/s on one machine: the ranks share"
            " its cores and add a collective per layer, so expect it slower here; on N"
            " machines each rank reads 1/N of the weights and KV per step."
        )
    return 1 if failed else 0


DISAGGREGATED_SCHEMES = ("plain", "affine4", "turbo")

DISAGGREGATED_HEADER = [
    "model",
    "scheme",
    "roles",
    "generated",
    "tok/s",
    "tok/s 1 process",
    "rows moved",
    "bytes moved",
    "decode batch peak",
    "max |dlogit|",
    "same tokens",
]


def _owned_by_prefill(requests: Sequence[Request], prefill_ranks: Sequence[int]) -> list[int]:
    """Each request's prefill rank (``DisaggregatedRank.serve``: trace order, round robin)."""
    return [prefill_ranks[i % len(prefill_ranks)] for i in range(len(requests))]


def run_disaggregated_demo(
    *,
    model_path: str | None = None,
    schemes: Sequence[str] | None = None,
    requests: int = 12,
    max_batch: int = 8,
    prefill_chunk: int = 16,
    progress: bool = True,
    paged: bool = False,
    roles: str | None = None,
) -> int:
    """The trace (first wave and follow-ups) served disaggregated over the launch's group
    (``mlx.launch -n N``, ``spec/distributed.md`` §7): prefill ranks compute the prompts
    (prefix cache included) and hand the rows to decode ranks, which decode them in their
    running batch. Checked on rank 0: every row's logits against its solo replay through
    the same prefill cuts (bit-identical), and the tokens against one process running the
    engine alone. Rank 0 prints the table and each decode rank's batch over time; every
    rank returns 1 if a check failed."""
    from kvrows.app.disaggregated import (
        DECODE,
        PREFILL,
        DisaggregatedRank,
        gather_texts,
        parse_roles,
        parsed_results,
        results_text,
    )
    from kvrows.app.distributed import any_rank

    del progress  # the engines print no progress bar here (ranks would interleave)
    group = mx.distributed.init()
    rank = group.rank()
    every = parse_roles(roles, group.size())
    prefill_ranks = [r for r, role in enumerate(every) if role == PREFILL]
    label = f"{len(prefill_ranks)}P+{every.count(DECODE)}D"
    rows: list[list[str]] = []
    timelines: list[str] = []
    failed = False
    doing = "the trace disaggregated, its solo replays, then one process"
    for name, model, first, scheme in _cells(
        _models(model_path),
        list(schemes or DISAGGREGATED_SCHEMES),
        requests,
        None,
        doing,
        announce=rank == 0,
    ):
        options: dict[str, Any] = dict(
            max_batch=max_batch, prefill_chunk=prefill_chunk, paged=paged
        )
        node = DisaggregatedRank(Engine(model, scheme, keep_logits=True, **options), every, group)
        started = time.perf_counter()
        served: list[Request] = []
        results: list[RequestResult] = []
        wave = list(first)
        for _ in range(2):  # the first wave, then its follow-ups
            mine = node.serve(wave)
            texts = gather_texts(results_text(mine, node.prefill_steps), group=group)
            got = parsed_results(texts, wave)
            served += wave
            results += got
            wave = follow_ups(got, wave) if len(served) == len(wave) else []
        seconds = time.perf_counter() - started
        moved = gather_texts(
            json.dumps([node.transfers, node.bytes_moved] if every[rank] == PREFILL else [0, 0]),
            group=group,
        )
        lines = gather_texts(node.timeline() if every[rank] == DECODE else "", group=group)
        peaks = gather_texts(str(max(node.batch, default=0)), group=group)
        ok = True
        if rank == 0:
            report = InvarianceReport()
            owners = _owned_by_prefill(first, prefill_ranks) + _owned_by_prefill(
                served[len(first) :], prefill_ranks
            )
            for source in prefill_ranks:  # each prefill rank's prefix cache is its own
                picked = [i for i, owner in enumerate(owners) if owner == source]
                part = check_invariance(
                    model,
                    scheme,
                    [served[i] for i in picked],
                    [results[i] for i in picked],
                    prefill_chunk,
                    tolerance=MODEL_TOLERANCES.get(name, EXACT),
                )
                report.max_logit_diff = max(report.max_logit_diff, part.max_logit_diff)
                report.steps += part.steps
                report.beyond_tolerance += part.beyond_tolerance
                report.mismatches += part.mismatches
                report.near_ties += part.near_ties
            _, single_results, single = _serve(Engine(model, scheme, **options), first)
            same = [r.tokens for r in results] == [r.tokens for r in single_results]
            ok = same and report.ok
            generated = sum(len(r.tokens) for r in results)
            sent = [json.loads(text) for text in moved]
            rows.append(
                [
                    name,
                    scheme.name,
                    label,
                    str(generated),
                    f"{generated / seconds:.1f}",
                    f"{single.tokens_per_second:.1f}",
                    f"{len(served)} in {sum(t for t, _ in sent)} transfers",
                    str(sum(b for _, b in sent)),
                    str(max(int(p) for p in peaks)),
                    f"{report.max_logit_diff:.1e} ({report.beyond_tolerance} > tol)",
                    verdict(ok, 0),
                ]
            )
            timelines += [f"{name} {scheme.name}: {line}" for line in lines if line]
        failed |= not ok
    failed = any_rank(failed, group=group)
    if rank == 0:
        _print_table(rows, DISAGGREGATED_HEADER)
        print("\ndecode ranks' batches over time:")
        for line in timelines:
            print(f"  {line}")
        print(
            f"\ndisaggregated prefill ({', '.join(f'rank {r} {x}' for r, x in enumerate(every))}"
            f"{', paged' if paged else ''}): prefill ranks compute each prompt (their prefix"
            " cache included) and sample its first token; the row's caches move to a decode"
            " rank (the transfer's bytes: the stored form, codes encoded), which merges it"
            " into its running batch. max |dlogit|: every row against its solo replay through"
            " the prefill rank's cuts (bit-identical); same tokens: equal to one process"
            " running the engine alone. tok/s on one machine: the ranks share its cores and"
            " meet once per step, so expect it slower here; apart, prefill and decode would"
            " stop taking each other's compute."
        )
    return 1 if failed else 0
