"""kvrows caches inside unmodified mlx-lm models, and the embedded tiny models.

``make_kvrows_cache(model, scheme)`` builds a model's per-layer caches from a storage
scheme: the model's own ``make_cache()`` says which layers are full attention
(``KVCache``) and which slide (``RotatingKVCache(max_size)``); the scheme says how each
is stored. ``tiny_model(arch)`` builds the embedded random-weight float32 models the
demo and the tests run on (no download).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from kvrows.errors import InvalidInputError

__all__ = ["ARCHITECTURES", "KvStorageScheme", "make_kvrows_cache", "tiny_model"]

ARCHITECTURES = ("llama", "gemma3")


@dataclass(frozen=True)
class KvStorageScheme:
    """How every attention layer stores its KV: plain, or affine at ``bits``/``group_size``."""

    kind: Literal["plain", "affine"] = "plain"
    bits: int = 8
    group_size: int = 64

    @classmethod
    def parse(cls, text: str) -> KvStorageScheme:
        """``plain``, ``affine8``, ``affine4``, or ``affine<bits>:<group>``."""
        if text == "plain":
            return cls()
        if text.startswith("affine"):
            spec = text[len("affine") :] or "8"
            bits, _, group = spec.partition(":")
            try:
                return cls("affine", int(bits), int(group or 64))
            except ValueError:
                pass
        raise InvalidInputError(f"unknown KV scheme {text!r}: expected plain, affine8, affine4:64")

    @property
    def name(self) -> str:
        return "plain" if self.kind == "plain" else f"affine{self.bits}:{self.group_size}"


def make_kvrows_cache(model: Any, scheme: KvStorageScheme | None = None) -> list[Any]:
    """The model's per-layer caches as kvrows optimized storages under ``scheme``."""
    import mlx_lm.models.cache as peer

    import kvrows.optimized as kv

    scheme = scheme or KvStorageScheme()
    template = model.make_cache() if hasattr(model, "make_cache") else None
    if template is None:
        template = [peer.KVCache() for _ in model.layers]  # type: ignore[no-untyped-call]
    caches: list[Any] = []
    for layer in template:
        if isinstance(layer, peer.RotatingKVCache):
            if getattr(layer, "keep", 0):
                raise InvalidInputError("rings with sink tokens (keep > 0) are not supported")
            if scheme.kind == "affine":
                caches.append(
                    kv.RotatingQuantizedKVCache(layer.max_size, scheme.group_size, scheme.bits)
                )
            else:
                caches.append(kv.RotatingKVCache(layer.max_size))
        elif isinstance(layer, peer.KVCache):
            if scheme.kind == "affine":
                caches.append(kv.QuantizedKVCache(scheme.group_size, scheme.bits))
            else:
                caches.append(kv.KVCache())
        else:
            raise InvalidInputError(f"no kvrows storage for mlx-lm {type(layer).__name__}")
    return caches


def tiny_model(arch: str, *, seed: int = 0, vocab: int = 256) -> Any:
    """A small random-weight float32 mlx-lm model of ``arch`` (``llama`` or ``gemma3``)."""
    if arch == "llama":
        from mlx_lm.models import llama

        model: Any = llama.Model(
            llama.ModelArgs(
                model_type="llama",
                hidden_size=128,
                num_hidden_layers=4,
                intermediate_size=256,
                num_attention_heads=8,
                num_key_value_heads=2,
                head_dim=64,
                rms_norm_eps=1e-5,
                vocab_size=vocab,
                tie_word_embeddings=True,
            )
        )
    elif arch == "gemma3":
        from mlx_lm.models import gemma3_text

        model = gemma3_text.Model(
            gemma3_text.ModelArgs(
                model_type="gemma3_text",
                hidden_size=128,
                num_hidden_layers=4,
                intermediate_size=256,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,
                vocab_size=vocab,
                sliding_window=16,
                sliding_window_pattern=2,
                query_pre_attn_scalar=64,
            )
        )
    else:
        raise InvalidInputError(f"unknown architecture {arch!r}: expected one of {ARCHITECTURES}")
    mx.random.seed(seed)
    from mlx.utils import tree_map

    params = tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters())
    model.update(params)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model
