"""Per-layer schemes with negative layer indices, resolved against the model's layers."""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.errors import InvalidInputError
from kvrows.schemes import Affine, KvStorageScheme, Plain


@pytest.fixture(scope="module")
def gemma3() -> Any:
    return tiny_model("gemma3")


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
    assert [scheme.codec_for_layer(i, 4) for i in range(4)] == [
        Plain(),
        Affine(bits=4, group_size=32),
        Affine(bits=4, group_size=32),
        Plain(),
    ]


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
    assert [scheme.codec_for_layer(i, 3) for i in range(3)] == [q4, Plain(), q8]
    kept = KvStorageScheme.per_layer({0: Plain(), -1: Plain()}, default=q4)
    assert kept.codec_for_layer(1, 3) == q4 and kept.codec_for_layer(2, 3) == Plain()
    with pytest.raises(InvalidInputError, match="mapping"):
        KvStorageScheme.per_layer([(0, q4)])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="layer index"):
        KvStorageScheme.per_layer({"0": q4})  # type: ignore[dict-item]
