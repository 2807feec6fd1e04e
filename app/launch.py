"""``kvrows launch``: ``mlx.launch`` whose exit status says how its ranks ended.

``mlx.launch`` (0.32) exits 0 whatever its ranks return: it logs ``Node with rank R exited
with code N`` (or ``was killed``) and stops the others. A supervisor needs the status, so
this runs ``mlx.launch`` with the same arguments, passes its output through, and exits
with the first non-zero rank status it logged (``LOST_RANK_STATUS`` for a rank that was
killed), 0 when every rank returned 0. Every rank inherits ``KVROWS_STOP_LOG`` naming a
file: a rank that stops on a lost peer or a timeout appends its reason there (the launcher
may stop relaying its output once it stops the launch), and the reasons are printed at
the end (``spec/distributed.md`` §7). Ranks on other machines do not share the file: their
launcher lines still set the status."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import IO

from kvrows.app.distributed import LOST_RANK_STATUS, STOP_LOG_VARIABLE, mlx_launcher
from kvrows.errors import InvalidInputError

__all__ = ["launcher_status", "run_launch"]

#: What ``mlx.launch`` logs for a rank that did not return 0.
_RANK_ENDED = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")


def launcher_status(lines: Sequence[str]) -> int:
    """The status a launch ends with, from the launcher's log ``lines``: the first rank's
    non-zero code (a signal or a kill: ``LOST_RANK_STATUS``), else 0."""
    for line in lines:
        found = _RANK_ENDED.search(line)
        if found is None:
            continue
        code = found.group(2)
        if code is None or int(code) < 0:
            return LOST_RANK_STATUS
        if int(code) != 0:
            return int(code)
    return 0


def _relay(source: IO[str], sink: IO[str], seen: list[str]) -> None:
    for line in source:
        sink.write(line)
        sink.flush()
        seen.append(line)


def _print_help() -> None:
    """``kvrows launch --help``: what it adds, then ``mlx.launch``'s own options; exits 0
    (as argparse's help does)."""
    shown = subprocess.run([mlx_launcher(), "--help"], capture_output=True, text=True, check=False)
    print(
        "usage: kvrows launch MLX_LAUNCH_ARGUMENTS... -- PROGRAM [ARGUMENTS...]\n\n"
        "mlx.launch with an exit status: the first non-zero status a rank returned (3 for a\n"
        "rank that was killed), 0 when every rank returned 0; the reasons ranks stopped\n"
        f"(their {STOP_LOG_VARIABLE} lines) are printed at the end. mlx.launch's options:\n"
    )
    print(shown.stdout)
    raise SystemExit(0)


def run_launch(arguments: Sequence[str]) -> int:
    """``mlx.launch arguments...`` (for example ``-n 2 --backend ring -- kvrows serve
    --tensor-parallel ...``); its status as :func:`launcher_status` reads it (the launcher's
    own, when it failed itself)."""
    if list(arguments[:1]) in (["-h"], ["--help"]):
        _print_help()
    if not arguments:
        raise InvalidInputError(
            "kvrows launch needs mlx.launch's arguments, e.g. -n 2 --backend ring -- PROGRAM"
        )
    launcher = mlx_launcher()
    with tempfile.TemporaryDirectory(prefix="kvrows-launch-") as folder:
        stop_log = Path(folder) / "stopped.log"
        env = {**os.environ, STOP_LOG_VARIABLE: str(stop_log)}
        process = subprocess.Popen(
            [launcher, *arguments], stderr=subprocess.PIPE, text=True, env=env, errors="replace"
        )

        def forward(signum: int, frame: FrameType | None) -> None:
            process.send_signal(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        logged: list[str] = []
        assert process.stderr is not None
        relay = threading.Thread(target=_relay, args=(process.stderr, sys.stderr, logged))
        relay.start()
        try:
            status = process.wait()
            relay.join()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        reasons = stop_log.read_text(encoding="utf-8") if stop_log.exists() else ""
    if reasons:
        sys.stderr.write(f"kvrows launch: ranks stopped:\n{reasons}")
        sys.stderr.flush()
    if status != 0:
        return status
    ranks = launcher_status(logged)
    if ranks == 0 and reasons:  # a rank stopped, and the launcher did not say (only here)
        return LOST_RANK_STATUS
    return ranks
