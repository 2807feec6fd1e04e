"""``kvrows.conversion.Conversion``: the bf16-first rule, restated from the spec pages.

Each test states a rule of ``spec/bf16-first.md``, ``spec/DelayedQuantizedKVCache.md``
or ``spec/EncodedLatentCache.md`` on the int-only record alone (no arrays, no storage):
when a row is due, what it records, which boundaries convert, how the record follows
the rows, and when ``bits`` / ``group_size`` show.
"""

from __future__ import annotations

import math

import pytest

from kvrows.conversion import (
    MIXED_READ,
    Conversion,
    RowAttentionPending,
    conversion_due,
    row_reads,
    row_reads_active,
)
from kvrows.errors import InvalidInputError, MixedPrecisionReadError, RowIndexError
from kvrows.schemes import Affine, Plain, Turbo

AFFINE = Affine(bits=4, group_size=32)


def converting(record: Conversion, offsets: list[int], **boundary: bool) -> list[int]:
    """What a storage does at a boundary: convert the due rows and record them."""
    due = record.due(offsets, **boundary)
    record.mark(due, offsets)
    return due


# -- bf16-first.md, "The conversion rule" -----------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "start", "due"),
    [(0, 0, False), (1, 0, True), (4, 5, False), (5, 5, True), (9, 5, True), (0, 5, False)],
)
def test_a_row_is_due_at_or_past_start_and_never_while_empty(
    offset: int, start: int, due: bool
) -> None:
    assert conversion_due(offset, start) is due
    assert Conversion(AFFINE, start, [None]).due([offset]) == ([0] if due else [])


def test_the_point_depends_on_the_append_boundaries() -> None:
    # The append 3 -> 9 with start 5 converts at 9, not 5.
    record = Conversion(AFFINE, 5, [None])
    assert converting(record, [3]) == []
    assert converting(record, [9]) == [0]
    assert record.converted_at == (9,)
    assert record.minimum_reusable_offset == 9


def test_start_zero_records_zero_and_needs_no_reuse_bound() -> None:
    record = Conversion(AFFINE, 0, [None])
    assert converting(record, [0]) == []  # the first append waits for a token
    assert converting(record, [3]) == [0]
    assert record.converted_at == (0,)
    assert record.minimum_reusable_offset == 0


def test_conversion_is_irreversible() -> None:
    # A trim below start keeps the row converted: no boundary un-converts it.
    record = Conversion(AFFINE, 5, [None])
    converting(record, [6])
    assert converting(record, [2]) == []
    assert record.converted == (True,)
    assert record.converted_at == (6,)


def test_a_plain_target_never_converts() -> None:
    # MLACache: the latent codec is plain, no row ever reads encoded.
    record = Conversion(Plain(), 0, [None, None])
    assert record.due([5, 9]) == []
    assert record.commit_prefill([0, 1], [5, 9]) == []


# -- DelayedQuantizedKVCache.md, "State", "Membership" --------------------------------------------


def test_phase_follows_the_rows() -> None:
    record = Conversion(AFFINE, 5)
    phases = [record.phase]
    record.join([None, None])
    phases.append(record.phase)
    converting(record, [6, 2])
    phases.append(record.phase)
    converting(record, [7, 5])
    phases.append(record.phase)
    assert phases == ["empty", "plain", "mixed", "packed"]
    assert record.converted_at == (6, 5)


def test_max_append_tokens_is_the_nearest_plain_boundary() -> None:
    # [2,4,7], start 5 -> 1; [2,7] -> 3; [7] -> inf (7 converted at its boundary).
    assert Conversion(AFFINE, 5, [None, None, None]).max_append_tokens([2, 4, 7]) == 1
    assert Conversion(AFFINE, 5, [None, None]).max_append_tokens([2, 7]) == 3
    assert Conversion(AFFINE, 5, [7]).max_append_tokens([7]) == math.inf
    # A converted row below start (trimmed) bounds nothing.
    assert Conversion(AFFINE, 5, [6, None]).max_append_tokens([2, 4]) == 1


def test_minimum_reusable_offset_is_the_largest_conversion_point() -> None:
    assert Conversion(AFFINE, 5, [None, 6, 9]).minimum_reusable_offset == 9
    assert Conversion(AFFINE, 5, [None]).minimum_reusable_offset == 0
    assert Conversion(AFFINE, 5).minimum_reusable_offset == 0


def test_a_row_joining_converted_records_its_offset_when_start_is_positive() -> None:
    assert Conversion(AFFINE, 5).point(12) == 12
    assert Conversion(AFFINE, 0).point(12) == 0


def test_the_record_follows_joins_filters_and_extraction() -> None:
    record = Conversion(AFFINE, 5, [None, 6])
    record.join([None, 8])
    assert list(record.converted_at) == [None, 6, None, 8]
    assert record.members(0) == [0, 2] and record.members(1) == [1, 3]
    assert record.slots() == [0, 0, 1, 1]
    assert [record.stage(b) for b in range(4)] == [0, 1, 0, 1]
    # A per-row quantity given per stage comes back in batch order.
    assert record.in_batch_order([[10, 30], [20, 40]]) == (10, 20, 30, 40)
    record.keep([3, 0])
    assert record.converted_at == (8, None)
    one = record.extract(0)
    assert (one.target, one.start, one.converted_at) == (AFFINE, 5, (8,))
    assert record.converted_at == (8, None)  # extraction leaves the rows
    record.keep([])
    assert record.phase == "empty"


# -- "Conversion points": boundaries only --------------------------------------------------------


def test_nothing_converts_inside_a_round() -> None:
    record = Conversion(AFFINE, 5, [None])
    assert converting(record, [7], round_open=True) == []
    assert converting(record, [7]) == [0]  # at the round's end, at its offset after it
    assert record.converted_at == (7,)


def test_prefill_defers_conversion_until_it_ends() -> None:
    # Rows [6,3], start 5, a 2-token prefill append -> [8,5]: nothing converts;
    # end_prefill -> converted_at [8,5], packed.
    record = Conversion(AFFINE, 5, [None, None])
    record.begin_prefill()
    assert record.prefilling
    assert converting(record, [8, 5]) == []
    due = record.end_prefill([8, 5])
    record.mark(due, [8, 5])
    assert not record.prefilling
    assert record.converted_at == (8, 5) and record.phase == "packed"


def test_commit_prefill_converts_the_named_due_rows() -> None:
    # Rows [6,1] -> [8,3]; commit_prefill([0]) converts row 0 at 8.
    record = Conversion(AFFINE, 5, [None, None])
    record.begin_prefill()
    assert record.commit_prefill([1, 0], [8, 3]) == [0]
    assert record.commit_prefill([], [8, 3]) == []
    assert record.prefilling  # committing rows does not end the prefill


@pytest.mark.parametrize(
    ("indices", "error"),
    [
        ("01", InvalidInputError),
        (7, InvalidInputError),
        ([True], RowIndexError),
        ([1.0], RowIndexError),
        ([2], RowIndexError),
        ([-1], RowIndexError),
        ([0, 0], RowIndexError),
    ],
)
def test_commit_prefill_refuses_bad_rows_and_changes_nothing(indices: object, error: type) -> None:
    record = Conversion(AFFINE, 5, [None, None])
    record.begin_prefill()
    with pytest.raises(error):
        record.commit_prefill(indices, [8, 8])  # type: ignore[arg-type]
    assert record.converted_at == (None, None) and record.prefilling


# -- bf16-first.md, "bits / group_size" ----------------------------------------------------------


def test_bits_show_only_after_a_quantized_read_of_an_affine_target() -> None:
    record = Conversion(AFFINE, 0, [None])
    with pytest.raises(AttributeError, match="reads plain keys and values now"):
        record.read_parameter("Lego", "bits")
    record.note_read(True)
    assert record.read_parameter("Lego", "bits") == 4
    assert record.read_parameter("Lego", "group_size") == 32
    record.note_read(False)  # the converting append reads plain
    assert not hasattr_parameter(record, "bits")


def test_a_turboquant_target_never_shows_bits() -> None:
    record = Conversion(Turbo(k_bits=8, v_bits=3), 0, [0])
    record.note_read(True)
    with pytest.raises(AttributeError, match="is an affine parameter"):
        record.read_parameter("Lego", "bits")


def hasattr_parameter(record: Conversion, what: str) -> bool:
    try:
        record.read_parameter("Lego", what)
    except AttributeError:
        return False
    return True


# -- the mixed-read scope ------------------------------------------------------------------------


def test_row_reads_nests_and_the_pending_pair_refuses_array_use() -> None:
    assert not row_reads_active()
    with row_reads():
        with row_reads():
            assert row_reads_active()
        assert row_reads_active()
    assert not row_reads_active()
    pending = RowAttentionPending(object(), 3)
    assert pending.generation == 3
    with pytest.raises(MixedPrecisionReadError) as caught:
        _ = pending.shape
    assert str(caught.value) == f"{MIXED_READ}; this model read .shape of the pending pair itself"


def test_the_old_homes_still_export_the_moved_names() -> None:
    import kvrows.delayed as delayed
    import kvrows.lego as lego

    assert delayed.RowAttentionPending is RowAttentionPending
    assert delayed.row_reads is row_reads and delayed.MIXED_READ is MIXED_READ
    assert lego.conversion_due is conversion_due
    # Stop 33: the target checks and the constructor's arguments moved beside the record,
    # the conversion's code path into kvrows.delayed; kvrows.lego still names them.
    import kvrows.conversion as conversion

    for name in ("Target", "check_target_dims", "delayed_arguments"):
        assert getattr(lego, name) is getattr(conversion, name)
    assert lego.ConversionBoundary is delayed.ConversionBoundary
    assert issubclass(lego.Bf16First, delayed.ConversionBoundary)
