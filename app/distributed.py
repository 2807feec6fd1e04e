"""Tensor parallelism on ``mlx.distributed``: a model sharded over a group, each rank's
caches holding only its KV heads, one scheduler deciding for every rank, and the guard
that catches a rank that drifted.

:func:`shard_model` splits the model's attention heads and MLP over the group (mlx-lm's
``model.shard`` where the model has one: llama, qwen3, deepseek and others; the same
split here for the attention models that have none: gemma3). Every rank then holds
``num_key_value_heads / N`` KV heads per layer, and ``make_kvrows_cache`` declares that
many (``spec/distributed.md`` §5). An MLA latent has no KV heads: each rank holds it whole.
Recurrent state is not split by heads: a model with recurrent layers is refused.

:func:`check_in_step` is the divergence guard: every rank hashes what it holds (row ids and
offsets) and the group compares the hashes in one small collective; a rank whose hash is
not rank 0's raises :class:`~kvrows.errors.RankDivergenceError` naming it.

:class:`Scheduler` (rank 0) and :func:`follow` (the other ranks) run one online engine per
rank in lockstep (``spec/distributed.md`` §6): rank 0 takes the server's submissions and
cancellations, and before every step broadcasts them as one decision record; every rank
applies the record to its engine in the same order, then steps. Everything else an engine
decides (admissions, prefill cuts, joins, filters, publishes, prefix hits, preemptions,
stop strings) follows from the records and the sampled tokens, which the all-sums leave
alike on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.errors import InvalidInputError, RankDivergenceError, RankLostError

__all__ = [
    "LOST_RANK_STATUS",
    "STEP_TIMEOUT",
    "STORE_MANIFEST",
    "Scheduler",
    "Watchdog",
    "agreed",
    "any_rank",
    "broadcast_text",
    "check_in_step",
    "check_store_sharding",
    "follow",
    "gathered_ints",
    "launch_command",
    "mlx_launcher",
    "shard_model",
    "sharding",
    "smallest",
]

#: mlx-lm cache classes whose state is not split by heads.
_RECURRENT = frozenset({"ArraysCache", "MambaCache"})


def mlx_launcher() -> str:
    """The ``mlx.launch`` beside this interpreter."""
    import sys
    from pathlib import Path

    return str(Path(sys.executable).with_name("mlx.launch"))


#: Where a launch's ring ports are drawn: below the ephemeral range (32768 up), so no
#: ``bind(("", 0))`` elsewhere (a test server's free port, another socket) takes one of
#: them between the draw and the launch.
_RING_PORTS = range(20000, 32000)


def launch_command(ranks: int = 2) -> list[str]:
    """``mlx.launch`` of ``ranks`` local processes over the ring backend, ending in ``--``
    (append the program). Each launch takes its own ports: a run of ``2 · ranks`` ports
    found free now, drawn at random below the ephemeral range (two launches at once on the
    default ports would meet each other; a port after an ephemeral one could be taken by
    the next ``bind`` to port 0)."""
    import random
    import socket

    def free(start: int) -> bool:
        for port in range(start, start + 2 * ranks):
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port))
                except OSError:
                    return False
        return True

    draws = random.Random()
    port = next(
        (p for p in (draws.randrange(_RING_PORTS.start, _RING_PORTS.stop) for _ in range(64))
         if free(p)),
        _RING_PORTS.start,
    )  # fmt: skip
    return [
        mlx_launcher(), "-n", str(ranks), "--backend", "ring", "--starting-port", str(port), "--",
    ]  # fmt: skip


def bounded_launch(
    program: Sequence[str],
    *,
    timeout: float,
    ranks: int = 2,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:
    """``program`` on ``ranks`` local processes (:func:`launch_command`), its output
    (stdout and stderr together) read whole: ``(status, output)`` (mlx.launch's status: 0
    whatever its ranks return). Past ``timeout`` seconds the launch's whole process group
    is killed and ``TimeoutError`` carries the output's tail; nothing is left running."""
    import os
    import signal
    import subprocess

    process = subprocess.Popen(
        [*launch_command(ranks), *program], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True, env={**os.environ, **(env or {})},
    )  # fmt: skip
    try:
        out, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate()
        raise TimeoutError(f"the launch did not end within {timeout} s:\n{out[-2000:]}") from None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, out


def sharding(model: Any) -> tuple[int, int] | None:
    """``(rank, size)`` of the group ``model`` was sharded over (``None``: not sharded)."""
    shards = getattr(model, "kvrows_shards", None)
    return None if shards is None else (int(shards[0]), int(shards[1]))


def _attention_models_shard(model: Any, group: Any) -> None:
    """The split of mlx-lm's ``shard`` for a model whose layers have ``self_attn``
    (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and ``mlp`` (``gate_proj``,
    ``up_proj``, ``down_proj``) but no ``shard`` of their own (gemma3)."""
    from mlx.nn.layers.distributed import shard_linear

    size = group.size()
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(
                attention,
                name,
                shard_linear(getattr(attention, name), "all-to-sharded", group=group),
            )
        attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
        attention.n_heads //= size
        attention.n_kv_heads //= size
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_model(model: Any, group: Any = None) -> Any:
    """Shard ``model`` in place over ``group`` (the global group by default) and return it.
    Refused (``InvalidInputError``, the model untouched) for a model already sharded, one
    with recurrent layers, one whose heads do not divide by the group's size, and one this
    cannot split."""
    made = mx.distributed.init() if group is None else group
    size = made.size()
    if sharding(model) is not None:
        raise InvalidInputError("the model is sharded already")
    name = type(model).__module__.rsplit(".", 1)[-1]
    template = model.make_cache() if hasattr(model, "make_cache") else []
    recurrent = sorted({type(c).__name__ for c in template} & _RECURRENT)
    if recurrent:
        raise InvalidInputError(
            f"{name}: its recurrent layers ({', '.join(recurrent)}) hold state that cannot be "
            "split by heads; tensor parallelism needs attention-only models"
        )
    layers = list(getattr(model, "layers", ()))
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        for attribute in ("n_heads", "n_kv_heads", "num_heads"):
            count = getattr(attention, attribute, None)
            if isinstance(count, int) and count % size:
                raise InvalidInputError(
                    f"{name}, layer {index}: {count} {attribute.replace('_', ' ')} do not divide "
                    f"over {size} ranks"
                )
    if hasattr(model, "shard"):
        model.shard(made)
    elif layers and all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        _attention_models_shard(model, made)
    else:
        raise InvalidInputError(f"{name}: no way to shard this model over heads")
    model.kvrows_shards = (made.rank(), size)
    model.kvrows_group = made  # a draft made from it is sharded over the same group
    mx.eval(model.parameters())
    return model


def _digest(rids: Sequence[str], offsets: Sequence[int]) -> int:
    text = "|".join(f"{rid}:{offset}" for rid, offset in zip(rids, offsets, strict=True))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


#: Collectives this process has taken part in: every rank of a group runs the same ones in
#: the same order, so the count is the same on each and names the collective.
_collectives = itertools.count(1)


def _presence_mark(limit: int) -> int:
    """The presence mark of the next collective: its number, in ``1..limit``. A mark that
    changes from one collective to the next keeps any result left from an earlier
    collective from passing for this one's."""
    return next(_collectives) % limit + 1


def _check_present(present: Sequence[int], mark: int, group: Any) -> None:
    """Raise ``RankLostError`` naming the ranks whose presence mark is missing from a
    collective's result (or a mark of another collective): MLX's ring backend does not
    raise when a peer is gone, it returns what the live ranks contributed."""
    lost = [rank for rank, found in enumerate(present) if found != mark]
    if lost:
        named = f"rank {lost[0]}" if len(lost) == 1 else f"ranks {', '.join(map(str, lost))}"
        raise RankLostError(
            f"rank {group.rank()}: {named} no longer take(s) part in the group's collectives "
            "(the process died or its connection is gone)"
        )


def gathered_ints(values: Sequence[int], group: Any) -> np.ndarray[Any, Any]:
    """Every rank's ``values`` (the same count on each), one row per rank in rank order:
    one all-gather of int32s, beside a presence mark that must come back from every rank
    (``RankLostError`` names a rank whose mark is missing)."""
    mark = _presence_mark(2**31 - 2)
    mine = mx.array([*values, mark], dtype=mx.int32)
    every = np.array(mx.distributed.all_gather(mine, group=group)).reshape(-1, len(values) + 1)
    if every.shape[0] != group.size():
        raise RankLostError(
            f"rank {group.rank()}: an all-gather came back from {every.shape[0]} ranks"
        )
    _check_present(every[:, -1].tolist(), mark, group)
    return every[:, :-1]


def _gathered(value: int, group: Any) -> list[int]:
    """``value`` of every rank of ``group``, in rank order."""
    values: list[int] = gathered_ints([value], group)[:, 0].tolist()
    return values


def agreed(text: str, *, group: Any = None) -> bool:
    """Whether every rank of ``group`` holds the same ``text`` (its digest compared)."""
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        return True
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF
    return len(set(_gathered(digest, made))) == 1


def smallest(value: int, *, group: Any = None) -> int:
    """The smallest ``value`` of the ranks of ``group`` (every rank gets it): what all of
    them can do, e.g. the disk-store prefix hit every rank holds."""
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        return value
    return min(_gathered(value, made))


#: The file in a prefix-store directory that names the tensor-parallel launch its entries
#: belong to (each rank's entries are its own shards).
STORE_MANIFEST = "tensor-parallel.json"


def check_store_sharding(directory: str, ranks: int) -> None:
    """Refuse a prefix store written by a launch of another number of ranks (its entries
    hold other shards: none would ever hit), else record this one's. ``ranks == 1``: a
    process serving the whole model."""
    from pathlib import Path

    manifest = Path(directory) / STORE_MANIFEST
    written = None
    if manifest.exists():
        try:
            written = int(json.loads(manifest.read_text())["ranks"])
        except (OSError, ValueError, KeyError, TypeError):
            raise InvalidInputError(f"{manifest} is unreadable: remove it or the store") from None
    if written is not None and written != ranks:
        raise InvalidInputError(
            f"the prefix store in {directory} holds rows of a {written}-rank tensor-parallel "
            f"launch; this is {'one process' if ranks == 1 else f'a {ranks}-rank launch'}: use "
            f"another directory, or {written} ranks"
        )
    if written is None and ranks > 1:
        Path(directory).mkdir(parents=True, exist_ok=True)
        manifest.write_text(json.dumps({"ranks": ranks}))


def any_rank(flag: bool, *, group: Any = None) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (every rank gets the same answer)."""
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        return flag
    return any(_gathered(int(flag), made))


def check_in_step(
    step: int, rids: Sequence[str], offsets: Sequence[int], *, group: Any = None
) -> None:
    """Compare what every rank holds at step ``step`` (the running rows' ids and offsets,
    in batch order) across the group; raise ``RankDivergenceError`` naming the ranks that
    differ from rank 0. One all-gather of one int32 per rank."""
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        return
    if len(rids) != len(offsets):
        raise InvalidInputError(f"{len(rids)} row ids but {len(offsets)} offsets")
    every = _gathered(_digest(rids, offsets), made)
    drifted = [rank for rank, value in enumerate(every) if value != every[0]]
    if drifted:
        raise RankDivergenceError(
            f"step {step}: rank(s) {', '.join(map(str, drifted))} hold other rows or offsets "
            f"than rank 0 (this is rank {made.rank()}): the ranks no longer apply the same "
            "row operations"
        )


#: Bytes of the first all-sum of a broadcast: the length and the start of the text. The
#: ring backend answers a collective of a few bytes an order of magnitude slower than one
#: of a few KiB (measured on loopback: 12 ms against 2 ms), and a decision record of a
#: step without submissions fits here: one collective per step.
BROADCAST_FIRST = 4096


def broadcast_text(text: str | None, *, group: Any) -> str:
    """Rank 0's ``text`` on every rank (the others pass ``None``): all-sums where the other
    ranks add zeros, the first of :data:`BROADCAST_FIRST` bytes holding the length, the
    text's start and one presence mark per rank (``RankLostError`` names a rank whose mark
    is missing), a second for the rest of a longer text."""
    root, size = group.rank() == 0, group.size()
    raw = (text or "").encode() if root else b""
    first = np.zeros(BROADCAST_FIRST, dtype=np.uint8)
    room = BROADCAST_FIRST - 4 - size
    mark = _presence_mark(255)
    first[BROADCAST_FIRST - size + group.rank()] = mark
    if root:
        first[:4] = np.frombuffer(np.uint32(len(raw)).tobytes(), dtype=np.uint8)
        head = np.frombuffer(raw[:room], dtype=np.uint8)
        first[4 : 4 + len(head)] = head
    summed = np.array(mx.distributed.all_sum(mx.array(first), group=group), dtype=np.uint8)
    _check_present(summed[BROADCAST_FIRST - size :].tolist(), mark, group)
    length = int(np.frombuffer(summed[:4].tobytes(), dtype=np.uint32)[0])
    body = summed[4 : 4 + min(length, room)].tobytes()
    if length > room:
        rest = np.frombuffer(raw[room:], dtype=np.uint8) if root else None
        mine = rest if rest is not None else np.zeros(length - room, dtype=np.uint8)
        body += np.array(
            mx.distributed.all_sum(mx.array(mine), group=group), dtype=np.uint8
        ).tobytes()
    return body.decode()


def request_record(request: Any) -> dict[str, Any]:
    return {
        "rid": request.rid,
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stop": sorted(request.stop),
        "stop_strings": list(request.stop_strings),
    }


def request_from_record(record: dict[str, Any]) -> Any:
    from kvrows.app.engine import Request

    return Request(
        rid=str(record["rid"]),
        prompt=tuple(int(t) for t in record["prompt"]),
        max_tokens=int(record["max_tokens"]),
        temperature=float(record["temperature"]),
        top_p=float(record["top_p"]),
        seed=int(record["seed"]),
        stop=frozenset(int(t) for t in record["stop"]),
        stop_strings=tuple(str(t) for t in record["stop_strings"]),
    )


@dataclass
class _Submission:
    """A submission waiting for the next step boundary, and its answer."""

    request: Any
    on_event: Callable[[Any], None] | None
    done: threading.Event = field(default_factory=threading.Event)
    stream: Any = None
    error: BaseException | None = None


def _apply(engine: Any, record: dict[str, Any], submissions: Sequence[_Submission] = ()) -> None:
    """One decision record on ``engine``, in its order: the submissions (rank 0 answers its
    callers: the stream, or the refusal every rank met alike), the cancellations, the
    budget, closing admissions."""
    waiting = {s.request.rid: s for s in submissions}
    for entry in record["submit"]:
        mine = waiting.get(entry["rid"])
        try:
            stream = engine.submit(
                mine.request if mine else request_from_record(entry),
                on_event=mine.on_event if mine else None,
            )
            if mine is not None:
                mine.stream = stream
        except Exception as error:  # the same refusal on every rank: rank 0's caller gets it
            if mine is not None:
                mine.error = error
        if mine is not None:
            mine.done.set()
    for rid in record["cancel"]:
        engine.cancel(rid)
    if "kv_budget" in record:
        engine.set_kv_budget(record["kv_budget"])
    if record["close"]:
        engine.close_admissions()


#: Seconds one step or one wait for the group may take before the watchdog stops the
#: rank (``--step-timeout``); an idle rank 0 sends an empty record every quarter of it.
STEP_TIMEOUT = 120.0

#: The exit status of a rank the watchdog or a lost peer stopped.
LOST_RANK_STATUS = 3

#: The environment variable naming a file to which a stopping rank appends its reason
#: (every rank of a launch inherits it).
STOP_LOG_VARIABLE = "KVROWS_STOP_LOG"


def _others(group: Any) -> str:
    others = [str(r) for r in range(group.size()) if r != group.rank()]
    return others[0] if len(others) == 1 else "one of " + ", ".join(others)


def _stop_rank(message: str) -> None:
    """Stop this process now, saying why (a collective that will never return cannot be
    interrupted: only the process can end)."""
    import os
    import sys

    line = f"kvrows: {message}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    # The launcher stops relaying a rank's output once it has begun stopping the others,
    # so the line may never reach its log: the file named by STOP_LOG_VARIABLE keeps it.
    path = os.environ.get(STOP_LOG_VARIABLE)
    if path:
        with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as log:
            log.write(line)
    os._exit(LOST_RANK_STATUS)


class Watchdog:
    """Bounds every step and every wait for the group (MLX's collectives have no timeout):
    ``watch(what)`` arms it for ``timeout`` seconds, ``done()`` disarms it; armed past its
    deadline, it calls ``expired(message)`` (by default: print it and end the process)."""

    def __init__(
        self,
        group: Any,
        timeout: float = STEP_TIMEOUT,
        expired: Callable[[str], None] = _stop_rank,
    ) -> None:
        if not timeout > 0:
            raise InvalidInputError(f"the step timeout must be > 0 seconds, got {timeout}")
        self.group, self.timeout, self.expired = group, timeout, expired
        self._armed: tuple[float, str] | None = None
        self._lock = threading.Lock()
        thread = threading.Thread(target=self._run, name="kvrows-watchdog", daemon=True)
        thread.start()

    def watch(self, what: str) -> None:
        import time

        with self._lock:
            self._armed = (time.monotonic() + self.timeout, what)

    def done(self) -> None:
        with self._lock:
            self._armed = None

    def _run(self) -> None:
        import time

        while True:
            time.sleep(min(0.2, self.timeout / 10))
            with self._lock:
                armed = self._armed
            if armed is not None and time.monotonic() > armed[0]:
                self.expired(
                    f"rank {self.group.rank()}: {armed[1]} took more than {self.timeout:g} s: "
                    f"rank {_others(self.group)} does not answer (it died or hangs); stopping"
                )
                with self._lock:
                    self._armed = None


def _watched(watchdog: Watchdog, what: str, work: Callable[[], Any]) -> Any:
    """``work()`` under the watchdog; a collective that fails (a peer's connection lost)
    stops the rank, naming the peer."""
    watchdog.watch(what)
    try:
        return work()
    except RuntimeError as error:  # MLX's ring backend: "connection to a peer was lost"
        watchdog.expired(
            f"rank {watchdog.group.rank()}: {what} failed ({error}): rank "
            f"{_others(watchdog.group)} is gone; stopping"
        )
        raise
    except RankLostError as error:  # the collective came back without a rank
        watchdog.expired(f"{error}: {what} cannot complete; stopping")
        raise
    except RankDivergenceError as error:  # serving on would answer from a drifted batch
        watchdog.expired(f"{error}; stopping")
        raise
    finally:
        watchdog.done()


class Scheduler:
    """Rank 0's engine for a tensor-parallel group: the online engine's API for the server
    (``submit``, ``cancel``, ``close_admissions``, ``set_kv_budget``, ``gauges``,
    ``serve_forever``), every change held for the next step boundary, where it goes to
    every rank in one decision record (:func:`follow` applies it on the others).
    ``submit`` waits for that boundary (one step at most) to answer as the engine does.
    Every broadcast and step runs under a :class:`Watchdog`; idle, an empty record goes out
    every quarter of its timeout, so the other ranks' waits stay bounded too."""

    def __init__(self, engine: Any, group: Any = None, *, watchdog: Watchdog | None = None) -> None:
        self.engine = engine
        self.group = mx.distributed.init() if group is None else group
        self.watchdog = watchdog or Watchdog(self.group)
        self._wake = threading.Condition()
        self._submissions: list[_Submission] = []
        self._cancels: list[str] = []
        self._budget: list[int | None] = []
        self._close = False
        #: Decision records sent and the seconds their broadcasts took (what deciding costs).
        self.records = 0
        self.record_seconds = 0.0

    def submit(self, request: Any, on_event: Callable[[Any], None] | None = None) -> Any:
        waiting = _Submission(request, on_event)
        with self._wake:
            self._submissions.append(waiting)
            self._wake.notify()
        waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error
        return waiting.stream

    def cancel(self, rid: str) -> bool:
        with self._wake:
            self._cancels.append(rid)
            self._wake.notify()
        return True

    def close_admissions(self) -> None:
        with self._wake:
            self._close = True
            self._wake.notify()

    def set_kv_budget(self, kv_budget: int | None) -> None:
        with self._wake:
            self._budget.append(kv_budget)
            self._wake.notify()

    def gauges(self) -> Any:
        return self.engine.gauges()

    def _pending(self) -> bool:
        return bool(self._submissions or self._cancels or self._budget or self._close)

    def serve_forever(self, stop: threading.Event) -> None:
        """Rank 0's engine loop: at each boundary, broadcast what changed and apply it, then
        step while there is work; idle, wait for a change (the other ranks wait in the
        broadcast; an empty record reaches them every quarter of the watchdog's timeout).
        Once ``stop`` is set and nothing is left, a last record stops them."""
        import time

        heartbeat = self.watchdog.timeout / 4
        while True:
            with self._wake:
                quiet = time.monotonic() + heartbeat
                while (
                    not self._pending()
                    and not self.engine.has_work()
                    and not stop.is_set()
                    and time.monotonic() < quiet
                ):
                    self._wake.wait(timeout=0.05)
                submissions, self._submissions = self._submissions, []
                cancels, self._cancels = self._cancels, []
                budgets, self._budget = self._budget, []
                close, self._close = self._close, False
            last = stop.is_set() and not submissions and not self.engine.has_work()
            record: dict[str, Any] = {
                "submit": [request_record(s.request) for s in submissions],
                "cancel": cancels,
                "close": close,
                "stop": last,
            }
            if budgets:
                record["kv_budget"] = budgets[-1]
            started = time.perf_counter()
            text = json.dumps(record)
            send = functools.partial(broadcast_text, text, group=self.group)
            _watched(self.watchdog, "a decision record", send)
            self.record_seconds += time.perf_counter() - started
            self.records += 1
            _apply(self.engine, record, submissions)
            if last:
                _watched(self.watchdog, "the acknowledgment of the last record", self._ended)
                return
            if self.engine.has_work():
                _watched(self.watchdog, "a step", self._step)

    def _step(self) -> None:
        self.engine.step_or_fail(fatal=(RankDivergenceError, RankLostError, RuntimeError))

    def _ended(self) -> None:
        _acknowledge_last(self.group)


def _acknowledge_last(group: Any) -> None:
    """Every rank's word that it received the last record. A peer's share of a collective
    can sit in the socket's buffer after the peer died, so a last record that went out
    proves nothing; a rank can only answer this after receiving it."""
    gathered_ints([], group)


def follow(engine: Any, group: Any = None, *, watchdog: Watchdog | None = None) -> None:
    """A rank other than 0 of a tensor-parallel group: apply rank 0's decision records to
    ``engine`` and step with it, until a record says stop; every wait and step under a
    :class:`Watchdog` (rank 0 sends an empty record at least every quarter of its timeout)."""
    made = mx.distributed.init() if group is None else group
    guard = watchdog or Watchdog(made)

    def step() -> None:
        engine.step_or_fail(fatal=(RankDivergenceError, RankLostError, RuntimeError))

    while True:
        receive = functools.partial(broadcast_text, None, group=made)
        text = _watched(guard, "waiting for rank 0's record", receive)
        record = json.loads(text)
        _apply(engine, record)
        if record["stop"]:
            _watched(
                guard, "the acknowledgment of the last record", lambda: _acknowledge_last(made)
            )
            return
        if engine.has_work():
            _watched(guard, "a step", step)
