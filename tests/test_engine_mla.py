"""The engine serves the MLA models (``deepseek_v3``, ``deepseek_v32`` with its DSA indexer,
``glm_moe_dsa``): their layers' drop-ins (``LatentCacheList`` pairs, or item 0 alone) join
the latent caches' row layouts through the table (``DropInWrapper``), so batching, prefix
hits, the disk prefix store, bf16-first latents and speculative rounds are the engine's
ordinary paths.

Oracles: each request alone (``check_invariance``: serial latent caches, the batch row's
prefill chunks, teacher-forced), and the engine without the option under test."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest

from kvrows.app.demo import LATENT_TOLERANCE, builtin_trace, check_invariance, latent_scheme
from kvrows.app.engine import Engine, Request, model_fingerprint
from kvrows.app.models import draft_model, make_kvrows_cache, tiny_model
from kvrows.errors import IncompatibleRowsError, InvalidInputError, LayoutStateError
from kvrows.persist.prefix_store import PrefixStore
from kvrows.protocols import DropInWrapper, SpeculativeRowLayout
from kvrows.schemes import KvStorageScheme
from kvrows.table import (
    is_batchable,
    owned_cache_layout,
    prefill_cache_layout,
    target_cache_layout,
)

MLA_MODELS = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
CHUNK = 16


pytestmark = pytest.mark.usefixtures("cpu_stream")


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {arch: tiny_model(arch) for arch in MLA_MODELS}


def _trace(count: int = 6) -> list[Request]:
    return builtin_trace(count)


def is_drop_in(cache: object) -> bool:
    return isinstance(cache, DropInWrapper)


def is_verify_layout(cache: object) -> bool:
    return isinstance(cache, SpeculativeRowLayout)


def test_the_table_gives_a_drop_in_its_latent_cache_layouts(models: dict[str, Any]) -> None:
    """Every role's layout is the latent cache's own (its table entry), behind a drop-in of
    the same form; the drop-in is a row layout and a verify layout by capability."""
    for arch in MLA_MODELS:
        serial: Any = make_kvrows_cache(models[arch])[0]
        assert is_drop_in(serial)
        for role in (owned_cache_layout, prefill_cache_layout, target_cache_layout):
            layout: Any = role(serial)
            assert layout is not None and type(layout) is type(serial)
            assert is_verify_layout(layout) and is_drop_in(layout)
            assert type(layout.wrapped) is type(serial.wrapped)
            assert layout.batch_size == 0 and layout.signature() == serial.signature()


#: Each architecture batched against its solo runs, every latent codec on the exact one
#: (the DSA models' layers add the indexer, the same path for either codec).
BATCH_RUNS = (
    ("deepseek_v3", "plain"),
    ("deepseek_v3", "affine8"),
    ("deepseek_v32", "affine8"),
    ("glm_moe_dsa", "plain"),
)


def test_batch_equals_solo_runs(models: dict[str, Any]) -> None:
    """deepseek_v3 (one latent cache a layer): bit for bit. The DSA models: the same greedy
    tokens, logits within LATENT_TOLERANCE (the indexer's batched matmuls round differently
    in the last bits: 6e-8 measured, as before the engine served them)."""
    trace = _trace()
    assert {arch for arch, _ in BATCH_RUNS} == set(MLA_MODELS)
    for arch, name in BATCH_RUNS:
        model = models[arch]
        scheme = latent_scheme(name)
        engine = Engine(model, scheme, max_batch=4, prefill_chunk=CHUNK, keep_logits=True)
        results, stats = engine.run(trace)
        assert stats.generated == sum(r.max_tokens for r in trace)
        assert stats.peak_rows > 1  # rows ran together
        exact = arch == "deepseek_v3"
        tolerance = 0.0 if exact else LATENT_TOLERANCE
        report = check_invariance(model, scheme, trace, results, CHUNK, tolerance=tolerance)
        assert report.steps == stats.generated
        assert report.ok and report.mismatches == 0 and report.near_ties == 0, (arch, report)
        if exact:
            assert report.max_logit_diff == 0.0


def test_kv_bytes_are_the_latent_bytes(models: dict[str, Any]) -> None:
    """Admission projects a row from the latent caches (learnt from one probe token)."""
    model = models["deepseek_v32"]
    engine = Engine(model)
    per_layer = make_kvrows_cache(model)[0]
    model(mx.array([[1, 2]]), cache=[*make_kvrows_cache(model)])  # a fresh run: widths, dtype
    assert engine.admission.bytes(1) == len(model.layers) * (64 + 16 + 32) * 4
    assert engine.admission.bytes(10) == 10 * engine.admission.bytes(1)
    with pytest.raises(LayoutStateError, match="unknown"):
        per_layer.projected_bytes(1)  # a fresh drop-in: no dtype yet


def test_a_prefix_hit_gives_the_cold_run(models: dict[str, Any]) -> None:
    """A follow-up whose prompt extends a finished request's prompt takes its published
    prompt row (latent rows publish at their exact length) and gives the tokens and logits
    of a run without the prefix cache."""
    for arch in ("deepseek_v3", "deepseek_v32"):
        model = models[arch]
        first = Request("a", tuple(range(3, 14)), 4)
        second = Request("b", (*first.prompt, 40, 41, 42), 5, arrival=1)
        warm, stats = Engine(model, max_batch=2, keep_logits=True).run([first, second])
        assert warm[1].prefix_hit_tokens == len(first.prompt) and stats.prefix_hits == 1
        cold, _ = Engine(model, use_prefix_cache=False, keep_logits=True).run([first, second])
        assert [r.tokens for r in warm] == [r.tokens for r in cold]
        tolerance = 0.0 if arch == "deepseek_v3" else LATENT_TOLERANCE
        report = check_invariance(
            model, KvStorageScheme(), [first, second], warm, 64, tolerance=tolerance
        )
        assert report.ok and report.mismatches == 0, (arch, report)


def test_bf16_first_latents_convert_per_row(models: dict[str, Any]) -> None:
    """``--kv-start``: an encoded latent read exact until each row passes the start, rows
    converting at their own lengths in one batch, each the solo run's."""
    trace = _trace()
    model = models["glm_moe_dsa"]
    for name in ("affine4", "turbo-v4"):
        scheme = latent_scheme(name, kv_start=20)
        assert make_kvrows_cache(model, scheme)[0].signature().endswith(":20")
        engine = Engine(model, scheme, max_batch=4, prefill_chunk=CHUNK, keep_logits=True)
        results, stats = engine.run(trace)
        report = check_invariance(model, scheme, trace, results, CHUNK, tolerance=LATENT_TOLERANCE)
        assert report.ok and report.mismatches == 0 and report.steps == stats.generated, report


def test_speculative_rounds_give_the_plain_tokens(models: dict[str, Any]) -> None:
    """A draft (a truncated copy) proposes, the latent verify layouts roll back per row:
    the greedy tokens are the plain engine's."""
    trace = _trace(4)
    for arch in ("deepseek_v3", "deepseek_v32"):
        model = models[arch]
        plain, _ = Engine(model, max_batch=4).run(trace)
        engine = Engine(model, max_batch=4, draft_model=draft_model(model, 1), draft_tokens=3)
        results, stats = engine.run(trace)
        assert [r.tokens for r in results] == [r.tokens for r in plain]
        assert stats.drafted > 0 and stats.target_forwards < stats.generated


def test_the_disk_store_keeps_latent_rows(models: dict[str, Any], tmp_path: Any) -> None:
    """A row saved at a block boundary (the latent cache behind the drop-in) loads into a
    new engine as drop-ins again and gives the cold run's tokens."""
    model = models["deepseek_v32"]
    scheme = KvStorageScheme()

    def store() -> PrefixStore:
        return PrefixStore(
            tmp_path,
            byte_budget=1 << 24,
            block_tokens=4,
            fingerprint=model_fingerprint(model, scheme),
        )

    first = Request("a", tuple(range(3, 10)), 2)  # covers 7 + 1 = 8 tokens: two blocks
    results, stats = Engine(model, prefix_store=store()).run([first])
    assert stats.store_writes == 1 and stats.store_errors == 0
    follow = Request("b", (*first.prompt, results[0].tokens[0], 50, 60), 3)
    loaded, stats = Engine(model, prefix_store=store(), use_prefix_cache=False).run([follow])
    assert stats.store_hits == 1 and loaded[0].store_hit_tokens == 8
    cold, _ = Engine(model, use_prefix_cache=False).run([follow])
    assert loaded[0].tokens == cold[0].tokens


def test_paged_latent_layers_share_prefix_blocks(models: dict[str, Any]) -> None:
    """``paged=True``: each layer's latent goes into one ``LatentBlockPool`` (the drop-in's
    ``PagedForm``), shared by every request: the trace's shared system prompts are taken
    as block hits (the contiguous engine's exact-length hits take none here), the tokens
    are the contiguous engine's, every step is the solo run's (deepseek_v3 bit for bit),
    and the pools hold less at the peak."""
    trace = _trace(8)
    for arch in ("deepseek_v3", "deepseek_v32"):
        model = models[arch]
        scheme = latent_scheme("plain")
        contiguous, flat = Engine(model, scheme, max_batch=4, prefill_chunk=CHUNK).run(trace)
        engine = Engine(
            model, scheme, max_batch=4, prefill_chunk=CHUNK, keep_logits=True, paged=True,
            block_size=8,
        )  # fmt: skip
        results, stats = engine.run(trace)
        assert [r.tokens for r in results] == [r.tokens for r in contiguous]
        assert stats.prefix_hits > flat.prefix_hits and stats.prefix_hit_tokens % 8 == 0
        assert stats.peak_kv_bytes < flat.peak_kv_bytes
        tolerance = 0.0 if arch == "deepseek_v3" else LATENT_TOLERANCE
        report = check_invariance(model, scheme, trace, results, CHUNK, tolerance=tolerance)
        assert report.ok and report.mismatches == 0, (arch, report)
        assert engine.paged is not None
        for pool in engine.paged.pools:
            assert pool.ledger.held_count > 0  # finished rows' blocks stay cached


def test_paged_encoded_latents_give_the_contiguous_tokens(models: dict[str, Any]) -> None:
    """An affine latent pool (start 0): prefix hits at block boundaries, the contiguous
    engine's tokens. (A hit's blocks were written by the request that computed them, whose
    first append read the latent exact: a solo replay cut elsewhere rounds differently, so
    the logits are not compared.) A bf16-first start stays refused under ``paged``."""
    trace = _trace(8)
    model = models["deepseek_v32"]
    scheme = latent_scheme("affine8")
    contiguous, _ = Engine(model, scheme, max_batch=4, prefill_chunk=CHUNK).run(trace)
    results, stats = Engine(
        model, scheme, max_batch=4, prefill_chunk=CHUNK, paged=True, block_size=8
    ).run(trace)
    assert stats.prefix_hits > 0
    assert [r.tokens for r in results] == [r.tokens for r in contiguous]
    with pytest.raises(InvalidInputError, match="paged"):
        Engine(model, latent_scheme("affine8", kv_start=4), paged=True)


def test_the_mla_demo_runs_paged(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvrows demo --mla --paged``: the paged engine takes the trace's shared system
    prompts as block hits; every request alone (its hit fed in its source row's appends)
    gives its batch tokens, logits within the tolerance, under the plain latent (whose
    tokens are also the contiguous engine's) and an encoded one (whose hit blocks, computed
    in other appends, may turn a near-tie against the contiguous engine: not failed)."""
    from kvrows.app import cli, demo

    status = demo.run_latent_demo(
        schemes=["plain", "affine4"], requests=8, max_batch=4, architectures=["glm_moe_dsa"],
        paged=True,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line.startswith("glm_moe_dsa")]
    assert [row[1] for row in rows] == ["plain", "affine4"]
    for row in rows:
        generated, hits = int(row[3]), int(row[-7])  # "N (T tok)" before the last four
        assert hits > 0 and row[-2] == f"0/{generated}" and row[-1] == "PASS"
        assert float(row[-3]) < 1e-5
    assert rows[0][-4] == "same"
    # B/token/layer, a block's share: admission's, the encoded latent's decoded window
    # (64 float32 values per token) beside its codes
    assert [int(row[6]) for row in rows] == [448, 240 + 64 * 4]
    called: list[dict[str, Any]] = []

    def record(**options: Any) -> int:
        called.append(options)
        return 0

    monkeypatch.setattr(demo, "run_latent_demo", record)
    assert cli.main(["demo", "--mla", "--paged", "--scheme", "plain"]) == 0
    assert called and called[0]["paged"] is True and called[0]["schemes"] == ["plain"]


def test_a_drop_in_layout_refuses_misuse(models: dict[str, Any]) -> None:
    model = models["deepseek_v32"]
    rows: list[Any] = []
    for prompt in ([1, 2, 3], [4, 5]):
        caches = make_kvrows_cache(model)
        model(mx.array([prompt]), cache=caches)
        rows.append(caches[0])
    layout: Any = owned_cache_layout(rows[0])
    assert is_batchable(layout) and layout.batch_size == 0
    layout.merge_rows([rows[0]])
    held = layout.wrapped
    layout.merge_rows([rows[1]])  # joins a running layout: the cache behind it takes the row
    assert layout.row_offsets == (3, 2) and rows[0].wrapped.batch_size == 1
    assert layout.wrapped is held
    layout.merge_rows([])  # no rows: nothing changes (every layout's rule)
    with pytest.raises(InvalidInputError):
        layout.merge_rows(rows[0])  # not a sequence
    with pytest.raises(IncompatibleRowsError):
        layout.merge_rows([layout])
    assert layout.wrapped is held and layout.row_offsets == (3, 2)  # nothing changed
    assert layout.extract_row(1).row_offsets == (2,)
    assert layout.can_publish_row(0, 3) and not layout.can_publish_row(0, 2)
    layout.filter_rows([1])
    assert layout.row_offsets == (2,)
    layout.filter_rows([])  # the last row leaves: an empty layout, ready for new rows
    assert layout.batch_size == 0
    layout.merge_rows([rows[1]])
    assert layout.row_offsets == (2,)
