"""What the conformance test files share: running one machine of a family, the runner's
smoke run, the checks that a run skipped nothing silently, and the teeth runs (a machine
must catch a planted bug)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import hypothesis
import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvrows.conformance.families import FAMILIES, Family, Impl, optimized_impl
from kvrows.conformance.machines import BASE_CHECKS, machine_class
from kvrows.conformance.parity import DIVERGENCES
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.conformance.runner import MachineResult, family_settings, format_report, run_machines
from kvrows.conformance.stats import Stats

#: The batch-parity checks a layout with an mlx-lm batch peer runs (the plain family's
#: layouts add trim and serial parity).
MLX_LM_BATCH_CHECKS = (
    "mlx-lm layout",
    "mlx-lm step",
    "mlx-lm merge",
    "mlx-lm filter",
    "mlx-lm extract",
)

#: Operations every machine of the base families (plain, affine, rotating) must have
#: exercised (layouts with per-row trims add trim_rows; the plain and affine ones, trim).
BASE_OPS = frozenset(
    {
        "new_request",
        "prefill_chunk",
        "trim_request",
        "merge",
        "join",
        "merge_layout",
        "decode_step",
        "multi_step",
        "filter",
        "extract",
        "publish",
        "invalid",
    }
)

#: Operations every speculative-style machine (rows trimmed one by one, rounds of verify
#: blocks) must have exercised, before the ones of its own family.
ROW_OPS = frozenset(
    {
        "new_request",
        "merge",
        "join",
        "decode_step",
        "multi_step",
        "extract",
        "publish",
        "trim_rows",
        "invalid",
        "spec_rounds",
    }
)

#: The quantities every machine of the base families compares.
BASE_QUANTITIES = frozenset({"kv.stored", "kv.fetched", "kv.solo", "attention", "attention.solo"})

#: A layout's run must reach at least this many filter kinds (``strategies.keep_lists``:
#: drop-longest, reorder, none, subset, and padded-rows). Which examples a worker runs
#: depends on what ran before it in the same process, so demanding every kind of every
#: layout made the check flaky; the family's layouts together reach every kind.
FILTER_KINDS = 3

#: The operations ``machines.OpsChecks`` checks on its cadence (no draw) in every
#: contiguous K/V machine and the latent, paged latent and recurrent ones: a save/load
#: across implementations and every lease ending.
OPS_CHECKED = frozenset({"save_load", "lease:close", "lease:transfer", "lease:failed release"})


def ops_ran(ops: Mapping[str, int]) -> set[str]:
    """The operations a run exercised, with ``filter`` standing for enough filter kinds."""
    ran = {op for op in ops if not op.startswith("filter:")}
    if len([op for op in ops if op.startswith("filter:")]) >= FILTER_KINDS:
        ran.add("filter")
    return ran


def run_family(
    family: Family,
    layout: str,
    settings: hypothesis.settings | None = None,
    ci_examples: int | None = None,
    **machine_args: Any,
) -> tuple[Stats, hypothesis.settings]:
    """Run ``layout``'s machine of ``family`` under ``settings`` (default: the family's
    settings under the selected profile, with ``ci_examples`` examples in the CI profile
    where the family's seed needs more to reach its coverage requirements); the run's
    statistics, and the settings."""
    if settings is None:
        ci = ci_examples is not None and active_profile().name == "ci"
        settings = (
            family_settings(family, max_examples=ci_examples) if ci else family_settings(family)
        )
    stats = Stats(family.name, layout)
    machine = machine_class(family, layout, stats=stats, **machine_args)
    run_state_machine_as_test(machine, settings=settings)
    return stats, settings


def run_base_family(
    family: Family,
    layout: str,
    common_ops: AbstractSet[str],
    oracles: Iterable[str] = (),
    ci_examples: int | None = None,
) -> Stats:
    """Run ``layout``'s machine of one of the base families (plain, affine, rotating):
    at least half the examples ran, every one of ``common_ops`` (and ``trim_rows`` where
    the layout has it; ``filter`` as :func:`ops_ran` counts it), every base oracle, the
    solo attention and every one of ``oracles``."""
    stats, settings = run_family(family, layout, ci_examples=ci_examples)
    expected_ops = (
        set(common_ops)
        | OPS_CHECKED
        | ({"trim_rows"} if family.layout(layout).trim_rows else set())
    )
    stats.require(
        settings.max_examples // 2,
        ops=expected_ops,
        ran=ops_ran(stats.ops),
        oracles=(*BASE_CHECKS, "solo attention", *oracles),
    )
    return stats


def assert_compared(stats: Stats, expected: Iterable[str]) -> None:
    """Every quantity of ``expected`` was compared at least once."""
    compared = {quantity for quantity, _ in stats.errors}
    missing = set(expected) - compared
    assert not missing, f"quantities never compared: {missing}"


def assert_skips_documented(stats: Stats) -> None:
    """Every parity skip names a divergence ``kvrows.conformance.parity`` documents."""
    unknown = set(stats.skips) - set(DIVERGENCES)
    assert not unknown, f"parity skips without a documented reason: {unknown}"


def run_runner(
    family: str, layouts: Sequence[str], max_examples: int, steps: int
) -> tuple[list[MachineResult], str]:
    """``kvrows conform --family <family>`` in small: the runner runs every layout of the
    family, in order, and each passes; the results and the CI report."""
    results = run_machines(
        [family], profile="ci", max_examples=max_examples, stateful_step_count=steps
    )
    assert [(r.family, r.layout) for r in results] == [(family, name) for name in layouts]
    assert all(r.passed for r in results), [r.failure for r in results]
    return results, format_report(results, "ci")


def delayed_ops(codec: str) -> set[str]:
    """Operations every machine of a delayed family (rows of legos converting to
    ``codec`` at their own start) must have exercised: its rules' and ``OpsChecks``'."""
    return {
        *(f"new_request:{kind}" for kind in ("lego", "plain", codec)),
        *("lego_append", "merge", "join", "decode_step", "multi_step", "prefill_crossing"),
        *("extract", "publish", "trim_rows", "invalid", "filter:reorder"),
        *(f"round:{kind}" for kind in ("all", "none", "equal", "unequal")),
        *OPS_CHECKED,
    }


#: The quantities every machine of a delayed family compares.
DELAYED_QUANTITIES = frozenset(
    {"kv.fetched", "kv.solo", "attention", "attention.solo", "attention.solo.plain"}
)


def teeth_settings(examples: int | None) -> hypothesis.settings:
    """The teeth profile, with ``examples`` examples where given."""
    return profile_settings("teeth", **({} if examples is None else {"max_examples": examples}))


def run_teeth(
    layout: str,
    mutant: type | None,
    examples: int | None = None,
    family_name: str = "plain",
    *,
    optimized: Impl | None = None,
    name: str | None = None,
) -> Stats:
    """Run ``family_name``'s machine on ``layout`` under the teeth profile, the optimized
    class replaced by ``mutant`` (or the implementation by ``optimized``, named ``name``)."""
    optimized = optimized_impl() if optimized is None else optimized
    name = name or f"Teeth{family_name.title()}{layout}Unmutated"
    if mutant is not None:
        optimized = optimized.with_classes({layout: mutant})
        name = f"Teeth{mutant.__name__}"
    return run_family(
        FAMILIES[family_name],
        layout,
        teeth_settings(examples),
        optimized=optimized,
        name=name,
        profile="teeth",
    )[0]


def caught(
    layout: str, mutant: type, examples: int | None = None, family_name: str = "plain"
) -> str:
    """Run the machine with ``mutant``: an oracle must catch it (not a crash inside the
    mutant), and Hypothesis say how; the failure's message."""
    with pytest.raises(AssertionError) as failure:
        run_teeth(layout, mutant, examples, family_name)
    assert "Failing test case" in "\n".join(getattr(failure.value, "__notes__", []))
    return str(failure.value)
