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
  pool, merges, filters, extracts and rollbacks only edit tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
from hypothesis import note
from hypothesis.stateful import initialize, invariant

from kvrows.conformance.families import Impl
from kvrows.conformance.latent import _CODECS, LatentMachine

__all__ = ["PagedLatentMachine"]


class PagedLatentMachine(LatentMachine):
    """The latent machine on ``PagedLatentCache`` rows in one pool per implementation."""

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
        note(f"codec {codec}, start {self.c.start}, block size {size}")

    def _new(self, impl: Impl) -> Any:
        cls: Any = impl.cls(self.spec.name)
        c = self.c
        pool = self._pools[impl.name]
        return cls(c.rank, c.rope, c.index, c.max_tokens, pool=pool, codec=c.codec, start=c.start)

    def _solo_of(self, request: Any) -> Any:
        """The row's oracle: a reference ``MLACache`` holding the request's tokens (an
        encoded latent: the reference's own extract, replayed alone)."""
        if self.encoded:
            return super()._solo_of(request)
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
        for pool in pools.values():
            pool.check_valid()
        if pools:
            self.stats.check("pool invariants")
