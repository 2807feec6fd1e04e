"""Per-row stages of the row machinery (contract §0.5), against one-stage storages.

A layout of two stages (plain, then affine) holds rows in either; each row must hold what
a serial storage of its stage's codec fed the same tokens holds (a conversion re-encodes
per token, so a converted row is what the affine storage fed its tokens holds). The oracle
is the public one-stage classes; the operations are drawn (append, convert, filter, merge,
trim, extract), and every refusal must leave the layout as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from array_helpers import to_mx
from hypothesis import given
from hypothesis import strategies as st
from stage_helpers import Request, TwoStages, drawn_steps, planes_of, same_planes

import kvrows.reference as ref
from kvrows.codecs.latent import Latent
from kvrows.conformance.profiles import active_profile, profile_settings
from kvrows.conversion import MIXED_READ
from kvrows.errors import (
    LayoutStateError,
    MixedPrecisionReadError,
    last_stage_message,
)
from kvrows.schemes import Affine, Plain

TARGET = Affine(bits=4, group_size=32)
HEADS, DIM = 2, 32


def _tokens(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    return rng.standard_normal((rows, HEADS, n, DIM)).astype(np.float16)


class _Staged(TwoStages):
    """A two-stage reference layout (plain, then affine), its one-stage plain shadow and
    the rows' record: each row holds what a serial storage of its stage's codec fed the
    same tokens holds, at the shadow's columns."""

    def __init__(self, seed: int) -> None:
        self.layout = ref.BatchedKVCache()
        self.layout._use_stages((Plain(), TARGET))
        self.shadow = ref.BatchedKVCache()
        self.requests: list[Request] = []
        self.rng = np.random.default_rng(seed)

    def tokens(self, rows: int, n: int) -> np.ndarray:
        return _tokens(self.rng, rows, n)

    def serial(self, request: Request, stage: int | None = None, twin: bool = False) -> Any:
        stage = request.stage if stage is None else stage
        cache = ref.KVCache() if stage == 0 else ref.QuantizedKVCache(32, 4)
        for k, v in zip(request.keys, request.values, strict=True):
            cache.update_and_fetch(k, v)
        return cache

    def oracle(self, stage: int, rows: list[int]) -> Any:
        layout = ref.BatchedKVCache() if stage == 0 else ref.BatchedQuantizedKVCache(32, 4)
        layout.merge_rows([self.serial(self.requests[b]) for b in rows])
        return layout

    def meta(self) -> tuple[Any, ...]:
        layout = self.layout
        return layout.row_stages, layout.row_offsets, layout.left_pad, layout.nbytes

    def check(self) -> None:
        checked = self.check_rows((Plain(), TARGET))
        if checked is None:
            return
        parts, stages = checked
        for (rows, codec, reads), stage in zip(parts, stages, strict=True):
            assert codec.spec == (Plain(), TARGET)[stage]
            for i, b in enumerate(rows):
                pad, n = self.layout.left_pad[b], self.requests[b].offset
                if not n:
                    continue  # a row trimmed to nothing: no column to compare
                expected = self.serial(self.requests[b]).fetch()
                for tensor, want in zip(("keys", "values"), expected, strict=True):
                    got = [p[i, :, pad : pad + n] for p in planes_of(reads[tensor])]
                    assert same_planes(got, [p[0] for p in planes_of(want)]), (b, tensor)
        self.check_reads(parts, stages)


@profile_settings(max_examples=active_profile().max_examples // 6)  # ci 25, deep 100
@given(st.data())
def test_rows_of_two_stages_hold_what_each_stage_storage_holds(data: st.DataObject) -> None:
    staged = _Staged(data.draw(st.integers(0, 2**16), label="seed"))
    drawn_steps(
        staged,
        data,
        longest=6,
        trim=lambda requests: [
            data.draw(st.integers(0, r.offset), label="count") for r in requests
        ],
        rows_first=(2, 4),
        steps=(3, 10),
    )


def test_a_mixed_read_is_refused_with_the_seed_words_and_a_serial_storage_moves_whole() -> None:
    """The messages: a mixed read is ``MIXED_READ``; converting a row in the last stage
    names it; a serial storage refuses to convert some of its rows."""
    rng = np.random.default_rng(3)
    layout = ref.BatchedKVCache()
    layout._use_stages((Plain(), TARGET))
    sources = []
    for n in (2, 4):
        cache = ref.KVCache()
        block = _tokens(rng, 1, n)
        cache.update_and_fetch(block, block)
        sources.append(cache)
    layout.merge_rows(sources)
    layout._convert_rows([1])
    with pytest.raises(MixedPrecisionReadError) as refused:
        layout.fetch()
    assert str(refused.value) == MIXED_READ
    with pytest.raises(LayoutStateError) as last:
        layout._convert_rows([0, 1])
    assert str(last.value) == last_stage_message(1, 1)
    assert layout.row_stages == (0, 1)
    serial = ref.KVCache()
    serial._use_stages((Plain(), TARGET))
    block = _tokens(rng, 2, 3)
    serial.update_and_fetch(block, block)
    with pytest.raises(LayoutStateError, match="convert together"):
        serial._convert_rows([0])
    serial._convert_rows([0, 1])
    assert serial.codec_spec == TARGET


@pytest.mark.parametrize("optimized", [False, True], ids=("reference", "optimized"))
def test_latent_rows_of_two_stages_read_one_dense_image(optimized: bool) -> None:
    """Stages whose codecs all read dense arrays (a plain and an encoded latent) read as one
    image (contract §0.5): each row's latent is what a cache of its stage's codec fed its
    tokens reads, at its columns; the rope plane is exact in every row; an append to rows
    of both stages reads the same way."""
    import kvrows.optimized as kv

    impl: Any = kv if optimized else ref
    native: Callable[[np.ndarray], Any] = to_mx if optimized else (lambda a: a)
    plain_spec = Latent(inner=Plain())
    target = Latent(inner=Affine(bits=8, group_size=32))
    rng = np.random.default_rng(5)
    lengths = (3, 6, 4)
    tokens = [
        (rng.standard_normal((1, 1, n, 64)), rng.standard_normal((1, 1, n, 16))) for n in lengths
    ]
    tokens = [(a.astype(np.float16), b.astype(np.float16)) for a, b in tokens]

    def solo(spec: Latent, b: int, steps: list[tuple[np.ndarray, np.ndarray]]) -> Any:
        cache = impl.MLACache(codec=spec)
        for latent, rope in [tokens[b], *steps]:
            cache.append(native(latent), native(rope))
        return cache

    layout = impl.MLACache()
    layout._use_stages((plain_spec, target))
    layout.merge_rows([solo(plain_spec, b, []) for b in range(len(lengths))])
    layout._convert_rows([0, 2])  # not a suffix: the stages' parts come out of batch order
    assert layout.row_stages == (1, 0, 1)
    steps: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in lengths]
    for step in range(2):
        latent, rope = layout.fetch()
        width = int(latent.shape[2])
        for b, stage in enumerate(layout.row_stages):
            want_latent, want_rope = solo((plain_spec, target)[stage], b, steps[b]).fetch()
            held = layout.row_offsets[b]
            got = [np.asarray(p)[b : b + 1, :, width - held :] for p in (latent, rope)]
            assert np.array_equal(got[0], np.asarray(want_latent)), (step, b)
            assert np.array_equal(got[1], np.asarray(want_rope)), (step, b)
        block = (
            rng.standard_normal((3, 1, 1, 64)).astype(np.float16),
            rng.standard_normal((3, 1, 1, 16)).astype(np.float16),
        )
        layout.append(native(block[0]), native(block[1]))
        for b in range(len(lengths)):
            steps[b].append((block[0][b : b + 1], block[1][b : b + 1]))
    layout.check_valid()
