"""Prompt-cache files: lists of caches of either implementation, in mlx-lm's file format.

A file is a safetensors file (written by ``persist.files.write_atomic``: atomic, fsynced,
checksummed) laid out as mlx-lm 0.32.2's ``save_prompt_cache`` lays it out:

* arrays: ``"<layer>.<field>[.<plane>]"``, the flattened ``state`` of each cache (a
  scalar field becomes a 0-d array, ``None`` an empty one);
* metadata: ``"0.<key>"`` the user's metadata, ``"1.<layer>"`` each layer's class name,
  ``"2.0" = ""`` then ``"2.<n>.0"`` / ``"2.<n>.1"`` the array name and kind
  (``scalar`` / ``none``) of each non-array field;
* kvrows' own entries under the user prefix, so mlx-lm still parses the file:
  ``"0.kvrows"`` (JSON: format version and, per layer, the composition, signature, codec,
  token geometry and KV geometry) and ``"0.kvrows_checksum"``.

A file with ``"0.kvrows"`` must carry a matching ``"0.kvrows_checksum"``, and a metadata
key one bit away from either is damage, not an mlx-lm file's entry: so no single flipped
bit lets a kvrows file load unverified (``spec/persistence.md`` §3).

A bf16-first lego is saved as its current storage, its layer record adding ``lego``
(its class, codec, ``start``, ``minimum_reusable_offset``) so kvrows' loader wraps the
storage back into the lego; mlx-lm reads the storage.

So mlx-lm's ``load_prompt_cache`` reads kvrows' files of the classes it has (their class
names are mlx-lm's: ``kvrows.forms.FILE_CLASSES``) and kvrows' ``load_prompt_cache``
reads mlx-lm's files (without a checksum to check) as well as its own. mlx-lm's older
format (``meta_state`` strings) is read too. See ``spec/persistence.md``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kvrows import forms_v1
from kvrows.compositions import Composition, codec_spec_for, composition
from kvrows.conversion import check_target
from kvrows.errors import CorruptStateError, InvalidInputError, UnsupportedStateError
from kvrows.forms import (
    FILE_CLASSES,
    FORMAT_VERSION,
    state_form,
    written_form,
)
from kvrows.persist.files import CHECKSUM_KEY, checksum, read_safetensors, write_atomic
from kvrows.protocols import DropInWrapper, Handover
from kvrows.recurrent import StateShapes
from kvrows.validation import KvGeometry

__all__ = [
    "KVROWS_KEY",
    "load_prompt_cache",
    "restored_caches",
    "save_prompt_cache",
    "saved_arrays",
]

#: The metadata entry holding kvrows' description of the file's layers.
KVROWS_KEY = "0.kvrows"
_RESERVED = {KVROWS_KEY[2:], CHECKSUM_KEY[2:]}
_RESERVED_KEYS = (KVROWS_KEY, CHECKSUM_KEY)


def _one_bit_apart(key: str, reserved: str) -> bool:
    """Whether ``key``'s UTF-8 bytes differ from ``reserved``'s in exactly one bit."""
    found, wanted = key.encode(), reserved.encode()
    if len(found) != len(wanted):
        return False
    return sum((a ^ b).bit_count() for a, b in zip(found, wanted, strict=True)) == 1


def _damaged_reserved_key(metadata: Mapping[str, str]) -> tuple[str, str] | None:
    """A metadata key one flipped bit away from a kvrows key, and that key; else None.

    Such a key is what a flip in a reserved key's name leaves: taken at face value it
    would make a kvrows file pass for an mlx-lm one (no checksum asked) and land in the
    user's metadata. ``save_prompt_cache`` refuses these names, so kvrows never writes
    one; an mlx-lm file holding one is refused too (a cost of the guard)."""
    for key in metadata:
        for reserved in _RESERVED_KEYS:
            if _one_bit_apart(key, reserved):
                return key, reserved
    return None


Implementation = Literal["optimized", "reference"]


def _to_mx(value: Any) -> mx.array:
    if isinstance(value, mx.array):
        return value
    array = np.asarray(value)
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: MLX takes its bits
        return mx.array(array.view(np.uint16)).view(mx.bfloat16)
    return mx.array(array)


def _to_numpy(value: mx.array) -> Any:
    if value.dtype == mx.bfloat16:
        import ml_dtypes

        return np.array(value.view(mx.uint16)).view(ml_dtypes.bfloat16)
    return np.array(value)


def _layer_record(cache: Any) -> dict[str, Any]:
    geometry: KvGeometry | None = cache.geometry
    return {
        "class": type(cache).__name__,
        "composition": cache.composition.name,
        "signature": cache.signature(),
        "codec": {"kind": cache.codec_spec.kind, **cache.codec_spec.parameters()},
        "token_geometry": {
            "kind": cache.token_geometry.kind,
            **cache.token_geometry.parameters(),
        },
        "kv": None if geometry is None else vars(geometry).copy(),
        "form": written_form(cache.composition),
    }


def _lego_record(lego: Any) -> dict[str, Any]:
    """What wraps a saved storage back into its lego: the class, the codec it converts to,
    ``start`` and the recorded conversion point."""
    return {
        "class": type(lego).__name__,
        **lego.quantization.parameters(),
        "start": lego.start,
        "minimum_reusable_offset": lego.minimum_reusable_offset,
    }


def _as_lego(storage: Any, saved: object, implementation: Implementation, path: object) -> Any:
    """``storage`` wrapped as the lego ``saved`` describes (``_lego_record``), of
    ``implementation``'s lego class of that name."""
    package = importlib.import_module(f"kvrows.{implementation}")
    name = saved.get("class") if isinstance(saved, dict) else None
    cls: Any = getattr(package, name, None) if isinstance(name, str) else None
    entry = getattr(cls, "composition", None)
    # A lego: the delayed modifier on a serial preset of the table.
    if not (
        isinstance(entry, Composition) and "delayed" in entry.modifiers and not entry.is_layout
    ):
        raise UnsupportedStateError(f"{path}: unknown lego class {name!r} in saved state")
    assert isinstance(saved, dict)
    try:
        # The record holds the target codec's parameters; the lego class says which codec
        # (affine or TurboQuant) they belong to.
        quantization = check_target(
            cls.__name__, codec_spec_for(cls.composition, saved), storage.token_geometry
        )
        # The saved parameters, then the storage adopted.
        lego = cls.from_parts(
            quantization, storage.token_geometry, saved["start"], storage.geometry
        )
        return lego.composed.over(storage, minimum_reusable_offset=saved["minimum_reusable_offset"])
    except (InvalidInputError, KeyError, TypeError) as error:
        raise CorruptStateError(
            f"{path}: the lego record {saved} does not fit its {type(storage).__name__}: {error}"
        ) from None


def save_prompt_cache(
    path: str | os.PathLike[str],
    caches: Sequence[Any],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``caches`` (one per layer; storages, legos or layouts of either
    implementation; a model's drop-in as the cache behind it) to ``path``, atomically.
    Nothing is written if any cache or metadata entry is refused. A lego is saved as its
    current storage (mlx-lm reads that) plus a ``lego`` record that kvrows' loader wraps it
    back with."""
    write_atomic(path, *saved_arrays(caches, metadata))


def saved_arrays(
    caches: Sequence[Any], metadata: Mapping[str, str] | None = None
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and metadata a prompt-cache file of ``caches`` holds (without the
    checksum, which the writer adds): what :func:`save_prompt_cache` writes and a
    transfer sends (``kvrows.persist.transfer``). The arrays are the caches' own planes,
    encoded as stored; refused as :func:`save_prompt_cache` refuses."""
    if isinstance(caches, str | bytes) or not isinstance(caches, Sequence):
        raise InvalidInputError("save_prompt_cache takes a list of caches, one per layer")
    user = dict(metadata or {})
    for key, value in user.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidInputError(f"metadata must map str to str, got {key!r}: {value!r}")
        if key in _RESERVED or "." in key or _damaged_reserved_key({f"0.{key}": ""}):
            raise InvalidInputError(
                f"metadata key {key!r} is reserved, one bit from a reserved key, or contains "
                "'.' (kvrows uses 'kvrows' and 'kvrows_checksum')"
            )
    layers, classes, states = [], [], []
    for index, layer in enumerate(caches):
        # A model's drop-in (an MLA layer's pair) is saved as the cache behind it.
        if isinstance(layer, DropInWrapper):
            layer = layer.wrapped
        # A lego is saved as its current storage plus what makes it a lego (its record).
        cache = layer.storage if isinstance(layer, Handover) else layer
        entry = getattr(cache, "composition", None)
        if entry is None:
            raise InvalidInputError(
                f"layer {index}: {type(cache).__name__} is not a kvrows cache; "
                "use mlx-lm's save_prompt_cache for mlx-lm's classes"
            )
        form = state_form(entry)  # UnsupportedStateError for a class without a form
        layers.append(_layer_record(cache))
        if isinstance(layer, Handover):
            layers[-1]["lego"] = _lego_record(layer)
        classes.append(form.file_class)
        states.append(cache.state)
    arrays: dict[str, mx.array] = {}
    scalars: list[Any] = [""]
    flattened = cast(list[tuple[str, Any]], tree_flatten(states))
    for name, value in flattened:
        if value is None:
            scalars.append((name, "none"))
            arrays[name] = mx.array([])
        elif isinstance(value, bool | int | float):
            scalars.append((name, "scalar"))
            arrays[name] = mx.array(value)
        else:
            arrays[name] = _to_mx(value)
    description = {"format": FORMAT_VERSION, "layers": layers}
    flat = dict(tree_flatten([{**user, "kvrows": json.dumps(description)}, classes, scalars]))
    return arrays, {key: str(value) for key, value in flat.items()}


def _grouped(metadata: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Flattened metadata split into its three top-level groups (``"0"``, ``"1"``, ``"2"``)."""
    groups: dict[str, dict[str, str]] = {"0": {}, "1": {}, "2": {}}
    for key, value in metadata.items():
        head, _, tail = key.partition(".")
        if head not in groups or not tail:
            raise CorruptStateError(f"unexpected metadata entry {key!r}")
        groups[head][tail] = value
    return groups


def _listed(group: Mapping[str, str], what: str) -> list[str]:
    if sorted(group, key=lambda k: int(k) if k.isdigit() else -1) != [
        str(i) for i in range(len(group))
    ]:
        raise CorruptStateError(f"{what} entries are not a list: {sorted(group)}")
    return [group[str(i)] for i in range(len(group))]


def _nested(items: Mapping[str, Any]) -> list[Any]:
    """Arrays named ``"<layer>.<field>[.<plane>]"`` as per-layer nested lists."""
    root: dict[str, Any] = {}
    for name, value in items.items():
        node = root
        parts = name.split(".")
        if not all(p.isdigit() for p in parts):
            raise CorruptStateError(f"unexpected array name {name!r}")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise CorruptStateError(f"array name {name!r} clashes with another")
        node[parts[-1]] = value

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        count = len(node)
        if sorted(node, key=int) != [str(i) for i in range(count)]:
            raise CorruptStateError(f"array names are not a dense list: {sorted(node)}")
        return tuple(build(node[str(i)]) for i in range(count))

    return list(build(root)) if root else []


def _implementation_classes(implementation: Implementation) -> Mapping[str, type[Any]]:
    if implementation == "optimized":
        from kvrows.optimized import declared_classes as optimized_classes

        return optimized_classes()
    if implementation == "reference":
        from kvrows.reference import declared_classes

        return declared_classes()
    raise InvalidInputError(
        f"implementation must be 'optimized' or 'reference', got {implementation!r}"
    )


def load_prompt_cache(
    path: str | os.PathLike[str],
    *,
    return_metadata: bool = False,
    implementation: Implementation = "optimized",
    require_checksum: bool = False,
) -> Any:
    """The caches saved in ``path`` (kvrows' files and mlx-lm's), as ``implementation``'s
    classes; with ``return_metadata``, ``(caches, user_metadata)``. A kvrows file is
    checksummed (mlx-lm's files carry no checksum: only their structure is checked); a
    file with kvrows' description but no checksum, or a metadata key one bit from a kvrows
    key, is corrupt. ``require_checksum`` refuses a file without a checksum (mlx-lm's
    too). Any problem raises ``CorruptStateError`` / ``UnsupportedStateError``
    (``StateReadError`` when the file cannot be read) and nothing is returned."""
    _implementation_classes(implementation)  # refused before the file is read
    if not isinstance(require_checksum, bool):
        raise InvalidInputError(f"require_checksum must be a bool, got {require_checksum!r}")
    arrays, metadata = read_safetensors(path)
    _verify(path, arrays, metadata, require_checksum)
    caches, user = restored_caches(arrays, metadata, implementation=implementation, source=path)
    return (caches, user) if return_metadata else caches


def restored_caches(
    arrays: dict[str, mx.array],
    metadata: Mapping[str, str],
    *,
    implementation: Implementation = "optimized",
    source: object = "saved state",
    pools: Sequence[Any] | None = None,
) -> tuple[list[Any], dict[str, str]]:
    """The caches (``implementation``'s classes) and user metadata that ``arrays`` and
    ``metadata`` describe, as :func:`saved_arrays` made them or a file holds them (checked
    already: the checksum is the reader's business). ``source`` names them in errors.
    ``pools``: per layer, a block pool a paged layer's positions are written into (``None``,
    or no ``pools``: a pool of its own; a state of several rows of as many layers each, a
    row transfer, uses them for every row); a pool is refused for a layer that is not
    paged.
    Takes ownership of ``arrays`` (its scalar entries are replaced)."""
    classes_by_name = _implementation_classes(implementation)
    path = source
    try:
        groups = _grouped(metadata)
        legacy = groups["2"].get("0") != ""
        if legacy:  # mlx-lm's older layout: meta_states, user metadata, class names
            meta_list: list[Any] = _nested(groups["0"])
            user, class_names = dict(groups["1"]), _listed(groups["2"], "class")
        else:
            user, class_names = dict(groups["0"]), _listed(groups["1"], "class")
            meta_list = [None] * len(class_names)
    except CorruptStateError as error:
        raise CorruptStateError(f"{path}: {error}") from None
    description = None
    if "kvrows" in user:
        try:
            description = json.loads(user.pop("kvrows"))
        except json.JSONDecodeError as error:
            raise CorruptStateError(f"{path}: unreadable kvrows metadata ({error})") from None
        version = description.get("format") if isinstance(description, dict) else None
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise UnsupportedStateError(
                f"{path}: kvrows state format {version!r}; this kvrows reads up to "
                f"{FORMAT_VERSION}: upgrade kvrows"
            )
    user.pop(CHECKSUM_KEY[2:], None)
    if not legacy:
        for key, kind in _scalar_entries(groups["2"]):
            if key not in arrays:
                raise CorruptStateError(f"{path}: scalar entry {key!r} names no array")
            if kind == "none":
                arrays[key] = None  # type: ignore[assignment]
            elif kind == "scalar":
                arrays[key] = arrays[key].item()  # type: ignore[assignment]
            else:
                raise CorruptStateError(f"{path}: unknown scalar kind {kind!r}")
    states = _nested(arrays)
    if len(states) != len(class_names):
        raise CorruptStateError(
            f"{path}: {len(class_names)} layer classes but {len(states)} layer states"
        )
    layers = description.get("layers") if description else [None] * len(class_names)
    if description and not (
        isinstance(layers, list)
        and all(
            isinstance(record, dict) and isinstance(record.get("token_geometry", {}), dict)
            for record in layers
        )
    ):
        # Only a file written with a valid checksum gets here: a damaged one is refused.
        raise CorruptStateError(f"{path}: kvrows metadata's layers are not a list of records")
    if len(layers) != len(class_names):
        raise CorruptStateError(f"{path}: kvrows metadata describes {len(layers)} layers")
    for index, record in enumerate(layers):
        if record is None:
            continue
        try:  # every layer's form is one this kvrows reads, before any layer is restored
            forms_v1.form_version(record)
        except (CorruptStateError, UnsupportedStateError) as error:
            raise type(error)(f"{path}: layer {index}: {error}") from None
    if pools is not None and (not pools or len(class_names) % len(pools)):
        raise InvalidInputError(
            f"{path}: {len(pools)} pools given for {len(class_names)} layers (one per layer "
            "of a row)"
        )
    each = [None] * len(layers) if pools is None else list(pools) * (len(layers) // len(pools))
    caches = [
        _restore(classes_by_name, name, state, meta, record, implementation, path, pool)
        for name, state, meta, record, pool in zip(
            class_names, states, meta_list, layers, each, strict=True
        )
    ]
    return caches, user


def _verify(
    path: object, arrays: Mapping[str, mx.array], metadata: Mapping[str, str], required: bool
) -> None:
    """Refuse (``CorruptStateError``) a file whose checksum is missing where it must be
    present, or does not match; see the module's docstring."""
    damaged = _damaged_reserved_key(metadata)
    if damaged is not None:
        raise CorruptStateError(
            f"{path}: metadata key {damaged[0]!r} is one bit from kvrows' {damaged[1]!r}: "
            "a kvrows file with a damaged key"
        )
    recorded = metadata.get(CHECKSUM_KEY)
    if recorded is None:
        if KVROWS_KEY in metadata:
            raise CorruptStateError(
                f"{path}: kvrows metadata ({KVROWS_KEY!r}) without its checksum "
                f"({CHECKSUM_KEY!r}): the file is damaged or was edited"
            )
        if required:
            raise CorruptStateError(
                f"{path}: no checksum ({CHECKSUM_KEY!r}): not a file kvrows wrote, or damaged"
            )
        return
    try:
        actual = checksum(arrays, metadata)
    except InvalidInputError:  # an array of a dtype kvrows never writes (float64)
        actual = None
    if actual != recorded:
        raise CorruptStateError(f"{path}: checksum mismatch: the file is corrupt or was altered")


def _scalar_entries(group: Mapping[str, str]) -> list[tuple[str, str]]:
    entries = []
    index = 1
    while f"{index}.0" in group:
        entries.append((group[f"{index}.0"], group.get(f"{index}.1", "")))
        index += 1
    return entries


def _restore(
    classes_by_name: Mapping[str, type[Any]],
    file_class: str,
    state: Any,
    meta_state: Any,
    record: Mapping[str, Any] | None,
    implementation: Implementation,
    path: object,
    pool: Any = None,
) -> Any:
    if record is not None:
        name = record.get("composition")
        keep = record.get("token_geometry", {}).get("keep", 0)
    else:
        name = FILE_CLASSES.get(file_class)
        keep = 0
        if name is None:
            raise UnsupportedStateError(
                f"{path}: kvrows cannot load mlx-lm's {file_class} (no kvrows storage for it)"
            )
    if not isinstance(name, str) or name not in classes_by_name:
        try:
            composition(str(name))
        except KeyError:
            raise UnsupportedStateError(f"{path}: unknown class {name!r} in saved state") from None
        raise UnsupportedStateError(
            f"{path}: {name} is not landed in the {implementation} implementation"
        )
    cls = _drop_in(classes_by_name[name], record.get("class") if record else file_class)
    # A class that restores into a given pool says so: its ``from_state`` takes ``pool``.
    if pool is not None and "pool" not in inspect.signature(cls.from_state).parameters:
        raise InvalidInputError(f"{path}: a block pool given for a {name} layer, not a paged one")
    if state_form(cls.composition).file_class != file_class:
        raise CorruptStateError(
            f"{path}: layer class {file_class!r} does not match kvrows' {name} form"
        )
    if implementation == "reference":
        state = _map_arrays(state, _to_numpy)
    try:
        kv = record.get("kv") if record is not None else None
        geometry: Any = None
        if isinstance(kv, dict):
            if "planes" in kv:  # recurrent state
                geometry = StateShapes.from_record(kv)
            elif "conv_shape" in kv:  # version 1's two-plane recurrent record
                geometry = forms_v1.state_shapes(kv)
            else:
                geometry = KvGeometry(**kv)
        # A pool: the positions are written into its blocks (the receiver's pool).
        into = {} if pool is None else {"pool": pool}
        restored = cls.from_state(state, meta_state, keep=keep, geometry=geometry, **into)
    except (InvalidInputError, TypeError, KeyError) as error:
        raise CorruptStateError(f"{path}: {file_class} state is inconsistent: {error}") from None
    if record is not None and restored.signature() != record.get("signature"):
        raise CorruptStateError(
            f"{path}: restored {restored.signature()} but the file says {record.get('signature')}"
        )
    if record is not None and "lego" in record:
        return _as_lego(restored, record["lego"], implementation, path)
    return restored


def _drop_in(cls: type[Any], class_name: object) -> type[Any]:
    """The composition's class, or the drop-in subclass the file names (mlx-lm's
    ``BatchKVCache`` / ``BatchRotatingKVCache``) when the implementation has it."""
    if not isinstance(class_name, str) or class_name == cls.__name__:
        return cls
    module = sys.modules.get(cls.__module__.rsplit(".", 1)[0])
    candidate = getattr(module, class_name, None)
    if isinstance(candidate, type) and issubclass(candidate, cls):
        return candidate
    return cls


def _map_arrays(tree: Any, function: Any) -> Any:
    if isinstance(tree, tuple | list):
        return tuple(_map_arrays(item, function) for item in tree)
    return function(tree) if isinstance(tree, mx.array) else tree
