"""The engine bench's serving trace (``kvrows bench --family engine``): it runs end to end
on a tiny trace, compares the plain engine's tokens with mlx-lm's, prints the ratios and a
latency histogram per system, and its checks and helpers can fail."""

from __future__ import annotations

import io

import pytest

from kvrows.app.bench import engine
from kvrows.app.bench.runner import BenchCheckError, Family, run_family
from kvrows.app.bench.serving import histogram, percentile, serving_trace


def _family(**options: object) -> Family:
    return engine.family(
        quick=True,
        max_batches=(1,),
        requests=2,
        serving_batches=(2,),
        serving_requests=3,
        serving_contexts=(24, 40),
        schemes=("plain", "affine8"),
        **options,  # type: ignore[arg-type]
    )


def test_serving_trace_shares_documents_and_arrives_in_order() -> None:
    trace = serving_trace(8, contexts=(30, 50), documents=2, outputs=(3, 5), seed=1)
    assert len(trace) == 8
    arrivals = [r.arrival for r in trace]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0
    # requests i and i + 2 read the same document: a shared prefix of 30+ tokens
    for a, b in zip(trace, trace[2:], strict=False):
        shared = next(i for i, (x, y) in enumerate(zip(a.prompt, b.prompt, strict=False)) if x != y)
        assert shared >= 30
    assert {r.max_tokens for r in trace} <= {3, 5}


def test_serving_table_prints_ratios_and_a_latency_histogram(tmp_path: object) -> None:
    out = io.StringIO()
    plot = f"{tmp_path}/latency.png"
    assert run_family(_family(plot=plot), quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    assert "WRONG RESULT" not in text
    table = text[text.index("serving trace (") :].splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[3:5]]
    assert [row[1] for row in rows] == ["plain", "affine8"]
    plain = rows[0]
    assert plain[-1] == "True"  # the plain engine's greedy tokens are mlx-lm's
    assert float(plain[5]) == pytest.approx(float(plain[3]) / float(plain[4]), rel=0.02)
    assert "per-request latency" in text and text.count(" s | ") >= 3 * 8
    assert "matplotlib is not installed" in text or "latency plot written" in text


def test_serving_check_refuses_different_plain_tokens() -> None:
    case = next(iter(_family().tables[1].cases))
    case.workloads["mlx-lm"].check({"s00": [1, 2]})
    case.workloads["affine8"].check({"s00": [1, 3]})  # quantized: not compared
    with pytest.raises(BenchCheckError, match="s00"):
        case.workloads["plain"].check({"s00": [1, 3]})


def test_histogram_and_percentiles() -> None:
    values = [0.1, 0.2, 0.2, 0.9]
    lines = histogram(values, bins=4, width=8).splitlines()
    assert len(lines) == 4
    assert [int(line.rsplit(" ", 1)[1]) for line in lines] == [3, 0, 0, 1]
    assert lines[0].count("#") == 8 and lines[3].count("#") == 3  # scaled to the fullest
    assert percentile(values, 50) == 0.2 and percentile(values, 99) == 0.9
    assert percentile([], 50) == 0.0
