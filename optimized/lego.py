"""The optimized bf16-first storages (``kvrows.lego``; ``spec/bf16-first.md``).

Conversion is the plain storage's ``to_quantized`` (``dropin.py``): every plane quantized
whole, a ring keeping its phase, the result owned and evaluated. Beyond the lego's own
surface, what mlx-lm's models read off a cache (``keys``, ``values``,
``keys_and_values()``, ``size()``, ``empty()``, a ring's ``max_size`` / ``keep``) is the
current storage's. A lego has no ``to_quantized``: ``generate(kv_bits=...)`` leaves it
alone (it converts itself).
"""

from __future__ import annotations

from typing import Any

from kvrows.lego import Bf16First, FullAttentionLego, SlidingWindowLego, Target, TurboLego
from kvrows.optimized.classes import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    TurboQuantKVCache,
)
from kvrows.optimized.dropin import encoded_copy
from kvrows.schemes import Affine

__all__ = [
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
    "convert",
]


def convert(storage: Any, target: Target, converted_class: type[Any]) -> Any:
    """The bf16-first conversion of a plain storage: affine through its ``to_quantized``,
    TurboQuant by encoding its planes into ``converted_class`` (``fromKVCache``)."""
    if isinstance(target, Affine):
        return storage.to_quantized(group_size=target.group_size, bits=target.bits)
    return encoded_copy(storage, target, converted_class)


class _OptimizedLego(Bf16First):
    def _convert(self, storage: Any) -> Any:
        return convert(storage, self.quantization, self.affine_class)

    @property
    def keys(self) -> Any:
        """What attention reads of the keys (the current storage's ``keys``)."""
        return self._storage.keys

    @property
    def values(self) -> Any:
        """What attention reads of the values (the current storage's ``values``)."""
        return self._storage.values

    def keys_and_values(self) -> tuple[Any, Any]:
        held: tuple[Any, Any] = self._storage.keys_and_values()
        return held

    def size(self) -> int:
        return int(self._storage.size())

    def empty(self) -> bool:
        return bool(self._storage.empty())


class Bf16FirstQuantizedKVCache(_OptimizedLego, FullAttentionLego):
    """Full attention: ``KVCache`` until the append that reaches ``start``, then
    ``QuantizedKVCache`` (arguments: ``QuantizedKVCache``'s, then ``start``)."""

    plain_class = KVCache
    affine_class = QuantizedKVCache


class Bf16FirstRotatingQuantizedKVCache(_OptimizedLego, SlidingWindowLego):
    """Sliding window: ``RotatingKVCache`` until the append that reaches ``start``, then
    ``RotatingQuantizedKVCache`` holding the same ring (arguments:
    ``RotatingQuantizedKVCache``'s, then ``start``)."""

    plain_class = RotatingKVCache
    affine_class = RotatingQuantizedKVCache


class Bf16FirstTurboQuantKVCache(_OptimizedLego, TurboLego):
    """Full attention: ``KVCache`` until the append that reaches ``start``, then
    ``TurboQuantKVCache`` holding the same tokens (arguments: ``TurboQuantKVCache``'s, then
    ``start``)."""

    plain_class = KVCache
    affine_class = TurboQuantKVCache
