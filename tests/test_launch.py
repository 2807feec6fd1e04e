"""``kvrows launch``'s status: the first rank's non-zero status ``mlx.launch`` logged (a
killed rank: ``LOST_RANK_STATUS``), 0 when none did. The launches themselves run in
``tests/test_serve_tensor_parallel.py`` (a rank killed or stopped: status 3; a drain: 0)."""

from __future__ import annotations

import pytest

from kvrows.app.cli import main
from kvrows.app.distributed import LOST_RANK_STATUS
from kvrows.app.launch import launcher_status

WARN = "\x1b[33m[WARN] Node with rank {} {} \x1b[0m\n"


@pytest.mark.parametrize(
    ("lines", "status"),
    [
        ([], 0),
        (["rank 0 up\n", "rank 1 up\n"], 0),
        ([WARN.format(1, "exited with code 3"), WARN.format(0, "exited with code -15")], 3),
        ([WARN.format(0, "exited with code 1")], 1),
        ([WARN.format(1, "exited with code -9")], LOST_RANK_STATUS),
        ([WARN.format(1, "was killed")], LOST_RANK_STATUS),
        (["some output\n", WARN.format(0, "exited with code 0")], 0),
    ],
)
def test_the_status_is_the_first_rank_that_did_not_return_0(lines: list[str], status: int) -> None:
    assert launcher_status(lines) == status


def test_launch_without_arguments_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch"]) == 2
    assert "needs mlx.launch's arguments" in capsys.readouterr().err
