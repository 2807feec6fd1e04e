"""TurboQuant (issue 12): quality against the paper and against plain, bytes per token, and
the cost of one decode step. ``kvrows bench --family turbo``; the figures and their reading
are in ``benchmarks/RESULTS.md``.

Four tables:

* ``values``: the value codec alone (sign flip, Walsh-Hadamard, per-32-group RMS scale,
  Gaussian Lloyd-Max codes) on random unit vectors of R^128: ``E‖x - x̃‖²`` beside the
  paper's Algorithm-1 distortion (0.36, 0.117, 0.03, 0.009 at b = 1..4), the exact Beta
  Lloyd-Max figures at d = 128 (shared/notes/algorithms.md §9.1) and the exact distortion
  of our stored codebook on a unit normal (closed form). 1 bit is not a codec width: its
  row gives the closed form of the 1-bit Gaussian table only. Check: the optimized codec's
  codes and scales equal the NumPy reference's, bit for bit.
* ``bytes``: bytes per token per KV head at D = 128 of every scheme, from the codecs'
  plane specs (``codec_token_bytes``). Check: a storage of each scheme holding 8 tokens
  holds exactly 8 times that many bytes in its planes.
* ``quality``: the embedded tiny models (``tiny_model``: llama, gemma3) teacher-forced over
  a random prompt (chunks of 64 tokens, the last tokens one at a time as decode steps),
  each scheme against mlx-lm's own plain caches: KL(plain || scheme) of every position's
  next-token distribution, top-1 agreement, and the relative L2 error of decode attention
  output, layer by layer in isolation (the plain run's queries, keys and values of each
  full-attention layer stored by the scheme, each position attending its stored
  prefix). The seed's MiniCPM-1B figures stand beside. Checks: kvrows' plain scheme
  reproduces mlx-lm's logits; TurboQuant's deferred-V attention (rotated values, output
  un-rotated) matches the eager path (values decoded first).
* ``decode``: one decode step's attention over a live ragged batch (``B`` rows, ``L`` down
  to ``L/2`` tokens, 8 KV heads, 32 query heads, D = 128, bfloat16): plain, affine 8/4 and
  TurboQuant (deferred; the eager path, every stored value un-rotated, beside it for
  k8v3). Check: each checked row's output against float32 NumPy attention over the
  tokens the reference codec decodes.
"""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

import kvrows.optimized as optimized
from kvrows.app.attention import attention_scope, hookable_modules
from kvrows.app.bench.plain import BenchData, Shape, reference_attention
from kvrows.app.bench.runner import (
    NP,
    BenchCheckError,
    Case,
    Family,
    Line,
    Table,
    Timing,
    Workload,
    check_equal,
    format_gbps,
    ratio,
    to_numpy,
)
from kvrows.app.models import tiny_model
from kvrows.codec import TURBO_GROUP, Codec, Role, codec_token_bytes
from kvrows.compositions import composition, serial_for_peer
from kvrows.optimized import turbo_codec as optimized_codec
from kvrows.optimized.codecs import make_codec
from kvrows.optimized.codecs.common import sdpa
from kvrows.reference import codecs as reference_codecs
from kvrows.reference import turbo_codec as reference_codec
from kvrows.schemes import TURBO_VALUE_BITS, CodecSpec, Growing, KvStorageScheme
from kvrows.turbo_tables import BOUNDARIES, CENTROIDS

# mlx-lm's attention helpers, untyped: reached through Any.
lm_base: Any = importlib.import_module("mlx_lm.models.base")

__all__ = [
    "BETA_DISTORTION",
    "BYTES_SCHEMES",
    "DECODE_STORAGES",
    "PAPER_DISTORTION",
    "PARTS",
    "QUALITY_SCHEMES",
    "SEED_KL",
    "DecodeBench",
    "QualityRun",
    "TurboShapes",
    "ValueBench",
    "family",
    "gaussian_distortion",
    "kl_divergence",
    "scheme_bytes",
]

#: The paper's Algorithm-1 (TurboQuant_mse) distortion ``E‖x - x̃‖²`` of unit vectors,
#: b = 1..4 (Theorem 1, arXiv 2504.19874).
PAPER_DISTORTION = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}
#: Exact Beta(d = 128) Lloyd-Max distortion (shared/notes/algorithms.md §9.1).
BETA_DISTORTION = {1: 0.3609, 2: 0.1160, 3: 0.0340, 4: 0.0093}
#: Value widths the table reports: 1 is not a codec width (the row says so).
VALUE_ROWS = (1, *TURBO_VALUE_BITS)
#: The seed engine's teacher-forced KL on MiniCPM 1B (shared/notes/semantics.md).
SEED_KL = {"affine8:64": 0.0025, "turbo-k8v4": 0.0094, "turbo-k8v3": 0.0325, "affine4:64": 0.052}

#: Schemes of the bytes table (every codec the engine stores, at D = 128).
BYTES_SCHEMES = (
    "plain",
    "affine8:64",
    "affine8:32",
    "affine4:64",
    "affine4:32",
    "turbo:k8v8",
    "turbo:k8v5",
    "turbo:k8v4",
    "turbo:k8v3",
    "turbo:k5v3",
    "turbo:k4v4",
    "turbo:k4v3",
    "turbo:k4v2",
    "turbo:k2v2",
    "mxfp8",
    "mxfp4",
    "nvfp4",
)
#: Schemes of the quality table ("turbo" is k8v3).
QUALITY_SCHEMES = (
    "plain",
    "affine8",
    "affine4",
    "turbo:k8v8",
    "turbo:k8v4",
    "turbo",
    "turbo:k4v3",
    "turbo:k4v2",
    "mxfp8",
    "mxfp4",
    "nvfp4",
)
#: Storages of the decode table; the eager path is timed for the first TurboQuant one.
DECODE_STORAGES = ("plain", "affine8", "affine4", "turbo", "turbo:k8v4", "turbo:k4v3")

#: Activation dtype of the bytes and decode tables.
DTYPE = "bfloat16"
#: Head dim of the values and bytes tables (the paper's d).
DIM = 128
#: Largest relative L2 error of a checked decode row against float32 NumPy over the same
#: decoded tokens (bfloat16 reads; a wrong row, order or mask is off by 30% or more).
DECODE_TOLERANCE = 0.02
#: Deferred-V against eager attention: both read bfloat16, rounded before (eager) or
#: after (deferred) the un-rotation, so they differ by bfloat16 rounding only (~1e-3);
#: a wrong sign or a skipped un-rotation is off by order 1.
DEFERRED_TOLERANCE = 0.02
#: kvrows' plain scheme against mlx-lm's own caches: the same float32 computation.
PLAIN_LOGIT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class TurboShapes:
    """The sizes of one run: value vectors; the teacher-forced prompt (tokens, prefill
    chunk, trailing decode steps), its models and the positions whose attention is
    measured; the decode-attention shape."""

    vectors: int
    tokens: int
    chunk: int
    decode_steps: int
    models: tuple[str, ...]
    decode: Shape
    samples: int = 64


#: ``kvrows bench --family turbo``. The decode step runs at L = 1024, not the issue's
#: 4096: the TurboQuant read takes seconds per step there on a shared 2-core CPU, and the
#: family must stay under two minutes (RESULTS.md gives one L = 4096 run beside).
FULL_TURBO = TurboShapes(
    vectors=4096,
    tokens=512,
    chunk=64,
    decode_steps=16,
    models=("llama", "gemma3"),
    decode=Shape(16, 1024, dtype=DTYPE),
)
#: ``--quick``: a smoke run.
QUICK_TURBO = TurboShapes(
    vectors=512,
    tokens=96,
    chunk=32,
    decode_steps=4,
    models=("llama", "gemma3"),
    decode=Shape(4, 128, dtype=DTYPE),
)


def _codec(name: str) -> CodecSpec:
    return KvStorageScheme.parse(name).codec


# -- values ---------------------------------------------------------------------------------


def gaussian_distortion(centroids: Sequence[float], boundaries: Sequence[float]) -> float:
    """``E (Z - c(Z))²`` for ``Z ~ N(0, 1)`` under the scalar quantizer (cell ``i`` between
    consecutive ``boundaries``, value ``centroids[i]``), in closed form."""
    if len(boundaries) != len(centroids) - 1:
        raise ValueError(f"{len(centroids)} centroids need {len(centroids) - 1} boundaries")

    def pdf(z: float) -> float:
        return 0.0 if math.isinf(z) else math.exp(-z * z / 2) / math.sqrt(2 * math.pi)

    def cdf(z: float) -> float:
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    def z_pdf(z: float) -> float:  # z·φ(z), 0 at ±inf
        return 0.0 if math.isinf(z) else z * pdf(z)

    edges = [-math.inf, *boundaries, math.inf]
    total = 0.0
    for c, a, b in zip(centroids, edges[:-1], edges[1:], strict=True):
        mass = cdf(b) - cdf(a)
        first = pdf(a) - pdf(b)  # ∫ z φ
        second = mass + z_pdf(a) - z_pdf(b)  # ∫ z² φ
        total += second - 2 * c * first + c * c * mass
    return total


def codebook_distortion(bits: int) -> float:
    """The Gaussian distortion of the stored ``bits``-bit table; 1 bit: ``±√(2/π)``."""
    if bits == 1:
        return gaussian_distortion((-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)), (0.0,))
    return gaussian_distortion(CENTROIDS[bits], BOUNDARIES[bits])


@dataclass
class ValueResult:
    """One width's measurement: mean squared error and mean squared norm of ``x̃``."""

    mse: float
    norm2: float


class ValueBench:
    """The value codec on ``vectors`` random unit vectors of R^``dim`` (float32)."""

    def __init__(self, vectors: int, dim: int = DIM, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((vectors, dim)).astype(np.float32)
        self.x: NP = x / np.linalg.norm(x, axis=1, keepdims=True)
        self.results: dict[int, ValueResult] = {}

    def workload(self, bits: int) -> Workload:
        """Encode and decode every vector with the optimized codec; the check compares its
        codes and scales with the reference's and records the error."""

        def run(x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
            packed, scales = optimized_codec.encode_values(x, bits)
            decoded = optimized_codec.decode_values(packed, scales, bits)
            mx.eval(packed, scales, decoded)
            return packed, scales, decoded

        def check(result: tuple[mx.array, mx.array, mx.array]) -> None:
            packed, scales, decoded = (to_numpy(a) for a in result)
            ref_packed, ref_scales = reference_codec.encode_values(self.x, bits)
            if not np.array_equal(packed, ref_packed):
                raise BenchCheckError(f"values {bits}-bit: codes differ from the reference's")
            if not np.array_equal(scales.view(np.uint16), ref_scales.view(np.uint16)):
                raise BenchCheckError(f"values {bits}-bit: scales differ from the reference's")
            error = np.sum((decoded.astype(np.float64) - self.x) ** 2, axis=1)
            norm2 = np.sum(decoded.astype(np.float64) ** 2, axis=1)
            self.results[bits] = ValueResult(float(error.mean()), float(norm2.mean()))

        return Workload(
            "values",
            f"{bits}-bit",
            self.x.shape,
            self.x.nbytes,
            lambda: mx.array(self.x),
            run,
            check,
        )


def _value_cases(vectors: int) -> Iterator[Case]:
    bench = ValueBench(vectors)
    workloads = {f"{bits}": bench.workload(bits) for bits in TURBO_VALUE_BITS}

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        out = []
        for bits in VALUE_ROWS:
            paper = PAPER_DISTORTION.get(bits)
            beta = BETA_DISTORTION.get(bits)
            result = bench.results.get(bits)
            measured = (
                "not a width" if bits == 1 else "-" if result is None else f"{result.mse:.4f}"
            )
            overhead = 16 / TURBO_GROUP  # one float16 scale per group
            out.append(
                {
                    "v_bits": str(bits),
                    "MSE": measured,
                    "paper": "-" if paper is None else f"{paper:g}",
                    "Beta LM d=128": "-" if beta is None else f"{beta:.4f}",
                    "Gaussian LM": f"{codebook_distortion(bits):.4f}",
                    "bound": f"{math.sqrt(3) * math.pi / 2 * 4.0**-bits:.4f}",
                    "MSE/paper": ratio(result.mse if result else None, paper),
                    "E norm(x~)^2": "-" if result is None else f"{result.norm2:.4f}",
                    "bits/coord": f"{bits + overhead:g}",
                    "ms": "-" if bits == 1 else t[str(bits)].cell,
                }
            )
        return out

    yield Case(f"values x{vectors}", workloads, lines)


# -- bytes ----------------------------------------------------------------------------------


def scheme_bytes(name: str, dim: int = DIM, dtype: str = DTYPE) -> tuple[int, int]:
    """Bytes of one token's keys and values, one KV head of ``dim``, under scheme ``name``."""
    codec = _codec(name)
    return (
        codec_token_bytes(codec, 1, dim, dtype, "keys"),
        codec_token_bytes(codec, 1, dim, dtype, "values"),
    )


def _serial(codec: CodecSpec) -> Any:
    """A fresh serial full-attention storage of ``codec``."""
    entry = serial_for_peer("KVCache", codec)
    return getattr(optimized, entry.name).from_specs(codec, Growing())


def _defers_values(codec: CodecSpec) -> bool:
    """Whether ``codec``'s reads hold values its attention finishes (TurboQuant's rotated
    values): the codecs with an eager path to measure the deferred one against."""
    return make_codec(codec).defers_values


def _eager_attention(
    codec: Codec, queries: mx.array, key_planes: Any, value_planes: Any, mask: Any, scale: float
) -> mx.array:
    """The eager oracle of ``codec.attend``: keys and values fully decoded (bfloat16, as a
    read returns them), then SDPA."""
    keys = codec.decode(key_planes, "keys").astype(mx.bfloat16)
    values = codec.decode(value_planes, "values").astype(mx.bfloat16)
    out: mx.array = sdpa(queries, keys, values, mask, scale)
    return out


def _stored_bytes(cache: Any) -> int:
    held = cache.planes()
    planes = [*held[0], *held[1]] if isinstance(held[0], tuple) else [*held]
    return sum(int(p.nbytes) for p in planes)


def _bytes_cases(schemes: Sequence[str]) -> Iterator[Case]:
    tokens = 8
    block = mx.random.normal((1, 1, tokens, DIM), key=mx.random.key(5)).astype(mx.bfloat16)

    def workload(name: str) -> Workload:
        def run(_: None) -> int:
            cache = _serial(_codec(name))
            cache.update_and_fetch(block, block)
            mx.eval(cache.held_arrays())
            return _stored_bytes(cache)

        def check(held: int) -> None:
            check_equal(
                f"bytes {name}: planes of {tokens} tokens", held, tokens * sum(scheme_bytes(name))
            )

        return Workload("bytes", name, None, 0, lambda: None, run, check)

    workloads = {name: workload(name) for name in schemes}
    plain = sum(scheme_bytes("plain"))

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        out = []
        for name in schemes:
            keys, values = scheme_bytes(name)
            total = keys + values
            out.append(
                {
                    "scheme": _codec(name).name,
                    "K B": str(keys),
                    "V B": str(values),
                    "K+V B": str(total),
                    "bits/elt": f"{8 * total / (2 * DIM):.3g}",
                    "x smaller": f"{plain / total:.2f}",
                    "checked": "yes" if t[name].ms is not None else t[name].cell,
                }
            )
        return out

    yield Case("bytes", workloads, lines)


# -- quality ----------------------------------------------------------------------------------


def kl_divergence(reference: NP, other: NP) -> NP:
    """``KL(softmax(reference) || softmax(other))`` per row of ``[N, V]`` logits (float64)."""
    p_log = _log_softmax(reference.astype(np.float64))
    q_log = _log_softmax(other.astype(np.float64))
    out: NP = np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)
    return out


def _log_softmax(x: NP) -> NP:
    shifted = x - x.max(axis=-1, keepdims=True)
    out: NP = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return out


@dataclass
class LayerRecord:
    """One full-attention layer of the plain run: the queries of the sampled positions,
    the keys and values the layer stored, its attention scale, and the mask letting each
    sampled position see its prefix (``[P, T]`` boolean)."""

    queries: mx.array
    keys: mx.array
    values: mx.array
    scale: float
    mask: mx.array


@dataclass
class PlainRecord:
    """The plain run of one model: logits ``[T, V]`` and its full-attention layers."""

    logits: NP
    layers: dict[int, LayerRecord]
    seconds: float
    #: The positions whose attention is recorded.
    positions: list[int]

    def uniform_peak(self) -> float:
        """The mean largest weight of uniform attention rows at the recorded positions."""
        return float(np.mean([1 / (p + 1) for p in self.positions]))

    def attention_peak(self) -> float:
        """Mean over full layers, heads and positions of the largest attention weight."""
        peaks = []
        for layer in self.layers.values():
            q, k = layer.queries, layer.keys
            group = q.shape[1] // k.shape[1]
            k = mx.repeat(k, group, axis=1)
            scores = (q @ k.swapaxes(-1, -2)) * layer.scale
            weights = mx.softmax(mx.where(layer.mask, scores, -mx.inf), axis=-1)
            peaks.append(float(np.array(mx.mean(mx.max(weights, axis=-1)))))
        return float(np.mean(peaks)) if peaks else math.nan


@contextmanager
def _recording(
    model: Any, caches: Sequence[Any], into: dict[int, list[tuple[Any, ...]]]
) -> Iterator[None]:
    """While open, every attention call of ``model`` over one of ``caches`` is recorded in
    ``into[layer]`` as ``(queries, keys, values, scale)`` (then computed unchanged)."""
    modules = hookable_modules(model)
    name = "scaled_dot_product_attention"
    originals = {getattr(module, name) for module in modules}
    if len(originals) != 1:
        raise BenchCheckError(f"{type(model).__name__}: expected one attention function to record")
    (original,) = originals
    index = {id(cache): i for i, cache in enumerate(caches)}

    def record(
        queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None
    ) -> Any:
        layer = index.get(id(cache))
        if layer is not None:
            mx.eval(queries)
            into.setdefault(layer, []).append((queries, keys, values, scale))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    for module in modules:
        setattr(module, name, record)
    try:
        yield
    finally:
        for module in modules:
            setattr(module, name, original)


def _feed(
    model: Any, caches: Sequence[Any], prompt: Sequence[int], chunk: int, decode_steps: int
) -> NP:
    """Every position's next-token logits ``[T, V]`` float32: the prompt in chunks of
    ``chunk``, its last ``decode_steps`` tokens one at a time."""
    cut = len(prompt) - decode_steps
    pieces = [prompt[i : min(i + chunk, cut)] for i in range(0, cut, chunk)]
    pieces += [prompt[i : i + 1] for i in range(cut, len(prompt))]
    out = []
    for piece in pieces:
        with attention_scope(model, caches):
            logits = model(mx.array([list(piece)]), cache=caches)
        out.append(np.array(logits[0].astype(mx.float32)))
    return np.concatenate(out, axis=0)


def _prompt(tokens: int, vocab: int, seed: int = 3) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, vocab, tokens)]


def sampled_positions(tokens: int, samples: int) -> list[int]:
    """``samples`` positions spread evenly over ``tokens``, the last one included."""
    stride = max(1, tokens // max(1, samples))
    return list(range(tokens - 1, -1, -stride))[::-1][-samples:]


def plain_record(
    model: Any, prompt: Sequence[int], chunk: int, decode_steps: int, samples: int = 64
) -> PlainRecord:
    """The prompt through mlx-lm's own caches, its full-attention layers recorded at
    ``samples`` positions (a whole causal attention per layer costs seconds on the CPU)."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    full = [c if not isinstance(c, RotatingKVCache) else None for c in caches]
    calls: dict[int, list[tuple[Any, ...]]] = {}
    started = time.perf_counter()
    with _recording(model, [c for c in full if c is not None], calls):
        logits = _feed(model, caches, prompt, chunk, decode_steps)
    seconds = time.perf_counter() - started
    order = [i for i, c in enumerate(full) if c is not None]
    positions = sampled_positions(len(prompt), samples)
    picked = mx.array(positions)
    mask = mx.arange(len(prompt))[None, :] <= picked[:, None]
    layers = {}
    for position, recorded in calls.items():
        queries = mx.concatenate([call[0] for call in recorded], axis=2)[:, :, picked]
        _, keys, values, scale = recorded[-1]  # the last call read every stored token
        mx.eval(queries, keys, values, mask)
        layers[order[position]] = LayerRecord(queries, keys, values, float(scale), mask)
    return PlainRecord(logits, layers, seconds, positions)


@dataclass
class QualityRun:
    """One scheme on one model, against the plain run."""

    scheme: str
    kl_mean: float
    kl_max: float
    top1: float
    attention_mean: float
    attention_max: float
    seconds: float
    #: kvrows' plain against mlx-lm: max |Δlogit| (plain scheme only).
    plain_logit_diff: float | None = None
    #: TurboQuant: deferred-V against eager attention, worst relative L2 (turbo only).
    deferred_vs_eager: float | None = None


def _relative(got: mx.array, expected: mx.array) -> mx.array:
    """Relative L2 error of every ``[..., D]`` vector (float32)."""
    diff = mx.linalg.norm((got - expected).astype(mx.float32), axis=-1)
    return diff / mx.maximum(mx.linalg.norm(expected.astype(mx.float32), axis=-1), 1e-30)


def _layer_attention(codec: CodecSpec, layer: LayerRecord) -> tuple[mx.array, float | None]:
    """The sampled positions' attention over ``layer``'s tokens as ``codec`` stores them,
    and for TurboQuant the deferred path's worst relative distance to the eager one."""
    cache = _serial(codec)
    cache.update_and_fetch(layer.keys, layer.values)
    out = optimized.attend(layer.queries, cache, layer.mask, layer.scale)
    gap = None
    if _defers_values(codec):
        key_planes, value_planes = cache.planes()
        eager = _eager_attention(
            make_codec(codec), layer.queries, key_planes, value_planes, layer.mask, layer.scale
        )
        gap = float(np.array(mx.max(_relative(out, eager))))
    return out, gap


def quality_run(
    model: Any, record: PlainRecord, scheme_name: str, prompt: Sequence[int], chunk: int, steps: int
) -> QualityRun:
    """``scheme_name`` on ``model`` teacher-forced over ``prompt``, against ``record``."""
    from kvrows.app.models import make_kvrows_cache

    scheme = KvStorageScheme.parse(scheme_name)
    started = time.perf_counter()
    logits = _feed(model, make_kvrows_cache(model, scheme), prompt, chunk, steps)
    seconds = time.perf_counter() - started
    kl = kl_divergence(record.logits, logits)
    errors, gaps = [], []
    for layer in record.layers.values():
        expected = mx.fast.scaled_dot_product_attention(
            layer.queries, layer.keys, layer.values, scale=layer.scale, mask=layer.mask
        )
        out, gap = _layer_attention(scheme.codec, layer)
        errors.append(np.array(_relative(out, expected)).ravel())
        if gap is not None:
            gaps.append(gap)
    error = np.concatenate(errors)
    return QualityRun(
        scheme=scheme.name,
        kl_mean=float(kl.mean()),
        kl_max=float(kl.max()),
        top1=float(np.mean(record.logits.argmax(-1) == logits.argmax(-1))),
        attention_mean=float(error.mean()),
        attention_max=float(error.max()),
        seconds=seconds,
        plain_logit_diff=(
            float(np.abs(logits - record.logits).max()) if not scheme.codec.encodes else None
        ),
        deferred_vs_eager=max(gaps) if gaps else None,
    )


def check_quality(run: QualityRun) -> None:
    """Raise ``BenchCheckError`` if ``run`` shows a wrong computation, not a lossy one."""
    figures = (run.kl_mean, run.kl_max, run.attention_mean, run.attention_max)
    if not all(math.isfinite(x) for x in figures):
        raise BenchCheckError(f"quality {run.scheme}: non-finite figures {figures}")
    if run.plain_logit_diff is not None and run.plain_logit_diff > PLAIN_LOGIT_TOLERANCE:
        raise BenchCheckError(
            f"quality {run.scheme}: kvrows' plain caches differ from mlx-lm's by "
            f"{run.plain_logit_diff:.3g} in a logit (tolerance {PLAIN_LOGIT_TOLERANCE:g})"
        )
    if run.deferred_vs_eager is not None and not run.deferred_vs_eager <= DEFERRED_TOLERANCE:
        raise BenchCheckError(
            f"quality {run.scheme}: deferred-V attention is {run.deferred_vs_eager:.3g} "
            f"(relative L2) from the eager path, more than {DEFERRED_TOLERANCE}"
        )


def _quality_cases(shapes: TurboShapes, schemes: Sequence[str]) -> Iterator[Case]:
    for arch in shapes.models:
        yield _quality_case(arch, shapes, schemes)


def _quality_case(arch: str, shapes: TurboShapes, schemes: Sequence[str]) -> Case:
    """Every scheme on model ``arch`` against its plain run (recorded here, untimed)."""
    model = tiny_model(arch)
    vocab = int(model.args.vocab_size)
    prompt = _prompt(shapes.tokens, vocab)
    record = plain_record(model, prompt, shapes.chunk, shapes.decode_steps, shapes.samples)
    runs: dict[str, QualityRun] = {}

    def workload(name: str) -> Workload:
        def run(_: None) -> QualityRun:
            # Measured once: warm-ups and repeats reuse the run (a figure, not a time).
            if name not in runs:
                runs[name] = quality_run(
                    model, record, name, prompt, shapes.chunk, shapes.decode_steps
                )
            return runs[name]

        return Workload("quality", name, arch, 0, lambda: None, run, check_quality)

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        out = []
        for name in schemes:
            run = runs.get(name)
            scheme = _codec(name).name
            if run is None:
                out.append([arch, scheme, *(["-"] * 7), t[name].cell])
                continue
            seed = SEED_KL.get(scheme)
            out.append(
                [
                    arch,
                    scheme,
                    f"{run.attention_mean:.2e}",
                    f"{run.attention_max:.2e}",
                    f"{run.kl_mean:.2e}",
                    f"{run.kl_max:.2e}",
                    f"{100 * run.top1:.1f}",
                    "-" if seed is None else f"{seed:g}",
                    f"{len(prompt) / run.seconds:.0f}",
                    "ok" if t[name].ms is not None else t[name].cell,
                ]
            )
        probabilities = _softmax(record.logits)
        entropy = float(-np.mean(np.sum(probabilities * np.log(probabilities + 1e-300), -1)))
        out.append(
            [
                arch,
                "(plain stats)",
                f"peak w {record.attention_peak():.3f}",
                f"uniform {record.uniform_peak():.3f}",
                f"H {entropy:.2f} nats",
                f"ln V {math.log(vocab):.2f}",
                "-",
                "-",
                f"{len(prompt) / record.seconds:.0f}",
                "mlx-lm",
            ]
        )
        return [dict(zip(QUALITY_HEADER, line, strict=True)) for line in out]

    return Case(f"quality {arch}", {name: workload(name) for name in schemes}, lines)


def _softmax(x: NP) -> NP:
    out: NP = np.exp(_log_softmax(x.astype(np.float64)))
    return out


# -- decode ---------------------------------------------------------------------------------


def _layout(codec: CodecSpec) -> Any:
    """The decode layout a batch of ``codec`` rows runs in: the decode role of its serial
    full-attention storage in the composition table."""
    roles = serial_for_peer("KVCache", codec).roles
    if roles is None:
        raise ValueError(f"no decode layout batches {codec.name} rows")
    decode = composition(roles.decode)
    return getattr(optimized, decode.name).from_specs(codec, Growing())


def _decoded(codec: CodecSpec, tokens: NP, role: Role) -> NP:
    """``tokens`` ``[H, T, D]`` as ``codec`` gives them back, float32 (the oracle's input):
    encoded and decoded by the NumPy reference codec (affine as ``mx.dequantize`` gives
    it, TurboQuant's values fully decoded)."""
    oracle = reference_codecs.make_codec(codec)
    decoded: NP = np.asarray(oracle.decode(oracle.encode(tokens, role), role), np.float32)
    return decoded


class DecodeBench:
    """One decode step's attention over a live ragged batch of each storage, by each
    implementation: the decode tables of this family and of the affine family (a new
    codec is one more storage, a new kernel one more entry of :data:`DECODE_RUNS`).

    ``storages`` names each table label's scheme (a label not there is its own scheme);
    ``tolerance`` the largest relative L2 error of a checked row per label (default
    :data:`DECODE_TOLERANCE`); ``all_rows``: check every row, not the first, middle and
    last; ``op``: the workloads' operation (``"decode"``, the affine family's
    ``"attention"``).
    """

    def __init__(
        self,
        shape: Shape,
        data: BenchData | None = None,
        *,
        storages: Mapping[str, str] | None = None,
        tolerance: Mapping[str, float] | None = None,
        all_rows: bool = False,
        op: str = "decode",
    ) -> None:
        self.shape = shape
        self.data = data if data is not None else BenchData(shape)
        self.storages = dict(storages or {})
        self.tolerance = dict(tolerance or {})
        self.all_rows, self.op = all_rows, op
        self._live: dict[str, tuple[Any, Any]] = {}

    def codec(self, storage: str) -> CodecSpec:
        return _codec(self.storages.get(storage, storage))

    @property
    def width(self) -> int:
        """Columns attention reads: the longest row plus the step's token."""
        return max(self.shape.ragged) + 1

    def token_bytes(self, storage: str) -> int:
        """Bytes of one token's keys and values over every KV head."""
        codec, s = self.codec(storage), self.shape
        return sum(
            codec_token_bytes(codec, s.heads, s.head_dim, s.dtype, r) for r in ("keys", "values")
        )

    def bytes_read(self, storage: str) -> int:
        """The planes one step reads: every row over the layout's width (scales included)."""
        return self.shape.batch * self.width * self.token_bytes(storage)

    def live(self, storage: str) -> tuple[Any, Any]:
        """The batch of ``storage`` after ``make_mask(1)`` and one step, and that mask."""
        if storage not in self._live:
            codec = self.codec(storage)
            rows = []
            for b, n in enumerate(self.shape.ragged):
                cache = _serial(codec)
                cache.update_and_fetch(
                    self.data.keys[b : b + 1, :, :n], self.data.values[b : b + 1, :, :n]
                )
                rows.append(cache)
            layout = _layout(codec)
            layout.merge_rows(rows)
            mask = layout.make_mask(1)
            layout.update_and_fetch(self.data.step_keys, self.data.step_values)
            mx.eval(layout.held_arrays(), mask)
            self._live[storage] = (layout, mask)
        return self._live[storage]

    def checked_rows(self) -> list[int]:
        """Rows the check recomputes in NumPy: every one, or the first, middle and last
        (longest, a middle one, shortest), so a wrong row order or padding mask shows."""
        if self.all_rows:
            return list(range(self.shape.batch))
        return sorted({0, self.shape.batch // 2, self.shape.batch - 1})

    def workload(self, storage: str, impl: str) -> Workload:
        codec = self.codec(storage)
        attention = DECODE_RUNS.get(impl)
        if attention is None or (impl == "eager" and not _defers_values(codec)):
            raise ValueError(f"unknown implementation {impl!r} for {storage}")
        queries, scale = self.data.queries, self.data.scale
        what = f"{self.op} {storage} {impl}"
        tolerance = self.tolerance.get(storage, DECODE_TOLERANCE)

        def run(state: tuple[Any, Any]) -> Any:
            out = attention(codec, queries, state[0], state[1], scale)
            mx.eval(out)
            return out

        def check(out: Any) -> None:
            got = to_numpy(out).astype(np.float32)
            s = self.shape
            expected_shape = (s.batch, s.query_heads, 1, s.head_dim)
            check_equal(f"{what}: output shape", got.shape, expected_shape)
            keys, values, step_keys, step_values = (
                self.data.np(n) for n in ("keys", "values", "step_keys", "step_values")
            )
            q = self.data.np("queries")
            for b in self.checked_rows():
                n = s.ragged[b]
                k = np.concatenate([keys[b][:, :n], step_keys[b]], axis=1)
                v = np.concatenate([values[b][:, :n], step_values[b]], axis=1)
                expected = reference_attention(
                    q[b], _decoded(codec, k, "keys"), _decoded(codec, v, "values"), scale
                )
                error = float(np.linalg.norm(got[b] - expected) / np.linalg.norm(expected))
                if not error <= tolerance:
                    raise BenchCheckError(
                        f"{what}: row {b} is off by {error:.3g} (relative L2), "
                        f"more than {tolerance}"
                    )

        return Workload(
            f"{self.op} {storage}",
            impl,
            self.shape,
            self.bytes_read(storage),
            lambda: self.live(storage),
            run,
            check,
        )

    def release(self) -> None:
        self._live.clear()


def _attend(codec: CodecSpec, queries: Any, layout: Any, mask: Any, scale: float) -> Any:
    return optimized.attend(queries, layout, mask, scale)


def _mlx_lm_attention(codec: CodecSpec, queries: Any, layout: Any, mask: Any, scale: float) -> Any:
    """mlx-lm's own kernel on the layout's planes: ``mx.fast`` SDPA over plain ones,
    ``quantized_scaled_dot_product_attention`` over affine ones."""
    keys, values = layout.fetch()
    bits = getattr(codec, "bits", None)  # mlx-lm quantizes affine only (TurboQuant: none)
    if bits is None:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    # It computes ``queries *= scale`` in place: hand it a copy.
    return lm_base.quantized_scaled_dot_product_attention(
        mx.array(queries), keys, values, scale, mask, getattr(codec, "group_size", None), bits
    )


def _eager(codec: CodecSpec, queries: Any, layout: Any, mask: Any, scale: float) -> Any:
    """TurboQuant with the read's keys and values decoded first (values un-rotated, both
    bfloat16), then ``mx.fast`` SDPA."""
    key_planes, value_planes = layout.fetch()
    return _eager_attention(make_codec(codec), queries, key_planes, value_planes, mask, scale)


#: Who attends in a decode case, by implementation name (``kvrows`` and ``attend`` are
#: both ``kvrows.optimized.attend``: the affine and turbo tables' names for it).
DECODE_RUNS: dict[str, Callable[[CodecSpec, Any, Any, Any, float], Any]] = {
    "kvrows": _attend,
    "attend": _attend,
    "mlx-lm": _mlx_lm_attention,
    "eager": _eager,
}


def _decode_cases(shape: Shape, storages: Sequence[str]) -> Iterator[Case]:
    """One case: every storage's step timed together (interleaved), so the ratios compare
    timings taken under the same machine state."""
    bench = DecodeBench(shape)
    eager = next((s for s in storages if _defers_values(_codec(s))), None)
    workloads = {f"attend {s}": bench.workload(s, "attend") for s in storages}
    if eager is not None:
        workloads[f"eager {eager}"] = bench.workload(eager, "eager")

    def lines(t: Mapping[str, Timing]) -> list[Line]:
        plain = t.get("attend plain")
        affine4 = t.get("attend affine4")
        out = []
        for storage in storages:
            timing = t[f"attend {storage}"]
            out.append(
                {
                    "storage": _codec(storage).name,
                    **shape.cells,
                    "K+V B/token": str(bench.token_bytes(storage)),
                    "attend ms": timing.cell,
                    "eager ms": t[f"eager {storage}"].cell if storage == eager else "-",
                    "x plain": ratio(timing.ms, plain.ms if plain else None),
                    "x affine4": ratio(timing.ms, affine4.ms if affine4 else None),
                    "MB": f"{bench.bytes_read(storage) / 1e6:.1f}",
                    "GB/s": format_gbps(bench.bytes_read(storage), timing.ms),
                }
            )
        return out

    yield Case(f"decode {shape.label}", workloads, lines, release=bench.release)


# -- the family -------------------------------------------------------------------------------

#: The quality table's columns (its plain-stats line reuses them for other figures).
QUALITY_HEADER = (
    "model",
    "scheme",
    "attn rel err",
    "attn rel max",
    "KL mean",
    "KL max",
    "top-1 %",
    "seed KL",
    "tok/s",
    "checked",
)

#: The parts of the turbo family, in table order.
PARTS = ("values", "bytes", "quality", "decode")

NOTES = """\
values: {vectors} random unit vectors of R^{dim} through the value codec (sign flip, Walsh-Hadamard,
  per-{group} RMS scale in float16, Gaussian Lloyd-Max codes); MSE = mean ||x - x~||^2. paper =
  Algorithm 1's D_mse (Theorem 1, rounded); Beta LM = exact Beta(d={dim}) Lloyd-Max (notes §9.1);
  Gaussian LM = the exact distortion of our stored table on a unit normal (closed form; 1 bit:
  +-sqrt(2/pi), not a codec width); bound = sqrt(3)pi/2 * 4^-b; E norm(x~)^2 ~ 1 - MSE (shrinkage);
  bits/coord counts the scales; ms = optimized encode + decode of all vectors (codes and scales
  checked equal to the NumPy reference's).
bytes: one token, one KV head of D={dim}, {dtype} activations (affine scales and biases in {dtype},
  TurboQuant's in float16); bits/elt = (K+V bytes) * 8 / (2 D); x smaller = plain / this. checked:
  a storage holding 8 tokens holds exactly 8 x K+V bytes in its planes.
quality: tiny random-weight float32 models (tiny_model), a random {tokens}-token prompt fed in chunks
  of {chunk}, its last {steps} tokens one at a time (decode steps), under each scheme vs mlx-lm's own
  plain caches. KL = KL(plain || scheme) of each position's next-token distribution (mean, max);
  top-1 = positions whose argmax agrees; attn rel err = relative L2 error of the attention
  output (every head, mean and max) at {samples} positions spread over the prompt, in each
  full-attention layer in isolation: the plain run's queries, keys and values, stored by the
  scheme, each position attending its prefix (the gemma3 sliding layers are not counted;
  turbo keeps them plain, affine quantizes them). seed KL = the seed engine's teacher-forced KL
  on MiniCPM 1B. tok/s = prompt tokens / run time (teacher-forced, including the hook).
  (plain stats): mean largest attention weight vs a uniform row's, next-token entropy vs ln V.
  checks: kvrows plain = mlx-lm within {plain_tol:g} per logit; turbo deferred-V = eager within
  {deferred_tol} (relative L2).
decode: one decode step's attention at B={b}, L={l} (rows L down to ~L/2, padding mask), 32
  query heads over 8 KV heads, D=128, bfloat16; attend = kvrows.optimized.attend (plain: mx.fast
  SDPA; affine: quantized_matmul; turbo: keys scored on their codes with quantized_matmul,
  values gathered still rotated, float32 on the CPU, output un-rotated); eager = turbo with
  every stored key and value decoded first (bfloat16), then SDPA. x plain, x affine4 =
  this ms / that ms (> 1: slower). MB = stored planes over the layout's width."""


def family(
    *,
    quick: bool = False,
    shapes: TurboShapes | None = None,
    parts: Sequence[str] = PARTS,
    quality_schemes: Sequence[str] = QUALITY_SCHEMES,
    decode_storages: Sequence[str] = DECODE_STORAGES,
) -> Family:
    """The turbo family's tables (``parts``) at the full, quick or given ``shapes``."""
    chosen = shapes if shapes is not None else QUICK_TURBO if quick else FULL_TURBO
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}")
    tables = {
        "values": Table(_value_cases(chosen.vectors), "values (unit vectors, d = 128)"),
        "bytes": Table(_bytes_cases(BYTES_SCHEMES), "bytes per token per KV head (D = 128)"),
        "quality": Table(
            _quality_cases(chosen, quality_schemes), "quality against plain (teacher-forced)"
        ),
        "decode": Table(_decode_cases(chosen.decode, decode_storages), "decode step attention"),
    }
    notes = NOTES.format(
        vectors=chosen.vectors,
        dim=DIM,
        group=TURBO_GROUP,
        dtype=DTYPE,
        tokens=chosen.tokens,
        chunk=chosen.chunk,
        steps=chosen.decode_steps,
        samples=chosen.samples,
        plain_tol=PLAIN_LOGIT_TOLERANCE,
        deferred_tol=DEFERRED_TOLERANCE,
        b=chosen.decode.batch,
        l=chosen.decode.tokens,
    )
    return Family(
        "turbo",
        "TurboQuant quality, bytes and decode cost",
        [tables[p] for p in PARTS if p in parts],
        notes,
        repeats=(1, 3),
        warmups=(0, 1),
    )
