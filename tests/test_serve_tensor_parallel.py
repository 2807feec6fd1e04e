"""``kvrows serve --tensor-parallel`` over two processes (``mlx.launch -n 2 --backend ring``
on 127.0.0.1): rank 0 serves HTTP and decides for both ranks; concurrent greedy requests
get the text one process running the whole checkpoint gives; a restart finds each rank's
store entries; SIGTERM to rank 0 drains and every process exits; a rank that dies or hangs
stops the others. The checkpoint's llama has 4 KV heads: 2 per rank."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import free_port

from kvrows.app.checkpoints import write_checkpoint
from kvrows.app.distributed import LOST_RANK_STATUS, launch_command
from kvrows.app.engine import Request
from kvrows.app.server import build_engine, load_served_model

#: ``kvrows`` run by this interpreter.
KVROWS = "import sys; from kvrows.app.cli import main; sys.exit(main())"


def _kvrows_launch() -> list[str]:
    """``kvrows launch`` of two local ranks (mlx.launch's arguments, its own ports), ending
    in ``--``: it exits with the ranks' status."""
    return [sys.executable, "-c", KVROWS, "launch", *launch_command(2)[1:]]


#: Seconds the launch may take to answer /health, and to end after SIGTERM.
STARTUP, SHUTDOWN = 120.0, 60.0
PROMPTS = ("Once upon a time", "The cat sat", "In the beginning there was", "A row joins")


#: A prompt of several store blocks (16 tokens each), sent twice: the second time, its
#: prefix comes from each rank's own store entries.
LONG = "the cache holds every row of the batch and each request joins when a slot is free " * 3


def _completion(url: str, prompt: str) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    made: dict[str, Any] = answer.json()
    return made


@contextlib.contextmanager
def _launch(checkpoint: Path, store: Path, log: Path) -> Iterator[str]:
    """``kvrows serve --tensor-parallel`` on two ranks until it answers ``/health``; yields
    its URL; on the way out SIGTERM to rank 0 (a drain), and the launch must end with
    status 0, or everything is killed."""
    port = free_port()
    command = [
        *_kvrows_launch(), sys.executable, "-c", KVROWS,
        "serve", "--tensor-parallel", "--model", str(checkpoint), "--served-model-name", "m",
        "--port", str(port), "--max-batch", "4", "--prefix-store", str(store),
    ]  # fmt: skip
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {STARTUP:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
        # Rank 0 drains and sends the last record; the other rank and the launcher follow.
        found = re.search(r"SIGTERM to pid (\d+) drains", log.read_text())
        assert found is not None, log.read_text()[-3000:]
        os.kill(int(found.group(1)), signal.SIGTERM)
        process.wait(timeout=SHUTDOWN)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    assert process.returncode == 0, log.read_text()[-3000:]
    assert "decision records broadcast" in log.read_text()  # rank 0 reports what deciding cost


def test_a_sharded_server_answers_as_one_process(tmp_path: Path) -> None:
    """Concurrent greedy completions equal one process's; a restart of the same launch
    serves a long prompt's prefix from every rank's store entries; one process refuses the
    store of a two-rank launch."""
    checkpoint = write_checkpoint(
        tmp_path / "llama", "llama", config={"num_key_value_heads": 4, "num_attention_heads": 8}
    )
    model, tokenizer = load_served_model(str(checkpoint))
    engine = build_engine(model, tokenizer, max_batch=4)
    eos = frozenset(tokenizer.eos_token_ids)
    prompts = (*PROMPTS, LONG)
    requests = [
        Request(f"r{i}", tuple(tokenizer.encode(p)), max_tokens=6, stop=eos)
        for i, p in enumerate(prompts)
    ]
    expected = [r.text for r in engine.run(requests)[0]]
    store = tmp_path / "store"
    with _launch(checkpoint, store, tmp_path / "first.log") as url:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(lambda p: _completion(url, p), prompts))
        assert [answer["choices"][0]["text"] for answer in served] == expected
    with _launch(checkpoint, store, tmp_path / "second.log") as url:
        again = _completion(url, LONG)
        assert again["choices"][0]["text"] == expected[-1]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    alone = subprocess.run(
        [sys.executable, "-c", "import sys; from kvrows.app.cli import main; sys.exit(main())",
         "serve", "--model", str(checkpoint), "--port", "0", "--prefix-store", str(store)],
        capture_output=True, text=True, timeout=STARTUP,
    )  # fmt: skip
    assert alone.returncode == 2 and "2-rank tensor-parallel launch" in alone.stderr, alone.stderr


def _rank_pids(port: int) -> list[int]:
    """The pids of the Python processes serving ``port`` (the ranks, not their wrappers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # A rank runs ``python -c ... serve``; ``kvrows launch`` is ``python -c ... launch``
        # and the launcher ``python .../mlx.launch ...``.
        ours = argv[:2] == [sys.executable.encode(), b"-c"] and argv[3:4] == [b"serve"]
        if ours and str(port).encode() in argv:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP])
def test_a_rank_that_dies_or_hangs_stops_the_launch(tmp_path: Path, fault: int) -> None:
    """Rank 1 killed, or stopped (a hang): rank 0 stops within the step timeout with an
    error naming rank 1 and exit status ``LOST_RANK_STATUS``, and the launch ends."""
    checkpoint = write_checkpoint(
        tmp_path / "llama", "llama", config={"num_key_value_heads": 4, "num_attention_heads": 8}
    )
    port = free_port()
    command = [
        *_kvrows_launch(), sys.executable, "-c", KVROWS,
        "serve", "--tensor-parallel", "--model", str(checkpoint), "--port", str(port),
        "--step-timeout", "3",
    ]  # fmt: skip
    log = tmp_path / "launch.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + STARTUP
        while "SIGTERM to pid" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        first = re.search(r"SIGTERM to pid (\d+) drains", log.read_text())
        assert first is not None
        ranks = _rank_pids(port)
        (other,) = [pid for pid in ranks if pid != int(first.group(1))]
        os.kill(other, fault)
        if fault == signal.SIGSTOP:  # rank 0's watchdog ends it; a stopped rank only SIGKILL
            started = time.monotonic()
            while Path(f"/proc/{first.group(1)}").exists():
                assert time.monotonic() - started < SHUTDOWN, log.read_text()[-3000:]
                time.sleep(0.1)
            os.kill(other, signal.SIGKILL)
        # The launcher prints what its ranks said when it ends (it holds their output once
        # one of them has stopped).
        status = process.wait(timeout=SHUTDOWN)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    text = log.read_text()
    # The launcher may stop relaying rank 0's output once it stops the launch: ``kvrows
    # launch`` prints the reasons the stopping ranks wrote to its KVROWS_STOP_LOG file.
    _, _, reasons = text.partition("kvrows launch: ranks stopped:")
    line = next((line for line in reasons.splitlines() if line.startswith("kvrows: rank 0:")), "")
    assert "rank 1" in line and ("gone" in line or "does not answer" in line), text[-2000:]
    # mlx.launch (0.32) exits 0 whatever its ranks return; kvrows launch exits with the
    # first non-zero status a rank returned.
    assert status == LOST_RANK_STATUS, text[-2000:]
    assert not _rank_pids(port)
