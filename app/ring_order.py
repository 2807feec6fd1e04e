"""Ring reads in time order: the same attention summation order alone and in a batch.

A shared-column ring (:class:`kvrows.optimized.ring.SharedRing`: the serial ring and the
ring decode layouts) writes single tokens in place, so once it wraps its read returns
the window in *physical* order, rotated by the ring's phase. A row's solo ring turns at
its own phase and the batch's ring at the batch's (it restarts unrotated at every join),
so the same keys reach attention in another column order and float32 sums differ in the
last bits (``spec/engine.md`` §8). :func:`in_time_order` puts a rotated ring's read (keys,
values, the mask's last axis) in time order, sinks first, so every ring read, solo or
batched, sums its window oldest first. Padding columns a batched row has before its
oldest token stay in front, masked: they add exact zeros.

It costs one copy of the ring's columns per ring layer and decode step (the rotation);
prefill blocks and rings that have not wrapped are already in time order and are not
copied. Used by ``kvrows.app.attention.dispatch``, so it applies to every forward inside
``attention_scope`` (the engine's and the demo's solo replays).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.lego import Bf16First
from kvrows.optimized.ring import SharedRing

__all__ = ["in_time_order", "rotated_ring"]


def _ring_of(cache: Any) -> Any:
    """The storage whose read ``cache`` returned: a bf16-first lego's ``read_storage`` (the
    plain ring on the append that converted it)."""
    if isinstance(cache, Bf16First):
        return cache.read_storage
    return cache


def rotated_ring(cache: Any) -> bool:
    """Whether ``cache`` (or the lego's storage) is a shared-column ring whose physical
    order is not time order."""
    ring = _ring_of(cache)
    return isinstance(ring, SharedRing) and ring.ring_state[2]


def _reorder(array: Any, lead: int, idx: int, axis: int) -> Any:
    """Columns ``[sinks | ring[idx:] | ring[:idx]]`` of ``array`` along ``axis``."""
    width = int(array.shape[axis])

    def cut(start: int, stop: int) -> mx.array:
        index = [slice(None)] * array.ndim
        index[axis] = slice(start, stop)
        part: mx.array = array[tuple(index)]
        return part

    parts = [cut(lead + idx, width), cut(lead, lead + idx)]
    if lead:
        parts.insert(0, cut(0, lead))
    return mx.concatenate(parts, axis=axis)


def in_time_order(cache: Any, keys: Any, values: Any, mask: Any) -> tuple[Any, Any, Any]:
    """``keys``, ``values`` (arrays or tuples of planes) and ``mask`` as ``cache``'s read
    returned them, in time order when ``cache`` is a rotated shared ring; unchanged
    otherwise (a read of more columns than the ring holds is a block: already in order)."""
    if not rotated_ring(cache):
        return keys, values, mask
    ring = _ring_of(cache)
    idx = ring.ring_state[0]
    lead = ring.ring_index - idx
    first = keys[0] if isinstance(keys, tuple) else keys
    if int(first.shape[2]) != lead + ring.ring_length or idx == 0:
        return keys, values, mask

    def planes(x: Any) -> Any:
        if isinstance(x, tuple):
            return tuple(_reorder(p, lead, idx, 2) for p in x)
        return _reorder(x, lead, idx, 2)

    if isinstance(mask, mx.array) and mask.ndim >= 1:
        mask = _reorder(mask, lead, idx, mask.ndim - 1)
    return planes(keys), planes(values), mask
