"""Bf16-first storages ("legos", ``spec/bf16-first.md``) in both implementations.

The gate: a lego's reads and stored bytes equal "plain storage, converted after the
append that first leaves it holding ``offset >= start and offset != 0``" exactly, for
affine 4 and 8, full and rotating; the reference's conversion equals an affine storage fed
the same tokens; reference and optimized hold the same bytes; mlx-lm's own
``generate_step(kv_bits=..., quantized_kv_start=N)`` gives the same tokens and logits as
unmodified mlx-lm generation over kvrows legos.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as cache_module
import numpy as np
import pytest
from lego_helpers import to_affine

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.errors import InvalidInputError, LayoutStateError, UnsupportedStateError
from kvrows.lego import conversion_due
from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache
from kvrows.protocols import AppendLimited, Cache, ReusableOffset
from kvrows.schemes import Affine, KvStorageScheme, Plain
from kvrows.validation import KvGeometry

lm: Any = importlib.import_module("mlx_lm.generate")
peer: Any = cache_module
IMPLEMENTATIONS = (opt, ref)
WINDOW = 8
HEADS, DIM = 2, 64
#: (start, append sizes, offset at which the lego converts)
SEQUENCES = (
    (0, (7, 1, 3, 1), 7),  # the first append converts at 7 even with start 0
    (5, (3, 6, 1, 2), 9),  # the append 3 -> 9 crosses start 5
    (5, (2, 3, 1, 1), 5),  # an append that lands exactly on start
    (12, (4, 4, 4, 1, 5), 12),
    (12, (1, 1, 9, 1, 1, 4), 12),
    (12, (11, 1, 1), 12),
)


def _block(rng: np.random.Generator, n: int, dtype: Any = np.float32) -> tuple[Any, Any]:
    shape = (1, HEADS, n, DIM)
    return (
        rng.standard_normal(shape).astype(dtype),
        rng.standard_normal(shape).astype(dtype),
    )


def _to_impl(impl: ModuleType, array: Any) -> Any:
    return mx.array(array) if impl is opt else array


def _np(planes: Any) -> list[np.ndarray]:
    """Every array of a read or a pair of plane tuples, as NumPy."""
    flat: list[Any] = []

    def walk(node: Any) -> None:
        if isinstance(node, tuple | list):
            for item in node:
                walk(item)
        else:
            flat.append(np.asarray(node))

    walk(planes)
    return flat


def _same(first: Any, second: Any) -> bool:
    a, b = _np(first), _np(second)
    return len(a) == len(b) > 0 and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)
        for x, y in zip(a, b, strict=True)
    )


def _stored(storage: Any) -> Any:
    """The stored planes of the held window in time order (each implementation's view)."""
    if type(storage).__module__.startswith("kvrows.optimized"):
        return storage.planes()
    return storage.window()


def _lego(impl: ModuleType, ring: bool, bits: int, start: int) -> Any:
    if ring:
        return impl.Bf16FirstRotatingQuantizedKVCache(WINDOW, 64, bits, 0, start)
    return impl.Bf16FirstQuantizedKVCache(64, bits, start)


def _plain(impl: ModuleType, ring: bool) -> Any:
    return impl.RotatingKVCache(WINDOW) if ring else impl.KVCache()


def _convert(impl: ModuleType, storage: Any, ring: bool, bits: int) -> Any:
    """The oracle's "maintenance after the append": each implementation's own conversion."""
    if impl is opt:
        return storage.to_quantized(group_size=64, bits=bits)
    target = ref.RotatingQuantizedKVCache if ring else ref.QuantizedKVCache
    return to_affine(storage, Affine(bits=bits, group_size=64), target)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
@pytest.mark.parametrize("ring", (False, True), ids=("full", "ring"))
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize(("start", "sizes", "converts_at"), SEQUENCES)
def test_lego_equals_plain_then_convert(
    impl: ModuleType, ring: bool, bits: int, start: int, sizes: Sequence[int], converts_at: int
) -> None:
    rng = np.random.default_rng(start * 100 + sum(sizes))
    lego = _lego(impl, ring, bits, start)
    oracle = _plain(impl, ring)
    converted_at = None
    for n in sizes:
        assert lego.max_append_tokens() == (
            start - lego.offset if not lego.converted and lego.offset < start else math.inf
        )
        k, v = _block(rng, n)
        reads = lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
        expected = oracle.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
        assert _same(reads, expected)
        if oracle.codec_spec.kind == "plain" and conversion_due(oracle.offset, start):
            oracle = _convert(impl, oracle, ring, bits)
            converted_at = oracle.offset
        assert lego.converted == (oracle.codec_spec.kind == "affine")
        assert hasattr(lego, "bits") == (len(_np(reads)) == 6)  # triples: quantized reads
        assert lego.signature() == oracle.signature()
        assert lego.offset == oracle.offset
        assert lego.nbytes == oracle.nbytes
        assert _same(_stored(lego.storage), _stored(oracle))
        assert _same(lego.fetch(), oracle.fetch())
    assert converted_at == converts_at
    assert lego.minimum_reusable_offset == (converts_at if start > 0 else 0)
    assert lego.max_append_tokens() == math.inf


@pytest.mark.parametrize("dtype", (np.float32, np.float16), ids=("float32", "float16"))
@pytest.mark.parametrize("ring", (False, True), ids=("full", "ring"))
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize(("start", "sizes", "converts_at"), SEQUENCES)
def test_reference_and_optimized_store_the_same_bytes(
    ring: bool, bits: int, start: int, sizes: Sequence[int], converts_at: int, dtype: Any
) -> None:
    rng = np.random.default_rng(7)
    legos = {impl: _lego(impl, ring, bits, start) for impl in IMPLEMENTATIONS}
    for n in sizes:
        k, v = _block(rng, n, dtype)
        reads = [lego.update_and_fetch(_to_impl(i, k), _to_impl(i, v)) for i, lego in legos.items()]
        if not ring:  # a ring's read order is physical in one, temporal in the other
            assert _same(reads[0], reads[1])
        assert _same(_stored(legos[opt].storage), _stored(legos[ref].storage))
        assert legos[opt].signature() == legos[ref].signature()
        assert legos[opt].converted == legos[ref].converted == (legos[opt].offset >= converts_at)


@pytest.mark.parametrize("ring", (False, True), ids=("full", "ring"))
def test_reference_conversion_equals_an_affine_storage_fed_the_tokens(ring: bool) -> None:
    """The reference's conversion against its affine storage appended token blocks directly."""
    rng = np.random.default_rng(3)
    plain = _plain(ref, ring)
    direct = ref.RotatingQuantizedKVCache(WINDOW, 64, 4) if ring else ref.QuantizedKVCache(64, 4)
    for n in (5, 1, 6, 1):
        k, v = _block(rng, n)
        plain.update_and_fetch(k, v)
        direct.update_and_fetch(k, v)
    converted = to_affine(plain, Affine(bits=4, group_size=64), type(direct))
    assert _same(converted.window(), direct.window())
    assert converted.offset == direct.offset and converted.nbytes == direct.nbytes
    assert plain.codec_spec.kind == "plain"  # the source is unchanged


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
def test_conversion_is_irreversible(impl: ModuleType) -> None:
    rng = np.random.default_rng(1)
    lego = _lego(impl, False, 8, 5)
    k, v = _block(rng, 6)
    lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    assert lego.converted and lego.minimum_reusable_offset == 6
    assert lego.trim(4) == 4 and lego.offset == 2
    assert lego.converted and lego.signature() == "kv:quant:8:64"
    assert lego.max_append_tokens() == math.inf
    k, v = _block(rng, 1)
    reads = lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    assert len(_np(reads)) == 6 and lego.bits == 8 and lego.group_size == 64


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
def test_plain_phase_trims_and_limits_appends(impl: ModuleType) -> None:
    rng = np.random.default_rng(2)
    lego = _lego(impl, False, 4, 5)
    assert lego.max_append_tokens() == 5 and lego.offset == 0 and not hasattr(lego, "bits")
    k, v = _block(rng, 4)
    lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    assert lego.max_append_tokens() == 1 and not lego.converted
    lego.trim(3)
    assert lego.max_append_tokens() == 4 and lego.minimum_reusable_offset == 0
    assert lego.signature() == "kv:plain" and lego.is_trimmable()
    assert isinstance(lego, AppendLimited) and isinstance(lego, ReusableOffset)
    assert isinstance(lego, Cache)
    zero = _lego(impl, True, 4, 0)
    assert zero.max_append_tokens() == math.inf and not zero.converted  # empty stays plain


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
@pytest.mark.parametrize("ring", (False, True), ids=("full", "ring"))
def test_composed_release_and_over_round_trip(impl: ModuleType, ring: bool) -> None:
    rng = np.random.default_rng(4)
    blocks = [_block(rng, n) for n in (3, 3, 1, 1)]
    solo = _lego(impl, ring, 4, 5)
    for k, v in blocks:
        solo.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))

    lego = _lego(impl, ring, 4, 5)
    k, v = blocks[0]
    lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    plain = lego.composed.release()
    assert lego.offset == 0 and not lego.converted and lego.nbytes == 0  # back to empty
    assert plain.signature() == ("kv:rotating-plain" if ring else "kv:plain")
    lego = lego.composed.over(plain)
    assert not lego.converted and lego.max_append_tokens() == 2
    k, v = blocks[1]
    lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    minimum = lego.minimum_reusable_offset
    affine = lego.composed.release()
    lego = lego.composed.over(affine, minimum_reusable_offset=minimum)
    assert lego.converted and lego.minimum_reusable_offset == 6
    assert hasattr(lego, "bits")  # reads of a converted storage are quantized
    for k, v in blocks[2:]:
        lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    assert _same(_stored(lego.storage), _stored(solo.storage))
    assert lego.composed.over(solo.storage).minimum_reusable_offset == solo.offset


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
def test_over_refuses_foreign_storages(impl: ModuleType) -> None:
    lego = _lego(impl, False, 4, 5)
    other = ref if impl is opt else opt
    with pytest.raises(InvalidInputError, match=r"composed\.over takes"):
        lego.composed.over(other.KVCache())
    with pytest.raises(InvalidInputError, match=r"composed\.over takes"):
        lego.composed.over(impl.RotatingKVCache(WINDOW))
    with pytest.raises(InvalidInputError, match="affine8:64, this lego converts to affine4:64"):
        lego.composed.over(impl.QuantizedKVCache(64, 8))
    ring = _lego(impl, True, 4, 5)
    with pytest.raises(InvalidInputError, match="token geometry"):
        ring.composed.over(impl.RotatingKVCache(WINDOW + 1))
    with pytest.raises(InvalidInputError, match="plain storage has no minimum_reusable_offset"):
        lego.composed.over(impl.KVCache(), minimum_reusable_offset=3)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
def test_invalid_arguments(impl: ModuleType) -> None:
    with pytest.raises(InvalidInputError, match="Bf16FirstQuantizedKVCache: start"):
        impl.Bf16FirstQuantizedKVCache(64, 8, -1)
    with pytest.raises(InvalidInputError, match="bits"):
        impl.Bf16FirstQuantizedKVCache(64, 7)
    with pytest.raises(InvalidInputError, match=r"Bf16FirstQuantizedKVCache: .*group size"):
        impl.Bf16FirstQuantizedKVCache(48, 8)
    with pytest.raises(InvalidInputError, match="bits must be an integer"):
        impl.Bf16FirstQuantizedKVCache(64, 8.0)
    with pytest.raises(InvalidInputError, match="keep"):
        impl.Bf16FirstRotatingQuantizedKVCache(4, 64, 8, 4)
    with pytest.raises(InvalidInputError, match="max_size"):
        impl.Bf16FirstRotatingQuantizedKVCache(0)
    with pytest.raises(InvalidInputError, match="geometry must be a KvGeometry"):
        impl.Bf16FirstQuantizedKVCache(64, 8, 0, geometry=(2, 64))
    with pytest.raises(InvalidInputError, match="key head dim 48"):
        impl.Bf16FirstQuantizedKVCache(64, 8, 0, geometry=KvGeometry(2, 48, 48, "float32"))
    # A head dim the codec cannot take is refused before the plain append: nothing changes.
    lego = _lego(impl, False, 4, 5)
    odd = np.zeros((1, HEADS, 2, 48), np.float32)
    with pytest.raises(InvalidInputError, match="key head dim 48"):
        lego.update_and_fetch(_to_impl(impl, odd), _to_impl(impl, odd))
    assert lego.offset == 0 and lego.nbytes == 0


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
def test_the_stages_and_their_hooks(impl: ModuleType) -> None:
    """A lego is one storage of two stages: the rows are re-encoded in place of a storage
    swap, all together (a serial storage's rows move together: converting some of them is
    refused before anything changes), and a state is restored by its storage's class."""
    rng = np.random.default_rng(8)
    lego = _lego(impl, False, 4, 5)
    assert lego.stages == (Plain(), Affine(bits=4, group_size=64))
    built = type(lego).from_specs(lego.quantization, lego.token_geometry, start=5)
    assert repr(built) == repr(lego) and built.max_append_tokens() == 5
    assert lego.codec_spec == Plain() and lego.storage is lego.storage  # one view per stage
    k, v = (np.concatenate([x, x], axis=0) for x in _block(rng, 3))  # two rows
    lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    before = _np(_stored(lego.storage))
    with pytest.raises(LayoutStateError, match="convert together"):
        lego._convert_rows([0])
    assert lego.codec_spec == Plain() and _same(_stored(lego.storage), before)
    plain = lego.storage
    k, v = (np.concatenate([x, x], axis=0) for x in _block(rng, 3))
    lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    assert lego.converted and lego.codec_spec == lego.quantization
    assert lego.storage is not plain and type(lego.storage) is lego.affine_class
    with pytest.raises(UnsupportedStateError, match=r"composed\.over"):
        type(lego).from_state(lego.state)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
@pytest.mark.parametrize("ring", (False, True), ids=("full", "ring"))
def test_state_round_trips_as_the_current_storage(
    impl: ModuleType, ring: bool, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    blocks = [_block(rng, n) for n in (3, 4, 1, 2)]
    for stop in (1, 2):  # saved plain, saved converted
        lego = _lego(impl, ring, 8, 5)
        for k, v in blocks[:stop]:
            lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
        storage = lego.storage
        restored = type(storage).from_state(lego.state)
        assert _same(_stored(restored), _stored(storage)) and restored.offset == lego.offset
        path = tmp_path / f"lego-{stop}.safetensors"
        save_prompt_cache(path, [storage])
        if impl is opt:
            (loaded,) = load_prompt_cache(path, implementation="optimized")
        else:
            (loaded,) = load_prompt_cache(path, implementation="reference")
        assert type(loaded) is type(storage) and loaded.signature() == lego.signature()
        # The lego itself saves as its storage plus its lego record, and loads as the lego.
        save_prompt_cache(tmp_path / f"whole-{stop}.safetensors", [lego])
        (whole,) = load_prompt_cache(
            tmp_path / f"whole-{stop}.safetensors",
            implementation="optimized" if impl is opt else "reference",
        )
        assert type(whole) is type(lego) and whole.converted == lego.converted
        assert (whole.start, whole.minimum_reusable_offset) == (5, lego.minimum_reusable_offset)
        assert _same(_stored(whole.storage), _stored(storage))
        assert _same(_stored(loaded), _stored(storage))
        again = lego.composed.over(loaded, minimum_reusable_offset=lego.minimum_reusable_offset)
        for k, v in blocks[stop:]:
            lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
            again.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
        assert _same(_stored(again.storage), _stored(lego.storage))


# -- mlx-lm: the lego as a per-layer prompt cache ---------------------------------------------


def _steps(model: Any, prompt: Any, cache: list[Any], **options: Any) -> list[tuple[int, Any]]:
    steps = lm.generate_step(prompt, model, prompt_cache=cache, max_tokens=6, **options)
    return [(int(token), np.array(logprobs)) for token, logprobs in steps]


@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize(("start", "prefill_step"), ((0, 512), (9, 4), (9, 512), (13, 5)))
def test_generation_equals_mlx_lm_quantized_kv_start(
    llama: Any, bits: int, start: int, prefill_step: int
) -> None:
    """mlx-lm converts its caches after each forward once ``offset >= start``; a lego
    converts inside the append that gets there, and reads that append plain: the same
    point, so tokens and log-probabilities are identical."""
    prompt = mx.array(np.random.default_rng(start).integers(0, 256, 11), dtype=mx.uint32)
    scheme = KvStorageScheme(codec=Affine(bits=bits, group_size=64), quantized_kv_start=start)
    legos = make_kvrows_cache(llama, scheme)
    assert all(isinstance(c, opt.Bf16FirstQuantizedKVCache) for c in legos)
    got = _steps(llama, prompt, legos, prefill_step_size=prefill_step)
    expected = _steps(
        llama,
        prompt,
        [peer.KVCache() for _ in llama.layers],
        prefill_step_size=prefill_step,
        kv_bits=bits,
        kv_group_size=64,
        quantized_kv_start=start,
    )
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(c.converted for c in legos)
    # A lego has no to_quantized: mlx-lm's kv_bits leaves it to convert itself.
    assert not hasattr(legos[0], "to_quantized")
    again = make_kvrows_cache(llama, scheme)
    options = {"kv_bits": bits, "kv_group_size": 64, "quantized_kv_start": start}
    both = _steps(llama, prompt, again, prefill_step_size=prefill_step, **options)
    assert [t for t, _ in both] == [t for t, _ in expected]
    assert all(type(c) is opt.Bf16FirstQuantizedKVCache for c in again)


def test_make_kvrows_cache_builds_rotating_legos() -> None:
    gemma = tiny_model("gemma3")
    scheme = KvStorageScheme(codec=Affine(bits=4, group_size=64), quantized_kv_start=3)
    caches = make_kvrows_cache(gemma, scheme)
    kinds = {type(c).__name__ for c in caches}
    assert kinds == {"Bf16FirstQuantizedKVCache", "Bf16FirstRotatingQuantizedKVCache"}
    prompt = mx.array(np.arange(20) % 256, dtype=mx.uint32)
    got = _steps(gemma, prompt, caches, prefill_step_size=8)
    assert all(c.converted for c in caches) and all(c.start == 3 for c in caches)
    # Oracle: mlx-lm's own conversion (kv_bits) driving kvrows' plain storages, whose
    # to_quantized converts rings too (mlx-lm's own rings cannot).
    options = {"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 3}
    expected = _steps(gemma, prompt, make_kvrows_cache(gemma), prefill_step_size=8, **options)
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected, strict=True):
        np.testing.assert_array_equal(a, b)
    plain = make_kvrows_cache(gemma, KvStorageScheme(quantized_kv_start=3))
    assert {type(c).__name__ for c in plain} == {"KVCache", "RotatingKVCache"}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=("optimized", "reference"))
def test_a_storage_quantized_from_token_zero_reads_differently(impl: ModuleType) -> None:
    """Bug 9.3.11: the lego's first chunk is read plain; ``QuantizedKVCache`` from token 0
    is another composition whose first read is quantized (it dequantizes to other values)."""
    rng = np.random.default_rng(6)
    k, v = _block(rng, 5)
    lego = _lego(impl, False, 4, 0)
    reads = lego.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    np.testing.assert_array_equal(np.asarray(reads[0]), k)  # plain: the tokens themselves
    direct = impl.QuantizedKVCache(64, 4)
    triples = direct.update_and_fetch(_to_impl(impl, k), _to_impl(impl, v))
    assert len(_np(triples)) == 6 and lego.converted
    # What the converted lego stores is what the direct storage stores: only the first
    # read differs.
    assert _same(_stored(lego.storage), _stored(direct))
    packed, scales, biases = (mx.array(np.asarray(p)) for p in triples[0])
    decoded = np.asarray(mx.dequantize(packed, scales, biases, group_size=64, bits=4))
    assert np.max(np.abs(decoded - k)) > 0
