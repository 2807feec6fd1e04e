"""Benchmarks of the plain family's row operations against mlx-lm and a plain copy.

Shared by ``kvrows bench`` (:func:`run_bench`) and ``benchmarks/test_bench_plain.py``.

Operations (one attention layer; 8 KV heads, head dim 128, float16 unless a
shape says otherwise; ``T`` = bytes of one token's K and V = ``2·H·D·itemsize``):

* ``merge``: form a batch of ``B`` rows from ``B`` serial caches of ``L``
  tokens each (kvrows: ``PaddedKVRows().merge_rows(rows)``; mlx-lm:
  ``BatchKVCache.merge`` of mlx-lm ``KVCache`` s). Bytes moved: ``2·B·L·T``
  (every row read once and written once).
* ``merge-step``: ``merge`` followed by one decode ``update_and_fetch``, the
  unit mlx-lm's ``BatchGenerator`` performs (its merged buffer is exactly
  ``L`` columns, so its first step grows it with a full copy; kvrows
  allocates the step's room at merge). Bytes: ``2·B·L·T + B·T``.
* ``join``: one new row of ``L`` tokens joins a *live* batch of ``B`` rows
  (live = merged from ``B`` rows of ``L`` tokens, then one decode step, as in
  mlx-lm's ``BatchGenerator``). kvrows: ``merge_rows([serial])``; mlx-lm:
  ``extend`` with a one-row ``BatchKVCache``. Bytes: ``2·L·T`` (only the new
  row has to move).
* ``filter-half``: a live batch keeps its odd rows (``B/2`` of them, order
  kept). ``filter-one``: a live batch drops row 0 (the worst row for an
  order-keeping compaction). Bytes: ``2·kept·(L+1)·T`` (what a compacting
  gather of the kept rows moves).
* ``extract``: row ``B//2`` of a live batch as an independent compact serial
  cache. Bytes: ``2·(L+1)·T``.
* ``update``: the cache's share of a decode step, ``make_mask(1)`` and
  ``update_and_fetch`` of one token per row (no attention), on the ragged
  decode batch below. Bytes: ``B·T`` (the tokens written).
* ``decode``: one step on a live batch whose rows are ragged (row ``b`` holds
  ``L - b·⌊L/2B⌋`` tokens, so both implementations need a padding mask):
  ``make_mask(1)``, ``update_and_fetch`` of one token per row and attention of
  32 query heads (kvrows: ``kvrows.optimized.attend``; mlx-lm:
  ``mx.fast.scaled_dot_product_attention``). Bytes: every valid K/V byte the
  attention reads plus the ``B`` tokens written, ``Σ(len_b + 2)·T + B·T``.

Baselines, for each operation: ``copy`` is an MLX copy (a concatenate) of an
array of ``bytes/2`` bytes, so it reads and writes the operation's bytes;
``memcpy`` is ``numpy.copyto`` of the same into a pre-touched buffer (the CPU's
practical ceiling); ``reference`` is the NumPy reference implementation, for
context only, and skipped when ``B·L`` exceeds :data:`REFERENCE_MAX_TOKENS`.

Method: every timed call ends with ``mx.eval`` of everything it produced (the
layout's state, fetched arrays, attention output). Setup (fresh live batches
for the in-place operations, fresh inputs) is not timed. The figure is the
median of ``repeats`` timed calls after warm-ups. After timing, each
workload's last result is checked against the generated input data, so a
fast wrong operation is reported, never tabulated as a win. The
implementations of one operation run interleaved (round ``r`` times each of
them once), so drift in the machine's state does not favour whichever runs
first.

Allocation dominates on Linux's CPU backend: MLX keeps no buffer cache there,
and glibc serves blocks above its mmap threshold (at most 32 MB) with fresh
pages, so every large new buffer pays a page fault per 4 KiB (about 2.5 GB/s)
as it is first written. Both implementations pay it in proportion to the bytes
they allocate. ``MALLOC_MMAP_THRESHOLD_=4294967296
MALLOC_TRIM_THRESHOLD_=68719476736 kvrows bench`` keeps freed memory in the
heap and shows the figures without that cost.
"""

from __future__ import annotations

import gc
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TextIO

import ml_dtypes
import mlx.core as mx
import numpy as np
import numpy.typing as npt

import kvrows.optimized as optimized
import kvrows.reference as reference

# mlx-lm's cache module, untyped: reached through Any.
lm_cache: Any = importlib.import_module("mlx_lm.models.cache")

__all__ = [
    "CI_SHAPES",
    "FULL_SHAPES",
    "IMPLEMENTATIONS",
    "OPERATIONS",
    "PARITY_BAND",
    "QUICK_SHAPES",
    "REFERENCE_MAX_TOKENS",
    "BenchCheckError",
    "BenchData",
    "Impl",
    "KvrowsImpl",
    "Live",
    "MlxLmImpl",
    "Shape",
    "ShapeBench",
    "Timing",
    "Workload",
    "check_equal",
    "check_same",
    "format_gbps",
    "format_ms",
    "format_table",
    "markdown_table",
    "package_version",
    "reference_attention",
    "run_bench",
    "time_workload",
    "time_workloads",
    "to_numpy",
]

#: The operations, in table order.
OPERATIONS = (
    "merge",
    "merge-step",
    "join",
    "filter-half",
    "filter-one",
    "extract",
    "update",
    "decode",
)

#: Who performs each operation, in table order.
IMPLEMENTATIONS = ("kvrows", "mlx-lm", "copy", "memcpy", "reference")

#: The NumPy reference runs only where ``B·L`` is at most this.
REFERENCE_MAX_TOKENS = 16 * 1024

_NP = npt.NDArray[Any]


def to_numpy(array: Any) -> _NP:
    """A NumPy copy of an MLX array; bfloat16 becomes ``ml_dtypes.bfloat16`` (NumPy has none)."""
    if isinstance(array, mx.array) and array.dtype == mx.bfloat16:
        return np.array(array.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(array)


class BenchCheckError(AssertionError):
    """A benchmarked operation produced a wrong result."""


@dataclass(frozen=True)
class Shape:
    """One benchmark shape: ``batch`` rows of ``tokens`` tokens."""

    batch: int
    tokens: int
    heads: int = 8
    head_dim: int = 128
    query_heads: int = 32
    dtype: str = "float16"

    @property
    def mx_dtype(self) -> mx.Dtype:
        return {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values."""
        return 2 * self.heads * self.head_dim * self.mx_dtype.size

    @property
    def ragged(self) -> tuple[int, ...]:
        """Row lengths of the decode batch: ``L`` down to about ``L/2``."""
        step = self.tokens // (2 * self.batch)
        return tuple(self.tokens - b * step for b in range(self.batch))

    @property
    def label(self) -> str:
        return f"B={self.batch} L={self.tokens}"


#: The realistic shapes of the issue.
FULL_SHAPES = tuple(Shape(b, t) for b in (4, 16) for t in (1024, 4096))
#: ``kvrows bench --quick``: a smoke run.
QUICK_SHAPES = (Shape(4, 128),)
#: ``benchmarks/`` without ``KVROWS_BENCH_FULL=1``: small, odd sizes (growth, odd B).
CI_SHAPES = (Shape(4, 64), Shape(3, 300))


@dataclass
class Workload:
    """One operation by one implementation at one shape.

    ``run(setup())`` performs the operation and evaluates what it produced;
    ``check(result)`` raises :class:`BenchCheckError` if the result is wrong.
    """

    op: str
    impl: str
    shape: Shape
    bytes_moved: int
    setup: Callable[[], Any]
    run: Callable[[Any], Any]
    check: Callable[[Any], None]


# -- checks -----------------------------------------------------------------------


def _same(what: str, got: _NP, expected: _NP) -> None:
    if got.shape != expected.shape:
        raise BenchCheckError(f"{what}: shape {got.shape}, expected {expected.shape}")
    if not np.array_equal(got, expected):
        bad = int(np.count_nonzero(got != expected))
        raise BenchCheckError(f"{what}: {bad} of {got.size} values differ from the input data")


def _equal(what: str, got: object, expected: object) -> None:
    if got != expected:
        raise BenchCheckError(f"{what}: got {got!r}, expected {expected!r}")


def _attention(queries: _NP, keys: _NP, values: _NP, scale: float) -> _NP:
    """One row's attention in float32: queries ``[Hq, N, D]``, keys/values ``[H, S, D]``."""
    group = queries.shape[0] // keys.shape[0]
    k = np.repeat(keys.astype(np.float32), group, axis=0)
    v = np.repeat(values.astype(np.float32), group, axis=0)
    scores = np.einsum("hnd,hsd->hns", queries.astype(np.float32), k) * np.float32(scale)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out: _NP = np.einsum("hns,hsd->hnd", weights, v)
    return out


# -- data -------------------------------------------------------------------------


class _Data:
    """The generated inputs of one shape (evaluated MLX arrays; NumPy copies on demand)."""

    def __init__(self, shape: Shape, seed: int = 0) -> None:
        b, h, t, d, dt = shape.batch, shape.heads, shape.tokens, shape.head_dim, shape.mx_dtype
        keys = mx.random.split(mx.random.key(seed), 7)

        def normal(i: int, dims: tuple[int, ...]) -> mx.array:
            return mx.random.normal(dims, key=keys[i]).astype(dt)

        self.keys = normal(0, (b, h, t, d))
        self.values = normal(1, (b, h, t, d))
        self.join_keys = normal(2, (1, h, t, d))
        self.join_values = normal(3, (1, h, t, d))
        self.step_keys = normal(4, (b, h, 1, d))
        self.step_values = normal(5, (b, h, 1, d))
        self.queries = normal(6, (b, shape.query_heads, 1, d))
        self.scale = 1.0 / float(np.sqrt(d))
        mx.eval(
            self.keys,
            self.values,
            self.join_keys,
            self.join_values,
            self.step_keys,
            self.step_values,
            self.queries,
        )
        self._numpy: dict[str, _NP] = {}

    def np(self, name: str) -> _NP:
        """A NumPy copy of the array called ``name`` (cached)."""
        if name not in self._numpy:
            self._numpy[name] = to_numpy(getattr(self, name))
        return self._numpy[name]


# -- the implementations ---------------------------------------------------------


class _Impl:
    """How one implementation performs each operation (every method ends evaluated)."""

    name = ""

    def array(self, data: mx.array) -> Any:
        return data

    def sync(self, *arrays: Any) -> None:
        mx.eval(*(a for a in arrays if a is not None and not isinstance(a, str)))

    def serial(self, keys: Any, values: Any) -> Any:
        raise NotImplementedError

    def batch_state(self, batch: Any) -> tuple[Any, ...]:
        raise NotImplementedError

    def merge(self, rows: Sequence[Any]) -> Any:
        raise NotImplementedError

    def joiner(self, serial: Any) -> Any:
        """What ``join`` takes: the serial cache itself, or a one-row batch (mlx-lm)."""
        return serial

    def join(self, batch: Any, joiner: Any) -> Any:
        raise NotImplementedError

    def filter(self, batch: Any, keep: list[int]) -> Any:
        raise NotImplementedError

    def extract(self, batch: Any, row: int) -> Any:
        raise NotImplementedError

    def step(self, batch: Any, keys: Any, values: Any) -> None:
        """``update_and_fetch`` of one token per row, no attention (live-batch setup)."""
        raise NotImplementedError

    def update(self, batch: Any, keys: Any, values: Any) -> None:
        """A decode step's cache work: ``make_mask(1)`` then ``update_and_fetch``."""
        mask = batch.make_mask(1)
        self.sync(mask, *batch.update_and_fetch(keys, values))

    def decode(self, batch: Any, queries: Any, keys: Any, values: Any, scale: float) -> Any:
        raise NotImplementedError

    def rows(self, batch: Any) -> list[tuple[_NP, _NP]]:
        """Every row's valid keys and values ``[H, tokens, D]``, read back for checks."""
        raise NotImplementedError

    def serial_data(self, cache: Any) -> tuple[_NP, _NP]:
        raise NotImplementedError


class _Kvrows(_Impl):
    """``kvrows.optimized`` (MLX); ``kvrows.reference`` reuses it with NumPy arrays."""

    name = "kvrows"
    module: Any = optimized

    def serial(self, keys: Any, values: Any) -> Any:
        cache = self.module.KVCache()
        cache.update_and_fetch(keys, values)
        self.sync(cache.state)
        return cache

    def batch_state(self, batch: Any) -> tuple[Any, ...]:
        return tuple(batch.state)

    def merge(self, rows: Sequence[Any]) -> Any:
        layout = self.module.PaddedKVRows()
        layout.merge_rows(rows)
        self.sync(layout.state)
        return layout

    def join(self, batch: Any, joiner: Any) -> Any:
        batch.merge_rows([joiner])
        self.sync(batch.state)
        return batch

    def filter(self, batch: Any, keep: list[int]) -> Any:
        batch.filter_rows(keep)
        self.sync(batch.state)
        return batch

    def extract(self, batch: Any, row: int) -> Any:
        cache = batch.extract_row(row)
        self.sync(cache.state)
        return cache

    def step(self, batch: Any, keys: Any, values: Any) -> None:
        self.sync(*batch.update_and_fetch(keys, values))

    def decode(self, batch: Any, queries: Any, keys: Any, values: Any, scale: float) -> Any:
        mask = batch.make_mask(1)
        fetched = batch.update_and_fetch(keys, values)
        out = self.module.attend(queries, batch, mask, scale)
        self.sync(out, fetched)
        return out

    def rows(self, batch: Any) -> list[tuple[_NP, _NP]]:
        keys, values = (to_numpy(x) for x in batch.fetch())
        return [
            (keys[b, :, p : p + n], values[b, :, p : p + n])
            for b, (p, n) in enumerate(zip(batch.left_pad, batch.row_offsets, strict=True))
        ]

    def serial_data(self, cache: Any) -> tuple[_NP, _NP]:
        keys, values = (to_numpy(x) for x in cache.fetch())
        return keys[0], values[0]


class _Reference(_Kvrows):
    name = "reference"
    module = reference

    def array(self, data: mx.array) -> Any:
        return to_numpy(data)

    def sync(self, *arrays: Any) -> None:
        return None


class _MlxLm(_Impl):
    """mlx-lm's ``KVCache`` / ``BatchKVCache``."""

    name = "mlx-lm"

    def serial(self, keys: Any, values: Any) -> Any:
        cache = lm_cache.KVCache()
        cache.update_and_fetch(keys, values)
        self.sync(cache.keys, cache.values)
        return cache

    def batch_state(self, batch: Any) -> tuple[Any, ...]:
        return (batch.keys, batch.values, batch.offset, batch.left_padding)

    def merge(self, rows: Sequence[Any]) -> Any:
        batch = lm_cache.BatchKVCache.merge(list(rows))
        self.sync(*self.batch_state(batch))
        return batch

    def joiner(self, serial: Any) -> Any:
        return self.merge([serial])

    def join(self, batch: Any, joiner: Any) -> Any:
        batch.extend(joiner)
        self.sync(*self.batch_state(batch))
        return batch

    def filter(self, batch: Any, keep: list[int]) -> Any:
        batch.filter(keep)
        self.sync(*self.batch_state(batch))
        return batch

    def extract(self, batch: Any, row: int) -> Any:
        cache = batch.extract(row)
        self.sync(cache.keys, cache.values)
        return cache

    def step(self, batch: Any, keys: Any, values: Any) -> None:
        self.sync(*batch.update_and_fetch(keys, values), batch.offset)

    def update(self, batch: Any, keys: Any, values: Any) -> None:
        mask = batch.make_mask(1)
        self.sync(mask, *batch.update_and_fetch(keys, values), batch.offset)

    def decode(self, batch: Any, queries: Any, keys: Any, values: Any, scale: float) -> Any:
        mask = batch.make_mask(1)
        k, v = batch.update_and_fetch(keys, values)
        out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        self.sync(out, k, v, batch.offset)
        return out

    def rows(self, batch: Any) -> list[tuple[_NP, _NP]]:
        pads = [int(p) for p in batch.left_padding.tolist()]
        end = int(batch._idx)
        keys, values = to_numpy(batch.keys), to_numpy(batch.values)
        return [(keys[b, :, p:end], values[b, :, p:end]) for b, p in enumerate(pads)]

    def serial_data(self, cache: Any) -> tuple[_NP, _NP]:
        n = int(cache.offset)
        return to_numpy(cache.keys[0, :, :n]), to_numpy(cache.values[0, :, :n])


_IMPLS: dict[str, _Impl] = {"kvrows": _Kvrows(), "mlx-lm": _MlxLm(), "reference": _Reference()}


@dataclass
class _Live:
    """A decode batch reused across timed steps, and how many steps it has taken."""

    batch: Any
    steps: int


@dataclass
class Timing:
    """Median milliseconds of one workload (``None``: not run, with ``note`` saying why)."""

    ms: float | None
    note: str = ""


@dataclass
class _Row:
    op: str
    shape: Shape
    bytes_moved: int
    timings: dict[str, Timing] = field(default_factory=dict)

    def ms(self, impl: str) -> float | None:
        timing = self.timings.get(impl)
        return None if timing is None else timing.ms


class ShapeBench:
    """The workloads of one shape, with their generated data and cached sources.

    Other families reuse it by subclassing: ``operations``, ``implementations``,
    ``impls`` (the adapters by name) and ``token_bytes`` say what they run and how
    many bytes one token's keys and values hold; ``data`` lets several benches share
    one set of generated inputs.
    """

    operations: tuple[str, ...] = OPERATIONS
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    impls: Mapping[str, _Impl] = _IMPLS

    def __init__(self, shape: Shape, data: _Data | None = None) -> None:
        self.shape = shape
        self.data = data if data is not None else _Data(shape)
        self._cache: dict[tuple[str, str], Any] = {}

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values as stored (the plain family: ``shape.token_bytes``)."""
        return self.shape.token_bytes

    def adapter(self, impl: str) -> _Impl:
        """How ``impl`` performs each operation (for tests that build wrong results)."""
        return self.impls[impl]

    def runs(self, impl: str) -> bool:
        """Whether ``impl`` runs at this shape (the reference skips large ones)."""
        if impl not in self.implementations:
            raise ValueError(f"unknown implementation {impl!r}")
        return impl != "reference" or self.shape.batch * self.shape.tokens <= REFERENCE_MAX_TOKENS

    # -- sources ------------------------------------------------------------------
    def _cached(self, impl: str, what: str, build: Callable[[], Any]) -> Any:
        if (impl, what) not in self._cache:
            self._cache[impl, what] = build()
        return self._cache[impl, what]

    def _rows(self, impl: _Impl, lengths: Sequence[int]) -> list[Any]:
        keys, values = self.data.keys, self.data.values
        return [
            impl.serial(impl.array(keys[b : b + 1, :, :n]), impl.array(values[b : b + 1, :, :n]))
            for b, n in enumerate(lengths)
        ]

    def _equal_rows(self, impl: _Impl) -> list[Any]:
        return self._cached(  # type: ignore[no-any-return]
            impl.name, "rows", lambda: self._rows(impl, [self.shape.tokens] * self.shape.batch)
        )

    def _live(self, impl: _Impl, lengths: Sequence[int] | None = None) -> Any:
        """A freshly merged batch after one decode step."""
        rows = (
            self._equal_rows(impl)
            if lengths is None
            else self._cached(impl.name, "ragged", lambda: self._rows(impl, lengths))
        )
        batch = impl.merge(rows)
        impl.step(batch, impl.array(self.data.step_keys), impl.array(self.data.step_values))
        return batch

    def _joiner(self, impl: _Impl) -> Any:
        def build() -> Any:
            serial = impl.serial(impl.array(self.data.join_keys), impl.array(self.data.join_values))
            return impl.joiner(serial)

        return self._cached(impl.name, "joiner", build)

    def release(self) -> None:
        """Drop the cached sources and live batches (the generated data stays)."""
        self._cache.clear()

    # -- expected contents -------------------------------------------------------
    def _expected_row(self, row: int, tokens: int, steps: int) -> tuple[_NP, _NP]:
        """Source row ``row``'s first ``tokens`` tokens followed by ``steps`` step tokens."""
        k = self.data.np("keys")[row, :, :tokens]
        v = self.data.np("values")[row, :, :tokens]
        sk = np.repeat(self.data.np("step_keys")[row], steps, axis=1)
        sv = np.repeat(self.data.np("step_values")[row], steps, axis=1)
        return np.concatenate([k, sk], axis=1), np.concatenate([v, sv], axis=1)

    def _check_rows(self, held: list[tuple[_NP, _NP]], sources: Sequence[int], what: str) -> None:
        """``held`` is exactly source rows ``sources`` (each L tokens + one step token)."""
        _equal(f"{what}: row count", len(held), len(sources))
        for b, source in enumerate(sources):
            k, v = self._expected_row(source, self.shape.tokens, 1)
            _same(f"{what}: row {b} keys", held[b][0], k)
            _same(f"{what}: row {b} values", held[b][1], v)

    # -- workloads -----------------------------------------------------------------
    def bytes_moved(self, op: str) -> int:
        s = self.shape
        t = self.token_bytes
        if op == "merge":
            return 2 * s.batch * s.tokens * t
        if op == "merge-step":
            return 2 * s.batch * s.tokens * t + s.batch * t
        if op == "join":
            return 2 * s.tokens * t
        if op in ("filter-half", "filter-one"):
            return 2 * len(self.keep(op)) * (s.tokens + 1) * t
        if op == "extract":
            return 2 * (s.tokens + 1) * t
        if op == "update":
            return s.batch * t
        if op == "decode":
            return sum(n + 2 for n in s.ragged) * t + s.batch * t
        raise ValueError(f"unknown operation {op!r}")

    def keep(self, op: str) -> list[int]:
        if op == "filter-half":
            return list(range(1, self.shape.batch, 2))
        return list(range(1, self.shape.batch))

    def workload(self, op: str, impl: str) -> Workload:
        if op not in self.operations:
            raise ValueError(f"unknown operation {op!r}")
        if not self.runs(impl):
            raise ValueError(f"{impl} does not run at {self.shape.label}")
        moved = self.bytes_moved(op)
        if impl in ("copy", "memcpy"):
            setup, run, check = self._copy(moved, numpy=impl == "memcpy")
        else:
            setup, run, check = getattr(self, "_" + op.replace("-", "_"))(self.impls[impl])
        return Workload(op, impl, self.shape, moved, setup, run, check)

    _Parts = tuple[Callable[[], Any], Callable[[Any], Any], Callable[[Any], None]]

    def _copy(self, moved: int, *, numpy: bool) -> _Parts:
        count = max(1, moved // (2 * self.shape.mx_dtype.size))

        def source() -> mx.array:
            def build() -> mx.array:
                flat = mx.random.normal((count,), key=mx.random.key(count)).astype(
                    self.shape.mx_dtype
                )
                mx.eval(flat)
                return flat

            return self._cached("copy", f"source-{count}", build)  # type: ignore[no-any-return]

        if numpy:

            def np_setup() -> tuple[_NP, _NP]:
                def build() -> tuple[_NP, _NP]:
                    src = to_numpy(source())
                    dst = np.empty_like(src)
                    dst[...] = 1  # touch every page
                    return src, dst

                return self._cached("memcpy", f"buffers-{count}", build)  # type: ignore[no-any-return]

            def np_run(state: tuple[_NP, _NP]) -> tuple[_NP, _NP]:
                np.copyto(state[1], state[0])
                return state

            def np_check(state: tuple[_NP, _NP]) -> None:
                _same("memcpy", state[1], state[0])

            return np_setup, np_run, np_check

        def mx_run(src: mx.array) -> tuple[mx.array, mx.array]:
            out = mx.concatenate([src, src[:0]])
            mx.eval(out)
            return src, out

        def mx_check(result: tuple[mx.array, mx.array]) -> None:
            _same("copy", to_numpy(result[1]), to_numpy(result[0]))

        return source, mx_run, mx_check

    def _merge(self, impl: _Impl) -> _Parts:
        def check(batch: Any) -> None:
            held = impl.rows(batch)
            _equal("merge: row count", len(held), self.shape.batch)
            for b, (k, v) in enumerate(held):
                _same(f"merge: row {b} keys", k, self.data.np("keys")[b])
                _same(f"merge: row {b} values", v, self.data.np("values")[b])

        return lambda: self._equal_rows(impl), impl.merge, check

    def _merge_step(self, impl: _Impl) -> _Parts:
        step_keys = impl.array(self.data.step_keys)
        step_values = impl.array(self.data.step_values)

        def run(rows: list[Any]) -> Any:
            batch = impl.merge(rows)
            impl.step(batch, step_keys, step_values)
            return batch

        def check(batch: Any) -> None:
            self._check_rows(impl.rows(batch), range(self.shape.batch), "merge-step")

        return lambda: self._equal_rows(impl), run, check

    def _join(self, impl: _Impl) -> _Parts:
        def setup() -> tuple[Any, Any]:
            return self._live(impl), self._joiner(impl)

        def run(state: tuple[Any, Any]) -> Any:
            return impl.join(*state)

        def check(batch: Any) -> None:
            held = impl.rows(batch)
            self._check_rows(held[:-1], range(self.shape.batch), "join")
            _same("join: new row keys", held[-1][0], self.data.np("join_keys")[0])
            _same("join: new row values", held[-1][1], self.data.np("join_values")[0])

        return setup, run, check

    def _filter(self, impl: _Impl, op: str) -> _Parts:
        keep = self.keep(op)

        def run(batch: Any) -> Any:
            return impl.filter(batch, keep)

        def check(batch: Any) -> None:
            self._check_rows(impl.rows(batch), keep, op)

        return lambda: self._live(impl), run, check

    def _filter_half(self, impl: _Impl) -> _Parts:
        return self._filter(impl, "filter-half")

    def _filter_one(self, impl: _Impl) -> _Parts:
        return self._filter(impl, "filter-one")

    def _extract(self, impl: _Impl) -> _Parts:
        row = self.shape.batch // 2

        def run(batch: Any) -> Any:
            return impl.extract(batch, row)

        def check(cache: Any) -> None:
            keys, values = impl.serial_data(cache)
            k, v = self._expected_row(row, self.shape.tokens, 1)
            _same("extract: keys", keys, k)
            _same("extract: values", values, v)

        return lambda: self._cached(impl.name, "live", lambda: self._live(impl)), run, check

    def _stepping(self, impl: _Impl, op: str) -> Callable[[], _Live]:
        """Setup of ``update`` and ``decode``: one ragged live batch, reused step after step."""
        lengths = self.shape.ragged

        def setup() -> _Live:
            live: _Live = self._cached(impl.name, op, lambda: _Live(self._live(impl, lengths), 1))
            if live.steps > 200:  # stay clear of a capacity crossing
                self._cache.pop((impl.name, op))
                return setup()
            return live

        return setup

    def _update(self, impl: _Impl) -> _Parts:
        lengths = self.shape.ragged
        keys, values = impl.array(self.data.step_keys), impl.array(self.data.step_values)

        def run(live: _Live) -> _Live:
            impl.update(live.batch, keys, values)
            live.steps += 1
            return live

        def check(live: _Live) -> None:
            held = impl.rows(live.batch)
            _equal("update: row count", len(held), len(lengths))
            for b, n in enumerate(lengths):
                k, v = self._expected_row(b, n, live.steps)
                _same(f"update: row {b} keys", held[b][0], k)
                _same(f"update: row {b} values", held[b][1], v)

        return self._stepping(impl, "update"), run, check

    def _decode(self, impl: _Impl) -> _Parts:
        lengths = self.shape.ragged
        queries = impl.array(self.data.queries)
        keys, values = impl.array(self.data.step_keys), impl.array(self.data.step_values)

        def run(live: _Live) -> tuple[Any, int, tuple[int, ...]]:
            out = impl.decode(live.batch, queries, keys, values, self.data.scale)
            live.steps += 1
            return out, live.steps, tuple(int(x) for x in np.array(live.batch.offset))

        def check(result: tuple[Any, int, tuple[int, ...]]) -> None:
            out, steps, offsets = result
            _equal("decode: row offsets", offsets, tuple(n + steps for n in lengths))
            got = to_numpy(out).astype(np.float32)
            q = self.data.np("queries")
            for b, n in enumerate(lengths):
                k, v = self._expected_row(b, n, steps)
                expected = _attention(q[b], k, v, self.data.scale)
                if not np.allclose(got[b], expected, rtol=2e-2, atol=2e-3):
                    worst = float(np.max(np.abs(got[b] - expected)))
                    raise BenchCheckError(
                        f"decode: row {b} attention differs from the expected by up to {worst:.4g}"
                    )

        return self._stepping(impl, "decode"), run, check


# -- timing and the table ------------------------------------------------------------


def _time_once(workload: Workload) -> tuple[float, Any]:
    state = workload.setup()
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        result = workload.run(state)
        elapsed = time.perf_counter() - start
    finally:
        if enabled:
            gc.enable()
    return elapsed, result


def time_workloads(
    workloads: Sequence[Workload], *, repeats: Sequence[int], warmups: int
) -> list[float | BenchCheckError]:
    """Median milliseconds of each workload's timed runs, the workloads interleaved.

    Round ``r`` runs every workload once (while it has runs left), so drift of
    the machine's state (allocator, caches, neighbours) spreads over all of
    them instead of favouring whichever runs first. The last run of each is
    checked; a wrong result comes back as its :class:`BenchCheckError`.
    """
    times: list[list[float]] = [[] for _ in workloads]
    outcome: list[BenchCheckError | None] = [None] * len(workloads)
    for r in range(warmups + max(repeats, default=0)):
        for i, workload in enumerate(workloads):
            total = warmups + repeats[i]
            if r >= total:
                continue
            elapsed, result = _time_once(workload)
            if r >= warmups:
                times[i].append(elapsed)
            if r == total - 1:
                try:
                    workload.check(result)
                except BenchCheckError as error:
                    outcome[i] = error
            del result
    return [
        error if error is not None else 1e3 * statistics.median(t)
        for error, t in zip(outcome, times, strict=True)
    ]


def time_workload(workload: Workload, *, repeats: int, warmups: int) -> float:
    """Median milliseconds of ``repeats`` timed runs after ``warmups``; checks the last result."""
    (outcome,) = time_workloads([workload], repeats=[repeats], warmups=warmups)
    if isinstance(outcome, BenchCheckError):
        raise outcome
    return outcome


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _gbps(moved: int, ms: float | None) -> str:
    return "-" if not ms else f"{moved / (ms * 1e-3) / 1e9:.1f}"


_COLUMNS = (
    "op",
    "B",
    "L",
    "kvrows ms",
    "mlx-lm ms",
    "ratio",
    "copy ms",
    "memcpy ms",
    "reference ms",
    "MB moved",
    "GB/s kvrows",
    "GB/s mlx-lm",
    "GB/s copy",
)


def _cells(row: _Row) -> list[str]:
    kv, lm = row.ms("kvrows"), row.ms("mlx-lm")
    ratio = f"{lm / kv:.2f}" if kv and lm else "-"
    ref = row.timings.get("reference")
    return [
        row.op,
        str(row.shape.batch),
        str(row.shape.tokens),
        _ms(kv),
        _ms(lm),
        ratio,
        _ms(row.ms("copy")),
        _ms(row.ms("memcpy")),
        "skipped" if ref is not None and ref.ms is None else _ms(row.ms("reference")),
        f"{row.bytes_moved / 1e6:.1f}",
        _gbps(row.bytes_moved, kv),
        _gbps(row.bytes_moved, lm),
        _gbps(row.bytes_moved, row.ms("copy")),
    ]


def format_table(rows: Sequence[_Row]) -> str:
    """A Markdown table, one line per operation and shape."""
    return markdown_table(_COLUMNS, [_cells(r) for r in rows])


def markdown_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """A right-aligned Markdown table of ``header`` and the ``body`` lines."""
    lines = [tuple(header), *(tuple(line) for line in body)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def fmt(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return "\n".join([fmt(lines[0]), rule, *(fmt(line) for line in lines[1:])])


#: Ratios within this fraction below 1 are reported as parity (run-to-run noise).
PARITY_BAND = 0.05


def _verdict(rows: Sequence[_Row]) -> list[str]:
    """The issue's targets, against this run's medians (information, never an exit status)."""
    misses: list[str] = []
    parity: list[str] = []
    for row in rows:
        kv, lm = row.ms("kvrows"), row.ms("mlx-lm")
        if kv and lm and lm / kv < 1:
            entry = f"{row.op} {row.shape.label} ({lm / kv:.2f}x)"
            (parity if lm / kv >= 1 - PARITY_BAND else misses).append(entry)
    lines = [
        "target: every operation at least as fast as mlx-lm: "
        + ("met" if not misses else "missed by " + ", ".join(misses))
    ]
    if parity:
        lines.append(f"  within {PARITY_BAND:.0%} (noise) below parity: " + ", ".join(parity))
    for row in rows:
        kv, lm = row.ms("kvrows"), row.ms("mlx-lm")
        if row.op == "join" and row.shape.batch == 16 and kv and lm:
            state = "met" if lm / kv >= 3 else "missed"
            lines.append(
                f"target: join into B=16 at least 3x faster: {state} at {row.shape.label} "
                f"({lm / kv:.1f}x)"
            )
    return lines


_NOTES = """\
ratio = mlx-lm ms / kvrows ms (> 1: kvrows faster). GB/s = MB moved / time.
MB moved (valid K+V bytes read + written; T = one token's K+V bytes):
  merge 2*B*L*T; merge-step 2*B*L*T + B*T; join 2*L*T (the new row only);
  filter-half / filter-one 2*kept*(L+1)*T (the kept rows, as a compacting gather moves them);
  extract 2*(L+1)*T; update B*T (the new tokens);
  decode sum(len_b+2)*T + B*T (every valid byte attention reads, plus the new tokens).
copy: MLX concatenate of MB moved / 2; memcpy: numpy.copyto of the same, pre-touched.
merge-step: merge, then one update_and_fetch (what BatchGenerator does after a merge).
live batch (join, filter, extract): merged from B rows of L tokens, then one decode step.
filter-half keeps the odd rows; filter-one drops row 0; extract takes row B//2.
update: make_mask(1) + update_and_fetch, no attention, on the decode batch.
decode: ragged rows (L down to about L/2 tokens), make_mask(1) + update_and_fetch + attention,
  32 query heads over 8 KV heads; kvrows.optimized.attend vs mx.fast.scaled_dot_product_attention.
reference: kvrows.reference (NumPy), for context; skipped where B*L > {limit}.
Linux CPU backend: large fresh buffers are page-faulted (~2.5 GB/s); see the kvrows.bench
  docstring for MALLOC_MMAP_THRESHOLD_, which removes that cost for both implementations."""


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "?"


def run_bench(
    quick: bool = False,
    repeats: int | None = None,
    *,
    shapes: Sequence[Shape] | None = None,
    out: TextIO | None = None,
) -> int:
    """Time every operation at every shape, print the table; 0 unless a result was wrong."""
    stream = out if out is not None else sys.stdout
    chosen = tuple(shapes) if shapes is not None else QUICK_SHAPES if quick else FULL_SHAPES
    timed = repeats if repeats is not None else 2 if quick else 7
    if timed < 1:
        raise ValueError(f"repeats must be >= 1, got {timed}")
    warmups = 1 if quick else 2
    print(
        f"kvrows bench: plain family, one layer, mlx {_version('mlx')}, "
        f"mlx-lm {_version('mlx-lm')}, on "
        f"{mx.default_device()}; median of {timed} after {warmups} warm-up(s)",
        file=stream,
        flush=True,
    )
    rows: list[_Row] = []
    failures: list[str] = []
    for shape in chosen:
        bench = ShapeBench(shape)
        for op in OPERATIONS:
            row = _Row(op, shape, bench.bytes_moved(op))
            impls = [impl for impl in IMPLEMENTATIONS if bench.runs(impl)]
            row.timings.update(
                (impl, Timing(None, "skipped")) for impl in IMPLEMENTATIONS if impl not in impls
            )
            if not quick:
                print(f"  {shape.label} {op}", file=sys.stderr, flush=True)
            outcomes = time_workloads(
                [bench.workload(op, impl) for impl in impls],
                repeats=[min(timed, 3) if impl == "reference" else timed for impl in impls],
                warmups=warmups,
            )
            for impl, outcome in zip(impls, outcomes, strict=True):
                if isinstance(outcome, BenchCheckError):
                    failures.append(f"{op} {shape.label} {impl}: {outcome}")
                    row.timings[impl] = Timing(None, "wrong")
                else:
                    row.timings[impl] = Timing(outcome)
            rows.append(row)
            bench.release()
        del bench
        gc.collect()
        mx.clear_cache()
    print(format_table(rows), file=stream)
    print(_NOTES.format(limit=REFERENCE_MAX_TOKENS), file=stream)
    for line in _verdict(rows):
        print(line, file=stream)
    for failure in failures:
        print(f"WRONG RESULT: {failure}", file=stream)
    stream.flush()
    return 1 if failures else 0


# -- the helpers other families' benchmarks build on (kvrows.bench_affine, kvrows.bench_ring) --

Impl = _Impl
KvrowsImpl = _Kvrows
MlxLmImpl = _MlxLm
BenchData = _Data
Live = _Live
check_same = _same
check_equal = _equal
reference_attention = _attention
format_ms = _ms
format_gbps = _gbps
package_version = _version
