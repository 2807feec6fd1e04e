"""Issue 24, "every public operation in some machine": a planted bug in each operation
class the machines now drive is caught (``tests/test_teeth.py``'s discipline: a throwaway
subclass of an optimized class, the bug marked ``# MUTATION``, the machine run under the
teeth profile must fail with an oracle's ``AssertionError``).

* the prefix cache (``PagedRules.prefix_hit``): a lookup that hits one block too many;
* save/load (``OpsRules.save_load`` in the paged machines, ``OpsChecks`` on its cadence in
  the contiguous ones): a load that drops each row's last token; a contiguous ring's load
  that forgets its write index (the rotating family's machine);
* leases (``OpsRules.lease``): a close that releases but keeps lending the state;
* the latent and recurrent machines' save/load (``OpsChecks`` on its cadence, the hooks
  theirs): a latent load that drops each row's last token, an encoded latent whose state
  saves its warm rows' exact latent as zeros, a recurrent load that loses the last plane
  (zeros: the recurrent state of gated DeltaNet).
* the delayed layouts (``OpsChecks`` in ``DelayedMachine``): a saved state that records a
  converted row's current offset as its conversion offset, a ring's saved state whose
  converted rows lose their key scales, and the lease above;
* the paged latent machine's save/load (``OpsChecks`` on its cadence, the latent hooks and
  loads into the example's pools): a load into a given pool that drops each row's last
  token, a load that ignores the pool it is given, an encoded state that saves its warm
  rows' exact latent as zeros; the paged K/V machine's loads into the pools of the caches
  saved (``PagedRules._load_pools``): the same two pool mutants on ``PagedKvRows``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
import pytest
from conformance_helpers import caught, run_teeth

import kvrows.optimized as O
from kvrows.forms import DELAYED_PLAIN, state_form
from kvrows.leases import StateLease
from kvrows.optimized.paged import PagedKvRows
from kvrows.optimized.paging import BlockPool, PagedSerial

pytestmark = pytest.mark.usefixtures("cpu_stream")


_LOOKUP = BlockPool.lookup_prefix


def greedy_lookup(
    self: BlockPool, token_ids: Sequence[int], token_geometry: Any = None
) -> PagedSerial | None:
    """Looks up every whole block the ids cover: the last token is no longer left for
    the request to compute (a query of whole blocks hits one block too many). Patched
    onto the optimized pool (every pool of the machine: a subclass would make merges
    across pools refuse)."""
    hit: PagedSerial | None = _LOOKUP(self, [*token_ids, 0], token_geometry)  # MUTATION
    return hit  # (the real lookup caps at len - 1 ids)


class DropsLastTokenOnLoad:
    """``from_state`` loads every row one token short."""

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None, **kwargs: Any) -> Any:
        loaded = super().from_state(state, meta_state, **kwargs)  # type: ignore[misc]
        if any(loaded.row_offsets):
            # MUTATION (the load keeps every token)
            loaded.trim_rows([1 if offset else 0 for offset in loaded.row_offsets])
        return loaded


class LoadDropsLastToken(DropsLastTokenOnLoad, PagedKvRows):
    """A paged layout whose load drops each row's last token."""


def test_prefix_hit_one_block_too_many_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BlockPool, "lookup_prefix", greedy_lookup)
    with pytest.raises(AssertionError) as failure:
        run_teeth("PagedKvRows", None, 12, "paged", name="TeethGreedyLookup")
    assert "Failing test case" in "\n".join(getattr(failure.value, "__notes__", []))
    assert "lookup_prefix" in str(failure.value), failure.value


def test_load_dropping_the_last_token_is_caught() -> None:
    message = caught("PagedKvRows", LoadDropsLastToken, 12, family_name="paged")
    assert "loaded" in message, message


_CLOSE = StateLease.close


def close_keeps_lending(self: StateLease) -> None:
    """Releases the state but keeps lending it: ``borrow()`` after ``close()`` answers."""
    value = self._value
    _CLOSE(self)
    self._value = value  # MUTATION (ownership ends at close)


def test_lease_lent_after_close_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StateLease, "close", close_keeps_lending)
    with pytest.raises(AssertionError) as failure:
        run_teeth("PagedKvRows", None, 12, "paged", name="TeethLeaseLentAfterClose")
    assert "Failing test case" in "\n".join(getattr(failure.value, "__notes__", []))
    assert "lease" in str(failure.value), failure.value


_RESUME = O.RotatingKVCache._resume_serial


def ring_load_loses_index(self: Any, fields: dict[str, Any], held: int) -> None:
    """``from_state`` of a wrapped ring forgets where the ring writes next: the saved
    columns are read as if in time order (mlx-lm's ``_idx`` taken as the held count).
    Patched onto the optimized serial ring (a subclass would fail the machine's type
    checks of extracted rows)."""
    _RESUME(self, {**fields, "idx": held}, held)  # MUTATION (the saved idx)


#: The teeth profile's examples of the rotating family's decode ring that reach a save of
#: a wrapped request (``OpsChecks``' cadence: no rule, the draws are the family's own).
RING_TEETH_EXAMPLES = 12


def test_ring_load_losing_its_index_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(O.RotatingKVCache, "_resume_serial", ring_load_loses_index)
    with pytest.raises(AssertionError) as failure:
        run_teeth(
            "BatchedRotatingCache", None, RING_TEETH_EXAMPLES, "rotating", name="TeethRingLoad"
        )
    assert "Failing test case" in "\n".join(getattr(failure.value, "__notes__", []))
    assert "loaded" in str(failure.value), failure.value


def test_the_unmutated_ring_saves_and_loads() -> None:
    """The same run without the mutation passes, having saved and loaded requests."""
    stats = run_teeth("BatchedRotatingCache", None, RING_TEETH_EXAMPLES, "rotating")
    assert stats.ops["save_load"] > 0 and stats.checks["save_load across implementations"] > 0


# -- the latent and recurrent machines (``OpsChecks``' cadence, the CI machine's) ----------


class LatentLoadDropsLastToken(DropsLastTokenOnLoad, O.MLACache):
    """An MLA layout whose load drops each row's last token."""


class StateZeroesTheWarmLatent(O.EncodedLatentCache):
    """The state saves the exact latent of the rows still plain (bf16-first) as zeros."""

    def _state(self) -> tuple[Any, ...]:
        saved = list(super()._state())
        if saved[3] is not None:
            saved[3] = mx.zeros_like(saved[3])  # MUTATION (the exact latent, as held)
        return tuple(saved)


class LoadLosesTheLastPlane(O.BatchedSSMCache):
    """``from_state`` loads the last plane as zeros (the recurrent state forgotten)."""

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None, **kwargs: Any) -> Any:
        *planes, offset = state
        if planes[-1] is not None:
            planes[-1] = mx.zeros_like(planes[-1])  # MUTATION (the saved plane)
        return super().from_state((*planes, offset), meta_state, **kwargs)


#: The teeth profile's examples of the latent and recurrent machines: each mutant is caught
#: within 4 (``OpsChecks``' cadence: no rule, the draws are the families' own).
LATENT_TEETH_EXAMPLES = 6


@pytest.mark.parametrize(
    ("family_name", "layout", "mutant", "oracle"),
    [
        ("latent", "MLACache", LatentLoadDropsLastToken, "state loaded into"),
        # both implementations' saved forms differ: before any load
        ("latent", "EncodedLatentCache", StateZeroesTheWarmLatent, "rows of the saved state"),
        ("recurrent", "BatchedSSMCache", LoadLosesTheLastPlane, "state loaded into"),
    ],
)
def test_a_lossy_latent_or_recurrent_state_is_caught(
    family_name: str, layout: str, mutant: type, oracle: str
) -> None:
    message = caught(layout, mutant, LATENT_TEETH_EXAMPLES, family_name=family_name)
    assert oracle in message, message[:500]


@pytest.mark.parametrize(
    ("family_name", "layout"),
    [("latent", "MLACache"), ("latent", "EncodedLatentCache"), ("recurrent", "BatchedSSMCache")],
)
def test_the_unmutated_latent_and_recurrent_save_and_load(family_name: str, layout: str) -> None:
    """The same runs without the mutations pass, having saved, loaded and leased."""
    stats = run_teeth(layout, None, LATENT_TEETH_EXAMPLES, family_name)
    assert stats.checks["save_load across implementations"] > 0 and stats.checks["leases"] > 0


class SavesOffsetsAsConversions(O.DelayedQuantizedKVCache):
    """``state`` records a converted row's offset where its conversion offset belongs:
    the rows' planes are saved whole, a load reports the rows converted later than they
    did (their ``converted_at``, the extracted legos' ``minimum_reusable_offset``)."""

    @property
    def state(self) -> tuple[Any, ...]:
        saved = super().state
        fields = dict(zip(state_form(self.composition).fields, saved, strict=True))
        marks = [
            DELAYED_PLAIN if at is None else offset  # MUTATION (at: the conversion offset)
            for at, offset in zip(self.converted_at, self.row_offsets, strict=True)
        ]
        fields["converted_at"] = self._positions(marks)
        return tuple(fields.values())

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        cast(Any, O.DelayedQuantizedKVCache).state.fset(self, value)  # the real setter


def test_delayed_state_losing_the_conversion_offsets_is_caught() -> None:
    message = caught("DelayedQuantizedKVCache", SavesOffsetsAsConversions, family_name="delayed")
    assert "loaded" in message, message


class SavesConvertedScalesZeroed(O.DelayedRotatingQuantizedKVCache):
    """``state`` saves the converted rows' key scales as zeros (their codes and biases
    whole, the plain rows untouched)."""

    @property
    def state(self) -> tuple[Any, ...]:
        fields = dict(zip(state_form(self.composition).fields, super().state, strict=True))
        held = fields["stage1.keys"]
        if held is not None:
            codes, scales, *rest = held
            fields["stage1.keys"] = (codes, mx.zeros_like(scales), *rest)  # MUTATION
        return tuple(fields.values())

    @state.setter
    def state(self, value: tuple[Any, ...]) -> None:
        cast(Any, O.DelayedRotatingQuantizedKVCache).state.fset(self, value)  # the real setter


def test_delayed_ring_state_losing_the_converted_scales_is_caught() -> None:
    message = caught(
        "DelayedRotatingQuantizedKVCache", SavesConvertedScalesZeroed, family_name="delayed"
    )
    assert "saved state" in message, message


def test_delayed_lease_lent_after_close_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StateLease, "close", close_keeps_lending)
    with pytest.raises(AssertionError) as failure:
        run_teeth("DelayedRotatingQuantizedKVCache", None, 12, "delayed", name="TeethDelayedLease")
    assert "Failing test case" in "\n".join(getattr(failure.value, "__notes__", []))
    assert "lease" in str(failure.value), failure.value


# -- the paged latent machine (``OpsChecks``' cadence; loads into the example's pools) ------


class DropsLastTokenOnPoolLoad:
    """``from_state`` into a given pool loads every row one token short (a load into a
    private pool is right: only the loads into the example's pools can see it)."""

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None, **kwargs: Any) -> Any:
        loaded = super().from_state(state, meta_state, **kwargs)  # type: ignore[misc]
        if kwargs.get("pool") is not None and any(loaded.row_offsets):
            # MUTATION (the load keeps every token)
            loaded.trim_rows([1 if offset else 0 for offset in loaded.row_offsets])
        return loaded


class IgnoresThePoolOnLoad:
    """``from_state`` loads into a private pool whatever pool it is given (the rows are
    right; the pool the caller shares holds none of them)."""

    @classmethod
    def from_state(cls, state: Any, meta_state: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("pool", None)  # MUTATION (the load writes into the pool given)
        return super().from_state(state, meta_state, **kwargs)  # type: ignore[misc]


class PoolLoadDropsLastToken(DropsLastTokenOnPoolLoad, O.PagedLatentCache):
    """A paged latent cache whose load into a given pool drops each row's last token."""


class LoadIgnoresThePool(IgnoresThePoolOnLoad, O.PagedLatentCache):
    """A paged latent cache whose load ignores the pool it is given."""


class KvPoolLoadDropsLastToken(DropsLastTokenOnPoolLoad, PagedKvRows):
    """A paged K/V layout whose load into a given pool drops each row's last token."""


class KvLoadIgnoresThePool(IgnoresThePoolOnLoad, PagedKvRows):
    """A paged K/V layout whose load ignores the pool it is given."""


class PagedStateZeroesTheWarmLatent(O.PagedLatentCache):
    """The state saves the exact latent of the rows still plain (bf16-first, beside the
    pool) as zeros."""

    def _state(self) -> tuple[Any, ...]:
        saved = list(super()._state())
        if saved[3] is not None:
            saved[3] = mx.zeros_like(saved[3])  # MUTATION (the exact latent, as held)
        return tuple(saved)


#: The teeth profile's examples of the paged latent machine: each mutant is caught within
#: them (``OpsChecks``' cadence: no rule, the draws are the family's own).
PAGED_LATENT_TEETH_EXAMPLES = 6


@pytest.mark.parametrize(
    ("mutant", "oracle"),
    [
        (PoolLoadDropsLastToken, "in the example's pool"),
        (LoadIgnoresThePool, "the loads are in the pools given"),
        # both implementations' saved forms differ: before any load
        (PagedStateZeroesTheWarmLatent, "rows of the saved state"),
    ],
)
def test_a_lossy_paged_latent_state_is_caught(mutant: type, oracle: str) -> None:
    message = caught(
        "PagedLatentCache", mutant, PAGED_LATENT_TEETH_EXAMPLES, family_name="paged-latent"
    )
    assert oracle in message, message[:500]


@pytest.mark.parametrize(
    ("mutant", "oracle"),
    [
        (KvPoolLoadDropsLastToken, "in the example's pool"),
        (KvLoadIgnoresThePool, "the loads are in the pools given"),
    ],
)
def test_a_paged_kv_load_into_a_given_pool_is_checked(mutant: type, oracle: str) -> None:
    """The paged K/V machines load each saved state into the pools of the caches it was
    saved from too (``PagedRules._load_pools``): a load wrong only there is caught."""
    message = caught("PagedKvRows", mutant, 12, family_name="paged")
    assert oracle in message, message[:500]


def test_the_unmutated_paged_latent_saves_and_loads() -> None:
    """The same run without the mutations passes, having saved, loaded into private pools
    and the example's, and leased."""
    stats = run_teeth("PagedLatentCache", None, PAGED_LATENT_TEETH_EXAMPLES, "paged-latent")
    checks = ("save_load across implementations", "save_load into the pool", "leases")
    assert all(stats.checks[c] > 0 for c in checks), dict(stats.checks)
