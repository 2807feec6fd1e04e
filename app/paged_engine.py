"""The engine's paged option (``Engine(..., paged=True)``, ``spec/engine.md`` §14).

Every full-attention layer whose codec a block pool stores (plain, affine, TurboQuant)
keeps its rows in one ``BlockPool`` per layer, shared by every request of the engine: a
request's cache is a ``PagedKVCache`` into its layer's pool, its rows join the prefill,
decode and verify layouts (``PagedKvRows``) by block table, and nothing is copied when
rows move. Sliding-window layers (rings) and recurrent state keep their own layouts.

The prefix path uses the pools instead of serial copies:

* **publish**: a finished row's full blocks are registered (``register_prefix``); the row's
  tables are released, its blocks stay cached (free, evicted least recently used first)
  until the pool needs them;
* **lookup**: a new prompt's longest cached run of full blocks, capped at ``len - 1``
  tokens, the minimum over the paged layers; its caches reference those blocks. A model
  with other layers (rings) takes a hit only where the engine's ``PrefixCache`` (holding
  those layers' published serial copies) can cut them to a length the pools cover.

:class:`PagedLayers` keeps the pools and answers what the engine asks (fresh caches,
lookups, publication, bytes); the engine keeps its loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvrows.codecs import is_codec_spec, is_kv_codec, kv_codecs
from kvrows.errors import InvalidInputError
from kvrows.optimized import BlockPool, PagedKVCache
from kvrows.paged import DEFAULT_BLOCK_SIZE, chain_hashes
from kvrows.protocols import BatchableCache, Cache, Handover, PagedRows, RingGeometry

__all__ = ["PAGED_CODECS", "PagedLayers", "pageable"]

#: The codec kinds a block pool stores: every registered KV codec (a pool builds its
#: codec from the spec through the implementation's codec registry).
PAGED_CODECS = frozenset(kv_codecs())


def pageable(cache: Any) -> bool:
    """Whether a fresh serial cache's layer goes paged: full attention (a token geometry
    that is no sliding window) under a codec the pool stores; bf16-first legos, rings and
    recurrent state (no KV codec) do not."""
    if isinstance(cache, Handover):
        return False
    tokens = getattr(cache, "token_geometry", None) is not None
    codec = getattr(cache, "codec_spec", None)
    return (
        tokens
        and not isinstance(cache, RingGeometry)
        and is_codec_spec(codec)
        and is_kv_codec(codec)
    )


class PagedLayers:
    """The pools of an engine's paged layers and the prefix path over them.

    ``fresh``: a callable returning a request's fresh per-layer serial caches
    (``make_kvrows_cache``); the paged layers are those :func:`pageable` says, each with
    its own pool of ``block_size`` tokens per block (its codec and declared geometry)."""

    def __init__(self, fresh: Callable[[], list[Any]], *, block_size: int = DEFAULT_BLOCK_SIZE):
        self._fresh = fresh
        template = fresh()
        self.pools: list[BlockPool | None] = []
        for cache in template:
            if pageable(cache):
                self.pools.append(
                    BlockPool(cache.codec_spec, block_size=block_size, geometry=cache.geometry)
                )
            else:
                self.pools.append(None)
        if not any(self.pools):
            raise InvalidInputError(
                "paged: the model has no full-attention layer under a codec a block pool "
                f"stores ({', '.join(sorted(PAGED_CODECS))})"
            )
        self.block_size = block_size
        #: Whether some layer is not paged (rings, recurrent state): its prefix hits come
        #: from the engine's ``PrefixCache``.
        self.mixed = not all(self.pools)

    # -- caches ----------------------------------------------------------------------------
    def caches(self) -> list[Any]:
        """A request's fresh caches: paged layers as empty ``PagedKVCache``s of their pool."""
        out: list[Any] = []
        for cache, pool in zip(self._fresh(), self.pools, strict=True):
            out.append(cache if pool is None else PagedKVCache(pool=pool))
        return out

    def is_paged(self, layer: int) -> bool:
        return self.pools[layer] is not None

    # -- the prefix path -------------------------------------------------------------------
    def _paged_pools(self) -> list[BlockPool]:
        return [pool for pool in self.pools if pool is not None]

    def hit_blocks(self, prompt: Sequence[int]) -> list[list[int]]:
        """Per paged layer, the cached blocks the prompt's longest usable prefix would take
        (capped at ``len(prompt) - 1`` tokens; read only, nothing taken), cut to the layers'
        common length."""
        found: list[list[int]] = []
        for pool in self._paged_pools():
            most = max(len(prompt) - 1, 0) // pool.block_size
            digests = chain_hashes(list(prompt), pool.block_size, pool.ledger.extra, most)
            found.append(pool.ledger.lookup(digests))
        common = min(len(blocks) for blocks in found)
        return [blocks[:common] for blocks in found]

    def shared_credit(self, prompt: Sequence[int]) -> int:
        """Bytes of the prompt's prefix blocks that live tables already hold (so a running
        row's reservation counts them): what admission need not count twice."""
        credit = 0
        for pool, blocks in zip(self._paged_pools(), self.hit_blocks(prompt), strict=True):
            held = sum(1 for b in blocks if pool.ledger.ref(b) > 0)
            credit += held * pool.bytes_per_block
        return credit

    def lookup(
        self, prompt: Sequence[int], others: Callable[[int], tuple[int, list[Cache]] | None]
    ) -> tuple[int, list[Any]] | None:
        """The longest usable prefix: ``(tokens, caches)`` whose paged layers reference
        cached blocks (nothing copied) and, in a mixed model, whose other layers are the
        copies ``others(limit)`` returns (the ``PrefixCache``'s lookup over those layers,
        at most ``limit`` tokens, in layer order); ``None`` on a miss."""
        common = len(self.hit_blocks(prompt)[0]) * self.block_size
        if common == 0:
            return None
        fed = common
        copies: list[Cache] = []
        if self.mixed:
            found = others(common)
            if found is None:
                return None
            fed, copies = found
        rest = iter(copies)
        caches: list[Any] = []
        for pool in self.pools:
            if pool is None:
                caches.append(next(rest))
                continue
            hit = pool.lookup_prefix(list(prompt[: common + 1]))
            assert hit is not None and hit.offset == common
            if fed < common:
                hit.trim(common - fed)  # a partial tail stays shared: copied on its next write
            caches.append(hit)
        return fed, caches

    def publish_rows(self, layouts: Sequence[Any], row: int, covered: Sequence[int]) -> None:
        """Register row ``row``'s full blocks of ``covered`` in each paged layer's pool."""
        for layout in layouts:
            if (
                isinstance(layout, PagedRows)
                and isinstance(layout, BatchableCache)
                and layout.batch_size > row
            ):
                layout.register_prefix(row, list(covered))

    def publish_serial(self, caches: Sequence[Any], covered: Sequence[int]) -> None:
        """Register a serial row's full blocks (a row that finished on its first token)."""
        for cache in caches:
            if isinstance(cache, PagedRows) and not isinstance(cache, BatchableCache):
                serial: Any = cache  # a serial paged cache: ``rows`` is its batch rows
                if serial.rows == 1:
                    cache.register_prefix(list(covered))

    def unpaged_layers(self, caches: Sequence[Any]) -> list[Any]:
        """The layers of ``caches`` that are not paged (what the ``PrefixCache`` keeps of a
        mixed model's row)."""
        return [c for c, pool in zip(caches, self.pools, strict=True) if pool is None]

    # -- bytes -----------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """KV bytes the pools hold: blocks live tables reference, each counted once, and
        cached free blocks (the prefix cache's share)."""
        return sum(
            pool.ledger.held_count * pool.bytes_per_block
            for pool in self._paged_pools()
            if pool.geometry is not None
        )

    def allocated_bytes(self) -> int:
        """Bytes of the pools' planes (growth slack included)."""
        return sum(pool.nbytes for pool in self._paged_pools())

    @staticmethod
    def unpaged_bytes(caches: Iterable[Any]) -> int:
        """``nbytes`` of the caches and layouts that are not paged (the pools count those)."""
        return sum(c.nbytes for c in caches if not isinstance(c, PagedRows))
