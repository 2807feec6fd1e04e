"""The pool state machine (``conformance/paged_pool.py``) on both implementations and both
codecs, and its teeth: a forgotten decref and a hashed draft block are caught."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvrows.codecs.latent import Latent, LatentShapes
from kvrows.conformance.paged_pool import AFFINE_TEST, STATS, pool_machine
from kvrows.conformance.profiles import profile_settings
from kvrows.errors import InvalidInputError
from kvrows.optimized.paged import BlockPool, PagedKvRows
from kvrows.schemes import Affine, Plain

#: CI share: about 3 s on one core for the four runs.
EXAMPLES = 8
STEPS = 30


def test_pool_machines() -> None:
    """Both implementations x plain and affine; then every kind of event the invariants
    are about must have happened (over the four runs: a run's rule choices follow what
    the pool did, so one run alone may miss an event)."""
    STATS.clear()
    for impl in ("reference", "optimized"):
        for codec in (Plain(), AFFINE_TEST):
            run_state_machine_as_test(
                pool_machine(impl, codec),
                settings=profile_settings(max_examples=EXAMPLES, stateful_step_count=STEPS),
            )
    for event in ("hits", "copy on write", "rollbacks", "batches", "cached blocks",
                  "draft publish refused", "exhausted", "verify block refused", "evicted",
                  "forgotten"):  # fmt: skip
        assert STATS[event] > 0, (event, dict(STATS))


class ForgetsOneDecref(BlockPool):
    """Closing a table releases every block but its tail."""

    def close(self, tables: Sequence[list[int]]) -> None:
        for table in tables:
            if self._tables.pop(id(table), None) is not None:
                self.ledger.release(reversed(table[:-1]))
                table.clear()


class HashesDrafts(PagedKvRows):
    """Publishing in the middle of a speculative round hashes the unverified drafts."""

    def register_prefix(self, row: int, token_ids: Any) -> int:
        assert self._pool is not None
        held = (self._offsets[row], self._offsets[row])
        return self._pool.register_prefix(self._tables[row], held, token_ids)


@pytest.mark.parametrize(("mutant", "role"), [(ForgetsOneDecref, "pool"), (HashesDrafts, "rows")])
def test_the_pool_machine_catches(mutant: type, role: str) -> None:
    machine = pool_machine("optimized", Plain(), {role: mutant})
    if role == "pool":
        ForgetsOneDecref.cache_classes = BlockPool.cache_classes
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=profile_settings("teeth"))


@pytest.mark.parametrize("impl", ["reference", "optimized"])
@pytest.mark.parametrize("inner", [Plain(), Affine(bits=4, group_size=32)])
def test_a_paging_pool_holds_a_latent_codecs_planes(impl: str, inner: Any) -> None:
    """The paged placement's pool stores ``Latent``'s planes over ``LatentShapes`` (what
    ``PagedLatentCache``'s move puts under it, ``spec/machinery-migration.md`` §6): the
    codec's plane specs per block, its bytes, rows written and gathered right-aligned."""
    module = importlib.import_module(f"kvrows.{impl}.paging")
    spec = Latent(inner=inner, kv_lora_rank=64, rope_head_dim=8, index_head_dim=16)
    shapes = LatentShapes(64, 8, 16, "float32")
    pool = module.BlockPool(spec, block_size=4)
    with pytest.raises(InvalidInputError, match="index width must be 16"):
        pool.learn(LatentShapes(64, 8, 8, "float32"))
    pool.learn(shapes)
    with pytest.raises(InvalidInputError, match="kv_lora_rank=64, rope_head_dim=8, index=16"):
        pool.learn(LatentShapes(64, 8, 16, "float16"))
    assert pool.token_bytes == spec.token_bytes(shapes)
    rng = np.random.default_rng(0)
    tensors = {t: rng.standard_normal((2, 1, 6, w)).astype(np.float32)
               for t, w in (("latent", 64), ("rope", 8), ("index", 16))}  # fmt: skip
    wrap = np.asarray if impl == "reference" else mx.array
    block = {t: tuple(pool.codec.encode(wrap(a), t)) for t, a in tensors.items()}
    if impl == "reference":
        rows = [module.PagedRow(), module.PagedRow()]
        pool.append(rows, block, 6)
        for row in rows:
            row.offset = 6
        pool.append(rows[:1], {t: tuple(p[:1, :, :3] for p in ps) for t, ps in block.items()}, 3)
        rows[0].offset = 9
        image = pool.gather(rows, [0, 3], 9)
    else:
        tables: list[list[int]] = [[], []]
        pool.append(tables, [0, 0], block, 6)
        pool.append(
            tables[:1], [6], {t: tuple(p[:1, :, :3] for p in ps) for t, ps in block.items()}, 3
        )
        image = pool.gather(tables, [[(0, 9)], [(0, 6)]], [0, 3], 9)
    held = [(p.dtype, p.shape[1:]) for planes in pool._planes.values() for p in planes]
    assert [(str(dtype).rsplit(".", 1)[-1], shape) for dtype, shape in held] == [
        (p.dtype, (1, 4, p.width)) for p in spec.tensor_planes(shapes)
    ]
    assert pool.ledger.referenced_count == 3 + 2
    for t in tensors:
        read = np.asarray(pool.codec.fetched(image[t], t), dtype=np.float32)
        stored = np.asarray(pool.codec.fetched(block[t], t), dtype=np.float32)
        np.testing.assert_array_equal(read[1, :, 3:], stored[1])
        np.testing.assert_array_equal(read[0, :, :6], stored[0])
        np.testing.assert_array_equal(read[0, :, 6:], stored[0, :, :3])
        assert not read[1, :, :3].any()


@pytest.mark.parametrize("impl", ["reference", "optimized"])
def test_a_dropped_pool_frees_its_planes_without_the_collector(impl: str) -> None:
    """Nothing holds a pool in a cycle (its ledger's hooks hold it weakly): dropped with
    its caches, its planes are freed at once, not when the collector next runs."""
    import gc
    import weakref

    from kvrows.validation import KvGeometry

    module = importlib.import_module(f"kvrows.{impl}")
    native = mx.array if impl == "optimized" else np.asarray
    mx.eval(mx.zeros(1))
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        base = mx.get_active_memory()
        pool = module.BlockPool(block_size=4, geometry=KvGeometry(2, 64, 64, "float32"))
        cache = module.PagedKVCache(pool=pool)
        block = native(np.ones((1, 2, 9, 64), np.float32))
        cache.update_and_fetch(block, block)
        pool.check_valid()
        held = weakref.ref(pool)
        del cache, pool, block
        assert held() is None
        if impl == "optimized":
            assert mx.get_active_memory() == base
    finally:
        if collecting:
            gc.enable()
