"""How the reference stores one token's vector: the codec axis, and attention.

A codec turns a ``[B, H, T, D]`` block into a tuple of *planes*, each an array whose
axis 2 is the token axis. Every codec groups along the feature axis only, so slicing,
padding and concatenating planes along tokens never re-encodes a byte: the row
machinery (``kvrows.reference.rows``) is written once, over planes.

Both codecs implement ``kvrows.codec.Codec``; ``attend`` dispatches through
``cache.codec.attend``. The reference's attention is one dense kernel,
``softmax(where(mask, q·kᵀ·scale, min)) · v`` in float32 with GQA by repeating heads;
the affine codec dequantizes (bit-exactly as ``mx.dequantize`` on the CPU) and runs it.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from kvrows.affine_geometry import validate_codec
from kvrows.codec import CodecLayout, Role, check_turbo_dim
from kvrows.delayed import DelayedRows
from kvrows.errors import (
    InvalidInputError,
    attend_storage_message,
    head_dim_message,
    head_grouping_message,
    mask_message,
)
from kvrows.protocols import Cache, HasCodec, Mask
from kvrows.reference import affine_codec, turbo_codec
from kvrows.schemes import Affine, CodecSpec, Plain, Turbo
from kvrows.validation import KvGeometry

__all__ = [
    "AffineCodec",
    "Codec",
    "PlainCodec",
    "Planes",
    "TurboCodec",
    "attend",
    "attention",
    "dtype_name",
    "eager_attention",
    "make_codec",
    "numpy_dtype",
]

Planes = tuple[npt.NDArray[Any], ...]

_DTYPES: dict[str, Any] = {
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float32": np.float32,
    "uint32": np.uint32,
    "uint8": np.uint8,
    "int8": np.int8,
}


def numpy_dtype(name: str) -> Any:
    """The NumPy dtype for a dtype name (bf16 via ``ml_dtypes``)."""
    return np.dtype(_DTYPES[name])


def dtype_name(array: object) -> str:
    """``array``'s dtype name, refusing anything that is not a NumPy array."""
    if not isinstance(array, np.ndarray):
        raise InvalidInputError(
            f"the reference takes NumPy arrays, got {type(array).__module__}.{type(array).__name__}"
        )
    return str(array.dtype.name)


# -- attention ---------------------------------------------------------------------------


def _visible(mask: Mask, batch: int, queries: int, keys: int) -> npt.NDArray[np.bool_]:
    if mask is None:
        return np.ones((1, 1, queries, keys), dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            raise InvalidInputError(mask_message(mask))
        rows = np.arange(queries)[:, None] + (keys - queries)
        return (np.arange(keys)[None, :] <= rows)[None, None]
    array = np.asarray(mask)
    if array.dtype != np.bool_:
        raise InvalidInputError(f"a mask array must be boolean, got {array.dtype}")
    if array.ndim == 1:  # one query's mask ``[S]`` (a serial ring's, mlx-lm's shape)
        array = array[None]
    if array.ndim == 2:
        array = array[None, None]
    if array.ndim != 4 or array.shape[-2:] != (queries, keys) or array.shape[0] not in (1, batch):
        raise InvalidInputError(
            f"mask of shape {array.shape} does not fit {batch} rows, {queries} queries, {keys} keys"
        )
    return array


def attention(
    queries: npt.NDArray[Any],
    keys: npt.NDArray[Any],
    values: npt.NDArray[Any],
    mask: Mask,
    scale: float,
) -> npt.NDArray[Any]:
    """Attention of ``[B, Hq, N, D]`` queries over ``[B, Hkv, S, D]`` keys (GQA by repeating heads)."""
    dtype_name(queries)
    if queries.ndim != 4 or keys.ndim != 4 or values.ndim != 4:
        raise InvalidInputError("queries, keys and values must be [B, H, T, D]")
    batch, q_heads, n, _ = queries.shape
    kv_heads, s = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise InvalidInputError(head_grouping_message(q_heads, kv_heads))
    repeat = q_heads // kv_heads
    k = np.repeat(keys.astype(np.float32), repeat, axis=1)
    v = np.repeat(values.astype(np.float32), repeat, axis=1)
    scores = np.einsum("bhnd,bhsd->bhns", queries.astype(np.float32), k) * np.float32(scale)
    scores = np.where(_visible(mask, batch, n, s), scores, np.finfo(np.float32).min)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    out: npt.NDArray[Any] = np.einsum("bhns,bhsd->bhnd", weights, v).astype(queries.dtype)
    return out


def attend(queries: npt.NDArray[Any], cache: Cache, mask: Mask, scale: float) -> npt.NDArray[Any]:
    """Attention of ``queries`` over everything ``cache`` holds now, through its codec (a
    delayed layout: what its last append returned, a mixed read row group by row group)."""
    dtype_name(queries)
    if isinstance(cache, DelayedRows):
        last: npt.NDArray[Any] | None = cache.attend_last_read(queries, mask, scale)
        if last is not None:
            return last
    if not isinstance(cache, HasCodec):
        raise InvalidInputError(attend_storage_message(cache))
    codec: Codec = cache.codec
    return codec.attend(queries, *cache.fetch(), mask, scale)


# -- codecs ------------------------------------------------------------------------------


class _ZeroPlanes(CodecLayout):
    """Zero planes from the spec's plane layout, for both reference codecs."""

    def zeros(
        self, rows: int, heads: int, columns: int, dim: int, dtype: str, role: Role = "keys"
    ) -> Planes:
        """Zero planes of ``columns`` tokens (the padding a read shows)."""
        return tuple(
            np.zeros((rows, heads, columns, p.width), dtype=numpy_dtype(p.dtype))
            for p in self.plane_specs("t", dim, dtype, role)
        )


class PlainCodec(_ZeroPlanes):
    """Unquantized storage in the activation dtype: one plane, the block itself."""

    def __init__(self) -> None:
        self.spec: CodecSpec = Plain()

    def check(self, geometry: KvGeometry) -> None:
        return None

    def encode(self, block: npt.NDArray[Any], role: Role = "keys") -> Planes:
        return (np.array(block, copy=True),)

    def decode(self, planes: Planes) -> npt.NDArray[Any]:
        """The stored values."""
        return planes[0]

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        return planes[0]

    def attend(
        self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float
    ) -> npt.NDArray[Any]:
        return attention(queries, keys, values, mask, scale)


class AffineCodec(_ZeroPlanes):
    """MLX affine group quantization: planes ``(packed uint32, scales, biases)``.

    Quantizes each new token once, on append; row operations move codes, scales and
    biases without re-quantizing anything. ``update_and_fetch`` hands out the three
    planes as a tuple, mlx-lm's quantized-cache convention.
    """

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        self.spec = Affine(bits=bits, group_size=group_size)
        self.group_size = group_size
        self.bits = bits

    def check(self, geometry: KvGeometry) -> None:
        for name, dim in (("key", geometry.key_dim), ("value", geometry.value_dim)):
            try:
                validate_codec(dim, self.group_size, self.bits)
            except InvalidInputError as error:
                raise InvalidInputError(head_dim_message(name, dim, error)) from None

    def encode(self, block: npt.NDArray[Any], role: Role = "keys") -> Planes:
        return affine_codec.quantize(block, self.group_size, self.bits)

    def decode(self, planes: Planes) -> npt.NDArray[Any]:
        """The stored values, dequantized exactly as ``mx.dequantize`` on the CPU."""
        packed, scales, biases = planes
        return affine_codec.dequantize(packed, scales, biases, self.group_size, self.bits)

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        return tuple(planes)

    def attend(
        self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float
    ) -> npt.NDArray[Any]:
        return attention(queries, self.decode(keys), self.decode(values), mask, scale)


class TurboCodec(_ZeroPlanes):
    """TurboQuant (``spec/turbo-codec.md``): keys as planes ``(kIdx, kScales, kZeros)``,
    values as ``(vPacked, vScales)``.

    A read returns keys dequantized and values **still rotated**, both bfloat16 (the
    deferred-V read); ``attend`` runs attention over them and un-rotates the output once
    per query row. :func:`eager_attention` is the oracle that decodes V first.
    """

    spec: Turbo
    defers_values = True

    def __init__(self, spec: Turbo) -> None:
        self.spec = spec
        self.k_bits = spec.k_bits
        self.v_bits = spec.v_bits

    def check(self, geometry: KvGeometry) -> None:
        for name, dim in (("key", geometry.key_dim), ("value", geometry.value_dim)):
            try:
                check_turbo_dim(dim)
            except InvalidInputError as error:
                raise InvalidInputError(head_dim_message(name, dim, error)) from None

    def encode(self, block: npt.NDArray[Any], role: Role = "keys") -> Planes:
        if role == "keys":
            return turbo_codec.encode_keys(block, self.k_bits)
        return turbo_codec.encode_values(block, self.v_bits)

    def decode(self, planes: Planes, role: Role = "keys") -> npt.NDArray[Any]:
        """``role``'s tokens fully decoded, float32 (values un-rotated: the eager path)."""
        if role == "keys":
            return turbo_codec.decode_keys(planes[0], planes[1], planes[2], self.k_bits)
        return turbo_codec.decode_values(planes[0], planes[1], self.v_bits)

    def fetched(self, planes: Planes, role: Role = "keys") -> Any:
        if role == "keys":
            keys = turbo_codec.decode_keys(planes[0], planes[1], planes[2], self.k_bits)
            return keys.astype(ml_dtypes.bfloat16)
        return turbo_codec.rotated_values(planes[0], planes[1], self.v_bits).astype(
            ml_dtypes.bfloat16
        )

    def attend(
        self, queries: Any, keys: Any, values: Any, mask: Mask, scale: float
    ) -> npt.NDArray[Any]:
        """Deferred V: attention over the keys and the rotated values, then the output
        un-rotated (float32 Hadamard, then the signs, cast back to the queries' dtype)."""
        return turbo_codec.unrotate(attention(queries, keys, values, mask, scale))


def eager_attention(
    codec: TurboCodec,
    queries: npt.NDArray[Any],
    key_planes: Planes,
    value_planes: Planes,
    mask: Mask,
    scale: float,
) -> npt.NDArray[Any]:
    """The eager oracle of :meth:`TurboCodec.attend`: keys and values fully decoded
    (bfloat16, as a read returns them), then plain attention."""
    keys = codec.decode(key_planes, "keys").astype(ml_dtypes.bfloat16)
    values = codec.decode(value_planes, "values").astype(ml_dtypes.bfloat16)
    return attention(queries, keys, values, mask, scale)


Codec = PlainCodec | AffineCodec | TurboCodec


def make_codec(spec: CodecSpec) -> Codec:
    """The reference codec for ``spec``."""
    if isinstance(spec, Affine):
        return AffineCodec(spec.group_size, spec.bits)
    if isinstance(spec, Plain):
        return PlainCodec()
    if isinstance(spec, Turbo):
        return TurboCodec(spec)
    raise InvalidInputError(f"the reference does not implement the {spec.kind} codec yet")
