"""The paged family's machine: the speculative machine over ``PagedKVCache`` rows in
``PagedKvRows`` (all three roles), plus the pool's invariants after every rule.

Every base rule (requests, prefill chunks, joins, filters, extracts, publishes, steps,
per-row trims, bad input) and every verify round runs on paged storages; the base
machine's model is the contiguous KV (``KVCache``'s bytes), so every read, row view,
extracted row and saved state is compared bit-exact with the same tokens stored
contiguously, with the other implementation and with a solo replay. After every rule the
pools the caches point into must satisfy ``spec/paged-pool.md`` §4 (conservation, free
<=> count 0, counts = live tables holding the block, no empty tail block).
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis.stateful import invariant

from kvrows import table
from kvrows.compositions import composition
from kvrows.conformance.families import Impl
from kvrows.conformance.machines import Slot, _answer
from kvrows.conformance.speculative import SpeculativeAffineMachine, SpeculativeMachine
from kvrows.schemes import Affine

__all__ = ["PagedAffineMachine", "PagedMachine"]


class PagedMachine(SpeculativeMachine):
    """The speculative machine on paged storages, with the pool invariants."""

    def _pools(self, impl_index: int) -> list[Any]:
        pools: dict[int, Any] = {}
        for cache in self._everything()[impl_index]:
            pool = getattr(cache, "pool", None)
            if pool is not None:
                pools[id(pool)] = pool
        return list(pools.values())

    @invariant()
    def pools_are_sound(self) -> None:
        for index in (0, 1):
            for pool in self._pools(index):
                pool.check_valid()

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


class PagedAffineMachine(PagedMachine, SpeculativeAffineMachine):
    """The paged machine over affine pools: one affine codec per example (the affine
    machine's draw), every paged cache built with ``codec=Affine(...)``; stored codes
    compared exactly."""

    def _new(self, impl: Impl, name: str, **changes: int) -> Any:
        if composition(name).geometry != "paged":  # a foreign cache of an invalid case
            return super()._new(impl, name, **changes)
        g = self.g
        bits = changes.get("bits", g.bits or 8)
        group_size = changes.get("group_size", g.group_size or 32)
        return impl.cls(name)(codec=Affine(bits=bits, group_size=group_size))
