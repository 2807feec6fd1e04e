"""Disaggregated prefill on ``mlx.distributed``: prefill ranks compute prompts, decode ranks
decode them (``spec/distributed.md`` §7).

One launch (``mlx.launch -n N``) gives each rank a role (:func:`parse_roles`; by default
rank 0 prefills and the others decode). Every rank runs the ordinary online engine
(``spec/engine.md`` §17-§18):

* a **prefill** rank submits each request with ``prefill_only=True``: its engine computes
  the prompt (cohorts, chunks, its prefix cache), samples the first token and hands the
  row over in the request's ``FinishEvent.prefilled`` instead of decoding it;
* a **decode** rank submits each row it receives with ``prefilled=...``: its engine admits
  it under its own rules and merges it into its running batch, which decodes.

The ranks meet once per step in one small all-gather (:meth:`DisaggregatedRank.serve`): each says how many
rows it has ready (prefill) or how many more it can take (decode: ``max_batch`` less its
running and waiting rows) and whether it is done. Every rank derives the same routes from
that table (:func:`route`: each ready row to the decode rank with the most free room, ties
to the lower rank), so a decode rank knows which rank sends it how many rows before it
receives anything: MLX's point-to-point ``recv`` has no timeout and no probe, so a rank
must never wait for a transfer that may not come. The rows then move as one transfer per
(prefill, decode) pair (:func:`send_prefilled` / :func:`recv_prefilled`: the caches in the
prompt-cache file's form, ``kvrows.persist.transfer``), whose metadata carries each row's
request, first token and how its prompt was computed; a paged decode rank receives them
straight into its engine's pools (``Engine.receiving_pools``).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.app.distributed import gathered_ints, request_from_record, request_record
from kvrows.app.engine import (
    Engine,
    FinishEvent,
    PrefilledRow,
    Request,
    RequestResult,
    RequestStream,
    StreamEvent,
)
from kvrows.errors import CorruptStateError, InvalidInputError
from kvrows.persist.transfer import ROWS_KEY, recv_caches, send_caches

__all__ = [
    "PREFILLED_KEY",
    "ROLES",
    "DisaggregatedRank",
    "gather_texts",
    "parse_roles",
    "parsed_results",
    "recv_prefilled",
    "results_text",
    "route",
    "send_prefilled",
]

PREFILL, DECODE = "prefill", "decode"
ROLES = (PREFILL, DECODE)

#: The metadata entry of a transfer of prefilled rows: per row, its request, first token,
#: prefill chunks, prefix hit, the prefill rank's admission step and (optional) logits.
PREFILLED_KEY = "kvrows_prefilled"


def parse_roles(text: str | None, size: int) -> list[str]:
    """Each rank's role: ``text`` a comma-separated role per rank (``prefill,decode``), or
    by default rank 0 ``prefill`` and every other rank ``decode``. At least one of each."""
    if size < 2:
        raise InvalidInputError(
            "disaggregated prefill runs over the processes of a launch: run it as "
            "mlx.launch -n 2 --backend ring -- kvrows demo --disaggregated"
        )
    roles = [PREFILL] + [DECODE] * (size - 1)
    if text is not None:
        roles = [part.strip() for part in text.split(",")]
        unknown = sorted({r for r in roles if r not in ROLES})
        if unknown:
            raise InvalidInputError(
                f"--roles: unknown role(s) {', '.join(map(repr, unknown))}; known: prefill, decode"
            )
        if len(roles) != size:
            raise InvalidInputError(
                f"--roles names {len(roles)} role(s) for a launch of {size} processes "
                "(one per rank, in rank order)"
            )
    if PREFILL not in roles or DECODE not in roles:
        raise InvalidInputError("--roles needs at least one prefill and one decode rank")
    return roles


def route(ready: Mapping[int, int], free: Mapping[int, int]) -> list[tuple[int, int, int]]:
    """Where this step's prefilled rows go: ``(prefill rank, decode rank, rows)`` in the order
    the transfers run. ``ready``: rows each prefill rank has; ``free``: the room each decode
    rank has (may be 0 or less: it then queues them). Prefill ranks in rank order, each of
    their rows in order to the decode rank with the most room (ties: the lower rank), whose
    room then shrinks by one; a pair's rows travel together."""
    if not free:
        raise InvalidInputError("rows to route but no decode rank")
    room = dict(free)
    out: list[tuple[int, int, int]] = []
    for src in sorted(ready):
        counts: dict[int, int] = {}
        for _ in range(ready[src]):
            dst = min(room, key=lambda d: (-room[d], d))
            room[dst] -= 1
            counts[dst] = counts.get(dst, 0) + 1
        out.extend((src, dst, counts[dst]) for dst in sorted(counts))
    return out


def gather_texts(text: str, *, group: Any) -> list[str]:
    """Every rank's ``text``, in rank order, on every rank (two all-gathers: the lengths,
    then the bytes padded to the longest)."""
    raw = text.encode()
    lengths = gathered_ints([len(raw)], group)[:, 0]
    width = max(int(lengths.max()), 1)
    padded = np.zeros(width, dtype=np.uint8)
    padded[: len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    every = np.array(mx.distributed.all_gather(mx.array(padded), group=group), dtype=np.uint8)
    every = every.reshape(group.size(), width)
    return [every[r, : int(lengths[r])].tobytes().decode() for r in range(group.size())]


def _logits_text(logits: np.ndarray[Any, Any] | None) -> str | None:
    if logits is None:
        return None
    return base64.b64encode(np.asarray(logits, dtype=np.float32).tobytes()).decode()


def _logits_array(text: object) -> np.ndarray[Any, Any] | None:
    if text is None:
        return None
    return np.frombuffer(base64.b64decode(str(text)), dtype=np.float32).copy()


def send_prefilled(
    rows: Sequence[tuple[Request, PrefilledRow, int]], dst: int, *, group: Any
) -> int:
    """Send prefilled rows (each: its request, its row, the prefill rank's admission step) to
    rank ``dst`` in one transfer; returns the array bytes sent."""
    if not rows:
        raise InvalidInputError("no prefilled rows to send")
    records = [
        {
            **request_record(request),
            "first_token": row.first_token,
            "prefill_chunks": list(row.prefill_chunks),
            "prefix_hit_tokens": row.prefix_hit_tokens,
            "admitted_step": step,
            "logits": _logits_text(row.logits),
        }
        for request, row, step in rows
    ]
    caches = [cache for _, row, _ in rows for cache in row.caches]
    metadata = {ROWS_KEY: str(len(rows)), PREFILLED_KEY: json.dumps(records)}
    return send_caches(caches, dst, metadata=metadata, group=group)


def recv_prefilled(
    src: int, *, group: Any, pools: Sequence[Any] | None = None
) -> list[tuple[Request, PrefilledRow, int]]:
    """The rows rank ``src`` sends with :func:`send_prefilled`; ``pools`` (per layer,
    ``Engine.receiving_pools``) puts a paged row's positions in the receiving engine's
    pools."""
    caches, described = recv_caches(src, group=group, pools=pools)
    try:
        count = int(described[ROWS_KEY])
        records = json.loads(described[PREFILLED_KEY])
        assert isinstance(records, list) and len(records) == count and count > 0
        assert len(caches) % count == 0
    except (KeyError, ValueError, AssertionError):
        raise CorruptStateError(f"rank {src} sent caches, not prefilled rows") from None
    layers = len(caches) // count
    out: list[tuple[Request, PrefilledRow, int]] = []
    for index, record in enumerate(records):
        row = PrefilledRow(
            caches[index * layers : (index + 1) * layers],
            int(record["first_token"]),
            tuple(int(n) for n in record["prefill_chunks"]),
            int(record["prefix_hit_tokens"]),
            _logits_array(record.get("logits")),
        )
        out.append((request_from_record(record), row, int(record["admitted_step"])))
    return out


@dataclass
class DisaggregatedRank:
    """One rank of a disaggregated launch: its role, its engine and its part of the step
    loop (:meth:`serve`). ``roles``: every rank's (:func:`parse_roles`)."""

    engine: Engine
    roles: Sequence[str]
    group: Any
    #: Decode ranks: per step, the rows in the batch after the step and the rows that
    #: arrived at it (``spec/distributed.md`` §7 shows them).
    batch: list[int] = field(default_factory=list)
    arrivals: list[int] = field(default_factory=list)
    #: Bytes of the caches this rank sent or received, and the transfers.
    bytes_moved: int = 0
    transfers: int = 0
    #: Per request that arrived, the prefill rank's admission step (a solo replay's order).
    prefill_steps: dict[str, int] = field(default_factory=dict)

    @property
    def role(self) -> str:
        return str(self.roles[self.group.rank()])

    def serve(self, requests: Sequence[Request]) -> dict[str, RequestResult]:
        """Run ``requests`` (every rank passes the same trace; ``arrival``: the step it is
        submitted at, on the prefill rank that owns it: ``i mod`` prefill ranks in trace
        order) until every rank is done; returns the results this rank finished (decode:
        the requests' whole results; prefill: none)."""
        rank = self.group.rank()
        prefill_ranks = [r for r, role in enumerate(self.roles) if role == PREFILL]
        decode_ranks = [r for r, role in enumerate(self.roles) if role == DECODE]
        mine = [
            request
            for i, request in enumerate(requests)
            if prefill_ranks[i % len(prefill_ranks)] == rank
        ]
        pending = sorted(mine, key=lambda r: r.arrival) if self.role == PREFILL else []
        by_rid = {request.rid: request for request in requests}
        ready: list[tuple[Request, PrefilledRow, int]] = []
        results: dict[str, RequestResult] = {}
        streams: list[RequestStream] = []

        def handed(event: StreamEvent) -> None:  # the engine thread: a prompt is done
            if isinstance(event, FinishEvent) and event.prefilled is not None:
                result = event.result
                ready.append((by_rid[event.rid], event.prefilled, result.admitted_step))

        engine, step = self.engine, 0
        while True:
            while pending and pending[0].arrival <= step:
                engine.submit(pending.pop(0), on_event=handed, prefill_only=True)
            if engine.has_work():
                engine.step()
            if self.role == PREFILL:
                done = not pending and not engine.has_work() and not ready
                counts = [len(ready), 0, int(done)]
            else:
                gauges = engine.gauges()
                free = engine.max_batch - gauges.running - gauges.waiting
                counts = [0, free, int(not engine.has_work())]
            table = gathered_ints(counts, self.group)
            routes = route(
                {r: int(table[r, 0]) for r in prefill_ranks if table[r, 0] > 0},
                {r: int(table[r, 1]) for r in decode_ranks},
            )
            arrived = 0
            for src, dst, count in routes:
                if src == rank:
                    sent, ready[:] = ready[:count], ready[count:]
                    self.bytes_moved += send_prefilled(sent, dst, group=self.group)
                    self.transfers += 1
                elif dst == rank:
                    pools = engine.receiving_pools()
                    for request, row, at in recv_prefilled(src, group=self.group, pools=pools):
                        self.bytes_moved += sum(c.nbytes for c in row.caches)
                        self.prefill_steps[request.rid] = at
                        streams.append(engine.submit(request, prefilled=row))
                        arrived += 1
                    self.transfers += 1
            if self.role == DECODE:
                self.batch.append(engine.gauges().running)
                self.arrivals.append(arrived)
            if bool(table[:, 2].all()) and not routes:
                break
            step += 1
        for stream in streams:
            for event in stream:
                if isinstance(event, FinishEvent):
                    results[event.rid] = event.result
        return results

    def timeline(self) -> str:
        """A decode rank's batch over time: rows per step, and where rows arrived."""
        steps = len(self.batch)
        busy = [n for n in self.batch if n]
        mean = sum(busy) / len(busy) if busy else 0.0
        shown = " ".join(
            f"{n}+{a}" if a else str(n) for n, a in zip(self.batch, self.arrivals, strict=True)
        )
        return (
            f"rank {self.group.rank()} (decode): {steps} steps, {sum(self.arrivals)} rows "
            f"arrived in {sum(1 for a in self.arrivals if a)} transfers, batch peak "
            f"{max(self.batch, default=0)}, mean {mean:.1f} over its busy steps; rows after "
            f"each step (+rows that arrived then): {shown}"
        )


def results_text(results: Mapping[str, RequestResult], prefill_steps: Mapping[str, int]) -> str:
    """``results`` (a decode rank's) as JSON for :func:`gather_texts`: tokens, logits, how
    each prompt was computed, and the prefill rank's admission step as ``admitted_step``."""
    return json.dumps(
        {
            rid: {
                "tokens": r.tokens,
                "logits": [_logits_text(x) for x in r.logits],
                "prefill_chunks": r.prefill_chunks,
                "prefix_hit_tokens": r.prefix_hit_tokens,
                "admitted_step": prefill_steps.get(rid, r.admitted_step),
                "finish_reason": r.finish_reason,
                "error": r.error,
            }
            for rid, r in results.items()
        }
    )


def parsed_results(texts: Sequence[str], requests: Sequence[Request]) -> list[RequestResult]:
    """Every rank's :func:`results_text`, as the requests' results in trace order."""
    merged: dict[str, Any] = {}
    for text in texts:
        merged.update(json.loads(text))
    out: list[RequestResult] = []
    for request in requests:
        record = merged[request.rid]
        logits = [_logits_array(x) for x in record["logits"]]
        out.append(
            RequestResult(
                request.rid,
                len(request.prompt),
                admitted_step=int(record["admitted_step"]),
                tokens=[int(t) for t in record["tokens"]],
                logits=[x for x in logits if x is not None],
                prefix_hit_tokens=int(record["prefix_hit_tokens"]),
                finish_reason=str(record["finish_reason"]),
                error=record["error"],
                prefill_chunks=[int(n) for n in record["prefill_chunks"]],
            )
        )
    return out
