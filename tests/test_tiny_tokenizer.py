"""The built-in byte-level tokenizer: token ids are the text's UTF-8 bytes, it covers the
tiny models' vocabulary, and mlx-lm's generation loops take it with no download."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import batch_generate, generate, stream_generate

from kvrows.app.models import make_kvrows_cache, tiny_model_and_tokenizer
from kvrows.app.tiny_tokenizer import tiny_tokenizer

#: Spaces at both ends and before a comma, a NUL and a control byte, a newline, two- and
#: three-byte characters: what a tokenizer that trims, cleans up or splits would change.
AWKWARD = " a ,b\x00\x1f\n wörld ✓ 日本  "


def test_token_ids_are_the_utf8_bytes() -> None:
    tokenizer = tiny_tokenizer()
    assert tokenizer.encode(AWKWARD) == list(AWKWARD.encode("utf-8"))
    assert tokenizer.decode(list(AWKWARD.encode("utf-8"))) == AWKWARD
    every_byte = bytes(range(256))
    assert tokenizer.decode(list(every_byte)) == every_byte.decode("utf-8", "replace")


def test_the_vocabulary_is_the_tiny_models() -> None:
    model, tokenizer = tiny_model_and_tokenizer("gemma3")
    logits = model(mx.array([tokenizer.encode("Hi")]))
    assert len(tokenizer) == logits.shape[-1] == 256
    assert tokenizer.eos_token_ids == set()  # no special token: runs to max_tokens


def test_mlx_lm_generates_with_it_through_kvrows_caches() -> None:
    model, tokenizer = tiny_model_and_tokenizer("llama")
    tokens: list[int] = []
    streamed = ""
    for response in stream_generate(
        model, tokenizer, "Hello", max_tokens=24, prompt_cache=make_kvrows_cache(model)
    ):
        tokens.append(response.token)
        streamed += response.text
    assert len(tokens) == 24
    # the streaming detokenizer gives back exactly the bytes the model chose
    assert streamed == bytes(tokens).decode("utf-8", "replace")
    assert generate(model, tokenizer, "Hello", max_tokens=24) == streamed
    # batched: a text per prompt (not compared with the solo run: padded batches may
    # round differently on other backends)
    prompts = [tokenizer.encode("Hello"), tokenizer.encode("Hi there")]
    texts = batch_generate(model, tokenizer, prompts, max_tokens=6).texts
    assert len(texts) == 2 and all(texts)
