"""The recurrent family's state machine: ``SSMCache`` rows in ``BatchedSSMCache``.

Recurrent state has no token axis, no keys and values and no attention read, so these
rules (the recurrent writer's, ``hooks.WRITERS["recurrent"].rules``, over the root
machine ``conformance.machines`` in place of the K/V writer's ``KvRules``, on the writers'
skeleton ``WriterRules``: a block is the layer's inputs) drive plane writes, padded runs
and record/replay rounds. They keep the
base machine's discipline and pieces: its ``Stats`` counters, implementations, ids,
tolerance comparison (``_close``, at each plane's dtype) and bad-input check
(``_both_refuse``: both implementations raise the contract's error with the same message,
array-type names aside, and nothing changes). Each example draws a geometry (activation dtype, conv kernel, key
and value heads and dims) and a layer that writes the planes, as mlx-lm's layers do:
gated DeltaNet (each implementation's ``gated_delta_forward``: conv and recurrent
planes), or a toy layer over 1 to 4 planes of ranks 2 to 4 in drawn dtypes
(``plane_state_forward``: mlx-lm's ``ArraysCache(size=n)`` of any shape).

Oracles, after every rule that touched something:

* **reference vs optimized**: conv planes byte-identical (they are copied inputs),
  recurrent planes and the layer's outputs within the recurrent tolerance; the toy
  layer's planes byte-identical (one float32 rounding and one cast per step);
* **solo replay**: every row of a layout (extracted) byte-identical to the serial cache
  that saw only that row's real tokens (padded runs, joins, filters, rolled-back rounds),
  in each implementation;
* **mlx-lm parity**: mlx-lm's own ``ArraysCache`` (serial, and batched: ``merge``,
  ``extend``, ``filter``, ``extract``, ``prepare(lengths=…)``) driven by the optimized
  layer holds the optimized planes byte for byte (a rolled-back round is mirrored by
  restoring its planes and replaying the accepted prefix, masked);
* rows publish only at their exact coverage; saved states round-trip bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis.stateful import initialize, precondition, rule

from kvrows.conformance.arrays import NUMPY_DTYPES, as_numpy, to_mlx
from kvrows.conformance.families import Impl
from kvrows.conformance.hooks import lm_cache
from kvrows.conformance.machines import (
    ROLE_LOOKUPS,
    Block,
    Layout,
    OpsTarget,
    Request,
    WriterRules,
    planes_bytes,
)
from kvrows.errors import (
    IncompatibleRowsError,
    InvalidInputError,
    KvRowsError,
    NotTrimmableError,
    RowIndexError,
    SpeculativeRoundError,
)
from kvrows.recurrent import StateShapes
from kvrows.table import publish_row

__all__ = ["RECURRENT_CHECKS", "RecurrentMachine"]

Array = npt.NDArray[Any]

#: The checks (``Stats.checks`` keys) every recurrent machine must run.
RECURRENT_CHECKS = (
    "reference vs optimized",
    "solo replay",
    "mlx-lm parity",
    "error types",
    "error messages",
    "unchanged after an error",
    "publish at exact coverage",
    "state round trip",
    "rollback vs accepted-only run",
    "table roles",
)

_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Geometry:
    """One example's layer: activation dtype, conv kernel, heads and dims (gated
    DeltaNet), or the toy layer's planes (``shapes``)."""

    dtype: str
    kernel: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    #: The toy layer's planes; ``None``: gated DeltaNet's conv and recurrent planes.
    shapes: StateShapes | None = None

    @property
    def channels(self) -> int:
        if self.shapes is not None:  # the toy layer reads one input per plane element
            return max(math.prod(shape) for shape, _ in self.shapes.planes)
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def planes(self) -> int:
        return 2 if self.shapes is None else len(self.shapes.planes)

    def describe(self) -> str:
        if self.shapes is not None:
            return f"{self.dtype} toy layer, {self.shapes.describe()}"
        return (
            f"{self.dtype} K={self.kernel} Hk={self.key_heads} Dk={self.key_dim} "
            f"Hv={self.value_heads} Dv={self.value_dim}"
        )


def _plane_shapes(count: int) -> st.SearchStrategy[StateShapes]:
    """``count`` planes, each of rank 2 to 4 with the row axis (per-row rank 1 to 3)."""
    shape = st.integers(1, 3).flatmap(lambda r: st.lists(st.integers(1, 3), min_size=r, max_size=r))
    plane = st.tuples(shape.map(tuple), st.sampled_from(_DTYPES))
    planes = st.lists(plane, min_size=count, max_size=count)
    return planes.map(lambda ps: StateShapes(planes=tuple(ps)))


# every rule checks what it touched, teardown everything: no invariant
class RecurrentMachine(WriterRules):
    """Rules over a pool of requests and up to two layouts (see the module docstring)."""

    token_axis = 1

    #: Calibration runs record the float32 recurrence's errors without enforcing them.
    measured: ClassVar[tuple[str, ...]] = ("state.recurrent", "output")

    def __init__(self) -> None:
        super().__init__()
        self.layer: Geometry | None = None
        self.requests: list[Request] = []
        self.groups: list[Layout] = []
        self._noise = np.random.default_rng(0)
        self._layers: dict[str, Callable[..., Any]] = {}
        #: Per-example caps on the rules that never change the world's shape.
        self._calls = {"invalid": 0, "state": 0}

    # ------------------------------------------------------------------ set-up
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        key_heads = data.draw(st.sampled_from((1, 2)), label="key heads")
        geo = Geometry(
            dtype=data.draw(st.sampled_from(_DTYPES), label="dtype"),
            kernel=data.draw(st.integers(2, 4), label="kernel"),
            key_heads=key_heads,
            key_dim=data.draw(st.sampled_from((4, 8)), label="key dim"),
            value_heads=key_heads * data.draw(st.sampled_from((1, 2)), label="ratio"),
            value_dim=data.draw(st.sampled_from((4, 8)), label="value dim"),
        )
        self._noise = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
        count = data.draw(st.integers(0, 4), label="toy layer planes (0: gated DeltaNet)")
        if count:
            geo = dataclasses.replace(geo, shapes=data.draw(_plane_shapes(count), label="planes"))
        self.layer = geo
        self.stats.op("layer:gated delta" if geo.shapes is None else f"layer:{geo.planes} planes")
        if geo.shapes is not None:
            for shape, _ in geo.shapes.planes:
                self.stats.op(f"plane rank {len(shape) + 1}")
        note(f"geometry: {geo.describe()}")
        self.stats.variant(geo.dtype)
        from kvrows.optimized import recurrent as opt_rec
        from kvrows.reference import recurrent as ref_rec

        w = self._noise.standard_normal((geo.channels, geo.kernel)).astype(np.float32) * 0.5
        a_log = self._noise.standard_normal(geo.value_heads).astype(np.float32) * 0.3
        dt_bias = self._noise.standard_normal(geo.value_heads).astype(np.float32) * 0.3
        dims = (geo.key_heads, geo.key_dim, geo.value_heads, geo.value_dim)
        ref_params = ref_rec.GatedDeltaParams(w, a_log, dt_bias, *dims)
        opt_params = opt_rec.GatedDeltaParams(
            mx.array(w), mx.array(a_log), mx.array(dt_bias), *dims
        )
        self._layers = {
            "reference": lambda cache, *xs: ref_rec.gated_delta_forward(ref_params, cache, *xs),
            "optimized": lambda cache, *xs: opt_rec.gated_delta_forward(opt_params, cache, *xs),
        }
        shapes = geo.shapes
        if shapes is not None:
            self._layers = {
                "reference": lambda cache, x: ref_rec.plane_state_forward(shapes, cache, x),
                "optimized": lambda cache, x: opt_rec.plane_state_forward(shapes, cache, x),
            }

    def teardown(self) -> None:
        if self.layer is not None:
            for row in self.requests:
                self._check_row(row)
            for group in self.groups:
                self._check_group(group)
            self.stats.example_done()

    # ------------------------------------------------------------------ helpers
    def _new_state(self, impl: Impl, name: str) -> Any:
        """An empty cache of ``name`` with the example's plane count (``ArraysCache(n)``)."""
        assert self.layer is not None
        return impl.cls(name)(self.layer.planes)

    def _lm_new(self) -> Any:
        assert self.layer is not None
        return lm_cache().ArraysCache(self.layer.planes)

    # -- the writer skeleton's hooks (``machines.WriterRules``): a block is the layer's
    # inputs (the toy layer's one, gated DeltaNet's three), written by running the layer
    def _draw_block(self, rng: np.random.Generator, rows: int, n: int) -> Block:
        g = self.layer
        assert g is not None
        dtype = NUMPY_DTYPES[g.dtype]
        qkv = rng.standard_normal((rows, n, g.channels)).astype(dtype)
        if g.shapes is not None:
            return (qkv,)
        a = rng.standard_normal((rows, n, g.value_heads)).astype(dtype)
        b = rng.standard_normal((rows, n, g.value_heads)).astype(dtype)
        return qkv, a, b

    def _write(self, impl: Impl, cache: Any, block: Block) -> Array:
        inputs = (impl.to_native(x) for x in block if x is not None)  # (every input is drawn)
        return as_numpy(self._layers[impl.name](cache, *inputs))

    def _write_lm(self, lm: Any, block: Block) -> None:
        self._layers["optimized"](lm, *(to_mlx(x) for x in block if x is not None))

    def _same_writes(
        self, what: str, got: tuple[Any, Any], target: Any, counts: Sequence[int] | None
    ) -> None:
        """The layer's outputs (a padded run: each row's first ``counts[b]`` tokens)."""
        y_ref, y_opt = got
        if counts is None:
            self._same_arrays("output", f"{what} output", y_opt, y_ref)
        for b, k in enumerate(counts or ()):
            if k:
                self._same_arrays("output", f"{what} row {b} output", y_opt[b, :k], y_ref[b, :k])

    def _solo_write(self, what: str, row: Any, part: Block, expected: Block | None) -> None:
        solo = self._write_pair(row.ref, row.opt, part)
        self._write_lm(row.lm, part)
        if expected is not None:
            for impl, mine, theirs in zip(("reference", "optimized"), expected, solo, strict=True):
                self._same_arrays("output.solo", f"{what} output ({impl})", mine, theirs)
        row.tokens += int(part[0].shape[1])

    def _planes(self, cache: Any) -> tuple[Array, ...] | None:
        assert self.layer is not None
        planes = [cache[i] for i in range(self.layer.planes)]
        if planes[0] is None:
            assert all(p is None for p in planes), "some planes without the others"
            return None
        return tuple(as_numpy(p) for p in planes)

    def _same_state_planes(
        self, what: str, got: Any, want: Any, quantity: str | tuple[str, ...]
    ) -> None:
        """Plane by plane, at ``quantity`` (or one quantity per plane)."""
        a, b = self._planes(got), self._planes(want)
        if a is None or b is None:
            assert (a is None and b is None) or (quantity == "state.solo" and _zero(a or b)), (
                f"{what}: planes held by one side only"
            )
            return
        assert len(a) == len(b), f"{what}: {len(a)} planes vs {len(b)}"
        quantities = (quantity,) * len(a) if isinstance(quantity, str) else quantity
        for i, (q, mine, theirs) in enumerate(zip(quantities, a, b, strict=True)):
            self._same_arrays(q, f"{what} state.{i}", mine, theirs)

    @property
    def _ref_vs_opt_quantities(self) -> str | tuple[str, ...]:
        """The planes' quantities, reference vs optimized: gated DeltaNet's copied inputs,
        then its float32 recurrence (another reduction order); the toy layer's planes, one
        rounding and one cast per step, exact."""
        assert self.layer is not None
        return ("state.conv", "state.recurrent") if self.layer.shapes is None else "state.conv"

    def _ref_vs_opt(self, what: str, ref: Any, opt: Any) -> None:
        self._same_state_planes(what, opt, ref, self._ref_vs_opt_quantities)
        self.stats.check("reference vs optimized")

    # ------------------------------------------------------------------ oracles
    def _same_as_solo(self, what: str, rows: tuple[Any, Any], solo: Request) -> None:
        """A layout's row (reference, optimized) holds its solo replay's planes and offset."""
        for impl, got, want in zip(
            ("reference", "optimized"), rows, (solo.ref, solo.opt), strict=True
        ):
            self._same_state_planes(f"{what} ({impl}) vs solo", got, want, "state.solo")
            assert got.offset == want.offset == solo.tokens, f"{what} ({impl}): offsets"

    def _check_row(self, row: Request) -> None:
        self._ref_vs_opt(f"request {row.ident}", row.ref, row.opt)
        assert row.ref.offset == row.opt.offset == row.tokens, (
            f"request {row.ident}: offsets {row.ref.offset}, {row.opt.offset}, want {row.tokens}"
        )
        self._same_state_planes(f"request {row.ident} vs mlx-lm", row.opt, row.lm, "state.mlx_lm")
        self.stats.check("mlx-lm parity")
        row.ref.check_valid()
        row.opt.check_valid()

    def _check_group(self, group: Layout) -> None:
        what = f"layout {group.ident}"
        want = tuple(r.tokens for r in group.rows)
        assert group.ref.row_offsets == group.opt.row_offsets == want, (
            f"{what}: row offsets {group.ref.row_offsets} / {group.opt.row_offsets}, want {want}"
        )
        assert group.ref.group_offset == group.opt.group_offset == max(want, default=0)
        self._ref_vs_opt(what, group.ref, group.opt)
        self._same_state_planes(f"{what} vs mlx-lm", group.opt, group.lm, "state.mlx_lm")
        self.stats.check("mlx-lm parity")
        for b, row in enumerate(group.rows):
            extracted = group.ref.extract_row(b), group.opt.extract_row(b)
            self._same_as_solo(f"{what} row {b}", extracted, row)
        self.stats.check("solo replay")
        group.ref.check_valid()
        group.opt.check_valid()

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.requests) < 4)
    @rule()
    def new_request(self) -> None:
        self.stats.op("new_request")
        row = Request(
            next(self._ids),
            self._new_state(self.ref_impl, self.spec.serial),
            self._new_state(self.opt_impl, self.spec.serial),
            self._lm_new(),
        )
        self.requests.append(row)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        self.stats.op("prefill_chunk")
        row = data.draw(st.sampled_from(self.requests), label="request")
        n = data.draw(st.integers(1, 6), label="chunk")
        self._write_both(f"request {row.ident}", row, self._draw_block(self._noise, 1, n))
        row.tokens += n
        self._check_row(row)

    def _layout(self, data: st.DataObject, impl: Impl, serial: Any) -> Any:
        """A new layout of ``impl``'s class (a mutant in the teeth tests), after checking
        that the row-layout table gives that class in the drawn role."""
        role = data.draw(st.sampled_from(self.spec.roles), label="role")
        table: Any = ROLE_LOOKUPS[role](serial)
        # the table gives this machine's layout (its class from the composition table)
        assert type(table).__name__ == self.spec.name and table.batch_size == 0, role
        self.stats.check("table roles")
        return self._new_state(impl, self.spec.name)

    @precondition(lambda self: bool(self.requests) and len(self.groups) < 2)
    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        self.stats.op("merge")
        most = min(3, len(self.requests))
        # most rows first: multi-row layouts are what the row operations and rounds need
        count = data.draw(st.integers(1, most).map(lambda c: most + 1 - c), label="rows")
        rows = [
            self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
            for _ in range(count)
        ]
        ref = self._layout(data, self.ref_impl, rows[0].ref)
        opt = self._layout(data, self.opt_impl, rows[0].opt)
        ref.merge_rows([r.ref for r in rows])
        opt.merge_rows([r.opt for r in rows])
        lm = lm_cache().ArraysCache.merge([r.lm for r in rows])
        group = Layout(next(self._ids), ref, opt, lm, rows)
        self.groups.append(group)
        self._check_group(group)

    @precondition(lambda self: bool(self.requests) and bool(self.groups))
    @rule(data=st.data())
    def join(self, data: st.DataObject) -> None:
        self.stats.op("join")
        group = data.draw(st.sampled_from(self.groups), label="layout")
        row = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1), label="request"))
        group.ref.merge_rows([row.ref])
        group.opt.merge_rows([row.opt])
        joined = lm_cache().ArraysCache.merge([row.lm])
        if group.rows:
            group.lm.extend(joined)
        else:  # an ArraysCache without planes counts one row: extend would add a zero row
            group.lm = joined
        group.rows.append(row)
        self._check_group(group)

    def _steppable_groups(self) -> list[Layout]:
        return [g for g in self.groups if g.rows]

    @precondition(lambda self: bool(self._steppable_groups()))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One block for every row: decode (1), a multi-token block, or a right-padded run
        (``prepare(lengths=…)``: row ``b`` takes its first ``lengths[b]`` tokens)."""
        group = data.draw(st.sampled_from(self._steppable_groups()), label="layout")
        n = data.draw(st.sampled_from((3, 1, 2, 1, 5)), label="block")
        # padded runs first: they are what makes rows of one layout differ in coverage
        padded = n > 1 and not data.draw(st.booleans(), label="unpadded")
        self.stats.op("padded_step" if padded else ("decode_step" if n == 1 else "multi_step"))
        rows = len(group.rows)
        lengths = (
            [data.draw(st.integers(0, n), label=f"length {b}") for b in range(rows)]
            if padded
            else [n] * rows
        )
        block = self._draw_block(self._noise, rows, n)
        if padded:
            for layout in (group.ref, group.opt):
                layout.prepare(lengths=lengths, right_padding=[n - k for k in lengths])
            group.lm.prepare(lengths=lengths)
        what = f"layout {group.ident}"
        outputs = self._write_both(what, group, block, lengths)
        if padded:
            for layout in (group.ref, group.opt, group.lm):
                layout.finalize()
        self._write_solos(what, group.rows, block, lengths, outputs)
        self._check_group(group)

    @precondition(lambda self: bool(self.groups))
    @rule(data=st.data())
    def filter_layout(self, data: st.DataObject) -> None:
        self.stats.op("filter")
        group = data.draw(st.sampled_from(self.groups), label="layout")
        longest = max((r.tokens for r in group.rows), default=0)
        longest_leaves: bool = data.draw(st.booleans(), label="the longest row leaves")
        keep: list[int]
        if group.rows and longest_leaves:
            # the rows holding the most tokens leave (one of them when all tie); the rest
            # stay in reverse order
            shorter = [b for b, r in enumerate(group.rows) if r.tokens < longest]
            keep = list(reversed(shorter or range(1, len(group.rows))))
        else:
            keep = data.draw(
                st.permutations(range(len(group.rows))).flatmap(
                    lambda order: st.integers(0, len(order)).map(lambda k: list(order[:k]))
                ),
                label="keep",
            )
            if data.draw(st.booleans(), label="reversed"):
                keep.reverse()
        group.ref.filter_rows(keep)
        group.opt.filter_rows(keep)
        if keep:
            group.lm.filter(mx.array(keep, dtype=mx.int32))
        else:
            group.lm = self._lm_new()
        group.rows = [group.rows[b] for b in keep]
        if group.rows and max(r.tokens for r in group.rows) < longest:
            self.stats.op("filter:longest left")
        self._check_group(group)

    @precondition(lambda self: any(g.rows for g in self.groups) and len(self.requests) < 5)
    @rule(data=st.data())
    def extract(self, data: st.DataObject) -> None:
        self.stats.op("extract")
        group = data.draw(st.sampled_from([g for g in self.groups if g.rows]), label="layout")
        b = data.draw(st.integers(0, len(group.rows) - 1), label="row")
        solo = group.rows[b]
        row = Request(
            next(self._ids),
            group.ref.extract_row(b),
            group.opt.extract_row(b),
            # mlx-lm's extract subscripts every plane (None before the first write)
            group.lm.extract(b) if group.lm[0] is not None else self._lm_new(),
            solo.tokens,
        )
        self._same_as_solo("extracted row", (row.ref, row.opt), solo)
        self.stats.check("solo replay")
        self.requests.append(row)
        self._check_row(row)

    @precondition(lambda self: any(g.rows for g in self.groups))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """A row publishes at its exact coverage only (recurrent state cannot be cut)."""
        self.stats.op("publish")
        group = data.draw(st.sampled_from([g for g in self.groups if g.rows]), label="layout")
        b = data.draw(st.integers(0, len(group.rows) - 1), label="row")
        tokens = group.rows[b].tokens
        for impl, layout in ((self.ref_impl, group.ref), (self.opt_impl, group.opt)):
            before = self._observed(impl, layout)
            written = layout[0] is not None
            published = publish_row(layout, b, tokens)
            assert (published is not None) == written, "a written row publishes at its coverage"
            if tokens:
                assert publish_row(layout, b, tokens - 1) is None, "a cut recurrent row published"
                self.stats.op("publish:cut refused")
            assert publish_row(layout, b, tokens + 1) is None
            assert self._observed(impl, layout) == before, "publishing changed the layout"
        self.stats.check("publish at exact coverage")

    @precondition(lambda self: any(g.rows for g in self.groups))
    @rule(data=st.data())
    def spec_round(self, data: st.DataObject) -> None:
        """A verify round: a block of ``d + 1`` tokens, then commit (every row kept all)
        or roll back to ``keep[b]`` tokens per row (snapshot + replay)."""
        group = data.draw(st.sampled_from([g for g in self.groups if g.rows]), label="layout")
        d = data.draw(st.integers(1, 3), label="drafts")
        rows = len(group.rows)
        kind = data.draw(st.sampled_from(("unequal", "commit", "uniform")), label="outcome")
        if kind == "commit":
            keep = [d + 1] * rows
        elif kind == "uniform" or rows == 1:
            keep = [data.draw(st.integers(1, d), label="keep")] * rows
            kind = "uniform"
        else:
            keep = [data.draw(st.integers(1, d + 1), label=f"keep {b}") for b in range(rows)]
            if len(set(keep)) == 1:  # an unequal round needs two counts: row 0 keeps fewer
                keep[0] = 1 if keep[0] > 1 else 2
        self.stats.op("spec_rounds")
        self.stats.op(f"round:{kind}")
        block = self._draw_block(self._noise, rows, d + 1)
        for layout in (group.ref, group.opt):
            layout.spec_round_begin()
        what = f"layout {group.ident} round"
        outputs = self._write_pair(group.ref, group.opt, block)
        self._same_writes(what, outputs, group, None)  # the round's outputs, ref vs opt
        for layout in (group.ref, group.opt):
            assert not layout.can_publish_row(0, layout.row_offsets[0])
            if kind == "commit":
                layout.spec_round_commit()
            else:
                layout.spec_round_rollback(keep if kind == "unequal" else keep[0])
            assert not layout.spec_round_open
        # mlx-lm's twin (no rounds): only the accepted prefix, masked per row
        group.lm.prepare(lengths=keep)
        self._write_lm(group.lm, self._part(block, None, max(keep)))
        group.lm.finalize()
        # each row's accepted tokens' outputs are its solo run's over those tokens alone
        self._write_solos(what, group.rows, block, keep, outputs)
        self._check_group(group)
        self.stats.check("rollback vs accepted-only run")

    @precondition(
        lambda self: (
            (bool(self.requests) or any(g.rows for g in self.groups)) and self._calls["state"] < 3
        )
    )
    @rule(data=st.data())
    def round_trip(self, data: st.DataObject) -> None:
        """``state`` -> ``from_state``: the same planes bit for bit; the restored cache goes
        on in place of the original."""
        self.stats.op("state")
        self._calls["state"] += 1
        targets: list[Request | Layout] = [*self.requests, *(g for g in self.groups if g.rows)]
        target = data.draw(st.sampled_from(targets), label="cache")
        for side, impl in (("ref", self.ref_impl), ("opt", self.opt_impl)):
            cache = getattr(target, side)
            restored = type(cache).from_state(cache.state)
            self._exact(
                "state round trip", self._observed(impl, restored), self._observed(impl, cache)
            )
            setattr(target, side, restored)
        self.stats.check("state round trip")

    # -------------------------------- the operation checks' hooks (``machines.OpsChecks``,
    # composed after these rules: ``hooks.WRITERS["recurrent"]``): the requests and the
    # layouts leased and saved; a saved state is every plane and the offsets, no token
    # axis, so a load holds the live planes (at the reference vs optimized tolerance;
    # bit for bit its source's, ``_crossed``) and each row's offset, its token count
    def _ops_targets(self) -> tuple[list[OpsTarget], list[OpsTarget]] | None:
        if self.layer is None:
            return None
        return [*self.requests, *self.groups], [*self._steppable_groups(), *self.requests]

    def _snapshot(self, impl: Impl, cache: Any) -> tuple[Any, ...]:
        return self._observed(impl, cache)

    def _state_rows(self, impl: Impl, cache: Any) -> list[tuple[Any, ...]]:
        """The saved form ``(state.0, …, state.{N-1}, offset)``: each row's offset and its
        part of every plane (``None``: unwritten), bit for bit."""
        *planes, offset = cache.state
        offsets = [offset] if isinstance(offset, int) else impl.to_numpy(offset).tolist()
        held = [None if p is None else impl.to_numpy(p) for p in planes]
        return [
            (o, tuple(None if p is None else planes_bytes((p[b : b + 1],)) for p in held))
            for b, o in enumerate(offsets)
        ]

    def _check_state(self, what: str, ref_cache: Any, opt_cache: Any) -> None:
        """Both saved states hold the same offsets and planes (the planes at the reference
        vs optimized tolerance: gated DeltaNet's recurrence is not bit for bit)."""
        offsets = [
            [row[0] for row in self._state_rows(impl, cache)]
            for impl, cache in ((self.opt_impl, opt_cache), (self.ref_impl, ref_cache))
        ]
        self._exact(f"{what}: offsets of the saved state", offsets[0], offsets[1])
        *opt_planes, _ = opt_cache.state
        *ref_planes, _ = ref_cache.state
        quantities = self._ref_vs_opt_quantities
        for i, (mine, theirs) in enumerate(zip(opt_planes, ref_planes, strict=True)):
            self._exact(f"{what}: saved state.{i} held", mine is None, theirs is None)
            if mine is not None:
                q = quantities if isinstance(quantities, str) else quantities[i]
                self._same_arrays(q, f"{what}: saved state.{i}", as_numpy(mine), as_numpy(theirs))
        self.stats.check("state")

    def _holds_the_rows(self, what: str, item: OpsTarget, pair: tuple[Any, Any]) -> None:
        """Both loads hold the live rows: each row's offset its token count, the planes the
        live reference's (at the reference vs optimized tolerance), valid."""
        assert isinstance(item, Request | Layout)
        rows = [item] if isinstance(item, Request) else item.rows
        for impl, cache in zip((self.ref_impl, self.opt_impl), pair, strict=True):
            name = f"{what} ({impl.name})"
            offsets = cache.row_offsets if isinstance(item, Layout) else (cache.offset,)
            self._exact(f"{name}: offsets", tuple(offsets), tuple(r.tokens for r in rows))
            self._ref_vs_opt(f"{name} vs the live reference", item.ref, cache)
            cache.check_valid()

    # ------------------------------------------------------------------ bad inputs
    def _observed(self, impl: Impl, cache: Any) -> tuple[Any, ...]:
        held = [None if p is None else as_numpy(p) for p in cache.cache]
        planes = tuple(None if p is None else (p.dtype.name, p.shape, p.tobytes()) for p in held)
        offsets = cache.row_offsets if hasattr(cache, "row_offsets") else (cache.offset,)
        return planes, tuple(offsets)

    def _cases(
        self, layout: bool, rows: int, written: bool
    ) -> list[tuple[str, Callable[[Impl, Any], object], type[KvRowsError]]]:
        g = self.layer
        assert g is not None
        dtype = NUMPY_DTYPES[g.dtype]
        batch = max(rows, 1)

        conv_bad = np.zeros((batch, g.kernel, g.channels), dtype)
        state_bad = np.zeros((batch, g.value_heads, g.value_dim, g.key_dim + 1), np.float32)
        if g.shapes is not None:  # each plane one longer on its first per-row axis
            (first, first_dtype), (last, last_dtype) = g.shapes.planes[0], g.shapes.planes[-1]
            conv_bad = np.zeros((batch, first[0] + 1, *first[1:]), NUMPY_DTYPES[first_dtype])
            state_bad = np.zeros((batch, last[0] + 1, *last[1:]), NUMPY_DTYPES[last_dtype])
        past = g.planes
        cases: list[tuple[str, Callable[[Impl, Any], object], type[KvRowsError]]] = [
            ("trim", lambda impl, c: c.trim(1), NotTrimmableError),
            (
                "plane index past the last",
                lambda i, c: c.__setitem__(past, i.to_native(conv_bad)),
                InvalidInputError,
            ),
            (
                "the update of a KV cache",
                lambda i, c: c.update_and_fetch(None, None),
                InvalidInputError,
            ),
            ("a corrupt state", lambda i, c: type(c).from_state((None, None)), InvalidInputError),
        ]
        if written:  # the planes' shapes are known: a plane of another shape is refused
            cases += [
                (
                    "first plane of the wrong shape",
                    lambda i, c: c.__setitem__(0, i.to_native(conv_bad)),
                    InvalidInputError,
                ),
                (
                    "last plane of the wrong shape",
                    lambda i, c: c.__setitem__(past - 1, i.to_native(state_bad)),
                    InvalidInputError,
                ),
            ]
        if layout:
            cases += [
                ("filter naming a row twice", lambda i, c: c.filter_rows([0, 0]), RowIndexError),
                ("extract past the rows", lambda i, c: c.extract_row(rows), RowIndexError),
                ("merge into itself", lambda i, c: c.merge_rows([c]), IncompatibleRowsError),
                (
                    "rollback without a round",
                    lambda i, c: c.spec_round_rollback(1),
                    SpeculativeRoundError,
                ),
                (
                    "prepare with the wrong row count",
                    lambda i, c: c.prepare(lengths=[1] * (rows + 1)),
                    InvalidInputError,
                ),
                (
                    "merge the other implementation's rows",
                    lambda i, c: c.merge_rows(
                        [
                            (self.opt_impl if i is self.ref_impl else self.ref_impl).new(
                                self.spec.serial
                            )
                        ]
                    ),
                    IncompatibleRowsError,
                ),
            ]
        return cases

    @precondition(lambda self: self._calls["invalid"] < 4)
    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """A bad input: both implementations raise the contract's error with the same
        message (array-type names aside), and nothing changes."""
        self.stats.op("invalid")
        self._calls["invalid"] += 1
        targets: list[Request | Layout] = [*self.requests, *self.groups]
        if not targets:
            return
        target = data.draw(st.sampled_from(targets), label="target")
        is_layout = isinstance(target, Layout)
        rows = len(target.rows) if isinstance(target, Layout) else 1
        label, call, expected = data.draw(
            st.sampled_from(self._cases(is_layout, rows, target.ref[0] is not None)), label="case"
        )
        self.stats.op(f"invalid:{label}")
        self._both_refuse(label, call, target.ref, target.opt, expected)
        self.stats.check("unchanged after an error")

    def _message(self, error: BaseException) -> str:
        """Messages name the implementation's array type; the rest must match word for word."""
        return str(error).replace("NumPy", "<array>").replace("MLX", "<array>")


def _zero(planes: tuple[Array, ...] | None) -> bool:
    """A row that saw no token holds zero planes once it shares a layout's buffers."""
    return planes is not None and not any(np.any(p) for p in planes)
