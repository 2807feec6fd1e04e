"""Speculative decoding in the engine: a draft proposes, the target verifies in its verify
layouts, and the greedy output is the non-speculative engine's, token for token.

The tiny models are float32 with random weights; the verify forward reads ``d + 1``
positions at once where plain decode reads one, so logits may differ in the last bits:
the token checks rely on the trace having no near-tie (each comparison also checks the
logits against a solo replay within the demo's tolerance, so a tie would show).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.app.demo import builtin_trace, check_invariance
from kvrows.app.engine import Engine, Request
from kvrows.app.models import draft_model, make_kvrows_cache, tiny_model
from kvrows.errors import InvalidInputError
from kvrows.protocols import RingGeometry
from kvrows.schemes import KvStorageScheme

TRACE = builtin_trace(4)


def _tokens(results: Any) -> dict[str, list[int]]:
    return {r.rid: r.tokens for r in results}


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("scheme", ["plain", "affine8"])
def test_speculative_greedy_tokens_equal_plain_decoding(
    arch: str, scheme: str, llama: Any, gemma3: Any
) -> None:
    target = llama if arch == "llama" else gemma3
    storage = KvStorageScheme.parse(scheme)
    plain, _ = Engine(target, storage, max_batch=4, prefill_chunk=16).run(TRACE)
    engine = Engine(
        target,
        storage,
        max_batch=4,
        prefill_chunk=16,
        keep_logits=True,
        draft_model=draft_model(target),
        draft_tokens=3,
    )
    results, stats = engine.run(TRACE)
    assert _tokens(results) == _tokens(plain)
    # Speculation happened: drafts were accepted, so rows gained more than a token per
    # target forward, and the counts add up.
    assert 0 < stats.accepted <= stats.drafted
    assert stats.tokens_per_row_forward > 1
    first_tokens = sum(1 for r in results if r.tokens)
    assert stats.decode_tokens == stats.generated - first_tokens
    assert stats.decode_tokens == stats.row_forwards + stats.accepted
    # Every kept logit row is the one its token came from (a solo serial replay).
    report = check_invariance(target, storage, TRACE, results, 16)
    assert report.mismatches == 0 and report.steps == stats.generated
    if storage.codec.kind == "plain":
        assert report.beyond_tolerance == 0, report


def _replayed_acceptance(
    draft: Any, request: Request, output: list[int], drafts: int
) -> tuple[int, int]:
    """Drafts proposed and accepted for ``request`` alone, replayed without kvrows: each
    round the draft reads the committed tokens afresh through mlx-lm's own caches and
    proposes greedily; ``output`` (the target's greedy tokens) says what it accepts."""
    import mlx.core as mx

    proposed = accepted = 0
    emitted = 1  # the first token comes from the prefill
    while emitted < request.max_tokens:
        d = min(drafts, request.max_tokens - emitted - 1)
        if d == 0:
            emitted += 1
            continue
        cache = draft.make_cache()
        logits = draft(mx.array([[*request.prompt, *output[:emitted]]]), cache=cache)
        proposals: list[int] = []
        for _ in range(d):
            token: int = mx.argmax(logits[0, -1]).item()  # type: ignore[assignment]
            proposals.append(token)
            logits = draft(mx.array([[proposals[-1]]]), cache=cache)
        a = 0
        while a < d and proposals[a] == output[emitted + a]:
            a += 1
        proposed, accepted, emitted = proposed + d, accepted + a, emitted + a + 1
    return proposed, accepted


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_state_matches_a_serial_replay(arch: str, llama: Any, gemma3: Any) -> None:
    """The draft's own layouts hold exactly the accepted tokens after every round (its
    proposals are those of a fresh serial draft over the committed tokens): the engine
    accepts exactly as many drafts as the replay."""
    target = llama if arch == "llama" else gemma3
    draft = draft_model(target)
    request = Request("r", tuple((3 * j + 3) % 256 for j in range(21)), 20)
    (plain,), _ = Engine(target, max_batch=1).run([request])
    (result,), stats = Engine(target, max_batch=1, draft_model=draft).run([request])
    assert result.tokens == plain.tokens
    expected = _replayed_acceptance(draft, request, plain.tokens, 3)
    assert (stats.drafted, stats.accepted) == expected
    assert 0 < stats.accepted < stats.drafted  # rounds with partial acceptance


def test_stop_tokens_and_lengths_cap_acceptance(llama: Any) -> None:
    """A row never emits past ``max_tokens`` or a stop token, even when drafts run on."""
    plain, _ = Engine(llama, max_batch=4).run(TRACE)
    stops = [
        Request(r.rid, r.prompt, 24, stop=frozenset({p.tokens[min(3, len(p.tokens) - 1)]}))
        for r, p in zip(TRACE, plain, strict=True)
    ]
    expected, _ = Engine(llama, max_batch=4).run(stops)
    got, _ = Engine(llama, max_batch=4, draft_model=draft_model(llama), draft_tokens=4).run(stops)
    assert _tokens(got) == _tokens(expected)
    assert [r.finish_reason for r in got] == [r.finish_reason for r in expected]
    assert all(len(r.tokens) <= 24 for r in got)


def test_tempered_rows_draw_what_plain_decoding_draws(llama: Any) -> None:
    """A tempered row accepts no draft and samples its own key's next subkey."""
    mixed = [
        Request(r.rid, r.prompt, r.max_tokens, temperature=0.8 if i % 2 else 0.0, seed=i)
        for i, r in enumerate(TRACE)
    ]
    plain, _ = Engine(llama, max_batch=3).run(mixed)
    spec, _ = Engine(llama, max_batch=3, draft_model=draft_model(llama)).run(mixed)
    assert _tokens(spec) == _tokens(plain)


def test_published_rows_hold_only_accepted_tokens(llama: Any) -> None:
    """A follow-up reuses a speculative row from the prefix cache and gets the tokens a
    cold engine gives (a published row holding a rejected draft would change them)."""
    first = Request("a", tuple(range(30)), 10)
    engine = Engine(llama, max_batch=2, draft_model=draft_model(llama))
    (result,), _ = engine.run([first])
    follow = Request("b", first.prompt + tuple(result.tokens) + (1, 2, 3), 8)
    (reused,), _ = engine.run([follow])
    assert reused.prefix_hit_tokens == len(first.prompt) + len(result.tokens) - 1
    (cold,), _ = Engine(llama, max_batch=2, use_prefix_cache=False).run([follow])
    assert reused.tokens == cold.tokens


def test_draft_model_is_a_truncated_copy(llama: Any, gemma3: Any) -> None:
    draft = draft_model(llama)
    assert len(draft.layers) == 1 and draft.args.vocab_size == llama.args.vocab_size
    assert (draft.model.embed_tokens.weight == llama.model.embed_tokens.weight).all()
    assert len(draft_model(gemma3).layers) == 2  # one local and one global layer
    with pytest.raises(InvalidInputError):
        draft_model(gemma3, layers=1)
    with pytest.raises(InvalidInputError):
        draft_model(llama, layers=5)


def test_bad_draft_options(llama: Any) -> None:
    draft = draft_model(llama)
    with pytest.raises(InvalidInputError):
        Engine(llama, draft_model=draft, draft_tokens=0)
    with pytest.raises(InvalidInputError):
        Engine(llama, draft_model=tiny_model("llama", vocab=128))


def test_speculative_bench_smoke_run() -> None:
    """``kvrows bench --family speculative`` runs end to end on one small case; its check
    refuses tokens that are not the greedy ones."""
    import io

    from kvrows.app.bench import speculative
    from kvrows.app.bench.runner import BenchCheckError, run_family

    family = speculative.family(quick=True, archs=("llama",), requests=1)
    out = io.StringIO()
    assert run_family(family, quick=True, repeats=1, out=out) == 0
    text = out.getvalue()
    assert "WRONG RESULT" not in text
    rows = [[c.strip() for c in r.strip("|").split("|")] for r in text.splitlines() if "|" in r]
    (cells,) = [row for row in rows if row[0] == "llama"]
    assert cells[-2] == "True" and int(cells[3]) > 0
    case = speculative._case("llama", None, None, [], 1, 3, 64, {"r00": [1, 2, 3]})
    case.workloads["kvrows spec"].check({"r00": [1, 2, 3]})
    with pytest.raises(BenchCheckError, match="r00"):
        case.workloads["kvrows spec"].check({"r00": [1, 2]})


def test_kvrows_demo_speculative(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvrows demo --speculative`` passes on both models and says what it measured."""
    from kvrows.app import cli

    argv = ["demo", "--speculative", "--scheme", "plain", "--requests", "2", "--quiet"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith(("llama ", "gemma3 "))]
    assert [row[0] for row in rows] == ["llama", "gemma3"]
    assert all(row[-1] == "PASS" for row in rows)
    assert [row[2] for row in rows] == ["1", "2"]  # the draft's layers


def test_gemma3_rounds_cross_the_window_without_a_draft_copy(gemma3: Any, call_log: Any) -> None:
    """The sliding layers (window 16) are rings in their verify layouts; rows run rounds
    past the window (prompts of 20-22 tokens, 16 more generated). Dispatch: the draft's
    ring layers take its proposals in a proposal round on the layouts themselves
    (``spec_round_propose`` / ``spec_round_discard``), no scratch copy of the batch
    (``make_empty_batch``). The target as its own draft proposes exactly the target's
    tokens only if the draft's rings hold exactly the accepted tokens across the window:
    every draft is accepted."""
    rings = [isinstance(c, RingGeometry) for c in make_kvrows_cache(gemma3)]
    assert any(rings) and not all(rings)
    from kvrows.optimized import rows
    from kvrows.speculative import SpeculativeRounds

    call_log.watch(rows.Layout, "make_empty_batch")
    call_log.watch(SpeculativeRounds, "spec_round_propose")
    call_log.watch(SpeculativeRounds, "spec_round_discard")
    long = [Request(f"w{i}", tuple((5 * j + i) % 256 for j in range(20 + i)), 16) for i in range(3)]
    plain, _ = Engine(gemma3, max_batch=3, prefill_chunk=8).run(long)
    selfish = Engine(gemma3, max_batch=3, prefill_chunk=8, draft_model=draft_model(gemma3, 4))
    results, stats = selfish.run(long)
    assert _tokens(results) == _tokens(plain)
    assert stats.accepted == stats.drafted > 0
    assert "make_empty_batch" not in call_log.names
    proposed = call_log.names.count("spec_round_propose")
    assert proposed > 0 and call_log.names.count("spec_round_discard") == proposed
