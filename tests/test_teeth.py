"""The conformance suite has teeth: planted bugs in the optimized layouts are caught.

Each mutant is a subclass of an optimized layout that wraps one method and plants
one bug in it (marked ``# MUTATION``), touching as little of the layout's
internals as it can so the mutants survive refactors of the real code. The state machine runs
against it with the ``teeth`` profile (derandomized, a modest budget, no
shrinking) and must fail with an oracle's ``AssertionError``; the unmutated
implementation must pass the same budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx
import pytest
from conformance_helpers import caught, run_teeth

from kvrows.codec import PlaneSet, Role
from kvrows.conformance.families import optimized_impl
from kvrows.conversion import Conversion
from kvrows.delayed import GroupAttend, RowAttentionPending
from kvrows.errors import NotTrimmableError
from kvrows.optimized import turbo_codec as optimized_turbo
from kvrows.optimized.attention import attend as optimized_attend
from kvrows.optimized.classes import (
    BatchedKVCache,
    BatchedQuantizedKVCache,
    BatchedTurboQuantKVCache,
    DelayedQuantizedKVCache,
    DelayedRotatingQuantizedKVCache,
    DelayedTurboQuantKVCache,
    PaddedKVRows,
    PaddedQuantKVRows,
    QuantizedKVCache,
    SpeculativeRotatingKVCache,
)
from kvrows.optimized.classes import BatchedRotatingCache as RingBatchedRotatingCache
from kvrows.optimized.codecs import TurboCodec, host_attention
from kvrows.optimized.paged import PagedRotatingRows
from kvrows.optimized.rows import Serial, mapped, row_of, token_count
from kvrows.protocols import Cache, Mask
from kvrows.schemes import CodecSpec, GeometrySpec, Turbo
from kvrows.validation import KvGeometry, as_count, check_keep

pytestmark = pytest.mark.usefixtures("cpu_stream")


class FilterOffByOne(PaddedKVRows):
    """Drops one column fewer than the survivors' shared padding: the pads are right, but
    the origin lands one column left, so every survivor reads one column too early."""

    def filter_rows(self, keep: Sequence[int]) -> None:
        order = check_keep(keep, self.batch_size)
        shared = min((self.left_pad[i] for i in order), default=0)
        super().filter_rows(keep)
        if shared:
            self._origin -= 1  # MUTATION (the origin should move by `shared`, not `shared - 1`)


class MergeMissesLastRow(PaddedKVRows):
    """A merge of several rows never writes the last incoming row's tokens (its slot keeps
    whatever the buffer held); the metadata is right."""

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        before = self.batch_size
        super().merge_rows(rows)
        last = self.batch_size - 1
        if self.batch_size - before >= 2 and self._planes is not None:
            start = self._origin + self.left_pad[last]
            stop = start + self.row_offsets[last]
            if stop > start:
                for plane in self.held_arrays():
                    # MUTATION (these columns should hold the row's tokens)
                    plane[last : last + 1, :, start:stop] = mx.zeros_like(
                        plane[last : last + 1, :, start:stop]
                    )


class DecodeMaskIgnoresPadding(PaddedKVRows):
    """At N = 1 the mask is the serial one (None): rows attend their own left padding."""

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        if as_count(n, "n", minimum=1) == 1 and not return_array and window_size is None:
            return None  # MUTATION (None only when no row is padded)
        return super().make_mask(n, return_array=return_array, window_size=window_size)


class MaskCachedAcrossJoins(PaddedKVRows):
    """Masks are cached until the next step, so a join or a filter leaves them stale."""

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        cache: dict[tuple[int, bool, int | None], Mask] = self.__dict__.setdefault("_masks", {})
        key = (n, return_array, window_size)
        if key not in cache:
            cache[key] = super().make_mask(n, return_array=return_array, window_size=window_size)
        return cache[key]

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        super().merge_rows(rows)  # MUTATION (a join must clear the cached masks too)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.__dict__["_masks"] = {}
        return super().update_and_fetch(keys, values)


class RollbackOffByOne(BatchedKVCache):
    """Per-row rollback forgets one token fewer than asked for every row after the first."""

    def trim_rows(self, counts: Sequence[int]) -> int:
        if isinstance(counts, Sequence) and not isinstance(counts, str | bytes):
            shifted = [
                c - 1 if b and isinstance(c, int) and c > 0 else c  # MUTATION (was: c)
                for b, c in enumerate(counts)
            ]
            super().trim_rows(shifted)
            return max((int(c) for c in counts), default=0)
        return super().trim_rows(counts)


MUTANTS = [
    pytest.param("PaddedKVRows", FilterOffByOne, id="filter-padding-off-by-one"),
    pytest.param("PaddedKVRows", MergeMissesLastRow, id="merge-misses-last-row"),
    pytest.param("PaddedKVRows", DecodeMaskIgnoresPadding, id="decode-mask-ignores-padding"),
    pytest.param("PaddedKVRows", MaskCachedAcrossJoins, id="mask-stale-after-join"),
    pytest.param("BatchedKVCache", RollbackOffByOne, id="ragged-rollback-off-by-one"),
]


#: The unmutated controls: the same machine with the real classes must pass. The family
#: tests (tests/test_conformance*.py) run this machine class on these layouts with the full
#: CI budget, so a control only has to show the teeth configuration is not failing by
#: itself: a short run.
CONTROL_EXAMPLES = 3


#: Mutants the teeth profile's derandomized examples miss, and a budget whose examples
#: catch them (Hypothesis draws other examples for another ``max_examples``).
MUTANT_EXAMPLES: dict[type, int] = {FilterOffByOne: 150}


@pytest.mark.parametrize(("layout", "mutant"), MUTANTS)
def test_the_machine_catches(layout: str, mutant: type) -> None:
    caught(layout, mutant, MUTANT_EXAMPLES.get(mutant))


#: The (family, layout) machines the controls run with the real classes: every one a
#: mutant above or below plants its bug in (delayed-turbo's control checks more, below).
CONTROLS = [
    ("plain", "PaddedKVRows"),
    ("plain", "BatchedKVCache"),
    ("affine", "PaddedQuantKVRows"),
    ("affine", "BatchedQuantizedKVCache"),
    ("rotating", "BatchedRotatingCache"),
    ("speculative", "BatchedKVCache"),
    ("speculative", "SpeculativeRotatingKVCache"),
    ("delayed", "DelayedQuantizedKVCache"),
    ("delayed", "DelayedRotatingQuantizedKVCache"),
    ("paged-rotating", "PagedRotatingRows"),
]


@pytest.mark.parametrize(("family", "layout"), CONTROLS)
def test_the_unmutated_implementation_passes(family: str, layout: str) -> None:
    assert run_teeth(layout, None, CONTROL_EXAMPLES, family).examples > 0


# ------------------------------------------------------------------ affine family


class MergeZeroesKeyBiases(BatchedQuantizedKVCache):
    """Merged rows keep their key codes and scales, but their key biases are written as
    zeros (one plane of the triple lost on the way in)."""

    def merge_rows(self, rows: Sequence[Cache]) -> None:
        before = self.batch_size
        super().merge_rows(rows)
        if self._planes is None:
            return
        biases = self._planes["keys"][2]
        for b in range(before, self.batch_size):
            start = self._origin + self.left_pad[b]
            stop = start + self.row_offsets[b]
            if stop > start:
                # MUTATION (these columns should hold the row's key biases)
                biases[b : b + 1, :, start:stop] = mx.zeros_like(biases[b : b + 1, :, start:stop])


class ExtractRequantizes(PaddedQuantKVRows):
    """An extracted row is dequantized and quantized again: the values look the same, but
    re-quantizing is not the identity on codes, scales and biases."""

    def extract_row(self, row: int) -> Serial:
        cache = super().extract_row(row)
        assert isinstance(cache, QuantizedKVCache)
        held = cache.planes()
        if held is None:
            return cache

        def again(planes: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
            packed, scales, biases = planes
            dense = mx.dequantize(
                packed, scales, biases, group_size=self.group_size, bits=self.bits
            )
            # MUTATION (row operations must move codes, never re-quantize)
            return tuple(mx.quantize(dense, group_size=self.group_size, bits=self.bits))

        fresh = QuantizedKVCache(self.group_size, self.bits)
        planes = {"keys": again(held[0]), "values": again(held[1])}
        return fresh.adopt(planes, cache.offset, cache.geometry)


AFFINE_MUTANTS = [
    pytest.param("BatchedQuantizedKVCache", MergeZeroesKeyBiases, id="merge-zeroes-key-biases"),
    pytest.param("PaddedQuantKVRows", ExtractRequantizes, id="extract-requantizes"),
]


@pytest.mark.parametrize(("layout", "mutant"), AFFINE_MUTANTS)
def test_the_affine_machine_catches(layout: str, mutant: type) -> None:
    message = caught(layout, mutant, family_name="affine")
    # The oracle that must catch these: the exact comparison of stored or fetched triples.
    assert "differs beyond exact" in message


# ------------------------------------------------------------ rotating family (rings)


class RingMaskRolledShort(RingBatchedRotatingCache):
    """Once the ring wraps, the one-token mask is rolled by ``idx`` instead of ``idx + 1``:
    every row's visible columns land one column early (on the token being overwritten)."""

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        mask = super().make_mask(n, return_array=return_array, window_size=window_size)
        idx, _, rotated = self.ring_state
        if as_count(n, "n", minimum=1) == 1 and (rotated or idx >= self.max_size):
            assert isinstance(mask, mx.array)
            return mx.roll(mask, -1, -1)  # MUTATION (the roll is idx + 1)
        return mask


class RingExtractsTheOldestWindow(RingBatchedRotatingCache):
    """A row's window (what ``extract_row`` and joins read) is its *oldest* ``min(offset,
    max_size)`` retained tokens, not the newest: wrong right after a block, when the
    buffer holds more than the window (semantics bug 9.2.6 of the seed engine)."""

    def _window(self, planes: PlaneSet, row: int | None) -> PlaneSet | None:
        held = super()._window(planes, row)
        if held is None or row is None:
            return held
        ordered = self._chronological(row_of(planes, row))
        start, count = max(0, self.left_pad[row]), token_count(held)
        # MUTATION (the window is the newest `count` columns, not the first)
        return mapped(ordered, lambda p: p[:, :, start : start + count])


class RingBlockMaskFromStaleIndex(RingBatchedRotatingCache):
    """mlx-lm's B9 planted back: a block on a wrapped ring masks with pads the block's
    trim did not move (as if the ring had not wrapped), hiding short rows' oldest token."""

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Mask:
        mask = super().make_mask(n, return_array=return_array, window_size=window_size)
        if as_count(n, "n", minimum=1) > 1 and self.ring_state[2] and isinstance(mask, mx.array):
            # MUTATION (a short row's pad one column too far: its oldest column hidden)
            oldest = mx.argmax(mask[:, 0, 0, :], axis=-1)
            short = mx.array([p > 0 for p in self.left_pad])
            columns = mx.arange(mask.shape[-1])[None, :]
            hidden = (columns == oldest[:, None]) & short[:, None]
            mask = mask & ~hidden[:, None, None, :]
        return mask


class RingTimeOrderRolled(RingBatchedRotatingCache):
    """The ordered form's time-ordered read (a slice of its window, issue 28) comes back
    rolled by one column: the newest token first. The physical read, the masks and the
    windows stay right; only attention in time order would sum another order."""

    def reads_in_time_order(self, keys: Any, values: Any, mask: Any) -> tuple[Any, Any, Any]:
        timed_keys, timed_values, mask = super().reads_in_time_order(keys, values, mask)
        if not self.time_ordered:
            return timed_keys, timed_values, mask

        def rolled(read: Any) -> Any:  # MUTATION (the slice is already in time order)
            if isinstance(read, tuple):
                return tuple(mx.roll(p, 1, 2) for p in read)
            return mx.roll(read, 1, 2)

        return rolled(timed_keys), rolled(timed_values), mask


RING_MUTANTS = [
    pytest.param(RingMaskRolledShort, id="ring-mask-rolled-short"),
    pytest.param(RingTimeOrderRolled, id="ring-time-order-rolled"),
    pytest.param(RingExtractsTheOldestWindow, id="ring-extracts-the-oldest-window"),
    pytest.param(RingBlockMaskFromStaleIndex, id="ring-block-mask-b9"),
]


#: The b9 state (a block on a wrapped ring holding a short row) is built on purpose
#: (``machines._build_wrapped``): its mutant is caught by the 5th example (it was the 50th
#: of 90 while free draws had to reach it); the room keeps a small draw change from losing it.
RING_MUTANT_EXAMPLES: dict[type, int] = {RingBlockMaskFromStaleIndex: 20}


@pytest.mark.parametrize("mutant", RING_MUTANTS)
def test_the_ring_machine_catches(mutant: type) -> None:
    caught("BatchedRotatingCache", mutant, RING_MUTANT_EXAMPLES.get(mutant), family_name="rotating")


# ------------------------------------- the gaps issue 8 closed (in the base machine)


class ExtractReadsTheLayout(PaddedKVRows):
    """An extracted row still reads the layout's buffer (a view, not its own arrays): the
    layout's next steps show through it."""

    def extract_row(self, row: int) -> Serial:
        cache = super().extract_row(row)
        layout = self

        def planes() -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]] | None:
            # MUTATION (an extracted row must own its arrays)
            return layout.row_planes(row) if row < layout.batch_size else cache_planes()

        cache_planes = cache.planes
        cache.planes = planes  # type: ignore[method-assign]
        return cache


class RingWritesTheCallersBlock(RingBatchedRotatingCache):
    """The ring keeps the caller's block instead of its own copy, so the next one-token
    step writes into the caller's ``keys`` (the bug issue 8 found in the serial ring)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = super().update_and_fetch(keys, values)
        kept = self.__dict__.get("_kept")
        if int(keys.shape[2]) > 1:
            self.__dict__["_kept"] = (keys, values)
        elif kept is not None and kept[0].shape[0] == keys.shape[0]:
            kept[0][:, :, :1] = keys  # MUTATION (the ring must write its own buffer only)
        return out


class ProjectedBytesIgnoreTheWindow(RingBatchedRotatingCache):
    """Admission counts every token of a row, not the ``max_size`` the ring keeps."""

    def projected_bytes(self, tokens: int) -> int:
        per_token = super().projected_bytes(1)
        return per_token * as_count(tokens, "tokens")  # MUTATION (min(tokens, max_size))


def _upcast_quantized(queries: mx.array, cache: Cache, mask: Mask, scale: float) -> mx.array:
    """Quantized attention that returns float32 whatever the queries' dtype."""
    out = optimized_attend(queries, cache, mask, scale)
    if getattr(cache, "bits", None):
        return out.astype(mx.float32)  # MUTATION (attention returns the queries' dtype)
    return out


GAP_MUTANTS = [
    pytest.param(
        "plain",
        "PaddedKVRows",
        ExtractReadsTheLayout,
        "changed while",
        id="extract-aliases-the-layout",
    ),
    pytest.param(
        "rotating",
        "BatchedRotatingCache",
        RingWritesTheCallersBlock,
        "changed an input array",
        id="ring-keeps-the-callers-block",
    ),
    pytest.param(
        "rotating",
        "BatchedRotatingCache",
        ProjectedBytesIgnoreTheWindow,
        "projected_bytes",
        id="projected-bytes-ignore-the-window",
    ),
]


@pytest.mark.parametrize(("family", "layout", "mutant", "oracle"), GAP_MUTANTS)
def test_the_gap_checks_catch(family: str, layout: str, mutant: type, oracle: str) -> None:
    message = caught(layout, mutant, family_name=family)
    assert oracle in message, message


def test_the_dtype_check_catches_float32_attention() -> None:
    optimized = replace(optimized_impl(), attend=_upcast_quantized)
    with pytest.raises(AssertionError) as caught:
        run_teeth(
            "PaddedQuantKVRows",
            None,
            None,
            "affine",
            optimized=optimized,
            name="TeethAttentionUpcasts",
        )
    assert "attention dtype" in str(caught.value), str(caught.value)


def test_the_role_check_catches_a_wrong_verify_layout() -> None:
    """The optimized table sends BatchedRotatingQuantCache's rows to verify in their own
    decode layout instead of RotatingAffineLayout (the one role that differs)."""
    import kvrows.optimized as O
    from kvrows import table

    entry = next(e for e in table.registered_entries() if e.storage is O.BatchedRotatingQuantCache)
    table.register_row_layouts(
        O.BatchedRotatingQuantCache,
        decode=entry.decode,
        prefill=entry.prefill,
        verify=entry.decode,  # MUTATION (the composition table says RotatingAffineLayout)
    )
    try:
        with pytest.raises(AssertionError) as caught:
            run_teeth(
                "BatchedRotatingQuantCache", None, None, "rotating", name="TeethWrongVerifyRole"
            )
    finally:
        table.register_row_layouts(
            O.BatchedRotatingQuantCache,
            decode=entry.decode,
            prefill=entry.prefill,
            verify=entry.verify,
        )
    assert "the table's verify layout" in str(caught.value), str(caught.value)


# ------------------------------------------------------ speculative family (verify rounds)


class RollbackLeaksARejectedToken(BatchedKVCache):
    """A round's rollback forgets one rejected token fewer on the last row that rejected
    any: that row keeps a draft the target model refused."""

    def _spec_forget(self, counts: Sequence[int]) -> None:
        leaked = list(counts)
        last = max((b for b, count in enumerate(leaked) if count), default=None)
        if last is not None:
            leaked[last] -= 1  # MUTATION (every rejected token must be forgotten)
        super()._spec_forget(leaked)


class RingRollbackRefusedPastTheWindow(SpeculativeRotatingKVCache):
    """The ragged ring's old rule: a row that has reached its window refuses to roll back,
    so a round that crosses the window cannot reject a draft."""

    def _check_trim(self, counts: Sequence[int]) -> None:
        for count, offset in zip(counts, self.row_offsets, strict=True):
            if count and offset >= self.max_size:
                # MUTATION (a verify block keeps max_size - 1 history tokens: it may roll back)
                raise NotTrimmableError("a wrapped ring row cannot be trimmed")
        super()._check_trim(counts)


class RingRollbackLosesAWindowToken(SpeculativeRotatingKVCache):
    """A rollback on a row that has reached its window also forgets its oldest retained
    token: the row's window comes back one token short."""

    def _forget(self, counts: Sequence[int], *, justify: bool = False) -> None:
        super()._forget(counts, justify=justify)
        self._retained = [
            held - 1 if count and offset >= self.max_size and held else held  # MUTATION
            for held, count, offset in zip(self._retained, counts, self.row_offsets, strict=True)
        ]


class RingProposalDropsTheOldest(SpeculativeRotatingKVCache):
    """A proposal round's single tokens evict as outside one (issue 28): a row past its
    window drops its oldest token, so the discard cannot give the window back."""

    def _spec_hold(self, on: bool) -> None:
        super()._spec_hold(False)  # MUTATION (a held ring drops nothing)


class RingCompactsEveryDrop(SpeculativeRotatingKVCache):
    """The ragged ring's old layout (issue 28): every drop slides the rows to column 0,
    so each verify round on a full ring copies the whole layout, and the rows no longer
    stand at the columns the spec's rule puts them."""

    @property
    def _slack(self) -> int:
        return 0  # MUTATION (a contiguous ring without sinks keeps min(256, max_size))


SPECULATIVE_MUTANTS = [
    pytest.param("BatchedKVCache", RollbackLeaksARejectedToken, id="rollback-leaks-a-draft"),
    pytest.param(
        "SpeculativeRotatingKVCache", RingCompactsEveryDrop, id="ring-compacts-every-drop"
    ),
    pytest.param(
        "SpeculativeRotatingKVCache",
        RingProposalDropsTheOldest,
        id="ring-proposal-drops-the-oldest",
    ),
    pytest.param(
        "SpeculativeRotatingKVCache",
        RingRollbackRefusedPastTheWindow,
        id="ring-rollback-refused-past-the-window",
    ),
    pytest.param(
        "SpeculativeRotatingKVCache",
        RingRollbackLosesAWindowToken,
        id="ring-rollback-loses-a-window-token",
    ),
]


class PagedRingProposalFreesBlocks(PagedRotatingRows):
    """A paged ring held by a proposal round still drops what a single token evicts and
    frees its block (issue 28): the discard cannot give the window back."""

    def _spec_hold(self, on: bool) -> None:
        super()._spec_hold(False)  # MUTATION (a held paged ring row drops nothing)


def test_the_paged_ring_machine_catches_a_proposal_that_frees_blocks() -> None:
    message = caught(
        "PagedRotatingRows", PagedRingProposalFreesBlocks, family_name="paged-rotating"
    )
    assert "proposal" in message, message


@pytest.mark.parametrize(("layout", "mutant"), SPECULATIVE_MUTANTS)
def test_the_speculative_machine_catches(layout: str, mutant: type) -> None:
    message = caught(layout, mutant, family_name="speculative")
    if mutant is RingRollbackRefusedPastTheWindow:
        # A valid rollback that raises is the machine's failure, not the mutant's crash.
        assert "resolving a round" in message or "discarding a proposal" in message, message


# ------------------------------------------- delayed family (rows that convert at start)


class ConversionOneTokenEarly(Conversion):
    def row_due(self, offset: int) -> bool:
        return offset >= self.start - 1 and offset != 0  # MUTATION (the rule is offset >= start)


class ConvertsOneTokenEarly(DelayedQuantizedKVCache):
    """A row converts at the boundary where its offset reaches ``start - 1``."""

    conversion_class = ConversionOneTokenEarly


class RingConvertsOneTokenEarly(DelayedRotatingQuantizedKVCache):
    """A ring row converts at the boundary where its offset reaches ``start - 1``."""

    conversion_class = ConversionOneTokenEarly


class ConvertsInsideAProposalRound(DelayedQuantizedKVCache):
    """A proposal's append converts the rows it carries past ``start`` (issue 28): the
    discard then leaves them converted below it."""

    def _convert_due(self) -> None:
        if self._spec_proposing:  # MUTATION (nothing converts inside a round)
            self._convert(self._conversion.due(self._record_offsets()))
            return
        super()._convert_due()


DELAYED_MUTANTS = [
    pytest.param("DelayedQuantizedKVCache", ConvertsOneTokenEarly, id="converts-one-token-early"),
    pytest.param(
        "DelayedRotatingQuantizedKVCache",
        RingConvertsOneTokenEarly,
        id="ring-converts-one-token-early",
    ),
    pytest.param(
        "DelayedQuantizedKVCache",
        ConvertsInsideAProposalRound,
        id="converts-inside-a-proposal-round",
    ),
]


@pytest.mark.parametrize(("layout", "mutant"), DELAYED_MUTANTS)
def test_the_delayed_machine_catches(layout: str, mutant: type) -> None:
    message = caught(layout, mutant, family_name="delayed")
    # Caught by the conversion oracles (converted_at / a row's codec), not by a crash.
    assert "convert" in message, message


# ---------------------------------------------------- turbo family (TurboQuant codec)


def _flip_first(dim: int) -> mx.array:
    """``+1`` everywhere but ``-1`` at entry 0: the sign vector times this one is the
    sign vector with its first entry wrong."""
    return mx.concatenate([mx.array([-1.0]), mx.ones((dim - 1,))]).astype(mx.float32)


class WrongSignCodec(TurboCodec):
    """The value rotation's sign vector has one wrong entry, in the encoder and in the
    un-rotation alike: the round trip is right (deferred attention still equals eager), but
    the stored value codes are not the reference's."""

    def encode(self, block: Any, role: Role = "keys") -> tuple[mx.array, ...]:
        if role == "values":
            block = block.astype(mx.float32) * _flip_first(int(block.shape[-1]))  # MUTATION
        return super().encode(block, role)

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        out = super().attend(queries, keys, values, mask, scale)
        return out * _flip_first(int(out.shape[-1])).astype(out.dtype)  # MUTATION


def _left_rotated(
    codec: Any, queries: Any, keys: Any, values: Any, mask: Any, scale: float
) -> mx.array:
    """Attention over a TurboQuant read's keys and still-rotated values, the output left in
    the rotated basis (what a missing un-rotation computes)."""
    decoded = codec.decode(keys, "keys")
    rotated = optimized_turbo.rotated_values(values[0], values[1], codec.v_bits)
    return mx.fast.scaled_dot_product_attention(
        queries,
        decoded.astype(queries.dtype),
        rotated.astype(queries.dtype),
        scale=scale,
        mask=mask,
    )


class SkipsUnrotationCodec(TurboCodec):
    """Deferred-V attention returns the output still in the rotated basis."""

    def attend(self, queries: Any, keys: Any, values: Any, mask: Any, scale: float) -> Any:
        # MUTATION (the output is not un-rotated)
        return _left_rotated(self, queries, keys, values, mask, scale)


def _turbo_layout_with(codec: type[TurboCodec]) -> type[BatchedTurboQuantKVCache]:
    """The optimized TurboQuant layout encoding and attending with ``codec``."""

    class Mutant(BatchedTurboQuantKVCache):
        def _setup(
            self, codec_spec: CodecSpec, token_geometry: GeometrySpec, geometry: KvGeometry | None
        ) -> None:
            super()._setup(codec_spec, token_geometry, geometry)
            assert isinstance(codec_spec, Turbo)
            self.codec = codec(codec_spec)

    Mutant.__name__ = Mutant.__qualname__ = f"BatchedTurboQuantKVCacheWith{codec.__name__}"
    return Mutant


TURBO_MUTANTS = [
    pytest.param(WrongSignCodec, "differs beyond exact", id="wrong-sign-entry"),
    pytest.param(SkipsUnrotationCodec, "attention differs beyond", id="skips-unrotation"),
]


@pytest.mark.parametrize(("codec", "oracle"), TURBO_MUTANTS)
def test_the_turbo_machine_catches(codec: type[TurboCodec], oracle: str) -> None:
    message = caught("BatchedTurboQuantKVCache", _turbo_layout_with(codec), family_name="turbo")
    # Caught by the oracle that must catch it: the wrong sign by the exact stored or read
    # (its round trip is right), the missing un-rotation by attention vs the reference.
    assert oracle in message, message


# ------------------------------------ delayed-turbo family (rows that convert to TurboQuant)


class MixedReadSkipsUnrotation(DelayedTurboQuantKVCache):
    """A mixed read attends the TurboQuant group's rows over their rotated values and never
    un-rotates that group's output (plain groups, plain and packed reads are right)."""

    def attend_rows(
        self,
        queries: Any,
        scale: float,
        attend: GroupAttend | None = None,
        pending: RowAttentionPending | None = None,
    ) -> Any:
        def group_attend(
            rows_queries: Any, group: Any, keys: Any, values: Any, mask: Any, scale: float
        ) -> Any:
            if group.codec.defers_values:  # MUTATION (not un-rotated)
                return _left_rotated(group.codec, rows_queries, keys, values, mask, scale)
            return (attend or _plain_group_attend)(rows_queries, group, keys, values, mask, scale)

        return super().attend_rows(queries, scale, group_attend, pending)


def _plain_group_attend(
    queries: Any, group: Any, keys: Any, values: Any, mask: Any, scale: float
) -> Any:
    return group.codec.attend(queries, keys, values, mask, scale)


def test_the_delayed_turbo_machine_catches_a_mixed_read_without_unrotation() -> None:
    message = caught(
        "DelayedTurboQuantKVCache", MixedReadSkipsUnrotation, family_name="delayed-turbo"
    )
    # Caught on a mixed read's attention (vs the reference), not by a crash.
    assert "(mixed)" in message and "attention differs" in message, message


def test_the_unmutated_delayed_turbo_implementation_passes() -> None:
    # The family test runs this machine in full: a short control.
    stats = run_teeth("DelayedTurboQuantKVCache", None, CONTROL_EXAMPLES, "delayed-turbo")
    assert stats.examples > 0 and stats.checks["mixed read"] > 0, dict(stats.checks)


# ------------------------------------------- the CPU's host attention path (any family)


def _host_path_ignores_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    # MUTATION (every column visible to every query: padding and the future included)
    monkeypatch.setattr(host_attention, "_visible", lambda mask, n, columns: None)


def _host_keys_without_zero_points(monkeypatch: pytest.MonkeyPatch) -> None:
    real = optimized_turbo.host_key_rows

    def rows(codes: mx.array, scales: mx.array, zeros: mx.array, bits: int) -> Any:
        # MUTATION (the keys decoded as idx·scale: the zero point dropped)
        return real(codes, scales, mx.zeros_like(zeros), bits)

    monkeypatch.setattr(optimized_turbo, "host_key_rows", rows)


HOST_MUTANTS = [
    pytest.param("affine", "BatchedQuantizedKVCache", _host_path_ignores_masks,
                 id="host-path-ignores-masks"),
    pytest.param("turbo", "BatchedTurboQuantKVCache", _host_keys_without_zero_points,
                 id="host-keys-without-zero-points"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "layout", "mutate"), HOST_MUTANTS)
def test_the_machines_catch_a_wrong_host_path(
    family: str, layout: str, mutate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The examples on the host path (the CPU's default; the others take the MLX ops)
    compare its attention with the reference's: a wrong host path is caught there."""
    mutate(monkeypatch)
    implementation = optimized_impl().cls(layout)
    message = caught(layout, implementation, family_name=family)
    assert "attention differs beyond" in message, message
