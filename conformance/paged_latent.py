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
* **byte-limited pools**: an example draws a headroom (0-2 blocks, or no limit) and
  every append under test (prefill chunks, layout steps, verify blocks) runs with the
  pools limited to what they hold plus the headroom (``conformance.paged``). Both
  implementations must refuse at the same points, a refusal must leave both caches and
  both pools' accounting unchanged (a refused verify block: its round still open), and
  the append then goes in without the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis import note
from hypothesis.stateful import initialize, invariant

from kvrows.conformance.families import Impl
from kvrows.conformance.latent import _CODECS, LatentMachine
from kvrows.conformance.machines import Block
from kvrows.conformance.paged import (
    HEADROOMS,
    FrozenCollector,
    accounting,
    byte_limited,
    collector_paused,
)
from kvrows.errors import PoolExhaustedError
from kvrows.latent import latent_token_bytes

__all__ = ["PagedLatentMachine"]


class PagedLatentMachine(FrozenCollector, LatentMachine):
    """The latent machine on ``PagedLatentCache`` rows in one pool per implementation."""

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
                        outcomes.append(error)
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

    @invariant()
    def pools_are_sound(self) -> None:
        pools = getattr(self, "_pools", {})
        with collector_paused(collect=False):
            for pool in pools.values():
                pool.check_valid()
        if pools:
            self.stats.check("pool invariants")
