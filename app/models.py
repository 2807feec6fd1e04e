"""kvrows caches inside unmodified mlx-lm models, and the embedded tiny models.

``make_kvrows_cache(model, scheme)`` builds a model's per-layer caches from a storage
scheme (:class:`kvrows.schemes.KvStorageScheme`): the model's own ``make_cache()`` names
each layer's mlx-lm cache class, the composition table (``kvrows.compositions``) names
the kvrows serial storage that serves that class under the layer's codec, and the storage
is built from the one codec spec the scheme carries and the layer's token geometry, with
the KV geometry declared (:func:`kv_geometry`) so projected bytes are known before the
first token. ``tiny_model(arch)`` builds the embedded random-weight float32 models the
demo and the tests run on (no download); ``draft_model(target)`` a speculative draft of the
same architecture and vocabulary: a truncated copy of the target (its embedding, first
layers, final norm and head).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

import mlx.core as mx

import kvrows.optimized as kv
from kvrows.app.hybrid import HYBRID_ARCHITECTURES, recurrent_geometry
from kvrows.compositions import (
    Composition,
    bind_arguments,
    composition,
    landed,
    serial_for_peer,
)
from kvrows.errors import InvalidInputError
from kvrows.schemes import CodecSpec, GeometrySpec, KvStorageScheme, Plain
from kvrows.validation import KvGeometry

__all__ = [
    "ARCHITECTURES",
    "BUILTIN_MODELS",
    "check_model",
    "draft_model",
    "kv_geometry",
    "make_kvrows_cache",
    "tiny_model",
    "tiny_model_and_tokenizer",
]

ARCHITECTURES = ("llama", "gemma3")
#: What ``kvrows demo --model`` takes besides a checkpoint directory: the embedded tiny
#: models by architecture, and ``hybrid`` (both recurrent ones).
BUILTIN_MODELS = (*ARCHITECTURES, *HYBRID_ARCHITECTURES, "hybrid")


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


def kv_geometry(model: Any) -> KvGeometry | None:
    """The KV heads, head dim and dtype every attention layer of ``model`` stores, from its
    config (``num_key_value_heads``, ``head_dim`` or ``hidden_size / num_attention_heads``)
    and its first floating-point weight's dtype. ``None`` where the config does not say or
    keys and values may differ in width (MLA: ``kv_lora_rank``, ``v_head_dim``): the
    storages then learn the geometry from their first token.
    """
    args: Any = getattr(model, "args", object())
    if any(hasattr(args, name) for name in ("kv_lora_rank", "v_head_dim", "qk_rope_head_dim")):
        return None
    heads = getattr(args, "num_key_value_heads", None)
    dim = getattr(args, "head_dim", None)
    if dim is None and getattr(args, "num_attention_heads", None):
        dim = getattr(args, "hidden_size", 0) // args.num_attention_heads
    from mlx.utils import tree_flatten

    dtype = next(
        (
            str(item[1].dtype).rsplit(".", 1)[-1]
            for item in tree_flatten(model.parameters())
            if isinstance(item[1], mx.array) and mx.issubdtype(item[1].dtype, mx.floating)
        ),
        None,
    )
    if not heads or not dim or dtype is None:
        return None
    return KvGeometry(heads=int(heads), key_dim=int(dim), value_dim=int(dim), dtype=dtype)


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


def _layer_codec(codec: CodecSpec, layer: Any) -> CodecSpec:
    """``codec``, or plain where ``codec`` refuses the layer's token geometry: TurboQuant
    is full attention only, so a model's sliding layers stay plain rings under it."""
    try:
        plain = serial_for_peer(type(layer).__name__, Plain())
    except InvalidInputError:
        return codec  # no storage serves the layer: the codec's own lookup says so
    try:
        codec.check_token_geometry(plain.name, _token_geometry(plain, Plain(), layer))
    except InvalidInputError:
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
    from kvrows.app.latent_models import is_latent_model, latent_caches_for_scheme

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
    # part is served as that layer's, then grouped back into a CacheList.
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
        codec = _layer_codec(scheme.codec_for_layer(index), layer)
        try:
            entry = serial_for_peer(type(layer).__name__, codec)
        except InvalidInputError as refused:
            raise InvalidInputError(f"{_model_name(model)}, layer {index}: {refused}") from refused
        geometry = _token_geometry(entry, codec, layer)
        if scheme.quantized_kv_start is not None and codec.encodes:
            caches.append(_lego(entry, codec, geometry, scheme.quantized_kv_start, declared))
        else:
            caches.append(_build(entry, codec, geometry, declared))
    served = iter(caches)
    return [
        peer.CacheList(*(next(served) for _ in layer.caches))  # type: ignore[no-untyped-call]
        if type(layer).__name__ == "CacheList"
        else next(served)
        for layer in template
    ]


def _model_name(model: Any) -> str:
    """The model's ``model_type`` (its mlx-lm module name where the config has none)."""
    name = getattr(getattr(model, "args", None), "model_type", None)
    name = name or getattr(model, "model_type", None)
    return str(name or type(model).__module__.rsplit(".", 1)[-1])


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
    delayed = next(
        (c for c in landed() if "delayed" in c.modifiers and c.serial == entry.name), None
    )
    if delayed is None:
        raise InvalidInputError(f"{entry.name} has no bf16-first storage (quantized_kv_start)")
    lego: Any = getattr(kv, delayed.name).lego_class
    numbers = {**codec.parameters(), **geometry.parameters()}
    return lego(**{name: numbers[name] for name in entry.params}, start=start, geometry=declared)


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
    try:
        draft.load_weights(kept)
    except ValueError as error:  # e.g. a quantized checkpoint's scales and biases
        raise InvalidInputError(
            f"cannot copy {type(target).__name__}'s weights into a {count}-layer draft: {error}"
        ) from error
    mx.eval(draft.parameters())
    return draft
