"""Plain (unquantized) full-attention KV: the serial storage and its two layouts."""

from __future__ import annotations

from collections.abc import Sequence

from kvrows.optimized.codecs import PlainCodec
from kvrows.optimized.storage import FullAttentionCache, RowLayout

from kvrows.errors import InvalidInputError
from kvrows.validation import as_count

__all__ = ["BatchedKVCache", "KVCache", "PaddedKVRows"]


class KVCache(FullAttentionCache):
    """Serial plain full-attention cache (``spec/KVCache.md``)."""

    codec = PlainCodec()
    signature_text = "kv:plain"


class PaddedKVRows(RowLayout):
    """Decode layout of ``KVCache``: rows share one write column (``spec/PaddedKVRows.md``)."""

    codec = PlainCodec()
    serial_class = KVCache
    shared_column = True
    signature_text = "kv:padded-rows"


class BatchedKVCache(RowLayout):
    """Prefill/verify layout of ``KVCache``: ragged rows (``spec/BatchedKVCache.md``)."""

    codec = PlainCodec()
    serial_class = KVCache
    shared_column = False
    signature_text = "kv:batched-positions"

    def trim_rows(self, counts: Sequence[int]) -> int:
        """Forget ``counts[b]`` newest tokens of row ``b``; returns the largest count."""
        if isinstance(counts, str | bytes) or not isinstance(counts, Sequence):
            raise InvalidInputError("trim_rows takes one count per row")
        if len(counts) != self.batch_size:
            raise InvalidInputError(
                f"trim_rows needs {self.batch_size} counts (one per row), got {len(counts)}"
            )
        return self._trim_rows([as_count(c, f"counts[{i}]") for i, c in enumerate(counts)])
