"""Benchmark configuration, and the tiny model the engine benchmarks run."""

import sys
from pathlib import Path
from typing import Any

import pytest

# Under ``--import-mode=importlib`` pytest puts no test folder on ``sys.path``: this one
# goes there so that the benchmark files can import ``bench_common`` beside them.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def model() -> Any:
    """The app's tiny llama."""
    from kvrows.app.models import tiny_model

    return tiny_model("llama")
