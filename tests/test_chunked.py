"""Chunked-local attention (``spec/ChunkedKVCache.md``): mlx-lm's ``ChunkedKVCache`` inside
mlx-lm's llama4 as the parity oracle, the ``chunked`` conformance family (reference vs
optimized vs each row's solo replay), the surface, saved states and the engine's batch
against each request's solo run."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from conformance_helpers import (
    BASE_QUANTITIES,
    OPS_CHECKED,
    ROW_OPS,
    assert_compared,
    caught,
    run_family,
    run_teeth,
)
from mlx_lm.models import cache as lm_cache

import kvrows.optimized as kv
import kvrows.reference as ref
from kvrows.app.demo import check_invariance
from kvrows.app.engine import Engine, Request
from kvrows.app.models import draft_model, forward, make_kvrows_cache, tiny_model
from kvrows.conformance.families import FAMILIES
from kvrows.conformance.machines import BASE_CHECKS
from kvrows.delayed import row_reads
from kvrows.errors import InvalidInputError, NotTrimmableError
from kvrows.geometries.chunked import Chunked
from kvrows.optimized.geometries.growing import GrowingGeometry
from kvrows.schemes import KvStorageScheme

pytestmark = pytest.mark.usefixtures("cpu_stream")

CHUNK = 8  # the tiny llama4's attention_chunk_size


@pytest.fixture(scope="module")
def llama4() -> Any:
    return tiny_model("llama4")


def _block(seed: int, rows: int, n: int, dim: int = 16) -> mx.array:
    return mx.array(np.random.default_rng(seed).standard_normal((rows, 2, n, dim)), mx.float32)


# -- parity with mlx-lm's ChunkedKVCache inside llama4 ---------------------------------------


def test_llama4_logits_and_state_are_mlx_lm_s_bit_for_bit(llama4: Any) -> None:
    """The same prompt chunks, decode steps and rollbacks through mlx-lm's caches and
    kvrows': logits identical, and each chunked layer's held keys, offset and
    start_position identical (mlx-lm trims only in ``maybe_trim_front``, which llama4
    calls before every forward; kvrows also trims before each append)."""
    theirs = llama4.make_cache()
    ours = make_kvrows_cache(llama4)
    assert [type(c).__name__ for c in ours] == [type(c).__name__ for c in theirs]
    chunks = [list(range(1, 12)), [3], [4], [5, 6, 7], [8], [9] * 10, [2], [3]]
    trims = {3: 2, 5: 9, 6: 1}  # after chunk i, roll back (a draft rejected)
    for i, ids in enumerate(chunks):
        a = llama4(mx.array([ids]), cache=theirs)
        b = llama4(mx.array([ids]), cache=ours)
        assert mx.array_equal(a, b).item(), i
        for lm, kvr in zip(theirs, ours, strict=True):
            if isinstance(lm, lm_cache.ChunkedKVCache):
                assert (kvr.offset, kvr.start_position) == (lm.offset, lm.start_position)
                lk, lv = lm.keys_and_values()  # type: ignore[no-untyped-call]
                (ok,), (ov,) = kvr.planes()
                assert mx.array_equal(lk, ok).item() and mx.array_equal(lv, ov).item()
        if i in trims:
            for lm, kvr in zip(theirs, ours, strict=True):
                assert kvr.trim(trims[i]) == lm.trim(trims[i])


def test_the_serial_state_is_mlx_lm_s_and_loads_its_buffers(llama4: Any) -> None:
    """``state`` is mlx-lm's ``(keys, values, offset, chunk_size, start_position)``; a state
    of mlx-lm's buffers (capacity past the held columns) loads as what it holds."""
    theirs: Any = lm_cache.ChunkedKVCache(CHUNK)  # type: ignore[no-untyped-call]
    ours = kv.ChunkedKVCache(CHUNK)
    for seed, n in enumerate((5, 6, 1, 9)):
        block = _block(seed, 1, n)
        theirs.maybe_trim_front()
        theirs.update_and_fetch(block, block)
        ours.update_and_fetch(block, block)
    assert ours.state[2:] == theirs.state[2:]
    loaded = kv.ChunkedKVCache.from_state(theirs.state)
    assert (loaded.offset, loaded.start_position) == (theirs.offset, theirs.start_position)
    planes = loaded.planes()
    assert planes is not None
    (held,), _ = planes
    assert mx.array_equal(held, theirs.keys_and_values()[0]).item()
    again = ref.ChunkedKVCache.from_state(
        tuple(np.array(x) if isinstance(x, mx.array) else x for x in ours.state)
    )
    assert again.start_position == ours.start_position
    keys, values, offset, size, start = ours.state
    with pytest.raises(InvalidInputError, match="start_position"):
        kv.ChunkedKVCache.from_state((keys, values, offset, size, start - 1))


# -- conformance -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["PaddedChunkedRows", "BatchedChunkedKVCache"])
def test_chunked_family(layout: str) -> None:
    family = FAMILIES["chunked"]
    stats, settings = run_family(family, layout)
    # Verify rounds run in the speculative family; per-row trims on the ragged layout.
    ops = (ROW_OPS - {"spec_rounds", "trim_rows"}) | {"prefill_chunk", "trim"}
    if family.layout(layout).trim_rows:
        ops |= {"trim_rows"}
    stats.require(settings.max_examples // 2, ops=ops, oracles=(*BASE_CHECKS, "state"))
    stats.require(0, ops=OPS_CHECKED, oracles=("leases", "save_load across implementations"))
    assert stats.checks["front trim"] > 0, dict(stats.checks)
    assert_compared(stats, BASE_QUANTITIES)
    assert not stats.skips, dict(stats.skips)  # no mlx-lm peer in the machine


# -- the surface and its errors ---------------------------------------------------------------


@pytest.mark.parametrize("impl", [ref, kv], ids=["reference", "optimized"])
def test_layout_front_trims_keep_ends_and_drop_shared_padding(impl: Any) -> None:
    """Rows of 11 and 3 tokens in a decode layout: ``maybe_trim_front`` keeps each row's
    newest ``chunk_size`` (its pad grows), the padding both share leaves the read, and
    ``start_position`` says what each row holds."""
    to = np.array if impl is ref else (lambda x: x)
    rows = []
    for seed, n in enumerate((11, 3)):
        serial = impl.ChunkedKVCache(4)
        block = to(_block(seed, 1, n))
        serial.update_and_fetch(block, block)
        rows.append(serial)
    layout = impl.PaddedChunkedRows(4)
    layout.merge_rows(rows)
    assert layout.left_pad == (0, 8) and layout.width == 11
    layout.maybe_trim_front()
    assert np.asarray(layout.start_position).tolist() == [7, 0]
    assert layout.left_pad == (0, 1) and layout.width == 4  # 7 shared columns dropped
    assert layout.retained == (4, 3) if impl is ref else True
    step = to(_block(9, 2, 1))
    keys, _ = layout.update_and_fetch(step, step)
    assert int(np.asarray(keys).shape[2]) == 5
    assert np.asarray(layout.offset).tolist() == [12, 4]
    with pytest.raises(NotTrimmableError):
        layout.trim(6)  # row 1 holds 4 tokens
    assert np.asarray(layout.offset).tolist() == [12, 4]  # nothing changed


@pytest.mark.parametrize("impl", [ref, kv], ids=["reference", "optimized"])
def test_a_bf16_first_layout_front_trims_rows_of_both_stages(impl: Any) -> None:
    """Legos of 11 (converted at 11), 3 (plain) and 6 tokens (converted at 6), start 5,
    chunk 4, in a delayed layout: ``maybe_trim_front`` trims plain and converted rows alike
    (pads grow by what each forgot, the shared padding leaves), and after a step that
    converts the plain row each extracted row is its solo lego fed the same tokens, byte
    for byte (``spec/ChunkedKVCache.md`` §8)."""
    to = np.array if impl is ref else (lambda x: x)

    def lego() -> Any:
        return impl.Bf16FirstChunkedQuantizedKVCache(4, 32, 4, start=5)

    rows: list[Any] = []
    solos: list[Any] = []
    for seed, n in enumerate((11, 3, 6)):
        block = to(_block(seed, 1, n, dim=64))
        for held in (rows, solos):
            held.append(lego())
            held[-1].update_and_fetch(block, block)
    layout = impl.DelayedChunkedQuantizedKVCache(4, 32, 4, 5)
    layout.merge_rows(rows)
    assert layout.converted_at == (11, None, 6) and layout.left_pad == (0, 8, 5)
    layout.maybe_trim_front()
    assert np.asarray(layout.start_position).tolist() == [7, 0, 2]
    assert layout.left_pad == (0, 1, 0)  # 7 shared columns dropped
    layout.check_valid()
    step = to(_block(9, 3, 2, dim=64))
    with row_reads():
        layout.update_and_fetch(step, step)
    assert layout.converted_at == (11, 5, 6) and layout.row_offsets == (13, 5, 8)
    for b, solo in enumerate(solos):
        solo.update_and_fetch(step[b : b + 1], step[b : b + 1])
        row = layout.extract_row(b)
        assert (row.offset, row.converted, row.storage.start_position) == (
            solo.offset,
            solo.converted,
            solo.storage.start_position,
        )
        got, want = row.storage.planes(), solo.storage.planes()
        for mine, theirs in zip(
            (p for side in got for p in side), (p for side in want for p in side), strict=True
        ):
            assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes()


def test_bad_chunk_sizes_are_refused() -> None:
    for bad in (0, -1, 2.5, "8"):
        with pytest.raises(InvalidInputError, match="chunk_size"):
            kv.ChunkedKVCache(bad)
    with pytest.raises(InvalidInputError):
        Chunked(chunk_size=0)
    with pytest.raises(InvalidInputError, match="chunk_size"):
        kv.ChunkedKVCache()


# -- the engine: batched rows against each row's solo run -------------------------------------


def test_the_engine_s_batch_is_bit_identical_to_solo_runs(llama4: Any) -> None:
    """llama4's top level builds one mask from one row's positions: over layouts the
    engine runs its layers with each layer's own mask (``models.forward``), and every
    request's logits equal its solo run through the unmodified model (tolerance 0), rows
    well past several chunks included."""
    for scheme in (KvStorageScheme(), KvStorageScheme.parse("affine8")):
        trace = [
            Request(f"r{n}", tuple((5 * i + n) % 64 for i in range(n)), 12, arrival=i)
            for i, n in enumerate((5, 13, 21, 9))
        ]
        engine = Engine(llama4, scheme, max_batch=3, prefill_chunk=6, keep_logits=True)
        results, stats = engine.run(trace)
        assert stats.generated == 4 * 12
        report = check_invariance(llama4, scheme, trace, results, 6)
        assert report.steps == stats.generated
        assert report.mismatches == 0 and report.max_logit_diff == 0.0, report


def test_forward_runs_serial_caches_through_the_model(llama4: Any) -> None:
    caches = make_kvrows_cache(llama4)
    ids = mx.array([[1, 2, 3]])
    expected = llama4(ids, cache=make_kvrows_cache(llama4))
    assert mx.array_equal(forward(llama4, ids, caches), expected).item()


# -- the family has teeth ------------------------------------------------------------------------


class MaskIgnoresChunks(kv.PaddedChunkedRows):
    """The growing geometry's mask: a query sees the earlier chunk's keys it still holds."""

    def _layout_mask(self, n: int, return_array: bool, window: int | None) -> Any:
        return GrowingGeometry._layout_mask(self, n, return_array, window)  # MUTATION


class NoFrontTrim(kv.BatchedChunkedKVCache):
    """Rows never forget their oldest tokens: reads grow past the chunk (the mask hides
    them, so only what the rows hold and their saved forms differ)."""

    def _trim_front(self) -> None:
        return None  # MUTATION (each row should keep its newest chunk_size tokens)


@pytest.mark.parametrize(
    ("layout", "mutant"),
    [("PaddedChunkedRows", MaskIgnoresChunks), ("BatchedChunkedKVCache", NoFrontTrim)],
    ids=["mask-ignores-chunks", "no-front-trim"],
)
def test_the_chunked_machine_catches(layout: str, mutant: type) -> None:
    caught(layout, mutant, family_name="chunked")


class DelayedPadNotGrownOnFrontTrim(kv.DelayedChunkedQuantizedKVCache):
    """A bf16-first chunked layout whose front trim forgets a row's oldest tokens but
    leaves its pad where it was (``spec/ChunkedKVCache.md`` §3, §8): the row's held
    columns no longer start at its pad."""

    def _forget_front_pads(self, front: list[int]) -> None:
        super()._forget_front_pads([0] * len(front))  # MUTATION (the pad grows by front[b])


class DelayedConvertsByHeldTokens(kv.DelayedChunkedQuantizedKVCache):
    """A row converts when the tokens it holds reach ``start``, not its offset: after a
    front trim a row past ``start`` holding fewer stays plain (the conversion rule is on
    the offset, whatever the row still holds)."""

    def _record_offsets(self) -> list[int]:
        return list(self._tokens_held)  # MUTATION (the rule reads row_offsets)


@pytest.mark.parametrize(
    "mutant",
    [DelayedPadNotGrownOnFrontTrim, DelayedConvertsByHeldTokens],
    ids=["pad-not-grown-on-front-trim", "converts-by-held-tokens"],
)
def test_the_delayed_machine_catches_chunked_bookkeeping(mutant: type) -> None:
    caught("DelayedChunkedQuantizedKVCache", mutant, family_name="delayed")


def test_the_unmutated_chunked_layouts_pass() -> None:
    for layout in ("PaddedChunkedRows", "BatchedChunkedKVCache"):
        assert run_teeth(layout, None, 3, "chunked").examples > 0


def test_a_truncated_llama4_draft_is_refused(llama4: Any) -> None:
    with pytest.raises(InvalidInputError, match="draft model"):
        draft_model(llama4)
