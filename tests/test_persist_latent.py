"""Saved state of the latent caches (``kvrows.latent.LATENT_FIELDS``, ``spec/persistence.md``).

Oracles: the cache that was saved (a restored cache reads the same bytes and continues
the same), the other implementation (a file loads into either), and refusals of
inconsistent states that leave the target unchanged.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.conformance.arrays import as_numpy, to_mlx
from kvrows.errors import CorruptStateError, InvalidInputError
from kvrows.forms import state_form
from kvrows.latent import LATENT_FIELDS
from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache
from kvrows.schemes import Affine, Turbo

CODECS: list[Any] = [None, Affine(bits=4, group_size=32), Turbo(k_bits=8, v_bits=3)]


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _filled(impl: Any, codec: Any, seed: int = 0) -> Any:
    """Three rows (5, 2 and 0 tokens), DSA, start 3: rows read exact and encoded."""
    convert = (lambda a: a) if impl is ref else mx.array
    rng = np.random.default_rng(seed)
    rows = []
    for n in (5, 2, 0):
        cache = impl.MLACache(64, 16, 32) if codec is None else (
            impl.EncodedLatentCache(64, 16, 32, codec=codec, start=3)
        )  # fmt: skip
        if n:
            blocks = [rng.standard_normal((1, 1, n, w)).astype(np.float32) for w in (64, 16, 32)]
            cache.append(*(convert(b) for b in blocks))
        rows.append(cache)
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    return layout


def _reads(cache: Any) -> list[Any]:
    return [None if a is None else as_numpy(a) for a in cache.current()]


def _same_rows(a: Any, b: Any) -> None:
    assert (a.row_offsets, a.left_pad, a.converted) == (b.row_offsets, b.left_pad, b.converted)
    assert a.signature() == b.signature()
    for x, y, pad in zip(_reads(a), _reads(b), [a.left_pad] * 3, strict=True):
        if x is None:
            assert y is None
            continue
        for row, p in enumerate(pad):
            assert np.array_equal(x[row, :, p:], y[row, :, p:])


@pytest.mark.parametrize("codec", CODECS, ids=["plain", "affine", "turbo"])
@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_state_round_trip_and_continue(impl: Any, codec: Any) -> None:
    cache = _filled(impl, codec)
    state = cache.state
    assert len(state) == len(LATENT_FIELDS)
    assert state_form(cache.composition).fields == LATENT_FIELDS
    back = type(cache).from_state(state)
    _same_rows(back, cache)
    convert = (lambda a: a) if impl is ref else mx.array
    blocks = [np.full((3, 1, 1, w), 0.5, np.float32) for w in (64, 16, 32)]
    for target in (cache, back):
        target.append(*(convert(b) for b in blocks))
    _same_rows(back, cache)
    # start 3: rows at 6 and 3 tokens read encoded from now on (a plain latent never does)
    assert back.converted == ((False,) * 3 if codec is None else (True, True, False))
    other = type(cache).from_state(cache.state)  # the setter: same signature
    fresh = _filled(impl, codec, seed=1)
    fresh.state = other.state
    _same_rows(fresh, cache)


@pytest.mark.parametrize("codec", CODECS[1:], ids=["affine", "turbo"])
@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_warm_rows_beside_converted_ones_save_in_the_cache_dtype(impl: Any, codec: Any) -> None:
    """A bfloat16 layout of a converted row (24 tokens) beside a warm one (1 token, start
    3): the state's exact latent is bfloat16, as the reads are, and loads into either
    implementation's class holding the same rows. (The dense image holds the converted
    row decoded in the codec's dtype: TurboQuant's float32 was saved as such, a state no
    class loaded.)"""
    native = (lambda a: a) if impl is ref else to_mlx
    rng = np.random.default_rng(3)
    rows = []
    for n in (24, 1):
        cache = impl.EncodedLatentCache(64, 8, None, 40, codec=codec, start=3)
        block = [rng.standard_normal((1, 1, n, w)).astype(ml_dtypes.bfloat16) for w in (64, 8)]
        cache.append(*(native(b) for b in block))
        rows.append(cache)
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    assert layout.converted == (True, False)
    state = layout.state
    assert as_numpy(state[3]).dtype == as_numpy(state[1]).dtype == ml_dtypes.bfloat16
    _same_rows(type(layout).from_state(state), layout)
    other, to_other = (opt, to_mlx) if impl is ref else (ref, lambda a: a)

    def convert(value: Any) -> Any:  # arrays into the other implementation's, codec planes too
        if isinstance(value, tuple):
            return tuple(convert(v) for v in value)
        return to_other(as_numpy(value)) if isinstance(value, np.ndarray | mx.array) else value

    _same_rows(other.EncodedLatentCache.from_state(convert(state)), layout)


@pytest.mark.parametrize("codec", CODECS, ids=["plain", "affine", "turbo"])
def test_files_load_into_either_implementation(tmp_path: Path, codec: Any) -> None:
    path = tmp_path / "latent.safetensors"
    saved = [_filled(opt, codec), opt.MLACache()]
    save_prompt_cache(path, saved)
    mine = load_prompt_cache(path)
    _same_rows(mine[0], saved[0])
    assert mine[1].batch_size == 0 and mine[1].signature() == "kv:mla:target"
    theirs = load_prompt_cache(path, implementation="reference")
    twin = _filled(ref, codec)
    assert (theirs[0].row_offsets, theirs[0].converted) == (twin.row_offsets, twin.converted)
    for got, want in zip(_reads(theirs[0]), _reads(twin), strict=True):
        if want is not None:
            for row, pad in enumerate(twin.left_pad):
                assert np.array_equal(got[row, :, pad:], want[row, :, pad:])
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError):
        load_prompt_cache(path)


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_inconsistent_states_are_refused(impl: Any) -> None:
    good = _filled(impl, Affine(bits=4, group_size=32)).state
    plain = _filled(impl, None).state
    ints = (lambda v: np.array(v, np.int32)) if impl is ref else (lambda v: mx.array(v, mx.int32))

    def changed(base: tuple[Any, ...], **fields: Any) -> tuple[Any, ...]:
        values = dict(zip(LATENT_FIELDS, base, strict=True))
        values.update(fields)
        return tuple(values[name] for name in LATENT_FIELDS)

    bad = [
        good[:-2],  # a field short of the v1 form (``good[:-1]``: v1, no codec tag)
        changed(good, codec=2),  # the tag of a codec (TurboQuant) the tail does not fill
        changed(good, codec=9),  # no codec has that tag
        changed(good, offset=ints([5, 2, 7])),  # a row past the planes' width
        changed(good, converted=ints([1, 0, 2])),  # a flag that is not 0/1
        changed(good, exact=None),  # rows read exact with no exact latent
        changed(good, latent=good[0][:2]),  # affine planes missing
        changed(good, rope=good[2]),  # the rope plane of the index's width
        changed(good, role=5),
        changed(good, bits=4, group_size=None),
        changed(plain, converted=ints([1, 0, 0])),  # a plain latent never converts
    ]
    for state in bad:
        with pytest.raises(InvalidInputError):
            impl.EncodedLatentCache.from_state(state)
    with pytest.raises(InvalidInputError):
        impl.MLACache.from_state(good)  # an encoded state into the plain cache
    target = _filled(impl, None)
    before = _reads(target)
    with pytest.raises(InvalidInputError):
        target.state = good  # another signature: refused, unchanged
    for a, b in zip(_reads(target), before, strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_a_converted_row_trimmed_to_nothing_loads(impl: Any) -> None:
    """A layout whose converted row was trimmed back to no token (its stage then holds no
    planes) saves and loads, the row still converted, and goes on (the deep profile's
    latent machine found the optimized load raising)."""
    convert = (lambda a: a) if impl is ref else mx.array
    rng = np.random.default_rng(1)
    rows = []
    for n in (0, 2):
        cache = impl.EncodedLatentCache(64, 16, None, codec=Affine(bits=8, group_size=64), start=1)
        if n:
            cache.append(
                *(convert(rng.standard_normal((1, 1, n, w), np.float32)) for w in (64, 16))
            )
        rows.append(cache)
    layout = rows[0].make_empty_batch()
    layout.merge_rows(rows)
    layout.trim_rows([0, 2])
    assert layout.converted == (False, True) and layout.row_offsets == (0, 0)
    back = type(layout).from_state(layout.state)
    assert (back.row_offsets, back.converted) == ((0, 0), (False, True))
    assert back.signature() == layout.signature()
    blocks = [rng.standard_normal((2, 1, 3, w), np.float32) for w in (64, 16)]
    for cache in (layout, back):
        cache.append(*(convert(b) for b in blocks))
    _same_rows(back, layout)


@pytest.mark.parametrize("impl", [ref, opt], ids=["reference", "optimized"])
def test_an_empty_row_extracts_as_its_load_joins(impl: Any) -> None:
    """A converted row trimmed back to no token extracts as one row of no token, still
    converted (as a cache trimmed to nothing holds it): it joins a layout converted, and
    so does its saved form loaded (the deep profile's latent machine found the extract
    joining converted and its load not: the extract held no row, so its form saved no
    stage)."""
    convert = (lambda a: a) if impl is ref else mx.array
    rng = np.random.default_rng(2)

    def cache() -> Any:
        return impl.EncodedLatentCache(64, 8, None, codec=Affine(bits=8, group_size=64), start=0)

    def block(n: int) -> list[Any]:
        return [convert(rng.standard_normal((1, 1, n, w), np.float32)) for w in (64, 8)]

    first = cache()
    layout = first.make_empty_batch()
    layout.merge_rows([first])
    layout.append(*block(3))
    layout.trim(3)
    assert layout.converted == (True,)
    extracted = layout.extract_row(0)
    joined = []
    for row in (extracted, type(extracted).from_state(extracted.state)):
        host = cache()
        host.append(*block(2))
        batch = host.make_empty_batch()
        batch.merge_rows([host])
        batch.merge_rows([row])
        joined.append(batch.converted)
    assert extracted.row_offsets == (0,) and extracted.converted == (True,)
    assert joined == [(True, True), (True, True)]
