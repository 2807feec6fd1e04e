"""The paged-latent family's machine: ``PagedLatentCache`` (``spec/PagedLatentCache.md``).

The latent machine (``conformance.latent``: requests, prefill chunks, merges, decode
steps, verify rounds with per-row rollback, filters, extracts, trims, bad inputs) over
paged latent caches whose rows all live in **one block pool per implementation** (drawn
block size 2, 3 or 4, so rows cross blocks and share partly filled tails), with:

* **MLACache as the oracle** (plain latent): every layout row's solo twin is a reference
  ``MLACache`` holding the row's tokens (merged rows, extracted rows, reads after
  rollbacks compared bit-exact with it), besides the reference vs optimized and mlx-lm
  ``KVCache`` pair oracles of the latent machine; an encoded latent (affine or
  TurboQuant, bf16-first at a drawn start, half the examples) is compared with the
  reference and a solo replay per row (``tests/test_paged_latent.py`` holds it against
  ``EncodedLatentCache``);
* **the pool's invariants** after every rule (``spec/paged-pool.md`` §4: conservation,
  free <=> count 0, counts = live tables, no empty tail block); with every row in one
  pool, merges, filters, extracts and rollbacks only edit tables;
* **prefix hits** (``prefix_hit``): a request or a layout row registers its first
  positions (``register_prefix``, ids hashed from what its solo oracle holds there), and
  ``pool.lookup_prefix`` of a new request starting with them hits the whole blocks the
  spec names, holding the registered row's first tokens (the solo oracle's), its blocks
  referenced once more, nothing copied (``WHOLE_BLOCK_HIT``); rows of two or more whole
  blocks whose tables are not one run count ``BLOCK_TABLE_GAPS``;
* **byte-limited pools**: an example draws a headroom (0-2 blocks, or no limit) and
  every append under test (prefill chunks, layout steps, verify blocks) runs with the
  pools limited to what they hold plus the headroom (``conformance.paged``). Both
  implementations must refuse at the same points, a refusal must leave both caches and
  both pools' accounting unchanged (a refused verify block: its round still open), and
  the append then goes in without the limit;
* **leases and save/load** (``machines.OpsChecks``' cadence, drawing nothing, the latent
  machine's hooks): a state loaded across implementations into private pools, then into
  the example's pools, the loads released with every block back.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis import note
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvrows.conformance.families import Impl
from kvrows.conformance.latent import _CODECS, LatentMachine
from kvrows.conformance.machines import Block, OpsChecks, OpsTarget, detached
from kvrows.conformance.paged import (
    HEADROOMS,
    FrozenCollector,
    accounting,
    byte_limited,
    collector_paused,
    hit_accounting_problem,
)
from kvrows.conformance.rules import BLOCK_TABLE_GAPS, WHOLE_BLOCK_HIT, table_has_gaps
from kvrows.errors import PoolExhaustedError
from kvrows.latent import latent_token_bytes

__all__ = ["PagedLatentMachine"]


class PagedLatentMachine(FrozenCollector, LatentMachine, OpsChecks):
    """The latent machine on ``PagedLatentCache`` rows in one pool per implementation,
    with the operation checks after it (as ``hooks.WRITERS["latent"]`` composes them after
    the latent machine; the paged K/V rules bring ``OpsRules`` the same way)."""

    #: This example's headroom in blocks (``None``: no byte limit).
    headroom: int | None = None

    @property
    def encoded(self) -> bool:
        return self.cfg is not None and self.cfg.codec is not None

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        super().setup(data)
        codec = data.draw(st.sampled_from((None,) * 4 + _CODECS), label="codec")
        if codec is not None:
            self.c.codec = codec
            self.c.start = data.draw(st.sampled_from((0, 3, 9)), label="start")
        size = data.draw(st.sampled_from((2, 3, 4)), label="block size")
        self._pools = {
            impl.name: impl.cls(self.spec.name).pool_class(  # type: ignore[attr-defined]
                codec, block_size=size, index_head_dim=self.c.index
            )
            for impl in (self.ref_impl, self.opt_impl)
        }
        self.headroom = data.draw(st.sampled_from(HEADROOMS), label="headroom")
        note(f"codec {codec}, start {self.c.start}, block size {size}, headroom {self.headroom}")
        self._freeze_collector(self.headroom is not None)

    def _draws_window(self, data: st.DataObject) -> bool:
        """The decoded window or the eager read, by the seed's parity (drawn already): the
        family's examples stay the ones its coverage requirements were met with."""
        return self._seed % 2 == 0

    def _write_pair(self, ref: Any, opt: Any, block: Block) -> tuple[Any, Any]:
        """An append under test (both implementations) meets the example's byte limit: a
        refusal is checked, then the append goes in without the limit (a solo's runs free)."""
        if self.headroom is None:
            return super()._write_pair(ref, opt, block)
        pools = list(self._pools.values())
        c = self.c

        def block_bytes(pool: Any) -> int:
            token = latent_token_bytes(pool.latent_codec, c.rank, c.rope, c.index, c.dtype)
            return int(pool.block_size) * token

        def state() -> tuple[Any, ...]:
            # The rows and tables (what they hold is the oracles' business: the append
            # goes in after a refusal and every read is then compared with the solos).
            return (
                *((c.row_offsets, c.left_pad, c.converted, c.block_tables()) for c in (ref, opt)),
                [accounting(pool) for pool in pools],
            )  # fmt: skip

        with collector_paused():
            before = state()
            outcomes: list[Any] = []
            with byte_limited(pools, self.headroom, block_bytes):
                for impl, cache in ((self.ref_impl, ref), (self.opt_impl, opt)):
                    try:
                        outcomes.append(self._write(impl, cache, block))
                    except PoolExhaustedError as error:
                        outcomes.append(detached(error))
            refused = [isinstance(o, PoolExhaustedError) for o in outcomes]
            after = state() if any(refused) else before
        self._exact("appends refused past the byte limit (optimized)", refused[1], refused[0])
        self.stats.check("pool pressure")
        if not refused[0]:
            return outcomes[0], outcomes[1]
        self._exact("refusal messages (optimized)", str(outcomes[1]), str(outcomes[0]))
        self._exact("caches and pools unchanged after a refused append", after, before)
        self._exact("a refused block's round (optimized)", opt.spec_round_open, ref.spec_round_open)
        self.stats.check("exhaustion refused")
        if ref.spec_round_open:
            self.stats.check("round usable after a refused block")
        return super()._write_pair(ref, opt, block)

    def _new_latent(self, impl: Impl) -> Any:
        cls: Any = impl.cls(self.spec.name)
        c = self.c
        pool = self._pools[impl.name]
        return cls(c.rank, c.rope, c.index, c.max_tokens, pool=pool, codec=c.codec, start=c.start)

    def _solo_of(self, request: Any) -> Any:
        """The row's oracle: a reference ``MLACache`` holding the request's tokens (an
        encoded latent: the reference's own extract, replayed alone)."""
        if self.encoded:  # the reference's own extract, in a pool of its own: the two
            # implementations' pools then hold the same tables (a byte limit meets both alike)
            solo = super()._solo_of(request)
            cls: Any = self.ref_impl.cls(self.spec.name)
            if not solo.batch_size:
                c = self.c
                return cls(c.rank, c.rope, c.index, c.max_tokens, codec=c.codec, start=c.start)
            return cls.from_state(solo.state)
        c = self.c
        mla: Any = self.ref_impl.cls("MLACache")
        solo = mla(c.rank, c.rope, c.index, c.max_tokens)
        if request.ref.width:
            latent, rope, index = request.ref.current()
            solo.append(latent, rope, index)
            self.stats.check("MLACache oracle")
        return solo

    def _bad_cases(self, cache: Any) -> list[tuple[str, Callable[[Impl, Any], Any]]]:
        """The latent machine's bad inputs, and rows of another block size joining."""
        c = self.c

        def other_block_size(impl: Impl, target: Any) -> Any:
            cls: Any = impl.cls(self.spec.name)
            foreign = cls(c.rank, c.rope, c.index, c.max_tokens, block_size=target.block_size + 1)
            return target.make_empty_batch().merge_rows([target, foreign])

        return [*super()._bad_cases(cache), ("other block size", other_block_size)]

    # -- prefix hits (``PoolBase.register_blocks`` / ``lookup_prefix``) ---------------------
    def _token_ids(self, planes: tuple[Any, ...], tokens: int) -> list[int]:
        """Ids of a row's first ``tokens`` positions, from what its oracle holds there
        (``[1, 1, width, ·]`` planes): equal ids only ever name equal stored tokens, so a
        hit is right whichever row registered it."""
        columns = [
            b"".join(p[0, 0, i].tobytes() for p in planes if p is not None) for i in range(tokens)
        ]
        return [int.from_bytes(hashlib.blake2b(c, digest_size=6).digest()) for c in columns]

    @precondition(lambda self: self.layout is not None or bool(self.requests))
    @rule(data=st.data())
    def prefix_hit(self, data: st.DataObject) -> None:
        """``register_prefix`` of a row's (or a request's) first ``t`` positions, then
        ``pool.lookup_prefix`` of a new request starting with them: the hit is the whole
        blocks the spec names (``(q - 1) // block_size`` for ``q`` query ids), holds the
        oracle's first tokens, references the blocks once more (nothing copied), and is
        released (every count back). A row in its bf16-first warm-up (beside the pool)
        registers nothing. The collector is off throughout: no finalizer of a collected
        cache releases blocks between the counts compared (for the same reason block
        numbers differ between the implementations' pools: they are not compared)."""
        with collector_paused(collect=False):
            self._prefix_hit(data)

    def _prefix_hit(self, data: st.DataObject) -> None:
        targets: list[tuple[Any, Any, int, Any]] = [(r.ref, r.opt, 0, r.ref) for r in self.requests]
        if self.layout is not None:
            lay = self.layout
            targets += [(lay.ref, lay.opt, b, row.ref) for b, row in enumerate(lay.rows)]
        ref, opt, b, oracle = self._pick(data, targets, "row")
        if not ref.batch_size or not ref.row_offsets[b]:
            return
        self.stats.op("prefix:register")
        offset, bs = ref.row_offsets[b], ref.block_size
        width = oracle.width
        planes = tuple(
            None if p is None else self.ref_impl.to_numpy(p)[:, :, width - offset :]
            for p in oracle.current()
        )
        ids = self._token_ids(planes, offset)
        whole = offset // bs * bs
        t = data.draw(st.sampled_from((offset, whole)) | st.integers(0, offset), label="ids")
        registered = ids[:t]
        in_pool = [bool(c.block_tables()[b]) for c in (ref, opt)]
        self._exact("a row in the pool (optimized vs reference)", in_pool[1], in_pool[0])
        full = [c.register_prefix(b, registered) for c in (ref, opt)]
        expected = t // bs if in_pool[0] else 0
        self._exact(
            "register_prefix: whole blocks cached (reference, optimized)", full, [expected] * 2
        )
        q = data.draw(st.just(t + 1) | st.integers(0, t + 1), label="query ids")
        query = registered[:q] if q <= t else [*registered, -1]
        hit = max(q - 1, 0) // bs if full[0] else 0
        pools = [self._pools[impl.name] for impl in (self.ref_impl, self.opt_impl)]
        before = [accounting(pool) for pool in pools]
        got = [pool.lookup_prefix(query) for pool in pools]
        self._exact(
            f"lookup_prefix of {q} ids: a hit of {hit} blocks (reference, optimized)",
            [None if c is None else tuple(c.row_offsets) for c in got],
            [None if not hit else (hit * bs,)] * 2,
        )
        self.stats.op("prefix:lookup")
        if not hit:
            after = [accounting(pool) for pool in pools]
            self._exact("a missed lookup changes no pool", after, before)
            return
        self.stats.op("prefix:hit")
        tokens = hit * bs
        want = tuple(None if p is None else p[:, :, :tokens] for p in planes)
        for impl, pool, cache, held in zip(
            (self.ref_impl, self.opt_impl), pools, got, before, strict=True
        ):
            mine = tuple(None if p is None else impl.to_numpy(p) for p in cache.current())
            self._same_tensors(f"lookup_prefix hit ({impl.name}) vs the registered row", mine, want)
            problem = hit_accounting_problem(pool, cache.block_tables()[0], held)
            self._exact(f"lookup_prefix ({impl.name}): the pool after a hit", problem, None)
        self.stats.check("prefix hit")
        self.stats.state(WHOLE_BLOCK_HIT)
        for cache in got:
            cache.release()
        self._exact(
            "a released hit gives every count back",
            [accounting(pool)[4] for pool in pools],
            [held[4] for held in before],
        )

    # -- the operation checks' hooks (``machines.OpsChecks``, after this machine): the
    # latent machine's, and loads into the example's pools
    def _load_pools(self, item: OpsTarget) -> tuple[Any, Any]:
        return self._pools[self.ref_impl.name], self._pools[self.opt_impl.name]

    def _check_layout(self) -> None:
        super()._check_layout()
        layout = self.layout
        if layout is None:
            return
        bs = layout.ref.block_size
        tables = layout.ref.block_tables()
        if any(
            table_has_gaps(tb, t, bs) for tb, t in zip(tables, layout.ref.row_offsets, strict=True)
        ):
            self.stats.state(BLOCK_TABLE_GAPS)

    @invariant()
    def pools_are_sound(self) -> None:
        pools = getattr(self, "_pools", {})
        with collector_paused(collect=False):
            for pool in pools.values():
                pool.check_valid()
        if pools:
            self.stats.check("pool invariants")
