"""``kvrows serve`` on the real online engine and real checkpoints: OpenAI's client against
a live server (greedy tokens equal to the engine's offline ``Engine.run``), a checkpoint
written to disk and loaded by ``mlx_lm.load``, and ``kvrows serve`` as a subprocess:
``SIGTERM`` mid-stream exits 0, and a restart with the same ``--prefix-store`` serves the
earlier prefix from disk (``/metrics``). Families and schemes tested here: llama (plain,
affine8 with a bf16-first start), gemma3 (turbo; mxfp4 rings, paged), qwen3_next (the
hybrid: recurrent state beside attention), llama4 (chunked-local, affine4), deepseek_v32
(MLA latent, affine8) and baichuan_m1 (a layer of several caches); every tiny architecture
but glm_moe_dsa loads from disk to the same logits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import mlx.core as mx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from server_helpers import live_server

from kvrows.app.checkpoints import NO_CHECKPOINT, tiny_model_with_tokenizer, write_checkpoint
from kvrows.app.engine import Request
from kvrows.app.models import TINY_MODELS
from kvrows.app.server import KvRowsServer, build_engine, load_served_model

TIMEOUT = 20.0
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Tell me a short story about a cat."},
]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


@pytest.mark.parametrize(
    ("arch", "scheme", "kv_start", "paged"),
    [
        ("llama", "plain", None, False),
        ("gemma3", "turbo", None, False),
        ("qwen3_next", "affine8", 4, False),
        ("gemma3", "mxfp4", None, True),  # microscaling rings, paged
        ("llama4", "affine4", None, False),  # chunked-local attention
        ("deepseek_v32", "affine8", None, False),  # MLA latent
        ("baichuan_m1", "plain", None, False),  # a layer of several caches
    ],
)
def test_served_greedy_tokens_are_the_offline_engines(
    arch: str, scheme: str, kv_start: int | None, paged: bool
) -> None:
    model, tokenizer = tiny_model_with_tokenizer(arch)
    options: dict[str, Any] = {
        "scheme": scheme,
        "kv_start": kv_start,
        "max_batch": 4,
        "paged": paged,
    }
    prompt = tuple(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    completion_prompt = tuple(tokenizer.encode("Once upon a time", add_special_tokens=False))
    offline = build_engine(model, tokenizer, **options)
    eos = frozenset(tokenizer.eos_token_ids)
    (chat, completion), _ = offline.run(
        [
            Request("chat", prompt, max_tokens=6, stop=eos),
            Request("completion", completion_prompt, max_tokens=6, stop=eos),
        ]
    )
    server = KvRowsServer(
        build_engine(model, tokenizer, **options), tokenizer, model_name=f"tiny:{arch}"
    )
    with live_server(server) as url:
        client = _client(url)
        whole = client.chat.completions.create(
            model=f"tiny:{arch}",
            messages=MESSAGES,
            max_tokens=6,
            temperature=0,
        )
        assert whole.choices[0].message.content == chat.text
        assert whole.usage is not None
        assert whole.usage.completion_tokens == len(chat.tokens)
        assert whole.usage.prompt_tokens == len(prompt)
        streamed = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model=f"tiny:{arch}",
                prompt=list(completion_prompt),
                max_tokens=6,
                temperature=0,
                stream=True,
            )
            if c.choices
        )
        assert streamed == completion.text
        assert tokenizer.decode(completion.tokens) == completion.text or eos & set(
            completion.tokens
        )


def test_checkpoints_load_to_the_same_model(tmp_path: Path) -> None:
    """Every tiny architecture written to disk loads (``mlx_lm.load``: config, sanitize,
    weights, tokenizer and template) to the in-memory model's logits."""
    for arch in TINY_MODELS:
        if arch in NO_CHECKPOINT:
            with pytest.raises(Exception, match="no checkpoint"):
                write_checkpoint(tmp_path / arch, arch)
            continue
        write_checkpoint(tmp_path / arch, arch)
        loaded, tokenizer = load_served_model(str(tmp_path / arch))
        memory, _ = tiny_model_with_tokenizer(arch)
        ids = tokenizer.apply_chat_template(MESSAGES[1:], add_generation_prompt=True)
        assert tokenizer.decode(ids).startswith("<|bos|><|user|>Tell me")
        difference = mx.abs(loaded(mx.array([ids])) - memory(mx.array([ids]))).max().item()
        assert difference == 0.0, arch


@pytest.fixture(scope="module")
def checkpoint() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as folder:
        yield write_checkpoint(Path(folder) / "llama", "llama")


def _start(checkpoint: Path, store: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    """``kvrows serve`` on a free port, its URL once it listens (bounded wait)."""
    command = [sys.executable, "-m", "kvrows.app.cli", "serve", "--model", str(checkpoint)]
    command += ["--port", "0", "--prefix-store", str(store), "--drain-timeout", "5", *extra]
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    assert process.stderr is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            return process, found.group(1)
        if not line and process.poll() is not None:
            break
    process.kill()
    raise AssertionError(f"kvrows serve did not start: {process.stderr.read()}")


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_sigterm_drains_and_a_restart_reads_the_prefix_store(
    checkpoint: Path, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    name = str(checkpoint)
    long_prompt = "The same system prompt, sent by every client, is read once. " * 3
    body = {
        "model": name,
        "prompt": long_prompt,
        "max_tokens": 200,
        "stream": True,
        "temperature": 0,
    }
    process, url = _start(checkpoint, store)
    try:
        cold = httpx.post(
            f"{url}/v1/completions",
            json={**body, "stream": False, "max_tokens": 4},
            timeout=TIMEOUT,
        )
        assert cold.status_code == 200, cold.text
        lines: list[str] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT) as reply:
            iterator = reply.iter_lines()
            while not any(x.startswith("data: {") for x in lines):
                lines.append(next(iterator))
            process.send_signal(signal.SIGTERM)
            lines.extend(iterator)  # the stream finishes
        assert process.wait(TIMEOUT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)
    data = [x for x in lines if x.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
    assert any(store.iterdir())

    process, url = _start(checkpoint, store)
    try:
        warm = httpx.post(
            f"{url}/v1/completions",
            json={**body, "stream": False, "max_tokens": 4},
            timeout=TIMEOUT,
        )
        assert warm.status_code == 200, warm.text
        assert warm.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert _metric(url, "kvrows_prefix_store_hit_tokens_total") > 0
        assert warm.json()["choices"][0]["text"] == cold.json()["choices"][0]["text"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(TIMEOUT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(TIMEOUT)
