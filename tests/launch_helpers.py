"""Running a script on two processes under ``mlx.launch`` (the ring backend on 127.0.0.1),
bounded by a timeout: on expiry the launch's whole process group is killed and the test
fails with the output's tail."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvrows.app.distributed import launch_command

#: The tests folder: a worker script imports its siblings from it.
TESTS = Path(__file__).parent


def launch(script: Path, *, timeout: float, ranks: int = 2) -> tuple[int, str]:
    """Run ``script`` on ``ranks`` processes; ``(status, output)`` of the launch (the
    launcher exits 0 whatever its ranks return: a worker prints what it checked)."""
    command = [*launch_command(ranks), sys.executable, str(script)]
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env=env,
    )  # fmt: skip
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        pytest.fail(f"the launch did not end within {timeout} s:\n{out[-2000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, out
