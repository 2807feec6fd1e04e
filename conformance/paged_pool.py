"""The pool state machine: a shared block pool under requests, with a shadow model.

Requests get prompts from a two-token alphabet (so prefixes collide), look up their
cached prefix, append, run speculative rounds through a one-row ``PagedKvRows`` (merge,
verify block, accept ``k``, extract), join and split batches (merge, filter, extract),
publish prefixes, finish, and the pool evicts. The KV of position ``p`` is a pure
function of ``tokens[: p + 1]`` (a model would compute it so), which makes the shadow
model's oracle simple: a request's gathered KV must equal its KV computed from scratch.

After every rule (``spec/paged-pool.md`` §4): conservation (free + referenced = pool
size), free <=> count 0, count = number of live tables holding the block (counted from
the requests' tables, not the pool's), every cached block's hash is the hash of the
committed tokens that produced it, no draft token is ever hashed, full blocks of a live
table never change but by a trim, a hit is at most ``len(prompt) - 1`` positions, and
every request's KV is bit-exact (plain) / code-exact (affine) with its from-scratch KV.
"""

from __future__ import annotations

import gc
import zlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule

from kvrows.conformance.paged import FrozenCollector
from kvrows.errors import PoolExhaustedError, SpeculativeRoundError
from kvrows.paged import ROOT_HASH, block_hash
from kvrows.schemes import Affine, CodecSpec, Plain

__all__ = ["STATS", "PoolMachine", "pool_machine"]

#: What the runs exercised (tests assert the rules did their work, not nothing).
STATS: Counter[str] = Counter()

HEADS, DIM, BLOCK = 1, 32, 4
ALPHABET = st.integers(0, 1)
#: System prompts requests start with (so that full blocks are shared).
SYSTEMS: tuple[list[int], ...] = ([0] * (2 * BLOCK), [1, 0] * BLOCK, [])


def kv_of(tokens: list[int], start: int, stop: int) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """``[1, H, stop - start, D]`` keys and values of positions ``start..stop-1``: each a
    function of the tokens up to and including it."""
    keys, values = [], []
    for p in range(start, stop):
        seed = zlib.crc32(bytes(t & 0xFF for t in tokens[: p + 1]) + p.to_bytes(4, "little"))
        rng = np.random.default_rng(seed)
        keys.append(rng.standard_normal((HEADS, DIM)).astype(np.float32))
        values.append(rng.standard_normal((HEADS, DIM)).astype(np.float32))
    return np.stack(keys, axis=1)[None], np.stack(values, axis=1)[None]


class PoolMachine(FrozenCollector, RuleBasedStateMachine):
    """Set ``impl`` (``to_native``, ``to_numpy``, ``pool``, ``cache``, ``rows`` classes) and
    ``codec`` in a subclass (:func:`pool_machine`). Every example freezes what was alive
    at its start (``FrozenCollector``): ``forget``'s collection then scans the example's
    own objects, not the test session's."""

    to_native: Callable[[npt.NDArray[Any]], Any]
    to_numpy: Callable[[Any], npt.NDArray[Any]]
    pool_class: Any
    cache_class: Any
    rows_class: Any
    codec: CodecSpec = Plain()
    max_blocks = 8

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.encoder = self.pool_class(self.codec, block_size=BLOCK).codec
        token_bytes = int(
            self.encoder.token_bytes(HEADS, DIM, "float32", "keys")
            + self.encoder.token_bytes(HEADS, DIM, "float32", "values")
        )
        self.pool = self.pool_class(
            self.codec,
            block_size=BLOCK,
            num_blocks=4,
            max_bytes=self.max_blocks * token_bytes * BLOCK,
        )
        self.live: dict[int, Any] = {}  # request id -> its PagedKVCache
        self.tokens: dict[int, list[int]] = {}  # request id -> committed token ids
        self.full_before: dict[int, list[int]] = {}  # its full blocks after the last rule
        self.hashed_tokens: dict[bytes, tuple[int, ...]] = {}  # digest -> committed prefix
        self.next_id = 0
        self.trimmed: set[int] = set()
        self._freeze_collector(True)

    # -- helpers -------------------------------------------------------------------------
    def _append(self, cache: Any, tokens: list[int], start: int) -> bool:
        keys, values = kv_of(tokens, start, len(tokens))
        before = cache.rows, cache.offset, cache.block_table, self._accounting()
        try:
            cache.update_and_fetch(self.to_native(keys), self.to_native(values))
        except PoolExhaustedError:
            got = cache.rows, cache.offset, cache.block_table, self._accounting()
            assert got == before, "a refused append changed the cache or the pool"
            STATS["exhausted"] += 1
            return False
        return True

    def _accounting(self) -> tuple[Any, ...]:
        """What a refused call leaves as it was: the free queue, every count, the held and
        cached blocks, the live tables and the bytes moved."""
        ledger = self.pool.ledger
        return (
            ledger.free_order(), tuple(ledger.ref(b) for b in range(ledger.num_blocks)),
            ledger.held_count, ledger.cached_count, len(self.pool.live_tables()),
            self.pool.bytes_written, self.pool.bytes_copied,
        )  # fmt: skip

    def _expected_planes(self, tokens: list[int]) -> tuple[Any, Any]:
        keys, values = kv_of(tokens, 0, len(tokens))
        native_k, native_v = self.to_native(keys), self.to_native(values)
        return self.encoder.encode(native_k, "keys"), self.encoder.encode(native_v, "values")

    def _chain(self, tokens: list[int]) -> list[bytes]:
        parent, out = ROOT_HASH, []
        for j in range(len(tokens) // BLOCK):
            parent = block_hash(parent, tokens[j * BLOCK : (j + 1) * BLOCK], self.pool.ledger.extra)
            out.append(parent)
        return out

    # -- rules ---------------------------------------------------------------------------
    @rule(
        target=requests,
        system=st.sampled_from(range(len(SYSTEMS))),
        suffix=st.lists(ALPHABET, min_size=1, max_size=BLOCK + 1),
        publish=st.booleans(),
    )
    def add_request(self, system: int, suffix: list[int], publish: bool) -> int:
        prompt = SYSTEMS[system] + suffix
        hit = self.pool.lookup_prefix(prompt)
        cache = hit if hit is not None else self.cache_class(pool=self.pool)
        start = 0 if hit is None else hit.offset
        assert start <= len(prompt) - 1, "a hit leaves the last prompt token to compute"
        assert start % BLOCK == 0
        if hit is not None:
            STATS["hits"] += 1
            # the hit's blocks are the cached blocks of the prompt's chain
            chain = self._chain(prompt)[: start // BLOCK]
            assert [self.pool.ledger.block_of(d) for d in chain] == list(hit.block_table)
        rid = self.next_id
        self.next_id += 1
        if not self._append(cache, prompt, start):
            cache.release()
            return -1
        self.live[rid], self.tokens[rid] = cache, list(prompt)
        self.full_before[rid] = list(cache.block_table[: len(prompt) // BLOCK])
        if publish:
            self._publish(rid, len(prompt))
        return rid

    @rule(rid=requests, more=st.lists(ALPHABET, min_size=1, max_size=BLOCK + 1))
    def append(self, rid: int, more: list[int]) -> None:
        if rid not in self.live:
            return
        tokens = self.tokens[rid] + more
        if self._append(self.live[rid], tokens, len(self.tokens[rid])):
            self.tokens[rid] = tokens

    @rule(
        rid=requests,
        block=st.lists(ALPHABET, min_size=2, max_size=BLOCK + 2),
        data=st.data(),
        keep_source=st.booleans(),
    )
    def speculate(self, rid: int, block: list[int], data: st.DataObject, keep_source: bool) -> None:
        """Merge the request into a one-row verify layout, append [pending, drafts], try to
        publish mid-round (refused), accept ``k``, extract the row back."""
        if rid not in self.live:
            return
        cache, tokens = self.live[rid], self.tokens[rid]
        layout = self.rows_class(pool=self.pool)
        copied = self.pool.bytes_copied
        layout.merge_rows([cache])
        assert self.pool.bytes_copied == copied, "a merge of the pool's own rows copies nothing"
        if not keep_source:
            cache.release()
        layout.spec_round_begin()
        drafted = tokens + block
        keys, values = kv_of(drafted, len(tokens), len(drafted))
        before = layout.row_offsets, layout.block_tables(), self._accounting()
        try:
            layout.update_and_fetch(self.to_native(keys), self.to_native(values))
        except PoolExhaustedError:  # refused, nothing changed: the round waits for its block
            got = layout.row_offsets, layout.block_tables(), self._accounting()
            assert got == before, "a refused verify block changed the layout or the pool"
            assert layout.spec_round_open
            STATS["verify block refused"] += 1
            pending = kv_of(tokens + block[:1], len(tokens), len(tokens) + 1)
            try:  # the pending token alone
                layout.update_and_fetch(*(self.to_native(x) for x in pending))
            except PoolExhaustedError:
                layout.release()
                if not keep_source:  # the request went with it
                    del self.live[rid], self.tokens[rid], self.full_before[rid]
                return
            block = block[:1]
        finally:
            if self.pool.bytes_copied > copied:
                STATS["copy on write"] += 1
        try:
            layout.register_prefix(0, drafted)
        except SpeculativeRoundError:
            STATS["draft publish refused"] += 1
        keep = data.draw(st.integers(1, len(block)), label="keep")
        if keep == len(block):
            layout.spec_round_commit()
        else:
            layout.spec_round_rollback(keep)
            self.trimmed.add(rid)
            STATS["rollbacks"] += 1
        copied = self.pool.bytes_copied
        extracted = layout.extract_row(0)
        assert self.pool.bytes_copied == copied, "an extraction copies nothing"
        layout.release()
        cache.release()
        self.live[rid], self.tokens[rid] = extracted, tokens + block[:keep]

    @rule(data=st.data())
    @precondition(lambda self: len(self.live) >= 2)
    def batch(self, data: st.DataObject) -> None:
        """Join some requests in a layout, filter it to a subset in any order, and extract
        the survivors back: no byte moves."""
        chosen = data.draw(
            st.lists(st.sampled_from(sorted(self.live)), min_size=2, max_size=3, unique=True),
            label="rows",
        )
        layout = self.rows_class(pool=self.pool)
        copied = self.pool.bytes_copied
        layout.merge_rows([self.live[r] for r in chosen])
        order = data.draw(st.permutations(range(len(chosen))), label="order")
        keep = order[: data.draw(st.integers(1, len(chosen)), label="kept")]
        layout.filter_rows(keep)
        for position, index in enumerate(keep):
            rid = chosen[index]
            extracted = layout.extract_row(position)
            self.live[rid].release()
            self.live[rid] = extracted
        layout.release()
        assert self.pool.bytes_copied == copied, "row operations copy nothing"
        STATS["batches"] += 1

    @rule(rid=requests, data=st.data())
    def publish(self, rid: int, data: st.DataObject) -> None:
        if rid not in self.live:
            return
        self._publish(rid, data.draw(st.integers(0, len(self.tokens[rid])), label="publish"))

    def _publish(self, rid: int, count: int) -> None:
        tokens = self.tokens[rid]
        STATS["cached blocks"] += self.live[rid].register_prefix(tokens[:count])
        for j, digest in enumerate(self._chain(tokens[:count])):
            self.hashed_tokens.setdefault(digest, tuple(tokens[: (j + 1) * BLOCK]))

    @rule(rid=requests)
    def finish(self, rid: int) -> None:
        if rid not in self.live:
            return
        self.live.pop(rid).release()
        del self.tokens[rid], self.full_before[rid]

    @rule(drop=st.booleans())
    def forget(self, drop: bool) -> None:
        """Drop a request's cache without ``release`` (the collector gives its blocks back)."""
        if not self.live or not drop:
            return
        rid = min(self.live)
        del self.live[rid], self.tokens[rid], self.full_before[rid]
        gc.collect()
        STATS["forgotten"] += 1

    @rule(count=st.integers(1, 3))
    def evict(self, count: int) -> None:
        ledger = self.pool.ledger
        cached_free = [b for b in ledger.free_order() if ledger.hash_of(b) is not None]
        # held_count, derived from the free queue and the hashes, counts them block by block
        assert ledger.held_count == ledger.referenced_count + len(cached_free)
        dropped = self.pool.evict_cached(count)
        assert dropped == min(count, len(cached_free))
        for block in cached_free[:dropped]:  # least recently used first
            assert ledger.hash_of(block) is None
        STATS["evicted"] += dropped

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def ledger_is_sound(self) -> None:
        ledger = self.pool.ledger
        tables = [list(c.block_table) for c in self.live.values()]
        ledger.check_valid(tables)  # conservation, free <=> 0, counts = tables holding
        self.pool.check_valid()
        assert set(self.pool.ledger.free_order()) == {
            b for b in range(ledger.num_blocks) if ledger.ref(b) == 0
        }

    @invariant()
    def cached_blocks_hold_committed_tokens(self) -> None:
        ledger = self.pool.ledger
        for block in range(ledger.num_blocks):
            digest = ledger.hash_of(block)
            if digest is None:
                continue
            prefix = self.hashed_tokens.get(digest)
            assert prefix is not None, "a block is cached under a hash no publish produced"
            assert ledger.tokens_of(block) == prefix[-BLOCK:]

    @invariant()
    def tables_only_grow(self) -> None:
        for rid, cache in self.live.items():
            full = len(self.tokens[rid]) // BLOCK
            now = list(cache.block_table[:full])
            before = self.full_before[rid]
            if rid not in self.trimmed:
                assert now[: len(before)] == before[: len(now)], "a full block of a table moved"
            self.full_before[rid] = now
        self.trimmed.clear()

    @invariant()
    def every_request_reads_its_own_kv(self) -> None:
        for rid, cache in self.live.items():
            tokens = self.tokens[rid]
            assert cache.offset == len(tokens)
            held = cache.planes()
            want_k, want_v = self._expected_planes(tokens)
            for got, want in zip(held[0] + held[1], tuple(want_k) + tuple(want_v), strict=True):
                assert np.array_equal(self.to_numpy(got), self.to_numpy(want)), (
                    f"request {rid}'s KV is not its KV computed from scratch"
                )

    def teardown(self) -> None:
        try:
            for cache in self.live.values():
                cache.release()
            self.live.clear()
            self.pool.check_valid()
            assert self.pool.ledger.referenced_count == 0
        finally:
            super().teardown()  # thaws the collector


def pool_machine(
    impl: str, codec: CodecSpec | None = None, classes: dict[str, Any] | None = None
) -> type[PoolMachine]:
    """The machine over ``impl`` ("reference" / "optimized") with ``codec``; ``classes``
    replaces ``pool`` / ``cache`` / ``rows`` (mutants)."""
    if impl == "reference":
        from kvrows.reference import paged as module

        def native(a: npt.NDArray[Any]) -> Any:
            return a

        def numpy(a: Any) -> npt.NDArray[Any]:
            return np.asarray(a)
    else:
        import mlx.core as mx

        from kvrows.optimized import paged as module  # type: ignore[no-redef]

        def native(a: npt.NDArray[Any]) -> Any:
            return mx.array(a)

        def numpy(a: Any) -> npt.NDArray[Any]:
            return np.array(a)

    chosen = {
        "pool": module.BlockPool,
        "cache": module.PagedKVCache,
        "rows": module.PagedKvRows,
        **(classes or {}),
    }
    spec = codec or Plain()
    name = f"PoolMachine_{impl}_{spec.kind}"
    return type(
        name,
        (PoolMachine,),
        {
            "to_native": staticmethod(native),
            "to_numpy": staticmethod(numpy),
            "pool_class": chosen["pool"],
            "cache_class": chosen["cache"],
            "rows_class": chosen["rows"],
            "codec": spec,
        },
    )


AFFINE_TEST = Affine(bits=4, group_size=32)
