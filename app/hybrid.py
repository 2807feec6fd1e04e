"""Tiny random-weight recurrent models from mlx-lm configs (no download), the recurrent
geometry a model's config declares, and the recording that lets verify rounds roll back.

``tiny_hybrid_model("qwen3_next")`` is Qwen3-Next's hybrid layout (gated DeltaNet layers
with a full-attention layer every second layer, MoE MLPs); ``tiny_hybrid_model("mamba2")``
a pure Mamba2 SSM; every other architecture mlx-lm builds an ``ArraysCache`` for (lfm2,
rwkv7, kimi_linear, bailing_moe_linear, baichuan_m1, falcon_h1) likewise. Their
``make_cache()`` gives mlx-lm's ``ArraysCache`` for the recurrent layers, which
``kvrows.app.models.make_kvrows_cache`` serves with ``SSMCache``.

A verify round rolls recurrent state back by replaying the accepted tokens through the
layer that wrote it (``spec/BatchedSSMCache.md`` §7): :func:`record_recurrent_layers`
finds those layers generically (every layer called with a ``cache``) and
:func:`check_speculative_rounds` refuses a model whose layers cannot replay.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvrows.errors import InvalidInputError, NotTrimmableError
from kvrows.protocols import StateWritten
from kvrows.recurrent import StateShapes

__all__ = [
    "HYBRID_ARCHITECTURES",
    "RECURRENT_ARCHITECTURES",
    "check_speculative_rounds",
    "record_recurrent_layers",
    "recurrent_geometry",
    "tiny_hybrid_model",
]

HYBRID_ARCHITECTURES = ("qwen3_next", "mamba2")

#: Every mlx-lm architecture whose ``make_cache`` builds an ``ArraysCache``, as a tiny
#: config (every layer kind the architecture has: lfm2's conv and attention, kimi_linear's
#: KDA and MLA, bailing_moe_linear's GLA and attention, baichuan_m1's global and sliding
#: layers, falcon_h1's Mamba2 mixer beside attention in every layer).
_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64,  # a TurboQuant head dim
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        partial_rotary_factor=0.5, max_position_embeddings=512, tie_word_embeddings=True,
        full_attention_interval=2,
    ),
    "mamba2": dict(
        num_heads=8, head_dim=16, hidden_size=64, intermediate_size=128, state_size=16,
        num_hidden_layers=3, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=2,
        use_bias=False, use_conv_bias=True, tie_word_embeddings=True,
        time_step_limit=(0.001, 100.0), time_step_rank="auto",
    ),
    "lfm2": dict(
        hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, norm_eps=1e-5, conv_bias=False, conv_L_cache=3,
        block_dim=32, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=False, block_ff_dim=64,
        layer_types=["conv", "full_attention", "conv"],
    ),
    "rwkv7": dict(
        hidden_size=32, intermediate_size=64, norm_eps=1e-5, head_dim=16,
        num_hidden_layers=2, a_low_rank_dim=8, v_low_rank_dim=8, gate_low_rank_dim=8,
        decay_low_rank_dim=8,
    ),
    "kimi_linear": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=64, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        linear_attn_config={
            "num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1]
        },
        model_max_length=256, num_experts=0, moe_intermediate_size=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16,
    ),
    "bailing_moe_linear": dict(
        hidden_size=32, intermediate_size=64, max_position_embeddings=256,
        moe_intermediate_size=32, num_experts=4, num_shared_experts=1, norm_topk_prob=True,
        num_attention_heads=2, num_experts_per_tok=2, num_hidden_layers=2,
        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        first_k_dense_replace=1, layer_group_size=2, group_norm_size=1, head_dim=16,
    ),
    "baichuan_m1": dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, rope_theta=10000.0, sliding_window=8,
        sliding_window_layers=[1], conv_window=2, rms_norm_eps=1e-5,
    ),
    "falcon_h1": dict(
        hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, mamba_d_conv=4, mamba_d_head=8, mamba_d_ssm=32,
        mamba_d_state=8, mamba_n_groups=1, mamba_n_heads=4, num_hidden_layers=2,
        mamba_chunk_size=8,
    ),
}  # fmt: skip

#: The architectures :func:`tiny_hybrid_model` builds.
RECURRENT_ARCHITECTURES = tuple(_TINY_CONFIGS)


def tiny_hybrid_model(arch: str, *, seed: int = 0, vocab: int = 256, record: bool = True) -> Any:
    """A small random-weight float32 mlx-lm model of ``arch`` (one of
    :data:`RECURRENT_ARCHITECTURES`), its recurrent layers wrapped by
    :func:`record_recurrent_layers` (``record=False``: mlx-lm's model as it is)."""
    config = _TINY_CONFIGS.get(arch)
    if config is None:
        raise InvalidInputError(
            f"unknown recurrent architecture {arch!r}: expected one of {RECURRENT_ARCHITECTURES}"
        )
    module: Any = importlib.import_module(f"mlx_lm.models.{arch}")
    model: Any = module.Model(module.ModelArgs(model_type=arch, vocab_size=vocab, **config))
    mx.random.seed(seed)
    from mlx.utils import tree_map

    params = tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters())
    model.update(params)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    if record:
        record_recurrent_layers(model)  # verify rounds on its recurrent layers can roll back
    return model


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
    from mlx.utils import tree_flatten

    dtype = next(
        (
            str(item[1].dtype).rsplit(".", 1)[-1]
            for item in tree_flatten(model.parameters())
            if isinstance(item[1], mx.array) and mx.issubdtype(item[1].dtype, mx.floating)
        ),
        None,
    )
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
    from kvrows.app.models import _model_name, make_kvrows_cache

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
