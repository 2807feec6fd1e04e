"""The geometry registry (``kvrows.geometries``, contract §0.3): each token-geometry kind is
one spec module that registers itself, and building a preset's geometry from its
parameters, the saved-state forms and the bf16-first checks go through the registry and
the spec's members, so a geometry added as a new module plugs into all of them without an
edit elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any, ClassVar, cast

import numpy as np
import pytest

from kvrows.compositions import Composition, bind_arguments, composition
from kvrows.errors import InvalidInputError, KvRowsError, UnsupportedStateError
from kvrows.forms import (
    DELAYED_RECORD,
    delayed_state,
    geometry_from_fields,
    parse_delayed_state,
    rows_of_state,
    state_form,
)
from kvrows.geometries import (
    GEOMETRIES,
    GeometrySpec,
    Growing,
    Ring,
    geometry_class,
    is_geometry_spec,
    register_geometry,
)
from kvrows.geometries.registry import SpecParts
from kvrows.schemes import Affine, Plain
from kvrows.schemes import Ring as SchemesRing

EXAMPLES: tuple[GeometrySpec, ...] = (
    Growing(),
    Ring(max_size=8),
    Ring(max_size=5, keep=2),
)


def test_the_kinds_are_registered_in_kind_order() -> None:
    assert list(GEOMETRIES) == ["chunked", "growing", "recurrent", "ring"]
    assert geometry_class("ring") is Ring
    assert SchemesRing is Ring  # kvrows.schemes re-exports the specs


def test_an_unknown_kind_names_the_registered_ones() -> None:
    with pytest.raises(InvalidInputError) as caught:
        geometry_class("banded")
    assert str(caught.value) == (
        "no token geometry of kind 'banded': expected one of "
        "('chunked', 'growing', 'recurrent', 'ring')"
    )


@pytest.mark.parametrize("spec", EXAMPLES, ids=repr)
def test_the_parameters_round_trip(spec: GeometrySpec) -> None:
    assert is_geometry_spec(spec)
    assert type(spec).from_parameters(spec.parameters()) == spec
    assert type(spec).from_fields(spec.parameters()) == spec


def test_the_members_say_what_each_geometry_keeps() -> None:
    assert (Growing().parameters(), Growing().cap()) == ({}, None)
    ring = Ring(max_size=5, keep=2)
    assert (ring.parameters(), ring.cap()) == ({"max_size": 5, "keep": 2}, 5)
    assert (Growing.token_axis, Ring.token_axis) == (True, True)
    assert (Growing.wraps, Ring.wraps) == (False, True)
    # spec/persistence.md: mlx-lm's KVCache / RotatingKVCache / BatchKVCache /
    # BatchRotatingKVCache state after keys, values; the batch ring has no keep.
    assert Growing.serial_fields == ("offset",)
    assert Ring.serial_fields == ("offset", "keep", "max_size", "idx")
    assert Growing.layout_fields == ("offset", "left_padding", "idx")
    assert Ring.layout_fields == (
        "offset", "left_padding", "max_size", "total", "idx", "rotated",
    )  # fmt: skip
    assert (Growing.layout_form_omits, Ring.layout_form_omits) == ((), ("keep",))


def test_a_saved_ring_s_keep_comes_from_its_fields_or_from_outside() -> None:
    ring = composition("RotatingKVCache")
    assert geometry_from_fields(ring, {"max_size": 6, "keep": 2}) == Ring(max_size=6, keep=2)
    layout = composition("RaggedRotatingRows")
    assert geometry_from_fields(layout, {"max_size": 6}, keep=3) == Ring(max_size=6, keep=3)
    assert geometry_from_fields(layout, {"max_size": 6}) == Ring(max_size=6)
    assert geometry_from_fields(composition("KVCache"), {"offset": 4}, keep=3) == Growing()


def test_a_geometry_without_a_spec_has_no_generic_form() -> None:
    # Paging is a placement (contract §0.4): a paged entry's geometry is a registered one.
    assert geometry_from_fields(composition("PagedKVCache"), {}) == Growing()
    unknown = replace(composition("KVCache"), geometry=cast(Any, "banded"))
    with pytest.raises(UnsupportedStateError, match="has no banded geometry spec"):
        geometry_from_fields(unknown, {})


def test_only_a_registered_spec_is_a_geometry_spec() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Lookalike(Ring):
        pass

    assert not is_geometry_spec(Lookalike(max_size=4))
    assert not is_geometry_spec("ring")
    assert not is_geometry_spec(Ring)
    assert not is_geometry_spec(Plain())


def test_a_preset_refuses_an_unregistered_geometry() -> None:
    @dataclass(frozen=True, kw_only=True)
    class Lookalike(Ring):
        pass

    with pytest.raises(InvalidInputError, match="RotatingKVCache cannot be built from"):
        bind_arguments(
            composition("RotatingKVCache"), (), {"token_geometry": Lookalike(max_size=4)}
        )


# -- a geometry added as a module -------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Strided(SpecParts):
    """A toy geometry (not registered by the package): a window of ``span`` positions that
    does not wrap, saved with its span."""

    span: int = 4
    kind: ClassVar[str] = "strided-test"
    serial_fields: ClassVar[tuple[str, ...]] = ("offset", "span")
    layout_fields: ClassVar[tuple[str, ...]] = ("offset", "left_padding", "idx", "span")

    def cap(self) -> int:
        return self.span


#: Presets of the toy geometry (as a composition table entry would name them).
STRIDED_SERIAL = Composition(
    name="StridedKVCache", codec="plain", geometry="strided-test",  # type: ignore[arg-type]
    arrangement="serial", signature="kv:strided:{span}", params=("span",),
)  # fmt: skip
STRIDED_LAYOUT = Composition(
    name="BatchedStridedCache", codec="affine", geometry="strided-test",  # type: ignore[arg-type]
    arrangement="ragged", signature="kv:batched-strided:{span}:{bits}",
    params=("span", "group_size", "bits"), serial="StridedKVCache",
)  # fmt: skip


@pytest.fixture
def strided() -> Iterator[type[Strided]]:
    before = dict(GEOMETRIES)
    register_geometry(Strided)
    try:
        yield Strided
    finally:
        GEOMETRIES.clear()
        GEOMETRIES.update(before)


def test_a_new_geometry_module_plugs_in(strided: type[Strided]) -> None:
    spec = Strided(span=6)
    assert list(GEOMETRIES) == ["chunked", "growing", "recurrent", "ring", "strided-test"]
    assert is_geometry_spec(spec)
    # A preset builds it from its parameters, or takes it as a spec.
    assert bind_arguments(STRIDED_SERIAL, (6,), {}) == (Plain(), spec, None)
    assert bind_arguments(STRIDED_SERIAL, (), {"token_geometry": spec})[1] == spec
    assert STRIDED_SERIAL.signature_for(Plain(), spec) == "kv:strided:6"
    codec, built, _ = bind_arguments(STRIDED_LAYOUT, (6, 32, 4), {})
    assert (codec, built) == (Affine(bits=4, group_size=32), spec)
    # Its saved forms: the planes, its fields, the codec's tail.
    assert state_form(STRIDED_SERIAL).fields == ("keys", "values", "offset", "span")
    assert state_form(STRIDED_LAYOUT).fields == (
        "keys", "values", "offset", "left_padding", "idx", "span", "group_size", "bits",
    )  # fmt: skip
    assert geometry_from_fields(STRIDED_SERIAL, {"offset": 3, "span": 6}) == spec


def test_a_new_geometry_s_defaults_are_its_own(strided: type[Strided]) -> None:
    # A preset left without the parameter takes the spec's default (span 4), as a ring's
    # keep defaults to 0 and affine's bits to 8.
    assert bind_arguments(STRIDED_SERIAL, (), {})[1] == Strided(span=4)
    codec, built, _ = bind_arguments(STRIDED_LAYOUT, (), {"span": 5})
    assert (codec, built) == (Affine(bits=8, group_size=64), Strided(span=5))
    assert bind_arguments(composition("RotatingKVCache"), (6,), {})[1] == Ring(max_size=6)
    with pytest.raises(InvalidInputError, match="RotatingKVCache needs max_size"):
        bind_arguments(composition("RotatingKVCache"), (), {})


def test_a_new_geometry_s_saved_rows_are_read_as_growing_ones(strided: type[Strided]) -> None:
    # It does not wrap: a layout's row b holds columns [left_padding[b], idx).
    keys = np.array([[[[1.0], [2.0], [3.0]]], [[[0.0], [4.0], [5.0]]]])  # [B, H, T, D]
    values = {
        "keys": keys,
        "values": -keys,
        "offset": [3, 2],
        "left_padding": [0, 1],
        "idx": 3,
        "span": 6,
    }
    rows = rows_of_state(STRIDED_LAYOUT, values, concat=np.concatenate)
    held = [(k[0][0, 0, :, 0].tolist(), v[0][0, 0, :, 0].tolist(), t) for k, v, t in rows]  # type: ignore[index]
    assert held == [([1.0, 2.0, 3.0], [-1.0, -2.0, -3.0], 3), ([4.0, 5.0], [-4.0, -5.0], 2)]


def test_a_kind_registers_once(strided: type[Strided]) -> None:
    register_geometry(Strided)  # the same class again: nothing changes
    assert list(GEOMETRIES).count("strided-test") == 1

    @dataclass(frozen=True, kw_only=True)
    class Twin(Strided):
        pass

    with pytest.raises(KvRowsError, match="two geometry specs register the kind 'strided-test'"):
        register_geometry(Twin)


# -- the delayed form carries what a layout form omits ----------------------------------------


def test_a_delayed_ring_form_carries_keep_and_no_pads() -> None:
    entry = composition("DelayedRotatingQuantizedKVCache")
    fields = state_form(entry).fields
    assert fields[4:11] == (*Ring.layout_fields, *Ring.layout_form_omits)
    assert fields[-5:] == DELAYED_RECORD
    empty: tuple[Any, ...] = (None, None, [], [], 6, 0, 0, False)  # each stage's empty ragged ring
    record = {
        "start": 4, "converted_at": [], "left_pad": [], "prefilling": False, "composed": False,
    }  # fmt: skip
    parameters = {"max_size": 6, "keep": 1, "group_size": 32, "bits": 4}
    state = delayed_state(entry, (empty, (*empty, 32, 4)), record, parameters, list)
    assert state == (None, None, None, None, [], [], 6, 0, 0, False, 1, 32, 4, 4, [], [], False, False)  # fmt: skip
    assert parse_delayed_state(entry, state).record == {**record, "keep": 1}
    with pytest.raises(InvalidInputError, match="a ring keeps no position record"):
        parse_delayed_state(entry, (*state[:-3], [0], False, False))


def test_a_delayed_full_attention_form_has_no_keep() -> None:
    entry = composition("DelayedQuantizedKVCache")
    assert state_form(entry).fields[4:] == (
        *Growing.layout_fields,
        "group_size",
        "bits",
        *DELAYED_RECORD,
    )
    with pytest.raises(
        InvalidInputError, match=r"14 fields \(each stage's planes, .*'composed'\)\), got 1"
    ):
        parse_delayed_state(entry, (0,))
