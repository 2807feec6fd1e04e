"""The affine family's conformance machine: the shared machine at a codec drawn per example.

Every example draws one affine codec, ``(bits, group_size)`` with bits in {2, 3, 4, 5, 6,
8} and group sizes in {32, 64, 128}, and head dims (32, 64, 128) that the group divides;
then it runs :class:`~kvrows.conformance.machines.ConformanceMachine`'s rules over
``QuantizedKVCache`` and one of its layouts (``PaddedQuantKVRows``,
``BatchedQuantizedKVCache``). What differs from the plain family:

* **Stored planes** are the triples ``(packed uint32, scales, biases)``; the NumPy model of
  a request is the reference codec (``kvrows.reference.affine_codec.quantize``) applied to
  the request's whole token history at once, so "bit-exact" compares each implementation's
  codes, scales and biases with quantizing the history in one go (token slicing commutes
  with the codec; row operations never re-quantize).
* **Fetched triples** (``update_and_fetch`` / ``fetch`` return two triples) are compared as
  one byte array per triple: each plane's bytes along its last axis, concatenated
  (:func:`fuse_planes`), at every mask-visible position, exactly.
* **mlx-lm parity** is serial only (mlx-lm's ``QuantizedKVCache`` has no batch class):
  offsets, stored triples, masks, trims and attention through
  ``mlx_lm.models.base.scaled_dot_product_attention`` (its quantized path). Two named
  skips (``kvrows.conformance.parity``): ``A1``, the head dims where mlx-lm's packed width
  ``D // (32 // bits)`` is wrong (its first update raises), and ``A2``, grouped queries
  with a value head dim unlike the key head dim (its attention's reshape raises).
* **Invalid operations** add the codec's own (:meth:`AffineMachine.invalid_codec`): rows of
  another bit width or group size, plain caches and layouts, head dims the group does not
  divide; each must raise the named error type in both implementations and change nothing.
* **Serial prompt chunks** compare attention on their last :data:`ATTENDED_QUERIES`
  queries (masks whole); layout steps (at most 5 tokens) compare every query.

Per-example state (the implementations' constructors, the mlx-lm twin's class) is bound on
the machine instance in :meth:`AffineMachine._begin`, shadowing the class-level defaults
that :func:`~kvrows.conformance.machines.machine_class` sets. Hypothesis mutates an example
several times before it draws a new first choice, so a budget of a few dozen examples
reaches only part of the 18 codecs: ``affine_machine_class(..., codecs=[...])`` restricts
the draw, and ``tests/test_conformance.py`` sweeps every codec with a few examples each.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvrows.affine_geometry import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, packed_width
from kvrows.conformance import strategies as ks
from kvrows.conformance.arrays import random_block
from kvrows.conformance.families import Family, Impl, PeerSpec, optimized_impl, reference_impl
from kvrows.conformance.machines import (
    ConformanceMachine,
    Limits,
    Track,
    _update_with,
    machine_class,
)
from kvrows.conformance.stats import Stats
from kvrows.conformance.tolerances import DTYPES
from kvrows.errors import IncompatibleRowsError, InvalidInputError, KvRowsError
from kvrows.reference.affine_codec import quantize

__all__ = [
    "AFFINE_CLASSES",
    "ATTENDED_QUERIES",
    "CODECS",
    "HEAD_DIMS",
    "AffineGeometry",
    "AffineMachine",
    "CodecImpl",
    "affine_geometries",
    "affine_impl",
    "affine_machine_class",
    "affine_peer",
    "fuse_planes",
    "mlx_lm_packed_width",
]

Array = npt.NDArray[Any]

#: The affine family's classes (constructed with ``(group_size, bits)``).
AFFINE_CLASSES = ("QuantizedKVCache", "PaddedQuantKVRows", "BatchedQuantizedKVCache")
#: Plain classes the invalid-operation rules try to merge into an affine layout.
_PLAIN_CLASSES = ("KVCache", "PaddedKVRows", "BatchedKVCache")
#: Every supported codec, ``(bits, group_size)``.
CODECS: tuple[tuple[int, int], ...] = tuple(
    (bits, group) for bits in SUPPORTED_BITS for group in SUPPORTED_GROUP_SIZES
)
#: Head dims the examples use (those the example's group size divides).
HEAD_DIMS = (32, 64, 128)
#: A serial prompt chunk's attention is compared on its last this many queries: every row
#: runs the same kernel under the same mask rule (the masks are compared whole), and CPU
#: float16 ``quantized_matmul`` is slow enough that whole 256-token chunks would dominate.
ATTENDED_QUERIES = 8


def mlx_lm_packed_width(dim: int, bits: int) -> int:
    """The packed width mlx-lm's ``QuantizedKVCache`` allocates: ``D // (32 // bits)`` words."""
    return dim // (32 // bits)


def _last_rows(mask: Any, m: int) -> Any:
    """A mask for ``n`` queries, restricted to its last ``m`` queries (``"causal"`` is
    bottom-right aligned, so it stays ``"causal"``)."""
    if mask is None or isinstance(mask, str):
        return mask
    return mask[..., -m:, :]


def fuse_planes(planes: tuple[Array, ...]) -> Array:
    """A triple (any planes ``[..., W_i]``) as one uint8 array: each plane's bytes along
    its last axis, concatenated. Equal bytes at a position iff every plane is equal there."""
    return np.concatenate([np.ascontiguousarray(p).view(np.uint8) for p in planes], axis=-1)


@dataclass(frozen=True)
class AffineGeometry(ks.Geometry):
    """One example's shapes and codec."""

    bits: int = 8
    group_size: int = 64

    @property
    def codec(self) -> str:
        return f"bits={self.bits} group={self.group_size}"

    @property
    def mlx_lm_width_bug(self) -> bool:
        """mlx-lm's packed width differs from ``mx.quantize``'s for a head dim (skip A1)."""
        return any(
            mlx_lm_packed_width(dim, self.bits) != packed_width(dim, self.bits)
            for dim in (self.key_dim, self.value_dim)
        )

    @property
    def mlx_lm_reshape_bug(self) -> bool:
        """mlx-lm's quantized attention cannot reshape its output (skip A2)."""
        return self.query_heads > self.heads and self.value_dim != self.key_dim


@st.composite
def affine_geometries(
    draw: st.DrawFn, codecs: Sequence[tuple[int, int]] = CODECS
) -> AffineGeometry:
    """An example's geometry at one of ``codecs`` (``(bits, group_size)`` pairs)."""
    bits, group = draw(st.sampled_from(tuple(codecs)), label="(bits, group size)")
    dims = tuple(d for d in HEAD_DIMS if d % group == 0)
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    heads = draw(st.sampled_from((1, 2, 4)), label="heads")
    per_head = draw(st.sampled_from((1, 2)), label="query heads per KV head")
    key_dim = draw(st.sampled_from(dims), label="key_dim")
    value_dim = draw(st.sampled_from(dims), label="value_dim")
    return AffineGeometry(dtype, heads, heads * per_head, key_dim, value_dim, bits, group)


@dataclass(frozen=True)
class CodecImpl(Impl):
    """An implementation whose affine classes are constructed with ``codec`` =
    ``(group_size, bits)``, and whose ``to_numpy`` fuses a triple (:func:`fuse_planes`)."""

    codec: tuple[int, int] | None = None

    def new(self, name: str) -> Any:
        cls = self.cls(name)
        if name in AFFINE_CLASSES and self.codec is not None:
            return cls(*self.codec)
        return cls()


def affine_impl(base: Impl) -> CodecImpl:
    """``base`` with the affine and plain classes of its implementation added where it has
    none (a mutant's replaced class stays), and triples fused by ``to_numpy``."""
    if isinstance(base, CodecImpl):
        return base
    module = importlib.import_module(
        "kvrows.reference" if base.name == "reference" else "kvrows.optimized"
    )
    classes = {name: getattr(module, name) for name in (*AFFINE_CLASSES, *_PLAIN_CLASSES)}
    classes.update(base.classes)
    plane_to_numpy = base.to_numpy

    def to_numpy(value: Any) -> Array:
        if isinstance(value, tuple):
            return fuse_planes(tuple(plane_to_numpy(p) for p in value))
        return plane_to_numpy(value)

    return CodecImpl(
        name=base.name,
        classes=MappingProxyType(classes),
        attend=base.attend,
        to_native=base.to_native,
        to_numpy=to_numpy,
    )


def _lm_serial_kv(cache: Any) -> tuple[tuple[Any, ...], tuple[Any, ...]] | None:
    """What an mlx-lm ``QuantizedKVCache`` holds: two triples ``[B, H, offset, ·]``."""
    if cache.keys is None:
        return None
    end = int(cache.offset)
    return (
        tuple(p[:, :, :end] for p in cache.keys),
        tuple(p[:, :, :end] for p in cache.values),
    )


def _lm_attention(queries: mx.array, keys: Any, values: Any, **kwargs: Any) -> mx.array:
    """mlx-lm's attention (its quantized path for a cache with ``bits``), on a copy of the
    queries: ``quantized_scaled_dot_product_attention`` scales them with ``*=``, in place."""
    from mlx_lm.models.base import scaled_dot_product_attention

    out: mx.array = scaled_dot_product_attention(mx.array(queries), keys, values, **kwargs)
    return out


def affine_peer(group_size: int = 64, bits: int = 8) -> PeerSpec:
    """mlx-lm's ``QuantizedKVCache(group_size, bits)`` (serial only: it has no batch class)."""
    from mlx_lm.models.cache import QuantizedKVCache

    return PeerSpec(
        serial=lambda: QuantizedKVCache(group_size=group_size, bits=bits),
        batch=None,
        attention=_lm_attention,
        serial_kv=_lm_serial_kv,
        batch_kv=lambda cache: None,
    )


#: An invalid operation the codec rule tries: (label, call(impl, target), expected error).
_Case = tuple[str, Callable[[Impl, Any], object], type[KvRowsError]]


class AffineMachine(ConformanceMachine):
    """The shared rules at one affine codec per example (see the module docstring)."""

    ref_impl: ClassVar[CodecImpl]
    opt_impl: ClassVar[CodecImpl]

    def __init__(self) -> None:
        super().__init__()
        self._model: dict[tuple[int, int], tuple[Array, ...]] = {}

    @property
    def ag(self) -> AffineGeometry:
        geo = self.g
        assert isinstance(geo, AffineGeometry)
        return geo

    def _bind(self, name: str, value: object) -> None:
        """Shadow a class-level default (a ``ClassVar`` of the base) for this example."""
        vars(self)[name] = value

    # ------------------------------------------------------------------ setup
    @initialize(geo=affine_geometries())
    def setup(self, geo: ks.Geometry) -> None:
        self._begin(geo)

    def _begin(self, geo: ks.Geometry) -> None:
        """Bind the example's codec: constructors, and the mlx-lm twin (none under A1)."""
        assert isinstance(geo, AffineGeometry)
        self.geo = geo
        codec = (geo.group_size, geo.bits)
        self._bind("ref_impl", replace(type(self).ref_impl, codec=codec))
        self._bind("opt_impl", replace(type(self).opt_impl, codec=codec))
        peer = None
        if type(self).peer is not None and not geo.mlx_lm_width_bug:
            peer = affine_peer(geo.group_size, geo.bits)
        self._bind("peer", peer)
        note(f"geometry: {geo}")

    def teardown(self) -> None:
        if self.geo is not None and self.stats.steps > self._steps_at_start:
            self.stats.variant(self.ag.codec)
        super().teardown()

    # ---------------------------------------------------------------- helpers
    def _new_track(self) -> Track:
        if type(self).peer is not None and self.ag.mlx_lm_width_bug:
            self._skip("A1", f"no mlx-lm QuantizedKVCache twin at {self.ag}")
        return super()._new_track()

    def _model_planes(self, track: Track) -> tuple[Array, ...]:
        """The reference codec over the request's whole history (memoized per history)."""
        key = (track.ident, len(track.history))
        planes = self._model.get(key)
        if planes is None:
            g = self.ag
            planes = (
                *quantize(track.keys, g.group_size, g.bits),
                *quantize(track.values, g.group_size, g.bits),
            )
            self._model[key] = planes
        return planes

    def _serial_append(
        self, track: Track, keys: Array, values: Array, queries: Array, form: ks.MaskForm
    ) -> None:
        """The base rule's serial append, with attention compared on the chunk's last
        :data:`ATTENDED_QUERIES` queries (masks are compared whole) and skip ``A2``."""
        ref, opt, g = self.ref_impl, self.opt_impl, self.ag
        n = int(keys.shape[2])
        kw = form.kwargs()
        twin = track.lm
        masks = [track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)]
        if twin is not None:
            masks.append(twin.make_mask(n, **form.mlx_lm_kwargs()))
        self._masks_equal(f"request {track.ident} mask({n}, {form})", masks, 1, n, track.tokens + n)
        k_opt, v_opt = opt.to_native(keys), opt.to_native(values)
        track.ref.update_and_fetch(keys, values)
        track.opt.update_and_fetch(k_opt, v_opt)
        m = min(n, ATTENDED_QUERIES)
        q = queries[:, :, n - m :]
        q_opt = opt.to_native(q)
        last = [_last_rows(mask, m) for mask in masks]
        out_ref = ref.to_numpy(ref.attend(q, track.ref, last[0], g.scale))
        out_opt = opt.to_numpy(opt.attend(q_opt, track.opt, last[1], g.scale))
        self._close("attention", f"request {track.ident} attention", out_opt, out_ref)
        if twin is not None and self.peer is not None:
            lk, lv = twin.update_and_fetch(k_opt, v_opt)
            if g.mlx_lm_reshape_bug:
                self._skip("A2", f"mlx-lm attention at {g}")
            else:
                out_lm = self.peer.attention(q_opt, lk, lv, cache=twin, scale=g.scale, mask=last[2])
                self._close(
                    "attention.mlx_lm",
                    f"request {track.ident} attention",
                    out_opt,
                    opt.to_numpy(out_lm),
                )
        self._record_append(track, keys, values)

    def _foreign_cache(self, impl: Impl, what: str) -> Any:
        """As the base, but another key dim is one more group (a valid affine head dim)."""
        if what != "key_dim":
            return super()._foreign_cache(impl, what)
        g = self.ag
        rng = np.random.default_rng(1)
        cache = impl.new(self.family.serial)
        k = random_block(rng, (1, g.heads, 2, g.key_dim + g.group_size), g.dtype)
        v = random_block(rng, (1, g.heads, 2, g.value_dim), g.dtype)
        cache.update_and_fetch(impl.to_native(k), impl.to_native(v))
        return cache

    # ------------------------------------------------------ invalid codec use
    def _filled(self, impl: Impl, cache: Any, *, key_dim: int | None = None) -> Any:
        """``cache`` after one append of two tokens of the example's geometry."""
        g = self.ag
        rng = np.random.default_rng(4)
        k = random_block(rng, (1, g.heads, 2, key_dim or g.key_dim), g.dtype)
        v = random_block(rng, (1, g.heads, 2, g.value_dim), g.dtype)
        cache.update_and_fetch(impl.to_native(k), impl.to_native(v))
        return cache

    def _other_codec(self, impl: Impl, what: str) -> Any:
        """A ``QuantizedKVCache`` of another bit width or group size (holding tokens when
        the example's head dims allow its group size; empty otherwise)."""
        g = self.ag
        cls = impl.cls(self.family.serial)
        if what == "bits":
            other_bits = next(b for b in SUPPORTED_BITS if b != g.bits)
            return self._filled(impl, cls(g.group_size, other_bits))
        group = next(s for s in SUPPORTED_GROUP_SIZES if s != g.group_size)
        cache = cls(group, g.bits)
        if g.key_dim % group == 0 and g.value_dim % group == 0:
            return self._filled(impl, cache)
        return cache

    def _bad_dim_blocks(self, rows: int) -> list[tuple[str, Callable[[Impl], tuple[Any, Any]]]]:
        """Blocks whose key or value head dim the group does not divide."""
        g = self.ag
        rng = np.random.default_rng(5)
        b = max(rows, 1)

        def block(dk: int, dv: int) -> Callable[[Impl], tuple[Any, Any]]:
            k = random_block(rng, (b, g.heads, 1, dk), g.dtype)
            v = random_block(rng, (b, g.heads, 1, dv), g.dtype)
            return lambda impl: (impl.to_native(k), impl.to_native(v))

        return [
            (f"a key head dim {g.key_dim + 8}", block(g.key_dim + 8, g.value_dim)),
            (f"a value head dim {g.value_dim + 16}", block(g.key_dim, g.value_dim + 16)),
            ("head dims 16 (below the group)", block(16, 16)),
        ]

    def _codec_serial_cases(self, track: Track) -> list[_Case]:
        rows = 1 if track.appended else 0
        return [
            (
                f"serial update with {label} the group {self.ag.group_size} does not divide",
                _update_with(make),
                InvalidInputError,
            )
            for label, make in self._bad_dim_blocks(rows)
        ]

    def _codec_layout_cases(self, slot: Any) -> list[_Case]:
        g = self.ag
        serial = self.family.serial
        cases: list[_Case] = [
            (
                "merge_rows of a QuantizedKVCache of another bit width",
                lambda impl, lay: lay.merge_rows([self._other_codec(impl, "bits")]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a QuantizedKVCache of another group size",
                lambda impl, lay: lay.merge_rows([self._other_codec(impl, "group")]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a valid QuantizedKVCache and one of another bit width",
                lambda impl, lay: lay.merge_rows(
                    [self._filled(impl, impl.new(serial)), self._other_codec(impl, "bits")]
                ),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a plain KVCache holding tokens",
                lambda impl, lay: lay.merge_rows([self._filled(impl, impl.new("KVCache"))]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of an empty plain KVCache",
                lambda impl, lay: lay.merge_rows([impl.new("KVCache")]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a plain PaddedKVRows holding a row",
                lambda impl, lay: lay.merge_rows([self._plain_layout(impl, "PaddedKVRows")]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a plain BatchedKVCache holding a row",
                lambda impl, lay: lay.merge_rows([self._plain_layout(impl, "BatchedKVCache")]),
                IncompatibleRowsError,
            ),
            (
                "merge_rows of a layout of another bit width holding a row",
                lambda impl, lay: lay.merge_rows([self._other_layout(impl)]),
                IncompatibleRowsError,
            ),
        ]
        if slot.rows:
            for label, make in self._bad_dim_blocks(len(slot.rows)):
                cases.append(
                    (
                        f"update with {label} the group {g.group_size} does not divide",
                        _update_with(make),
                        InvalidInputError,
                    )
                )
        return cases

    def _plain_layout(self, impl: Impl, name: str) -> Any:
        layout = impl.new(name)
        layout.merge_rows([self._filled(impl, impl.new("KVCache"))])
        return layout

    def _other_layout(self, impl: Impl) -> Any:
        g = self.ag
        other_bits = next(b for b in SUPPORTED_BITS if b != g.bits)
        layout = impl.cls(self.spec.name)(g.group_size, other_bits)
        layout.merge_rows([self._other_codec(impl, "bits")])
        return layout

    @precondition(lambda self: self.geo is not None and (bool(self.pool) or bool(self.slots)))
    @rule(data=st.data())
    def invalid_codec(self, data: st.DataObject) -> None:
        """A call the codec must refuse: the named error in both implementations, no change."""
        targets: list[tuple[str, Any, Any, list[_Case]]] = []
        for t in self.pool:
            targets.append((f"request {t.ident}", t.ref, t.opt, self._codec_serial_cases(t)))
        for s in self.slots:
            targets.append((f"layout {s.ident}", s.ref, s.opt, self._codec_layout_cases(s)))
        name, ref_obj, opt_obj, cases = self._pick(data, targets, "target")
        label, call, expected = self._pick(data, cases, "invalid codec operation")
        note(f"invalid_codec: {name}: {label}")
        self.stats.op("invalid_codec")
        before = self._everything()
        for impl, obj in ((self.ref_impl, ref_obj), (self.opt_impl, opt_obj)):
            try:
                call(impl, obj)
            except KvRowsError as error:
                if type(error) is not expected:
                    raise AssertionError(
                        f"{impl.name}: {label} raised {type(error).__name__} ({error}), "
                        f"expected {expected.__name__}"
                    ) from error
            except Exception as error:  # any other exception is a contract violation
                raise AssertionError(
                    f"{impl.name}: {label} raised {type(error).__name__} ({error}), "
                    f"not {expected.__name__}"
                ) from error
            else:
                raise AssertionError(f"{impl.name}: {label} did not raise")
        self._exact(
            f"{label}: every cache unchanged after the failed call", self._everything(), before
        )
        self.stats.check("codec error types")


def affine_machine_class(
    family: Family,
    layout: str,
    *,
    stats: Stats | None = None,
    reference: Impl | None = None,
    optimized: Impl | None = None,
    parity: bool = True,
    limits: Limits | None = None,
    enforce: bool = True,
    name: str | None = None,
    codecs: Sequence[tuple[int, int]] | None = None,
) -> type[AffineMachine]:
    """:func:`~kvrows.conformance.machines.machine_class` for the affine family.

    ``reference`` / ``optimized`` may be plain :class:`Impl`\\ s (a mutant:
    ``optimized_impl().with_classes({"PaddedQuantKVRows": Mutant})``); the affine classes
    they lack are added (:func:`affine_impl`). ``codecs`` restricts the examples to those
    ``(bits, group_size)`` pairs (default: every supported codec).
    """
    base = machine_class(
        family,
        layout,
        stats=stats,
        reference=affine_impl(reference or reference_impl()),
        optimized=affine_impl(optimized or optimized_impl()),
        parity=parity,
        limits=limits,
        enforce=enforce,
        name=name,
    )
    names = ("family", "spec", "ref_impl", "opt_impl", "peer", "stats", "limits", "enforce")
    attrs: dict[str, Any] = {key: getattr(base, key) for key in names}
    attrs.update(__module__=__name__, __doc__=base.__doc__)
    if codecs is not None:

        @initialize(geo=affine_geometries(tuple(codecs)))
        def setup(self: AffineMachine, geo: ks.Geometry) -> None:
            self._begin(geo)

        attrs["setup"] = setup
    return type(base.__name__, (AffineMachine,), attrs)
