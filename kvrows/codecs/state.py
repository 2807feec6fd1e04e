"""The state codec's spec: recurrent state stored as the layer writes it (``spec/SSMCache.md``).

A recurrent layer keeps ``N`` tensors per row, ``state.0`` … ``state.{N-1}``, each
``[B, *row_shape]`` of any rank and without a token axis. ``State()`` stores each as it
is written (no encoding, no attention: the layer reads its planes back). What a storage
learns from the first write, or is told up front, is :class:`StateShapes`: each plane's
per-row shape and dtype (``spec/contract.md`` §0.2, the codec's ``Shapes``).

``State`` names no scheme word and its tensors are not ``keys`` / ``values``, so the
places that take only KV codecs (scheme words, block pools) leave it out by its
:meth:`State.tensors` (``kvrows.codecs.registry.is_kv_codec``), never by its kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvrows.codec import DTYPE_SIZES, PlaneSpec, Reads, Role
from kvrows.codecs.registry import SpecParts, register_codec
from kvrows.errors import InvalidInputError
from kvrows.validation import FLOAT_DTYPES

__all__ = ["DEFAULT_PLANES", "PlaneShape", "State", "StateShapes"]

#: Planes a cache built without a size or shapes holds (mlx-lm's ``ArraysCache(2)``).
DEFAULT_PLANES = 2

#: One plane's per-row shape and dtype name.
PlaneShape = tuple[tuple[int, ...], str]


def _shape_of(value: object, what: str) -> tuple[int, ...]:
    """A per-row shape (positive ints, at least one axis; JSON lists accepted)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise InvalidInputError(f"{what} must be a per-row shape of positive ints, got {value!r}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in value):
        raise InvalidInputError(f"{what} must be a per-row shape of positive ints, got {value!r}")
    return tuple(value)


def _dtype_of(value: object, what: str) -> str:
    if value not in FLOAT_DTYPES:
        raise InvalidInputError(f"{what} must be one of {FLOAT_DTYPES}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class StateShapes:
    """What every row of one recurrent layer holds: per plane (``state.i``), its per-row
    shape (any rank, without the row axis) and dtype."""

    planes: tuple[PlaneShape, ...]

    def __post_init__(self) -> None:
        planes = self.planes
        if isinstance(planes, str | bytes) or not isinstance(planes, Sequence) or not planes:
            raise InvalidInputError(
                f"planes must be one (row_shape, dtype) per plane, at least one, got {planes!r}"
            )
        parsed = []
        for i, plane in enumerate(planes):
            if isinstance(plane, str | bytes) or not isinstance(plane, Sequence) or len(plane) != 2:
                raise InvalidInputError(f"planes[{i}] must be (row_shape, dtype), got {plane!r}")
            parsed.append(
                (
                    _shape_of(plane[0], f"planes[{i}] row_shape"),
                    _dtype_of(plane[1], f"planes[{i}] dtype"),
                )
            )
        # Normalized, so a record read back from JSON (lists) equals the declared one.
        object.__setattr__(self, "planes", tuple(parsed))

    @classmethod
    def from_v1(
        cls,
        conv_shape: Sequence[int],
        conv_dtype: str,
        state_shape: Sequence[int],
        state_dtype: str = "float32",
    ) -> StateShapes:
        """The two planes of a version-1 record: conv ``(K - 1, C)`` and recurrent state."""
        if isinstance(conv_shape, str | bytes) or len(conv_shape) != 2:
            raise InvalidInputError(
                f"conv_shape must be (K - 1, channels), positive ints, got {conv_shape!r}"
            )
        return cls(planes=((tuple(conv_shape), conv_dtype), (tuple(state_shape), state_dtype)))

    @classmethod
    def from_record(cls, saved: Mapping[str, Any]) -> StateShapes:
        """The shapes a file's layer record holds (``planes``; version 1's two-plane
        record is ``kvrows.forms_v1.state_shapes``)."""
        return cls(planes=saved["planes"])

    def plane_specs(self) -> tuple[PlaneSpec, ...]:
        return tuple(
            PlaneSpec(f"state.{i}", None, dtype, shape[-1])
            for i, (shape, dtype) in enumerate(self.planes)
        )

    def row_bytes(self) -> int:
        """Bytes one row holds (constant in tokens)."""
        return sum(math.prod(shape) * DTYPE_SIZES[dtype] for shape, dtype in self.planes)

    def describe(self) -> str:
        return ", ".join(
            f"state.{i} {shape} {dtype}" for i, (shape, dtype) in enumerate(self.planes)
        )


def state_tensors(planes: int) -> tuple[str, ...]:
    """The tensors of ``planes`` recurrent planes: ``state.0`` … ``state.{planes-1}``."""
    return tuple(f"state.{i}" for i in range(planes))


@register_codec
@dataclass(frozen=True, kw_only=True)
class State(SpecParts):
    """The codec of recurrent state: planes stored as the layer writes them."""

    kind: ClassVar[str] = "state"
    names: ClassVar[tuple[str, ...]] = ()  # no scheme word: a layer's state is not a choice
    syntax: ClassVar[str] = ""
    state_tail: ClassVar[tuple[str, ...]] = ()
    encodes: ClassVar[bool] = False
    reads: ClassVar[Reads] = "dense"  # never attended: the layer reads its planes
    tag: ClassVar[int] = 3
    paged_fields: ClassVar[tuple[str, ...]] = ()
    dtype_plane: ClassVar[int | None] = None
    plane_labels: ClassVar[tuple[str, ...]] = ()

    @property
    def key(self) -> str:
        return "state"

    @property
    def name(self) -> str:
        return "state"

    def parameters(self) -> dict[str, int]:
        return {}

    @classmethod
    def tensors(cls, shapes: object = None) -> tuple[str, ...]:
        """``state.0`` … one per plane of ``shapes`` (a :class:`StateShapes`; without
        one, mlx-lm's default two)."""
        planes = shapes.planes if isinstance(shapes, StateShapes) else ()
        return state_tensors(len(planes) or DEFAULT_PLANES)

    @classmethod
    def parse(cls, text: str) -> State | None:
        return None

    def plane_specs(
        self, name: str, dim: int, dtype: str, role: Role = "keys"
    ) -> tuple[PlaneSpec, ...]:
        return (PlaneSpec(name, None, dtype, dim),)

    def head_dim(self, width: int, role: Role) -> int:
        return width
