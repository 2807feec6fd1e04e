"""The conformance machines' choice of attention path (host or MLX ops) lives inside each
attention call: after a family's run, and after an example that failed, the CPU's default,
the host path, is still what a caller gets."""

from __future__ import annotations

import pytest
from conformance_helpers import run_teeth

from kvrows.optimized.codecs.host_attention import takes_host_path
from kvrows.optimized.host import on_cpu


@pytest.mark.parametrize(
    ("family", "layout"),
    [("delayed-mx", "DelayedMxKVCache"), ("mx", "BatchedMxKVCache")],
)
def test_no_example_leaves_the_op_path_on(family: str, layout: str) -> None:
    assert on_cpu() and takes_host_path()
    run_teeth(layout, None, 6, family)
    assert takes_host_path()
