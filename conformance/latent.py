"""The latent family's machine: ``MLACache`` and ``EncodedLatentCache`` (``spec/MLACache.md``).

A latent cache is its own serial storage and its own layout, with three planes where a
KV storage has two, one shared write column, merges into an empty or a running cache
(rows right-justified to the longest), and (the
encoded variant) reads that depend on each row's bf16-first boundary. The base machine's
rules drive ``[B, H, N, D]`` key/value storages; these rules (the latent writer's,
``hooks.WRITERS["latent"].rules``) drive latent caches with the same oracles and the same
runner interface (``machines.machine_class`` builds it from the family, ``kvrows conform
--family latent`` runs it). They are composed over the root machine (in place of the K/V
writer's ``machines.KvRules``), on the writers' skeleton (``machines.WriterRules``: a
block is the latent, the rope and the index, written by ``append``), and reuse its ids, counters, world model
(``machines.Request``) and bad-input check:

* **reference vs optimized**: after every operation both hold the same rows (offsets,
  padding, converted flags) and return the same reads; stored codec planes bit-exact;
* **solo replay**: every row of a layout equals a reference cache of one row that saw the
  same appends and rollbacks (bit-exact: reads of a row never depend on its neighbours);
* **mlx-lm parity** (``MLACache``): mlx-lm's ``KVCache`` / ``BatchKVCache`` holding the
  latent as keys and the rope as values (and a second pair for the index plane, as
  ``deepseek_v32`` does) hold the same visible columns, the same offsets and padding;
* **bad inputs** raise the same ``KvRowsError`` subclass with the same message in both
  implementations (the base machine's ``_both_refuse``) and change nothing (wrong plane widths, ranks, dtypes, rows; a missing or unexpected index
  block; past ``max_tokens``; bad keep lists; trims past a row; rounds misused).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import hypothesis.strategies as st
import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis.stateful import initialize, precondition, rule

from kvrows.codecs.mx import Microscaled
from kvrows.conformance.arrays import NUMPY_DTYPES, from_mlx, to_mlx
from kvrows.conformance.families import Impl
from kvrows.conformance.hooks import lm_cache
from kvrows.conformance.machines import (
    Block,
    Layout,
    OpsTarget,
    Request,
    WriterRules,
    planes_bytes,
)
from kvrows.latent import LATENT_FIELDS, state_fields
from kvrows.schemes import Affine, CodecSpec, Turbo

__all__ = ["LATENT_CHECKS", "LatentMachine"]

Array = npt.NDArray[Any]

#: Oracles every run of the family must reach (the CI test asserts them).
LATENT_CHECKS = ("reference", "solo", "planes", "bad input unchanged")

#: The tensors a latent block holds, in ``append``'s order.
_TENSORS = ("latent", "rope", "index")

#: A saved state's planes, right-justified ``[B, 1, width, ·]`` (``LATENT_FIELDS``), and
#: its fields that are no array (the declaration, the codec, ``start``).
_STATE_PLANES = ("latent", "rope", "index", "exact")
_STATE_SCALARS = tuple(f for f in LATENT_FIELDS if f not in (*_STATE_PLANES, "offset", "converted"))

_CODECS: tuple[CodecSpec, ...] = (
    Affine(bits=8, group_size=64),
    Affine(bits=4, group_size=32),
    Turbo(k_bits=8, v_bits=4),
    Turbo(k_bits=8, v_bits=3),
    # the microscaling modes (issue 25): mxfp4, nvfp4
    Microscaled(group_size=32, bits=4),
    Microscaled(group_size=16, bits=4),
)


@dataclass
class _Config:
    rank: int
    rope: int
    index: int | None
    dtype: str
    max_tokens: int | None
    codec: CodecSpec | None
    start: int


@functools.cache
def _eager(cls: type) -> type:
    """``cls`` (an encoded latent with a decoded window) reading the eager way."""
    names = {n: getattr(cls, n) for n in ("__module__", "__qualname__")}
    return type(cls.__name__, (cls,), {"keeps_window": False, **names})


# every rule checks what it touched: no invariant
class LatentMachine(WriterRules):
    """Conformance of a latent cache class (both implementations, solo, mlx-lm)."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg: _Config | None = None
        self.requests: list[Request] = []
        #: The running layout: its rows' ``ref`` are their solo replays (reference one-row
        #: caches), its ``lm`` mlx-lm's ``BatchKVCache`` pair.
        self.layout: Layout | None = None
        self._noise = np.random.default_rng(0)
        self._invalid_left = 2
        #: The optimized encoded latent reads the eager way this example (no window).
        self._eager = False
        self._seed = 0

    # -- set-up ---------------------------------------------------------------------------
    @functools.cached_property
    def encoded(self) -> bool:
        """Whether a fresh cache keeps its rows in two ``stages`` (bf16-first: the plain
        latent, then the encoded one): its examples draw a codec and a start."""
        return len(self.ref_impl.new(self.spec.name).stages) > 1

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        codec = data.draw(st.sampled_from(_CODECS), label="codec") if self.encoded else None
        self.cfg = _Config(
            rank=64,
            rope=data.draw(st.sampled_from((8, 16)), label="rope"),
            index=data.draw(st.sampled_from((None, 16)), label="index"),
            dtype=data.draw(st.sampled_from(("float32", "bfloat16")), label="dtype"),
            max_tokens=data.draw(st.sampled_from((None, 40)), label="max_tokens"),
            codec=codec,
            start=data.draw(st.sampled_from((0, 3, 9)), label="start") if self.encoded else 0,
        )
        self._seed = data.draw(st.integers(0, 2**16), label="seed")
        self._noise = np.random.default_rng(self._seed)
        note(f"config: {self.cfg}")
        windowed = self.opt_impl.cls(self.spec.name)
        if hasattr(windowed, "keeps_window") and not self._draws_window(data):
            # The eager path the decoded window replaces: every read decodes the whole
            # latent (the same class name, so messages compare as they are).
            eager = {self.spec.name: _eager(windowed)}
            vars(self)["opt_impl"] = self.opt_impl.with_classes(eager)
            self._eager = True

    def _draws_window(self, data: st.DataObject) -> bool:
        """Whether the optimized class reads through its decoded window this example (else
        the eager way)."""
        return data.draw(st.booleans(), label="window")

    def teardown(self) -> None:
        if self.stats.steps > self._steps_at_start:
            if self.cfg is not None:
                codec = "plain" if self.cfg.codec is None else self.cfg.codec.key
                eager = " eager" if self._eager else ""
                self.stats.variant(f"{codec} dsa={self.cfg.index is not None}{eager}")
            self.stats.example_done()

    @property
    def c(self) -> _Config:
        assert self.cfg is not None
        return self.cfg

    def _new_latent(self, impl: Impl) -> Any:
        cls: Any = impl.cls(self.spec.name)
        args = (self.c.rank, self.c.rope, self.c.index, self.c.max_tokens)
        if self.c.codec is None:
            return cls(*args)
        return cls(*args, codec=self.c.codec, start=self.c.start)

    # -- the writer skeleton's hooks (``machines.WriterRules``): a block is the latent, the
    # rope and (DSA) the index tensor, written by ``append``; a request's solo replay is
    # a reference one-row cache
    def _draw_block(self, rng: np.random.Generator, rows: int, n: int) -> Block:
        dtype = NUMPY_DTYPES[self.c.dtype]

        def draw(width: int) -> Array:
            return rng.standard_normal((rows, 1, n, width)).astype(np.float32).astype(dtype)

        index = None if self.c.index is None else draw(self.c.index)
        return draw(self.c.rank), draw(self.c.rope), index

    def _write(self, impl: Impl, cache: Any, block: Block) -> Any:
        # no index block: ``append(latent, rope)``
        return cache.append(*(impl.to_native(b) for b in block if b is not None))

    def _write_lm(self, lm: Any, block: Block) -> None:
        if lm is None:
            return
        latent, rope, index = (None if b is None else to_mlx(b) for b in block)
        lm[0].update_and_fetch(latent, rope)
        if index is not None:
            lm[1].update_and_fetch(index, index)

    def _same_writes(
        self, what: str, got: tuple[Any, Any], target: Any, counts: Sequence[int] | None
    ) -> None:
        pads = target.ref.left_pad if isinstance(target, Layout) else None
        self._same_read(what, *got, pads)

    def _solo_write(self, what: str, row: Any, part: Block, expected: Block | None) -> None:
        self._write(self.ref_impl, row.ref, part)

    def _lm_twins(self) -> tuple[Any, Any] | None:
        if self.encoded or self.peer is None:
            return None
        lm: Any = lm_cache()
        return lm.KVCache(), lm.KVCache()

    # -- rules ----------------------------------------------------------------------------
    @precondition(lambda self: self.cfg is not None and len(self.requests) < 4)
    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        self.stats.op("new_request")
        request = Request(
            next(self._ids), self._new_latent(self.ref_impl), self._new_latent(self.opt_impl)
        )
        request.lm = self._lm_twins()
        self.requests.append(request)
        n = data.draw(st.integers(0, 7), label="prompt")
        if n:
            self._prefill(request, n)
        self._check_latent_request(request)

    def _prefill(self, request: Request, n: int) -> None:
        block = self._draw_block(self._noise, 1, n)
        if request.ref.width + n > (self.c.max_tokens or 10**9):
            return
        self._write_both("append read", request, block)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        self.stats.op("prefill_chunk")
        request = data.draw(st.sampled_from(self.requests), label="request")
        self._prefill(request, data.draw(st.integers(1, 5), label="chunk"))
        self._check_latent_request(request)

    @precondition(lambda self: len(self.requests) > 1 and self.layout is None)
    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        self.stats.op("merge")
        if data.draw(st.booleans(), label="several rows"):
            chosen = self.requests[-3:]  # the newest requests, several rows at once
        else:
            chosen = data.draw(
                st.lists(st.sampled_from(self.requests), min_size=1, max_size=3, unique_by=id),
                label="rows",
            )
        before = [self._observed(self.ref_impl, r.ref) for r in chosen]
        layout = Layout(
            next(self._ids), chosen[0].ref.make_empty_batch(), chosen[0].opt.make_empty_batch()
        )
        layout.ref.merge_rows([r.ref for r in chosen])
        layout.opt.merge_rows([r.opt for r in chosen])
        for request, snap in zip(chosen, before, strict=True):
            self._exact("merge source unchanged", self._observed(self.ref_impl, request.ref), snap)
        twins = [r.lm for r in chosen]
        self._into_rows(layout, chosen)
        if all(t is not None and t[0].offset > 0 for t in twins):
            layout.lm = self._merged_lm(twins)
        self.layout = layout
        for request in chosen:
            self.requests.remove(request)
        self._check_layout()

    @precondition(lambda self: self.layout is not None and bool(self.requests))
    @rule(data=st.data())
    def join(self, data: st.DataObject) -> None:
        """Requests join the running layout: the rows held keep their tokens, every row is
        right-justified to the longest."""
        self.stats.op("join")
        layout = self.layout
        assert layout is not None
        chosen = data.draw(
            st.lists(st.sampled_from(self.requests), min_size=1, max_size=2, unique_by=id),
            label="rows",
        )
        self._join(layout, chosen)

    def _join(self, layout: Layout, chosen: list[Request]) -> None:
        """``chosen`` join ``layout`` (borrowed, unchanged) as its last rows."""
        before = [self._observed(self.ref_impl, r.ref) for r in chosen]
        layout.ref.merge_rows([r.ref for r in chosen])
        layout.opt.merge_rows([r.opt for r in chosen])
        for request, snap in zip(chosen, before, strict=True):
            self._exact("join source unchanged", self._observed(self.ref_impl, request.ref), snap)
        self._into_rows(layout, chosen)
        for request in chosen:
            self.requests.remove(request)
        if layout.lm is not None:
            self._rebuild_lm(layout)
        self._check_layout()

    def _into_rows(self, layout: Layout, requests: list[Request]) -> None:
        """The merged requests become the layout's rows, each row's ``ref`` its solo
        replay (:meth:`_solo_of`)."""
        layout.rows += [Request(r.ident, self._solo_of(r), None) for r in requests]

    def _solo_of(self, request: Request) -> Any:
        """A reference one-row cache holding what the request holds (its own copy)."""
        if request.ref.batch_size == 0:
            return self._new_latent(self.ref_impl)
        return request.ref.extract_row(0)

    def _solos(self, layout: Layout) -> list[Any]:
        return [row.ref for row in layout.rows]

    def _step_layout(self, n: int, round_keep: list[int] | None) -> None:
        layout = self.layout
        assert layout is not None
        rows = layout.ref.batch_size
        if layout.ref.width + n > (self.c.max_tokens or 10**9):
            return
        block = self._draw_block(self._noise, rows, n)
        if round_keep is not None:
            layout.ref.spec_round_begin()
            layout.opt.spec_round_begin()
        self._write_both("layout append read", layout, block)
        self._write_solos("layout", layout.rows, block)
        if round_keep is None:
            return
        if len(set(round_keep)) == 1 and round_keep[0] == n:
            layout.ref.spec_round_commit()
            layout.opt.spec_round_commit()
            self.stats.op("round:commit")
            return
        layout.ref.spec_round_rollback(round_keep)
        layout.opt.spec_round_rollback(round_keep)
        self.stats.op("round:unequal" if len(set(round_keep)) > 1 else "round:equal")
        for solo, keep in zip(self._solos(layout), round_keep, strict=True):
            if n - keep:
                solo.trim(n - keep)
        if layout.lm is not None:
            self._rebuild_lm(layout)

    def _rebuild_lm(self, layout: Layout) -> None:
        """mlx-lm has no per-row rollback: its oracle is a merge of each row's accepted
        tokens (what the rolled layout must equal)."""
        lm: Any = lm_cache()
        pairs = []
        for solo in self._solos(layout):
            if solo.width == 0:
                layout.lm = None
                return
            pairs.append((lm.KVCache(), lm.KVCache()))
            self._write_lm(pairs[-1], solo.current())
        layout.lm = self._merged_lm(pairs)
        self.stats.check("mlx-lm rollback rebuild")

    def _merged_lm(self, twins: Sequence[Any]) -> tuple[Any, Any]:
        """mlx-lm's ``BatchKVCache`` pair over requests' ``KVCache`` pairs (the index
        twin only where the example has an index plane)."""
        batch: Any = lm_cache().BatchKVCache
        latent = batch.merge([t[0] for t in twins])
        return latent, batch.merge([t[1] for t in twins]) if self.c.index is not None else None

    @precondition(lambda self: self.layout is not None)
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        self.stats.op("decode_step")
        self._step_layout(data.draw(st.integers(1, 3), label="N"), None)
        self._check_layout()

    @precondition(lambda self: self.layout is not None)
    @rule(data=st.data())
    def spec_round(self, data: st.DataObject) -> None:
        self.stats.op("spec_rounds")
        assert self.layout is not None
        n = data.draw(st.integers(2, 4), label="block")
        rows = self.layout.ref.batch_size
        if rows > 1 and data.draw(st.integers(0, 3), label="unequal") > 0:
            keep = [1 + (b * 7 + n) % n for b in range(rows)]  # rows keep different counts
            keep = data.draw(st.permutations(keep), label="keep")
        else:
            keep = [data.draw(st.integers(1, n), label="keep")] * rows
        self._step_layout(n, keep)
        self._check_layout()

    @precondition(lambda self: self.layout is not None)
    @rule(data=st.data())
    def filter_layout(self, data: st.DataObject) -> None:
        self.stats.op("filter")
        layout = self.layout
        assert layout is not None
        rows = list(range(layout.ref.batch_size))
        keep = data.draw(st.permutations(rows), label="order")[
            : data.draw(st.integers(1, len(rows)), label="survivors")
        ]
        layout.ref.filter_rows(keep)
        layout.opt.filter_rows(keep)
        layout.rows = [layout.rows[r] for r in keep]
        if layout.lm is not None:
            pads = [int(p) for p in np.array(layout.lm[0].left_padding)[keep]]
            if min(pads) > 0 and layout.lm[0].keys is None:
                layout.lm = None
            else:
                for twin in layout.lm:
                    if twin is not None:
                        twin.filter(mx.array(keep))
        self._exact("filter drops the common padding", min(layout.ref.left_pad), 0)
        self._check_layout()

    @precondition(lambda self: self.layout is not None and len(self.requests) < 4)
    @rule(data=st.data())
    def extract(self, data: st.DataObject) -> None:
        self.stats.op("extract")
        layout = self.layout
        assert layout is not None
        b = data.draw(st.integers(0, layout.ref.batch_size - 1), label="row")
        request = Request(next(self._ids), layout.ref.extract_row(b), layout.opt.extract_row(b))
        self._same_rows("extract vs solo", request.ref, layout.rows[b].ref, 0)
        if layout.lm is not None and not self.encoded:
            twin = layout.lm[0].extract(b)
            index_twin = layout.lm[1].extract(b) if layout.lm[1] is not None else None
            request.lm = (twin, index_twin if index_twin is not None else self._lm_twins()[1])  # type: ignore[index]
        else:
            request.lm = None
        self.requests.append(request)
        self._check_latent_request(request)
        if data.draw(st.booleans(), label="retire layout"):
            self.layout = None

    @precondition(lambda self: self.layout is not None)
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        self.stats.op("trim")
        layout = self.layout
        assert layout is not None
        n = data.draw(st.integers(0, min(layout.ref.row_offsets)), label="trim")
        self._exact("trim count", (layout.ref.trim(n), layout.opt.trim(n)), (n, n))
        for solo in self._solos(layout):
            solo.trim(n)
        if layout.lm is not None:
            for twin in layout.lm:
                if twin is not None:
                    twin.trim(n)
        self._check_layout()

    @precondition(lambda self: self.layout is not None)
    @rule(data=st.data())
    def trim_rows(self, data: st.DataObject) -> None:
        """Per-row rollback outside a round; half the runs where the layout allows build
        a hard state instead (``machines._build_uneven``)."""
        layout = self.layout
        assert layout is not None
        if self._hard_trim(layout, data):
            return
        self.stats.op("trim_rows")
        offsets = layout.ref.row_offsets
        counts = [data.draw(st.integers(0, t), label=f"count {b}") for b, t in enumerate(offsets)]
        self._trim_rows(layout, counts)

    # -- the hard states' hooks (``machines._build_uneven``): a full-attention latent row
    # rolls back whatever it holds
    def _hard_trims(self, slot: Layout) -> list[str]:
        return self._uneven_rows(slot, lambda tokens: True)

    def _row_lengths(self, slot: Layout) -> list[int]:
        return list(slot.ref.row_offsets)

    def _uneven_joins(self, slot: Layout) -> list[Request]:
        return [r for r in self.requests if r.ref.width >= 1]

    def _join_for_trim(self, slot: Layout, request: Request) -> None:
        self._join(slot, [request])

    def _trim_rows(self, slot: Layout, counts: list[int]) -> None:
        self._note_uneven(slot, counts)
        got = (slot.ref.trim_rows(counts), slot.opt.trim_rows(counts))
        self._exact("trim_rows return (reference, optimized)", got, (max(counts),) * 2)
        for solo, count in zip(self._solos(slot), counts, strict=True):
            if count:
                solo.trim(count)
        if slot.lm is not None:
            self._rebuild_lm(slot)  # mlx-lm has no per-row trim
        self._check_layout()

    def _uneven_block(self, slot: Layout, n: int, data: st.DataObject) -> None:
        room = (self.c.max_tokens or 10**9) - slot.ref.width
        if room < 1:  # a full layout takes no block: the state is not reached
            slot.uneven = False
            return
        self._step_layout(min(n, room), None)
        self._check_layout()
        self._landed(slot)

    @precondition(lambda self: self.cfg is not None and self._invalid_left > 0)
    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """Every bad call raises the same error in both implementations and changes nothing
        (each step tries them all; two such steps per example)."""
        self.stats.op("invalid")
        self._invalid_left -= 1
        target = self.layout if self.layout is not None else None
        if target is None:
            if not self.requests:
                return
            request = data.draw(st.sampled_from(self.requests), label="request")
            ref, opt = request.ref, request.opt
        else:
            ref, opt = target.ref, target.opt
        for label, call in self._bad_cases(ref):
            self._both_refuse(label, call, ref, opt)
            self.stats.check("bad input unchanged")
            self.stats.op(f"bad:{label}")

    def _bad_cases(self, cache: Any) -> list[tuple[str, Callable[[Impl, Any], Any]]]:
        rows = max(1, cache.batch_size)
        c = self.c

        def append(blocks: tuple[Any, ...]) -> Callable[[Impl, Any], Any]:
            def call(impl: Impl, target: Any) -> Any:
                native = [None if b is None else impl.to_native(b) for b in blocks]
                return target.append(*native)

            return call

        good = self._draw_block(self._noise, rows, 1)
        latent, rope, index = good
        assert latent is not None and rope is not None
        dtype = NUMPY_DTYPES[c.dtype]
        wrong_width = (latent[..., :-8], rope, index)
        wrong_rope = (latent, np.zeros((rows, 1, 1, c.rope + 2), dtype), index)
        rank5 = (latent[None], rope[None], None if index is None else index[None])
        other = "float16" if c.dtype != "float16" else "float32"
        wrong_dtype = tuple(None if b is None else b.astype(NUMPY_DTYPES[other]) for b in good)
        dsa = (
            (latent, rope, None)
            if c.index is not None
            else (latent, rope, np.zeros((rows, 1, 1, 16), dtype))
        )
        cases: list[tuple[str, Callable[[Impl, Any], Any]]] = [
            ("latent width", append(wrong_width)),
            ("rope width", append(wrong_rope)),
            ("rank", append(rank5)),
            ("dtype", append(wrong_dtype)),
            ("dsa mismatch", append(dsa)),
            ("trim past shortest", lambda impl, t: t.trim(min(t.row_offsets, default=0) + 1)),
            ("filter duplicate", lambda impl, t: t.filter_rows([0, 0])),
            ("extract out of range", lambda impl, t: t.extract_row(rows)),
            ("rollback without round", lambda impl, t: t.spec_round_rollback(1)),
            # (the reference takes NumPy: a block of no shape; the messages differ)
            ("the other implementation's arrays", lambda i, t: t.append(np.zeros(1), np.zeros(1))),
        ]
        if cache.batch_size:
            more = self._draw_block(self._noise, rows + 1, 1)
            cases.append(("wrong rows", append(more)))
        if c.index is not None and cache.batch_size:
            bad_index = (latent, rope, np.zeros((rows, 1, 1, c.index + 1), dtype))
            cases.append(("index width", append(bad_index)))
        if c.max_tokens is not None:
            n = c.max_tokens - cache.width + 1
            cases.append(("past max_tokens", append(self._draw_block(self._noise, rows, n))))
        if cache.dtype is None:  # the first append chooses the dtype
            cases = [x for x in cases if x[0] != "dtype"]
        return cases

    # -- the operation checks' hooks (``machines.OpsChecks``, composed after these rules:
    # ``hooks.WRITERS["latent"]``): the requests and the running layout leased and saved;
    # a load holds, bit for bit, what the request or each layout row's solo replay reads
    def _ops_targets(self) -> tuple[list[OpsTarget], list[OpsTarget]] | None:
        if self.cfg is None:
            return None
        layouts: list[OpsTarget] = [] if self.layout is None else [self.layout]
        with_rows = [x for x in layouts if x.ref.batch_size]
        return [*self.requests, *layouts], [*with_rows, *self.requests]

    def _snapshot(self, impl: Impl, cache: Any) -> tuple[Any, ...]:
        return self._observed(impl, cache)

    def _state_rows(self, impl: Impl, cache: Any) -> list[tuple[Any, ...]]:
        """The saved form (``LATENT_FIELDS``, then a paged state's block size:
        ``PAGED_LATENT_FIELDS``): its declaration, codec, ``start`` (and block size), then
        each row's offset, converted flag and columns of every plane."""
        state = tuple(cache.state)
        fields, _ = state_fields(type(cache).__name__, state[: len(LATENT_FIELDS)])
        offsets = impl.to_numpy(fields["offset"]).tolist()
        flags = impl.to_numpy(fields["converted"]).tolist()
        planes = [_as_arrays(impl, fields[f]) for f in _STATE_PLANES]
        rows: list[tuple[Any, ...]] = [
            (
                *(None if fields[f] is None else int(fields[f]) for f in _STATE_SCALARS),
                *(int(v) for v in state[len(LATENT_FIELDS) :]),
            )
        ]
        for b, (offset, flag) in enumerate(zip(offsets, flags, strict=True)):
            # right-justified: the row's tokens are its plane's last ``offset`` columns
            columns = (
                None
                if p is None
                else planes_bytes(tuple(a[b : b + 1, :, a.shape[2] - offset :] for a in p))
                for p in planes
            )
            rows.append((offset, flag, *columns))
        return rows

    def _holds_the_rows(self, what: str, item: OpsTarget, pair: tuple[Any, Any]) -> None:
        """Both loads hold the live rows (offsets, converted flags), each row reading what
        its model reads (the request's reference cache; a layout row's solo replay) bit for
        bit. (Their saved forms, stored planes included, are ``_crossed``'s.)"""
        assert isinstance(item, Request | Layout)
        models = [item.ref] if isinstance(item, Request) else [row.ref for row in item.rows]
        for impl, cache in zip((self.ref_impl, self.opt_impl), pair, strict=True):
            name = f"{what} ({impl.name})"
            self._exact(
                f"{name}: row offsets, converted",
                (cache.row_offsets, cache.converted),
                (item.ref.row_offsets, item.ref.converted),
            )
            cache.check_valid()
            reads = (
                [None if a is None else impl.to_numpy(a) for a in cache.current()]
                if cache.width
                else []
            )
            for b, model in enumerate(models):
                if model.width:
                    pad, own = cache.left_pad[b], model.left_pad[0]
                    got = [None if a is None else a[b : b + 1, :, pad:] for a in reads]
                    want = [None if a is None else a[:, :, own:] for a in model.current()]
                    self._same_tensors(f"{name} row {b} vs the model", got, want)

    # -- checks ---------------------------------------------------------------------------
    def _message(self, error: BaseException) -> str:
        """Messages name the cache's class (a mutant's in the teeth tests) and a foreign
        cache's module; the rest must match word for word."""
        text = str(error)
        for impl in (self.ref_impl, self.opt_impl):
            cls = impl.cls(self.spec.name)
            text = text.replace(f"{cls.__module__}.{cls.__qualname__}", "<its class>")
            text = text.replace(cls.__name__, self.spec.name)
        return text

    def _observed(self, impl: Impl, cache: Any) -> tuple[Any, ...]:
        read = cache.current() if cache.width else ()
        return (
            cache.row_offsets,
            cache.left_pad,
            cache.converted,
            tuple(None if a is None else impl.to_numpy(a).tobytes() for a in read),
        )

    def _same_read(
        self, what: str, got_ref: Any, got_opt: Any, pads: tuple[int, ...] | None = None
    ) -> None:
        """Both reads agree on every row's visible columns (padding is unspecified: the
        optimized rollback leaves rolled-out tokens there, hidden by the mask)."""
        for name, r, o in zip(_TENSORS, got_ref, got_opt, strict=True):
            if r is None or o is None:
                self._exact(f"{what} {name} presence", o is None, r is None)
                continue
            held = from_mlx(o)
            self._exact(f"{what} {name} shape", held.shape, r.shape)
            for b, pad in enumerate(pads or (0,) * r.shape[0]):
                self._same_latent(f"{what} {name} row {b}", held[b, :, pad:], r[b, :, pad:])
        self.stats.check("reference")

    def _check_latent_request(self, request: Request) -> None:
        ref, opt = request.ref, request.opt
        self._same_state("request", ref, opt)
        if ref.width and request.lm is not None and not self.encoded:
            twin, index_twin = request.lm
            self._exact("mlx-lm offset", int(twin.offset), ref.width)
            held = (twin.keys, twin.values, index_twin.keys)
            ends = (twin.offset, twin.offset, index_twin.offset)
            lm = [
                None if a is None else from_mlx(a[:, :, :end])
                for a, end in zip(held, ends, strict=True)
            ]
            self._same_tensors("mlx-lm", lm, ref.current())
            self.stats.check("mlx-lm")

    def _same_latent(self, what: str, got: Array, want: Array) -> None:
        """Byte-exact: the decoded latent too (the TurboQuant decode of both implementations
        agrees bit for bit; the deep profile never saw a difference)."""
        self._same_arrays("latent", what, got, want, exact=True)

    def _same_tensors(
        self, what: str, got: Sequence[Array | None], want: Sequence[Array | None]
    ) -> None:
        """Tensor by tensor (latent, rope, index), byte-exact where ``want`` holds one."""
        for name, mine, theirs in zip(_TENSORS, got, want, strict=True):
            if theirs is not None:
                assert mine is not None, f"{what} {name}: missing"
                self._same_latent(f"{what} {name}", mine, theirs)

    def _same_state(self, what: str, ref: Any, opt: Any) -> None:
        self._exact(f"{what} row offsets", opt.row_offsets, ref.row_offsets)
        self._exact(f"{what} left pad", opt.left_pad, ref.left_pad)
        self._exact(f"{what} converted", opt.converted, ref.converted)
        self._exact(f"{what} signature", opt.signature(), ref.signature())
        self._exact(f"{what} bytes per token", opt.bytes_per_token(), ref.bytes_per_token())
        ref.check_valid()
        opt.check_valid()
        if not ref.width:
            return
        self._same_read(what, ref.current(), opt.current(), ref.left_pad)
        self._same_stored_planes(what, ref, opt)
        n = 2
        mask_ref = np.asarray(ref.make_mask(n, return_array=True))
        mask_opt = from_mlx(opt.make_mask(n, return_array=True))
        self._exact(f"{what} mask", mask_opt.tolist(), mask_ref.tolist())

    def _same_stored_planes(self, what: str, ref: Any, opt: Any) -> None:
        """The stored planes (codec planes, rope, index), row by row over each row's
        columns, bit-exact."""
        opt_planes, opt_rope, opt_index, _ = opt.planes()
        for b, (planes, rope, index, _) in enumerate(ref.planes()):
            if rope is None:
                continue
            pad = opt.left_pad[b]
            pairs = [*zip(planes, opt_planes, strict=True), (rope, opt_rope)]
            if index is not None:
                pairs.append((index, opt_index))
            for p_ref, p_opt in pairs:
                held = from_mlx(p_opt[b : b + 1, :, pad:])
                self._exact(f"{what} row {b} stored plane", held.tobytes(), p_ref.tobytes())
        self.stats.check("planes")

    def _same_rows(self, what: str, got: Any, solo: Any, b: int) -> None:
        self._exact(f"{what} width", got.width, solo.width)
        if solo.width:
            self._exact(f"{what} converted", got.converted, solo.converted)
            self._same_tensors(what, got.current(), solo.current())
        self.stats.check("solo")

    def _check_layout(self) -> None:
        layout = self.layout
        assert layout is not None
        ref, opt = layout.ref, layout.opt
        self._same_state("layout", ref, opt)
        self._exact("layout solos", len(layout.rows), ref.batch_size)
        if not ref.width:
            return
        if any(ref.converted) and not all(ref.converted):
            self.stats.check("mixed conversion")  # rows reading exact beside encoded ones
        reads = ref.current()
        for b, solo in enumerate(self._solos(layout)):
            pad = ref.left_pad[b]
            self._exact(f"row {b} offset vs solo", ref.row_offsets[b], solo.width)
            self._exact(
                f"row {b} converted vs solo", ref.converted[b], (solo.converted or (False,))[0]
            )
            if solo.width:
                row = [None if a is None else a[b : b + 1, :, pad:] for a in reads]
                self._same_tensors(f"row {b} vs solo", row, solo.current())
        self.stats.check("solo")
        if layout.lm is not None:
            twin, index_twin = layout.lm
            self._exact(
                "mlx-lm left padding",
                [int(p) for p in np.array(twin.left_padding)],
                list(ref.left_pad),
            )
            self._exact("mlx-lm write column", int(twin._idx), ref.width)
            held = (twin.keys, twin.values, None if index_twin is None else index_twin.keys)
            ends = (twin._idx, twin._idx, None if index_twin is None else index_twin._idx)
            for b in range(ref.batch_size):
                pad = ref.left_pad[b]
                lm = [None if a is None else from_mlx(a[b : b + 1, :, pad:end])
                      for a, end in zip(held, ends, strict=True)]  # fmt: skip
                row = [None if a is None else a[b : b + 1, :, pad:] for a in reads]
                self._same_tensors(f"mlx-lm row {b}", lm, row)
            self.stats.check("mlx-lm")


def _as_arrays(impl: Impl, value: Any) -> tuple[Array, ...] | None:
    """A saved or read tensor (a codec's planes: several arrays) as NumPy arrays."""
    if value is None:
        return None
    return tuple(impl.to_numpy(a) for a in (value if isinstance(value, tuple | list) else (value,)))
