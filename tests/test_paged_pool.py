"""The pool state machine (``conformance/paged_pool.py``) on both implementations and both
codecs, and its teeth: a forgotten decref and a hashed draft block are caught."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvrows.conformance.paged_pool import AFFINE_TEST, STATS, pool_machine
from kvrows.conformance.profiles import profile_settings
from kvrows.optimized.paged import BlockPool, PagedKvRows
from kvrows.schemes import Plain

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
        return self._pool.register_prefix(self._tables[row], self._offsets[row], token_ids)


@pytest.mark.parametrize(("mutant", "role"), [(ForgetsOneDecref, "pool"), (HashesDrafts, "rows")])
def test_the_pool_machine_catches(mutant: type, role: str) -> None:
    machine = pool_machine("optimized", Plain(), {role: mutant})
    if role == "pool":
        ForgetsOneDecref.cache_class = BlockPool.cache_class
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=profile_settings("teeth"))
