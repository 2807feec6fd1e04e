"""What reading a wrapped ring in time order costs (``spec/engine.md`` §8).

One ring layer's decode attention (fp16, 8 KV heads, head dim 128, one query token, 16
query heads) through ``mx.fast.scaled_dot_product_attention``, on the ring's physical
columns and on the same columns put in time order by ``kvrows.app.ring_order`` (one copy
of the window's keys and values); and the cost of opening ``attention_scope`` once
(the tiny gemma3). Median of 20 after one warm-up.

Run: ``.venv/bin/python tools/ring_order_cost.py``
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import mlx.core as mx

from kvrows.app.attention import attention_scope
from kvrows.app.models import make_kvrows_cache, tiny_model
from kvrows.app.ring_order import _reorder


def _median_ms(run: Callable[[], object], repeats: int = 20) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[len(times) // 2]


def _attend(queries: mx.array, keys: mx.array, values: mx.array, idx: int = 0) -> None:
    """Attention over the columns as they are, or (``idx > 0``) put in time order first."""
    if idx:
        keys, values = _reorder(keys, 0, idx, 2), _reorder(values, 0, idx, 2)
    mx.eval(mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.1))


def main() -> None:
    heads, dim = 8, 128
    for rows, window in ((1, 1024), (16, 1024), (1, 4096), (16, 4096)):
        keys = mx.random.normal((rows, heads, window, dim)).astype(mx.float16)
        values = mx.random.normal((rows, heads, window, dim)).astype(mx.float16)
        queries = mx.random.normal((rows, 2 * heads, 1, dim)).astype(mx.float16)
        mx.eval(keys, values, queries)
        idx = window // 3

        a = _median_ms(partial(_attend, queries, keys, values))
        b = _median_ms(partial(_attend, queries, keys, values, idx))
        print(f"B={rows} W={window}: physical {a:.3f} ms, time order {b:.3f} ms ({b / a:.2f}x)")
    model = tiny_model("gemma3")
    caches = make_kvrows_cache(model)

    def scope() -> None:
        with attention_scope(model, caches):
            pass

    print(f"attention_scope enter + exit (tiny gemma3): {1e3 * _median_ms(scope, 200):.1f} us")


if __name__ == "__main__":
    main()
