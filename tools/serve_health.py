"""``/health`` latency of ``kvrows serve`` under full load (a measurement, not a test).

Starts the server in-process on a free port of 127.0.0.1 (uvicorn in a thread, the real
engine on ``--model``), keeps ``--clients`` streaming clients busy (more than
``--max-batch``: rows decode and requests wait), polls ``GET /health`` ``--polls`` times
and prints its latency percentiles. Bounded: the clients stop when the polls are done.

    .venv/bin/python tools/serve_health.py --model tiny:llama --clients 16 --polls 300
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
import time

import httpx
import uvicorn

from kvrows.app.server import KvRowsServer, build_engine, create_app, load_served_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny:llama")
    parser.add_argument("--scheme", default="plain")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--polls", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    model, tokenizer = load_served_model(args.model)
    engine = build_engine(model, tokenizer, scheme=args.scheme, max_batch=args.max_batch)
    server = KvRowsServer(engine, tokenizer, model_name=args.model)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    runner = uvicorn.Server(
        uvicorn.Config(create_app(server), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    while not runner.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    done = threading.Event()
    streamed = [0]

    def client(index: int) -> None:
        body = {
            "model": args.model,
            "prompt": f"Request {index}: tell me about the cache of a language model.",
            "max_tokens": args.max_tokens,
            "stream": True,
        }
        while not done.is_set():
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    streamed[0] += line.startswith("data: {")
                    if done.is_set():
                        break

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    for each in clients:
        each.start()
    time.sleep(1.0)  # the queue fills
    latencies = []
    with httpx.Client(timeout=10) as poller:
        for _ in range(args.polls):
            start = time.perf_counter()
            assert poller.get(f"{url}/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.01)
    gauges = engine.gauges()
    done.set()
    for each in clients:
        each.join(60)
    runner.should_exit = True
    thread.join(30)
    server.stop(30)
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
    print(
        f"{args.model} {args.scheme}: {args.clients} streaming clients, max batch "
        f"{args.max_batch} (running {gauges.running}, waiting {gauges.waiting} at the end); "
        f"{streamed[0]} chunks streamed; /health over {len(latencies)} polls: "
        f"p50 {statistics.median(latencies) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
        f"max {latencies[-1] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
