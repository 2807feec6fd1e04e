"""The rules the hook rows compose into machines (``hooks.compose``), one mixin per axis
value over ``machines.ConformanceMachine`` (no machine is written per family):

* codec rules: :class:`AffineRules` (``CODEC_HOOKS[Affine]``), :class:`TurboRules`
  (``CODEC_HOOKS[Turbo]``);
* geometry and placement rules: :class:`RingRules` (``GEOMETRY_HOOKS["ring"]``), and what verify rounds
  add on a ring, :class:`RingRoundRules` (its ``round_rules``); :class:`PagedRules`
  (``PLACEMENT_HOOKS["paged"]``: block pools, their invariants, byte limits);
* modifier rules: :class:`RoundRules`, the speculative verify rounds
  (``MODIFIER_RULES["speculative"]``), composed onto every storage whose verify layouts
  run rounds: the speculative family's layouts (plain, affine, both rings), the turbo and
  paged families' layouts (every role).

What a codec or geometry draws (parameter sets, head dims, windows, sinks) is data in its
hook row (``hooks.Draw``); its tolerances are the tolerance table's rows.

**Verify rounds** (``spec_rounds``: the layout's own calls; ``row_rounds``: through
``kvrows.speculative.RowRound``), one to four in a row: ``d`` in 0..4 drafts; ``d = 0``
appends the pending token without a round; else ``spec_round_begin()``, the ``d + 1``
token verify block on every row (fetched planes, masks and visibility checked as every
step is), then every row accepts all (``spec_round_commit()``), none (keep 1), the same
count (an int keep) or its own count (a keep per row, as a list, tuple or vector). Every
base rule (requests, joins, filters, extracts, publishes, steps, trims, bad input) runs
between the rounds. Besides:

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

Ring windows of verify layouts run from 1 to 32, mostly small, so rounds cross the
window boundary often (``Stats.checks``: "round across the window", "rollback on a
wrapped row").
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvrows import table
from kvrows.affine_geometry import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from kvrows.codec import TURBO_HEAD_DIMS, Role
from kvrows.compositions import composition
from kvrows.conformance import strategies as ks
from kvrows.conformance.arrays import random_block
from kvrows.conformance.families import Impl
from kvrows.conformance.hooks import lm_cache
from kvrows.conformance.machines import (
    FULL_RING_ROLLBACK,
    RING_TRIM_REFUSED,
    Case,
    ConformanceMachine,
    KvRules,
    OpsRules,
    OpsTarget,
    Planes,
    Slot,
    Track,
    _answer,
    _cat,
    column_ids,
    detached,
    evaluate,
    expand,
    planes_of,
    raised,
    view_planes,
)
from kvrows.conformance.paged import (
    HEADROOMS,
    FrozenCollector,
    accounting,
    byte_limited,
    collector_paused,
    hit_accounting_problem,
)
from kvrows.errors import (
    SPECULATIVE_INVALID,
    IncompatibleRowsError,
    InvalidInputError,
    KvRowsError,
    LayoutStateError,
    PoolExhaustedError,
    SpeculativeRoundError,
    SpeculativeStateInvalidError,
)
from kvrows.paged import FREE, projected_blocks
from kvrows.reference import turbo_codec
from kvrows.schemes import TURBO_KEY_BITS, TURBO_VALUE_BITS, Turbo
from kvrows.speculative import RowRound

__all__ = [
    "ACCEPTANCE",
    "ATTENDED_QUERIES",
    "BLOCK_TABLE_GAPS",
    "FULL_RING_ROLLBACK",
    "MAX_DRAFTS",
    "RING_TRIM_REFUSED",
    "SPECULATIVE_CHECKS",
    "TURBO_CHECKS",
    "WHOLE_BLOCK_HIT",
    "AffineRules",
    "PagedRules",
    "RingRoundRules",
    "RingRules",
    "RoundRules",
    "TurboRules",
    "table_has_gaps",
]

Array = npt.NDArray[Any]
#: A call inside a round: (label, call(impl, layout, its RowRound or None), the error type).
RoundCase = tuple[str, Callable[[Impl, Any, RowRound | None], object], type[KvRowsError]]

#: A serial prompt chunk's attention is compared on its last this many queries (affine).
ATTENDED_QUERIES = 8
#: The checks (``Stats.checks`` keys) the turbo rules add; the cases they exist for.
TURBO_CHECKS = (
    "deferred vs eager",
    "eager over padding columns",
    "8-bit keys",
    "packed keys",
    "key and value dims differ",
)
#: Drafts per round: ``d`` in ``0..MAX_DRAFTS`` (a verify block of ``d + 1`` tokens).
MAX_DRAFTS = 4
#: Acceptance kinds of a round with drafts (and ``d0``: a round without drafts).
ACCEPTANCE = ("unequal", "equal", "all", "none")
#: What ``pool_pressure`` runs: a merge (takes blocks), operations that take none.
PRESSURED = ("merge", "extract", "publish", "filter", "trim_rows")
#: The checks (``Stats.checks`` keys) every machine with verify rounds runs.
SPECULATIVE_CHECKS = (
    "round solo replay",
    "round misuse",
    "invalidated round",
    "rejected tokens unpublished",
)


def _lm_ring(max_size: int, keep: int = 0) -> Any:
    return lm_cache().RotatingKVCache(max_size, keep)


# --------------------------------------------------------------------------- codecs
class CodecCases(ConformanceMachine):
    """What the codecs' invalid merges build: filled caches and layouts holding a row."""

    def _filled(self, impl: Impl, name: str, **changes: int) -> Any:
        """A new ``name`` of ``impl`` (this example's codec unless ``changes``) after one
        append of two tokens of the example's shapes."""
        return self._fill(impl, self._new(impl, name, **changes), self.g.key_dim)

    def _holding(self, impl: Impl, name: str, cache: Any, **changes: int) -> Any:
        """A new ``name`` layout of ``impl`` holding ``cache`` as its row."""
        layout = self._new(impl, name, **changes)
        layout.merge_rows([cache])
        return layout


class AffineRules(CodecCases):
    """The affine codec's rules (one ``(bits, group_size)`` per example, the draw of
    ``hooks.CODEC_HOOKS[Affine]``): the base machine already encodes with the reference
    codec and compares the stored triples against mlx-lm's ``QuantizedKVCache`` (named
    skips ``A1``, ``A2``). These rules add that serial prompt chunks compare attention on
    their last :data:`ATTENDED_QUERIES` queries (CPU float16 ``quantized_matmul`` is slow;
    masks are still compared whole), and the codec's invalid merges: rows of another bit
    width or group size, plain caches and layouts, each refused with
    ``IncompatibleRowsError`` by both implementations."""

    attended_queries: ClassVar[int | None] = ATTENDED_QUERIES

    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        g = self.g
        other_bits = next(b for b in SUPPORTED_BITS if b != g.bits)
        other_group = next(s for s in SUPPORTED_GROUP_SIZES if s != g.group_size)
        serial, bad = self.serial_name, IncompatibleRowsError

        def other(impl: Impl, what: str) -> Any:
            if what == "bits":
                return self._filled(impl, serial, bits=other_bits)
            cache = self._new(impl, serial, group_size=other_group)
            fits = g.key_dim % other_group == 0 and g.value_dim % other_group == 0
            return self._fill(impl, cache, g.key_dim) if fits else cache

        def plain(impl: Impl) -> Any:
            return self._filled(impl, "KVCache")

        return [
            (
                "merge_rows of a cache of another bit width",
                lambda impl, lay: lay.merge_rows([other(impl, "bits")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a cache of another group size",
                lambda impl, lay: lay.merge_rows([other(impl, "group")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a valid cache and one of another bit width",
                lambda impl, lay: lay.merge_rows([self._filled(impl, serial), other(impl, "bits")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain KVCache holding tokens",
                lambda impl, lay: lay.merge_rows([plain(impl)]),
                "V0",
                bad,
            ),
            (
                "merge_rows of an empty plain KVCache",
                lambda impl, lay: lay.merge_rows([self._new(impl, "KVCache")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain PaddedKVRows holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, "PaddedKVRows", plain(impl))]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain BatchedKVCache holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, "BatchedKVCache", plain(impl))]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a layout of another bit width holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, self.spec.name, other(impl, "bits"), bits=other_bits)]
                ),
                "V0",
                bad,
            ),
            *super()._extra_layout_cases(slot),
        ]


class TurboRules(CodecCases):
    """The TurboQuant codec's rules (one ``(k_bits, v_bits)`` per example, the draw of
    ``hooks.CODEC_HOOKS[Turbo]``; its family composes the verify rounds):

    * **the model, by role**: keys stored as ``(kIdx, kScales, kZeros)``, values as
      ``(vPacked, vScales)``, by the reference codec (``kvrows.reference.turbo_codec``):
      every stored plane of both implementations must equal it byte for byte;
    * **the fetched form**: keys decoded and values still rotated, both bfloat16 (tokens
      are identified by the bytes of their decoded keys);
    * **deferred vs eager V** (:meth:`_check_deferred`): every attention output of both
      implementations against ``eager_attention`` over the model's planes laid out in the
      read's columns, under the ``attention.eager`` tolerance;
    * the codec's invalid operations: rows of other widths, plain and affine caches and
      layouts (``IncompatibleRowsError``); head dims the codec does not store
      (``InvalidInputError``, before anything changes).

    No mlx-lm peer: mlx-lm has no TurboQuant cache."""

    def teardown(self) -> None:
        if self.geo is not None and self.stats.steps > self._steps_at_start:
            g = self.g
            self.stats.check("8-bit keys" if g.k_bits == 8 else "packed keys")
            for dim in {g.key_dim, g.value_dim}:
                self.stats.check(f"head dim {dim}")
            if g.key_dim != g.value_dim:
                self.stats.check("key and value dims differ")
        super().teardown()

    # ------------------------------------------------------------------ the model
    def _encode(self, block: Array, role: Role = "keys") -> Planes:
        if role == "keys":
            return tuple(turbo_codec.encode_keys(block, self.g.k_bits))
        return tuple(turbo_codec.encode_values(block, self.g.v_bits))

    # --------------------------------------------------------- deferred vs eager V
    def _models(
        self, rows: Sequence[tuple[int, Track, Array, Array]]
    ) -> list[tuple[int, tuple[Planes, Planes], dict[bytes, int]]]:
        """Each row's model key and value planes after the append, and its ``{token id:
        position}`` (the same for both implementations' reads)."""
        models = []
        for b, track, keys, values in rows:
            model = (
                tuple(
                    np.concatenate([p, e], axis=2)
                    for p, e in zip(track.keys, self._encoded(keys), strict=True)
                ),
                tuple(
                    np.concatenate([p, e], axis=2)
                    for p, e in zip(track.values, self._encoded(values, "values"), strict=True)
                ),
            )
            ids = column_ids(self._fetched_form(model[0]), 0)
            models.append((b, model, {token: p for p, token in enumerate(ids)}))
        return models

    def _image(
        self,
        fetched_keys: Planes,
        models: Sequence[tuple[int, tuple[Planes, Planes], dict[bytes, int]]],
    ) -> tuple[Planes, Planes]:
        """The model's key and value planes laid out in the read's columns: each column
        that holds a token of its row (identified by its decoded key) gets the token's
        planes, every other column zero planes (the mask hides them)."""
        batch, columns = int(fetched_keys[0].shape[0]), int(fetched_keys[0].shape[2])
        image: list[list[Array]] = [[], []]
        for b, model, position in models:
            if not image[0]:
                for side, planes in enumerate(model):
                    image[side] = [
                        np.zeros((batch, p.shape[1], columns, p.shape[3]), p.dtype) for p in planes
                    ]
            for c, token in enumerate(column_ids(fetched_keys, b)):
                p = position.get(token)
                if p is None:
                    self.stats.check("eager over padding columns")
                    continue
                for side, planes in enumerate(model):
                    for target, plane in zip(image[side], planes, strict=True):
                        target[b, :, c] = plane[0, :, p]
        return tuple(image[0]), tuple(image[1])

    def _check_deferred(
        self,
        what: str,
        queries: Array,
        outputs: tuple[Array, Array],
        fetched_keys: tuple[Planes, Planes],
        mask: npt.NDArray[np.bool_],
        rows: Sequence[tuple[int, Track, Array, Array]],
    ) -> None:
        """Each implementation's (deferred) attention equals its ``eager_attention``: keys
        and values decoded from the model's planes in the read's columns, then attention
        under the same mask (values un-rotated before attention, not after)."""
        import kvrows.optimized.codecs as opt_codecs
        import kvrows.reference.codecs as ref_codecs

        spec = Turbo(k_bits=self.g.k_bits, v_bits=self.g.v_bits)
        oracles: tuple[tuple[Impl, Any, Any], ...] = (
            (self.ref_impl, ref_codecs.TurboCodec(spec), ref_codecs.eager_attention),
            (self.opt_impl, opt_codecs.TurboCodec(spec), opt_codecs.eager_attention),
        )
        models = self._models(rows)
        for (impl, codec, eager), out, keys in zip(oracles, outputs, fetched_keys, strict=True):
            image_keys, image_values = self._image(keys, models)
            if impl is self.ref_impl:
                self._same_decoding(what, oracles[0][1], oracles[1][1], image_keys, image_values)
            expected = eager(
                codec,
                impl.to_native(queries),
                tuple(impl.to_native(p) for p in image_keys),
                tuple(impl.to_native(p) for p in image_values),
                impl.to_native(mask),
                self.g.scale,
            )
            self._close(
                "attention.eager",
                f"{what} ({impl.name}): deferred-V attention vs eager",
                out,
                impl.to_numpy(expected),
            )
        self.stats.check("deferred vs eager", len(rows))

    def _same_decoding(
        self, what: str, ref_codec: Any, opt_codec: Any, keys: Planes, values: Planes
    ) -> None:
        """The two codecs decode the same planes to the same float32 bits: keys, and values
        still rotated (what attention reads; a read hands out the planes, so this is where
        a wrong table or unpacking in one implementation shows exactly)."""
        from kvrows.optimized import turbo_codec as opt_turbo

        opt = self.opt_impl
        native = [tuple(opt.to_native(p) for p in side) for side in (keys, values)]
        pairs = (
            ("keys", ref_codec.decode(keys, "keys"), opt_codec.decode(native[0], "keys")),
            (
                "values (rotated)",
                turbo_codec.rotated_values(values[0], values[1], self.g.v_bits),
                opt_turbo.rotated_values(native[1][0], native[1][1], self.g.v_bits),
            ),
        )
        for name, want, got in pairs:
            self._close("kv.fetched", f"{what}: decoded {name}", opt.to_numpy(got), want)
        self.stats.check("decoded reads")

    # ------------------------------------------------------------- invalid input
    def _other_widths(self) -> tuple[dict[str, int], dict[str, int]]:
        g = self.g
        other_k = next(k for k in TURBO_KEY_BITS if k != g.k_bits)
        other_v = next(v for v in TURBO_VALUE_BITS if v != g.v_bits)
        return {"k_bits": other_k}, {"v_bits": other_v}

    def _foreign(self, impl: Impl, what: str) -> Any:
        """The base machine's foreign caches, with the codec's own notion of another key
        dim (another stored head dim) and of another codec (an affine cache)."""
        g = self.g
        if what == "key_dim":
            other = next(d for d in TURBO_HEAD_DIMS if d != g.key_dim)
            return self._fill(impl, self._new(impl, self.serial_name), other)
        if what == "other codec":
            return self._fill(impl, self._new(impl, "QuantizedKVCache"), g.key_dim)
        return super()._foreign(impl, what)

    def _extra_serial_cases(self, track: Track) -> list[Case]:
        g = self.g
        rng = np.random.default_rng(6)
        rows = 1
        odd = random_block(rng, (rows, g.heads, 1, 96), g.dtype)
        keys = random_block(rng, (rows, g.heads, 1, g.key_dim), g.dtype)
        values = random_block(rng, (rows, g.heads, 1, g.value_dim), g.dtype)
        cases: list[Case] = [
            (
                "serial update with a key dim of 96 (not a TurboQuant head dim)",
                lambda impl, c: c.update_and_fetch(impl.to_native(odd), impl.to_native(values)),
                "V0",
                None if track.geometry_known else InvalidInputError,
            ),
            (
                "serial update with a value dim of 96 (not a TurboQuant head dim)",
                lambda impl, c: c.update_and_fetch(impl.to_native(keys), impl.to_native(odd)),
                "V0",
                None if track.geometry_known else InvalidInputError,
            ),
        ]
        return cases + super()._extra_serial_cases(track)

    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        serial, layout, bad = self.serial_name, self.spec.name, IncompatibleRowsError
        other_k, other_v = self._other_widths()
        cases: list[Case] = [
            (
                f"merge_rows of a cache of k_bits {other_k['k_bits']}",
                lambda impl, lay: lay.merge_rows([self._filled(impl, serial, **other_k)]),
                "V0",
                bad,
            ),
            (
                f"merge_rows of a cache of v_bits {other_v['v_bits']}",
                lambda impl, lay: lay.merge_rows([self._filled(impl, serial, **other_v)]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a valid cache and one of other widths",
                lambda impl, lay: lay.merge_rows(
                    [self._filled(impl, serial), self._filled(impl, serial, **other_v)]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain KVCache holding tokens",
                lambda impl, lay: lay.merge_rows([self._filled(impl, "KVCache")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of an affine QuantizedKVCache holding tokens",
                lambda impl, lay: lay.merge_rows([self._filled(impl, "QuantizedKVCache")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain BatchedKVCache holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, "BatchedKVCache", self._filled(impl, "KVCache"))]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a layout of other widths holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, layout, self._filled(impl, serial, **other_k), **other_k)]
                ),
                "V0",
                bad,
            ),
        ]
        return cases + super()._extra_layout_cases(slot)


# ------------------------------------------------------------------------ geometries
class RingRules(ConformanceMachine):
    """The ring geometry's rules, for both codecs (the example's window, sinks and codec
    drawn by ``hooks.GEOMETRY_HOOKS["ring"]``: windows by role, quantized rings at head
    dims up to 64). The base machine already speaks windows through the example's
    geometry (``max_size``: what a store keeps, when it has wrapped, what a trim or a
    publish may do, the semantic mask check of every append). These rules add:

    * prompts, chunks and blocks around the window;
    * the views ``window()`` / ``row_window()`` (the newest ``min(offset, max_size)``
      tokens in temporal order);
    * a ring filter keeps the survivors' padding; ragged rings have none;
    * mlx-lm's rings (plain codec): serial ``RotatingKVCache`` twins (ring index) and the
      ``BatchRotatingKVCache`` mirror (ring state), with the named skips ``B7`` (no
      mirror of a layout with sinks), ``B9`` (a block on a wrapped ring: mlx-lm's mask
      may only hide), ``R1`` (a join re-syncs the mirror by ``merge`` of mlx-lm's own
      ``extract`` of its running rows plus the newcomers' twins) and ``R2`` (mlx-lm's
      extracted ring keeps the oversized buffer: its newest window is compared and kept
      as the request's twin);
    * the invalid merges of rings of another window, full-attention caches and other
      codec parameters."""

    serial_view = "window"
    row_view = "row_window"

    def teardown(self) -> None:
        if self.geo is not None and self.stats.steps > self._steps_at_start:
            self.stats.variant("sink tokens" if self.g.keep else "no sink tokens")
        super().teardown()

    @property
    def window(self) -> int:
        assert self.g.max_size is not None
        return self.g.max_size

    def _prompt_length(self, data: st.DataObject) -> int:
        m = self.window
        return data.draw(
            st.one_of(st.integers(0, m - 1), st.integers(m, 2 * m + 3)), label="prompt length"
        )

    def _chunk(self, data: st.DataObject) -> int:
        return data.draw(st.one_of(st.just(1), st.integers(2, self.window + 2)), label="chunk")

    def _block_size(self, data: st.DataObject) -> int:
        return data.draw(st.one_of(st.integers(2, 4), st.integers(2, self.window + 2)), label="N")

    # ------------------------------------------------- full rows rolled back
    def _hard_trims(self, slot: Slot) -> list[str]:
        """Besides the base's: ``fill`` (``machines._fill_kinds``)."""
        return [*super()._hard_trims(slot), *self._fill_kinds(slot)]

    # The hooks of ``machines._build_fill`` (``FULL_RING_ROLLBACK``, ``RING_TRIM_REFUSED``).
    def _fill_window(self, slot: Slot) -> int:
        return self.window

    # ------------------------------------------------- a block on a wrapped ring
    def _hard_steps(self, slot: Slot) -> list[str]:
        """Besides the base's: ``wrapped`` (``machines._wrapped_kinds``)."""
        return [*super()._hard_steps(slot), *self._wrapped_kinds(slot)]

    def _wrapped_short(self, slot: Slot) -> bool:
        """A shared ring rotated with a row's left padding still positive (what B9 and the
        block mask's ``ring = max_size`` are about); a ragged ring: a row wrapped and
        another shorter than the window."""
        if self.spec.shared_column:
            return bool(slot.opt.ring_state[2]) and any(p > 0 for p in slot.ref.left_pad)
        lengths = self._row_lengths(slot)
        return any(self.g.wrapped(t) for t in lengths) and not all(
            self.g.wrapped(t) for t in lengths
        )

    def _fill_joins(self, slot: Slot) -> list[Track]:
        if len(slot.rows) >= self.limits.rows:
            return []
        return [t for t in self.pool if t.tokens < self.window]

    def _fill_block(self, slot: Slot, n: int, data: st.DataObject) -> Any:
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        g, rows = self.g, len(slot.rows)
        keys = self._block(rng, rows, n, g.key_dim)
        values = self._block(rng, rows, n, g.value_dim)
        queries = self._queries(rng, rows, n)
        outputs = self._layout_step(slot, keys, values, queries, form)
        return keys, values, queries, form, outputs

    def _fill_replay(self, slot: Slot, pending: Any, counts: list[int]) -> None:
        keys, values, queries, form, (out_ref, out_opt) = pending
        n = int(keys.shape[2])
        if slot.lm is not None and any(counts):
            slot.mirrored = False  # mlx-lm's batch ring has no per-row trim
        for b, track in enumerate(slot.rows):
            kept = n - counts[b]
            if track.lm is not None and counts[b]:
                track.lm = None  # the serial twin cannot forget a block it saw whole
            if kept:
                part = slice(b, b + 1), slice(None), slice(None, kept)
                self._solo_row(
                    track,
                    np.ascontiguousarray(keys[part]),
                    np.ascontiguousarray(values[part]),
                    np.ascontiguousarray(queries[part]),
                    form,
                    (np.ascontiguousarray(out_ref[part]), np.ascontiguousarray(out_opt[part])),
                    f"row {b} ({track.tokens} tokens, keeps {kept} of a block of {n})",
                )
                if track.lm is not None:  # its whole block (a trimmed row dropped its twin)
                    track.lm.update_and_fetch(
                        self._lm_copy(keys[part]), self._lm_copy(values[part])
                    )
        self.stats.check("solo attention", len(slot.rows))

    def _check_layout_shape(self, slot: Slot) -> None:
        if not self.spec.shared_column:
            self._exact(
                f"layout {slot.ident} left_pad of ragged rings",
                slot.ref.left_pad,
                (0,) * len(slot.rows),
            )

    def _after_filter(self, slot: Slot, pads: tuple[int, ...], keep: list[int]) -> None:
        self._exact(
            "a ring filter keeps every survivor's padding",
            slot.ref.left_pad,
            tuple(pads[i] for i in keep),
        )

    # ------------------------------------------------------------------ mlx-lm
    def _parity(self, slot: Slot) -> bool:
        """mlx-lm's batch ring has no sinks (``B7``): no mirror of a layout with ``keep``."""
        if self.g.keep and self.peer is not None and self.spec.peer:
            self._skip("B7", "BatchRotatingKVCache has no keep: no mirror of this layout")
            return False
        return super()._parity(slot)

    def _peer_divergence(self, slot: Slot, n: int) -> str | None:
        return "B9" if n > 1 and slot.opt.ring_state[2] else None

    def _peer_layout_state(self, slot: Slot, lm: Any) -> None:
        what = f"layout {slot.ident} mlx-lm"
        self._exact(
            f"{what} (_idx, _offset, rotated)",
            (int(lm._idx), int(lm._offset), bool(lm.rotated)),
            slot.opt.ring_state,
        )
        self._exact(f"{what} is_trimmable", lm.is_trimmable(), slot.opt.is_trimmable())

    def _peer_serial_state(self, track: Track) -> None:
        lm = track.lm
        self._exact(
            f"request {track.ident} mlx-lm ring index", int(lm._idx), int(track.opt.ring_index)
        )
        self._exact(
            f"request {track.ident} mlx-lm is_trimmable",
            lm.is_trimmable(),
            not self.g.wrapped(track.tokens),
        )

    def _peer_join(self, slot: Slot, twins: Sequence[Any]) -> None:
        """A join re-syncs the mirror (skip ``R1``): mlx-lm's ``extend`` keeps its running
        geometry where kvrows re-merges every row."""
        assert self.peer is not None
        running: list[Any] = []
        if slot.rows:
            self._skip("R1", "join: mlx-lm extend keeps its geometry; re-merge the mirror")
            if slot.lm is None or slot.lm.keys is None:
                running = [_lm_ring(self.window, self.g.keep) for _ in slot.rows]
            else:
                running = [slot.lm.extract(b) for b in range(len(slot.rows))]
        slot.lm = self.peer.batch.merge([*running, *twins])

    def _peer_filter(self, slot: Slot, keep: list[int]) -> None:
        slot.lm.filter(keep)
        self.stats.check("mlx-lm filter")

    def _peer_extract(self, lm: Any, b: int, track: Track) -> Any:
        """mlx-lm's ``extract(b)``: offset and newest window vs the model; the compact twin."""
        ring = lm.extract(b)
        self._exact("mlx-lm extract offset", int(ring.offset), track.tokens)
        keep = self.g.kept(track.tokens)
        held = int(ring.keys.shape[2])
        self._exact(f"mlx-lm extract holds at least the window ({keep})", held >= keep, True)
        if held > keep:
            self._skip("R2", f"mlx-lm's extracted ring keeps {held} columns, kvrows' {keep}")
        newest = ((ring.keys[..., held - keep :, :],), (ring.values[..., held - keep :, :],))
        self._same_planes(
            "kv.mlx_lm",
            "mlx-lm extract (newest window)",
            view_planes(self.opt_impl, newest),
            self._model_view(track),
        )
        self.stats.check("mlx-lm extract")
        return self._compact(newest[0][0], newest[1][0], track.tokens)

    def _compact(self, keys: Any, values: Any, offset: int) -> Any:
        """An mlx-lm ring holding ``keys``/``values`` (the newest window, in temporal order),
        its index at the end: the layout kvrows' extracted ring has."""
        twin = _lm_ring(self.window, self.g.keep)
        if int(keys.shape[2]):
            twin.keys, twin.values = mx.contiguous(keys), mx.contiguous(values)
        twin.offset, twin._idx = offset, int(keys.shape[2])
        return twin

    def _twin_for(self, track: Track) -> Any:
        """A replayed twin re-laid as kvrows' extracted ring is (newest window, in order)."""
        ring = self._replay(track).lm
        keep = self.g.kept(track.tokens)
        if keep == 0 or ring.keys is None:
            return _lm_ring(self.window, self.g.keep)
        sinks = min(self.g.keep, track.tokens)

        def window(planes: Any) -> Any:
            """mlx-lm's temporal order (its sinks stay first), cut to kvrows' window."""
            idx = ring._idx
            if idx < ring.offset and idx < planes.shape[2]:
                planes = mx.concatenate(
                    [planes[..., :sinks, :], planes[..., idx:, :], planes[..., sinks:idx, :]],
                    axis=2,
                )
            else:
                planes = planes[..., :idx, :]
            tail = planes[..., planes.shape[2] - keep + sinks :, :]
            return mx.concatenate([planes[..., :sinks, :], tail], axis=2) if sinks else tail

        return self._compact(window(ring.keys), window(ring.values), track.tokens)

    # ------------------------------------------------------------- bad input
    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        g = self.g
        cases: list[Case] = [
            (
                "merge_rows of a ring of another window",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "window")]),
                "V0",
                None,
            ),
            (
                "merge_rows of a full-attention cache",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "full attention")]),
                "V0",
                None,
            ),
            (
                "merge_rows of a good ring and one of another window",
                lambda impl, lay: lay.merge_rows(
                    [self._new(impl, self.serial_name), self._foreign(impl, "window")]
                ),
                "V0",
                None,
            ),
            (
                "merge_rows of an empty layout of another window",
                lambda impl, lay: lay.merge_rows(
                    [self._new(impl, self.spec.name, max_size=self.window + 1)]
                ),
                "V0",
                None,
            ),
        ]
        if g.affine:
            cases += [
                (
                    "merge_rows of a ring with other bits",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "other bits")]),
                    "V0",
                    None,
                ),
                (
                    "merge_rows of a ring with another group size",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "other group")]),
                    "V0",
                    None,
                ),
            ]
        return cases + super()._extra_layout_cases(slot)


#: Hard states of the paged placement (``Stats.states`` keys, spec/contract.md §0.11): a
#: row holding two or more whole blocks whose table is not one run of blocks (scattered
#: in the pool, or ``FREE`` entries where a paged ring gave blocks back), its read
#: compared; a ``lookup_prefix`` hitting whole blocks (referenced, not copied).
BLOCK_TABLE_GAPS = "a row of two or more whole blocks with gaps in its block table"
WHOLE_BLOCK_HIT = "a whole-block prefix hit"


def table_has_gaps(table: Sequence[int], tokens: int, block_size: int) -> bool:
    """A table of a row of ``tokens`` positions that holds two or more whole blocks not in
    one run (a ``FREE`` entry, or a held block not right after the one before)."""
    held = [b for b in table if b != FREE]
    if tokens < 2 * block_size or len(held) < 2:
        return False
    return len(held) < len(table) or any(b != a + 1 for a, b in itertools.pairwise(held))


class PagedRules(FrozenCollector, OpsRules, KvRules):
    """The paged placement's rules (``PLACEMENT_HOOKS["paged"]``, composed with the verify
    rounds and the codec's rules: ``PagedKVCache`` rows in ``PagedKvRows``, all three
    roles; affine pools at the example's codec, codes compared exactly).

    Every K/V rule (it drives them under pool pressure) and every verify round runs on
    paged storages; the base machine's
    model is the contiguous KV (``KVCache``'s bytes), so every read, row view, extracted
    row and saved state is compared bit-exact with the same tokens stored contiguously,
    with the other implementation and with a solo replay. After every rule the pools the
    caches point into must satisfy ``spec/paged-pool.md`` §4 (conservation, free <=>
    count 0, counts = live tables holding the block, no empty tail block). Some examples
    put every new request of an implementation in one shared pool.

    **Byte-limited pools.** An example draws a headroom (0, 1 or 2 blocks, or none):
    every append under test (prefill chunks, layout steps, verify blocks inside rounds)
    runs with the pools of its caches limited to the blocks they hold plus the headroom
    (a pool that has not learnt its geometry yet: a byte limit of that many blocks), so
    pools run out at random points. ``pool_pressure`` does the same for a merge of
    requests (rows of another pool are copied), and runs extracts, publishes, filters and
    row trims, which take no block, under a limit they must never meet. Both
    implementations must refuse at the same points (``PoolExhaustedError``, the same
    message); a refusal must leave the caches and every pool's accounting exactly as it
    was. The append then goes in without the limit: a refused verify block leaves its
    round open before its block, and the round resolves as any other."""

    def _load_pools(self, item: OpsTarget) -> tuple[Any, Any] | None:
        """A state also loads into the pools of the caches it was saved from (besides the
        private pools: ``OpsChecks._pool_loads``)."""
        pools = (getattr(item.ref, "pool", None), getattr(item.opt, "pool", None))
        return None if pools[0] is None or pools[1] is None else (pools[0], pools[1])

    @staticmethod
    def _cached(cache: Any, row: int | None, blocks: int) -> bool:
        """Whether one of the first ``blocks`` blocks of row ``row`` of ``cache`` (``None``:
        a serial cache's) is cached (holds a hash)."""
        table = cache.block_table if row is None else cache.block_tables()[row]
        return any(cache.pool.ledger.hash_of(block) is not None for block in table[:blocks])

    def _pools(self, impl_index: int) -> list[Any]:
        """The pools of every request and layout of one implementation, in a fixed order."""
        pairs = [(t.ref, t.opt) for t in self.pool]
        for slot in self.slots:
            pairs += [(slot.ref, slot.opt), *((t.ref, t.opt) for t in slot.rows)]
        pools: dict[int, Any] = {}
        for pair in pairs:
            pool = getattr(pair[impl_index], "pool", None)
            if pool is not None:
                pools[id(pool)] = pool
        return list(pools.values())

    @invariant()
    def pools_are_sound(self) -> None:
        with collector_paused(collect=False):
            for index in (0, 1):
                for pool in self._pools(index):
                    pool.check_valid()
                    self.stats.check("pool invariants")

    def _check_slot(self, slot: Slot) -> None:
        super()._check_slot(slot)
        tables = slot.ref.block_tables()
        bs = slot.ref.block_size
        self._held_blocks(f"layout {slot.ident}", tables, slot.opt.block_tables(), slot.rows, bs)
        if any(table_has_gaps(tb, t.tokens, bs) for tb, t in zip(tables, slot.rows, strict=True)):
            self.stats.state(BLOCK_TABLE_GAPS)

    def _check_request(self, track: Track) -> None:
        super()._check_request(track)
        bs = track.ref.block_size
        self._held_blocks(
            f"request {track.ident}", [track.ref.block_table], [track.opt.block_table], [track], bs
        )
        if table_has_gaps(track.ref.block_table, track.tokens, bs):
            self.stats.state(BLOCK_TABLE_GAPS)

    def _held_blocks(
        self, what: str, ref: Sequence[Sequence[int]], opt: Sequence[Sequence[int]],
        tracks: Sequence[Track], block_size: int,
    ) -> None:  # fmt: skip
        """Which logical blocks each row's table holds (the others ``FREE``): the same in
        both twins, and for a chunked row the blocks of the positions the model says it
        holds (its newest ``held``; ``kvrows.paged`` §4.5 restated)."""
        held = [tuple(b != FREE for b in table) for table in ref]
        self._exact(f"{what}: held blocks (optimized vs reference)", [
            tuple(b != FREE for b in table) for table in opt
        ], held)  # fmt: skip
        if self.g.chunk_size is None:
            return
        for b, (track, row) in enumerate(zip(tracks, held, strict=True)):
            first = track.tokens - track.held
            live = range(first // block_size, -(-track.tokens // block_size)) if track.held else ()
            want = tuple(j in live for j in range(-(-track.tokens // block_size)))
            self._exact(f"{what} row {b}: held blocks (the model)", row, want)

    # -- byte-limited pools ------------------------------------------------------------
    #: This example's headroom: every append under test (prefill chunks, layout steps,
    #: verify blocks) runs with its pools limited to this many blocks more than they hold
    #: (``None``: no limit).
    headroom: int | None = None

    #: Whether this example's new requests share one pool per implementation (else each
    #: makes its own on its first write, and merges copy the rows of other pools).
    shared: bool = False

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        super().setup(data)
        self.headroom = data.draw(st.sampled_from(HEADROOMS), label="headroom")
        self.shared = data.draw(st.booleans(), label="one pool")
        self._shared_pools: dict[str, Any] = {}
        note(f"appends run with a headroom of {self.headroom} blocks, one pool: {self.shared}")
        self._freeze_collector(self.headroom is not None)

    def _new(self, impl: Impl, name: str, **changes: int) -> Any:
        g = self.g
        own = (self.serial_name, self.spec.name, *self.spec.siblings)
        if not g.affine or name not in own:  # plain pools, or a foreign cache
            return self._in_shared_pool(impl, name, changes, super()._new(impl, name, **changes))
        values = {**g.parameters(), **changes}  # the geometry's (a paged ring's window)
        params = {p: values[p] for p in composition(name).params if p in values}
        codec = type(g.spec).from_parameters(values)  # the example's codec kind, changed
        cache = impl.cls(name)(codec=codec, **params)
        return self._in_shared_pool(impl, name, changes, cache)

    def _in_shared_pool(self, impl: Impl, name: str, changes: object, cache: Any) -> Any:
        """``cache``, or in an example of one pool a new request of its kind in that pool."""
        if not self.shared or changes or name != self.serial_name:
            return cache
        pool = self._shared_pools.get(impl.name)
        if pool is None:
            pool = cache.pool_class(cache.codec_spec, block_size=cache.block_size)
            self._shared_pools[impl.name] = pool
        return type(cache)(pool=pool, token_geometry=cache.token_geometry)

    def _ledgers(self, more: Sequence[Sequence[Any]] = ((), ())) -> list[list[tuple[Any, ...]]]:
        """Every pool's accounting (and the pools ``more`` names), per implementation."""
        return [
            [accounting(pool) for pool in {id(p): p for p in [*self._pools(i), *more[i]]}.values()]
            for i in (0, 1)
        ]

    @contextmanager
    def _limited(self, pools: Sequence[Any], headroom: int) -> Iterator[None]:
        with byte_limited(pools, headroom, lambda pool: pool.block_size * self.g.token_bytes()):
            yield

    def _under_pressure(
        self, what: str, pairs: Sequence[tuple[Any, Any]], headroom: int,
        call: Callable[[Impl, Any], Any],
    ) -> list[Any] | None:  # fmt: skip
        """``call(impl, cache)`` on the reference and the optimized cache of ``pairs[0]``,
        the pools of every pair's caches limited to ``headroom`` more blocks: both succeed
        (their results), or both refuse alike with every pair's caches and every pool's
        accounting unchanged (``None``)."""
        pools = [
            [p for p in (getattr(pair[index], "pool", None) for pair in pairs) if p is not None]
            for index in (0, 1)
        ]
        limited = list({id(p): p for side in pools for p in side}.values())
        with collector_paused():
            before = self._snapshots(pairs), self._ledgers(pools)
            outcomes: list[Any] = []
            with self._limited(limited, headroom):
                for index, impl in enumerate((self.ref_impl, self.opt_impl)):
                    try:
                        outcomes.append(call(impl, pairs[0][index]))
                    except PoolExhaustedError as error:
                        outcomes.append(detached(error))
            refused = [isinstance(o, PoolExhaustedError) for o in outcomes]
            after = (self._snapshots(pairs), self._ledgers(pools)) if any(refused) else before
        self._exact(f"{what}, headroom {headroom}: refused (optimized)", refused[1], refused[0])
        self.stats.check("pool pressure")
        if not refused[0]:
            return outcomes
        self._same_error(f"{what} past the byte limit", outcomes[0], outcomes[1])
        self._exact(f"{what}: caches unchanged after the refusal", after[0], before[0])
        self._exact(f"{what}: every pool's accounting unchanged", after[1], before[1])
        note(f"  refused past the byte limit: {outcomes[0]}")
        self.stats.check("exhaustion refused")
        return None

    def _append(
        self, what: str, ref_cache: Any, opt_cache: Any, keys: Any, values: Any
    ) -> list[tuple[Any, Any]]:
        """The append under the example's byte limit; once refused (checked), the limit is
        lifted and the same append goes in: a refused verify block leaves its round open
        before its block, so the round then resolves as any other."""
        if self.headroom is None:
            return super()._append(what, ref_cache, opt_cache, keys, values)

        def append(impl: Impl, cache: Any) -> Any:
            return cache.update_and_fetch(
                self._give(impl, keys, what), self._give(impl, values, what)
            )

        pair = (ref_cache, opt_cache)
        outcomes = self._under_pressure(what, [pair], self.headroom, append)
        if outcomes is None:
            self.stats.op("exhausted:append")
            if getattr(ref_cache, "spec_round_open", False):
                self._exact(
                    f"{what}: round open after the refusal", opt_cache.spec_round_open, True
                )
                self.stats.check("round usable after a refused block")
            return super()._append(what, ref_cache, opt_cache, keys, values)
        fetched = []
        for impl, (fk, fv) in zip((self.ref_impl, self.opt_impl), outcomes, strict=True):
            evaluate([*planes_of(impl, fk), *planes_of(impl, fv)])
            fetched.append((planes_of(impl, fk), planes_of(impl, fv)))
        self._fetch_dtypes(what, *fetched[0], *fetched[1])
        return fetched

    def _pressured(self) -> list[str]:
        """The operations ``pool_pressure`` can run now."""
        steppable = bool(self._steppable())
        can = {
            "merge": bool(self.pool) and any(len(s.rows) < self.limits.rows for s in self.slots),
            "extract": steppable, "publish": steppable, "filter": bool(self.slots),
            "trim_rows": steppable and self.spec.trim_rows,
        }  # fmt: skip
        return [op for op in PRESSURED if can[op]]

    @precondition(lambda self: self.geo is not None and bool(self._pressured()))
    @rule(data=st.data())
    def pool_pressure(self, data: st.DataObject) -> None:
        """A merge of requests (another pool's rows are copied) whose pools reach their
        byte limit, or an operation that takes no block under a limit it must not meet."""
        op = data.draw(st.sampled_from(self._pressured()), label="operation under pressure")
        headroom = data.draw(st.sampled_from(HEADROOMS[:-1]), label="headroom")
        note(f"pool_pressure: {op}, headroom {headroom} blocks")
        if op == "merge":
            self._pressured_merge(data, headroom)
            return
        self.stats.op(f"pressure:{op}")
        every = [p for index in (0, 1) for p in self._pools(index)]
        self._pressed = True
        try:
            with self._limited(every, headroom):
                rule_of = {
                    "extract": self.extract,
                    "publish": self.publish,
                    "filter": self.filter_layout,
                    "trim_rows": self.trim_rows,
                }
                rule_of[op](data)
        finally:
            self._pressed = False

    def _pressured_merge(self, data: st.DataObject, headroom: int) -> None:
        """Free requests join a layout (rows of another pool are copied into its pool)."""
        targets = [s for s in self.slots if len(s.rows) < self.limits.rows]
        slot = self._pick(data, targets, "layout")
        count = data.draw(
            st.integers(1, min(self.limits.rows - len(slot.rows), len(self.pool))), label="rows"
        )
        order = data.draw(st.permutations(range(len(self.pool))), label="requests")
        picked = [self.pool[i] for i in order[:count]]
        note(f"  merge: layout {slot.ident} <- requests {[t.ident for t in picked]}")
        self._op("pressure:merge", slot)
        pairs = [(t.ref, t.opt) for t in picked]

        def merge(impl: Impl, layout: Any) -> None:
            layout.merge_rows([pair[0 if impl is self.ref_impl else 1] for pair in pairs])

        before = self._snapshots(pairs)
        what = f"layout {slot.ident} merge"
        if self._under_pressure(what, [(slot.ref, slot.opt), *pairs], headroom, merge) is None:
            self.stats.op("exhausted:merge")
            return
        self._exact("merge sources are borrowed and left unchanged", self._snapshots(pairs), before)
        self._mirror_merge(slot, [t.lm for t in picked])
        for t in picked:
            self.pool.remove(t)
        slot.rows.extend(picked)

    @precondition(lambda self: hasattr(self, "spec_rounds") and any(s.rows for s in self.slots))
    @rule(data=st.data())
    def round_at_the_limit(self, data: st.DataObject) -> None:
        """Verify rounds whose blocks run with no headroom (a block that needs a new pool
        block is refused, alike and with nothing changed, its round open before its
        block; then it goes in and the round resolves): rare under free draws."""
        saved, self.headroom = self.headroom, 0
        try:
            self.spec_rounds(data)  # type: ignore[attr-defined]
        finally:
            self.headroom = saved

    # -- the prefix cache --------------------------------------------------------------
    def _token_ids(self, track: Track) -> list[int]:
        """Token ids of a row's positions, from what the model holds there (keys' and
        values' bytes): equal ids only ever name equal stored tokens, so a prefix hit is
        right whichever row registered it."""
        columns = column_ids((*track.keys, *track.values), 0)
        return [int.from_bytes(hashlib.blake2b(c, digest_size=6).digest()) for c in columns]

    @precondition(
        lambda self: self.geo is not None and (bool(self.pool) or any(s.rows for s in self.slots))
    )
    @rule(data=st.data())
    def prefix_hit(self, data: st.DataObject) -> None:
        """``register_prefix`` of a row's (or a request's) first ``t`` positions, then
        ``pool.lookup_prefix`` of a new request starting with them: the hit is the whole
        blocks the spec names (``(q - 1) // block_size`` for ``q`` query ids, at most the
        registered ones), holds the model's first tokens, references the row's blocks
        (counts + 1, nothing copied), and goes on as a new request or is released (every
        count back). A row in a round or a cache without a pool refuses, alike. A ring
        (its ``max_size``) registers the blocks of its first ``min(t, max_size)`` positions
        while it holds every position, none (no pool changes) once it gave one back; its
        hits (a ring's lookup) are at most ``max_size`` positions."""
        targets: list[tuple[Track, Any, Any, int | None]] = [
            (t, t.ref, t.opt, None) for t in self.pool
        ]
        for slot in self._steppable():
            targets += [(t, slot.ref, slot.opt, b) for b, t in enumerate(slot.rows)]
        track, ref, opt, b = self._pick(data, targets, "row")
        bs, cap = ref.block_size, self.g.cap
        if b is None and track.appended and (cap or bs) >= bs and track.tokens <= 2 * bs:
            # Whole-block hits are rare under free draws (prompts are mostly shorter than
            # a block): the request grows to two whole blocks and one token first.
            n = 2 * bs + 1 - track.tokens
            rng = self._rng(data)
            keys, values = (self._block(rng, 1, n, d) for d in (self.g.key_dim, self.g.value_dim))
            self._op("prefix:grow", track)
            self._serial_append(track, keys, values, self._queries(rng, 1, n), ks.MaskForm())
        whole = track.tokens // bs * bs
        t = data.draw(
            st.sampled_from((track.tokens, whole)) | st.integers(0, track.tokens),
            label="registered tokens",
        )
        ids = self._token_ids(track)
        registered = ids[:t]
        note(f"prefix_hit: request {track.ident} (row {b}), {t} of {track.tokens} ids")
        self._op("prefix:register", track)

        def register(given: list[int]) -> Callable[[Impl, Any], int]:
            if b is None:
                return lambda impl, cache: cache.register_prefix(given)
            return lambda impl, lay: lay.register_prefix(b, given)

        refuses = (
            ref.pool is None
            or (b is None and not track.appended)
            or getattr(ref, "spec_round_open", False)
        )
        if refuses:
            self._refused("register_prefix (no pool or in a round)", register(registered), ref, opt)
            self.stats.op("prefix:refused")
            return
        if data.draw(st.booleans(), label="more ids than positions"):
            self._refused(
                "register_prefix of more ids than positions",
                register([*ids, 7]),
                ref,
                opt,
                InvalidInputError,
            )
        # A ring's or a chunked row holds every position until it gives one back: the twins'
        # ``retained`` (a serial cache's an int, a layout's per row), which must agree (a
        # chunked row's with the model's).
        retained = [r if b is None else r[b] for r in ((ref.retained, opt.retained) if cap else ())]
        self._exact("held positions (reference, optimized)", retained[1:], retained[:1])
        if retained and self.g.chunk_size is not None:
            self._exact("held positions (the model)", retained[0], track.held)
        dropped = bool(retained) and retained[0] < track.tokens
        before = [accounting(pool) for pool in (ref.pool, opt.pool)]
        full = [
            register(registered)(impl, c)
            for impl, c in ((self.ref_impl, ref), (self.opt_impl, opt))
        ]
        expected = 0 if dropped else (t if cap is None else min(t, cap)) // bs
        self._exact(
            "register_prefix: whole blocks cached (reference, optimized)", full, [expected] * 2
        )
        if dropped:  # a ring past its window: nothing registered, no pool changed
            self._exact(
                "register_prefix past the window changes no pool",
                [accounting(pool) for pool in (ref.pool, opt.pool)],
                before,
            )
            self.stats.op("prefix:past the window")
            return
        geometry = ref.token_geometry  # a ring's lookup: its window's blocks
        if (
            full[0]
            and data.draw(st.booleans(), label="register other ids")
            and self._cached(ref, b, full[0])
        ):
            # A cached block's hash is its tokens': other ids for it are refused, unchanged
            # (blocks that stayed private, another block caching their hash, would cache
            # the other ids: the pool changes, no refusal).
            self._refused(
                "register_prefix of other ids for a cached block",
                register([registered[0] + 1, *registered[1:]]),
                ref,
                opt,
                InvalidInputError,
            )
        if full[0]:
            # The boundary: a prompt of exactly the cached whole blocks hits all but the
            # last (its last token is always computed, for its logits).
            exact = registered[: full[0] * bs]
            edge = [pool.lookup_prefix(exact, geometry) for pool in (ref.pool, opt.pool)]
            self._exact(
                f"lookup_prefix of {len(exact)} ids, {full[0]} whole blocks (reference, optimized)",
                [0 if c is None else int(c.offset) for c in edge],
                [(full[0] - 1) * bs] * 2,
            )
            for cache in edge:
                if cache is not None:
                    cache.release()
        # A new request: the first q ids, or all t and one the pool never saw.
        q = data.draw(st.just(t + 1) | st.integers(0, t + 1), label="query ids")
        query = registered[:q] if q <= t else [*registered, -1]
        hit = (max(q - 1, 0) if cap is None else min(max(q - 1, 0), cap)) // bs
        pools = (ref.pool, opt.pool)
        before = [accounting(pool) for pool in pools]
        got = [pool.lookup_prefix(query, geometry) for pool in pools]
        self._exact(
            f"lookup_prefix of {q} ids: a hit of {hit} blocks (reference, optimized)",
            [None if c is None else int(c.offset) for c in got],
            [None if not hit else hit * bs] * 2,
        )
        self.stats.op("prefix:lookup")
        if not hit:
            self._exact("a missed lookup changes no pool", [accounting(p) for p in pools], before)
            return
        self.stats.op("prefix:hit")
        tokens = hit * bs
        model = (*(p[:, :, :tokens] for p in track.keys), *(p[:, :, :tokens] for p in track.values))
        for impl, pool, cache, held in zip(
            (self.ref_impl, self.opt_impl), pools, got, before, strict=True
        ):
            self._same_planes(
                "kv.solo",
                f"lookup_prefix hit ({impl.name}) vs the model",
                self._view(impl, cache),
                model,
            )
            problem = hit_accounting_problem(pool, list(cache.block_table), held)
            self._exact(f"lookup_prefix ({impl.name}): the pool after a hit", problem, None)
        self._exact(
            "lookup_prefix: block tables (optimized vs reference)",
            got[1].block_table,
            got[0].block_table,
        )
        self._exact(
            "pool accounting after a hit (optimized vs reference)",
            accounting(pools[1]),
            accounting(pools[0]),
        )
        self.stats.check("prefix hit")
        self.stats.state(WHOLE_BLOCK_HIT)
        if len(self.pool) < self.limits.pool and data.draw(st.booleans(), label="hit goes on"):
            keep = track.tokens - tokens
            history = [*track.history, ("trim", keep, None)] if keep else list(track.history)
            copy = Track(
                ident=next(self._ids),
                ref=got[0],
                opt=got[1],
                lm=None,
                keys=tuple(np.ascontiguousarray(p[:, :, :tokens]) for p in track.keys),
                values=tuple(np.ascontiguousarray(p[:, :, :tokens]) for p in track.values),
                appended=True,
                geometry_known=True,
                history=history,
                held=tokens,
            )
            note(f"  the hit becomes request {copy.ident}")
            self._dirty.add(copy.ident)
            self.pool.append(copy)
            return
        for cache in got:
            cache.release()
        # Every count back (a hit on a free cached block puts it back at the queue's tail).
        self._exact(
            "a released hit gives every block back",
            [accounting(p)[3:] for p in pools],
            [held[3:] for held in before],
        )

    def _check_admission(self, slot: Slot) -> None:
        """``projected_bytes(t)`` counts whole blocks (``ceil(t / block_size)`` of them; a
        ring's: those of its sinks and newest ``max_size`` positions);
        ``row_admission`` sums it; before the geometry is known both refuse, alike."""
        ts = [0, 1, 7, 16, 17, *(t.tokens for t in slot.rows)]
        answers = []
        for name, lay in (("reference", slot.ref), ("optimized", slot.opt)):
            admission = table.row_admission([lay, lay])
            assert admission is not None
            what = f"layout {slot.ident} ({name})"
            got = [_answer(lay.projected_bytes, t) for t in ts]
            doubled = [_answer(admission.bytes, t) for t in ts]
            if lay.geometry is not None:
                size, cap, keep = lay.block_size, self.g.cap, self.g.keep or 0
                # Whole blocks: every position's (growing), a ring's sinks' and window's.
                want = [
                    self.g.token_bytes() * projected_blocks(t, cap, keep, size) * size for t in ts
                ]
                self._exact(f"{what} projected_bytes{ts} (whole blocks)", got, want)
                self._exact(f"{what} row_admission bytes{ts}", doubled, [2 * x for x in got])
            else:
                self._exact(f"{what} projected_bytes{ts}, no geometry yet", got, doubled)
            answers.append(got)
        self._exact(f"layout {slot.ident} projected_bytes (both)", answers[1], answers[0])
        self.stats.check("admission")


# ------------------------------------------------------------------------- modifiers
def _rows_part(everything: tuple[list[Any], list[Any]]) -> tuple[list[Any], list[Any]]:
    """``_everything()`` without each cache's bytes and whole read: what a discarded
    proposal round restores is every row (its window, offsets, pads, ``repr``); a growing
    layout keeps the bytes its trim forgot (masked columns) and may have grown its buffer."""

    def rows(snapshots: list[Any]) -> list[Any]:
        return [(*s[:3], *s[4:6], *s[7:]) for s in snapshots]

    return rows(everything[0]), rows(everything[1])


class RoundRules(ConformanceMachine):
    """The speculative modifier's rules: verify rounds, composed onto the storage's
    machine (see the module docstring)."""

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

    def _proposal_round(self, slot: Slot, count: int) -> None:
        """A proposal round (a draft model's proposals on its own layout): ``count``
        single-token steps, each checked as a layout step is (fetched planes, masks, the
        time-ordered read, visibility against the rows' tokens plus the proposals so far,
        attention), then ``spec_round_discard()``: every row reads as it did before. A
        layout that cannot hold the proposals refuses in both implementations, unchanged.
        Run after each ``_rounds`` with no draw of its own (the rules' draws, and so what
        a derandomized run exercises, are the same as without it)."""
        self._op("proposal_round", slot)
        holds = (slot.ref.holds_proposals, slot.opt.holds_proposals)
        self._exact(
            f"layout {slot.ident} holds_proposals (reference, optimized)", holds[1], holds[0]
        )
        before = self._everything()
        if not holds[0]:
            errors = [
                raised(impl, "spec_round_propose()", lay.spec_round_propose)
                for impl, lay in ((self.ref_impl, slot.ref), (self.opt_impl, slot.opt))
            ]
            self._same_error("spec_round_propose()", errors[0], errors[1], SpeculativeRoundError)
            self._exact("a refused proposal round changes nothing", self._everything(), before)
            return
        g, rows = self.g, len(slot.rows)
        rng = np.random.default_rng([count, *(t.tokens for t in slot.rows)])
        slot.ref.spec_round_propose()
        slot.opt.spec_round_propose()
        self._round_open(slot, True)
        proposed: list[Array] = []
        for i in range(count):
            keys = self._block(rng, rows, 1, g.key_dim)
            values = self._block(rng, rows, 1, g.value_dim)
            queries = self._queries(rng, rows, 1)
            what = f"layout {slot.ident} proposal {i + 1} of {count}"
            masks = [slot.ref.make_mask(1), slot.opt.make_mask(1)]
            (keys_ref, _), (keys_opt, _) = self._append(what, slot.ref, slot.opt, keys, values)
            width = int(keys_ref[0].shape[2])
            self._exact(
                f"{what}: columns read (optimized, reference)", int(keys_opt[0].shape[2]), width
            )
            exp_ref, exp_opt = expand(masks[0], rows, 1, width), expand(masks[1], rows, 1, width)
            self._masks_equal(what, [exp_ref, exp_opt])
            proposed.append(keys)
            model = [
                (
                    b,
                    functools.reduce(_cat, (self._encoded(k[b : b + 1]) for k in proposed), t.keys),
                    t.tokens + i,
                    t.held,
                )
                for b, t in enumerate(slot.rows)
            ]
            self._visibility(f"{what} (reference)", keys_ref, exp_ref, model, 1, None)
            self._visibility(f"{what} (optimized)", keys_opt, exp_opt, model, 1, None)
            out_ref = self._attend(self.ref_impl, queries, slot.ref, masks[0], what)
            out_opt = self._attend(self.opt_impl, queries, slot.opt, masks[1], what)
            self._close("attention", f"{what} attention", out_opt, out_ref)
        for impl, lay in ((self.ref_impl, slot.ref), (self.opt_impl, slot.opt)):
            try:
                lay.spec_round_discard()
            except KvRowsError as error:  # a valid discard must succeed
                raise AssertionError(
                    f"{impl.name}: discarding a proposal round of {count} raised "
                    f"{type(error).__name__}: {error}"
                ) from error
        self._round_open(slot, False)
        self._exact(
            "a discarded proposal round leaves every row as it was",
            _rows_part(self._everything()),
            _rows_part(before),
        )
        self.stats.check("proposal round discarded", count)
        if g.max_size is not None and any(t.tokens >= g.max_size for t in slot.rows):
            self.stats.check("proposal round on a full window")

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
            raised(impl, f"a verify block with {label}", partial(_append_block, c, make(impl)))
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
                raised(impl, f"{what} after a failed verify block", partial(call, impl, c))
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
        if slot.rows:  # (a draft's proposals between two rounds, 1 to 3 of them)
            self._proposal_round(slot, 1 + sum(t.tokens for t in slot.rows) % 3)

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
            rows = [(0, model_keys, before, track.held)]
            self._visibility(what, k_lm, exp_lm, rows, n, form.window_size)
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
        lm = lm_cache()
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
            raised(impl, label, partial(call, impl, lay, rr))
            for impl, lay, rr in zip(
                (self.ref_impl, self.opt_impl), (slot.ref, slot.opt), rounds, strict=True
            )
        ]
        self._same_error(label, errors[0], errors[1], expected)
        self._exact(f"{label}: every cache unchanged", self._everything(), before)
        self._round_open(slot, True)
        self.stats.check("round misuse")
        self.stats.check("error types")

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


class RingRoundRules(RoundRules):
    """What verify rounds add on a ring (composed before ``RoundRules`` and
    ``RingRules``; verify layouts draw windows of 1-32, mostly small, sinks included):
    drafts and a rule that take a row across its window, and the ``B10`` twin re-synced
    from the row's serial ring."""

    def _hard_steps(self, slot: Slot) -> list[str]:
        """None: the rounds land their blocks on wrapped rows ("round across the window",
        "rollback on a wrapped row"), and a ``wrapped`` branch in ``multi_step`` would
        redraw every verify ring's examples (the affine one then never joined)."""
        return []

    def _crossing(self, slot: Slot) -> list[int]:
        """Drafts that take a row from below its window past it (``d = W - tokens``)."""
        window = self.g.max_size or 0
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
            self.stats.variant("window 1" if self.g.max_size == 1 else "window > 1")
        super().teardown()


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
