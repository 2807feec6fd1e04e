"""Rings with sink tokens (``keep > 0``) against mlx-lm's ``RotatingKVCache(max_size, keep)``.

Keys are tagged with their position (key ``[..., 0] = position + 1``), so what a query
attends is read back as a set of positions. The oracles: mlx-lm's own ring (same inputs:
stored tokens, physical order and ring index always; masks for single tokens), the
rule the spec states (``spec/RotatingKVCache.md`` §1.1: a query sees its row's sinks and
its newest ``max_size - keep`` positions), and a serial ring that saw the same tokens
(solo replay) for rows that went through a layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import numpy as np
import pytest

import kvrows.optimized as O
import kvrows.reference as R
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.errors import IncompatibleRowsError, InvalidInputError
from kvrows.schemes import Ring

peer: Any = mlx_lm_cache  # mlx-lm is untyped

SERIAL_STEPS = (3, 1, 1, 1, 1, 1, 1, 4, 1, 1, 1, 1, 2, 1, 1, 9, 1, 1)  # wraps, blocks past it


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _block(first: int, n: int, rows: int = 1, row_tag: Sequence[int] = (0,)) -> Any:
    """``[rows, 1, n, 2]`` float32: key ``[b, 0, i, 0] = 1000 * tag[b] + first + i + 1``."""
    block = np.ones((rows, 1, n, 2), dtype=np.float32)
    for b in range(rows):
        block[b, 0, :, 0] = 1000 * row_tag[b] + np.arange(first, first + n) + 1
    return block


def _positions(keys: Any, row: int = 0) -> list[int]:
    return [int(x) % 1000 - 1 for x in np.array(keys)[row, 0, :, 0]]


def _seen(mask: Any, columns: list[int], n: int) -> list[list[int]]:
    """The positions each of ``n`` queries attends (``columns``: each column's position)."""
    width = len(columns)
    if mask is None:
        grid = np.ones((n, width), dtype=bool)
    elif isinstance(mask, str):
        grid = np.arange(width)[None, :] <= np.arange(n)[:, None] + width - n
    else:
        grid = np.array(mask).reshape(-1, n, width)[-1]
    return [sorted(p for p, v in zip(columns, line, strict=True) if v and p >= 0) for line in grid]


def _rule(
    before: int, n: int, max_size: int, keep: int, window: int | None = None
) -> list[list[int]]:
    """What the spec says query ``i`` sees: sinks and the newest ``reach`` positions it
    may (everything a ring of this size still holds)."""
    held = min(before, max_size - 1) + n
    head = min(keep, before + n)
    kept = [*range(head), *range(before + n - held + head, before + n)]
    reach = max(1, (window or max_size) - keep)
    return [
        [j for j in kept if j <= p and (j < keep or p - j < reach)]
        for p in range(before, before + n)
    ]


@pytest.mark.parametrize(("max_size", "keep"), [(6, 2), (5, 1), (8, 3), (4, 3)])
def test_serial_rings_attend_like_mlx_lm(max_size: int, keep: int) -> None:
    """Single tokens: the same keys, order, ring index and mask as mlx-lm. Blocks: the same
    stored keys; the first query sees what mlx-lm's does, every query the spec's rule."""
    theirs = peer.RotatingKVCache(max_size, keep)
    ours_opt, ours_ref = (
        O.RotatingKVCache(max_size, keep=keep),
        R.RotatingKVCache(max_size, keep=keep),
    )
    position, sink_hidden = 0, 0
    for n in SERIAL_STEPS:
        block = _block(position, n)
        masks = [c.make_mask(n) for c in (theirs, ours_opt, ours_ref)]
        k_lm, _ = theirs.update_and_fetch(mx.array(block), mx.array(block))
        k_opt, _ = ours_opt.update_and_fetch(mx.array(block), mx.array(block))
        k_ref, _ = ours_ref.update_and_fetch(block, block)
        columns = _positions(k_lm)
        assert _positions(k_opt) == columns  # mlx-lm's physical order, bit for bit
        assert ours_opt.ring_index == theirs._idx and ours_opt.offset == theirs.offset
        assert sorted(_positions(k_ref)) == sorted(columns)  # the reference reads in time order
        seen_lm = _seen(masks[0], columns, n)
        seen_opt = _seen(masks[1], columns, n)
        assert seen_opt == _seen(masks[2], _positions(k_ref), n)
        assert seen_opt == _rule(position, n, max_size, keep)
        assert seen_opt[0] == seen_lm[0]
        if n == 1:
            assert seen_opt == seen_lm
        sink_hidden += sum(not set(range(min(keep, position + 1))) <= set(s) for s in seen_lm)
        position += n
    assert sink_hidden > 0  # mlx-lm's block masks did slide over the sinks (K1)


def test_serial_attention_output_matches_mlx_lm_on_single_tokens() -> None:
    from mlx_lm.models.base import scaled_dot_product_attention

    from kvrows.optimized.attention import attend

    rng = np.random.default_rng(0)
    theirs, ours = peer.RotatingKVCache(6, 2), O.RotatingKVCache(6, keep=2)
    for step, n in enumerate((4, 1, 1, 1, 1, 1, 1, 1, 1)):
        keys = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        values = mx.array(rng.standard_normal((1, 2, n, 8)).astype(np.float32))
        queries = mx.array(rng.standard_normal((1, 4, n, 8)).astype(np.float32))
        mask_lm, mask = theirs.make_mask(n), ours.make_mask(n)
        k, v = theirs.update_and_fetch(keys, values)
        ours.update_and_fetch(keys, values)
        want = scaled_dot_product_attention(queries, k, v, cache=theirs, scale=0.35, mask=mask_lm)
        got = attend(queries, ours, mask, 0.35)
        assert np.array_equal(np.array(got), np.array(want)), step


def test_window_size_counts_the_sinks() -> None:
    """``window_size`` includes the sinks: window 3 with keep 2 leaves each query itself."""
    for impl in (O, R):
        ring = impl.RotatingKVCache(6, keep=2)
        _feed(impl, ring, _block(0, 9))
        mask = ring.make_mask(1, window_size=3)
        _feed(impl, ring, _block(9, 1))
        columns = _positions(ring.fetch()[0])
        assert np.array(mask).shape == (len(columns),)  # mlx-lm's 1-D shape
        assert _seen(mask, columns, 1) == [[0, 1, 9]] == _rule(9, 1, 6, 2, window=3)


def test_one_query_masks_have_mlx_lm_shape() -> None:
    """``make_mask(1, window_size=w)`` on a serial ring: 1-D ``[S]`` like mlx-lm's."""
    theirs = peer.RotatingKVCache(6)
    ours: list[Any] = [O.RotatingKVCache(6), R.RotatingKVCache(6)]
    for position in range(9):
        block = _block(position, 1)
        want = theirs.make_mask(1, window_size=3)
        for cache in ours:
            got = cache.make_mask(1, window_size=3)
            assert (got is None) == (want is None)
            if want is not None:
                assert np.array(got).shape == tuple(want.shape) == (min(position + 1, 6),)
            _feed(R if cache is ours[1] else O, cache, block)
        theirs.update_and_fetch(mx.array(block), mx.array(block))
    assert np.array(ours[0].make_mask(1, return_array=True)).shape == (6,)


# ------------------------------------------------------------- keep through the layouts

LAYOUTS = ("BatchedRotatingCache", "RaggedRotatingRows")
AFFINE = ("BatchedRotatingQuantCache", "RotatingAffineLayout")


def _make(impl: Any, name: str, max_size: int, keep: int) -> Any:
    if "Quant" in name or "Affine" in name:
        return getattr(impl, name)(max_size, 32, 8, keep=keep)
    return getattr(impl, name)(max_size, keep=keep)


def _serial_for(name: str) -> str:
    return (
        "RotatingQuantizedKVCache" if ("Quant" in name or "Affine" in name) else "RotatingKVCache"
    )


def _feed(impl: Any, cache: Any, block: Any) -> None:
    arr = block if impl is R else mx.array(block)
    cache.update_and_fetch(arr, arr)


def _window_positions(impl: Any, cache: Any) -> list[int]:
    window = cache.window()
    if window is None:
        return []
    keys = window[0]
    if len(keys) > 1:  # affine: dequantize the codes
        codes, scales, biases = (mx.array(p) for p in keys)
        keys = mx.dequantize(codes, scales, biases, group_size=32, bits=8)
    else:
        keys = keys[0]
    return [round(float(x)) % 1000 - 1 for x in np.array(keys)[0, 0, :, 0]]


def _tagged(first: int, n: int, rows: int, tags: Sequence[int], dim: int) -> Any:
    block = np.zeros((rows, 1, n, dim), dtype=np.float32)
    for b in range(rows):
        block[b, 0, :, 0] = 1000 * tags[b] + np.arange(first, first + n) + 1
    return block


@pytest.mark.parametrize("name", LAYOUTS + AFFINE)
@pytest.mark.parametrize("impl", [O, R], ids=["optimized", "reference"])
def test_keep_survives_merge_filter_extract(name: str, impl: Any) -> None:
    """Rows of 1, 9 and 3 tokens (keep 2, window 6) merge, step, filter and extract: every
    extracted row holds its sinks and newest tokens and continues like its solo replay."""
    max_size, keep, dim = 6, 2, 32 if name in AFFINE else 2
    lengths = (1, 9, 3)
    serial = _serial_for(name)
    # Small integer tags only: the affine codec must round-trip them (8 bits over 0..~40).
    sources, solos = [], []
    for length in lengths:
        ring, solo = (_make(impl, serial, max_size, keep) for _ in range(2))
        if length:
            block = _tagged(0, length, 1, [0], dim)
            _feed(impl, ring, block)
            _feed(impl, solo, block)
        sources.append(ring)
        solos.append(solo)
    layout = _make(impl, name, max_size, keep)
    layout.merge_rows(sources)
    offsets = list(lengths)
    for n in (1, 1, 3, 1, 1, 1):
        block = np.concatenate([_tagged(o, n, 1, [0], dim) for o in offsets])
        _feed(impl, layout, block)
        for b, solo in enumerate(solos):
            _feed(impl, solo, block[b : b + 1])
        offsets = [o + n for o in offsets]
        layout.check_valid()
    layout.filter_rows([2, 0])
    solos = [solos[2], solos[0]]
    offsets = [offsets[2], offsets[0]]
    for b, solo in enumerate(solos):
        extracted = layout.extract_row(b)
        assert extracted.token_geometry == Ring(max_size=max_size, keep=keep)
        expected = [*range(keep), *range(offsets[b] - (max_size - keep), offsets[b])]
        assert _window_positions(impl, extracted) == expected == _window_positions(impl, solo)
        more = _tagged(offsets[b], 2, 1, [0], dim)
        _feed(impl, extracted, more)
        _feed(impl, solo, more)
        assert _window_positions(impl, extracted) == _window_positions(impl, solo)


def test_mlx_lm_batch_ring_loses_keep() -> None:
    """B7 (why a layout with sinks has no mlx-lm mirror): merge and extract drop ``keep``."""
    ring = peer.RotatingKVCache(4, 2)
    block = mx.array(_block(0, 6))
    ring.update_and_fetch(block, block)
    assert peer.BatchRotatingKVCache.merge([ring]).extract(0).keep == 0
    layout: Any = O.BatchedRotatingCache(4, keep=2)
    layout.merge_rows([O.RotatingKVCache(4, keep=2)])
    assert layout.extract_row(0).keep == 2


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("keep", [-1, 4, 5])
def test_keep_out_of_range_is_refused(keep: int) -> None:
    with pytest.raises(InvalidInputError, match="keep"):
        Ring(max_size=4, keep=keep)
    for impl in (O, R):
        with pytest.raises(InvalidInputError, match="keep"):
            impl.RotatingKVCache(4, keep=keep)
        with pytest.raises(InvalidInputError, match="keep"):
            impl.BatchedRotatingCache(4, keep=keep)


@pytest.mark.parametrize("impl", [O, R], ids=["optimized", "reference"])
def test_rows_with_another_keep_do_not_merge(impl: Any) -> None:
    layout = impl.BatchedRotatingCache(6, keep=2)
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([impl.RotatingKVCache(6, keep=1)])
    assert layout.batch_size == 0


# ------------------------------------------------------------------------ drop-in


def test_make_kvrows_cache_takes_a_ring_with_sinks() -> None:
    """``make_prompt_cache(model, max_kv_size)``'s template, ``RotatingKVCache(n, keep=4)``:
    a short prompt, then single tokens far past the window give mlx-lm's logits."""
    model = tiny_model("llama")
    template = SimpleNamespace(
        make_cache=lambda: [peer.RotatingKVCache(12, 4) for _ in model.layers],
        parameters=model.parameters,
        args=model.args,
        layers=model.layers,
    )
    ours = make_kvrows_cache(template)
    assert all(isinstance(c, O.RotatingKVCache) and c.keep == 4 for c in ours)
    theirs = template.make_cache()
    tokens = mx.array(np.random.default_rng(3).integers(0, 256, (1, 40)))
    position = 0
    for n in (8, *([1] * 20)):
        a = model(tokens[:, position : position + n], cache=ours)
        b = model(tokens[:, position : position + n], cache=theirs)
        assert float(mx.abs(a - b).max()) <= 1e-5
        position += n
