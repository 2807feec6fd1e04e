"""The encoded latent's decoded window (``spec/EncodedLatentCache.md`` §5): a decode step
decodes only the columns it wrote, and every row operation leaves reads exactly what the
eager path (every read decodes the whole latent) returns.

Oracles: the eager path (``keeps_window = False``), itself the reference's twin in the
latent conformance family; the reference implementation for the reads; the codec's own
decode calls (a dispatch test: which columns each decode read).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from dispatch_helpers import CallLog

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.codecs.mx import Microscaled
from kvrows.conformance.arrays import from_mlx
from kvrows.optimized.codecs.latent import LatentArrayCodec
from kvrows.optimized.rows import Layout, Storage
from kvrows.schemes import Affine, CodecSpec, Turbo

RANK, ROPE = 64, 8
CODECS: list[CodecSpec] = [
    Affine(bits=8, group_size=64),
    Turbo(k_bits=8, v_bits=4),
    Microscaled(group_size=32, bits=4),
]

pytestmark = pytest.mark.usefixtures("cpu_stream")


class Eager(opt.EncodedLatentCache):
    """The eager path: every read decodes the whole latent."""

    keeps_window = False


def _blocks(rows: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((rows, 1, n, RANK)).astype(np.float32)
    rope = rng.standard_normal((rows, 1, n, ROPE)).astype(np.float32)
    return latent, rope


def _mlx(blocks: tuple[np.ndarray, ...]) -> tuple[mx.array, ...]:
    return tuple(mx.array(b).astype(mx.bfloat16) for b in blocks)


def _as_bf16(blocks: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """The blocks as the bf16 activations the optimized caches take (the reference's)."""
    return tuple(from_mlx(b) for b in _mlx(blocks))


def _layout(cls: type, codec: CodecSpec, start: int, sizes: tuple[tuple[int, int], ...]) -> Any:
    rows = []
    for seed, n in sizes:
        cache = cls(codec=codec, start=start)
        cache.update_and_fetch(*_mlx(_blocks(1, n, seed)))
        rows.append(cache)
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    return layout


def _read(cache: Any) -> np.ndarray:
    latent = cache.current()[0]
    assert latent.dtype == mx.bfloat16  # the activations' dtype, windowed or not
    return np.asarray(from_mlx(latent))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.key)
def test_a_decode_step_decodes_only_its_own_columns(codec: CodecSpec, call_log: CallLog) -> None:
    """After the first read (the window built: one decode of every column), each
    append + read decodes the one column it wrote; the eager path decodes every column
    at every read. Both read the same bytes."""
    call_log.watch(LatentArrayCodec, "decode")
    layouts = [_layout(cls, codec, 0, ((1, 9), (2, 4))) for cls in (opt.EncodedLatentCache, Eager)]
    columns: dict[str, list[list[int]]] = {}
    for name, layout in zip(("window", "eager"), layouts, strict=True):
        steps = []
        for step in range(4):
            del call_log.calls[:]
            layout.update_and_fetch(*_mlx(_blocks(2, 1, 10 + step)))
            latent = [args[1] for _, args in call_log.calls if args[2:3] in ((), ("latent",))]
            steps.append([int(planes[0].shape[2]) for planes in latent])
        columns[name] = steps
    assert columns["window"] == [[10], [1], [1], [1]]  # built at the first read, then extended
    assert columns["eager"] == [[10], [11], [12], [13]]
    assert _same([_read(layouts[0])], [_read(layouts[1])])
    assert layouts[0].window_nbytes > 0 and layouts[1].window_nbytes == 0


def test_a_step_that_outgrows_the_buffers_moves_the_window(call_log: CallLog) -> None:
    """The step after which the buffers are full takes fresh ones: the window moves with
    the codes (a copy), and that step decodes only its own column too."""
    call_log.watch(LatentArrayCodec, "decode")
    codec = CODECS[0]
    layouts = [_layout(cls, codec, 0, ((1, 9), (2, 4))) for cls in (opt.EncodedLatentCache, Eager)]
    columns = []
    for layout in layouts:
        layout.update_and_fetch(*_mlx(_blocks(2, 1, 10)))  # the window built
        room = layout.capacity - layout.width
        layout.update_and_fetch(*_mlx(_blocks(2, room, 11)))  # the buffers full
        capacity = layout.capacity
        del call_log.calls[:]
        layout.update_and_fetch(*_mlx(_blocks(2, 1, 12)))
        assert layout.capacity > capacity  # the step outgrew them
        latent = [args[1] for _, args in call_log.calls if args[2:3] in ((), ("latent",))]
        columns.append([int(planes[0].shape[2]) for planes in latent])
    assert columns == [[1], [257]]  # the window's step; the eager one reads every column
    assert _same([_read(layouts[0])], [_read(layouts[1])])


def _rollback_equal(layout: Any) -> Any:
    layout.spec_round_begin()
    layout.update_and_fetch(*_mlx(_blocks(layout.batch_size, 3, 8)))
    layout.spec_round_rollback([2] * layout.batch_size)  # every row keeps as many
    return layout


@pytest.mark.parametrize("operation", ["trim", "rollback-equal", "rollback", "filter"])
def test_the_window_is_kept_through_rollbacks_trims_and_filters(
    operation: str, call_log: CallLog
) -> None:
    """A trim, a rollback of equal counts and a filter move no column (the origin at
    most), an uneven rollback rolls each row right: the window follows, and the next step
    still decodes its own column only. (A join rebuilds it at the next read:
    ``test_the_window_follows_every_row_operation`` checks the reads after it.)"""
    call_log.watch(LatentArrayCodec, "decode")
    layout = _layout(opt.EncodedLatentCache, CODECS[0], 0, ((1, 9), (2, 4), (3, 6)))
    layout.update_and_fetch(*_mlx(_blocks(3, 1, 10)))  # the window built
    eager = _layout(Eager, CODECS[0], 0, ((1, 9), (2, 4), (3, 6)))
    eager.update_and_fetch(*_mlx(_blocks(3, 1, 10)))
    change = OPERATIONS[operation]
    for cache in (layout, eager):
        change(cache)
    del call_log.calls[:]
    layout.update_and_fetch(*_mlx(_blocks(layout.batch_size, 1, 11)))
    latent = [args[1] for _, args in call_log.calls if args[2:3] in ((), ("latent",))]
    assert [int(planes[0].shape[2]) for planes in latent] == [1]
    eager.update_and_fetch(*_mlx(_blocks(eager.batch_size, 1, 11)))
    assert _same([_read(layout)], [_read(eager)])


def _join(layout: Any) -> Any:
    row = type(layout)(codec=layout.latent_codec, start=layout.start)
    row.update_and_fetch(*_mlx(_blocks(1, 14, 7)))
    layout.merge_rows([row])
    return layout


def _join_short(layout: Any) -> Any:
    """A row no longer than the others: it takes the spare slot in place (no new buffer)."""
    row = type(layout)(codec=layout.latent_codec, start=layout.start)
    row.update_and_fetch(*_mlx(_blocks(1, 3, 7)))
    layout.merge_rows([row])
    return layout


def _rollback(layout: Any) -> Any:
    layout.spec_round_begin()
    layout.update_and_fetch(*_mlx(_blocks(layout.batch_size, 3, 8)))
    layout.spec_round_rollback([1 + b % 3 for b in range(layout.batch_size)])
    return layout


def _trim(layout: Any) -> Any:
    layout.trim(2)
    return layout


def _filter(layout: Any) -> Any:
    layout.filter_rows([1, 0])
    return layout


def _filter_and_rejoin(layout: Any) -> Any:
    layout.filter_rows([])
    return _join(layout)


def _extract(layout: Any) -> Any:
    return layout.extract_row(1)


def _state(layout: Any) -> Any:
    return type(layout).from_state(layout.state)


def _state_setter(layout: Any) -> Any:
    other = _layout(type(layout), layout.latent_codec, layout.start, ((5, 6), (6, 11)))
    other.current()  # its window built, then replaced by the loaded rows
    other.state = layout.state
    return other


def _grow(layout: Any) -> Any:
    layout.update_and_fetch(*_mlx(_blocks(layout.batch_size, 300, 9)))  # past the buffer
    return layout


OPERATIONS: dict[str, Callable[[Any], Any]] = {
    "join": _join,
    "join-short": _join_short,
    "rollback": _rollback,
    "rollback-equal": _rollback_equal,
    "trim": _trim,
    "filter": _filter,
    "filter-all-rejoin": _filter_and_rejoin,
    "extract": _extract,
    "state": _state,
    "state-setter": _state_setter,
    "grow": _grow,
}


def _replay(cls: type, codec: CodecSpec, start: int, operation: str) -> list[np.ndarray]:
    """Reads of a layout through a decode step, ``operation``, two more decode steps."""
    layout = _layout(cls, codec, start, ((1, 9), (2, 4)))
    reads = []
    for seed in (20, 21):  # the window built, then extended
        layout.update_and_fetch(*_mlx(_blocks(layout.batch_size, 1, seed)))
        reads.append(_read(layout))
    layout = OPERATIONS[operation](layout)
    reads.append(_read(layout))
    for seed in (22, 23):
        layout.update_and_fetch(*_mlx(_blocks(layout.batch_size, 1, seed)))
        reads.append(_read(layout))
    layout.check_valid()
    return reads


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    """Byte for byte (a zero's sign included)."""
    return len(got) == len(want) and all(
        g.shape == w.shape and g.tobytes() == w.tobytes() for g, w in zip(got, want, strict=True)
    )


@pytest.mark.parametrize("start", [0, 3], ids=["start0", "start3"])
@pytest.mark.parametrize("operation", list(OPERATIONS))
@pytest.mark.parametrize("codec", CODECS[:2], ids=lambda c: c.key)
def test_the_window_follows_every_row_operation(
    codec: CodecSpec, operation: str, start: int
) -> None:
    """Reads before and after each row operation (and the appends after it) are the
    eager path's, byte for byte (``start = 3``: rows in two stages, the window the
    encoded store's); the padding columns aside, they are the reference's."""
    got = _replay(opt.EncodedLatentCache, codec, start, operation)
    assert _same(got, _replay(Eager, codec, start, operation))


def test_the_reads_are_the_references() -> None:
    """A windowed layout reads what the reference reads after a rollback, a join and
    decode steps (each row's columns: padding is unspecified)."""
    codec = Affine(bits=8, group_size=64)
    layouts = []
    for impl in (ref, opt):
        rows = []
        for seed, n in ((1, 9), (2, 4)):
            cache = impl.EncodedLatentCache(codec=codec)
            blocks = _as_bf16(_blocks(1, n, seed))
            cache.update_and_fetch(*(blocks if impl is ref else _mlx(blocks)))
            rows.append(cache)
        layout = rows[0].make_empty_batch()
        layout.merge_rows(rows)
        layouts.append(layout)
    for step in range(3):
        blocks = _as_bf16(_blocks(2, 1 + step, 30 + step))
        for impl, layout in zip((ref, opt), layouts, strict=True):
            layout.spec_round_begin()
            layout.update_and_fetch(*(blocks if impl is ref else _mlx(blocks)))
            layout.spec_round_rollback([1 + step, 1])  # tokens kept
            layout.current()
    want, got = np.asarray(layouts[0].current()[0]), _read(layouts[1])
    assert layouts[0].left_pad == layouts[1].left_pad
    for b, pad in enumerate(layouts[1].left_pad):
        assert np.array_equal(got[b, :, pad:].astype(np.float32), want[b, :, pad:])


@pytest.mark.parametrize(
    ("operation", "expected"),
    [("join-short", [(1, 11)]), ("join", [(2, 3), (1, 14)])],
    ids=["in-place", "new-buffers"],
)
def test_a_join_decodes_only_what_is_new(
    operation: str, expected: list[tuple[int, int]], call_log: CallLog
) -> None:
    """A row joining (11 columns wide: a free slot, written in place; 14: new buffers, the
    running rows 3 columns right) is decoded alone, with the running rows' new left
    padding; then a step decodes its own column. Its reads are the eager path's."""
    call_log.watch(LatentArrayCodec, "decode")
    layouts = [
        _layout(cls, CODECS[0], 0, ((1, 9), (2, 4))) for cls in (opt.EncodedLatentCache, Eager)
    ]
    for layout in layouts:
        layout.update_and_fetch(*_mlx(_blocks(2, 1, 10)))  # the window built: 10 + 1 columns
        layout.update_and_fetch(*_mlx(_blocks(2, 1, 11)))
    del call_log.calls[:]
    OPERATIONS[operation](layouts[0])
    layouts[0].update_and_fetch(*_mlx(_blocks(3, 1, 12)))
    latent = [args[1] for _, args in call_log.calls if args[2:3] in ((), ("latent",))]
    # the encoded latent's decodes (the joining row's own warm-up read is plain: one plane)
    shapes = [(int(p[0].shape[0]), int(p[0].shape[2])) for p in latent if len(p) > 1]
    assert shapes == [*expected, (3, 1)]
    OPERATIONS[operation](layouts[1])
    layouts[1].update_and_fetch(*_mlx(_blocks(3, 1, 12)))
    assert _same([_read(layouts[0])], [_read(layouts[1])])


def test_a_window_kept_through_row_operations_would_go_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The teeth of the test above: a window that row operations do not drop, and that a
    join does not bring up to date, reads stale columns after a join that writes into the
    planes in place (one that builds new planes would rebuild it: the window is of one
    codes plane, by identity)."""
    codec = Affine(bits=8, group_size=64)
    monkeypatch.setattr(opt.EncodedLatentCache, "_changed", Storage._changed)
    monkeypatch.setattr(opt.EncodedLatentCache, "_join", Layout._join)
    for operation in ("join-short",):
        got = _replay(opt.EncodedLatentCache, codec, 0, operation)
        assert not _same(got, _replay(Eager, codec, 0, operation)), operation


def test_the_window_counts_in_nbytes() -> None:
    """``nbytes`` holds the window once an append built it: ``R`` values of the
    activations' dtype per column of every slot, beside the codes. A read builds none (it
    changes nothing observable: ``nbytes`` neither)."""
    codec = Affine(bits=8, group_size=64)
    layout, eager = (
        _layout(cls, codec, 0, ((1, 9), (2, 4))) for cls in (opt.EncodedLatentCache, Eager)
    )
    assert layout.window_nbytes == 0  # a merge drops it
    layout.current()
    assert layout.window_nbytes == 0 and layout.nbytes == eager.nbytes
    for cache in (layout, eager):
        cache.update_and_fetch(*_mlx(_blocks(2, 1, 5)))
    slots, capacity = layout.slots, layout.capacity
    assert layout.window_nbytes == slots * capacity * RANK * 2
    assert layout.nbytes == eager.nbytes + layout.window_nbytes
    assert eager.window_nbytes == 0
    assert len(layout.held_arrays()) == len(eager.held_arrays()) + 1  # the window's columns


@pytest.mark.parametrize("start", [0, 100], ids=["converted", "warm"])
def test_projected_bytes_count_the_window(start: int) -> None:
    """Admission's projection counts what a decoding layout holds: the codes and the
    window, ``R`` values of the activations' dtype per token beside them. Measured
    against ``nbytes`` (every slot's ``capacity`` columns) and against MLX's active
    memory, which the step that builds the window grows by the window's bytes. A row
    still warm (``start`` not reached) holds its exact latent instead: at most as much."""
    codec = Affine(bits=8, group_size=64)
    layout, eager = (
        _layout(cls, codec, start, ((1, 9), (2, 4))) for cls in (opt.EncodedLatentCache, Eager)
    )
    block = _mlx(_blocks(2, 1, 5))
    mx.eval(*block, *layout.held_arrays())
    gc.collect()  # (the merged rows' buffers go)
    before = mx.get_active_memory()
    mx.eval(layout.update_and_fetch(*block), layout.held_arrays())
    grown = mx.get_active_memory() - before
    eager.update_and_fetch(*block)
    per_column = layout.slots * layout.capacity  # what ``nbytes`` counts: every column
    assert layout.window_token_bytes() == RANK * 2 and eager.window_token_bytes() == 0
    assert layout.projected_bytes(3) == 3 * (layout.bytes_per_token() + RANK * 2)
    assert eager.projected_bytes(3) == 3 * eager.bytes_per_token()
    if start == 0:
        assert layout.nbytes == per_column * layout.projected_bytes(1)
        assert eager.nbytes == per_column * eager.projected_bytes(1)
        assert grown >= per_column * layout.window_token_bytes() == layout.window_nbytes
    else:  # the exact latent, no window, no codes yet
        assert layout.window_nbytes == 0 and not any(layout.converted)
        assert layout.nbytes <= per_column * layout.projected_bytes(1)
    # the reference holds no window: its projection is its rows' planes
    reference = ref.EncodedLatentCache(codec=codec)
    reference.update_and_fetch(*_as_bf16(_blocks(1, 4, 1)))
    assert reference.window_token_bytes() == 0
    assert reference.projected_bytes(4) == reference.nbytes == 4 * reference.bytes_per_token()


def test_admission_projects_the_window() -> None:
    """``table.row_admission`` over a windowed encoded latent bills codes and window per
    token (DeepSeek-V3's 512 + 64 bf16, affine 8-bit group 128: 656 + 1,024)."""
    from kvrows.table import row_admission

    bf16 = mx.bfloat16
    encoded = opt.EncodedLatentCache(512, 64, codec=Affine(bits=8, group_size=128))
    encoded.update_and_fetch(mx.zeros((1, 1, 3, 512), bf16), mx.zeros((1, 1, 3, 64), bf16))
    admission = row_admission([encoded])
    assert admission is not None
    assert admission.bytes(10) == admission.most_bytes(10) == 10 * (656 + 1024)


# -- the paged placement: the same window over the pool's rows (``PagedLatentCache``) ---


class PagedEager(opt.PagedLatentCache):
    """The paged eager path: every read gathers and decodes the whole latent."""

    keeps_window = False


def _paged(cls: type, codec: CodecSpec, start: int, sizes: tuple[tuple[int, int], ...]) -> Any:
    """Rows of ``sizes`` in one pool of 4-token blocks, merged (by reference)."""
    pool = opt.LatentBlockPool(codec, block_size=4)
    rows = []
    for seed, n in sizes:
        cache = cls(codec=codec, start=start, pool=pool)
        cache.update_and_fetch(*_mlx(_blocks(1, n, seed)))
        rows.append(cache)
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    return layout


def _latent_decodes(call_log: CallLog) -> list[tuple[int, int]]:
    """``(rows, columns)`` of each latent decode logged (encoded planes: more than one)."""
    latent = [args[1] for _, args in call_log.calls if args[2:3] in ((), ("latent",))]
    return [(int(p[0].shape[0]), int(p[0].shape[2])) for p in latent if len(p) > 1]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.key)
def test_a_paged_decode_step_decodes_only_its_own_columns(
    codec: CodecSpec, call_log: CallLog
) -> None:
    """The paged dispatch test: after the append that builds the window (one decode of
    every column), each append + read decodes its own column and gathers no latent code
    from the pool (rope only); the eager path gathers and decodes every column at every
    read. Both read the same bytes, through a step that outgrows the window's columns."""
    call_log.watch(LatentArrayCodec, "decode")
    call_log.watch(opt.LatentBlockPool, "gather")
    layouts = [
        _paged(cls, codec, 0, ((1, 9), (2, 4))) for cls in (opt.PagedLatentCache, PagedEager)
    ]
    decodes: dict[str, list[list[tuple[int, int]]]] = {}
    gathered: dict[str, list[set[str]]] = {}
    for name, layout in zip(("window", "eager"), layouts, strict=True):
        decodes[name], gathered[name] = [], []
        for step in range(4):
            del call_log.calls[:]
            layout.update_and_fetch(*_mlx(_blocks(2, 1, 10 + step)))
            decodes[name].append(_latent_decodes(call_log))
            # the tensors each gather read (``tensors``, its sixth argument: all by default)
            calls = [args for n, args in call_log.calls if n == "gather"]
            asked = [a[5] if len(a) > 5 and a[5] else ("all",) for a in calls]
            gathered[name].append({str(t) for tensors in asked for t in tensors})
    assert decodes["window"] == [[(2, 10)], [(2, 1)], [(2, 1)], [(2, 1)]]
    assert decodes["eager"] == [[(2, 10)], [(2, 11)], [(2, 12)], [(2, 13)]]
    # the build gathers the codes once; every read, the first's too, the rest only
    assert gathered["window"] == [{"latent", "rope", "index"}] + [{"rope", "index"}] * 3
    assert gathered["eager"] == [{"all"}] * 4
    assert _same([_read(layouts[0])], [_read(layouts[1])])
    assert layouts[0].window_nbytes > 0 and layouts[1].window_nbytes == 0
    for layout in layouts:  # past the window's 256 columns: one copy into more
        layout.update_and_fetch(*_mlx(_blocks(2, 250, 20)))
        layout.update_and_fetch(*_mlx(_blocks(2, 1, 21)))
    assert layouts[0].window_nbytes == 2 * 512 * RANK * 2
    assert _same([_read(layouts[0])], [_read(layouts[1])])


PAGED_OPERATIONS: dict[str, Callable[[Any], Any]] = {
    "trim-equal": lambda layout: layout.trim_rows([2, 2]),
    "trim-ragged": lambda layout: layout.trim_rows([3, 1]),
    "filter-reorder": lambda layout: layout.filter_rows([1, 0]),
    "filter": lambda layout: layout.filter_rows([1]),
    "join": lambda layout: layout.merge_rows(
        [_paged(type(layout), CODECS[0], layout.start, ((5, 6),))]
    ),
}


@pytest.mark.parametrize("start", [0, 12], ids=["converted", "converting"])
@pytest.mark.parametrize("operation", list(PAGED_OPERATIONS))
def test_the_paged_window_follows_every_row_operation(
    operation: str, start: int, call_log: CallLog
) -> None:
    """After each row operation the paged window reads what the eager path reads, byte
    for byte, through three more steps (``start`` 12: rows convert on the way, moving
    into the pool); rows that forget equal counts keep it (the next step decodes its own
    column only), every other operation drops it (the next step decodes every column)."""
    call_log.watch(LatentArrayCodec, "decode")
    codec = CODECS[0]
    reads = []
    for cls in (opt.PagedLatentCache, PagedEager):
        layout = _paged(cls, codec, start, ((1, 9), (2, 4)))
        for step in range(2):
            layout.update_and_fetch(*_mlx(_blocks(2, 1, 10 + step)))
        PAGED_OPERATIONS[operation](layout)
        got = [_read(layout)]
        del call_log.calls[:]
        for step in range(3):
            layout.update_and_fetch(*_mlx(_blocks(layout.batch_size, 1, 20 + step)))
            got.append(_read(layout))
            if step == 0 and cls is opt.PagedLatentCache and start == 0:
                columns = [n for _, n in _latent_decodes(call_log)]
                assert columns == ([1] if operation == "trim-equal" else [layout.width])
        reads.append(got)
    assert _same(reads[0], reads[1])


def test_a_paged_window_kept_through_a_ragged_rollback_would_go_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The teeth of the test above: a window kept whatever the counts reads stale columns
    after a ragged rollback (the rows' columns moved)."""
    original = opt.PagedLatentCache._trim_rows

    def keeps(self: Any, counts: Any, *, justify: bool = False) -> int:
        kept = self._dense_window
        trimmed = original(self, counts, justify=justify)
        self._dense_window = kept
        return trimmed

    monkeypatch.setattr(opt.PagedLatentCache, "_trim_rows", keeps)
    reads = []
    for cls in (opt.PagedLatentCache, PagedEager):
        layout = _paged(cls, CODECS[0], 0, ((1, 9), (2, 4)))
        layout.update_and_fetch(*_mlx(_blocks(2, 1, 10)))
        PAGED_OPERATIONS["trim-ragged"](layout)
        layout.update_and_fetch(*_mlx(_blocks(2, 1, 11)))
        reads.append([_read(layout)])
    assert not _same(reads[0], reads[1])


def test_the_paged_window_counts_in_nbytes_and_the_projection() -> None:
    """A paged layout holding a window: ``nbytes`` is its blocks and the window
    (``beside_nbytes``, what an engine adds to its pools: the window alone here), and its
    projection bills the window's ``R`` values per token beside the codes' whole blocks."""
    layout, eager = (
        _paged(cls, CODECS[0], 0, ((1, 9), (2, 4))) for cls in (opt.PagedLatentCache, PagedEager)
    )
    for cache in (layout, eager):
        cache.update_and_fetch(*_mlx(_blocks(2, 1, 5)))
    assert layout.window_nbytes == 2 * 256 * RANK * 2  # two rows, 256 columns, bf16
    assert layout.nbytes == eager.nbytes + layout.window_nbytes
    assert layout.beside_nbytes == layout.window_nbytes and eager.beside_nbytes == 0
    assert layout.projected_bytes(5) == 8 * (layout.bytes_per_token() + RANK * 2)
    assert eager.projected_bytes(5) == 8 * eager.bytes_per_token()  # two 4-token blocks
