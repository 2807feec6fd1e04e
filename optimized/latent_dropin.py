"""Latent caches inside unmodified mlx-lm MLA models (``spec/MLACache.md`` §3).

mlx-lm's ``deepseek_v32`` (and ``glm_moe_dsa``, its subclass) gives each layer a
``CacheList(KVCache, KVCache)``: item 0 takes ``update_and_fetch(kv_latent, k_pe)``, item
1 (the sparse-attention indexer) ``update_and_fetch(k, k)`` a moment later in the same
layer call. :class:`LatentCacheList` serves such a layer with one latent cache
(``MLACache``, ``EncodedLatentCache`` or ``PagedLatentCache``, declared with the index width): item 0 returns
what the cache will hold (``preview``) and keeps the pair until item 1 brings the index
block; then all three planes are appended at once, so the index plane never lags.
A model without an indexer (``index_head_dim`` not declared) appends at item 0; such a
model (mlx-lm ``deepseek_v3``: one ``KVCache`` per layer holding ``kv_latent`` and
``k_pe``) takes item 0 alone as its layer cache (``LatentCacheList(cache)[0]``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.errors import InvalidInputError, LayoutStateError
from kvrows.optimized.latent import EncodedLatentCache, MLACache
from kvrows.optimized.paged_latent import PagedLatentCache

__all__ = ["LatentCacheList"]

Latent = MLACache | EncodedLatentCache | PagedLatentCache


class _View:
    """What the model sees as one mlx-lm cache of the pair."""

    def __init__(self, owner: LatentCacheList) -> None:
        self._owner = owner

    @property
    def offset(self) -> Any:
        cache = self._owner.cache
        if cache.batch_size <= 1 or not any(cache.left_pad):
            return cache.width  # a serial cache: mlx-lm's KVCache.offset is an int
        return cache.offset

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        """mlx-lm's ``KVCache`` policy while no row is padded (``None`` for one token,
        ``[n, width + n]`` or ``"causal"`` for a block); the layout's array otherwise."""
        cache = self._owner.cache
        if any(cache.left_pad):
            return cache.make_mask(n, return_array=True, window_size=window_size)
        if window_size is None and n == 1:
            return None
        if not return_array and window_size is None:
            return "causal"
        width = cache.width
        columns = mx.arange(width + n)[None, :]
        queries = mx.arange(n)[:, None]
        visible = columns <= width + queries
        if window_size is not None:
            visible = visible & (width + queries - columns < window_size)
        return visible

    def is_trimmable(self) -> bool:
        return self._owner.is_trimmable()

    def trim(self, n: int) -> int:
        return self._owner.trim(n)

    @property
    def cache(self) -> Latent:
        """The latent cache behind the view."""
        return self._owner.cache

    @property
    def state(self) -> Any:
        return self._owner.state

    @property
    def nbytes(self) -> int:
        return self._owner.nbytes

    def signature(self) -> str:
        return self._owner.signature()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return int(self._owner.cache.width)


class _LatentView(_View):
    """Item 0: ``update_and_fetch(kv_latent, k_pe)``."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        owner = self._owner
        if owner.pending is not None:
            raise LayoutStateError(
                "LatentCacheList: the previous latent block still waits for its index block"
            )
        if not owner.cache.latent_spec.dsa:
            return owner.cache.update_and_fetch(keys, values)
        fetched = owner.cache.preview(keys, values)
        owner.pending = (keys, values)
        return fetched

    @property
    def keys(self) -> mx.array:
        held: mx.array = self._owner.cache.fetch()[0]
        return held

    @keys.setter
    def keys(self, value: Any) -> None:
        # The model re-binds keys to tie its lazy graph (mx.depends); the cache keeps its
        # own planes, which ``state`` hands to the caller's evaluation.
        return None

    @property
    def values(self) -> mx.array:
        held: mx.array = self._owner.cache.fetch()[1]
        return held

    @values.setter
    def values(self, value: Any) -> None:
        return None


class _IndexView(_View):
    """Item 1: the indexer's ``update_and_fetch(k, k)``."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        owner = self._owner
        if owner.pending is None:
            raise LayoutStateError(
                "LatentCacheList: an index block needs the layer's latent block first"
            )
        latent, rope = owner.pending
        _, _, index = owner.cache.append(latent, rope, keys)
        owner.pending = None
        return index, index

    @property
    def keys(self) -> mx.array:
        held: mx.array = self._owner.cache.fetch_index()
        return held

    @keys.setter
    def keys(self, value: Any) -> None:
        return None

    @property
    def values(self) -> mx.array:
        held: mx.array = self._owner.cache.fetch_index()
        return held

    @values.setter
    def values(self, value: Any) -> None:
        # The indexer replaces its values with zeros to cut its graph: nothing to keep.
        return None


class LatentCacheList:
    """One MLA layer's cache for mlx-lm's ``deepseek_v32`` / ``glm_moe_dsa``: items 0 and 1
    of mlx-lm's ``CacheList``, over one latent cache."""

    def __init__(self, cache: Latent) -> None:
        if not isinstance(cache, MLACache | EncodedLatentCache | PagedLatentCache):
            raise InvalidInputError(
                f"LatentCacheList holds an optimized MLACache, EncodedLatentCache or "
                f"PagedLatentCache, got "
                f"{type(cache).__name__}"
            )
        self.cache = cache
        self.pending: tuple[mx.array, mx.array] | None = None
        self.caches = (_LatentView(self), _IndexView(self))

    def __getitem__(self, index: int) -> _View:
        if index == 1 and not self.cache.latent_spec.dsa:
            raise InvalidInputError("this latent cache has no DSA index plane (item 1)")
        return self.caches[index]

    def __bool__(self) -> bool:
        return True

    @property
    def offset(self) -> Any:
        return self.caches[0].offset

    @property
    def state(self) -> Any:
        """The arrays to evaluate (mlx-lm's generate evaluates every cache's ``state``);
        save ``self.cache`` for a persistent form."""
        return self.cache.held_arrays()

    @property
    def nbytes(self) -> int:
        return int(self.cache.nbytes)

    def is_trimmable(self) -> bool:
        return self.pending is None

    def trim(self, n: int) -> int:
        if self.pending is not None:
            raise LayoutStateError("LatentCacheList: cannot trim while a latent block waits")
        return self.cache.trim(n)

    # the round protocol of the cache (``kvrows.speculative.RowRound`` drives a list of these)
    @property
    def row_offsets(self) -> tuple[int, ...]:
        return self.cache.row_offsets

    @property
    def spec_round_open(self) -> bool:
        return bool(self.cache.spec_round_open)

    def spec_round_begin(self) -> None:
        self.cache.spec_round_begin()

    def spec_round_commit(self) -> None:
        self.cache.spec_round_commit()

    def spec_round_rollback(self, keep: Any) -> None:
        self.cache.spec_round_rollback(keep)

    def size(self) -> int:
        return int(self.cache.width)

    def empty(self) -> bool:
        return self.cache.width == 0

    def signature(self) -> str:
        return self.cache.signature()
