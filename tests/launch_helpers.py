"""Running a script on two processes under ``mlx.launch`` (the ring backend on 127.0.0.1),
bounded by a timeout: on expiry the launch's whole process group is killed and the test
fails with the output's tail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvrows.app.distributed import bounded_launch

#: The tests folder: a worker script imports its siblings from it.
TESTS = Path(__file__).parent


def launch(script: Path, *, timeout: float, ranks: int = 2) -> tuple[int, str]:
    """Run ``script`` on ``ranks`` processes; ``(status, output)`` of the launch (the
    launcher exits 0 whatever its ranks return: a worker prints what it checked)."""
    try:
        return bounded_launch(
            [sys.executable, str(script)], timeout=timeout, ranks=ranks,
            env={"PYTHONPATH": str(TESTS)},
        )  # fmt: skip
    except TimeoutError as error:
        pytest.fail(str(error))
