"""Ring reads in time order: the same attention summation order alone and in a batch.

A shared-column ring (the serial ring and the ring decode layouts) writes single tokens
in place, so once it wraps its read returns the window in *physical* order, rotated by
the ring's phase. A row's solo ring turns at its own phase and the batch's ring at the
batch's (it restarts unrotated at every join), so the same keys reach attention in
another column order and float32 sums differ in the last bits (``spec/engine.md`` §8).
:func:`in_time_order` puts a rotated ring's read (keys, values, the mask's last axis) in
time order, sinks first, so every ring read, solo or batched, sums its window oldest
first; the cache does it (``kvrows.protocols.TimeOrderedReads``: the shared ring, and a
bf16-first lego through the storage its read came from). Padding columns a batched row
has before its oldest token stay in front, masked: they add exact zeros.

A wrapped ring without sinks keeps its window in time order (``spec/RotatingKVCache.md``
§2.1) and answers with a slice of it, no copy; a ring with sinks re-orders a copy of its
columns per ring layer and decode step. Prefill blocks and rings that have not wrapped are
already in time order and are not copied. Used by ``kvrows.app.attention.dispatch``, so it applies to every forward inside
``attention_scope`` (the engine's and the demo's solo replays).
"""

from __future__ import annotations

from typing import Any

from kvrows.protocols import TimeOrderedReads

__all__ = ["in_time_order"]


def in_time_order(cache: Any, keys: Any, values: Any, mask: Any) -> tuple[Any, Any, Any]:
    """``keys``, ``values`` (arrays or tuples of planes) and ``mask`` as ``cache``'s read
    returned them, in time order when ``cache`` can put them so (a rotated shared ring);
    unchanged otherwise."""
    if isinstance(cache, TimeOrderedReads):
        return cache.reads_in_time_order(keys, values, mask)
    return keys, values, mask
