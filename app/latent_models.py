"""Tiny random-weight MLA models (mlx-lm ``deepseek_v32`` / ``glm_moe_dsa``) and their
kvrows latent caches (``spec/MLACache.md`` §3). No download: the models are built from
mlx-lm's own ``ModelArgs`` with small widths."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.errors import InvalidInputError
from kvrows.latent import LatentCodec
from kvrows.optimized import (
    EncodedLatentCache,
    LatentBlockPool,
    LatentCacheList,
    MLACache,
    PagedLatentCache,
)
from kvrows.schemes import KvStorageScheme

__all__ = [
    "LATENT_ARCHITECTURES",
    "LATENT_PLAIN_ARCHITECTURES",
    "is_latent_model",
    "latent_caches_for_scheme",
    "latent_pools",
    "make_latent_cache",
    "make_paged_latent_cache",
    "tiny_latent_model",
]

LATENT_ARCHITECTURES = ("deepseek_v32", "glm_moe_dsa")
#: MLA models whose layers cache only the latent and the rope key in one mlx-lm KVCache.
LATENT_PLAIN_ARCHITECTURES = ("deepseek_v3",)

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "index_head_dim": 32,
    "index_n_heads": 2,
    "index_topk": 8,  # prompts past 8 tokens take the sparse path
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": None,
    "n_routed_experts": None,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 64,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "qk_nope_head_dim": 32,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 0,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
}


def tiny_latent_model(arch: str, *, seed: int = 0, vocab: int = 256) -> Any:
    """A small random-weight float32 MLA model of ``arch`` (DSA indexer included)."""
    args = {**_COMMON, "vocab_size": vocab}
    if arch == "deepseek_v32":
        from mlx_lm.models import deepseek_v32

        model: Any = deepseek_v32.Model(
            deepseek_v32.ModelArgs(model_type="deepseek_v32", rope_theta=10000.0, **args)
        )
    elif arch == "deepseek_v3":
        from mlx_lm.models import deepseek_v3

        fields = deepseek_v3.ModelArgs.__dataclass_fields__
        model = deepseek_v3.Model(
            deepseek_v3.ModelArgs(
                model_type="deepseek_v3",
                rope_theta=10000.0,
                **{k: v for k, v in args.items() if k in fields},
            )
        )
    elif arch == "glm_moe_dsa":
        from mlx_lm.models import glm_moe_dsa

        model = glm_moe_dsa.Model(
            glm_moe_dsa.ModelArgs(
                model_type="glm_moe_dsa", rope_parameters={"rope_theta": 10000.0}, **args
            )
        )
    else:
        raise InvalidInputError(
            f"unknown MLA architecture {arch!r}: expected one of {LATENT_ARCHITECTURES}"
        )
    mx.random.seed(seed)
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters()))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def is_latent_model(model: Any) -> bool:
    """Whether ``model``'s layers cache an MLA latent: through ``CacheList`` pairs with a
    DSA indexer (``deepseek_v32``, ``glm_moe_dsa``) or one ``KVCache`` (``deepseek_v3``)."""
    args: Any = getattr(model, "args", None)
    if not hasattr(args, "kv_lora_rank"):
        return False
    return hasattr(args, "index_head_dim") or args.model_type in LATENT_PLAIN_ARCHITECTURES


def _geometry(model: Any) -> tuple[int, int, int | None]:
    args = model.args
    return args.kv_lora_rank, args.qk_rope_head_dim, getattr(args, "index_head_dim", None)


def _layer(cache: MLACache | EncodedLatentCache | PagedLatentCache) -> Any:
    """The object a layer takes: the pair for a DSA layer, else item 0 alone."""
    pair = LatentCacheList(cache)
    return pair if cache.options.dsa else pair[0]


def make_latent_cache(model: Any, codec: LatentCodec | None = None, start: int = 0) -> list[Any]:
    """One :class:`LatentCacheList` per layer of an MLA model: ``MLACache`` (plain codec)
    or ``EncodedLatentCache`` (``codec`` affine or TurboQuant, bf16-first at ``start``)."""
    if not is_latent_model(model):
        raise InvalidInputError(f"{type(model).__name__} is not an MLA model kvrows serves")
    geometry = _geometry(model)
    caches: list[Any] = []
    for _ in model.layers:
        if codec is None or not codec.encodes:
            caches.append(_layer(MLACache(*geometry)))
        else:
            caches.append(_layer(EncodedLatentCache(*geometry, codec=codec, start=start)))
    return caches


def latent_pools(
    model: Any, block_size: int = 16, codec: LatentCodec | None = None
) -> list[LatentBlockPool]:
    """One latent block pool per layer of an MLA model (shared by every request); the
    latent plain, or through ``codec`` (affine or TurboQuant)."""
    index = _geometry(model)[2]
    return [
        LatentBlockPool(codec, block_size=block_size, index_head_dim=index) for _ in model.layers
    ]


def make_paged_latent_cache(
    model: Any, pools: list[LatentBlockPool] | None = None, start: int = 0
) -> list[Any]:
    """One request's layer caches over ``pools`` (``latent_pools``; private plain pools
    when ``None``): a :class:`PagedLatentCache` per layer behind a ``LatentCacheList``, its
    latent codec the pool's (bf16-first at ``start`` when encoded)."""
    if not is_latent_model(model):
        raise InvalidInputError(f"{type(model).__name__} is not an MLA model kvrows serves")
    chosen = pools if pools is not None else latent_pools(model)
    if len(chosen) != len(model.layers):
        raise InvalidInputError(f"one pool per layer: {len(model.layers)}, got {len(chosen)}")
    geometry = _geometry(model)
    caches = []
    for pool in chosen:
        codec = pool.codec_spec
        encoded = codec.encodes
        cache = PagedLatentCache(
            *geometry, pool=pool, codec=codec if encoded else None, start=start if encoded else 0
        )
        caches.append(_layer(cache))
    return caches


def latent_caches_for_scheme(model: Any, scheme: KvStorageScheme) -> list[Any]:
    """``make_kvrows_cache`` for an MLA model: each layer's codec from ``scheme`` (plain:
    ``MLACache``; affine or TurboQuant: ``EncodedLatentCache`` of that latent codec, bf16-first
    at ``scheme.quantized_kv_start``, else 0: the first append of a row reads exact)."""
    geometry = _geometry(model)
    resolved = scheme.resolve(len(model.layers))
    start = resolved.quantized_kv_start or 0
    caches: list[Any] = []
    for index in range(len(model.layers)):
        codec = resolved.codec_for_layer(index)
        if codec.encodes:
            caches.append(_layer(EncodedLatentCache(*geometry, codec=codec, start=start)))
        else:
            caches.append(_layer(MLACache(*geometry)))
    return caches
