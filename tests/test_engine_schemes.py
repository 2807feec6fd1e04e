"""Per-layer schemes with negative layer indices, resolved against the model's layers; the
TurboQuant scheme names (``turbo``, ``turbo-k4v3``, ``turbo:k4v3``) and the demo under them."""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.app import demo
from kvrows.app.engine import Engine
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.codec import CodecSpec
from kvrows.errors import InvalidInputError
from kvrows.schemes import Affine, KvStorageScheme, Plain, Turbo


def test_negative_layer_indices_parse_and_round_trip() -> None:
    scheme = KvStorageScheme.parse("affine4:32,0=plain,-1=plain@512")
    assert scheme == KvStorageScheme(
        codec=Affine(bits=4, group_size=32),
        layers=((0, Plain()), (-1, Plain())),
        quantized_kv_start=512,
    )
    assert scheme.name == "affine4:32,0=plain,-1=plain@512"
    assert KvStorageScheme.parse(scheme.name) == scheme
    resolved = scheme.resolve(4)
    assert resolved.layers == ((0, Plain()), (3, Plain()))
    expected: list[CodecSpec] = [
        Plain(),
        Affine(bits=4, group_size=32),
        Affine(bits=4, group_size=32),
        Plain(),
    ]
    assert [scheme.codec_for_layer(i, 4) for i in range(4)] == expected


def test_the_caches_follow_the_resolved_layers(gemma3: Any) -> None:
    caches = make_kvrows_cache(gemma3, KvStorageScheme.parse("affine8,-1=plain,-4=affine4"))
    explicit = make_kvrows_cache(gemma3, KvStorageScheme.parse("affine8,3=plain,0=affine4"))
    assert [c.signature() for c in caches] == [c.signature() for c in explicit]
    assert caches[3].signature() == "kv:plain" and "quant" in caches[1].signature()
    assert caches[0].codec_spec == Affine(bits=4)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("plain,-5=affine8", "outside a model of 4 layers"),
        ("plain,4=affine8", "outside a model of 4 layers"),
        ("plain,3=affine8,-1=affine4", "both layer 3"),
    ],
)
def test_unresolvable_layers_are_refused(gemma3: Any, text: str, match: str) -> None:
    scheme = KvStorageScheme.parse(text)  # valid on its own: only a model resolves it
    with pytest.raises(InvalidInputError, match=match):
        make_kvrows_cache(gemma3, scheme)


@pytest.mark.parametrize("text", ["plain,-=affine8", "plain,x=affine8", "plain,--1=plain"])
def test_malformed_layer_indices_are_refused(text: str) -> None:
    with pytest.raises(InvalidInputError, match="layer"):
        KvStorageScheme.parse(text)


def test_a_duplicate_literal_index_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="two codecs"):
        KvStorageScheme(layers=((-1, Plain()), (-1, Affine())))
    with pytest.raises(InvalidInputError, match="integer"):
        KvStorageScheme(layers=((True, Plain()),))


def test_the_seed_per_layer_form() -> None:
    """``per_layer``: listed layers' codecs, the rest plain (or ``default``); the same
    scheme the text form names."""
    q4, q8 = Affine(bits=4, group_size=32), Affine(bits=8, group_size=64)
    scheme = KvStorageScheme.per_layer({0: q4, -1: q8}, quantized_kv_start=3)
    assert scheme == KvStorageScheme.parse("plain,0=affine4:32,-1=affine8:64@3")
    per_layer: list[CodecSpec] = [q4, Plain(), q8]
    assert [scheme.codec_for_layer(i, 3) for i in range(3)] == per_layer
    kept = KvStorageScheme.per_layer({0: Plain(), -1: Plain()}, default=q4)
    assert kept.codec_for_layer(1, 3) == q4 and kept.codec_for_layer(2, 3) == Plain()
    with pytest.raises(InvalidInputError, match="mapping"):
        KvStorageScheme.per_layer([(0, q4)])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="layer index"):
        KvStorageScheme.per_layer({"0": q4})  # type: ignore[dict-item]


# -- TurboQuant names ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "codec"),
    [
        ("turbo", Turbo(k_bits=8, v_bits=3)),  # the bare name: k8v3
        ("turbo-k4v3", Turbo(k_bits=4, v_bits=3)),
        ("turbo:k4v3", Turbo(k_bits=4, v_bits=3)),
        ("turbo:k8v8", Turbo(k_bits=8, v_bits=8)),
        ("turbo:k2v2", Turbo(k_bits=2, v_bits=2)),
    ],
)
def test_turbo_names_parse_to_their_widths(text: str, codec: Turbo) -> None:
    scheme = KvStorageScheme.parse(text)
    assert scheme.codec == codec
    assert scheme.name == f"turbo-k{codec.k_bits}v{codec.v_bits}"
    assert KvStorageScheme.parse(scheme.name) == scheme  # the canonical name round-trips


def test_turbo_names_compose_with_layers_and_a_start() -> None:
    scheme = KvStorageScheme.parse("turbo:k4v3,0=plain,-1=turbo@16")
    assert scheme == KvStorageScheme(
        codec=Turbo(k_bits=4, v_bits=3),
        layers=((0, Plain()), (-1, Turbo())),
        quantized_kv_start=16,
    )
    assert KvStorageScheme.parse(scheme.name) == scheme


def test_the_turbo_alias_builds_turbo_layers(gemma3: Any) -> None:
    """gemma3's full-attention layers under k8v3, its sliding layers plain rings."""
    caches = make_kvrows_cache(gemma3, KvStorageScheme.parse("turbo"))
    assert [c.signature() for c in caches] == [
        c.signature() for c in make_kvrows_cache(gemma3, KvStorageScheme.parse("turbo-k8v3"))
    ]
    kinds = [type(c).__name__ for c in caches]
    assert kinds == ["RotatingKVCache", "TurboQuantKVCache"] * 2
    assert caches[1].codec_spec == Turbo(k_bits=8, v_bits=3)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_demo_invariance_under_turbo(arch: str) -> None:
    """The demo's batch-invariance check under ``turbo``: llama (no rings) must match its
    solo runs within the tolerance; gemma3's rings feed its TurboQuant layers, so a
    last-bit ring-order difference may flip a key code: counted, not failed."""
    model = tiny_model(arch)
    scheme = demo.parse_scheme("turbo")
    requests = demo.builtin_trace(4)
    results, _ = Engine(model, scheme, max_batch=3, prefill_chunk=16, keep_logits=True).run(
        requests
    )
    report = demo.check_invariance(model, scheme, requests, results, 16)
    assert report.steps == sum(len(r.tokens) for r in results) > 0
    assert report.quantized_with_rings == (arch == "gemma3")
    assert report.mismatches == 0 and report.ok
    if arch == "llama":
        assert report.beyond_tolerance == 0


def test_demo_invariance_fails_a_turbo_row_that_drifts() -> None:
    """Without rings nothing excuses a difference: a batch logit off by more than the
    tolerance fails the report (llama, turbo)."""
    model = tiny_model("llama")
    scheme = demo.parse_scheme("turbo")
    requests = demo.builtin_trace(2)
    results, _ = Engine(model, scheme, max_batch=2, prefill_chunk=16, keep_logits=True).run(
        requests
    )
    results[0].logits[0] = results[0].logits[0] + 1e-3
    report = demo.check_invariance(model, scheme, requests, results, 16)
    assert report.beyond_tolerance >= 1 and not report.ok
