"""The delayed families' machine: rows that convert to a codec at their own boundary.

``DelayedQuantizedKVCache``, ``DelayedRotatingQuantizedKVCache`` (the ``delayed`` family)
and ``DelayedTurboQuantKVCache`` (``delayed-turbo``) (``kvrows.delayed``) hold rows of two
codecs at once: each row is plain until its own offset reaches ``start`` and affine (or
TurboQuant) afterwards, exactly as its serial bf16-first lego (``kvrows.lego``) would be.
The rules, oracles, draws and statistics are specified in ``spec/DelayedQuantizedKVCache.md``
(Conformance: the ``delayed`` family) and ``spec/DelayedTurboQuantKVCache.md``; each rule's
docstring says what it drives.

**A subclass of the base machine.** :class:`DelayedMachine`, the delayed modifier's rules
(``hooks.MODIFIER_RULES["delayed"]``, ``own``: not composed over the storage's), is a
:class:`~kvrows.conformance.machines.WriterRules` (the writers' skeleton over the only
storage root, ``spec/contract.md`` §0.11: its blocks are keys and values, its solo
replays the rows' legos): its geometry is the base ``Geometry`` plus the rows'
``start``, its requests and layouts are the base model's ``Track`` (the tokens appended,
minus the trims, their history, the stage ``converted_at``, what the pool holds and the
solo legos) and ``Slot`` (with the position record ``pads``), and the base machine compares its errors, snapshots its objects,
measures its tolerances and records its stats, through hooks (``_message``,
``_snapshot``). The K/V writer's rules (``machines.KvRules``, one serial class per
family) are not composed here: a delayed row changes codec at its conversion, a mixed
layout refuses ``fetch()`` and answers appends with pending pairs, and its serial
counterpart is a lego (two storages in turn), so the rules below drive it.

**The conversion rule** is the model's own, restated from ``spec/bf16-first.md`` (a
plain row holding ``offset`` tokens after a boundary converts when ``offset >= start``
and ``offset != 0``: :meth:`DelayedGeometry.converts`), never the core's
``kvrows.lego.conversion_due``.

**Oracles**, in short: reference vs optimized after every rule and on every append
(masks, reads, attention); the layout model (position record, ``row_offsets``,
``converted_at``, ``phase``, ``max_append_tokens()``, ``minimum_reusable_offset``);
solo replay (each row's serial lego per implementation: attention, extracted bytes,
publishing, the conversion offset); deferred vs eager V (TurboQuant); leases and
save/load across implementations (``machines.OpsChecks``, mixed in: an invariant that
draws nothing, its hooks taking a lego as its current storage). ``Stats.checks``
counts the cases that matter; ``tests/test_conformance_delayed.py`` and
``tests/test_conformance_delayed_turbo.py`` require each (:data:`DELAYED_CHECKS`,
:data:`DELAYED_TURBO_CHECKS`).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvrows import table
from kvrows.codec import Role
from kvrows.codecs import CODECS
from kvrows.compositions import composition, stage_presets
from kvrows.conformance import strategies as ks
from kvrows.conformance.arrays import NUMPY_DTYPES, expand_mask, random_block
from kvrows.conformance.families import Impl
from kvrows.conformance.hooks import CODEC_HOOKS, GEOMETRY_HOOKS
from kvrows.conformance.machines import (
    Block,
    OpsChecks,
    OpsTarget,
    Slot,
    Track,
    WriterRules,
    _answer,
    planes_bytes,
    planes_of,
    publish_counts,
    take_columns,
    view_planes,
)
from kvrows.conformance.tolerances import EXACT
from kvrows.delayed import row_reads
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    MixedPrecisionReadError,
    NotTrimmableError,
    RowIndexError,
    SpeculativeRoundError,
)
from kvrows.geometries.chunked import chunk_visible
from kvrows.lego import Target
from kvrows.protocols import Handover
from kvrows.schemes import TURBO_KEY_BITS, TURBO_VALUE_BITS
from kvrows.speculative import RowRound

__all__ = [
    "DELAYED_CHECKS",
    "DELAYED_TURBO_CHECKS",
    "DelayedGeometry",
    "DelayedMachine",
]

Array = npt.NDArray[Any]
Planes = tuple[Array, ...]
#: What a pool request holds: a lego, or a serial storage of its exact or converted stage.
Holds = Literal["lego", "exact", "converted"]
#: A bad call: (label, call(impl, layout), the error type the contract names).
BadCall = tuple[str, Callable[[Impl, Any], object], type[KvRowsError]]

#: The checks (``Stats.checks`` keys) a delayed machine must have run in CI.
DELAYED_CHECKS = (
    "reference vs optimized",
    "layout model",
    "solo replay",
    "solo attention",
    "exact before conversion",
    "extracted row bytes",
    "converted_at",
    "mixed read",
    "mixed read that converted rows",
    "packed read",
    "Impl.attend of plain and packed reads",
    "conversion mid-batch",
    "conversion at a round boundary",
    "conversion at merge",
    "crossing chunk in prefill",
    "commit_prefill converts a listed row",
    "a crossed row waits for end_prefill",
    "round on mixed rows",
    "extract mid-conversion",
    "published prefix",
    "publish past",
    "round misuse",
    "RowRound",
    "error types",
    "error messages",
    # ``OpsChecks`` (issue 24): leases, and loads across implementations of a lego and of
    # a layout holding rows of both codecs.
    "leases",
    "save_load across implementations",
    "save_load: a lego request",
    "save_load: mixed rows",
)

#: The checks a delayed TurboQuant machine adds (``DelayedTurboQuantKVCache``).
DELAYED_TURBO_CHECKS = (
    "deferred vs eager",
    "deferred vs eager of a mixed read",
)

#: Rows a layout holds at most, requests in the pool, layouts at once.
MAX_ROWS, MAX_POOL, MAX_LAYOUTS = 4, 4, 2
#: Drafts per round (a verify block of ``d + 1`` tokens).
MAX_DRAFTS = 4
#: Every TurboQuant codec, ``(k_bits, v_bits)``.
TURBO_CODECS: tuple[tuple[int, int], ...] = tuple(
    (k, v) for k in TURBO_KEY_BITS for v in TURBO_VALUE_BITS
)


@dataclass(frozen=True)
class DelayedGeometry(ks.Geometry):
    """The base geometry (shapes, window, the codec rows convert to: ``bits`` /
    ``group_size`` or ``k_bits`` / ``v_bits``) and the rows' boundary ``start``."""

    start: int = 0

    def parameters(self) -> dict[str, int]:
        return {**super().parameters(), "start": self.start}

    @property
    def dim(self) -> int:
        return self.key_dim

    @property
    def target(self) -> Target:
        """The codec rows convert to."""
        return self.spec

    def converts(self, offset: int) -> bool:
        """Whether a plain row holding ``offset`` tokens after a boundary converts
        (``spec/bf16-first.md``, the conversion rule; restated, not the core's)."""
        return offset >= self.start and offset != 0

    def __str__(self) -> str:
        ring = f", window {self.max_size} keep {self.keep}" if self.max_size else ""
        chunk = f", chunk {self.chunk_size}" if self.chunk_size is not None else ""
        return (
            f"{self.dtype}, {self.heads} KV heads x{self.query_heads // self.heads}, "
            f"head dim {self.dim}, {self.codec}, start {self.start}{ring}{chunk}"
        )


@st.composite
def delayed_geometries(draw: st.DrawFn, geometry: str, kind: str) -> DelayedGeometry:
    """An example's geometry: a target of codec kind ``kind`` drawn as its
    ``CODEC_HOOKS`` row's ``delayed`` draw says (affine: bits 4/8, group 32/64, head dim
    64; TurboQuant: any widths, head dims 64..256; a microscaling mode at head dim 64),
    one head dim for keys and values; a ring's window (rings affine only) or a chunk size
    as ``GEOMETRY_HOOKS[geometry]`` draws them."""
    dtype = draw(st.sampled_from(("float16", "bfloat16")), label="dtype")
    heads = draw(st.sampled_from((1, 2)), label="heads")
    per = draw(st.sampled_from((1, 2)), label="query heads per KV head")
    targets = CODEC_HOOKS[CODECS[kind]].delayed
    assert targets is not None, f"no row converts to the {kind} codec"
    target = targets(draw)
    # Small starts convert within a few tokens; large ones hold plain rows long.
    start = draw(st.one_of(st.integers(0, 8), st.integers(0, 40)), label="start")
    max_size = keep = chunk_size = None
    hooks = GEOMETRY_HOOKS[geometry]
    if hooks.windows is not None:  # a ring (its own draws: the CI examples stay as they were)
        max_size = draw(st.integers(4, 16), label="max_size")
        keep = draw(st.integers(0, 2), label="keep")
    if hooks.chunks is not None:
        chunk_size = draw(hooks.chunks("ragged"), label="chunk_size")
    dim, bits, group = target["dim"], target.get("bits", 0), target.get("group_size", 0)
    return DelayedGeometry(
        dtype, heads, heads * per, dim, dim, max_size, bits, group, keep or 0,
        target.get("k_bits", 0), target.get("v_bits", 0), kind, chunk_size, start=start,
    )  # fmt: skip


class DelayedMachine(WriterRules, OpsChecks):
    """The delayed layouts, both implementations, solo legos (see the module docstring)."""

    #: ``OpsChecks``' cadence: a delayed layout's ``state`` regroups its rows by codec, so
    #: a save/load costs several K/V ones; every 8th check reaches each lease end and the
    #: loads of mixed rows in the CI examples (every 6th: about 10% more CPU time).
    ops_cadence = 8

    def __init__(self) -> None:
        super().__init__()
        #: The phase of the layout before the last append (``_append``).
        self._read_phase = "empty"
        #: Publishes of a shorter prefix so far (``_publish`` takes the covered ones in turn).
        self._publishes = 0
        self._codecs: dict[tuple[str, bool], Any] = {}
        #: The solo replays in progress are of a verify block (``_solo``).
        self._round_block = False

    @property
    def ring(self) -> bool:
        """The layout's rows are rings (the example drew a window)."""
        return self.g.max_size is not None

    @property
    def chunked(self) -> bool:
        """The layout's rows are chunked-local (the example drew a chunk size): each row
        keeps its newest ``chunk_size`` tokens before every append (``Track.held``)."""
        return self.g.chunk_size is not None

    @property
    def turbo(self) -> bool:
        """The layout's rows convert to TurboQuant (else affine)."""
        return self.g.turbo

    @property
    def converted_kind(self) -> str:
        """The codec kind of a converted serial storage (``affine``, ``turbo``)."""
        return composition(self._converted_name).codec

    @classmethod
    def geometries(cls) -> st.SearchStrategy[ks.Geometry]:
        entry = composition(cls.spec.name)  # a ring's window, a chunk; the target's codec kind
        return delayed_geometries(entry.geometry, entry.codec)

    def teardown(self) -> None:
        # Hypothesis tears down in a ``finally``: after a failed rule, or a rule it stopped
        # mid-draw (``StopTest``: the example is discarded), the model is mid-update, and a
        # check here would replace that exception with its own.
        failing = sys.exc_info()[1] is not None
        with self._scopes:  # the example's read buffers scope (``_choose_read_buffers``)
            if self.geo is not None and self.stats.steps > self._steps_at_start and not failing:
                for slot in self.slots:
                    self._check_layout(slot, rows=True)
                g = self.g
                self.stats.variant(g.codec)
                if g.turbo:
                    self.stats.check(f"head dim {g.dim}")
                self.stats.variant("start 0" if g.start == 0 else "start > 0")
                self.stats.example_done()

    # ------------------------------------------------------------------ helpers
    @property
    def g(self) -> DelayedGeometry:
        assert self.geo is not None
        return cast(DelayedGeometry, self.geo)

    @property
    def impls(self) -> tuple[Impl, Impl]:
        return self.ref_impl, self.opt_impl

    def _encode(self, block: Array, role: Role = "keys") -> Planes:
        """The model holds a request's tokens as appended (its stage says how the rows
        hold them)."""
        return (block,)

    def _new_request(self, kind: Holds) -> Track:
        g = self.g
        empty = np.zeros((1, g.heads, 0, g.dim), NUMPY_DTYPES[g.dtype])
        return Track(next(self._ids), None, None, None, (empty,), (empty,), holds=kind)

    def _record_rows(self, slot: Slot, keys: Array, values: Array, counts: list[int]) -> None:
        """The model: row ``b`` took the first ``counts[b]`` tokens of the block."""
        for b, (track, n) in enumerate(zip(slot.rows, counts, strict=True)):
            self._record_append(track, keys[b : b + 1, :, :n], values[b : b + 1, :, :n])

    @property
    def _converted_name(self) -> str:
        """The converted serial storage's class (the layout's composition's ``serial``)."""
        serial = composition(self.spec.name).serial
        assert serial is not None, self.spec.name
        return serial

    def _layout(self, impl: Impl, **changes: int) -> Any:
        return self._new(impl, self.spec.name, **changes)

    def _lego(self, impl: Impl, **changes: int) -> Any:
        """This layout's serial counterpart: the lego of its converted storage."""
        return self._new(impl, self.spec.solo, **changes)

    def _stage_preset(self, converted: bool) -> str:
        """The serial preset of the lego's exact stage (its first) or converted one (the
        layout's serial): the composition table names both."""
        return (
            self._converted_name
            if converted
            else stage_presets(composition(self.spec.solo))[0].name
        )

    def _storage(self, impl: Impl, converted: bool, **changes: int) -> Any:
        """A serial storage of the lego's exact or converted stage."""
        return self._new(impl, self._stage_preset(converted), **changes)

    def _other_widths(self, side: str = "values") -> dict[str, int]:
        """This example's codec at another bit width (TurboQuant: of ``side``)."""
        g = self.g
        if not g.turbo:  # a group codec: the other of 4 and 8 bits, at a group it has
            other = {"bits": 12 - g.bits}
            try:
                type(g.spec).from_parameters({**g.parameters(), **other})
            except InvalidInputError:  # (nvfp4: 8 bits only in groups of 32, mxfp8)
                other["group_size"] = 32
            return other
        if side == "keys":
            return {"k_bits": next(k for k in TURBO_KEY_BITS if k != g.k_bits)}
        return {"v_bits": next(v for v in TURBO_VALUE_BITS if v != g.v_bits)}

    def _holding_a_token(self, impl: Impl, cache: Any, seed: int) -> Any:
        g = self.g
        block = impl.to_native(
            random_block(np.random.default_rng(seed), (1, g.heads, 1, g.dim), g.dtype)
        )
        cache.update_and_fetch(block, block)
        return cache

    def _other_geometry(self, impl: Impl, kind: str) -> Any:
        """A lego or plain storage holding a token, of the other token geometry (an affine
        ring of 8 for full attention, full attention for a ring)."""
        # Only the affine codec has a ring lego: a layout of another codec takes one of
        # this example's start (its own parameters where it is affine).
        ring_lego = composition("Bf16FirstRotatingQuantizedKVCache").codec
        # A group that divides this example's head dims (a microscaling example may draw
        # 32): the lego must hold the token, so that only the merge can refuse it.
        group = 64 if not (self.g.key_dim % 64 or self.g.value_dim % 64) else 32
        affine = {} if self.g.spec.kind == ring_lego else {"group_size": group, "bits": 8}
        if kind != "lego":
            ring = {"max_size": 8, "keep": 0}
            cache = self._new(impl, "KVCache" if self.ring else "RotatingKVCache", **ring)
        elif self.ring:
            cache = self._new(impl, "Bf16FirstQuantizedKVCache", **affine)
        else:
            cache = self._new(
                impl, "Bf16FirstRotatingQuantizedKVCache", max_size=8, keep=0, **affine
            )
        return self._holding_a_token(impl, cache, 3)

    def _other_codec(self, impl: Impl, kind: str) -> Any:
        """A full-attention affine lego (``lego``) or ``QuantizedKVCache`` holding a
        token: another codec for a TurboQuant layout."""
        lego = kind == "lego"
        cache = self._new(
            impl, "Bf16FirstQuantizedKVCache" if lego else "QuantizedKVCache", group_size=64, bits=8
        )
        return self._holding_a_token(impl, cache, 4)

    def _codec(self, impl: Impl, quantized: bool) -> Any:
        """The codec of a plain or converted read of ``impl`` (one per example: a codec
        is a function of the example's parameters)."""
        key = (impl.name, quantized)
        if key not in self._codecs:
            storage = self._storage(impl, quantized)
            self._codecs[key] = storage.codec
        return self._codecs[key]

    def _view(self, impl: Impl, cache: Any) -> Planes | None:
        """A serial storage's (or lego's) tokens in time order, keys' planes then values'."""
        storage = cache.storage if isinstance(cache, Handover) else cache
        held = storage.window() if self.ring else storage.planes()
        return view_planes(impl, held)

    # -- the public operations (``machines.OpsChecks``' hooks): a lego saves as its current
    # storage (``kvrows.lego``), a layout its rows of both codecs and their record
    def _leased_pairs(self, item: OpsTarget) -> list[tuple[Any, Any]] | None:
        """A request's lego or storage, or a layout alone: a layout's rows' solo legos are
        the machine's oracles, not the layout's (a pool lego is leased as a request)."""
        return [(item.ref, item.opt)]

    def _state_rows(self, impl: Impl, cache: Any) -> list[tuple[int, Any, Any]]:
        return super()._state_rows(impl, _storage_of(cache))

    def _restored(self, what: str, ref_cache: Any, opt_cache: Any) -> tuple[Any, Any]:
        if not isinstance(ref_cache, Handover):
            return super()._restored(what, ref_cache, opt_cache)
        loaded = super()._restored(what, ref_cache.storage, opt_cache.storage)
        return self._as_legos(loaded, (ref_cache, opt_cache))

    def _crossed(
        self,
        what: str,
        name: str,
        ref_cache: Any,
        opt_cache: Any,
        pools: tuple[Any, Any] | None = None,
    ) -> tuple[Any, Any]:
        """A layout loads into its class; a pool storage into its own preset (either stage),
        a lego's storage into its stage's, wrapped back as the lego (the record a file
        keeps: ``start``, the conversion offset)."""
        storage = _storage_of(ref_cache)
        if isinstance(ref_cache, Handover) or not hasattr(ref_cache, "converted_at"):
            name = storage.composition.name
        loaded = super()._crossed(what, name, storage, _storage_of(opt_cache), pools)
        if not isinstance(ref_cache, Handover):
            return loaded
        return self._as_legos(loaded, (opt_cache, ref_cache))

    def _as_legos(self, storages: tuple[Any, Any], sources: tuple[Any, Any]) -> tuple[Any, Any]:
        """Loaded storages (reference class, optimized class) wrapped as this example's
        legos, each with the record of the lego its state came from."""
        ref, opt = (
            self._lego(impl).composed.over(
                storage, minimum_reusable_offset=source.minimum_reusable_offset
            )
            for impl, storage, source in zip(self.impls, storages, sources, strict=True)
        )
        return ref, opt

    def _holds_the_rows(self, what: str, item: OpsTarget, pair: tuple[Any, Any]) -> None:
        """A load holds what the live one holds. A request: its offset, a lego's stage and
        conversion offset, its planes (each implementation's live ones). A layout: the
        record against the model (rows, offsets, ``converted_at``, phase), the position
        record, and each row extracted against its solo lego (``_check_extracted``: bytes
        of either codec, the conversion offset)."""
        if isinstance(item, Track):
            for impl, cache, live in zip(self.impls, pair, (item.ref, item.opt), strict=True):
                self._exact(
                    f"{what} ({impl.name}): offset", int(_storage_of(cache).offset), item.tokens
                )
                if isinstance(live, Handover):
                    self._exact(
                        f"{what} ({impl.name}): converted, minimum_reusable_offset",
                        (cache.converted, cache.minimum_reusable_offset),
                        (live.converted, live.minimum_reusable_offset),
                    )
                self._same_planes(
                    "kv.stored",
                    f"{what} ({impl.name}) vs the live one",
                    self._view(impl, cache),
                    self._view(impl, live),
                )
            self.stats.check(f"save_load: a {item.holds} request")
            return
        assert isinstance(item, Slot)  # this machine's targets: its requests and layouts
        observed = [self._layout_observed(lay) for lay in pair]
        self._exact(f"{what}: vs the model", observed, [self._expected(item)] * 2)
        pads = [tuple(lay.left_pad) for lay in pair]
        if self.ring:
            self._exact(f"{what}: left_pad (optimized vs reference)", pads[1], pads[0])
        else:
            self._exact(f"{what}: left_pad vs the position record", pads, [tuple(item.pads)] * 2)
        for lay in pair:
            lay.check_valid()
        for b, track in enumerate(item.rows):
            got = [lay.extract_row(b) for lay in pair]
            self._check_extracted(f"{what} row {b}", got, track)
        self.stats.check(f"save_load: {item.ref.phase} rows")

    # -- the writer skeleton's hooks (``machines.WriterRules``): a block is keys and values,
    # written by ``update_and_fetch``; a layout row's solo replay is its solo legos
    def _draw_block(self, rng: np.random.Generator, rows: int, n: int) -> Block:
        return self._block(rng, rows, n, self.g.dim), self._block(rng, rows, n, self.g.dim)

    def _write(self, impl: Impl, cache: Any, block: Block) -> Any:
        keys, values = block
        return cache.update_and_fetch(impl.to_native(keys), impl.to_native(values))

    # -- the model ----------------------------------------------------------------------------
    def _due(self, track: Track) -> bool:
        return track.converted_at is None and self.g.converts(track.tokens)

    def _mark_converted(self, track: Track) -> None:
        track.converted_at = track.tokens if self.g.start > 0 else 0

    def _expected(self, slot: Slot) -> tuple[Any, ...]:
        """What the model says a layout reports."""
        g = self.g
        converted = [t.converted_at for t in slot.rows]
        count = sum(c is not None for c in converted)
        rows = len(slot.rows)
        phase = (
            "empty"
            if not rows
            else "plain"
            if count == 0
            else "packed"
            if count == rows
            else "mixed"
        )
        limits = [
            g.start - t.tokens for t in slot.rows if t.converted_at is None and t.tokens < g.start
        ]
        return (
            rows,
            tuple(t.tokens for t in slot.rows),
            tuple(converted),
            phase,
            min(limits, default=math.inf),
            max((c or 0 for c in converted), default=0),
        )

    def _layout_observed(self, layout: Any) -> tuple[Any, ...]:
        return (
            layout.batch_size,
            tuple(layout.row_offsets),
            tuple(layout.converted_at),
            layout.phase,
            layout.max_append_tokens(),
            layout.minimum_reusable_offset,
        )

    # -- snapshots (nothing changed) and errors: the base machine's, through these hooks -----
    def _snapshot(self, impl: Impl, cache: Any) -> tuple[Any, ...]:
        if isinstance(cache, Handover) or not hasattr(cache, "converted_at"):
            storage = cache.storage if isinstance(cache, Handover) else cache
            return (repr(cache), int(storage.offset), planes_bytes(self._view(impl, storage)))
        held = tuple((tuple(a.shape), impl.to_numpy(a).tobytes()) for a in cache.held_arrays())
        return (
            repr(cache),
            tuple(cache.row_offsets),
            tuple(cache.left_pad),
            tuple(cache.converted_at),
            int(cache.nbytes),
            cache.prefilling,
            cache.spec_round_open,
            cache.reads_pending,
            held,
        )

    def _everything(self) -> tuple[list[Any], list[Any]]:
        """What a bad call could change: the pool's objects and the layouts (a row's solo
        legos are the machine's own, never handed to a bad call)."""
        pairs = [(t.ref, t.opt) for t in self.pool] + [(s.ref, s.opt) for s in self.slots]
        return self._snapshots(pairs)

    def _message(self, error: BaseException) -> str:
        """Messages name the layout's class: a mutant's subclass answers as the layout."""
        text = str(error)
        for impl in self.impls:
            text = text.replace(impl.cls(self.spec.name).__name__, self.spec.name)
        return text

    # ------------------------------------------------------------------ requests
    @precondition(lambda self: self.geo is not None and len(self.pool) < MAX_POOL)
    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        """A lego prefilled by chunks cut at ``max_append_tokens()`` (sometimes one chunk
        crosses ``start``), or a plain or converted (affine, TurboQuant) serial storage fed
        random chunks."""
        g = self.g
        kinds: tuple[Holds, ...] = ("lego", "lego", "exact", "converted")
        kind = data.draw(st.sampled_from(kinds), label="kind")
        near = st.integers(max(0, g.start - 6), g.start + 4)
        length = data.draw(st.one_of(near, st.integers(0, g.start + 6)), label="prompt length")
        track = self._new_request(kind)
        if kind == "lego":
            track.ref, track.opt = self._lego(self.ref_impl), self._lego(self.opt_impl)
            track.solo_ref, track.solo_opt = self._lego(self.ref_impl), self._lego(self.opt_impl)
        else:
            track.ref = self._storage(self.ref_impl, kind == "converted")
            track.opt = self._storage(self.opt_impl, kind == "converted")
        note(f"new_request {track.ident}: {kind}, {length} tokens")
        # named by what the pool holds: a lego, or the codec kind of the stage's storage
        held = (
            kind if kind == "lego" else composition(self._stage_preset(kind == "converted")).codec
        )
        self._op(f"new_request:{held}")
        rng = self._rng(data)
        while track.tokens < length:
            left = length - track.tokens
            self._pool_chunk(track, data, rng, left)
        self.pool.append(track)

    def _pool_chunk(
        self, track: Track, data: st.DataObject, rng: np.random.Generator, most: int
    ) -> None:
        """One chunk appended to a pool request (and its solo legos)."""
        limit = track.ref.max_append_tokens() if track.holds == "lego" else math.inf
        self._exact(
            f"request {track.ident} max_append_tokens (optimized)",
            track.opt.max_append_tokens() if track.holds == "lego" else math.inf,
            limit,
        )
        drawn = data.draw(st.integers(1, 8), label="chunk")
        crossing = limit < most and data.draw(st.integers(0, 4), label="cross") == 0
        n = min(drawn, most) if crossing or limit == math.inf else min(drawn, most, int(limit))
        if crossing and n > limit:
            self.stats.check("crossing chunk in a lego")
        block = keys, values = self._draw_block(rng, 1, n)
        what = f"request {track.ident} ({track.holds}) chunk of {n} onto {track.tokens}"
        pairs = [(track.ref, track.opt)]
        if track.solo_ref is not None:
            pairs.append((track.solo_ref, track.solo_opt))
        for ref, opt in pairs:
            self._write_pair(ref, opt, block)
        # What each holds in time order (a serial ring's reads come in its own column order).
        views = [
            self._view(impl, c) for pair in pairs for impl, c in zip(self.impls, pair, strict=True)
        ]
        names = ["optimized", "the reference's solo lego", "the optimized solo lego"]
        for name, view in zip(names, views[1:], strict=False):
            self._same_planes("kv.solo" if "solo" in name else "kv.fetched",
                             f"{what}: {name} vs the reference", view, views[0])  # fmt: skip
        self._record_append(track, keys, values)
        if track.holds == "lego" and self._due(track):  # the model's rule, not the lego's
            self._mark_converted(track)
        if track.holds == "lego":
            self._exact(
                f"{what}: converted (reference, optimized)",
                (track.ref.converted, track.opt.converted),
                (track.converted_at is not None,) * 2,
            )

    @precondition(lambda self: any(t.holds == "lego" and t.extracted for t in self.pool))
    @rule(data=st.data())
    def lego_append(self, data: st.DataObject) -> None:
        """A row extracted as a lego goes on: one more chunk (and its solo legos)."""
        track = self._pick(
            data, [t for t in self.pool if t.holds == "lego" and t.extracted], "request"
        )
        self._op("lego_append")
        self._pool_chunk(track, data, self._rng(data), 8)
        self._check_pool_lego(track)

    def _solo_for(self, track: Track) -> None:
        """A storage's solo legos, built at its merge: a lego fed its chunks (plain, not
        due), or a lego over a converted storage fed its chunks (converted, or plain past
        ``start``: the layout converts it at the merge)."""
        g = self.g
        if track.solo_ref is not None:
            if track.holds == "converted":
                # A converted storage records its offset at the merge (the conservative
                # bound): its lego now says the same.
                minimum = track.tokens if g.start > 0 else 0
                track.solo_ref, track.solo_opt = (
                    solo.composed.over(solo.composed.release(), minimum_reusable_offset=minimum)
                    for solo in (track.solo_ref, track.solo_opt)
                )
                track.converted_at = minimum
            return
        affine = track.holds == "converted" or g.converts(track.tokens)
        # The request's chunks as the pool storage took them (a pool storage is never trimmed).
        chunks = [(keys, values) for what, keys, values in track.history if what == "append"]
        solos = []
        for impl in self.impls:
            lego = self._lego(impl)
            if affine:
                storage = self._storage(impl, True)
                for keys, values in chunks:
                    storage.update_and_fetch(impl.to_native(keys), impl.to_native(values))
                minimum = track.tokens if g.start > 0 else 0
                lego = lego.composed.over(storage, minimum_reusable_offset=minimum)
            else:
                for keys, values in chunks:
                    lego.update_and_fetch(impl.to_native(keys), impl.to_native(values))
                self._exact(f"request {track.ident}'s solo lego stays plain", lego.converted, False)
            solos.append(lego)
        track.solo_ref, track.solo_opt = solos
        if affine:
            if track.holds == "exact":
                self.stats.check("conversion at merge")
            self._mark_converted(track)

    # ------------------------------------------------------------------ merges
    def _new_layout(self) -> Slot:
        ident = next(self._ids)
        slot = Slot(ident, self._layout(self.ref_impl), self._layout(self.opt_impl), [])
        self.slots.append(slot)
        return slot

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        """Pool requests join a layout (new or running), directly or through a side
        delayed layout; legos are released, everything else borrowed."""
        targets = [s for s in self.slots if len(s.rows) < MAX_ROWS]
        new = len(self.slots) < MAX_LAYOUTS and data.draw(st.booleans(), label="new layout")
        if not targets and not new:
            return
        slot = self._new_layout() if new or not targets else self._pick(data, targets, "layout")
        room = MAX_ROWS - len(slot.rows)
        count = data.draw(st.integers(1, min(room, len(self.pool))), label="sources")
        picked = list(data.draw(st.permutations(self.pool), label="order"))[:count]
        side = data.draw(st.booleans(), label="via a side layout")
        note(
            f"merge: layout {slot.ident} {slot.opt!r} <- requests "
            f"{[(t.ident, t.holds, t.tokens) for t in picked]}{' via a side layout' if side else ''}"
        )
        self._op("join" if slot.rows else "merge")
        self._join_requests(slot, picked, side)

    def _join_requests(self, slot: Slot, picked: list[Track], side: bool) -> None:
        """``picked`` join ``slot`` (directly, or ``side``: through a side delayed
        layout); legos are released, everything else borrowed."""
        for t in picked:
            self._solo_for(t)
        was_mixed = slot.ref.phase == "mixed"
        if side:
            sources = []
            for impl, attr in ((self.ref_impl, "ref"), (self.opt_impl, "opt")):
                lay = self._layout(impl)
                lay.merge_rows([getattr(t, attr) for t in picked])
                sources.append([lay])
            self.stats.check("merge of a delayed layout")
        else:
            sources = [[t.ref for t in picked], [t.opt for t in picked]]
        borrowed = [
            (impl, s) for impl, group in zip(self.impls, sources, strict=True) for s in group
            if not isinstance(s, Handover)
        ]  # fmt: skip
        before = [self._snapshot(impl, s) for impl, s in borrowed]
        slot.ref.merge_rows(sources[0])
        slot.opt.merge_rows(sources[1])
        self._exact(
            "merge sources that are not legos are borrowed and unchanged",
            [self._snapshot(impl, s) for impl, s in borrowed],
            before,
        )
        for t in picked:
            if t.holds == "lego":
                for lego in (t.ref, t.opt):
                    self._exact(
                        f"request {t.ident}'s lego is released by the merge",
                        (int(lego.offset), lego.converted),
                        (0, False),
                    )
            self.pool.remove(t)
            t.ref, t.opt = t.solo_ref, t.solo_opt  # in a layout, the row's solo replay
        self._merge_pads(slot, [t.held for t in picked])
        slot.rows.extend(picked)
        if was_mixed or any(t.converted_at is not None for t in picked):
            self.stats.check("merge into mixed rows")
        self._check_layout(slot)

    def _merge_pads(self, slot: Slot, held: list[int]) -> None:
        """The ragged rule: every row right-aligned at the widest end of what the rows
        hold (``Track.held``: a chunked row's front-trimmed tokens are gone)."""
        if self.ring:
            return
        width = max((p + t.held for p, t in zip(slot.pads, slot.rows, strict=True)), default=0)
        target = max([width, *held])
        grow = target - width
        slot.pads = [p + grow for p in slot.pads] + [target - t for t in held]

    def _front_trim_pads(self, slot: Slot) -> None:
        """A layout append's front trims (``spec/ChunkedKVCache.md`` §3): each chunked
        row keeps its newest ``chunk_size`` tokens, its pad grows by what it forgot (its
        end stays), and the padding every row then shares leaves. ``Track.held`` follows
        at the model's append (``_record_append``)."""
        size = self.g.chunk_size
        if size is None or not slot.rows:
            return
        pads = [p + max(0, t.held - size) for p, t in zip(slot.pads, slot.rows, strict=True)]
        shared = min(pads)
        slot.pads = [p - shared for p in pads]

    # ------------------------------------------------------------------ appends
    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """An append on every row: a decode token, or a chunk capped at
        ``max_append_tokens()`` (sometimes crossing ``start``)."""
        slot = self._pick(data, [s for s in self.slots if s.rows], "layout")
        limit = slot.ref.max_append_tokens()
        multi = data.draw(st.booleans(), label="chunk")
        n = data.draw(st.integers(2, 6), label="N") if multi else 1
        if n > limit and data.draw(st.integers(0, 3), label="cross") != 0:
            n = max(1, int(limit))
        crossing = n > limit
        inside = slot.ref.phase == "mixed" or data.draw(st.booleans(), label="in row_reads")
        self._op("decode_step" if n == 1 else "multi_step")
        rng = self._rng(data)
        self._layout_append(slot, n, rng, inside, "step")
        if crossing:
            self.stats.check("crossing append outside prefill")
        self._check_layout(slot)

    def _layout_append(
        self,
        slot: Slot,
        n: int,
        rng: np.random.Generator,
        inside: bool,
        label: str,
        *,
        replay: bool = True,
        modelled: bool = True,
    ) -> tuple[Array, Array, Array, list[Array]]:
        """Append ``n`` tokens to every row in both implementations: masks, reads and
        attention, reference vs optimized. Returns the block, the queries and both
        outputs. ``replay``: the rows take the block now (the solo legos too, then the
        layout against the model); else the caller does (a round, a prefill chunk).
        ``modelled``: the model's rows are the layout's (a proposal round's later
        appends follow proposals the model never takes: no mask against its record)."""
        rows = len(slot.rows)
        block = keys, values = self._draw_block(rng, rows, n)
        queries = self._queries(rng, rows, n)
        phase = slot.ref.phase
        self._read_phase = phase
        what = f"layout {slot.ident} {label} of {n} ({phase}) {slot.opt!r}"
        note(f"{label}: layout {slot.ident} {slot.opt!r}, {n} tokens, row_reads {inside}")
        form = {"return_array": bool(next(self._draws) % 2)}
        masks = [lay.make_mask(n, **form) for lay in (slot.ref, slot.opt)]
        self._same_masks(f"{what}: masks (optimized vs reference)", masks, rows, n)
        if phase == "mixed" and not self.ring and modelled:
            self._record_mask(what, slot, _as_mask(self.ref_impl, masks[0]), n)
        converted = tuple(slot.ref.converted_at)
        layouts = (slot.ref, slot.opt)
        codecs = [lay.codec for lay in layouts]  # the codec of this append's reads
        with row_reads() if inside else contextlib.nullcontext():
            reads = self._write_pair(slot.ref, slot.opt, block)
            self._front_trim_pads(slot)  # whatever the block keeps (a round, a fill)
            outputs = [
                impl.to_numpy(self._attend_read(
                    impl, lay, codec, impl.to_native(queries), got, mask, phase
                ))
                for impl, lay, codec, got, mask in zip(
                    self.impls, layouts, codecs, reads, masks, strict=True
                )
            ]  # fmt: skip
        self._exact(
            f"{what}: reads pending (reference, optimized)",
            (slot.ref.reads_pending, slot.opt.reads_pending),
            (phase == "mixed",) * 2,
        )
        # mlx-lm's quantized attention asks for ``bits``: affine packed reads only.
        quantized = [hasattr(lay, "bits") for lay in (slot.ref, slot.opt)]
        self._exact(
            f"{what}: bits readable (reference, optimized)",
            quantized,
            [phase == "packed" and not self.turbo] * 2,
        )
        if phase == "mixed":
            self.stats.check("mixed read")
            if tuple(slot.ref.converted_at) != converted:
                # attend_rows ran after the append converted rows (its reads were kept).
                self.stats.check("mixed read that converted rows")
        else:
            if phase == "packed":
                self.stats.check("packed read")
            self._compare_reads(what, list(reads), masks, rows, n)
        self._close(
            "attention", f"{what}: attention (optimized vs reference)", outputs[1], outputs[0]
        )
        self.stats.check("reference vs optimized")
        if not replay:
            return keys, values, queries, outputs
        before = [t.converted_at for t in slot.rows]
        self._record_rows(slot, keys, values, [n] * rows)
        self._solo(slot, block, queries, outputs, [n] * rows)
        self._advance(slot, before)
        return keys, values, queries, outputs

    def _attend_read(
        self, impl: Impl, lay: Any, codec: Any, queries: Any, reads: Any, mask: Any, phase: str
    ) -> Any:
        """A mixed read's attention through ``impl.attend`` (it routes the pending pair to
        ``attend_rows``); a plain or packed read's through its codec over the reads, as a
        model attends: ``impl.attend`` fetches again, and after an append that converted
        rows the layout holds quantized planes where the reads were plain. When nothing
        converted, ``impl.attend`` must give the same output. On the example's attention
        path (host or MLX ops, ``_on_path``)."""
        with self._on_path():
            return self._attend_read_on_path(impl, lay, codec, queries, reads, mask, phase)

    def _attend_read_on_path(
        self, impl: Impl, lay: Any, codec: Any, queries: Any, reads: Any, mask: Any, phase: str
    ) -> Any:
        if phase == "mixed":
            return impl.attend(queries, lay, mask, self.g.scale)
        out = codec.attend(queries, *reads, mask, self.g.scale)
        if lay.phase == phase and not lay.spec_round_open:
            again = impl.attend(queries, lay, mask, self.g.scale)
            self._close(
                "attention.solo.plain",
                f"{impl.name} attend() of a {phase} layout vs its codec over the reads",
                impl.to_numpy(again),
                impl.to_numpy(out),
                chosen=EXACT,
            )
            self.stats.check("Impl.attend of plain and packed reads")
        return out

    def _record_mask(self, what: str, slot: Slot, mask: Any, n: int) -> None:
        """Mixed full-attention or chunked rows: the mask (for the model's other layers)
        is the position record's as the append lays the rows (after their front trims):
        row ``b``'s held token ``j`` at column ``left_pad[b] + j``, and query ``i`` sees
        the row's columns up to its own position (a chunked row: those of its chunk,
        ``chunk_visible``)."""
        size = self.g.chunk_size
        kept = [t.held if size is None else min(t.held, size) for t in slot.rows]
        pads = [p + t.held - k for p, t, k in zip(slot.pads, slot.rows, kept, strict=True)]
        pads = [p - min(pads) for p in pads]
        ends = [p + k + n for p, k in zip(pads, kept, strict=True)]
        columns = int(mask.shape[-1]) if isinstance(mask, np.ndarray) else max(ends)
        got = expand_mask(mask, len(slot.rows), n, columns)
        want = np.zeros_like(got)
        for b, (pad, k, track) in enumerate(zip(pads, kept, slot.rows, strict=True)):
            first = track.tokens - k  # the position at column ``pad``
            for i in range(n):
                for j in range(k + i + 1):
                    position, query = first + j, track.tokens + i
                    seen = size is None or chunk_visible(query, position, size, None)
                    want[b, 0, i, pad + j] = seen
        self._exact(
            f"{what}: the mixed rows' mask is the position record's", got.tolist(), want.tolist()
        )
        self.stats.check("record mask")

    def _same_masks(self, what: str, masks: list[Any], rows: int, n: int) -> None:
        """Both masks select the same keys (compared as booleans when either is an array)."""
        ref, opt = _as_mask(self.ref_impl, masks[0]), _as_mask(self.opt_impl, masks[1])
        arrays = [m for m in (ref, opt) if isinstance(m, np.ndarray)]
        if not arrays:
            self._exact(what, opt, ref)
            return
        columns = int(arrays[0].shape[-1])
        self._exact(
            what,
            expand_mask(opt, rows, n, columns).tolist(),
            expand_mask(ref, rows, n, columns).tolist(),
        )

    def _compare_reads(
        self, what: str, reads: list[tuple[Any, Any]], masks: list[Any], rows: int, n: int
    ) -> None:
        """Plain or packed reads, reference vs optimized, at the columns some query sees."""
        planes = [
            (planes_of(impl, got[0]), planes_of(impl, got[1]))
            for impl, got in zip(self.impls, reads, strict=True)
        ]
        (k_ref, v_ref), (k_opt, v_opt) = planes
        self._exact(
            f"{what}: read shapes (optimized vs reference)",
            [p.shape for p in k_opt + v_opt],
            [p.shape for p in k_ref + v_ref],
        )
        columns = int(k_ref[0].shape[2])
        expanded = expand_mask(_as_mask(self.ref_impl, masks[0]), rows, n, columns)
        seen: npt.NDArray[np.bool_] = np.any(expanded, axis=(1, 2))
        for b in range(rows):
            cols = np.flatnonzero(seen[b]).tolist()
            for name, got, want in (("keys", k_opt, k_ref), ("values", v_opt, v_ref)):
                for i, (a, e) in enumerate(
                    zip(take_columns(got, b, cols), take_columns(want, b, cols), strict=True)
                ):
                    self._close("kv.fetched", f"{what}: read {name} row {b} plane {i}", a, e)

    def _solo(
        self,
        slot: Slot,
        block: Block,
        queries: Array,
        outputs: list[Array],
        accepted: list[int],
        *,
        round_block: bool = False,
    ) -> None:
        """Each row's solo legos take the row's first ``accepted[b]`` tokens of the block
        (:meth:`_solo_write`, through the writer skeleton's ``_write_solos``)."""
        self._round_block = round_block
        answers = (outputs[0], outputs[1])
        self._write_solos(f"layout {slot.ident}", slot.rows, (*block, queries), accepted, answers)
        self.stats.check("solo attention", len(slot.rows))
        self.stats.check("solo replay")

    def _solo_write(self, what: str, track: Any, part: Block, expected: Block | None) -> None:
        """A row's solo legos take its part of the block (keys, values, queries); their
        attention equals the layout row's for those queries (exactly in the optimized
        implementation while the row reads plain, outside rounds). A converted TurboQuant
        row's attention also equals the eager oracle over its solo storage's planes
        (:meth:`_check_eager`). Then the model's rule converts the row when due."""
        kb, vb, qb = part
        assert expected is not None
        k = int(kb.shape[2])
        what = f"{what} (request {track.ident}, {k} tokens)"
        plain_before = track.converted_at is None
        for impl, solo, out in zip(
            self.impls, (track.solo_ref, track.solo_opt), expected, strict=True
        ):
            plain = not solo.converted
            self._exact(f"{what}: plain before the append ({impl.name})", plain, plain_before)
            mask = solo.make_mask(k)
            got = self._write(impl, solo, (kb, vb))
            # An affine read is the planes' triples; a TurboQuant one is two arrays (keys
            # decoded, values still rotated) whose codec defers the values.
            quantized = (
                bool(solo.last_read_codec.defers_values)
                if self.turbo
                else isinstance(got[0], tuple | list)
            )
            self._exact(f"{what}: the lego's read is quantized", quantized, not plain)
            codec = self._codec(impl, quantized)
            q_native = impl.to_native(qb)
            with self._on_path():
                solo_out = impl.to_numpy(codec.attend(q_native, *got, mask, self.g.scale))
            if quantized and self.turbo:
                self._check_eager(f"{what} ({impl.name})", impl, solo, q_native, mask, out)
            # A wrapped serial ring reads a single token's step in physical order (the
            # window rotated by its phase) where the layout reads each row in time
            # order: the same terms summed in another order, so not bit for bit.
            wrapped = self.g.max_size is not None and k == 1 and int(solo.offset) > self.g.max_size
            if plain and not self._round_block and impl is self.opt_impl and not wrapped:
                self._close(
                    "attention.solo.plain",
                    f"{what}: optimized attention vs its plain solo lego",
                    out,
                    solo_out,
                    chosen=EXACT,
                )
                self.stats.check("exact before conversion")
            else:
                self._close(
                    "attention.solo", f"{what}: {impl.name} attention vs its solo lego",
                    out, solo_out,
                )  # fmt: skip
        if self._due(track):  # the model's rule: the row converts at this boundary
            self._mark_converted(track)
        self._exact(
            f"{what}: the solo legos converted (reference, optimized)",
            (track.solo_ref.converted, track.solo_opt.converted),
            (track.converted_at is not None,) * 2,
        )
        self._exact(
            f"{what}: the solo lego's conversion offset",
            track.solo_ref.minimum_reusable_offset,
            (track.converted_at or 0) if self.g.start > 0 else 0,
        )

    def _check_eager(
        self, what: str, impl: Impl, solo: Any, queries: Any, mask: Any, row_out: Array
    ) -> None:
        """Deferred vs eager V: a converted TurboQuant row's attention (its values read
        rotated, the output un-rotated) equals ``eager_attention`` of the same
        implementation over its solo storage's planes (values decoded before attention)."""
        module = importlib.import_module(".".join(type(solo).__module__.split(".")[:2]) + ".codecs")
        held = solo.storage.planes()
        expected = module.eager_attention(
            module.TurboCodec(self.g.target), queries, held[0], held[1], mask, self.g.scale
        )
        self._close(
            "attention.eager",
            f"{what}: deferred-V attention vs eager over the solo planes",
            row_out,
            impl.to_numpy(expected),
        )
        self.stats.check("deferred vs eager")
        if self._read_phase == "mixed":
            self.stats.check("deferred vs eager of a mixed read")

    def _advance(self, slot: Slot, before: list[int | None]) -> None:
        """After a boundary (the model's due rows converted: their solo legos say so),
        the layout against the model."""
        fresh = [
            b for b, t in enumerate(slot.rows) if before[b] is None and t.converted_at is not None
        ]
        if fresh and any(t.converted_at is None for t in slot.rows):
            self.stats.check("conversion mid-batch")
        self._check_layout(slot)

    # ------------------------------------------------------------------ prefill maintenance
    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def prefill_crossing(self, data: st.DataObject) -> None:
        """``begin_prefill()``, a chunk that takes plain rows past ``start`` (nothing
        converts), ``commit_prefill`` of some of them, then ``end_prefill()``."""
        slot = self._pick(data, [s for s in self.slots if s.rows], "layout")
        g = self.g
        plain = [t for t in slot.rows if t.converted_at is None]
        reach = [g.start - t.tokens for t in plain if t.tokens < g.start] or [1]
        # Mostly a chunk that takes the nearest plain row to start or past it.
        low, high = min(reach), max(1, min(10, max(reach) + 2))
        n = data.draw(st.integers(min(low, high), high), label="N")
        self._op("prefill_crossing")
        for lay in (slot.ref, slot.opt):
            lay.begin_prefill()
        self._exact(
            "prefilling (reference, optimized)",
            (slot.ref.prefilling, slot.opt.prefilling),
            (True, True),
        )
        before = [t.converted_at for t in slot.rows]
        keys, values, queries, outputs = self._layout_append(
            slot, n, self._rng(data), True, "prefill chunk", replay=False
        )
        self._record_rows(slot, keys, values, [n] * len(slot.rows))
        self._exact(
            "nothing converts while prefilling (reference, optimized)",
            (tuple(slot.ref.converted_at), tuple(slot.opt.converted_at)),
            (tuple(before),) * 2,
        )
        # The solo legos convert at the crossing chunk; the layout at the commit.
        crossed = [b for b, t in enumerate(slot.rows) if t.converted_at is None and self._due(t)]
        if crossed:
            self.stats.check("crossing chunk in prefill")
        pending = [t.converted_at for t in slot.rows]
        self._solo(slot, (keys, values), queries, outputs, [n] * len(slot.rows))
        committed = [t.converted_at for t in slot.rows]
        for t, c in zip(slot.rows, pending, strict=True):
            t.converted_at = c  # the layout converts them at the commit
        listed = [b for b in range(len(slot.rows)) if data.draw(st.booleans(), label=f"commit {b}")]
        for lay in (slot.ref, slot.opt):
            lay.commit_prefill(listed)
        for b in listed:
            slot.rows[b].converted_at = committed[b]
        if any(b in crossed for b in listed):
            self.stats.check("commit_prefill converts a listed row")
        if any(b not in listed for b in crossed):
            self.stats.check("a crossed row waits for end_prefill")
        self._check_layout(slot, solos=False)
        for lay in (slot.ref, slot.opt):
            lay.end_prefill()
        for t, c in zip(slot.rows, committed, strict=True):
            t.converted_at = c
        self._advance(slot, before)

    # ------------------------------------------------------------------ rounds
    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def spec_round(self, data: st.DataObject) -> None:
        """``spec_round_begin()``, a verify block, then commit or a rollback (int or per
        row); rows convert at the round's end when their committed offset reached ``start``."""
        slot = self._pick(data, [s for s in self.slots if s.rows], "layout")
        rows = len(slot.rows)
        d = data.draw(st.integers(1, MAX_DRAFTS), label="drafts")
        n = d + 1
        kind = data.draw(st.sampled_from(("unequal", "equal", "all", "none")), label="acceptance")
        keep = {
            "all": lambda: [n] * rows,
            "none": lambda: [1] * rows,
            "equal": lambda: [data.draw(st.integers(1, n), label="keep")] * rows,
            "unequal": lambda: [
                data.draw(st.integers(1, n), label=f"keep {b}") for b in range(rows)
            ],
        }[kind]()
        note(f"round: layout {slot.ident} {slot.opt!r}, d={d}, {kind}, keep {keep}")
        self._op(f"round:{kind}")
        if slot.ref.phase == "mixed":
            self.stats.check("round on mixed rows")
        # The layout's own calls, or the seed's row transaction over it.
        rounds = (
            [RowRound([slot.ref]), RowRound([slot.opt])]
            if data.draw(st.booleans(), label="through RowRound")
            else None
        )
        if rounds is not None:
            for row_round in rounds:
                row_round.begin(d)
            self.stats.check("RowRound")
        else:
            for lay in (slot.ref, slot.opt):
                lay.spec_round_begin()
        if data.draw(st.booleans(), label="misuse"):
            self._misuse(slot, data)
        before = [t.converted_at for t in slot.rows]
        keys, values, queries, outputs = self._layout_append(
            slot, n, self._rng(data), True, "verify block", replay=False
        )
        if data.draw(st.booleans(), label="misuse after the block"):
            self._misuse(slot, data)
        as_int = len(set(keep)) == 1 and data.draw(st.booleans(), label="keep as an int")
        for row_round in rounds or ():
            row_round.resolve([k - 1 for k in keep])
        for lay in (slot.ref, slot.opt) if rounds is None else ():
            if kind == "all":
                lay.spec_round_commit()
            else:
                lay.spec_round_rollback(keep[0] if as_int else list(keep))
        self._record_rows(slot, keys, values, keep)
        self._solo(slot, (keys, values), queries, outputs, keep, round_block=True)
        if any(
            b is None and t.converted_at is not None for b, t in zip(before, slot.rows, strict=True)
        ):
            self.stats.check("conversion at a round boundary")
        self._advance(slot, before)
        self._proposal_round(slot, 1 + sum(t.tokens for t in slot.rows) % 3)

    def _proposal_round(self, slot: Slot, count: int) -> None:
        """A proposal round (a draft model's proposals on its own layout), after each verify
        round with no draw of its own: ``count`` single-token appends, each compared as a
        layout append is (masks, reads, attention, reference vs optimized; no row converts
        inside the round, speculative.md §9), then ``spec_round_discard()``: every row is
        as it was (its record, stage and bytes against its solo legos). A layout that
        cannot hold the proposals (chunked rows) refuses in both implementations,
        unchanged."""
        self._op("proposal_round")
        holds = (slot.ref.holds_proposals, slot.opt.holds_proposals)
        self._exact(
            f"layout {slot.ident} holds_proposals (reference, optimized)", holds[1], holds[0]
        )
        if not holds[0]:
            self._refused(
                "spec_round_propose()",
                lambda impl, lay: lay.spec_round_propose(),
                slot.ref,
                slot.opt,
                SpeculativeRoundError,
            )
            return

        def record(cache: Any) -> tuple[Any, ...]:
            return (
                repr(cache), tuple(cache.row_offsets), tuple(cache.left_pad),
                tuple(cache.converted_at), cache.phase, cache.spec_round_open,
            )  # fmt: skip

        before = [record(lay) for lay in (slot.ref, slot.opt)]
        if any(t.converted_at is None and t.tokens + count >= self.g.start for t in slot.rows):
            self.stats.check("proposal past start (no conversion)")
        rng = np.random.default_rng([count, *(t.tokens for t in slot.rows)])
        for lay in (slot.ref, slot.opt):
            lay.spec_round_propose()
        for i in range(count):
            label = f"proposal {i + 1} of {count}"
            self._layout_append(slot, 1, rng, True, label, replay=False, modelled=i == 0)
            self._exact(
                f"layout {slot.ident} {label}: nothing converts in a proposal round",
                [tuple(lay.converted_at) for lay in (slot.ref, slot.opt)],
                [before[0][3]] * 2,
            )
        for lay in (slot.ref, slot.opt):
            lay.spec_round_discard()
        self._exact(
            f"layout {slot.ident}: a discarded proposal round leaves every row as it was",
            [record(lay) for lay in (slot.ref, slot.opt)],
            before,
        )
        self._check_layout(slot, rows=True)
        self.stats.check("proposal round discarded", count)
        if self.ring and any(t.tokens >= cast(int, self.g.max_size) for t in slot.rows):
            self.stats.check("proposal round on a full window")

    def _misuse(self, slot: Slot, data: st.DataObject) -> None:
        rows = len(slot.rows)
        cases: list[tuple[str, Callable[[Impl, Any], object]]] = [
            ("merge_rows in a round", lambda impl, lay: lay.merge_rows([self._lego(impl)])),
            ("filter_rows in a round", lambda impl, lay: lay.filter_rows(list(range(rows)))),
            ("extract_row(0) in a round", lambda impl, lay: lay.extract_row(0)),
            ("trim_rows in a round", lambda impl, lay: lay.trim_rows([0] * rows)),
            ("begin_prefill in a round", lambda impl, lay: lay.begin_prefill()),
            ("commit_prefill in a round", lambda impl, lay: lay.commit_prefill([])),
            ("end_prefill in a round", lambda impl, lay: lay.end_prefill()),
            ("a second spec_round_begin", lambda impl, lay: lay.spec_round_begin()),
            ("state in a round", lambda impl, lay: lay.state),
            (
                "merging the layout's rows into another in a round",
                lambda impl, lay: self._layout(impl).merge_rows([lay]),
            ),
        ]
        label, call = self._pick(data, cases, "misuse")
        note(f"  misuse in the round: {label}")
        self._refused(label, call, slot.ref, slot.opt, SpeculativeRoundError)
        self.stats.check("round misuse")

    # ------------------------------------------------------------------ membership
    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def filter_rows(self, data: st.DataObject) -> None:
        """Keep any subset of the rows, in any order."""
        slot = self._pick(data, self.slots, "layout")
        kind, keep = data.draw(ks.keep_lists(tuple(t.tokens for t in slot.rows)), label="keep")
        note(f"filter: layout {slot.ident} {slot.opt!r} keep {keep} ({kind})")
        self._op(f"filter:{kind}")
        if slot.ref.phase == "mixed":
            self.stats.check("filter of mixed rows")
        slot.ref.filter_rows(keep)
        slot.opt.filter_rows(keep)
        self._filter_model(slot, keep)
        self._check_layout(slot)

    def _filter_model(self, slot: Slot, keep: list[int]) -> None:
        slot.rows = [slot.rows[b] for b in keep]
        if not self.ring:
            pads = [slot.pads[b] for b in keep]
            shared = min(pads, default=0)
            slot.pads = [p - shared for p in pads]

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def extract(self, data: st.DataObject) -> None:
        """Extract a row: compared with its solo lego, and published covering a drawn
        count (``_publish``); it then leaves the layout and goes on as a request (a lego
        when the layout's rows came from legos), or stays."""
        slot = self._pick(data, [s for s in self.slots if s.rows], "layout")
        b = data.draw(st.integers(0, len(slot.rows) - 1), label="row")
        track = slot.rows[b]
        note(f"extract: layout {slot.ident} row {b} {slot.opt!r}")
        self._op("extract")
        if slot.ref.phase == "mixed":
            self.stats.check("extract mid-conversion")
        got = [lay.extract_row(b) for lay in (slot.ref, slot.opt)]
        self._check_extracted(f"layout {slot.ident} extract_row({b})", got, track)
        self._publish(slot, b)
        moves = len(self.pool) < MAX_POOL and data.draw(st.booleans(), label="the row leaves")
        if not moves:
            return
        keep = [i for i in range(len(slot.rows)) if i != b]
        slot.ref.filter_rows(keep)
        slot.opt.filter_rows(keep)
        self._filter_model(slot, keep)
        moved = track  # the request goes on in the pool: it holds what extract_row gave
        moved.ref, moved.opt, moved.extracted = got[0], got[1], True
        moved.holds = "lego"
        if not isinstance(got[0], Handover):
            moved.holds = "exact" if track.converted_at is None else "converted"
        self.pool.append(moved)
        self._check_layout(slot)
        if moved.holds == "lego" and data.draw(st.booleans(), label="goes on at once"):
            self._op("lego_append")
            self._pool_chunk(moved, data, self._rng(data), 8)
            self._check_pool_lego(moved)

    def _publish(self, slot: Slot, b: int) -> None:
        """``table.publish_row``: the row (as ``extract_row`` gives it) when it covers
        ``tokens``, else ``None``. The row's solo lego says what it covers: all its tokens,
        or a shorter prefix while it can still be trimmed (a ring row: before it wraps).

        Every count where the answer changes (``publish_counts``) is asked; of the shorter
        prefixes the row covers, one in turn is published and, cut back to it, must equal
        its solo lego's first tokens (the whole row is what ``extract`` just checked).
        Nothing is drawn: a draw here would move the derandomized CI examples off the rare
        cases the family's test requires."""
        track = slot.rows[b]
        self._op("publish")
        shorter: list[int] = []
        for tokens in publish_counts(track.tokens, self.g.max_size):
            # A chunked row covers a shorter prefix while it holds every position.
            covers = tokens == track.tokens or (
                tokens < track.tokens
                and track.solo_ref.is_trimmable()
                and track.held == track.tokens
            )
            what = f"layout {slot.ident} publish_row({b}, {tokens}) of {track.tokens} tokens"
            for impl, lay in zip(self.impls, (slot.ref, slot.opt), strict=True):
                answer = lay.can_publish_row(b, tokens)
                self._exact(f"{what}: can_publish_row ({impl.name})", answer, covers)
                if not covers:
                    refused = table.publish_row(lay, b, tokens)
                    self._exact(f"{what}: returns None ({impl.name})", refused, None)
            if not covers:
                self.stats.check("publish refused" if tokens <= track.tokens else "publish past")
            elif tokens < track.tokens:
                shorter.append(tokens)
        if not shorter:
            return
        tokens = shorter[self._publishes % len(shorter)]
        self._publishes += 1
        what = f"layout {slot.ident} publish_row({b}, {tokens}) of {track.tokens} tokens"
        note(f"publish: {what}")
        published = [table.publish_row(lay, b, tokens) for lay in (slot.ref, slot.opt)]
        got = [cache for cache in published if cache is not None]
        self._exact(f"{what}: published (reference, optimized)", len(got), 2)
        self._check_extracted(what, got, track)
        count = track.tokens - tokens
        for impl, cache, solo in zip(
            self.impls, got, (track.solo_ref, track.solo_opt), strict=True
        ):
            self._exact(f"{what} ({impl.name}): trim return", cache.trim(count), count)
            storage = cache.storage if isinstance(cache, Handover) else cache
            self._exact(f"{what} ({impl.name}): offset once cut", int(storage.offset), tokens)
            full = self._view(impl, solo)
            want = None if full is None else tuple(p[:, :, :tokens] for p in full)
            mine = self._view(impl, storage)
            label = f"{what} cut back ({impl.name}) vs its solo lego"
            self._same_planes("kv.solo", label, mine, want)
        self.stats.check("published prefix")

    def _check_extracted(self, what: str, got: list[Any], track: Track) -> None:
        """An extracted row equals its solo lego: bytes, offset, codec phase, conversion."""
        legos = [isinstance(x, Handover) for x in got]
        self._exact(f"{what}: legos (reference, optimized)", legos[1], legos[0])
        converted = track.converted_at is not None
        for impl, cache, solo in zip(
            self.impls, got, (track.solo_ref, track.solo_opt), strict=True
        ):
            storage = cache.storage if isinstance(cache, Handover) else cache
            self._exact(f"{what} ({impl.name}) offset", int(storage.offset), track.tokens)
            if isinstance(cache, Handover):
                self._exact(
                    f"{what} ({impl.name}): converted, minimum_reusable_offset",
                    (cache.converted, cache.minimum_reusable_offset),
                    (converted, solo.minimum_reusable_offset),
                )
            self._exact(
                f"{what} ({impl.name}) storage class",
                type(storage).__name__,
                type(solo.storage).__name__,
            )
            mine, want = self._view(impl, storage), self._view(impl, solo)
            self._same_planes("kv.solo", f"{what} ({impl.name}) vs its solo lego", mine, want)
        self.stats.check("extracted row bytes")

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def trim_rows(self, data: st.DataObject) -> None:
        """Per-row trims (a ring row only before it wraps, a chunked row at most what it
        holds); converted rows stay converted."""
        slot = self._pick(data, [s for s in self.slots if s.rows], "layout")
        if self._hard_trim(slot, data):
            return
        counts = [
            0
            if self._wrapped(t.tokens)
            else data.draw(ks.counts_up_to(min(t.held, 6)), label=f"count {b}")
            for b, t in enumerate(slot.rows)
        ]
        # Sometimes one count for every row, through trim(n).
        whole = len(set(counts)) == 1 and data.draw(st.booleans(), label="as trim(n)")
        note(f"trim_rows: layout {slot.ident} {slot.opt!r} counts {counts} (trim(n): {whole})")
        self._op("trim" if whole else "trim_rows")
        self._trim_rows(slot, counts, whole=whole)

    def _wrapped(self, tokens: int) -> bool:
        """A ring row holding its window takes no free count."""
        return self.g.max_size is not None and tokens >= self.g.max_size

    def _trim_rows(self, slot: Slot, counts: list[int], *, whole: bool = False) -> None:
        """``trim_rows(counts)`` on both layouts (``whole``: ``trim(counts[0])``), which
        every row's model and solo legos follow."""
        g = self.g
        self._note_uneven(slot, counts)
        for impl, lay in zip(self.impls, (slot.ref, slot.opt), strict=True):
            got = lay.trim(counts[0]) if whole else lay.trim_rows(counts)
            self._exact(f"trim return ({impl.name})", got, max(counts))
        for t, count in zip(slot.rows, counts, strict=True):
            if count:
                self._record_trim(t, count)
                for solo in (t.solo_ref, t.solo_opt):
                    solo.trim(count)
                if t.converted_at is not None and t.tokens < g.start:
                    self.stats.check("converted row trimmed below start")
        self._check_layout(slot)

    # ----------------------------------------- the hard states (``machines._build_uneven``)
    def _hard_trims(self, slot: Slot) -> list[str]:
        """``uneven`` (``UNEVEN_TRIM``) where no row holds its window; a ring's ``fill``
        (``FULL_RING_ROLLBACK``, ``RING_TRIM_REFUSED``) where a block can fill a row to
        exactly its window (``machines._fill_kinds``)."""
        uneven = self._uneven_rows(slot, lambda tokens: not self._wrapped(tokens))
        return [*uneven, *(self._fill_kinds(slot) if self.ring else [])]

    def _fill_rows(self, rows: list[Track]) -> list[int]:
        """The rows below the window a block may fill with no row converting in it: the
        layout converts a row at the append, its solo lego (fed what the row keeps) at
        what it keeps, so the fill draws no block that crosses a row's ``start``."""
        window = self._fill_window(None)
        return [
            b
            for b, t in enumerate(rows)
            if t.tokens < window
            and all(
                r.converted_at is not None or not self.g.converts(r.tokens + window - t.tokens)
                for r in rows
            )
        ]

    def _fill_window(self, slot: Slot | None) -> int:
        assert self.g.max_size is not None
        return self.g.max_size

    def _fill_short(self, slot: Slot) -> list[int]:
        return self._fill_rows(slot.rows)

    def _fill_joins(self, slot: Slot) -> list[Track]:
        if len(slot.rows) >= MAX_ROWS:
            return []
        return [t for t in self.pool if self._fill_rows([*slot.rows, t])[-1:] == [len(slot.rows)]]

    def _fill_block(self, slot: Slot, n: int, data: st.DataObject) -> Any:
        inside = slot.ref.phase == "mixed" or data.draw(st.booleans(), label="in row_reads")
        before = [t.converted_at for t in slot.rows]
        block = self._layout_append(slot, n, self._rng(data), inside, "fill", replay=False)
        return block, before

    def _fill_replay(self, slot: Slot, pending: Any, counts: list[int]) -> None:
        (keys, values, queries, outputs), before = pending
        kept = [int(keys.shape[2]) - c for c in counts]
        for b, (track, k) in enumerate(zip(slot.rows, kept, strict=True)):
            if k:
                self._record_append(track, keys[b : b + 1, :, :k], values[b : b + 1, :, :k])
        self._solo(slot, (keys, values), queries, outputs, kept)
        self._advance(slot, before)

    def _uneven_joins(self, slot: Slot) -> list[Track]:
        if len(slot.rows) >= MAX_ROWS:
            return []
        return [t for t in self.pool if t.tokens >= 1 and not self._wrapped(t.tokens)]

    def _join_for_trim(self, slot: Slot, request: Track) -> None:
        self._join_requests(slot, [request], False)

    def _uneven_block(self, slot: Slot, n: int, data: st.DataObject) -> None:
        inside = slot.ref.phase == "mixed" or data.draw(st.booleans(), label="in row_reads")
        self._layout_append(slot, n, self._rng(data), inside, "step")
        self._check_layout(slot)
        self._landed(slot)

    # ------------------------------------------------------------------ bad calls
    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """A bad call: the same ``KvRowsError`` type and message in both, nothing changes."""
        slot = self._pick(data, self.slots, "layout")
        label, call, expected = self._pick(data, self._bad_calls(slot), "bad call")
        note(f"invalid: layout {slot.ident} {slot.opt!r}: {label}")
        self._op("invalid")
        self._refused(label, call, slot.ref, slot.opt, expected)

    def _bad_calls(self, slot: Slot) -> list[BadCall]:
        g = self.g
        rows = len(slot.rows)
        rng = np.random.default_rng(7)

        def block(impl: Impl, batch: int, dim: int = g.dim) -> tuple[Any, Any]:
            shape = (batch, g.heads, 1, dim)
            return (impl.to_native(random_block(rng, shape, g.dtype)),
                    impl.to_native(random_block(rng, shape, g.dtype)))  # fmt: skip

        def filled_lego(impl: Impl, start: int) -> Any:
            lego = self._lego(impl, start=start)
            lego.update_and_fetch(*block(impl, 1))
            return lego

        def other_impl(impl: Impl) -> Impl:
            return self.opt_impl if impl is self.ref_impl else self.ref_impl

        other_start = g.start + 1
        cases: list[BadCall] = [
            (
                "merge_rows of itself",
                lambda impl, lay: lay.merge_rows([lay]),
                IncompatibleRowsError,
            ),
            (
                f"merge_rows of a lego of start {other_start}",
                lambda impl, lay: lay.merge_rows([filled_lego(impl, other_start)]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a valid lego and a lego of another start",
                lambda impl, lay: lay.merge_rows(
                    [filled_lego(impl, g.start), filled_lego(impl, other_start)]
                ),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a lego of another bit width",
                lambda impl, lay: lay.merge_rows([self._lego(impl, **self._other_widths())]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of the other implementation's lego",
                lambda impl, lay: lay.merge_rows([self._lego(other_impl(impl))]),
                IncompatibleRowsError,
            ),
            (
                f"merge_rows of a delayed layout of start {other_start}",
                lambda impl, lay: lay.merge_rows([self._layout(impl, start=other_start)]),
                IncompatibleRowsError,
            ),
            (
                f"merge_rows of a {self.converted_kind} storage of another bit width",
                lambda impl, lay: lay.merge_rows(
                    [self._storage(impl, True, **self._other_widths("keys"))]
                ),
                IncompatibleRowsError,
            ),
            ("merge_rows of a string", lambda impl, lay: lay.merge_rows("rows"), InvalidInputError),
            (
                "merge_rows of a lego of the other token geometry",
                lambda impl, lay: lay.merge_rows([self._other_geometry(impl, "lego")]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a plain storage of the other token geometry",
                lambda impl, lay: lay.merge_rows([self._other_geometry(impl, "plain")]),
                IncompatibleRowsError,
            ),
            (
                "spec_round_commit without a round",
                lambda impl, lay: lay.spec_round_commit(),
                SpeculativeRoundError,
            ),
            (
                "spec_round_rollback(1) without a round",
                lambda impl, lay: lay.spec_round_rollback(1),
                SpeculativeRoundError,
            ),
            (
                "a truncated state",
                lambda impl, lay: setattr(lay, "state", lay.state[:-1]),
                InvalidInputError,
            ),
            (f"extract_row({rows})", lambda impl, lay: lay.extract_row(rows), RowIndexError),
            (
                f"commit_prefill([{rows}])",
                lambda impl, lay: lay.commit_prefill([rows]),
                RowIndexError,
            ),
            ("commit_prefill('0')", lambda impl, lay: lay.commit_prefill("0"), InvalidInputError),
            (f"filter_rows([{rows}])", lambda impl, lay: lay.filter_rows([rows]), RowIndexError),
        ]
        if self.turbo:
            cases += [
                (
                    "merge_rows of an affine lego (another codec)",
                    lambda impl, lay: lay.merge_rows([self._other_codec(impl, "lego")]),
                    IncompatibleRowsError,
                ),
                (
                    "merge_rows of an affine QuantizedKVCache (another codec)",
                    lambda impl, lay: lay.merge_rows([self._other_codec(impl, "storage")]),
                    IncompatibleRowsError,
                ),
            ]
        if not rows:
            cases.append(
                (
                    "update_and_fetch on a layout without rows",
                    lambda impl, lay: lay.update_and_fetch(*block(impl, 1)),
                    LayoutStateError,
                )
            )
            return cases
        cases += [
            (
                f"a block of {rows + 1} rows",
                lambda impl, lay: lay.update_and_fetch(*block(impl, rows + 1)),
                InvalidInputError,
            ),
            (
                "a block of head dim 48 (not a TurboQuant head dim)"
                if self.turbo
                else "a block of head dim 48 (no group divides it)",
                lambda impl, lay: lay.update_and_fetch(*block(impl, rows, 48)),
                InvalidInputError,
            ),
            ("filter_rows([0, 0])", lambda impl, lay: lay.filter_rows([0, 0]), RowIndexError),
            (
                "trim_rows past a row's tokens",
                lambda impl, lay: lay.trim_rows([t.tokens + 1 for t in slot.rows]),
                NotTrimmableError,
            ),
            (
                f"trim_rows with {rows + 1} counts",
                lambda impl, lay: lay.trim_rows([0] * (rows + 1)),
                InvalidInputError,
            ),
            ("commit_prefill([0, 0])", lambda impl, lay: lay.commit_prefill([0, 0]), RowIndexError),
        ]
        if slot.ref.phase == "mixed":
            cases += [
                (
                    "a mixed read outside row_reads()",
                    lambda impl, lay: lay.update_and_fetch(*block(impl, rows)),
                    MixedPrecisionReadError,
                ),
                ("fetch() of mixed rows", lambda impl, lay: lay.fetch(), MixedPrecisionReadError),
            ]
        if not slot.ref.reads_pending:
            queries = random_block(rng, (rows, g.query_heads, 1, g.dim), g.dtype)
            cases.append(
                (
                    "attend_rows without a pending mixed read",
                    lambda impl, lay: lay.attend_rows(impl.to_native(queries), g.scale),
                    MixedPrecisionReadError,
                )
            )
        return cases

    # ------------------------------------------------------------------ oracles
    @invariant()
    def check_oracles(self) -> None:
        if self.geo is None:
            return
        for track in self.pool:
            self._check_pool_lego(track)

    def _check_pool_lego(self, track: Track) -> None:
        """A pool lego against its solo lego (offset, phase) in both implementations."""
        if track.holds != "lego":
            return
        for impl, lego in zip(self.impls, (track.ref, track.opt), strict=True):
            self._exact(
                f"request {track.ident} ({impl.name}): offset, converted",
                (int(lego.offset), lego.converted),
                (track.tokens, track.converted_at is not None),
            )

    def _check_layout(self, slot: Slot, *, rows: bool = False, solos: bool = True) -> None:
        """Reference vs optimized vs the model; ``rows``: every row's bytes vs its lego;
        ``solos``: the solo legos converted where the layout did (not between a prefill
        chunk and its commit)."""
        what = f"layout {slot.ident} {slot.opt!r}"
        observed = [self._layout_observed(lay) for lay in (slot.ref, slot.opt)]
        self._exact(f"{what}: reference vs optimized", observed[1], observed[0])
        self._exact(f"{what}: vs the model", observed[0], self._expected(slot))
        pads = [tuple(lay.left_pad) for lay in (slot.ref, slot.opt)]
        self._exact(f"{what}: left_pad (optimized vs reference)", pads[1], pads[0])
        if not self.ring:
            self._exact(f"{what}: left_pad vs the position record", pads[0], tuple(slot.pads))
        positions = [impl.to_numpy(lay.offset).tolist() for impl, lay in
                     zip(self.impls, (slot.ref, slot.opt), strict=True)]  # fmt: skip
        self._exact(f"{what}: positions", positions, [[t.tokens for t in slot.rows]] * 2)
        for lay in (slot.ref, slot.opt):
            lay.check_valid()
        probes = (0, self.g.start, self.g.start + 7)
        self._exact(
            f"{what}: projected_bytes (optimized vs reference)",
            [_answer(slot.opt.projected_bytes, t) for t in probes],
            [_answer(slot.ref.projected_bytes, t) for t in probes],
        )
        for t in slot.rows if solos else ():
            self._exact(
                f"{what}: request {t.ident}'s solo legos converted",
                (t.solo_ref.converted, t.solo_opt.converted),
                (t.converted_at is not None,) * 2,
            )
        self.stats.check("reference vs optimized")
        self.stats.check("layout model")
        self.stats.check("converted_at", len(slot.rows))
        if rows:
            for b, track in enumerate(slot.rows):
                got = [lay.extract_row(b) for lay in (slot.ref, slot.opt)]
                self._check_extracted(f"{what} row {b} at teardown", got, track)


def _storage_of(cache: Any) -> Any:
    """A lego's current storage (what its ``state`` saves), else the cache itself."""
    return cache.storage if isinstance(cache, Handover) else cache


def _as_mask(impl: Impl, mask: Any) -> Any:
    if mask is None or isinstance(mask, str):
        return mask
    return impl.to_numpy(mask)
