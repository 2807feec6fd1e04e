"""One rank of the transfer test (``tests/test_transfer.py`` runs two under ``mlx.launch``).

Both ranks build the same caches (tiny models, fixed seeds, the same prompts): rank 0
sends, rank 1 receives and compares what arrived with its own copy, bit for bit (the
saved form), and the next decode step on it (logits bit for bit). Prints ``ok <case>``
per case checked; any difference raises (a non-zero exit ends the launch).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.app.attention import attention_scope
from kvrows.app.models import forward, make_kvrows_cache, tiny_model
from kvrows.persist.prompt_cache import saved_arrays
from kvrows.persist.transfer import recv_caches, recv_rows, send_caches, send_rows
from kvrows.schemes import KvStorageScheme
from kvrows.table import owned_cache_layout

#: (tiny model, scheme): every codec, rings, chunked, recurrent, latent and bf16-first rows.
CASES = (
    ("llama", "plain"),
    ("llama", "affine4"),
    ("llama", "turbo"),
    ("gemma3", "mxfp4"),
    ("gemma3", "affine8@8"),
    ("llama4", "nvfp4"),
    ("qwen3_next", "plain"),
    ("deepseek_v32", "plain"),
)


def _prompt(seed: int, length: int = 20) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(1, 200, (1, length)))


def _filled(model: Any, scheme: str, seed: int) -> list[Any]:
    caches = make_kvrows_cache(model, KvStorageScheme.parse(scheme))
    with attention_scope(model, caches):
        mx.eval(forward(model, _prompt(seed), caches))
    return caches


def _step(model: Any, caches: list[Any], token: int, rows: int = 1) -> np.ndarray:
    ids = mx.array([[token]] * rows)
    with attention_scope(model, caches):
        logits = forward(model, ids, caches)
    return np.array(logits.astype(mx.float32))


def _same_form(got: list[Any], expected: list[Any], case: str) -> None:
    arrays, metadata = saved_arrays(got)
    theirs, their_metadata = saved_arrays(expected)
    assert metadata == their_metadata, f"{case}: the forms' metadata differ"
    assert list(arrays) == list(theirs), f"{case}: the forms' arrays differ in name"
    for name, array in arrays.items():
        a = np.array(array.reshape(-1).view(mx.uint8))
        b = np.array(theirs[name].reshape(-1).view(mx.uint8))
        assert array.dtype == theirs[name].dtype and np.array_equal(a, b), f"{case}: {name}"


def _layouts(caches: list[Any]) -> list[Any]:
    """Each layer's decode layout (the engine's choice for a running batch)."""
    made = [owned_cache_layout(cache) for cache in caches]
    assert all(layout is not None for layout in made)
    return made


def main() -> int:
    group = mx.distributed.init()
    rank = group.rank()
    for arch, scheme in CASES:
        case = f"{arch} {scheme}"
        model = tiny_model(arch)
        caches = _filled(model, scheme, 1)
        if rank == 0:
            send_caches(caches, 1)
        else:
            received, _ = recv_caches(0, like=make_kvrows_cache(model))
            _same_form(received, caches, case)
            assert np.array_equal(_step(model, received, 5), _step(model, caches, 5)), case
            print(f"ok {case}", flush=True)
    # A row of a running batch moves and joins the receiver's batch.
    model = tiny_model("gemma3")
    rows = [_filled(model, "affine4", seed) for seed in (2, 3, 4)]
    layouts = _layouts(rows[0])
    for layer, layout in enumerate(layouts):
        layout.merge_rows([row[layer] for row in rows])
    if rank == 0:
        send_rows(layouts, [1], 1)
    else:
        (moved,) = recv_rows(0)
        running = _layouts(rows[0])
        for layer, layout in enumerate(running):
            layout.merge_rows([rows[0][layer], rows[2][layer], moved[layer]])
        local = _layouts(rows[0])
        for layer, layout in enumerate(local):
            layout.merge_rows([rows[0][layer], rows[2][layer], layouts[layer].extract_row(1)])
        _same_form(moved, [layout.extract_row(1) for layout in layouts], "row")
        assert np.array_equal(_step(model, running, 7, 3), _step(model, local, 7, 3)), "row"
        print("ok row", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
