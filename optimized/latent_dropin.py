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

Both layer objects are also row layouts (``kvrows.protocols.BatchableCache`` and
``SpeculativeRowLayout``) and ``DropInWrapper``s: the row-layout table finds their layouts
through the latent cache behind them (its own entry), each behind a new drop-in of the same
form, so the engine batches MLA layers as it batches every other family.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvrows.errors import InvalidInputError, LayoutStateError
from kvrows.optimized.classes import MLACache
from kvrows.optimized.latent import EncodedLatentCache
from kvrows.optimized.paged import LatentBlockPool, PagedLatentCache
from kvrows.protocols import LatentAppend

__all__ = ["LatentCacheList"]

Latent = MLACache | EncodedLatentCache | PagedLatentCache


class _Rows:
    """The row-layout members of a drop-in, over the latent cache behind it
    (``wrapped``): each row operation is the cache's own (a merge passes the caches
    behind the drop-ins it is given). ``rewrap`` puts another latent cache behind a new
    drop-in of the same form."""

    @property
    def wrapped(self) -> Latent:
        raise NotImplementedError

    def rewrap(self, cache: Any) -> Any:
        raise NotImplementedError

    def _idle(self, operation: str) -> None:
        raise NotImplementedError

    @property
    def batch_size(self) -> int:
        return self.wrapped.batch_size

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return self.wrapped.row_offsets

    @property
    def left_pad(self) -> tuple[int, ...]:
        return self.wrapped.left_pad

    @property
    def max_tokens(self) -> float:
        return self.wrapped.max_tokens

    @property
    def state_needs_dispose(self) -> bool:
        return False

    def held_arrays(self) -> tuple[Any, ...]:
        return self.wrapped.held_arrays()

    def fetch(self) -> tuple[Any, Any]:
        fetched: tuple[Any, Any] = self.wrapped.fetch()
        return fetched

    def projected_bytes(self, tokens: int) -> int:
        """The latent cache's projection; while its dtype is unknown (nothing appended or
        merged yet) ``LayoutStateError``, as ``BatchableCache`` promises (never 0)."""
        projected = self.wrapped.projected_bytes(tokens)
        if projected == 0 and tokens > 0:
            raise LayoutStateError(
                "the latent cache's bytes per token are unknown until its first append "
                "(the dtype is learnt from it)"
            )
        return projected

    def make_empty_batch(self) -> Any:
        return self.rewrap(self.wrapped.make_empty_batch())

    def merge_rows(self, rows: Sequence[Any]) -> None:
        self._idle("merge_rows")
        sources: Any = rows  # the cache refuses what is not a sequence of caches
        if isinstance(rows, Sequence) and not isinstance(rows, str | bytes):
            sources = [getattr(row, "wrapped", row) for row in rows]
        self.wrapped.merge_rows(sources)

    def filter_rows(self, keep: Sequence[int]) -> None:
        self._idle("filter_rows")
        self.wrapped.filter_rows(keep)

    def extract_row(self, row: int) -> Any:
        self._idle("extract_row")
        return self.rewrap(self.wrapped.extract_row(row))

    def can_publish_row(self, row: int, tokens: int) -> bool:
        return self.wrapped.can_publish_row(row, tokens)

    # the paged form (``kvrows.protocols.PagedForm``: the engine's paged option)
    def paged_pool(self, block_size: int) -> LatentBlockPool:
        """A new latent block pool for this layer: its latent codec, its DSA index width."""
        cache = self.wrapped
        codec = cache.latent_codec
        return LatentBlockPool(
            codec if codec.encodes else None,
            block_size=block_size,
            index_head_dim=cache.latent_spec.index_head_dim,
        )

    def in_pool(self, pool: LatentBlockPool) -> Any:
        """An empty drop-in of this form over a ``PagedLatentCache`` in ``pool``, of this
        layer's declaration and codec."""
        cache = self.wrapped
        spec = cache.latent_spec
        encoded = cache.latent_codec.encodes
        paged = PagedLatentCache(
            spec.kv_lora_rank, spec.rope_head_dim, spec.index_head_dim,
            cache.token_geometry.cap(), spec.role,
            pool=pool, codec=cache.latent_codec if encoded else None,
            start=cache.start if encoded else 0,
        )  # fmt: skip
        return self.rewrap(paged)

    # the round protocol (``kvrows.speculative.RowRound`` drives a list of these)
    @property
    def spec_round_open(self) -> bool:
        return bool(self.wrapped.spec_round_open)

    def spec_round_begin(self) -> None:
        self.wrapped.spec_round_begin()

    def spec_round_commit(self) -> None:
        self.wrapped.spec_round_commit()

    def spec_round_rollback(self, keep: Any) -> None:
        self.wrapped.spec_round_rollback(keep)


class _View(_Rows):
    """What the model sees as one mlx-lm cache of the pair."""

    #: Which item of the pair this view is.
    item = 0

    def __init__(self, owner: LatentCacheList) -> None:
        self._owner = owner

    @property
    def wrapped(self) -> Latent:
        return self._owner.cache

    def rewrap(self, cache: Any) -> Any:
        return LatentCacheList(cache).caches[self.item]

    def _idle(self, operation: str) -> None:
        self._owner._idle(operation)

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

    item = 1

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


class LatentCacheList(_Rows):
    """One MLA layer's cache for mlx-lm's ``deepseek_v32`` / ``glm_moe_dsa``: items 0 and 1
    of mlx-lm's ``CacheList``, over one latent cache."""

    def __init__(self, cache: Latent) -> None:
        # An optimized latent cache: one that appends MLA planes and previews an append.
        if not (isinstance(cache, LatentAppend) and callable(getattr(cache, "preview", None))):
            raise InvalidInputError(
                f"LatentCacheList holds an optimized MLACache, EncodedLatentCache or "
                f"PagedLatentCache, got "
                f"{type(cache).__name__}"
            )
        self.cache = cache
        self.pending: tuple[mx.array, mx.array] | None = None
        self.caches = (_LatentView(self), _IndexView(self))

    @property
    def wrapped(self) -> Latent:
        return self.cache

    def rewrap(self, cache: Any) -> Any:
        return LatentCacheList(cache)

    def _idle(self, operation: str) -> None:
        if self.pending is not None:
            raise LayoutStateError(
                f"LatentCacheList: cannot {operation} while a latent block waits for its index"
            )

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Item 0's call (a layer that takes the pair calls its items)."""
        return self.caches[0].update_and_fetch(keys, values)

    def make_mask(
        self, n: int, *, return_array: bool = False, window_size: int | None = None
    ) -> Any:
        return self.caches[0].make_mask(n, return_array=return_array, window_size=window_size)

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

    def size(self) -> int:
        return int(self.cache.width)

    def empty(self) -> bool:
        return self.cache.width == 0

    def signature(self) -> str:
        return self.cache.signature()
