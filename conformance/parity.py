"""Where kvrows and mlx-lm knowingly differ, so the parity oracle skips exactly those cases.

Every skip the machines take names one entry of :data:`DIVERGENCES`; the runner
counts and prints them and ``tests/test_conformance.py`` fails on a skip
without an entry. In each case kvrows follows the reference (and the spec);
``spec/tolerances.md`` lists the same table with a minimal reproduction of
each mlx-lm behaviour (``B``-codes are ``notes/mlx-lm.md`` §7's; ``N``-codes
were found by this suite).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DIVERGENCES", "Divergence"]


@dataclass(frozen=True)
class Divergence:
    code: str
    operation: str
    mlx_lm: str
    kvrows: str


DIVERGENCES: dict[str, Divergence] = {
    d.code: d
    for d in (
        Divergence(
            "B2",
            "filter of a batch that has no keys yet but has left padding",
            "BatchKVCache.filter moves _idx below zero; the next mask has zero width",
            "drops the shared padding of the survivors; positions never go negative",
        ),
        Divergence(
            "B3",
            "extract from a batch whose rows hold no tokens yet (keys is None)",
            "BatchKVCache.extract raises TypeError ('NoneType' object is not subscriptable)",
            "returns an empty serial KVCache",
        ),
        Divergence(
            "B4",
            "uniform trim(n) with n larger than some row's tokens",
            "BatchKVCache.trim makes that row's offset negative",
            "raises NotTrimmableError and changes nothing",
        ),
        Divergence(
            "B5",
            "merge or join of rows of different dtypes",
            "BatchKVCache.merge casts every row to the first row's dtype; extend promotes",
            "raises IncompatibleRowsError and changes nothing",
        ),
        Divergence(
            "N1",
            "filter keeping no row (keep = [])",
            "BatchKVCache.filter([]) raises ValueError ([gather] indices must be integral: "
            "mx.array([]) is float32)",
            "the layout becomes empty (batch_size 0) and can form a new batch",
        ),
        Divergence(
            "N2",
            "merge of rows with different KV head counts",
            "BatchKVCache.merge broadcasts a 1-head row into every head of an H-head batch",
            "raises IncompatibleRowsError and changes nothing",
        ),
        Divergence(
            "A1",
            "affine: a QuantizedKVCache whose key or value head dim D has D // (32 // bits) "
            "!= D * bits / 32 (at head dims 32/64/128: bits 5 and 6 at D = 128)",
            "QuantizedKVCache sizes its buffers as D // (32 // bits) words; its first "
            "update_and_fetch raises ValueError ([broadcast_shapes] ... (…, 20) and (…, 21))",
            "stores D * bits / 32 words, as mx.quantize packs them; the example runs without "
            "an mlx-lm twin (one skip per request that would have had one)",
        ),
        Divergence(
            "A2",
            "affine: attention with grouped queries (Hq > H) and a value head dim != key head dim",
            "quantized_scaled_dot_product_attention reshapes its output to the query head dim: "
            "ValueError ([reshape] Cannot reshape array of size ...)",
            "returns [B, Hq, N, Dv]; the mlx-lm twin still takes the block and its stored "
            "planes are compared, only its attention output is not",
        ),
        Divergence(
            "B7",
            "rings with sink tokens (keep > 0) in a batch",
            "BatchRotatingKVCache has no keep: merge and extract drop the sinks (#1631)",
            "every ring layout keeps each row's sinks through merge, filter and extract; the "
            "layout has no mlx-lm mirror (its serial twins still have theirs)",
        ),
        Divergence(
            "K1",
            "rings with sink tokens: a block (N > 1) past the window, or a window_size",
            "RotatingKVCache.make_mask slides the window over the buffer's columns, sinks "
            "included: later queries of a block stop seeing the sinks; window_size ignores them",
            "every query sees its row's sinks and its newest max_size - keep positions "
            "(window_size - keep, at least 1); the stored tokens are compared, the mask and "
            "attention are not",
        ),
        Divergence(
            "B9",
            "rings: a multi-token update of a BatchRotatingKVCache whose ring has wrapped",
            "make_mask trims from the pre-reordering _idx: it hides the oldest valid token of "
            "every row shorter than the window",
            "trims from the max_size columns the temporal copy holds (ring = max_size); the "
            "step's mlx-lm mask must be a subset of kvrows'; fetched columns still compared",
        ),
        Divergence(
            "B10",
            "speculative rounds on a ring: rolling back rejected drafts once the ring has "
            "reached its window (offset >= max_size after the verify block)",
            "RotatingKVCache.is_trimmable() is False, so speculative decoding's "
            "trim_prompt_cache trims nothing: the rejected drafts stay in the ring (later "
            "queries attend to them)",
            "every verify layout forgets the rejected drafts, across the window too (a verify "
            "block keeps max_size - 1 history tokens); the row's mlx-lm twin is rebuilt from "
            "its accepted tokens",
        ),
        Divergence(
            "B11",
            "rings: trim(n > 0) of a ring that has wrapped (offset / _offset >= max_size)",
            "RotatingKVCache.trim and BatchRotatingKVCache.trim ignore is_trimmable() and move "
            "offset and _idx anyway",
            "raises NotTrimmableError and changes nothing; mlx-lm is not asked",
        ),
        Divergence(
            "R1",
            "rings: a join (merge_rows into a running BatchedRotatingCache)",
            "BatchRotatingKVCache.extend keeps the running buffer's width, _idx, _offset and "
            "negative pads (physical layout, masks and trimmability differ from then on)",
            "re-merges every row in temporal order (W = longest window, idx = total = W); the "
            "mirror is re-synced by BatchRotatingKVCache.merge of its own extract()s and the "
            "newcomers, so the physical comparison continues",
        ),
        Divergence(
            "R2",
            "rings: extract of a row after a multi-token update (buffer longer than the window)",
            "BatchRotatingKVCache.extract keeps the whole temporal buffer, up to max_size - 1 + N "
            "columns, _idx at its end",
            "the extracted RotatingKVCache holds the newest min(offset, max_size) tokens; "
            "mlx-lm's newest window is compared and kept (compacted) as the twin",
        ),
        Divergence(
            "V0",
            "invalid input (bad shape, dtype, index, keep list, count, foreign source)",
            "not validated by mlx-lm (fails later, differently, or silently)",
            "raises a KvRowsError subclass before changing anything; not a parity case",
        ),
    )
}
