"""``kvrows example`` runs, narrates every row operation, and fails when a row is wrong."""

from __future__ import annotations

from typing import Any

import pytest

import kvrows.optimized as optimized
from kvrows.app.cli import main
from kvrows.app.example import run_example


def test_example_passes_and_narrates_each_operation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["example"]) == 0
    out = capsys.readouterr().out
    for operation in (
        "prefill",
        "merge_rows",
        "decode step",
        "joins",
        "publish_row",
        "filter_rows",
        "extract_row",
    ):
        assert operation in out, operation
    # Prompts of 5, 12 and 3 tokens right-align to W = 12: pads 12 - 5, 0, 12 - 3.
    assert "row_offsets=(5, 12, 3) left_pad=(7, 0, 9) width=12" in out
    # Three decode steps later (8, 15, 6), width 15; D (20 tokens) joins, W = 20, pads grow by 5.
    assert "row_offsets=(8, 15, 6, 20) left_pad=(12, 5, 14, 0) width=20" in out
    # Two steps later D (22 tokens) leaves; the survivors' pads (12, 5, 14) share 5 columns.
    assert "row_offsets=(10, 17, 8) left_pad=(7, 0, 9) width=17" in out
    assert "mask bool (4, 1, 1, 21)" in out  # 4 rows, 1 query, width 20 + 1 columns
    assert out.rstrip().endswith("PASS")


def test_example_reports_a_wrong_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layout whose extracted rows lose their newest token must make the example fail."""
    extract = optimized.PaddedKVRows.extract_row

    def lossy(self: Any, row: int) -> Any:
        cache = extract(self, row)
        cache.trim(1)
        return cache

    monkeypatch.setattr(optimized.PaddedKVRows, "extract_row", lossy)
    assert run_example() == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and out.rstrip().endswith("FAIL")
