"""A ``CacheListLayout``'s merge is all or nothing: every part checks its share of the rows
with its own machinery (``check_merge``, a ``MergeChecking``) before any part joins, so a
refusal in any part leaves every part as it was.

Drawn: a CacheList of two or three parts (recurrent state, a growing KV layout, mlx-lm's
``BatchKVCache`` drop-in, a paged layout in a pool with a byte limit), some rows already
joined, then a merge of new rows where each part may carry a fault of its own: a source of
another KV or state geometry, of another codec, of the other implementation, the drop-in
inside a right-padded run, a pool too small for the copies. Oracles: the faults that must
refuse (a geometry fault needs rows to disagree with), a snapshot of every part (rows,
offsets, pads, bytes, held arrays, the pool's ledger) after a refusal, each part's offsets
after a merge."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.errors import KvRowsError
from kvrows.optimized import CacheListDropIn, CacheListLayout
from kvrows.protocols import MergeChecking

H, D, BLOCK = 2, 8, 4
KINDS = ("ssm", "kv", "dropin", "paged")
FAULTS = {
    "ssm": ("none", "geometry", "twin"),
    "kv": ("none", "geometry", "codec", "twin"),
    "dropin": ("none", "geometry", "run"),
    "paged": ("none", "geometry", "pool"),
}


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _as_object(value: object) -> object:
    return value  # (an isinstance on the object would narrow the test's own name)


def _kv(n: int, d: int = D) -> tuple[Any, Any]:
    rng = np.random.default_rng(n * 31 + d)
    keys = rng.standard_normal((1, H, n, d)).astype(np.float32)
    return mx.array(keys), mx.array(keys * 0.5)


def _serial(kind: str, n: int, fault: str, other_pool: Any) -> Any:
    """One request's cache of part ``kind`` holding ``n`` tokens (``fault``: made wrong)."""
    d = 2 * D if fault == "geometry" else D
    if kind == "ssm":
        twin = fault == "twin"
        cache: Any = ref.SSMCache() if twin else opt.SSMCache()
        array: Any = np.zeros if twin else mx.zeros
        cache[0] = array((1, 3, d), dtype=np.float32 if twin else mx.float32)
        cache[1] = array((1, 2, 4, 4), dtype=np.float32 if twin else mx.float32)
        cache.advance(n)
        return cache
    if fault == "twin":
        cache = ref.KVCache()
        cache.update_and_fetch(*(np.array(x) for x in _kv(n, d)))
        return cache
    if kind == "paged":
        # (a pool holds one geometry: a row of another is in a pool of its own)
        pool = opt.BlockPool(block_size=BLOCK) if fault == "geometry" else other_pool
        cache = opt.PagedKVCache(pool=pool)
    elif fault == "codec":
        cache, d = opt.QuantizedKVCache(), 64  # an affine row (its groups need 64 dims)
    else:
        cache = opt.KVCache()
    cache.update_and_fetch(*_kv(n, d))
    return cache


def _layout(kind: str, pool_blocks: int | None) -> Any:
    if kind == "ssm":
        return opt.BatchedSSMCache()
    if kind == "kv":
        return opt.BatchedKVCache()
    if kind == "dropin":
        return opt.BatchKVCache([])
    per_block = BLOCK * 2 * H * D * 4  # keys and values, float32
    assert pool_blocks is not None
    return opt.PagedKvRows(pool=opt.BlockPool(block_size=BLOCK, max_bytes=pool_blocks * per_block))


def _snapshot(part: Any) -> tuple[Any, ...]:
    """Everything a refused merge must leave as it was in a part."""
    arrays = [np.array(a) for a in part.held_arrays()]
    pool = getattr(part, "pool", None)
    ledger = None
    if pool is not None:
        led = pool.ledger
        ledger = (
            pool.geometry, led.num_blocks, led.free_order(), led.held_count,
            [led.ref(b) for b in range(led.num_blocks)], pool.bytes_copied,
        )  # fmt: skip
    run = getattr(part, "_run", None)
    return (
        part.batch_size, part.row_offsets, part.left_pad, part.nbytes,
        [a.shape for a in arrays], arrays, ledger, run,
        getattr(part, "pending_left_padding", None),
    )  # fmt: skip


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, list) and x and isinstance(x[0], np.ndarray):
            if len(x) != len(y) or not all(np.array_equal(p, q) for p, q in zip(x, y, strict=True)):
                return False
        elif x != y:
            return False
    return True


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=2, max_size=3))
    initial = draw(st.lists(st.integers(1, 9), max_size=2))
    new = draw(st.lists(st.integers(1, 9), min_size=1, max_size=3))
    faults = [draw(st.sampled_from(FAULTS[kind])) for kind in kinds]
    extend = len(new) == 1 and draw(st.booleans())  # mlx-lm's extend of one CacheList
    return {"kinds": kinds, "initial": initial, "new": new, "faults": faults, "extend": extend}


def _refuses(kind: str, fault: str, initial: list[int], new: list[int]) -> bool:
    """Whether the fault must refuse (a geometry differs only from rows beside it)."""
    if fault == "none":
        return False
    if fault in ("geometry",):
        return bool(initial) or len(new) > 1
    if fault == "run":
        return bool(initial)  # only a layout with rows enters a right-padded run here
    return True


@settings(max_examples=150, deadline=None)
@given(cases())
# The faults found only past the first part's join (what a merge part by part would leave):
@example({"kinds": ["kv", "paged"], "initial": [5], "new": [5], "faults": ["none", "pool"]})
@example(
    {
        "kinds": ["kv", "paged"],
        "initial": [5],
        "new": [5],
        "faults": ["none", "pool"],
        "extend": True,
    }
)
@example({"kinds": ["ssm", "dropin"], "initial": [3], "new": [2], "faults": ["none", "run"]})
@example({"kinds": ["kv", "ssm"], "initial": [], "new": [2, 3], "faults": ["none", "geometry"]})
def test_a_refused_merge_changes_no_part(case: dict[str, Any]) -> None:
    kinds, initial, new, faults = case["kinds"], case["initial"], case["new"], case["faults"]
    other = opt.BlockPool(block_size=BLOCK)
    held_blocks = sum(math.ceil(n / BLOCK) for n in initial)
    new_blocks = sum(math.ceil(n / BLOCK) for n in new)
    parts = []
    for kind, fault in zip(kinds, faults, strict=True):
        # (plenty but for a pool fault: a row of the geometry fault takes twice the bytes)
        room = held_blocks + (new_blocks - 1 if fault == "pool" else 2 * new_blocks + 2)
        parts.append(_layout(kind, room))
    layout = CacheListLayout(*parts)
    assert isinstance(_as_object(layout), MergeChecking)
    if initial:
        layout.merge_rows(
            [CacheListDropIn(*(_serial(k, n, "none", other) for k in kinds)) for n in initial]
        )
    for part, fault in zip(layout.parts, faults, strict=True):
        if fault == "run" and initial:
            part.prepare(
                lengths=[o + 2 for o in part.row_offsets], right_padding=[1] * part.batch_size
            )
    rows = []
    for index, n in enumerate(new):
        last = index == len(new) - 1  # the faulty row comes last: earlier parts check first
        rows.append(
            CacheListDropIn(
                *(
                    _serial(k, n, f if last and f not in ("pool", "run") else "none", other)
                    for k, f in zip(kinds, faults, strict=True)
                )
            )
        )
    expected = any(_refuses(k, f, initial, new) for k, f in zip(kinds, faults, strict=True))
    before = [_snapshot(part) for part in layout.parts]
    try:
        if case.get("extend"):
            layout.extend(rows[0])
        else:
            layout.merge_rows(rows)
    except KvRowsError:
        assert expected, "a merge without a fault was refused"
        assert all(
            _same(_snapshot(part), was) for part, was in zip(layout.parts, before, strict=True)
        )
        return
    assert not expected, f"a faulty merge was taken: {kinds} {faults}"
    assert layout.batch_size == len(initial) + len(new)
    for part in layout.parts:
        assert part.row_offsets[len(initial) :] == tuple(new)


@pytest.mark.parametrize("twin", [ref, opt], ids=["reference", "optimized"])
def test_check_merge_refuses_what_merge_rows_refuses_and_changes_nothing(twin: Any) -> None:
    """Both machineries' ``check_merge``: a paged layout's pool too small for another
    pool's rows refuses in the check (``PoolExhaustedError``, the pool as it was); rows that
    fit pass the check unchanged and then join."""
    native: Any = mx.array if twin is opt else np.array
    other = twin.BlockPool(block_size=BLOCK)
    sources = [twin.PagedKVCache(pool=other) for _ in range(2)]
    for cache in sources:
        cache.update_and_fetch(*(native(x) for x in _kv(6)))  # two blocks each
    per_block = BLOCK * 2 * H * D * 4
    tight = twin.BlockPool(block_size=BLOCK, max_bytes=3 * per_block)
    layout: Any = twin.PagedKvRows(pool=tight)
    assert isinstance(_as_object(layout), MergeChecking)
    ledger = (tight.geometry, tight.ledger.num_blocks, tight.ledger.free_order())
    for call in (layout.check_merge, layout.merge_rows):
        with pytest.raises(KvRowsError, match="may hold at most 3"):
            call(sources)
        assert (tight.geometry, tight.ledger.num_blocks, tight.ledger.free_order()) == ledger
    layout.check_merge(sources[:1])
    assert layout.batch_size == 0 and tight.geometry is None
    layout.merge_rows(sources[:1])
    assert layout.row_offsets == (6,)
    with pytest.raises(KvRowsError, match="may hold at most 3"):
        layout.check_merge(sources[1:])  # two more blocks: four in a pool of three
    assert layout.row_offsets == (6,)
