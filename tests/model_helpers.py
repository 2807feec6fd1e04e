"""What the model test files share: kvrows caches and mlx-lm's side by side inside the
app's tiny models (prefilled rows, their batch merges, mlx-lm's ``BatchGenerator``), and
the bit-for-bit comparison of what comes out."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as mlx_lm_cache
import numpy as np

from kvrows.app.models import make_kvrows_cache
from kvrows.optimized import CacheListDropIn
from kvrows.table import owned_cache_layout

#: mlx-lm is untyped; reach its classes through ``Any``.
peer: Any = mlx_lm_cache
# ``mlx_lm.generate`` the module (the package re-exports a function of that name).
generate: Any = importlib.import_module("mlx_lm.generate")


def same(a: mx.array, b: mx.array) -> bool:
    """Bit for bit: the same shape, dtype and values."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def cache_parts(cache: Any) -> tuple[Any, ...]:
    """A layer's caches: a ``CacheList``'s parts, or the cache itself."""
    return tuple(cache.caches) if isinstance(cache, peer.CacheList | CacheListDropIn) else (cache,)


def prefilled_rows(
    model: Any,
    prompts: Sequence[np.ndarray[Any, Any]],
    make_cache: Callable[[Any], list[Any]] = make_kvrows_cache,
) -> list[list[Any]]:
    """Each prompt (``[1, n]`` token ids) run through its own fresh ``make_cache(model)``."""
    rows = []
    for prompt in prompts:
        caches = make_cache(model)
        model(mx.array(prompt), cache=caches)
        rows.append(caches)
    return rows


def merged_layers(
    rows: list[list[Any]], layout_of: Callable[[Any], Any] = owned_cache_layout
) -> list[Any]:
    """Each layer's batch layout (``layout_of`` the first row's cache) holding ``rows``'
    caches of that layer; a ``CacheList`` of layouts where the layer keeps a ``CacheList``."""
    layers: list[Any] = []
    for index, first in enumerate(rows[0]):
        layouts = []
        for part, template in enumerate(cache_parts(first)):
            layout = layout_of(template)
            assert layout is not None
            layout.merge_rows([cache_parts(row[index])[part] for row in rows])
            layouts.append(layout)
        is_list = isinstance(first, peer.CacheList | CacheListDropIn)
        layers.append(peer.CacheList(*layouts) if is_list else layouts[0])
    return layers


def peer_merged(rows: list[list[Any]]) -> list[Any]:
    """mlx-lm's batch caches of ``rows`` (its own caches): each layer's class's ``merge``."""
    return [type(first).merge([row[i] for row in rows]) for i, first in enumerate(rows[0])]


def run_generator(
    model: Any,
    prompts: list[list[int]],
    max_tokens: list[int],
    caches: list[list[Any]] | None = None,
) -> dict[str, Any]:
    """mlx-lm's ``BatchGenerator`` (batches of 3, prefill batches of 2 in chunks of 8):
    greedy tokens per request, and each finished request's extracted caches."""
    generator = generate.BatchGenerator(
        model, completion_batch_size=3, prefill_batch_size=2, prefill_step_size=8
    )
    uids = generator.insert(prompts, max_tokens, caches=caches)
    tokens: dict[int, list[int]] = {uid: [] for uid in uids}
    finished: dict[int, list[Any]] = {}
    while responses := generator.next_generated():
        for response in responses:
            tokens[response.uid].append(response.token)
            if response.finish_reason is not None:
                finished[response.uid] = response.prompt_cache
    generator.close()
    return {"tokens": [tokens[u] for u in uids], "caches": [finished[u] for u in uids]}
