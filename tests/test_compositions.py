"""The core's tables as data: schemes, the composition table, constructors, the contract page."""

from __future__ import annotations

import ast
import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import kvrows
import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows.app.classes import spec_page
from kvrows.codec import codec_plane_specs, codec_token_bytes
from kvrows.compositions import (
    COMPOSITIONS,
    SELF,
    bind_arguments,
    composition,
    landed,
    serial_for_peer,
    stage_presets,
)
from kvrows.errors import InvalidInputError
from kvrows.schemes import Affine, Growing, KvStorageScheme, Plain, Ring, Turbo
from kvrows.table import (
    is_batchable,
    owned_cache_layout,
    prefill_cache_layout,
    target_cache_layout,
    target_row_layout_factory,
)
from kvrows.validation import KvGeometry

ROOT = Path(__file__).resolve().parents[1]


# -- schemes -----------------------------------------------------------------------------


def test_schemes_are_frozen_keyword_only_and_validated() -> None:
    spec = Affine(bits=4, group_size=32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.bits = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        Affine(4, 32)  # type: ignore[call-arg]
    with pytest.raises(InvalidInputError, match="bits"):
        Affine(bits=7)
    with pytest.raises(InvalidInputError, match="group size"):
        Affine(group_size=48)
    with pytest.raises(InvalidInputError, match="k_bits"):
        Turbo(k_bits=3)
    with pytest.raises(InvalidInputError, match="v_bits"):
        Turbo(v_bits=6)
    with pytest.raises(InvalidInputError, match="max_size"):
        Ring(max_size=0)
    with pytest.raises(InvalidInputError, match="sink tokens"):
        Ring(max_size=8, keep=8)  # keep < max_size: the window needs a column


@pytest.mark.parametrize(
    ("text", "codec"),
    [
        ("plain", Plain()),
        ("affine", Affine()),  # a bare "affine" means the 8-bit default
        ("affine8", Affine(bits=8, group_size=64)),
        ("affine4", Affine(bits=4, group_size=64)),
        ("affine4:32", Affine(bits=4, group_size=32)),
        ("turbo-k8v3", Turbo(k_bits=8, v_bits=3)),
    ],
)
def test_scheme_names_parse_to_one_frozen_codec_spec(text: str, codec: object) -> None:
    scheme = KvStorageScheme.parse(text)
    assert scheme.codec == codec
    assert KvStorageScheme.parse(scheme.name).codec == codec  # the name round-trips


def test_per_layer_codecs_and_start() -> None:
    scheme = KvStorageScheme(codec=Affine(bits=8), layers=((0, Plain()),), quantized_kv_start=64)
    assert scheme.codec_for_layer(0) == Plain()
    assert scheme.codec_for_layer(3) == Affine(bits=8)
    assert scheme.name == "affine8:64,0=plain@64"
    with pytest.raises(InvalidInputError, match="two codecs"):
        KvStorageScheme(layers=((1, Plain()), (1, Affine())))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("affine8:64,0=plain@64", KvStorageScheme(
            codec=Affine(bits=8), layers=((0, Plain()),), quantized_kv_start=64)),
        ("affine4@0", KvStorageScheme(codec=Affine(bits=4), quantized_kv_start=0)),
        ("plain,2=affine4:32,5=affine8", KvStorageScheme(
            layers=((2, Affine(bits=4, group_size=32)), (5, Affine(bits=8))))),
    ],
)  # fmt: skip
def test_a_scheme_parses_from_its_name(text: str, expected: KvStorageScheme) -> None:
    scheme = KvStorageScheme.parse(text)
    assert scheme == expected
    assert KvStorageScheme.parse(scheme.name) == scheme  # every name round-trips


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("affine8@", "token count"),
        ("affine8@x", "token count"),
        ("affine8,plain", "<layer>=<codec>"),
        ("affine8,x=plain", "<layer>=<codec>"),  # a negative index is valid (issue 11)
        ("affine8,0=bf16", "unknown KV scheme"),
        ("affine8,0=plain,0=affine4", "two codecs"),
        *((text, "unknown KV scheme") for text in ("", "affinex", "turbo-k8", "bf16", "4bit")),
        ("affine9", "bits must be one of"),
        *((text, "unknown KV scheme") for text in ("turbo:", "turbo:k4", "turbo:k4v", "turbo:4:3")),
        *((text, "unknown KV scheme") for text in ("turbo-", "turbok8v3")),
        ("turbo:k3v3", "k_bits must be one of"),
        ("turbo:k8v1", "v_bits must be one of"),
        ("turbo-k8v6", "v_bits must be one of"),
    ],
)
def test_bad_scheme_texts_say_what_was_expected(text: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        KvStorageScheme.parse(text)


def test_codec_bytes_come_from_the_plane_specs() -> None:
    # plain: one plane of D values; affine: D*bits/32 uint32 words + a scale and a bias a group
    assert codec_token_bytes(Plain(), 2, 64, "bfloat16") == 2 * 64 * 2
    assert codec_token_bytes(Affine(bits=4, group_size=32), 2, 64, "float16") == 2 * (
        4 * (64 * 4 // 32) + 2 * 2 * (64 // 32)
    )
    names = [p.name for p in codec_plane_specs(Affine(), "keys", 128, "float16")]
    assert names == ["keys", "keys.scales", "keys.biases"]
    # turbo: keys and values are stored differently (the role)
    keys = codec_plane_specs(Turbo(), "keys", 128, "float16", "keys")
    values = codec_plane_specs(Turbo(), "values", 128, "float16", "values")
    assert [(p.name, p.dtype, p.width) for p in keys + values] == [
        ("keys", "int8", 128), ("keys.scales", "float16", 4), ("keys.zeros", "float16", 4),
        ("values", "uint8", 48), ("values.scales", "float16", 4),
    ]  # fmt: skip


def test_shapes_name_the_read_image_and_its_bytes() -> None:
    # The machinery's zeros and byte counts ask a storage's shapes for its tensors: a KV
    # geometry's keys and values, a latent's latent / rope / index (one head, rope and
    # index plain whatever the inner codec).
    from kvrows.codecs.latent import Latent, LatentShapes
    from kvrows.common import shapes_token_bytes
    from kvrows.reference.codecs import make_codec

    geometry = KvGeometry(heads=2, key_dim=64, value_dim=32, dtype="float16")
    assert geometry.tensors == ("keys", "values")
    assert geometry.tensor_image("values") == (2, 32, "float16")
    assert shapes_token_bytes(make_codec(Plain()), geometry) == 2 * (64 + 32) * 2
    shapes = LatentShapes(rank=512, rope=64, index=32, dtype="bfloat16")
    assert shapes.tensors == ("latent", "rope", "index")
    assert shapes.tensor_image("rope") == (1, 64, "bfloat16")
    for inner in (Plain(), Affine(bits=4, group_size=32)):
        spec = Latent(inner=inner, index_head_dim=32)
        assert shapes_token_bytes(make_codec(spec), shapes) == spec.token_bytes(shapes)


# -- the composition table ----------------------------------------------------------------


def test_the_table_names_every_seed_class_once() -> None:
    names = [c.name for c in COMPOSITIONS]
    # The seed's 26 classes, the three bf16-first legos (serial presets, delayed) and the
    # two paged rings (the paged placement under the ring geometry), the four presets of
    # the microscaling codecs, their three rings and the fourteen of the chunked geometry
    # (plain, affine, microscaling, paged, bf16-first; issue 25).
    assert len(names) == len(set(names)) == 54
    assert len(landed()) == 54
    assert len([c for c in COMPOSITIONS if not c.is_landed]) == 0
    for entry in COMPOSITIONS:
        if entry.serial is not None:
            assert composition(entry.serial).arrangement == "serial", entry.name
        for _, role in entry.roles.items() if entry.roles else ():
            if role != SELF:
                assert composition(role).is_layout, (entry.name, role)
                # a landed storage never hands its rows to a planned layout
                assert composition(role).is_landed or not entry.is_landed, (entry.name, role)


def test_constructor_arguments_bind_in_mlx_lm_order() -> None:
    ring = composition("RotatingQuantizedKVCache")
    assert bind_arguments(ring, (16, 32, 4), {}) == (
        Affine(bits=4, group_size=32),
        Ring(max_size=16),
        None,
    )
    assert bind_arguments(ring, (16,), {"bits": 4})[0] == Affine(bits=4, group_size=64)
    heads = KvGeometry(2, 64, 64, "float16")
    assert bind_arguments(composition("KVCache"), (), {"geometry": heads}) == (
        Plain(),
        Growing(),
        heads,
    )
    spec = Affine(bits=2, group_size=128)
    assert bind_arguments(composition("QuantizedKVCache"), (), {"codec": spec})[0] is spec
    window = Ring(max_size=4)
    assert bind_arguments(ring, (), {"codec": spec, "token_geometry": window}) == (
        spec,
        window,
        None,
    )


@pytest.mark.parametrize(
    ("name", "args", "kwargs", "message"),
    [
        ("RotatingKVCache", (), {}, "needs max_size"),
        ("KVCache", (1,), {}, "at most 0 positional"),
        ("QuantizedKVCache", (64,), {"group_size": 32}, "twice"),
        ("QuantizedKVCache", (), {"max_size": 8}, "no parameter max_size"),
        ("RotatingKVCache", (True,), {}, "integer"),
        ("RotatingKVCache", (8.0,), {}, "integer"),
        ("RotatingKVCache", (0,), {}, "max_size"),
        ("QuantizedKVCache", (), {"bits": 7}, "bits"),
        ("KVCache", (), {"codec": Affine()}, "stores the plain codec"),
        ("KVCache", (), {"token_geometry": Ring(max_size=4)}, "growing geometry"),
        ("KVCache", (), {"geometry": (2, 64, 64, "float16")}, "KvGeometry"),
        ("RotatingKVCache", (8,), {"token_geometry": Ring(max_size=4)}, "max_size twice"),
        ("QuantizedKVCache", (), {"codec": "affine"}, "cannot be built from"),
    ],
)
def test_bad_constructor_arguments_say_what_was_expected(
    name: str, args: tuple[object, ...], kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidInputError, match=message):
        bind_arguments(composition(name), args, kwargs)


def test_signatures_are_formatted_from_the_specs() -> None:
    affine, ring = Affine(bits=4, group_size=32), Ring(max_size=16)
    assert composition("QuantizedKVCache").signature_for(affine, Growing()) == "kv:quant:4:32"
    assert (
        composition("RotatingAffineLayout").signature_for(affine, ring)
        == "kv:rotating-affine:16:32:4"
    )
    assert composition("RaggedRotatingRows").signature_for(Plain(), ring) == (
        "kv:ragged-rotating:16"
    )


def test_mlx_lm_layers_map_to_one_serial_storage_per_codec() -> None:
    assert serial_for_peer("KVCache", Plain()).name == "KVCache"
    assert serial_for_peer("KVCache", Affine()).name == "QuantizedKVCache"
    assert serial_for_peer("RotatingKVCache", Plain()).name == "RotatingKVCache"
    assert serial_for_peer("RotatingKVCache", Affine()).name == "RotatingQuantizedKVCache"
    assert serial_for_peer("KVCache", Turbo()).name == "TurboQuantKVCache"
    with pytest.raises(InvalidInputError, match="turbo"):
        serial_for_peer("RotatingKVCache", Turbo())  # sliding layers stay plain rings
    with pytest.raises(InvalidInputError, match="ArraysCache"):
        serial_for_peer("ArraysCache", Plain())  # planned (issue 14), not landed


# -- the contract page --------------------------------------------------------------------


def _contract_rows() -> dict[str, list[str]]:
    text = (ROOT / "spec" / "contract.md").read_text()
    section = text[text.index("## 0.") : text.index("## 1.")]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        match = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def test_the_contract_page_shows_the_table_as_it_is() -> None:
    rows = _contract_rows()
    assert list(rows) == [c.name for c in COMPOSITIONS]  # same classes, lookup order
    for entry in COMPOSITIONS:
        codec, geometry, placement, arrangement, modifiers, roles, status = rows[entry.name]
        assert (codec, geometry, placement, arrangement) == (
            entry.codec, entry.geometry, entry.placement, entry.arrangement
        )  # fmt: skip
        assert modifiers == (", ".join(sorted(entry.modifiers)) or "—"), entry.name
        expected_roles = (
            "—"
            if entry.roles is None
            else " / ".join("own" if r == SELF else f"`{r}`" for _, r in entry.roles.items())
        )
        assert roles == expected_roles, entry.name
        assert status == ("landed" if entry.is_landed else f"issue {entry.issue}"), entry.name


def test_the_signature_table_matches_the_compositions() -> None:
    text = (ROOT / "spec" / "contract.md").read_text()
    section = text[text.index("## 5.") : text.index("## 6.")]
    documented = dict(re.findall(r"\| `(\w+)` \| `([^`]+)`", section))
    placeholders = {
        k: f"<{k}>"
        for k in (
            "bits",
            "group_size",
            "max_size",
            "keep",
            "start",
            "k_bits",
            "v_bits",
            "chunk_size",
        )
    }
    for entry in landed():
        assert documented[entry.name] == entry.signature.format(**placeholders), entry.name


# -- the package -----------------------------------------------------------------------------


def test_import_kvrows_exposes_the_contract() -> None:
    for name in (
        "owned_cache_layout",
        "publish_row",
        "row_admission",
        "BatchableCache",
        "KvRowsError",
        "Affine",
        "KvStorageScheme",
        "COMPOSITIONS",
        "lease_cache_states",
    ):
        assert name in kvrows.__all__ and hasattr(kvrows, name), name


def test_the_implementations_import_from_the_repository_root() -> None:
    # The checkout's kvrows/ folder must not shadow the installed subpackages.
    result = subprocess.run(
        [sys.executable, "-c", "import kvrows.optimized, kvrows.reference, kvrows.conformance"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


# -- both implementations against the table ----------------------------------------------

_EXAMPLE = {
    "max_size": 8,
    "keep": 0,
    "group_size": 32,
    "bits": 4,
    "start": 3,
    "k_bits": 4,
    "v_bits": 2,
    "chunk_size": 8,
}


def _instance(impl: ModuleType, name: str) -> Any:
    entry = composition(name)
    kwargs = {p: _EXAMPLE[p] for p in entry.params if p in _EXAMPLE}
    return getattr(impl, name)(**kwargs)


@pytest.mark.parametrize("impl", [optimized, reference], ids=["optimized", "reference"])
@pytest.mark.parametrize("name", [c.name for c in landed()])
def test_every_role_of_every_landed_class_is_the_one_the_table_names(
    impl: ModuleType, name: str
) -> None:
    entry = composition(name)
    cache = _instance(impl, name)
    assert type(cache) is getattr(impl, name)
    if "delayed" in entry.modifiers and not entry.is_layout:
        # A lego signs as its current stage's serial preset (plain while empty) and has no
        # row-layout entry: kvrows.maintenance puts it into its delayed layout.
        plain, converted = stage_presets(entry)
        assert cache.signature() == plain.signature.format(**_EXAMPLE)
        assert entry.signature == converted.signature and entry.roles is None
        assert not is_batchable(cache) and target_row_layout_factory(cache) is None
        return
    assert cache.signature() == entry.signature.format(**_EXAMPLE)
    assert is_batchable(cache) == entry.is_layout
    if entry.roles is None:
        # no entry: a decode layout serves as its own decode/prefill layout and has no verify
        assert entry.is_layout
        own: type = getattr(impl, name)
        assert type(owned_cache_layout(cache)) is own
        assert type(prefill_cache_layout(cache)) is own
        assert target_row_layout_factory(cache) is None
        return
    built: dict[str, Any] = {
        "decode": owned_cache_layout(cache),
        "prefill": prefill_cache_layout(cache),
        "verify": target_cache_layout(cache),
    }
    for role, target in entry.roles.items():
        layout = built[role]
        expected = type(cache) if target == SELF else getattr(impl, target)
        assert type(layout) is expected, (name, role)
        assert layout is not cache and layout.batch_size == 0, (name, role)
        # the layout carries the storage's codec and window parameters
        assert layout.signature() == composition(expected.__name__).signature.format(**_EXAMPLE)


def test_every_landed_class_is_driven_by_a_conformance_machine() -> None:
    from kvrows.conformance.families import FAMILIES

    layouts = {spec.name for fam in FAMILIES.values() for spec in fam.layouts}
    serials = {spec.serial or fam.serial for fam in FAMILIES.values() for spec in fam.layouts}
    assert layouts == {c.name for c in landed() if c.is_layout}
    # The legos are driven by their delayed layouts' machine (the solo replay of each row
    # is the lego of the layout's serial storage, ``conformance/delayed.py``).
    legos = {c.name for c in landed() if "delayed" in c.modifiers and not c.is_layout}
    assert legos == {spec.solo for fam in FAMILIES.values() for spec in fam.layouts} - {""}
    # a latent cache is its own serial storage (its family names it as its own serial)
    assert serials - layouts == {c.name for c in landed() if not c.is_layout} - legos


@pytest.mark.parametrize("implementation", [reference, optimized], ids=lambda m: m.__name__)
def test_the_classes_mypy_sees_are_the_classes_build_makes(implementation: ModuleType) -> None:
    """Each ``classes.py`` builds its public classes from the table and declares them to
    mypy under ``TYPE_CHECKING``: the declarations name exactly the built classes, each
    with the bases ``build`` gave it, and each class is where pickles look for it."""
    classes = implementation.classes
    tree = ast.parse(Path(classes.__file__).read_text())
    (block,) = (
        n for n in tree.body if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
    )
    declared = {
        node.name: [ast.unparse(base) for base in node.bases]
        for node in block.body
        if isinstance(node, ast.ClassDef)
    }
    # The module's own classes: building again would declare a second class per name.
    built = {e.name: getattr(classes, e.name) for e in classes.PRESETS}
    assert declared == {name: [b.__name__ for b in cls.__bases__] for name, cls in built.items()}
    for name, cls in built.items():
        assert getattr(implementation, name) is cls
        assert (cls.__module__, cls.__qualname__) == (classes.__name__, name)
        assert cls.composition is composition(name)
        assert f"``{spec_page(name)}``" in (cls.__doc__ or "")  # the page ``kvrows classes`` shows
