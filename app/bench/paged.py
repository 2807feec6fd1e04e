"""The paged family: block-table row operations against the contiguous layouts and mlx-lm.

Shared by ``kvrows bench --family paged`` and ``benchmarks/test_bench_paged.py``.

One attention layer, float16, ``H`` KV heads of dim ``D`` (the plain family's 8 x 128 by
default), block size 16. Implementations:

* ``paged``: ``kvrows.optimized.PagedKvRows`` over one ``BlockPool`` holding every row (the
  serial rows are ``PagedKVCache`` s of that pool, prefilled once);
* ``contiguous``: ``kvrows.optimized.PaddedKVRows`` over ``KVCache`` rows;
* ``mlx-lm``: ``BatchKVCache.merge`` / ``extend`` / ``filter`` / ``extract`` over mlx-lm
  ``KVCache`` rows.

Operations: ``merge`` (``B`` rows of ``L`` tokens into a batch), ``filter`` (a live batch
keeps its odd rows), ``extract`` (row ``B//2`` as a serial cache), ``join`` (one row of
``L`` tokens joins a live batch of ``B``), ``decode`` (one step on the live batch:
``make_mask(1)``, ``update_and_fetch`` of one token per row and attention of ``4·H`` query
heads: the paged read gathers every row's blocks). ``bytes`` is what the operation moves:
for ``paged`` the pool's counters (``bytes_copied`` + ``bytes_written`` difference: 0 for
the row operations, the ``B`` new tokens for decode), for the others the bytes a compacting
copy moves (``2·B·L·T`` for merge, and so on; ``T`` = bytes of one token's K and V).

The append table: one row of ``L`` tokens appended into a pool allocated once and reused
(``BlockPool.append``) against ``numpy.copyto`` of the same bytes into a pre-touched buffer
(the CPU's practical ceiling) and a fresh contiguous ``KVCache.update_and_fetch``.

Every timed call ends with ``mx.eval`` of what it produced; setup is not timed; the last
result of each workload is checked (tables, row contents, counters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

import kvrows.optimized as optimized
from kvrows.app.bench.plain import Impl, KvrowsImpl, MlxLmImpl
from kvrows.app.bench.runner import (
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
from kvrows.optimized import BlockPool, PagedKVCache, PagedKvRows
from kvrows.validation import KvGeometry

__all__ = [
    "CI_SHAPES",
    "FULL_SHAPES",
    "IMPLS",
    "OPERATIONS",
    "QUICK_SHAPES",
    "PagedShape",
    "append_cases",
    "family",
    "shape_cases",
]

OPERATIONS = ("merge", "filter", "extract", "join", "decode")
#: The implementations a case times, by their column label (labels, not geometry kinds).
PAGED, CONTIGUOUS, MLX_LM = "paged", "contiguous", "mlx-lm"
IMPLS = (PAGED, CONTIGUOUS, MLX_LM)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class PagedShape:
    batch: int
    tokens: int
    heads: int = 8
    head_dim: int = 128

    @property
    def token_bytes(self) -> int:
        return 2 * self.heads * self.head_dim * 2

    @property
    def label(self) -> str:
        return f"B={self.batch} L={self.tokens}"


FULL_SHAPES = tuple(PagedShape(b, t) for b in (4, 16, 64) for t in (1024, 4096))
QUICK_SHAPES = (PagedShape(4, 256, heads=4, head_dim=64), PagedShape(16, 256, heads=4, head_dim=64))
#: ``benchmarks/`` without ``KVROWS_BENCH_FULL=1`` and the smoke test: seconds.
CI_SHAPES = (PagedShape(3, 40, heads=2, head_dim=32),)


class _Data:
    """One shape's inputs and its serial rows in all three implementations."""

    def __init__(self, shape: PagedShape) -> None:
        b, h, t, d = shape.batch, shape.heads, shape.tokens, shape.head_dim
        seeds = mx.random.split(mx.random.key(0), 6)
        self.keys = mx.random.normal((b + 1, h, t, d), key=seeds[0]).astype(mx.float16)
        self.values = mx.random.normal((b + 1, h, t, d), key=seeds[1]).astype(mx.float16)
        self.step_keys = mx.random.normal((b, h, 1, d), key=seeds[2]).astype(mx.float16)
        self.step_values = mx.random.normal((b, h, 1, d), key=seeds[3]).astype(mx.float16)
        self.queries = mx.random.normal((b, 4 * h, 1, d), key=seeds[4]).astype(mx.float16)
        self.scale = 1.0 / float(np.sqrt(d))
        mx.eval(self.keys, self.values, self.step_keys, self.step_values, self.queries)
        self.shape = shape
        geometry = KvGeometry(h, d, d, "float16")
        blocks = (b + 2) * (-(-(t + 2) // BLOCK_SIZE)) + 8
        self.pool = BlockPool(block_size=BLOCK_SIZE, num_blocks=blocks, geometry=geometry)
        self.rows: dict[str, list[Any]] = {name: [] for name in IMPLS}
        for r in range(b + 1):
            k, v = self.keys[r : r + 1], self.values[r : r + 1]
            paged = PagedKVCache(pool=self.pool)
            paged.update_and_fetch(k, v)
            self.rows[PAGED].append(paged)
            for name in (CONTIGUOUS, MLX_LM):
                self.rows[name].append(ADAPTERS[name].serial(k, v))

    def moved(self) -> int:
        return self.pool.bytes_copied + self.pool.bytes_written


#: How each implementation performs the row operations (the plain family's adapters).
ADAPTERS: dict[str, Impl] = {
    PAGED: KvrowsImpl(PAGED, make_batch=PagedKvRows),  # over the serial rows' pool
    CONTIGUOUS: KvrowsImpl(),
    MLX_LM: MlxLmImpl(),
}


def _expect(data: _Data, source: int, what: str, got: tuple[Any, Any]) -> None:
    n = got[0].shape[1]
    keys = to_numpy(data.keys[source, :, :n])
    values = to_numpy(data.values[source, :, :n])
    if not (np.array_equal(got[0], keys) and np.array_equal(got[1], values)):
        raise BenchCheckError(f"{what}: row {source} is not the input data")


def _decode(batch: Any, data: _Data) -> Any:
    """One step: ``make_mask(1)``, ``update_and_fetch`` and ``mx.fast`` SDPA (every
    implementation reads its K/V the same way: the paged read gathers the blocks)."""
    mask = batch.make_mask(1)
    k, v = batch.update_and_fetch(data.step_keys, data.step_values)
    out = mx.fast.scaled_dot_product_attention(data.queries, k, v, scale=data.scale, mask=mask)
    mx.eval(out)
    return out


def shape_cases(shape: PagedShape) -> Iterator[Case]:
    """One case per operation at ``shape`` (its data generated once, shared)."""
    data = _Data(shape)
    b, t, tb = shape.batch, shape.tokens, shape.token_bytes
    kept = list(range(1, b, 2))
    copied = {
        "merge": 2 * b * t * tb,
        "filter": 2 * len(kept) * t * tb,
        "extract": 2 * t * tb,
        "join": 2 * t * tb,
        "decode": sum(2 * (t + 1) * tb for _ in range(b)) + b * tb,
    }

    # What the pool's counters must see: nothing for the row operations; for decode the B
    # new tokens, and a copy of each row's partly filled tail first (the live batch shares
    # it with the serial row: copy on write).
    paged_moved = {op: 0 for op in OPERATIONS}
    paged_moved["decode"] = b * tb + b * (t % BLOCK_SIZE) * tb

    def workload(op: str, name: str) -> Workload:
        impl, rows = ADAPTERS[name], data.rows[name]
        before = [0]

        def setup() -> Any:
            state = None if op == "merge" else impl.merge(rows[:b])  # a fresh live batch
            if op == "join":
                state = (state, impl.joiner(rows[b]))
            before[0] = data.moved()
            return state

        runs: dict[str, Callable[[Any], Any]] = {
            "merge": lambda _: impl.merge(rows[:b]),
            "filter": lambda batch: impl.filter(batch, kept),
            "extract": lambda batch: impl.extract(batch, b // 2),
            "join": lambda state: impl.join(*state),
            "decode": lambda batch: _decode(batch, data),
        }
        # The source rows a result must hold, each with what the result holds there.
        held: dict[str, Callable[[Any], list[tuple[int, Any]]]] = {
            "merge": lambda out: [(r, impl.rows(out)[r]) for r in (0, b - 1)],
            "filter": lambda out: [(kept[-1], impl.rows(out)[len(kept) - 1])],
            "extract": lambda out: [(b // 2, impl.serial_data(out))],
            "join": lambda out: [(b, impl.rows(out)[b])],
            "decode": lambda out: [],
        }

        def run(state: Any) -> Any:
            return runs[op](state), data.moved() - before[0]

        def check(result: Any) -> None:
            for source, got in held[op](result[0]):
                _expect(data, source, f"{op} {name}", got)
            if op == "decode" and result[0].shape != (b, 4 * shape.heads, 1, shape.head_dim):
                raise BenchCheckError(f"decode {name}: output shape {result[0].shape}")
            if name == PAGED:
                check_equal(f"{op} paged bytes moved", result[1], paged_moved[op])

        return Workload(op, name, shape, copied[op], setup, run, check)

    for op in OPERATIONS:
        loads = {impl: workload(op, impl) for impl in IMPLS}

        def lines(timings: Mapping[str, Timing], op: str = op) -> list[Line]:
            paged = timings["paged"].ms
            return [
                {
                    "op": op,
                    "B": str(b),
                    "L": str(t),
                    "paged ms": timings["paged"].cell,
                    "contiguous ms": timings["contiguous"].cell,
                    "mlx-lm ms": timings["mlx-lm"].cell,
                    "paged bytes": str(paged_moved[op]),
                    "copy bytes": str(copied[op]),
                    "contiguous/paged": ratio(timings["contiguous"].ms, paged),
                    "mlx-lm/paged": ratio(timings["mlx-lm"].ms, paged),
                }
            ]

        yield Case(f"{op} {shape.label}", loads, lines, key=(op, shape))


def append_cases(shapes: Sequence[PagedShape]) -> Iterator[Case]:
    """One append case per distinct ``(L, H, D)`` of ``shapes``."""
    seen: set[tuple[int, int, int]] = set()
    for shape in shapes:
        key = (shape.tokens, shape.heads, shape.head_dim)
        if key in seen:
            continue
        seen.add(key)
        h, t, d = shape.heads, shape.tokens, shape.head_dim
        seeds = mx.random.split(mx.random.key(1), 2)
        keys = mx.random.normal((1, h, t, d), key=seeds[0]).astype(mx.float16)
        values = mx.random.normal((1, h, t, d), key=seeds[1]).astype(mx.float16)
        mx.eval(keys, values)
        nbytes = 2 * int(keys.nbytes)
        pool = BlockPool(
            block_size=BLOCK_SIZE,
            num_blocks=2 * (-(-t // BLOCK_SIZE)),
            geometry=KvGeometry(h, d, d, "float16"),
        )
        source = np.concatenate([to_numpy(keys).ravel(), to_numpy(values).ravel()])
        target = np.empty_like(source)
        np.copyto(target, source)  # pre-touched

        def append(
            _: Any, pool: BlockPool = pool, k: Any = keys, v: Any = values, t: int = t
        ) -> Any:
            table = pool.open([])
            pool.append([table], [0], {"keys": (k,), "values": (v,)}, t)
            return pool, table

        def check_append(result: Any, k: Any = keys, t: int = t) -> None:
            pool, table = result
            got = pool.gather([table], [[(0, t)]], [0], t)["keys"]
            pool.close([table])
            if not np.array_equal(to_numpy(got[0]), to_numpy(k)):
                raise BenchCheckError("paged append: the pool does not hold the keys")

        def copy(_: Any, s: Any = source, o: Any = target) -> Any:
            np.copyto(o, s)
            return o

        def check_copy(result: Any, s: Any = source) -> None:
            if not np.array_equal(result, s):
                raise BenchCheckError("memcpy: wrong bytes")

        def fresh(_: Any, k: Any = keys, v: Any = values) -> Any:
            cache = optimized.KVCache()
            cache.update_and_fetch(k, v)
            mx.eval(cache.held_arrays())
            return cache

        def check_fresh(result: Any, k: Any = keys) -> None:
            if not np.array_equal(to_numpy(result.fetch()[0]), to_numpy(k)):
                raise BenchCheckError("contiguous append: wrong keys")

        def release(pool: BlockPool = pool) -> None:
            pool.close(list(pool.live_tables()))

        def setup(pool: BlockPool = pool) -> Any:
            pool.close(list(pool.live_tables()))
            return None

        loads = {
            "paged": Workload("append", "paged", shape, nbytes, setup, append, check_append),
            "memcpy": Workload("append", "memcpy", shape, nbytes, lambda: None, copy, check_copy),
            "contiguous": Workload(
                "append", "contiguous", shape, nbytes, lambda: None, fresh, check_fresh
            ),
        }

        def lines(timings: Mapping[str, Timing], nbytes: int = nbytes, t: int = t) -> list[Line]:
            paged, memcpy = timings["paged"].ms, timings["memcpy"].ms
            return [
                {
                    "L": str(t),
                    "bytes": str(nbytes),
                    "paged ms": timings["paged"].cell,
                    "paged GB/s": format_gbps(nbytes, paged),
                    "contiguous GB/s": format_gbps(nbytes, timings["contiguous"].ms),
                    "memcpy GB/s": format_gbps(nbytes, memcpy),
                    "paged/memcpy": ratio(memcpy, paged),
                }
            ]

        yield Case(f"append L={t}", loads, lines, release=release)


NOTES = """\
paged: PagedKvRows over one BlockPool (block size 16) holding every row; contiguous:
PaddedKVRows over KVCache rows; mlx-lm: BatchKVCache merge/filter/extract/extend. ms: median
wall time; paged bytes: KV bytes the pool's counters saw move (bytes_copied + bytes_written;
checked: 0 for the row operations, the B new tokens for decode); copy bytes: what a
compacting layout moves for the same operation. decode = make_mask(1) + update_and_fetch of
one token per row + SDPA: the paged read gathers every row's blocks into a fresh [B, H, W, D]
array each step (mx.take of whole blocks per row), which a contiguous layout does not do.
append: one row of L tokens written into a pool allocated once (memory already touched)
against numpy.copyto of the same bytes into a pre-touched buffer and a fresh KVCache."""


def family(*, quick: bool = False, shapes: Sequence[PagedShape] | None = None) -> Family:
    chosen = tuple(shapes) if shapes is not None else QUICK_SHAPES if quick else FULL_SHAPES

    def row_cases() -> Iterator[Case]:
        for shape in chosen:
            yield from shape_cases(shape)

    return Family(
        name="paged",
        subject="block-table row operations vs the contiguous layouts and mlx-lm",
        tables=[
            Table(row_cases(), "row operations and the decode step"),
            Table(append_cases(chosen), "append into a reused pool"),
        ],
        notes=NOTES,
    )
