"""What the benchmark files share: the shape choice, the rounds, one timed and checked
call, and one shape's data at a time.

Each test is one ``benchmark.pedantic`` call whose setup (fresh live batches for the
in-place operations) is not timed; the benchmark group is the operation and shape, so
pytest-benchmark's table puts the implementations side by side. Timings never decide
pass or fail: a test checks only that the result is right. The default run
(``--benchmark-disable`` in ``pyproject.toml``: each body runs once, untimed, on small CI
shapes) is a smoke run of seconds; ``KVROWS_BENCH_FULL=1`` selects the realistic shapes of
each family's issue::

    KVROWS_BENCH_FULL=1 .venv/bin/pytest benchmarks --benchmark-enable

``kvrows bench --family <family>`` prints the same comparisons as tables with ratios and
GB/s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from kvrows.app.bench.runner import Workload

#: ``KVROWS_BENCH_FULL=1``: the realistic shapes of the issues; else small CI shapes.
FULL = os.environ.get("KVROWS_BENCH_FULL", "") not in ("", "0")
ROUNDS, WARMUPS = (7, 2) if FULL else (3, 1)

T = TypeVar("T")
_latest: dict[Hashable, Any] = {}


def latest(key: Hashable, make: Callable[[], T]) -> T:
    """``make()`` for ``key``, built once; building another key's drops the previous one's
    (memory: the tests run shape-major, so one shape's data serves all its tests)."""
    if key not in _latest:
        _latest.clear()
        _latest[key] = make()
    result: T = _latest[key]
    return result


def measure(benchmark: Any, workload: Workload, group: str) -> None:
    """One ``benchmark.pedantic`` call of ``workload`` (its setup untimed), then its check:
    timings never decide pass or fail."""
    benchmark.group = group
    benchmark.extra_info["bytes_moved"] = workload.bytes_moved
    result = benchmark.pedantic(
        workload.run,
        setup=lambda: ((workload.setup(),), {}),
        rounds=ROUNDS,
        warmup_rounds=WARMUPS,
        iterations=1,
    )
    workload.check(result)
