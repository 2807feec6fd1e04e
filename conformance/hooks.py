"""Per-axis hooks: what each axis of the composition table brings to a conformance family.

``conformance.families`` derives every family from ``kvrows.compositions.COMPOSITIONS``
and these tables, one row per value of an axis (spec/contract.md §0.11):

* :data:`CODEC_HOOKS` ``[codec spec class]``: how an example draws the codec's
  parameters and head dims (:class:`Draw`), the codec's rules (a mixin of
  ``conformance.rules``: its model, its invalid merges), whether its family runs verify
  rounds, its tolerance key, its mlx-lm peer, the family of its growing storages, and
  what its tensors are written with (``families`` resolves a composition's codec kind
  through ``kvrows.codecs.CODECS``, the one place kinds are looked up);
* :data:`GEOMETRY_HOOKS` ``[geometry kind]``: the geometry's rules (a ring's views,
  windows and mlx-lm quirks) and what rounds add on it, its draw (windows and sinks by
  role, a head-dim cap), the mlx-lm peer it imposes, how its families are named;
* :data:`PLACEMENT_HOOKS` ``[placement kind]``: the same row for a placement other than
  contiguous buffers (a pool's invariants and byte limits), which stands first: its
  rules, rounds, family, peer and the codecs a storage of ``any`` codec is driven with
  (contract §0.4: paging is a placement, under any geometry with a token axis);
* :data:`WRITERS` ``[tensors]``: how a block is written (the writer's rules: K/V
  ``update_and_fetch``, the latent's three tensors, recurrent planes), and so
  what the table's arrangement and parity columns mean for the machine's layout flags
  and mlx-lm twins;
* :data:`MODIFIER_RULES` ``[modifier]``: the rules a modifier composes onto the machine
  (the speculative verify rounds) or runs alone (delayed conversion: ``own``), and how
  its families are named.

A machine is never written per family: :func:`compose` builds it from the rule mixins
the rows name (round rules of the geometry, the modifier's, the geometry's, the
codec's, the writer's, over ``machines.ConformanceMachine``), and
``machines.machine_class`` gives it the layout's :class:`Draw`. A new codec or geometry
(an MX codec, a chunked geometry) gets its conformance family by a row here. Rules are
named by :func:`load` (lazily: the rule modules import ``machines``, which imports
``families``); the same name gives the same loader, and the same rules the same
composed machine.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Final, Literal, cast

import mlx.core as mx
from hypothesis import strategies as st

from kvrows.affine_geometry import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from kvrows.codec import TURBO_HEAD_DIMS, CodecSpec
from kvrows.codecs import Affine, Latent, Plain, State, Turbo
from kvrows.codecs.mx import MX_MODES, Microscaled
from kvrows.conformance import strategies as ks
from kvrows.schemes import TURBO_KEY_BITS, TURBO_VALUE_BITS

__all__ = [
    "CODEC_HOOKS",
    "GEOMETRY_HOOKS",
    "MODIFIER_RULES",
    "PLACEMENT_HOOKS",
    "WRITERS",
    "CodecHooks",
    "Draw",
    "GeometryHooks",
    "Loader",
    "ModifierRules",
    "PeerSpec",
    "Rounds",
    "WriterHooks",
    "compose",
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


@functools.cache
def compose(*rules: Loader) -> Loader | None:
    """The loader of the machine made of ``rules`` (mixins over
    ``machines.ConformanceMachine``, the first overriding the next): ``None`` for none
    (the base machine), the rules themselves for one, else one class per tuple."""
    if len(rules) < 2:
        return rules[0] if rules else None

    def machine() -> type[Any]:
        bases = tuple(rule() for rule in rules)
        named = [b for i, b in enumerate(bases) if not any(issubclass(a, b) for a in bases[:i])]
        name = "".join(b.__name__.removesuffix("Rules").removesuffix("Machine") for b in named)
        return type(f"{name}Machine", bases, {"__module__": bases[0].__module__})

    machine.__name__ = machine.__qualname__ = "load_" + "_".join(r.__name__[5:] for r in rules)
    return functools.cache(machine)


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


# ----------------------------------------------------------------------------- draws
@dataclass(frozen=True)
class Draw:
    """How an example draws its geometry: ``strategy(dims=, codecs=[, windows=, keeps=])``
    over head dims ``dims`` and the codec's parameter sets ``params`` (a machine's
    ``codecs``, which a test may narrow), with a geometry's windows (by the layout's role)
    and sink tokens."""

    strategy: Callable[..., st.SearchStrategy[ks.Geometry]] = ks.geometries
    dims: tuple[int, ...] = (8, 16)
    params: tuple[tuple[int, int], ...] = ()
    windows: Callable[[str], st.SearchStrategy[int]] | None = None
    keeps: Callable[[int], st.SearchStrategy[int]] | None = None
    #: A chunked geometry's chunk sizes (by the layout's role).
    chunks: Callable[[str], st.SearchStrategy[int]] | None = None
    #: The codec kind the draw's parameters are of (``families`` sets the layout's).
    codec_kind: str = ""

    def geometries(
        self, codecs: tuple[tuple[int, int], ...], role: str
    ) -> st.SearchStrategy[ks.Geometry]:
        extra: dict[str, Any] = {}
        if self.windows is not None:
            extra.update(windows=self.windows(role), keeps=self.keeps)
        if self.chunks is not None:
            extra.update(chunks=self.chunks(role))
        return self.strategy(dims=self.dims, codecs=codecs, kind=self.codec_kind, **extra)

    def on(self, geometry: GeometryHooks) -> Draw:
        """This codec's draw on ``geometry``: its windows and sinks, head dims capped."""
        dims = self.dims
        if geometry.max_dim is not None:
            dims = tuple(d for d in dims if d <= geometry.max_dim)
        return replace(
            self, dims=dims, windows=geometry.windows, keeps=geometry.keeps, chunks=geometry.chunks
        )


#: Where a family's verify rounds run: ``"modifier"``, its verify layouts join the
#: speculative family (the modifier's rules composed onto the storage's machine);
#: ``"family"``, its own machine composes them (a layout in every role: turbo, paged);
#: ``"own"``, its rules run rounds of their own (latent, recurrent).
Rounds = Literal["modifier", "family", "own"]


# ---------------------------------------------------------------------------- the axes
@dataclass(frozen=True)
class CodecHooks:
    """A codec (the row of its spec class): ``draw`` how an example draws its parameters
    and head dims, ``rules`` its rules (its model, its invalid merges; ``None``: the base
    machine's), ``rounds`` where its verify rounds run (when its geometry has no rules),
    ``tolerance_key`` its rows of the tolerance table, ``peer`` mlx-lm's cache of the
    codec, ``family`` the family of its growing storages, ``tensors`` its writer;
    ``qualifier`` names it in a geometry's family and tolerance key (``paged-affine``,
    ``rotating-affine``; empty for the plain codec, the geometry's own)."""

    tolerance_key: str
    family: str
    qualifier: str
    draw: Draw = Draw()
    rules: Loader | None = None
    rounds: Rounds = "modifier"
    peer: PeerChoice = None
    tensors: str = "kv"
    #: How a delayed modifier's example draws a target of this codec: its parameters by
    #: the table's names and the head ``dim`` (narrower than ``draw``: conversions
    #: mid-batch need the longer runs); ``None`` for a codec no row converts to.
    delayed: Callable[[st.DrawFn], dict[str, int]] | None = None


@dataclass(frozen=True)
class GeometryHooks:
    """A geometry kind: ``rules`` its rules (``None``: the codec's alone), composed over
    the codec's unless ``codec_rules`` is false (a ring's rules hold its codecs' invalid
    merges); ``by_codec`` a machine of its own for a codec (the latent pool);
    ``round_rules`` what verify rounds add on it (a ring: rounds across the window);
    ``rounds`` where its rounds run (as for a codec, when it has rules); ``windows``
    (by the layout's role) and ``keeps`` its draw, ``max_dim`` a cap on the codec's head
    dims; ``family`` names its families (``None``: the codec's family), ``codec_suffix``
    adds the codec's qualifier; ``tolerance_prefix`` keys a codec's tolerances
    (``rotating`` + ``-affine``); ``peer`` mlx-lm's cache of the geometry; ``codecs``:
    the codecs a storage of ``any`` codec is driven with in the CI profile."""

    rules: Loader | None = None
    codec_rules: bool = True
    by_codec: Mapping[str, Loader] = field(default_factory=lambda: MappingProxyType({}))
    round_rules: Loader | None = None
    rounds: Rounds = "modifier"
    windows: Callable[[str], st.SearchStrategy[int]] | None = None
    keeps: Callable[[int], st.SearchStrategy[int]] | None = None
    chunks: Callable[[str], st.SearchStrategy[int]] | None = None
    max_dim: int | None = None
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
    ``peer``: mlx-lm's cache of these tensors (:data:`DEFER`: the geometry's or codec's);
    ``rules``: the rules that write blocks (``machines.KvRules``: ``update_and_fetch``;
    the latent's three tensors; recurrent planes), last in the composition, over the
    root; ``rounds``: where their verify rounds run (``own``: in the writer's rules).
    """

    rules: Loader
    rounds: Rounds | None = None
    shared_column: bool | None = None
    trim_rows: bool | None = None
    parity_from_table: bool = True
    unmirrored: frozenset[str] = frozenset()
    siblings: bool = True
    peer: PeerChoice = DEFER


@dataclass(frozen=True)
class ModifierRules:
    """A modifier's family: its rules (composed onto the storage's machine; ``own``: the
    family's machine alone, its rows of two codecs), its family name (``-<codec>`` added
    for a codec other than ``default_codec``; ``None``: one family for every codec), and
    whether its layouts have an mlx-lm peer."""

    family: str
    rules: Loader
    own: bool = False
    default_codec: str | None = None
    peer: bool = True


#: Every supported affine codec, ``(bits, group_size)``, and the head dims its examples use.
AFFINE = Draw(
    dims=(32, 64, 128),
    params=tuple((bits, group) for bits in SUPPORTED_BITS for group in SUPPORTED_GROUP_SIZES),
)
#: Every supported TurboQuant codec, ``(k_bits, v_bits)``, at every head dim it stores.
TURBO = Draw(
    strategy=ks.turbo_geometries,
    dims=TURBO_HEAD_DIMS,
    params=tuple((k, v) for k in TURBO_KEY_BITS for v in TURBO_VALUE_BITS),
)
#: Every microscaling mode, ``(bits, group_size)``, at head dims of both groups.
MICROSCALED = Draw(dims=(32, 64), params=tuple((bits, group) for group, bits in MX_MODES.values()))


def _delayed_turbo(draw: st.DrawFn) -> dict[str, int]:
    """Every width; head dims up to 256 (the turbo family covers 512)."""
    k_bits, v_bits = draw(st.sampled_from(TURBO.params), label="(k_bits, v_bits)")
    dim = draw(st.sampled_from((64, 64, 128, 256)), label="head dim")
    return {"k_bits": k_bits, "v_bits": v_bits, "dim": dim}


def _delayed_microscaled(draw: st.DrawFn) -> dict[str, int]:
    """Every mode at head dim 64."""
    bits, group = draw(st.sampled_from(MICROSCALED.params), label="(bits, group size)")
    return {"bits": bits, "group_size": group, "dim": 64}


CODEC_HOOKS: Mapping[type[CodecSpec], CodecHooks] = MappingProxyType(
    {
        Plain: CodecHooks("plain", "plain", "", peer=plain_peer),
        Affine: CodecHooks(
            "affine",
            "affine",
            "affine",
            draw=AFFINE,
            rules=load("rules", "AffineRules"),
            peer=affine_peer,
            delayed=lambda draw: {
                "bits": draw(st.sampled_from((4, 8)), label="bits"),
                "group_size": draw(st.sampled_from((32, 64)), label="group size"),
                "dim": 64,
            },
        ),
        # Its one layout serves every role: the family runs verify rounds; mlx-lm has no
        # TurboQuant cache.
        Turbo: CodecHooks(
            "turbo",
            "turbo",
            "turbo",
            draw=TURBO,
            rules=load("rules", "TurboRules"),
            rounds="family",
            delayed=_delayed_turbo,
        ),
        # One layout serves every role (rounds in the family); no mlx-lm peer. Both
        # implementations attend over the same exactly decoded values in float32: the
        # affine family's tolerance rows hold (spec/tolerances.md).
        Microscaled: CodecHooks(
            "affine",
            "mx",
            "mx",
            draw=MICROSCALED,
            rounds="family",
            delayed=_delayed_microscaled,
        ),
        # MLA latent storages grow (the growing geometry); their writer's rules run rounds.
        Latent: CodecHooks("latent", "latent", "latent", tensors="latent"),
        State: CodecHooks("recurrent", "recurrent", "state", tensors="recurrent"),
    }
)

GEOMETRY_HOOKS: Mapping[str, GeometryHooks] = MappingProxyType(
    {
        "growing": GeometryHooks(),
        # Both codecs' rings in one family (the ring's rules hold both codecs' invalid
        # merges; quantized rings at head dims up to 64); mlx-lm's rings are the peer of
        # both.
        "ring": GeometryHooks(
            rules=load("rules", "RingRules"),
            codec_rules=False,
            round_rules=load("rules", "RingRoundRules"),
            windows=ks.ring_windows,
            keeps=ks.ring_keeps,
            max_dim=64,
            family="rotating",
            tolerance_prefix="rotating",
            peer=ring_peer,
        ),
        # Chunked-local attention (issue 25): the growing machine over the chunked model
        # (``strategies.Geometry.chunk_size``: retention and visibility restated). mlx-lm's
        # ChunkedKVCache trims only when llama4 calls ``maybe_trim_front`` and has no
        # ``make_mask``: its parity runs inside llama4 (tests/test_chunked.py).
        "chunked": GeometryHooks(chunks=ks.attention_chunks, family="chunked", peer=None),
        "recurrent": GeometryHooks(family="recurrent"),
    }
)

#: The placements other than contiguous buffers (a row of the same kind as a geometry's:
#: its rules stand where a contiguous storage's geometry rules do).
PLACEMENT_HOOKS: Mapping[str, GeometryHooks] = MappingProxyType(
    {
        # mlx-lm has no paged cache; a paged KV storage runs with plain and affine pools,
        # in every role (rounds included); latent planes in a pool have their own machine.
        "paged": GeometryHooks(
            rules=load("rules", "PagedRules"),
            by_codec=MappingProxyType({"latent": load("paged_latent", "PagedLatentMachine")}),
            rounds="family",
            family="paged",
            codec_suffix=True,
            peer=None,
            codecs=("plain", "affine", "mx"),
        ),
    }
)

WRITERS: Mapping[str, WriterHooks] = MappingProxyType(
    {
        # Blocks by ``update_and_fetch``; leases and save/load across implementations
        # checked on a cadence that draws nothing (``machines.OpsChecks``: issue 24).
        "kv": WriterHooks(
            rules=cast(Loader, compose(load("machines", "OpsChecks"), load("machines", "KvRules")))
        ),
        # Three tensors on one token axis, every layout rolled back by row; mlx-lm's
        # KVCache pairs twin a latent held plain (mlx-lm has no encoded latent cache).
        # Leases and save/load on ``OpsChecks``' cadence, composed after the writer's
        # rules, whose hooks fit it to their world model (requests and a layout).
        "latent": WriterHooks(
            rules=cast(
                Loader, compose(load("latent", "LatentMachine"), load("machines", "OpsChecks"))
            ),
            rounds="own",
            shared_column=True,
            trim_rows=True,
            parity_from_table=False,
            unmirrored=frozenset({"EncodedLatentCache"}),
            siblings=False,
            peer=plain_peer,
        ),
        # Planes written by the layer and advanced: no token axis to share or roll back;
        # mlx-lm's ArraysCache twins every row (the machine makes it). Leases and
        # save/load as the latent's.
        "recurrent": WriterHooks(
            rules=cast(
                Loader,
                compose(load("recurrent", "RecurrentMachine"), load("machines", "OpsChecks")),
            ),
            rounds="own",
            shared_column=False,
            trim_rows=False,
            parity_from_table=False,
            siblings=False,
        ),
    }
)

MODIFIER_RULES: Mapping[str, ModifierRules] = MappingProxyType(
    {
        # Verify rounds composed onto the storage's machine (``rules.RoundRules``).
        "speculative": ModifierRules("speculative", rules=load("rules", "RoundRules")),
        # Rows of two codecs (bf16, then the codec): rules of their own and solo legos.
        "delayed": ModifierRules(
            "delayed",
            rules=load("delayed", "DelayedMachine"),
            own=True,
            default_codec="affine",
            peer=False,
        ),
    }
)
