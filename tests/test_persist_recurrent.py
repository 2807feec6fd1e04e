"""Recurrent caches in prompt-cache files (``kvrows.forms``: ``(state.0, …, state.{N-1},
offset)``, version 1's ``(conv, recurrent, offset)`` for two planes): bit-exact round trips
in both implementations and across them, any plane count, declared geometry kept, corrupt
files refused."""

from __future__ import annotations

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
from kvrows.forms import recurrent_fields, state_form
from kvrows.persist.prompt_cache import load_prompt_cache, save_prompt_cache
from kvrows.recurrent import StateShapes

GEOMETRY = StateShapes.from_v1((3, 12), "bfloat16", (2, 4, 8))


pytestmark = pytest.mark.usefixtures("cpu_stream")


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
        assert form.fields == ("state.0", "state.1", "offset") and form.file_class == name
    assert recurrent_fields(3) == ("state.0", "state.1", "state.2", "offset")
    cache = opt.SSMCache(3)
    assert len(cache.state) == len(recurrent_fields(3))


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


#: Planes of other counts and ranks (rwkv7-like three, a declared four, lfm2-like one).
THREE = StateShapes(planes=(((1, 8), "bfloat16"), ((2, 4, 4), "float32"), ((1, 8), "bfloat16")))
FOUR = StateShapes(planes=(*(((3, 6), "float16") for _ in range(3)), ((2, 2, 2), "float32")))
ONE = StateShapes(planes=(((2, 5), "float32"),))


def _filled(module: Any, native: Any, shapes: StateShapes, seed: int, tokens: int) -> Any:
    rng = np.random.default_rng(seed)
    cache = module.SSMCache(len(shapes.planes))
    for i, (shape, dtype) in enumerate(shapes.planes):
        kind = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
        cache[i] = native(rng.standard_normal((1, *shape)).astype(np.float32).astype(kind))
    cache.advance(tokens)
    return cache


@pytest.mark.parametrize(
    ("saved", "loaded"), [("optimized", "reference"), ("reference", "optimized")]
)
def test_any_plane_count_round_trips(tmp_path: Path, saved: str, loaded: str) -> None:
    """``(state.0, …, state.{N-1}, offset)`` with the geometry's ``planes`` record: 1, 3 and
    4 planes of ranks 2 to 4 load bit for bit, a declared geometry without planes kept."""
    module, native = (opt, to_mlx) if saved == "optimized" else (ref, np.array)
    layout = module.BatchedSSMCache(1)
    layout.merge_rows([_filled(module, native, ONE, 3, 4), module.SSMCache(1)])
    caches = [_filled(module, native, THREE, 2, 6), module.SSMCache(geometry=FOUR), layout]
    path = tmp_path / "planes.safetensors"
    save_prompt_cache(path, caches)
    back = load_prompt_cache(path, implementation=loaded)  # type: ignore[arg-type]
    for got, want in zip(back, caches, strict=True):
        assert _bits(got)[1:] == _bits(want)[1:]
    assert [len(c.cache) for c in back] == [3, 4, 1]
    assert back[1].geometry == FOUR and back[2].row_offsets == (4, 0)
