"""The codec specs, one module per kind, and their registry (``spec/contract.md`` §0.2).

``CODECS`` maps each kind to its spec class; :func:`parse_codec` reads a scheme word,
:func:`codec_from_tail` a saved state's tail. Importing the package imports every module
it holds, so a codec added as a new module registers itself.
"""

from __future__ import annotations

import importlib
import pkgutil

from kvrows.codecs.affine import Affine
from kvrows.codecs.latent import Latent, LatentShapes
from kvrows.codecs.plain import Plain
from kvrows.codecs.registry import (
    CODECS,
    KV_TENSORS,
    codec_from_tail,
    is_codec_spec,
    is_kv_codec,
    kv_codecs,
    parse_codec,
    register_codec,
)
from kvrows.codecs.state import State, StateShapes
from kvrows.codecs.turbo import TURBO_KEY_BITS, TURBO_VALUE_BITS, Turbo

__all__ = [
    "CODECS",
    "KV_TENSORS",
    "TURBO_KEY_BITS",
    "TURBO_VALUE_BITS",
    "Affine",
    "Latent",
    "LatentShapes",
    "Plain",
    "State",
    "StateShapes",
    "Turbo",
    "codec_from_tail",
    "is_codec_spec",
    "is_kv_codec",
    "kv_codecs",
    "parse_codec",
    "register_codec",
]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    importlib.import_module(f"{__name__}.{_module}")
