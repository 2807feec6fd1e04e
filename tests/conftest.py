"""Shared pytest configuration, and the fixtures many test files use."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from hypothesis import settings

# Under ``--import-mode=importlib`` pytest puts no test folder on ``sys.path``: this one
# goes there so that test files can import the helper modules beside them
# (``conformance_helpers``, ``array_helpers``).
sys.path.insert(0, str(Path(__file__).resolve().parent))

# Timings never decide a test (a loaded CI machine runs an example 10x slower than a quiet
# one): every Hypothesis test without a profile of its own runs without a deadline.
settings.register_profile("kvrows-tests", deadline=None)
settings.load_profile("kvrows-tests")

#: Test files whose tests take seconds to tens of seconds each (the two-process launches,
#: the conformance machines, the teeth runs, the pool machines and the draw-order check).
_LONG = (
    "test_tensor_parallel",
    "test_serve_tensor_parallel",
    "test_bench_distributed",
    "test_disaggregated",
    "test_transfer",
    "test_conformance",
    "test_teeth",
    "test_paged_pool",
    "test_profiles",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long tests first: the two workers then share the long ones and finish together,
    instead of one worker running a long machine alone at the end (stable otherwise)."""
    items.sort(key=lambda item: not any(name in item.nodeid for name in _LONG))


@pytest.fixture
def cpu_stream() -> Iterator[None]:
    """Run the test on MLX's CPU stream, whatever the default device: the specs promise
    byte-for-byte agreement with the NumPy reference on the CPU backend. A test file opts
    in with ``pytestmark = pytest.mark.usefixtures("cpu_stream")``."""
    with mx.stream(mx.cpu):
        yield


@pytest.fixture(scope="module")
def llama() -> Any:
    """The app's tiny llama (full attention), built once per test file."""
    from kvrows.app.models import tiny_model  # only the files that ask load the app

    return tiny_model("llama")


@pytest.fixture(scope="module")
def gemma3() -> Any:
    """The app's tiny gemma3 (sliding-window rings between full-attention layers)."""
    from kvrows.app.models import tiny_model

    return tiny_model("gemma3")


@pytest.fixture(scope="module")
def models(llama: Any, gemma3: Any) -> dict[str, Any]:
    """The tiny llama and gemma3 by name (a file with other models defines its own)."""
    return {"llama": llama, "gemma3": gemma3}


@pytest.fixture
def call_log(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A ``dispatch_helpers.CallLog`` for the test: which fast path ran (a dispatch test)."""
    from dispatch_helpers import CallLog

    return CallLog(monkeypatch)
