"""The speculative family's machine: verify rounds on every verify layout.

The verify layouts (``table.target_cache_layout``) are ``BatchedKVCache`` (plain),
``BatchedQuantizedKVCache`` (affine), ``SpeculativeRotatingKVCache`` (plain ring) and
``SpeculativeRotatingAffineLayout`` (affine ring). Each runs on its storage's machine
(:class:`SpeculativeMachine`, :class:`SpeculativeAffineMachine`,
:class:`SpeculativeRingMachine`: the base, affine and ring machines with the rules
below), so every base rule (requests, joins, filters, extracts, publishes, steps, trims,
bad input) runs between the rounds. This module adds:

* **rounds** (``spec_rounds``: the layout's own calls; ``row_rounds``: through
  ``kvrows.speculative.RowRound``), one to four in a row: ``d`` in 0..4 drafts; ``d = 0``
  appends the pending token without a round; else ``spec_round_begin()``, the ``d + 1``
  token verify block on every row (fetched planes, masks and visibility checked as every
  step is), then every row accepts all (``spec_round_commit()``), none (keep 1), the same
  count (an int keep) or its own count (a keep per row, as a list, tuple or vector);
* **solo replay**: each row's serial caches (both implementations) take only the row's
  accepted tokens, so the invariant's row views, extracted rows and publishes are
  compared with a cache that never saw a rejected draft, and the accepted queries'
  attention equals the serial cache's on the accepted prefix;
* **mlx-lm**, where it is right: each row's serial twin does what mlx-lm's speculative
  decoding does, the whole verify block, then ``trim_prompt_cache`` of the rejected
  drafts; the twin's mask, attention and kept tokens are compared. Once a ring's twin
  has reached its window mlx-lm cannot trim (``B10``: the rejected drafts stay); the twin
  is then rebuilt from the row's accepted tokens;
* **protocol misuse** inside a round (before and after its block: a second begin, a
  second block, commit or rollback before the block, invalid keep vectors, merges,
  filters, extracts, trims, saving state) and outside one (commit or rollback without a
  begin, a begin on a layout without rows): the same ``KvRowsError`` subclass and
  message in both implementations, nothing changes and an open round stays open;
* **a failed append inside a round** (on a copy of the layout): both implementations
  mark the copy invalid and refuse every later call with ``SPECULATIVE_INVALID``.

Ring windows run from 1 to 32, mostly small, so rounds cross the window boundary often
(``Stats.checks``: "round across the window", "rollback on a wrapped row").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvrows import table
from kvrows.conformance import strategies as ks
from kvrows.conformance.affine import AffineMachine
from kvrows.conformance.families import Impl
from kvrows.conformance.machines import (
    Case,
    ConformanceMachine,
    Slot,
    Track,
    expand,
    planes_of,
    view_planes,
)
from kvrows.conformance.rings import RingMachine
from kvrows.errors import (
    SPECULATIVE_INVALID,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    SpeculativeRoundError,
    SpeculativeStateInvalidError,
)
from kvrows.speculative import RowRound

__all__ = [
    "ACCEPTANCE",
    "MAX_DRAFTS",
    "SPECULATIVE_CHECKS",
    "SpeculativeAffineMachine",
    "SpeculativeMachine",
    "SpeculativeRingMachine",
    "speculative_windows",
]

Array = npt.NDArray[Any]
#: A call inside a round: (label, call(impl, layout, its RowRound or None), the error type).
RoundCase = tuple[str, Callable[[Impl, Any, RowRound | None], object], type[KvRowsError]]

#: Drafts per round: ``d`` in ``0..MAX_DRAFTS`` (a verify block of ``d + 1`` tokens).
MAX_DRAFTS = 4
#: Acceptance kinds of a round with drafts (and ``d0``: a round without drafts).
ACCEPTANCE = ("unequal", "equal", "all", "none")

#: The checks (``Stats.checks`` keys) every speculative machine runs.
SPECULATIVE_CHECKS = (
    "round solo replay",
    "round misuse",
    "invalidated round",
    "rejected tokens unpublished",
)


def speculative_windows() -> st.SearchStrategy[int]:
    """Ring windows for rounds: mostly 1-8 (a few rounds cross them), sometimes 12-32."""
    return st.one_of(st.integers(1, 4), st.integers(2, 8), st.sampled_from((12, 16, 32)))


def _lm_cache() -> Any:
    from mlx_lm.models import cache

    return cache


class SpeculativeMachine(ConformanceMachine):
    """The base rules plus verify rounds (see the module docstring); the plain layout's
    machine, and the mixin of the affine and ring ones."""

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def spec_rounds(self, data: st.DataObject) -> None:
        """One to four rounds through the layout's own ``spec_round_*`` calls."""
        self._rounds(data, through_row_round=False)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def row_rounds(self, data: st.DataObject) -> None:
        """One to four rounds through ``RowRound`` (``begin(d)``, ``resolve(accepted)``)."""
        self._rounds(data, through_row_round=True)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def failed_round(self, data: st.DataObject) -> None:
        """An append that fails inside a round marks the layout invalid (on a copy)."""
        slot = self._pick(data, self._steppable(), "layout")
        known = slot.ref.geometry is not None
        label, make = self._pick(data, self._bad_blocks(len(slot.rows), known), "bad block")
        note(f"failed_round: layout {slot.ident} {slot.opt!r}: a block with {label}")
        self._op("failed_round")
        before = self._everything()
        copies = []
        for impl, lay in ((self.ref_impl, slot.ref), (self.opt_impl, slot.opt)):
            copy = self._new(impl, self.spec.name)
            copy.merge_rows([lay])
            copy.spec_round_begin()
            copies.append(copy)
        errors = [
            self._refused(impl, f"a verify block with {label}", _append_block, c, make(impl))
            for impl, c in zip((self.ref_impl, self.opt_impl), copies, strict=True)
        ]
        self._same_error(f"a verify block with {label}", errors[0], errors[1])
        rows = len(slot.rows)
        g = self.g
        rng = np.random.default_rng(5)
        good = self._block(rng, rows, 1, g.key_dim)
        good_values = self._block(rng, rows, 1, g.value_dim)
        later: list[tuple[str, Callable[[Impl, Any], object]]] = [
            ("fetch()", lambda impl, c: c.fetch()),
            ("make_mask(1)", lambda impl, c: c.make_mask(1)),
            (
                "update_and_fetch",
                lambda impl, c: c.update_and_fetch(
                    impl.to_native(good), impl.to_native(good_values)
                ),
            ),
            ("spec_round_begin()", lambda impl, c: c.spec_round_begin()),
            ("spec_round_commit()", lambda impl, c: c.spec_round_commit()),
            ("spec_round_rollback(1)", lambda impl, c: c.spec_round_rollback(1)),
            ("merge_rows([])", lambda impl, c: c.merge_rows([])),
            ("filter_rows(all)", lambda impl, c: c.filter_rows(list(range(rows)))),
            ("extract_row(0)", lambda impl, c: c.extract_row(0)),
            ("trim(0)", lambda impl, c: c.trim(0)),
            ("trim_rows(zeros)", lambda impl, c: c.trim_rows([0] * rows)),
            ("can_publish_row(0, 0)", lambda impl, c: c.can_publish_row(0, 0)),
            ("state", lambda impl, c: c.state),
        ]
        for what, call in later:
            refused = [
                self._refused(impl, f"{what} after a failed verify block", call, impl, c)
                for impl, c in zip((self.ref_impl, self.opt_impl), copies, strict=True)
            ]
            for impl, error in zip((self.ref_impl, self.opt_impl), refused, strict=True):
                self._exact(
                    f"{what} of an invalidated layout ({impl.name})",
                    (type(error).__name__, str(error)),
                    (SpeculativeStateInvalidError.__name__, SPECULATIVE_INVALID),
                )
        self._exact("the source layout is unchanged", self._everything(), before)
        self.stats.check("invalidated round")

    # ------------------------------------------------------------------ rounds
    def _rounds(self, data: st.DataObject, *, through_row_round: bool) -> None:
        slot = self._pick(data, self._steppable(), "layout")
        count = data.draw(st.integers(1, 4), label="rounds")
        self._op("row_rounds" if through_row_round else "spec_rounds", slot)
        for _ in range(count):
            self._round(slot, data, through_row_round)

    def _round(
        self,
        slot: Slot,
        data: st.DataObject,
        through_row_round: bool,
        drafts: st.SearchStrategy[int] | None = None,
        acceptance: tuple[str, ...] = ACCEPTANCE,
    ) -> None:
        g = self.g
        rows = len(slot.rows)
        d = data.draw(self._drafts(slot) if drafts is None else drafts, label="drafts")
        n = d + 1
        kind = "d0" if d == 0 else data.draw(st.sampled_from(acceptance), label="acceptance")
        keep = {
            "d0": lambda: [1] * rows,
            "all": lambda: [n] * rows,
            "none": lambda: [1] * rows,
            "equal": lambda: [data.draw(st.integers(1, n), label="keep")] * rows,
            "unequal": lambda: [
                data.draw(st.integers(1, n), label=f"keep {b}") for b in range(rows)
            ],
        }[kind]()
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        keys = self._block(rng, rows, n, g.key_dim)
        values = self._block(rng, rows, n, g.value_dim)
        queries = self._queries(rng, rows, n)
        before = [t.tokens for t in slot.rows]
        note(
            f"round: layout {slot.ident} {slot.opt!r}, d={d}, {kind}, keep {keep}, "
            f"{'RowRound' if through_row_round else 'direct'}, mask {form}"
        )
        self.stats.op(f"round:{kind}")
        rounds: list[RowRound | None] = [None, None]
        if through_row_round:
            rounds = [RowRound([slot.ref]), RowRound([slot.opt])]
            for rr in rounds:
                assert rr is not None
                rr.begin(d)
            self.stats.check("RowRound")
        elif d:
            slot.ref.spec_round_begin()
            slot.opt.spec_round_begin()
        self._round_open(slot, d > 0)
        if d and data.draw(st.booleans(), label="misuse before the block"):
            self._misuse(slot, data, rounds, d, None)
        outputs = self._layout_step(slot, keys, values, queries, form)
        if d:
            self._round_open(slot, True)
            self._unpublished(slot)
            if data.draw(st.booleans(), label="misuse after the block"):
                self._misuse(slot, data, rounds, d, n)
        self._resolve(slot, data, rounds, d, kind, keep)
        self._round_open(slot, False)
        self._solo_round(slot, keys, values, queries, form, outputs, keep, before)
        if g.max_size is not None:
            for b, start in enumerate(before):
                if keep[b] < n and start + n > g.max_size:
                    self.stats.check("rollback on a wrapped row")
                    if start < g.max_size:  # the block took the row past its window
                        self.stats.check("round across the window")

    def _drafts(self, slot: Slot) -> st.SearchStrategy[int]:
        return st.integers(0, MAX_DRAFTS)

    def _resolve(
        self,
        slot: Slot,
        data: st.DataObject,
        rounds: list[RowRound | None],
        d: int,
        kind: str,
        keep: list[int],
    ) -> None:
        """Commit or roll back in both implementations; a valid resolution must succeed."""
        same = len(set(keep)) == 1
        form = "int" if same and data.draw(st.booleans(), label="keep as an int") else ""
        if not form:
            form = data.draw(st.sampled_from(("list", "tuple", "vector")), label="keep form")
        for impl, lay, rr in zip(
            (self.ref_impl, self.opt_impl), (slot.ref, slot.opt), rounds, strict=True
        ):
            try:
                if rr is not None:
                    rr.resolve([k - 1 for k in keep])
                elif d == 0:
                    pass
                elif kind == "all":
                    lay.spec_round_commit()
                else:
                    lay.spec_round_rollback(_keep_argument(impl, keep, form))
            except KvRowsError as error:
                raise AssertionError(
                    f"{impl.name}: resolving a round of {d} drafts with keep {keep} ({form}) "
                    f"raised {type(error).__name__}: {error}"
                ) from error

    def _round_open(self, slot: Slot, expected: bool) -> None:
        self._exact(
            f"layout {slot.ident} spec_round_open (reference, optimized)",
            (slot.ref.spec_round_open, slot.opt.spec_round_open),
            (expected, expected),
        )

    def _unpublished(self, slot: Slot) -> None:
        """While a round is open no row can be published (its newest tokens are drafts)."""
        for b, track in enumerate(slot.rows):
            for tokens in {track.tokens, max(track.tokens - 1, 0)}:
                self._exact(
                    f"layout {slot.ident} can_publish_row({b}, {tokens}) in a round",
                    (slot.ref.can_publish_row(b, tokens), slot.opt.can_publish_row(b, tokens)),
                    (False, False),
                )
                self._exact(
                    f"layout {slot.ident} table.publish_row({b}, {tokens}) in a round",
                    (
                        table.publish_row(slot.ref, b, tokens),
                        table.publish_row(slot.opt, b, tokens),
                    ),
                    (None, None),
                )
        self.stats.check("rejected tokens unpublished")

    # ------------------------------------------------------------- solo replay
    def _solo_round(
        self,
        slot: Slot,
        keys: Array,
        values: Array,
        queries: Array,
        form: ks.MaskForm,
        outputs: tuple[Array, Array],
        keep: list[int],
        before: list[int],
    ) -> None:
        """Each row's serial caches take only its accepted tokens; the accepted queries'
        attention in the layout equals theirs; the mlx-lm twin runs mlx-lm's round."""
        out_ref, out_opt = outputs
        n = int(keys.shape[2])
        for b, track in enumerate(slot.rows):
            k = keep[b]
            kb = np.ascontiguousarray(keys[b : b + 1, :, :k])
            vb = np.ascontiguousarray(values[b : b + 1, :, :k])
            qb = np.ascontiguousarray(queries[b : b + 1, :, :k])
            rebuild = not self._twin_round(
                track,
                keys[b : b + 1],
                values[b : b + 1],
                queries[b : b + 1],
                out_opt[b : b + 1],
                k,
                form,
            )
            what = f"row {b} ({before[b]} tokens, keep {k} of {n}: the accepted tokens)"
            expected = (
                np.ascontiguousarray(out_ref[b : b + 1, :, :k]),
                np.ascontiguousarray(out_opt[b : b + 1, :, :k]),
            )
            self._solo_row(track, kb, vb, qb, form, expected, what)
            if rebuild:
                track.lm = self._rebuilt_twin(track)
            elif track.lm is not None:
                self._twin_holds_the_model(track, what)
        self.stats.check("solo attention", len(slot.rows))
        self.stats.check("round solo replay", len(slot.rows))
        self.stats.check("solo replay")

    def _twin_round(
        self,
        track: Track,
        keys: Array,
        values: Array,
        queries: Array,
        out_row: Array,
        keep: int,
        form: ks.MaskForm,
    ) -> bool:
        """mlx-lm's round on the row's serial twin: the whole verify block (mask and, for a
        plain codec, attention against the layout row), then ``trim_prompt_cache`` of the
        rejected drafts. ``False`` when mlx-lm cannot trim them (``B10``)."""
        twin, g = track.lm, self.g
        if twin is None or self.peer is None:
            return True
        n = int(keys.shape[2])
        before = track.tokens
        what = f"request {track.ident}'s mlx-lm twin: verify block of {n} onto {before}"
        mask_lm = twin.make_mask(n, **form.mlx_lm_kwargs())
        lk, lv = twin.update_and_fetch(self._lm_copy(keys), self._lm_copy(values))
        k_lm = planes_of(self.opt_impl, lk)
        slides_over_sinks = bool(g.keep) and (
            form.window_size is not None or (g.max_size is not None and before + n > g.max_size)
        )
        if slides_over_sinks:
            self._skip("K1", f"{what}: mlx-lm's mask slides over the sink tokens")
        else:
            model_keys = tuple(
                np.concatenate([p, e], axis=2)
                for p, e in zip(track.keys, self._encoded(keys), strict=True)
            )
            exp_lm = expand(mask_lm, 1, n, int(k_lm[0].shape[2]))
            self._visibility(what, k_lm, exp_lm, [(0, model_keys, before)], n, form.window_size)
            if not g.affine:
                # The layout row against a serial cache of the same tokens (affine: mlx-lm's
                # quantized attention rounds in the activation dtype; the serial steps
                # compare it under the affine mlx-lm tolerance).
                out_lm = self.peer.attention(
                    self._lm_copy(queries), lk, lv, cache=twin, scale=g.scale, mask=mask_lm
                )
                self._close(
                    "attention.solo",
                    f"{what}: the layout row's attention vs mlx-lm's",
                    out_row,
                    self.opt_impl.to_numpy(out_lm),
                )
        self.stats.check("mlx-lm speculative twin")
        rejected = n - keep
        if not rejected:
            return True
        lm = _lm_cache()
        if lm.can_trim_prompt_cache([twin]):
            self._exact(
                f"{what}: trim_prompt_cache", lm.trim_prompt_cache([twin], rejected), rejected
            )
            return True
        # mlx-lm's speculative decoding leaves the rejected drafts in a full ring.
        self._exact(
            f"{what}: mlx-lm refuses to trim only a ring that reached its window",
            (g.max_size is not None, int(twin.offset) >= (g.max_size or 0)),
            (True, True),
        )
        self._exact(f"{what}: trim_prompt_cache refuses", lm.trim_prompt_cache([twin], rejected), 0)
        self._skip("B10", f"{what}: {rejected} rejected drafts stay in mlx-lm's full ring")
        return False

    def _twin_holds_the_model(self, track: Track, what: str) -> None:
        """The twin holds the row's accepted tokens (a ring: while it has not wrapped, when
        its buffer is in temporal order; later, the request's own checks compare it)."""
        if self.peer is None or track.lm is None or self.g.wrapped(track.tokens):
            return
        held = self.peer.serial_kv(track.lm)
        got = None if held is None else view_planes(self.opt_impl, held)
        self._same_planes(
            "kv.mlx_lm", f"{what}: mlx-lm's twin after the round", got, self._model_view(track)
        )

    def _rebuilt_twin(self, track: Track) -> Any:
        """A twin for a row whose mlx-lm twin kept rejected drafts (``B10``): a fresh
        mlx-lm cache fed the row's history (its accepted appends and its trims)."""
        assert self.peer is not None
        twin = self.peer.serial(self.g)
        for kind, keys, values in track.history:
            if kind == "append":
                twin.update_and_fetch(self._lm_copy(keys), self._lm_copy(values))
            else:
                twin.trim(keys)
        return twin

    # ------------------------------------------------------------------ misuse
    def _misuse(
        self,
        slot: Slot,
        data: st.DataObject,
        rounds: list[RowRound | None],
        drafts: int,
        block: int | None,
    ) -> None:
        """A call a round refuses: same error in both, nothing changes, the round stays open.
        ``block``: the verify block's tokens once it was appended."""
        cases = self._round_cases(slot, rounds, drafts, block)
        label, call, expected = self._pick(data, cases, "misuse")
        note(f"  misuse in the round: {label}")
        self.stats.op("round misuse")
        before = self._everything()
        errors = [
            self._refused(impl, label, call, impl, lay, rr)
            for impl, lay, rr in zip(
                (self.ref_impl, self.opt_impl), (slot.ref, slot.opt), rounds, strict=True
            )
        ]
        self._same_error(label, errors[0], errors[1], expected)
        self._exact(f"{label}: every cache unchanged", self._everything(), before)
        self._round_open(slot, True)
        self.stats.check("round misuse")
        self.stats.check("error types")

    def _refused(
        self, impl: Impl, label: str, call: Callable[..., object], *args: Any
    ) -> KvRowsError:
        """The ``KvRowsError`` ``call(*args)`` raises (anything else is a failure)."""
        try:
            call(*args)
        except KvRowsError as error:
            return error
        except Exception as error:
            raise AssertionError(
                f"{impl.name}: {label} raised {type(error).__name__} ({error}), not a KvRowsError"
            ) from error
        raise AssertionError(f"{impl.name}: {label} did not raise")

    def _round_cases(
        self, slot: Slot, rounds: list[RowRound | None], drafts: int, block: int | None
    ) -> list[RoundCase]:
        rows, g = len(slot.rows), self.g
        serial, name = self.serial_name, self.spec.name
        bad_round, bad_input = SpeculativeRoundError, InvalidInputError
        cases: list[RoundCase] = [
            ("a second spec_round_begin", lambda impl, lay, rr: lay.spec_round_begin(), bad_round),
            (
                "merge_rows in a round",
                lambda impl, lay, rr: lay.merge_rows([self._new(impl, serial)]),
                bad_round,
            ),
            (
                "filter_rows in a round",
                lambda impl, lay, rr: lay.filter_rows(list(range(rows))),
                bad_round,
            ),
            ("extract_row(0) in a round", lambda impl, lay, rr: lay.extract_row(0), bad_round),
            ("trim(0) in a round", lambda impl, lay, rr: lay.trim(0), bad_round),
            (
                "trim_rows in a round",
                lambda impl, lay, rr: lay.trim_rows([0] * rows),
                bad_round,
            ),
            ("state in a round", lambda impl, lay, rr: lay.state, bad_round),
            (
                "merging the layout's rows into another in a round",
                lambda impl, lay, rr: self._new(impl, name).merge_rows([lay]),
                bad_round,
            ),
        ]
        if block is None:
            cases += [
                (
                    "spec_round_commit before the verify block",
                    lambda impl, lay, rr: lay.spec_round_commit(),
                    bad_round,
                ),
                (
                    "spec_round_rollback(1) before the verify block",
                    lambda impl, lay, rr: lay.spec_round_rollback(1),
                    bad_round,
                ),
            ]
        else:
            rng = np.random.default_rng(4)
            k = self._block(rng, rows, 1, g.key_dim)
            v = self._block(rng, rows, 1, g.value_dim)
            ones = [1] * rows
            above = [*ones[:-1], block + 1]
            bad_keeps: list[tuple[str, object]] = [
                (f"{rows + 1} counts", [1] * (rows + 1)),
                ("no count", []),
                ("0", 0),
                ("zeros", [0] * rows),
                (f"{block + 1} (above the block)", block + 1),
                (f"{above} (above the block)", above),
                ("-1", -1),
                ("1.5", 1.5),
                ("floats", [1.0] * rows),
                ("True", True),
                ("'1'", "1"),
                ("None", None),
                ("nested lists", [[1]] * rows),
            ]
            cases += [
                (
                    "a second verify block",
                    lambda impl, lay, rr: lay.update_and_fetch(
                        impl.to_native(k), impl.to_native(v)
                    ),
                    bad_round,
                ),
            ]
            cases += [
                (f"spec_round_rollback with keep {text}", _rollback_with(bad), bad_input)
                for text, bad in bad_keeps
            ]
        if rounds[0] is not None:
            cases += [
                (
                    "RowRound.begin twice",
                    lambda impl, lay, rr: _row_round(rr).begin(drafts),
                    bad_round,
                ),
                (
                    f"RowRound.resolve with {rows + 1} counts",
                    lambda impl, lay, rr: _row_round(rr).resolve([0] * (rows + 1)),
                    bad_input,
                ),
                (
                    f"RowRound.resolve with {drafts + 1} accepted of {drafts}",
                    lambda impl, lay, rr: _row_round(rr).resolve([drafts + 1] * rows),
                    bad_input,
                ),
            ]
        return cases

    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        """Round calls outside a round (and a round without rows), via the base ``invalid``."""
        bad_round = SpeculativeRoundError
        cases: list[Case] = [
            (
                "spec_round_commit without spec_round_begin",
                lambda impl, lay: lay.spec_round_commit(),
                "V0",
                bad_round,
            ),
            (
                "spec_round_rollback(1) without spec_round_begin",
                lambda impl, lay: lay.spec_round_rollback(1),
                "V0",
                bad_round,
            ),
            (
                "spec_round_rollback(0) without spec_round_begin",
                lambda impl, lay: lay.spec_round_rollback(0),
                "V0",
                bad_round,
            ),
        ]
        if not slot.rows:
            cases.append(
                (
                    "spec_round_begin on a layout without rows",
                    lambda impl, lay: lay.spec_round_begin(),
                    "V0",
                    LayoutStateError,
                )
            )
        return cases + super()._extra_layout_cases(slot)


def _rollback_with(keep: object) -> Callable[[Impl, Any, RowRound | None], object]:
    return lambda impl, lay, rr: lay.spec_round_rollback(keep)


def _append_block(cache: Any, block: tuple[Any, Any]) -> object:
    return cache.update_and_fetch(*block)


def _row_round(rr: RowRound | None) -> RowRound:
    assert rr is not None
    return rr


def _keep_argument(impl: Impl, keep: list[int], form: str) -> Any:
    """``keep`` as the caller passes it: an int, a list, a tuple or an integer vector of
    the implementation's arrays."""
    if form == "int":
        return keep[0]
    if form == "tuple":
        return tuple(keep)
    if form == "vector":
        return impl.to_native(np.array(keep, dtype=np.int32))
    return list(keep)


class SpeculativeAffineMachine(SpeculativeMachine, AffineMachine):
    """Rounds at one affine codec per example."""


class SpeculativeRingMachine(SpeculativeMachine, RingMachine):
    """Rounds on ragged rings of windows 1-32 (the ring family's geometry, sinks included)."""

    @classmethod
    def window_sizes(cls) -> st.SearchStrategy[int]:
        return speculative_windows()

    def _crossing(self, slot: Slot) -> list[int]:
        """Drafts that take a row from below its window past it (``d = W - tokens``)."""
        window = self.window
        return sorted({window - t.tokens for t in slot.rows if 0 < window - t.tokens <= MAX_DRAFTS})

    def _drafts(self, slot: Slot) -> st.SearchStrategy[int]:
        crossing = self._crossing(slot)
        drafts = super()._drafts(slot)
        return st.one_of(drafts, st.sampled_from(crossing)) if crossing else drafts

    @precondition(lambda self: self.geo is not None and any(self._crossing(s) for s in self.slots))
    @rule(data=st.data())
    def round_across_the_window(self, data: st.DataObject) -> None:
        """A round whose block takes a row past its window, then rolls back."""
        slot = self._pick(data, [s for s in self.slots if self._crossing(s)], "layout")
        through = data.draw(st.booleans(), label="through RowRound")
        self._op("round_across_the_window", slot)
        drafts = st.sampled_from(self._crossing(slot))
        self._round(slot, data, through, drafts, ("unequal", "equal", "none"))

    def _rebuilt_twin(self, track: Track) -> Any:
        """``B10``: the twin is re-synced from the row's serial ring (the optimized one's
        buffer, offset and ring index): mlx-lm's ring holding the accepted tokens where
        kvrows holds them, which the request's physical comparisons need (an extracted
        row is compact, a replayed one would not be)."""
        assert self.peer is not None
        twin = self.peer.serial(self.g)
        if track.tokens:
            keys, values = track.opt.fetch()
            twin.keys, twin.values = mx.contiguous(keys), mx.contiguous(values)
        twin.offset, twin._idx = track.tokens, int(track.opt.ring_index)
        return twin

    def teardown(self) -> None:
        if self.geo is not None and self.stats.steps > self._steps_at_start:
            self.stats.variant("window 1" if self.window == 1 else "window > 1")
        super().teardown()
