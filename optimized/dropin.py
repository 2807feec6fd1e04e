"""mlx-lm's per-cache surface beyond the model protocol, on every optimized class.

What mlx-lm's models and generation loop read or call on one cache object, besides
``offset``, ``update_and_fetch``, ``make_mask``, ``trim`` and ``nbytes`` (``rows.py``):

* ``keys`` / ``values``: what attention reads (the arrays ``fetch`` returns; the
  ``(packed, scales, biases)`` triples of an affine storage), ``None`` before the cache
  holds a buffer. Settable on a plain storage with an array of exactly that shape and
  dtype (pipeline-parallel models write ``mx.depends(cache.keys, h)`` back, deepseek_v32's
  indexer writes ``mx.zeros_like(cache.keys)``); an affine storage refuses the write.
* ``keys_and_values()`` (KV-sharing models: gemma3n, afm7), ``size()``, ``empty()``.
* ``to_quantized(group_size=64, bits=4)`` on plain classes only: a plain storage becomes
  its affine counterpart in the composition table, holding the same tokens at the same
  positions. An affine class has no ``to_quantized`` attribute at all, as mlx-lm's
  ``QuantizedKVCache`` has none: ``generate(kv_bits=…)`` asks ``hasattr`` on every step
  and must leave an already-quantized cache alone.

``spec/mlx-lm-drop-in.md`` lists every mlx-lm cache member against every kvrows class.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import MethodType
from typing import Any

import mlx.core as mx

from kvrows.codec import KV_TENSORS, Role
from kvrows.codecs import CODECS
from kvrows.compositions import affine_counterpart
from kvrows.errors import InvalidInputError, LayoutStateError
from kvrows.optimized.codecs import make_codec
from kvrows.optimized.rows import DECLARED, Storage, arrays, token_count
from kvrows.schemes import Affine, CodecSpec
from kvrows.validation import STEP

__all__ = ["LayoutDropIn", "SerialDropIn", "encoded_copy"]

#: Instance attributes ``to_quantized`` does not copy: the codec, its stages and planes (re-encoded),
#: the specs and KV geometry (given to the constructor), device caches of host state and the
#: memo of the last block accepted.
_NOT_COPIED = frozenset(
    {
        "codec",
        "_stages",
        "_keys",
        "_values",
        "_token_geometry",
        "_geometry",
        "_pads_of",
        "_pads_array",
        "_pad_test",
        "_accepted",  # the last block accepted, into the source's codec
        "_offset_array",
        "_physical",  # a ring's planes, re-encoded (``_planes``), in whichever form
        "_ordered",
    }
)


def _capped(count: int, cap: int | None) -> int:
    """``count`` at most ``cap`` (a ring's ``max_size``; ``None``: unbounded)."""
    return count if cap is None else min(count, cap)


def _held(cache: Storage) -> tuple[Any, Any] | None:
    """What attention reads, or ``None`` while the cache holds no buffer."""
    if cache._planes is None:
        return None
    return cache.fetch()


def _write_held(cache: Storage, side: str, value: object) -> None:
    """Replace the tokens ``cache.keys`` (``side == "keys"``) or ``cache.values`` reads."""
    name = f"{type(cache).__name__}.{side}"
    cache._settle()  # (written in place below)
    held = cache._planes
    if held is None:
        if value is None:
            return  # an empty cache reads None; writing None back changes nothing
        raise LayoutStateError(
            f"{name} cannot be written on a cache that holds no tokens (it reads None): "
            "append tokens through update_and_fetch first"
        )
    if cache.codec_spec.encodes:  # written planes must be the tokens themselves
        raise InvalidInputError(
            f"{name} is read-only on a {cache.codec_spec.kind} storage: its planes are the "
            "codec's encoding of the tokens update_and_fetch appended, and written planes "
            "cannot be checked to be one; keep this layer plain (a KvStorageScheme layer "
            "override) if the model writes its keys or values"
        )
    if value is None:
        raise InvalidInputError(
            f"{name} cannot be set to None on a cache holding tokens: forget tokens with "
            "trim(n), or build a new cache"
        )
    tensor: Role = "keys" if side == "keys" else "values"
    planes = held[tensor]
    current = cache.codec.fetched(cache._visible(held)[tensor], tensor)
    if not isinstance(value, mx.array) or value.shape != current.shape:
        got = f"shape {tuple(value.shape)}" if isinstance(value, mx.array) else type(value)
        raise InvalidInputError(
            f"{name} takes an mlx array of the shape it reads, {tuple(current.shape)} "
            f"(the tokens held), got {got}"
        )
    if value.dtype != current.dtype:
        raise InvalidInputError(
            f"{name} takes an array of the dtype it holds ({current.dtype}), got {value.dtype}"
        )
    rows, width = int(value.shape[0]), int(value.shape[2])
    # What attention reads starts at the geometry's first read column (growing: the origin).
    start = cache._read_start()
    planes[0][:rows, :, start : start + width] = value


def _quantized(cache: Storage, group_size: int, bits: int) -> Storage:
    """``cache`` held by its affine counterpart: every plane quantized whole (capacity and
    spare slots included, as mlx-lm quantizes its buffer) and the host state copied, so
    the new cache holds the same tokens at the same positions (a ring keeps its phase)."""
    spec = Affine(bits=bits, group_size=group_size)  # validates both
    name = cache.composition.name
    entry = affine_counterpart(name)
    if entry is None or entry.name not in DECLARED:
        raise InvalidInputError(
            f"{name} has no affine counterpart with its token geometry and arrangement "
            f"({cache.composition.geometry}/{cache.composition.arrangement}); extract its "
            "rows (extract_row), convert each with to_quantized, and merge them into an "
            "affine layout"
        )
    return encoded_copy(cache, spec, DECLARED[entry.name])


def encoded_copy(cache: Storage, spec: CodecSpec, target: type[Storage]) -> Storage:
    """``cache`` (plain) held by ``target`` (its counterpart over ``spec``): every plane
    encoded whole and the host state copied, owned and evaluated; ``cache`` is unchanged.
    Each token's encoding depends on that token only, so the copy holds what ``target``
    fed the same tokens holds (TurboQuant's ``fromKVCache``; the bf16-first conversion)."""
    codec = make_codec(spec)
    if cache.geometry is not None:
        codec.check(cache.geometry)  # head dims the codec stores
    fresh = target.from_specs(spec, cache.token_geometry, geometry=cache.geometry)
    for attribute, value in vars(cache).items():
        if attribute not in _NOT_COPIED:
            setattr(fresh, attribute, copy.deepcopy(value))
    if cache._planes is not None:
        fresh._planes = {t: codec.encode(cache._planes[t][0], t) for t in KV_TENSORS}
        mx.eval(*arrays(fresh._planes))
    fresh._changed()
    return fresh


class _PlainCodecOnly:
    """A method only plain-codec classes have: on an affine class the attribute does not
    exist (``AttributeError``, so ``hasattr`` is false), as on mlx-lm's
    ``QuantizedKVCache``, which has no ``to_quantized``."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = method
        self.__doc__ = method.__doc__

    def __get__(self, instance: object, owner: type | None = None) -> Callable[..., Any]:
        entry = getattr(owner, "composition", None)
        codec = None if entry is None else CODECS.get(entry.codec)
        if entry is not None and (codec is None or codec.encodes):
            raise AttributeError(
                f"{getattr(owner, '__name__', owner)} has no to_quantized: it is already "
                f"{entry.codec}-quantized (mlx-lm's QuantizedKVCache has none either, so "
                "generate(kv_bits=...) leaves it as it is)"
            )
        if instance is None:
            return self._method
        return MethodType(self._method, instance)


def _growth_step(self: Storage) -> int:
    """Columns the buffers grow by (mlx-lm's ``step``): fixed at 256 in kvrows."""
    return STEP


def _refuse_step(self: Storage, value: object) -> None:
    raise InvalidInputError(
        f"{type(self).__name__}.step is fixed at {STEP}: kvrows grows its buffers in steps "
        "of 256 columns and has no per-cache setting"
    )


def _to_quantized(self: Storage, group_size: int = 64, bits: int = 4) -> Storage:
    """An independent affine copy holding the same tokens (mlx-lm's defaults: group 64,
    4 bits); the source is unchanged. Its arrays are owned and evaluated."""
    return _quantized(self, group_size, bits)


class _HeldPlanes(Storage):
    """``keys`` / ``values`` / ``keys_and_values()``: what attention reads, serial or layout
    (plain storages also take writes of the same shape; see ``_write_held``)."""

    @property
    def keys(self) -> Any:
        """The keys attention reads (``fetch()[0]``); ``None`` before any buffer exists."""
        held = _held(self)
        return None if held is None else held[0]

    @keys.setter
    def keys(self, value: object) -> None:
        _write_held(self, "keys", value)

    @property
    def values(self) -> Any:
        """The values attention reads (``fetch()[1]``); ``None`` before any buffer exists."""
        held = _held(self)
        return None if held is None else held[1]

    @values.setter
    def values(self, value: object) -> None:
        _write_held(self, "values", value)

    def keys_and_values(self) -> tuple[Any, Any]:
        """``(keys, values)`` as attention reads them (``LayoutStateError`` when empty)."""
        return self.fetch()

    def empty(self) -> bool:
        """Whether no buffer exists yet (mlx-lm: ``keys is None``; a cache trimmed to zero
        tokens keeps its buffer and is not empty)."""
        return self._planes is None

    to_quantized = _PlainCodecOnly(_to_quantized)
    step = property(_growth_step, _refuse_step)


class SerialDropIn(_HeldPlanes):
    """mlx-lm's single-sequence cache methods on a serial storage."""

    def size(self) -> int:
        """Tokens held: ``offset``, at most ``max_size`` for a ring (mlx-lm's ``size()``)."""
        offset = self._offsets[0] if self._offsets else 0
        return _capped(offset, self._token_geometry.cap())


class LayoutDropIn(_HeldPlanes):
    """mlx-lm's cache methods on a layout (the batch API is ``batch_dropin.py``'s)."""

    @property
    def left_padding(self) -> mx.array:
        """mlx-lm's per-row left padding, int32 ``[B]``: the columns before each row's
        oldest token in what ``fetch`` returns (``left_pad``), plus the pads a row announced
        by ``BatchKVCache(left_padding)`` / ``prepare`` has yet to receive. Read-only."""
        pending = getattr(self, "pending_left_padding", ()) or (0,) * len(self._pads)
        return mx.array([p + q for p, q in zip(self._pads, pending, strict=True)], dtype=mx.int32)

    def size(self) -> int:
        """The key columns attention reads, at most ``max_size`` for a ring (mlx-lm:
        ``BatchKVCache.size()`` is its write column, ``BatchRotatingKVCache.size()`` is
        capped at the window)."""
        if self._planes is None:
            return 0
        width = token_count(self._visible(self._planes))
        return _capped(width, self._token_geometry.cap())
