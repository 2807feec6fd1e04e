"""The serve benchmark's parts without starting model servers: its trace, and its load
generator against a live kvrows server over the fake engine (what the clients count is
what the server says it sent)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from server_helpers import FakeEngine, live_server

from kvrows.app.bench import FAMILIES, IN_PROCESS, serve
from kvrows.app.checkpoints import train_tokenizer
from kvrows.app.server import KvRowsServer
from kvrows.errors import InvalidInputError


def test_the_trace_shares_documents_and_arrives_in_order() -> None:
    trace = serve.http_trace(8, document_words=(5, 9), documents=2, outputs=(3, 5), seed=4)
    assert [r.rid for r in trace] == [f"h{i:03d}" for i in range(8)]
    assert all(a.at <= b.at for a, b in itertools.pairwise(trace))
    assert {r.max_tokens for r in trace} <= {3, 5}
    documents = [r.prompt.split("\nquestion")[0] for r in trace]
    assert documents[0::2] == [documents[0]] * 4 and documents[1::2] == [documents[1]] * 4
    assert documents[0] != documents[1]
    assert trace == serve.http_trace(8, document_words=(5, 9), documents=2, outputs=(3, 5), seed=4)
    with pytest.raises(InvalidInputError):
        serve.http_trace(0, document_words=(5, 9))


def test_the_load_generator_counts_what_the_server_sent() -> None:
    tokenizer: Any = TokenizerWrapper(train_tokenizer())
    engine = FakeEngine(len(tokenizer.get_vocab()), tokenizer.decode)
    server = KvRowsServer(engine, tokenizer, model_name="m", context_length=512, drain_timeout=5.0)
    trace = serve.http_trace(6, document_words=(5, 9), outputs=(3, 4), mean_gap=0.01)
    with live_server(server) as url:
        run = serve.send_trace(url, "m", trace, clients=3)
        metrics = serve.send_trace(url, "unknown-model", trace[:1], clients=1)
    assert not run.errors and sorted(run.texts) == [r.rid for r in trace]
    assert run.completion_tokens == sum(r.max_tokens for r in trace)  # the fake never stops
    assert len(run.ttft) == len(run.latency) == 6 and run.tokens_per_second > 0
    assert metrics.errors and "404" in metrics.errors[0]  # an error is reported, not counted


def test_serve_is_a_family_but_not_part_of_all() -> None:
    assert FAMILIES["serve"] == "serve" and "serve" not in IN_PROCESS
