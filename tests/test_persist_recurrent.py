"""Recurrent caches in prompt-cache files (``kvrows.forms``: ``(conv, recurrent, offset)``):
bit-exact round trips in both implementations and across them, declared geometry kept,
corrupt files refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.compositions import composition
from kvrows.conformance.arrays import from_mlx, to_mlx
from kvrows.errors import CorruptStateError
from kvrows.forms import state_form
from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache
from kvrows.recurrent import StateShapes

GEOMETRY = StateShapes.from_v1((3, 12), "bfloat16", (2, 4, 8))


@pytest.fixture(autouse=True)
def _cpu() -> Iterator[None]:
    with mx.stream(mx.cpu):
        yield


def _planes(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((rows, 3, 12)).astype(ml_dtypes.bfloat16)
    state = rng.standard_normal((rows, 2, 4, 8)).astype(np.float32)
    return conv, state


def _caches(module: Any, native: Any) -> list[Any]:
    """A written serial cache, an empty one with a declared geometry, and a layout of
    three rows of different coverage (one never written)."""
    written = module.SSMCache()
    conv, state = _planes(1, 0)
    written[0], written[1] = native(conv), native(state)
    written.advance(5)
    other = module.SSMCache()
    conv, state = _planes(1, 1)
    other[0], other[1] = native(conv), native(state)
    other.advance(2)
    layout = module.BatchedSSMCache()
    layout.merge_rows([written, module.SSMCache(), other])
    return [written, module.SSMCache(geometry=GEOMETRY), layout]


def _bits(cache: Any) -> tuple[Any, ...]:
    planes = tuple(
        None
        if p is None
        else (lambda a: (a.dtype.name, a.shape, a.tobytes()))(
            from_mlx(p) if isinstance(p, mx.array) else np.asarray(p)
        )
        for p in cache.cache
    )
    rows = cache.row_offsets if hasattr(cache, "row_offsets") else (cache.offset,)
    return type(cache).__name__, planes, tuple(rows), cache.geometry, cache.signature()


def test_the_form_is_planes_and_coverage() -> None:
    for name in ("SSMCache", "BatchedSSMCache"):
        form = state_form(composition(name))
        assert form.fields == ("conv", "recurrent", "offset") and form.file_class == name


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [("optimized", "optimized"), ("reference", "reference"), ("optimized", "reference")],
)
def test_round_trip_is_bit_exact(tmp_path: Path, saved: str, loaded: str) -> None:
    module, native = (opt, to_mlx) if saved == "optimized" else (ref, np.array)
    caches = _caches(module, native)
    path = tmp_path / "ssm.safetensors"
    save_prompt_cache(path, caches, {"note": "ssm"})
    back, user = load_prompt_cache(path, return_metadata=True, implementation=loaded)  # type: ignore[arg-type]
    assert user == {"note": "ssm"}
    target = opt if loaded == "optimized" else ref
    assert [type(c) for c in back] == [target.SSMCache, target.SSMCache, target.BatchedSSMCache]
    for got, want in zip(back, caches, strict=True):
        assert _bits(got)[1:] == _bits(want)[1:]
    assert back[1].geometry == GEOMETRY  # an empty cache keeps its declared geometry
    assert back[2].row_offsets == (5, 0, 2)


def test_corrupt_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ssm.safetensors"
    save_prompt_cache(path, _caches(opt, to_mlx))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0xFF  # a byte of the last plane
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError):
        load_prompt_cache(path)
