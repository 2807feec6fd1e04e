"""The turbo family's conformance machine (``kvrows.conformance.turbo``).

``BatchedTurboQuantKVCache`` (the layout of ``TurboQuantKVCache``'s rows in all three
roles) runs its machine under the selected profile, scaled by the family's example
budget: serial caches and layout rows at one TurboQuant codec per example, merged,
joined, stepped, verified in rounds, filtered, extracted, published and trimmed, against
the reference (codes and scales exact), a solo replay per row and the eager-V oracle.
The tests check that nothing was skipped silently: every operation, every oracle, every
compared quantity, and the cases the family exists for (several codecs, packed and
8-bit keys, head dims past 128, key and value dims that differ, the eager oracle over a
read with padding columns, rolled-back rounds).
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvrows.codec import TURBO_HEAD_DIMS
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import BASE_CHECKS, machine_class
from kvrows.conformance.profiles import active_profile
from kvrows.conformance.runner import family_settings, format_report, run_machines
from kvrows.conformance.speculative import SPECULATIVE_CHECKS, SpeculativeMachine
from kvrows.conformance.stats import Stats
from kvrows.conformance.turbo import CODECS, TURBO_CHECKS, TurboMachine

FAMILY = FAMILIES["turbo"]
LAYOUTS = [spec.name for spec in FAMILY.layouts]

#: Operations the turbo machine must have exercised.
EXPECTED_OPS = {
    "new_request",
    "prefill_chunk",
    "merge",
    "join",
    "decode_step",
    "multi_step",
    "extract",
    "publish",
    "trim_rows",
    "invalid",
    "spec_rounds",
    "round:none",
    "round:unequal",
}


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


#: The CI profile's examples (drawn from the machine's own seed,
#: ``profiles.machine_seed``) first draw 8-bit keys past 26 (the family's budget is 10;
#: an example's codec is its first draw, which later examples tend to keep): 30 reach
#: every requirement.
CI_EXAMPLES = 30


@pytest.mark.parametrize("layout", LAYOUTS)
def test_turbo_family(layout: str) -> None:
    settings = family_settings(FAMILY)
    if active_profile().name == "ci":
        settings = family_settings(FAMILY, max_examples=CI_EXAMPLES)
    stats = Stats(FAMILY.name, layout)
    run_state_machine_as_test(machine_class(FAMILY, layout, stats=stats), settings=settings)
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS)
    # Saved states too: both implementations describe the same rows, and the machine goes
    # on with the restored caches.
    oracles = (*BASE_CHECKS, *SPECULATIVE_CHECKS, *TURBO_CHECKS, "solo attention", "state")
    for oracle in (*oracles, "save_restore"):
        assert stats.checks[oracle] > 0, f"oracle {oracle!r} never ran: {dict(stats.checks)}"
    compared = {quantity for quantity, _ in stats.errors}
    expected = {"kv.stored", "kv.fetched", "kv.solo", "attention", "attention.solo"}
    expected |= {"attention.eager"}
    assert expected <= compared, f"quantities never compared: {expected - compared}"
    # Every example ran at one supported codec, and not always the same one.
    names = {f"turbo k{k}v{v}" for k, v in CODECS}
    assert set(stats.variants) <= names, set(stats.variants) - names
    assert sum(stats.variants.values()) == stats.examples
    assert len(stats.variants) >= 3, dict(stats.variants)
    # Head dims: only the codec's, and past 128 too.
    dims = {int(name.split()[-1]) for name in stats.checks if name.startswith("head dim ")}
    assert dims <= set(TURBO_HEAD_DIMS), dims
    assert max(dims) > 128, dims
    # No mlx-lm peer: nothing to skip.
    assert not stats.skips, dict(stats.skips)


def test_the_family_drives_both_turbo_storages() -> None:
    """One layout, ``BatchedTurboQuantKVCache``, in every role of ``TurboQuantKVCache``'s
    rows, on the turbo machine (verify rounds included), without an mlx-lm peer."""
    assert LAYOUTS == ["BatchedTurboQuantKVCache"]
    spec = FAMILY.layout("BatchedTurboQuantKVCache")
    assert spec.roles == ("decode", "prefill", "verify")
    assert spec.trim_rows and not spec.shared_column
    assert FAMILY.serial == "TurboQuantKVCache"
    assert FAMILY.peer is None and not spec.peer and not spec.serial_peer
    assert FAMILY.machine is not None
    machine = FAMILY.machine()
    assert issubclass(machine, TurboMachine) and issubclass(machine, SpeculativeMachine)
    # No other family drives a turbo class (but the delayed turbo layout, whose converted
    # rows extract into TurboQuantKVCache: the delayed-turbo family).
    for name, family in FAMILIES.items():
        if name not in ("turbo", "delayed-turbo"):
            serials = {s.serial or family.serial for s in family.layouts}
            assert "TurboQuantKVCache" not in serials, name


def test_runner_runs_the_turbo_family() -> None:
    results = run_machines(["turbo"], profile="ci", max_examples=2, stateful_step_count=6)
    assert [(r.family, r.layout) for r in results] == [("turbo", name) for name in LAYOUTS]
    assert all(r.passed for r in results), [r.failure for r in results]
    assert "BatchedTurboQuantKVCache" in format_report(results, "ci")
