"""``kvrows bench --family serve``: one serving trace over HTTP, to ``kvrows serve`` and to
``mlx_lm.server`` on the same checkpoint, one server after the other in one run.

The checkpoint is written once per run into a temporary directory (random weights in
mlx-lm's format, the trained tokenizer and chat template of :mod:`kvrows.app.checkpoints`):
a llama of 8 layers, hidden size 512 and 4 KV heads, where the model's compute and not
HTTP dominates. The trace (:func:`http_trace`) is the engine family's shape in text:
shared documents that several requests ask about, a private question each, Poisson
arrivals in seconds and mixed output lengths. One load generator (:func:`send_trace`)
sends it with a fixed number of concurrent clients: a request goes out at its arrival
time or when a client is free, whichever is later, streamed (``/v1/completions``,
``stream_options.include_usage``), greedy.

Per server: tokens per second (completion tokens over the trace's wall time), time to
first token from the moment the request was sent (p50, p99), time per output token (p50),
the server process's peak resident memory (``VmHWM``, Linux), and how many completions
are the other server's text. The servers run as child processes started and stopped
here (each bounded by a timeout); a server that does not come up is reported, not
waited for.

Needs the ``serve`` extra (``pip install 'kvrows[serve]'``: the HTTP client, and
``kvrows serve`` itself); the bench never installs anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvrows.app.bench.runner import Case, Family, Line, Table, Timing, Workload
from kvrows.app.bench.serving import percentile, plot_latencies
from kvrows.errors import InvalidInputError

__all__ = [
    "BENCH_LLAMA",
    "HttpRequest",
    "ServerRun",
    "family",
    "http_trace",
    "send_trace",
    "server_commands",
]

#: The bench checkpoint's llama (``config.json`` fields over the tiny llama's).
BENCH_LLAMA: dict[str, Any] = {
    "num_hidden_layers": 8,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}

#: Seconds a server may take to answer ``/health`` after it starts (model load included).
STARTUP_TIMEOUT = 120.0
#: Seconds one request may take end to end before the load generator gives it up.
REQUEST_TIMEOUT = 600.0

#: Words the documents and questions are drawn from (a byte-level BPE splits each into a
#: token or a few).
_WORDS = (
    "the", "cache", "holds", "every", "row", "of", "batch", "and", "each", "request", "joins",
    "when", "a", "slot", "is", "free", "while", "others", "leave", "after", "their", "last",
    "token", "so", "memory", "stays", "bounded", "by", "budget",
)  # fmt: skip


@dataclass(frozen=True)
class HttpRequest:
    """One request of the trace: its text prompt, its output length and when it is sent
    (seconds after the trace starts)."""

    rid: str
    prompt: str
    max_tokens: int
    at: float


def http_trace(
    count: int,
    *,
    document_words: tuple[int, int],
    documents: int = 4,
    question_words: tuple[int, int] = (8, 32),
    outputs: Sequence[int] = (16, 32, 64),
    mean_gap: float = 0.25,
    seed: int = 0,
) -> list[HttpRequest]:
    """``count`` requests: request ``i`` reads document ``i % documents`` then its own
    question; Poisson arrivals (mean gap ``mean_gap`` seconds); one of ``outputs`` tokens."""
    if count < 1 or documents < 1 or mean_gap < 0:
        raise InvalidInputError("a trace needs count >= 1, documents >= 1 and mean_gap >= 0")
    rng = random.Random(seed)

    def words(span: tuple[int, int]) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*span)))

    docs = [words(document_words) for _ in range(documents)]
    out: list[HttpRequest] = []
    clock = 0.0
    for i in range(count):
        prompt = f"{docs[i % documents]}\nquestion {i}: {words(question_words)}"
        out.append(HttpRequest(f"h{i:03d}", prompt, rng.choice(tuple(outputs)), clock))
        clock += rng.expovariate(1.0 / mean_gap) if mean_gap else 0.0
    return out


@dataclass
class ServerRun:
    """What the load generator saw of one server on one trace."""

    texts: dict[str, str] = field(default_factory=dict)
    completion_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    latency: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    peak_rss: int | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0


async def _one(client: Any, url: str, model: str, request: HttpRequest, run: ServerRun) -> None:
    body = {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first: float | None = None
    chunks, text = 0, []
    usage: Mapping[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:200]
            run.errors.append(f"{request.rid}: HTTP {response.status_code} {detail}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            usage = event.get("usage") or usage
            for choice in event.get("choices") or ():
                piece = choice.get("text") or ""
                if piece and first is None:
                    first = time.perf_counter()
                chunks += bool(piece)
                text.append(piece)
    done = time.perf_counter()
    tokens = int(usage.get("completion_tokens", chunks))
    run.texts[request.rid] = "".join(text)
    run.completion_tokens += tokens
    details = usage.get("prompt_tokens_details") or {}
    run.cached_tokens += int(details.get("cached_tokens") or 0)
    run.latency.append(done - sent)
    if first is not None:
        run.ttft.append(first - sent)
        if tokens > 1:
            run.tpot.append((done - first) / (tokens - 1))


async def _send(url: str, model: str, trace: Sequence[HttpRequest], clients: int) -> ServerRun:
    import httpx

    run = ServerRun()
    free = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    timeout = httpx.Timeout(REQUEST_TIMEOUT)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()

        async def scheduled(request: HttpRequest) -> None:
            await asyncio.sleep(max(0.0, start + request.at - time.perf_counter()))
            async with free:
                try:
                    await _one(client, url, model, request, run)
                except (httpx.HTTPError, ValueError) as error:
                    run.errors.append(f"{request.rid}: {type(error).__name__}: {error}")

        await asyncio.gather(*(scheduled(r) for r in trace))
        run.seconds = time.perf_counter() - start
    return run


def send_trace(url: str, model: str, trace: Sequence[HttpRequest], clients: int) -> ServerRun:
    """Send ``trace`` to the OpenAI-compatible server at ``url`` with ``clients``
    concurrent clients; what they saw."""
    if clients < 1:
        raise InvalidInputError(f"clients must be >= 1, got {clients}")
    return asyncio.run(_send(url, model, trace, clients))


# -- servers ---------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def server_commands(checkpoint: Path, port: int, max_batch: int) -> dict[str, list[str]]:
    """The command line of each server under test, on ``checkpoint`` at ``port``: the same
    rows in flight (``max_batch``), prefix reuse on in both (their defaults)."""
    python = sys.executable
    kvrows = "import sys; from kvrows.app.cli import main; sys.exit(main())"
    return {
        "kvrows": [
            python, "-c", kvrows, "serve", "--model", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port), "--max-batch", str(max_batch),
        ],
        "mlx-lm": [
            python, "-m", "mlx_lm", "server", "--model", str(checkpoint),
            "--host", "127.0.0.1", "--port", str(port),
            "--decode-concurrency", str(max_batch), "--prompt-concurrency", str(max_batch),
            "--log-level", "ERROR",
        ],
    }  # fmt: skip


def _peak_rss(pid: int) -> int | None:
    """The process's peak resident set in bytes (``VmHWM``; ``None`` where /proc has none)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


@contextlib.contextmanager
def _server(command: list[str], port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``command`` running until it answers ``/health`` (at most ``STARTUP_TIMEOUT``);
    stopped (SIGTERM, then SIGKILL) on the way out, whatever happened."""
    import httpx

    with log.open("wb") as sink:
        process = subprocess.Popen(
            command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-600:]
                raise RuntimeError(f"exited with {process.returncode} at startup: {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"did not answer /health within {STARTUP_TIMEOUT:.0f} s")
            time.sleep(0.2)
        yield process
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def _serve_once(
    name: str, checkpoint: Path, trace: Sequence[HttpRequest], clients: int, max_batch: int
) -> ServerRun:
    """Start server ``name``, warm it up (one short request, untimed), send the trace,
    read its peak memory, stop it."""
    # A SIGTERM (a timeout, a supervisor) ends the bench through its ``finally`` blocks, so
    # the server child (a session of its own) is stopped, not left behind.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return _serve_started(name, checkpoint, trace, clients, max_batch)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _serve_started(
    name: str, checkpoint: Path, trace: Sequence[HttpRequest], clients: int, max_batch: int
) -> ServerRun:
    port = _free_port()
    command = server_commands(checkpoint, port, max_batch)[name]
    url = f"http://127.0.0.1:{port}"
    model = str(checkpoint)
    log = checkpoint.parent / f"{name}-{port}.log"
    try:
        with _server(command, port, log) as process:
            send_trace(url, model, [HttpRequest("warm-up", "the cache", 4, 0.0)], 1)
            run = send_trace(url, model, trace, clients)
            run.peak_rss = _peak_rss(process.pid)
    except RuntimeError as error:
        return ServerRun(errors=[f"{name}: {error}"])
    return run


# -- the family ------------------------------------------------------------------------------


def _write_checkpoint(directory: Path) -> Path:
    from kvrows.app.checkpoints import write_checkpoint

    return write_checkpoint(directory / "llama-8x512", "llama", config=BENCH_LLAMA)


def _missing() -> list[str]:
    needed = ("httpx", "uvicorn", "prometheus_client")
    return [name for name in needed if importlib.util.find_spec(name) is None]


def family(
    *,
    quick: bool = False,
    clients: Sequence[int] | None = None,
    requests: int | None = None,
    plot: str | None = None,
) -> Family:
    """Both servers on the shared-prefix trace at each client count ((16, 1); ``quick``:
    (4,) with a short trace of short documents)."""
    counts = tuple(clients or ((4,) if quick else (16, 1)))
    # Sized so that mlx_lm.server finishes it on a 2-core CPU within the per-request limit
    # (documents of 400-800 words did not).
    total = requests or (6 if quick else 24)
    words = (16, 32) if quick else (150, 300)
    outputs = (4, 8) if quick else (16, 32)
    summary: dict[tuple[int, str], ServerRun] = {}
    holder: dict[str, Any] = {}

    def checkpoint() -> Path:
        if "path" not in holder:
            holder["tmp"] = tempfile.TemporaryDirectory(prefix="kvrows-bench-serve-")
            holder["path"] = _write_checkpoint(Path(holder["tmp"].name))
        path: Path = holder["path"]
        return path

    def case(count: int) -> Case:
        # One client sends the trace back to back: the arrivals would only add idle time.
        trace = http_trace(total if count > 1 else max(2, total // 4), document_words=words,
                           outputs=outputs, mean_gap=0.1 if count > 1 else 0.0)  # fmt: skip
        max_batch = max(count, 1)

        def workload(name: str) -> Workload:
            def run(_: object) -> ServerRun:
                made = _serve_once(name, checkpoint(), trace, count, max_batch)
                summary[(count, name)] = made
                return made

            return Workload("serve", name, count, 0, lambda: None, run, lambda _: None)

        def lines(_: Mapping[str, Timing]) -> list[Line]:
            ours, theirs = summary.get((count, "kvrows")), summary.get((count, "mlx-lm"))
            if ours is None or theirs is None:
                return []
            same = sum(ours.texts.get(r) == t for r, t in theirs.texts.items())

            def mb(value: int | None) -> str:
                return "-" if value is None else f"{value / 2**20:.0f}"

            def div(a: float, b: float) -> str:
                return f"{a / b:.2f}" if b else "-"

            return [
                {
                    "clients": str(count),
                    "requests": str(len(trace)),
                    "kvrows tok/s": f"{ours.tokens_per_second:.1f}",
                    "mlx-lm tok/s": f"{theirs.tokens_per_second:.1f}",
                    "tok/s ratio": div(ours.tokens_per_second, theirs.tokens_per_second),
                    "TTFT p50/p99 s kvrows": (
                        f"{percentile(ours.ttft, 50):.2f} / {percentile(ours.ttft, 99):.2f}"
                    ),
                    "TTFT p50/p99 s mlx-lm": (
                        f"{percentile(theirs.ttft, 50):.2f} / {percentile(theirs.ttft, 99):.2f}"
                    ),
                    "TTFT p50 ratio": div(percentile(ours.ttft, 50), percentile(theirs.ttft, 50)),
                    "TPOT p50 ms kvrows/mlx-lm": (
                        f"{1e3 * percentile(ours.tpot, 50):.1f} / "
                        f"{1e3 * percentile(theirs.tpot, 50):.1f}"
                    ),
                    "peak RSS MiB kvrows/mlx-lm": f"{mb(ours.peak_rss)} / {mb(theirs.peak_rss)}",
                    "cached tokens kvrows/mlx-lm": f"{ours.cached_tokens} / {theirs.cached_tokens}",
                    "same text": f"{same}/{len(theirs.texts)}",
                    "errors": str(len(ours.errors) + len(theirs.errors)),
                }
            ]

        def release() -> None:
            for name in ("kvrows", "mlx-lm"):
                run = summary.get((count, name))
                for error in (run.errors if run else [])[:3]:
                    print(f"  {name}, {count} clients: {error}", file=sys.stderr)

        workloads = {name: workload(name) for name in ("kvrows", "mlx-lm")}
        return Case(f"serve, {count} clients", workloads, lines, key=count, release=release)

    def cases() -> Iterator[Case]:
        missing = _missing()
        if missing:
            print(
                f"kvrows bench --family serve needs the serve extra ({', '.join(missing)} "
                "missing): pip install 'kvrows[serve]'",
                file=sys.stderr,
            )
            return
        try:
            for count in counts:
                yield case(count)
        finally:
            if plot is not None and summary:
                series = {f"{n} ({c} clients)": r.ttft for (c, n), r in summary.items()}
                if not plot_latencies(plot, series):
                    print("--plot needs matplotlib: pip install 'kvrows[plot]'", file=sys.stderr)
            if "tmp" in holder:
                holder.pop("tmp").cleanup()
                holder.pop("path", None)

    notes = (
        "serve: one serving trace over HTTP (streamed /v1/completions, greedy, "
        "stream_options.include_usage) to kvrows serve and to mlx_lm.server on the same\n"
        f"  checkpoint (a random-weight llama: {BENCH_LLAMA['num_hidden_layers']} layers, "
        f"hidden {BENCH_LLAMA['hidden_size']}, {BENCH_LLAMA['num_key_value_heads']} KV heads; "
        "trained BPE tokenizer), each server started fresh and warmed up with one request;\n"
        "  the shared-prefix trace: 4 shared documents, a private question each, Poisson "
        "arrivals, mixed output lengths; at one client the requests go back to back.\n"
        "  tok/s = completion tokens / the trace's wall time; TTFT from the moment a request "
        "is sent; TPOT = (last - first token) / (tokens - 1); peak RSS = the server "
        "process's VmHWM.\n"
        "  Goals (issue 26): at 16 clients >= 2x mlx-lm's tok/s and <= 0.5x its p50 TTFT; "
        "at one client >= 1.0x its tok/s."
    )
    return Family(
        "serve",
        "kvrows serve against mlx_lm.server over HTTP",
        [Table(cases(), "the shared-prefix trace over HTTP")],
        notes,
        repeats=(1, 1),
        warmups=(0, 0),
    )
