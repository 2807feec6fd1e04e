"""``kvrows bench --family turbo`` runs end to end at tiny sizes, its figures agree with
independent oracles (published Lloyd-Max distortions, byte formulas written out here), and
its checks catch a wrong computation."""

from __future__ import annotations

import io
import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from bench_helpers import rows, tables

import kvrows.optimized.turbo_codec as optimized_turbo
from kvrows.app import cli
from kvrows.app.bench import FAMILIES, turbo
from kvrows.app.bench.plain import Shape
from kvrows.app.bench.runner import BenchCheckError, run_family
from kvrows.app.models import tiny_model
from kvrows.schemes import KvStorageScheme

TINY = turbo.TurboShapes(
    vectors=256,
    tokens=40,
    chunk=16,
    decode_steps=3,
    models=("llama",),
    decode=Shape(3, 40, heads=2, query_heads=4, dtype="bfloat16"),
)
#: Max's (1960) Lloyd-Max distortion of a unit normal, b = 2, 3, 4: an independent oracle
#: of the codec's MSE on unit vectors (a rotated coordinate is close to N(0, 1/d)).
MAX_1960 = {2: 0.1175, 3: 0.03454, 4: 0.009497}


def _expected_bytes(name: str) -> int:
    """K+V bytes of one token and KV head at D = 128, written out from the formats."""
    d = 128
    if name == "plain":
        return 2 * d * 2
    if name.startswith("affine"):
        bits, group = (int(x) for x in name[len("affine") :].split(":"))
        return 2 * (d * bits // 8 + 2 * 2 * d // group)  # codes + bf16 scales and biases
    microscaled = {"mxfp8": (8, 32), "mxfp4": (4, 32), "nvfp4": (4, 16)}
    if name in microscaled:
        bits, group = microscaled[name]
        return 2 * (d * bits // 8 + d // group)  # codes + one uint8 scale per group
    k_bits, v_bits = (int(x) for x in name[len("turbo-k") :].split("v"))
    keys = d * k_bits // 8 + 2 * 2 * d // 32  # codes + float16 scale and zero per 32
    values = d * v_bits // 8 + 2 * d // 32  # codes + float16 scale per 32
    return keys + values


@pytest.fixture(scope="module")
def report() -> str:
    out = io.StringIO()
    family = turbo.family(
        shapes=TINY,
        quality_schemes=("plain", "affine8", "turbo", "turbo:k4v2"),
        decode_storages=("plain", "affine4", "turbo"),
    )
    assert run_family(family, quick=True, repeats=1, out=out) == 0
    return out.getvalue()


def test_every_table_is_printed_and_checked(report: str) -> None:
    assert "WRONG RESULT" not in report
    values, sizes, quality, decode = (rows(t) for t in tables(report))
    assert [r["v_bits"] for r in values] == ["1", "2", "3", "4", "5", "8"]
    assert values[0]["MSE"] == "not a width"  # 1 bit is not a codec width
    assert [r["scheme"] for r in sizes] == [
        KvStorageScheme.parse(n).name for n in turbo.BYTES_SCHEMES
    ]
    assert all(r["checked"] == "yes" for r in sizes)
    assert [r["scheme"] for r in quality] == [
        "plain",
        "affine8:64",
        "turbo-k8v3",
        "turbo-k4v2",
        "(plain stats)",
    ]
    assert all(r["checked"] in ("ok", "mlx-lm") for r in quality)
    assert [r["storage"] for r in decode] == ["plain", "affine4:64", "turbo-k8v3"]
    assert decode[2]["eager ms"] != "-" and float(decode[2]["attend ms"]) > 0


def test_value_distortion_lands_on_the_gaussian_lloyd_max_figures(report: str) -> None:
    values = {r["v_bits"]: r for r in rows(tables(report)[0])}
    for bits, expected in MAX_1960.items():
        measured = float(values[str(bits)]["MSE"])
        assert measured == pytest.approx(expected, rel=0.15)
        assert float(values[str(bits)]["paper"]) == turbo.PAPER_DISTORTION[bits]
        # The stored table's closed form is Max's figure.
        assert float(values[str(bits)]["Gaussian LM"]) == pytest.approx(expected, abs=2e-4)
    assert float(values["5"]["MSE"]) < float(values["4"]["MSE"]) < float(values["3"]["MSE"])


def test_bytes_per_token_follow_the_formats(report: str) -> None:
    for row in rows(tables(report)[1]):
        total = _expected_bytes(row["scheme"])
        assert int(row["K+V B"]) == total, row
        assert int(row["K B"]) + int(row["V B"]) == total
    assert turbo.scheme_bytes("turbo") == (144, 56)  # k8v3: 200 bytes vs 512 in bf16


def test_quality_orders_the_schemes_by_their_loss(report: str) -> None:
    quality = {r["scheme"]: r for r in rows(tables(report)[2])}
    assert float(quality["plain"]["KL mean"]) == 0.0
    assert float(quality["plain"]["attn rel err"]) == 0.0
    errors = [float(quality[n]["attn rel err"]) for n in ("affine8:64", "turbo-k8v3", "turbo-k4v2")]
    assert 0 < errors[0] < errors[1] < errors[2]  # 8-bit values, then 3, then 2


def test_helpers_against_closed_forms() -> None:
    # 1-bit Gaussian Lloyd-Max: E (Z - sign(Z) sqrt(2/pi))^2 = 1 - 2/pi.
    assert turbo.codebook_distortion(1) == pytest.approx(1 - 2 / math.pi, abs=1e-12)
    p = np.array([[0.0, math.log(3.0)]])  # probabilities 1/4, 3/4
    q = np.array([[0.0, 0.0]])
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert turbo.kl_divergence(p, q)[0] == pytest.approx(expected, rel=1e-12)
    assert turbo.kl_divergence(p, p + 5.0)[0] == pytest.approx(0.0, abs=1e-15)


def test_registered_as_a_bench_family() -> None:
    assert FAMILIES["turbo"] == "turbo"
    assert "turbo" in cli.BENCH_FAMILIES


# -- the checks can fail ----------------------------------------------------------------------


def test_values_check_refuses_codes_that_are_not_the_references() -> None:
    bench = turbo.ValueBench(32)
    workload = bench.workload(3)
    packed, scales, decoded = workload.run(workload.setup())
    workload.check((packed, scales, decoded))
    assert bench.results[3].mse > 0
    with pytest.raises(BenchCheckError, match="codes"):
        workload.check((packed ^ 1, scales, decoded))


def test_decode_check_refuses_an_output_left_rotated() -> None:
    bench = turbo.DecodeBench(TINY.decode)
    workload = bench.workload("turbo", "attend")
    layout, mask = workload.setup()
    workload.check(workload.run((layout, mask)))
    (codes, k_scales, k_zeros), (packed, v_scales) = layout.fetch()
    spec = layout.codec.spec
    keys = optimized_turbo.decode_keys(codes, k_scales, k_zeros, spec.k_bits)
    rotated = optimized_turbo.rotated_values(packed, v_scales, spec.v_bits)
    queries = bench.data.queries
    skipped = mx.fast.scaled_dot_product_attention(
        queries, keys.astype(queries.dtype), rotated.astype(queries.dtype),
        scale=bench.data.scale, mask=mask,
    )  # fmt: skip
    with pytest.raises(BenchCheckError, match="off by"):
        workload.check(skipped)


def test_quality_check_refuses_a_deferred_path_that_skips_the_unrotation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model("llama")
    prompt = turbo._prompt(24, 256)
    record = turbo.plain_record(model, prompt, 8, 2)
    turbo.check_quality(turbo.quality_run(model, record, "turbo", prompt, 8, 2))

    def identity(x: Any) -> Any:
        return x

    monkeypatch.setattr(optimized_turbo, "unrotate", identity)
    broken = turbo.quality_run(model, record, "turbo", prompt, 8, 2)
    with pytest.raises(BenchCheckError, match="eager"):
        turbo.check_quality(broken)
