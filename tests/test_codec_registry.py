"""The codec registry (``kvrows.codecs``, contract §0.2): each codec kind is one spec
module that registers itself, and parsing, saved-state tails, the paged codec field and
the bf16-first target check go through the registry and the spec's members, so a codec
added as a new module plugs into all of them without an edit elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar, Self

import pytest

from kvrows.codec import PlaneSpec, Reads, Role
from kvrows.codecs import (
    CODECS,
    Affine,
    Plain,
    State,
    StateShapes,
    Turbo,
    codec_from_tail,
    is_codec_spec,
    is_kv_codec,
    kv_codecs,
    parse_codec,
    register_codec,
)
from kvrows.codecs.mx import Microscaled
from kvrows.codecs.registry import SpecParts
from kvrows.conversion import check_target, check_target_dims
from kvrows.errors import CorruptStateError, InvalidInputError, KvRowsError
from kvrows.paged_forms import codec_field, codec_named
from kvrows.schemes import Growing, KvStorageScheme, Ring

EXAMPLES = (
    Plain(),
    Affine(),
    Affine(bits=4, group_size=32),
    Affine(bits=3, group_size=128),
    Turbo(),
    Turbo(k_bits=4, v_bits=5),
    Turbo(k_bits=2, v_bits=8),
    Microscaled(),
    Microscaled(group_size=32, bits=8),
    Microscaled(group_size=16, bits=4),
)


def test_the_kinds_are_registered_in_tag_order() -> None:
    assert list(CODECS) == ["plain", "affine", "turbo", "state", "latent", "mx"]
    assert [spec.tag for spec in CODECS.values()] == [0, 1, 2, 3, 4, 5]
    assert list(kv_codecs()) == ["plain", "affine", "turbo", "mx"]


def test_the_state_codec_is_no_kv_scheme() -> None:
    # Recurrent state registers as a codec, but its tensors are no keys and values: it
    # names no scheme word, the unknown-scheme message leaves it out, no block pool stores
    # it (paged forms, the engine's paged layers) and its form is its planes.
    from kvrows.app.engine import PAGED_CODECS
    from kvrows.compositions import composition
    from kvrows.forms import state_form

    spec = State()
    assert is_codec_spec(spec) and not is_kv_codec(spec) and not is_kv_codec(State)
    assert State.tensors() == ("state.0", "state.1")
    assert spec.tensors(StateShapes(planes=(((3,), "float32"),))) == ("state.0",)
    assert "state" not in PAGED_CODECS
    with pytest.raises(InvalidInputError) as caught:
        parse_codec("state")
    assert str(caught.value) == (
        "unknown KV scheme 'state': expected plain, affine<bits>[:<group>] (affine8, "
        "affine4:32), turbo (k8v3) or turbo-k<bits>v<bits> / turbo:k<bits>v<bits>, "
        "mxfp8, mxfp4 or nvfp4"
    )
    with pytest.raises(CorruptStateError, match="unknown codec"):
        codec_named((3, 0, 0))
    assert state_form(composition("SSMCache")).fields == ("state.0", "state.1", "offset")
    assert state_form(composition("BatchedSSMCache")).fields == ("state.0", "state.1", "offset")


@pytest.mark.parametrize("spec", EXAMPLES, ids=str)
def test_a_spec_parses_back_from_its_name(spec: object) -> None:
    assert is_codec_spec(spec)
    assert parse_codec(spec.name) == spec
    assert KvStorageScheme.parse(spec.name).codec == spec


def test_every_listed_name_parses_to_its_kind() -> None:
    for kind, spec in kv_codecs().items():
        assert spec.names, kind
        for name in spec.names:
            assert parse_codec(name).kind == kind, name


def test_scheme_words_as_the_cli_writes_them() -> None:
    assert parse_codec("affine") == Affine(bits=8, group_size=64)
    assert parse_codec("affine4") == Affine(bits=4, group_size=64)
    assert parse_codec("affine4:32") == Affine(bits=4, group_size=32)
    assert parse_codec("turbo") == Turbo(k_bits=8, v_bits=3)
    assert parse_codec("turbo:k4v2") == Turbo(k_bits=4, v_bits=2)
    assert parse_codec("mxfp8") == Microscaled(group_size=32, bits=8)
    assert parse_codec("mxfp4") == Microscaled(group_size=32, bits=4)
    assert parse_codec("nvfp4") == Microscaled(group_size=16, bits=4)


def test_an_unknown_word_names_every_syntax() -> None:
    with pytest.raises(InvalidInputError) as caught:
        parse_codec("fp8")
    assert str(caught.value) == (
        "unknown KV scheme 'fp8': expected plain, affine<bits>[:<group>] (affine8, "
        "affine4:32), turbo (k8v3) or turbo-k<bits>v<bits> / turbo:k<bits>v<bits>, "
        "mxfp8, mxfp4 or nvfp4"
    )


def test_a_refused_parameter_is_the_spec_s_own_error() -> None:
    with pytest.raises(InvalidInputError, match="k_bits must be one of"):
        parse_codec("turbo-k3v3")


@pytest.mark.parametrize("spec", EXAMPLES, ids=str)
def test_the_state_tail_round_trips(spec: object) -> None:
    assert is_codec_spec(spec)
    assert tuple(spec.tail()) == spec.state_tail
    assert codec_from_tail(spec.kind, spec.tail()) == spec


def test_the_tails_are_the_saved_forms() -> None:
    # spec/persistence.md §1.2: affine appends group_size, bits; TurboQuant k_bits, v_bits.
    assert Plain().tail() == {}
    assert list(Affine(bits=4, group_size=32).tail().items()) == [("group_size", 32), ("bits", 4)]
    assert list(Turbo(k_bits=4, v_bits=5).tail().items()) == [("k_bits", 4), ("v_bits", 5)]


def test_an_unknown_kind_has_no_tail() -> None:
    with pytest.raises(InvalidInputError, match="no codec of kind 'fp6'"):
        codec_from_tail("fp6", {})


def test_only_a_registered_spec_is_a_codec_spec() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Lookalike(Affine):
        pass

    assert not is_codec_spec(Lookalike())
    assert not is_codec_spec("affine8")
    assert not is_codec_spec(Affine)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (Plain(), (0, 0, 0)),
        (Affine(bits=4, group_size=32), (1, 4, 32)),
        (Turbo(k_bits=4, v_bits=5), (2, 4, 5)),
    ],
    ids=str,
)
def test_the_paged_codec_field(spec: object, field: tuple[int, int, int]) -> None:
    assert is_codec_spec(spec)
    assert codec_field(spec) == field
    assert codec_named(field) == spec


@pytest.mark.parametrize("field", [(0, 1, 0), (0, 0, 1), (3, 0, 0), (-1, 0, 0)])
def test_an_unknown_paged_codec_field_is_refused(field: tuple[int, int, int]) -> None:
    with pytest.raises(CorruptStateError, match="unknown codec"):
        codec_named(field)


def test_a_paged_codec_field_of_refused_parameters_says_why() -> None:
    with pytest.raises(CorruptStateError, match=r"unknown codec \(1, 7, 64\): .*bits"):
        codec_named((1, 7, 64))


def test_a_bf16_first_target_encodes() -> None:
    assert check_target("Lego", Affine(), Ring(max_size=8)) == Affine()
    with pytest.raises(InvalidInputError) as caught:
        check_target("Lego", Plain(), Growing())
    assert str(caught.value) == "Lego converts to an affine or TurboQuant codec, got Plain()"
    with pytest.raises(InvalidInputError, match="Lego: TurboQuant is full attention only"):
        check_target("Lego", Turbo(), Ring(max_size=8))
    with pytest.raises(InvalidInputError, match="value head dim 96 cannot be converted"):
        check_target_dims(128, 96, Turbo())
    with pytest.raises(InvalidInputError, match="key head dim 48 cannot be converted"):
        check_target_dims(48, 64, Affine(bits=4, group_size=32))


# -- a codec added as a module ------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Halved(SpecParts):
    """A toy codec (not registered by the package): half-width planes."""

    step: int = 2
    kind: ClassVar[str] = "halved-test"
    names: ClassVar[tuple[str, ...]] = ("halved2",)
    syntax: ClassVar[str] = "halved<step>"
    state_tail: ClassVar[tuple[str, ...]] = ("step",)
    encodes: ClassVar[bool] = True
    reads: ClassVar[Reads] = "own"
    tag: ClassVar[int] = 99
    paged_fields: ClassVar[tuple[str, ...]] = ("step",)
    dtype_plane: ClassVar[int | None] = 0
    plane_labels: ClassVar[tuple[str, ...]] = ()

    @property
    def key(self) -> str:
        return f"halved:{self.step}"

    @property
    def name(self) -> str:
        return f"halved{self.step}"

    def parameters(self) -> dict[str, int]:
        return {"step": self.step}

    @classmethod
    def parse(cls, text: str) -> Self | None:
        rest = text.removeprefix("halved")
        return cls(step=int(rest)) if rest != text and rest.isdigit() else None

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        return (PlaneSpec(name, 2, dtype, dim // self.step),)

    def head_dim(self, width: int, role: Role) -> int:
        return width * self.step


@pytest.fixture
def halved() -> Iterator[type[Halved]]:
    before = dict(CODECS)
    register_codec(Halved)
    try:
        yield Halved
    finally:
        CODECS.clear()
        CODECS.update(before)


def test_a_new_codec_module_plugs_in(halved: type[Halved]) -> None:
    spec = Halved(step=4)
    assert list(CODECS)[-1] == "halved-test"  # after the six, by its tag
    assert is_codec_spec(spec)
    assert parse_codec("halved4") == spec
    assert KvStorageScheme.parse("affine4,0=halved4").codec_for_layer(0) == spec
    with pytest.raises(InvalidInputError, match=r"mxfp8, mxfp4 or nvfp4, halved<step>$"):
        parse_codec("fp8")
    assert codec_from_tail("halved-test", {"step": 4}) == spec
    assert codec_field(spec) == (99, 4, 0)
    assert codec_named((99, 4, 0)) == spec
    assert check_target("Lego", spec, Ring(max_size=8)) == spec


def test_a_kind_or_a_tag_registers_once(halved: type[Halved]) -> None:
    register_codec(Halved)  # the same class again: nothing changes
    assert list(CODECS).count("halved-test") == 1

    @dataclass(frozen=True, kw_only=True)
    class Twin(Halved):
        pass

    with pytest.raises(KvRowsError, match="two codec specs register the kind 'halved-test'"):
        register_codec(Twin)

    @dataclass(frozen=True, kw_only=True)
    class SameTag(Halved):
        kind: ClassVar[str] = "same-tag-test"

    with pytest.raises(KvRowsError, match="two codec specs register the tag 99"):
        register_codec(SameTag)
    assert "same-tag-test" not in CODECS


# -- the array codecs of each implementation ------------------------------------------------


def _implementations() -> list[tuple[str, ModuleType]]:
    from kvrows.optimized import codecs as optimized_codecs
    from kvrows.reference import codecs as reference_codecs

    return [("reference", reference_codecs), ("optimized", optimized_codecs)]


@pytest.mark.parametrize("spec", EXAMPLES, ids=str)
def test_each_implementation_builds_the_codec_a_spec_names(spec: object) -> None:
    assert is_codec_spec(spec)
    for name, module in _implementations():
        # Every registered codec has an array codec in each implementation (the state
        # codec's came with recurrent's move onto the row machinery).
        assert set(module.IMPLEMENTATIONS) == set(CODECS), name
        codec = module.make_codec(spec)
        assert codec.spec == spec and codec.key == spec.key, name
        assert codec.defers_values == (spec.reads == "own"), name


def test_an_array_codec_checks_head_dims_through_its_spec() -> None:
    from kvrows.validation import KvGeometry

    for name, module in _implementations():
        module.make_codec(Plain()).check(KvGeometry(2, 48, 40, "float16"))
        with pytest.raises(InvalidInputError) as caught:
            module.make_codec(Turbo()).check(KvGeometry(2, 128, 96, "bfloat16"))
        assert str(caught.value) == (
            "value head dim 96: TurboQuant stores head dims (64, 128, 256, 512), got 96"
        ), name
        with pytest.raises(InvalidInputError, match=r"^key head dim 48: "):
            module.make_codec(Affine(bits=4, group_size=32)).check(KvGeometry(2, 48, 64, "float16"))


def test_a_kind_without_an_array_codec_is_refused(halved: type[Halved]) -> None:
    messages = {
        "reference": "the reference has no halved-test codec yet",
        "optimized": "the optimized implementation has no halved-test codec yet",
    }
    for name, module in _implementations():
        with pytest.raises(InvalidInputError) as caught:
            module.make_codec(Halved())
        assert str(caught.value) == messages[name]


def test_a_new_array_codec_module_plugs_in(halved: type[Halved]) -> None:
    for name, module in _implementations():
        before = dict(module.IMPLEMENTATIONS)
        try:

            @module.implements("halved-test")
            class HalvedCodec:
                def __init__(self, spec: Halved) -> None:
                    self.spec = spec

            assert isinstance(module.make_codec(Halved(step=4)), HalvedCodec), name
            with pytest.raises(KvRowsError, match=r"implement 'halved-test'"):
                module.implements("halved-test")(type("Other", (), {}))
        finally:
            module.IMPLEMENTATIONS.clear()
            module.IMPLEMENTATIONS.update(before)


def test_every_registered_array_codec_is_a_codec() -> None:
    from kvrows.codec import Codec

    for name, module in _implementations():
        for kind in module.IMPLEMENTATIONS:
            assert isinstance(module.make_codec(CODECS[kind]()), Codec), (name, kind)


@pytest.mark.parametrize("spec", EXAMPLES, ids=str)
@pytest.mark.parametrize("role", ["keys", "values"])
def test_the_twins_decode_the_same_planes_alike(spec: object, role: Role) -> None:
    import mlx.core as mx
    import numpy as np

    from kvrows.optimized.codecs import make_codec as optimized_codec
    from kvrows.reference.codecs import make_codec as reference_codec

    assert is_codec_spec(spec)
    block = np.random.default_rng(7).standard_normal((1, 2, 3, 128)).astype(np.float16)
    reference, optimized = reference_codec(spec), optimized_codec(spec)
    planes = reference.encode(block, role)
    for ours, theirs in zip(planes, optimized.encode(mx.array(block), role), strict=True):
        np.testing.assert_array_equal(ours, np.array(theirs))
    decoded = reference.decode(planes, role)
    twin = optimized.decode(tuple(mx.array(p) for p in planes), role)
    np.testing.assert_array_equal(decoded, np.array(twin.astype(mx.float32)).astype(decoded.dtype))
