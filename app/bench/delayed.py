"""Delayed quantization (``quantized_kv_start``): per-row conversion against whole-cache
conversion and the solo runs, on one model, scheme and trace, at each start ``N``.

Three ways to run the same requests (arrivals staggered, so rows join while others run):

1. ``per-row``: the engine under the scheme with ``quantized_kv_start = N``: rows live in
   delayed layouts and each converts when its own offset reaches ``N`` (prefill chunks cut
   there), as its solo run does;
2. ``whole-cache``: mlx-lm's way, as an engine policy used only here
   (:class:`WholeCacheEngine`): every layer is plain until the **batch**'s offset (its
   longest row) reaches ``N``, then the whole layer converts at once (``to_quantized``, what
   mlx-lm's ``maybe_quantize_kv_cache`` does to one cache), in the prefill cohort and in
   the running batch alike; a row that joins a converted batch is quantized as it joins. So
   rows convert at the batch's step, not at their own offset;
3. ``solo``: each request alone through its serial bf16-first caches (legos), prefill
   chunks cut at ``N``: the oracle (bit-identical to mlx-lm's ``generate_step`` with
   ``quantized_kv_start = N``, ``tests/test_lego.py``).

Reported per run: peak KV bytes (``EngineStats.peak_kv_bytes``: the layouts' ``nbytes`` at
step boundaries, capacity slack included; solo: the largest ``nbytes`` of one request's
caches) and ``mx.get_peak_memory()`` over the run (weights and activations included),
prefill and decode tokens per second, and each request's max |Δlogit| against its solo run
teacher-forced with the run's own tokens, with the steps whose greedy token differs from
the solo run's argmax. The per-row run must match the solo runs (tokens equal, |Δlogit|
within ``TOLERANCE``): a difference is a wrong result.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.app.bench.runner import BenchCheckError, Case, Family, Line, Table, Timing, Workload
from kvrows.app.demo import solo_logits
from kvrows.app.engine import Engine, EngineStats, Request, RequestResult, _Row
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.compositions import affine_counterpart
from kvrows.maintenance import create_kv_maintenance
from kvrows.protocols import BatchableCache
from kvrows.schemes import CodecSpec, KvStorageScheme, Plain

__all__ = ["SoloRun", "WholeCacheEngine", "compare", "family", "solo_run", "trace"]

#: Per-row conversion against the solo run: float32 rounding of batched vs solo sums.
TOLERANCE = 1e-4
SCHEME = "affine4:64"


def _converts_whole(codec: CodecSpec) -> bool:
    """Whether mlx-lm converts a whole layer to ``codec``: a plain storage's
    ``to_quantized`` reaches the codec of its counterpart in the composition table only."""
    counterpart = affine_counterpart("KVCache")
    return counterpart is not None and codec.kind == counterpart.codec


class WholeCacheEngine(Engine):
    """The engine with mlx-lm's conversion rule instead of per-row conversion (bench only).

    Every layer the scheme quantizes starts plain; after each prefill chunk, decode step and
    join, a layout whose longest row holds ``quantized_kv_start`` tokens or more (and at
    least one) becomes its affine counterpart (``to_quantized``: every row, whatever its own
    offset). Rows joining a converted layout are converted as they join. The scheme's other
    parameters are the engine's."""

    def __init__(self, model: Any, scheme: KvStorageScheme, **options: Any) -> None:
        start = scheme.quantized_kv_start
        if start is None:
            raise ValueError("whole-cache conversion needs a scheme with quantized_kv_start")
        plain = KvStorageScheme()
        super().__init__(model, plain, **options)
        self.convert_at = start
        count = len(make_kvrows_cache(model, plain))
        self.codecs = [scheme.codec_for_layer(i, count) for i in range(count)]

    def _due(self, layout: BatchableCache, codec: CodecSpec) -> bool:
        if not _converts_whole(codec) or getattr(layout, "codec_spec", None) != Plain():
            return False
        longest = max((int(t) for t in getattr(layout, "row_offsets", ())), default=0)
        return longest > 0 and longest >= self.convert_at

    def _convert(self, layouts: list[BatchableCache]) -> None:
        """Convert, in place, every layer of ``layouts`` that is due (the whole layer)."""
        if not layouts or layouts[0].batch_size == 0:
            return
        for index, (layout, codec) in enumerate(zip(layouts, self.codecs, strict=True)):
            if self._due(layout, codec):
                layouts[index] = layout.to_quantized(**codec.parameters())  # type: ignore[attr-defined]

    def _join(
        self, layouts: list[BatchableCache], rows: list[_Row], *, prefill: bool
    ) -> list[BatchableCache]:
        # A layer whose batch or any joining row is converted converts whole: the layout
        # and every joining row (mlx-lm holds one cache per layer, one codec for all rows).
        held = bool(layouts) and layouts[0].batch_size > 0
        for index, codec in enumerate(self.codecs):
            if not _converts_whole(codec):
                continue
            members = [row.caches[index] for row in rows]
            if held:
                members.append(layouts[index])
            if not any(getattr(m, "codec_spec", None) == codec for m in members):
                continue
            if held and getattr(layouts[index], "codec_spec", None) == Plain():
                layouts[index] = layouts[index].to_quantized(**codec.parameters())  # type: ignore[attr-defined]
            for row in rows:
                if getattr(row.caches[index], "codec_spec", None) == Plain():
                    row.caches[index] = row.caches[index].to_quantized(  # type: ignore[attr-defined]
                        **codec.parameters()
                    )
        made = super()._join(layouts, rows, prefill=prefill)
        self._convert(made)
        return made

    def _prefill_chunk(self, cohort: list[_Row], layouts: list[BatchableCache]) -> list[_Row]:
        done = super()._prefill_chunk(cohort, layouts)
        self._convert(layouts)
        return done

    def _decode_step(self, running: list[_Row], layouts: list[BatchableCache]) -> list[_Row]:
        leaving = super()._decode_step(running, layouts)
        self._convert(layouts)
        return leaving


@dataclass
class Run:
    """One way of running the trace: what it produced and measured."""

    results: list[RequestResult]
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    peak_kv_bytes: int = 0
    peak_memory: int = 0
    #: Per request: max |Δlogit| against the solo run, and steps whose token differs.
    deltas: list[float] = field(default_factory=list)
    mismatches: int = 0


@dataclass
class SoloRun:
    """One request alone: its result (tokens, logits, chunks), its timings and peak bytes."""

    result: RequestResult
    prefill_seconds: float
    decode_seconds: float
    peak_kv_bytes: int


def solo_run(model: Any, scheme: KvStorageScheme, request: Request, chunk: int) -> SoloRun:
    """``request`` alone through its serial caches (legos), greedy, prefill chunks cut at
    the conversion boundary; each step evaluated, so the times are the work's."""
    caches = make_kvrows_cache(model, scheme)
    maintenance = create_kv_maintenance(scheme)
    result = RequestResult(request.rid, len(request.prompt))
    peak = 0
    started = time.perf_counter()
    fed = 0
    logits = None
    while fed < len(request.prompt):
        n = int(min(chunk, len(request.prompt) - fed, maintenance.max_append_tokens(caches)))
        logits = model(mx.array([list(request.prompt[fed : fed + n])]), cache=caches)
        mx.eval(logits, [c.held_arrays() for c in caches])
        peak = max(peak, sum(c.nbytes for c in caches))
        result.prefill_chunks.append(n)
        fed += n
    assert logits is not None
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for step in range(request.max_tokens):
        last = logits[0, -1].astype(mx.float32)
        token: int = mx.argmax(last).item()  # type: ignore[assignment]
        result.logits.append(np.array(last))
        result.tokens.append(token)
        if step + 1 < request.max_tokens:
            logits = model(mx.array([[token]]), cache=caches)
            mx.eval(logits, [c.held_arrays() for c in caches])
            peak = max(peak, sum(c.nbytes for c in caches))
    return SoloRun(result, prefill, time.perf_counter() - started, peak)


def _engine_run(engine: Engine, requests: Sequence[Request]) -> Run:
    mx.eval(mx.zeros(1))
    mx.reset_peak_memory()
    results, stats = engine.run(requests)
    return _from_stats(results, stats, mx.get_peak_memory())


def _from_stats(results: list[RequestResult], stats: EngineStats, peak_memory: int) -> Run:
    return Run(
        results,
        prefill_tokens=stats.prefill_tokens,
        prefill_seconds=stats.prefill_seconds,
        decode_tokens=stats.decode_tokens,
        decode_seconds=max(stats.seconds - stats.prefill_seconds, 1e-9),
        peak_kv_bytes=stats.peak_kv_bytes,
        peak_memory=peak_memory,
    )


def _solo_runs(model: Any, scheme: KvStorageScheme, requests: Sequence[Request], chunk: int) -> Run:
    mx.eval(mx.zeros(1))
    mx.reset_peak_memory()
    solos = [solo_run(model, scheme, request, chunk) for request in requests]
    run = Run([solo.result for solo in solos], peak_memory=mx.get_peak_memory())
    for request, solo in zip(requests, solos, strict=True):
        run.prefill_tokens += len(request.prompt)
        run.prefill_seconds += solo.prefill_seconds
        run.decode_tokens += len(solo.result.tokens) - 1
        run.decode_seconds += solo.decode_seconds
        run.peak_kv_bytes = max(run.peak_kv_bytes, solo.peak_kv_bytes)
    return run


def compare(
    model: Any, scheme: KvStorageScheme, requests: Sequence[Request], run: Run, chunk: int
) -> None:
    """Fill ``run.deltas`` / ``run.mismatches``: each request against its solo lego run
    driven with the run's own chunk cuts and teacher-forced with its tokens (the chunks
    matter with ``start == 0``: a lego reads its first append in plain precision)."""
    run.deltas, run.mismatches = [], 0
    for request, result in zip(requests, run.results, strict=True):
        solo = solo_logits(model, scheme, request, result.tokens, chunk, cuts=result.prefill_chunks)
        run.deltas.append(
            max(float(np.abs(a - b).max()) for a, b in zip(result.logits, solo, strict=True))
        )
        run.mismatches += sum(
            int(np.argmax(s)) != t for s, t in zip(solo, result.tokens, strict=True)
        )


def trace(*, quick: bool = False, vocab: int = 256) -> list[Request]:
    """Prompt lengths on both sides of every start, staggered arrivals (rows join while
    others run), outputs long enough for short prompts to cross the small starts."""
    shapes = (
        [(5, 12, 0), (30, 8, 0), (12, 16, 2)]
        if quick
        else [
            (24, 48, 0),
            (80, 24, 0),
            (560, 24, 1),
            (200, 32, 2),
            (48, 40, 4),
            (530, 16, 6),
            (120, 24, 8),
        ]
    )
    rng = np.random.default_rng(11)
    return [
        Request(f"r{i}", tuple(int(t) for t in rng.integers(0, vocab, length)), tokens, arrival)
        for i, (length, tokens, arrival) in enumerate(shapes)
    ]


#: The table's columns (a run that produced nothing shows "-" in all but the first two).
HEADER = (
    "start",
    "run",
    "peak KV B",
    "peak mem B",
    "prefill tok/s",
    "decode tok/s",
    "max |dlogit|",
    "token mismatches",
    "trace ms",
)


def _case(
    model: Any,
    scheme: KvStorageScheme,
    requests: list[Request],
    *,
    max_batch: int,
    chunk: int,
) -> Case:
    start = scheme.quantized_kv_start
    seen: dict[str, Run] = {}
    options: dict[str, Any] = {
        "max_batch": max_batch,
        "prefill_chunk": chunk,
        "keep_logits": True,
        "use_prefix_cache": False,
    }

    def checked(name: str) -> Any:
        def check(run: Run) -> None:
            if name != "solo":
                compare(model, scheme, requests, run, chunk)
            seen[name] = run
            if name == "per-row" and (run.mismatches or max(run.deltas) > TOLERANCE):
                raise BenchCheckError(
                    f"per-row conversion differs from the solo runs: {run.mismatches} tokens, "
                    f"max |dlogit| {max(run.deltas):.2e} (tolerance {TOLERANCE:g})"
                )

        return check

    workloads = {
        "per-row": Workload(
            "run",
            "per-row",
            start,
            0,
            lambda: Engine(model, scheme, **options),
            lambda engine: _engine_run(engine, requests),
            checked("per-row"),
        ),
        "whole-cache": Workload(
            "run",
            "whole-cache",
            start,
            0,
            lambda: WholeCacheEngine(model, scheme, **options),
            lambda engine: _engine_run(engine, requests),
            checked("whole-cache"),
        ),
        "solo": Workload(
            "run",
            "solo",
            start,
            0,
            lambda: None,
            lambda _: _solo_runs(model, scheme, requests, chunk),
            checked("solo"),
        ),
    }

    def lines(timings: Mapping[str, Timing]) -> list[Line]:
        out: list[Line] = []
        for name in workloads:
            line = {"start": str(start), "run": name}
            run = seen.get(name)
            if run is None:
                out.append(line | dict.fromkeys(HEADER[2:], "-"))
                continue
            deltas = "0 (oracle)" if name == "solo" else f"{max(run.deltas):.1e}"
            out.append(
                line
                | {
                    "peak KV B": str(run.peak_kv_bytes),
                    "peak mem B": str(run.peak_memory),
                    "prefill tok/s": f"{run.prefill_tokens / max(run.prefill_seconds, 1e-9):.0f}",
                    "decode tok/s": f"{run.decode_tokens / max(run.decode_seconds, 1e-9):.0f}",
                    "max |dlogit|": deltas,
                    "token mismatches": "-" if name == "solo" else str(run.mismatches),
                    "trace ms": timings[name].cell,
                }
            )
        return out

    return Case(f"delayed start {start}", workloads, lines, key=start)


def family(
    *,
    quick: bool = False,
    starts: Sequence[int] | None = None,
    scheme: str = SCHEME,
    max_batch: int = 4,
    chunk: int | None = None,
) -> Family:
    """The three ways at each start: (0, 64, 512) on the full trace, (0, 8, 24) quick."""
    chosen = tuple(starts) if starts else ((0, 8, 24) if quick else (0, 64, 512))
    block = chunk or (8 if quick else 64)
    base = KvStorageScheme.parse(scheme)

    def cases() -> Iterator[Case]:
        model = tiny_model("llama")
        requests = trace(quick=quick)
        for start in chosen:
            yield _case(
                model,
                replace(base, quantized_kv_start=start),
                requests,
                max_batch=max_batch,
                chunk=block,
            )

    requests = trace(quick=quick)
    notes = (
        f"the embedded llama (float32, greedy), scheme {base.codec.name}, {len(requests)} "
        f"requests (prompts {min(len(r.prompt) for r in requests)}-"
        f"{max(len(r.prompt) for r in requests)} tokens, staggered arrivals), max batch "
        f"{max_batch}, prefill chunk {block}, prefix cache off.\n"
        "  per-row: delayed layouts, each row converts at its own start (chunks cut there);\n"
        "  whole-cache: mlx-lm's rule, every row of a layer converts when the batch's longest\n"
        "  row reaches the start (to_quantized of the whole layout; joining rows converted);\n"
        "  solo: each request alone through its legos (the oracle). max |dlogit|: the worst\n"
        "  request's logits vs its solo lego run driven with the same chunk cuts and\n"
        "  teacher-forced with the same tokens; token\n"
        "  mismatches: steps whose token is not the solo run's argmax. peak KV B: the layouts'\n"
        "  nbytes at step boundaries (capacity slack included; solo: one request's caches);\n"
        "  peak mem B: mx.get_peak_memory() over the run (weights and activations included)."
    )
    return Family(
        "delayed",
        "per-row vs whole-cache conversion",
        [Table(cases())],
        notes,
        repeats=(1, 1),
        warmups=(0, 0),
    )
