"""The codec axis on MLX: how one token's vector is stored, read and attended over.

Every codec implements ``kvrows.codec.Codec``: a ``[B, H, T, D]`` block becomes planes whose
axis 2 is the token axis, so the row machinery moves planes without re-encoding a byte, and
``attend`` dispatches through the codec that owns its kernel (``mx.fast`` SDPA for plain
planes, ``mx.quantized_matmul`` straight over affine planes, as mlx-lm's quantized attention
does: no dequantized copy of the cache is made).

One module per codec kind (``plain``, ``affine``, ``turbo``), each registering its class
with ``@implements(kind)``; :func:`make_codec` builds the one a spec names. Importing the
package imports every module it holds.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import TypeAlias

from kvrows.codec import Codec as CodecProtocol
from kvrows.codec import CodecSpec
from kvrows.optimized.codecs.affine import AffineCodec, quantized_attention
from kvrows.optimized.codecs.common import Planes, dtype_name, mlx_dtype
from kvrows.optimized.codecs.plain import PlainCodec
from kvrows.optimized.codecs.registry import IMPLEMENTATIONS, build, implements
from kvrows.optimized.codecs.turbo import TurboCodec, eager_attention

__all__ = [
    "IMPLEMENTATIONS",
    "AffineCodec",
    "Codec",
    "PlainCodec",
    "Planes",
    "TurboCodec",
    "dtype_name",
    "eager_attention",
    "implements",
    "make_codec",
    "mlx_dtype",
    "quantized_attention",
]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

#: What every array codec answers (``kvrows.codec.Codec``): callers never ask which it is.
Codec: TypeAlias = CodecProtocol


@cache
def make_codec(spec: CodecSpec) -> Codec:
    """The codec a spec names (one shared instance per spec: codecs hold no state)."""
    codec: Codec = build(spec)
    return codec
