"""What the state machines drive: implementations, storage families and their layouts.

An :class:`Impl` is one implementation of the contract (the NumPy reference,
the MLX optimized one, or a mutant of it in the teeth tests): classes are
resolved by name, as both implementations mirror each other's names, and a
mutant is the same table with one class replaced.

A :class:`Family` is a set of (serial storage, layout) pairs the machines are generated
from: its serial class, its layouts (each with the operations it supports), its
tolerance key, its mlx-lm peers and its machine. :func:`derive` builds every family
from the composition table (``kvrows.compositions.COMPOSITIONS``: codec kind, geometry
kind, arrangement, modifiers, parity) and the per-axis hook tables of
``conformance.hooks``; :data:`BUDGETS` adds what the table does not say (a description,
notes, the share of the profile a family runs). A new codec or geometry gets its family
by a hook-table row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from kvrows.codecs import CODECS
from kvrows.compositions import SELF, Composition, landed, layouts_of, stage_presets
from kvrows.conformance.arrays import from_mlx, to_mlx
from kvrows.conformance.hooks import (
    CODEC_HOOKS,
    DEFER,
    GEOMETRY_HOOKS,
    MODIFIER_RULES,
    PLACEMENT_HOOKS,
    WRITERS,
    Draw,
    GeometryHooks,
    Loader,
    ModifierRules,
    PeerChoice,
    PeerLoader,
    PeerSpec,
    WriterHooks,
    compose,
)

Planes = tuple[Any, ...]

__all__ = [
    "BUDGETS",
    "CONSTRUCTORS",
    "FAMILIES",
    "Budget",
    "Family",
    "Impl",
    "LayoutSpec",
    "PeerSpec",
    "derive",
    "family",
    "optimized_impl",
    "reference_impl",
]


@dataclass(frozen=True)
class Impl:
    """One implementation: its classes by name, its attention, and its array conversions."""

    name: str
    classes: Mapping[str, type]
    attend: Callable[[Any, Any, Any, float], Any]
    to_native: Callable[[npt.NDArray[Any]], Any]
    to_numpy: Callable[[Any], npt.NDArray[Any]]

    def cls(self, name: str) -> type:
        try:
            return self.classes[name]
        except KeyError:
            raise KeyError(f"{self.name} has no class {name!r}") from None

    def new(self, name: str) -> Any:
        return self.cls(name)()

    def with_classes(self, classes: Mapping[str, type], name: str | None = None) -> Impl:
        """This implementation with some classes replaced (a mutant, for the teeth tests)."""
        merged = dict(self.classes)
        merged.update(classes)
        return replace(self, name=name or self.name, classes=MappingProxyType(merged))


def _numpy_identity(array: npt.NDArray[Any]) -> npt.NDArray[Any]:
    if not isinstance(array, np.ndarray):
        raise TypeError(f"the reference returned {type(array).__name__}, not a NumPy array")
    return array


def _mlx_to_numpy(array: Any) -> npt.NDArray[Any]:
    if not isinstance(array, mx.array):
        raise TypeError(f"the optimized implementation returned {type(array).__name__}")
    return from_mlx(array)


#: Every landed class of the composition table, by name: (takes a ring window, takes an
#: affine codec). Constructors: ``Cls()``, ``Cls(max_size)``, ``Cls(group_size, bits)`` or
#: ``Cls(max_size, group_size, bits)`` (the table's ``params`` order).
CONSTRUCTORS: dict[str, tuple[bool, bool]] = {
    entry.name: ("max_size" in entry.params, "group_size" in entry.params) for entry in landed()
}


def _classes(module: Any) -> Mapping[str, type]:
    return MappingProxyType({name: getattr(module, name) for name in CONSTRUCTORS})


def reference_impl() -> Impl:
    """``kvrows.reference``: NumPy arrays in, NumPy arrays out."""
    import kvrows.reference as reference

    return Impl(
        name="reference",
        classes=_classes(reference),
        attend=reference.attend,
        to_native=lambda array: np.array(array, copy=True),
        to_numpy=_numpy_identity,
    )


def optimized_impl() -> Impl:
    """``kvrows.optimized``: MLX arrays (converted exactly from the NumPy data)."""
    import kvrows.optimized as optimized

    return Impl(
        name="optimized",
        classes=_classes(optimized),
        attend=optimized.attend,
        to_native=to_mlx,
        to_numpy=_mlx_to_numpy,
    )


@dataclass(frozen=True)
class LayoutSpec:
    """One row layout of a family and what its machine may do with it.

    ``roles``: the row-layout table roles in which the serial storage's rows land here.
    ``shared_column``: rows share one write column (decode layout, mlx-lm
    ``BatchKVCache`` parity); otherwise rows are ragged (prefill/verify).
    ``trim_rows``: the layout has per-row rollback ``trim_rows(counts)``.
    ``peer``: mlx-lm mirrors this layout with the family's ``PeerSpec.batch``;
    ``serial_peer``: the serial caches have mlx-lm twins (``PeerSpec.serial``).
    ``serial`` / ``tolerance_key``: when not the family's (a family of two codecs).
    ``siblings``: other layouts whose rows this one merges (side sources of a merge).
    ``draw``: how its examples draw their geometry (the codec's and geometry's hook rows).
    ``machine`` / ``peer_spec``: this layout's machine base and mlx-lm peer when not the
    family's (a family over several storages: the speculative family).
    ``solo``: the serial preset each row is replayed alone in (a delayed layout's lego,
    ``conformance/delayed.py``), driven by this layout's machine too.
    """

    name: str
    roles: tuple[str, ...]
    shared_column: bool
    trim_rows: bool
    peer: bool
    serial_peer: bool = True
    serial: str = ""
    tolerance_key: str = ""
    siblings: tuple[str, ...] = ()
    draw: Draw = field(default_factory=Draw)
    machine: Callable[[], type[Any]] | None = None
    peer_spec: Callable[[], PeerSpec] | None = None
    #: ``machine`` / ``peer_spec`` are this layout's own (``peer_spec`` ``None``: no peer).
    own_machine: bool = False
    solo: str = ""

    @property
    def role(self) -> str:
        return self.roles[0]


@dataclass(frozen=True)
class Family:
    """A storage family: its serial class, its layouts, its machine and how to compare."""

    name: str
    serial: str
    layouts: tuple[LayoutSpec, ...]
    tolerance_key: str
    peer: Callable[[], PeerSpec] | None = None
    description: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: The family's machine base class (``None``: ``machines.ConformanceMachine``): a
    #: subclass of hooks and strategies only (``machines.machine_class`` builds on it).
    machine: Callable[[], type[Any]] | None = None
    #: The share of the profile's ``max_examples`` the family's machines run (an example of
    #: a costlier family takes longer; ``runner.family_settings`` applies it).
    examples: float = 1.0
    #: The share of the profile's steps per example (long sequences cost more than
    #: linearly: the pool and layouts grow); ``runner.family_settings`` applies it.
    steps: float = 1.0

    def layout(self, name: str) -> LayoutSpec:
        for spec in self.layouts:
            if spec.name == name:
                return spec
        raise KeyError(f"family {self.name!r} has no layout {name!r}")


@dataclass(frozen=True)
class Budget:
    """What the table does not say about a family: its description and notes, and the
    share of the profile's examples and steps its machines run (an example of a costlier
    family takes longer; ``runner.family_settings`` applies them)."""

    description: str
    examples: float = 1.0
    steps: float = 1.0
    notes: tuple[str, ...] = ()


#: The families' budgets, in the order ``kvrows conform`` lists the families (a derived
#: family not named here runs the whole profile and is listed last).
BUDGETS: dict[str, Budget] = {
    # Long prompts (past 256 columns) and every check on every append: 60 examples
    # keep the CI profile near 12 s per layout on one core.
    "plain": Budget("plain (unquantized) full-attention KV", examples=0.572, steps=0.9),
    # Six planes per row and quantized attention: an example costs about twice a plain one.
    "affine": Budget(
        "affine-quantized full-attention KV at every (bits, group size)", examples=0.23, steps=0.9
    ),
    # Sliding-window rings, both codecs: each layout names its serial ring and codec. An
    # example drives four implementations of a ring (reference, optimized, mlx-lm twins and
    # the model) through every wrap; 29 steps (prompts and chunks of several tokens) wrap
    # the windows the geometries draw (mostly 4-16) and still reach layout merges and
    # mlx-lm's filter.
    "rotating": Budget(
        "sliding-window rings (plain and affine): serial, decode and prefill layouts",
        examples=0.4,
        steps=0.85,
    ),
    # Chunked-local attention (issue 25): plain rows across chunk boundaries, front trims
    # before every append, trims back into a chunk; 25 examples per layout keep it near
    # 10 s on one core.
    "chunked": Budget(
        "chunked-local attention (llama4's ChunkedKVCache): serial, decode and prefill "
        "layouts, front trims, chunk masks",
        examples=0.2,
        steps=0.8,
        notes=(
            "mlx-lm's ChunkedKVCache trims only when llama4 asks and has no make_mask: its "
            "parity runs inside llama4 (tests/test_chunked.py)",
        ),
    ),
    # Verify rounds on every storage's verify layout (two codecs, two geometries). Each
    # example runs rounds with a solo replay per row, round misuse and mlx-lm's rollback:
    # 27 examples of 32 steps per layout keep the family near 30 s on two workers.
    "speculative": Budget(
        "speculative verify rounds (commit / per-row rollback) on every verify layout, rings "
        "across the window",
        examples=0.258,
        steps=0.8,
    ),
    # TurboQuant: serial caches and their one layout in all three roles (verify rounds
    # included), codes and scales exact, deferred-V attention against the eager oracle. An
    # example runs every codec width's planes through verify rounds and the eager oracle
    # (about 2 s on one core): 10 examples of 34 steps.
    "turbo": Budget(
        "TurboQuant full attention at every (k_bits, v_bits) and head dim: serial, the layout "
        "in every role with verify rounds, deferred vs eager V",
        examples=0.07,
        notes=(
            "no mlx-lm peer (mlx-lm has no TurboQuant cache): reference vs optimized, solo "
            "replay and the eager-V oracle only",
        ),
    ),
    # Delayed layouts (rows that convert to affine at their own boundary), full attention
    # and rings, with solo legos for every row in both implementations: 60 examples of 39
    # steps per layout (conversions mid-batch need the longer runs) keep the family near
    # 25 s on one core.
    "delayed": Budget(
        "delayed layouts: rows convert to affine at their own start, mixed reads, prefill "
        "maintenance, rounds, solo legos",
        examples=0.4,
        steps=1.15,
    ),
    # MLA latent state (issue 14): MLACache and EncodedLatentCache, each its own serial
    # storage and layout. Every bad input is tried on each ``invalid`` step; 22 examples
    # of 24 steps per class keep the family near 8 s on one core.
    "latent": Budget(
        "MLA latent caches (latent + rope + DSA index planes; affine/TurboQuant/MX latent, "
        "bf16-first): rows, rounds, solo replay, mlx-lm KVCache pairs",
        examples=0.15,
        steps=0.6,
    ),
    # MLA latent planes in a block pool (issue 14): PagedLatentCache rows in one pool per
    # implementation, MLACache as every row's oracle. Half the examples plain, half
    # encoded: about 5 s on one core in CI.
    "paged-latent": Budget(
        "MLA latent planes in a block pool (plain; affine/TurboQuant/MX latent, bf16-first): "
        "MLACache's rows as block tables, rounds, MLACache and mlx-lm KVCache pairs as "
        "oracles, pool invariants",
        examples=0.2,
        steps=0.6,
    ),
    # Recurrent state (SSM / gated DeltaNet): rows of SSMCache in BatchedSSMCache, every
    # role, verify rounds by snapshot + replay (no token axis, no attention read), mlx-lm's
    # ArraysCache as the parity twin.
    "recurrent": Budget(
        "recurrent state (conv + float32 state, layer-written): rows, padded runs, snapshot "
        "+ replay rounds, mlx-lm ArraysCache parity",
        examples=0.2,
        steps=0.75,
    ),
    # Rows that convert to TurboQuant (full attention only): codes and scales exact,
    # attention within the turbo tolerances, deferred vs eager V. One layout, solo legos
    # for every row: 38 examples keep it near 8 s on one core.
    "delayed-turbo": Budget(
        "delayed TurboQuant layout: rows convert to TurboQuant at their own start, mixed "
        "reads attended per group, prefill maintenance, rounds, solo legos, eager V",
        examples=0.25,
        notes=("no mlx-lm peer (mlx-lm has no TurboQuant cache)",),
    ),
    # The microscaling codecs (issue 25): MxKVCache rows in BatchedMxKVCache (every role,
    # verify rounds), every mode and dtype, planes exact; no mlx-lm peer. 26 examples keep
    # it near 8 s on one core.
    "mx": Budget(
        "microscaling float KV (mxfp8, mxfp4, nvfp4): serial, the layout in every role with "
        "verify rounds, planes bit-exact with the NumPy formats",
        examples=0.25,
        notes=("no mlx-lm peer (mlx-lm has no microscaling cache)",),
    ),
    # Rows that convert to a microscaling mode: one layout, solo legos for every row; 40
    # examples keep it near 7 s on one core.
    "delayed-mx": Budget(
        "delayed microscaling layout: rows convert to mxfp8 / mxfp4 / nvfp4 at their own "
        "start, mixed reads attended per group, prefill maintenance, rounds, solo legos",
        examples=0.4,
        notes=("no mlx-lm peer (mlx-lm has no microscaling cache)",),
    ),
    # Paged KV (issue 13): PagedKVCache rows in PagedKvRows (every role, verify rounds),
    # bit-exact with the contiguous model; the pools' invariants after every rule. About
    # 5 s on one core in CI (15 examples).
    "paged": Budget(
        "paged KV: block tables into shared pools, rows by reference, verify rounds, copy "
        "on write, bit-exact with the contiguous KV",
        examples=0.1,
        steps=0.7,
        notes=(
            "no mlx-lm peer (mlx-lm has no paged cache): reference vs optimized, the "
            "contiguous model and solo replay",
        ),
    ),
    # The same rows over affine pools, one affine codec per example, codes exact: about
    # 4 s on one core in CI (6 examples: quantized attention is slow on the CPU).
    "paged-affine": Budget(
        "paged KV over affine pools at every (bits, group size)", examples=0.058, steps=0.6
    ),
    # Paged rings (issue 23: the paged placement under the ring geometry):
    # PagedRotatingKVCache rows in PagedRotatingRows (every role, rounds across the
    # window), the ring's rules over the paged ones; the contiguous ring's model and the
    # pools' invariants after every rule.
    "paged-rotating": Budget(
        "paged rings: sliding-window block tables, blocks out of the window back in the "
        "pool, rounds across the window, the contiguous ring's model",
        examples=0.1,
        steps=0.7,
        notes=(
            "no mlx-lm peer (mlx-lm has no paged cache): reference vs optimized, the "
            "contiguous ring's model and solo replay",
        ),
    ),
    "paged-rotating-affine": Budget(
        "paged rings over affine pools at every (bits, group size)", examples=0.04, steps=0.6
    ),
    # The microscaling codecs in block pools (issue 25: paging takes any codec): every
    # mode, about 5 s each on one core.
    "paged-mx": Budget(
        "paged KV over microscaling pools (mxfp8, mxfp4, nvfp4)", examples=0.1, steps=0.6
    ),
    "paged-rotating-mx": Budget(
        "paged rings over microscaling pools (mxfp8, mxfp4, nvfp4)", examples=0.1, steps=0.6
    ),
    # Paged chunked-local attention (issue 25: the paged placement under the chunked
    # geometry): PagedChunkedKVCache rows in PagedChunkedRows (every role, rounds), front
    # trims giving blocks back; the contiguous chunked model and the pools' invariants.
    "paged-chunked": Budget(
        "paged chunked-local attention: block tables whose blocks before the chunk go back "
        "to the pool, front trims, rounds, the contiguous chunked model",
        examples=0.1,
        steps=0.7,
        notes=(
            "no mlx-lm peer (mlx-lm has no paged cache): reference vs optimized, the "
            "contiguous chunked model and solo replay",
        ),
    ),
    "paged-chunked-affine": Budget(
        "paged chunked-local attention over affine pools at every (bits, group size)",
        examples=0.04,
        steps=0.6,
    ),
    "paged-chunked-mx": Budget(
        "paged chunked-local attention over microscaling pools (mxfp8, mxfp4, nvfp4)",
        examples=0.06,
        steps=0.6,
    ),
}


def _storages() -> list[Composition]:
    """The landed serial storages (a layout without a serial is its own storage), by
    placement (contiguous first), geometry, then codec (the hook tables' order), then
    table order."""
    placements = ["contiguous", *PLACEMENT_HOOKS]
    geometries, codecs = list(GEOMETRY_HOOKS), [spec.kind for spec in CODEC_HOOKS]
    storages = [c for c in landed() if not c.is_layout or c.serial is None]
    return sorted(
        storages,
        key=lambda c: (
            placements.index(c.placement),
            geometries.index(c.geometry) if c.geometry in geometries else len(geometries),
            codecs.index(c.codec) if c.codec in codecs else -1,
        ),
    )


def _place_hooks(storage: Composition) -> GeometryHooks:
    """The hook row that stands first for ``storage``: its placement's (paged), else its
    geometry's."""
    if storage.placement != "contiguous":
        return PLACEMENT_HOOKS[storage.placement]
    return GEOMETRY_HOOKS[storage.geometry]


def _codecs(storage: Composition) -> tuple[str, ...]:
    """The codec kinds ``storage`` is driven with (a storage of any codec: its placement's
    or geometry's)."""
    if storage.codec == "any":
        return _place_hooks(storage).codecs
    return (storage.codec,)


@dataclass(frozen=True)
class _Axes:
    """One storage under one codec: its family, machine, peer and tolerance key."""

    family: str
    machine: Loader | None
    rounds: Loader | None  # the machine with verify rounds
    has_rounds: bool
    peer: PeerLoader | None
    tolerance_key: str
    writer: WriterHooks
    draw: Draw


def _axes(codec: str, storage: Composition) -> _Axes:
    """The machines of ``codec`` on ``storage``'s geometry and placement: the rules its
    rows name, composed (the geometry's round rules, the speculative modifier's, the
    placement's or geometry's, the codec's, the writer's)."""
    spec = CODECS.get(codec)  # the codec registry resolves kinds; the hook rows are by spec
    codec_hooks = None if spec is None else CODEC_HOOKS.get(spec)
    geometry, placement = storage.geometry, storage.placement
    known = geometry in GEOMETRY_HOOKS and placement in ("contiguous", *PLACEMENT_HOOKS)
    if codec_hooks is None or not known:
        raise KeyError(
            f"no conformance hooks for the {codec} codec on the {geometry} geometry "
            f"({placement}): add a row to conformance.hooks.CODEC_HOOKS / GEOMETRY_HOOKS / "
            "PLACEMENT_HOOKS"
        )
    geometry_hooks = _place_hooks(storage)
    # A placement's row stands first; the geometry under it adds its own rules (a paged
    # ring: the ring's windows and invalid merges, its rounds across the window).
    under = None if placement == "contiguous" else GEOMETRY_HOOKS[geometry]
    writer = WRITERS[codec_hooks.tensors]
    own = geometry_hooks.by_codec.get(codec)
    codec_rules = geometry_hooks.codec_rules and (under is None or under.codec_rules)
    rules = tuple(
        r
        for r in (
            geometry_hooks.rules,
            None if under is None else under.rules,
            codec_hooks.rules if codec_rules else None,
            writer.rules,
        )
        if r is not None
    )
    where = geometry_hooks.rounds if geometry_hooks.rules is not None else codec_hooks.rounds
    if writer.rounds is not None:  # a writer of other tensors than K/V: rounds of its own
        where = writer.rounds
    speculative = MODIFIER_RULES["speculative"].rules
    round_rules = geometry_hooks.round_rules or (None if under is None else under.round_rules)
    with_rounds = compose(*(r for r in (round_rules, speculative) if r is not None), *rules)
    machine: Loader | None = compose(*rules) if own is None else own
    rounds: Loader | None = with_rounds
    if own is not None or where == "own":  # rules with rounds of their own
        rounds, where = machine, "own"
    elif where == "family":
        machine = with_rounds
    family = geometry_hooks.family or codec_hooks.family
    if under is not None and under.family is not None:  # ``paged-rotating``
        family = f"{family}-{under.family}"
    qualifier = codec_hooks.qualifier
    if geometry_hooks.family is not None and geometry_hooks.codec_suffix and qualifier:
        family = f"{family}-{qualifier}"
    prefix, key = geometry_hooks.tolerance_prefix, codec_hooks.tolerance_key
    if prefix:
        key = f"{prefix}-{key}" if qualifier else prefix
    peer: PeerChoice = None
    for choice in (writer.peer, geometry_hooks.peer, codec_hooks.peer):
        if choice != DEFER:
            peer = choice
            break
    assert peer != DEFER
    # Windows and sinks: the geometry's; the codec kind its parameters are of (the model
    # encodes through the reference codec of the example's spec).
    draw = replace(codec_hooks.draw.on(GEOMETRY_HOOKS[geometry]), codec_kind=codec)
    return _Axes(family, machine, rounds, where != "modifier", peer, key, writer, draw)


def _roles(storage: Composition, entry: Composition) -> tuple[str, ...]:
    """The roles in which ``storage``'s rows land in ``entry`` (the storage's roles that
    name it; else the ones the layout names itself for: a delayed layout)."""
    own = entry is storage
    named = tuple(
        role
        for role, target in (storage.roles.items() if storage.roles else ())
        if target == entry.name or (own and target == SELF)
    )
    if not named and entry.roles is not None:
        named = tuple(role for role, target in entry.roles.items() if target == SELF)
    return named or ("decode",)


def _layout(storage: Composition, entry: Composition, axes: _Axes, peer: bool) -> LayoutSpec:
    writer = axes.writer
    layouts = (storage,) if storage.is_layout else layouts_of(storage.name)

    def mirrored(c: Composition) -> bool:
        if writer.parity_from_table:  # (and the axes name an mlx-lm peer to build it)
            return peer and c.parity is not None and axes.peer is not None
        return peer and c.name not in writer.unmirrored

    siblings = (
        tuple(c.name for c in layouts if "delayed" not in c.modifiers)
        if writer.siblings and "delayed" not in entry.modifiers
        else ()
    )
    return LayoutSpec(
        entry.name,
        _roles(storage, entry),
        shared_column=entry.shared_column if writer.shared_column is None else writer.shared_column,
        trim_rows=entry.arrangement == "ragged" if writer.trim_rows is None else writer.trim_rows,
        peer=mirrored(entry),
        serial_peer=mirrored(storage),
        serial=storage.name,
        tolerance_key=axes.tolerance_key,
        siblings=siblings,
        draw=axes.draw,
    )


def _lego_of(storage: Composition) -> str:
    """The delayed serial preset (lego) whose converted stage is ``storage``."""
    (lego,) = (
        c.name
        for c in landed()
        if c.modifiers == {"delayed"}
        and not c.is_layout
        and stage_presets(c)[1].name == storage.name
    )
    return lego


def _modifier_family(rules: ModifierRules, codec: str) -> str:
    if rules.default_codec is None or codec == rules.default_codec:
        return rules.family
    return f"{rules.family}-{codec}"


def derive() -> dict[str, Family]:
    """Every family, derived from the composition table and the hook tables (§0.11).

    Each landed storage under each codec it is driven with joins the family of its axes
    (geometry, else codec) with its layouts; a layout that serves only the verify role
    joins only the speculative family, unless the storage's machine runs rounds itself; a
    delayed layout (rows of two codecs) joins only its modifier's family. The speculative
    family also takes every other verify layout of a storage whose machine has no rounds.
    """
    members: dict[str, list[tuple[LayoutSpec, Loader | None, PeerLoader | None]]] = {}
    speculative, delayed = MODIFIER_RULES["speculative"], MODIFIER_RULES["delayed"]
    for storage in _storages():
        for codec in _codecs(storage):
            axes = _axes(codec, storage)
            for entry in (storage,) if storage.is_layout else layouts_of(storage.name):
                if "delayed" in entry.modifiers:
                    spec = replace(
                        _layout(storage, entry, axes, peer=delayed.peer), solo=_lego_of(storage)
                    )
                    name = _modifier_family(delayed, codec)
                    over = () if delayed.own or axes.machine is None else (axes.machine,)
                    machine = compose(delayed.rules, *over)
                    members.setdefault(name, []).append((spec, machine, None))
                    continue
                spec = _layout(storage, entry, axes, peer=True)
                rounds_elsewhere = "verify" in spec.roles and not axes.has_rounds
                if rounds_elsewhere and "speculative" in entry.modifiers:
                    name = _modifier_family(speculative, codec)
                    members.setdefault(name, []).append((spec, axes.rounds, axes.peer))
                if spec.roles != ("verify",) or axes.has_rounds:
                    members.setdefault(axes.family, []).append((spec, axes.machine, axes.peer))
    order = list(BUDGETS)
    families: dict[str, Family] = {}
    for name in sorted(members, key=lambda n: order.index(n) if n in order else len(order)):
        rows = members[name]
        first, machine, peer = rows[0]
        shared = all(row[1] is machine for row in rows)
        budget = BUDGETS.get(name) or Budget(
            f"{first.serial}: {', '.join(r[0].name for r in rows)}"
        )
        families[name] = Family(
            name=name,
            serial=first.serial,
            layouts=tuple(
                spec
                if shared and row_peer is peer
                else replace(spec, machine=row_machine, peer_spec=row_peer, own_machine=True)
                for spec, row_machine, row_peer in rows
            ),
            tolerance_key=first.tolerance_key,
            peer=peer,
            description=budget.description,
            notes=budget.notes,
            machine=machine if shared else None,
            examples=budget.examples,
            steps=budget.steps,
        )
    return families


FAMILIES: dict[str, Family] = derive()


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; known: {sorted(FAMILIES)}") from None
