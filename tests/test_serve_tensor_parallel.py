"""``kvrows serve --tensor-parallel`` over two processes (``mlx.launch -n 2 --backend ring``
on 127.0.0.1): rank 0 serves HTTP and decides for both ranks; concurrent greedy requests
get the text one process running the whole checkpoint gives; SIGTERM to the launch drains
and every process exits. The checkpoint's llama has 4 KV heads: 2 per rank."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port

from kvrows.app.checkpoints import write_checkpoint
from kvrows.app.engine import Request
from kvrows.app.server import build_engine, load_served_model

#: Seconds the launch may take to answer /health, and to end after SIGTERM.
STARTUP, SHUTDOWN = 120.0, 60.0
PROMPTS = ("Once upon a time", "The cat sat", "In the beginning there was", "A row joins")


def _completion(url: str, prompt: str) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    text: str = answer.json()["choices"][0]["text"]
    return text


def test_a_sharded_server_answers_as_one_process(tmp_path: Path) -> None:
    checkpoint = write_checkpoint(
        tmp_path / "llama", "llama", config={"num_key_value_heads": 4, "num_attention_heads": 8}
    )
    model, tokenizer = load_served_model(str(checkpoint))
    engine = build_engine(model, tokenizer, max_batch=4)
    eos = frozenset(tokenizer.eos_token_ids)
    requests = [
        Request(f"r{i}", tuple(tokenizer.encode(p)), max_tokens=6, stop=eos)
        for i, p in enumerate(PROMPTS)
    ]
    expected = [r.text for r in engine.run(requests)[0]]

    port = free_port()
    launcher = Path(sys.executable).with_name("mlx.launch")
    kvrows = "import sys; from kvrows.app.cli import main; sys.exit(main())"
    command = [
        str(launcher), "-n", "2", "--backend", "ring", "--", sys.executable, "-c", kvrows,
        "serve", "--tensor-parallel", "--model", str(checkpoint), "--served-model-name", "m",
        "--port", str(port), "--max-batch", "4",
    ]  # fmt: skip
    log = tmp_path / "launch.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP
        while True:
            assert process.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"no /health within {STARTUP:.0f} s:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            served = list(pool.map(lambda p: _completion(url, p), PROMPTS))
        assert served == expected
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
