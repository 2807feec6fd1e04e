"""Admission over every scheme: what ``row_admission`` projects for a row of ``t`` tokens
against the bytes that row then holds, measured, on a real model's layer mix (gemma3:
sliding-window rings and full-attention layers), each role's layouts."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kvrows.app.engine import Engine
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.maintenance import create_kv_maintenance
from kvrows.protocols import Converting
from kvrows.schemes import Affine, KvStorageScheme, Plain
from kvrows.table import (
    owned_cache_layout,
    prefill_cache_layout,
    row_admission,
    target_cache_layout,
)

SCHEMES = {
    "plain": KvStorageScheme(),
    "affine8": KvStorageScheme(codec=Affine(bits=8, group_size=64)),
    "affine4:32": KvStorageScheme(codec=Affine(bits=4, group_size=32)),
    # the first layer plain (a sliding ring in gemma3), the rest 4-bit
    "per-layer": KvStorageScheme(codec=Affine(bits=4, group_size=64), layers=((0, Plain()),)),
}
ROLES = {
    "decode": owned_cache_layout,
    "prefill": prefill_cache_layout,
    "verify": target_cache_layout,
}


pytestmark = pytest.mark.usefixtures("cpu_stream")


def _filled(model: object, scheme: KvStorageScheme, tokens: int) -> list[object]:
    """The model's per-layer caches, each holding ``tokens`` random tokens of its geometry."""
    caches = make_kvrows_cache(model, scheme)
    for index, cache in enumerate(caches):
        geometry = cache.geometry
        assert geometry is not None
        shape = (1, geometry.heads, tokens, geometry.key_dim)
        key = mx.random.key(index + 1000 * tokens)
        keys = mx.random.normal(shape, key=key).astype(getattr(mx, geometry.dtype))
        cache.update_and_fetch(keys, keys * 0.5)
    return caches


@pytest.mark.parametrize("role", list(ROLES))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_admission_projects_the_bytes_a_row_then_holds(scheme: str, role: str) -> None:
    model = tiny_model("gemma3")
    make_layout = ROLES[role]
    previous = -1
    for tokens in (1, 16, 40):  # before and past the sliding window (16)
        caches = _filled(model, SCHEMES[scheme], tokens)
        layouts = []
        for cache in caches:
            layout = make_layout(cache)  # type: ignore[arg-type]
            assert layout is not None
            layout.merge_rows([cache])  # type: ignore[list-item]
            layouts.append(layout)
        admission = row_admission(layouts)
        assert admission is not None
        projected = admission.bytes(tokens)
        # additive over layers, and monotone in tokens
        assert projected == sum(layout.projected_bytes(tokens) for layout in layouts)
        assert projected >= previous
        previous = projected
        # what the row holds, compact: its extracted serial caches
        held = sum(layout.extract_row(0).nbytes for layout in layouts)
        assert abs(projected - held) <= 0.01 * held, (scheme, role, tokens, projected, held)


def test_a_mixed_scheme_bills_each_layer_by_its_own_codec() -> None:
    model = tiny_model("gemma3")
    tokens = 12
    layouts = []
    for cache in _filled(model, SCHEMES["per-layer"], tokens):
        layout = owned_cache_layout(cache)  # type: ignore[arg-type]
        assert layout is not None
        layout.merge_rows([cache])  # type: ignore[list-item]
        layouts.append(layout)
    plain = [layout for layout in layouts if getattr(layout, "codec_spec", None) == Plain()]
    assert len(plain) == 1  # layer 0 only
    each = [layout.projected_bytes(tokens) for layout in layouts]
    # a 4-bit layer holds about a quarter of a float16 one (plus its scales and biases)
    assert each[0] > 3 * max(each[1:])


# -- bf16-first schemes: the delayed layouts project the peak a row reaches ----------------

DELAYED_SCHEMES = {
    "affine8@5": KvStorageScheme.parse("affine8@5"),
    "affine4:32@12": KvStorageScheme.parse("affine4:32@12"),
    # the first layer plain (a sliding ring in gemma3), the others 4-bit from token 7
    "per-layer@7": KvStorageScheme.parse("affine4,0=plain@7"),
}


def _running_layouts(model: object, scheme: KvStorageScheme) -> tuple[list[Any], list[Any]]:
    """What the engine's running batch holds for one fresh request: ``prepare_batch``'s
    layouts (delayed layouts holding the row) and the request's serial caches."""
    caches = make_kvrows_cache(model, scheme)
    prepared = create_kv_maintenance(scheme).prepare_batch(caches)
    return prepared, caches


@pytest.mark.parametrize("scheme", list(DELAYED_SCHEMES))
def test_delayed_admission_projects_the_peak_a_row_reaches(scheme: str) -> None:
    model = tiny_model("gemma3")
    storage = DELAYED_SCHEMES[scheme]
    engine = Engine(model, storage, max_batch=2)
    previous = -1
    for tokens in (1, 4, 16, 40):  # below, at and past each start; past the window (16)
        prepared, caches = _running_layouts(model, storage)
        delayed = [isinstance(layer, Converting) for layer in prepared]
        assert any(delayed) and (scheme != "per-layer@7" or not delayed[0])
        peaks = [0] * len(prepared)
        for position in range(tokens):  # one token at a time: every boundary is visited
            for index, layer in enumerate(prepared):
                geometry = caches[index].geometry
                shape = (1, geometry.heads, 1, geometry.key_dim)
                key = mx.random.key(index + 1000 * position)
                keys = mx.random.normal(shape, key=key).astype(getattr(mx, geometry.dtype))
                layer.update_and_fetch(keys, keys * 0.5)
                if delayed[index]:  # what the layout holds for the row, compact
                    peaks[index] = max(peaks[index], layer.extract_row(0).nbytes)
        layouts: list[Any] = []
        for index, layer in enumerate(prepared):
            if delayed[index]:
                layouts.append(layer)
                continue
            layout = owned_cache_layout(layer)
            assert layout is not None
            layout.merge_rows([layer])
            peaks[index] = layout.extract_row(0).nbytes  # growing or capped: the end is the peak
            layouts.append(layout)
        admission = row_admission(layouts)
        assert admission is not None
        projected = admission.bytes(tokens)
        assert projected == engine.admission.bytes(tokens)  # the engine bills the same
        # additive over layers, and monotone in tokens
        assert projected == sum(layout.projected_bytes(tokens) for layout in layouts)
        assert projected >= previous
        previous = projected
        held = sum(peaks)
        assert abs(projected - held) <= 0.01 * held, (scheme, tokens, projected, held)
        converted = [layer.converted_at[0] for layer, d in zip(prepared, delayed, strict=True) if d]
        start = storage.quantized_kv_start
        assert start is not None
        assert all((c is not None) == (tokens >= start) for c in converted)
