"""The engine's prefill: a row publishes its prompt's KV as soon as its prefill is done."""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.app.demo import check_invariance
from kvrows.app.engine import Engine, Request
from kvrows.schemes import KvStorageScheme

CHUNK = 8


def _pair() -> tuple[Request, Request]:
    """``a`` decodes for many steps; ``b`` extends a's prompt and arrives while it does
    (a's 24-token prompt takes 3 chunks of 8: its prefill is done at step 2)."""
    prompt = tuple((5 * i + 3) % 256 for i in range(24))
    return Request("a", prompt, 12), Request("b", (*prompt, 9, 8, 7, 6, 5), 4, arrival=5)


@pytest.mark.parametrize(
    ("model", "scheme"), [("llama", "plain"), ("llama", "affine8"), ("gemma3", "plain")]
)
def test_a_prompt_is_reused_while_its_row_still_decodes(
    models: dict[str, Any], model: str, scheme: str
) -> None:
    """``b`` reuses a's whole prompt before ``a`` has finished (and published its longer
    row); both give their solo runs' tokens and logits, bit for bit. gemma3's rings of 16
    have wrapped in a's 24-token prompt: reusable whole."""
    net, storage = models[model], KvStorageScheme.parse(scheme)
    a, b = _pair()
    engine = Engine(net, storage, max_batch=2, prefill_chunk=CHUNK, keep_logits=True)
    results, stats = engine.run([a, b])
    first, second = results
    assert second.admitted_step == b.arrival
    assert first.admitted_step + a.max_tokens > b.arrival  # a still decoded then
    assert second.prefix_hit_tokens == len(a.prompt) and stats.prefix_hits == 1
    # The rest of b's prompt in one chunk, its last token appended alone (spec/engine.md §5).
    assert second.prefill_chunks == [len(b.prompt) - len(a.prompt) - 1, 1]
    report = check_invariance(net, storage, [a, b], results, CHUNK)
    assert report.ok and report.max_logit_diff == 0.0 and report.steps > 0, report


def test_a_bf16_first_row_is_reused_only_after_it_leaves(models: dict[str, Any]) -> None:
    """Under a bf16-first start the prompt's legos join the decode layouts (which release
    them), so a row publishes only when it leaves; ``b`` still gives its solo run's tokens
    and logits."""
    a, b = _pair()
    storage = KvStorageScheme.parse("affine8:32@6")
    engine = Engine(models["llama"], storage, max_batch=2, prefill_chunk=CHUNK, keep_logits=True)
    results, _ = engine.run([a, b])
    assert results[1].prefix_hit_tokens == 0
    report = check_invariance(models["llama"], storage, [a, b], results, CHUNK)
    assert report.ok and report.max_logit_diff == 0.0 and report.steps > 0, report


def test_gemma3_rows_converting_on_a_decode_step_are_bit_identical(
    models: dict[str, Any],
) -> None:
    """gemma3 (rings of 16) under a start of 20: rows convert on a single-token decode append
    after their rings wrapped. The solo lego reads that step from the plain ring it just
    replaced (``read_storage``), in time order as the batch does: logits bit-identical."""
    storage = KvStorageScheme.parse("affine8:32@20")
    requests = [
        Request(f"c{i}", tuple((11 * i + 7 * j + 2) % 256 for j in range(length)), 9, at)
        for i, (length, at) in enumerate([(17, 0), (13, 0), (15, 2)])
    ]
    engine = Engine(models["gemma3"], storage, max_batch=3, prefill_chunk=CHUNK, keep_logits=True)
    results, _ = engine.run(requests)
    report = check_invariance(models["gemma3"], storage, requests, results, CHUNK)
    assert report.ok and report.max_logit_diff == 0.0 and report.steps > 0, report


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_a_start_0_prefix_hit_replays_its_first_append(models: dict[str, Any], model: str) -> None:
    """Under a start of 0 a lego's first append reads plain whatever its size. ``a``'s
    3-token prompt is that append; its decoded tokens read quantized. ``b`` reuses a's
    prompt and decodes: its solo replay feeds that prefix as a 3-token chunk, then the
    rest (one 6-token chunk read plain throughout was 7.3e-03 off on llama)."""
    net, storage = models[model], KvStorageScheme.parse("affine4:32@0")
    a = Request("a", (17, 4, 99), 5)
    engine = Engine(net, storage, max_batch=2, prefill_chunk=CHUNK, keep_logits=True)
    first, _ = engine.run([a])
    b = Request("b", (*a.prompt, *first[0].tokens, 8, 7), 4)
    second, _ = engine.run([b])
    assert second[0].prefix_hit_tokens > len(a.prompt), second[0]
    report = check_invariance(net, storage, [a, b], first + second, CHUNK)
    assert report.ok and report.max_logit_diff == 0.0 and report.steps > 0, report
