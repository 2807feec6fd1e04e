"""``kvrows bench --family distributed``: what moving rows and decisions between processes
costs (``spec/distributed.md`` §1-§7). It starts processes (one ``mlx.launch -n 2
--backend ring`` on 127.0.0.1 running this module as its worker), so ``--family all``
leaves it out, as it does ``serve``.

The worker measures, on two ranks of one machine:

* **transfer**: a row of ``tokens`` positions over ``layers`` layers of 8 KV heads of 128
  (a realistic attention geometry) under each scheme, sent by rank 0 and received by rank 1
  (``send_caches`` / ``recv_caches``: the stored bytes, restored); the receive's time (its
  median over the repeats) against a local copy of the same bytes (one ``mx.concatenate``,
  evaluated) and the bytes against the row's bf16 plain bytes;
* **decision record**: the tensor-parallel scheduler's per-step cost, ``broadcast_text`` of
  an empty record and of one carrying a 2,000-token submission (on rank 0);
* **tensor parallel**: tokens/s of the demo's sharded llama (2 KV heads per rank, the
  divergence guard on) over the built-in trace at N = 2, and of one process running the
  whole model (N = 1) on the same trace.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from kvrows.app.bench.runner import Case, Family, Line, Table, Timing, Workload, format_gbps

__all__ = ["SCHEMES", "family", "measure"]

#: The schemes a row is sent under (plain: bf16, the baseline of the bytes).
SCHEMES = ("plain", "affine8", "affine4", "mxfp4", "turbo")
#: The worker's result line on rank 0's stdout.
RESULT = "BENCH-DISTRIBUTED "
#: Seconds the launch may take; then its process group is killed.
LAUNCH_TIMEOUT = 600


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"tokens": 256, "layers": 1, "repeats": 2, "requests": 2}
    return {"tokens": 4096, "layers": 4, "repeats": 7, "requests": 12}


def _row_caches(scheme_name: str, tokens: int, layers: int) -> list[Any]:
    """One row of ``tokens`` positions in every layer of a llama of ``layers`` layers and 8
    KV heads of 128 under ``scheme_name``, filled with bf16 keys and values."""
    import mlx.core as mx

    from kvrows.app.models import make_kvrows_cache, tiny_model
    from kvrows.schemes import KvStorageScheme

    model = tiny_model(
        "llama",
        overrides={
            "hidden_size": 1024,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "num_hidden_layers": layers,
            "intermediate_size": 256,
        },
    )
    model.set_dtype(mx.bfloat16)  # a served model's KV dtype
    caches = make_kvrows_cache(model, KvStorageScheme.parse(scheme_name))
    for index, cache in enumerate(caches):
        key = mx.random.key(index)
        keys = mx.random.normal((1, 8, tokens, 128), key=key).astype(mx.bfloat16)
        values = mx.random.normal((1, 8, tokens, 128), key=key + 1).astype(mx.bfloat16)
        cache.update_and_fetch(keys, values)
    mx.eval([cache.state for cache in caches])
    return caches


def _transfer(group: Any, sizes: Mapping[str, int]) -> list[dict[str, Any]]:
    import mlx.core as mx

    from kvrows.persist.prompt_cache import saved_arrays
    from kvrows.persist.transfer import recv_caches, send_caches
    from kvrows.schemes import KvStorageScheme

    rank, out = group.rank(), []
    for name in SCHEMES:
        caches = _row_caches(name, sizes["tokens"], sizes["layers"])
        arrays = [a for a in saved_arrays(caches)[0].values() if a.ndim and a.size]
        stored = sum(a.nbytes for a in arrays)
        received, copied = [], []
        for _ in range(sizes["repeats"] + 1):  # the first is a warm-up
            if rank == 0:
                send_caches(caches, 1, group=group)
            else:
                started = time.perf_counter()
                got, _ = recv_caches(0, group=group)
                mx.eval([cache.state for cache in got])
                received.append(time.perf_counter() - started)
            started = time.perf_counter()
            mx.eval(mx.concatenate([a.view(mx.uint8).reshape(-1) for a in arrays]))
            copied.append(time.perf_counter() - started)
        out.append(
            {
                "scheme": KvStorageScheme.parse(name).name,
                "bytes": stored,
                "recv_ms": 1e3 * statistics.median(received[1:]) if received else None,
                "copy_ms": 1e3 * statistics.median(copied[1:]),
            }
        )
    return out


def _records(group: Any, sizes: Mapping[str, int]) -> dict[str, float]:
    from kvrows.app.distributed import broadcast_text, request_record
    from kvrows.app.engine import Request

    submission = Request("r0", tuple(range(1, 2001)), max_tokens=64)
    texts = {
        "empty": json.dumps({"submit": [], "cancel": [], "close": False, "stop": False}),
        "2000-token submission": json.dumps(
            {"submit": [request_record(submission)], "cancel": [], "close": False, "stop": False}
        ),
    }
    out: dict[str, float] = {}
    for label, text in texts.items():
        times = []
        for _ in range(sizes["repeats"] * 3 + 1):
            started = time.perf_counter()
            got = broadcast_text(text if group.rank() == 0 else None, group=group)
            times.append(time.perf_counter() - started)
            assert got == text
        out[label] = 1e3 * statistics.median(times[1:])
        out[f"{label} bytes"] = len(text.encode())
    return out


def _tensor_parallel(group: Any, sizes: Mapping[str, int]) -> dict[str, float]:
    from kvrows.app.demo import _tensor_parallel_models, builtin_trace
    from kvrows.app.distributed import agreed, check_in_step
    from kvrows.app.engine import Engine
    from kvrows.schemes import KvStorageScheme

    ((_, sharded, whole),) = _tensor_parallel_models("llama", group.size())
    trace = builtin_trace(sizes["requests"])
    scheme = KvStorageScheme.parse("plain")
    options: dict[str, Any] = dict(max_batch=8, prefill_chunk=16)
    guard = functools.partial(check_in_step, group=group)
    sharded_results, stats = Engine(sharded, scheme, step_guard=guard, **options).run(trace)
    out = {"N=2": stats.tokens_per_second, "generated": float(stats.generated)}
    if group.rank() == 0:  # the other rank waits in the collective below
        single_results, single = Engine(whole, scheme, **options).run(trace)
        out["N=1"] = single.tokens_per_second
        out["same"] = float(
            [r.tokens for r in single_results] == [r.tokens for r in sharded_results]
        )
    agreed("done", group=group)
    return out


def measure(quick: bool) -> dict[str, Any]:
    """The worker: run on every rank of a two-process launch; rank 0 returns the figures."""
    import mlx.core as mx

    from kvrows.app.disaggregated import gather_texts

    group = mx.distributed.init()
    sizes = _sizes(quick)
    transfer = _transfer(group, sizes)
    received = gather_texts(json.dumps(transfer), group=group)[1]  # rank 1 timed them
    for mine, theirs in zip(transfer, json.loads(received), strict=True):
        mine["recv_ms"] = theirs["recv_ms"]
    return {
        "sizes": sizes,
        "transfer": transfer,
        "records": _records(group, sizes),
        "tensor_parallel": _tensor_parallel(group, sizes),
    }


def _launch(quick: bool) -> dict[str, Any]:
    """One ``mlx.launch -n 2 --backend ring`` of this module; rank 0's figures."""
    from kvrows.app.distributed import bounded_launch

    program = [sys.executable, "-m", __name__, *(["--quick"] if quick else [])]
    try:
        status, out = bounded_launch(program, timeout=LAUNCH_TIMEOUT, env={"PYTHONHASHSEED": "0"})
    except TimeoutError as error:
        raise RuntimeError(str(error)) from None
    found = [line[len(RESULT) :] for line in out.splitlines() if line.startswith(RESULT)]
    if status != 0 or not found:
        raise RuntimeError(f"the two-process launch failed:\n{out[-3000:]}")
    figures: dict[str, Any] = json.loads(found[-1])
    return figures


def family(*, quick: bool = False) -> Family:
    """The three tables, from one two-process launch (made by the first case)."""
    holder: dict[str, Any] = {}

    def figures() -> dict[str, Any]:
        if "figures" not in holder:
            holder["figures"] = _launch(quick)
        made: dict[str, Any] = holder["figures"]
        return made

    def case(label: str, lines: Any) -> Case:
        workload = Workload(
            "launch", label, 0, 0, lambda: None, lambda _: figures(), lambda _: None
        )
        return Case(label, {"launch": workload}, lines)

    def transfer_lines(_: Mapping[str, Timing]) -> list[Line]:
        made = figures()
        rows = made["transfer"]
        plain = rows[0]["bytes"]
        sizes = made["sizes"]
        return [
            {
                "scheme": row["scheme"],
                "row": f"{sizes['tokens']} tok x {sizes['layers']} layers",
                "bytes": str(row["bytes"]),
                "x bf16 bytes": f"{row['bytes'] / plain:.3f}",
                "recv ms": f"{row['recv_ms']:.2f}",
                "GB/s transfer": format_gbps(row["bytes"], row["recv_ms"]),
                "copy ms": f"{row['copy_ms']:.3f}",
                "GB/s local copy": format_gbps(row["bytes"], row["copy_ms"]),
                "transfer / copy": f"{row['recv_ms'] / row['copy_ms']:.0f}x",
            }
            for row in rows
        ]

    def record_lines(_: Mapping[str, Timing]) -> list[Line]:
        records = figures()["records"]
        return [
            {
                "record": label,
                "JSON bytes": str(int(records[f"{label} bytes"])),
                "broadcast_text ms": f"{records[label]:.2f}",
            }
            for label in ("empty", "2000-token submission")
        ]

    def parallel_lines(_: Mapping[str, Timing]) -> list[Line]:
        made = figures()["tensor_parallel"]
        return [
            {
                "model": "tiny llama, 4 KV heads (2 per rank), plain",
                "generated": str(int(made["generated"])),
                "tok/s N=1": f"{made['N=1']:.1f}",
                "tok/s N=2": f"{made['N=2']:.1f}",
                "N=2 / N=1": f"{made['N=2'] / made['N=1']:.2f}",
                "same tokens": "yes" if made["same"] else "NO",
            }
        ]

    def cases(label: str, lines: Any) -> Iterator[Case]:
        yield case(label, lines)

    notes = (
        "distributed: one mlx.launch -n 2 --backend ring on 127.0.0.1 (both ranks on this "
        "machine's cores). transfer: rank 0 sends a row (send_caches: the stored form, codes "
        "encoded), rank 1 times recv_caches until its caches are restored and evaluated "
        "(median); the local copy is one mx.concatenate of the same bytes. decision record: "
        "rank 0's broadcast_text per step (median). tensor parallel: the demo trace on the "
        "sharded model (N=2, the divergence guard on) against one process (N=1); on one "
        "machine the ranks share its cores and add two all-sums per layer over the "
        "loopback, so N=2 is expected slower here; on two machines each rank reads half "
        "the weights and KV per step and the all-sums cross the network."
    )
    return Family(
        "distributed",
        "rows and decisions between processes over mlx.distributed",
        [
            Table(cases("transfer", transfer_lines), "a row between two processes, per scheme"),
            Table(cases("records", record_lines), "the tensor-parallel decision record"),
            Table(cases("tensor parallel", parallel_lines), "tokens/s at N=1 and N=2"),
        ],
        notes,
        repeats=(1, 1),
        warmups=(0, 0),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvrows bench --family distributed's worker")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    figures = measure(args.quick)
    import mlx.core as mx

    if mx.distributed.init().rank() == 0:
        print(RESULT + json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
