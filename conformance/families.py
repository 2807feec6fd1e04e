"""What the state machines drive: implementations, storage families and their layouts.

An :class:`Impl` is one implementation of the contract (the NumPy reference,
the MLX optimized one, or a mutant of it in the teeth tests): classes are
resolved by name, as both implementations mirror each other's names, and a
mutant is the same table with one class replaced.

A :class:`Family` is a row of the storage table the machines are generated
from: its serial class, its layouts (each with the operations it supports),
its tolerance key and its mlx-lm peers. Later issues add affine, rotating, …
families by adding entries to :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import mlx.core as mx
import numpy as np
import numpy.typing as npt

from kvrows.conformance.arrays import from_mlx, to_mlx

Planes = tuple[Any, ...]

__all__ = [
    "FAMILIES",
    "Family",
    "Impl",
    "LayoutSpec",
    "PeerSpec",
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


def _classes(module: Any, names: tuple[str, ...]) -> Mapping[str, type]:
    return MappingProxyType({name: getattr(module, name) for name in names})


_PLAIN_CLASSES = ("KVCache", "PaddedKVRows", "BatchedKVCache")


def reference_impl() -> Impl:
    """``kvrows.reference``: NumPy arrays in, NumPy arrays out."""
    import kvrows.reference as reference

    return Impl(
        name="reference",
        classes=_classes(reference, _PLAIN_CLASSES),
        attend=reference.attend,
        to_native=lambda array: np.array(array, copy=True),
        to_numpy=_numpy_identity,
    )


def optimized_impl() -> Impl:
    """``kvrows.optimized``: MLX arrays (converted exactly from the NumPy data)."""
    import kvrows.optimized as optimized

    return Impl(
        name="optimized",
        classes=_classes(optimized, _PLAIN_CLASSES),
        attend=optimized.attend,
        to_native=to_mlx,
        to_numpy=_mlx_to_numpy,
    )


@dataclass(frozen=True)
class PeerSpec:
    """mlx-lm's classes for a family: the serial cache and the shared-column batch.

    ``batch`` must offer mlx-lm's ``merge`` (classmethod), ``extend``, ``filter``,
    ``extract``, ``trim``, ``make_mask``, ``update_and_fetch``, ``left_padding``,
    ``offset`` and ``_idx``; ``attention`` is the attention models call.
    """

    serial: Callable[[], Any]
    batch: Any
    attention: Callable[..., Any]
    serial_kv: Callable[[Any], tuple[Planes, Planes] | None]
    batch_kv: Callable[[Any], tuple[Planes, Planes] | None]


def _plain_serial_kv(cache: Any) -> tuple[Planes, Planes] | None:
    """What an mlx-lm ``KVCache`` holds: ``[B, H, offset, D]`` (observed, not fetched)."""
    if cache.keys is None:
        return None
    end = int(cache.offset)
    return (cache.keys[:, :, :end],), (cache.values[:, :, :end],)


def _plain_batch_kv(cache: Any) -> tuple[Planes, Planes] | None:
    """What an mlx-lm ``BatchKVCache`` holds: ``[B, H, _idx, D]`` (``None`` before any token)."""
    if cache.keys is None:
        return None
    end = int(cache._idx)
    return (cache.keys[:, :, :end],), (cache.values[:, :, :end],)


def _plain_peer() -> PeerSpec:
    from mlx_lm.models.base import scaled_dot_product_attention
    from mlx_lm.models.cache import BatchKVCache, KVCache

    return PeerSpec(
        serial=KVCache,
        batch=BatchKVCache,
        attention=scaled_dot_product_attention,
        serial_kv=_plain_serial_kv,
        batch_kv=_plain_batch_kv,
    )


def _plain_encode(block: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], ...]:
    """The planes a plain cache stores for ``block``: the block itself."""
    return (block,)


def _affine_encode(block: npt.NDArray[Any]) -> tuple[npt.NDArray[Any], ...]:
    """Affine planes depend on the example's (bits, group size): the affine machine encodes."""
    raise NotImplementedError("the affine family encodes per example (kvrows.conformance.affine)")


def _affine_peer() -> PeerSpec:
    from kvrows.conformance.affine import affine_peer

    return affine_peer()


def _affine_machine(*args: Any, **kwargs: Any) -> type[Any]:
    from kvrows.conformance.affine import affine_machine_class

    return affine_machine_class(*args, **kwargs)


def _ring_machine(*args: Any, **kwargs: Any) -> type[Any]:
    from kvrows.conformance.rings import ring_machine_class

    return ring_machine_class(*args, **kwargs)


@dataclass(frozen=True)
class LayoutSpec:
    """One row layout of a family and what its machine may do with it.

    ``shared_column``: rows share one write column (decode layout, mlx-lm
    ``BatchKVCache`` parity); otherwise rows are ragged (prefill/verify).
    ``trim_rows``: the layout has per-row rollback ``trim_rows(counts)``.
    ``peer``: mlx-lm mirrors this layout with the family's ``PeerSpec.batch``.
    """

    name: str
    role: str
    shared_column: bool
    trim_rows: bool
    peer: bool


@dataclass(frozen=True)
class Family:
    """A storage family: its serial class, its layouts and how to compare them."""

    name: str
    serial: str
    layouts: tuple[LayoutSpec, ...]
    tolerance_key: str
    encode: Callable[[npt.NDArray[Any]], tuple[npt.NDArray[Any], ...]]
    peer: Callable[[], PeerSpec] | None = None
    description: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: Builds the family's machine classes, with ``machines.machine_class``'s signature
    #: (``None``: ``machine_class`` itself); a family whose examples draw parameters of
    #: their own (the affine codec's bits and group size) supplies a subclass's factory.
    machine: Callable[..., type[Any]] | None = None
    #: The share of the profile's ``max_examples`` the family's machines run (an example of
    #: a costlier family takes longer; ``runner.family_settings`` applies it).
    examples: float = 1.0

    def layout(self, name: str) -> LayoutSpec:
        for spec in self.layouts:
            if spec.name == name:
                return spec
        raise KeyError(f"family {self.name!r} has no layout {name!r}")


FAMILIES: dict[str, Family] = {
    "plain": Family(
        name="plain",
        serial="KVCache",
        layouts=(
            LayoutSpec(
                "PaddedKVRows", role="decode", shared_column=True, trim_rows=False, peer=True
            ),
            LayoutSpec(
                "BatchedKVCache", role="prefill", shared_column=False, trim_rows=True, peer=False
            ),
        ),
        tolerance_key="plain",
        encode=_plain_encode,
        peer=_plain_peer,
        description="plain (unquantized) full-attention KV",
    ),
    "affine": Family(
        name="affine",
        serial="QuantizedKVCache",
        layouts=(
            LayoutSpec(
                "PaddedQuantKVRows", role="decode", shared_column=True, trim_rows=False, peer=False
            ),
            LayoutSpec(
                "BatchedQuantizedKVCache",
                role="prefill",
                shared_column=False,
                trim_rows=True,
                peer=False,
            ),
        ),
        tolerance_key="affine",
        encode=_affine_encode,
        peer=_affine_peer,
        description="affine-quantized full-attention KV at every (bits, group size)",
        machine=_affine_machine,
        # Six planes per row and quantized attention: an example costs about twice a
        # plain one; 40% of the profile's examples keeps the CI profile near a minute
        # with the per-codec sweep of tests/test_conformance.py.
        examples=0.4,
    ),
    # Sliding-window rings, both codecs: the serial rings RotatingKVCache and
    # RotatingQuantizedKVCache ride along in every machine (kvrows.conformance.rings
    # picks each layout's serial class and codec; ``encode`` is the plain codec's).
    "rotating": Family(
        name="rotating",
        serial="RotatingKVCache",
        layouts=(
            LayoutSpec(
                "BatchedRotatingCache",
                role="decode",
                shared_column=True,
                trim_rows=False,
                peer=True,
            ),
            LayoutSpec(
                "RaggedRotatingRows",
                role="prefill",
                shared_column=False,
                trim_rows=True,
                peer=False,
            ),
            LayoutSpec(
                "BatchedRotatingQuantCache",
                role="decode",
                shared_column=True,
                trim_rows=False,
                peer=False,
            ),
            LayoutSpec(
                "RotatingAffineLayout",
                role="prefill",
                shared_column=True,
                trim_rows=False,
                peer=False,
            ),
        ),
        tolerance_key="rotating",
        encode=_plain_encode,
        description="sliding-window rings (plain and affine): serial, decode and prefill layouts",
        machine=_ring_machine,
        # An example drives four implementations of a ring (reference, optimized, mlx-lm
        # twins and the model) through every wrap: 45% of the profile keeps the CI
        # profile near a minute for the four layouts on two cores.
        examples=0.45,
    ),
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; known: {sorted(FAMILIES)}") from None
