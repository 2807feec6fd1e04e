"""Per-axis hooks: what each axis of the composition table brings to a conformance family.

``conformance.families`` derives every family from ``kvrows.compositions.COMPOSITIONS``
and these tables, one row per value of an axis (spec/contract.md §0.11):

* :data:`CODEC_HOOKS` ``[codec kind]``: the machine whose geometry strategy draws the
  codec's parameters (``None``: the base machine), its tolerance key, its mlx-lm peer,
  the family its growing storages form, and what its tensors are written with;
* :data:`GEOMETRY_HOOKS` ``[geometry kind]``: the machine whose strategy draws the
  geometry (a ring's window, a pool), the mlx-lm peer it imposes, how its families are
  named and which codecs a storage of ``any`` codec is driven with;
* :data:`WRITERS` ``[tensors]``: how a block is written (KV ``update_and_fetch``, the
  latent's three tensors, recurrent planes), and so what the table's arrangement and
  parity columns mean for the machine's layout flags and mlx-lm twins;
* :data:`MODIFIER_RULES` ``[modifier]``: the machine mixin a modifier's family runs
  (verify rounds, delayed conversion) and how its families are named.

A new codec or geometry (an MX codec, a chunked geometry) gets its conformance family by
a row here, not by a family function. Machines are named by :func:`load` (lazily: the
machine modules import ``families``); the same name gives the same loader, so families
that share a machine share its loader.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal

import mlx.core as mx

__all__ = [
    "CODEC_HOOKS",
    "GEOMETRY_HOOKS",
    "MODIFIER_RULES",
    "WRITERS",
    "CodecHooks",
    "GeometryHooks",
    "Loader",
    "ModifierRules",
    "PeerSpec",
    "WriterHooks",
    "lm_cache",
    "load",
]

#: A machine class, imported when a machine is first made.
Loader = Callable[[], type[Any]]

Planes = tuple[Any, ...]
Fetched = tuple[Planes, Planes] | None


@functools.cache
def load(module: str, name: str) -> Loader:
    """The loader of ``kvrows.conformance.<module>.<name>`` (one loader per class)."""

    def machine() -> type[Any]:
        cls: type[Any] = getattr(importlib.import_module(f"kvrows.conformance.{module}"), name)
        return cls

    machine.__name__ = machine.__qualname__ = f"load_{name}"
    return machine


# ------------------------------------------------------------------------ mlx-lm peers
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


def lm_cache() -> Any:
    """mlx-lm's cache module (untyped: reached through ``Any``)."""
    from mlx_lm.models import cache

    return cache


def plain_peer() -> PeerSpec:
    lm = lm_cache()
    return PeerSpec(
        serial=lambda geometry: lm.KVCache(),
        batch=lm.BatchKVCache,
        attention=_lm_attention,
        serial_kv=lambda cache: _sliced(cache, int(cache.offset)),
        batch_kv=lambda cache: _sliced(cache, int(cache._idx)),
    )


def affine_peer() -> PeerSpec:
    """mlx-lm's ``QuantizedKVCache`` (serial only: mlx-lm has no quantized batch)."""
    lm = lm_cache()
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


def ring_peer() -> PeerSpec:
    lm = lm_cache()
    return PeerSpec(
        serial=lambda g: lm.RotatingKVCache(g.max_size, g.keep),
        batch=lm.BatchRotatingKVCache,
        attention=_lm_attention,
        serial_kv=_ring_kv,
        batch_kv=_ring_kv,
    )


PeerLoader = Callable[[], PeerSpec]
#: A hook that leaves the mlx-lm peer to the next axis (writer, then geometry, then codec).
DEFER: Final = "defer"
PeerChoice = PeerLoader | None | Literal["defer"]


# ---------------------------------------------------------------------------- the axes
@dataclass(frozen=True)
class CodecHooks:
    """A codec kind: ``machine`` draws its parameters (``None``: the base machine's
    geometry strategy), ``rounds`` its machine with verify rounds (``None``: the
    speculative mixin over ``machine``; ``machine`` itself when ``has_rounds``),
    ``tolerance_key`` its rows of the tolerance table, ``peer`` mlx-lm's cache of the
    codec, ``family`` the family of its growing storages, ``tensors`` its writer;
    ``qualifier`` names it in a geometry's family and tolerance key (``paged-affine``,
    ``rotating-affine``; empty for the plain codec, the geometry's own)."""

    tolerance_key: str
    family: str
    qualifier: str
    machine: Loader | None = None
    rounds: Loader | None = None
    has_rounds: bool = False
    peer: PeerChoice = None
    tensors: str = "kv"


@dataclass(frozen=True)
class GeometryHooks:
    """A geometry kind: ``machine`` draws it (``None``: the codec's machine), or
    ``by_codec`` per codec; ``rounds`` the machine with verify rounds (as for a codec);
    ``family`` names its families (``None``: the codec's family), ``codec_suffix`` adds
    the codec's qualifier; ``tolerance_prefix`` keys a codec's tolerances (``rotating``
    + ``-affine``); ``peer`` mlx-lm's cache of the geometry;
    ``codecs``: the codecs a storage of ``any`` codec is driven with in the CI profile."""

    machine: Loader | None = None
    by_codec: Mapping[str, Loader] = field(default_factory=lambda: MappingProxyType({}))
    rounds: Loader | None = None
    has_rounds: bool = False
    family: str | None = None
    codec_suffix: bool = False
    tolerance_prefix: str = ""
    peer: PeerChoice = DEFER
    codecs: tuple[str, ...] = ()


@dataclass(frozen=True)
class WriterHooks:
    """How a block is written (per tensors), and what the table's columns mean for it.

    ``shared_column`` / ``trim_rows``: the layout flags, ``None`` where the table's
    arrangement decides (shared: one write column; ragged: per-row rollback); mlx-lm
    twins a storage where the table names its parity class (``parity_from_table``), else
    every storage but the ``unmirrored`` ones; ``siblings``:
    whether a layout merges the rows of its storage's other layouts (else the family's);
    ``peer``: mlx-lm's cache of these tensors (:data:`DEFER`: the geometry's or codec's).
    """

    shared_column: bool | None = None
    trim_rows: bool | None = None
    parity_from_table: bool = True
    unmirrored: frozenset[str] = frozenset()
    siblings: bool = True
    peer: PeerChoice = DEFER


@dataclass(frozen=True)
class ModifierRules:
    """A modifier's family: its machine (``mixin``: mixed into the storage's machine;
    else ``machine``: the family's own), its family name (``-<codec>`` added for a codec
    other than ``default_codec``; ``None``: one family for every codec), and whether its
    layouts have an mlx-lm peer."""

    family: str
    mixin: Loader | None = None
    machine: Loader | None = None
    default_codec: str | None = None
    peer: bool = True


CODEC_HOOKS: Mapping[str, CodecHooks] = MappingProxyType(
    {
        "plain": CodecHooks("plain", "plain", "", peer=plain_peer),
        "affine": CodecHooks(
            "affine",
            "affine",
            "affine",
            machine=load("affine", "AffineMachine"),
            rounds=load("speculative", "SpeculativeAffineMachine"),
            peer=affine_peer,
        ),
        # The turbo machine runs verify rounds itself; mlx-lm has no TurboQuant cache.
        "turbo": CodecHooks(
            "turbo", "turbo", "turbo", machine=load("turbo", "TurboMachine"), has_rounds=True
        ),
        # MLA latent storages grow (the growing geometry); their machine runs rounds.
        "latent": CodecHooks(
            "latent",
            "latent",
            "latent",
            machine=load("latent", "LatentMachine"),
            has_rounds=True,
            tensors="latent",
        ),
        "state": CodecHooks("recurrent", "recurrent", "state", tensors="recurrent"),
    }
)

GEOMETRY_HOOKS: Mapping[str, GeometryHooks] = MappingProxyType(
    {
        "growing": GeometryHooks(),
        # Both codecs' rings in one family; mlx-lm's rings are the peer of both.
        "ring": GeometryHooks(
            machine=load("rings", "RingMachine"),
            rounds=load("speculative", "SpeculativeRingMachine"),
            family="rotating",
            tolerance_prefix="rotating",
            peer=ring_peer,
        ),
        # mlx-lm has no paged cache; a paged KV storage runs with plain and affine pools.
        "paged": GeometryHooks(
            by_codec=MappingProxyType(
                {
                    "plain": load("paged", "PagedMachine"),
                    "affine": load("paged", "PagedAffineMachine"),
                    "latent": load("paged_latent", "PagedLatentMachine"),
                }
            ),
            has_rounds=True,
            family="paged",
            codec_suffix=True,
            peer=None,
            codecs=("plain", "affine"),
        ),
        "recurrent": GeometryHooks(
            machine=load("recurrent", "RecurrentMachine"), has_rounds=True, family="recurrent"
        ),
    }
)

WRITERS: Mapping[str, WriterHooks] = MappingProxyType(
    {
        "kv": WriterHooks(),
        # Three tensors on one token axis, every layout rolled back by row; mlx-lm's
        # KVCache pairs twin a latent held plain (mlx-lm has no encoded latent cache).
        "latent": WriterHooks(
            shared_column=True,
            trim_rows=True,
            parity_from_table=False,
            unmirrored=frozenset({"EncodedLatentCache"}),
            siblings=False,
            peer=plain_peer,
        ),
        # Planes written by the layer and advanced: no token axis to share or roll back;
        # mlx-lm's ArraysCache twins every row (the machine makes it).
        "recurrent": WriterHooks(
            shared_column=False, trim_rows=False, parity_from_table=False, siblings=False
        ),
    }
)

MODIFIER_RULES: Mapping[str, ModifierRules] = MappingProxyType(
    {
        # Verify rounds on the verify layouts of storages whose machine has none.
        "speculative": ModifierRules(
            "speculative", mixin=load("speculative", "SpeculativeMachine")
        ),
        # Rows of two codecs (bf16, then the codec): their own machine and solo legos.
        "delayed": ModifierRules(
            "delayed", machine=load("delayed", "DelayedMachine"), default_codec="affine", peer=False
        ),
    }
)
