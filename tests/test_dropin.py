"""mlx-lm's per-cache surface on the optimized classes, against mlx-lm's own classes.

``keys`` / ``values`` (read and written), ``keys_and_values()``, ``size()``, ``empty()`` and
``to_quantized``: the same inputs go into ``mlx_lm.models.cache``'s classes and the
arrays are compared bit for bit; the refusals leave the cache unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as peer_module
import numpy as np
import pytest

import kvrows.optimized as kv
from kvrows.compositions import affine_counterpart, landed
from kvrows.delayed import row_reads
from kvrows.errors import InvalidInputError, KvRowsError, LayoutStateError, MixedPrecisionReadError

peer: Any = peer_module  # mlx-lm is untyped
HEADS, DIM = 2, 64
#: Tokens per update: blocks and single tokens, crossing a ring of 6 several times.
STEPS = (3, 1, 1, 2, 1, 1, 1, 4, 1, 1)
WINDOW = 6


def _blocks(seed: int, steps: Sequence[int] = STEPS, rows: int = 1) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [
        (
            mx.array(rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float32)),
            mx.array(rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float32)),
        )
        for n in steps
    ]


def _feed(cache: Any, blocks: Sequence[tuple[Any, Any]]) -> Any:
    for keys, values in blocks:
        cache.update_and_fetch(keys, values)
    return cache


def _same(a: Any, b: Any) -> bool:
    """Bit-identical arrays, or tuples of them (affine triples)."""
    if isinstance(a, tuple | list) or isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(_np(a), _np(b))


def _np(a: Any) -> Any:
    """An mlx array as NumPy, bit-exact (bfloat16, which NumPy lacks, as its bits)."""
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _snapshot(cache: Any) -> Any:
    """What a cache observably holds (to check a refused call changed nothing)."""
    held = None if cache.empty() else cache.keys_and_values()
    return (
        repr(cache),
        None if held is None else tuple(_np(p) for p in _flat(held)),
        cache.size(),
    )


def _flat(held: Any) -> list[Any]:
    out: list[Any] = []
    for part in held:
        out.extend(part if isinstance(part, tuple | list) else [part])
    return out


def _unchanged(before: Any, after: Any) -> bool:
    if before[0] != after[0] or before[2] != after[2] or (before[1] is None) != (after[1] is None):
        return False
    if before[1] is None:
        return True
    return all(np.array_equal(x, y) for x, y in zip(before[1], after[1], strict=True))


# -- serial caches against mlx-lm's -----------------------------------------------------

SERIAL_PAIRS: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
    "KVCache": (kv.KVCache, peer.KVCache),
    "RotatingKVCache": (
        lambda: kv.RotatingKVCache(max_size=WINDOW, keep=0),
        lambda: peer.RotatingKVCache(max_size=WINDOW, keep=0),
    ),
    "QuantizedKVCache": (
        lambda: kv.QuantizedKVCache(group_size=32, bits=4),
        lambda: peer.QuantizedKVCache(group_size=32, bits=4),
    ),
}


@pytest.mark.parametrize("name", sorted(SERIAL_PAIRS))
def test_serial_reads_match_mlx_lm(name: str) -> None:
    make_ours, make_theirs = SERIAL_PAIRS[name]
    ours, theirs = make_ours(), make_theirs()
    assert ours.keys is None and ours.values is None and theirs.keys is None
    assert ours.empty() and theirs.empty() and ours.size() == 0
    for keys, values in _blocks(0):
        fetched = ours.update_and_fetch(keys, values)
        expected = theirs.update_and_fetch(keys, values)
        assert _same(fetched, expected)
        assert _same(ours.keys, expected[0]) and _same(ours.values, expected[1])
        assert _same(ours.keys_and_values(), theirs.keys_and_values())
        assert not ours.empty() and not theirs.empty()
        if name == "QuantizedKVCache":
            # mlx-lm's QuantizedKVCache keeps _BaseCache.size() == 0; kvrows counts tokens.
            assert ours.size() == ours.offset
        else:
            assert ours.size() == theirs.size()
    # Trimmed to nothing, a cache keeps its buffer: not empty, size 0 (mlx-lm's answer).
    if ours.is_trimmable():
        assert ours.trim(ours.offset) == theirs.trim(theirs.offset)
        assert not ours.empty() and not theirs.empty() and ours.size() == 0


@pytest.mark.parametrize("name", ["KVCache", "RotatingKVCache"])
def test_serial_writes_match_mlx_lm(name: str) -> None:
    """deepseek_v32's indexer writes zeros over its values; pipeline-parallel models write
    ``mx.depends(cache.keys, h)`` back. The next update then reads what mlx-lm reads."""
    make_ours, make_theirs = SERIAL_PAIRS[name]
    ours, theirs = make_ours(), make_theirs()
    blocks = _blocks(1)
    for step, (keys, values) in enumerate(blocks):
        ours.update_and_fetch(keys, values)
        theirs.update_and_fetch(keys, values)
        if step % 3 == 0:
            ours.values = mx.zeros_like(ours.keys)
            theirs.values = mx.zeros_like(theirs.keys)
        else:
            hidden = mx.ones((1, 4))
            ours.keys = mx.depends(ours.keys, hidden)
            theirs.keys = mx.depends(theirs.keys, hidden)
        assert _same(ours.keys_and_values(), theirs.keys_and_values())


def test_a_write_changes_only_this_cache() -> None:
    cache = _feed(kv.KVCache(), _blocks(2, (5,)))
    handed_out = cache.keys
    before = np.array(handed_out)
    cache.keys = mx.zeros_like(cache.keys)
    assert np.array_equal(np.array(handed_out), before)  # arrays already read keep theirs
    assert not np.any(np.array(cache.keys))
    assert cache.offset == 5 and cache.size() == 5


# -- layouts ---------------------------------------------------------------------------


def _layout(name: str, seed: int) -> Any:
    """Layout ``name`` holding three rows of different lengths (plain or affine)."""
    entry = next(c for c in landed() if c.name == name)
    serial_name = entry.serial
    assert serial_name is not None
    serial_cls: Any = getattr(kv, serial_name)
    layout_cls: Any = getattr(kv, name)
    params = _geometry_params(name)
    if entry.codec == "affine":
        params.update(group_size=32, bits=4)
    rows = [
        _feed(serial_cls(**params), _blocks(seed + i, steps))
        for i, steps in enumerate(((3, 1, 1), (5, 1, 1, 1), (2,)))
    ]
    layout = layout_cls(**params)
    layout.merge_rows(rows)
    return layout


#: The drop-in surface's classes: every landed class but the delayed layouts, whose rows sit
#: in two groups of different codecs, so there is no one buffer to write (their reads follow
#: the phase: ``test_delayed_layout_reads``).
DROP_INS = [
    c
    for c in landed()
    if "delayed" not in c.modifiers
    and c.geometry not in ("latent", "recurrent")
    and c.codec != "latent"
]
# (latent caches reach mlx-lm's MLA layers through LatentCacheList: tests/test_latent_models.py;
# recurrent state is ArraysCache's drop-in: tests/test_recurrent_models.py)
LAYOUTS = sorted(c.name for c in DROP_INS if c.is_layout)
PLAIN_LAYOUTS = sorted(c.name for c in DROP_INS if c.is_layout and c.codec == "plain")


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_reads(name: str) -> None:
    layout_cls: Any = getattr(kv, name)
    capped = bool(_geometry_params(name))  # a ring's window, a chunk: size() is capped
    empty = layout_cls(**_geometry_params(name), **_affine_params(name))
    assert empty.keys is None and empty.values is None and empty.empty() and empty.size() == 0
    layout = _layout(name, 3)
    fetched = layout.fetch()
    assert _same(layout.keys, fetched[0]) and _same(layout.values, fetched[1])
    assert _same(layout.keys_and_values(), fetched)
    width = int(_flat(fetched)[0].shape[2])
    assert layout.size() == (min(width, WINDOW) if capped else width)
    assert not layout.empty()


def _geometry_params(name: str) -> dict[str, int]:
    """A ring's window or a chunk of ``WINDOW`` positions (nothing for full attention)."""
    names = {"ring": "max_size", "chunked": "chunk_size"}
    kind = next(c for c in landed() if c.name == name).geometry
    return {names[kind]: WINDOW} if kind in names else {}


def _affine_params(name: str) -> dict[str, int]:
    entry = next(c for c in landed() if c.name == name)
    return {"group_size": 32, "bits": 4} if entry.codec == "affine" else {}


@pytest.mark.parametrize("name", PLAIN_LAYOUTS)
def test_layout_write_reads_back(name: str) -> None:
    layout = _layout(name, 4)
    written = mx.array(np.random.default_rng(5).standard_normal(layout.keys.shape), mx.float32)
    layout.keys = written
    layout.values = mx.depends(layout.values, written)
    assert _same(layout.keys, written)
    step = _blocks(6, (1,), rows=layout.batch_size)[0]
    layout.update_and_fetch(*step)  # still a working layout
    assert layout.offset.tolist() == [6, 9, 3]


@pytest.mark.parametrize(
    ("ours_name", "peer_class"),
    [("PaddedKVRows", peer.BatchKVCache), ("BatchedRotatingCache", peer.BatchRotatingKVCache)],
)
def test_layout_writes_match_mlx_lm_batch(ours_name: str, peer_class: Any) -> None:
    ring = "Rotat" in ours_name
    serial_ours: Any = kv.RotatingKVCache if ring else kv.KVCache
    serial_theirs: Any = peer.RotatingKVCache if ring else peer.KVCache
    params = {"max_size": WINDOW} if ring else {}
    prompts = [_blocks(10 + i, steps) for i, steps in enumerate(((3, 1), (5,), (2, 1, 1)))]
    ours_rows = [_feed(serial_ours(**params), p) for p in prompts]
    their_rows = [_feed(serial_theirs(**params), p) for p in prompts]
    ours: Any = getattr(kv, ours_name)(**params)
    ours.merge_rows(ours_rows)
    theirs = peer_class.merge(their_rows)
    for step, block in enumerate(_blocks(20, (1, 1, 1, 1, 1), rows=3)):
        assert _same(ours.update_and_fetch(*block), theirs.update_and_fetch(*block))
        if step % 2:
            ours.values = mx.zeros_like(ours.keys)
            theirs.values = mx.zeros_like(theirs.keys)  # its whole buffer, as the model does
        else:
            ours.keys = mx.depends(ours.keys, block[0])
    assert _same(ours.keys_and_values(), theirs.keys_and_values())


# -- refusals --------------------------------------------------------------------------


def _filled(name: str) -> Any:
    if name in SERIAL_PAIRS:
        return _feed(SERIAL_PAIRS[name][0](), _blocks(7))
    return _layout(name, 7)


@pytest.mark.parametrize("name", [*sorted(SERIAL_PAIRS), *LAYOUTS])
def test_refused_writes_change_nothing(name: str) -> None:
    cache = _filled(name)
    keys = cache.keys
    affine = isinstance(keys, tuple)
    attempts: list[tuple[str, object]] = [
        ("keys", None),
        ("values", "text"),
        ("keys", mx.zeros((1, 2, 3, 4))),
    ]
    if affine:
        attempts.append(("keys", keys))  # even its own triple: the planes are read-only
    else:
        attempts.append(("keys", keys.astype(mx.float16)))  # right shape, wrong dtype
        attempts.append(("values", keys[:, :, :-1]))  # one token short
    for attribute, value in attempts:
        before = _snapshot(cache)
        with pytest.raises(InvalidInputError) as refused:
            setattr(cache, attribute, value)
        assert type(cache).__name__ in str(refused.value)
        assert _unchanged(before, _snapshot(cache))


@pytest.mark.parametrize("name", [*sorted(SERIAL_PAIRS), *LAYOUTS])
def test_an_empty_cache_reads_none_and_refuses_arrays(name: str) -> None:
    cache: Any
    if name in SERIAL_PAIRS:
        cache = SERIAL_PAIRS[name][0]()
    else:
        cache = getattr(kv, name)(**_geometry_params(name), **_affine_params(name))
    assert cache.keys is None and cache.values is None
    cache.keys = None  # reading None and writing it back changes nothing
    with pytest.raises(LayoutStateError, match="update_and_fetch"):
        cache.values = mx.zeros((1, HEADS, 1, DIM))
    with pytest.raises(LayoutStateError):
        cache.keys_and_values()
    assert cache.empty() and cache.keys is None


# -- to_quantized ----------------------------------------------------------------------


@pytest.mark.parametrize(("group_size", "bits"), [(64, 4), (32, 8), (64, 2)])
def test_to_quantized_matches_mlx_lm(group_size: int, bits: int) -> None:
    blocks = _blocks(30, (5, 1, 1))
    ours, theirs = _feed(kv.KVCache(), blocks), _feed(peer.KVCache(), blocks)
    before = np.array(ours.keys)
    ours_q = ours.to_quantized(group_size=group_size, bits=bits)
    theirs_q = theirs.to_quantized(group_size=group_size, bits=bits)
    assert type(ours_q) is kv.QuantizedKVCache
    assert (ours_q.bits, ours_q.group_size, ours_q.offset) == (bits, group_size, 7)
    assert _same(ours_q.keys_and_values(), theirs_q.keys_and_values())
    for keys, values in _blocks(31, (1, 3, 1)):  # the copy keeps working like mlx-lm's
        assert _same(ours_q.update_and_fetch(keys, values), theirs_q.update_and_fetch(keys, values))
    assert np.array_equal(np.array(ours.keys), before) and ours.offset == 7  # source unchanged
    ours.update_and_fetch(*_blocks(32, (1,))[0])
    assert ours_q.offset == 12  # independent


def test_to_quantized_defaults_and_empty() -> None:
    empty = kv.KVCache()
    converted = empty.to_quantized()
    assert (converted.bits, converted.group_size) == (4, 64)  # mlx-lm's defaults
    assert converted.empty() and converted.offset == 0 and converted.keys is None
    block = _blocks(33, (2,))[0]
    assert _same(
        converted.update_and_fetch(*block), peer.QuantizedKVCache(64, 4).update_and_fetch(*block)
    )


def test_ring_to_quantized_keeps_the_ring_positions() -> None:
    """mlx-lm cannot quantize a ring (NotImplementedError). kvrows converts it in place
    order: the result reads mx.quantize of what mlx-lm's ring reads, before and after more
    updates (single tokens that wrap, and a block)."""
    blocks = _blocks(40, (4, 1, 1, 1, 1))  # wrapped: offset 8 > window 6
    ours, theirs = (
        _feed(kv.RotatingKVCache(WINDOW), blocks),
        _feed(peer.RotatingKVCache(WINDOW), blocks),
    )
    with pytest.raises(NotImplementedError):
        theirs.to_quantized()
    converted = ours.to_quantized(group_size=32, bits=8)
    assert type(converted) is kv.RotatingQuantizedKVCache
    assert converted.max_size == WINDOW and converted.offset == 8

    def quantized(fetched: Any) -> tuple[Any, Any]:
        return tuple(  # type: ignore[return-value]
            tuple(mx.quantize(x, group_size=32, bits=8)) for x in fetched
        )

    assert _same(converted.keys_and_values(), quantized(theirs.keys_and_values()))
    for n in (1, 1, 3, 1, 1):
        keys, values = _blocks(41 + n, (n,))[0]
        # The same phase as the plain ring it came from (mlx-lm's N=1 masks are None here).
        assert _same(
            converted.make_mask(n, return_array=True), ours.make_mask(n, return_array=True)
        )
        got = converted.update_and_fetch(keys, values)
        assert _same(got, quantized(theirs.update_and_fetch(keys, values)))
        ours.update_and_fetch(keys, values)
    assert converted.offset == theirs.offset


@pytest.mark.parametrize("name", PLAIN_LAYOUTS)
def test_layout_to_quantized(name: str) -> None:
    layout = _layout(name, 50)
    entry = affine_counterpart(name)
    if entry is None:  # RaggedRotatingRows: no landed affine ragged ring
        before = _snapshot(layout)
        with pytest.raises(InvalidInputError, match="extract_row"):
            layout.to_quantized()
        assert _unchanged(before, _snapshot(layout))
        return
    converted = layout.to_quantized(group_size=32, bits=4)
    assert type(converted).__name__ == entry.name
    assert converted.row_offsets == layout.row_offsets and converted.left_pad == layout.left_pad
    # Each row's tokens are mx.quantize of the plain row's (the padding around them,
    # masked, is quantized zeros: a scale of -1e-7 where a fresh affine buffer holds 0).
    reference = _layout(entry.name, 50)  # the same rows as affine serial caches, merged
    step = _blocks(51, (1,), rows=3)[0]
    for check in range(2):
        for row in range(3):
            plain = layout.row_planes(row)
            expected = tuple(tuple(mx.quantize(x[0], group_size=32, bits=4)) for x in plain)
            assert _same(converted.row_planes(row), expected)
            assert _same(reference.row_planes(row), expected)
        mask = converted.make_mask(1, return_array=True)
        assert _same(mask, reference.make_mask(1, return_array=True))
        if not check:
            converted.update_and_fetch(*step)
            reference.update_and_fetch(*step)
            layout.update_and_fetch(*step)


def test_counterparts() -> None:
    assert {
        name: (None if affine_counterpart(name) is None else affine_counterpart(name).name)  # type: ignore[union-attr]
        for name in ("KVCache", "RotatingKVCache", "PaddedKVRows", "BatchedKVCache",
                     "BatchedRotatingCache", "RaggedRotatingRows")
    } == {
        "KVCache": "QuantizedKVCache",
        "RotatingKVCache": "RotatingQuantizedKVCache",
        "PaddedKVRows": "PaddedQuantKVRows",
        "BatchedKVCache": "BatchedQuantizedKVCache",
        "BatchedRotatingCache": "BatchedRotatingQuantCache",
        "RaggedRotatingRows": None,
    }  # fmt: skip


def test_affine_classes_have_no_to_quantized() -> None:
    """As mlx-lm's QuantizedKVCache: generate(kv_bits=...) asks hasattr on every step."""
    for entry in landed():
        cls: Any = getattr(kv, entry.name)
        assert hasattr(cls, "to_quantized") == (entry.codec == "plain"), entry.name
    with pytest.raises(AttributeError, match="already affine-quantized"):
        kv.QuantizedKVCache().to_quantized()


@pytest.mark.parametrize(("group_size", "bits"), [(64, 7), (48, 4), (128, 4), (True, 4), (64, "4")])
def test_to_quantized_refusals_change_nothing(group_size: Any, bits: Any) -> None:
    cache = _feed(kv.KVCache(), _blocks(60, (3,)))  # head dim 64: group 128 does not fit
    before = _snapshot(cache)
    with pytest.raises(InvalidInputError):
        cache.to_quantized(group_size=group_size, bits=bits)
    assert _unchanged(before, _snapshot(cache))


def test_never_attribute_error() -> None:
    """Every member mlx-lm's models read exists on every class, empty or not."""
    for entry in DROP_INS:
        cls: Any = getattr(kv, entry.name)
        cache = cls(**_geometry_params(entry.name), **_affine_params(entry.name))
        for member in ("keys", "values", "keys_and_values", "size", "empty", "offset", "nbytes"):
            getattr(cache, member)
        with pytest.raises(KvRowsError):
            cache.keys_and_values()


def test_step_is_the_growth_step() -> None:
    """mlx-lm's ``step`` (its test grows a cache by ``cache.step`` tokens) reads 256."""
    cache, theirs = kv.KVCache(), peer.KVCache()
    assert cache.step == theirs.step == 256
    block = _blocks(70, (cache.step + 1,))[0]
    cache.update_and_fetch(*block)
    theirs.update_and_fetch(*block)
    assert cache.capacity == theirs.keys.shape[2] == 512  # the same growth
    with pytest.raises(InvalidInputError, match="fixed"):
        cache.step = 512
    assert cache.step == 256


def test_the_mixins_do_not_reorder_the_geometry() -> None:
    """The drop-in mixins sit in front of each class without changing which geometry or
    arrangement method wins (a ring's ``projected_bytes`` stays the ring's)."""
    from kvrows.optimized.batch_dropin import LayoutBatchOps, SerialMerge
    from kvrows.optimized.dropin import LayoutDropIn, SerialDropIn, _HeldPlanes

    mixins = (SerialDropIn, LayoutDropIn, _HeldPlanes, SerialMerge, LayoutBatchOps)
    for entry in landed():
        cls: Any = getattr(kv, entry.name)
        bases = tuple(b for b in cls.__bases__ if b not in mixins)
        bare = type("Bare", bases, {})
        assert [c for c in cls.__mro__[1:] if c not in mixins] == list(bare.__mro__[1:])


@pytest.mark.parametrize("name", ["DelayedQuantizedKVCache", "DelayedRotatingQuantizedKVCache"])
def test_delayed_layout_reads(name: str) -> None:
    """The read surface follows the phase: the plain group's, then (packed) the affine
    group's; mixed rows have no one buffer and refuse."""
    ring = "Rotat" in name
    params: dict[str, int] = {"max_size": WINDOW} if ring else {}
    layout: Any = getattr(kv, name)(**params, group_size=32, bits=4, start=6)
    assert layout.empty() and layout.size() == 0 and layout.keys is None
    serial: Any = kv.RotatingKVCache if ring else kv.KVCache
    layout.merge_rows(
        [_feed(serial(**params), _blocks(30 + i, (n,))) for i, n in enumerate((2, 4))]
    )
    assert layout.phase == "plain"
    assert _same(layout.keys_and_values(), layout.fetch())
    keys, _ = layout.fetch()
    assert _same(layout.keys, keys) and layout.size() == int(keys.shape[2])
    assert not isinstance(layout.keys, tuple)  # plain keys
    assert layout.left_padding.tolist() == list(layout.left_pad)
    layout.update_and_fetch(*_blocks(31, (2,), rows=2)[0])  # row 1 reaches 6: mixed
    assert layout.phase == "mixed"
    for read in (lambda: layout.keys, lambda: layout.values, layout.keys_and_values):
        with pytest.raises(MixedPrecisionReadError):
            read()
    with row_reads():
        layout.update_and_fetch(*_blocks(32, (2,), rows=2)[0])
    assert layout.phase == "packed"
    keys, _ = layout.fetch()
    assert _same(layout.keys, keys) and len(keys) == 3  # the affine triple
    # A ring row read after a block holds ``max_size - 1`` history tokens and the block
    # (row 1 here: 7 columns); ``size()`` is capped at the window (mlx-lm's).
    width = int(keys[0].shape[2])
    assert layout.size() == (min(width, WINDOW) if ring else width) and not layout.empty()


def _spec_mapping_rows() -> tuple[list[str], list[list[str]]]:
    """spec/mlx-lm-drop-in.md §3's mapping table: the scheme names of its header and its
    rows' cells."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "spec" / "mlx-lm-drop-in.md").read_text()
    section = text[text.index("## 3. ") : text.index("## 4. ")]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = next(i for i, line in enumerate(lines) if line.startswith("| mlx-lm template |"))
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[header:]]
    schemes = [c.strip("`") for c in cells[0][2:]]
    return schemes, cells[2:]  # past the header and its |---| rule


class _TemplateModel:
    """A model's cache surface only: the spec row's template as its one layer."""

    model_type = "spec_row"

    def __init__(self, template: Any) -> None:
        self.layers = [template]
        self._template = template

    def make_cache(self) -> list[Any]:
        return [self._template]

    def parameters(self) -> dict[str, Any]:
        return {}


def test_spec_mapping_table_is_make_kvrows_cache() -> None:
    """Each row of the spec's table, its template built as written there, gets the class
    (and ``keep``) or the refusal the table says under each column's scheme."""
    import re

    from kvrows.app.models import make_kvrows_cache
    from kvrows.schemes import KvStorageScheme

    schemes, rows = _spec_mapping_rows()
    assert schemes == ["plain", "affine", "turbo-k4v4"] and len(rows) >= 8
    for row in rows:
        expression = re.fullmatch(r"`([^`]+)`", row[0])
        assert expression, f"the template cell {row[0]!r} is not one code span"
        for scheme_name, cell in zip(schemes, row[2:], strict=True):
            # a fresh template each time: mlx-lm's constructors, as the spec writes them
            template = eval(expression.group(1), dict(vars(peer)))
            model = _TemplateModel(template)
            scheme = KvStorageScheme.parse(scheme_name)
            where = f"{row[0]} under {scheme_name}"
            if cell.startswith("refused"):
                with pytest.raises(InvalidInputError, match="spec_row, layer 0"):
                    make_kvrows_cache(model, scheme)
                continue
            named = re.match(r"`(\w+)`", cell)
            assert named, f"{where}: the cell {cell!r} names no class"
            (cache,) = make_kvrows_cache(model, scheme)
            assert type(cache).__name__ == named.group(1), where
            keep = re.search(r"`keep=(\d+)`", cell)
            assert int(getattr(cache, "keep", 0)) == (int(keep.group(1)) if keep else 0), where
