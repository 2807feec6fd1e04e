"""kvrows caches inside unmodified mlx-lm models, and the embedded tiny models.

``make_kvrows_cache(model, scheme)`` builds a model's per-layer caches from a storage
scheme (:class:`kvrows.schemes.KvStorageScheme`): the model's own ``make_cache()`` names
each layer's mlx-lm cache class, the composition table (``kvrows.compositions``) names
the kvrows serial storage that serves that class under the layer's codec, and the storage
is built from the one codec spec the scheme carries and the layer's token geometry, with
the KV geometry declared (:func:`kv_geometry`) so projected bytes are known before the
first token; an MLA model's layers get latent caches (``spec/MLACache.md`` §3), its
recurrent layers ``SSMCache`` (the planes its config declares: :func:`recurrent_geometry`).

``tiny_model(arch)`` builds the embedded random-weight float32 models the demo and the
tests run on (no download), one row of :data:`TINY_MODELS` per architecture: attention
(llama, gemma3), recurrent (Qwen3-Next's gated DeltaNet with full attention every second
layer, Mamba2, and every other architecture mlx-lm builds an ``ArraysCache`` for) and MLA
(deepseek_v3, and the DSA ones). ``draft_model(target)`` a speculative draft of the same
architecture and vocabulary: a truncated copy of the target (its embedding, first layers,
final norm and head).

A verify round rolls recurrent state back by replaying the accepted tokens through the
layer that wrote it (``spec/BatchedSSMCache.md`` §7): :func:`record_recurrent_layers`
finds those layers generically (every layer called with a ``cache`` that a ``StateWritten``
state reaches) and :func:`check_speculative_rounds` refuses a model whose layers cannot
replay. ``tiny_model`` records every model it builds (a model without recurrent state is
not touched).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

import kvrows.optimized as kv
from kvrows.compositions import (
    Composition,
    bind_arguments,
    composition,
    landed,
    serial_for_peer,
)
from kvrows.errors import InvalidInputError, NotTrimmableError
from kvrows.latent import LatentCodec
from kvrows.optimized import (
    EncodedLatentCache,
    LatentBlockPool,
    LatentCacheList,
    MLACache,
    PagedLatentCache,
)
from kvrows.protocols import StateWritten
from kvrows.recurrent import StateShapes
from kvrows.schemes import CodecSpec, GeometrySpec, KvStorageScheme, Plain
from kvrows.validation import KvGeometry

__all__ = [
    "ARCHITECTURES",
    "BUILTIN_MODELS",
    "CHUNKED_ARCHITECTURES",
    "HYBRID_ARCHITECTURES",
    "LATENT_ARCHITECTURES",
    "LATENT_PLAIN_ARCHITECTURES",
    "RECURRENT_ARCHITECTURES",
    "TINY_MODELS",
    "TinyModel",
    "check_model",
    "check_speculative_rounds",
    "draft_model",
    "forward",
    "is_latent_model",
    "kv_geometry",
    "latent_caches_for_scheme",
    "latent_pools",
    "make_kvrows_cache",
    "make_latent_cache",
    "make_paged_latent_cache",
    "record_recurrent_layers",
    "recurrent_geometry",
    "text_config",
    "tiny_model",
    "tiny_model_and_tokenizer",
]


@dataclass(frozen=True)
class TinyModel:
    """One embedded tiny architecture: ``mlx_lm.models.<module>`` (also its config's
    ``model_type``), its family and the config (what its ``ModelArgs`` does not take is
    dropped: the MLA rows share one config)."""

    module: str
    #: ``attention``; ``hybrid`` (the demo's recurrent models) or ``recurrent``; ``mla``
    #: (latent and rope key in one ``KVCache``) or ``dsa`` (``CacheList`` pairs with a DSA
    #: indexer).
    family: str
    config: dict[str, Any]


_ATTENTION: dict[str, Any] = dict(
    hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_key_value_heads=2,
    head_dim=64,
)  # fmt: skip

_MLA: dict[str, Any] = dict(
    hidden_size=64, index_head_dim=32, index_n_heads=2,
    index_topk=8,  # prompts past 8 tokens take the sparse path
    intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=None,
    n_routed_experts=None, routed_scaling_factor=1.0, kv_lora_rank=64, q_lora_rank=32,
    qk_rope_head_dim=16, v_head_dim=32, qk_nope_head_dim=32, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1,
    num_experts_per_tok=1, moe_layer_freq=1, first_k_dense_replace=0,
    max_position_embeddings=1024, rms_norm_eps=1e-6, attention_bias=False,
)  # fmt: skip

#: The embedded tiny models, by architecture. A recurrent row has every layer kind its
#: architecture has (lfm2's conv and attention, kimi_linear's KDA and MLA,
#: bailing_moe_linear's GLA and attention, baichuan_m1's global and sliding layers,
#: falcon_h1's Mamba2 mixer beside attention in every layer).
TINY_MODELS: dict[str, TinyModel] = {
    "llama": TinyModel("llama", "attention", dict(
        _ATTENTION, num_attention_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )),
    "gemma3": TinyModel("gemma3_text", "attention", dict(
        _ATTENTION, num_attention_heads=4, sliding_window=16, sliding_window_pattern=2,
        query_pre_attn_scalar=64,
    )),
    "qwen3_next": TinyModel("qwen3_next", "hybrid", dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64,  # a TurboQuant head dim
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        partial_rotary_factor=0.5, max_position_embeddings=512, tie_word_embeddings=True,
        full_attention_interval=2,
    )),
    "mamba2": TinyModel("mamba2", "hybrid", dict(
        num_heads=8, head_dim=16, hidden_size=64, intermediate_size=128, state_size=16,
        num_hidden_layers=3, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=2,
        use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
        time_step_limit=(0.001, 100.0), time_step_rank="auto",
    )),
    "lfm2": TinyModel("lfm2", "recurrent", dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=32, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, block_ff_dim=64,
        layer_types=["conv", "full_attention", "conv"],
    )),
    "rwkv7": TinyModel("rwkv7", "recurrent", dict(
        hidden_size=32, intermediate_size=64, norm_eps=1e-5, head_dim=16,
        num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
        decay_low_rank_dim=8,
    )),
    "kimi_linear": TinyModel("kimi_linear", "recurrent", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        linear_attn_config={
            "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1]
        },
        model_max_length=256, num_experts=0, moe_intermediate_size=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
    )),
    "bailing_moe_linear": TinyModel("bailing_moe_linear", "recurrent", dict(
        hidden_size=32, intermediate_size=64, max_position_embeddings=256,
        moe_intermediate_size=32, num_experts=4, num_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=2, num_experts_per_tok=2, num_hidden_layers=2,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        first_k_dense_replace=1, layer_group_size=2, group_norm_size=1, head_dim=16,
    )),
    "baichuan_m1": TinyModel("baichuan_m1", "recurrent", dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, rope_theta=10000.0, sliding_window=8,
        sliding_window_layers=[1], conv_window=2, rms_norm_eps=1e-5,
    )),
    "falcon_h1": TinyModel("falcon_h1", "recurrent", dict(
        hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, mamba_d_conv=4, mamba_d_head=8, mamba_d_ssm=32,
        mamba_d_state=8, mamba_n_groups=1, mamba_n_heads=4, num_hidden_layers=2,
        mamba_chunk_size=8,
    )),
    "deepseek_v32": TinyModel("deepseek_v32", "dsa", dict(_MLA, rope_theta=10000.0)),
    "glm_moe_dsa": TinyModel(
        "glm_moe_dsa", "dsa", dict(_MLA, rope_parameters={"rope_theta": 10000.0})
    ),
    "deepseek_v3": TinyModel("deepseek_v3", "mla", dict(_MLA, rope_theta=10000.0)),
    # Chunked-local attention on three layers of four (ChunkedKVCache), full attention on
    # the fourth; no MoE layer, and no attention temperature tuning (its NoPE layers then
    # take per-row positions).
    "llama4": TinyModel("llama4", "chunked", dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, intermediate_size_mlp=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, attention_chunk_size=8,
        attention_bias=False, interleave_moe_layer_step=4096, num_experts_per_tok=1,
        num_local_experts=1, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_scaling=None, rope_theta=10000.0, use_qk_norm=True, attn_temperature_tuning=0,
    )),
}  # fmt: skip


def _family(*families: str) -> tuple[str, ...]:
    return tuple(arch for arch, row in TINY_MODELS.items() if row.family in families)


ARCHITECTURES = _family("attention")
#: The recurrent models the demo runs (``--model hybrid``), and every recurrent one.
HYBRID_ARCHITECTURES = _family("hybrid")
RECURRENT_ARCHITECTURES = _family("hybrid", "recurrent")
LATENT_ARCHITECTURES = _family("dsa")
#: MLA models whose layers cache only the latent and the rope key in one mlx-lm KVCache.
LATENT_PLAIN_ARCHITECTURES = _family("mla")
#: Models with chunked-local attention layers (llama4's ``ChunkedKVCache``).
CHUNKED_ARCHITECTURES = _family("chunked")
#: What ``kvrows demo --model`` takes besides a checkpoint directory: the embedded tiny
#: models by architecture, and ``hybrid`` (both recurrent ones).
BUILTIN_MODELS = (*ARCHITECTURES, *HYBRID_ARCHITECTURES, *CHUNKED_ARCHITECTURES, "hybrid")


def check_model(name: str) -> None:
    """Refuse a model name that is neither built in (:data:`BUILTIN_MODELS`) nor a local
    mlx-lm checkpoint directory (``config.json`` and ``model*.safetensors``), saying which:
    no such directory, not a model directory, or a built-in name misspelt. Nothing is
    downloaded: a name that is not a directory here never reaches the Hugging Face Hub."""
    if name in BUILTIN_MODELS:
        return
    builtin = ", ".join(BUILTIN_MODELS)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise InvalidInputError(
                f"{name} is not a model directory: it has no config.json (an mlx-lm "
                "checkpoint holds config.json and model*.safetensors)"
            )
        if not any(
            entry.startswith("model") and entry.endswith(".safetensors")
            for entry in os.listdir(path)
        ):
            raise InvalidInputError(
                f"{name} is not a model directory: it has no model*.safetensors weights"
            )
        return
    if os.path.exists(path):
        raise InvalidInputError(f"{name} is a file, not a model directory")
    if os.sep in name or "/" in name or name.startswith((".", "~")):
        raise InvalidInputError(
            f"no such directory {name} (a model is a local mlx-lm checkpoint directory, "
            f"or a built-in: {builtin}; nothing is downloaded)"
        )
    close = difflib.get_close_matches(name, BUILTIN_MODELS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise InvalidInputError(
        f"unknown model {name!r}{hint}: the built-in models are {builtin}; "
        "anything else is a local mlx-lm checkpoint directory"
    )


#: mlx-lm's recurrent caches (``ArraysCache``): ``SSMCache`` serves them under every scheme.
_RECURRENT_PEERS = composition("SSMCache").peers

#: Models whose ``ArraysCache`` is not recurrent state, so ``SSMCache`` cannot serve it,
#: by ``model_type``: refused before any cache is built (spec/mlx-lm-drop-in.md §3).
_NOT_STATE_ARRAYS = {
    "longcat_flash_ngram": (
        0,
        "its ArraysCache(size=1) holds the n-gram token ids (int64, a width that grows "
        "with the context), not recurrent state; kvrows has no class for it",
    ),
}


def _weight_dtype(model: Any) -> str | None:
    """The dtype of ``model``'s first floating-point weight (its activations'), by name:
    the first of ``tree_flatten(model.parameters())`` in its order (public keys, dicts
    and lists in order), found without building the whole tree (every request's fresh
    caches ask)."""
    # (a wrapper that is no ``nn.Module`` hands its model's tree)
    found = _first_floating(model if isinstance(model, dict) else model.parameters())
    return None if found is None else str(found.dtype).rsplit(".", 1)[-1]


def _first_floating(tree: Any) -> mx.array | None:
    if isinstance(tree, mx.array):
        return tree if mx.issubdtype(tree.dtype, mx.floating) else None
    if isinstance(tree, dict):  # (an ``nn.Module`` is a dict of its members)
        items: Any = ((k, v) for k, v in tree.items() if not k.startswith("_"))
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        return None
    for _, value in items:
        if isinstance(value, mx.array | dict | list):
            found = _first_floating(value)
            if found is not None:
                return found
    return None


def text_config(model: Any) -> Any:
    """``model``'s config (``args``), its language part's for a multimodal model (llama4's
    ``text_config``)."""
    args: Any = getattr(model, "args", object())
    return getattr(args, "text_config", args)


def kv_geometry(model: Any) -> KvGeometry | None:
    """The KV heads, head dim and dtype every attention layer of ``model`` stores, from its
    config (``num_key_value_heads``, ``head_dim`` or ``hidden_size / num_attention_heads``)
    and its first floating-point weight's dtype. ``None`` where the config does not say or
    keys and values may differ in width (MLA: ``kv_lora_rank``, ``v_head_dim``): the
    storages then learn the geometry from their first token.
    """
    args = text_config(model)
    if any(hasattr(args, name) for name in ("kv_lora_rank", "v_head_dim", "qk_rope_head_dim")):
        return None
    heads = _sharded_kv_heads(model) or getattr(args, "num_key_value_heads", None)
    dim = getattr(args, "head_dim", None)
    if dim is None and getattr(args, "num_attention_heads", None):
        dim = getattr(args, "hidden_size", 0) // args.num_attention_heads
    dtype = _weight_dtype(model)
    if not heads or not dim or dtype is None:
        return None
    return KvGeometry(heads=int(heads), key_dim=int(dim), value_dim=int(dim), dtype=dtype)


def _sharded_kv_heads(model: Any) -> int | None:
    """The KV heads each attention layer holds where the model was sharded over a group
    (``model.shard``: its layers hold ``num_key_value_heads / N``); ``None`` otherwise."""
    shards = getattr(model, "kvrows_shards", None)
    if shards is None:
        return None
    counts = {
        int(attention.n_kv_heads)
        for layer in getattr(model, "layers", ())
        if (attention := getattr(layer, "self_attn", None)) is not None
        and hasattr(attention, "n_kv_heads")
    }
    return counts.pop() if len(counts) == 1 else None


def _token_geometry(entry: Composition, codec: CodecSpec, layer: Any) -> GeometrySpec:
    """The token geometry of mlx-lm cache ``layer`` as the composition ``entry`` stores it
    under ``codec``: the entry's parameters the codec does not give (a ring's ``max_size``
    and ``keep``) read off the layer, which names them as mlx-lm's constructors do."""
    given = codec.parameters()
    numbers = {
        name: int(getattr(layer, name))
        for name in entry.params
        if name not in given and hasattr(layer, name)
    }
    _, geometry, _ = bind_arguments(entry, (), {**numbers, "codec": codec})
    return geometry


def _layer_codec(codec: CodecSpec, layer: Any, bf16_first: bool) -> CodecSpec:
    """``codec``, or plain where no storage serving the layer's mlx-lm class takes
    ``codec`` (``bf16_first``: a bf16-first one): TurboQuant refuses the layer's token
    geometry (full attention only); a codec with no bf16-first storage on the layer's
    geometry is refused under a start. Such a layer stays plain (what a bf16-first layer
    holds before its start)."""
    peer = type(layer).__name__
    try:
        plain = serial_for_peer(peer, Plain())
    except InvalidInputError:
        return codec  # no storage serves the layer: the codec's own lookup says so
    try:
        codec.check_token_geometry(plain.name, _token_geometry(plain, Plain(), layer))
        entry = serial_for_peer(peer, codec)
    except InvalidInputError:
        return Plain()
    if bf16_first and codec.encodes and _delayed_of(entry) is None:
        return Plain()
    return codec


def _build(
    entry: Composition, codec: CodecSpec, geometry: GeometrySpec, declared: KvGeometry | None
) -> Any:
    cls: Any = getattr(kv, entry.name)
    return cls.from_specs(codec, geometry, geometry=declared)


def make_kvrows_cache(model: Any, scheme: KvStorageScheme | None = None) -> list[Any]:
    """The model's per-layer caches as kvrows optimized storages under ``scheme``.

    With ``scheme.quantized_kv_start`` set, each affine or TurboQuant layer gets a
    bf16-first storage (``Bf16FirstQuantizedKVCache`` / ``Bf16FirstRotatingQuantizedKVCache``
    / ``Bf16FirstTurboQuantKVCache``) that stays plain until an append reaches that many
    tokens (``spec/bf16-first.md``); plain layers ignore the boundary. A TurboQuant scheme
    stores the full-attention layers as ``TurboQuantKVCache`` (or its lego) and keeps
    sliding-window layers plain rings; its reads return
    rotated values, so run the model inside ``kvrows.app.attention.row_attention(model)``
    (the engine does), which un-rotates each attention output."""
    import mlx_lm.models.cache as peer

    scheme = scheme or KvStorageScheme()
    if is_latent_model(model):  # MLA layers: latent caches (spec/MLACache.md §3)
        return latent_caches_for_scheme(model, scheme)
    unserved = _NOT_STATE_ARRAYS.get(_model_name(model))
    if unserved is not None:
        layer_index, why = unserved
        raise InvalidInputError(f"{_model_name(model)}, layer {layer_index}: {why}")
    template = model.make_cache() if hasattr(model, "make_cache") else None
    if template is None:
        template = [peer.KVCache() for _ in model.layers]  # type: ignore[no-untyped-call]
    declared = kv_geometry(model)
    scheme = scheme.resolve(len(template))  # negative layer indices count from the last
    caches: list[Any] = []
    declared_state = recurrent_geometry(model)
    # mlx-lm's CacheList (baichuan_m1: an ArraysCache(2) and a KV cache per layer): each
    # part is served as that layer's, then grouped in a CacheListDropIn (the table batches
    # it part by part).
    parts = [
        (index, part)
        for index, layer in enumerate(template)
        for part in (layer.caches if type(layer).__name__ == "CacheList" else (layer,))
    ]
    for index, layer in parts:
        if type(layer).__name__ in _RECURRENT_PEERS:  # recurrent state: no KV codec applies
            # mlx-lm's ArraysCache(size=n): n planes of any rank (the config declares the
            # shapes of gated DeltaNet's two; other layers' are learnt at the first write).
            planes = len(getattr(layer, "cache", ())) or None
            fits = declared_state is not None and len(declared_state.planes) == planes
            caches.append(kv.SSMCache(planes, geometry=declared_state if fits else None))
            continue
        start = scheme.quantized_kv_start
        codec = _layer_codec(scheme.codec_for_layer(index), layer, start is not None)
        try:
            entry = serial_for_peer(type(layer).__name__, codec)
        except InvalidInputError as refused:
            raise InvalidInputError(f"{_model_name(model)}, layer {index}: {refused}") from refused
        geometry = _token_geometry(entry, codec, layer)
        if start is not None and codec.encodes:
            caches.append(_lego(entry, codec, geometry, start, declared))
        else:
            caches.append(_build(entry, codec, geometry, declared))
    served = iter(caches)
    return [
        kv.CacheListDropIn(*(next(served) for _ in layer.caches))
        if type(layer).__name__ == "CacheList"
        else next(served)
        for layer in template
    ]


def _llama4_rows(model: Any, ids: mx.array, caches: Sequence[Any]) -> mx.array:
    """llama4's language model over layouts: its top level builds one chunk mask from
    ``cache[0].start_position`` and ``offset``, one row's positions; here each layer takes
    its own cache's mask (a chunked layout's hides other chunks row by row)."""
    text = model.language_model
    inner = text.model
    h = inner.embed_tokens(ids)
    n = int(h.shape[1])
    for layer, cache in zip(inner.layers, caches, strict=True):
        h = layer(h, cache.make_mask(n), cache=cache)
    logits: mx.array = text.lm_head(inner.norm(h))
    return logits


#: The models whose top level computes its masks from one row's positions, by
#: ``model_type``: what runs them over layouts (:func:`forward`).
_LAYOUT_FORWARDS: dict[str, Callable[[Any, mx.array, Sequence[Any]], mx.array]] = {
    "llama4": _llama4_rows,
}


def forward(model: Any, ids: mx.array, caches: Sequence[Any]) -> mx.array:
    """``model(ids, cache=caches)``; over layouts (per-row positions), a model of
    :data:`_LAYOUT_FORWARDS` runs its layers with each layer's own mask."""
    rows = _LAYOUT_FORWARDS.get(_model_name(model))
    if rows is not None and caches and not isinstance(caches[0].offset, int):
        return rows(model, ids, caches)
    logits: mx.array = model(ids, cache=caches)
    return logits


def _model_name(model: Any) -> str:
    """The model's ``model_type`` (its mlx-lm module name where the config has none)."""
    name = getattr(getattr(model, "args", None), "model_type", None)
    name = name or getattr(model, "model_type", None)
    return str(name or type(model).__module__.rsplit(".", 1)[-1])


def _delayed_of(entry: Composition) -> Composition | None:
    """The delayed layout whose rows extract into ``entry`` (``None``: the serial storage
    has no bf16-first form)."""
    return next((c for c in landed() if "delayed" in c.modifiers and c.serial == entry.name), None)


def _lego(
    entry: Composition,
    codec: CodecSpec,
    geometry: GeometrySpec,
    start: int,
    declared: KvGeometry | None,
) -> Any:
    """The bf16-first storage of an encoding layer with a conversion boundary: the lego of
    the delayed layout whose rows extract into ``entry`` (the table's serial storage), built
    from ``entry``'s parameters by name, then ``start``."""
    delayed = _delayed_of(entry)
    if delayed is None:
        raise InvalidInputError(f"{entry.name} has no bf16-first storage (quantized_kv_start)")
    lego: Any = getattr(kv, delayed.name).lego_class
    numbers = {**codec.parameters(), **geometry.parameters()}
    return lego(**{name: numbers[name] for name in entry.params}, start=start, geometry=declared)


def tiny_model(
    arch: str,
    *,
    seed: int = 0,
    vocab: int = 256,
    record: bool = True,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """A small random-weight float32 mlx-lm model of ``arch`` (a key of
    :data:`TINY_MODELS`), its recurrent layers wrapped by :func:`record_recurrent_layers`
    (``record=False``: mlx-lm's model as it is). ``overrides``: config fields over the
    architecture's (``{"num_key_value_heads": 4}``: heads to shard over two ranks)."""
    row = TINY_MODELS.get(arch)
    if row is None:
        raise InvalidInputError(
            f"unknown architecture {arch!r}: expected one of {tuple(TINY_MODELS)}"
        )
    module: Any = importlib.import_module(f"mlx_lm.models.{row.module}")
    config = {"model_type": row.module, **row.config, **(overrides or {}), "vocab_size": vocab}
    taken = module.ModelArgs.__dataclass_fields__
    if "text_config" in taken:  # a multimodal model's language part (llama4)
        config = {"model_type": row.module, "text_config": config}
    model: Any = module.Model(module.ModelArgs(**{k: v for k, v in config.items() if k in taken}))
    mx.random.seed(seed)
    from mlx.utils import tree_map

    params = tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters())
    model.update(params)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    if record:
        record_recurrent_layers(model)  # verify rounds on its recurrent layers can roll back
    return model


def tiny_model_and_tokenizer(arch: str, *, seed: int = 0) -> tuple[Any, Any]:
    """``tiny_model(arch)`` and its built-in byte-level tokenizer
    (:func:`kvrows.app.tiny_tokenizer.tiny_tokenizer`): what mlx-lm's ``load`` returns for a
    checkpoint, with no download. The weights are random, so the text is noise."""
    from kvrows.app.tiny_tokenizer import BYTE_VOCAB, tiny_tokenizer

    return tiny_model(arch, seed=seed, vocab=BYTE_VOCAB), tiny_tokenizer()


def draft_model(target: Any, layers: int | None = None) -> Any:
    """A speculative draft for ``target``: the same class, config and vocabulary with only
    its first ``layers`` transformer layers, sharing the target's own weights (embedding,
    those layers, final norm, head), so it agrees with the target often enough to accept.

    ``layers`` defaults to the fewest that keep every kind of layer the target has (gemma3
    needs one window of its local/global pattern: 2 for the tiny model; llama 1).
    """
    from mlx.utils import tree_flatten

    args: Any = getattr(target, "args", None)
    if args is None or not dataclasses.is_dataclass(args) or not hasattr(target, "layers"):
        raise InvalidInputError(
            f"{type(target).__name__} has no dataclass config and layer list to truncate"
        )
    if hasattr(args, "text_config"):  # llama4: its top level reads the fourth layer's cache
        raise InvalidInputError(
            f"{_model_name(target)}: no truncated draft of a multimodal model's language part "
            "(its top level reads layers a truncated copy lacks); pass a draft model"
        )
    total = len(target.layers)
    # one window of local/global layers (gemma3), or of linear/full attention (qwen3_next)
    pattern = int(
        getattr(args, "sliding_window_pattern", None)
        or getattr(args, "full_attention_interval", None)
        or 1
    )
    count = min(total, pattern) if layers is None else layers
    if not 1 <= count <= total:
        raise InvalidInputError(f"a draft keeps 1..{total} of the target's layers, got {count}")
    if count < min(total, pattern):
        raise InvalidInputError(
            f"the target alternates {pattern} kinds of layer: a draft needs at least {pattern}"
        )
    changes: dict[str, Any] = {"num_hidden_layers": count}
    layer_types = getattr(args, "layer_types", None)
    if isinstance(layer_types, list):
        changes["layer_types"] = layer_types[:count]
    config: Any = dataclasses.replace(args, **changes)  # type: ignore[type-var]
    draft: Any = type(target)(config)
    kept: list[tuple[str, Any]] = []
    named: list[tuple[str, Any]] = tree_flatten(target.parameters())  # type: ignore[assignment]
    for name, weight in named:
        parts = name.split(".")
        if "layers" in parts:
            at = parts.index("layers") + 1
            if at < len(parts) and parts[at].isdigit() and int(parts[at]) >= count:
                continue
        kept.append((name, weight))
    group = getattr(target, "kvrows_group", None)
    if group is not None:  # a sharded target: its draft holds the same shards
        from kvrows.app.distributed import shard_model

        shard_model(draft, group)
    try:
        draft.load_weights(kept)
    except ValueError as error:  # e.g. a quantized checkpoint's scales and biases
        raise InvalidInputError(
            f"cannot copy {type(target).__name__}'s weights into a {count}-layer draft: {error}"
        ) from error
    mx.eval(draft.parameters())
    return draft


# -- MLA models: latent caches (spec/MLACache.md §3) ------------------------------


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
    return pair if cache.latent_spec.dsa else pair[0]


def _latent_layers(model: Any, codecs: list[LatentCodec], start: int) -> list[Any]:
    """Per layer ``MLACache`` (a plain codec) or ``EncodedLatentCache`` (affine or
    TurboQuant, bf16-first at ``start``), as the layer takes it."""
    geometry = _geometry(model)
    return [
        _layer(
            EncodedLatentCache(*geometry, codec=codec, start=start)
            if codec.encodes
            else MLACache(*geometry)
        )
        for codec in codecs
    ]


def make_latent_cache(model: Any, codec: LatentCodec | None = None, start: int = 0) -> list[Any]:
    """One :class:`LatentCacheList` per layer of an MLA model: ``MLACache`` (plain codec)
    or ``EncodedLatentCache`` (``codec`` affine or TurboQuant, bf16-first at ``start``)."""
    if not is_latent_model(model):
        raise InvalidInputError(f"{type(model).__name__} is not an MLA model kvrows serves")
    return _latent_layers(model, [codec or Plain()] * len(model.layers), start)


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
        codec = pool.latent_codec
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
    resolved = scheme.resolve(len(model.layers))
    codecs = [resolved.codec_for_layer(index) for index in range(len(model.layers))]
    return _latent_layers(model, codecs, resolved.quantized_kv_start or 0)


# -- recurrent models: their planes, and verify rounds that roll back -------------


def recurrent_geometry(model: Any) -> StateShapes | None:
    """The planes every recurrent layer of ``model`` holds, from its config: gated
    DeltaNet (``linear_*`` fields: conv ``(K - 1, 2 * Hk * Dk + Hv * Dv)`` in the
    activation dtype, recurrent ``(Hv, Dv, Dk)`` float32); ``None`` where the config does
    not say (Mamba2's SSD state takes the dtype its computation yields: the cache learns
    it from the layer's first write)."""
    args: Any = getattr(model, "args", object())
    names = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim")
    if not all(hasattr(args, name) for name in (*names, "linear_value_head_dim")):
        return None
    dtype = _weight_dtype(model)
    if dtype is None:
        return None
    hv, hk = int(args.linear_num_value_heads), int(args.linear_num_key_heads)
    dk, dv = int(args.linear_key_head_dim), int(args.linear_value_head_dim)
    kernel = int(args.linear_conv_kernel_dim)
    return StateShapes.from_v1((kernel - 1, 2 * hk * dk + hv * dv), dtype, (hv, dv, dk), "float32")


class _RecordingLayer:
    """A recurrent layer that, as a verify round's forward, hands its per-position inputs
    and a replay to a ``BatchedSSMCache`` (the replay calls the same layer again with the
    same arguments, each per-position one cut to a prefix, the ``mask`` the cache's
    per-row one and the ``cache`` the cache: ``spec_round_rollback``). Not a module: the
    parent keeps the layer among its children, so the parameter tree is unchanged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.signature = inspect.signature(inner.__call__)
        parameter = self.signature.parameters["cache"]
        positional = (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        #: Where ``cache`` comes when passed by position (read on every forward: no bind).
        self.cache_at = (
            list(self.signature.parameters).index("cache") if parameter.kind in positional else -1
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        at = self.cache_at
        cache = kwargs.get("cache", args[at] if 0 <= at < len(args) else None)
        if _PROBED is not None and cache is not None:
            _PROBED.append((self, cache))
        if cache is not None and getattr(cache, "spec_round_awaits_record", False):
            self._record(cache, self.signature.bind(*args, **kwargs))
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)  # the layer's own attributes read through

    def _record(self, cache: Any, bound: inspect.BoundArguments) -> None:
        first = bound.args[0] if bound.args else None
        if not isinstance(first, mx.array) or first.ndim < 2:
            return  # no per-position input: cache.spec_round_record refuses the rollback
        rows, span = first.shape[:2]
        # Every argument laid out per position (the hidden states; rwkv7's v_first) is cut
        # to the replayed prefix; the rest (offsets, flags) is passed as it was.
        names = [
            name
            for name, value in bound.arguments.items()
            if name not in ("cache", "mask")
            and isinstance(value, mx.array)
            and value.ndim >= 2
            and tuple(value.shape[:2]) == (rows, span)
        ]
        inner, signature = self.inner, self.signature

        def replay(target: Any, *prefixes: mx.array) -> object:
            again = signature.bind(*bound.args, **bound.kwargs)
            again.arguments.update(zip(names, prefixes, strict=True))
            again.arguments["cache"] = target
            if "mask" in signature.parameters:
                again.arguments["mask"] = target.make_mask(prefixes[0].shape[1])
            return inner(*again.args, **again.kwargs)

        cache.spec_round_record(replay, *(bound.arguments[name] for name in names))


#: ``(wrapper, cache)`` for each wrapped layer's call during a probe (:func:`_probe`).
_PROBED: list[tuple[_RecordingLayer, Any]] | None = None


def _takes_cache(module: Any) -> bool:
    try:
        return "cache" in inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class _Probe:
    """What one probe token through fresh caches showed: each recurrent state (its layer
    index) and how many wrapped layers took it as their ``cache``."""

    model: str
    states: list[tuple[int, Any, int]]  # (layer index, state, wrapped layers that took it)
    wrapped: int  # layers newly wrapped


def _probe(model: Any) -> _Probe:
    """Wrap every layer of ``model`` called with a ``cache`` that calls no other such
    layer (the mixers and attention layers, not the decoder layers around them), run one
    token through fresh caches, and keep the wrappers of the layers a recurrent state
    reached (``StateWritten``); the others are unwrapped. A model without recurrent state
    runs no token and is not touched."""
    global _PROBED
    caches = make_kvrows_cache(model)
    recurrent = [
        (index, part)
        for index, layer in enumerate(caches)
        for part in (layer, *getattr(layer, "caches", ()))
        if isinstance(part, StateWritten)
    ]
    if not recurrent:
        return _Probe(_model_name(model), [], 0)
    modules = dict(model.named_modules())
    takers = [name for name, module in modules.items() if _takes_cache(module)]
    added: list[tuple[Any, str, _RecordingLayer]] = []
    for name in takers:
        if not name or any(other.startswith(name + ".") for other in takers):
            continue  # the model, or a decoder layer that hands its cache on
        parent_name, _, attribute = name.rpartition(".")
        parent = modules[parent_name]
        if attribute.isdigit() or isinstance(getattr(parent, attribute), _RecordingLayer):
            continue  # a list element cannot be shadowed; already wrapped
        # Past mlx's Module.__setattr__, which would drop the layer from its parent's
        # children: the call finds the wrapper, the parameter tree still the layer.
        wrapper = _RecordingLayer(modules[name])
        object.__setattr__(parent, attribute, wrapper)
        added.append((parent, attribute, wrapper))
    _PROBED = []
    try:
        model(mx.array([[0]]), cache=caches)
        calls = _PROBED
    finally:
        _PROBED = None
    states = {id(state) for _, state in recurrent}
    kept = {id(wrapper) for wrapper, cache in calls if id(cache) in states}
    for parent, attribute, wrapper in added:
        if id(wrapper) not in kept:  # an attention layer: nothing of it to replay
            object.__delattr__(parent, attribute)
    taken = [id(cache) for _, cache in calls]
    return _Probe(
        _model_name(model),
        [(index, state, taken.count(id(state))) for index, state in recurrent],
        sum(id(wrapper) in kept for _, _, wrapper in added),
    )


def record_recurrent_layers(model: Any) -> int:
    """Wrap, in place, every layer of ``model`` that a recurrent state reaches as its
    ``cache`` (gated DeltaNet, Mamba2, lfm2's short conv, kimi_linear's KDA, falcon_h1's
    Mamba mixer, ...; found by one probe token), so verify rounds on ``BatchedSSMCache``
    can roll back (snapshot + replay); returns how many were newly wrapped. A wrapped
    layer records only when its cache awaits a round's record: the model computes
    exactly what it did."""
    return _probe(model).wrapped


def check_speculative_rounds(model: Any) -> None:
    """Make ``model``'s verify rounds roll back (:func:`record_recurrent_layers`), or
    refuse it up front: every recurrent state must reach exactly one wrapped layer as its
    ``cache`` (a rollback replays that layer alone) and that layer must ``advance`` it
    over the probe token (the replay counts each row's kept tokens by it). Otherwise
    raises ``NotTrimmableError`` naming the model, the layer and why. A model without
    recurrent state passes untouched (its rounds roll back by trimming)."""
    probe = _probe(model)
    for index, state, takers in probe.states:
        why = []
        if takers == 0:
            why.append(
                "no layer of the model takes it as its `cache` argument (a layer reads it "
                "out of another cache), so no replay can rewrite it"
            )
        elif takers > 1:
            why.append(
                f"{takers} layers write it in one forward, so replaying one of them cannot "
                "rewrite it"
            )
        if state.offset != 1:
            why.append(
                "its layer never calls cache.advance, so a replay cannot count the tokens "
                "each row keeps"
            )
        if why:
            raise NotTrimmableError(
                f"{probe.model} cannot run speculative rounds: a rollback must replay the "
                f"accepted tokens into layer {index}'s recurrent state, but "
                f"{'; and '.join(why)}; run it without a draft model"
            )
