"""The conformance state machines: one base machine, generated per (family, layout).

A machine holds the same logical state three or four times over:

* the **reference** and the **optimized** implementation, side by side (same
  operations, same data converted exactly);
* for every request, **solo** serial caches in each implementation (and an
  mlx-lm ``KVCache`` twin) that saw exactly the appends and trims its row saw;
* a NumPy **model** of every request's tokens (the blocks appended, minus the
  trims), which depends on no implementation at all;
* for a shared-column layout, an **mlx-lm mirror** (``BatchKVCache``) driven
  through the same merges (``merge``), joins (``extend``), filters, extracts,
  trims and steps.

After every step :meth:`ConformanceMachine.check_oracles` checks the three
oracles of ``DESIGN.md``: (a) reference vs optimized, (b) solo replay in each
implementation, (c) mlx-lm parity; plus both implementations against the model.
Attention outputs are compared inside the step rules (they exist only there).

Requests live in a **pool** (free serial caches: prefill, trim, merge from
here) or as **rows** of a layout. Rows that a filter drops go back to the pool
(their solo caches become the request's caches); an extracted row may join the
pool as a new request (its caches are the extracted ones).

Machines are classes made by :func:`machine_class`, which takes the
implementations as parameters so the teeth tests can inject mutants.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvrows import table
from kvrows.conformance import strategies as ks
from kvrows.conformance.arrays import NUMPY_DTYPES, expand_mask, random_block
from kvrows.conformance.families import Family, Impl, LayoutSpec, PeerSpec
from kvrows.conformance.parity import DIVERGENCES
from kvrows.conformance.snapshot import snapshot
from kvrows.conformance.stats import Stats
from kvrows.conformance.tolerances import compare, tolerance
from kvrows.errors import KvRowsError

__all__ = ["ConformanceMachine", "Limits", "machine_class", "projected_or_error"]


def projected_or_error(layout: Any, tokens: int) -> int | str:
    """``projected_bytes(tokens)``, or the error's type name (unknown geometry raises)."""
    try:
        return int(layout.projected_bytes(tokens))
    except KvRowsError as error:
        return type(error).__name__


Array = npt.NDArray[Any]


@dataclass(frozen=True)
class Limits:
    """How big a machine's world may get (keeps examples fast on two cores)."""

    pool: int = 5
    layouts: int = 2
    rows: int = 8
    long_prompts: bool = True


@dataclass
class Track:
    """One request: its model (tokens appended minus trims) and its serial caches.

    In the pool, ``ref``/``opt``/``lm`` *are* the request; inside a layout they
    are the row's solo replay caches.
    """

    ident: int
    ref: Any
    opt: Any
    lm: Any
    keys: Array
    values: Array
    #: The caches hold planes (some block was appended): their row count B is fixed.
    appended: bool = False
    #: The caches know their geometry (an append, or an extracted empty row that kept it).
    geometry_known: bool = False
    history: list[tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.keys.shape[2])


@dataclass
class Slot:
    """One layout in both implementations, its rows' tracks and its mlx-lm mirror."""

    ident: int
    ref: Any
    opt: Any
    rows: list[Track]
    lm: Any = None
    #: False once a skipped operation left the mirror unable to follow (then it is dropped).
    mirrored: bool = True


def _update_with(
    make: Callable[[Impl], tuple[Any, Any]],
) -> Callable[[Impl, Any], object]:
    """A call that appends ``make(impl)``'s keys and values to a cache."""
    return lambda impl, cache: cache.update_and_fetch(*make(impl))


class ConformanceMachine(RuleBasedStateMachine):
    """Shared rules for every (family, layout); see the module docstring."""

    family: ClassVar[Family]
    spec: ClassVar[LayoutSpec]
    ref_impl: ClassVar[Impl]
    opt_impl: ClassVar[Impl]
    peer: ClassVar[PeerSpec | None]
    stats: ClassVar[Stats]
    limits: ClassVar[Limits]
    #: False in calibration runs: attention errors are recorded, not enforced.
    enforce: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.geo: ks.Geometry | None = None
        self.pool: list[Track] = []
        self.slots: list[Slot] = []
        self._ids = itertools.count()
        self._steps_at_start = self.stats.steps

    def teardown(self) -> None:
        # Examples Hypothesis abandons before any operation (duplicates of explored
        # prefixes) are not counted.
        if self.stats.steps > self._steps_at_start:
            self.stats.example_done()

    # ------------------------------------------------------------------ helpers
    @property
    def g(self) -> ks.Geometry:
        assert self.geo is not None
        return self.geo

    def _exact(self, what: str, actual: object, expected: object) -> None:
        if actual != expected:
            raise AssertionError(f"{what}: got {actual!r}, expected {expected!r}")

    def _close(self, quantity: str, what: str, actual: Array, expected: Array) -> None:
        tol = tolerance(self.family.tolerance_key, quantity, self.g.dtype)
        ok, error = compare(actual, expected, tol)
        ratio = 0.0
        if not tol.exact and actual.shape == expected.shape and actual.size:
            wide = expected.astype(np.float64)
            bound = tol.atol + tol.rtol * np.abs(wide)
            ratio = float(np.max(np.abs(actual.astype(np.float64) - wide) / bound))
        self.stats.error(quantity, self.g.dtype, tol, error, ratio)
        if ok or (not self.enforce and quantity.startswith("attention")):
            return
        raise AssertionError(
            f"{what}: {quantity} differs beyond {tol.describe()} "
            f"(max |diff| = {error:g}; shapes {actual.shape} / {expected.shape}, "
            f"dtypes {actual.dtype} / {expected.dtype})"
        )

    def _block(self, rng: np.random.Generator, rows: int, n: int, dim: int) -> Array:
        return random_block(rng, (rows, self.g.heads, n, dim), self.g.dtype)

    def _planes(self, impl: Impl, held: Any) -> tuple[Array, ...] | None:
        """``(k planes..., v planes...)`` of a ``planes()`` / ``row_planes()`` answer, as NumPy."""
        if held is None:
            return None
        return tuple(impl.to_numpy(p) for group in held for p in group)

    def _model_planes(self, track: Track) -> tuple[Array, ...]:
        return (*self.family.encode(track.keys), *self.family.encode(track.values))

    def _same_planes(
        self, quantity: str, what: str, actual: tuple[Array, ...] | None, track: Track
    ) -> None:
        """``actual`` holds exactly ``track``'s tokens (``None`` only for an empty row)."""
        if actual is None:
            self._exact(f"{what}: holds no planes, so the row must hold 0 tokens", track.tokens, 0)
            return
        for i, (got, want) in enumerate(zip(actual, self._model_planes(track), strict=True)):
            self._close(quantity, f"{what} plane {i}", got, want)

    def _new_track(self) -> Track:
        g = self.g
        dtype = NUMPY_DTYPES[g.dtype]
        lm = self.peer.serial() if self.peer is not None else None
        return Track(
            ident=next(self._ids),
            ref=self.ref_impl.new(self.family.serial),
            opt=self.opt_impl.new(self.family.serial),
            lm=lm,
            keys=np.zeros((1, g.heads, 0, g.key_dim), dtype=dtype),
            values=np.zeros((1, g.heads, 0, g.value_dim), dtype=dtype),
        )

    def _record_append(self, track: Track, keys: Array, values: Array) -> None:
        track.keys = np.concatenate([track.keys, keys], axis=2)
        track.values = np.concatenate([track.values, values], axis=2)
        track.appended = track.geometry_known = True
        track.history.append(("append", keys, values))

    def _record_trim(self, track: Track, count: int) -> None:
        keep = track.tokens - count
        track.keys = track.keys[:, :, :keep].copy()
        track.values = track.values[:, :, :keep].copy()
        track.history.append(("trim", count, None))

    def _replay(self, source: Track) -> Track:
        """A new track whose fresh serial caches saw exactly ``source``'s appends and trims."""
        track = self._new_track()
        for kind, a, b in source.history:
            if kind == "append":
                track.ref.update_and_fetch(a, b)
                track.opt.update_and_fetch(self.opt_impl.to_native(a), self.opt_impl.to_native(b))
                if track.lm is not None:
                    track.lm.update_and_fetch(
                        self.opt_impl.to_native(a), self.opt_impl.to_native(b)
                    )
                self._record_append(track, a, b)
            else:
                track.ref.trim(a)
                track.opt.trim(a)
                if track.lm is not None:
                    track.lm.trim(a)
                self._record_trim(track, a)
        return track

    def _masks_equal(self, what: str, masks: Sequence[Any], batch: int, n: int, keys: int) -> None:
        """``masks`` (reference, optimized[, mlx-lm]) describe the same visibility."""
        names = ("reference", "optimized", "mlx-lm")
        expanded = []
        for name, mask in zip(names, masks, strict=False):
            try:
                expanded.append(expand_mask(mask, batch, n, keys))
            except AssertionError as error:
                raise AssertionError(f"{what} ({name}): {error}") from None
        for name, other in zip(names[1:], expanded[1:], strict=False):
            if not np.array_equal(expanded[0], other):
                raise AssertionError(
                    f"{what}: the {name} mask differs from the reference's:\n"
                    f"{other.astype(int)}\nvs\n{expanded[0].astype(int)}"
                )
        self.stats.check("masks")

    def _visible_rows(
        self, fetched: Array, pads: Sequence[int], lens: Sequence[int]
    ) -> list[Array]:
        return [
            fetched[b : b + 1, :, p : p + t]
            for b, (p, t) in enumerate(zip(pads, lens, strict=True))
        ]

    def _parity(self, slot: Slot) -> bool:
        return self.peer is not None and self.spec.peer and slot.mirrored

    def _skip(self, code: str, what: str) -> None:
        assert code in DIVERGENCES, code
        note(f"  parity skip {code}: {what}")
        self.stats.skip(code)

    def _pick(self, data: st.DataObject, items: Sequence[Any], label: str) -> Any:
        return items[data.draw(st.integers(0, len(items) - 1), label=label)]

    # ------------------------------------------------------------ serial steps
    def _serial_append(
        self, track: Track, keys: Array, values: Array, queries: Array, form: ks.MaskForm
    ) -> None:
        """Append one block to a free request in every implementation; compare attention."""
        ref, opt = self.ref_impl, self.opt_impl
        n = int(keys.shape[2])
        kw = form.kwargs()
        masks = [track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)]
        if track.lm is not None:
            masks.append(track.lm.make_mask(n, **form.mlx_lm_kwargs()))
        self._masks_equal(f"request {track.ident} mask({n}, {form})", masks, 1, n, track.tokens + n)
        k_opt, v_opt, q_opt = (opt.to_native(x) for x in (keys, values, queries))
        track.ref.update_and_fetch(keys, values)
        track.opt.update_and_fetch(k_opt, v_opt)
        out_ref = ref.to_numpy(ref.attend(queries, track.ref, masks[0], self.g.scale))
        out_opt = opt.to_numpy(opt.attend(q_opt, track.opt, masks[1], self.g.scale))
        self._close("attention", f"request {track.ident} attention", out_opt, out_ref)
        if track.lm is not None and self.peer is not None:
            lk, lv = track.lm.update_and_fetch(k_opt, v_opt)
            out_lm = self.peer.attention(
                q_opt, lk, lv, cache=track.lm, scale=self.g.scale, mask=masks[2]
            )
            self._close(
                "attention.mlx_lm",
                f"request {track.ident} attention",
                out_opt,
                opt.to_numpy(out_lm),
            )
        self._record_append(track, keys, values)

    # ------------------------------------------------------------------- rules
    @initialize(geo=ks.geometries())
    def setup(self, geo: ks.Geometry) -> None:
        self.geo = geo
        note(f"geometry: {geo}")

    @precondition(lambda self: len(self.pool) < self.limits.pool)
    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        """A request with a random prompt (0 tokens included), prefilled in random chunks."""
        length = data.draw(ks.prompt_lengths(self.limits.long_prompts), label="prompt length")
        chunks = data.draw(ks.chunk_sizes(length), label="chunks")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = np.random.default_rng(data.draw(ks.seeds, label="seed"))
        track = self._new_track()
        note(f"new_request: request {track.ident}, prompt {length} in chunks {chunks}")
        self.stats.op("new_request")
        for n in chunks:
            keys = self._block(rng, 1, n, self.g.key_dim)
            values = self._block(rng, 1, n, self.g.value_dim)
            queries = random_block(rng, (1, self.g.query_heads, n, self.g.key_dim), self.g.dtype)
            self._serial_append(track, keys, values, queries, form)
        self.pool.append(track)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        """One more prompt chunk into a free request."""
        track = self._pick(data, self.pool, "request")
        n = data.draw(st.integers(1, 8), label="chunk")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = np.random.default_rng(data.draw(ks.seeds, label="seed"))
        note(f"prefill_chunk: request {track.ident} (+{n} tokens onto {track.tokens})")
        self.stats.op("prefill_chunk")
        keys = self._block(rng, 1, n, self.g.key_dim)
        values = self._block(rng, 1, n, self.g.value_dim)
        queries = random_block(rng, (1, self.g.query_heads, n, self.g.key_dim), self.g.dtype)
        self._serial_append(track, keys, values, queries, form)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def trim_request(self, data: st.DataObject) -> None:
        """Serial trim (clamps to what the cache holds; returns the count)."""
        track = self._pick(data, self.pool, "request")
        n = data.draw(st.integers(0, track.tokens + 2), label="n")
        note(f"trim_request: request {track.ident} holding {track.tokens}, trim({n})")
        self.stats.op("trim_request")
        expected = min(n, track.tokens)
        self._exact("reference trim() return", track.ref.trim(n), expected)
        self._exact("optimized trim() return", track.opt.trim(n), expected)
        if track.lm is not None:
            self._exact("mlx-lm trim() return", track.lm.trim(n), expected)
        self._record_trim(track, expected)

    def _merge_sources(
        self, data: st.DataObject, room: int
    ) -> tuple[list[tuple[str, Any, Any]], list[Track], list[Track]]:
        """Draw merge sources: free requests and, sometimes, a side layout built from some.

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
        if len(picked) >= 1 and data.draw(st.booleans(), label="via a side layout"):
            side_rows = data.draw(st.integers(1, len(picked)), label="side layout rows")
        if side_rows:
            kinds = [spec.name for spec in self.family.layouts]
            kind = data.draw(st.sampled_from(kinds), label="side layout kind")
            side_ref = self.ref_impl.new(kind)
            side_opt = self.opt_impl.new(kind)
            group = picked[:side_rows]
            side_ref.merge_rows([t.ref for t in group])
            side_opt.merge_rows([t.opt for t in group])
            sources.append(("layout " + kind, side_ref, side_opt))
            incoming.extend(group)
        for t in picked[side_rows:]:
            sources.append((f"request {t.ident}", t.ref, t.opt))
            incoming.append(t)
        return sources, incoming, picked

    @precondition(lambda self: bool(self.pool) and self.geo is not None)
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
            f"{kind}: layout {slot.ident} ({slot.ref!r}) <- "
            + ", ".join(f"{label}" for label, _, _ in sources)
            + f" = requests {[t.ident for t in incoming]} with tokens {[t.tokens for t in incoming]}"
        )
        self.stats.op(kind)
        before = (
            [snapshot(s[1], self.ref_impl.to_numpy) for s in sources],
            [snapshot(s[2], self.opt_impl.to_numpy) for s in sources],
        )
        slot.ref.merge_rows([s[1] for s in sources])
        slot.opt.merge_rows([s[2] for s in sources])
        after = (
            [snapshot(s[1], self.ref_impl.to_numpy) for s in sources],
            [snapshot(s[2], self.opt_impl.to_numpy) for s in sources],
        )
        self._exact("merge sources are borrowed and left unchanged", after, before)
        self._mirror_merge(slot, incoming)
        for t in consumed:
            self.pool.remove(t)
        slot.rows.extend(incoming)

    def _new_slot(self, data: st.DataObject) -> Slot:
        if len(self.slots) > 0 and bool(data.draw(st.booleans(), label="via make_empty_batch")):
            model = self.slots[0]
            ref, opt = model.ref.make_empty_batch(), model.opt.make_empty_batch()
        else:
            ref, opt = self.ref_impl.new(self.spec.name), self.opt_impl.new(self.spec.name)
        slot = Slot(next(self._ids), ref, opt, [])
        self.slots.append(slot)
        return slot

    def _mirror_merge(self, slot: Slot, incoming: Sequence[Track]) -> None:
        """mlx-lm: ``BatchKVCache.merge`` of the incoming twins; ``extend`` onto a running batch."""
        if not self._parity(slot) or not incoming or self.peer is None:
            return
        batch = self.peer.batch.merge([t.lm for t in incoming])
        if slot.lm is None:
            slot.lm = batch
        else:
            slot.lm.extend(batch)
        self.stats.check("mlx-lm merge/extend")

    @precondition(lambda self: len(self.slots) >= 2)
    @rule(data=st.data())
    def merge_layout(self, data: st.DataObject) -> None:
        """Merge one running layout into another (the source is borrowed and stays intact)."""
        target = self._pick(data, self.slots, "target layout")
        others = [s for s in self.slots if s is not target and s.rows]
        if not others:
            return
        source = self._pick(data, others, "source layout")
        if len(target.rows) + len(source.rows) > self.limits.rows:
            return
        note(f"merge_layout: layout {source.ident} ({source.ref!r}) into layout {target.ident}")
        self.stats.op("merge_layout")
        target.ref.merge_rows([source.ref])
        target.opt.merge_rows([source.opt])
        copies = [self._replay(t) for t in source.rows]
        self._mirror_merge(target, copies)
        target.rows.extend(copies)

    def _step(self, slot: Slot, n: int, rng: np.random.Generator, form: ks.MaskForm) -> None:
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        rows = len(slot.rows)
        keys = self._block(rng, rows, n, g.key_dim)
        values = self._block(rng, rows, n, g.value_dim)
        queries = random_block(rng, (rows, g.query_heads, n, g.key_dim), g.dtype)
        k_opt, v_opt, q_opt = (opt.to_native(x) for x in (keys, values, queries))
        positions = [t.tokens for t in slot.rows]
        pos_ref = ref.to_numpy(slot.ref.offset).copy()
        pos_opt_handle = slot.opt.offset
        self._exact("positions (reference offset)", pos_ref.tolist(), positions)
        self._exact(
            "positions (optimized offset)", opt.to_numpy(pos_opt_handle).tolist(), positions
        )
        width = slot.ref.width
        kw = form.kwargs()
        mask_ref, mask_opt = slot.ref.make_mask(n, **kw), slot.opt.make_mask(n, **kw)
        self._masks_equal(
            f"layout {slot.ident} mask({n})", [mask_ref, mask_opt], rows, n, width + n
        )
        lm_mask = lm_positions = None
        parity = self._parity(slot) and self.peer is not None and slot.lm is not None
        if parity:
            lm_positions = slot.lm.offset
            lm_mask = slot.lm.make_mask(n, **form.mlx_lm_kwargs())
            self._masks_equal(
                f"layout {slot.ident} mlx-lm mask({n})", [mask_opt, lm_mask], rows, n, width + n
            )
        fk_ref, fv_ref = slot.ref.update_and_fetch(keys, values)
        fk_opt, fv_opt = slot.opt.update_and_fetch(k_opt, v_opt)
        self._exact(
            "optimized offset handle captured before the step is unchanged (rebound, not mutated)",
            opt.to_numpy(pos_opt_handle).tolist(),
            positions,
        )
        pads = slot.ref.left_pad
        lens = [p + n for p in positions]
        for name, f_ref, f_opt in (("keys", fk_ref, fk_opt), ("values", fv_ref, fv_opt)):
            got, want = opt.to_numpy(f_opt), ref.to_numpy(f_ref)
            self._exact(f"fetched {name} shape", got.shape, want.shape)
            for b, (a, e) in enumerate(
                zip(
                    self._visible_rows(got, pads, lens),
                    self._visible_rows(want, pads, lens),
                    strict=True,
                )
            ):
                self._close("kv.fetched", f"layout {slot.ident} fetched {name} row {b}", a, e)
        out_ref = ref.to_numpy(ref.attend(queries, slot.ref, mask_ref, g.scale))
        out_opt = opt.to_numpy(opt.attend(q_opt, slot.opt, mask_opt, g.scale))
        self._close("attention", f"layout {slot.ident} attention", out_opt, out_ref)
        if parity and self.peer is not None:
            lk, lv = slot.lm.update_and_fetch(k_opt, v_opt)
            self._exact(
                "mlx-lm offset handle captured before the step is unchanged",
                np.array(lm_positions).tolist(),
                positions,
            )
            out_lm = self.peer.attention(q_opt, lk, lv, cache=slot.lm, scale=g.scale, mask=lm_mask)
            self._close(
                "attention.mlx_lm", f"layout {slot.ident} attention", out_opt, opt.to_numpy(out_lm)
            )
            for name, f_lm, f_opt in (("keys", lk, fk_opt), ("values", lv, fv_opt)):
                got, want = opt.to_numpy(f_opt), opt.to_numpy(f_lm)
                for b, (a, e) in enumerate(
                    zip(
                        self._visible_rows(got, pads, lens),
                        self._visible_rows(want, pads, lens),
                        strict=True,
                    )
                ):
                    self._close(
                        "kv.mlx_lm", f"layout {slot.ident} fetched {name} row {b} vs mlx-lm", a, e
                    )
            self.stats.check("mlx-lm step")
        # Solo replay: each row's serial caches take the same block; same attention output.
        for b, track in enumerate(slot.rows):
            kb, vb, qb = keys[b : b + 1], values[b : b + 1], queries[b : b + 1]
            kb_opt, vb_opt, qb_opt = (opt.to_native(x) for x in (kb, vb, qb))
            solo_masks = track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)
            track.ref.update_and_fetch(kb, vb)
            track.opt.update_and_fetch(kb_opt, vb_opt)
            solo_ref = ref.to_numpy(ref.attend(qb, track.ref, solo_masks[0], g.scale))
            solo_opt = opt.to_numpy(opt.attend(qb_opt, track.opt, solo_masks[1], g.scale))
            self._close(
                "attention.solo",
                f"reference row {b} vs its serial cache",
                out_ref[b : b + 1],
                solo_ref,
            )
            self._close(
                "attention.solo",
                f"optimized row {b} vs its serial cache",
                out_opt[b : b + 1],
                solo_opt,
            )
            if track.lm is not None:
                track.lm.update_and_fetch(kb_opt, vb_opt)
            self._record_append(track, kb, vb)
        self.stats.check("solo attention", rows)

    def _steppable(self) -> list[Slot]:
        return [s for s in self.slots if s.rows]

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """One token for every row (N = 1)."""
        slot = self._pick(data, self._steppable(), "layout")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = np.random.default_rng(data.draw(ks.seeds, label="seed"))
        note(f"decode_step: layout {slot.ident} {slot.ref!r}, mask {form}")
        self.stats.op("decode_step")
        self._step(slot, 1, rng, form)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def multi_step(self, data: st.DataObject) -> None:
        """N > 1 tokens for every row (chunked prefill / a verify block)."""
        slot = self._pick(data, self._steppable(), "layout")
        n = data.draw(ks.step_sizes(multi=True), label="N")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = np.random.default_rng(data.draw(ks.seeds, label="seed"))
        note(f"multi_step: layout {slot.ident} {slot.ref!r}, N={n}, mask {form}")
        self.stats.op("multi_step")
        self._step(slot, n, rng, form)

    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def filter_layout(self, data: st.DataObject) -> None:
        """Keep any subset in any order (drop the longest, reorder, keep none)."""
        slot = self._pick(data, self.slots, "layout")
        kind, keep = data.draw(ks.keep_lists(tuple(t.tokens for t in slot.rows)), label="keep")
        via_table = data.draw(st.booleans(), label="via table.filter_layout_rows")
        note(f"filter ({kind}): layout {slot.ident} {slot.ref!r} keep {keep}")
        self.stats.op(f"filter:{kind}")
        if via_table:
            table.filter_layout_rows(slot.ref, keep)
            table.filter_layout_rows(slot.opt, keep)
        else:
            slot.ref.filter_rows(keep)
            slot.opt.filter_rows(keep)
        if self._parity(slot) and slot.lm is not None:
            if not keep:
                self._skip("N1", "filter([]) on mlx-lm; the mirror restarts at the next merge")
                slot.lm = None
            elif slot.lm.keys is None and min(np.array(slot.lm.left_padding)[keep].tolist()) > 0:
                self._skip("B2", "filter of a key-less mlx-lm batch with left padding")
                slot.lm, slot.mirrored = None, False
            else:
                slot.lm.filter(keep)
                self.stats.check("mlx-lm filter")
        kept = [slot.rows[i] for i in keep]
        dropped = [t for t in slot.rows if all(t is not k for k in kept)]
        slot.rows = kept
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
        self.stats.op("extract")
        got_ref: Any
        got_opt: Any
        if sole:
            got_ref, got_opt = table.extract_sole_row(slot.ref), table.extract_sole_row(slot.opt)
        else:
            got_ref, got_opt = slot.ref.extract_row(b), slot.opt.extract_row(b)
        self._check_serial_like(f"extract_row({b})", got_ref, got_opt, track)
        lm = None
        if self._parity(slot) and self.peer is not None:
            if slot.lm is None or slot.lm.keys is None:
                self._skip("B3", "extract from an mlx-lm batch with no keys")
            else:
                lm = slot.lm.extract(b)
                self._exact("mlx-lm extract offset", int(lm.offset), track.tokens)
                held = self.peer.serial_kv(lm)
                self._same_planes(
                    "kv.mlx_lm", "mlx-lm extract", self._planes(self.opt_impl, held), track
                )
                self.stats.check("mlx-lm extract")
        if len(self.pool) < self.limits.pool and data.draw(st.booleans(), label="keep as request"):
            # A row holding no token extracts as an empty cache (no planes) that keeps the
            # layout's geometry (spec/contract.md §1; both answers were compared above).
            copy = Track(
                ident=next(self._ids),
                ref=got_ref,
                opt=got_opt,
                lm=lm,
                keys=track.keys.copy(),
                values=track.values.copy(),
                appended=track.tokens > 0,
                geometry_known=got_ref.geometry is not None,
                history=list(track.history) if track.tokens else [],
            )
            if copy.lm is None and self.peer is not None:
                copy.lm = self._replay(track).lm
            note(f"  extracted row becomes request {copy.ident}")
            self.pool.append(copy)

    def _check_serial_like(self, what: str, got_ref: Any, got_opt: Any, track: Track) -> None:
        """An extracted/published row: a serial cache of the family holding exactly the row."""
        ref, opt = self.ref_impl, self.opt_impl
        self._exact(f"{what}: reference type", type(got_ref), ref.cls(self.family.serial))
        self._exact(f"{what}: optimized type", type(got_opt), opt.cls(self.family.serial))
        self._exact(
            f"{what}: offsets", (got_ref.offset, got_opt.offset), (track.tokens, track.tokens)
        )
        self._exact(f"{what}: signatures", got_opt.signature(), got_ref.signature())
        self._exact(f"{what}: geometry", got_opt.geometry, got_ref.geometry)
        planes_ref, planes_opt = (
            self._planes(ref, got_ref.planes()),
            self._planes(opt, got_opt.planes()),
        )
        self._exact(
            f"{what}: holds planes (reference, optimized)", planes_opt is None, planes_ref is None
        )
        self._same_planes("kv.solo", f"{what} (reference) vs its solo replay", planes_ref, track)
        self._same_planes("kv.solo", f"{what} (optimized) vs its solo replay", planes_opt, track)
        solo_ref, solo_opt = (
            self._planes(ref, track.ref.planes()),
            self._planes(opt, track.opt.planes()),
        )
        if planes_ref is not None and solo_ref is not None:
            for a, e in zip(planes_ref, solo_ref, strict=True):
                self._close("kv.solo", f"{what} (reference) vs solo cache", a, e)
        if planes_opt is not None and solo_opt is not None:
            for a, e in zip(planes_opt, solo_opt, strict=True):
                self._close("kv.solo", f"{what} (optimized) vs solo cache", a, e)
        self.stats.check("solo replay")

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """``table.publish_row``: the row as a serial cache, or ``None`` past its tokens."""
        slot = self._pick(data, self._steppable(), "layout")
        b = data.draw(st.integers(0, len(slot.rows) - 1), label="row")
        track = slot.rows[b]
        tokens = data.draw(st.integers(0, track.tokens + 2), label="tokens")
        note(f"publish: layout {slot.ident} row {b} ({track.tokens} tokens) covering {tokens}")
        self.stats.op("publish")
        self._exact(
            "can_publish_row",
            slot.opt.can_publish_row(b, tokens),
            slot.ref.can_publish_row(b, tokens),
        )
        got_ref = table.publish_row(slot.ref, b, tokens)
        got_opt = table.publish_row(slot.opt, b, tokens)
        self._exact(
            "publish_row returns None (reference, optimized)", got_opt is None, got_ref is None
        )
        if got_ref is not None:
            self._check_serial_like(f"publish_row({b}, {tokens})", got_ref, got_opt, track)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        """Trim every row by ``n`` (at most what the shortest row holds)."""
        slot = self._pick(data, self._steppable(), "layout")
        shortest = min(t.tokens for t in slot.rows)
        n = data.draw(ks.counts_up_to(shortest), label="n")
        equal_counts = data.draw(st.booleans(), label="as trim_rows of equal counts")
        note(f"trim: layout {slot.ident} {slot.ref!r} trim({n}){' as trim_rows' * equal_counts}")
        self.stats.op("trim")
        if equal_counts:
            counts = [n] * len(slot.rows)
            self._exact("trim_rows() return (reference)", slot.ref.trim_rows(counts), n)
            self._exact("trim_rows() return (optimized)", slot.opt.trim_rows(counts), n)
        else:
            self._exact("trim() return (reference)", slot.ref.trim(n), n)
            self._exact("trim() return (optimized)", slot.opt.trim(n), n)
        if self._parity(slot) and slot.lm is not None:
            self._exact("trim() return (mlx-lm)", slot.lm.trim(n), n)
            self.stats.check("mlx-lm trim")
        for track in slot.rows:
            self._solo_trim(track, n)

    def _solo_trim(self, track: Track, n: int) -> None:
        self._exact("solo trim (reference)", track.ref.trim(n), n)
        self._exact("solo trim (optimized)", track.opt.trim(n), n)
        if track.lm is not None:
            track.lm.trim(n)
        self._record_trim(track, n)

    @precondition(lambda self: self.spec.trim_rows and any(s.rows for s in self.slots))
    @rule(data=st.data())
    def trim_rows(self, data: st.DataObject) -> None:
        """Per-row rollback on a ragged layout: row ``b`` forgets ``counts[b]`` tokens."""
        slot = self._pick(data, self._steppable(), "layout")
        counts = [
            data.draw(ks.counts_up_to(t.tokens), label=f"count {b}")
            for b, t in enumerate(slot.rows)
        ]
        note(f"trim_rows: layout {slot.ident} {slot.ref!r} counts {counts}")
        self.stats.op("trim_rows")
        expected = max(counts, default=0)
        self._exact("trim_rows() return (reference)", slot.ref.trim_rows(counts), expected)
        self._exact("trim_rows() return (optimized)", slot.opt.trim_rows(counts), expected)
        for track, count in zip(slot.rows, counts, strict=True):
            self._solo_trim(track, count)

    # ------------------------------------------------------------ invalid input
    def _bad_blocks(
        self, rows: int, geometry_known: bool
    ) -> list[tuple[str, Callable[[Impl], tuple[Any, Any]]]]:
        """Blocks an update must refuse: (label, impl -> (keys, values))."""
        g = self.g
        rng = np.random.default_rng(0)
        other_dtype = next(d for d in NUMPY_DTYPES if d != g.dtype)

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
        good_k, good_v = (b, g.heads, 1, g.key_dim), (b, g.heads, 1, g.value_dim)
        cases = [
            ("keys of rank 3", block(good_k[1:], good_v[1:], g.dtype, g.dtype)),
            (
                "N = 0",
                block((b, g.heads, 0, g.key_dim), (b, g.heads, 0, g.value_dim), g.dtype, g.dtype),
            ),
            ("int32 keys and values", block(good_k, good_v, "int32", "int32")),
            ("keys and values of different dtypes", block(good_k, good_v, g.dtype, other_dtype)),
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
        if geometry_known:
            cases += [
                ("a different dtype", block(good_k, good_v, other_dtype, other_dtype)),
                (
                    "one KV head more",
                    block(
                        (b, g.heads + 1, 1, g.key_dim),
                        (b, g.heads + 1, 1, g.value_dim),
                        g.dtype,
                        g.dtype,
                    ),
                ),
                (
                    "a different key dim",
                    block((b, g.heads, 1, g.key_dim + 8), good_v, g.dtype, g.dtype),
                ),
                (
                    "a different value dim",
                    block(good_k, (b, g.heads, 1, g.value_dim + 8), g.dtype, g.dtype),
                ),
            ]
        k_np, v_np = random_block(rng, good_k, g.dtype), random_block(rng, good_v, g.dtype)
        foreign: dict[str, Callable[[Impl], tuple[Any, Any]]] = {
            "the other implementation's arrays": lambda impl: (
                (k_np, v_np)
                if impl.name != "reference"
                else (mx.array(k_np.astype(np.float32)), mx.array(v_np.astype(np.float32)))
            ),
        }
        cases += list(foreign.items())
        return cases

    def _foreign_cache(self, impl: Impl, what: str) -> Any:
        """A serial cache (of ``impl``) whose geometry differs from the example's in ``what``."""
        g = self.g
        heads, key_dim, dtype = g.heads, g.key_dim, g.dtype
        if what == "dtype":
            dtype = next(d for d in NUMPY_DTYPES if d != g.dtype)
        elif what == "heads":
            heads = g.heads + 1
        else:
            key_dim = g.key_dim + 8
        rng = np.random.default_rng(1)
        cache = impl.new(self.family.serial)
        k = random_block(rng, (1, heads, 2, key_dim), dtype)
        v = random_block(rng, (1, heads, 2, g.value_dim), dtype)
        cache.update_and_fetch(impl.to_native(k), impl.to_native(v))
        return cache

    def _layout_cases(self, slot: Slot) -> list[tuple[str, Callable[[Impl, Any], object], str]]:
        """(label, call(impl, layout), parity skip code) for invalid operations on a layout."""
        rows = len(slot.rows)
        known = slot.ref.geometry is not None
        cases: list[tuple[str, Callable[[Impl, Any], object], str]] = []
        if rows == 0:
            g = self.g
            k = random_block(np.random.default_rng(2), (1, g.heads, 1, g.key_dim), g.dtype)
            v = random_block(np.random.default_rng(3), (1, g.heads, 1, g.value_dim), g.dtype)
            cases.append(
                (
                    "update of an empty layout",
                    lambda impl, lay: lay.update_and_fetch(impl.to_native(k), impl.to_native(v)),
                    "V0",
                )
            )
        else:
            for label, make in self._bad_blocks(rows, known):
                cases.append(
                    (
                        f"update with {label}",
                        _update_with(make),
                        "V0",
                    )
                )
            shortest = min(t.tokens for t in slot.rows)
            over = shortest + 1
            cases.append(
                (f"trim({over}) past the shortest row", lambda impl, lay: lay.trim(over), "B4")
            )
            if self.spec.shared_column and rows >= 2 and shortest >= 1:
                unequal = [0] * (rows - 1) + [1]
                cases.append(
                    (
                        f"trim_rows({unequal}) with unequal counts on a shared write column",
                        lambda impl, lay: lay.trim_rows(unequal),
                        "V0",
                    )
                )
            if self.spec.trim_rows:
                counts = [t.tokens for t in slot.rows]
                counts[-1] += 1
                cases.append(
                    (
                        f"trim_rows({counts}) past a row",
                        lambda impl, lay: lay.trim_rows(counts),
                        "V0",
                    )
                )
                cases.append(
                    (
                        "trim_rows with one count too many",
                        lambda impl, lay: lay.trim_rows([0] * (rows + 1)),
                        "V0",
                    )
                )
                cases.append(
                    (
                        "trim_rows with a negative count",
                        lambda impl, lay: lay.trim_rows([-1] * rows),
                        "V0",
                    )
                )
                cases.append(
                    ("trim_rows of a non-sequence", lambda impl, lay: lay.trim_rows(0), "V0")
                )
            cases.append(
                ("filter naming a row twice", lambda impl, lay: lay.filter_rows([0, 0]), "V0")
            )
        cases += [
            ("trim(-1)", lambda impl, lay: lay.trim(-1), "V0"),
            ("make_mask(0)", lambda impl, lay: lay.make_mask(0), "V0"),
            ("make_mask(True)", lambda impl, lay: lay.make_mask(True), "V0"),
            (
                "make_mask(1, window_size=0)",
                lambda impl, lay: lay.make_mask(1, window_size=0),
                "V0",
            ),
            ("projected_bytes(-1)", lambda impl, lay: lay.projected_bytes(-1), "V0"),
            (f"extract_row({rows}) out of range", lambda impl, lay: lay.extract_row(rows), "V0"),
            ("extract_row(-1)", lambda impl, lay: lay.extract_row(-1), "V0"),
            ("extract_row(1.0)", lambda impl, lay: lay.extract_row(1.0), "V0"),
            (f"can_publish_row({rows}, 0)", lambda impl, lay: lay.can_publish_row(rows, 0), "V0"),
            (
                f"table.publish_row(layout, {rows}, 0)",
                lambda impl, lay: table.publish_row(lay, rows, 0),
                "V0",
            ),
            (f"filter naming row {rows}", lambda impl, lay: lay.filter_rows([rows]), "V0"),
            ("filter with a non-sequence", lambda impl, lay: lay.filter_rows(0), "V0"),
            ("filter with a string", lambda impl, lay: lay.filter_rows("0"), "V0"),
            (
                "merge_rows of a bare cache (not a sequence)",
                lambda impl, lay: lay.merge_rows(impl.new(self.family.serial)),
                "V0",
            ),
            ("merge_rows of a foreign object", lambda impl, lay: lay.merge_rows([object()]), "V0"),
            (
                "merge_rows of the other implementation's cache",
                lambda impl, lay: lay.merge_rows(
                    [
                        (self.opt_impl if impl.name == "reference" else self.ref_impl).new(
                            self.family.serial
                        )
                    ]
                ),
                "V0",
            ),
            (
                "merge_rows of two caches of different dtypes",
                lambda impl, lay: lay.merge_rows(
                    [self._foreign_cache(impl, "dtype"), self._foreign_cache(impl, "heads")]
                ),
                "B5",
            ),
        ]
        if self.peer is not None:
            peer = self.peer
            cases.append(
                (
                    "merge_rows of an mlx-lm KVCache",
                    lambda impl, lay: lay.merge_rows([peer.serial()]),
                    "V0",
                )
            )
        if known:
            cases += [
                (
                    "merge_rows of a cache of another dtype",
                    lambda impl, lay: lay.merge_rows([self._foreign_cache(impl, "dtype")]),
                    "B5",
                ),
                (
                    "merge_rows of a cache with another head count",
                    lambda impl, lay: lay.merge_rows([self._foreign_cache(impl, "heads")]),
                    "N2",
                ),
                (
                    "merge_rows of a cache with another key dim",
                    lambda impl, lay: lay.merge_rows([self._foreign_cache(impl, "key_dim")]),
                    "V0",
                ),
            ]
        return cases

    def _serial_cases(self, track: Track) -> list[tuple[str, Callable[[Impl, Any], object], str]]:
        cases: list[tuple[str, Callable[[Impl, Any], object], str]] = []
        for label, make in self._bad_blocks(1 if track.appended else 0, track.geometry_known):
            cases.append(
                (
                    f"serial update with {label}",
                    _update_with(make),
                    "V0",
                )
            )
        cases += [
            ("serial trim(-1)", lambda impl, c: c.trim(-1), "V0"),
            ("serial make_mask(0)", lambda impl, c: c.make_mask(0), "V0"),
            (
                "table.filter_layout_rows of serial state",
                lambda impl, c: table.filter_layout_rows(c, [0]),
                "V0",
            ),
        ]
        if not track.geometry_known:
            cases.append(
                ("fetch of a cache that never held a token", lambda impl, c: c.fetch(), "V0")
            )
        return cases

    def _everything(self) -> tuple[list[Any], list[Any]]:
        ref_snaps, opt_snaps = [], []
        for t in self.pool:
            ref_snaps.append(snapshot(t.ref, self.ref_impl.to_numpy))
            opt_snaps.append(snapshot(t.opt, self.opt_impl.to_numpy))
        for s in self.slots:
            ref_snaps.append(snapshot(s.ref, self.ref_impl.to_numpy))
            opt_snaps.append(snapshot(s.opt, self.opt_impl.to_numpy))
            for t in s.rows:
                ref_snaps.append(snapshot(t.ref, self.ref_impl.to_numpy))
                opt_snaps.append(snapshot(t.opt, self.opt_impl.to_numpy))
        return ref_snaps, opt_snaps

    @precondition(lambda self: bool(self.pool) or bool(self.slots))
    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """A bad call: both implementations raise the same KvRowsError subclass; nothing changes."""
        targets: list[
            tuple[str, Any, Any, list[tuple[str, Callable[[Impl, Any], object], str]], Slot | None]
        ] = []
        for t in self.pool:
            targets.append((f"request {t.ident}", t.ref, t.opt, self._serial_cases(t), None))
        for s in self.slots:
            targets.append((f"layout {s.ident}", s.ref, s.opt, self._layout_cases(s), s))
        name, ref_obj, opt_obj, cases, slot = self._pick(data, targets, "target")
        label, call, code = self._pick(data, cases, "invalid operation")
        note(f"invalid: {name}: {label}")
        self.stats.op("invalid")
        before = self._everything()
        errors: list[type[BaseException]] = []
        for impl, obj in ((self.ref_impl, ref_obj), (self.opt_impl, opt_obj)):
            try:
                call(impl, obj)
            except KvRowsError as error:
                errors.append(type(error))
            except Exception as error:  # any other exception is a contract violation
                raise AssertionError(
                    f"{impl.name}: {label} raised {type(error).__name__} ({error}), "
                    "not a KvRowsError"
                ) from error
            else:
                raise AssertionError(f"{impl.name}: {label} did not raise")
        self._exact(f"{label}: error types (reference, optimized)", errors[1], errors[0])
        self._exact(
            f"{label}: every cache unchanged after the failed call", self._everything(), before
        )
        self.stats.check("error types")
        if slot is not None and self._parity(slot):
            self._skip(code, label)

    # ---------------------------------------------------------------- oracles
    @invariant()
    def check_oracles(self) -> None:
        if self.geo is None:
            return
        for track in self.pool:
            self._check_request(track)
        for slot in self.slots:
            self._check_slot(slot)

    def _check_request(self, track: Track) -> None:
        """A free request: reference, optimized and mlx-lm serial caches hold the model."""
        ref, opt = self.ref_impl, self.opt_impl
        what = f"request {track.ident}"
        self._exact(
            f"{what} offsets (reference, optimized)",
            (track.ref.offset, track.opt.offset),
            (track.tokens, track.tokens),
        )
        self._exact(f"{what} signature", track.opt.signature(), track.ref.signature())
        self._exact(f"{what} geometry", track.opt.geometry, track.ref.geometry)
        self._exact(f"{what} is_trimmable", track.opt.is_trimmable(), track.ref.is_trimmable())
        planes_ref, planes_opt = (
            self._planes(ref, track.ref.planes()),
            self._planes(opt, track.opt.planes()),
        )
        self._exact(
            f"{what} holds planes (reference, optimized)", planes_opt is None, planes_ref is None
        )
        self._same_planes("kv.stored", f"{what} (reference)", planes_ref, track)
        self._same_planes("kv.stored", f"{what} (optimized)", planes_opt, track)
        for n, form in ks.CHECKED_MASKS:
            kw = form.kwargs()
            masks = [track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)]
            if track.lm is not None:
                masks.append(track.lm.make_mask(n, **form.mlx_lm_kwargs()))
            self._masks_equal(f"{what} make_mask({n}, {form})", masks, 1, n, track.tokens + n)
        if track.lm is not None and self.peer is not None:
            self._exact(f"{what} mlx-lm offset", int(track.lm.offset), track.tokens)
            held = self.peer.serial_kv(track.lm)
            if held is not None:
                self._same_planes(
                    "kv.mlx_lm", f"{what} (mlx-lm KVCache)", self._planes(opt, held), track
                )
            self.stats.check("mlx-lm serial")
        self.stats.check("reference vs optimized")

    def _check_slot(self, slot: Slot) -> None:
        ref, opt = self.ref_impl, self.opt_impl
        r, o = slot.ref, slot.opt
        what = f"layout {slot.ident}"
        tokens = tuple(t.tokens for t in slot.rows)
        # (a) reference vs optimized, and both vs the model.
        self._exact(
            f"{what} batch_size", (r.batch_size, o.batch_size), (len(slot.rows), len(slot.rows))
        )
        self._exact(f"{what} row_offsets (reference)", r.row_offsets, tokens)
        self._exact(f"{what} row_offsets (optimized)", o.row_offsets, tokens)
        self._exact(f"{what} left_pad", o.left_pad, r.left_pad)
        self._exact(f"{what} width", o.width, r.width)
        self._exact(
            f"{what} offset (reference)",
            (ref.to_numpy(r.offset).tolist(), str(ref.to_numpy(r.offset).dtype)),
            (list(tokens), "int32"),
        )
        self._exact(
            f"{what} offset (optimized)",
            (opt.to_numpy(o.offset).tolist(), str(opt.to_numpy(o.offset).dtype)),
            (list(tokens), "int32"),
        )
        self._exact(f"{what} signature", o.signature(), r.signature())
        self._exact(f"{what} geometry", o.geometry, r.geometry)
        self._exact(f"{what} max_tokens", o.max_tokens, r.max_tokens)
        self._exact(f"{what} is_trimmable", o.is_trimmable(), r.is_trimmable())
        for t in (0, 1, 7):
            self._exact(
                f"{what} projected_bytes({t})", projected_or_error(o, t), projected_or_error(r, t)
            )
        r.check_valid()
        o.check_valid()
        width, pads = r.width, r.left_pad
        if self.spec.shared_column:
            self._exact(
                f"{what} rows share one write column",
                {p + t for p, t in zip(pads, tokens, strict=True)} | {width},
                {width},
            )
        rows = len(slot.rows)
        for n, form in ks.CHECKED_MASKS:
            kw = form.kwargs()
            masks = [r.make_mask(n, **kw), o.make_mask(n, **kw)]
            if self._parity(slot) and slot.lm is not None:
                masks.append(slot.lm.make_mask(n, **form.mlx_lm_kwargs()))
            self._masks_equal(f"{what} make_mask({n}, {form})", masks, rows, n, width + n)
        outcomes: list[Any] = []
        for lay in (r, o):
            try:
                outcomes.append(lay.fetch())
            except KvRowsError as error:
                outcomes.append(type(error))
        self._exact(
            f"{what} fetch() raises (optimized vs reference)",
            outcomes[1] if isinstance(outcomes[1], type) else "returns",
            outcomes[0] if isinstance(outcomes[0], type) else "returns",
        )
        if not isinstance(outcomes[0], type):
            for i, name in enumerate(("keys", "values")):
                got = opt.to_numpy(outcomes[1][i])
                want = ref.to_numpy(outcomes[0][i])
                self._exact(f"{what} fetched {name} shape", got.shape, want.shape)
                for b, (a, e) in enumerate(
                    zip(
                        self._visible_rows(got, pads, tokens),
                        self._visible_rows(want, pads, tokens),
                        strict=True,
                    )
                ):
                    self._close("kv.fetched", f"{what} fetch() {name} row {b}", a, e)
        for b, track in enumerate(slot.rows):
            planes_ref = self._planes(ref, r.row_planes(b))
            planes_opt = self._planes(opt, o.row_planes(b))
            self._same_planes("kv.stored", f"{what} row {b} (reference)", planes_ref, track)
            self._same_planes("kv.stored", f"{what} row {b} (optimized)", planes_opt, track)
            # (b) solo replay: the extracted row equals the serial caches that saw the same appends.
            self._check_serial_like(
                f"{what} extract_row({b})", r.extract_row(b), o.extract_row(b), track
            )
        self.stats.check("reference vs optimized")
        # (c) mlx-lm parity.
        if self._parity(slot) and slot.lm is not None and self.peer is not None:
            lm = slot.lm
            self._exact(f"{what} mlx-lm offsets", np.array(lm.offset).tolist(), list(tokens))
            self._exact(
                f"{what} mlx-lm left_padding", np.array(lm.left_padding).tolist(), list(pads)
            )
            self._exact(f"{what} mlx-lm _idx (shared write column)", int(lm._idx), width)
            held = self.peer.batch_kv(lm)
            if held is None:
                self._exact(
                    f"{what}: mlx-lm holds no keys, so no row holds a token", sum(tokens), 0
                )
            else:
                planes = self._planes(opt, held)
                assert planes is not None
                for b, track in enumerate(slot.rows):
                    if track.tokens == 0:
                        continue
                    row = tuple(p[b : b + 1, :, pads[b] : pads[b] + track.tokens] for p in planes)
                    self._same_planes(
                        "kv.mlx_lm", f"{what} row {b} (mlx-lm BatchKVCache)", row, track
                    )
            self.stats.check("mlx-lm layout")


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
) -> type[ConformanceMachine]:
    """A machine class for ``family``'s ``layout``, driving ``reference`` and ``optimized``.

    ``optimized`` may be a mutant (``optimized_impl().with_classes({"PaddedKVRows": Mutant})``);
    ``name`` must then differ from the unmutated machine's so Hypothesis keeps
    their example databases apart.
    """
    from kvrows.conformance.families import optimized_impl, reference_impl

    spec = family.layout(layout)
    ref = reference or reference_impl()
    opt = optimized or optimized_impl()
    peer = family.peer() if (parity and family.peer is not None) else None
    attrs = {
        "family": family,
        "spec": spec,
        "ref_impl": ref,
        "opt_impl": opt,
        "peer": peer,
        "stats": stats or Stats(family.name, layout),
        "limits": limits or Limits(),
        "enforce": enforce,
        "__module__": __name__,
        "__doc__": f"Conformance of the {family.name} family's {layout} ({spec.role} layout).",
    }
    class_name = name or f"{family.name.capitalize()}{layout}Machine"
    return type(class_name, (ConformanceMachine,), attrs)
