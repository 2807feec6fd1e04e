"""The conformance machines under the selected profile (``KVROWS_PROFILE``, default ``ci``).

Each (family, layout) machine drives the reference and the optimized
implementation through the same random operation sequences and checks the
three oracles (reference vs optimized, solo replay, mlx-lm parity) after every
step. The tests then check that nothing was skipped silently: every operation
ran, every oracle ran, and every parity skip names a documented divergence.
The last tests pin the divergences themselves: each shows, on mlx-lm as
installed, the behaviour the parity oracle skips (if mlx-lm fixes one, its test
fails and the skip should go).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conformance_helpers import (
    BASE_OPS,
    BASE_QUANTITIES,
    MLX_LM_BATCH_CHECKS,
    assert_compared,
    assert_skips_documented,
    run_base_family,
    run_family,
    run_runner,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_lm_cache

from kvrows.codecs import Affine
from kvrows.conformance.arrays import expand_mask, from_mlx, to_mlx
from kvrows.conformance.families import BUDGETS, FAMILIES, derive
from kvrows.conformance.hooks import CODEC_HOOKS
from kvrows.conformance.machines import UNEVEN_TRIM, ConformanceMachine, machine_class
from kvrows.conformance.parity import DIVERGENCES
from kvrows.conformance.profiles import PROFILES, active_profile, profile_settings
from kvrows.conformance.runner import (
    MachineResult,
    family_settings,
    run_conformance,
    run_machines,
)
from kvrows.conformance.tolerances import EXACT, TOLERANCES, Tolerance, compare, tolerance

#: mlx-lm is untyped; reach its classes through ``Any``.
LM: Any = mlx_lm_cache

pytestmark = pytest.mark.usefixtures("cpu_stream")

SPEC = Path(__file__).resolve().parents[1] / "spec" / "tolerances.md"

#: Operations every plain and affine machine must have exercised.
COMMON_OPS = BASE_OPS | {"trim"}

#: The affine codec's draw: every supported ``(bits, group_size)`` and the head dims.
AFFINE = CODEC_HOOKS[Affine].draw
CODECS = AFFINE.params


#: Layouts whose CI examples (derandomized, from the layout's own seed) reach every
#: operation, oracle and state well inside the family's share: the serial decode layout by
#: its 8th example, the prefill layout by its 5th, the decode layout by its 12th (a
#: mirrored layout's filters keep rows first, ``strategies.keep_lists``: its first mlx-lm
#: filter came at the 53rd of 59), so they run fewer (CI wall time).
CI_EXAMPLES = {"BatchedKVCache": 24, "PaddedQuantKVRows": 14, "PaddedKVRows": 20}


@pytest.mark.parametrize("layout", [spec.name for spec in FAMILIES["plain"].layouts])
def test_plain_family(layout: str) -> None:
    spec = FAMILIES["plain"].layout(layout)
    stats = run_base_family(
        FAMILIES["plain"], layout, COMMON_OPS, ci_examples=CI_EXAMPLES.get(layout)
    )
    assert_skips_documented(stats)
    if spec.peer:
        stats.require(0, oracles=(*MLX_LM_BATCH_CHECKS, "mlx-lm trim", "mlx-lm serial"))
        # Skips are the exception: most operations on a mirrored layout were compared.
        assert sum(stats.skips.values()) < stats.checks["mlx-lm layout"]
    else:
        assert not stats.skips, "a layout without an mlx-lm peer cannot skip parity"
    mirrored = {"kv.mlx_lm", "attention.mlx_lm"} if spec.peer else set()
    assert_compared(stats, BASE_QUANTITIES | mirrored)
    if spec.trim_rows:  # equal rows trimmed unequally, then a step (issue 24)
        stats.require(0, states=(UNEVEN_TRIM,))
    # Rows of keys only (values of width 0, minimax_m3's indexer cache) ran too.
    assert stats.variants["keys only"] > 0, dict(stats.variants)


@pytest.mark.parametrize("layout", [spec.name for spec in FAMILIES["affine"].layouts])
def test_affine_family(layout: str) -> None:
    stats = run_base_family(
        FAMILIES["affine"], layout, COMMON_OPS, ["mlx-lm serial"], CI_EXAMPLES.get(layout)
    )
    # mlx-lm has no quantized batch: parity is serial, and only the affine skips occur
    # (where exactly: test_affine_parity_skips_are_exactly_where_mlx_lm_fails).
    assert not FAMILIES["affine"].layout(layout).peer
    assert set(stats.skips) <= {"A1", "A2"}, dict(stats.skips)
    assert sum(stats.skips.values()) < stats.checks["mlx-lm serial"]
    assert_compared(stats, BASE_QUANTITIES | {"kv.mlx_lm", "attention.mlx_lm"})
    # Every example ran at one supported codec (test_affine_codec_sweep runs all 18).
    names = {f"bits={bits} group={group}" for bits, group in CODECS}
    assert set(stats.variants) <= names, set(stats.variants) - names
    assert sum(stats.variants.values()) == stats.examples
    if FAMILIES["affine"].layout(layout).trim_rows:  # issue 24's uneven trim
        stats.require(0, states=(UNEVEN_TRIM,))


def test_affine_parity_skips_are_exactly_where_mlx_lm_fails() -> None:
    """A1 and A2 are taken exactly where mlx-lm's QuantizedKVCache / quantized attention
    raise, for every codec, head dims and GQA the affine machines draw."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from kvrows.conformance.strategies import Geometry

    for bits, group in CODECS:
        dims = [d for d in AFFINE.dims if d % group == 0]
        for key_dim in dims:
            for value_dim in dims:
                for per_head in (1, 2):
                    geo = Geometry("float32", 1, per_head, key_dim, value_dim, None, bits, group)
                    cache = LM.QuantizedKVCache(group_size=group, bits=bits)
                    keys = mx.ones((1, 1, 2, key_dim), dtype=mx.float32)
                    values = mx.ones((1, 1, 2, value_dim), dtype=mx.float32)
                    try:
                        held = cache.update_and_fetch(keys, values)
                        mx.eval(held)
                    except ValueError:
                        assert geo.mlx_lm_width_bug, geo
                        continue
                    assert not geo.mlx_lm_width_bug, geo
                    queries = mx.ones((1, per_head, 1, key_dim), dtype=mx.float32)
                    try:
                        out = quantized_scaled_dot_product_attention(
                            queries,
                            held[0],
                            held[1],
                            scale=1.0,
                            mask=None,
                            group_size=group,
                            bits=bits,
                        )
                        mx.eval(out)
                    except ValueError:
                        assert geo.mlx_lm_reshape_bug, geo
                        continue
                    assert not geo.mlx_lm_reshape_bug, geo


def _sweep_cases() -> list[Any]:
    layouts = [spec.name for spec in FAMILIES["affine"].layouts]
    return [
        pytest.param((bits, group), layouts[i % len(layouts)], id=f"bits{bits}-group{group}")
        for i, (bits, group) in enumerate(CODECS)
    ]


@pytest.mark.parametrize(("codec", "layout"), _sweep_cases())
def test_affine_codec_sweep(codec: tuple[int, int], layout: str) -> None:
    """Every supported (bits, group size) runs the machine: the per-example draw of
    ``test_affine_family`` reaches only part of the 18 codecs in the CI budget (Hypothesis
    mutates an example several times before drawing a new first choice), so each codec
    also gets a few examples of its own (on alternating layouts)."""
    profile = active_profile()
    settings = profile_settings(
        max_examples=max(3, profile.max_examples // 40),
        stateful_step_count=max(20, profile.steps // 2),
    )
    stats, _ = run_family(
        FAMILIES["affine"],
        layout,
        settings,
        codecs=(codec,),
        name=f"AffineSweep{layout}Bits{codec[0]}Group{codec[1]}",
    )
    assert stats.examples > 0
    assert dict(stats.variants) == {f"bits={codec[0]} group={codec[1]}": stats.examples}
    assert_compared(stats, {"kv.stored", "kv.solo", "attention"})


def test_runner_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    _, report = run_runner("plain", ["PaddedKVRows", "BatchedKVCache"], 3, 8)
    for word in ("family", "layout", "operations", "examples", "worst error/tol", "PASS"):
        assert word in report
    assert "max error seen vs tolerance" in report


def test_runner_runs_the_affine_family() -> None:
    """``kvrows conform --family affine``: the family's own machine factory and budget."""

    family = FAMILIES["affine"]
    ci_examples = PROFILES["ci"].max_examples
    assert family_settings(family, "ci").max_examples == round(ci_examples * family.examples)
    assert family_settings(family, "ci", max_examples=3).max_examples == 3
    results, report = run_runner("affine", ["PaddedQuantKVRows", "BatchedQuantizedKVCache"], 3, 8)
    assert all(sum(r.stats.variants.values()) == r.stats.examples for r in results)
    assert "examples per variant: bits=" in report


@pytest.mark.parametrize(
    "family",
    [
        "rotating",
        "speculative",
        "turbo",
        "delayed",
        "delayed-turbo",
        "recurrent",
        "mx",
        "delayed-mx",
    ],
)
def test_runner_runs_the_family(family: str) -> None:
    """``kvrows conform --family <family>`` in small: every layout runs, passes and is
    reported."""
    layouts = [spec.name for spec in FAMILIES[family].layouts]
    _, report = run_runner(family, layouts, 2, 6)
    assert family in report and all(layout in report for layout in layouts)


#: Every (family, layout) the machines drive: the CLI, the tests and their coverage
#: requirements name them, so deriving the families must keep them.
FAMILY_LAYOUTS = [
    ("plain", "PaddedKVRows"),
    ("plain", "BatchedKVCache"),
    ("affine", "PaddedQuantKVRows"),
    ("affine", "BatchedQuantizedKVCache"),
    ("rotating", "BatchedRotatingCache"),
    ("rotating", "RaggedRotatingRows"),
    ("rotating", "BatchedRotatingQuantCache"),
    ("rotating", "RotatingAffineLayout"),
    ("rotating", "BatchedRotatingMxCache"),
    ("chunked", "PaddedChunkedRows"),
    ("chunked", "BatchedChunkedKVCache"),
    ("chunked", "PaddedChunkedQuantRows"),
    ("chunked", "BatchedChunkedQuantizedKVCache"),
    ("chunked", "BatchedChunkedMxKVCache"),
    ("speculative", "BatchedKVCache"),
    ("speculative", "BatchedQuantizedKVCache"),
    ("speculative", "SpeculativeRotatingKVCache"),
    ("speculative", "SpeculativeRotatingAffineLayout"),
    ("speculative", "SpeculativeRotatingMxLayout"),
    ("speculative", "BatchedChunkedKVCache"),
    ("speculative", "BatchedChunkedQuantizedKVCache"),
    ("turbo", "BatchedTurboQuantKVCache"),
    ("delayed", "DelayedQuantizedKVCache"),
    ("delayed", "DelayedRotatingQuantizedKVCache"),
    ("delayed", "DelayedChunkedQuantizedKVCache"),
    ("latent", "MLACache"),
    ("latent", "EncodedLatentCache"),
    ("paged-latent", "PagedLatentCache"),
    ("recurrent", "BatchedSSMCache"),
    ("delayed-turbo", "DelayedTurboQuantKVCache"),
    ("mx", "BatchedMxKVCache"),
    ("delayed-mx", "DelayedMxKVCache"),
    ("delayed-mx", "DelayedRotatingMxKVCache"),
    ("delayed-mx", "DelayedChunkedMxKVCache"),
    ("paged", "PagedKvRows"),
    ("paged-affine", "PagedKvRows"),
    ("paged-rotating", "PagedRotatingRows"),
    ("paged-rotating-affine", "PagedRotatingRows"),
    ("paged-mx", "PagedKvRows"),
    ("paged-rotating-mx", "PagedRotatingRows"),
    ("paged-chunked", "PagedChunkedRows"),
    ("paged-chunked-affine", "PagedChunkedRows"),
    ("paged-chunked-mx", "PagedChunkedRows"),
]


def test_the_families_are_derived_from_the_composition_table() -> None:
    assert [(f.name, spec.name) for f in derive().values() for spec in f.layouts] == FAMILY_LAYOUTS
    assert list(FAMILIES) == list(BUDGETS)
    # Families that share a machine share its loader (one loader per machine class).
    assert FAMILIES["delayed"].machine is FAMILIES["delayed-turbo"].machine


@settings(max_examples=40, deadline=None, database=None)
@given(data=st.data())
def test_layouts_draw_what_their_rows_say(data: st.DataObject) -> None:
    """Each layout's geometry comes from its codec's and geometry's rows: affine codecs at
    the affine head dims (capped at 64 on rings, so only groups that fit), TurboQuant at
    its own, ring windows by role (verify layouts down to one token)."""
    for family, layout, role in (
        ("affine", "PaddedQuantKVRows", "decode"),
        ("rotating", "RotatingAffineLayout", "prefill"),
        ("speculative", "SpeculativeRotatingKVCache", "verify"),
        ("turbo", "BatchedTurboQuantKVCache", "decode"),
    ):
        draw = FAMILIES[family].layout(layout).draw
        g = data.draw(draw.geometries(draw.params, role), label=layout)
        if family == "turbo":
            assert (g.k_bits, g.v_bits) in draw.params and g.key_dim in draw.dims
            continue
        if family != "speculative":
            assert (g.bits, g.group_size) in CODECS
            assert g.key_dim % g.group_size == 0 and g.value_dim % g.group_size == 0
        ring = family != "affine"
        assert (g.max_size is not None) == ring
        assert max(g.dims) <= (64 if ring else 128)
        if role == "verify":
            assert g.max_size is not None and 1 <= g.max_size <= 32 and not g.affine


def test_machines_are_composed_from_the_hook_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """No machine is written per family: each is the rules its rows name, composed in one
    order (the geometry's round rules, the speculative modifier's, the geometry's, the
    codec's, the writer's) over the root machine; the same rules give the same machine."""
    from kvrows.conformance import families, hooks
    from kvrows.conformance.latent import LatentMachine
    from kvrows.conformance.machines import KvRules, OpsChecks, OpsRules, WriterRules
    from kvrows.conformance.paged import FrozenCollector
    from kvrows.conformance.recurrent import RecurrentMachine
    from kvrows.conformance.rules import (
        AffineRules,
        PagedRules,
        RingRoundRules,
        RingRules,
        RoundRules,
        TurboRules,
    )

    def rules(family: str, layout: str) -> list[type]:
        fam = FAMILIES[family]
        load = fam.layout(layout).machine or fam.machine
        machine = load() if load is not None else ConformanceMachine
        return [c for c in machine.__mro__ if c.__name__.endswith("Rules")]

    assert rules("plain", "PaddedKVRows") == [KvRules]  # the K/V writer's rules alone
    assert rules("affine", "PaddedQuantKVRows") == [AffineRules, KvRules]
    # the ring's own merges
    assert rules("rotating", "RotatingAffineLayout") == [RingRules, KvRules]
    assert rules("speculative", "BatchedKVCache") == [RoundRules, KvRules]
    assert rules("speculative", "BatchedQuantizedKVCache") == [RoundRules, AffineRules, KvRules]
    ring_rounds = [RingRoundRules, RoundRules, RingRules, KvRules]
    assert rules("speculative", "SpeculativeRotatingAffineLayout") == ring_rounds
    assert rules("turbo", "BatchedTurboQuantKVCache") == [RoundRules, TurboRules, KvRules]
    # the paged placement's rules bring the operation rules (issue 24: leases, save/load)
    paged = [RoundRules, PagedRules, OpsRules, AffineRules, KvRules]
    assert rules("paged-affine", "PagedKvRows") == paged
    # the latent and recurrent writers' rules and the delayed modifier's, over the writers'
    # skeleton over the root; the writers' then over the operation checks (issue 24),
    # whose hooks theirs override
    own = (
        ("latent", "MLACache", (LatentMachine, WriterRules, OpsChecks, ConformanceMachine)),
        ("recurrent", "BatchedSSMCache", (RecurrentMachine, WriterRules, OpsChecks)),
        # the latent pool's own machine (the placement's ``by_codec``): the operation
        # checks after the latent's rules, as the latent's
        (
            "paged-latent",
            "PagedLatentCache",
            (FrozenCollector, LatentMachine, WriterRules, OpsChecks),
        ),
        ("delayed", "DelayedQuantizedKVCache", (WriterRules, OpsChecks, ConformanceMachine)),
    )
    for family, layout, bases in own:
        fam = FAMILIES[family]
        load = fam.layout(layout).machine or fam.machine
        assert load is not None and load().__mro__[1 : 1 + len(bases)] == bases
    # The paged placement over the ring geometry: the placement's rules, then the ring's.
    paged_ring = [RingRoundRules, RoundRules, PagedRules, OpsRules, RingRules, KvRules]
    assert rules("paged-rotating-affine", "PagedRotatingRows") == paged_ring
    spec = FAMILIES["speculative"]
    assert spec.layout("SpeculativeRotatingKVCache").machine is (
        spec.layout("SpeculativeRotatingAffineLayout").machine
    )
    # A codec row with rules of its own and no rounds: its verify layouts get the rounds
    # composed onto its rules (here the affine rows' rules swapped for the turbo ones).
    rows = dict(hooks.CODEC_HOOKS)
    rows[Affine] = replace(rows[Affine], rules=hooks.load("rules", "TurboRules"))
    monkeypatch.setattr(families, "CODEC_HOOKS", rows)
    derived = families.derive()
    assert [(f.name, s.name) for f in derived.values() for s in f.layouts] == FAMILY_LAYOUTS
    load = derived["speculative"].layout("BatchedQuantizedKVCache").machine
    assert load is not None and load().__mro__[1:3] == (RoundRules, TurboRules)


def _drawn(results: list[MachineResult]) -> dict[tuple[str, str], tuple[object, ...]]:
    """What each machine of a run drew: operations, checks, variants and the largest error
    per compared quantity (sensitive to every value drawn)."""
    return {
        (r.family, r.layout): (
            r.stats.examples,
            sorted(r.stats.ops.items()),
            sorted(r.stats.checks.items()),
            sorted(r.stats.variants.items()),
            sorted((key, e.max_error, e.comparisons) for key, e in r.stats.errors.items()),
        )
        for r in results
    }


def test_ci_draws_do_not_depend_on_test_order() -> None:
    """Each CI machine draws from its own seed, ``zlib.crc32(f"{family}/{layout}")``: two
    families run in either order draw the same examples."""
    small: dict[str, Any] = {"max_examples": 3, "stateful_step_count": 8}
    forward = run_machines(["paged", "recurrent"], profile="ci", **small)
    backward = run_machines(["recurrent", "paged"], profile="ci", **small)
    assert all(r.passed for r in forward + backward), [r.failure for r in forward + backward]
    assert _drawn(forward) == _drawn(backward)
    family = FAMILIES["paged"]
    seeded = machine_class(family, "PagedKvRows", profile="ci")
    assert getattr(seeded, "_hypothesis_internal_use_seed", None) == zlib.crc32(
        b"paged/PagedKvRows"
    )
    for profile in ("deep", "teeth"):  # randomized, or the digest of the mutant's name
        unseeded = machine_class(family, "PagedKvRows", profile=profile)
        assert getattr(unseeded, "_hypothesis_internal_use_seed", None) is None


def test_runner_rejects_an_unknown_family(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_conformance(profile="ci", families=["no-such-family"]) == 2
    assert "unknown families" in capsys.readouterr().err


def test_profiles() -> None:
    ci, deep = active_profile("ci"), active_profile("deep")
    assert ci.derandomize and not deep.derandomize
    assert deep.max_examples > ci.max_examples and deep.steps > ci.steps
    assert profile_settings("ci").stateful_step_count == ci.steps
    with pytest.raises(ValueError):
        active_profile("nope")


# --------------------------------------------------------------- the helpers


def test_expand_mask_conventions() -> None:
    assert expand_mask(None, 2, 1, 3).all()
    causal = expand_mask("causal", 1, 2, 4)[0, 0].astype(int).tolist()
    assert causal == [[1, 1, 1, 0], [1, 1, 1, 1]]  # bottom-right aligned
    array = np.array([[[[False, True, True]]], [[[True, True, True]]]])
    assert np.array_equal(expand_mask(mx.array(array), 2, 1, 3), array)
    with pytest.raises(AssertionError):
        expand_mask(np.ones((1, 1, 1, 4), dtype=bool), 1, 1, 3)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_conversions_are_exact(dtype: str) -> None:
    from kvrows.conformance.arrays import NUMPY_DTYPES

    bits = np.random.default_rng(0).integers(0, 2**16, size=64, dtype=np.uint16)
    if dtype == "float32":
        values = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    else:
        values = bits.view(NUMPY_DTYPES[dtype])
        values = values[np.isfinite(values.astype(np.float32))]
    back = from_mlx(to_mlx(values))
    assert back.dtype == values.dtype and back.tobytes() == values.tobytes()


def test_compare_and_lookup() -> None:
    a = np.array([1.0, 2.0], dtype=np.float32)
    assert compare(a, a.copy(), EXACT) == (True, 0.0)
    assert not compare(a, a.astype(np.float16), EXACT)[0]  # dtype is part of "exact"
    assert not compare(np.array([0.0]), np.array([-0.0]), EXACT)[0]  # so are the bits
    ok, error = compare(a + 1e-3, a, Tolerance(atol=2e-3, rtol=0))
    assert ok and error == pytest.approx(1e-3, rel=1e-3)
    assert not compare(a + 1e-2, a, Tolerance(atol=2e-3, rtol=1e-3))[0]
    assert tolerance("plain", "kv.stored", "bfloat16").exact
    with pytest.raises(KeyError, match="no tolerance chosen"):
        tolerance("plain", "attention", "float64")
    # Every family x quantity has all three dtypes.
    keys = {(f, q) for f, q, _ in TOLERANCES}
    for family, quantity in keys:
        for dtype in ("float32", "float16", "bfloat16"):
            assert (family, quantity, dtype) in TOLERANCES


def test_spec_lists_every_tolerance_and_divergence() -> None:
    text = SPEC.read_text()
    for code in DIVERGENCES:
        assert re.search(rf"\b{code}\b", text), f"spec/tolerances.md does not list {code}"
    for (family, quantity, dtype), tol in TOLERANCES.items():
        row = f"| {family} | {quantity} |"
        assert row in text, f"spec/tolerances.md has no row for {family}/{quantity}"
        cell = "exact" if tol.exact else f"{tol.atol:g} / {tol.rtol:g}"
        line = next(line for line in text.splitlines() if line.startswith(row))
        assert cell in line, f"spec row for {family}/{quantity}/{dtype} should say {cell}: {line}"


# ------------------------------------------- mlx-lm divergences the oracle skips


def _lm(tokens: int, heads: int = 2, dim: int = 4, dtype: Any = mx.float16) -> Any:
    cache = LM.KVCache()
    if tokens:
        block = mx.ones((1, heads, tokens, dim), dtype=dtype)
        cache.update_and_fetch(block, block)
    return cache


def test_divergence_b2_filter_of_keyless_batch_moves_idx_below_zero() -> None:
    batch = LM.BatchKVCache([2, 3])
    batch.filter([1])
    assert batch._idx == -3


def test_divergence_b3_extract_from_keyless_batch_raises() -> None:
    batch = LM.BatchKVCache.merge([_lm(0), _lm(0)])
    with pytest.raises(TypeError):
        batch.extract(0)


def test_divergence_b4_trim_past_a_row_goes_negative() -> None:
    batch = LM.BatchKVCache.merge([_lm(3), _lm(7), _lm(1)])
    batch.trim(3)
    assert np.array(batch.offset).tolist() == [0, 4, -2]


def test_divergence_b5_merge_casts_dtypes() -> None:
    batch = LM.BatchKVCache.merge([_lm(2, dtype=mx.float16), _lm(3, dtype=mx.float32)])
    assert batch.keys.dtype == mx.float16


def test_divergence_n1_filter_keeping_nothing_raises() -> None:
    batch = LM.BatchKVCache.merge([_lm(3), _lm(5)])
    with pytest.raises(ValueError):
        batch.filter([])


def test_divergence_n2_merge_broadcasts_head_counts() -> None:
    batch = LM.BatchKVCache.merge([_lm(2, heads=2), _lm(3, heads=1)])
    assert batch.keys.shape == (2, 2, 3, 4)


# ---------------------------------- mlx-lm divergences the affine family skips


def test_divergence_a1_quantized_cache_packed_width() -> None:
    """mlx-lm allocates D // (32 // bits) words: 21 for D = 128 at 5 bits, where
    mx.quantize packs 20, so its first update cannot write the codes."""
    cache = LM.QuantizedKVCache(group_size=32, bits=5)
    block = mx.ones((1, 1, 2, 128), dtype=mx.float16)
    with pytest.raises(ValueError, match="broadcast"):
        cache.update_and_fetch(block, block)
    assert mx.quantize(block, group_size=32, bits=5)[0].shape[-1] == 20


def test_divergence_a2_quantized_attention_reshapes_to_the_key_dim() -> None:
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    cache = LM.QuantizedKVCache(group_size=32, bits=4)
    keys, values = cache.update_and_fetch(
        mx.ones((1, 1, 2, 64), dtype=mx.float32), mx.ones((1, 1, 2, 32), dtype=mx.float32)
    )
    queries = mx.ones((1, 2, 1, 64), dtype=mx.float32)  # two query heads per KV head
    with pytest.raises(ValueError, match="reshape"):
        quantized_scaled_dot_product_attention(
            queries, keys, values, scale=0.125, mask=None, group_size=32, bits=4
        )


# ------------------------------------------------------------- one message per error


def _empty_fetch(module: Any) -> None:
    module.RotatingKVCache(4).fetch()


def _empty_layout_fetch(module: Any) -> None:
    module.BatchedKVCache().fetch()


def _foreign_merge(module: Any) -> None:
    module.PaddedKVRows().merge_rows([object()])


def _other_window_merge(module: Any) -> None:
    module.RaggedRotatingRows(8).merge_rows([module.RotatingKVCache(4)])


def _self_merge(module: Any) -> None:
    layout = module.BatchedKVCache()
    layout.merge_rows([layout])


@pytest.mark.parametrize(
    "probe", [_empty_fetch, _empty_layout_fetch, _foreign_merge, _other_window_merge, _self_merge]
)
def test_both_implementations_say_the_same_thing(probe: Any) -> None:
    """The messages the machines compare, on the cases they reach least often."""
    import kvrows.optimized as O
    import kvrows.reference as R
    from kvrows.conformance.machines import MESSAGE_EXCEPTIONS
    from kvrows.errors import KvRowsError

    assert set(MESSAGE_EXCEPTIONS) == {"the other implementation's arrays"}
    raised = []
    for module in (R, O):
        with pytest.raises(KvRowsError) as caught:
            probe(module)
        raised.append((type(caught.value), str(caught.value)))
    assert raised[0] == raised[1]


def test_table_layouts_declare_their_storage_geometry() -> None:
    """A layout the row-layout table makes for a cache that knows its geometry declares it,
    in both implementations, so projected_bytes answers before any row joins."""
    import kvrows.optimized as O
    import kvrows.reference as R
    from kvrows import table

    for module, block in ((R, np.ones((1, 1, 1, 8), np.float32)), (O, mx.ones((1, 1, 1, 8)))):
        cache = module.KVCache()
        cache.update_and_fetch(block, block)
        for get in (
            table.owned_cache_layout,
            table.prefill_cache_layout,
            table.target_cache_layout,
        ):
            layout: Any = get(cache)
            assert layout.geometry == cache.geometry
            assert layout.projected_bytes(3) == 3 * 2 * 8 * 4
