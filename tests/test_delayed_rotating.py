"""DelayedRotatingQuantizedKVCache in a sliding-window model (semantics.md §4.16).

The four adoption cases (chunks, start; window 8) prefilled through the delayed layouts
inside ``row_attention`` and decoded 8 steps equal each row's solo run over serial legos
(logits within tolerance, greedy tokens equal, extracted bytes equal); two rows decode
together mixed; a round rolled back across the window in the mixed phase keeps each row
equal to its solo run fed only the kept tokens.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
from kvrows.app.attention import row_attention
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.conformance.arrays import as_numpy
from kvrows.maintenance import create_kv_maintenance
from kvrows.schemes import KvStorageScheme
from kvrows.table import owned_cache_layout

gemma3: Any = importlib.import_module("mlx_lm.models.gemma3_text")
WINDOW = 8
#: Logits of a row vs its solo run: the same arithmetic per row, other accumulation
#: orders (masked columns, ring phase) only, carried through the model's layers (largest
#: seen over these cases: float32 1.2e-6, float16 0.021, bfloat16 0.047; about twice that).
LOGIT_TOLERANCE = {"float32": 1e-5, "float16": 4e-2, "bfloat16": 1e-1}
CASES = (  # (prefill chunks, start): semantics.md §4.16
    ((11, 1), 14),  # tail-split prefill past the window
    ((12,), 14),  # one block past the window
    ((5, 1), 9),  # within the window, converting after the wrap
    ((6, 6, 1), 6),  # converted in prefill before adoption
)

_MODELS: dict[tuple[str, tuple[int, int, int]], Any] = {}
SMALL, WIDE = (4, 2, 64), (8, 4, 128)  # query heads, KV heads, head dim


def _model(dtype: str, heads: tuple[int, int, int] = SMALL) -> Any:
    """A tiny gemma3 (window 8, a sliding and a global layer) in ``dtype``."""
    if (dtype, heads) not in _MODELS:
        model = gemma3.Model(
            gemma3.ModelArgs(
                model_type="gemma3_text",
                hidden_size=64,
                num_hidden_layers=2,
                intermediate_size=128,
                num_attention_heads=heads[0],
                num_key_value_heads=heads[1],
                head_dim=heads[2],
                vocab_size=128,
                sliding_window=WINDOW,
                sliding_window_pattern=2,
                query_pre_attn_scalar=heads[2],
            )
        )
        mx.random.seed(3)
        from mlx.utils import tree_map

        model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters()))
        model.set_dtype(getattr(mx, dtype))
        mx.eval(model.parameters())
        _MODELS[dtype, heads] = model
    return _MODELS[dtype, heads]


def _scheme(bits: int, start: int) -> KvStorageScheme:
    return KvStorageScheme.parse(f"affine{bits}:32@{start}")


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 128, size=n)]


def _ring_bytes(cache: Any) -> list[Any]:
    """A full ring's planes in temporal order (oldest first): a ring row of a layout may
    sit at another ring phase than its serial ring, with the same bytes per position."""
    storage = getattr(cache, "storage", cache)
    assert int(storage.offset) >= WINDOW and storage.keep == 0
    shift = int(storage._idx) % WINDOW

    def flat(node: Any) -> list[Any]:
        if isinstance(node, tuple | list):
            return [a for item in node for a in flat(item)]
        if not isinstance(node, mx.array):
            return []  # ring bookkeeping (its phase); the offset is compared below
        planes = as_numpy(node)
        return [np.roll(planes, -shift, axis=2).tobytes()]

    return [storage.codec_spec.name, int(storage.offset), *flat(storage.state)]


def _solo(
    model: Any, scheme: KvStorageScheme, chunks: Sequence[list[int]], steps: int
) -> tuple[list[Any], list[np.ndarray], list[int]]:
    """The serial lego run: prefill chunks, then greedy decode. Logits: the prefill's last
    and each step's (``steps + 1``); tokens: the greedy pick from each but the last."""
    caches = make_kvrows_cache(model, scheme)
    for chunk in chunks:
        logits = model(mx.array([chunk]), cache=caches)
    rows = [_last(logits)]
    picks = []
    for _ in range(steps):
        picks.append(int(np.argmax(rows[-1])))
        rows.append(_last(model(mx.array([[picks[-1]]]), cache=caches)))
    return caches, rows, picks


def _last(logits: Any) -> np.ndarray:
    return as_numpy(logits[0, -1].astype(mx.float32))


def _clear_pick(expected: np.ndarray, dtype: str) -> bool:
    """Whether the solo run's greedy pick is clear of the runner-up by more than twice the
    logit tolerance (else a rounding difference may flip a near tie)."""
    top = np.sort(expected)[-2:]
    return bool(top[1] - top[0] > 2 * LOGIT_TOLERANCE[dtype])


def _close(actual: np.ndarray, expected: np.ndarray, dtype: str) -> bool:
    return bool(np.max(np.abs(actual - expected)) <= LOGIT_TOLERANCE[dtype])


@pytest.mark.parametrize(
    "dtype,bits,heads",
    [("float16", 4, SMALL), ("bfloat16", 8, SMALL), ("bfloat16", 4, WIDE)],
    ids=["f16-kv4", "bf16-kv8", "bf16-kv4-8q4kvd128"],
)
@pytest.mark.parametrize("chunks,start", CASES, ids=["11+1@14", "12@14", "5+1@9", "6+6+1@6"])
def test_adoption_cases_equal_the_solo_run(
    dtype: str, bits: int, heads: tuple[int, int, int], chunks: tuple[int, ...], start: int
) -> None:
    model = _model(dtype, heads)
    scheme = _scheme(bits, start)
    prompt = _prompt(start, sum(chunks))
    cut = [prompt[sum(chunks[:i]) : sum(chunks[: i + 1])] for i in range(len(chunks))]
    solo_caches, solo_logits, solo_tokens = _solo(model, scheme, cut, 8)
    caches = create_kv_maintenance(scheme).prepare_prefill(make_kvrows_cache(model, scheme))
    assert isinstance(caches[0], opt.DelayedRotatingQuantizedKVCache)
    assert isinstance(caches[1], opt.DelayedQuantizedKVCache)
    with row_attention(model):
        for chunk in cut:
            logits = model(mx.array([chunk]), cache=caches)
        for step in range(9):
            row = _last(logits)
            assert _close(row, solo_logits[step], dtype), step
            if step == 8:
                break
            if _clear_pick(solo_logits[step], dtype):
                assert int(np.argmax(row)) == solo_tokens[step], step
            # Both runs continue with the solo run's token (teacher forcing).
            logits = model(mx.array([[solo_tokens[step]]]), cache=caches)
    for layout, solo in zip(caches, solo_caches, strict=True):
        assert layout.converted_at == (solo.minimum_reusable_offset,)
    # The first layer's keys and values come from the embeddings alone, so its bytes are
    # exact; deeper layers see attention outputs that differ in accumulation order.
    assert _ring_bytes(caches[0].extract_row(0)) == _ring_bytes(solo_caches[0])


def _batch(model: Any, scheme: KvStorageScheme, prompts: Sequence[list[int]]) -> list[Any]:
    maintenance = create_kv_maintenance(scheme)
    rows = []
    for prompt in prompts:
        caches = make_kvrows_cache(model, scheme)
        model(mx.array([prompt]), cache=caches)
        rows.append(maintenance.prepare_batch(caches))
    layers = []
    for index, first in enumerate(rows[0]):
        # A one-row layout is its own batch; a serial storage joins its decode layout.
        layout = first if hasattr(first, "row_offsets") else owned_cache_layout(first)
        assert layout is not None
        layout.merge_rows([row[index] for row in rows if row[index] is not layout])
        layers.append(layout)
    return layers


def test_two_rows_decode_mixed_and_roll_back_across_the_window() -> None:
    dtype = "float32"
    model = _model(dtype)
    scheme = _scheme(8, 12)
    prompts = [_prompt(1, 6), _prompt(2, 13)]
    layers = _batch(model, scheme, prompts)
    assert layers[0].phase == "mixed" and layers[0].converted_at == (None, 13)
    solos = [make_kvrows_cache(model, scheme) for _ in prompts]
    for solo, prompt in zip(solos, prompts, strict=True):
        model(mx.array([prompt]), cache=solo)
    feed = [[5], [7]]

    def solo_step(b: int, tokens: list[int]) -> np.ndarray:
        logits = model(mx.array([tokens]), cache=solos[b])
        return as_numpy(logits[0, -1])

    def decode(steps: int) -> None:
        nonlocal feed
        for step in range(steps):
            logits = as_numpy(model(mx.array(feed), cache=layers)[:, -1])
            for b in range(2):
                assert _close(logits[b], solo_step(b, feed[b]), dtype), (step, b)
            feed = [[int(np.argmax(logits[b]))] for b in range(2)]

    with row_attention(model):
        decode(3)
        assert layers[0].row_offsets == (9, 16) and layers[0].phase == "mixed"
        # A round of 3 tokens in the mixed phase (row 0 would reach 12 = start inside it;
        # row 1 is past the window), rolled back to keep [1, 2]: nothing converts, and each
        # row equals its solo run fed the kept tokens only.
        block = [[3, 4, 5], [6, 7, 8]]
        for layout in layers:
            layout.spec_round_begin()
        model(mx.array(block), cache=layers)
        for layout in layers:
            layout.spec_round_rollback([1, 2])
        for b, keep in enumerate((1, 2)):
            solo_step(b, block[b][:keep])
        assert layers[0].row_offsets == (10, 18) and layers[0].phase == "mixed"
        decode(3)  # row 0 converts at 12
    for layout, solo_layer in ((layers[0], 0), (layers[1], 1)):
        assert layout.converted_at == (12, 13) and layout.phase == "packed"
        for b in range(2):
            assert solos[b][solo_layer].minimum_reusable_offset == (12, 13)[b]
    for b in range(2):
        assert _ring_bytes(layers[0].extract_row(b)) == _ring_bytes(solos[b][0])


_TINY: list[Any] = []


def _gemma3() -> Any:
    """kvrows' tiny gemma3 (4 layers: sliding layers 0 and 2 share one mask)."""
    if not _TINY:
        _TINY.append(tiny_model("gemma3"))
    return _TINY[0]


@pytest.mark.parametrize(
    "text", ["affine8:32,2=plain@6", "affine8:32,0=plain@6", "affine8:32,2=plain@20"]
)
def test_plain_and_delayed_sliding_layers_share_one_mask(text: str) -> None:
    """gemma3 builds one sliding mask (from layer 0) for every sliding layer: with some
    sliding layers plain and some delayed, every phase (plain, mixed, packed) still gives
    each row its solo run."""
    model = _gemma3()
    scheme = KvStorageScheme.parse(text)
    prompts = [_prompt(3, 3), _prompt(4, 9)]
    layers = _batch(model, scheme, prompts)
    solos = [make_kvrows_cache(model, scheme) for _ in prompts]
    for solo, prompt in zip(solos, prompts, strict=True):
        model(mx.array([prompt]), cache=solo)
    phases = set()
    with row_attention(model):
        for step in range(4):
            phases.add(next(c.phase for c in layers if hasattr(c, "phase")))
            feed = [[5 + step], [9 + step]]
            logits = as_numpy(model(mx.array(feed), cache=layers)[:, -1])
            for b in range(2):
                expected = _last(model(mx.array([feed[b]]), cache=solos[b]))
                assert _close(logits[b], expected, "float32"), (step, b)
    assert phases == ({"plain"} if text.endswith("@20") else {"mixed", "packed"})


def _plane_address(plane: mx.array) -> int:
    return int(np.asarray(plane).ctypes.data)


@pytest.mark.parametrize("close", ["rollback", "discard"])
def test_a_round_forgets_in_place_past_its_last_read(close: str) -> None:
    """The dispatch: a verify round's rollback and a proposal round's discard on a delayed
    ring clear the forgotten columns in place (the planes keep their buffers: MLX donated
    them), even though the round's last read (views of those planes, kept for
    ``attend_last_read``) was the layout's own: the forget drops it first. Before, every
    round copied every plane of the batch."""
    window, rows = 16, 2
    layout = opt.DelayedRotatingQuantizedKVCache(window, 32, 8, 0, window // 2)
    serial = []
    for b in range(rows):
        ring = opt.RotatingKVCache(window)
        block = mx.random.normal((1, 2, window + 3 + b, 32), key=mx.random.key(b))
        ring.update_and_fetch(block, block)
        serial.append(ring)
    layout.merge_rows(serial)
    assert layout.phase == "packed"
    offsets = layout.row_offsets
    addresses: list[int] = []
    for warm in (True, False, False):  # (the first round may grow the buffers)
        if close == "rollback":
            layout.spec_round_begin()
            block = mx.random.normal((rows, 2, 3, 32))
            mx.eval(*layout.update_and_fetch(block, block))
            layout.spec_round_rollback(1)
        else:
            layout.spec_round_propose()
            for _ in range(2):
                token = mx.random.normal((rows, 2, 1, 32))
                mx.eval(*layout.update_and_fetch(token, token))
            layout.spec_round_discard()
        mx.eval(layout.held_arrays())
        if close == "discard":
            assert layout.row_offsets == offsets
        held = [_plane_address(p) for p in layout.held_arrays()]
        if not warm:
            assert held == addresses
        addresses = held
