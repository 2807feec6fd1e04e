"""The optimized bf16-first storages (``kvrows.lego``; ``spec/bf16-first.md``): the
presets are built by ``classes.py`` from the table (re-exported here, where they were
written before).

A lego's conversion is the row machinery's ``_convert_rows`` (``rows.py``): every plane
re-encoded whole, a ring keeping its phase, the result owned and evaluated, as the plain
storage's ``to_quantized`` does. Beyond the lego's own surface, what mlx-lm's models read
off a cache (``keys``, ``values``, ``keys_and_values()``, ``size()``, ``empty()``, a ring's
``max_size`` / ``keep``) is the current stage's. A lego has no ``to_quantized``:
``generate(kv_bits=...)`` leaves it alone (it converts itself).
"""

from __future__ import annotations

from kvrows.optimized.classes import (
    Bf16FirstQuantizedKVCache,
    Bf16FirstRotatingQuantizedKVCache,
    Bf16FirstTurboQuantKVCache,
)

__all__ = [
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
]
