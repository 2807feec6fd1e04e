"""SSMCache / BatchedSSMCache inside unmodified mlx-lm recurrent models (``qwen3_next``:
gated DeltaNet + full attention; ``mamba2``: pure SSM): the same logits as mlx-lm's own
``ArraysCache`` serially, after a batch merge (decode, filter, extract), and through mlx-lm's
own ``BatchGenerator`` (right-padded prefill chunks, joins, retirements). Every other
``ArraysCache`` shape mlx-lm's models build (lfm2's 1 plane, rwkv7's 3, kimi_linear's 4,
bailing_moe_linear's GLA state, baichuan_m1's last key and value and falcon_h1's Mamba2
conv and SSM state, each inside a ``CacheList``):
the same logits serially and in a left-padded batch (``ArraysCache(n, left_padding=...)``)."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import mlx_lm.models.cache as peer
import numpy as np
import pytest
from model_helpers import (
    cache_parts,
    merged_layers,
    peer_merged,
    prefilled_rows,
    run_generator,
    same,
)

import kvrows.optimized as kv
from kvrows.app.models import (
    HYBRID_ARCHITECTURES,
    make_kvrows_cache,
    record_recurrent_layers,
    recurrent_geometry,
    tiny_model,
)
from kvrows.errors import InvalidInputError
from kvrows.optimized.geometries.recurrent import ArraysCacheSurface
from kvrows.recurrent import StateShapes
from kvrows.speculative import RowRound
from kvrows.table import owned_cache_layout, target_cache_layout

mlx_cache: Any = peer  # mlx-lm is untyped


pytestmark = pytest.mark.usefixtures("cpu_stream")


@pytest.fixture(scope="module", params=HYBRID_ARCHITECTURES)
def model(request: pytest.FixtureRequest) -> Any:
    return tiny_model(request.param)


def test_serial_logits_match_mlx_lm(model: Any) -> None:
    ours, theirs = make_kvrows_cache(model), model.make_cache()
    recurrent = [c for c in ours if isinstance(c, kv.SSMCache)]
    assert recurrent
    for mine, their in zip(ours, theirs, strict=True):
        assert isinstance(mine, kv.SSMCache) == (type(their) is peer.ArraysCache)
    tokens = mx.array(np.random.default_rng(1).integers(0, 256, (1, 32)))
    position = 0
    for n in (7, 13, 1, 1, 5, 1, 4):
        a = model(tokens[:, position : position + n], cache=ours)
        b = model(tokens[:, position : position + n], cache=theirs)
        assert same(a, b)  # the same arrays through the same ops: bit for bit
        position += n
    for mine, their in zip(ours, theirs, strict=True):
        if isinstance(mine, kv.SSMCache):
            assert mine.offset == position
            assert same(mine[0], their[0]) and same(mine[1], their[1])
            mine.check_valid()


def test_batched_logits_match_mlx_lm_merge(model: Any) -> None:
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, (1, n)) for n in (9, 21, 4)]
    layers = merged_layers(prefilled_rows(model, prompts))
    theirs_batch = peer_merged(prefilled_rows(model, prompts, lambda m: m.make_cache()))
    for step in range(6):
        tokens = mx.array(rng.integers(0, 256, (len(layers[0].row_offsets), 1)))
        assert same(model(tokens, cache=layers), model(tokens, cache=theirs_batch))
        if step == 2:  # the longest row leaves
            for layer in (*layers, *theirs_batch):
                layer.filter([2, 0])  # mlx-lm's name, on both
    recurrent = [c for c in layers if isinstance(c, kv.BatchedSSMCache)]
    assert recurrent and all(c.row_offsets == (10, 15) and c.group_offset == 15 for c in recurrent)
    # an extracted row goes on alone exactly as mlx-lm's extracted row
    ours_row = [layer.extract_row(1) for layer in layers]
    their_row = [layer.extract(1) for layer in theirs_batch]
    tokens = mx.array([[5, 6, 7]])
    assert same(model(tokens, cache=ours_row), model(tokens, cache=their_row))


LENGTHS = [5, 23, 2, 11, 9]
MAX_TOKENS = [6, 3, 7, 4, 5]
PROMPTS = [[(7 * i + 3 * j) % 200 + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]


def _generator_on_both(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, Any], dict[str, Any]]:
    """mlx-lm's ``BatchGenerator`` on kvrows caches, then on mlx-lm's: the same tokens, of
    the asked lengths, with ragged prompt chunks reaching the recurrent layouts."""
    theirs = run_generator(model, PROMPTS, MAX_TOKENS)
    padded: list[int] = []
    original = ArraysCacheSurface.prepare

    def counting(self: ArraysCacheSurface, **kwargs: Any) -> None:
        if kwargs.get("lengths") is not None and len(set(kwargs["lengths"])) > 1:
            padded.append(1)
        original(self, **kwargs)

    monkeypatch.setattr(ArraysCacheSurface, "prepare", counting)
    caches = [make_kvrows_cache(model) for _ in PROMPTS]
    ours = run_generator(model, PROMPTS, MAX_TOKENS, caches)
    assert padded, "ragged prompt chunks must have reached the recurrent layouts"
    assert ours["tokens"] == theirs["tokens"]
    assert [len(t) for t in ours["tokens"]] == MAX_TOKENS
    return ours, theirs


def test_batch_generator_matches_mlx_lm_caches(model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Right-padded prefill chunks (``prepare(lengths=…)``, ``make_mask``, ``lengths``,
    ``advance``), cohort joins (``extend``), retirements (``extract``, ``filter``)."""
    ours, theirs = _generator_on_both(model, monkeypatch)
    for mine, peers in zip(ours["caches"], theirs["caches"], strict=True):
        recurrent = [(m, p) for m, p in zip(mine, peers, strict=True) if isinstance(m, kv.SSMCache)]
        assert recurrent
        for m, p in recurrent:
            # the finished row's state is mlx-lm's, bit for bit, and it counted its tokens
            assert same(m[0], p[0]) and same(m[1], p[1])
        assert len({m.offset for m, _ in recurrent}) == 1


def test_geometry_is_declared_from_the_config() -> None:
    qwen = tiny_model("qwen3_next")
    g = recurrent_geometry(qwen)
    assert g == StateShapes(
        planes=(((3, 2 * 2 * 32 + 4 * 16), "float32"), ((4, 16, 32), "float32"))
    )
    cache = make_kvrows_cache(qwen)[0]
    assert isinstance(cache, kv.SSMCache) and cache.geometry == g
    layout = owned_cache_layout(cache)
    assert layout is not None and layout.projected_bytes(0) == g.row_bytes()
    assert recurrent_geometry(tiny_model("mamba2")) is None  # learnt at the first write


@pytest.mark.parametrize("arch", HYBRID_ARCHITECTURES)
def test_verify_round_rolls_back_to_the_accepted_run(arch: str) -> None:
    """A verify round through the model's own layers (``record_recurrent_layers``): each
    row's state and next logits after a per-row rollback equal a solo run that saw only
    the accepted tokens (mlx-lm's layers replay the accepted prefix, masked per row)."""
    model = tiny_model(arch)
    assert record_recurrent_layers(model) == 0  # the tiny models come wrapped
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, (1, n)) for n in (5, 9, 3)]
    layers = merged_layers(prefilled_rows(model, prompts), target_cache_layout)
    drafts, accepted = 3, [0, 3, 1]
    block = rng.integers(0, 256, (3, drafts + 1))
    round_ = RowRound(layers)
    round_.begin(drafts)
    model(mx.array(block), cache=layers)
    round_.resolve(accepted)
    following = rng.integers(0, 256, (3, 1))
    logits = model(mx.array(following), cache=layers)
    for b, (prompt, count) in enumerate(zip(prompts, accepted, strict=True)):
        solo = make_kvrows_cache(model)
        model(mx.array(prompt), cache=solo)
        model(mx.array(block[b : b + 1, : count + 1]), cache=solo)
        assert same(logits[b : b + 1], model(mx.array(following[b : b + 1]), cache=solo))
        for layout, alone in zip(layers, solo, strict=True):
            if isinstance(alone, kv.SSMCache):
                row = layout.extract_row(b)
                assert same(row[0], alone[0]) and same(row[1], alone[1])
                assert row.offset == alone.offset == prompt.shape[1] + count + 2


def test_kvrows_demo_runs_the_recurrent_models(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvrows demo --model hybrid``: the engine batches, prefix-caches (rows publish at
    their exact coverage) and passes the batch-invariance check on both models."""
    from kvrows.app.cli import main

    assert (
        main(["demo", "--model", "hybrid", "--scheme", "plain", "--requests", "3", "--quiet"]) == 0
    )
    table = capsys.readouterr().out
    rows = [
        line.split()
        for line in table.splitlines()
        if line.split()[:2] in (["qwen3_next", "plain"], ["mamba2", "plain"])
    ]
    assert len(rows) == 2 and all(row[-1] == "PASS" for row in rows), table


def test_kvrows_demo_speculative_on_the_recurrent_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--speculative``: the draft proposes on scratch copies of its recurrent layouts
    (they cannot trim), the target's verify rounds roll back by replay, and every request's
    greedy tokens equal the engine's without a draft."""
    from kvrows.app.cli import main

    argv = ["demo", "--speculative", "--model", "hybrid", "--scheme", "plain"]
    assert main([*argv, "--requests", "2", "--quiet"]) == 0
    table = capsys.readouterr().out
    rows = [
        line.split()
        for line in table.splitlines()
        if line.split()[:1] in (["qwen3_next"], ["mamba2"])
    ]
    assert len(rows) == 2 and all(row[-1] == "PASS" for row in rows), table


class _Stub:
    """A model's cache surface only: ``model_type`` and the templates its ``make_cache``
    builds (copied from the mlx-lm module of that name, 0.32.2)."""

    def __init__(self, model_type: str, templates: list[Any]) -> None:
        self.model_type = model_type
        self.layers = templates
        self._templates = templates

    def make_cache(self) -> list[Any]:
        return self._templates

    def parameters(self) -> dict[str, Any]:
        return {}


@pytest.mark.parametrize(
    ("model_type", "templates", "planes"),
    [
        ("lfm2", [mlx_cache.KVCache(), mlx_cache.ArraysCache(size=1)], [None, 1]),
        ("rwkv7", [mlx_cache.ArraysCache(size=3)], [3]),
        ("kimi_linear", [mlx_cache.ArraysCache(size=4), mlx_cache.KVCache()], [4, None]),
        ("bailing_moe_linear", [mlx_cache.ArraysCache(size=1), mlx_cache.KVCache()], [1, None]),
        ("mamba", [mlx_cache.ArraysCache(size=2), mlx_cache.KVCache()], [2, None]),
    ],
)
def test_every_arrays_cache_size_is_served(
    model_type: str, templates: list[Any], planes: list[int | None]
) -> None:
    """``ArraysCache(size=n)`` becomes an ``SSMCache`` of ``n`` planes (a KV layer a KV
    storage); ``conv, state = cache``-style unpacking sees ``n`` planes."""
    caches = make_kvrows_cache(_Stub(model_type, templates))
    for cache, count in zip(caches, planes, strict=True):
        if count is None:
            assert isinstance(cache, kv.KVCache)
        else:
            assert isinstance(cache, kv.SSMCache) and len(list(cache)) == count


def test_cache_list_parts_are_served_and_refused_by_layer() -> None:
    """baichuan_m1's ``CacheList(ArraysCache(2), KVCache())`` becomes a ``CacheListDropIn``
    (mlx-lm's container's surface) around kvrows parts; a part no kvrows storage serves is refused up front, naming the
    model, the layer and the class."""
    served = make_kvrows_cache(
        _Stub(
            "baichuan_m1", [mlx_cache.CacheList(mlx_cache.ArraysCache(size=2), mlx_cache.KVCache())]
        )
    )
    assert isinstance(served[0], kv.CacheListDropIn)  # mlx-lm's CacheList, row layouts in
    assert isinstance(served[0][0], kv.SSMCache) and isinstance(served[0][1], kv.KVCache)
    unserved = [
        mlx_cache.KVCache(),
        mlx_cache.CacheList(mlx_cache.ArraysCache(size=2), mlx_cache.ConcatenateKVCache()),
    ]
    with pytest.raises(InvalidInputError) as refused:
        make_kvrows_cache(_Stub("falcon_like", unserved))
    message = str(refused.value)
    assert "falcon_like" in message and "layer 1" in message and "ConcatenateKVCache" in message


def test_token_id_arrays_cache_is_refused_up_front() -> None:
    """longcat_flash_ngram's first ``ArraysCache(size=1)`` holds n-gram token ids, not
    recurrent state: refused before any cache is built, naming the model, layer and why
    (it used to become an ``SSMCache`` that refused the layer's first write)."""
    template = [mlx_cache.ArraysCache(size=1), mlx_cache.KVCache()]
    with pytest.raises(InvalidInputError) as refused:
        make_kvrows_cache(_Stub("longcat_flash_ngram", template))
    message = str(refused.value)
    assert message.startswith("longcat_flash_ngram, layer 0: its ArraysCache(size=1)")
    assert "token ids" in message


def _mask_of(mask: Any) -> list[list[bool]] | None:
    return None if mask is None else np.asarray(mask).astype(bool).tolist()


@pytest.mark.parametrize("implementation", ["optimized", "reference"])
def test_make_mask_matches_mlx_lm_arrays_cache(implementation: str) -> None:
    """``make_mask`` answers what mlx-lm's ``ArraysCache.make_mask`` answers, ``None`` or
    the same booleans, through mlx-lm's batch life cycle: a merge of empty caches (mlx-lm
    sets ``left_padding`` to zeros, so its masks are all-true arrays until ``finalize``),
    ``advance``, a right-padded ``prepare``, ``filter``, ``extend``, and a merge of written
    caches (``None``)."""
    ours_module: Any = importlib.import_module(f"kvrows.{implementation}")
    to_native: Any = mx.array if implementation == "optimized" else np.asarray

    def planes(cache: Any, rows: int) -> None:
        native = mx.array if isinstance(cache, mlx_cache.ArraysCache) else to_native
        cache[0] = native(np.zeros((rows, 3, 4), np.float32))
        cache[1] = native(np.zeros((rows, 2, 2), np.float32))

    def written(cls: Any) -> Any:
        cache = cls() if cls is not mlx_cache.ArraysCache else cls(2)
        planes(cache, 1)
        cache.advance(2)
        return cache

    ours_cls, theirs_cls = ours_module.SSMCache, mlx_cache.ArraysCache
    checks: list[tuple[str, Any, Any]] = []

    def check(label: str, ours: Any, theirs: Any, n: int) -> None:
        checks.append((label, _mask_of(ours.make_mask(n)), _mask_of(theirs.make_mask(n))))

    check("serial", ours_cls(), theirs_cls(2), 3)
    ours = ours_cls.merge([ours_cls(), ours_cls(), ours_cls()])
    theirs = theirs_cls.merge([theirs_cls(2), theirs_cls(2), theirs_cls(2)])
    check("merged empty", ours, theirs, 3)
    for cache in (ours, theirs):
        planes(cache, 3)
        cache.advance(3)
    check("advanced", ours, theirs, 1)
    for cache in (ours, theirs):
        cache.prepare(lengths=[2, 4, 1], right_padding=[2, 0, 3])
    check("right-padded", ours, theirs, 4)
    for cache in (ours, theirs):
        planes(cache, 3)
        cache.advance(4)
    check("after the padded chunk", ours, theirs, 2)
    for cache in (ours, theirs):
        cache.finalize()
    check("finalized", ours, theirs, 2)
    ours = ours_cls.merge([written(ours_cls), ours_cls()])
    theirs = theirs_cls.merge([written(theirs_cls), theirs_cls(2)])
    check("merged written", ours, theirs, 2)
    ours.extend(ours_cls.merge([ours_cls()]))
    theirs.extend(theirs_cls.merge([theirs_cls(2)]))
    check("extended by a merged empty", ours, theirs, 2)
    for cache in (ours, theirs):
        cache.filter([2, 0])
    check("filtered", ours, theirs, 1)
    for label, mine, expected in checks:
        assert mine == expected, label


@pytest.mark.parametrize("implementation", ["optimized", "reference"])
def test_planes_unpack_as_mlx_lm_arrays_cache(implementation: str) -> None:
    """``conv, state = cache`` (kimi_k3's layer) unpacks the two planes, ``None`` before
    the layer wrote them, as mlx-lm's ``ArraysCache(2)`` does."""
    ours_module: Any = importlib.import_module(f"kvrows.{implementation}")
    to_native: Any = mx.array if implementation == "optimized" else np.asarray
    ours, theirs = ours_module.SSMCache(), mlx_cache.ArraysCache(2)
    conv, state = ours
    assert (conv, state) == tuple(theirs) == (None, None)
    conv_plane, state_plane = np.ones((1, 3, 4), np.float32), np.full((1, 2, 2), 2, np.float32)
    ours[0], ours[1] = to_native(conv_plane), to_native(state_plane)
    conv, state = ours
    assert np.array_equal(np.asarray(conv), conv_plane)
    assert np.array_equal(np.asarray(state), state_plane)
    assert len(list(ours)) == len(list(theirs)) == 2


#: mlx-lm models whose ArraysCache is not gated DeltaNet's / Mamba2's two planes.
ARRAYS_MODELS = (
    "lfm2", "rwkv7", "kimi_linear", "bailing_moe_linear", "baichuan_m1", "falcon_h1",
)  # fmt: skip


def _tiny_arrays_model(arch: str, vocab: int = 128) -> Any:
    """The app's tiny model of ``arch`` (every layer kind its ``make_cache`` builds), as
    mlx-lm builds it: no layer wrapped for verify rounds."""
    return tiny_model(arch, vocab=vocab, record=False)


@pytest.fixture(scope="module", params=ARRAYS_MODELS)
def arrays_model(request: pytest.FixtureRequest) -> Any:
    return _tiny_arrays_model(request.param)


def _arrays_caches(caches: list[Any]) -> list[tuple[Any, ...]]:
    """Each layer's plane lists (``ArraysCache`` / ``SSMCache``, ``CacheList`` parts too)."""
    found = []
    for cache in caches:
        for part in cache_parts(cache):
            if isinstance(part, ArraysCacheSurface | mlx_cache.ArraysCache):
                found.append(tuple(part))
    return found


def _same_planes(ours: list[Any], theirs: list[Any]) -> bool:
    mine, peers = _arrays_caches(ours), _arrays_caches(theirs)
    assert mine and len(mine) == len(peers)
    return all(
        len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(mine, peers, strict=True)
    )


def test_arrays_cache_models_serial_logits_match_mlx_lm(arrays_model: Any) -> None:
    """``make_kvrows_cache`` serves each ``ArraysCache(size=n)`` (inside a ``CacheList``
    too) with an ``SSMCache`` of ``n`` planes: mlx-lm's logits and planes, bit for bit."""
    ours, theirs = make_kvrows_cache(arrays_model), arrays_model.make_cache()
    assert [isinstance(c, kv.CacheListDropIn) for c in ours] == [
        type(c) is mlx_cache.CacheList for c in theirs
    ]
    tokens = mx.array(np.random.default_rng(1).integers(0, 128, (1, 20)))
    position = 0
    for n in (7, 5, 1, 1, 6):
        chunk = tokens[:, position : position + n]
        assert same(arrays_model(chunk, cache=ours), arrays_model(chunk, cache=theirs))
        position += n
    assert _same_planes(ours, theirs)
    for cache in ours:
        for part in cache_parts(cache):
            if isinstance(part, kv.SSMCache):
                part.check_valid()
                assert part.geometry is not None and part.nbytes == sum(p.nbytes for p in part)


def _left_padded(template: list[Any], left_padding: list[int], ours: bool) -> list[Any]:
    """The batch caches of ``template`` for left-padded prompts: mlx-lm's
    ``ArraysCache(n, left_padding=...)`` / ``BatchKVCache`` / ``BatchRotatingKVCache``,
    or kvrows' drop-ins of the same construction."""
    batch = []
    for layer in template:
        if isinstance(layer, mlx_cache.CacheList):
            batch.append(mlx_cache.CacheList(*_left_padded(list(layer.caches), left_padding, ours)))
        elif isinstance(layer, mlx_cache.ArraysCache):
            cls: Any = kv.BatchedSSMCache if ours else mlx_cache.ArraysCache
            batch.append(cls(len(layer.cache), left_padding=left_padding))
        elif isinstance(layer, mlx_cache.RotatingKVCache):
            cls = kv.BatchRotatingKVCache if ours else mlx_cache.BatchRotatingKVCache
            batch.append(cls(layer.max_size, left_padding=left_padding))
        else:
            cls = kv.BatchKVCache if ours else mlx_cache.BatchKVCache
            batch.append(cls(left_padding=left_padding))
    return batch


@pytest.mark.parametrize("arch", [*ARRAYS_MODELS, *HYBRID_ARCHITECTURES])
def test_left_padded_batch_logits_match_mlx_lm(arch: str) -> None:
    """A left-padded prompt batch (``ArraysCache(n, left_padding=...)``), decode steps,
    ``finalize``, a ``filter`` and an ``extract``: mlx-lm's logits and planes, bit for bit."""
    model = _tiny_arrays_model(arch) if arch in ARRAYS_MODELS else tiny_model(arch)
    rng = np.random.default_rng(4)
    lengths = [6, 11, 3]
    pads = [max(lengths) - n for n in lengths]
    prompts = [
        [0] * p + rng.integers(1, 128, n).tolist() for p, n in zip(pads, lengths, strict=True)
    ]
    ours = _left_padded(model.make_cache(), pads, ours=True)
    theirs = _left_padded(model.make_cache(), pads, ours=False)
    assert same(model(mx.array(prompts), cache=ours), model(mx.array(prompts), cache=theirs))
    for _ in range(2):
        step = mx.array(rng.integers(1, 128, (3, 1)))
        assert same(model(step, cache=ours), model(step, cache=theirs))
    assert _same_planes(ours, theirs)
    for cache in (*ours, *theirs):
        for part in cache_parts(cache):
            if isinstance(part, kv.BatchedSSMCache | mlx_cache.ArraysCache):
                part.finalize()  # the padded run is over: mlx-lm's masks become None
    for cache in (*ours, *theirs):
        cache.filter([2, 0])
    step = mx.array(rng.integers(1, 128, (2, 1)))
    assert same(model(step, cache=ours), model(step, cache=theirs))
    ours_row = [cache.extract(1) for cache in ours]
    their_row = [cache.extract(1) for cache in theirs]
    tokens = mx.array([[5, 6, 7]])
    assert same(model(tokens, cache=ours_row), model(tokens, cache=their_row))
    assert _same_planes(ours_row, their_row)


def test_arrays_cache_models_through_mlx_lm_batch_generator(
    arrays_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's ``BatchGenerator`` (right-padded prefill chunks, ``merge`` of serial
    caches, ``CacheList.merge`` for baichuan_m1, joins and retirements) on kvrows caches:
    mlx-lm's tokens, and each finished row's planes bit for bit."""
    ours, theirs = _generator_on_both(arrays_model, monkeypatch)
    for mine, peers in zip(ours["caches"], theirs["caches"], strict=True):
        assert _same_planes(mine, peers)
