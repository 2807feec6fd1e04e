"""The delayed family's conformance machines (``kvrows.conformance.delayed``).

Each delayed layout (``DelayedQuantizedKVCache``, ``DelayedRotatingQuantizedKVCache``) runs
its machine under the selected profile, scaled by the family's example budget: rows of
legos and serial storages that convert to affine at their own ``start`` while they are
merged, stepped, prefilled, verified in rounds, filtered, extracted and trimmed, against
the reference, a model of the layout and a solo lego per row. The tests check that
nothing was skipped silently: every operation, every oracle, and each case the family
exists for (mixed reads, a row converting while others stay plain, conversion at a
round's end, at a merge, a crossing chunk inside prefill maintenance, packed reads).
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest
from hypothesis.stateful import run_state_machine_as_test

import kvrows.optimized as O
import kvrows.reference as R
from kvrows.conformance.delayed import DELAYED_CHECKS
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import machine_class
from kvrows.conformance.runner import family_settings, format_report, run_machines
from kvrows.conformance.stats import Stats

FAMILY = FAMILIES["delayed"]
LAYOUTS = [spec.name for spec in FAMILY.layouts]

#: Operations every delayed machine must have exercised.
EXPECTED_OPS = {
    "new_request:lego",
    "new_request:plain",
    "new_request:affine",
    "lego_append",
    "merge",
    "join",
    "decode_step",
    "multi_step",
    "prefill_crossing",
    "extract",
    "publish",
    "trim_rows",
    "invalid",
    "round:all",
    "round:none",
    "round:equal",
    "round:unequal",
    "filter:reorder",
}


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


@pytest.mark.parametrize("layout", LAYOUTS)
def test_delayed_family(layout: str) -> None:
    settings = family_settings(FAMILY)
    stats = Stats(FAMILY.name, layout)
    run_state_machine_as_test(machine_class(FAMILY, layout, stats=stats), settings=settings)
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS, oracles=DELAYED_CHECKS)
    compared = {quantity for quantity, _ in stats.errors}
    expected = {"kv.fetched", "kv.solo", "attention", "attention.solo", "attention.solo.plain"}
    assert expected <= compared, f"quantities never compared: {expected - compared}"
    assert {"start 0", "start > 0"} <= set(stats.variants), dict(stats.variants)
    if layout == "DelayedQuantizedKVCache":
        # Mixed full-attention rows answer make_mask with the position record's mask.
        assert stats.checks["record mask"] > 0, dict(stats.checks)
    else:
        # A wrapped ring row refused a publish of a shorter prefix.
        assert stats.checks["publish refused"] > 0, dict(stats.checks)
    assert not stats.skips, dict(stats.skips)


def test_the_family_drives_both_delayed_layouts() -> None:
    """The family's layouts are both implementations' delayed layouts, each holding rows
    of its lego class."""
    assert LAYOUTS == ["DelayedQuantizedKVCache", "DelayedRotatingQuantizedKVCache"]
    for mod in (R, O):
        assert mod.DelayedQuantizedKVCache.lego_class is mod.Bf16FirstQuantizedKVCache
        assert (
            mod.DelayedRotatingQuantizedKVCache.lego_class is mod.Bf16FirstRotatingQuantizedKVCache
        )
    assert {spec.tolerance_key for spec in FAMILY.layouts} == {"affine", "rotating-affine"}
    # No other family drives a delayed layout (their rows change codec).
    for name, family in FAMILIES.items():
        if name != "delayed":
            assert not {spec.name for spec in family.layouts} & set(LAYOUTS), name


def test_runner_runs_the_delayed_family() -> None:
    results = run_machines(["delayed"], profile="ci", max_examples=2, stateful_step_count=6)
    assert [(r.family, r.layout) for r in results] == [("delayed", name) for name in LAYOUTS]
    assert all(r.passed for r in results), [r.failure for r in results]
    report = format_report(results, "ci")
    assert "DelayedRotatingQuantizedKVCache" in report
