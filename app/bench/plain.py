"""Benchmarks of the plain family's row operations against mlx-lm and a plain copy.

Shared by ``kvrows bench --family plain`` and ``benchmarks/test_bench_plain.py``.

One attention layer: 8 KV heads, head dim 128, float16 unless a shape says otherwise.
The operations (``merge``, ``merge-step``, ``join``, ``filter-half``, ``filter-one``,
``extract``, ``update``, ``decode``), the bytes each moves and the baselines (``copy``: an
MLX concatenate of those bytes; ``memcpy``: ``numpy.copyto`` into a pre-touched buffer, the
CPU's practical ceiling; ``reference``: the NumPy reference, skipped above
:data:`REFERENCE_MAX_TOKENS` tokens) are stated once, in :data:`NOTES`, which the run prints
under its table. Every operation is one method of an implementation adapter (:class:`Impl`);
the other row families (rotating, affine, paged) are adapters of their own storages.

Method: the runner's (:mod:`kvrows.app.bench.runner`); setup (fresh live batches for the
in-place operations, fresh inputs) is not timed, and each workload's last result is
checked against the generated input data.

Allocation dominates on Linux's CPU backend: MLX keeps no buffer cache there,
and glibc serves blocks above its mmap threshold (at most 32 MB) with fresh
pages, so every large new buffer pays a page fault per 4 KiB (about 2.5 GB/s)
as it is first written. Both implementations pay it in proportion to the bytes
they allocate. ``MALLOC_MMAP_THRESHOLD_=4294967296
MALLOC_TRIM_THRESHOLD_=68719476736 kvrows bench`` keeps freed memory in the
heap and shows the figures without that cost.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows.app.bench.runner import (
    NP,
    BenchCheckError,
    Case,
    Family,
    Line,
    Result,
    Table,
    Timing,
    Workload,
    check_equal,
    check_same,
    format_gbps,
    parity_verdict,
    ratio,
    to_numpy,
)

# mlx-lm's cache module, untyped: reached through Any.
lm_cache: Any = importlib.import_module("mlx_lm.models.cache")

__all__ = [
    "CI_SHAPES",
    "FULL_SHAPES",
    "IMPLEMENTATIONS",
    "OPERATIONS",
    "BenchData",
    "KvrowsImpl",
    "MlxLmImpl",
    "Shape",
    "ShapeBench",
    "family",
    "reference_attention",
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
    def cells(self) -> Line:
        """The table columns that name a shape, and their cells."""
        return {"B": str(self.batch), "L": str(self.tokens)}

    @property
    def label(self) -> str:
        return f"B={self.batch} L={self.tokens}"


#: The realistic shapes of the issue.
FULL_SHAPES = tuple(Shape(b, t) for b in (4, 16) for t in (1024, 4096))
#: ``kvrows bench --quick``: a smoke run.
QUICK_SHAPES = (Shape(4, 128),)
#: ``benchmarks/`` without ``KVROWS_BENCH_FULL=1``: small, odd sizes (growth, odd B).
CI_SHAPES = (Shape(4, 64), Shape(3, 300))


def reference_attention(queries: NP, keys: NP, values: NP, scale: float) -> NP:
    """One row's attention in float32: queries ``[Hq, N, D]``, keys/values ``[H, S, D]``."""
    group = queries.shape[0] // keys.shape[0]
    k = np.repeat(keys.astype(np.float32), group, axis=0)
    v = np.repeat(values.astype(np.float32), group, axis=0)
    scores = np.einsum("hnd,hsd->hns", queries.astype(np.float32), k) * np.float32(scale)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out: NP = np.einsum("hns,hsd->hnd", weights, v)
    return out


# -- data -------------------------------------------------------------------------


class BenchData:
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
        self._numpy: dict[str, NP] = {}

    def np(self, name: str) -> NP:
        """A NumPy copy of the array called ``name`` (cached)."""
        if name not in self._numpy:
            self._numpy[name] = to_numpy(getattr(self, name))
        return self._numpy[name]


# -- the implementations ---------------------------------------------------------


def fill(cache: Any, keys: Any, values: Any) -> None:
    """A source row's tokens, as one ``update_and_fetch``."""
    cache.update_and_fetch(keys, values)


class Impl:
    """How one implementation performs each operation (every method ends evaluated).

    Data, not subclasses, say which storage: ``make_serial`` / ``make_batch`` build the
    serial cache and the batch, ``feed`` puts a source row's tokens in the serial cache,
    ``read_rows`` (if given) reads a batch's rows back for checks, ``planes`` one fetched
    plane (the affine family: its stored bytes). A new codec or geometry is a new instance.
    """

    name = ""

    def __init__(
        self,
        name: str | None = None,
        *,
        make_serial: Callable[[], Any] | None = None,
        make_batch: Callable[[], Any] | None = None,
        feed: Callable[[Any, Any, Any], None] = fill,
        read_rows: Callable[[Any], list[tuple[NP, NP]]] | None = None,
        planes: Callable[[Any], NP] = to_numpy,
    ) -> None:
        self.name = name or self.name
        self.make_serial = make_serial or self._default_serial
        self.make_batch = make_batch or self._default_batch
        self.feed, self.read_rows, self.planes = feed, read_rows, planes

    def _default_serial(self) -> Any:
        raise NotImplementedError

    def _default_batch(self) -> Any:
        raise NotImplementedError

    def array(self, data: mx.array) -> Any:
        return data

    def sync(self, *arrays: Any) -> None:
        mx.eval(*(a for a in arrays if a is not None and not isinstance(a, str)))

    def held(self, cache: Any) -> tuple[Any, ...]:
        """What evaluating a serial cache evaluates."""
        return (cache.held_arrays(),)

    def batch_state(self, batch: Any) -> tuple[Any, ...]:
        """What evaluating a batch evaluates."""
        return self.held(batch)

    def serial(self, keys: Any, values: Any) -> Any:
        cache = self.make_serial()
        self.feed(cache, keys, values)
        self.sync(*self.held(cache))
        return cache

    def merge(self, rows: Sequence[Any]) -> Any:
        layout = self.make_batch()
        layout.merge_rows(rows)
        self.sync(*self.batch_state(layout))
        return layout

    def joiner(self, serial: Any) -> Any:
        """What ``join`` takes: the serial cache itself, or a one-row batch (mlx-lm)."""
        return serial

    def join(self, batch: Any, joiner: Any) -> Any:
        batch.merge_rows([joiner])
        self.sync(*self.batch_state(batch))
        return batch

    def filter(self, batch: Any, keep: list[int]) -> Any:
        batch.filter_rows(keep)
        self.sync(*self.batch_state(batch))
        return batch

    def extract(self, batch: Any, row: int) -> Any:
        cache = batch.extract_row(row)
        self.sync(*self.held(cache))
        return cache

    def step(self, batch: Any, keys: Any, values: Any) -> None:
        """``update_and_fetch`` of one token per row, no attention (live-batch setup)."""
        self.sync(*batch.update_and_fetch(keys, values))

    def update(self, batch: Any, keys: Any, values: Any) -> None:
        """A decode step's cache work: ``make_mask(1)`` then ``update_and_fetch``."""
        mask = batch.make_mask(1)
        self.sync(mask, *batch.update_and_fetch(keys, values))

    def decode(self, batch: Any, queries: Any, keys: Any, values: Any, scale: float) -> Any:
        raise NotImplementedError

    def rows(self, batch: Any) -> list[tuple[NP, NP]]:
        """Every row's valid keys and values ``[H, tokens, D]``, read back for checks."""
        if self.read_rows is not None:
            return self.read_rows(batch)
        keys, values = (self.planes(x) for x in batch.fetch())
        return [
            (keys[b, :, p : p + n], values[b, :, p : p + n])
            for b, (p, n) in enumerate(zip(batch.left_pad, batch.row_offsets, strict=True))
        ]

    def serial_data(self, cache: Any) -> tuple[NP, NP]:
        keys, values = (self.planes(x) for x in cache.fetch())
        return keys[0], values[0]


class KvrowsImpl(Impl):
    """``kvrows.optimized`` (MLX) unless told otherwise; ``kvrows.reference`` reuses it
    with NumPy arrays."""

    name = "kvrows"
    module: Any = optimized

    def _default_serial(self) -> Any:
        return self.module.KVCache()

    def _default_batch(self) -> Any:
        return self.module.PaddedKVRows()

    def decode(self, batch: Any, queries: Any, keys: Any, values: Any, scale: float) -> Any:
        mask = batch.make_mask(1)
        fetched = batch.update_and_fetch(keys, values)
        out = self.module.attend(queries, batch, mask, scale)
        self.sync(out, fetched)
        return out


class ReferenceImpl(KvrowsImpl):
    name = "reference"
    module = reference

    def array(self, data: mx.array) -> Any:
        return to_numpy(data)

    def sync(self, *arrays: Any) -> None:
        return None


class MlxLmImpl(Impl):
    """mlx-lm's ``KVCache`` / ``BatchKVCache`` unless told otherwise (``make_batch``: the
    batch class, whose ``merge`` builds it)."""

    name = "mlx-lm"

    def _default_serial(self) -> Any:
        return lm_cache.KVCache()

    def _default_batch(self) -> Any:
        return lm_cache.BatchKVCache

    def held(self, cache: Any) -> tuple[Any, ...]:
        return (cache.keys, cache.values)

    def batch_state(self, batch: Any) -> tuple[Any, ...]:
        return (batch.keys, batch.values, batch.offset, batch.left_padding)

    def merge(self, rows: Sequence[Any]) -> Any:
        batch = self.make_batch().merge(list(rows))
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
        self.sync(*self.held(cache))
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

    def rows(self, batch: Any) -> list[tuple[NP, NP]]:
        if self.read_rows is not None:
            return self.read_rows(batch)
        pads = [int(p) for p in batch.left_padding.tolist()]
        end = int(batch._idx)
        keys, values = to_numpy(batch.keys), to_numpy(batch.values)
        return [(keys[b, :, p:end], values[b, :, p:end]) for b, p in enumerate(pads)]

    def serial_data(self, cache: Any) -> tuple[NP, NP]:
        n = int(cache.offset)
        return to_numpy(cache.keys[0, :, :n]), to_numpy(cache.values[0, :, :n])


IMPLS: dict[str, Impl] = {
    "kvrows": KvrowsImpl(),
    "mlx-lm": MlxLmImpl(),
    "reference": ReferenceImpl(),
}


@dataclass
class Live:
    """A decode batch reused across timed steps, and how many steps it has taken."""

    batch: Any
    steps: int


class ShapeBench:
    """The workloads of one shape, with their generated data and cached sources.

    Other families reuse it by subclassing: ``operations``, ``implementations``,
    ``impls`` (the adapters by name) and ``token_bytes`` say what they run and how
    many bytes one token's keys and values hold; ``data`` lets several benches share
    one set of generated inputs.
    """

    operations: tuple[str, ...] = OPERATIONS
    implementations: tuple[str, ...] = IMPLEMENTATIONS
    impls: Mapping[str, Impl] = IMPLS

    def __init__(self, shape: Shape, data: BenchData | None = None) -> None:
        self.shape = shape
        self.data = data if data is not None else BenchData(shape)
        self._cache: dict[tuple[str, str], Any] = {}

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values as stored (the plain family: ``shape.token_bytes``)."""
        return self.shape.token_bytes

    def adapter(self, impl: str) -> Impl:
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

    def _rows(self, impl: Impl, lengths: Sequence[int]) -> list[Any]:
        keys, values = self.data.keys, self.data.values
        return [
            impl.serial(impl.array(keys[b : b + 1, :, :n]), impl.array(values[b : b + 1, :, :n]))
            for b, n in enumerate(lengths)
        ]

    def _equal_rows(self, impl: Impl) -> list[Any]:
        return self._cached(  # type: ignore[no-any-return]
            impl.name, "rows", lambda: self._rows(impl, [self.shape.tokens] * self.shape.batch)
        )

    def _live(self, impl: Impl, lengths: Sequence[int] | None = None) -> Any:
        """A freshly merged batch after one decode step."""
        rows = (
            self._equal_rows(impl)
            if lengths is None
            else self._cached(impl.name, "ragged", lambda: self._rows(impl, lengths))
        )
        batch = impl.merge(rows)
        impl.step(batch, impl.array(self.data.step_keys), impl.array(self.data.step_values))
        return batch

    def _joiner(self, impl: Impl) -> Any:
        def build() -> Any:
            serial = impl.serial(impl.array(self.data.join_keys), impl.array(self.data.join_values))
            return impl.joiner(serial)

        return self._cached(impl.name, "joiner", build)

    def release(self) -> None:
        """Drop the cached sources and live batches (the generated data stays)."""
        self._cache.clear()

    # -- expected contents -------------------------------------------------------
    def _held(self, tokens: int) -> int:
        """Positions a row of ``tokens`` tokens holds (a ring: at most its window)."""
        return tokens

    def _expected_row(self, row: int, tokens: int, steps: int) -> tuple[NP, NP]:
        """The newest ``_held(tokens + steps)`` of source row ``row``'s first ``tokens``
        tokens followed by ``steps`` step tokens."""
        k = self.data.np("keys")[row, :, :tokens]
        v = self.data.np("values")[row, :, :tokens]
        sk = np.repeat(self.data.np("step_keys")[row], steps, axis=1)
        sv = np.repeat(self.data.np("step_values")[row], steps, axis=1)
        first = tokens + steps - self._held(tokens + steps)
        return np.concatenate([k, sk], axis=1)[:, first:], np.concatenate([v, sv], axis=1)[
            :, first:
        ]

    def _check_rows(self, held: list[tuple[NP, NP]], sources: Sequence[int], what: str) -> None:
        """``held`` is exactly source rows ``sources`` (each L tokens + one step token)."""
        check_equal(f"{what}: row count", len(held), len(sources))
        for b, source in enumerate(sources):
            k, v = self._expected_row(source, self.shape.tokens, 1)
            check_same(f"{what}: row {b} keys", held[b][0], k)
            check_same(f"{what}: row {b} values", held[b][1], v)

    # -- workloads -----------------------------------------------------------------
    def bytes_moved(self, op: str) -> int:
        s, t, held = self.shape, self.token_bytes, self._held
        if op == "merge":
            return 2 * s.batch * held(s.tokens) * t
        if op == "merge-step":
            return 2 * s.batch * held(s.tokens) * t + s.batch * t
        if op == "join":
            return 2 * held(s.tokens) * t
        if op in ("filter-half", "filter-one"):
            return 2 * len(self.keep(op)) * held(s.tokens + 1) * t
        if op == "extract":
            return 2 * held(s.tokens + 1) * t
        if op == "update":
            return s.batch * t
        if op == "decode":
            return sum(held(n + 2) for n in s.ragged) * t + s.batch * t
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

    def case(self, op: str) -> Case:
        """``op`` by every implementation that runs at this shape, timed together."""
        runs = [impl for impl in self.implementations if self.runs(impl)]
        moved = self.bytes_moved(op)

        def lines(t: Mapping[str, Timing]) -> list[Line]:
            kv, lm = t["kvrows"].ms, t["mlx-lm"].ms
            return [
                {
                    "op": op,
                    **self.shape.cells,
                    "kvrows ms": t["kvrows"].cell,
                    "mlx-lm ms": t["mlx-lm"].cell,
                    "ratio": ratio(lm, kv),
                    **{f"{impl} ms": t[impl].cell for impl in self.implementations[2:]},
                    "MB moved": f"{moved / 1e6:.1f}",
                    "GB/s kvrows": format_gbps(moved, kv),
                    "GB/s mlx-lm": format_gbps(moved, lm),
                    "GB/s copy": format_gbps(moved, t["copy"].ms),
                }
            ]

        return Case(
            f"{op} {self.shape.label}",
            {impl: self.workload(op, impl) for impl in runs},
            lines,
            key=(op, self.shape),
            skipped=tuple(impl for impl in self.implementations if impl not in runs),
            max_repeats={"reference": 3},
            release=self.release,
        )

    def cases(self) -> Iterator[Case]:
        for op in self.operations:
            yield self.case(op)

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

            def np_setup() -> tuple[NP, NP]:
                def build() -> tuple[NP, NP]:
                    src = to_numpy(source())
                    dst = np.empty_like(src)
                    dst[...] = 1  # touch every page
                    return src, dst

                return self._cached("memcpy", f"buffers-{count}", build)  # type: ignore[no-any-return]

            def np_run(state: tuple[NP, NP]) -> tuple[NP, NP]:
                np.copyto(state[1], state[0])
                return state

            def np_check(state: tuple[NP, NP]) -> None:
                check_same("memcpy", state[1], state[0])

            return np_setup, np_run, np_check

        def mx_run(src: mx.array) -> tuple[mx.array, mx.array]:
            out = mx.concatenate([src, src[:0]])
            mx.eval(out)
            return src, out

        def mx_check(result: tuple[mx.array, mx.array]) -> None:
            check_same("copy", to_numpy(result[1]), to_numpy(result[0]))

        return source, mx_run, mx_check

    def _merge(self, impl: Impl) -> _Parts:
        def check(batch: Any) -> None:
            held = impl.rows(batch)
            check_equal("merge: row count", len(held), self.shape.batch)
            for b, (k, v) in enumerate(held):
                expected_k, expected_v = self._expected_row(b, self.shape.tokens, 0)
                check_same(f"merge: row {b} keys", k, expected_k)
                check_same(f"merge: row {b} values", v, expected_v)

        return lambda: self._equal_rows(impl), impl.merge, check

    def _merge_step(self, impl: Impl) -> _Parts:
        step_keys = impl.array(self.data.step_keys)
        step_values = impl.array(self.data.step_values)

        def run(rows: list[Any]) -> Any:
            batch = impl.merge(rows)
            impl.step(batch, step_keys, step_values)
            return batch

        def check(batch: Any) -> None:
            self._check_rows(impl.rows(batch), range(self.shape.batch), "merge-step")

        return lambda: self._equal_rows(impl), run, check

    def _join(self, impl: Impl) -> _Parts:
        def setup() -> tuple[Any, Any]:
            return self._live(impl), self._joiner(impl)

        def run(state: tuple[Any, Any]) -> Any:
            return impl.join(*state)

        first = self.shape.tokens - self._held(self.shape.tokens)

        def check(batch: Any) -> None:
            held = impl.rows(batch)
            self._check_rows(held[:-1], range(self.shape.batch), "join")
            check_same("join: new row keys", held[-1][0], self.data.np("join_keys")[0, :, first:])
            new_values = self.data.np("join_values")[0, :, first:]
            check_same("join: new row values", held[-1][1], new_values)

        return setup, run, check

    def _filter(self, impl: Impl, op: str) -> _Parts:
        keep = self.keep(op)

        def run(batch: Any) -> Any:
            return impl.filter(batch, keep)

        def check(batch: Any) -> None:
            self._check_rows(impl.rows(batch), keep, op)

        return lambda: self._live(impl), run, check

    def _filter_half(self, impl: Impl) -> _Parts:
        return self._filter(impl, "filter-half")

    def _filter_one(self, impl: Impl) -> _Parts:
        return self._filter(impl, "filter-one")

    def _extract(self, impl: Impl) -> _Parts:
        row = self.shape.batch // 2

        def run(batch: Any) -> Any:
            return impl.extract(batch, row)

        def check(cache: Any) -> None:
            keys, values = impl.serial_data(cache)
            k, v = self._expected_row(row, self.shape.tokens, 1)
            check_same("extract: keys", keys, k)
            check_same("extract: values", values, v)

        return lambda: self._cached(impl.name, "live", lambda: self._live(impl)), run, check

    def _stepping(self, impl: Impl, op: str) -> Callable[[], Live]:
        """Setup of ``update`` and ``decode``: one ragged live batch, reused step after step."""
        lengths = self.shape.ragged

        def setup() -> Live:
            live: Live = self._cached(impl.name, op, lambda: Live(self._live(impl, lengths), 1))
            if live.steps > 200:  # stay clear of a capacity crossing
                self._cache.pop((impl.name, op))
                return setup()
            return live

        return setup

    def _update(self, impl: Impl) -> _Parts:
        lengths = self.shape.ragged
        keys, values = impl.array(self.data.step_keys), impl.array(self.data.step_values)

        def run(live: Live) -> Live:
            impl.update(live.batch, keys, values)
            live.steps += 1
            return live

        def check(live: Live) -> None:
            held = impl.rows(live.batch)
            check_equal("update: row count", len(held), len(lengths))
            for b, n in enumerate(lengths):
                k, v = self._expected_row(b, n, live.steps)
                check_same(f"update: row {b} keys", held[b][0], k)
                check_same(f"update: row {b} values", held[b][1], v)

        return self._stepping(impl, "update"), run, check

    def _decode(self, impl: Impl) -> _Parts:
        lengths = self.shape.ragged
        queries = impl.array(self.data.queries)
        keys, values = impl.array(self.data.step_keys), impl.array(self.data.step_values)

        def run(live: Live) -> tuple[Any, int, tuple[int, ...]]:
            out = impl.decode(live.batch, queries, keys, values, self.data.scale)
            live.steps += 1
            return out, live.steps, tuple(int(x) for x in np.array(live.batch.offset))

        def check(result: tuple[Any, int, tuple[int, ...]]) -> None:
            out, steps, offsets = result
            check_equal("decode: row offsets", offsets, tuple(n + steps for n in lengths))
            got = to_numpy(out).astype(np.float32)
            q = self.data.np("queries")
            for b, n in enumerate(lengths):
                k, v = self._expected_row(b, n, steps)
                expected = reference_attention(q[b], k, v, self.data.scale)
                if not np.allclose(got[b], expected, rtol=2e-2, atol=2e-3):
                    worst = float(np.max(np.abs(got[b] - expected)))
                    raise BenchCheckError(
                        f"decode: row {b} attention differs from the expected by up to {worst:.4g}"
                    )

        return self._stepping(impl, "decode"), run, check


NOTES = """\
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
Linux CPU backend: large fresh buffers are page-faulted (~2.5 GB/s); see the kvrows.app.bench.plain
  docstring for MALLOC_MMAP_THRESHOLD_, which removes that cost for both implementations."""


def _verdict(results: Sequence[Result]) -> list[str]:
    """The issue's targets, against this run's medians (information, never an exit status)."""
    lines = parity_verdict(results)
    for result in results:
        op, shape = result.key
        kv, lm = result.ms("kvrows"), result.ms("mlx-lm")
        if op == "join" and shape.batch == 16 and kv and lm:
            state = "met" if lm / kv >= 3 else "missed"
            lines.append(
                f"target: join into B=16 at least 3x faster: {state} at {shape.label} "
                f"({lm / kv:.1f}x)"
            )
    return lines


def family(*, quick: bool = False, shapes: Sequence[Shape] | None = None) -> Family:
    """The plain family's table: every operation at every shape."""
    chosen = tuple(shapes) if shapes is not None else QUICK_SHAPES if quick else FULL_SHAPES

    def cases() -> Iterator[Case]:
        for shape in chosen:
            yield from ShapeBench(shape).cases()

    return Family(
        "plain",
        "one layer",
        [Table(cases())],
        NOTES.format(limit=REFERENCE_MAX_TOKENS),
        _verdict,
    )
