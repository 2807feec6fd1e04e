"""kvrows.optimized: the MLX implementation of every landed composition.

``classes`` declares one class per composition (``lego`` adds the bf16-first wrappers
around table storages, which are not table entries); this module registers every declared
class in the row-layout table with one call (the roles come from the composition table).
"""

from kvrows.compositions import register_compositions
from kvrows.optimized import classes
from kvrows.optimized.attention import attend
from kvrows.optimized.classes import *  # noqa: F403
from kvrows.optimized.delayed import DelayedQuantizedKVCache, DelayedRotatingQuantizedKVCache
from kvrows.optimized.lego import Bf16FirstQuantizedKVCache, Bf16FirstRotatingQuantizedKVCache
from kvrows.optimized.mlxlm_batch import BatchKVCache, BatchRotatingKVCache
from kvrows.optimized.rows import DECLARED

__all__ = [
    *classes.__all__,
    "BatchKVCache",
    "BatchRotatingKVCache",
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "DelayedQuantizedKVCache",
    "DelayedRotatingQuantizedKVCache",
    "attend",
]

register_compositions(DECLARED)
