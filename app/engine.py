"""A small continuous-batching engine built only on the kvrows contract.

It uses the row-layout table (``owned_cache_layout``, ``prefill_cache_layout``,
``publish_row``, ``filter_layout_rows``, ``row_admission``) and the layouts' own
``merge_rows`` / ``filter_rows`` / ``extract_row``; it never looks inside a storage.

Lifecycle of a request (``spec/engine.md``):

1. it arrives (at an engine step) and waits in FIFO order;
2. it is admitted while the projected KV bytes of the running rows plus its own fit
   the byte budget (a request that can never fit is refused at once; a running row is
   preempted only when the budget falls below the rows' reservations); its cache starts
   from the longest usable prefix in the prefix cache (LRU-bounded inside the budget);
3. it prefills in a cohort through the prefill layouts, a chunk per engine step (every
   cohort row advances by the same chunk, at most the shortest remaining prompt); when
   its prompt is done its prompt's KV is published to the prefix cache;
4. when its prompt is done it samples its first token and joins the decode layouts
   between steps; each step feeds every running row its last token;
5. it finishes on a stop token or ``max_tokens``; its row is published to the prefix
   cache (keyed by the tokens its KV covers) and leaves the batch.

The state lives on the engine and ``step`` advances it one boundary at a time
(``spec/engine.md`` §17): ``submit``, ``cancel`` and ``gauges`` are called from any thread,
``serve_forever`` steps in one, every request's tokens stream out as ``TokenEvent``s and
end with a ``FinishEvent``; ``run`` is the offline client.

With a ``kvrows.persist.prefix_store.PrefixStore`` the published rows are also saved to
disk (at a block boundary), and admission takes the longest usable prefix from memory
first, then from disk when the disk holds a longer one: rows survive a restart.

Under a scheme with a bf16-first boundary (``quantized_kv_start``, ``spec/engine.md`` §12) a
request's affine layers are legos; :func:`kvrows.maintenance.create_kv_maintenance` puts them in
delayed layouts (each row converts at its own ``start``), prefill chunks are cut at
``max_append_tokens`` so a row converts exactly where its solo run does, and every forward
over a delayed layout runs inside ``kvrows.app.attention.row_attention``.

With a ``draft_model`` the decode step is a speculative round (``spec/engine.md`` §11): the
draft proposes ``d`` tokens per row, the target runs one forward over ``[pending, drafts]``
through its verify layouts (``target_cache_layout``) inside a ``kvrows.speculative.RowRound``,
and each row keeps its longest matching prefix plus the target's own next token.

With ``paged=True`` (``spec/engine.md`` §14) every attention layer whose codec a block
pool stores keeps its rows in one ``BlockPool`` per layer, shared by every request: a
request's cache is a ``PagedKVCache`` into its layer's pool (a sliding-window layer's a
``PagedRotatingKVCache`` of its window, a chunked-local layer's a ``PagedChunkedKVCache``
of its chunk), its rows join the layouts by block table, and
nothing is copied when rows move (recurrent state keeps its own layouts). A finished row's
full blocks are registered (``register_prefix``) and stay cached until the pool needs
them; a new prompt takes the longest cached run of full blocks (at most ``len - 1``
tokens, the minimum over the paged layers), and a model with other layers (recurrent
state) takes a hit only where the ``PrefixCache`` (those layers' published serial copies)
can cut them to a length the pools cover. A paged ring's (or chunked layer's) pool takes
part as the others do within its window (its chunk): such a row registers its blocks while
it holds every position, and a hit is at most its window (``spec/engine.md`` §14). :class:`PagedLayers` keeps the pools and
answers what the engine asks; the engine keeps its loop.

Every model family's caches come from ``make_kvrows_cache`` and the engine asks only
capabilities: recurrent state (``StateWritten``) rolls back in verify rounds by replay
(``kvrows.app.models.check_speculative_rounds``); an MLA model's layer objects (the latent
drop-ins, ``DropInWrapper``) join their latent caches' layouts through the table, and a
prefix loaded from disk is put behind a drop-in again (``spec/engine.md`` §15); paged,
each latent layer gets a pool of its own form (``PagedForm``), and a layer of several
caches (``DropInParts``: falcon_h1's ``CacheList``) is paged part by part: its attention
part in its pool, its recurrent part contiguous (``spec/engine.md`` §16).
"""

from __future__ import annotations

import hashlib
import math
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from kvrows.app.attention import attention_scope, hookable_modules
from kvrows.app.models import check_speculative_rounds, forward, make_kvrows_cache
from kvrows.codecs import is_codec_spec, is_kv_codec, kv_codecs
from kvrows.compositions import placed_geometries
from kvrows.errors import (
    CapacityError,
    DrainingError,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    QueueFullError,
    never_fits_message,
    queue_full_message,
    queue_timeout_message,
)
from kvrows.maintenance import KvMaintenance, create_kv_maintenance
from kvrows.optimized import BlockPool
from kvrows.paged import DEFAULT_BLOCK_SIZE
from kvrows.persist.prefix_store import PrefixStore, reusable_copies, servable_prefixes
from kvrows.protocols import (
    BatchableCache,
    Cache,
    Converting,
    DropInParts,
    DropInWrapper,
    Handover,
    PagedForm,
    PagedRows,
    RingGeometry,
)
from kvrows.schemes import GeometrySpec, KvStorageScheme
from kvrows.speculative import RowRound
from kvrows.table import (
    RowAdmission,
    filter_layout_rows,
    owned_cache_layout,
    prefill_cache_layout,
    publish_row,
    row_admission,
    target_cache_layout,
)

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "PAGED_CODECS",
    "Engine",
    "EngineGauges",
    "EngineStats",
    "FinishEvent",
    "PagedLayers",
    "PrefilledRow",
    "PrefixCache",
    "Request",
    "RequestResult",
    "RequestStream",
    "StreamEvent",
    "TokenEvent",
    "model_fingerprint",
    "pageable",
]


#: The ``max_tokens`` of a request that does not say (admission reserves it, §3).
DEFAULT_MAX_TOKENS = 256

#: The fewest prompt tokens a row still prefilling must share with a waiting request,
#: beyond what the prefix cache covers, for the request to wait for that row's
#: publication (§3.1): below it, computing them beside it costs less than the wait.
PREFIX_WAIT_TOKENS = 32


@dataclass(frozen=True)
class Request:
    """One generation request (``spec/engine.md`` §1).

    ``arrival`` is the engine step an offline trace (``Engine.run``) makes it visible at;
    ``arrived_at`` the ``time.perf_counter()`` when a client sent it (``None``: when it is
    submitted), which time to first token and the queue timeout count from. ``top_p`` keeps
    the smallest set of tokens whose probability reaches it (1.0: off); ``stop`` token ids
    and ``stop_strings`` (matched on the detokenized completion) end the request."""

    rid: str
    prompt: tuple[int, ...]
    max_tokens: int = DEFAULT_MAX_TOKENS
    arrival: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    arrived_at: float | None = None


@dataclass
class RequestResult:
    """What one request produced, and how fast."""

    rid: str
    prompt_tokens: int
    admitted_step: int = -1
    tokens: list[int] = field(default_factory=list)
    logits: list[npt.NDArray[np.float32]] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    #: Of ``prefix_hit_tokens``, those loaded from the disk prefix store.
    store_hit_tokens: int = 0
    #: Seconds from arrival (``Request.arrived_at``, else when it was submitted) to the
    #: first sampled token.
    time_to_first_token: float = 0.0
    tokens_per_second: float = 0.0
    #: ``"stop"``, ``"length"``, ``"cancelled"``, ``"rejected"``, ``"error"``, or
    #: ``"prefilled"`` (a prefill-only submission, handed over: ``FinishEvent.prefilled``);
    #: empty while it runs.
    finish_reason: str = ""
    error: str | None = None
    #: Seconds from arrival to (first) admission: the wait in the queue.
    queue_seconds: float = 0.0
    #: The prompt chunks the model computed for this row, in order (after any prefix hit):
    #: a solo replay driven with the same cuts converts and rounds as the batch did.
    prefill_chunks: list[int] = field(default_factory=list)
    #: The detokenized completion (an engine with ``detokenize``), cut before a matched
    #: stop string.
    text: str = ""


@dataclass(frozen=True)
class TokenEvent:
    """Tokens a request produced at one step boundary, and the completion text they add
    (``""`` without a detokenizer; text that may be the start of a stop string is held back
    until it is not, and a last event with no tokens may release the rest)."""

    rid: str
    tokens: tuple[int, ...]
    text: str = ""


@dataclass
class PrefilledRow:
    """A request's row once its prompt is computed (``spec/engine.md`` §18): what a
    prefill-only submission hands over (``FinishEvent.prefilled``) and what
    ``submit(request, prefilled=...)`` admits straight into the decode batch.

    ``caches``: the per-layer serial caches holding the prompt's KV (its positions only);
    ``first_token``: the token sampled from the prompt's last position; ``prefill_chunks``
    and ``prefix_hit_tokens``: how the prompt was computed (a solo replay follows them);
    ``logits``: the first token's logits (float32), from an engine with ``keep_logits``."""

    caches: list[Any]
    first_token: int
    prefill_chunks: tuple[int, ...] = ()
    prefix_hit_tokens: int = 0
    logits: npt.NDArray[np.float32] | None = None


@dataclass(frozen=True)
class FinishEvent:
    """The last event of every stream: the request's result (and, for a prefill-only
    submission, its row: ``prefilled``)."""

    rid: str
    result: RequestResult
    prefilled: PrefilledRow | None = None


StreamEvent = TokenEvent | FinishEvent


class RequestStream:
    """The events of one submitted request, in order; thread-safe (the engine thread puts,
    any thread reads). Ends after its ``FinishEvent``."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self._events: queue.SimpleQueue[StreamEvent] = queue.SimpleQueue()
        self._ended = False

    def _put(self, event: StreamEvent) -> None:
        self._events.put(event)

    def next_event(self, timeout: float | None = None) -> StreamEvent | None:
        """The next event (waiting at most ``timeout`` seconds; ``None``: without bound);
        ``None`` when none came in time or the stream has ended."""
        if self._ended:
            return None
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(event, FinishEvent):
            self._ended = True
        return event

    def __iter__(self) -> Iterator[StreamEvent]:
        while (event := self.next_event()) is not None:
            yield event


@dataclass(frozen=True)
class EngineGauges:
    """A snapshot of a live engine (``Engine.gauges``); totals count since construction."""

    running: int
    waiting: int
    kv_bytes_held: int
    kv_budget: int | None
    prefix_cache_bytes: int
    prefix_hits: int
    prefix_hit_tokens: int
    store_hit_tokens: int
    generated_tokens: int
    preemptions: int
    requests_finished: int


@dataclass
class EngineStats:
    """Totals of one ``Engine.run``."""

    requests: int = 0
    generated: int = 0
    seconds: float = 0.0
    steps: int = 0
    #: The largest count of KV bytes the engine held (``nbytes`` of its layouts, the serial
    #: caches in transit and the prefix cache), sampled at step boundaries.
    peak_kv_bytes: int = 0
    #: The largest growth of MLX active memory over the run's non-KV baseline, sampled at
    #: the same points: what the KV state really occupies, views and pinned buffers included.
    peak_active_kv_bytes: int = 0
    kv_bytes_per_token: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    rejected: int = 0
    #: Prompt tokens the model computed in prefill chunks, and the seconds those took
    #: (evaluated, so the time is the work's).
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    #: Requests whose prefix came from the disk prefix store, and the tokens it gave.
    store_hits: int = 0
    store_hit_tokens: int = 0
    #: Seconds spent looking up and loading from the store, and saving to it.
    store_read_seconds: float = 0.0
    store_write_seconds: float = 0.0
    #: Rows saved to the store, and saves that failed (the engine runs on without them).
    store_writes: int = 0
    store_errors: int = 0
    #: Decode steps (one target forward each: a plain step or a speculative round), the
    #: rows they served (``Σ`` rows per step) and the tokens they produced (first tokens,
    #: sampled from the prefill, are not counted).
    target_forwards: int = 0
    row_forwards: int = 0
    decode_tokens: int = 0
    #: Speculative decoding: draft tokens proposed to rows that could take them, those the
    #: target accepted, and the draft model's forwards (prefills excluded).
    drafted: int = 0
    accepted: int = 0
    draft_forwards: int = 0
    #: The most rows (prefilling and decoding) the engine held at once.
    peak_rows: int = 0
    #: Rows preempted (their KV dropped, re-prefilled later) to stay inside the budget.
    preemptions: int = 0
    #: Steps a request was held back because a row still prefilling shares its prefix
    #: (``Engine(wait_for_prefix=True)``, ``spec/engine.md`` §3.1), summed over requests.
    prefix_waits: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (0 without a draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_row_forward(self) -> float:
        """Tokens one row gains per target forward: 1 without a draft."""
        return self.decode_tokens / self.row_forwards if self.row_forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0

    @property
    def prefill_seconds_per_token(self) -> float:
        """This run's measured prefill cost of one prompt token."""
        return self.prefill_seconds / self.prefill_tokens if self.prefill_tokens else 0.0

    def add(self, other: EngineStats) -> None:
        """Fold another run's totals into these (peaks take the larger)."""
        for entry in fields(self):
            if entry.name not in _NOT_SUMMED:
                setattr(self, entry.name, getattr(self, entry.name) + getattr(other, entry.name))
        self.peak_kv_bytes = max(self.peak_kv_bytes, other.peak_kv_bytes)
        self.peak_active_kv_bytes = max(self.peak_active_kv_bytes, other.peak_active_kv_bytes)
        self.peak_rows = max(self.peak_rows, other.peak_rows)
        self.kv_bytes_per_token = self.kv_bytes_per_token or other.kv_bytes_per_token


#: ``EngineStats`` fields ``add`` does not sum: peaks and a per-token constant.
_NOT_SUMMED = frozenset(
    {"peak_kv_bytes", "peak_active_kv_bytes", "peak_rows", "kv_bytes_per_token"}
)


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading tokens ``a`` and ``b`` share: a binary search over slice
    comparisons (C loops), since admission asks it of every waiting request and every
    prefilling row at each step, over prompts of thousands of tokens."""
    low, high = 0, min(len(a), len(b))
    if a[:high] == b[:high]:
        return high
    while high - low > 1:  # a[:low] == b[:low], a[:high] != b[:high]
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


class PrefixCache:
    """Published rows keyed by the tokens their KV covers; lookups return owned copies.

    ``max_bytes`` bounds the bytes the entries hold (``None``: unbounded): a publication
    beyond it evicts the least recently used entries (a lookup that takes an entry, or a
    publication, uses it); :meth:`evict_to` evicts down to any bound (the engine's budget)."""

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes
        #: Lookups scan in publication order (ties go to the first published).
        self._entries: dict[tuple[int, ...], list[Cache]] = {}
        #: Each entry's bytes, least recently used first.
        self._recency: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self._nbytes = 0
        #: Entries evicted so far.
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """Bytes the published caches hold."""
        return self._nbytes

    def publish(self, tokens: Sequence[int], caches: list[Cache]) -> None:
        if not tokens:
            return
        key = tuple(tokens)
        self._nbytes -= self._recency.pop(key, 0)
        size = sum(cache.nbytes for cache in caches)
        self._entries[key] = caches
        self._recency[key] = size
        self._nbytes += size
        if self.max_bytes is not None:
            self.evict_to(self.max_bytes)

    def evict_to(self, limit: int) -> int:
        """Evict least recently used entries until at most ``limit`` bytes are held;
        returns the bytes freed."""
        freed = 0
        while self._nbytes > limit and self._recency:
            key, size = self._recency.popitem(last=False)
            del self._entries[key]
            self._nbytes -= size
            freed += size
            self.evictions += 1
        return freed

    def matched(self, prompt: Sequence[int]) -> int:
        """The most leading tokens of ``prompt`` an entry covers (nothing copied; whether
        every layer can be cut there is the lookup's to say)."""
        tokens = tuple(prompt)
        return max((_common_prefix(key, tokens) for key in self._entries), default=0)

    def lookup(
        self, prompt: Sequence[int], *, limit: int | None = None
    ) -> tuple[int, list[Cache]] | None:
        """The longest usable prefix of ``prompt`` (leaving one token to compute; at most
        ``limit`` tokens), as copies; the entry it came from becomes the most recently
        used."""
        best: tuple[int, list[Cache]] | None = None
        used: tuple[int, ...] | None = None
        limit = len(prompt) - 1 if limit is None else min(limit, len(prompt) - 1)
        tokens = tuple(prompt)
        for key, caches in self._entries.items():
            usable = min(_common_prefix(key, tokens), limit)
            if usable <= 0 or (best is not None and usable <= best[0]):
                continue
            copies = reusable_copies(caches, usable)
            if copies is not None:
                best, used = (usable, copies), key
        if used is not None:
            self._recency.move_to_end(used)
        return best


# -- the paged option -------------------------------------------------------------------

#: The codec kinds a block pool stores: every registered KV codec (a pool builds its codec
#: from the spec through the implementation's codec registry).
PAGED_CODECS = frozenset(kv_codecs())
#: The token geometries a paged preset holds (growing, ring, chunked).
PAGED_GEOMETRIES = placed_geometries("paged")


def pageable(cache: Any) -> bool:
    """Whether a fresh serial cache's layer goes paged: a token geometry (full attention, a
    sliding window or chunked-local attention: a ring pages as a ``PagedRotatingKVCache``,
    a chunked layer as a ``PagedChunkedKVCache``) under a codec the pool stores; bf16-first
    legos and recurrent state (no KV codec) do not."""
    if isinstance(cache, Handover):
        return False
    geometry = getattr(cache, "token_geometry", None)
    codec = getattr(cache, "codec_spec", None)
    return (
        geometry is not None
        and geometry.kind in PAGED_GEOMETRIES
        and is_codec_spec(codec)
        and is_kv_codec(codec)
    )


def _capped_geometry(cache: Any) -> GeometrySpec | None:
    """A pageable slot's token geometry if a row of it holds at most ``cap()`` positions
    (a ring's window, a chunked layer's chunk), else ``None`` (growing)."""
    geometry: GeometrySpec | None = getattr(cache, "token_geometry", None)
    return geometry if geometry is not None and geometry.cap() is not None else None


def _in_pool(pool: Any, geometry: GeometrySpec | None) -> Any:
    """An empty paged cache of ``pool`` and ``geometry`` (``None``: a ``PagedKVCache``; a
    ring a ``PagedRotatingKVCache``, a chunked layer a ``PagedChunkedKVCache``)."""
    return pool._prefix_cache(geometry)


class PagedLayers:
    """The pools of an engine's paged layers and the prefix path over them.

    ``fresh``: a callable returning a request's fresh per-layer serial caches
    (``make_kvrows_cache``). A layer of several caches (a ``DropInParts``: falcon_h1's
    ``CacheList``) is paged part by part: its **slots** are its parts, any other layer is
    one slot. The paged slots are those :func:`pageable` says (or a ``PagedForm``), each
    with its own pool of ``block_size`` tokens per block (its codec and declared geometry);
    ``pools`` is per slot (``None``: not paged). A sliding-window slot (a ring) is a
    ``PagedRotatingKVCache`` of its model cache's ``max_size`` and ``keep`` in its pool, a
    chunked-local slot a ``PagedChunkedKVCache`` of its ``chunk_size``: each publishes its
    blocks only while its rows hold every position, and its hits are at most its window
    or chunk (``BlockPool.prefix_blocks`` of its geometry), so a model with such layers
    takes hits no longer than the shortest."""

    def __init__(self, fresh: Callable[[], list[Any]], *, block_size: int = DEFAULT_BLOCK_SIZE):
        self._fresh = fresh
        template = fresh()
        #: The layers' forms: a layer of several caches regroups its slots (``regroup``).
        self._template = template
        slots = _slots_of(template)
        #: Per slot, what a pool's cache becomes as the model takes it (a drop-in's form).
        self._forms: list[Callable[[Any], Any]] = [
            cache.rewrap if isinstance(cache, DropInWrapper) else _as_is for cache in slots
        ]
        self.pools: list[Any] = []
        #: Per slot, the token geometry of a paged slot whose rows hold at most ``cap()``
        #: positions (a ring, a chunked layer; ``None``: growing or not paged).
        self.capped: list[GeometrySpec | None] = []
        for cache in slots:
            self.capped.append(None if isinstance(cache, PagedForm) else _capped_geometry(cache))
            if isinstance(cache, PagedForm):  # a form with its own pools (MLA latents)
                self.pools.append(cache.paged_pool(block_size))
            elif pageable(cache):
                self.pools.append(
                    BlockPool(cache.codec_spec, block_size=block_size, geometry=cache.geometry)
                )
            else:
                self.pools.append(None)
        if not any(pool is not None for pool in self.pools):
            raise InvalidInputError(
                "paged: the model has no attention layer under a codec a block pool "
                f"stores ({', '.join(sorted(PAGED_CODECS))}) and no latent layer"
            )
        self.block_size = block_size
        #: Whether some slot is not paged (rings, recurrent state): its prefix hits come
        #: from the engine's ``PrefixCache``.
        self.mixed = not all(pool is not None for pool in self.pools)

    # -- caches ----------------------------------------------------------------------------
    def caches(self) -> list[Any]:
        """A request's fresh caches: paged slots as empty ``PagedKVCache``s of their pool
        (a slot with a paged form of its own: that form in its pool)."""
        out: list[Any] = []
        slots = _slots_of(self._fresh())
        for cache, pool, geometry in zip(slots, self.pools, self.capped, strict=True):
            if pool is None:
                out.append(cache)
            elif isinstance(cache, PagedForm):
                out.append(cache.in_pool(pool))
            else:
                out.append(_in_pool(pool, geometry))
        return _regrouped(out, self._template)

    def probe_caches(self, caches: Sequence[Any]) -> list[Any]:
        """``caches`` (fresh serial ones) with their paged slots in private pools: a probe
        that leaves the shared pools untouched."""
        slots = [
            _probe_cache(cache, pool, geometry, self.block_size)
            for cache, pool, geometry in zip(
                _slots_of(caches), self.pools, self.capped, strict=True
            )
        ]
        return _regrouped(slots, self._template)

    # -- the prefix path -------------------------------------------------------------------
    def _paged_pools(self) -> list[Any]:
        return [pool for pool in self.pools if pool is not None]

    def _geometries(self) -> list[Any]:
        """Per paged slot, the token geometry its hits take (a ring's window, a chunked
        layer's chunk, else growing: ``None``)."""
        return [
            geometry
            for pool, geometry in zip(self.pools, self.capped, strict=True)
            if pool is not None
        ]

    def hit_blocks(self, prompt: Sequence[int]) -> list[list[int]]:
        """Per paged slot, the cached blocks the prompt's longest usable prefix would take
        (capped at ``len(prompt) - 1`` tokens and a ring's window; read only, nothing
        taken), cut to the slots' common length."""
        found = [
            pool.prefix_blocks(list(prompt), geometry)
            for pool, geometry in zip(self._paged_pools(), self._geometries(), strict=True)
        ]
        common = min((len(blocks) for blocks in found), default=0)
        return [blocks[:common] for blocks in found]

    def shared_credit(self, prompt: Sequence[int]) -> int:
        """Bytes of the prompt's prefix blocks that live tables already hold (so a running
        row's reservation counts them): what admission need not count twice."""
        credit = 0
        for pool, blocks in zip(self._paged_pools(), self.hit_blocks(prompt), strict=True):
            held = sum(1 for b in blocks if pool.ledger.ref(b) > 0)
            if held:  # a pool that has held nothing may not know its geometry yet
                credit += held * pool.bytes_per_block
        return credit

    def lookup(
        self, prompt: Sequence[int], others: Callable[[int], tuple[int, list[Cache]] | None]
    ) -> tuple[int, list[Any]] | None:
        """The longest usable prefix: ``(tokens, caches)`` whose paged slots reference
        cached blocks (nothing copied) and, in a mixed model, whose other slots are the
        copies ``others(limit)`` returns (the ``PrefixCache``'s lookup over those slots,
        at most ``limit`` tokens, in slot order); ``None`` on a miss."""
        common = len(self.hit_blocks(prompt)[0]) * self.block_size
        if common == 0:
            return None
        fed = common
        copies: list[Cache] = []
        if self.mixed:
            found = others(common)
            if found is None:
                return None
            fed, copies = found
            if fed < common and any(
                g is not None and g.wraps and common >= (g.cap() or 0) for g in self.capped
            ):
                return None  # a ring's hit of its whole window cannot be cut (not trimmable)
        rest = iter(copies)
        slots: list[Any] = []
        geometries = iter(self._geometries())
        for pool, form in zip(self.pools, self._forms, strict=True):
            if pool is None:
                slots.append(next(rest))
                continue
            hit = form(pool.lookup_prefix(list(prompt[: common + 1]), next(geometries)))
            assert hit is not None and hit.offset == common
            if fed < common:
                hit.trim(common - fed)  # a partial tail stays shared: copied on its next write
            slots.append(hit)
        return fed, _regrouped(slots, self._template)

    def _register(
        self,
        slots: Sequence[Any],
        covered: Sequence[int],
        register: Callable[[Any, list[int]], int | None],
    ) -> None:
        """``register(slot, ids)`` in every slot, the capped ones (rings, chunked layers)
        first: the other slots register no more whole blocks than every capped one did (a
        hit needs every layer's prefix, so their blocks past a ring's would never be hit:
        they would only stay cached)."""
        tokens = list(covered)
        rings = [i for i, geometry in enumerate(self.capped) if geometry is not None]
        others = [i for i, geometry in enumerate(self.capped) if geometry is None]
        for i in rings:
            count = register(slots[i], tokens)
            if count is not None:
                tokens = tokens[: count * self.block_size]
        for i in others:
            register(slots[i], tokens)

    def publish_rows(self, layouts: Sequence[Any], row: int, covered: Sequence[int]) -> None:
        """Register row ``row``'s full blocks of ``covered`` in each paged slot's pool."""

        def register(slot: Any, tokens: list[int]) -> int | None:
            layout = _behind(slot)
            if (
                isinstance(layout, PagedRows)
                and isinstance(layout, BatchableCache)
                and layout.batch_size > row
            ):
                return layout.register_prefix(row, tokens)
            return None

        self._register(_slots_of(layouts), covered, register)

    def publish_serial(self, caches: Sequence[Any], covered: Sequence[int]) -> None:
        """Register a serial row's full blocks (a row that finished on its first token; a
        latent cache is its own one-row layout)."""

        def register(slot: Any, tokens: list[int]) -> int | None:
            cache = _behind(slot)
            if not isinstance(cache, PagedRows):
                return None
            if isinstance(cache, BatchableCache):
                return cache.register_prefix(0, tokens) if cache.batch_size == 1 else None
            serial: Any = cache  # a serial paged cache: ``rows`` is its batch rows
            return int(serial.register_prefix(tokens)) if serial.rows == 1 else None

        self._register(_slots_of(caches), covered, register)

    def layer_pools(self) -> list[Any]:
        """Per layer, the pool a received row's paged cache is written into
        (``recv_caches(..., pools=...)``): ``None`` for a layer that is not paged, and for
        a layer of several caches or a form of its own (the engine places those parts when
        the row is admitted, :meth:`Engine._placed`)."""
        out: list[Any] = []
        slot = 0
        for layer in self._template:
            if isinstance(layer, DropInParts):
                out.append(None)
                slot += len(layer.parts)
                continue
            pool = self.pools[slot]
            out.append(None if isinstance(layer, PagedForm) else pool)
            slot += 1
        return out

    def unpaged_layers(self, caches: Sequence[Any]) -> list[Any]:
        """The slots of ``caches`` that are not paged (what the ``PrefixCache`` keeps of a
        mixed model's row: a layer of several caches gives its unpaged parts)."""
        return [c for c, pool in zip(_slots_of(caches), self.pools, strict=True) if pool is None]

    # -- bytes -----------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """KV bytes the pools hold: blocks live tables reference, each counted once, and
        cached free blocks (the prefix cache's share)."""
        return sum(
            pool.ledger.held_count * pool.bytes_per_block
            for pool in self._paged_pools()
            if pool.geometry is not None
        )

    def cached_bytes(self) -> int:
        """KV bytes of the pools' cached free blocks: the prefix cache's share of the pools
        (no live table holds them; a later prompt may)."""
        total = 0
        for pool in self._paged_pools():
            if pool.geometry is None:
                continue
            ledger = pool.ledger
            referenced = ledger.num_blocks - ledger.free_count
            total += (ledger.held_count - referenced) * pool.bytes_per_block
        return total

    def evict_cached(self, excess: int) -> int:
        """Forget cached free blocks, least recently used first, until ``excess`` bytes are
        freed or none is left: the same count from every pool (each layer caches the same
        prefixes); returns the bytes freed."""
        pools = [pool for pool in self._paged_pools() if pool.geometry is not None]
        per_round = sum(pool.bytes_per_block for pool in pools)
        if excess <= 0 or per_round == 0:
            return 0
        count = -(-excess // per_round)
        freed = 0
        for pool in pools:
            freed += pool.ledger.evict_cached(count) * pool.bytes_per_block
        return freed

    @staticmethod
    def unpaged_bytes(caches: Iterable[Any]) -> int:
        """``nbytes`` of the caches and layouts that are not paged (the pools count those;
        a layer of several caches counts its unpaged parts), and what paged ones hold
        outside their pools (``beside_nbytes``: warm rows beside it, a decoded window)."""
        held = 0
        for cache in _slots_of(caches):
            inner = _behind(cache)
            if isinstance(inner, PagedRows):
                held += int(getattr(inner, "beside_nbytes", 0))
            else:
                held += cache.nbytes
        return held


def _probe_cache(cache: Any, pool: Any, geometry: GeometrySpec | None, block_size: int) -> Any:
    """A paged slot's probe cache in a private pool (the shared pools stay untouched)."""
    if pool is None:
        return cache
    if isinstance(cache, PagedForm):
        return cache.in_pool(cache.paged_pool(block_size))
    private = BlockPool(pool.codec_spec, block_size=block_size, geometry=pool.geometry)
    return _in_pool(private, geometry)  # the shared pool's codec and block size: it joins


def _as_is(cache: Any) -> Any:
    return cache


def _behind(cache: Any) -> Any:
    """The cache behind a drop-in (the one that holds the blocks), else ``cache``."""
    return cache.wrapped if isinstance(cache, DropInWrapper) else cache


def _signatures_of(cache: Cache) -> frozenset[str]:
    """The signatures a stored layer may have to stand in for a fresh ``cache``: its own,
    and for a bf16-first lego also its converted storage's."""
    if isinstance(cache, Handover):
        signatures: frozenset[str] = cache.composed.storage_signatures()
        return signatures
    return frozenset({cache.signature()})


def _fits(caches: Sequence[Cache], signatures: Sequence[frozenset[str]]) -> bool:
    return len(caches) == len(signatures) and all(
        cache.signature() in allowed for cache, allowed in zip(caches, signatures, strict=True)
    )


def model_fingerprint(model: Any, scheme: KvStorageScheme) -> str:
    """A digest naming a model and a storage scheme, to seed a ``PrefixStore``.

    It covers the model's class and config, the per-layer cache signatures under
    ``scheme``, and every parameter's name, shape, dtype and up to 256 values spread over
    it (hashing every weight of a large checkpoint would cost seconds per GB)."""
    from mlx.utils import tree_flatten

    digest = hashlib.sha256()
    digest.update(f"{type(model).__module__}.{type(model).__qualname__}\n".encode())
    args = getattr(model, "args", None)
    if args is not None and hasattr(args, "__dict__"):
        digest.update(repr(sorted(vars(args).items(), key=lambda kv: kv[0])).encode())
    signatures = [cache.signature() for cache in make_kvrows_cache(model, scheme)]
    digest.update(f"{scheme.name}|{'|'.join(signatures)}\n".encode())
    parameters = tree_flatten(model.parameters(), destination={})
    assert isinstance(parameters, dict)
    for name, array in sorted(parameters.items()):
        flat = array.reshape(-1)
        sample = flat[:: max(1, flat.size // 256)]
        if sample.dtype == mx.bfloat16:
            sample = sample.view(mx.uint16)
        digest.update(f"{name}|{array.dtype}|{tuple(array.shape)}|".encode())
        digest.update(np.array(sample).tobytes())
    return f"{scheme.name}:{digest.hexdigest()}"


@dataclass(eq=False)
class _Row:
    """A request's row while it is admitted (prefilling or decoding). Compared by identity."""

    request: Request
    result: RequestResult
    caches: list[Cache]
    fed: int
    key: mx.array
    #: When the request arrived (``perf_counter``): time to first token counts from it.
    arrived_at: float
    #: What prefill feeds: the prompt; after a preemption, the prompt and every token read
    #: so far (the row recomputes its KV and samples on from there).
    context: tuple[int, ...] = ()
    first_at: float = 0.0
    next_input: int = 0
    #: Tokens sampled for the row, read or still in flight (pipelined decode reads them one
    #: step late): ``sampled - 1`` decode steps have fed its KV.
    sampled: int = 0
    #: Pipelined decode: a stop token was read for the row (it leaves at the next boundary;
    #: tokens sampled for it after the stop are dropped).
    stopped: bool = False
    #: The row has left every layout (its KV is released or published).
    left: bool = False
    #: Preempted: tokens still in flight for this row object are dropped (its request
    #: resumes in a new row).
    gone: bool = False
    #: Admission order (preemption takes the newest rows first).
    order: int = 0
    #: Admitted with its prompt computed elsewhere (``submit(prefilled=...)``): it joins
    #: the decode batch at once.
    arrived: bool = False
    #: A prefill-only submission: its caches are handed over when its prompt is done.
    prefill_only: bool = False


@dataclass(eq=False)
class _Entry:
    """A submitted request until its ``FinishEvent``: its stream, its result and, while it
    is admitted, its row."""

    request: Request
    result: RequestResult
    stream: RequestStream
    on_event: Callable[[StreamEvent], None] | None
    arrived_at: float
    row: _Row | None = None
    admissions: int = 0
    #: ``result.tokens`` already sent in ``TokenEvent``s.
    emitted: int = 0
    text: _CompletionText | None = None
    #: The engine thread: the row leaves at the next boundary (a stop string matched, or a
    #: cancel) and finishes then.
    removal: bool = False
    #: Set under the engine's lock by ``cancel``.
    cancel_requested: bool = False
    first_at: float = 0.0
    finished: bool = False
    #: ``submit(prefill_only=True)``: the row stops after its first token and hands over.
    prefill_only: bool = False
    #: ``submit(prefilled=...)``: the row that arrives prefilled (until its admission).
    prefilled: PrefilledRow | None = None
    #: What a prefill-only row hands over (its ``FinishEvent.prefilled``).
    handoff: PrefilledRow | None = None


class _CompletionText:
    """A row's completion text, detokenized incrementally, and its stop strings.

    Each token decodes a short window (the tokens since the last text boundary), never the
    whole completion: the text grows by what the window adds once it does not end in an
    incomplete character (``\ufffd``). Only the text's tail that a new character can
    complete is searched for the stop strings, and text that may be the start of one is
    held back from the events until it is not."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str], stops: Sequence[str]):
        self._detokenize = detokenize
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._tokens: list[int] = []
        #: ``_tokens[_start:_read]`` decode to ``_before``, the tail of ``text``.
        self._start = 0
        self._read = 0
        self._before = ""
        self.text = ""
        self._sent = 0
        self._searched = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Take one token; whether a stop string is now matched (``text`` is then cut
        before it)."""
        self._tokens.append(token)
        window = self._detokenize(self._tokens[self._start :])
        # A trailing U+FFFD may be a character still incomplete; past 4 tokens (a UTF-8
        # character's most bytes) it is not, and the text moves on.
        pending = len(self._tokens) - self._read
        if len(window) <= len(self._before) or (window.endswith("\ufffd") and pending < 4):
            return False
        self._grow(window)
        return self._match()

    def _grow(self, window: str) -> None:
        self.text += window[len(self._before) :]
        self._start, self._read = self._read, len(self._tokens)
        self._before = self._detokenize(self._tokens[self._start : self._read])

    def _match(self) -> bool:
        if not self._stops:
            return False
        start = max(0, self._searched - self._longest + 1)
        found = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        self._searched = len(self.text)
        if not found:
            return False
        self.text = self.text[: min(found)]
        self.stopped = True
        return True

    def release(self) -> str:
        """The text not sent yet that cannot be the start of a stop string."""
        end = len(self.text)
        if not self.stopped:
            for size in range(min(self._longest - 1, len(self.text)), 0, -1):
                tail = self.text[-size:]
                if any(stop.startswith(tail) for stop in self._stops):
                    end -= size
                    break
        out, self._sent = self.text[self._sent : end], max(self._sent, end)
        return out

    def finish(self) -> str:
        """The rest, at the end: the last window however it ends, then everything unsent."""
        if not self.stopped and self._read < len(self._tokens):
            window = self._detokenize(self._tokens[self._start :])
            if len(window) > len(self._before):
                self._grow(window)
                self._match()
        self.stopped = True
        return self.release()


@dataclass
class _Flight:
    """One pipelined decode step whose tokens are not read yet: the rows it served (its
    batch order), their sampled tokens ``[B]`` and, with ``keep_logits``, the logits
    ``[B, vocab]`` (float32), all on the device, evaluation started (``mx.async_eval``)."""

    rows: list[_Row]
    tokens: mx.array
    logits: mx.array | None


class Engine:
    """Continuous batching over one mlx-lm model with kvrows caches under one scheme."""

    def __init__(
        self,
        model: Any,
        scheme: KvStorageScheme | None = None,
        *,
        max_batch: int = 8,
        kv_budget: int | None = None,
        prefill_chunk: int = 64,
        keep_logits: bool = False,
        use_prefix_cache: bool = True,
        prefix_store: PrefixStore | None = None,
        progress: bool = False,
        draft_model: Any = None,
        draft_tokens: int = 3,
        pipelined: bool = True,
        paged: bool = False,
        block_size: int = DEFAULT_BLOCK_SIZE,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        max_waiting: int | None = None,
        queue_timeout: float | None = None,
        prefix_cache_bytes: int | None = None,
        step_guard: Callable[[int, Sequence[str], Sequence[int]], None] | None = None,
        store_agreement: Callable[[int], int] | None = None,
        wait_for_prefix: bool = True,
    ) -> None:
        if max_batch < 1 or prefill_chunk < 1:
            raise InvalidInputError("max_batch and prefill_chunk must be >= 1")
        for name, bound in (
            ("kv_budget", kv_budget),
            ("max_waiting", max_waiting),
            ("prefix_cache_bytes", prefix_cache_bytes),
        ):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
                raise InvalidInputError(f"{name} must be an integer or None, got {bound!r}")
            if bound is not None and bound < 0:
                raise InvalidInputError(f"{name} must be >= 0, got {bound}")
        if queue_timeout is not None and not queue_timeout > 0:
            raise InvalidInputError(f"queue_timeout must be > 0 seconds, got {queue_timeout!r}")
        if draft_model is not None:
            if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int):
                raise InvalidInputError(f"draft_tokens must be an integer, got {draft_tokens!r}")
            if draft_tokens < 1:
                raise InvalidInputError(
                    f"draft_tokens must be >= 1 with a draft, got {draft_tokens}"
                )
            vocabularies = {_vocabulary(m) for m in (model, draft_model)}
            if len(vocabularies) != 1:
                sizes = ", ".join(sorted(map(str, vocabularies)))
                raise InvalidInputError(
                    f"the draft's vocabulary differs from the target's: sizes {sizes}"
                )
            for each in (model, draft_model):  # recurrent layers roll back by replay
                check_speculative_rounds(each)
        maintenance = create_kv_maintenance(scheme or KvStorageScheme())
        if maintenance.converts_later and max_batch > 1:
            for each in (model, draft_model):
                if each is not None and not hookable_modules(each):
                    raise InvalidInputError(
                        f"scheme {maintenance.scheme.name}: {type(each).__name__} does not "
                        "call mlx-lm's scaled_dot_product_attention, so rows that convert at "
                        "their own quantized_kv_start cannot attend together; run without a "
                        "start (no --kv-start) or with max_batch 1"
                    )
        self.model = model
        self.scheme = scheme or KvStorageScheme()
        self.maintenance = maintenance
        self.max_batch = max_batch
        self.kv_budget = kv_budget
        self.prefill_chunk = prefill_chunk
        #: Called at the end of every step with the step, the admitted rows' ids and their
        #: positions (prompt tokens fed plus decode steps), in batch order: tensor
        #: parallelism's divergence guard (``kvrows.app.distributed.check_in_step``).
        self.step_guard = step_guard
        #: Engines that must decide alike (tensor-parallel ranks, each with its own store
        #: entries): given this engine's disk-store hit in tokens, the hit every engine
        #: takes (the smallest); called once or twice per lookup, on every engine alike.
        self.store_agreement = store_agreement
        self.keep_logits = keep_logits
        self.prefix_cache = PrefixCache(prefix_cache_bytes) if use_prefix_cache else None
        #: The bound of the in-memory prefix cache (its entries and, paged, the pools'
        #: cached free blocks), inside ``kv_budget`` (``None``: only the budget bounds it).
        self.prefix_cache_bytes = prefix_cache_bytes
        #: Hold a request back while a row still prefilling shares at least
        #: ``PREFIX_WAIT_TOKENS`` more of its prompt than the prefix cache covers: it is
        #: admitted once that row publishes, and reuses its prefix instead of computing it
        #: again beside it (``spec/engine.md`` §3.1). Only where prompts are published as
        #: they finish (not under a bf16-first scheme: its rows publish when they leave).
        self.wait_for_prefix = (
            bool(wait_for_prefix) and use_prefix_cache and not maintenance.converts_later
        )
        #: Whether a published row serves a part of its prompt (every layer can be cut: no
        #: ring past its window, no recurrent state); learned from the first prompt
        #: published (``None`` until then), and waiting stops where it cannot help.
        self._partial_reuse: bool | None = None
        self.detokenize = detokenize
        self.max_waiting = max_waiting
        self.queue_timeout = queue_timeout
        self.prefix_store = prefix_store
        self.progress = progress
        self.draft_model = draft_model
        self.draft_tokens = draft_tokens
        #: Decode steps overlap (``spec/engine.md`` §6.1): step t+1's graph is built while
        #: step t evaluates and tokens are read one step late. ``False``: every step is
        #: evaluated and read before the next (the synchronous oracle). Speculative rounds
        #: (a draft model) read their verdict every round: they always run synchronously.
        self.pipelined = bool(pipelined)
        #: The paged option (``spec/engine.md`` §14): one block pool per attention layer
        #: (rings included), shared by every request; ``None``: contiguous layouts.
        self.paged: PagedLayers | None = None
        if paged:
            if maintenance.converts_later:
                raise InvalidInputError(
                    f"scheme {maintenance.scheme.name}: a bf16-first start (quantized_kv_start) "
                    "has no paged layout; run paged without --kv-start"
                )
            self.paged = PagedLayers(
                lambda: make_kvrows_cache(model, self.scheme), block_size=block_size
            )
        #: Paged admission: per running request, the bytes of its prefix blocks that other
        #: rows held when it was admitted (counted once: by them); reset when a row leaves.
        self._shared_credit: dict[str, int] = {}
        self.admission = self._admission(model)
        self.draft_admission = None if draft_model is None else self._admission(draft_model)
        #: ``_full_bytes`` by row length (the admission layouts never change).
        self._full_bytes_at: dict[int, int] = {}
        #: Per stored cache (a layer, or each part of a layer of several caches: the store
        #: saves parts), the signatures a loaded one may have.
        self._signatures = [
            _signatures_of(c) for c in _slots_of(make_kvrows_cache(model, self.scheme))
        ]
        #: Per slot, the signatures a prefilled row's cache may have: this engine's fresh
        #: caches' (paged slots: their paged form).
        self._row_signatures = [_signatures_of(c) for c in _slots_of(self._fresh_caches())]
        self._stats = EngineStats()
        self._init_online()

    def _admission(self, model: Any) -> RowAdmission:
        """Projected bytes per row of ``model``, from the running batch's layouts of fresh
        caches (``_new_layouts`` of ``prepare_batch``: delayed layouts under a bf16-first
        scheme).

        ``make_kvrows_cache`` declares the KV geometry, so the layouts answer without a
        token; where a storage does not know it yet (the model's config does not say, or
        the storage cannot take a declaration), one probe token runs through the model.
        """
        caches = (
            self._fresh_caches() if model is self.model else make_kvrows_cache(model, self.scheme)
        )
        layouts = self._new_layouts(self.maintenance.prepare_batch(caches), prefill=False)
        admission = row_admission(layouts)
        assert admission is not None
        try:
            admission.bytes(1)
        except LayoutStateError:
            probe = make_kvrows_cache(model, self.scheme)
            if model is self.model and self.paged is not None:
                probe = self.paged.probe_caches(probe)
            model(mx.array([[0]]), cache=probe)
            for layout, cache in zip(layouts, probe, strict=True):
                layout.merge_rows([cache])
        return admission

    def _new_layouts(self, prepared: Sequence[Any], *, prefill: bool) -> list[BatchableCache]:
        """Layouts for one request's prepared caches (``prepare_prefill`` /
        ``prepare_batch``): a delayed layout is its own (it holds the row already); other
        layers get the prefill layout, or the decode layout (the verify layout with a draft
        model, whose rounds run there)."""
        out: list[BatchableCache] = []
        for cache in prepared:
            layout: BatchableCache | None
            if isinstance(cache, Converting):
                layout = cache
            elif self.maintenance.converts_later:
                # Beside delayed layouts (the verify layouts with per-row stages), the other
                # layers take the verify layouts too: a model that builds one mask from
                # one layer for all its sliding-window layers (gemma3) needs every ring
                # layer to hold its rows at the same physical columns.
                layout = target_cache_layout(cache)
            elif prefill:
                layout = prefill_cache_layout(cache)
            elif self.draft_model is not None:
                layout = target_cache_layout(cache)
            else:
                layout = owned_cache_layout(cache)
            if layout is None:
                raise InvalidInputError(f"{cache.signature()} joins no row layout")
            out.append(layout)
        return out

    def projected_bytes(self, request: Request) -> int:
        """The row's KV bytes at its longest (the draft's rows included). Paged: whole
        blocks, less the prefix blocks other running rows hold (counted once, by them)."""
        tokens = len(request.prompt) + request.max_tokens
        draft = 0 if self.draft_admission is None else self.draft_admission.most_bytes(tokens)
        credit = 0
        if self.paged is not None:
            credit = self._shared_credit.get(request.rid, -1)
            if credit < 0:  # not admitted yet: what its lookup would share now
                credit = self.paged.shared_credit(request.prompt)
        return self.admission.most_bytes(tokens) + draft - credit

    def receiving_pools(self) -> list[Any] | None:
        """Per layer, the block pool a prefilled row's paged cache should be received into
        (``kvrows.persist.transfer.recv_caches(..., pools=...)``), so it arrives in this
        engine's pools and is admitted without a copy; ``None`` for a contiguous engine."""
        return None if self.paged is None else self.paged.layer_pools()

    def _fresh_caches(self) -> list[Cache]:
        """A request's fresh per-layer caches (paged layers: empty caches of their pool)."""
        if self.paged is not None:
            return self.paged.caches()
        return make_kvrows_cache(self.model, self.scheme)

    def _held_kv_bytes(self, caches: Sequence[Cache]) -> int:
        """``Σ nbytes`` of layouts and caches; paged layers are counted by their pools
        (a block shared by several tables once, cached free blocks included)."""
        if self.paged is None:
            return sum(c.nbytes for c in caches)
        return self.paged.unpaged_bytes(caches) + self.paged.held_bytes()

    # -- the online engine (spec/engine.md §17) --------------------------------------------
    def _init_online(self) -> None:
        """The engine state ``step`` advances: the waiting queue, the cohort and the running
        batch with their layouts, the draft's layouts, the pipeline, and the streams."""
        #: ``submit``, ``cancel``, ``gauges`` and ``set_kv_budget`` take the lock from any
        #: thread; ``step`` runs in one thread and takes it only to touch what they share
        #: (the queue, the cancels, the live requests, the gauges).
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._live: dict[str, _Entry] = {}
        self._waiting: list[_Entry] = []
        self._cancels: list[_Entry] = []
        self._draining = False
        self._budget_change: tuple[int | None] | None = None
        # The engine thread's own state.
        self._cohort: list[_Row] = []
        self._cohort_layouts: list[BatchableCache] = []
        self._running: list[_Row] = []
        self._decode_layouts: list[BatchableCache] = []
        self._drafter = None if self.draft_model is None else _Drafter(self, self.draft_model)
        self._pipeline = _Pipeline(self) if self.pipelined and self._drafter is None else None
        #: Pipelined: the batch changed since the last evaluated boundary.
        self._changed = False
        #: Admitted requests not finished yet (their events are sent at each boundary), and
        #: rows that leave at the next boundary (a stop string, a cancel).
        self._streaming: list[_Entry] = []
        self._removals: list[_Entry] = []
        self._step = 0
        self._admissions = 0
        #: Memory that is not KV state (``peak_active_kv_bytes``): set by ``run``.
        self._baseline = mx.get_active_memory()
        #: Gauges: written at step boundaries under the lock, read by ``gauges``.
        self._gauge = {
            "running": 0,
            "kv_bytes_held": 0,
            "prefix_cache_bytes": 0,
            "prefix_hits": 0,
            "prefix_hit_tokens": 0,
            "store_hit_tokens": 0,
            "generated_tokens": 0,
            "preemptions": 0,
            "requests_finished": 0,
        }

    def submit(
        self,
        request: Request,
        on_event: Callable[[StreamEvent], None] | None = None,
        *,
        prefill_only: bool = False,
        prefilled: PrefilledRow | None = None,
    ) -> RequestStream:
        """Queue ``request``; thread-safe. Its events (``TokenEvent``s, then one
        ``FinishEvent``) go to the returned stream and, from the engine thread, to
        ``on_event``. Raises ``InvalidInputError`` (a bad request, the rid of a live one),
        ``CapacityError`` (a request that can never fit), ``QueueFullError``
        (``max_waiting`` requests wait) or ``DrainingError`` (``close_admissions``).

        Disaggregated prefill (``spec/engine.md`` §18): ``prefill_only`` computes the
        prompt (prefix cache included), samples the first token and stops there: the row's
        caches go out in its ``FinishEvent.prefilled`` (``finish_reason`` ``"prefilled"``)
        instead of decoding; ``prefilled``, a row computed that way (here or in another
        process), is admitted under the same rules as any request and joins the decode
        batch at once, its first token already sampled."""
        return self._submit(
            request, on_event, bounded=True, prefill_only=prefill_only, prefilled=prefilled
        ).stream

    def _submit(
        self,
        request: Request,
        on_event: Callable[[StreamEvent], None] | None = None,
        *,
        bounded: bool,
        prefill_only: bool = False,
        prefilled: PrefilledRow | None = None,
    ) -> _Entry:
        self._validate(request)
        if prefill_only and prefilled is not None:
            raise InvalidInputError(
                f"request {request.rid}: a prefilled row is not computed again (prefill_only)"
            )
        if prefilled is not None:
            self._check_prefilled(request, prefilled)
        if prefill_only:  # the row holds its prompt and stops at its first token
            request = replace(request, max_tokens=1, stop=frozenset(), stop_strings=())
        self._check_fits(request)
        now = time.perf_counter()
        result = RequestResult(request.rid, len(request.prompt))
        entry = _Entry(
            request,
            result,
            RequestStream(request.rid),
            on_event,
            now if request.arrived_at is None else request.arrived_at,
            prefill_only=prefill_only,
            prefilled=prefilled,
        )
        if self.detokenize is not None and not prefill_only:
            entry.text = _CompletionText(self.detokenize, request.stop_strings)
        with self._lock:
            if self._draining:
                raise DrainingError(
                    f"request {request.rid}: the engine is draining and takes no new request"
                )
            if request.rid in self._live:
                raise InvalidInputError(f"request {request.rid}: a live request has that rid")
            waiting = len(self._waiting)
            if bounded and self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFullError(queue_full_message(request.rid, waiting), self._retry_after())
            self._live[request.rid] = entry
            self._waiting.append(entry)
            self._wake.notify_all()
        return entry

    def _validate(self, request: Request) -> None:
        rid = request.rid
        if not request.prompt:
            raise InvalidInputError(f"request {rid} has an empty prompt")
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int):
            raise InvalidInputError(f"request {rid}: max_tokens must be an integer")
        if request.max_tokens < 1:
            raise InvalidInputError(f"request {rid} asks for no tokens")
        if not request.temperature >= 0 or math.isinf(request.temperature):
            raise InvalidInputError(
                f"request {rid}: temperature must be finite and >= 0, got {request.temperature}"
            )
        if not 0 < request.top_p <= 1:
            raise InvalidInputError(f"request {rid}: top_p must be in (0, 1], got {request.top_p}")
        if request.stop_strings and self.detokenize is None:
            raise InvalidInputError(
                f"request {rid} has stop strings, and the engine has no detokenize to match them on"
            )
        if any(not isinstance(s, str) or not s for s in request.stop_strings):
            raise InvalidInputError(f"request {rid}: stop strings must be non-empty strings")

    def _check_prefilled(self, request: Request, row: PrefilledRow) -> None:
        """A prefilled row must be this engine's caches (one per layer, the signatures its
        fresh caches have) holding exactly the prompt, with a first token."""
        rid = request.rid
        token = row.first_token
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidInputError(f"request {rid}: a prefilled row's first token is {token!r}")
        slots = _slots_of(row.caches)
        if not _fits(slots, self._row_signatures):
            got = ", ".join(c.signature() for c in slots)
            raise InvalidInputError(
                f"request {rid}: a prefilled row's caches ({got}) are not this engine's "
                f"({len(self._row_signatures)} slots of its model and scheme"
                f"{', paged' if self.paged is not None else ''})"
            )
        for cache in slots:
            offset = getattr(cache, "offset", None)
            if isinstance(offset, int) and offset != len(request.prompt):
                raise InvalidInputError(
                    f"request {rid}: a prefilled row's caches hold {offset} positions, its "
                    f"prompt {len(request.prompt)}"
                )
        computed = row.prefix_hit_tokens + sum(row.prefill_chunks)
        if row.prefill_chunks and computed != len(request.prompt):
            raise InvalidInputError(
                f"request {rid}: a prefilled row's prefix hit and chunks cover {computed} "
                f"tokens, its prompt {len(request.prompt)}"
            )

    def _full_bytes(self, request: Request) -> int:
        """The row's KV bytes at its longest, shared prefix blocks counted (what it holds
        alone)."""
        tokens = len(request.prompt) + request.max_tokens
        # A waiting request is asked at every step: the count depends on its length alone.
        known = self._full_bytes_at.get(tokens)
        if known is None:
            draft = 0 if self.draft_admission is None else self.draft_admission.most_bytes(tokens)
            known = self._full_bytes_at[tokens] = self.admission.most_bytes(tokens) + draft
        return known

    def _never_fits(self, request: Request, budget: int | None) -> str | None:
        """Why ``request`` can never be admitted (``None``: it can)."""
        positions = len(request.prompt) + request.max_tokens
        if positions > self.admission.max_tokens:
            return (
                f"request {request.rid} needs {positions} positions; its layouts hold at most "
                f"{self.admission.max_tokens}"
            )
        need = self._full_bytes(request)
        if budget is not None and need > budget:
            return never_fits_message(
                request.rid, need, len(request.prompt), request.max_tokens, budget
            )
        return None

    def _check_fits(self, request: Request) -> None:
        problem = self._never_fits(request, self.kv_budget)
        if problem is not None:
            raise CapacityError(problem)

    def _retry_after(self) -> float:
        """Seconds a refused client should wait: the queue's mean wait so far, at least a
        tenth of a second (one second before anything was admitted)."""
        waits = [e.result.queue_seconds for e in self._streaming if e.admissions]
        return max(0.1, sum(waits) / len(waits)) if waits else 1.0

    def cancel(self, rid: str) -> bool:
        """End request ``rid``; thread-safe. It leaves at the next step boundary, its KV
        released (paged: its blocks back to the pool), and its stream ends with
        ``finish_reason`` ``"cancelled"``. ``False``: no live request has that rid."""
        with self._lock:
            entry = self._live.get(rid)
            if entry is None:
                return False
            if not entry.cancel_requested:
                entry.cancel_requested = True
                self._cancels.append(entry)
                self._wake.notify_all()
            return True

    def close_admissions(self) -> None:
        """Drain: ``submit`` raises ``DrainingError`` from now on; what was submitted runs
        to its end."""
        with self._lock:
            self._draining = True
            self._wake.notify_all()

    def set_kv_budget(self, kv_budget: int | None) -> None:
        """Change the byte budget at the next step boundary; thread-safe. Under a smaller
        budget the newest rows are preempted until the rest fit (§17)."""
        if kv_budget is not None and (
            isinstance(kv_budget, bool) or not isinstance(kv_budget, int) or kv_budget < 0
        ):
            raise InvalidInputError(f"kv_budget must be an integer >= 0 or None, got {kv_budget!r}")
        with self._lock:
            self._budget_change = (kv_budget,)
            self._wake.notify_all()

    def gauges(self) -> EngineGauges:
        """A snapshot, thread-safe (bytes as counted at the last step boundary)."""
        with self._lock:
            g = self._gauge
            return EngineGauges(
                running=g["running"],
                waiting=len(self._waiting),
                kv_bytes_held=g["kv_bytes_held"],
                kv_budget=self.kv_budget,
                prefix_cache_bytes=g["prefix_cache_bytes"],
                prefix_hits=g["prefix_hits"],
                prefix_hit_tokens=g["prefix_hit_tokens"],
                store_hit_tokens=g["store_hit_tokens"],
                generated_tokens=g["generated_tokens"],
                preemptions=g["preemptions"],
                requests_finished=g["requests_finished"],
            )

    def serve_forever(self, stop: threading.Event) -> None:
        """The engine thread's loop: ``step`` while there is work, else wait for a submit
        (no spinning: a wait on the engine's condition, woken by ``submit``, ``cancel``
        and ``close_admissions``; ``stop`` is looked at every 50 ms). Returns once ``stop``
        is set and nothing waits or runs (to drain, call ``close_admissions`` first)."""
        while True:
            with self._wake:
                while not self._has_work() and not stop.is_set():
                    self._wake.wait(timeout=0.05)
                if not self._has_work():
                    return
            self.step_or_fail()

    def step_or_fail(self, fatal: tuple[type[Exception], ...] = ()) -> None:
        """``step``; if it raises, every live request fails with the error and the engine
        serves on (``serve_forever``'s step), unless the error is one of ``fatal`` (raised:
        a tensor-parallel rank that drifted must stop)."""
        try:
            self.step()
        except fatal:
            raise
        except Exception as error:  # the process serves on: these requests fail
            self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        """A step raised: every live request finishes with ``finish_reason`` ``"error"``
        (its ``error`` the exception's text), and the batch state starts afresh (the
        prefix cache, the pools and the totals stay)."""
        with self._lock:
            entries = list(self._live.values())
            self._waiting, self._cancels = [], []
        for entry in entries:
            if not entry.finished:
                entry.result.finish_reason = "error"
                entry.result.error = f"{type(error).__name__}: {error}"
                self._finish(entry)
        self._cohort, self._running = [], []
        self._cohort_layouts, self._decode_layouts = [], []
        self._streaming, self._removals = [], []
        if self._drafter is not None:
            self._drafter = _Drafter(self, self.draft_model)
        if self._pipeline is not None:
            self._pipeline = _Pipeline(self)
        self._shared_credit.clear()
        self._refresh_gauges()

    def _has_work(self) -> bool:
        return bool(
            self._waiting
            or self._cancels
            or self._cohort
            or self._running
            or self._streaming
            or self._removals
        )

    def has_work(self) -> bool:
        """Whether a request waits, runs or has events still to send."""
        with self._lock:
            return self._has_work()

    def step(self) -> bool:
        """One step boundary (``spec/engine.md`` §3): removals (cancels, matched stop
        strings, queue timeouts), preemption under the budget, admissions, one prefill
        chunk, one decode step, retirements, then every stream's events. Called from one
        thread only. Returns whether a request still waits or runs."""
        self._boundary()
        self._preempt_over_budget()
        admitted = self._admit_waiting()
        arrived = [row for row in admitted if row.arrived]
        if arrived:  # prefilled elsewhere: straight to the decode batch
            admitted = [row for row in admitted if not row.arrived]
            self._enter_decode(arrived)
        if admitted:
            self._cohort_layouts = self._join(self._cohort_layouts, admitted, prefill=True)
            self._cohort.extend(admitted)
        # one prefill chunk for the cohort
        prefilled = bool(self._cohort)
        if self._cohort:
            started = time.perf_counter()
            done = self._prefill_chunk(self._cohort, self._cohort_layouts)
            self._stats.prefill_seconds += time.perf_counter() - started
            if done:
                self._leave_cohort(done)
        pipeline = self._pipeline
        # A prefill chunk has waited for the device already: its boundary evaluates. A
        # pipelined step where nothing joined, prefilled or changed holds at most what the
        # last step's measure counted (rows may only have left): the measure after this
        # step's launch counts it.
        if pipeline is None or self._changed or prefilled:
            self._measure()
            self._changed = False
        # one decode step for the running rows
        running, layouts = self._running, self._decode_layouts
        if pipeline is not None:
            # Built and started now, read at the next boundary; the previous step's tokens
            # are read while this one evaluates.
            if running:
                pipeline.launch(running, layouts)
            pipeline.read_settled()
            leaving = pipeline.leaving(running)
            self._measure(evaluate=bool(leaving))
        elif running:
            if self._drafter is None:
                leaving = self._decode_step(running, layouts)
            else:
                leaving = self._speculative_step(running, layouts, self._drafter)
            self._measure()
        else:
            leaving = []
        # The gauges are the last measure's unless rows leave now (their caches, the
        # prefix cache they publish to): a count of every cache is no free call.
        measured = pipeline is not None or bool(running)
        if leaving:
            for row in leaving:
                self._retire(row, layouts, running.index(row))
            self._drop_from_batch(leaving)
        if pipeline is not None and not self._running:
            pipeline.read_settled(everything=True)  # the rows that left: nothing in flight
        if self.step_guard is not None:  # what every rank of a group must hold alike
            rows = self._cohort + self._running
            positions = [row.fed + max(row.sampled - 1, 0) for row in rows]
            self.step_guard(self._step, [row.request.rid for row in rows], positions)
        self._step += 1
        self._send_events()
        if leaving or not measured:
            self._refresh_gauges()
        with self._lock:
            return self._has_work()

    def _leave_cohort(self, done: list[_Row]) -> None:
        """Rows whose prompt is done leave the cohort: finished ones retire, the others
        publish their prompt and join the decode batch."""
        keep = [i for i, row in enumerate(self._cohort) if row not in done]
        for layout in self._cohort_layouts:
            filter_layout_rows(layout, keep)
        self._cohort = [self._cohort[i] for i in keep]
        self._enter_decode(done)

    def _enter_decode(self, done: list[_Row]) -> None:
        """Rows whose prompt is done (here, or prefilled elsewhere): finished ones retire
        (a prefill-only row hands its caches over), the others publish their prompt and
        join the decode batch."""
        joining = [row for row in done if not self._finished(row)]
        for row in done:
            if self._finished(row):
                self._retire_serial(row)
        if joining:
            for row in joining:
                self._publish_prompt(row)
            if self._drafter is not None:
                self._drafter.join(joining)
            self._decode_layouts = self._join(self._decode_layouts, joining, prefill=False)
            self._running.extend(joining)
            if self._pipeline is not None:
                self._pipeline.join(joining)
                self._changed = True

    def _drop_from_batch(self, rows: Sequence[_Row]) -> None:
        """``rows`` leave the cohort or the decode batch (every layout, the draft's and the
        pipeline's inputs): their KV is released."""
        gone = {id(row) for row in rows}
        keep = [i for i, row in enumerate(self._cohort) if id(row) not in gone]
        if len(keep) < len(self._cohort):
            for layout in self._cohort_layouts:
                filter_layout_rows(layout, keep)
            self._cohort = [self._cohort[i] for i in keep]
        keep = [i for i, row in enumerate(self._running) if id(row) not in gone]
        if len(keep) < len(self._running):
            for layout in self._decode_layouts:
                filter_layout_rows(layout, keep)
            if self._drafter is not None:
                self._drafter.filter(keep)
            if self._pipeline is not None:
                self._pipeline.filter(keep)
                self._changed = True
            self._running = [self._running[i] for i in keep]
        for row in rows:
            row.left = True
            row.caches = []
        if self.paged is not None:
            self._shared_credit.clear()  # a row leaves: the rows it shared with count theirs

    def _boundary(self) -> None:
        """What other threads asked since the last boundary, and the queue timeouts: rows
        leave (cancelled, or a stop string matched), waiting requests finish."""
        now = time.perf_counter()
        with self._lock:
            cancels, self._cancels = self._cancels, []
            if self._budget_change is not None:
                (self.kv_budget,), self._budget_change = self._budget_change, None
            ended: list[tuple[_Entry, str, str | None]] = []
            kept: list[_Entry] = []
            for entry in self._waiting:
                waited = now - entry.arrived_at
                if entry.cancel_requested:
                    ended.append((entry, "cancelled", None))
                elif (
                    self.queue_timeout is not None
                    and not entry.admissions
                    and waited > self.queue_timeout
                ):
                    message = queue_timeout_message(entry.request.rid, waited, self.queue_timeout)
                    ended.append((entry, "rejected", str(CapacityError(message))))
                else:
                    kept.append(entry)
            self._waiting = kept
        leaving = list(self._removals)
        self._removals = []
        for entry in cancels:
            row = entry.row
            if entry.finished or entry.result.finish_reason or row is None:
                continue  # done already, or ended in the queue above
            if row.left or row.stopped:
                continue  # it finishes at this boundary anyway
            entry.result.finish_reason = "cancelled"
            leaving.append(entry)
        rows = [e.row for e in leaving if e.row is not None and not e.row.left]
        if rows:
            self._drop_from_batch(rows)
        for entry in leaving:
            entry.removal = False
        for entry, reason, error in ended:
            entry.result.finish_reason, entry.result.error = reason, error
            if reason == "rejected":
                self._stats.rejected += 1
            if entry.admissions:  # a preempted request: its stream is sent from _streaming
                continue
            self._finish(entry)

    def _reserved(self, rows: Iterable[_Row]) -> int:
        return sum(self.projected_bytes(row.request) for row in rows)

    def _preempt_over_budget(self) -> None:
        """While the active rows' reservations exceed the budget (it was lowered, or shared
        prefix blocks stopped being shared), preempt the newest row (never the last one):
        its KV is dropped, and its request goes back to the head of the queue to prefill
        its prompt and its tokens so far (recompute); its stream goes on."""
        if self.kv_budget is None:
            return
        while True:
            active = [r for r in self._cohort + self._running if not r.stopped and not r.left]
            if len(active) <= 1 or self._reserved(active) <= self.kv_budget:
                return
            victim = max(active, key=lambda r: r.order)
            self._drop_from_batch([victim])
            victim.gone = True
            entry = self._live_entry(victim.request.rid)
            entry.row = None
            entry.first_at = victim.first_at
            with self._lock:
                self._waiting.insert(0, entry)
                self._gauge["preemptions"] += 1
            self._stats.preemptions += 1

    def _live_entry(self, rid: str) -> _Entry:
        with self._lock:
            return self._live[rid]

    def _admit_waiting(self) -> list[_Row]:
        """Admission, FIFO, under the row count and the byte budget (§3): the first request
        that does not fit waits, and nothing behind it overtakes it. A request waiting for
        a prefilling row's prefix (§3.1) keeps its place; those behind it go on."""
        admitted: list[_Row] = []
        index = 0  # only this thread removes entries: those before it stay put
        while True:
            with self._lock:
                if index >= len(self._waiting):
                    break
                entry = self._waiting[index]
            request = entry.request
            problem = self._never_fits(request, self.kv_budget)  # the budget may have shrunk
            if problem is not None:
                with self._lock:
                    self._waiting.pop(index)
                entry.result.error = str(CapacityError(problem))
                entry.result.finish_reason = "rejected"
                self._stats.rejected += 1
                if not entry.admissions:
                    self._finish(entry)
                continue
            active = self._cohort + admitted + self._running
            if len(active) >= self.max_batch:
                break
            if self._waits_for_prefix(entry, self._cohort + admitted):
                self._stats.prefix_waits += 1
                index += 1
                continue
            # A prefilled row holds blocks of its own: no shared prefix credited.
            need = self._full_bytes(request) if entry.prefilled else self.projected_bytes(request)
            if self.kv_budget is not None and self._reserved(active) + need > self.kv_budget:
                break
            with self._lock:
                self._waiting.pop(index)
            admitted.append(self._admit(entry))
        return admitted

    def _waits_for_prefix(self, entry: _Entry, prefilling: Sequence[_Row]) -> bool:
        """Whether ``entry`` waits for a row still prefilling (§3.1): that row shares at
        least ``PREFIX_WAIT_TOKENS`` more of its context than the prefix cache covers now,
        and its prompt will be published when done (so this one reuses it then)."""
        if not self.wait_for_prefix or self._partial_reuse is False or entry.prefilled:
            return False
        context = entry.request.prompt + tuple(entry.result.tokens)
        head = context[:PREFIX_WAIT_TOKENS]
        sharing = [row for row in prefilling if row.context[:PREFIX_WAIT_TOKENS] == head]
        limit = len(context) - 1  # one token is always computed
        shared = min(limit, max((_common_prefix(r.context, context) for r in sharing), default=0))
        if shared < PREFIX_WAIT_TOKENS:
            return False
        return shared - self._cached_prefix(context) >= PREFIX_WAIT_TOKENS

    def _cached_prefix(self, context: Sequence[int]) -> int:
        """Leading tokens of ``context`` the in-memory prefix cache covers (paged: whole
        blocks the pools hold), copying nothing."""
        if self.paged is not None:
            return len(self.paged.hit_blocks(context)[0]) * self.paged.block_size
        return self.prefix_cache.matched(context) if self.prefix_cache is not None else 0

    def _prefix_held(self) -> int:
        """Bytes the prefix cache holds: its entries, and paged, the cached free blocks."""
        held = self.prefix_cache.nbytes if self.prefix_cache is not None else 0
        return held + (self.paged.cached_bytes() if self.paged is not None else 0)

    def _bound_prefix_cache(self) -> None:
        """Keep the prefix cache within ``prefix_cache_bytes`` and within what the budget
        leaves beside the active rows' reservations, least recently used first."""
        limit = math.inf if self.prefix_cache_bytes is None else self.prefix_cache_bytes
        if self.kv_budget is not None:
            active = self._cohort + self._running
            limit = min(limit, max(0, self.kv_budget - self._reserved(active)))
        if math.isinf(limit):
            return
        excess = self._prefix_held() - int(limit)
        if excess > 0 and self.paged is not None:
            excess -= self.paged.evict_cached(excess)
        if excess > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict_to(max(0, self.prefix_cache.nbytes - excess))

    def _kv_bytes(self) -> int:
        """KV bytes held now: layouts (the draft's too), serial caches in transit, the
        prefix cache."""
        draft = [] if self._drafter is None else self._drafter.layouts
        rows = self._cohort + self._running
        with self._lock:  # rows that arrived prefilled and wait hold their caches
            arrived = [c for e in self._waiting if e.prefilled for c in e.prefilled.caches]
        held = self._held_kv_bytes(
            self._cohort_layouts
            + self._decode_layouts
            + draft
            + [c for r in rows for c in r.caches]
            + arrived
        )
        return held + (self.prefix_cache.nbytes if self.prefix_cache is not None else 0)

    def _measure(self, evaluate: bool = True) -> None:
        """At a step boundary: bound the prefix cache, evaluate what the step left lazy
        (merges, filters), so freed buffers go now, then take both counts. A pipelined
        boundary where the batch did not change does not evaluate (that would wait for the
        step in flight) and takes only the count: active memory there holds that step's
        working set."""
        self._bound_prefix_cache()
        stats = self._stats
        held = self._refresh_gauges()
        rows = len(self._cohort) + len(self._running)
        stats.peak_kv_bytes = max(stats.peak_kv_bytes, held)
        stats.peak_rows = max(stats.peak_rows, rows)
        if not evaluate:
            return
        draft = [] if self._drafter is None else self._drafter.layouts
        mx.eval([x.held_arrays() for x in self._cohort_layouts + self._decode_layouts + draft])
        stats.peak_active_kv_bytes = max(
            stats.peak_active_kv_bytes, mx.get_active_memory() - self._baseline
        )

    def _refresh_gauges(self) -> int:
        """The gauges' counts of the engine's state now; returns the KV bytes held."""
        held = self._kv_bytes()
        prefix = self._prefix_held()
        with self._lock:
            self._gauge["kv_bytes_held"] = held
            self._gauge["running"] = len(self._cohort) + len(self._running)
            self._gauge["prefix_cache_bytes"] = prefix
        return held

    # -- events ----------------------------------------------------------------------------
    def _send_events(self) -> None:
        """Every admitted request's new tokens (one ``TokenEvent``), and the
        ``FinishEvent`` of each that finished (its row has left)."""
        streaming: list[_Entry] = []
        for entry in self._streaming:
            if entry.finished:
                continue
            if len(entry.result.tokens) > entry.emitted:
                self._send_tokens(entry)
            row = entry.row
            if entry.result.finish_reason and not entry.removal and (row is None or row.left):
                self._finish(entry)
            else:
                streaming.append(entry)
        self._streaming = streaming

    def _send_tokens(self, entry: _Entry) -> None:
        result = entry.result
        new = result.tokens[entry.emitted :]
        text = ""
        if entry.text is not None:
            for count, token in enumerate(new, 1):
                if entry.text.add(token):  # a stop string matched: the row ends here
                    del result.tokens[entry.emitted + count :]
                    del result.logits[entry.emitted + count :]
                    new = new[:count]
                    row = entry.row
                    if row is not None and not row.left and not result.finish_reason:
                        entry.removal = True
                        self._removals.append(entry)
                    result.finish_reason = "stop"
                    break
            text = entry.text.release()
        entry.emitted += len(new)
        with self._lock:
            self._gauge["generated_tokens"] += len(new)
        self._emit(entry, TokenEvent(entry.request.rid, tuple(new), text))

    def _finish(self, entry: _Entry) -> None:
        """The request's last events: the rest of its text, then its ``FinishEvent``."""
        result = entry.result
        if entry.text is not None:
            rest = entry.text.finish()
            result.text = entry.text.text
            if rest:
                self._emit(entry, TokenEvent(entry.request.rid, (), rest))
        entry.finished = True
        entry.prefilled = None  # a row that arrived and never ran: its caches go
        handoff, entry.handoff = entry.handoff, None
        with self._lock:
            self._live.pop(entry.request.rid, None)
            self._gauge["requests_finished"] += 1
        self._emit(entry, FinishEvent(entry.request.rid, result, handoff))

    def _emit(self, entry: _Entry, event: StreamEvent) -> None:
        """To the stream, and to ``on_event``: a callback that raises cancels its request
        (its client is gone); the engine runs on."""
        entry.stream._put(event)
        if entry.on_event is not None:
            try:
                entry.on_event(event)
            except Exception:
                entry.on_event = None
                if not isinstance(event, FinishEvent):
                    self.cancel(entry.request.rid)

    # -- the offline client ------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> tuple[list[RequestResult], EngineStats]:
        """Serve a trace: each request is submitted at its ``arrival`` step (counted from
        this call) and ``step`` runs until nothing waits or runs; results in the order of
        ``requests``. A request that can never fit is not raised: its result is
        ``"rejected"``. The engine must be idle (no online requests)."""
        for request in requests:
            self._validate(request)
        if self.has_work():
            raise InvalidInputError("Engine.run needs an idle engine: requests are live")
        results: dict[str, RequestResult] = {}
        stats = EngineStats(requests=len(requests))
        self._stats = stats
        stats.kv_bytes_per_token = self.admission.bytes(1)
        # Memory that is not KV state (weights, the probe): active now, less what is KV.
        self._baseline = mx.get_active_memory() - self._kv_bytes()
        start = time.perf_counter()
        first_step = self._step
        pending = sorted(requests, key=lambda r: r.arrival)
        shown = -1
        while pending or self.has_work():
            while pending and pending[0].arrival <= self._step - first_step:
                request = pending.pop(0)
                try:
                    results[request.rid] = self._submit(request, bounded=False).result
                except CapacityError as error:
                    results[request.rid] = RequestResult(
                        request.rid,
                        len(request.prompt),
                        finish_reason="rejected",
                        error=str(error),
                    )
                    stats.rejected += 1
            self.step()
            if self.progress:
                done = sum(1 for r in results.values() if r.finish_reason)
                steps = self._step - first_step
                if done != shown or steps % 16 == 0:
                    shown = done
                    generated = sum(len(r.tokens) for r in results.values())
                    _progress(done, len(requests), steps, generated, time.perf_counter() - start)
        self._measure()
        stats.seconds = time.perf_counter() - start
        stats.steps = self._step - first_step
        if self.progress:
            generated = sum(len(r.tokens) for r in results.values())
            _progress(len(requests), len(requests), stats.steps, generated, stats.seconds)
            sys.stderr.write("\n")
        out = [results[r.rid] for r in requests]
        stats.generated = sum(len(r.tokens) for r in out)
        stats.prefix_hits = sum(1 for r in out if r.prefix_hit_tokens)
        stats.prefix_hit_tokens = sum(r.prefix_hit_tokens for r in out)
        stats.store_hits = sum(1 for r in out if r.store_hit_tokens)
        stats.store_hit_tokens = sum(r.store_hit_tokens for r in out)
        return out, stats

    # -- pieces ----------------------------------------------------------------------------
    def _key_after(self, request: Request, draws: int) -> mx.array:
        """The request's random key after ``draws`` tokens (each sampled token splits it
        once): a preempted row draws on where it stopped."""
        key = mx.random.key(request.seed)
        if request.temperature > 0:
            for _ in range(draws):
                key, _ = mx.random.split(key)
        return key

    def _admit(self, entry: _Entry) -> _Row:
        request, result = entry.request, entry.result
        if entry.prefilled is not None:
            return self._admit_prefilled(entry, entry.prefilled)
        # A preempted request recomputes its prompt and the tokens it has.
        context = request.prompt + tuple(result.tokens)
        caches: list[Cache] = self._fresh_caches()
        fed = 0
        store_hit = 0
        if self.paged is not None:
            self._shared_credit[request.rid] = self.paged.shared_credit(request.prompt)
            if self.prefix_cache is not None:
                cache = self.prefix_cache
                hit = self.paged.lookup(context, lambda limit: cache.lookup(context, limit=limit))
                if hit is not None:
                    fed, caches = hit
        elif self.prefix_cache is not None:
            hit = self.prefix_cache.lookup(context)
            if hit is not None:
                fed, caches = hit
        if self.prefix_store is not None and self.paged is None:
            started = time.perf_counter()
            # Only a longer prefix than memory's is worth a load (and one token stays).
            found = self.prefix_store.longest(context, limit=len(context) - 1, beyond=fed)
            if found is not None and not _fits(found[1], self._signatures):
                found = None
            if self.store_agreement is not None:
                found = self._agreed_hit(context, fed, found)
            if found is not None:
                fed = store_hit = found[0]
                caches = _regrouped(found[1], make_kvrows_cache(self.model, self.scheme))
            self._stats.store_read_seconds += time.perf_counter() - started
        if fed:
            caches = _as_legos(caches, make_kvrows_cache(self.model, self.scheme))
        if not entry.admissions:
            result.admitted_step = self._step
            result.prefix_hit_tokens = fed
            result.store_hit_tokens = store_hit
            result.queue_seconds = time.perf_counter() - entry.arrived_at
            with self._lock:
                self._gauge["prefix_hits"] += fed > 0
                self._gauge["prefix_hit_tokens"] += fed
                self._gauge["store_hit_tokens"] += store_hit
            self._streaming.append(entry)
        entry.admissions += 1
        self._admissions += 1
        row = _Row(
            request,
            result,
            caches,
            fed,
            self._key_after(request, len(result.tokens)),
            entry.arrived_at,
            context=context,
            first_at=entry.first_at,
            next_input=result.tokens[-1] if result.tokens else 0,
            sampled=len(result.tokens),
            order=self._admissions,
            prefill_only=entry.prefill_only,
        )
        entry.row = row
        return row

    def _admit_prefilled(self, entry: _Entry, arrived: PrefilledRow) -> _Row:
        """A row whose prompt was computed elsewhere: its caches (placed in this engine's
        pools when paged), its first token read, and it joins the decode batch at this
        step. Preempted later, it recomputes here as any row does."""
        request, result = entry.request, entry.result
        entry.prefilled = None
        caches = self._placed(arrived.caches)
        now = time.perf_counter()
        result.admitted_step = self._step
        result.prefix_hit_tokens = arrived.prefix_hit_tokens
        result.prefill_chunks = list(arrived.prefill_chunks)
        result.queue_seconds = now - entry.arrived_at
        result.time_to_first_token = now - entry.arrived_at
        result.tokens.append(arrived.first_token)
        if self.keep_logits and arrived.logits is not None:
            result.logits.append(arrived.logits)
        if self.paged is not None:
            self._shared_credit[request.rid] = 0  # its blocks are its own
        self._streaming.append(entry)
        entry.admissions += 1
        self._admissions += 1
        entry.first_at = now
        row = _Row(
            request,
            result,
            caches,
            len(request.prompt),
            self._key_after(request, 1),
            entry.arrived_at,
            context=request.prompt,
            first_at=now,
            next_input=arrived.first_token,
            sampled=1,
            order=self._admissions,
            arrived=True,
        )
        entry.row = row
        return row

    def _placed(self, caches: list[Cache]) -> list[Cache]:
        """``caches`` with every paged slot in this engine's pool: a cache over another
        pool (a hand-over within one process; a transfer received without ``pools``) is
        restored into it (its bytes copied once); one over this pool is kept as it is."""
        if self.paged is None:
            return caches
        slots: list[Any] = []
        for cache, pool in zip(_slots_of(caches), self.paged.pools, strict=True):
            inner = _behind(cache)
            if pool is not None and isinstance(inner, PagedRows) and inner.pool is not pool:
                source: Any = inner  # a paged storage: its form restores into ``pool``
                moved = type(source).from_state(
                    source.state,
                    None,
                    keep=getattr(source, "keep", None),
                    geometry=source.geometry,
                    pool=pool,
                )
                cache = cache.rewrap(moved) if isinstance(cache, DropInWrapper) else moved
            slots.append(cache)
        return _regrouped(slots, caches)

    def _join(
        self, layouts: list[BatchableCache], rows: list[_Row], *, prefill: bool
    ) -> list[BatchableCache]:
        """Merge ``rows``' per-layer serial caches into ``layouts`` (made on first use from
        the first row's prepared caches: ``prepare_prefill`` / ``prepare_batch``)."""
        first: list[Any] | None = None
        if not layouts or layouts[0].batch_size == 0:
            prepare = (
                self.maintenance.prepare_prefill if prefill else self.maintenance.prepare_batch
            )
            first = prepare(rows[0].caches)
            layouts = self._new_layouts(first, prefill=prefill)
        _merge_prepared(self.maintenance, layouts, first, [row.caches for row in rows])
        for row in rows:
            row.caches = []  # the layout holds the row now; the serial copies are released
        return layouts

    def _forward(self, model: Any, ids: mx.array, layouts: Sequence[Any]) -> mx.array:
        """``model(ids, cache=layouts)``, inside the row-attention hook when some layer is a
        delayed layout (its rows may be mixed: each attends with its own codec)."""
        with self._row_attention(model, layouts):
            logits: mx.array = forward(model, ids, layouts)
        return logits

    @staticmethod
    @contextmanager
    def _row_attention(model: Any, layouts: Sequence[Any]) -> Iterator[None]:
        with attention_scope(model, layouts):
            yield

    def _prefill_chunk(self, cohort: list[_Row], layouts: list[BatchableCache]) -> list[_Row]:
        """One prefill forward for the cohort (``spec/engine.md`` §5): every row advances by
        the same chunk, at most the shortest remaining prompt, cut at the next conversion
        boundary. (Per-row chunks in a right-padded block measured slower on the serving
        trace: each pad costs a real token's compute; benchmarks/RESULTS.md.)"""
        n = min(self.prefill_chunk, min(len(row.context) - row.fed for row in cohort))
        # Cut at the next conversion boundary: each row converts exactly at its start.
        boundary = self.maintenance.max_append_tokens(layouts)
        if not math.isinf(boundary):
            n = min(n, int(boundary))
        ids = mx.array([list(row.context[row.fed : row.fed + n]) for row in cohort])
        finishing = [b for b, row in enumerate(cohort) if row.fed + n == len(row.context)]
        # The appends this chunk makes (what a solo replay cuts at: ``prefill_chunks``).
        cuts = [n]
        if finishing and n > 1:
            # Only the last position's logits are used: the chunk's other tokens only fill
            # the caches, so they go first, and the last layer's attention, its MLP and the
            # head run for the last position alone (as mlx-lm's prompt processing does).
            self._forward(self.model, ids[:, :-1], layouts)
            ids, cuts = ids[:, -1:], [n - 1, 1]
        hidden = self._forward(self.model, ids, layouts)
        # Evaluated here so the prefill time is measured (the step boundary would anyway).
        # Logits only when some row finishes its prompt: else evaluating the layouts alone
        # leaves the last layer's attention and the head out of the graph (as mlx-lm's
        # prompt processing does).
        logits = None
        if finishing:
            logits = hidden[mx.array(finishing), -1]
        held = [layout.held_arrays() for layout in layouts]
        mx.eval(held if logits is None else (logits, held))
        del hidden
        self._stats.prefill_tokens += n * len(cohort)
        done: list[_Row] = []
        for b, row in enumerate(cohort):
            row.fed += n
            row.result.prefill_chunks.extend(cuts)
            if b in finishing:
                row.caches = [layout.extract_row(b) for layout in layouts]
                done.append(row)
        if logits is not None:
            self._sample(done, logits)
            now = time.perf_counter()
            for row in done:
                if not row.first_at:  # a preempted row had its first token already
                    row.first_at = now
                    row.result.time_to_first_token = now - row.arrived_at
        return done

    def _decode_step(self, running: list[_Row], layouts: list[BatchableCache]) -> list[_Row]:
        ids = mx.array([[row.next_input] for row in running])
        logits = self._forward(self.model, ids, layouts)[:, -1, :]
        self._sample(running, logits)
        self._count_forward(len(running), len(running))
        return [row for row in running if self._finished(row)]

    def _count_forward(self, rows: int, tokens: int) -> None:
        self._stats.target_forwards += 1
        self._stats.row_forwards += rows
        self._stats.decode_tokens += tokens

    def _speculative_step(
        self, running: list[_Row], layouts: list[BatchableCache], drafter: _Drafter
    ) -> list[_Row]:
        """One speculative round for every running row (``spec/engine.md`` §11).

        ``d`` drafts per row (fewer when no row has room for ``d + 1`` more tokens); the
        target verifies ``[pending, drafts]`` in one forward inside a ``RowRound``. Row
        ``b`` accepts its longest prefix of drafts equal to the target's greedy tokens,
        capped so it never passes ``max_tokens`` or a stop token (so the KV it keeps is
        exactly what it emits), and emits them plus the target's token after them. A
        tempered row accepts none and samples the first position with its own key: its
        draws are those of a plain decode step."""
        rows = len(running)
        room = [row.request.max_tokens - len(row.result.tokens) - 1 for row in running]
        d = min(self.draft_tokens, max(room))
        target_round = RowRound(layouts)
        pending = mx.array([[row.next_input] for row in running])
        if d == 0:  # every row ends with this token: a plain step, no draft
            target_round.begin(0)
            logits = self._forward(self.model, pending, layouts)[:, -1, :]
            target_round.resolve([0] * rows)
            self._sample(running, logits)
            self._count_forward(rows, rows)
            return [row for row in running if self._finished(row)]
        proposed = drafter.propose(d)
        target_round.begin(d)
        logits = self._forward(self.model, mx.concatenate([pending, proposed], axis=1), layouts)
        chosen = mx.argmax(logits, axis=-1)
        mx.eval(proposed, chosen)
        drafts: list[list[int]] = proposed.tolist()  # type: ignore[assignment]
        greedy: list[list[int]] = chosen.tolist()  # type: ignore[assignment]
        accepted: list[int] = []
        for b, row in enumerate(running):
            limit = min(d, room[b]) if row.request.temperature <= 0 else 0
            a = 0
            while (
                a < limit
                and drafts[b][a] == greedy[b][a]
                and drafts[b][a] not in row.request.stop  # a stop token ends the row
            ):
                a += 1
            accepted.append(a)
            self._stats.drafted += limit
            self._stats.accepted += a
        target_round.resolve(accepted)
        kept = np.array(logits.astype(mx.float32)) if self.keep_logits else None
        emitted: list[list[int]] = []
        for b, row in enumerate(running):
            tokens = greedy[b][: accepted[b] + 1]
            if row.request.temperature > 0:
                tokens = [int(self._draw(row, logits[b, 0]).tolist())]  # type: ignore[arg-type]
            if kept is not None:
                row.result.logits.extend(kept[b, : len(tokens)])
            row.result.tokens.extend(tokens)
            row.next_input = tokens[-1]
            row.sampled += len(tokens)
            emitted.append(tokens)
        self._count_forward(rows, sum(len(t) for t in emitted))
        leaving = [row for row in running if self._finished(row)]
        if len(leaving) < rows:  # the draft catches up on what the rows that stay emitted
            drafter.absorb(
                [t + g[len(t) :] for t, g in zip(emitted, greedy, strict=True)], accepted
            )
        return leaving

    def _sample(self, rows: list[_Row], logits: mx.array) -> None:
        """One token per row from ``logits`` ``[rows, vocab]``: greedy rows in one argmax,
        tempered rows from their own key (so a row's draw does not depend on its batch)."""
        tokens: list[int] = mx.argmax(logits, axis=-1).tolist()  # type: ignore[assignment]
        for b, row in enumerate(rows):
            if row.request.temperature > 0:
                tokens[b] = int(self._draw(row, logits[b]).tolist())  # type: ignore[arg-type]
        if self.keep_logits:
            kept = np.array(logits.astype(mx.float32))
            for b, row in enumerate(rows):
                row.result.logits.append(kept[b])
        for token, row in zip(tokens, rows, strict=True):
            row.result.tokens.append(int(token))
            row.next_input = int(token)
            row.sampled += 1

    @staticmethod
    def _draw(row: _Row, logits: mx.array) -> mx.array:
        """A tempered row's next token from its ``[vocab]`` logits: its own next subkey, a
        categorical draw over ``logits / temperature``, within the nucleus under
        ``top_p < 1`` (only the row's own logits decide: its batch mates never do)."""
        row.key, sub = mx.random.split(row.key)
        scaled = logits / row.request.temperature
        if row.request.top_p < 1.0:
            scaled = _nucleus(scaled, row.request.top_p)
        return mx.random.categorical(scaled, key=sub)

    def _sample_on_device(self, rows: list[_Row], logits: mx.array) -> mx.array:
        """``_sample``'s draws, left on the device: ``[rows]`` tokens, the same operations
        (one argmax; a tempered row's own next subkey and categorical draw)."""
        greedy = mx.argmax(logits, axis=-1)
        if all(row.request.temperature <= 0 for row in rows):
            return greedy
        picks: list[mx.array] = []
        for b, row in enumerate(rows):
            if row.request.temperature > 0:
                picks.append(self._draw(row, logits[b]).astype(greedy.dtype))
            else:
                picks.append(greedy[b])
        return mx.stack(picks)

    @staticmethod
    def _finished(row: _Row) -> bool:
        tokens = row.result.tokens
        if tokens and tokens[-1] in row.request.stop:
            row.result.finish_reason = "stop"
            return True
        if len(tokens) >= row.request.max_tokens:
            row.result.finish_reason = "length"
            return True
        return False

    def _covered(self, row: _Row) -> tuple[int, ...]:
        """The tokens the row's KV holds: its prompt and every generated token fed back (all
        but the last sampled; a pipelined row that stopped was also fed its stop token)."""
        return row.request.prompt + tuple(row.result.tokens[: row.sampled - 1])

    def _close_timing(self, row: _Row) -> None:
        """Decode rate: tokens after the first over the time since the first."""
        elapsed = time.perf_counter() - row.first_at
        after_first = len(row.result.tokens) - 1
        if after_first > 0 and elapsed > 0:
            row.result.tokens_per_second = after_first / elapsed

    def _retire_serial(self, row: _Row) -> None:
        """A row that finished on its first token: its serial caches are published as is
        (a prefill-only row's are then handed over in its ``FinishEvent``)."""
        self._close_timing(row)
        row.left = True
        if self.paged is not None:
            self._shared_credit.clear()  # a row leaves: the rows it shared with count theirs
        if self.paged is None or self.prefix_cache is not None:
            self._publish_serial(self._covered(row), row.caches, to_store=True)
        if row.prefill_only:
            result = row.result
            result.finish_reason = "prefilled"
            self._live_entry(row.request.rid).handoff = PrefilledRow(
                row.caches,
                result.tokens[0],
                tuple(result.prefill_chunks),
                result.prefix_hit_tokens,
                result.logits[0] if result.logits else None,
            )
        row.caches = []

    def _retire(self, row: _Row, layouts: list[BatchableCache], index: int) -> None:
        if row.result.finish_reason:  # else its last token is in flight: timed when read
            self._close_timing(row)
        if self.paged is not None:
            self._shared_credit.clear()  # a row leaves: the rows it shared with count theirs
            if self.prefix_cache is None:
                return
            covered = self._covered(row)
            self.paged.publish_rows(layouts, index, covered)
            if self.paged.mixed:
                others = [
                    publish_row(x, index, len(covered)) for x in self.paged.unpaged_layers(layouts)
                ]
                if all(cache is not None for cache in others):
                    self._publish(covered, [c for c in others if c is not None])
            return
        if self.prefix_cache is None and self.prefix_store is None:
            return
        covered = self._covered(row)
        published = [publish_row(layout, index, len(covered)) for layout in layouts]
        if all(cache is not None for cache in published):
            self._publish(covered, [c for c in published if c is not None])

    def _publish_prompt(self, row: _Row) -> None:
        """A row whose prompt is done publishes its prompt's KV to the prefix cache before
        it decodes, so requests admitted meanwhile reuse it (a row publishes again, longer,
        when it leaves). Its serial caches are published as they are: merging them into the
        decode layouts leaves them unchanged. Not for legos, which a decode join releases,
        and not to the disk store (it saves the row when it leaves)."""
        if self.prefix_cache is None or any(isinstance(c, Handover) for c in row.caches):
            return
        if self._partial_reuse is None and len(row.context) > 2:
            # Whether a prefix shorter than a prompt can be served (§3.1): a ring past its
            # window or recurrent state cannot be cut, and waiting for them would only delay.
            self._partial_reuse = bool(servable_prefixes(row.caches, [len(row.context) // 2]))
        self._publish_serial(row.context, row.caches, to_store=False)

    def _publish_serial(
        self, covered: tuple[int, ...], caches: list[Cache], *, to_store: bool
    ) -> None:
        """Serial caches published as they are: paged layers register their full blocks in
        their pools (referenced, never copied), the other layers go to the prefix cache
        (``to_store``: and to the disk store, :meth:`_publish`)."""
        publish = self._publish if to_store else self._publish_cached
        if self.paged is None:
            publish(covered, list(caches))
            return
        self.paged.publish_serial(caches, covered)
        if self.paged.mixed:
            publish(covered, self.paged.unpaged_layers(caches))

    def _publish_cached(self, covered: tuple[int, ...], caches: list[Cache]) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.publish(covered, caches)

    def _agreed_hit(
        self, context: tuple[int, ...], fed: int, found: tuple[int, list[Cache]] | None
    ) -> tuple[int, list[Cache]] | None:
        """The store hit every engine of the agreement takes: the smallest (an entry some
        engine lacks, or one only partly written, is served by none); a longer local hit is
        loaded again at that length, and the engines confirm they all could."""
        assert self.store_agreement is not None and self.prefix_store is not None
        agreed = self.store_agreement(0 if found is None else found[0])
        if not agreed or found is None:  # every engine sees 0: one call each
            return None
        if found[0] != agreed:  # every hit is longer than ``fed``: so is the smallest
            again = self.prefix_store.longest(context, limit=agreed, beyond=fed)
            found = again if again is not None and again[0] == agreed else None
        confirmed = self.store_agreement(0 if found is None else agreed)  # a second call each
        return found if found is not None and confirmed == agreed else None

    def _publish(self, covered: tuple[int, ...], caches: list[Cache]) -> None:
        """To the prefix cache, and to the disk store (a failed save is counted, and the
        engine runs on: the store is a cache)."""
        self._publish_cached(covered, caches)
        if self.prefix_store is not None:
            started = time.perf_counter()
            try:
                stored = self.prefix_store.put(covered, _slots_of(caches))
                self._stats.store_writes += stored > 0
            except (KvRowsError, OSError):
                self._stats.store_errors += 1
            self._stats.store_write_seconds += time.perf_counter() - started


class _Pipeline:
    """Pipelined decode (``spec/engine.md`` §6.1): the running rows' next inputs stay on the
    device (``pending``, ``[B]`` in the running batch's order), each step's graph is built
    from them and started with ``mx.async_eval``, and its tokens are read one step later,
    while the next step evaluates. Nothing on this path waits for the device but that read.

    Batch changes happen between steps, on the host's view: rows that join bring their
    first token (already read: their prefill was evaluated); rows that leave are known
    before their last token is read (``max_tokens`` reached) or one step after their stop
    token was read (they were fed it once more; what that step sampled for them is
    dropped). ``filter`` takes ``pending`` to the kept rows, so no step ever runs a row that
    has left. A flight keeps its own row list, so a read after a batch change still maps
    each token to its row."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.pending: mx.array | None = None
        self.flights: list[_Flight] = []

    def join(self, rows: list[_Row]) -> None:
        tokens = mx.array([row.next_input for row in rows], dtype=mx.uint32)
        if self.pending is None or self.pending.size == 0:
            self.pending = tokens
        else:
            self.pending = mx.concatenate([self.pending, tokens])

    def filter(self, keep: list[int]) -> None:
        assert self.pending is not None
        self.pending = self.pending[mx.array(keep, dtype=mx.int32)] if keep else None

    def launch(self, running: list[_Row], layouts: list[BatchableCache]) -> None:
        """Build one decode step for ``running`` (its inputs: ``pending``) and start it."""
        engine = self.engine
        assert self.pending is not None and self.pending.size == len(running)
        logits = engine._forward(engine.model, self.pending[:, None], layouts)[:, -1, :]
        tokens = engine._sample_on_device(running, logits)
        kept = logits.astype(mx.float32) if engine.keep_logits else None
        started = (tokens,) if kept is None else (tokens, kept)
        mx.async_eval(*started)  # type: ignore[no-untyped-call]
        self.flights.append(_Flight(list(running), tokens, kept))
        self.pending = tokens
        for row in running:
            row.sampled += 1
        engine._count_forward(len(running), len(running))

    def read_settled(self, *, everything: bool = False) -> int:
        """Read every flight but the newest (``everything``: all of them); the rows they
        finish (length, or a stop among those that left already) count as finished."""
        finished = 0
        while len(self.flights) > (0 if everything else 1):
            flight = self.flights.pop(0)
            tokens: list[int] = flight.tokens.tolist()  # type: ignore[assignment]
            kept = None if flight.logits is None else np.array(flight.logits)
            for b, (row, token) in enumerate(zip(flight.rows, tokens, strict=True)):
                if row.gone or row.stopped or row.result.finish_reason:
                    continue  # sampled after its stop token (or a cancel, a preemption): dropped
                row.result.tokens.append(int(token))
                if kept is not None:
                    row.result.logits.append(kept[b])
                row.next_input = int(token)
                if self.engine._finished(row):
                    reason: str = row.result.finish_reason
                    if reason == "stop" and row.sampled > len(row.result.tokens):
                        row.stopped = True  # still in the batch: it leaves next boundary
                        row.result.finish_reason = ""
                    else:
                        self.engine._close_timing(row)
                        finished += 1
        return finished

    def leaving(self, running: list[_Row]) -> list[_Row]:
        """Rows that leave at this boundary: their last token is sampled (in flight or
        read), or a stop token was read for them (their finish is recorded now)."""
        out: list[_Row] = []
        for row in running:
            if row.stopped:
                row.result.finish_reason = "stop"
                out.append(row)
            elif row.sampled >= row.request.max_tokens:
                out.append(row)
        return out


def _merge_prepared(
    maintenance: KvMaintenance,
    layouts: Sequence[BatchableCache],
    first: list[Any] | None,
    rows: Sequence[Sequence[Cache]],
) -> None:
    """Merge each row's per-layer caches into ``layouts``. ``first``: the first row's
    prepared caches when ``layouts`` were just made from them (a delayed layout holds that
    row already). A lego joins a delayed layout as it is (the layout releases it) and an
    ordinary layout as its storage (``start == 0``: ``prepare_batch`` releases it)."""
    for layer, layout in enumerate(layouts):
        sources: list[Any] = []
        for index, caches in enumerate(rows):
            if index == 0 and first is not None:
                if first[layer] is not layout:
                    sources.append(first[layer])
                continue
            cache = caches[layer]
            if isinstance(cache, Handover) and not isinstance(layout, Converting):
                cache = maintenance.prepare_batch([cache])[0]
            sources.append(cache)
        if sources:
            layout.merge_rows(sources)


def _nucleus(scaled: mx.array, top_p: float) -> mx.array:
    """``scaled`` logits ``[vocab]`` with every token outside the nucleus at ``-inf``: the
    most probable tokens whose probability before them is below ``top_p`` (the first
    always; a tie at the edge keeps every tied token)."""
    probs = mx.softmax(scaled.astype(mx.float32), axis=-1)
    ranked = mx.sort(probs)[::-1]
    before = mx.cumsum(ranked) - ranked
    edge = mx.min(mx.where(before < top_p, ranked, mx.array(math.inf)))
    return mx.where(probs >= edge, scaled, mx.array(-math.inf, dtype=scaled.dtype))


def _slots_of(caches: Iterable[Any]) -> list[Any]:
    """Per-layer caches as **slots**: each layer, or each part of a layer of several caches
    (``DropInParts``), in order. The paged option pools slots; the disk store saves them
    (its files record one cache per entry layer)."""
    out: list[Any] = []
    for cache in caches:
        out.extend(cache.parts if isinstance(cache, DropInParts) else (cache,))
    return out


def _regrouped(parts: Sequence[Any], fresh: Sequence[Any]) -> list[Any]:
    """Per-slot caches (:func:`_slots_of`) as the model's layers: each layer of several
    caches regrouped in the form of ``fresh``'s (``regroup``)."""
    rest = iter(parts)
    return [
        layer.regroup([next(rest) for _ in layer.parts])
        if isinstance(layer, DropInParts)
        else next(rest)
        for layer in fresh
    ]


def _as_legos(caches: list[Cache], fresh: list[Cache]) -> list[Cache]:
    """A prefix hit's caches in the form the model takes: every bf16-first layer a lego
    again (a row published from ordinary decode layouts, ``start == 0``, or loaded from disk
    holds the lego's storage, which ``composed.over`` wraps in a lego of the scheme's
    parameters), and every layer the model takes through a drop-in (an MLA layer's pair)
    behind one again (disk holds the cache behind it)."""
    out: list[Cache] = []
    for cache, lego in zip(caches, fresh, strict=True):
        if isinstance(lego, Handover) and not isinstance(cache, Handover):
            cache = lego.composed.over(cache)
        elif isinstance(lego, DropInWrapper) and not isinstance(cache, DropInWrapper):
            cache = lego.rewrap(cache)
        out.append(cache)
    return out


def _vocabulary(model: Any) -> int | None:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return int(size) if size is not None else None


class _Drafter:
    """The draft model's side of speculative decoding: its rows in its own verify layouts
    (``target_cache_layout`` of its serial caches), in the running batch's row order.

    Invariant between rounds: a row's draft KV covers what the target's covers plus the
    pending token, and ``next[b]`` is the draft's greedy token after it (its first
    proposal). A round proposes ``d`` tokens: ``next`` and ``d - 1`` more forwards, on the
    layouts themselves for growing layers (trimmed back afterwards) and ring layers (in a
    proposal round, ``spec_round_propose``: the ring drops no column until
    ``spec_round_discard`` forgets the proposals; delayed layers the same way, no row
    converting inside the round), on a scratch copy for the layers that cannot hold a
    proposal round (recurrent state, chunked layers). After
    the target's verdict, :meth:`absorb` appends the rows' emitted tokens as one verify
    block inside a ``RowRound`` and keeps ``accepted + 1`` of them: the same rollback the
    target's layouts do, and the next ``next`` comes from the same forward.
    """

    def __init__(self, engine: Engine, model: Any):
        self.engine, self.model = engine, model
        self.scheme, self.chunk = engine.scheme, engine.prefill_chunk
        self.layouts: list[BatchableCache] = []
        self.next: list[int] = []
        fresh = make_kvrows_cache(model, self.scheme)
        # Layers a proposal cannot trim away: rings (a wrapped ring cannot forget
        # single-token appends), delayed layouts (an append past start converts a row, and
        # a conversion cannot be trimmed away) and recurrent state (never trimmable). Those
        # that hold proposals take a proposal round; the others a scratch copy.
        self.scratch = [
            isinstance(cache, RingGeometry | Handover) or not cache.is_trimmable()
            for cache in fresh
        ]

    def _forward(self, ids: mx.array, caches: Sequence[Any]) -> mx.array:
        return self.engine._forward(self.model, ids, caches)

    def join(self, rows: list[_Row]) -> None:
        """Prefill each joining row's prompt and first token through the draft (serial
        caches, chunks cut at the conversion boundary), then merge them into the draft
        layouts."""
        maintenance = self.engine.maintenance
        serial: list[list[Cache]] = []
        for row in rows:
            tokens = [*row.context, row.next_input]
            caches: list[Cache] = make_kvrows_cache(self.model, self.scheme)
            logits = None
            fed = 0
            while fed < len(tokens):
                n = min(self.chunk, len(tokens) - fed, maintenance.max_append_tokens(caches))
                logits = self._forward(mx.array([tokens[fed : fed + int(n)]]), caches)
                fed += int(n)
            assert logits is not None
            token: int = mx.argmax(logits[0, -1]).item()  # type: ignore[assignment]
            self.next.append(token)
            serial.append(caches)
        first: list[Any] | None = None
        if not self.layouts or self.layouts[0].batch_size == 0:
            first = maintenance.prepare_batch(serial[0])
            self.layouts = [
                cache if isinstance(cache, Converting) else target_cache_layout(cache)
                for cache in first
            ]
        _merge_prepared(maintenance, self.layouts, first, serial)

    def filter(self, keep: list[int]) -> None:
        for layout in self.layouts:
            filter_layout_rows(layout, keep)
        self.next = [self.next[i] for i in keep]

    def propose(self, d: int) -> mx.array:
        """``d`` greedy draft tokens per row, ``[rows, d]`` (left lazy: the target's
        forward joins the same graph); the draft's state is unchanged afterwards."""
        proposals = [mx.array(self.next)]
        if d > 1:
            caches: list[BatchableCache] = []
            held: list[Any] = []  # layouts in a proposal round (their rows drop nothing)
            for layout, copied in zip(self.layouts, self.scratch, strict=True):
                if copied and getattr(layout, "holds_proposals", False):
                    layout.spec_round_propose()  # type: ignore[attr-defined]
                    held.append(layout)
                elif copied:
                    scratch = layout.make_empty_batch()
                    scratch.merge_rows([layout])  # borrowed: the layout is unchanged
                    layout = scratch
                caches.append(layout)
            for _ in range(d - 1):
                logits = self._forward(proposals[-1][:, None], caches)[:, -1, :]
                proposals.append(mx.argmax(logits, axis=-1))
                self.engine._stats.draft_forwards += 1
            for layout in held:
                layout.spec_round_discard()
            for layout, copied in zip(self.layouts, self.scratch, strict=True):
                if not copied:
                    layout.trim(d - 1)
        return mx.stack(proposals, axis=1).astype(mx.int32)

    def absorb(self, block: list[list[int]], accepted: list[int]) -> None:
        """Append ``block`` (row ``b``: its emitted tokens first, any tokens after) as one
        verify block and keep ``accepted[b] + 1`` tokens of row ``b``."""
        rows = len(block)
        draft_round = RowRound(self.layouts)
        draft_round.begin(len(block[0]) - 1)
        logits = self._forward(mx.array(block), self.layouts)
        last = logits[mx.arange(rows), mx.array(accepted)]
        self.next = mx.argmax(last, axis=-1).tolist()  # type: ignore[assignment]
        draft_round.resolve(accepted)
        self.engine._stats.draft_forwards += 1


def _progress(done: int, total: int, step: int, generated: int, seconds: float) -> None:
    """One line on stderr, rewritten in place: requests done, step, tokens and their rate."""
    width = 30
    filled = width * done // max(total, 1)
    rate = generated / seconds if seconds > 0 else 0.0
    sys.stderr.write(
        f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} requests, step {step}, "
        f"{generated} tok, {rate:.1f} tok/s, {seconds:.1f} s "
    )
    sys.stderr.flush()
