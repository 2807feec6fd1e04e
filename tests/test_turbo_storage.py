"""TurboQuantKVCache and BatchedTurboQuantKVCache in both implementations: the optimized
planes equal the reference's byte for byte, row operations move bytes (an extracted row
equals a solo replay of its tokens), verify rounds roll back per row, deferred-V attention
agrees with the eager oracle, and turbo layers work inside an unmodified mlx-lm model."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.app.attention import row_attention
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.errors import InvalidInputError
from kvrows.optimized.codecs import eager_attention as opt_eager
from kvrows.reference.codecs import eager_attention as ref_eager
from kvrows.schemes import KvStorageScheme

HEADS, DIM = 2, 64


pytestmark = pytest.mark.usefixtures("cpu_stream")


def block(rows: int, tokens: int, seed: int) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, HEADS, tokens, DIM)).astype(ml_dtypes.bfloat16)


def to_mx(x: np.ndarray[Any, Any]) -> mx.array:
    return mx.array(x.view(np.uint16)).view(mx.bfloat16)


def raw(a: Any) -> bytes:
    if isinstance(a, mx.array):
        return np.array(a.view(mx.uint8) if a.dtype != mx.int8 else a).tobytes()
    return np.ascontiguousarray(a).tobytes()


def same_planes(mine: Any, theirs: Any) -> bool:
    return len(mine) == len(theirs) and all(
        tuple(a.shape) == tuple(b.shape) and raw(a) == raw(b)
        for a, b in zip(mine, theirs, strict=True)
    )


def both(name: str, *args: int) -> tuple[Any, Any]:
    return getattr(ref, name)(*args), getattr(opt, name)(*args)


def feed(pair: tuple[Any, Any], keys: np.ndarray[Any, Any], values: np.ndarray[Any, Any]) -> None:
    pair[0].update_and_fetch(keys, values)
    pair[1].update_and_fetch(to_mx(keys), to_mx(values))


def serial_planes(cache: Any) -> tuple[Any, ...]:
    held = cache.planes()
    assert held is not None
    return (*held[0], *held[1])


@pytest.mark.parametrize(("k_bits", "v_bits"), [(8, 3), (4, 2), (5, 5), (2, 8)])
def test_serial_planes_are_the_reference_bytes(k_bits: int, v_bits: int) -> None:
    pair = both("TurboQuantKVCache", k_bits, v_bits)
    assert pair[0].signature() == pair[1].signature() == f"kv:turboquant:{k_bits}:{v_bits}"
    for n, seed in ((7, 0), (1, 1), (3, 2)):
        feed(pair, block(1, n, seed), block(1, n, seed + 10))
    mine, theirs = serial_planes(pair[0]), serial_planes(pair[1])
    assert same_planes(mine, theirs)
    widths = [HEADS and p.shape[-1] for p in mine]
    assert widths == [DIM * k_bits // 8, DIM // 32, DIM // 32, DIM * v_bits // 8, DIM // 32]
    assert pair[0].offset == pair[1].offset == 11
    assert pair[0].trim(4) == 4 and pair[1].trim(4) == 4
    assert same_planes(serial_planes(pair[0]), serial_planes(pair[1]))
    assert pair[0].nbytes == 7 * HEADS * (sum(p.shape[-1] * p.dtype.itemsize for p in mine))


def test_k8v3_costs_200_bytes_per_token_and_head_at_128() -> None:
    cache = ref.TurboQuantKVCache(8, 3)
    k = np.zeros((1, 1, 5, 128), dtype=np.float32)
    cache.update_and_fetch(k, k)
    assert cache.nbytes == 5 * 200


def test_other_head_dims_are_refused_before_anything_changes() -> None:
    for cache, to in ((ref.TurboQuantKVCache(), lambda a: a), (opt.TurboQuantKVCache(), mx.array)):
        with pytest.raises(InvalidInputError, match="head dims"):
            cache.update_and_fetch(
                to(np.zeros((1, 1, 2, 96), np.float32)), to(np.zeros((1, 1, 2, 96), np.float32))
            )
        assert cache.offset == 0 and cache.planes() is None


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_batched_rows_equal_solo_replays(impl: Any) -> None:
    to = (lambda a: a) if impl is ref else to_mx
    lengths = (5, 2, 9)
    solos = []
    for i, length in enumerate(lengths):
        solo = impl.TurboQuantKVCache(4, 3)
        solo.update_and_fetch(to(block(1, length, i)), to(block(1, length, i + 50)))
        solos.append(solo)
    layout = impl.BatchedTurboQuantKVCache(4, 3)
    layout.merge_rows(solos)
    assert layout.signature() == "kv:batched-turboquant:4:3"
    layout.update_and_fetch(to(block(3, 2, 7)), to(block(3, 2, 8)))
    layout.filter_rows([2, 0])
    layout.trim_rows([1, 0])
    layout.check_valid()
    for row, source in enumerate((2, 0)):
        extracted = layout.extract_row(row)
        replay = impl.TurboQuantKVCache(4, 3)
        keys = np.concatenate(
            [block(1, lengths[source], source), block(3, 2, 7)[source : source + 1]], axis=2
        )
        values = np.concatenate(
            [block(1, lengths[source], source + 50), block(3, 2, 8)[source : source + 1]], axis=2
        )
        keep = keys.shape[2] - (1 if row == 0 else 0)
        replay.update_and_fetch(to(keys[:, :, :keep]), to(values[:, :, :keep]))
        assert extracted.offset == replay.offset == keep
        assert same_planes(serial_planes(extracted), serial_planes(replay))
        if impl is opt:  # owned, compact, evaluated
            for plane in serial_planes(extracted):
                assert plane.shape[2] == keep


def test_layouts_agree_across_implementations_and_rounds_roll_back() -> None:
    pair = both("BatchedTurboQuantKVCache", 8, 3)
    solos = both("TurboQuantKVCache", 8, 3), both("TurboQuantKVCache", 8, 3)
    for i, solo in enumerate(solos):
        feed(solo, block(1, 3 + 4 * i, i), block(1, 3 + 4 * i, i + 9))
    pair[0].merge_rows([solos[0][0], solos[1][0]])
    pair[1].merge_rows([solos[0][1], solos[1][1]])
    for layout in pair:
        layout.spec_round_begin()
    feed(pair, block(2, 3, 20), block(2, 3, 21))
    for layout in pair:
        layout.spec_round_rollback([1, 3])
    assert pair[0].row_offsets == pair[1].row_offsets == (4, 10)
    for row in range(2):
        a, b = pair[0].extract_row(row), pair[1].extract_row(row)
        assert same_planes(serial_planes(a), serial_planes(b))
    # What a read shows of every row (its own columns; the rest is masked and unspecified):
    # the stored planes, the same bytes in both implementations.
    assert pair[0].left_pad == pair[1].left_pad
    for ours, theirs in zip(pair[0].fetch(), pair[1].fetch(), strict=True):
        for a, b in zip(ours, theirs, strict=True):
            mine, other = np.asarray(a), np.array(b)
            for row, (pad, offset) in enumerate(
                zip(pair[0].left_pad, pair[0].row_offsets, strict=True)
            ):
                columns = slice(pad, pad + offset)
                assert mine.dtype == other.dtype
                assert mine[row, :, columns].tobytes() == other[row, :, columns].tobytes()


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_deferred_attention_through_attend_matches_the_eager_oracle(impl: Any) -> None:
    to = (lambda a: a) if impl is ref else to_mx
    eager: Any = ref_eager if impl is ref else opt_eager
    cache = impl.TurboQuantKVCache(8, 3)
    cache.update_and_fetch(to(block(1, 12, 0)), to(block(1, 12, 1)))
    queries = to(
        np.random.default_rng(3).standard_normal((1, 4, 2, DIM)).astype(ml_dtypes.bfloat16)
    )
    out = impl.attend(queries, cache, None, 0.125)
    keys, values = cache.planes()
    oracle = eager(cache.codec, queries, keys, values, None, 0.125)
    as_np = (
        (lambda a: a.astype(np.float32))
        if impl is ref
        else (lambda a: np.array(a.astype(mx.float32)))
    )
    np.testing.assert_allclose(as_np(out), as_np(oracle), atol=3e-2)


def test_turbo_layers_in_an_unmodified_mlx_lm_model() -> None:
    model = tiny_model("llama")
    tokens = mx.array(np.random.default_rng(1).integers(0, 256, (1, 24)))
    plain = model(tokens, cache=make_kvrows_cache(model, KvStorageScheme.parse("plain")))
    caches = make_kvrows_cache(model, KvStorageScheme.parse("turbo-k8v3"))
    assert {type(c).__name__ for c in caches} == {"TurboQuantKVCache"}
    with row_attention(model):
        turbo = model(tokens, cache=caches)

    def kl(logits: mx.array) -> float:
        p = mx.softmax(plain, axis=-1)
        return float(mx.sum(p * (mx.log(p) - mx.log(mx.softmax(logits, axis=-1))), axis=-1).mean())

    assert kl(turbo) < 1e-3
    # Without the hook mlx-lm's attention gets the read's planes, which only the codec's
    # own attention reads: it refuses them rather than answering wrong.
    with pytest.raises((TypeError, ValueError)):
        model(tokens, cache=make_kvrows_cache(model, KvStorageScheme.parse("turbo-k8v3")))


def test_sliding_layers_stay_plain_rings_under_turbo() -> None:
    caches = make_kvrows_cache(tiny_model("gemma3"), KvStorageScheme.parse("turbo-k8v3"))
    names = [type(c).__name__ for c in caches]
    assert "TurboQuantKVCache" in names and "RotatingKVCache" in names


def test_engine_batch_matches_solo_under_turbo() -> None:
    from kvrows.app.demo import builtin_trace, check_invariance
    from kvrows.app.engine import Engine

    model = tiny_model("llama")
    storage = KvStorageScheme.parse("turbo-k8v3")
    trace = builtin_trace(4)
    results, stats = Engine(model, storage, max_batch=4, prefill_chunk=16, keep_logits=True).run(
        trace
    )
    assert stats.generated == sum(r.max_tokens for r in trace)
    report = check_invariance(model, storage, trace, results, 16)
    assert report.mismatches == 0 and report.beyond_tolerance == 0, report
