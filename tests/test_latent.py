"""MLACache and EncodedLatentCache (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``):
fixed cases next to the latent conformance family.

Oracles: the reference against the optimized implementation, hand-written vectors (the
right-justified layout after a ragged rollback), a solo cache that saw the same tokens,
the codecs' own encode/decode, and the bytes table of the spec page.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.conformance.arrays import as_numpy, from_mlx
from kvrows.errors import (
    CapacityError,
    IncompatibleRowsError,
    InvalidInputError,
    KvRowsError,
    SpeculativeRoundError,
    self_merge_message,
)
from kvrows.latent import (
    DEEPSEEK_V3_BF16_BYTES,
    FLASHMLA_FP8_BYTES,
    latent_token_bytes,
)
from kvrows.reference import affine_codec
from kvrows.schemes import Affine, Plain, Turbo
from kvrows.table import owned_cache_layout, prefill_cache_layout, target_cache_layout

RANK, ROPE, INDEX = 64, 16, 32


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _blocks(rows: int, n: int, seed: int, index: bool = False) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((rows, 1, n, RANK)).astype(np.float32)
    rope = rng.standard_normal((rows, 1, n, ROPE)).astype(np.float32)
    if not index:
        return latent, rope
    return latent, rope, rng.standard_normal((rows, 1, n, INDEX)).astype(np.float32)


def _mx(blocks: tuple[np.ndarray, ...]) -> tuple[mx.array, ...]:
    return tuple(mx.array(b) for b in blocks)


def _rows(impl: Any, sizes: tuple[tuple[int, int], ...]) -> list[Any]:
    """One ``MLACache`` per ``(seed, tokens)``, fed that many tokens of that seed."""
    rows = []
    for seed, n in sizes:
        cache = impl.MLACache()
        blocks = _blocks(1, n, seed)
        cache.update_and_fetch(*(blocks if impl is ref else _mx(blocks)))
        rows.append(cache)
    return rows


def test_bytes_table() -> None:
    """The spec page's table: DeepSeek-V3 geometry (512 + 64), bf16."""
    bf16 = "bfloat16"

    def per_token(codec: Any, index: int | None = None) -> int:
        return latent_token_bytes(codec, 512, 64, index, bf16)

    assert per_token(Plain()) == DEEPSEEK_V3_BF16_BYTES == 1152
    assert latent_token_bytes(Plain(), 512, 64, None, "float32") == 2304
    assert per_token(Plain(), 128) == 1408
    assert per_token(Affine(bits=8, group_size=64)) == 672
    assert per_token(Affine(bits=8, group_size=128)) == FLASHMLA_FP8_BYTES == 656
    assert per_token(Affine(bits=4, group_size=64)) == 416
    assert per_token(Turbo(k_bits=8, v_bits=4)) == 416
    assert per_token(Turbo(k_bits=8, v_bits=3)) == 352
    # a cache reports the same, and bills it per projected token with its decoded window
    # (512 bf16 values per token, spec §5) beside it
    cache = opt.EncodedLatentCache(512, 64, codec=Affine(bits=8, group_size=128))
    cache.append(mx.zeros((1, 1, 1, 512), mx.bfloat16), mx.zeros((1, 1, 1, 64), mx.bfloat16))
    assert cache.bytes_per_token() == 656 and cache.projected_bytes(10) == 10 * (656 + 1024)


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_roles_signatures_and_max_tokens(impl: Any) -> None:
    cache = impl.MLACache()
    for layout in (
        owned_cache_layout(cache),
        prefill_cache_layout(cache),
        target_cache_layout(cache),
    ):
        assert type(layout) is impl.MLACache and layout is not None and layout.batch_size == 0
    assert impl.MLACache(index_head_dim=INDEX).signature() == "kv:mla:target:dsa"
    assert impl.MLACache(role="mtp").signature() == "kv:mla:mtp"
    assert cache.max_tokens == float("inf")
    assert impl.MLACache(max_tokens=12).max_tokens == 12
    with pytest.raises(InvalidInputError, match="MTP"):
        impl.MLACache(index_head_dim=INDEX, role="mtp")
    encoded = impl.EncodedLatentCache(codec=Turbo(k_bits=8, v_bits=3), start=4)
    assert encoded.signature() == "kv:mla-encoded:target:turbo:8:3:4"
    with pytest.raises(InvalidInputError, match="bits"):
        impl.EncodedLatentCache(bits=7)


def _ragged_layout(impl: Any) -> Any:
    """Rows of 5 and 2 tokens, then a 3-token verify block kept 1 and 3 (row offsets 6, 5)."""
    convert = (lambda a: a) if impl is ref else mx.array
    rows = _rows(impl, ((1, 5), (2, 2)))
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    layout.spec_round_begin()
    layout.update_and_fetch(*(convert(b) for b in _blocks(2, 3, 3)))
    layout.spec_round_rollback([1, 3])
    return layout


def test_ragged_rollback_vector() -> None:
    """Pads (0, 3) and widths 5 / 2 -> block of 3 -> keep (1, 3): offsets (6, 5), the row that
    rejected two tokens rolls right by two (pads (0, 1), width 6), in both implementations;
    every visible column equals the tokens each row kept, in order."""
    layouts = [_ragged_layout(ref), _ragged_layout(opt)]
    first, second = _blocks(1, 5, 1), _blocks(1, 2, 2)
    block = _blocks(2, 3, 3)
    want = [
        np.concatenate([first[0], block[0][0:1, :, :1]], axis=2),
        np.concatenate([second[0], block[0][1:2]], axis=2),
    ]
    for layout in layouts:
        assert layout.row_offsets == (6, 5) and layout.left_pad == (0, 1) and layout.width == 6
        latent, _, _ = layout.current()
        latent = as_numpy(latent)
        assert np.array_equal(latent[0:1, :, 0:], want[0])
        assert np.array_equal(latent[1:2, :, 1:], want[1])
        mask = layout.make_mask(1)
        mask = as_numpy(mask)
        assert mask[:, 0, 0].tolist() == [[True] * 7, [False] + [True] * 6]
    # the optimized stored columns are exactly the new width (the common padding dropped)
    assert layouts[1].planes()[0][0].shape[2] == 6


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_filter_drops_common_padding_and_extract_is_compact(impl: Any) -> None:
    layout = impl.MLACache().make_empty_batch()
    layout.merge_rows(_rows(impl, ((1, 6), (2, 2), (3, 4))))
    assert layout.left_pad == (0, 4, 2)
    layout.filter_rows([2, 1])
    assert layout.row_offsets == (4, 2) and layout.left_pad == (0, 2) and layout.width == 4
    row = layout.extract_row(1)
    assert row.row_offsets == (2,) and row.left_pad == (0,)
    assert np.array_equal(as_numpy(row.current()[0]), _blocks(1, 2, 2)[0])


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_merge_into_a_running_cache_and_filter_to_none(impl: Any) -> None:
    """Rows join a running cache as they join an empty one (right-justified to the
    longest, the rows held unchanged); keeping no row leaves an empty cache that still
    knows its widths (contract §0.12 e)."""
    rows = _rows(impl, ((1, 3), (2, 5), (3, 2)))
    running = rows[0].make_empty_batch()
    running.merge_rows(rows[:1])
    running.merge_rows(rows[1:])
    at_once = rows[0].make_empty_batch()
    at_once.merge_rows(rows)
    assert running.row_offsets == at_once.row_offsets == (3, 5, 2)
    assert running.left_pad == at_once.left_pad == (2, 0, 3)
    for got, want in zip(running.current()[:2], at_once.current()[:2], strict=True):
        for b, pad in enumerate(running.left_pad):
            assert np.array_equal(as_numpy(got)[b, :, pad:], as_numpy(want)[b, :, pad:])
    running.filter_rows([])
    assert running.batch_size == 0 and running.bytes_per_token() == (RANK + ROPE) * 4
    running.merge_rows(rows[1:2])  # an emptied cache takes rows again
    assert running.row_offsets == (5,)


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_bad_inputs_change_nothing(impl: Any) -> None:
    convert = (lambda a: a) if impl is ref else mx.array
    cache = impl.MLACache(index_head_dim=INDEX, max_tokens=8)
    cache.append(*(convert(b) for b in _blocks(2, 3, 1, index=True)))
    before = (cache.row_offsets, [np.array(a).tobytes() for a in cache.held_arrays()])
    latent, rope, index = (convert(b) for b in _blocks(2, 1, 2, index=True))
    bad: list[tuple[type[KvRowsError], Any]] = [
        (InvalidInputError, lambda: cache.append(latent, rope)),  # the DSA block is missing
        (InvalidInputError, lambda: cache.update_and_fetch(latent, rope)),  # DSA: use append
        (InvalidInputError, lambda: cache.append(latent[..., :32], rope, index)),
        (InvalidInputError, lambda: cache.append(latent, rope[..., :8], index)),
        (InvalidInputError, lambda: cache.append(latent, rope, index[..., :8])),
        (InvalidInputError, lambda: cache.append(latent[:1], rope[:1], index[:1])),
        (CapacityError, lambda: cache.append(*(convert(b) for b in _blocks(2, 6, 3, True)))),
        (SpeculativeRoundError, lambda: cache.spec_round_rollback(1)),
    ]
    for error, call in bad:
        with pytest.raises(error):
            call()
        after = (cache.row_offsets, [np.array(a).tobytes() for a in cache.held_arrays()])
        assert after == before
    empty = cache.make_empty_batch()
    with pytest.raises(IncompatibleRowsError):
        empty.merge_rows([cache, impl.MLACache()])  # DSA and no DSA
    assert empty.batch_size == 0
    # The contract's self-merge refusal, with the shared message, also on a held layout.
    for target, sources in ((empty, [empty]), (empty, [cache, cache]), (cache, [cache])):
        with pytest.raises(IncompatibleRowsError) as caught:
            target.merge_rows(sources)
        assert str(caught.value) == self_merge_message(target.signature())
    assert empty.batch_size == 0
    assert (cache.row_offsets, [np.array(a).tobytes() for a in cache.held_arrays()]) == before


def test_the_other_implementations_arrays_are_refused() -> None:
    latent, rope = _blocks(1, 2, 1)
    with pytest.raises(InvalidInputError, match="mlx arrays"):
        opt.MLACache().update_and_fetch(latent, rope)
    with pytest.raises(InvalidInputError, match="NumPy"):
        ref.MLACache().update_and_fetch(mx.array(latent), mx.array(rope))


@pytest.mark.parametrize(
    "codec",
    [Affine(bits=8, group_size=64), Affine(bits=4, group_size=32), Turbo(k_bits=8, v_bits=4)],
)
def test_encoded_bf16_first_rule(codec: Any) -> None:
    """start = 4: the prompt of 3 reads exact; the append reaching 5 still reads exact and
    converts; the next read is decoded, its codes those of the reference codec."""
    caches: list[Any] = [
        ref.EncodedLatentCache(codec=codec, start=4),
        opt.EncodedLatentCache(codec=codec, start=4),
    ]
    prompt, second, third = _blocks(1, 3, 1), _blocks(1, 2, 2), _blocks(1, 1, 3)
    history = np.concatenate([prompt[0], second[0], third[0]], axis=2)
    for cache in caches:
        convert = (lambda a: a) if isinstance(cache, ref.EncodedLatentCache) else mx.array
        got = cache.update_and_fetch(*(convert(b) for b in prompt))[0]
        assert np.array_equal(
            np.asarray(got) if convert is not mx.array else from_mlx(got), prompt[0]
        )
        assert cache.converted == (False,)
        got = cache.update_and_fetch(*(convert(b) for b in second))[0]
        got = got if convert is not mx.array else from_mlx(got)
        assert np.array_equal(got, history[:, :, :5]) and cache.converted == (True,)
        got = cache.update_and_fetch(*(convert(b) for b in third))[0]
        got = got if convert is not mx.array else from_mlx(got)
        assert not np.array_equal(got, history)  # decoded now
        if isinstance(codec, Affine):  # the stored codes are mx.quantize's, token by token
            packed, scales, biases = affine_codec.quantize(history, codec.group_size, codec.bits)
            want = affine_codec.dequantize(packed, scales, biases, codec.group_size, codec.bits)
            assert np.array_equal(got, want.astype(np.float32))
        assert cache.held_arrays()  # the exact latent is gone once every row reads encoded
        planes: Any = cache.planes()
        exact = planes[0][3] if isinstance(cache, ref.EncodedLatentCache) else planes[3]
        assert exact is None


def test_encoded_rows_move_bytes_without_reencoding() -> None:
    """A merged, rolled back, filtered and extracted encoded row holds the same codes as a
    solo cache fed the kept tokens (codes depend on the token only)."""
    codec = Affine(bits=4, group_size=32)
    rows = []
    for seed, n in ((1, 4), (2, 2)):
        cache = opt.EncodedLatentCache(codec=codec)
        cache.update_and_fetch(*_mx(_blocks(1, n, seed)))
        rows.append(cache)
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    layout.spec_round_begin()
    block = _blocks(2, 3, 5)
    layout.update_and_fetch(*_mx(block))
    layout.spec_round_rollback([3, 1])
    layout.filter_rows([1, 0])
    row: Any = layout.extract_row(0)
    solo = opt.EncodedLatentCache(codec=codec)
    solo.update_and_fetch(*_mx(_blocks(1, 2, 2)))
    solo.update_and_fetch(*_mx(tuple(b[1:2, :, :1] for b in block)))
    for mine, theirs in zip(row.planes()[0], solo.planes()[0], strict=True):
        assert np.array_equal(from_mlx(mine), from_mlx(theirs))
    assert row.converted == solo.converted == (True,)


@pytest.mark.parametrize("codec", [None, Affine(bits=4, group_size=32)], ids=["mla", "encoded"])
def test_reads_and_states_never_change_later(codec: Any) -> None:
    """The optimized writes appends into its own capacity buffers: a read, a state, the
    held arrays and the caller's blocks stay what they were through later appends, a
    rollback and a filter."""
    caches = [
        opt.MLACache() if codec is None else opt.EncodedLatentCache(codec=codec, start=3)
        for _ in range(2)
    ]
    first = _mx(_blocks(1, 3, 1))
    kept = [np.array(from_mlx(b)) for b in first]
    for cache, seed in zip(caches, (1, 2), strict=True):
        cache.update_and_fetch(*_mx(_blocks(1, 3, seed)))
    layout = caches[0].make_empty_batch()
    layout.merge_rows(caches)
    block = _mx(_blocks(2, 2, 3))
    read = [from_mlx(a).copy() for a in layout.update_and_fetch(*block)]
    handed = layout.update_and_fetch(*block)
    state = layout.state
    held = layout.held_arrays()
    frozen = (
        [from_mlx(a).copy() for a in handed],
        [from_mlx(a).copy() for a in held],
        [from_mlx(a).copy() for a in state[1:3] if a is not None],
    )
    for n in (1, 300):  # the second outgrows the first 256-column buffer
        layout.update_and_fetch(*_mx(_blocks(2, n, 4 + n)))
    layout.spec_round_begin()
    layout.update_and_fetch(*_mx(_blocks(2, 3, 9)))
    layout.spec_round_rollback([1, 3])
    layout.filter_rows([1])
    assert [from_mlx(a).tolist() for a in handed] == [a.tolist() for a in frozen[0]]
    assert [from_mlx(a).tolist() for a in held] == [a.tolist() for a in frozen[1]]
    assert [from_mlx(a).tolist() for a in state[1:3] if a is not None] == [
        a.tolist() for a in frozen[2]
    ]
    assert all(np.array_equal(from_mlx(b), k) for b, k in zip(first, kept, strict=True))
    assert read[0].shape[2] == 5 and layout.row_offsets == (311,)


def test_row_admission_over_latent_layers() -> None:
    """The seed's rowAdmission: bytes add over layers (the spec page's 1,152 + 656 per token
    at DeepSeek-V3's geometry, the encoded layer's decoded window's 1,024 beside its codes)
    and the context bound is the smallest max_tokens."""
    from kvrows.table import row_admission

    bf16 = mx.bfloat16
    plain = opt.MLACache(512, 64, None, 4096)
    encoded = opt.EncodedLatentCache(512, 64, codec=Affine(bits=8, group_size=128))
    for cache in (plain, encoded):
        cache.update_and_fetch(mx.zeros((1, 1, 3, 512), bf16), mx.zeros((1, 1, 3, 64), bf16))
    admission = row_admission([plain, encoded])
    assert admission is not None
    assert admission.bytes(10) == 10 * (1152 + 656 + 1024)
    assert admission.max_tokens == 4096
