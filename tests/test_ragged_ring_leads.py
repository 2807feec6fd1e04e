"""Ragged ring rows drop their oldest tokens in place (issue 28, ``spec/RaggedRotatingRows.md``
§1): a verify round or a decode step on full rings moves no column, and the rows are
compacted to column 0 (one gather of the layout) only once a block would end past
``max_size + slack`` columns, ``slack = min(256, max_size)``."""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from dispatch_helpers import CallLog

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.conformance.arrays import as_numpy
from kvrows.optimized.geometries.ring import RaggedRing

pytestmark = pytest.mark.usefixtures("cpu_stream")

WINDOW = 64
SLACK = 64  # min(256, WINDOW)
DRAFTS = 3  # a verify block of DRAFTS + 1 tokens


def _native(package: ModuleType, array: np.ndarray) -> Any:
    if package is opt:
        import mlx.core as mx

        return mx.array(array)
    return array


def _tags(tags: list[list[float]]) -> np.ndarray:
    """A block whose token ``i`` of row ``b`` has key ``tags[b][i]`` on every channel."""
    block = np.array(tags, np.float32)[:, None, :, None]
    return np.broadcast_to(block, (*block.shape[:3], 8)).copy()


def _layout(package: ModuleType, lengths: list[int], keep: int = 0) -> tuple[Any, list[list[int]]]:
    """A ring verify layout of rows fed ``lengths`` tokens, and each row's history (the tag
    of row ``b``'s position ``p`` is ``1000 * b + p``)."""
    history = [[1000 * b + p for p in range(n)] for b, n in enumerate(lengths)]
    serial = []
    for tags in history:
        ring = package.RotatingKVCache(WINDOW, keep=keep)
        x = _native(package, _tags([[float(t) for t in tags]]))
        ring.update_and_fetch(x, x)
        serial.append(ring)
    layout = package.SpeculativeRotatingKVCache(WINDOW, keep=keep)
    layout.merge_rows(serial)
    return layout, history


def _windows(layout: Any) -> list[list[int]]:
    held = [layout.row_window(b) for b in range(layout.batch_size)]
    return [[int(v) for v in as_numpy(h[0][0])[0, 0, :, 0]] for h in held]


def _round(layout: Any, history: list[list[int]], keeps: list[int], package: ModuleType) -> None:
    """One verify round of ``DRAFTS + 1`` tokens; row ``b`` keeps ``keeps[b]`` of them (the
    rejected ones carry negative tags)."""
    layout.spec_round_begin()
    block = [
        [float(1000 * b + len(h) + i) if i < keep else -1.0 - i for i in range(DRAFTS + 1)]
        for b, (h, keep) in enumerate(zip(history, keeps, strict=True))
    ]
    x = _native(package, _tags(block))
    layout.update_and_fetch(x, x)
    layout.spec_round_rollback(keeps)
    for h, keep in zip(history, keeps, strict=True):
        h.extend(range(h[-1] + 1, h[-1] + 1 + keep))


def test_verify_rounds_on_full_rings_move_no_column_until_the_slack_is_spent(
    call_log: CallLog,
) -> None:
    call_log.watch(RaggedRing, "_slide")
    layout, history = _layout(opt, [70, 90, 100])
    rng = np.random.default_rng(28)
    slides = []
    for _ in range(100):
        before = len(call_log.names)
        _round(layout, history, [int(k) for k in rng.integers(1, DRAFTS + 2, 3)], opt)
        slides.append(len(call_log.names) - before)
        assert _windows(layout) == [h[-WINDOW:] for h in history]
    # A row's lead grows by what it drops, at most DRAFTS + 1 a round, and the rows are
    # compacted when a lead passes SLACK - DRAFTS - 1 (a block ends at lead + WINDOW - 1 +
    # DRAFTS + 1): no slide in the first rounds, then at most one every 15 rounds (a
    # whole-layout slide every round before issue 28's layout).
    quiet = (SLACK - DRAFTS - 1) // (DRAFTS + 1)
    assert slides[:quiet] == [0] * quiet
    assert set(slides) <= {0, 1}
    compacted = [i for i, s in enumerate(slides) if s]
    assert compacted, "every row keeps a token a round: some lead passes the slack"
    assert all(b - a >= quiet for a, b in itertools.pairwise(compacted))


def test_decode_steps_on_full_rings_move_no_column(call_log: CallLog) -> None:
    call_log.watch(RaggedRing, "_slide")
    layout, history = _layout(opt, [64, 80])
    for step in range(SLACK + 1):
        x = _native(opt, _tags([[float(h[-1] + 1)] for h in history]))
        layout.update_and_fetch(x, x)
        for h in history:
            h.append(h[-1] + 1)
        # One token a step: the lead is SLACK after SLACK steps (the rows then end at
        # WINDOW + SLACK); the next step's would pass it, so the rows move then.
        assert call_log.names == ([] if step < SLACK else ["_slide"]), step
    assert _windows(layout) == [h[-WINDOW:] for h in history]


def test_rings_with_sinks_still_slide_every_drop(call_log: CallLog) -> None:
    """Sinks keep the old layout (spec: a row's sinks at columns ``[0, keep)``)."""
    call_log.watch(RaggedRing, "_slide")
    layout, history = _layout(opt, [70, 90], keep=2)
    _round(layout, history, [2, 4], opt)
    _round(layout, history, [1, 3], opt)
    assert call_log.names == ["_slide", "_slide"]
    assert _windows(layout) == [h[:2] + h[-WINDOW + 2 :] for h in history]


@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
def test_a_lead_is_in_the_read_and_the_mask_alike(package: ModuleType) -> None:
    """Both implementations place the rows at the same columns (conformance compares
    masks and visible columns exactly): row 1 dropped a token in place, row 0 none."""
    layout, history = _layout(package, [3, WINDOW])
    _round(layout, history, [4, 4], package)
    mask = as_numpy(layout.make_mask(1, return_array=True))
    x = _native(package, _tags([[float(h[-1] + 1)] for h in history]))
    keys, _ = layout.update_and_fetch(x, x)
    for h in history:
        h.append(h[-1] + 1)
    # Row 1 stood at lead 1 after its round (it dropped 1, then kept 4 of 4) and drops 4
    # now: its tokens at [5, 5 + WINDOW); row 0 holds 8 tokens from column 0.
    assert mask.shape == (2, 1, 1, 5 + WINDOW)
    seen = [
        [int(v) for v, m in zip(as_numpy(keys)[b, 0, :, 0], mask[b, 0, 0], strict=True) if m]
        for b in range(2)
    ]
    assert seen == [history[0], history[1][-WINDOW:]]
    assert [int(i) for i in np.flatnonzero(mask[1, 0, 0])] == list(range(5, 5 + WINDOW))
