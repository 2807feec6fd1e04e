"""The paged family's conformance machine (``kvrows.conformance.paged``).

``PagedKvRows`` (the layout of ``PagedKVCache``'s rows in all three roles) runs the
speculative machine under the selected profile, scaled by the family's example budget:
serial caches and layout rows merged, joined, stepped, verified in rounds, filtered,
extracted, published, trimmed and saved, against the reference, the contiguous model
(the same bytes as ``KVCache``) and a solo replay per row, with the pools' invariants
after every rule, in byte-limited pools that run out at random points (a refusal must
be the same in both implementations and change nothing). The test checks nothing was
skipped silently.
"""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import BASE_CHECKS, machine_class
from kvrows.conformance.paged import PagedAffineMachine, PagedMachine
from kvrows.conformance.profiles import active_profile
from kvrows.conformance.runner import family_settings
from kvrows.conformance.speculative import SPECULATIVE_CHECKS
from kvrows.conformance.stats import Stats

FAMILY = FAMILIES["paged"]

#: Operations the paged machine must have exercised.
EXPECTED_OPS = {
    "new_request",
    "prefill_chunk",
    "merge",
    "decode_step",
    "extract",
    "publish",
    "trim_rows",
    "invalid",
}


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


#: The CI profile's examples (drawn from the machine's own seed,
#: ``profiles.machine_seed``) first reach a round that goes on after a refused block
#: past the family's 15: 40 reach every requirement (about 15 s on one core).
CI_EXAMPLES = 40


def test_paged_family() -> None:
    assert [spec.name for spec in FAMILY.layouts] == ["PagedKvRows"]
    spec = FAMILY.layout("PagedKvRows")
    assert spec.roles == ("decode", "prefill", "verify") and spec.trim_rows
    assert FAMILY.machine is not None and issubclass(FAMILY.machine(), PagedMachine)
    settings = family_settings(FAMILY)
    if active_profile().name == "ci":
        settings = family_settings(FAMILY, max_examples=CI_EXAMPLES)
    stats = Stats(FAMILY.name, "PagedKvRows")
    run_state_machine_as_test(machine_class(FAMILY, "PagedKvRows", stats=stats), settings=settings)
    stats.require(settings.max_examples // 2, ops=EXPECTED_OPS)
    assert stats.ops["spec_rounds"] + stats.ops["row_rounds"] > 0, dict(stats.ops)
    rollbacks = ("round:none", "round:equal", "round:unequal")
    assert sum(stats.ops[op] for op in rollbacks) > 0, dict(stats.ops)
    oracles = (*BASE_CHECKS, *SPECULATIVE_CHECKS, "state", "save_restore")
    for oracle in oracles:
        assert stats.checks[oracle] > 0, f"oracle {oracle!r} never ran: {dict(stats.checks)}"
    compared = {quantity for quantity, _ in stats.errors}
    assert {"kv.stored", "kv.fetched", "kv.solo", "attention"} <= compared, compared
    assert not stats.skips, dict(stats.skips)
    # Byte-limited pools: appends (verify blocks included) were refused, alike and with
    # nothing changed, and the rounds went on.
    assert stats.ops["exhausted:append"] > 0, dict(stats.ops)
    for oracle in ("pool invariants", "exhaustion refused", "round usable after a refused block"):
        assert stats.checks[oracle] > 0, f"oracle {oracle!r} never ran: {dict(stats.checks)}"


def test_paged_affine_family() -> None:
    """The same rows over affine pools (one codec per example): codes exact."""
    family = FAMILIES["paged-affine"]
    assert family.machine is not None and issubclass(family.machine(), PagedAffineMachine)
    settings = family_settings(family)
    stats = Stats(family.name, "PagedKvRows")
    machine = machine_class(family, "PagedKvRows", stats=stats)
    run_state_machine_as_test(machine, settings=settings)
    assert stats.examples >= settings.max_examples // 2, f"only {stats.examples} examples ran"
    assert len(stats.variants) >= 3 and all(v.startswith("bits=") for v in stats.variants)
    for oracle in ("reference vs optimized", "solo replay", "state", "admission"):
        assert stats.checks[oracle] > 0, f"oracle {oracle!r} never ran: {dict(stats.checks)}"
    assert {"kv.stored", "kv.solo"} <= {quantity for quantity, _ in stats.errors}
