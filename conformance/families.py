"""What the state machines drive: implementations, storage families and their layouts.

An :class:`Impl` is one implementation of the contract (the NumPy reference,
the MLX optimized one, or a mutant of it in the teeth tests): classes are
resolved by name, as both implementations mirror each other's names, and a
mutant is the same table with one class replaced.

A :class:`Family` is a row of the storage table the machines are generated
from: its serial class, its layouts (each with the operations it supports),
its tolerance key, its mlx-lm peers and its machine (a subclass of
``machines.ConformanceMachine`` that supplies hooks and strategies only). A new
family is an entry of :data:`FAMILIES` plus, if its geometry or peers differ, such a
subclass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from kvrows.compositions import composition, landed, layouts_of
from kvrows.conformance.arrays import from_mlx, to_mlx

Planes = tuple[Any, ...]

__all__ = [
    "CONSTRUCTORS",
    "FAMILIES",
    "Family",
    "Impl",
    "LayoutSpec",
    "PeerSpec",
    "delayed_layouts",
    "family",
    "latent_layouts",
    "optimized_impl",
    "reference_impl",
    "speculative_layouts",
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


Fetched = tuple[Planes, Planes] | None


@dataclass(frozen=True)
class PeerSpec:
    """mlx-lm's classes for a family: the serial cache and (optionally) the batch.

    ``serial(geometry)`` makes a serial twin; ``batch`` offers mlx-lm's ``merge``
    (classmethod), ``extend``, ``filter``, ``extract``, ``trim``, ``make_mask``,
    ``update_and_fetch``, ``left_padding`` and ``offset``; ``attention`` is the
    attention models call; ``serial_kv`` / ``batch_kv`` read what a twin holds in the
    column order of the optimized ``fetch()`` (``None`` before any token).
    """

    serial: Callable[[Any], Any]
    batch: Any
    attention: Callable[..., Any]
    serial_kv: Callable[[Any], Fetched]
    batch_kv: Callable[[Any], Fetched]


def _sliced(cache: Any, end: int) -> Fetched:
    if cache.keys is None:
        return None

    def cut(held: Any) -> Planes:
        planes = held if isinstance(held, tuple | list) else (held,)
        return tuple(p[:, :, :end] for p in planes)

    return cut(cache.keys), cut(cache.values)


def _lm_attention(queries: Any, keys: Any, values: Any, **kwargs: Any) -> Any:
    """mlx-lm's attention on a copy of the queries (its quantized path scales them in place)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    return scaled_dot_product_attention(mx.array(queries), keys, values, **kwargs)


def _lm_cache() -> Any:
    """mlx-lm's cache module (untyped: reached through ``Any``)."""
    from mlx_lm.models import cache

    return cache


def _plain_peer() -> PeerSpec:
    lm = _lm_cache()
    return PeerSpec(
        serial=lambda geometry: lm.KVCache(),
        batch=lm.BatchKVCache,
        attention=_lm_attention,
        serial_kv=lambda cache: _sliced(cache, int(cache.offset)),
        batch_kv=lambda cache: _sliced(cache, int(cache._idx)),
    )


def _affine_peer() -> PeerSpec:
    """mlx-lm's ``QuantizedKVCache`` (serial only: mlx-lm has no quantized batch)."""
    lm = _lm_cache()
    return PeerSpec(
        serial=lambda g: lm.QuantizedKVCache(group_size=g.group_size, bits=g.bits),
        batch=None,
        attention=_lm_attention,
        serial_kv=lambda cache: _sliced(cache, int(cache.offset)),
        batch_kv=lambda cache: None,
    )


def _ring_kv(cache: Any) -> Fetched:
    if cache.keys is None:
        return None
    keys, values = cache.keys_and_values()
    return (keys,), (values,)


def _ring_peer() -> PeerSpec:
    lm = _lm_cache()
    return PeerSpec(
        serial=lambda g: lm.RotatingKVCache(g.max_size, g.keep),
        batch=lm.BatchRotatingKVCache,
        attention=_lm_attention,
        serial_kv=_ring_kv,
        batch_kv=_ring_kv,
    )


def _affine_machine() -> type[Any]:
    from kvrows.conformance.affine import AffineMachine

    return AffineMachine


def _ring_machine() -> type[Any]:
    from kvrows.conformance.rings import RingMachine

    return RingMachine


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
    ``machine`` / ``peer_spec``: this layout's machine base and mlx-lm peer when not the
    family's (a family over several storages: the speculative family).
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
    machine: Callable[[], type[Any]] | None = None
    peer_spec: Callable[[], PeerSpec] | None = None

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


def derived_layouts(
    serial: str, tolerance_key: str = "", verify_only: str = "skip"
) -> tuple[LayoutSpec, ...]:
    """The machines' layouts of ``serial``'s rows, read off the composition table.

    Roles: the roles of ``serial``'s entry that name the layout; rows share one write
    column when the arrangement is ``shared`` and roll back per row when it is
    ``ragged``; mlx-lm mirrors a layout (and twins the serial caches) where the table
    names a parity class. Every layout merges rows of its siblings (the other layouts of
    the same storage). Layouts that serve only the verify role are left to the speculative
    family unless ``verify_only="keep"``.
    """
    storage = composition(serial)
    layouts = layouts_of(serial)
    # The delayed layouts hold rows of two codecs: their own family drives them.
    siblings = tuple(c.name for c in layouts if "delayed" not in c.modifiers)
    specs = []
    for entry in layouts:
        roles = tuple(
            role
            for role, target in (storage.roles.items() if storage.roles else ())
            if target == entry.name
        )
        if roles == ("verify",) and verify_only == "skip":
            continue  # a verify-only layout: the speculative family drives it
        if "delayed" in entry.modifiers:
            continue  # rows of two codecs: the delayed family drives it
        specs.append(
            LayoutSpec(
                entry.name,
                roles or ("decode",),
                shared_column=entry.shared_column,
                trim_rows=entry.arrangement == "ragged",
                peer=entry.parity is not None,
                serial_peer=storage.parity is not None,
                serial=serial,
                tolerance_key=tolerance_key,
                siblings=siblings,
            )
        )
    return tuple(specs)


def _paged_machine() -> type[Any]:
    from kvrows.conformance.paged import PagedMachine

    return PagedMachine


def _paged_affine_machine() -> type[Any]:
    from kvrows.conformance.paged import PagedAffineMachine

    return PagedAffineMachine


def _turbo_machine() -> type[Any]:
    from kvrows.conformance.turbo import TurboMachine

    return TurboMachine


def _delayed_machine() -> type[Any]:
    from kvrows.conformance.delayed import DelayedMachine

    return DelayedMachine


def _recurrent_machine() -> type[Any]:
    from kvrows.conformance.recurrent import RecurrentMachine

    return RecurrentMachine


def delayed_layouts(codec: str = "affine") -> tuple[LayoutSpec, ...]:
    """The delayed layouts converting to ``codec`` (``affine`` or ``turbo``; each serves
    every role of its lego's rows; no mlx-lm peer)."""
    roles = ("decode", "prefill", "verify")
    layouts = {
        "affine": (
            ("DelayedQuantizedKVCache", "QuantizedKVCache", "affine"),
            ("DelayedRotatingQuantizedKVCache", "RotatingQuantizedKVCache", "rotating-affine"),
        ),
        "turbo": (("DelayedTurboQuantKVCache", "TurboQuantKVCache", "turbo"),),
    }[codec]
    return tuple(
        LayoutSpec(
            name,
            roles,
            shared_column=False,
            trim_rows=True,
            peer=False,
            serial_peer=False,
            serial=serial,
            tolerance_key=key,
        )
        for name, serial, key in layouts
    )


def _speculative_machine(name: str) -> Callable[[], type[Any]]:
    def machine() -> type[Any]:
        from kvrows.conformance import speculative

        cls: type[Any] = getattr(speculative, name)
        return cls

    return machine


def speculative_layouts() -> tuple[LayoutSpec, ...]:
    """Every storage's verify layout (the table's verify role), on its storage's machine
    with the rounds, its tolerance key and its mlx-lm peer."""
    storages = (
        ("KVCache", "plain", _plain_peer, "SpeculativeMachine"),
        ("QuantizedKVCache", "affine", _affine_peer, "SpeculativeAffineMachine"),
        ("RotatingKVCache", "rotating", _ring_peer, "SpeculativeRingMachine"),
        ("RotatingQuantizedKVCache", "rotating-affine", _ring_peer, "SpeculativeRingMachine"),
    )
    return tuple(
        replace(spec, machine=_speculative_machine(machine), peer_spec=peer)
        for serial, key, peer, machine in storages
        for spec in derived_layouts(serial, tolerance_key=key, verify_only="keep")
        if "verify" in spec.roles
    )


def _latent_machine() -> type[Any]:
    from kvrows.conformance.latent import LatentMachine

    return LatentMachine


def _paged_latent_machine() -> type[Any]:
    from kvrows.conformance.paged_latent import PagedLatentMachine

    return PagedLatentMachine


def latent_layouts() -> tuple[LayoutSpec, ...]:
    """The latent caches: each its own serial storage and its own layout in every role
    (mlx-lm parity for ``MLACache``: its ``KVCache``/``BatchKVCache`` pairs hold the same)."""
    return tuple(
        LayoutSpec(
            name,
            ("decode", "prefill", "verify"),
            shared_column=True,
            trim_rows=True,
            peer=name == "MLACache",
            serial_peer=name == "MLACache",
            serial=name,
            tolerance_key="latent",
        )
        for name in ("MLACache", "EncodedLatentCache")
    )


FAMILIES: dict[str, Family] = {
    "plain": Family(
        name="plain",
        serial="KVCache",
        layouts=derived_layouts("KVCache"),
        tolerance_key="plain",
        peer=_plain_peer,
        description="plain (unquantized) full-attention KV",
        # Long prompts (past 256 columns) and every check on every append: half the
        # profile keeps the CI profile near 15 s per layout on one core.
        examples=0.5,
        steps=0.9,
    ),
    "affine": Family(
        name="affine",
        serial="QuantizedKVCache",
        layouts=derived_layouts("QuantizedKVCache"),
        tolerance_key="affine",
        peer=_affine_peer,
        description="affine-quantized full-attention KV at every (bits, group size)",
        machine=_affine_machine,
        # Six planes per row and quantized attention: an example costs about twice a
        # plain one.
        examples=0.28,
        steps=0.9,
    ),
    # Sliding-window rings, both codecs: each layout names its serial ring and codec.
    "rotating": Family(
        name="rotating",
        serial="RotatingKVCache",
        layouts=derived_layouts("RotatingKVCache")
        + derived_layouts("RotatingQuantizedKVCache", tolerance_key="rotating-affine"),
        tolerance_key="rotating",
        peer=_ring_peer,
        description="sliding-window rings (plain and affine): serial, decode and prefill layouts",
        machine=_ring_machine,
        # An example drives four implementations of a ring (reference, optimized, mlx-lm
        # twins and the model) through every wrap; 29 steps (prompts and chunks of
        # several tokens) wrap the windows the geometries draw (mostly 4-16) and still
        # reach layout merges and mlx-lm's filter.
        examples=0.35,
        steps=0.85,
    ),
    # Verify rounds on every storage's verify layout (two codecs, two geometries): each
    # layout names its serial class, machine, tolerance key and mlx-lm peer.
    "speculative": Family(
        name="speculative",
        serial="KVCache",
        layouts=speculative_layouts(),
        tolerance_key="plain",
        peer=_plain_peer,
        description="speculative verify rounds (commit / per-row rollback) on every verify "
        "layout, rings across the window",
        # Each example runs rounds with a solo replay per row, round misuse and mlx-lm's
        # rollback: 33 examples of 32 steps per layout keep the family near 35 s on two
        # workers.
        examples=0.22,
        steps=0.8,
    ),
    # TurboQuant: serial caches and their one layout in all three roles (verify rounds
    # included), codes and scales exact, deferred-V attention against the eager oracle.
    # No mlx-lm peer: mlx-lm has no TurboQuant cache.
    "turbo": Family(
        name="turbo",
        serial="TurboQuantKVCache",
        layouts=derived_layouts("TurboQuantKVCache"),
        tolerance_key="turbo",
        peer=None,
        description="TurboQuant full attention at every (k_bits, v_bits) and head dim: "
        "serial, the layout in every role with verify rounds, deferred vs eager V",
        notes=(
            "no mlx-lm peer (mlx-lm has no TurboQuant cache): reference vs optimized, solo "
            "replay and the eager-V oracle only",
        ),
        machine=_turbo_machine,
        # An example runs every codec width's planes through verify rounds and the eager
        # oracle (about 2 s on one core): 10 examples of 34 steps.
        examples=0.07,
    ),
    # Delayed layouts (rows that convert to affine at their own boundary), full attention
    # and rings: their own machine (``conformance.delayed``) with solo legos.
    "delayed": Family(
        name="delayed",
        serial="QuantizedKVCache",
        layouts=delayed_layouts(),
        tolerance_key="affine",
        description="delayed layouts: rows convert to affine at their own start, mixed reads, "
        "prefill maintenance, rounds, solo legos",
        machine=_delayed_machine,
        # Each example runs solo legos in both implementations for every row: 60 examples
        # of 39 steps per layout (conversions mid-batch need the longer runs) keep the
        # family near 25 s on one core.
        examples=0.4,
        steps=1.15,
    ),
    # MLA latent state (issue 14): MLACache and EncodedLatentCache, each its own serial
    # storage and layout; their own machine (``conformance.latent``).
    "latent": Family(
        name="latent",
        serial="MLACache",
        layouts=latent_layouts(),
        tolerance_key="latent",
        peer=_plain_peer,
        description="MLA latent caches (latent + rope + DSA index planes; affine/TurboQuant "
        "latent, bf16-first): rows, rounds, solo replay, mlx-lm KVCache pairs",
        machine=_latent_machine,
        # Every bad input is tried on each ``invalid`` step; 22 examples of 24 steps per
        # class keep the family near 8 s on one core.
        examples=0.15,
        steps=0.6,
    ),
    # MLA latent planes in a block pool (issue 14): PagedLatentCache rows in one pool per
    # implementation, MLACache as every row's oracle (``conformance.paged_latent``).
    "paged-latent": Family(
        name="paged-latent",
        serial="PagedLatentCache",
        layouts=(
            LayoutSpec(
                "PagedLatentCache",
                ("decode", "prefill", "verify"),
                shared_column=True,
                trim_rows=True,
                peer=True,
                serial_peer=True,
                serial="PagedLatentCache",
                tolerance_key="latent",
            ),
        ),
        tolerance_key="latent",
        peer=_plain_peer,
        description="MLA latent planes in a block pool (plain; affine/TurboQuant latent, "
        "bf16-first): MLACache's rows as block tables, rounds, MLACache and mlx-lm KVCache "
        "pairs as oracles, pool invariants",
        machine=_paged_latent_machine,
        # Half the examples plain, half encoded: about 5 s on one core in CI.
        examples=0.2,
        steps=0.6,
    ),
    # Recurrent state (SSM / gated DeltaNet): rows of SSMCache in BatchedSSMCache, every
    # role, verify rounds by snapshot + replay; its own machine (no token axis, no attention
    # read: ``conformance.recurrent``), mlx-lm's ArraysCache as the parity twin.
    "recurrent": Family(
        name="recurrent",
        serial="SSMCache",
        layouts=(
            LayoutSpec(
                "BatchedSSMCache",
                ("decode", "prefill", "verify"),
                shared_column=False,
                trim_rows=False,
                peer=True,
                serial="SSMCache",
                tolerance_key="recurrent",
            ),
        ),
        tolerance_key="recurrent",
        description="recurrent state (conv + float32 state, layer-written): rows, padded runs, "
        "snapshot + replay rounds, mlx-lm ArraysCache parity",
        machine=_recurrent_machine,
        examples=0.2,
        steps=0.75,
    ),
    # The delayed machine with rows that convert to TurboQuant (full attention only):
    # codes and scales exact, attention within the turbo tolerances, deferred vs eager V.
    "delayed-turbo": Family(
        name="delayed-turbo",
        serial="TurboQuantKVCache",
        layouts=delayed_layouts("turbo"),
        tolerance_key="turbo",
        description="delayed TurboQuant layout: rows convert to TurboQuant at their own start, "
        "mixed reads attended per group, prefill maintenance, rounds, solo legos, eager V",
        notes=("no mlx-lm peer (mlx-lm has no TurboQuant cache)",),
        machine=_delayed_machine,
        # One layout, solo legos for every row: 38 examples keep it near 8 s on one core.
        examples=0.25,
    ),
    # Paged KV (issue 13): PagedKVCache rows in PagedKvRows (every role, verify rounds),
    # bit-exact with the contiguous model; the pools' invariants after every rule.
    "paged": Family(
        name="paged",
        serial="PagedKVCache",
        layouts=derived_layouts("PagedKVCache", verify_only="keep"),
        tolerance_key="plain",
        peer=None,
        description="paged KV: block tables into shared pools, rows by reference, verify "
        "rounds, copy on write, bit-exact with the contiguous KV",
        notes=(
            "no mlx-lm peer (mlx-lm has no paged cache): reference vs optimized, the "
            "contiguous model and solo replay",
        ),
        machine=_paged_machine,
        # About 5 s on one core in CI (15 examples).
        examples=0.1,
        steps=0.7,
    ),
    # The same rows over affine pools: one affine codec per example, codes exact.
    "paged-affine": Family(
        name="paged-affine",
        serial="PagedKVCache",
        layouts=derived_layouts("PagedKVCache", tolerance_key="affine", verify_only="keep"),
        tolerance_key="affine",
        peer=None,
        description="paged KV over affine pools at every (bits, group size)",
        machine=_paged_affine_machine,
        # About 4 s on one core in CI (6 examples: quantized attention is slow on the CPU).
        examples=0.04,
        steps=0.6,
    ),
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; known: {sorted(FAMILIES)}") from None
