"""The conformance state machine: one base machine, generated per (family, layout).

A machine holds the same logical state several times over:

* the **reference** and the **optimized** implementation, side by side (same
  operations, same data converted exactly, each implementation its own copy of
  every input array);
* for every request, **solo** serial caches in each implementation (and an
  mlx-lm twin where mlx-lm has the storage) that saw exactly the appends and trims
  its row saw;
* a NumPy **model** of every request: the encoded planes of every token appended,
  minus the trims, which depends on no implementation at all;
* for a layout mlx-lm mirrors, an **mlx-lm mirror** driven through the same
  merges, joins, filters, extracts, trims and steps.

The oracles of ``DESIGN.md`` run inside the steps and in the invariant
(:meth:`ConformanceMachine.check_oracles`): (a) reference vs optimized, (b) solo
replay in each implementation, (c) mlx-lm parity; plus both implementations
against the model. Masks are checked **semantically** on every append: the keys
each query sees (identified by their bytes) must be exactly the row's tokens at
positions ``(p - window, p]`` that the store keeps (:func:`expected_visible`), so
the check holds whatever column order a store reads in; where two stores read the
same columns in the same order, their masks must also be the same booleans.

Besides the values, the machine checks what a caller relies on:

* **independence**: the caller's input arrays never change after a call, and an
  extracted or published cache keeps what it held while the layout goes on;
* **publishing**: ``can_publish_row(b, t)`` (``t`` drawn around 0, the row's offset and
  a ring's ``max_size``) holds exactly when the row covers ``t``, ``publish_row``
  returns ``None`` otherwise, and a published copy cut back to ``t`` holds exactly the
  row's first ``t`` tokens;
* **dtypes**: every fetched plane and every attention output has the dtype the
  spec names (attention: the queries' dtype);
* **the row-layout table**: a new layout made through its role's table function is
  of the layout's class and parameters;
* **admission**: ``projected_bytes(t)`` and ``table.row_admission`` against the
  spec's formula and the compact plane bytes of an extracted row of ``t`` tokens;
* **bad input**: the same ``KvRowsError`` subclass and message in both
  implementations, and no change anywhere (:data:`MESSAGE_EXCEPTIONS` lists the
  messages that still differ).

Cost: the invariant checks what the last rule touched and everything every
:data:`FULL_CHECK_EVERY` rules; teardown checks every live object once more.

A family plugs in through its hook rows (``conformance.hooks``): its geometry draw is
data (``draw``, ``codecs``), and what its axes add as code are rule mixins of
``conformance.rules`` composed over this class (``hooks.compose``): the views of what a
serial cache and a layout row hold, prompt/step/keep strategies, the mlx-lm peer's
quirks, extra invalid operations, verify rounds. The rules that write blocks are the
writer's (``hooks.WRITERS``): :class:`KvRules` for K/V storages; a writer of other
tensors (``conformance.latent``, ``conformance.recurrent``) and the delayed modifier
bring theirs over the same root (no base rule is turned off) and keep its ids,
counters, :class:`Request` / :class:`Layout`, ``_close`` and ``_both_refuse``.
:func:`machine_class` makes every machine; it takes the implementations as
parameters so the teeth tests can inject mutants.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, ClassVar, TypeVar

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvrows import table
from kvrows.codec import Role
from kvrows.compositions import SELF, composition
from kvrows.conformance import strategies as ks
from kvrows.conformance.arrays import NUMPY_DTYPES, expand_mask, random_block, to_mlx
from kvrows.conformance.families import CONSTRUCTORS, Family, Impl, LayoutSpec, PeerSpec
from kvrows.conformance.hooks import Draw
from kvrows.conformance.paged import collector_paused, held_blocks
from kvrows.conformance.parity import DIVERGENCES
from kvrows.conformance.profiles import active_profile, machine_seed
from kvrows.conformance.stats import Stats
from kvrows.conformance.tolerances import EXACT, Tolerance, compare, tolerance
from kvrows.errors import (
    IncompatibleRowsError,
    KvRowsError,
    LayoutStateError,
    NoRowLayoutError,
    NotTrimmableError,
    UnsupportedStateError,
)
from kvrows.forms import rows_of_state, unpack_state
from kvrows.geometries.chunked import chunk_visible
from kvrows.leases import lease_cache_states
from kvrows.optimized.codecs.host_attention import op_attention
from kvrows.optimized.host import keep_every_buffer, kept_from, on_cpu
from kvrows.protocols import RowTrimmable, TimeOrderedReads

__all__ = [
    "BASE_CHECKS",
    "FULL_CHECK_EVERY",
    "FULL_RING_ROLLBACK",
    "MESSAGE_EXCEPTIONS",
    "RING_TRIM_REFUSED",
    "ROLE_LOOKUPS",
    "UNEVEN_TRIM",
    "WRAPPED_RING_BLOCK",
    "Block",
    "ConformanceMachine",
    "KvRules",
    "Layout",
    "Limits",
    "OpsChecks",
    "OpsRules",
    "OpsTarget",
    "Request",
    "Slot",
    "Track",
    "WriterRules",
    "expected_visible",
    "machine_class",
    "publish_counts",
    "publish_tokens",
    "raised",
    "snapshot",
]

Array = npt.NDArray[Any]
Planes = tuple[Array, ...]
#: An invalid operation: (label, call(impl, target), parity skip code, the error type the
#: contract names, or ``None`` when only "the same type in both" is specified).
Case = tuple[str, Callable[[Impl, Any], object], str, type[KvRowsError] | None]

#: The checks (``Stats.checks`` keys) every machine runs, whatever its family.
BASE_CHECKS = (
    "reference vs optimized",
    "solo replay",
    "masks",
    "visibility",
    "error types",
    "error messages",
    "dtypes",
    "independence",
    "admission",
    "table roles",
    "full check",
)

#: The invariant checks what the last rule touched, and everything every this many rules
#: (a rule that changes what it did not touch is caught within this many; every planted
#: bug of the teeth suite is caught at 8 as at 4, and the full checks cost half as much).
FULL_CHECK_EVERY = 8

#: A hard state (a ``Stats.states`` key, spec/contract.md §0.11): rows of equal length
#: trimmed by unequal counts (``trim_rows``), then a block. Counted, not yet built by a
#: rule nor asserted: free draws never reach it in the CI profile.
UNEVEN_TRIM = "equal rows trimmed unequally, then a step"

#: Hard states (``Stats.states`` keys, spec/contract.md §0.11) of the rings with
#: per-row trims: a row holding exactly ``max_size`` tokens rolled back by ``trim_rows``;
#: a ``trim_rows`` past a row's window (or holdings) refused after a block.
FULL_RING_ROLLBACK = "a ring row holding exactly max_size rolled back"
RING_TRIM_REFUSED = "a ring trim past the window refused"

#: A hard state (a ``Stats.states`` key, spec/contract.md §0.11) of the rings: a block of
#: two tokens or more lands on a wrapped ring holding a row shorter than its window (the
#: shared ring rotated with a row's left padding still positive: mlx-lm's B9, where its
#: mask hides that row's oldest token; a ragged ring: one row wrapped, another short).
WRAPPED_RING_BLOCK = "a block on a wrapped ring with a short row"

#: Bad-input cases (a part of their label) whose error *messages* differ between the
#: implementations: only their error types are compared. Each says why; the list shrinks
#: as the implementations converge on one message per error.
MESSAGE_EXCEPTIONS: dict[str, str] = {
    "the other implementation's arrays": (
        "each implementation names the array type it takes (NumPy / MLX) and the one it got"
    ),
}


@dataclass(frozen=True)
class Limits:
    """How big a machine's world may get (keeps examples fast on two cores)."""

    pool: int = 5
    layouts: int = 2
    rows: int = 8
    long_prompts: bool = True


@dataclass
class Track:
    """One request: its model (encoded planes of every token held) and its serial caches.

    In the pool, ``ref``/``opt``/``lm`` *are* the request; inside a layout they are the
    row's solo replay caches.
    """

    ident: int
    ref: Any
    opt: Any
    lm: Any
    keys: Planes
    values: Planes
    #: The caches hold planes (some block was appended): their row count B is fixed.
    appended: bool = False
    #: The caches know their geometry (an append, or an extracted empty row that kept it).
    geometry_known: bool = False
    history: list[tuple[str, Any, Any]] = field(default_factory=list)
    #: The request's stage: ``None`` while it holds its first codec's planes, else the
    #: offset at which it converted to its second (the delayed families' rows).
    converted_at: int | None = None
    #: A delayed request in the pool: what it holds (``"lego"``, or a serial storage of
    #: the lego's ``"exact"`` or ``"converted"`` stage) and its solo replay legos (a
    #: storage's built at its merge); ``extracted``: it left a layout and goes on as a lego.
    holds: str = "lego"
    solo_ref: Any = None
    solo_opt: Any = None
    extracted: bool = False
    #: Tokens the request's stores hold (the geometry's retention over its history: a
    #: chunked row's depends on its appends and trims, not only on ``tokens``).
    held: int = 0

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[2])


@dataclass
class Slot:
    """One layout in both implementations, its rows' tracks and its mlx-lm mirror."""

    ident: int
    ref: Any
    opt: Any
    rows: list[Track]
    lm: Any = None
    #: False once a skipped operation left the mirror unable to follow.
    mirrored: bool = True
    #: The position record of a delayed layout: each row's left padding (full attention).
    pads: list[int] = field(default_factory=list)
    #: Rows of equal length were trimmed by unequal counts and have not stepped since
    #: (the hard state ``UNEVEN_TRIM`` counts when the next block lands).
    uneven: bool = False


@dataclass
class Request:
    """One request of a family that models a request by its token count (latent,
    recurrent): its caches in both implementations and mlx-lm's twin. In the pool they
    *are* the request; inside a layout, the row's solo replay."""

    ident: int
    ref: Any
    opt: Any
    lm: Any = None
    tokens: int = 0


@dataclass
class Layout:
    """One layout of :class:`Request` rows in both implementations, and mlx-lm's twin."""

    ident: int
    ref: Any
    opt: Any
    lm: Any = None
    rows: list[Request] = field(default_factory=list)
    #: As ``Slot.uneven`` (``UNEVEN_TRIM``).
    uneven: bool = False


#: What ``OpsChecks`` leases and saves: a request or a layout, of the root's world model
#: (``Track``, ``Slot``) or of a writer's that models a request by its caches (``Request``,
#: ``Layout``: latent, recurrent).
OpsTarget = Track | Slot | Request | Layout


# ------------------------------------------------------------------ array helpers
def evaluate(arrays: Sequence[Any]) -> None:
    """Evaluate the MLX arrays among ``arrays`` in one ``mx.eval``: each conversion to
    NumPy would otherwise wait on the MLX stream once per array (values unchanged)."""
    pending = [a for a in arrays if isinstance(a, mx.array)]
    if len(pending) > 1:
        mx.eval(*pending)


def _flat(fetched: Any) -> list[Any]:
    """A fetch answer's arrays (a plane, or a tuple of planes, per tensor)."""
    return [p for part in fetched for p in (part if isinstance(part, tuple | list) else (part,))]


def _bits(array: mx.array) -> bytes:
    """An evaluated MLX array's bytes (bfloat16 as its ``uint16`` bits)."""
    return np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array).tobytes()


def planes_of(impl: Impl, fetched: Any) -> Planes:
    """An ``update_and_fetch`` / ``fetch`` answer as NumPy planes (affine: the triple)."""
    if isinstance(fetched, tuple | list):
        evaluate(fetched)
        return tuple(impl.to_numpy(p) for p in fetched)
    return (impl.to_numpy(fetched),)


def view_planes(impl: Impl, held: Any) -> Planes | None:
    """``(key planes, value planes)`` (or ``None``) as one NumPy tuple: keys', values'."""
    if held is None:
        return None
    arrays = [p for group in held for p in group]
    evaluate(arrays)
    return tuple(impl.to_numpy(p) for p in arrays)


def column_ids(planes: Planes, row: int) -> list[bytes]:
    """The bytes of every column of row ``row`` (all heads, all planes): a token's identity."""
    columns = int(planes[0].shape[2])
    if columns == 0:
        return []
    parts = [
        np.ascontiguousarray(np.moveaxis(p[row], 1, 0)).reshape(columns, -1).view(np.uint8)
        for p in planes
    ]
    joined = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    return [bytes(column) for column in joined]


def take_columns(planes: Planes, row: int, columns: Sequence[int]) -> Planes:
    index = np.array(list(columns), dtype=np.int64)
    return tuple(np.ascontiguousarray(p[row : row + 1, :, index]) for p in planes)


def expand(mask: Any, batch: int, n: int, keys: int) -> npt.NDArray[np.bool_]:
    """``expand_mask``, also taking mlx-lm's 1-D ``[S]`` decode mask of a serial ring."""
    if isinstance(mask, mx.array | np.ndarray) and mask.ndim == 1:
        mask = mask[None]
    return expand_mask(mask, batch, n, keys)


def _state_concat(parts: list[Any]) -> Any:
    """Planes joined on the token axis, NumPy or MLX alike."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=2)
    return mx.concatenate(parts, axis=2)


def planes_bytes(planes: Planes | None) -> Any:
    if planes is None:
        return None
    # The dtype object, not its name: ``str(dtype)`` costs more than the bytes on these sizes.
    return tuple((p.shape, p.dtype, p.tobytes()) for p in planes)


def _cat(a: Planes, b: Planes) -> Planes:
    return tuple(np.concatenate([x, y], axis=2) for x, y in zip(a, b, strict=True))


def _newest(planes: Planes, keep: int, sinks: int = 0) -> Planes:
    """The first ``min(sinks, keep)`` tokens and the newest others, ``keep`` in all."""
    length = int(planes[0].shape[2])
    head = min(sinks, keep)
    return tuple(
        np.ascontiguousarray(np.concatenate([p[:, :, :head], p[:, :, length - keep + head :]], 2))
        for p in planes
    )


def publish_counts(offset: int, max_size: int | None) -> list[int]:
    """The counts where whether a row of ``offset`` tokens covers them changes: 0,
    ``offset`` and its neighbours, a ring's ``max_size`` and its neighbours."""
    marks = {0, offset - 1, offset, offset + 1}
    if max_size is not None:
        marks |= {max_size - 1, max_size, max_size + 1}
    return sorted(m for m in marks if m >= 0)


def publish_tokens(offset: int, max_size: int | None) -> st.SearchStrategy[int]:
    """How many tokens a publish asks a row of ``offset`` tokens to cover: one of
    :func:`publish_counts`, or any count up to ``offset + 2``.

    One draw of ``integers(0, offset + 2)``, the draw the base machine's ``publish``
    always made: a draw below the number of boundary counts picks one of them, any other
    is the count itself. Keeping the draw keeps the derandomized CI examples (and so what
    each family's CI test covers) as they were."""
    boundaries = publish_counts(offset, max_size)
    return st.integers(0, offset + 2).map(
        lambda drawn: boundaries[drawn] if drawn < len(boundaries) else drawn
    )


def _last_rows(mask: Any, m: int) -> Any:
    """A mask for ``n`` queries restricted to its last ``m`` (``"causal"`` is bottom-right
    aligned, so it stays ``"causal"``)."""
    if mask is None or isinstance(mask, str):
        return mask
    return mask[..., -m:, :]


def snapshot(cache: Any, impl: Impl, view: str, row_view: str) -> tuple[Any, ...]:
    """Everything observable about a cache or layout (public surface and ``repr``)."""
    try:
        parts = cache.fetch()
        evaluate(_flat(parts))
        fetched: Any = planes_bytes(tuple(p for part in parts for p in planes_of(impl, part)))
    except KvRowsError as error:
        fetched = type(error).__name__
    base = (
        type(cache).__name__,
        cache.signature(),
        repr(cache.geometry),
        int(cache.nbytes),
        repr(cache),
        cache.is_trimmable(),
        fetched,
    )
    if table.is_batchable(cache):
        held = [getattr(cache, row_view)(b) for b in range(cache.batch_size)]
        evaluate([p for h in held if h is not None for group in h for p in group])
        rows = tuple(planes_bytes(view_planes(impl, h)) for h in held)
        offsets = tuple(int(x) for x in impl.to_numpy(cache.offset).tolist())
        return (*base, cache.batch_size, cache.row_offsets, cache.left_pad, offsets, rows)
    return (*base, int(cache.offset), planes_bytes(view_planes(impl, getattr(cache, view)())))


def expected_visible(
    before: int,
    n: int,
    window: int | None,
    max_size: int | None,
    keep: int = 0,
    chunk_size: int | None = None,
    held: int | None = None,
) -> list[list[int]]:
    """Positions query ``i`` of an ``n``-token append onto ``before`` tokens must see.

    The store keeps every token (``max_size`` ``None``), or a ring's ``min(before + 1,
    max_size)`` after one token and ``min(before, max_size - 1) + n`` after a block: its
    first ``keep`` (sinks) and its newest others. Query ``i`` (position ``p = before +
    i``) sees the kept tokens at positions ``(p - reach, p]`` and the sinks up to ``p``:
    ``reach`` is ``window or max_size`` without sinks, that less ``keep`` (at least 1)
    with them. A chunked row holding ``held`` keeps its newest ``chunk_size`` of them and
    the block; query ``p`` sees the kept positions of its chunk up to ``p``.
    """
    if chunk_size is not None:
        first = before + n - min(before if held is None else held, chunk_size) - n
        return [
            [j for j in range(first, p + 1) if chunk_visible(p, j, chunk_size, window)]
            for p in range(before, before + n)
        ]
    geo = ks.Geometry("float32", 1, 1, 1, 1, max_size, keep=keep)
    positions = geo.positions(before + n, geo.retained(before, n))
    reach = window or max_size or before + n + 1
    if keep:
        reach = max(1, reach - keep)
    return [
        [j for j in positions if j <= p and (j < keep or p - j < reach)]
        for p in range(before, before + n)
    ]


#: The row-layout table's lookup for each role.
ROLE_LOOKUPS: dict[str, Callable[[Any], Any]] = {
    "decode": table.owned_cache_layout,
    "prefill": table.prefill_cache_layout,
    "verify": table.target_cache_layout,
}


def _answer(call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or the name of the ``KvRowsError`` it raised."""
    try:
        return call(*args)
    except KvRowsError as error:
        return type(error).__name__


_E = TypeVar("_E", bound=BaseException)


def detached(error: _E) -> _E:
    """``error`` without its traceback, to keep: a traceback holds every frame it passed
    and their callers', so an error kept in a caller's local makes a cycle that holds
    the caches of those frames until the collector runs (a paged cache's blocks too:
    when it runs differs between the implementations, and copy on write with it)."""
    return error.with_traceback(None)


def raised(impl: Impl, label: str, call: Callable[[], object]) -> KvRowsError:
    """The ``KvRowsError`` ``call()`` raises (any other exception, or none, is a failure),
    detached from its frames."""
    try:
        call()
    except KvRowsError as error:
        return detached(error)
    except Exception as error:  # any other exception is a contract violation
        raise AssertionError(
            f"{impl.name}: {label} raised {type(error).__name__} ({error}), not a KvRowsError"
        ) from error
    raise AssertionError(f"{impl.name}: {label} did not raise")


def _update_with(make: Callable[[Impl], tuple[Any, Any]]) -> Callable[[Impl, Any], object]:
    """A call that appends ``make(impl)``'s keys and values to a cache."""
    return lambda impl, cache: cache.update_and_fetch(*make(impl))


def _state_values(impl: Impl, state: Sequence[Any]) -> list[Any]:
    """A state's entries as comparable values (arrays: shape, dtype and bytes)."""
    evaluate(state)

    def value(a: Any) -> Any:
        if isinstance(a, mx.array):
            return planes_bytes((impl.to_numpy(a),))
        if isinstance(a, np.ndarray):
            return planes_bytes((a,))
        if isinstance(a, tuple | list):
            return [value(x) for x in a]
        return a

    return [value(a) for a in state]


class _FailingRelease:
    """A state a lease must release whose release fails (``dispose_state`` raises):
    what a closed lease does then is the lease's, whatever the caches."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.released = 0

    @property
    def state(self) -> tuple[Any, ...]:
        return (f"temporary state of {self.name}",)

    @property
    def state_needs_dispose(self) -> bool:
        return True

    def dispose_state(self, state: tuple[Any, ...]) -> None:
        self.released += 1
        raise LayoutStateError(f"the release failed ({self.released})")


class ConformanceMachine(RuleBasedStateMachine):
    """Shared rules for every (family, layout); see the module docstring.

    The class-level hooks describe full-attention storage; the rule mixins the hook rows
    compose override what differs (``rules.RingRules``: a window; ``rules.AffineRules``:
    the codec's invalid merges).
    """

    family: ClassVar[Family]
    spec: ClassVar[LayoutSpec]
    ref_impl: ClassVar[Impl]
    opt_impl: ClassVar[Impl]
    peer: ClassVar[PeerSpec | None]
    stats: ClassVar[Stats]
    limits: ClassVar[Limits]
    #: False in calibration runs: attention errors are recorded, not enforced.
    enforce: ClassVar[bool] = True

    # ------------------------------------------------------------- family hooks
    #: The serial cache's and the layout row's time-ordered views (``(keys, values)``).
    serial_view: ClassVar[str] = "planes"
    row_view: ClassVar[str] = "row_planes"
    #: Serial chunks compare attention on their last this many queries (``None``: all).
    attended_queries: ClassVar[int | None] = None
    #: Why the family's storages have no saved-state form yet (``None``: they have one).
    #: While both implementations refuse ``state`` with ``UnsupportedStateError``, the
    #: state and save/restore checks are skipped (``Stats.checks["state form pending"]``).
    state_pending: ClassVar[str | None] = None
    #: Quantities (prefixes) a calibration run (``enforce=False``) records without enforcing.
    measured: ClassVar[tuple[str, ...]] = ("attention",)
    #: How an example draws its geometry (the layout's, from the codec's and geometry's
    #: hook rows) and the codec parameter sets it draws from (a test may narrow them:
    #: ``machine_class(family, layout, codecs=[(4, 64)])``).
    draw: ClassVar[Draw] = Draw()
    codecs: ClassVar[tuple[tuple[int, int], ...]] = ()

    @classmethod
    def geometries(cls) -> st.SearchStrategy[ks.Geometry]:
        return cls.draw.geometries(tuple(cls.codecs), cls.spec.role)

    def _prompt_length(self, data: st.DataObject) -> int:
        return data.draw(ks.prompt_lengths(self.limits.long_prompts), label="prompt length")

    def _chunk(self, data: st.DataObject) -> int:
        return data.draw(st.integers(1, 8), label="chunk")

    def _block_size(self, data: st.DataObject) -> int:
        return data.draw(ks.step_sizes(multi=True), label="N")

    def _keep(self, data: st.DataObject, slot: Slot) -> tuple[str, list[int]]:
        """``strategies.keep_lists``, or ``padded-rows``: only rows that have left padding,
        shuffled (the survivors share padding: a full-attention filter drops it, a ring's
        keeps it)."""
        padded = [b for b, pad in enumerate(slot.ref.left_pad) if pad > 0]
        only_padded: bool = bool(padded) and data.draw(st.booleans(), label="padded rows only")
        if only_padded:
            return "padded-rows", list(data.draw(st.permutations(padded), label="keep"))
        mirrored = self._parity(slot) and slot.lm is not None
        return data.draw(ks.keep_lists(tuple(t.tokens for t in slot.rows), mirrored), label="keep")

    def _check_layout_shape(self, slot: Slot) -> None:
        """Full attention: both agree on the width; shared-column rows end at it."""
        r, o = slot.ref, slot.opt
        self._exact(f"layout {slot.ident} width", o.width, r.width)
        if self.spec.shared_column:
            ends = {p + t.held for p, t in zip(r.left_pad, slot.rows, strict=True)}
            self._exact(
                f"layout {slot.ident}: rows share one write column", ends | {r.width}, {r.width}
            )

    def _after_filter(self, slot: Slot, pads: tuple[int, ...], keep: list[int]) -> None:
        """What a filter must leave (rings keep their survivors' padding)."""

    def _peer_divergence(self, slot: Slot, n: int) -> str | None:
        """A parity skip code when mlx-lm's mask for an ``n``-token step may differ."""
        return None

    def _peer_layout_state(self, slot: Slot, lm: Any) -> None:
        self._exact(
            f"layout {slot.ident} mlx-lm _idx (shared write column)", int(lm._idx), slot.ref.width
        )

    def _peer_serial_state(self, track: Track) -> None:
        """Anything more of an mlx-lm serial twin's state to compare (rings: the index)."""

    def _peer_join(self, slot: Slot, twins: Sequence[Any]) -> None:
        """mlx-lm: ``merge`` of the incoming twins; ``extend`` onto a running batch."""
        assert self.peer is not None
        batch = self.peer.batch.merge(list(twins))
        if slot.lm is None:
            slot.lm = batch
        else:
            slot.lm.extend(batch)

    def _peer_filter(self, slot: Slot, keep: list[int]) -> None:
        lm = slot.lm
        if lm.keys is None and keep and min(np.array(lm.left_padding)[keep].tolist()) > 0:
            self._skip("B2", "filter of a key-less mlx-lm batch with left padding")
            slot.lm, slot.mirrored = None, False
            return
        lm.filter(keep)
        self.stats.check("mlx-lm filter")

    def _peer_extract(self, lm: Any, b: int, track: Track) -> Any:
        """mlx-lm's ``extract(b)`` against the model; the twin the request keeps."""
        assert self.peer is not None
        twin = lm.extract(b)
        self._exact("mlx-lm extract offset", int(twin.offset), track.tokens)
        held = self.peer.serial_kv(twin)
        got = None if held is None else view_planes(self.opt_impl, held)
        self._same_planes("kv.mlx_lm", "mlx-lm extract", got, self._model_view(track))
        self.stats.check("mlx-lm extract")
        return twin

    def _twin_for(self, track: Track) -> Any:
        """An mlx-lm twin for an extracted row mlx-lm could not extract."""
        return self._replay(track).lm

    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        return []

    def _extra_serial_cases(self, track: Track) -> list[Case]:
        return []

    # ------------------------------------------------------------------ set-up
    def __init__(self) -> None:
        super().__init__()
        self.geo: ks.Geometry | None = None
        self.pool: list[Track] = []
        self.slots: list[Slot] = []
        self._ids = itertools.count()
        self._draws = itertools.count()
        self._dirty: set[int] = set()
        #: Counters choosing which filtered layouts and extracted rows go on restored from
        #: their saved state.
        self._filters = self._kept_extracts = 0
        self._invariants = 0
        self._clean = True
        #: ``_fetched_dtypes()`` (keys', values') of the geometry it was computed for.
        self._dtypes_of: tuple[ks.Geometry | None, tuple[list[str], list[str]]] = (
            None,
            ([], []),
        )
        #: ``_encoded`` answers (for one geometry) and ``_positions`` answers (the planes
        #: object kept, so its id is not reused while remembered).
        self._encodings: tuple[ks.Geometry | None, dict[Any, Planes]] = (None, {})
        self._position_memo: dict[int, tuple[Planes, dict[bytes, int]]] = {}
        self._steps_at_start = self.stats.steps
        #: (label, implementation, the array handed over, the machine's pristine copy).
        self._inputs: deque[tuple[str, Impl, Any, Array]] = deque(maxlen=48)
        #: (label, implementation, an extracted/published cache, what it held then).
        self._outputs: deque[tuple[str, Impl, Any, Any]] = deque(maxlen=6)
        #: Whether this example attends through the MLX ops on the CPU (not the host path).
        self._op_path = False
        #: Whether this example's host-written reads keep their buffers at every size
        #: (``keep_every_buffer``), and the scope that does it (closed at teardown).
        self._kept_reads = False
        self._scopes = ExitStack()
        #: Optimized reads the machine holds on to, each with its bytes then (``_hold_read``).
        self._held_reads: deque[tuple[str, Any, Any]] = deque(maxlen=4)
        self._reads_seen = 0

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.geo = data.draw(self.geometries(), label="geometry")
        note(f"geometry: {self.geo}")
        if self.geo.mlx_lm_width_bug and self.peer is not None and self.spec.serial_peer:
            self._skip("A1", f"no mlx-lm twin at {self.geo}")
        self._choose_attention_path()
        self._choose_read_buffers()

    def _choose_attention_path(self) -> None:
        """On the CPU, an example attends over encoded planes either in NumPy (the host
        path, the CPU's default) or through the MLX ops every other backend runs
        (``op_attention``): both against the reference. The path is a function of the drawn
        geometry (its CRC's low bit), not a draw of its own: the same data replays the same
        path, and every family's derandomized CI examples draw what they drew before. Each
        attention call takes it (:meth:`_on_path`): no state outlives the example."""
        self._op_path = on_cpu() and bool(zlib.crc32(repr(self.geo).encode()) & 1)
        if self._op_path:
            note("attention path: MLX ops (op_attention)")

    def _choose_read_buffers(self) -> None:
        """On the CPU, an example's host-written reads (a paged pool's gather) either take
        fresh buffers at these small shapes (the eager path) or keep them from read to
        read as large reads do (``keep_every_buffer``: the reuse), by the drawn geometry's
        CRC as the attention path; the machine holds some reads across later calls in
        either case (:meth:`_hold_read`), so a reuse that wrote a held read is caught. The
        scope closes at :meth:`teardown` (a machine that overrides it closes ``_scopes``)."""
        # An example before this one left its scope open (a machine whose teardown does
        # not close ``_scopes``): its generator would reset the mode whenever collected.
        assert kept_from(), "an earlier example's keep_every_buffer scope is still open"
        self._kept_reads = on_cpu() and bool(zlib.crc32(repr(self.geo).encode()) & 2)
        if self._kept_reads:
            note("reads: kept buffers at every size (keep_every_buffer)")
            self._scopes.enter_context(keep_every_buffer())

    def _hold_read(self, what: str, fetched: Any) -> None:
        """Keep every third optimized read (its arrays, or slices of them not yet
        evaluated: the slice holds the read), with its bytes now: ``_check_independence``
        checks that later calls left it as it was. The others are dropped, so a pool may
        reuse their buffers."""
        self._reads_seen += 1
        if self._reads_seen % 3:
            return
        arrays = _flat(fetched)
        evaluate(arrays)
        if self._reads_seen % 2:  # (an op other than a slice may change bits: -0.0 + 0)
            pristine = [_bits(a[:1]) for a in arrays if isinstance(a, mx.array)]
            arrays = [a[:1] if isinstance(a, mx.array) else a for a in arrays]
        else:
            pristine = [_bits(a) for a in arrays if isinstance(a, mx.array)]
        self._held_reads.append((what, arrays, pristine))
        if self._kept_reads:
            self.stats.check("kept read buffers")

    def _on_path(self) -> AbstractContextManager[None]:
        """The example's attention path, around one attention call."""
        return op_attention() if self._op_path else nullcontext()

    @property
    def _encodes(self) -> bool:
        """Whether the example's codec stores other than the block (its attention has a
        host path and an op path)."""
        return bool(self.g.codec_kind) and self.g.spec.encodes

    @property
    def _mlx_lm_attention(self) -> str:
        """The quantity the optimized attention vs mlx-lm's is: bit for bit through the same
        MLX ops, within the attention bound on the CPU's host path over encoded planes."""
        host = not self._op_path and on_cpu() and self._encodes
        return "attention.mlx_lm.host" if host else "attention.mlx_lm"

    def teardown(self) -> None:
        with self._scopes:  # the example's read buffers scope, closed whatever happens
            if self.geo is not None and self._clean:
                self._check_everything(final=True)
        # Examples Hypothesis abandons before any operation are not counted.
        if self.stats.steps > self._steps_at_start:
            if self.geo is not None:
                self.stats.variant(self.geo.codec)
                if self.geo.value_dim == 0:
                    self.stats.variant("keys only")  # values of width 0 (ks.keys_only)
            self.stats.example_done()

    # ------------------------------------------------------------------ helpers
    @property
    def g(self) -> ks.Geometry:
        assert self.geo is not None
        return self.geo

    @property
    def serial_name(self) -> str:
        return self.spec.serial or self.family.serial

    @property
    def twins(self) -> bool:
        """Serial caches have mlx-lm twins in this example."""
        return self.peer is not None and self.spec.serial_peer and not self.g.mlx_lm_width_bug

    def _both_trim_rows(self, slot: Slot) -> bool:
        """Both implementations' layouts roll back per row (the ``RowTrimmable`` capability)."""
        return all(isinstance(lay, RowTrimmable) for lay in (slot.ref, slot.opt))

    def _parity(self, slot: Slot) -> bool:
        return self.peer is not None and self.spec.peer and slot.mirrored

    def _op(self, name: str, *touched: Track | Slot) -> None:
        self._clean = False
        self.stats.op(name)
        self._dirty.update(item.ident for item in touched)

    def _exact(self, what: str, actual: object, expected: object) -> None:
        if actual != expected:
            raise AssertionError(f"{what}: got {actual!r}, expected {expected!r}")

    def _close(
        self,
        quantity: str,
        what: str,
        actual: Array,
        expected: Array,
        dtype: str | None = None,
        chosen: Tolerance | None = None,
    ) -> None:
        """``actual`` equals ``expected`` within ``chosen`` (default: the layout's tolerance
        of ``quantity`` at ``dtype``, by default the example's); the error is recorded in
        ``stats`` either way."""
        key = self.spec.tolerance_key or self.family.tolerance_key
        dtype = dtype or self.g.dtype  # recorded under the dtype it was held at
        tol = chosen if chosen is not None else tolerance(key, quantity, dtype)
        ok, error = compare(actual, expected, tol)
        ratio = 0.0
        if not tol.exact and actual.shape == expected.shape and actual.size:
            wide = expected.astype(np.float64)
            bound = tol.atol + tol.rtol * np.abs(wide)
            ratio = float(np.max(np.abs(actual.astype(np.float64) - wide) / bound))
        self.stats.error(quantity, dtype, tol, error, ratio)
        if ok or (not self.enforce and quantity.startswith(self.measured)):
            return
        raise AssertionError(
            f"{what}: {quantity} differs beyond {tol.describe()} "
            f"(max |diff| = {error:g}; shapes {actual.shape} / {expected.shape}, "
            f"dtypes {actual.dtype} / {expected.dtype})"
        )

    def _same_planes(
        self, quantity: str, what: str, got: Planes | None, want: Planes | None
    ) -> None:
        """``got`` equals ``want`` plane by plane (``None`` holds no token, as empty planes)."""
        if got is None or want is None:
            empty = [x is None or int(x[0].shape[2]) == 0 for x in (got, want)]
            self._exact(f"{what}: both hold no token", empty, [True, True])
            return
        self._exact(f"{what}: plane count", len(got), len(want))
        for i, (a, e) in enumerate(zip(got, want, strict=True)):
            self._close(quantity, f"{what} plane {i}", a, e)

    def _pick(self, data: st.DataObject, items: Sequence[Any], label: str) -> Any:
        return items[data.draw(st.integers(0, len(items) - 1), label=label)]

    def _skip(self, code: str, what: str) -> None:
        assert code in DIVERGENCES, code
        note(f"  parity skip {code}: {what}")
        self.stats.skip(code)

    def _new(self, impl: Impl, name: str, **changes: int) -> Any:
        """A new ``name`` of ``impl``, its composition's parameters by keyword: this
        example's values (``Geometry.parameters``), or ``changes`` (a parameter with
        neither keeps the class's default: a lego's ``start`` outside the delayed family)."""
        values = {**self.g.parameters(), **changes}
        params = composition(name).params
        return impl.cls(name)(**{p: values[p] for p in params if p in values})

    def _encode(self, block: Array, role: Role = "keys") -> Planes:
        """The planes the spec stores for ``block`` as ``role`` under this example's codec."""
        from kvrows.reference.codecs import make_codec

        return tuple(make_codec(self.g.spec).encode(block, role))

    def _encoded(self, block: Array, role: Role = "keys") -> Planes:
        """:meth:`_encode`, remembered by the block's bytes: a block's planes are needed for
        its visibility check, the model and the solo replay (the codec is deterministic)."""
        key = (role, str(block.dtype), block.shape, block.tobytes())
        if self._encodings[0] is not self.geo or len(self._encodings[1]) > 256:
            self._encodings = (self.geo, {})
        memo = self._encodings[1]
        if key not in memo:
            memo[key] = self._encode(block, role)
        return memo[key]

    def _positions(self, model_keys: Planes) -> dict[bytes, int]:
        """``{token id: position}`` of a run of model key planes (the bytes of each column
        of their fetched form), remembered for the same planes object."""
        if len(self._position_memo) > 64:
            self._position_memo.clear()
        hit = self._position_memo.get(id(model_keys))
        if hit is None or hit[0] is not model_keys:
            ids = column_ids(self._fetched_form(model_keys), 0)
            hit = (model_keys, {token: p for p, token in enumerate(ids)})
            self._position_memo[id(model_keys)] = hit
        return hit[1]

    def _fetched_form(self, planes: Planes, role: Role = "keys") -> Planes:
        """What a read returns for a run of ``role`` tokens stored as ``planes`` (the
        model's planes as a fetch shows them; plain and affine: the planes themselves).
        Tokens are identified by the bytes of this form of their keys."""
        return planes

    def _fetched_dtypes(self) -> tuple[list[str], list[str]]:
        """The dtypes of the fetched keys' planes and values' (the model's: values in the
        cache's dtype, affine codes ``uint32`` with scales and biases in the cache's dtype)."""
        dtype = NUMPY_DTYPES[self.g.dtype]
        keys = np.zeros((1, 1, 0, self.g.key_dim), dtype)
        values = np.zeros((1, 1, 0, self.g.value_dim), dtype)
        return (
            [str(p.dtype) for p in self._fetched_form(self._encode(keys))],
            [str(p.dtype) for p in self._fetched_form(self._encode(values, "values"), "values")],
        )

    def _check_deferred(
        self,
        what: str,
        queries: Array,
        outputs: tuple[Array, Array],
        fetched_keys: tuple[Planes, Planes],
        mask: npt.NDArray[np.bool_],
        rows: Sequence[tuple[int, Track, Array, Array]],
    ) -> None:
        """More oracles for one attention call of both implementations (a codec whose
        read is not the values: TurboQuant's eager path). ``outputs``: the attention of
        ``queries`` (reference, optimized); ``fetched_keys``: the read's key planes
        (reference, optimized); ``mask``: the expanded mask of ``queries``; ``rows``:
        ``(batch index, the row's track before the append, the keys and values it
        appended)``."""

    def _model_view(self, track: Track) -> Planes:
        """What the request's store must hold, keys' planes then values'."""
        keep = self.g.kept(track.tokens, track.held)
        sinks = self.g.keep
        return (*_newest(track.keys, keep, sinks), *_newest(track.values, keep, sinks))

    def _view(self, impl: Impl, cache: Any) -> Planes | None:
        return view_planes(impl, getattr(cache, self.serial_view)())

    def _row_view(self, impl: Impl, layout: Any, b: int) -> Planes | None:
        return view_planes(impl, getattr(layout, self.row_view)(b))

    def _rng(self, data: st.DataObject) -> np.random.Generator:
        """A generator for one rule's blocks: the drawn seed plus a per-example count, so
        two blocks never repeat (tokens are identified by their bytes)."""
        return np.random.default_rng([data.draw(ks.seeds, label="seed"), next(self._draws)])

    def _block(self, rng: np.random.Generator, rows: int, n: int, dim: int) -> Array:
        return random_block(rng, (rows, self.g.heads, n, dim), self.g.dtype)

    def _queries(self, rng: np.random.Generator, rows: int, n: int) -> Array:
        g = self.g
        return random_block(rng, (rows, g.query_heads, n, g.key_dim), g.dtype)

    def _give(self, impl: Impl, array: Array, label: str) -> Any:
        """``impl``'s own copy of ``array``; kept to check later that it never changes."""
        native = impl.to_native(array)
        self._inputs.append((label, impl, native, array))
        return native

    def _lm_copy(self, array: Array) -> mx.array:
        """mlx-lm's own copy (mlx-lm may keep and later write a caller's array)."""
        return to_mlx(array)

    def _new_track(self) -> Track:
        g = self.g
        dtype = NUMPY_DTYPES[g.dtype]
        return Track(
            ident=next(self._ids),
            ref=self._new(self.ref_impl, self.serial_name),
            opt=self._new(self.opt_impl, self.serial_name),
            lm=self.peer.serial(g) if (self.peer is not None and self.twins) else None,
            keys=self._encode(np.zeros((1, g.heads, 0, g.key_dim), dtype)),
            values=self._encode(np.zeros((1, g.heads, 0, g.value_dim), dtype), "values"),
        )

    def _record_append(self, track: Track, keys: Array, values: Array) -> None:
        if self.g.chunk_size is not None and track.held > self.g.chunk_size:
            self.stats.check("front trim")  # the append forgets the row's oldest tokens
        track.held = self.g.retained(track.held, int(keys.shape[2]))
        track.keys = _cat(track.keys, self._encoded(keys))
        track.values = _cat(track.values, self._encoded(values, "values"))
        track.appended = track.geometry_known = True
        track.history.append(("append", keys, values))

    def _record_trim(self, track: Track, count: int) -> None:
        keep = track.tokens - count
        track.held -= count
        track.keys = tuple(np.ascontiguousarray(p[:, :, :keep]) for p in track.keys)
        track.values = tuple(np.ascontiguousarray(p[:, :, :keep]) for p in track.values)
        track.history.append(("trim", count, None))

    def _replay(self, source: Track) -> Track:
        """A new track whose fresh serial caches saw exactly ``source``'s appends and trims."""
        track = self._new_track()
        for kind, a, b in source.history:
            if kind == "append":
                track.ref.update_and_fetch(
                    self._give(self.ref_impl, a, "replay"), self._give(self.ref_impl, b, "replay")
                )
                track.opt.update_and_fetch(
                    self._give(self.opt_impl, a, "replay"), self._give(self.opt_impl, b, "replay")
                )
                if track.lm is not None:
                    track.lm.update_and_fetch(self._lm_copy(a), self._lm_copy(b))
                self._record_append(track, a, b)
            else:
                track.ref.trim(a)
                track.opt.trim(a)
                if track.lm is not None:
                    track.lm.trim(a)
                self._record_trim(track, a)
        return track

    # ------------------------------------------------------- masks and dtypes
    def _visibility(
        self,
        what: str,
        fetched_keys: Planes,
        mask: npt.NDArray[np.bool_],
        rows: Sequence[tuple[int, Planes, int, int]],
        n: int,
        window: int | None,
    ) -> list[list[int]]:
        """Each row's queries see exactly the tokens :func:`expected_visible` names.

        ``rows``: ``(batch index, the row's model key planes after the append, tokens
        and tokens held before it)``. Keys are identified by their bytes, so the check holds whatever the
        column order. Returns, per row, the columns some query sees.
        """
        seen: list[list[int]] = []
        g = self.g
        for b, model_keys, before, held in rows:
            position = self._positions(model_keys)
            found = np.array([position.get(x, -1) for x in column_ids(fetched_keys, b)])
            expected = expected_visible(before, n, window, g.max_size, g.keep, g.chunk_size, held)
            visible_any = np.zeros(len(found), dtype=bool)
            for i in range(n):
                visible = mask[b, 0, i]
                visible_any |= visible
                got = np.sort(found[visible]).tolist()
                if got != expected[i]:
                    raise AssertionError(
                        f"{what}: row {b} query {i} (position {before + i}) sees positions "
                        f"{got} (-1: not a token of the row), expected {list(expected[i])} "
                        f"(window {window}, max_size {self.g.max_size}, n {n})"
                    )
            seen.append(np.flatnonzero(visible_any).tolist())
        self.stats.check("visibility")
        return seen

    def _masks_equal(self, what: str, masks: Sequence[npt.NDArray[np.bool_]]) -> None:
        for name, other in zip(("optimized", "mlx-lm"), masks[1:], strict=False):
            if other.shape != masks[0].shape or not np.array_equal(other, masks[0]):
                raise AssertionError(
                    f"{what}: the {name} mask differs:\n{other.astype(int)}\n"
                    f"vs\n{masks[0].astype(int)}"
                )
        self.stats.check("masks")

    def _fetched_dtypes_now(self) -> tuple[list[str], list[str]]:
        """:meth:`_fetched_dtypes` of this example's geometry (one answer per geometry)."""
        if self._dtypes_of[0] is not self.geo:
            self._dtypes_of = (self.geo, self._fetched_dtypes())
        return self._dtypes_of[1]

    def _fetch_dtypes(self, what: str, *fetched: Planes) -> None:
        """Fetched planes have the dtypes :meth:`_fetched_dtypes` names: ``fetched`` is
        keys' planes, values', keys', ... (one pair per implementation)."""
        wants = self._fetched_dtypes_now()
        for i, planes in enumerate(fetched):
            want = wants[i % 2]
            self._exact(f"{what}: fetched dtypes", [str(p.dtype) for p in planes], want)
        self.stats.check("dtypes")

    def _attend(self, impl: Impl, queries: Array, cache: Any, mask: Any, what: str) -> Array:
        """``impl``'s attention; its output has the queries' dtype and shape (value dim)."""
        given = self._give(impl, queries, what)
        with self._on_path():
            out = impl.to_numpy(impl.attend(given, cache, mask, self.g.scale))
        if impl is self.opt_impl and self._encodes:
            self.stats.check("op attention" if self._op_path else "host attention")
        rows, heads, n, _ = queries.shape
        self._exact(
            f"{what} ({impl.name}) attention dtype and shape",
            (str(out.dtype), out.shape),
            (self.g.dtype, (rows, heads, n, self.g.value_dim)),
        )
        return out

    def _append(
        self, what: str, ref_cache: Any, opt_cache: Any, keys: Array, values: Array
    ) -> list[tuple[Planes, Planes]]:
        """``update_and_fetch`` in both implementations, each with its own copy of the block:
        the fetched (keys, values) planes of each, their dtypes checked."""
        fetched = []
        for impl, cache in ((self.ref_impl, ref_cache), (self.opt_impl, opt_cache)):
            fk, fv = cache.update_and_fetch(
                self._give(impl, keys, what), self._give(impl, values, what)
            )
            evaluate(_flat((fk, fv)))
            fetched.append((planes_of(impl, fk), planes_of(impl, fv)))
            if impl is self.opt_impl:
                self._time_ordered(what, cache, fk, fv)
                self._hold_read(what, (fk, fv))
        self._fetch_dtypes(what, *fetched[0], *fetched[1])
        return fetched

    def _time_ordered(self, what: str, cache: Any, keys: Any, values: Any) -> None:
        """A shared ring's read put in time order (``TimeOrderedReads``; a wrapped ring
        without sinks answers from its ordered form, no copy) equals the eager path's
        re-ordered copy of the physical read (``reordered_reads``), plane for plane."""
        storage = getattr(cache, "read_storage", cache)
        eager = getattr(storage, "reordered_reads", None)
        if eager is None or not isinstance(cache, TimeOrderedReads):
            return
        fast = cache.reads_in_time_order(keys, values, None)[:2]
        slow = eager(keys, values, None)[:2]
        opt = self.opt_impl
        for name, got, want in zip(("keys", "values"), fast, slow, strict=True):
            self._same_planes(
                "kv.stored",
                f"{what}: {name} in time order",
                planes_of(opt, got),
                planes_of(opt, want),
            )
        self.stats.check("time order")
        if getattr(storage, "time_ordered", False):
            self.stats.check("time order from the ordered form")

    # ------------------------------------------------------------ serial steps
    def _serial_append(
        self, track: Track, keys: Array, values: Array, queries: Array, form: ks.MaskForm
    ) -> None:
        """Append one block to a free request everywhere: visibility, masks, attention."""
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        n = int(keys.shape[2])
        kw = form.kwargs()
        masks = [track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)]
        mask_lm = track.lm.make_mask(n, **form.mlx_lm_kwargs()) if track.lm is not None else None
        before = track.tokens
        what = f"request {track.ident} append {n} onto {before} ({form})"
        (keys_ref, values_ref), (keys_opt, values_opt) = self._append(
            what, track.ref, track.opt, keys, values
        )
        s_ref, s_opt = int(keys_ref[0].shape[2]), int(keys_opt[0].shape[2])
        self._exact(f"{what}: columns read (reference, optimized)", s_opt, s_ref)
        exp_ref, exp_opt = expand(masks[0], 1, n, s_ref), expand(masks[1], 1, n, s_opt)
        rows = [(0, _cat(track.keys, self._encoded(keys)), before, track.held)]
        self._visibility(f"{what} (reference)", keys_ref, exp_ref, rows, n, form.window_size)
        self._visibility(f"{what} (optimized)", keys_opt, exp_opt, rows, n, form.window_size)
        if planes_bytes(keys_opt + values_opt) == planes_bytes(keys_ref + values_ref):
            # Same columns in the same order: the masks must be the same booleans.
            self._masks_equal(what, [exp_ref, exp_opt])
        m = min(n, self.attended_queries or n)
        q = queries[:, :, n - m :]
        last = [_last_rows(mask, m) if m < n else mask for mask in (*masks, mask_lm)]
        out_ref = self._attend(ref, q, track.ref, last[0], what)
        out_opt = self._attend(opt, q, track.opt, last[1], what)
        self._close("attention", f"{what} attention", out_opt, out_ref)
        self._check_deferred(
            what,
            q,
            (out_ref, out_opt),
            (keys_ref, keys_opt),
            exp_ref[:, :, n - m :],
            [(0, track, keys, values)],
        )
        if track.lm is not None and self.peer is not None:
            lk, lv = track.lm.update_and_fetch(self._lm_copy(keys), self._lm_copy(values))
            k_lm, v_lm = planes_of(opt, lk), planes_of(opt, lv)
            exp_lm = expand(mask_lm, 1, n, int(k_lm[0].shape[2]))
            sinks_differ = bool(g.keep) and not np.array_equal(exp_opt, exp_lm)
            if not sinks_differ:
                self._masks_equal(f"{what} mask vs mlx-lm", [exp_opt, exp_lm])
            for name, got, want in (("keys", keys_opt, k_lm), ("values", values_opt, v_lm)):
                self._same_planes("kv.mlx_lm", f"{what} fetched {name} vs mlx-lm", got, want)
            if sinks_differ:
                self._skip("K1", f"{what}: mlx-lm's mask slides over the sink tokens")
            elif g.mlx_lm_reshape_bug:
                self._skip("A2", f"mlx-lm attention at {g}")
            else:
                out_lm = self.peer.attention(
                    self._lm_copy(q), lk, lv, cache=track.lm, scale=g.scale, mask=last[2]
                )
                self._close(
                    self._mlx_lm_attention, f"{what} attention", out_opt, opt.to_numpy(out_lm)
                )
            self.stats.check("mlx-lm serial")
        self._record_append(track, keys, values)

    def _trim_serial(self, track: Track, n: int) -> None:
        """Serial trim: clamps to what the cache holds; a wrapped ring refuses (n > 0)."""
        wrapped = self.g.wrapped(track.tokens)
        self._exact(
            f"request {track.ident} is_trimmable (reference, optimized)",
            (track.ref.is_trimmable(), track.opt.is_trimmable()),
            (not wrapped, not wrapped),
        )
        if n and wrapped:
            before = self._everything()
            for impl, cache in ((self.ref_impl, track.ref), (self.opt_impl, track.opt)):
                try:
                    cache.trim(n)
                except NotTrimmableError:
                    pass
                else:
                    raise AssertionError(f"{impl.name}: trim({n}) of a wrapped ring did not raise")
            self._exact("a refused trim changes nothing", self._everything(), before)
            if track.lm is not None:
                self._skip("B11", f"trim({n}) of a wrapped ring (mlx-lm would mutate)")
            return
        expected = min(n, track.held)  # what it holds (a chunked row may hold fewer)
        self._exact("reference trim() return", track.ref.trim(n), expected)
        self._exact("optimized trim() return", track.opt.trim(n), expected)
        if track.lm is not None:
            self._exact("mlx-lm trim() return", track.lm.trim(n), expected)
        self._record_trim(track, expected)

    # ------------------------------------------------------------- what rules call

    def _merge_sources(
        self, data: st.DataObject, room: int
    ) -> tuple[list[tuple[str, Any, Any]], list[Track], list[Track]]:
        """Free requests and, sometimes, a side layout built from some of them.

        Returns ``(sources, incoming tracks in row order, pool tracks consumed)``.
        """
        count = data.draw(st.integers(1, min(room, len(self.pool))), label="rows to merge")
        chosen = data.draw(
            st.permutations(list(range(len(self.pool)))).map(lambda p: p[:count]), label="requests"
        )
        picked = [self.pool[i] for i in chosen]
        sources: list[tuple[str, Any, Any]] = []
        incoming: list[Track] = []
        side_rows = 0
        if data.draw(st.booleans(), label="via a side layout"):
            side_rows = data.draw(st.integers(1, len(picked)), label="side layout rows")
        if side_rows:
            kinds = self.spec.siblings or tuple(spec.name for spec in self.family.layouts)
            kind = data.draw(st.sampled_from(kinds), label="side layout kind")
            side_ref, side_opt = self._new(self.ref_impl, kind), self._new(self.opt_impl, kind)
            group = picked[:side_rows]
            side_ref.merge_rows([t.ref for t in group])
            side_opt.merge_rows([t.opt for t in group])
            sources.append(("layout " + kind, side_ref, side_opt))
            incoming.extend(group)
        for t in picked[side_rows:]:
            sources.append((f"request {t.ident}", t.ref, t.opt))
            incoming.append(t)
        return sources, incoming, picked

    def _new_slot(self, data: st.DataObject) -> Slot:
        how = data.draw(st.sampled_from(("constructor", "table", "make_empty_batch")), label="how")
        name = self.spec.name
        if how == "make_empty_batch" and self.slots:
            ref, opt = self.slots[0].ref.make_empty_batch(), self.slots[0].opt.make_empty_batch()
        elif how == "table" and self.pool:
            roles = composition(self.serial_name).roles
            assert roles is not None
            mine = tuple(role for role, name in roles.items() if name == self.spec.name)
            self._exact(f"{self.serial_name}'s roles that are {name}", mine, self.spec.roles)
            role = data.draw(st.sampled_from(mine), label="table role")
            ref, opt = self._table_layout(role, self.pool[0])
        else:
            ref, opt = self._new(self.ref_impl, name), self._new(self.opt_impl, name)
        self._exact("new layout class (reference)", type(ref), self.ref_impl.cls(name))
        self._exact("new layout class (optimized)", type(opt), self.opt_impl.cls(name))
        slot = Slot(next(self._ids), ref, opt, [])
        self.slots.append(slot)
        return slot

    def _table_layout(self, role: str, track: Track) -> tuple[Any, Any]:
        """The row-layout table's ``role`` layout for the request's storage: this layout's
        class with this example's parameters (a mutant is then constructed instead)."""
        get = ROLE_LOOKUPS[role]
        made = []
        declared = []
        for impl, cache in ((self.ref_impl, track.ref), (self.opt_impl, track.opt)):
            layout = get(cache)
            declared.append(layout.geometry)
            fresh = self._new(impl, self.spec.name)
            self._exact(
                f"the table's {role} layout ({impl.name})",
                (type(layout).__name__, layout.signature(), layout.batch_size),
                (self.spec.name, fresh.signature(), 0),
            )
            if type(layout) is not type(fresh):  # a mutant stands in, declared alike
                layout = type(fresh).from_specs(
                    layout.codec_spec, layout.token_geometry, geometry=layout.geometry
                )
            made.append(layout)
        # A table layout declares the geometry its storage knows (admission answers at once).
        self._exact(f"the table's {role} layout geometry", declared[0], track.ref.geometry)
        self._exact(f"the table's {role} layout geometry", declared[1], declared[0])
        self.stats.check("table roles")
        return made[0], made[1]

    def _merge_into(
        self,
        slot: Slot,
        sources: list[tuple[str, Any, Any]],
        incoming: list[Track],
        consumed: list[Track],
    ) -> None:
        """``merge_rows(sources)`` on both layouts (the sources borrowed, unchanged), the
        mlx-lm mirror following; ``incoming`` become the slot's last rows."""
        before = self._snapshots([(s[1], s[2]) for s in sources])
        slot.ref.merge_rows([s[1] for s in sources])
        slot.opt.merge_rows([s[2] for s in sources])
        after = self._snapshots([(s[1], s[2]) for s in sources])
        self._exact("merge sources are borrowed and left unchanged", after, before)
        self._mirror_merge(slot, [t.lm for t in incoming])
        for t in consumed:
            self.pool.remove(t)
        slot.rows.extend(incoming)

    #: Set while ``pool_pressure`` runs a rule under a byte limit it must never meet: the
    #: hard-state builders step a layout, which may take blocks.
    _pressed = False

    def _hard_trims(self, slot: Any) -> list[str]:
        """The hard states ``trim_rows`` can build on ``slot`` (spec/contract.md §0.11),
        each a ``_build_<name>``: none here; the writer's and the geometry's rules name
        theirs."""
        return []

    def _hard_trim(self, slot: Any, data: st.DataObject) -> bool:
        """``trim_rows``' branch for the hard states (every writer's): where ``slot``
        allows (:meth:`_hard_trims`), half the runs build one instead of drawing free
        counts (which reach them 0 times); whether one was built. A branch of the rule,
        not a rule of its own, so a machine's other layouts draw exactly as before."""
        return self._hard_branch(slot, data, "trim_rows", "trim", self._hard_trims)

    def _hard_branch(
        self,
        slot: Any,
        data: st.DataObject,
        op: str,
        label: str,
        names: Callable[[Any], list[str]],
    ) -> bool:
        """A rule's branch for the hard states ``names(slot)`` (none while the machine is
        pressed): "free" or one of them drawn, the chosen one built by its
        ``_build_<name>`` and counted as ``op`` and ``op:<name>``; whether one was built."""
        hard = [] if self._pressed else names(slot)
        kind = data.draw(st.sampled_from(("free", *hard)), label=label) if hard else ""
        if not kind or kind == "free":
            return False
        self._op(op, slot)
        self._op(f"{op}:{kind}", slot)
        getattr(self, f"_build_{kind}")(slot, data)
        return True

    def _hard_steps(self, slot: Any) -> list[str]:
        """The hard states a multi-token step can build on ``slot``, each a
        ``_build_<name>``: none here; the geometry's rules name theirs (rings: ``wrapped``)."""
        return []

    def _hard_step(self, slot: Any, data: st.DataObject) -> bool:
        """``multi_step``'s branch for the hard states, as :meth:`_hard_trim` is
        ``trim_rows``': where ``slot`` allows (:meth:`_hard_steps`), a share of the runs
        build one instead of a free block; whether one was built. Machines whose layouts
        name none draw exactly as before."""
        return self._hard_branch(slot, data, "multi_step", "step", self._hard_steps)

    # The hooks of ``_build_uneven`` (a writer's rules supply them; ``slot``: a ``Slot``
    # or a ``Layout``).
    def _row_lengths(self, slot: Any) -> list[int]:
        """The tokens each row of ``slot`` holds (a ``Slot``'s requests; a writer whose
        layouts hold no requests overrides it)."""
        return [t.held for t in slot.rows]

    def _uneven_joins(self, slot: Any) -> list[Any]:
        """Free requests that may join ``slot`` as a second row for ``_build_uneven``."""
        raise NotImplementedError

    def _join_for_trim(self, slot: Any, request: Any) -> None:
        """``request`` (one of :meth:`_uneven_joins` or :meth:`_fill_joins`) joins
        ``slot`` as its last row."""
        raise NotImplementedError

    def _trim_rows(self, slot: Any, counts: list[int]) -> None:
        """``trim_rows(counts)`` on both layouts, which every row's solo replay follows
        (calling :meth:`_note_uneven` first)."""
        raise NotImplementedError

    def _uneven_block(self, slot: Any, n: int, data: st.DataObject) -> None:
        """A block of ``n`` tokens lands on every row of ``slot`` (then :meth:`_landed`)."""
        raise NotImplementedError

    def _note_uneven(self, slot: Any, counts: Sequence[int]) -> None:
        """Before ``trim_rows(counts)``: rows of equal length trimmed unequally mark
        ``slot`` (the hard state ``UNEVEN_TRIM`` counts when the next block lands)."""
        lengths = self._row_lengths(slot)
        if len(lengths) > 1 and len(set(lengths)) == 1:
            slot.uneven = len(set(counts)) > 1

    def _landed(self, slot: Any) -> None:
        """A block landed on ``slot``: a marked slot reached ``UNEVEN_TRIM``."""
        if slot.uneven:
            self.stats.state(UNEVEN_TRIM)
            slot.uneven = False

    def _uneven_rows(self, slot: Any, rolls_back: Callable[[int], bool]) -> list[str]:
        """``uneven`` where two or more rows hold a token and each may roll back
        (``rolls_back(tokens)``), or one does and a free request may join it."""
        rows = self._row_lengths(slot)
        if min(rows, default=0) < 1 or not all(rolls_back(t) for t in rows):
            return []
        return ["uneven"] if len(rows) >= 2 or self._uneven_joins(slot) else []

    # The hooks of ``_build_fill`` (a ring writer's rules supply them).
    def _fill_window(self, slot: Any) -> int:
        """The window (``max_size``) of ``slot``'s rows."""
        raise NotImplementedError

    def _fill_joins(self, slot: Any) -> list[Any]:
        """Free requests below their window that may join ``slot`` (its rows all wrapped)."""
        raise NotImplementedError

    def _fill_block(self, slot: Any, n: int, data: st.DataObject) -> Any:
        """A block of ``n`` tokens on every row of ``slot``, compared reference vs
        optimized, its rows' solo replays not yet fed; what :meth:`_fill_replay` needs."""
        raise NotImplementedError

    def _fill_replay(self, slot: Any, pending: Any, counts: list[int]) -> None:
        """After ``trim_rows(counts)`` following :meth:`_fill_block`: each row's solo
        replay takes only what the row kept of the block (a serial ring holding its
        window cannot forget)."""
        raise NotImplementedError

    def _fill_short(self, slot: Any) -> list[int]:
        """The rows of ``slot`` below their window."""
        window = self._fill_window(slot)
        return [b for b, t in enumerate(self._row_lengths(slot)) if t < window]

    def _fill_kinds(self, slot: Any) -> list[str]:
        """``fill`` in a ring writer's :meth:`_hard_trims` where a block can fill a row of
        ``slot`` to exactly its window, three shares of the draw (a ring's free trims of
        wrapped rows are no-ops, and verify layouts, with their rounds, draw ``trim_rows``
        seldom)."""
        return ["fill"] * 3 if self._fill_short(slot) or self._fill_joins(slot) else []

    def _may_forget(self, before: int, n: int, count: int) -> bool:
        """The spec's rule (spec/RaggedRotatingRows.md, ``trim_rows``), restated: after a
        block of ``n`` onto ``before`` a row may forget ``count`` tokens while it still
        retains the whole window of the position it goes back to."""
        return bool(self.g.may_forget(before + n, self.g.retained(before, n), count))

    def _build_fill(self, slot: Any, data: st.DataObject) -> None:
        """The hard states ``FULL_RING_ROLLBACK`` and ``RING_TRIM_REFUSED``, built (every
        ring writer's, through the hooks above): a block fills one row to exactly
        ``max_size`` (wrapped, yet holding every token; other rows may pass their window),
        then ``trim_rows`` rolls rows back, the filled row by one token at least. A count
        past a row's window (or holdings) comes first: both refuse it with the same
        error, nothing changed. What the spec allows is then accepted, each row's solo
        replay taking only the tokens it kept."""
        if not self._fill_short(slot):
            # Every row wrapped (the common case by the time a layout is trimmed): a free
            # request below its window joins first.
            request = self._pick(data, self._fill_joins(slot), "request joining")
            self._join_for_trim(slot, request)
        window = self._fill_window(slot)
        full = data.draw(st.sampled_from(self._fill_short(slot)), label="row to fill")
        before = self._row_lengths(slot)
        n = window - before[full]
        # Each row's count among those the spec allows (at most the block: the solo replays
        # take what each row kept of it), the filled row forgetting one at least.
        counts = [
            data.draw(
                st.sampled_from(
                    [c for c in range(b == full, n + 1) if self._may_forget(before[b], n, c)]
                ),
                label=f"count {b}",
            )
            for b in range(len(before))
        ]
        b = data.draw(st.integers(0, len(before) - 1), label="refused row")
        first = next(
            c for c in range(1, before[b] + n + 2) if not self._may_forget(before[b], n, c)
        )
        refused = list(counts)
        refused[b] = data.draw(st.integers(first, first + 2), label=f"refused count {b}")
        note(
            f"trim_rows (fill): layout {slot.ident} row {full} +{n} to {window}, "
            f"{refused} refused, {counts}"
        )
        pending = self._fill_block(slot, n, data)
        after = f"after a block of {n} onto rows {before}"
        self._refused(
            f"trim_rows({refused}) {after}",
            lambda impl, lay: lay.trim_rows(refused),
            slot.ref,
            slot.opt,
            NotTrimmableError,
        )
        self.stats.state(RING_TRIM_REFUSED)
        label = f"trim_rows({counts}) {after}"
        self._exact(f"{label} (reference)", slot.ref.trim_rows(counts), max(counts))
        self._exact(f"{label} (optimized)", slot.opt.trim_rows(counts), max(counts))
        self.stats.state(FULL_RING_ROLLBACK)
        self._fill_replay(slot, pending, counts)

    # The hooks of ``_build_wrapped`` (a ring's rules supply them; the joins and blocks are
    # ``_build_uneven``'s: :meth:`_join_for_trim`, :meth:`_uneven_block`).
    def _wrapped_short(self, slot: Any) -> bool:
        """``slot`` has wrapped and holds a row shorter than its window: the state a block
        then lands in (``WRAPPED_RING_BLOCK``)."""
        return False

    def _wrap_gap(self, lengths: Sequence[int]) -> bool:
        """Rows of ``lengths`` tokens can reach :meth:`_wrapped_short` by one-token steps
        and a block: the shortest holds two tokens less than the longest keeps (a
        shared ring pads the shortest row by the difference, its first wrapped step takes
        one column of it)."""
        kept = [self.g.kept(t) for t in lengths]
        return len(kept) >= 2 and min(kept) <= max(kept) - 2

    def _fresh_request(self) -> Any:
        """A request holding no token, to join a layout (the K/V writer's: a ``Track``)."""
        return self._new_track()

    def _wrapped_kinds(self, slot: Any) -> list[str]:
        """``wrapped`` in a ring's :meth:`_hard_steps` where ``slot`` is in the state, can
        step into it, or has room for a row that makes it so."""
        lengths = self._row_lengths(slot)
        if self._wrapped_short(slot) or self._wrap_gap(lengths) or len(lengths) < self.limits.rows:
            return ["wrapped"]
        return []

    def _build_wrapped(self, slot: Any, data: st.DataObject) -> None:
        """``WRAPPED_RING_BLOCK``, built (every ring's, through the hooks above): where
        the rows cannot wrap with a short row, a request holding no token joins (after a
        block of two where the longest row holds less); blocks then bring the longest
        row to its window and one-token steps wrap the ring (a shared ring rotates at
        the step after it fills), until a short row sits on a wrapped ring; then a block
        of two tokens or more (``_layout_step`` counts the state)."""
        if not self._wrapped_short(slot) and not self._wrap_gap(self._row_lengths(slot)):
            if max(self._row_lengths(slot)) < 2:
                self._uneven_block(slot, 2, data)
            request = self._fresh_request()
            self.pool.append(request)  # a free request for the join (which consumes it)
            note(f"multi_step (wrapped): empty request {request.ident} joins layout {slot.ident}")
            self._join_for_trim(slot, request)
        window = self._fill_window(slot)
        for _ in range(window + 2):  # a shared ring wraps within a window and a step
            lengths = self._row_lengths(slot)
            if self._wrapped_short(slot) or min(lengths) >= window:
                break  # there, or no short row left (a shared ring's pads ran out)
            k = window - max(lengths)
            self._uneven_block(slot, k if k >= 2 else 1, data)
        n = data.draw(st.integers(2, window + 2), label="N")
        note(f"multi_step (wrapped): layout {slot.ident} rows {self._row_lengths(slot)}, N={n}")
        self._uneven_block(slot, n, data)

    def _build_uneven(self, slot: Any, data: st.DataObject) -> None:
        """``UNEVEN_TRIM``, built (every writer's, through the hooks above): the rows are
        trimmed to the shortest one's length (equal rows; a layout of one row takes a
        free request first), then by unequal counts, then a block lands on them."""
        if len(self._row_lengths(slot)) < 2:
            request = self._pick(data, self._uneven_joins(slot), "request joining")
            note(f"trim_rows (uneven): a request joins layout {slot.ident}")
            self._join_for_trim(slot, request)
        lengths = self._row_lengths(slot)
        shortest = min(lengths)
        even = [t - shortest for t in lengths]
        counts = [data.draw(st.integers(0, shortest), label=f"count {b}") for b in range(len(even))]
        if len(set(counts)) == 1:  # unequal: one row forgets one token more or less
            counts[0] = counts[0] - 1 if counts[0] else 1
        n = data.draw(st.integers(1, 4), label="N")
        note(f"trim_rows (uneven): layout {slot.ident} {even}, then {counts}, then N={n}")
        if any(even):
            self._trim_rows(slot, even)
        self._trim_rows(slot, counts)
        assert slot.uneven, "equal rows trimmed unequally"
        self._uneven_block(slot, n, data)

    def _mirror_merge(self, slot: Slot, twins: Sequence[Any]) -> None:
        if not self._parity(slot) or not twins or self.peer is None:
            return
        self._peer_join(slot, twins)
        self.stats.check("mlx-lm merge")

    def _step(self, slot: Slot, n: int, rng: np.random.Generator, form: ks.MaskForm) -> None:
        rows, g = len(slot.rows), self.g
        keys = self._block(rng, rows, n, g.key_dim)
        values = self._block(rng, rows, n, g.value_dim)
        queries = self._queries(rng, rows, n)
        outputs = self._layout_step(slot, keys, values, queries, form)
        self._solo_step(slot, keys, values, queries, form, outputs)
        self._landed(slot)

    def _layout_step(
        self, slot: Slot, keys: Array, values: Array, queries: Array, form: ks.MaskForm
    ) -> tuple[Array, Array]:
        """Append one block to every row of a layout in both implementations (and its
        mlx-lm mirror): fetched planes, masks, visibility, attention. Returns both
        implementations' attention outputs; the rows' solo caches are not touched."""
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        rows, n = len(slot.rows), int(keys.shape[2])
        if n > 1 and self._wrapped_short(slot):
            self.stats.state(WRAPPED_RING_BLOCK)
        positions = [t.tokens for t in slot.rows]
        handle = slot.opt.offset
        self._exact(
            "positions (reference offset)", ref.to_numpy(slot.ref.offset).tolist(), positions
        )
        self._exact("positions (optimized offset)", opt.to_numpy(handle).tolist(), positions)
        kw = form.kwargs()
        mask_ref, mask_opt = slot.ref.make_mask(n, **kw), slot.opt.make_mask(n, **kw)
        lm = slot.lm if self._parity(slot) else None
        divergence = self._peer_divergence(slot, n) if lm is not None else None
        mask_lm = lm.make_mask(n, **form.mlx_lm_kwargs()) if lm is not None else None
        what = f"layout {slot.ident} step of {n} ({form})"
        (keys_ref, values_ref), (keys_opt, values_opt) = self._append(
            what, slot.ref, slot.opt, keys, values
        )
        self._exact(
            "the optimized offset captured before the step is unchanged (rebound, not mutated)",
            opt.to_numpy(handle).tolist(),
            positions,
        )
        self._exact(
            f"{what}: fetched shapes (optimized vs reference)",
            [p.shape for p in keys_opt + values_opt],
            [p.shape for p in keys_ref + values_ref],
        )
        s = int(keys_ref[0].shape[2])
        exp_ref, exp_opt = expand(mask_ref, rows, n, s), expand(mask_opt, rows, n, s)
        self._masks_equal(what, [exp_ref, exp_opt])
        model = [
            (b, _cat(t.keys, self._encoded(keys[b : b + 1])), t.tokens, t.held)
            for b, t in enumerate(slot.rows)
        ]
        seen = self._visibility(
            f"{what} (reference)", keys_ref, exp_ref, model, n, form.window_size
        )
        self._visibility(f"{what} (optimized)", keys_opt, exp_opt, model, n, form.window_size)
        for b, columns in enumerate(seen):
            for name, got, want in (
                ("keys", keys_opt, keys_ref),
                ("values", values_opt, values_ref),
            ):
                for i, (a, e) in enumerate(
                    zip(take_columns(got, b, columns), take_columns(want, b, columns), strict=True)
                ):
                    self._close("kv.fetched", f"{what} fetched {name} row {b} plane {i}", a, e)
        out_ref = self._attend(ref, queries, slot.ref, mask_ref, what)
        out_opt = self._attend(opt, queries, slot.opt, mask_opt, what)
        self._close("attention", f"{what} attention", out_opt, out_ref)
        self._check_deferred(
            what,
            queries,
            (out_ref, out_opt),
            (keys_ref, keys_opt),
            exp_ref,
            [(b, t, keys[b : b + 1], values[b : b + 1]) for b, t in enumerate(slot.rows)],
        )
        if lm is not None and self.peer is not None:
            lm_positions = np.array(lm.offset).tolist()
            lk, lv = lm.update_and_fetch(self._lm_copy(keys), self._lm_copy(values))
            self._exact(
                "mlx-lm offsets captured before the step are unchanged", lm_positions, positions
            )
            k_lm, v_lm = planes_of(opt, lk), planes_of(opt, lv)
            same = self._step_parity(
                slot,
                what,
                n,
                divergence,
                mask_lm,
                exp_opt,
                (k_lm, v_lm),
                (keys_opt, values_opt),
                seen,
            )
            if same:
                self._visibility(
                    f"{what} (mlx-lm)",
                    k_lm,
                    expand(mask_lm, rows, n, int(k_lm[0].shape[2])),
                    model,
                    n,
                    form.window_size,
                )
                out_lm = self.peer.attention(
                    self._lm_copy(queries), lk, lv, cache=lm, scale=g.scale, mask=mask_lm
                )
                self._close(
                    self._mlx_lm_attention, f"{what} attention", out_opt, opt.to_numpy(out_lm)
                )
                self.stats.check("mlx-lm step")
        return out_ref, out_opt

    def _solo_step(
        self,
        slot: Slot,
        keys: Array,
        values: Array,
        queries: Array,
        form: ks.MaskForm,
        outputs: tuple[Array, Array],
    ) -> None:
        """Solo replay: each row's serial caches take the same block; same attention output."""
        rows = len(slot.rows)
        out_ref, out_opt = outputs
        for b, track in enumerate(slot.rows):
            kb, vb, qb = keys[b : b + 1], values[b : b + 1], queries[b : b + 1]
            self._solo_row(
                track, kb, vb, qb, form, (out_ref[b : b + 1], out_opt[b : b + 1]), f"row {b}"
            )
            if track.lm is not None:
                track.lm.update_and_fetch(self._lm_copy(kb), self._lm_copy(vb))
        self.stats.check("solo attention", rows)

    def _solo_row(
        self,
        track: Track,
        keys: Array,
        values: Array,
        queries: Array,
        form: ks.MaskForm,
        expected: tuple[Array, Array],
        what: str,
    ) -> None:
        """A row's serial caches (both implementations) take ``keys``/``values``; their
        attention for ``queries`` equals ``expected`` (the layout row's, reference and
        optimized), and the row's model records the append."""
        ref, opt, kw = self.ref_impl, self.opt_impl, form.kwargs()
        n = int(keys.shape[2])
        masks = track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)
        for impl, cache in ((ref, track.ref), (opt, track.opt)):
            cache.update_and_fetch(self._give(impl, keys, "solo"), self._give(impl, values, "solo"))
        solo_ref = self._attend(ref, queries, track.ref, masks[0], f"{what} solo")
        solo_opt = self._attend(opt, queries, track.opt, masks[1], f"{what} solo")
        self._close(
            "attention.solo", f"reference {what} vs its serial cache", expected[0], solo_ref
        )
        self._close(
            "attention.solo", f"optimized {what} vs its serial cache", expected[1], solo_opt
        )
        self._record_append(track, keys, values)

    def _step_parity(
        self,
        slot: Slot,
        what: str,
        n: int,
        divergence: str | None,
        mask_lm: Any,
        exp_opt: npt.NDArray[np.bool_],
        fetched_lm: tuple[Planes, Planes],
        fetched_opt: tuple[Planes, Planes],
        seen: list[list[int]],
    ) -> bool:
        """mlx-lm's batch on the same step: fetched columns, masks; ``False`` where a named
        divergence makes its mask differ (it may then only hide keys)."""
        rows = len(slot.rows)
        k_lm = fetched_lm[0]
        self._exact(
            f"{what}: mlx-lm fetched shapes",
            [p.shape for p in k_lm],
            [p.shape for p in fetched_opt[0]],
        )
        for b, columns in enumerate(seen):
            for name, got, want in (
                ("keys", fetched_opt[0], k_lm),
                ("values", fetched_opt[1], fetched_lm[1]),
            ):
                for a, e in zip(
                    take_columns(got, b, columns), take_columns(want, b, columns), strict=True
                ):
                    self._close("kv.mlx_lm", f"{what} fetched {name} row {b} vs mlx-lm", a, e)
        exp_lm = expand(mask_lm, rows, n, int(k_lm[0].shape[2]))
        if divergence is not None and not np.array_equal(exp_lm, exp_opt):
            self._exact(
                f"{what}: {divergence} only hides keys kvrows shows",
                bool(np.all(exp_opt | ~exp_lm)),
                True,
            )
            self._skip(divergence, f"{what}: mlx-lm's mask hides a visible token")
            return False
        self._masks_equal(f"{what} vs mlx-lm", [exp_opt, exp_lm])
        return True

    def _steppable(self) -> list[Slot]:
        return [s for s in self.slots if s.rows]

    def _state_rows(self, impl: Impl, cache: Any) -> list[tuple[Any, ...]]:
        """The rows ``cache.state`` holds, canonical: position and time-ordered planes (a
        writer's form: what it holds per row)."""
        entry = cache.composition
        fields = unpack_state(entry, cache.state)
        keep = getattr(cache.token_geometry, "keep", 0)
        rows = rows_of_state(entry, fields, _state_concat, keep=keep)
        return [
            (
                offset,
                None if keys is None else planes_bytes(tuple(impl.to_numpy(p) for p in keys)),
                None if values is None else planes_bytes(tuple(impl.to_numpy(p) for p in values)),
            )
            for keys, values, offset in rows
        ]

    def _state_pending(self, ref_cache: Any, opt_cache: Any) -> bool:
        """The family has no saved-state form yet (:attr:`state_pending` says why) and the
        reference, which defines the forms, refuses ``state`` with ``UnsupportedStateError``:
        the state checks are skipped (they run as soon as the form lands)."""
        if self.state_pending is None:
            return False
        try:
            ref_cache.state  # noqa: B018 (the property raises when there is no form)
        except UnsupportedStateError:
            self.stats.check("state form pending")
            return True
        return False

    def _check_state(self, what: str, ref_cache: Any, opt_cache: Any) -> None:
        """Both implementations' ``state`` describe the same rows (the reference's is the
        canonical form; the optimized may keep its physical column order)."""
        if self._state_pending(ref_cache, opt_cache):
            return
        self._exact(
            f"{what}: rows of the saved state",
            self._state_rows(self.opt_impl, opt_cache),
            self._state_rows(self.ref_impl, ref_cache),
        )
        self.stats.check("state")

    def _restored(self, what: str, ref_cache: Any, opt_cache: Any) -> tuple[Any, Any]:
        """``type(c).from_state(c.state)`` of both, after checking their states agree; the
        machine then goes on with the restored caches (every later check applies)."""
        if self._state_pending(ref_cache, opt_cache):
            return ref_cache, opt_cache
        self._check_state(what, ref_cache, opt_cache)
        keep = getattr(ref_cache.token_geometry, "keep", 0)
        # Ring layouts whose form saves the frame's left_padding (a delayed ring's frame is
        # its stages': its record and rows are the delayed machine's to check). Each state
        # is unpacked once (a layout's ``state`` gathers every row).
        forms = (
            [unpack_state(c.composition, c.state) for c in (opt_cache, ref_cache)]
            if hasattr(ref_cache, "left_pad") and hasattr(ref_cache, "max_size")
            else []
        )
        pads = bool(forms) and "left_padding" in forms[1]
        if pads:
            # Raw, not through rows_of_state: a wrapped ring row's negative pad (mlx-lm's).
            saved = [form["left_padding"] for form in forms]
            self._exact(
                f"{what}: saved left_padding",
                self.opt_impl.to_numpy(saved[0]).tolist(),
                self.ref_impl.to_numpy(saved[1]).tolist(),
            )
        pair = tuple(
            type(c).from_state(c.state, keep=keep, geometry=c.geometry)
            for c in (ref_cache, opt_cache)
        )
        for cache, copy in zip((ref_cache, opt_cache), pair, strict=True):
            self._exact(
                f"{what}: {type(cache).__name__} restored from its state",
                (copy.signature(), repr(copy.geometry)),
                (cache.signature(), repr(cache.geometry)),
            )
        if pads:
            self._exact(f"{what}: left_pad restored", pair[1].left_pad, pair[0].left_pad)
            # The live columns: past the window a load drops the block history (the saved
            # idx need not say so: kvrows' form of a ring with sinks saves each row's window).
            held = bool(ref_cache.row_offsets) and max(ref_cache.row_offsets) > 0
            if held and ref_cache.width <= ref_cache.max_size:
                # The load keeps each row's pad but the columns every row pads.
                common = max(0, min(ref_cache.left_pad))
                self._exact(
                    f"{what}: left_pad after a load",
                    pair[0].left_pad,
                    tuple(pad - common for pad in ref_cache.left_pad),
                )
        self.stats.check("save_restore")
        return pair[0], pair[1]

    def _hold_out(self, what: str, got_ref: Any, got_opt: Any) -> None:
        """Remember an extracted/published cache: it must keep what it holds now."""
        for impl, cache in ((self.ref_impl, got_ref), (self.opt_impl, got_opt)):
            held = (int(cache.offset), planes_bytes(self._view(impl, cache)))
            self._outputs.append((what, impl, cache, held))

    def _check_serial_like(self, what: str, got_ref: Any, got_opt: Any, track: Track) -> None:
        """An extracted/published row: a serial cache of the family holding the row's view,
        whose planes are exactly ``projected_bytes`` of a row of its tokens."""
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        self._exact(f"{what}: reference type", type(got_ref), ref.cls(self.serial_name))
        self._exact(f"{what}: optimized type", type(got_opt), opt.cls(self.serial_name))
        self._exact(
            f"{what}: offsets", (got_ref.offset, got_opt.offset), (track.tokens, track.tokens)
        )
        self._exact(f"{what}: signatures", got_opt.signature(), got_ref.signature())
        self._exact(
            f"{what}: signature is the serial cache's", got_ref.signature(), track.ref.signature()
        )
        self._exact(f"{what}: geometry", got_opt.geometry, got_ref.geometry)
        self._exact(
            f"{what}: is_trimmable",
            (got_ref.is_trimmable(), got_opt.is_trimmable()),
            (not g.wrapped(track.tokens),) * 2,
        )
        model = self._model_view(track)
        for name, impl, got, solo in (
            ("reference", ref, got_ref, track.ref),
            ("optimized", opt, got_opt, track.opt),
        ):
            view = self._view(impl, got)
            self._same_planes("kv.solo", f"{what} ({name}) vs the model", view, model)
            self._same_planes(
                "kv.solo", f"{what} ({name}) solo cache vs the model", self._view(impl, solo), model
            )
            held = sum(int(p.nbytes) for p in view) if view is not None else 0
            if got.geometry is not None:
                self._exact(
                    f"{what} ({name}): compact plane bytes vs the spec",
                    held,
                    g.token_bytes() * g.kept(track.tokens, track.held),
                )
            self._exact(f"{what} ({name}): nbytes covers the planes", int(got.nbytes) >= held, True)
        self.stats.check("solo replay")

    def _check_published_prefix(self, slot: Slot, b: int, tokens: int, track: Track) -> None:
        """What "covers ``tokens``" promises: another published copy, cut back to
        ``tokens`` as a prefix store cuts it, holds exactly them and equals what a solo
        cache of the row's first ``tokens`` tokens holds (the model of that prefix)."""
        g = self.g
        keys = tuple(p[:, :, :tokens] for p in track.keys)
        values = tuple(p[:, :, :tokens] for p in track.values)
        # The published row held every position: its prefix holds every one of them.
        kept = g.kept(tokens, tokens)
        want = (*_newest(keys, kept, g.keep), *_newest(values, kept, g.keep))
        what = f"publish_row({b}, {tokens}) cut back to {tokens}"
        for impl, lay in ((self.ref_impl, slot.ref), (self.opt_impl, slot.opt)):
            copy = table.publish_row(lay, b, tokens)
            assert copy is not None, f"{what} ({impl.name}): a second publish refused"
            count = int(copy.offset) - tokens
            self._exact(f"{what} ({impl.name}): trim return", copy.trim(count), count)
            self._exact(f"{what} ({impl.name}): offset", int(copy.offset), tokens)
            self._same_planes("kv.solo", f"{what} ({impl.name})", self._view(impl, copy), want)
        self.stats.check("published prefix")

    def _solo_trim(self, track: Track, n: int) -> None:
        self._exact("solo trim (reference)", track.ref.trim(n), n)
        self._exact("solo trim (optimized)", track.opt.trim(n), n)
        if track.lm is not None:
            track.lm.trim(n)
        self._record_trim(track, n)

    # ------------------------------------------------------------ invalid input
    def _bad_blocks(
        self, rows: int, known: bool
    ) -> list[tuple[str, Callable[[Impl], tuple[Any, Any]]]]:
        """Blocks an update must refuse: (label, impl -> (keys, values))."""
        g = self.g
        rng = np.random.default_rng(0)
        other = next(d for d in NUMPY_DTYPES if d != g.dtype)

        def block(
            shape_k: tuple[int, ...], shape_v: tuple[int, ...], dk: str, dv: str
        ) -> Callable[[Impl], tuple[Any, Any]]:
            k = (
                random_block(rng, shape_k, dk)
                if dk in NUMPY_DTYPES
                else np.zeros(shape_k, dtype=dk)
            )
            v = (
                random_block(rng, shape_v, dv)
                if dv in NUMPY_DTYPES
                else np.zeros(shape_v, dtype=dv)
            )
            return lambda impl: (impl.to_native(k), impl.to_native(v))

        b = max(rows, 1)
        step = g.group_size or 8  # another head dim the codec can store
        good_k, good_v = (b, g.heads, 1, g.key_dim), (b, g.heads, 1, g.value_dim)
        cases = [
            ("keys of rank 3", block(good_k[1:], good_v[1:], g.dtype, g.dtype)),
            (
                "N = 0",
                block((b, g.heads, 0, g.key_dim), (b, g.heads, 0, g.value_dim), g.dtype, g.dtype),
            ),
            ("int32 keys and values", block(good_k, good_v, "int32", "int32")),
            ("keys and values of different dtypes", block(good_k, good_v, g.dtype, other)),
            (
                "keys and values with different N",
                block(good_k, (b, g.heads, 2, g.value_dim), g.dtype, g.dtype),
            ),
        ]
        if rows:
            cases.append(
                (
                    "one row too many",
                    block((b + 1, *good_k[1:]), (b + 1, *good_v[1:]), g.dtype, g.dtype),
                )
            )
        if known:
            heads_k, heads_v = (b, g.heads + 1, 1, g.key_dim), (b, g.heads + 1, 1, g.value_dim)
            cases += [
                ("a different dtype", block(good_k, good_v, other, other)),
                ("one KV head more", block(heads_k, heads_v, g.dtype, g.dtype)),
                (
                    "a different key dim",
                    block((b, g.heads, 1, g.key_dim + step), good_v, g.dtype, g.dtype),
                ),
                (
                    "a different value dim",
                    block(good_k, (b, g.heads, 1, g.value_dim + step), g.dtype, g.dtype),
                ),
            ]
        if g.affine:
            # Head dims the group does not divide: refused even before the geometry is known.
            cases += [
                (
                    f"a key dim {g.key_dim + 8} the group does not divide",
                    block((b, g.heads, 1, g.key_dim + 8), good_v, g.dtype, g.dtype),
                ),
                (
                    f"a value dim {g.value_dim + 16} the group does not divide",
                    block(good_k, (b, g.heads, 1, g.value_dim + 16), g.dtype, g.dtype),
                ),
                (
                    "head dims 16 (below the group)",
                    block((b, g.heads, 1, 16), (b, g.heads, 1, 16), g.dtype, g.dtype),
                ),
            ]
        k_np, v_np = random_block(rng, good_k, g.dtype), random_block(rng, good_v, g.dtype)
        cases.append(
            (
                "the other implementation's arrays",
                lambda impl: (
                    (k_np, v_np)
                    if impl.name != "reference"
                    else (mx.array(k_np.astype(np.float32)), mx.array(v_np.astype(np.float32)))
                ),
            )
        )
        return cases

    def _foreign(self, impl: Impl, what: str) -> Any:
        """A cache of ``impl`` holding two tokens that a layout of this machine must refuse
        (or, for ``dtype`` / ``heads`` with a known geometry, a layout must refuse)."""
        g = self.g
        heads, key_dim, value_dim, dtype, name = (
            g.heads,
            g.key_dim,
            g.value_dim,
            g.dtype,
            self.serial_name,
        )
        ring, affine = CONSTRUCTORS[name]
        changes: dict[str, int] = {}
        if what == "dtype":
            dtype = next(d for d in NUMPY_DTYPES if d != g.dtype)
        elif what == "heads":
            heads = g.heads + 1
        elif what == "key_dim":
            key_dim = g.key_dim + (g.group_size or 8)
        elif what == "window":
            changes["max_size"] = (g.max_size or 8) + 1
        elif what == "full attention":
            name = "QuantizedKVCache" if affine else "KVCache"
        elif what == "other codec":
            # The serial storage of the other codec (plain <-> affine) and the same token
            # geometry: a storage, never a layout (the table lists layouts of every codec).
            other = "plain" if affine else "affine"
            name = next(
                n
                for n, traits in CONSTRUCTORS.items()
                if traits[0] == ring
                and composition(n).arrangement == "serial"
                and composition(n).codec == other
            )
            key_dim = value_dim = 32 if not affine else key_dim
        elif what == "other bits":
            changes["bits"] = 8 if g.bits != 8 else 4
        elif what == "other group":
            changes["group_size"] = 64 if g.group_size == 32 else 32
            key_dim = value_dim = 64
        return self._fill(impl, self._new(impl, name, **changes), key_dim, value_dim, heads, dtype)

    def _fill(
        self,
        impl: Impl,
        cache: Any,
        key_dim: int,
        value_dim: int | None = None,
        heads: int | None = None,
        dtype: str | None = None,
    ) -> Any:
        """``cache`` after one append of two tokens (the example's shapes unless given)."""
        g = self.g
        rng = np.random.default_rng(1)
        k = random_block(rng, (1, heads or g.heads, 2, key_dim), dtype or g.dtype)
        v = random_block(rng, (1, heads or g.heads, 2, value_dim or g.value_dim), dtype or g.dtype)
        cache.update_and_fetch(impl.to_native(k), impl.to_native(v))
        return cache

    def _layout_cases(self, slot: Slot) -> list[Case]:
        """Invalid operations on a layout: (label, call(impl, layout), skip code, type)."""
        rows, g = len(slot.rows), self.g
        known = slot.ref.geometry is not None
        cases: list[Case] = []
        if rows == 0:
            cases.append(
                ("fetch() of a layout without rows", lambda impl, lay: lay.fetch(), "V0", None)
            )
            k = random_block(np.random.default_rng(2), (1, g.heads, 1, g.key_dim), g.dtype)
            v = random_block(np.random.default_rng(3), (1, g.heads, 1, g.value_dim), g.dtype)
            cases.append(
                (
                    "update of an empty layout",
                    lambda impl, lay: lay.update_and_fetch(impl.to_native(k), impl.to_native(v)),
                    "V0",
                    None,
                )
            )
        else:
            cases += [
                (f"update with {label}", _update_with(make), "V0", None)
                for label, make in self._bad_blocks(rows, known)
            ]
            shortest = min(t.tokens for t in slot.rows)
            if slot.ref.is_trimmable():
                cases.append(
                    (
                        f"trim({shortest + 1}) past the shortest row",
                        lambda impl, lay: lay.trim(shortest + 1),
                        "B4",
                        None,
                    )
                )
            else:
                # A per-row ring trims every row by the per-row rule (``trim(n)`` is
                # ``trim_rows([n] * B)``): right after a block a wrapped row may still give
                # back its block's newest tokens, so the count is the first one a row
                # refuses. A shared write column refuses any trim once wrapped.
                wrapped_n = 1
                if self.spec.trim_rows and not self.spec.shared_column:
                    offsets, held = [t.tokens for t in slot.rows], slot.ref.retained
                    wrapped_n = next(
                        c
                        for c in range(1, max(offsets) + 2)
                        if any(
                            not g.may_forget(o, h, c) for o, h in zip(offsets, held, strict=True)
                        )
                    )
                cases.append(
                    (
                        f"trim({wrapped_n}) of a wrapped ring",
                        lambda impl, lay: lay.trim(wrapped_n),
                        "B11",
                        NotTrimmableError,
                    )
                )
            has_trim_rows = self._both_trim_rows(slot)
            if has_trim_rows and self.spec.shared_column and rows >= 2 and shortest >= 1:
                unequal = [0] * (rows - 1) + [1]
                cases.append(
                    (
                        f"trim_rows({unequal}) with unequal counts on a shared write column",
                        lambda impl, lay: lay.trim_rows(unequal),
                        "V0",
                        None,
                    )
                )
            if self.spec.trim_rows:
                counts = [t.tokens for t in slot.rows]
                counts[-1] += 1
                cases += [
                    (
                        f"trim_rows({counts}) past a row",
                        lambda impl, lay: lay.trim_rows(counts),
                        "V0",
                        None,
                    ),
                    (
                        "trim_rows with one count too many",
                        lambda impl, lay: lay.trim_rows([0] * (rows + 1)),
                        "V0",
                        None,
                    ),
                    (
                        "trim_rows with a negative count",
                        lambda impl, lay: lay.trim_rows([-1] * rows),
                        "V0",
                        None,
                    ),
                    ("trim_rows of a non-sequence", lambda impl, lay: lay.trim_rows(0), "V0", None),
                ]
                wrapped = [b for b, t in enumerate(slot.rows) if g.wrapped(t.tokens)]
                if wrapped:
                    # A wrapped row trims only while it keeps the whole window of the position
                    # it goes back to (a block keeps max_size - 1 history tokens): the first
                    # count it cannot afford.
                    b, offset = wrapped[0], slot.rows[wrapped[0]].tokens
                    held = slot.ref.retained[b]
                    refused = [c for c in range(1, offset + 1) if not g.may_forget(offset, held, c)]
                    if refused:
                        one = [refused[0] if r == b else 0 for r in range(rows)]
                        cases.append(
                            (
                                f"trim_rows({one}) past a wrapped row's window",
                                lambda impl, lay: lay.trim_rows(one),
                                "V0",
                                None,
                            )
                        )
            cases.append(
                ("filter naming a row twice", lambda impl, lay: lay.filter_rows([0, 0]), "V0", None)
            )

        def other_impl(impl: Impl) -> Impl:
            return self.opt_impl if impl.name == "reference" else self.ref_impl

        serial = self.serial_name
        cases += [
            ("trim(-1)", lambda impl, lay: lay.trim(-1), "V0", None),
            ("make_mask(0)", lambda impl, lay: lay.make_mask(0), "V0", None),
            ("make_mask(True)", lambda impl, lay: lay.make_mask(True), "V0", None),
            (
                "make_mask(1, window_size=0)",
                lambda impl, lay: lay.make_mask(1, window_size=0),
                "V0",
                None,
            ),
            ("projected_bytes(-1)", lambda impl, lay: lay.projected_bytes(-1), "V0", None),
            (
                f"extract_row({rows}) out of range",
                lambda impl, lay: lay.extract_row(rows),
                "V0",
                None,
            ),
            ("extract_row(-1)", lambda impl, lay: lay.extract_row(-1), "V0", None),
            ("extract_row(1.0)", lambda impl, lay: lay.extract_row(1.0), "V0", None),
            (
                f"can_publish_row({rows}, 0)",
                lambda impl, lay: lay.can_publish_row(rows, 0),
                "V0",
                None,
            ),
            (
                f"table.publish_row(layout, {rows}, 0)",
                lambda impl, lay: table.publish_row(lay, rows, 0),
                "V0",
                None,
            ),
            (f"filter naming row {rows}", lambda impl, lay: lay.filter_rows([rows]), "V0", None),
            ("filter with a non-sequence", lambda impl, lay: lay.filter_rows(0), "V0", None),
            ("filter with a string", lambda impl, lay: lay.filter_rows("0"), "V0", None),
            (
                "merge_rows of a bare cache (not a sequence)",
                lambda impl, lay: lay.merge_rows(self._new(impl, serial)),
                "V0",
                None,
            ),
            (
                "merge_rows of the layout itself",
                lambda impl, lay: lay.merge_rows([lay]),
                "V0",
                IncompatibleRowsError,
            ),
            (
                "merge_rows of one source twice",
                lambda impl, lay: lay.merge_rows([src := self._new(impl, serial), src]),
                "V0",
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a foreign object",
                lambda impl, lay: lay.merge_rows([object()]),
                "V0",
                None,
            ),
            (
                "merge_rows of the other implementation's cache",
                lambda impl, lay: lay.merge_rows([self._new(other_impl(impl), serial)]),
                "V0",
                None,
            ),
            (
                "merge_rows of two caches of different dtypes",
                lambda impl, lay: lay.merge_rows(
                    [self._foreign(impl, "dtype"), self._foreign(impl, "heads")]
                ),
                "B5",
                None,
            ),
            (
                "merge_rows of a cache of the other codec",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "other codec")]),
                "V0",
                None,
            ),
        ]
        if self.peer is not None and self.twins:
            peer, geo = self.peer, g
            cases.append(
                (
                    "merge_rows of an mlx-lm cache",
                    lambda impl, lay: lay.merge_rows([peer.serial(geo)]),
                    "V0",
                    None,
                )
            )
        if known:
            cases += [
                (
                    "merge_rows of a cache of another dtype",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "dtype")]),
                    "B5",
                    None,
                ),
                (
                    "merge_rows of a cache with another head count",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "heads")]),
                    "N2",
                    None,
                ),
                (
                    "merge_rows of a cache with another key dim",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "key_dim")]),
                    "V0",
                    None,
                ),
            ]
        return cases + self._extra_layout_cases(slot)

    def _serial_cases(self, track: Track) -> list[Case]:
        cases: list[Case] = [
            (f"serial update with {label}", _update_with(make), "V0", None)
            for label, make in self._bad_blocks(1 if track.appended else 0, track.geometry_known)
        ]
        cases += [
            ("serial trim(-1)", lambda impl, c: c.trim(-1), "V0", None),
            ("serial trim(1.5)", lambda impl, c: c.trim(1.5), "V0", None),
            ("serial make_mask(0)", lambda impl, c: c.make_mask(0), "V0", None),
            (
                "serial make_mask(1, window_size=0)",
                lambda impl, c: c.make_mask(1, window_size=0),
                "V0",
                None,
            ),
            (
                "table.filter_layout_rows of serial state",
                lambda impl, c: table.filter_layout_rows(c, [0]),
                "V0",
                None,
            ),
        ]
        if self.g.wrapped(track.tokens):
            cases.append(
                (
                    "serial trim(1) of a wrapped ring",
                    lambda impl, c: c.trim(1),
                    "B11",
                    NotTrimmableError,
                )
            )
        if not track.appended:
            cases.append(
                (
                    "fetch() of a cache that never held a token",
                    lambda impl, c: c.fetch(),
                    "V0",
                    None,
                )
            )
        return cases + self._extra_serial_cases(track)

    def _snapshot(self, impl: Impl, cache: Any) -> tuple[Any, ...]:
        """Everything observable about one cache or layout of ``impl`` (:func:`snapshot`)."""
        return snapshot(cache, impl, self.serial_view, self.row_view)

    def _snapshots(self, pairs: Sequence[tuple[Any, Any]]) -> tuple[list[Any], list[Any]]:
        ref, opt = self.ref_impl, self.opt_impl
        return [self._snapshot(ref, r) for r, _ in pairs], [
            self._snapshot(opt, o) for _, o in pairs
        ]

    def _everything(self) -> tuple[list[Any], list[Any]]:
        pairs: list[tuple[Any, Any]] = [(t.ref, t.opt) for t in self.pool]
        for s in self.slots:
            pairs.append((s.ref, s.opt))
            pairs.extend((t.ref, t.opt) for t in s.rows)
        return self._snapshots(pairs)

    def _same_error(
        self,
        label: str,
        ref: BaseException,
        opt: BaseException,
        expected: type[KvRowsError] | None = None,
    ) -> None:
        """Both raised the same ``KvRowsError`` subclass (the named one, if any) with the
        same message (:data:`MESSAGE_EXCEPTIONS` excepted)."""
        self._exact(f"{label}: error types (reference, optimized)", type(opt), type(ref))
        if expected is not None:
            self._exact(f"{label}: the error type the contract names", type(ref), expected)
        if not any(part in label for part in MESSAGE_EXCEPTIONS):
            self._exact(
                f"{label}: error messages (optimized vs reference)",
                self._message(opt),
                self._message(ref),
            )
            self.stats.check("error messages")

    def _message(self, error: BaseException) -> str:
        """An error's message as :meth:`_same_error` compares it (a family whose messages
        name the implementation's array type normalizes that name)."""
        return str(error)

    def _observed(self, impl: Impl, cache: Any) -> Any:
        """Everything observable about one of ``impl``'s caches (a family overrides it)."""
        return snapshot(cache, impl, self.serial_view, self.row_view)

    def _both_refuse(
        self,
        label: str,
        call: Callable[[Impl, Any], object],
        ref_obj: Any,
        opt_obj: Any,
        expected: type[KvRowsError] | None = None,
    ) -> None:
        """A bad call on ``ref_obj`` and ``opt_obj``: both raise the same ``KvRowsError``
        (:meth:`_same_error`) and leave their object as it was (:meth:`_observed`)."""
        pairs = ((self.ref_impl, ref_obj), (self.opt_impl, opt_obj))
        before = [self._observed(impl, obj) for impl, obj in pairs]
        errors = self._refusals(label, call, ref_obj, opt_obj)
        for (impl, obj), held in zip(pairs, before, strict=True):
            self._exact(f"{label}: {impl.name} unchanged", self._observed(impl, obj), held)
        self._same_error(label, *errors, expected)
        self.stats.check("error types")

    def _refused(
        self,
        label: str,
        call: Callable[[Impl, Any], object],
        ref_obj: Any,
        opt_obj: Any,
        expected: type[KvRowsError] | None = None,
        reach: Sequence[tuple[Any, Any]] | None = None,
    ) -> None:
        """A bad call on ``ref_obj`` and ``opt_obj``: both raise the same ``KvRowsError``
        (:meth:`_same_error`), and no cache the machine holds changed (:meth:`_everything`;
        only the ``reach`` pairs when the call can reach no other cache)."""

        def observed() -> tuple[list[Any], list[Any]]:
            return self._everything() if reach is None else self._snapshots(reach)

        before = observed()
        self._same_error(label, *self._refusals(label, call, ref_obj, opt_obj), expected)
        self._exact(f"{label}: every cache unchanged after the failed call", observed(), before)
        self.stats.check("error types")

    def _refusals(
        self, label: str, call: Callable[[Impl, Any], object], ref_obj: Any, opt_obj: Any
    ) -> tuple[KvRowsError, KvRowsError]:
        """The ``KvRowsError`` each implementation raises for ``call`` (anything else, or
        nothing, fails)."""
        ref_error = raised(self.ref_impl, label, partial(call, self.ref_impl, ref_obj))
        return ref_error, raised(self.opt_impl, label, partial(call, self.opt_impl, opt_obj))

    # ---------------------------------------------------------------- oracles

    def _check_everything(self, *, final: bool = False) -> None:
        for track in self.pool:
            self._check_request(track)
        for slot in self.slots:
            self._check_slot(slot)
        if final:
            # Both implementations' saved states describe the same rows (restores check
            # it as they go; every example ends with every cache's).
            items: list[Track | Slot] = [*self.pool, *self.slots]
            for item in items:
                self._check_state(f"{type(item).__name__.lower()} {item.ident}", item.ref, item.opt)
        self._check_independence()
        self.stats.check("full check")

    def _check_independence(self) -> None:
        """The caller's arrays never change after a call; extracted and published caches
        keep what they held while the layouts go on."""
        evaluate([native for _, _, native, _ in self._inputs])
        for label, impl, native, pristine in self._inputs:
            got = impl.to_numpy(native)
            if got.tobytes() != pristine.tobytes():
                raise AssertionError(
                    f"{impl.name} changed an input array after the call ({label}): an "
                    "implementation kept the caller's array and wrote into it"
                )
        for label, arrays, pristine in self._held_reads:
            held = [a for a in arrays if isinstance(a, mx.array)]
            evaluate(held)
            if [_bits(a) for a in held] != pristine:
                raise AssertionError(
                    f"the optimized read of {label} changed while the machine held it (a "
                    "later read wrote into its buffer)"
                )
        for label, impl, cache, held in self._outputs:
            now = (int(cache.offset), planes_bytes(self._view(impl, cache)))
            if now != held:
                raise AssertionError(
                    f"{impl.name}: the cache of {label} changed while the layout went on "
                    "(it shares storage with the layout)"
                )
        self.stats.check("independence")

    def _check_request(self, track: Track) -> None:
        """A free request: reference, optimized and mlx-lm serial caches hold the model."""
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        what = f"request {track.ident}"
        self._exact(
            f"{what} offsets (reference, optimized)",
            (track.ref.offset, track.opt.offset),
            (track.tokens,) * 2,
        )
        self._exact(f"{what} signature", track.opt.signature(), track.ref.signature())
        self._exact(f"{what} geometry", track.opt.geometry, track.ref.geometry)
        self._exact(
            f"{what} is_trimmable (reference, optimized)",
            (track.ref.is_trimmable(), track.opt.is_trimmable()),
            (not g.wrapped(track.tokens),) * 2,
        )
        self._exact(
            f"{what}: row_admission of serial state", table.row_admission([track.ref]), None
        )
        model = self._model_view(track)
        self._same_planes(
            "kv.stored", f"{what} view (reference)", self._view(ref, track.ref), model
        )
        self._same_planes(
            "kv.stored", f"{what} view (optimized)", self._view(opt, track.opt), model
        )
        got = [self._fetch(ref, track.ref), self._fetch(opt, track.opt)]
        fetched = [None if isinstance(x, KvRowsError) else x for x in got]
        if isinstance(got[0], KvRowsError) and isinstance(got[1], KvRowsError):
            label = f"{what} fetch() of an empty {type(track.ref).__name__}"
            self._same_error(label, got[0], got[1])
        same_order = fetched[0] is not None and planes_bytes(fetched[0]) == planes_bytes(fetched[1])
        masks = [
            (
                track.ref.make_mask(n, **form.kwargs()),
                track.opt.make_mask(n, **form.kwargs()),
                None if track.lm is None else track.lm.make_mask(n, **form.mlx_lm_kwargs()),
            )
            for n, form in ks.CHECKED_MASKS
        ]
        evaluate([m for trio in masks for m in trio])
        for (n, form), (m_ref, m_opt, m_lm) in zip(ks.CHECKED_MASKS, masks, strict=True):
            keys = g.retained(track.held, n)
            e_ref = expand(m_ref, 1, n, keys)
            e_opt = expand(m_opt, 1, n, keys)
            if same_order:
                self._masks_equal(f"{what} make_mask({n}, {form})", [e_ref, e_opt])
            else:  # rings read in another order: the same number of visible keys per query
                self._exact(
                    f"{what} make_mask({n}, {form}) visible counts",
                    e_opt.sum(axis=-1).tolist(),
                    e_ref.sum(axis=-1).tolist(),
                )
            if track.lm is not None:
                e_lm = expand(m_lm, 1, n, keys)
                if self.g.keep and not np.array_equal(e_opt, e_lm):
                    self._skip("K1", f"{what} make_mask({n}, {form}): mlx-lm slides over sinks")
                else:
                    self._masks_equal(f"{what} make_mask({n}, {form}) vs mlx-lm", [e_opt, e_lm])
        if track.lm is not None and self.peer is not None:
            self._exact(f"{what} mlx-lm offset", int(track.lm.offset), track.tokens)
            self._peer_serial_state(track)
            held = self.peer.serial_kv(track.lm)
            if held is not None and fetched[1] is not None:
                self._same_planes(
                    "kv.mlx_lm", f"{what} fetch() vs mlx-lm", view_planes(opt, held), fetched[1]
                )
            self.stats.check("mlx-lm serial")
        self.stats.check("reference vs optimized")

    def _fetch(self, impl: Impl, cache: Any) -> Planes | KvRowsError:
        """``fetch()`` as one NumPy tuple (keys' planes, values'), or the error it raised."""
        try:
            keys, values = cache.fetch()
        except KvRowsError as error:
            return detached(error)
        evaluate(_flat((keys, values)))
        key_planes, value_planes = planes_of(impl, keys), planes_of(impl, values)
        self._fetch_dtypes("fetch()", key_planes, value_planes)
        return (*key_planes, *value_planes)

    def _check_slot(self, slot: Slot) -> None:
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        r, o = slot.ref, slot.opt
        what = f"layout {slot.ident}"
        tokens = tuple(t.tokens for t in slot.rows)
        rows = len(slot.rows)
        self._exact(f"{what} batch_size", (r.batch_size, o.batch_size), (rows, rows))
        self._exact(f"{what} row_offsets (reference)", r.row_offsets, tokens)
        self._exact(f"{what} row_offsets (optimized)", o.row_offsets, tokens)
        self._exact(f"{what} left_pad", o.left_pad, r.left_pad)
        for name, impl, lay in (("reference", ref, r), ("optimized", opt, o)):
            offset = impl.to_numpy(lay.offset)
            self._exact(
                f"{what} offset ({name})",
                (offset.tolist(), str(offset.dtype)),
                (list(tokens), "int32"),
            )
        self._exact(f"{what} signature", o.signature(), r.signature())
        self._exact(f"{what} geometry", o.geometry, r.geometry)
        self._exact(f"{what} max_tokens", (r.max_tokens, o.max_tokens), (math.inf, math.inf))
        self._exact(f"{what} is_trimmable", o.is_trimmable(), r.is_trimmable())
        if not self.spec.shared_column:
            self._exact(
                f"{what} ragged is_trimmable: no row has wrapped",
                r.is_trimmable(),
                not any(g.wrapped(t) for t in tokens),
            )
        self._check_admission(slot)
        self._check_roles(slot)
        r.check_valid()
        o.check_valid()
        self._check_layout_shape(slot)
        lm = slot.lm if self._parity(slot) else None
        fetched = self._check_fetch(slot, what, tokens)
        width = int(fetched[0][0].shape[2]) if fetched is not None else 0
        made = [
            (
                r.make_mask(n, **form.kwargs()),
                o.make_mask(n, **form.kwargs()),
                lm.make_mask(n, **form.mlx_lm_kwargs()) if lm is not None and rows else None,
            )
            for n, form in ks.CHECKED_MASKS
        ]
        evaluate([m for trio in made for m in trio])
        for (n, form), (m_ref, m_opt, m_lm) in zip(ks.CHECKED_MASKS, made, strict=True):
            keys = int(np.shape(m_ref)[-1]) if isinstance(m_ref, np.ndarray) else width + n
            masks = [expand(m_ref, rows, n, keys), expand(m_opt, rows, n, keys)]
            self._masks_equal(f"{what} make_mask({n}, {form})", masks)
            if lm is not None and rows:
                e_lm = expand(m_lm, rows, n, keys)
                code = self._peer_divergence(slot, n)
                if code is not None and not np.array_equal(masks[1], e_lm):
                    self._exact(
                        f"{what} make_mask({n}) vs mlx-lm: {code} only hides",
                        bool(np.all(masks[1] | ~e_lm)),
                        True,
                    )
                else:
                    self._masks_equal(f"{what} make_mask({n}, {form}) vs mlx-lm", [masks[1], e_lm])
        for b, track in enumerate(slot.rows):
            model = self._model_view(track)
            self._same_planes(
                "kv.stored", f"{what} row {b} view (reference)", self._row_view(ref, r, b), model
            )
            self._same_planes(
                "kv.stored", f"{what} row {b} view (optimized)", self._row_view(opt, o, b), model
            )
            self._check_serial_like(
                f"{what} extract_row({b})", r.extract_row(b), o.extract_row(b), track
            )
        self.stats.check("reference vs optimized")
        if lm is not None and self.peer is not None:
            self._exact(f"{what} mlx-lm offsets", np.array(lm.offset).tolist(), list(tokens))
            self._exact(
                f"{what} mlx-lm left_padding", np.array(lm.left_padding).tolist(), list(r.left_pad)
            )
            self._peer_layout_state(slot, lm)
            held = self.peer.batch_kv(lm)
            if held is None or fetched is None:
                self._exact(
                    f"{what}: mlx-lm holds no keys, so no row holds a token",
                    (held is None, sum(tokens)),
                    (True, 0),
                )
            else:
                planes = view_planes(opt, held)
                assert planes is not None
                self._exact(
                    f"{what} mlx-lm fetched shapes",
                    [p.shape for p in planes],
                    [p.shape for p in fetched[1]],
                )
                for b, track in enumerate(slot.rows):
                    columns = [c for c, _ in self._token_columns(fetched[0], b, track)]
                    for a, e in zip(
                        take_columns(planes, b, columns),
                        take_columns(fetched[1], b, columns),
                        strict=True,
                    ):
                        self._close("kv.mlx_lm", f"{what} row {b} fetch() vs mlx-lm", a, e)
            self.stats.check("mlx-lm layout")

    def _check_admission(self, slot: Slot) -> None:
        """``projected_bytes(t)`` is the spec's bytes of a row of ``t`` tokens (what its
        extracted cache holds, capacity excluded: checked in ``_check_serial_like``), and
        ``table.row_admission`` sums it; before the geometry is known both refuse, alike."""
        g = self.g
        ts = [0, 1, 7] + ([g.max_size - 1, g.max_size + 5] if g.max_size else [])
        ts += [t.tokens for t in slot.rows]
        answers = []
        for name, lay in (("reference", slot.ref), ("optimized", slot.opt)):
            admission = table.row_admission([lay, lay])
            assert admission is not None
            what = f"layout {slot.ident} ({name})"
            self._exact(f"{what} row_admission max_tokens", admission.max_tokens, lay.max_tokens)
            got = [_answer(lay.projected_bytes, t) for t in ts]
            doubled = [_answer(admission.bytes, t) for t in ts]
            if lay.geometry is not None:
                want = [g.token_bytes() * g.kept(t) for t in ts]
                self._exact(f"{what} projected_bytes{ts}", got, want)
                self._exact(f"{what} row_admission bytes{ts}", doubled, [2 * x for x in got])
            else:
                self._exact(f"{what} projected_bytes{ts}, no geometry yet", got, doubled)
            answers.append(got)
        self._exact(
            f"layout {slot.ident} projected_bytes (optimized vs reference)", answers[1], answers[0]
        )
        self.stats.check("admission")

    def _check_roles(self, slot: Slot) -> None:
        """The row-layout table's every role for this layout (as a storage), per the
        composition table: the named class (``self``: its own), or none to verify."""
        roles = composition(self.spec.name).roles
        for role, get in ROLE_LOOKUPS.items():
            want = getattr(roles, role) if roles is not None else SELF
            if roles is None and role == "verify":
                want = NoRowLayoutError.__name__
            name = self.spec.name if want == SELF else want
            for impl, lay in ((self.ref_impl, slot.ref), (self.opt_impl, slot.opt)):
                got = _answer(get, lay)
                kind = got if isinstance(got, str) else type(got).__name__
                if kind != name and (isinstance(got, str) or type(got) is not impl.cls(name)):
                    raise AssertionError(
                        f"layout {slot.ident}: the table's {role} layout for {self.spec.name} "
                        f"({impl.name}) is {kind}; the composition table says {name}"
                    )
        self.stats.check("table roles")

    def _token_columns(self, planes: Planes, b: int, track: Track) -> list[tuple[int, int]]:
        """(column, position) of every token of ``track`` in row ``b`` of fetched planes."""
        position = self._positions(track.keys)
        found = column_ids(planes[: len(self._fetched_dtypes_now()[0])], b)  # the keys' planes
        return [(c, position[x]) for c, x in enumerate(found) if x in position]

    def _check_fetch(
        self, slot: Slot, what: str, tokens: tuple[int, ...]
    ) -> tuple[Planes, Planes] | None:
        """``fetch()``: both raise or both read; each row's token columns are the same bytes,
        and they hold a contiguous newest run of the row's tokens covering its view.
        Returns the optimized and reference fetch (``None`` when it raised)."""
        got_ref, got_opt = (
            self._fetch(self.ref_impl, slot.ref),
            self._fetch(self.opt_impl, slot.opt),
        )
        if isinstance(got_ref, KvRowsError) or isinstance(got_opt, KvRowsError):
            self._exact(
                f"{what} fetch() raises (reference, optimized)",
                (isinstance(got_ref, KvRowsError), isinstance(got_opt, KvRowsError)),
                (True, True),
            )
            assert isinstance(got_ref, KvRowsError) and isinstance(got_opt, KvRowsError)
            self._exact(f"{what} fetch() raises only when no row holds a token", sum(tokens), 0)
            empty = f"fetch() of an empty {type(slot.ref).__name__}"
            self._same_error(f"{what} {empty}", got_ref, got_opt)
            return None
        self._exact(
            f"{what} fetch() shapes", [p.shape for p in got_opt], [p.shape for p in got_ref]
        )
        for b, track in enumerate(slot.rows):
            held = self._token_columns(got_ref, b, track)
            found = sorted(p for _, p in held)
            sinks = min(self.g.keep, track.tokens, len(found))
            self._exact(
                f"{what} fetch() row {b}: its sinks and a newest run of the row's tokens",
                found,
                [*range(sinks), *range(track.tokens - len(found) + sinks, track.tokens)],
            )
            self._exact(
                f"{what} fetch() row {b}: covers the view",
                len(found) >= self.g.kept(track.tokens, track.held),
                True,
            )
            columns = [c for c, _ in held]
            for i, (a, e) in enumerate(
                zip(
                    take_columns(got_opt, b, columns),
                    take_columns(got_ref, b, columns),
                    strict=True,
                )
            ):
                self._close("kv.fetched", f"{what} fetch() row {b} plane {i}", a, e)
        return got_ref, got_opt


#: One block a writer writes: an array per tensor (or layer input), ``None`` where this
#: example has no such tensor (a latent without its index plane). ``Any``: a writer
#: unpacks its own tensors (keys and values are never ``None``).
Block = tuple[Any, ...]


class WriterRules(ConformanceMachine):
    """The writers' skeleton (the latent's, the recurrent's and the delayed's rules): a
    block is drawn, one array per tensor the writer writes (:meth:`_draw_block`), written
    to both implementations (:meth:`_write_pair`) and mlx-lm's twin (:meth:`_write_lm`),
    what the writes answered compared, reference vs optimized (:meth:`_same_writes`), and
    each row's part (its first tokens, :meth:`_part`) replayed on its solo caches and
    compared with the layout row's answers (:meth:`_solo_write`). A writer supplies only
    what differs: its tensors and draw, one write (:meth:`_write`: an append, a layer's
    run, ``update_and_fetch``), its comparison and its solo replay."""

    #: The blocks' token axis (``[B, H, N, D]`` tensors: 2; a layer's ``[B, N, C]``: 1).
    token_axis: ClassVar[int] = 2

    def _draw_block(self, rng: np.random.Generator, rows: int, n: int) -> Block:
        raise NotImplementedError

    def _write(self, impl: Impl, cache: Any, block: Block) -> Any:
        """One write of ``block`` to ``impl``'s ``cache``; what it answered (numpy)."""
        raise NotImplementedError

    def _write_lm(self, lm: Any, block: Block) -> None:
        """mlx-lm's twin (``None``: none) takes the block."""

    def _same_writes(
        self, what: str, got: tuple[Any, Any], target: Any, counts: Sequence[int] | None
    ) -> None:
        """The writes' answers agree, reference vs optimized (row ``b``'s first
        ``counts[b]`` tokens; every token without counts)."""

    def _solo_write(self, what: str, row: Any, part: Block, expected: Block | None) -> None:
        """A layout row's solo caches take its ``part`` of the block; their answers equal
        the layout row's ``expected`` (reference, optimized; ``None``: not compared)."""
        raise NotImplementedError

    def _write_pair(self, ref: Any, opt: Any, block: Block) -> tuple[Any, Any]:
        return self._write(self.ref_impl, ref, block), self._write(self.opt_impl, opt, block)

    def _write_both(
        self, what: str, target: Any, block: Block, counts: Sequence[int] | None = None
    ) -> tuple[Any, Any]:
        """``block`` written to ``target`` (a request or a layout: its ``ref``, ``opt``
        and ``lm``), the answers compared; returns them."""
        got = self._write_pair(target.ref, target.opt, block)
        self._write_lm(target.lm, block)
        self._same_writes(what, got, target, counts)
        return got

    def _part(self, block: Block, b: int | None, k: int | None = None) -> Block:
        """Row ``b``'s part of ``block`` (``None``: every row's): its first ``k`` tokens
        (``None``: all)."""
        rows = slice(None) if b is None else slice(b, b + 1)
        cut = (rows, *(slice(None),) * (self.token_axis - 1), slice(0, k))
        return tuple(None if x is None else np.ascontiguousarray(x[cut]) for x in block)

    def _write_solos(
        self,
        what: str,
        rows: Sequence[Any],
        block: Block,
        counts: Sequence[int] | None = None,
        answers: tuple[Any, Any] | None = None,
    ) -> None:
        """Each row's solo replay takes its part of ``block`` (its first ``counts[b]``
        tokens; a row of count 0 nothing), compared with its part of the layout's
        ``answers`` (reference, optimized) when given."""
        for b, row in enumerate(rows):
            k = None if counts is None else counts[b]
            if k == 0:
                continue
            expected = None if answers is None else self._part(answers, b, k)
            self._solo_write(f"{what} row {b}", row, self._part(block, b, k), expected)

    def _same_arrays(
        self, quantity: str, what: str, got: Array, want: Array, *, exact: bool = False
    ) -> None:
        """The base comparison at the tolerance of ``want``'s own dtype (``exact``: bytes)."""
        self._close(quantity, what, got, want, want.dtype.name, EXACT if exact else None)


class KvRules(ConformanceMachine):
    """The K/V writer's rules (``hooks.WRITERS["kv"].rules``): requests prefilled by
    ``update_and_fetch``, layouts merged, stepped, filtered, extracted, published and
    trimmed, bad calls, and the invariant, over the root's world model and oracles. A
    writer of other tensors (latent, recurrent) or the delayed modifier brings its own
    rules over the root instead."""

    @precondition(lambda self: self.geo is not None and len(self.pool) < self.limits.pool)
    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        """A request with a random prompt (0 tokens included), prefilled in random chunks."""
        length = self._prompt_length(data)
        chunks = data.draw(ks.chunk_sizes(length), label="chunks")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        track = self._new_track()
        note(f"new_request: request {track.ident}, prompt {length} in chunks {chunks}")
        self._op("new_request", track)
        for n in chunks:
            keys = self._block(rng, 1, n, self.g.key_dim)
            values = self._block(rng, 1, n, self.g.value_dim)
            self._serial_append(track, keys, values, self._queries(rng, 1, n), form)
        self.pool.append(track)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        """One more prompt chunk into a free request."""
        track = self._pick(data, self.pool, "request")
        n = self._chunk(data)
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        note(f"prefill_chunk: request {track.ident} (+{n} tokens onto {track.tokens})")
        self._op("prefill_chunk", track)
        keys = self._block(rng, 1, n, self.g.key_dim)
        values = self._block(rng, 1, n, self.g.value_dim)
        self._serial_append(track, keys, values, self._queries(rng, 1, n), form)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def trim_request(self, data: st.DataObject) -> None:
        """Serial trim: clamps before a ring wraps, raises (changing nothing) after."""
        track = self._pick(data, self.pool, "request")
        n = data.draw(st.integers(0, track.tokens + 2), label="n")
        note(f"trim_request: request {track.ident} holding {track.tokens}, trim({n})")
        self._op("trim_request", track)
        self._trim_serial(track, n)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        """Form a batch (new or emptied layout) or join rows into a running one."""
        targets = [s for s in self.slots if len(s.rows) < self.limits.rows]
        new = len(self.slots) < self.limits.layouts and data.draw(st.booleans(), label="new layout")
        if not targets and not new:
            return
        slot = self._new_slot(data) if new or not targets else self._pick(data, targets, "layout")
        room = self.limits.rows - len(slot.rows)
        sources, incoming, consumed = self._merge_sources(data, room)
        kind = "join" if slot.rows else "merge"
        note(
            f"{kind}: layout {slot.ident} ({slot.ref!r}) <- {[s[0] for s in sources]} = requests "
            f"{[t.ident for t in incoming]} with tokens {[t.tokens for t in incoming]}"
        )
        self._op(kind, slot)
        self._merge_into(slot, sources, incoming, consumed)

    @precondition(lambda self: len(self.slots) >= 2)
    @rule(data=st.data())
    def merge_layout(self, data: st.DataObject) -> None:
        """Merge one running layout into another (the source is borrowed and unchanged)."""
        target = self._pick(data, self.slots, "target layout")
        others = [s for s in self.slots if s is not target and s.rows]
        if not others:
            return
        source = self._pick(data, others, "source layout")
        if len(target.rows) + len(source.rows) > self.limits.rows:
            return
        note(f"merge_layout: layout {source.ident} into layout {target.ident}")
        self._op("merge_layout", target)
        before = self._snapshots([(source.ref, source.opt)])
        target.ref.merge_rows([source.ref])
        target.opt.merge_rows([source.opt])
        self._exact(
            "a merged layout is borrowed and left unchanged",
            self._snapshots([(source.ref, source.opt)]),
            before,
        )
        copies = [self._replay(t) for t in source.rows]
        self._mirror_merge(target, [t.lm for t in copies])
        target.rows.extend(copies)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """One token for every row (N = 1)."""
        slot = self._pick(data, self._steppable(), "layout")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        note(f"decode_step: layout {slot.ident} {slot.opt!r}, mask {form}")
        self._op("decode_step", slot)
        self._step(slot, 1, rng, form)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def multi_step(self, data: st.DataObject) -> None:
        """N > 1 tokens for every row (chunked prefill / a verify block)."""
        slot = self._pick(data, self._steppable(), "layout")
        if self._hard_step(slot, data):
            return
        n = self._block_size(data)
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        note(f"multi_step: layout {slot.ident} {slot.opt!r}, N={n}, mask {form}")
        self._op("multi_step", slot)
        self._step(slot, n, rng, form)

    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def filter_layout(self, data: st.DataObject) -> None:
        """Keep any subset in any order (drop the longest, reorder, keep none)."""
        slot = self._pick(data, self.slots, "layout")
        kind, keep = self._keep(data, slot)
        via_table = data.draw(st.booleans(), label="via table.filter_layout_rows")
        note(f"filter ({kind}): layout {slot.ident} {slot.opt!r} keep {keep}")
        self._op(f"filter:{kind}", slot, *slot.rows)
        pads = slot.ref.left_pad
        for lay in (slot.ref, slot.opt):
            if via_table:
                table.filter_layout_rows(lay, keep)
            else:
                lay.filter_rows(keep)
        self._after_filter(slot, pads, keep)
        if self._parity(slot) and slot.lm is not None:
            if not keep:
                self._skip("N1", "filter([]) on mlx-lm; the mirror restarts at the next merge")
                slot.lm = None
            else:
                self._peer_filter(slot, keep)
        kept = [slot.rows[i] for i in keep]
        dropped = [t for t in slot.rows if all(t is not k for k in kept)]
        slot.rows = kept
        self._filters += 1
        if self._filters % 4 == 0:  # every fourth filter (no draw: the search is unchanged)
            # A layout is rebuilt through merge_rows: same rows, fresh physical columns,
            # which an mlx-lm mirror does not follow.
            slot.ref, slot.opt = self._restored(f"layout {slot.ident}", slot.ref, slot.opt)
            slot.mirrored = False
        for track in dropped:
            if len(self.pool) < self.limits.pool:
                self.pool.append(track)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def extract(self, data: st.DataObject) -> None:
        """Extract a row: an independent compact serial cache, maybe kept as a new request."""
        slot = self._pick(data, self._steppable(), "layout")
        b = data.draw(st.integers(0, len(slot.rows) - 1), label="row")
        sole = len(slot.rows) == 1 and data.draw(st.booleans(), label="via extract_sole_row")
        track = slot.rows[b]
        note(f"extract: layout {slot.ident} row {b} (request {track.ident}, {track.tokens} tokens)")
        self._op("extract", slot)
        got_ref: Any
        got_opt: Any
        if sole:
            got_ref, got_opt = table.extract_sole_row(slot.ref), table.extract_sole_row(slot.opt)
        else:
            got_ref, got_opt = slot.ref.extract_row(b), slot.opt.extract_row(b)
        self._check_serial_like(f"extract_row({b})", got_ref, got_opt, track)
        twin = None
        if self._parity(slot) and self.peer is not None:
            if slot.lm is None or slot.lm.keys is None:
                self._skip("B3", "extract from an mlx-lm batch with no keys")
            else:
                twin = self._peer_extract(slot.lm, b, track)
        if len(self.pool) < self.limits.pool and data.draw(st.booleans(), label="keep as request"):
            self._kept_extracts += 1
            if self._kept_extracts % 2 == 1:  # every other kept row, the first included (no draw)
                # A serial cache restores column for column: its mlx-lm twin still follows.
                got_ref, got_opt = self._restored(f"extract_row({b})", got_ref, got_opt)
            # A row holding no token extracts as an empty cache that keeps the layout's
            # geometry (spec/contract.md §1; both answers were compared above).
            copy = Track(
                ident=next(self._ids),
                ref=got_ref,
                opt=got_opt,
                lm=twin,
                keys=track.keys,
                values=track.values,
                appended=track.tokens > 0,
                geometry_known=got_ref.geometry is not None,
                history=list(track.history) if track.tokens else [],
                held=track.held,
            )
            if copy.lm is None and self.peer is not None and self.twins:
                copy.lm = self._twin_for(track)
            note(f"  extracted row becomes request {copy.ident}")
            self._dirty.add(copy.ident)
            self.pool.append(copy)
        else:
            self._hold_out(f"extract_row({b}) of layout {slot.ident}", got_ref, got_opt)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """``table.publish_row``: the row as a serial cache, or ``None`` when it cannot cover."""
        slot = self._pick(data, self._steppable(), "layout")
        b = data.draw(st.integers(0, len(slot.rows) - 1), label="row")
        track = slot.rows[b]
        tokens = data.draw(publish_tokens(track.tokens, self.g.max_size), label="tokens")
        note(f"publish: layout {slot.ident} row {b} ({track.tokens} tokens) covering {tokens}")
        self._op("publish", slot)
        # The whole row, or a shorter prefix while the store could still be trimmed to it.
        expected = tokens == track.tokens or (
            tokens < track.tokens
            and not self.g.wrapped(track.tokens)
            and track.held == track.tokens  # it still holds every position
        )
        self._exact("can_publish_row (reference)", slot.ref.can_publish_row(b, tokens), expected)
        self._exact("can_publish_row (optimized)", slot.opt.can_publish_row(b, tokens), expected)
        got_ref = table.publish_row(slot.ref, b, tokens)
        got_opt = table.publish_row(slot.opt, b, tokens)
        self._exact(
            "publish_row returns None (reference, optimized)",
            (got_ref is None, got_opt is None),
            (not expected,) * 2,
        )
        if got_ref is not None:
            self._check_serial_like(f"publish_row({b}, {tokens})", got_ref, got_opt, track)
            self._hold_out(f"publish_row({b}, {tokens}) of layout {slot.ident}", got_ref, got_opt)
            if tokens < track.tokens:
                self._check_published_prefix(slot, b, tokens, track)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        """Trim every row by ``n`` (at most the shortest row; rings only before the wrap)."""
        slot = self._pick(data, self._steppable(), "layout")
        trimmable = slot.ref.is_trimmable()
        self._exact("is_trimmable (optimized vs reference)", slot.opt.is_trimmable(), trimmable)
        if not trimmable:
            return
        n = data.draw(ks.counts_up_to(min(t.held for t in slot.rows)), label="n")
        equal_counts = self._both_trim_rows(slot) and data.draw(
            st.booleans(), label="as trim_rows of equal counts"
        )
        note(f"trim: layout {slot.ident} {slot.opt!r} trim({n}){' as trim_rows' * equal_counts}")
        self._op("trim", slot)
        for name, lay in (("reference", slot.ref), ("optimized", slot.opt)):
            got = lay.trim_rows([n] * len(slot.rows)) if equal_counts else lay.trim(n)
            self._exact(f"trim() return ({name})", got, n)
        if self._parity(slot) and slot.lm is not None:
            self._exact("trim() return (mlx-lm)", slot.lm.trim(n), n)
            self.stats.check("mlx-lm trim")
        for track in slot.rows:
            self._solo_trim(track, n)

    @precondition(lambda self: self.spec.trim_rows and any(s.rows for s in self.slots))
    @rule(data=st.data())
    def trim_rows(self, data: st.DataObject) -> None:
        """Per-row rollback on a ragged layout: a row that has not wrapped forgets
        ``counts[b]``. Where the layout allows, half the runs build a hard state
        instead (``_hard_trims``: spec/contract.md §0.11), the free draws reaching them
        0 times; a branch of this rule, not rules of their own, so a machine's other
        layouts draw exactly as before."""
        slot = self._pick(data, self._steppable(), "layout")
        if self._hard_trim(slot, data):
            return
        counts = [
            0
            if self.g.wrapped(t.tokens)
            else data.draw(ks.counts_up_to(t.held), label=f"count {b}")
            for b, t in enumerate(slot.rows)
        ]
        note(f"trim_rows: layout {slot.ident} {slot.opt!r} counts {counts}")
        self._op("trim_rows", slot)
        self._trim_rows(slot, counts)

    def _hard_trims(self, slot: Slot) -> list[str]:
        """``uneven`` (``UNEVEN_TRIM``) where two or more rows hold a token and none has
        wrapped (a wrapped ring row takes no free count)."""
        return self._uneven_rows(slot, lambda tokens: not self.g.wrapped(tokens))

    def _uneven_joins(self, slot: Slot) -> list[Track]:
        if len(slot.rows) >= self.limits.rows:
            return []
        return [t for t in self.pool if t.held >= 1 and not self.g.wrapped(t.tokens)]

    def _join_for_trim(self, slot: Slot, request: Track) -> None:
        self._merge_into(
            slot, [(f"request {request.ident}", request.ref, request.opt)], [request], [request]
        )

    def _uneven_block(self, slot: Slot, n: int, data: st.DataObject) -> None:
        form = data.draw(ks.mask_forms(), label="mask form")
        self._step(slot, n, self._rng(data), form)

    def _trim_rows(self, slot: Slot, counts: list[int]) -> None:
        """``trim_rows(counts)`` on both layouts, which every row's solo replay follows."""
        expected = max(counts, default=0)
        self._note_uneven(slot, counts)
        self._exact("trim_rows() return (reference)", slot.ref.trim_rows(counts), expected)
        self._exact("trim_rows() return (optimized)", slot.opt.trim_rows(counts), expected)
        for track, count in zip(slot.rows, counts, strict=True):
            self._solo_trim(track, count)

    @precondition(lambda self: bool(self.pool) or bool(self.slots))
    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """A bad call: both raise the same KvRowsError subclass and message; nothing changes."""
        targets: list[tuple[str, Any, Any, list[Case], Slot | None, Track | None]] = []
        for t in self.pool:
            targets.append((f"request {t.ident}", t.ref, t.opt, self._serial_cases(t), None, t))
        for s in self.slots:
            targets.append((f"layout {s.ident}", s.ref, s.opt, self._layout_cases(s), s, None))
        name, ref_obj, opt_obj, cases, slot, track = self._pick(data, targets, "target")
        label, call, code, expected = self._pick(data, cases, "invalid operation")
        note(f"invalid: {name}: {label}")
        self._op("invalid")
        self._refused(label, call, ref_obj, opt_obj, expected)
        if (slot is not None and self._parity(slot) and slot.lm is not None) or (
            track is not None and track.lm is not None and code == "B11"
        ):
            self._skip(code, label)

    @invariant()
    def check_oracles(self) -> None:
        """Check what the last rule touched, and everything every ``FULL_CHECK_EVERY`` rules
        (rules that must change nothing prove it with snapshots); teardown checks all."""
        if self.geo is None:
            return
        self._invariants += 1
        if self._invariants % FULL_CHECK_EVERY == 0:
            self._check_everything()
        else:
            for track in self.pool:
                if track.ident in self._dirty:
                    self._check_request(track)
            for slot in self.slots:
                if slot.ident in self._dirty:
                    self._check_slot(slot)
            self._check_independence()
        self._dirty.clear()
        self._clean = True


#: How a lease ends (``OpsChecks``: in turn; ``OpsRules.lease``: drawn).
LEASE_ENDS = ("close", "transfer", "failed release")


class OpsChecks(ConformanceMachine):
    """The public operations besides writes and row changes (issue 24): ``lease``
    (contract §7) and ``save_load`` (the saved form across implementations), over the
    root's world model, as checks that draw nothing: every ``ops_cadence``-th invariant
    check leases one request or layout and saves and loads one (targets and lease ends in
    turn), the machine going on with the live caches. A rule would change every
    derandomized example of the machines it joins and the examples at which they reach
    their required states (measured: the speculative rings and turbo then need two to
    four times their CI examples); an invariant leaves the search as it was.
    ``OpsRules`` makes them rules (the paged families, which take them that way)."""

    #: Every how many invariant checks the two run (``None``: never).
    ops_cadence: ClassVar[int | None] = 6
    _ops_checks = 0

    @invariant()
    def check_ops(self) -> None:
        cadence = self.ops_cadence
        targets = None if cadence is None else self._ops_targets()
        if cadence is None or targets is None:
            return
        self._ops_checks += 1
        turn, due = divmod(self._ops_checks, cadence)
        if due:
            return
        leased, saved = targets
        if leased:
            how = LEASE_ENDS[turn % len(LEASE_ENDS)]
            if self._lease(leased[turn % len(leased)], how):
                self.stats.op(f"lease:{how}")
        if saved:
            item = saved[turn % len(saved)]
            if not self._state_pending(item.ref, item.opt):
                self.stats.op("save_load")
                self._save_load(item)

    def _ops_targets(self) -> tuple[list[OpsTarget], list[OpsTarget]] | None:
        """What :meth:`check_ops` leases (every request and layout) and saves (the layouts
        with rows, then the requests), in turn; ``None`` before the example's set-up. A
        writer with a world model of its own (``Request``, ``Layout``) names its own."""
        if self.geo is None:
            return None
        return [*self.pool, *self.slots], [*self._steppable(), *self.pool]

    def _lease(self, item: OpsTarget, how: str) -> bool:
        """``lease_cache_states`` over a request or a layout and its rows' solo caches
        (contract §7): ``borrow()`` is every cache's ``state``, borrowed (no cache asks
        for a release); then ``close()`` or ``transfer()``, a second ``close()`` (a no-op),
        and a ``borrow()`` after it, refused alike (``LayoutStateError``, the same message)
        with every cache unchanged. Half the examples add a state whose release fails:
        closing raises its error in both, ownership ends all the same. ``False`` (nothing
        done) while a cache's state is pending."""
        pairs = self._leased_pairs(item)
        if pairs is None:
            return False
        # A lease reaches only the caches it is given: their snapshots are the check.
        before = self._snapshots(pairs)
        leases, failing = [], []
        for index, impl in enumerate((self.ref_impl, self.opt_impl)):
            caches = [pair[index] for pair in pairs]
            self._exact(
                f"state_needs_dispose ({impl.name})",
                [bool(c.state_needs_dispose) for c in caches],
                [False] * len(caches),
            )
            owned: list[Any] = [_FailingRelease(impl.name)] if how == "failed release" else []
            lease = lease_cache_states([*owned, *caches])
            borrowed = lease.borrow()
            states = [*(s for o in owned for s in o.state), *(s for c in caches for s in c.state)]
            self._exact(
                f"a lease borrows every state ({impl.name})",
                _state_values(impl, borrowed),
                _state_values(impl, states),
            )
            leases.append(lease)
            failing += owned
        if how == "transfer":
            for lease in leases:
                lease.transfer()
        elif how == "close":
            for lease in leases:
                lease.close()
        else:
            errors = [
                raised(i, "close()", lease.close)
                for i, lease in zip((self.ref_impl, self.opt_impl), leases, strict=True)
            ]
            self._same_error(
                "a lease whose release fails: close()", errors[0], errors[1], LayoutStateError
            )
        self._exact(
            "the lease is over (reference, optimized)", [x.closed for x in leases], [True, True]
        )
        for lease in leases:
            lease.close()  # idempotent: nothing is released twice
        self._exact("releases run once", [f.released for f in failing], [1] * len(failing))
        self._refused(
            "borrow() of a closed lease",
            lambda impl, lease: lease.borrow(),
            leases[0],
            leases[1],
            LayoutStateError,
            reach=pairs,
        )
        self._exact("a lease changes no cache", self._snapshots(pairs), before)
        self.stats.check("leases")
        return True

    def _leased_pairs(self, item: OpsTarget) -> list[tuple[Any, Any]] | None:
        """The (reference, optimized) caches a lease of ``item`` takes: the request's, or
        the layout's and its rows' solo caches (those of both implementations: a latent
        row's solo is a reference cache alone); ``None`` while one's state is pending."""
        pairs = [(item.ref, item.opt)]
        if isinstance(item, Slot | Layout):
            pairs += [(t.ref, t.opt) for t in item.rows if t.opt is not None]
        return None if any(self._state_pending(r, o) for r, o in pairs) else pairs

    def _save_load(self, item: OpsTarget) -> tuple[Any, Any]:
        """``item``'s state loaded into each implementation's own class (the optimized's
        physical form: a ring's write index), then across; both must hold the live rows.
        The crossed loads (reference class, optimized class)."""
        what = f"{type(item).__name__.lower()} {item.ident}"
        restored = self._restored(what, item.ref, item.opt)
        name = self.spec.name if isinstance(item, Slot | Layout) else self.serial_name
        crossed = self._crossed(what, name, item.ref, item.opt)
        for how, pair in (("loaded into its own class", restored), ("loaded", crossed)):
            self._holds_the_rows(f"{what} {how}", item, pair)
        pools = self._load_pools(item)
        if pools is not None:
            self._pool_loads(f"{what} in the example's pool", name, item, pools)
        return crossed

    def _load_pools(self, item: OpsTarget) -> tuple[Any, Any] | None:
        """The (reference, optimized) pools ``item``'s state also loads into (``pool=``):
        a paged family's (``None``: no pool; the loads above went into private ones)."""
        return None

    def _pool_loads(self, what: str, name: str, item: OpsTarget, pools: tuple[Any, Any]) -> None:
        """The crossed loads into ``pools``: each load in its pool, holding ``item``'s
        rows, the pools sound; released, they give back every block they took (the pools
        lend what they lent before). The collector is off throughout: no finalizer of a
        collected cache releases blocks between the counts compared."""
        with collector_paused(collect=False):
            before = [held_blocks(pool) for pool in pools]
            pair = self._crossed(what, name, item.ref, item.opt, pools)
            self._exact(
                f"{what}: the loads are in the pools given (reference, optimized)",
                [cache.pool is pool for cache, pool in zip(pair, pools, strict=True)],
                [True, True],
            )
            self._holds_the_rows(what, item, pair)
            for pool in pools:
                pool.check_valid()
            for cache in pair:
                cache.release()
            after = [held_blocks(pool) for pool in pools]
        self._exact(f"{what}: loads released, every block back", after, before)
        self.stats.check("save_load into the pool")

    def _holds_the_rows(self, what: str, item: OpsTarget, pair: tuple[Any, Any]) -> None:
        """The reference and optimized caches of ``pair`` hold ``item``'s rows (offsets,
        stored planes against the model; a writer of its own world model has its own)."""
        for impl, cache in zip((self.ref_impl, self.opt_impl), pair, strict=True):
            assert isinstance(item, Track | Slot), "the root's world model"
            if isinstance(item, Track):
                self._exact(f"{what} ({impl.name}): offset", int(cache.offset), item.tokens)
                self._same_planes(
                    "kv.stored",
                    f"{what} ({impl.name}) vs the model",
                    self._view(impl, cache),
                    self._model_view(item),
                )
                continue
            self._exact(
                f"{what} ({impl.name}): row offsets",
                cache.row_offsets,
                tuple(t.tokens for t in item.rows),
            )
            for b, track in enumerate(item.rows):
                self._same_planes(
                    "kv.stored",
                    f"{what} ({impl.name}) row {b} vs the model",
                    self._row_view(impl, cache, b),
                    self._model_view(track),
                )

    def _lm_state(self, state: Any) -> Any:
        """A reference ``state`` as mlx-lm's arrays (its own copies: mlx-lm writes into the
        buffers it holds)."""
        if isinstance(state, np.ndarray):
            return self._lm_copy(state)
        if isinstance(state, tuple | list):
            return type(state)(self._lm_state(v) for v in state)
        return state

    def _crossed(
        self, what: str, name: str, ref_cache: Any, opt_cache: Any,
        pools: tuple[Any, Any] | None = None,
    ) -> tuple[Any, Any]:  # fmt: skip
        """The optimized cache's state loaded into the reference class ``name`` and the
        reference's into the optimized one (arrays converted, nothing else): each holds
        the rows its source's saved form describes (the two describe the same rows where
        the implementations agree bit for bit: ``_check_state``). ``pools``: a paged
        class's loads go into these (the reference's, the optimized's), not a private one."""
        keep = getattr(ref_cache.token_geometry, "keep", 0)
        into = [{} if pools is None else {"pool": pool} for pool in pools or (None, None)]

        def convert(value: Any, src: Impl, dst: Impl) -> Any:
            if isinstance(value, np.ndarray | mx.array):
                return dst.to_native(src.to_numpy(value))
            if isinstance(value, tuple | list):
                return type(value)(convert(v, src, dst) for v in value)
            return value

        loaded = []
        for src, dst, cache, pool in (
            (self.opt_impl, self.ref_impl, opt_cache, into[0]),
            (self.ref_impl, self.opt_impl, ref_cache, into[1]),
        ):
            state = convert(cache.state, src, dst)
            saved: Any = dst.cls(name)
            copy = saved.from_state(state, keep=keep, geometry=cache.geometry, **pool)
            # A state that never learnt a geometry may take the given pool's (a paged K/V
            # cache's geometry is its pool's; a latent cache reports none).
            geometry = ref_cache.geometry
            given: Any = pool.get("pool")
            if geometry is None and given is not None and copy.geometry is not None:
                geometry = given.geometry
            self._exact(
                f"{what}: {src.name} state loaded into the {dst.name} class",
                (copy.signature(), repr(copy.geometry), self._state_rows(dst, copy)),
                (ref_cache.signature(), repr(geometry), self._state_rows(src, cache)),
            )
            loaded.append(copy)
        self.stats.check("save_load across implementations")
        return loaded[0], loaded[1]


class OpsRules(OpsChecks):
    """``lease`` and ``save_load`` as rules: drawn targets, lease ends and mask forms,
    and the machine goes on with the crossed loads (a layout stepped at once). The paged
    families compose it (their CI examples were set with these rules)."""

    ops_cadence = None

    @precondition(lambda self: bool(self.pool) or bool(self.slots))
    @rule(data=st.data())
    def lease(self, data: st.DataObject) -> None:
        """:meth:`OpsChecks._lease` of a drawn request or layout, ended a drawn way."""
        targets: list[Track | Slot] = [*self.pool, *self.slots]
        item = self._pick(data, targets, "leased")
        if self._leased_pairs(item) is None:
            return
        how = data.draw(st.sampled_from(LEASE_ENDS), label="end")
        note(f"lease: {type(item).__name__.lower()} {item.ident}, {how}")
        self._op(f"lease:{how}")
        self._lease(item, how)

    @precondition(lambda self: bool(self.pool) or any(s.rows for s in self.slots))
    @rule(data=st.data())
    def save_load(self, data: st.DataObject) -> None:
        """A request's or a layout's ``state``, loaded (``from_state``, in memory) into a
        fresh object of the same implementation and of the other one: each load holds
        the live one's rows (saved form, offsets, reads against the model); the machine
        goes on with the crossed loads (the reference's state in the optimized class, the
        optimized's in the reference; a request's mlx-lm twin loads the state the
        optimized class loads), a layout with a step at once. The loads are compared by
        their rows, not by a ring's physical write index: the reference saves a ring in
        time order (``idx`` = the retained count), which continues as the live ring."""
        layouts = self._steppable()
        # A layout whenever one has rows, but for a drawn few (a request's load is also
        # the kept extracts' restore).
        use_layout = bool(layouts) and (not self.pool or data.draw(st.integers(0, 3)) > 0)
        targets: list[Track | Slot] = [*(layouts if use_layout else self.pool)]
        item = self._pick(data, targets, "saved")
        if self._state_pending(item.ref, item.opt):
            return
        note(f"save_load: {type(item).__name__.lower()} {item.ident}")
        self._op("save_load", item)
        crossed = self._save_load(item)
        if isinstance(item, Track):
            if item.lm is not None:
                # mlx-lm's twin loads the state the optimized class loads (the reference's,
                # canonical: a ring's retained tokens in time order), so both go on from the
                # same physical buffers, as a file mlx-lm and kvrows both load would.
                item.lm = type(item.lm).from_state(self._lm_state(item.ref.state))
            item.ref, item.opt = crossed
            return
        item.ref, item.opt = crossed
        item.mirrored = False  # fresh physical columns, which an mlx-lm mirror does not follow
        form = data.draw(ks.mask_forms(), label="mask form")
        self._step(item, 1, self._rng(data), form)


def machine_class(
    family: Family,
    layout: str,
    *,
    stats: Stats | None = None,
    reference: Impl | None = None,
    optimized: Impl | None = None,
    parity: bool = True,
    limits: Limits | None = None,
    enforce: bool = True,
    name: str | None = None,
    profile: str | None = None,
    **hooks: Any,
) -> type[ConformanceMachine]:
    """The machine class for ``family``'s ``layout``, driving ``reference`` and ``optimized``.

    ``optimized`` may be a mutant (``optimized_impl().with_classes({"PaddedKVRows": Mutant})``);
    ``name`` must then differ from the unmutated machine's so Hypothesis keeps their example
    databases apart. ``hooks`` override class attributes of the family's machine (e.g. the
    affine family's ``codecs``). ``profile`` (default: the active one, as the settings of
    ``runner.family_settings``): in a seeded profile (``ci``) the machine draws from its
    fixed seed ``profiles.machine_seed(family, layout)``; a mutant run under ``teeth``
    passes ``profile="teeth"``.
    """
    from kvrows.conformance.families import optimized_impl, reference_impl

    spec = family.layout(layout)
    make_base = spec.machine or family.machine
    base: type[ConformanceMachine] = make_base() if make_base is not None else ConformanceMachine
    # A layout with a machine of its own names its peer (``None``: mlx-lm has none).
    make_peer = spec.peer_spec if spec.own_machine else family.peer
    attrs: dict[str, Any] = {
        "family": family,
        "spec": spec,
        "ref_impl": reference or reference_impl(),
        "opt_impl": optimized or optimized_impl(),
        "peer": make_peer() if (parity and make_peer is not None) else None,
        "stats": stats or Stats(family.name, layout),
        "limits": limits or Limits(),
        "enforce": enforce,
        "draw": spec.draw,
        "codecs": spec.draw.params,
        # No file backs a class made here: Hypothesis digests a machine class by its source,
        # and looking one up in its base's module parses that whole file (0.1 s a run) only
        # to find no such class; the digest is the class's name either way.
        "__module__": f"{base.__module__}.generated",
        "__doc__": f"Conformance of the {family.name} family's {layout} ({'/'.join(spec.roles)} layout).",
        **hooks,
    }
    machine = type(name or f"{family.name.capitalize()}{layout}Machine", (base,), attrs)
    if active_profile(profile).seeded:
        # Its own draws, whatever ran before (``profiles.machine_seed``); a later
        # ``hypothesis.seed`` (``kvrows conform --seed``) replaces it.
        machine = hypothesis_seed(machine_seed(family.name, layout))(machine)
    return machine
