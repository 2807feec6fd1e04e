"""The paged geometry's rules (``GEOMETRY_HOOKS["paged"]``): composed with the verify
rounds (``rules.RoundRules``) and the codec's rules (``rules.AffineRules`` for affine
pools) over ``PagedKVCache`` rows in ``PagedKvRows`` (all three roles), plus the pool's
invariants after every rule.

Every base rule (requests, prefill chunks, joins, filters, extracts, publishes, steps,
per-row trims, bad input) and every verify round runs on paged storages; the base
machine's model is the contiguous KV (``KVCache``'s bytes), so every read, row view,
extracted row and saved state is compared bit-exact with the same tokens stored
contiguously, with the other implementation and with a solo replay. After every rule the
pools the caches point into must satisfy ``spec/paged-pool.md`` §4 (conservation, free
<=> count 0, counts = live tables holding the block, no empty tail block).

**Byte-limited pools.** An example draws a headroom (0, 1 or 2 blocks, or none): every
append under test (prefill chunks, layout steps, verify blocks inside rounds) runs with
the pools of its caches limited to the blocks they hold plus the headroom (a pool that
has not learnt its geometry yet: a byte limit of that many blocks), so pools run out at
random points. ``pool_pressure`` does the same for a merge of requests (rows of another
pool are copied), and runs extracts, publishes, filters and row trims, which take no
block, under a limit they must never meet. Both implementations must refuse at the same
points (``PoolExhaustedError``, the same message); a refusal must leave the caches and
every pool's accounting (size, free queue, reference counts, held and cached blocks,
live tables, bytes written and copied) exactly as they were. The append then goes in
without the limit: a refused verify block leaves its round open before its block, and
the round resolves as any other.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvrows import table
from kvrows.compositions import composition
from kvrows.conformance.families import Impl
from kvrows.conformance.machines import ConformanceMachine, Slot, _answer, evaluate, planes_of
from kvrows.errors import PoolExhaustedError
from kvrows.schemes import Affine

__all__ = [
    "HEADROOMS",
    "FrozenCollector",
    "PagedRules",
    "accounting",
    "byte_limited",
    "collector_paused",
]

#: Blocks a pool may grow by while an operation runs at its byte limit (0: none), and
#: ``None``: an example without a limit.
HEADROOMS = (0, 1, 2, None)
#: What ``pool_pressure`` runs: a merge (takes blocks), operations that take none.
PRESSURED = ("merge", "extract", "publish", "filter", "trim_rows")


def accounting(pool: Any) -> tuple[Any, ...]:
    """Everything a refused operation must leave as it was in a pool."""
    ledger = pool.ledger
    return (
        repr(pool.geometry), ledger.num_blocks, ledger.free_order(), ledger.held_count,
        tuple(ledger.ref(b) for b in range(ledger.num_blocks)), ledger.cached_count,
        len(pool.live_tables()), pool.bytes_written, pool.bytes_copied,
    )  # fmt: skip


class FrozenCollector:
    """A paged machine's garbage-collector discipline (mixed in before the machine class).

    An example with a byte limit collects, then leaves every object alive at its start out
    of later collections (:meth:`_freeze_collector`; thawed at teardown), so that the
    collection before each limited operation (:func:`collector_paused`) scans only the
    example's own objects."""

    _frozen = False

    def _freeze_collector(self, limited: bool) -> None:
        if limited:
            gc.collect()
            gc.freeze()
            self._frozen = True

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[misc]  # the machine class after this mixin
        finally:
            if self._frozen:
                gc.unfreeze()
                self._frozen = False


@contextmanager
def collector_paused(collect: bool = True) -> Iterator[None]:
    """Collect now (unless ``collect`` is false), then keep the collector off for the block:
    whether a pool runs out never depends on when the collector gives back an unreachable
    cache's blocks (a collected cache's finalizer would release them in between), and a
    pool's invariants are checked on one state (no finalizer releases tables mid-check)."""
    if collect:
        gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextmanager
def byte_limited(
    pools: Sequence[Any], headroom: int, block_bytes: Callable[[Any], int]
) -> Iterator[None]:
    """Each pool may hold ``headroom`` blocks more than it holds now (a pool without
    geometry: ``headroom`` blocks of ``block_bytes(pool)`` bytes in all) until the block
    exits; the machines' pools have no byte limit otherwise."""
    for pool in pools:
        assert pool.max_bytes is None and pool.ledger.max_blocks is None
        if pool.geometry is None:  # it learns its limit from max_bytes with its geometry
            pool.max_bytes = headroom * block_bytes(pool)
        else:
            pool.ledger.max_blocks = pool.num_blocks + headroom
            pool.max_bytes = pool.ledger.max_blocks * pool.bytes_per_block
    try:
        yield
    finally:
        for pool in pools:
            pool.max_bytes = pool.ledger.max_blocks = None


class PagedRules(FrozenCollector, ConformanceMachine):
    """The paged geometry's rules: storages in block pools (one shared pool per
    implementation in some examples; affine pools at the example's codec, codes compared
    exactly), the pool invariants, byte-limited pools."""

    def _pools(self, impl_index: int) -> list[Any]:
        """The pools of every request and layout of one implementation, in a fixed order."""
        pairs = [(t.ref, t.opt) for t in self.pool]
        for slot in self.slots:
            pairs += [(slot.ref, slot.opt), *((t.ref, t.opt) for t in slot.rows)]
        pools: dict[int, Any] = {}
        for pair in pairs:
            pool = getattr(pair[impl_index], "pool", None)
            if pool is not None:
                pools[id(pool)] = pool
        return list(pools.values())

    @invariant()
    def pools_are_sound(self) -> None:
        with collector_paused(collect=False):
            for index in (0, 1):
                for pool in self._pools(index):
                    pool.check_valid()
                    self.stats.check("pool invariants")

    # -- byte-limited pools ------------------------------------------------------------
    #: This example's headroom: every append under test (prefill chunks, layout steps,
    #: verify blocks) runs with its pools limited to this many blocks more than they hold
    #: (``None``: no limit).
    headroom: int | None = None

    #: Whether this example's new requests share one pool per implementation (else each
    #: makes its own on its first write, and merges copy the rows of other pools).
    shared: bool = False

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        super().setup(data)
        self.headroom = data.draw(st.sampled_from(HEADROOMS), label="headroom")
        self.shared = data.draw(st.booleans(), label="one pool")
        self._shared_pools: dict[str, Any] = {}
        note(f"appends run with a headroom of {self.headroom} blocks, one pool: {self.shared}")
        self._freeze_collector(self.headroom is not None)

    def _new(self, impl: Impl, name: str, **changes: int) -> Any:
        g = self.g
        if not g.affine or composition(name).geometry != "paged":  # plain, or a foreign cache
            return self._in_shared_pool(impl, name, changes, super()._new(impl, name, **changes))
        bits = changes.get("bits", g.bits)
        group_size = changes.get("group_size", g.group_size)
        cache = impl.cls(name)(codec=Affine(bits=bits, group_size=group_size))
        return self._in_shared_pool(impl, name, changes, cache)

    def _in_shared_pool(self, impl: Impl, name: str, changes: object, cache: Any) -> Any:
        """``cache``, or in an example of one pool a new request of its kind in that pool."""
        if not self.shared or changes or name != self.serial_name:
            return cache
        pool = self._shared_pools.get(impl.name)
        if pool is None:
            pool = cache.pool_class(cache.codec_spec, block_size=cache.block_size)
            self._shared_pools[impl.name] = pool
        return type(cache)(pool=pool)

    def _ledgers(self, more: Sequence[Sequence[Any]] = ((), ())) -> list[list[tuple[Any, ...]]]:
        """Every pool's accounting (and the pools ``more`` names), per implementation."""
        return [
            [accounting(pool) for pool in {id(p): p for p in [*self._pools(i), *more[i]]}.values()]
            for i in (0, 1)
        ]

    @contextmanager
    def _limited(self, pools: Sequence[Any], headroom: int) -> Iterator[None]:
        with byte_limited(pools, headroom, lambda pool: pool.block_size * self.g.token_bytes()):
            yield

    def _under_pressure(
        self, what: str, pairs: Sequence[tuple[Any, Any]], headroom: int,
        call: Callable[[Impl, Any], Any],
    ) -> list[Any] | None:  # fmt: skip
        """``call(impl, cache)`` on the reference and the optimized cache of ``pairs[0]``,
        the pools of every pair's caches limited to ``headroom`` more blocks: both succeed
        (their results), or both refuse alike with every pair's caches and every pool's
        accounting unchanged (``None``)."""
        pools = [
            [p for p in (getattr(pair[index], "pool", None) for pair in pairs) if p is not None]
            for index in (0, 1)
        ]
        limited = list({id(p): p for side in pools for p in side}.values())
        with collector_paused():
            before = self._snapshots(pairs), self._ledgers(pools)
            outcomes: list[Any] = []
            with self._limited(limited, headroom):
                for index, impl in enumerate((self.ref_impl, self.opt_impl)):
                    try:
                        outcomes.append(call(impl, pairs[0][index]))
                    except PoolExhaustedError as error:
                        outcomes.append(error)
            refused = [isinstance(o, PoolExhaustedError) for o in outcomes]
            after = (self._snapshots(pairs), self._ledgers(pools)) if any(refused) else before
        self._exact(f"{what}, headroom {headroom}: refused (optimized)", refused[1], refused[0])
        self.stats.check("pool pressure")
        if not refused[0]:
            return outcomes
        self._same_error(f"{what} past the byte limit", outcomes[0], outcomes[1])
        self._exact(f"{what}: caches unchanged after the refusal", after[0], before[0])
        self._exact(f"{what}: every pool's accounting unchanged", after[1], before[1])
        note(f"  refused past the byte limit: {outcomes[0]}")
        self.stats.check("exhaustion refused")
        return None

    def _append(
        self, what: str, ref_cache: Any, opt_cache: Any, keys: Any, values: Any
    ) -> list[tuple[Any, Any]]:
        """The append under the example's byte limit; once refused (checked), the limit is
        lifted and the same append goes in: a refused verify block leaves its round open
        before its block, so the round then resolves as any other."""
        if self.headroom is None:
            return super()._append(what, ref_cache, opt_cache, keys, values)

        def append(impl: Impl, cache: Any) -> Any:
            return cache.update_and_fetch(
                self._give(impl, keys, what), self._give(impl, values, what)
            )

        pair = (ref_cache, opt_cache)
        outcomes = self._under_pressure(what, [pair], self.headroom, append)
        if outcomes is None:
            self.stats.op("exhausted:append")
            if getattr(ref_cache, "spec_round_open", False):
                self._exact(
                    f"{what}: round open after the refusal", opt_cache.spec_round_open, True
                )
                self.stats.check("round usable after a refused block")
            return super()._append(what, ref_cache, opt_cache, keys, values)
        fetched = []
        for impl, (fk, fv) in zip((self.ref_impl, self.opt_impl), outcomes, strict=True):
            evaluate([*planes_of(impl, fk), *planes_of(impl, fv)])
            fetched.append((planes_of(impl, fk), planes_of(impl, fv)))
        self._fetch_dtypes(what, *fetched[0], *fetched[1])
        return fetched

    def _pressured(self) -> list[str]:
        """The operations ``pool_pressure`` can run now."""
        steppable = bool(self._steppable())
        can = {
            "merge": bool(self.pool) and any(len(s.rows) < self.limits.rows for s in self.slots),
            "extract": steppable, "publish": steppable, "filter": bool(self.slots),
            "trim_rows": steppable and self.spec.trim_rows,
        }  # fmt: skip
        return [op for op in PRESSURED if can[op]]

    @precondition(lambda self: self.geo is not None and bool(self._pressured()))
    @rule(data=st.data())
    def pool_pressure(self, data: st.DataObject) -> None:
        """A merge of requests (another pool's rows are copied) whose pools reach their
        byte limit, or an operation that takes no block under a limit it must not meet."""
        op = data.draw(st.sampled_from(self._pressured()), label="operation under pressure")
        headroom = data.draw(st.sampled_from(HEADROOMS[:-1]), label="headroom")
        note(f"pool_pressure: {op}, headroom {headroom} blocks")
        if op == "merge":
            self._pressured_merge(data, headroom)
            return
        self.stats.op(f"pressure:{op}")
        every = [p for index in (0, 1) for p in self._pools(index)]
        with self._limited(every, headroom):
            rule_of = {
                "extract": self.extract,
                "publish": self.publish,
                "filter": self.filter_layout,
                "trim_rows": self.trim_rows,
            }
            rule_of[op](data)

    def _pressured_merge(self, data: st.DataObject, headroom: int) -> None:
        """Free requests join a layout (rows of another pool are copied into its pool)."""
        targets = [s for s in self.slots if len(s.rows) < self.limits.rows]
        slot = self._pick(data, targets, "layout")
        count = data.draw(
            st.integers(1, min(self.limits.rows - len(slot.rows), len(self.pool))), label="rows"
        )
        order = data.draw(st.permutations(range(len(self.pool))), label="requests")
        picked = [self.pool[i] for i in order[:count]]
        note(f"  merge: layout {slot.ident} <- requests {[t.ident for t in picked]}")
        self._op("pressure:merge", slot)
        pairs = [(t.ref, t.opt) for t in picked]

        def merge(impl: Impl, layout: Any) -> None:
            layout.merge_rows([pair[0 if impl is self.ref_impl else 1] for pair in pairs])

        before = self._snapshots(pairs)
        what = f"layout {slot.ident} merge"
        if self._under_pressure(what, [(slot.ref, slot.opt), *pairs], headroom, merge) is None:
            self.stats.op("exhausted:merge")
            return
        self._exact("merge sources are borrowed and left unchanged", self._snapshots(pairs), before)
        self._mirror_merge(slot, [t.lm for t in picked])
        for t in picked:
            self.pool.remove(t)
        slot.rows.extend(picked)

    def _check_admission(self, slot: Slot) -> None:
        """``projected_bytes(t)`` counts whole blocks (``ceil(t / block_size)`` of them);
        ``row_admission`` sums it; before the geometry is known both refuse, alike."""
        ts = [0, 1, 7, 16, 17, *(t.tokens for t in slot.rows)]
        answers = []
        for name, lay in (("reference", slot.ref), ("optimized", slot.opt)):
            admission = table.row_admission([lay, lay])
            assert admission is not None
            what = f"layout {slot.ident} ({name})"
            got = [_answer(lay.projected_bytes, t) for t in ts]
            doubled = [_answer(admission.bytes, t) for t in ts]
            if lay.geometry is not None:
                size = lay.block_size
                want = [self.g.token_bytes() * math.ceil(t / size) * size for t in ts]
                self._exact(f"{what} projected_bytes{ts} (whole blocks)", got, want)
                self._exact(f"{what} row_admission bytes{ts}", doubled, [2 * x for x in got])
            else:
                self._exact(f"{what} projected_bytes{ts}, no geometry yet", got, doubled)
            answers.append(got)
        self._exact(f"layout {slot.ident} projected_bytes (both)", answers[1], answers[0])
        self.stats.check("admission")
