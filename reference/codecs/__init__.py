"""How the reference stores one token's vector: the codec axis, and attention.

A codec turns a ``[B, H, T, D]`` block into a tuple of *planes*, each an array whose
axis 2 is the token axis. Every codec groups along the feature axis only, so slicing,
padding and concatenating planes along tokens never re-encodes a byte: the row
machinery (``kvrows.reference.rows``) is written once, over planes.

One module per codec kind (``plain``, ``affine``, ``turbo``), each registering its class
with ``@implements(kind)``; :func:`make_codec` builds the one a spec names. Every codec
implements ``kvrows.codec.Codec``; ``attend`` dispatches through ``cache.codec.attend``.
The affine codec dequantizes (bit-exactly as ``mx.dequantize`` on the CPU) and runs the
dense kernel (``common.attention``). Importing the package imports every module it holds.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TypeAlias

from kvrows.codec import Codec as CodecProtocol
from kvrows.codec import CodecSpec
from kvrows.reference.codecs.affine import AffineCodec
from kvrows.reference.codecs.common import Planes, attend, attention, dtype_name, numpy_dtype
from kvrows.reference.codecs.plain import PlainCodec
from kvrows.reference.codecs.registry import IMPLEMENTATIONS, build, implements
from kvrows.reference.codecs.turbo import TurboCodec, eager_attention

__all__ = [
    "IMPLEMENTATIONS",
    "AffineCodec",
    "Codec",
    "PlainCodec",
    "Planes",
    "TurboCodec",
    "attend",
    "attention",
    "dtype_name",
    "eager_attention",
    "implements",
    "make_codec",
    "numpy_dtype",
]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")

#: What every array codec answers (``kvrows.codec.Codec``): callers never ask which it is.
Codec: TypeAlias = CodecProtocol


def make_codec(spec: CodecSpec) -> Codec:
    """The reference codec for ``spec``."""
    codec: Codec = build(spec)
    return codec
