"""Tiny random-weight recurrent models from mlx-lm configs (no download), and the
recurrent geometry a model's config declares.

``tiny_hybrid_model("qwen3_next")`` is Qwen3-Next's hybrid layout (gated DeltaNet layers
with a full-attention layer every second layer, MoE MLPs); ``tiny_hybrid_model("mamba2")``
a pure Mamba2 SSM. Their ``make_cache()`` gives mlx-lm's ``ArraysCache`` for the
recurrent layers, which ``kvrows.app.models.make_kvrows_cache`` serves with ``SSMCache``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kvrows.errors import InvalidInputError
from kvrows.recurrent import StateShapes

__all__ = [
    "HYBRID_ARCHITECTURES",
    "record_recurrent_layers",
    "recurrent_geometry",
    "tiny_hybrid_model",
]

HYBRID_ARCHITECTURES = ("qwen3_next", "mamba2")


def tiny_hybrid_model(arch: str, *, seed: int = 0, vocab: int = 256) -> Any:
    """A small random-weight float32 mlx-lm model of ``arch`` (``qwen3_next`` or ``mamba2``),
    its recurrent mixers wrapped by :func:`record_recurrent_layers`."""
    model: Any
    if arch == "qwen3_next":
        from mlx_lm.models import qwen3_next

        model = qwen3_next.Model(
            qwen3_next.ModelArgs(
                model_type="qwen3_next",
                hidden_size=64,
                num_hidden_layers=4,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=64,  # a TurboQuant head dim
                linear_num_value_heads=4,
                linear_num_key_heads=2,
                linear_key_head_dim=32,
                linear_value_head_dim=16,
                linear_conv_kernel_dim=4,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                shared_expert_intermediate_size=64,
                mlp_only_layers=[],
                moe_intermediate_size=64,
                rms_norm_eps=1e-6,
                vocab_size=vocab,
                rope_theta=10000.0,
                partial_rotary_factor=0.5,
                max_position_embeddings=512,
                tie_word_embeddings=True,
                full_attention_interval=2,
            )
        )
    elif arch == "mamba2":
        from mlx_lm.models import mamba2

        model = mamba2.Model(
            mamba2.ModelArgs(
                model_type="mamba2",
                num_heads=8,
                head_dim=16,
                vocab_size=vocab,
                hidden_size=64,
                intermediate_size=128,
                state_size=16,
                num_hidden_layers=3,
                layer_norm_epsilon=1e-5,
                conv_kernel=4,
                n_groups=2,
                use_bias=False,
                use_conv_bias=True,
                tie_word_embeddings=True,
                time_step_limit=(0.001, 100.0),
                time_step_rank="auto",
            )
        )
    else:
        raise InvalidInputError(
            f"unknown recurrent architecture {arch!r}: expected one of {HYBRID_ARCHITECTURES}"
        )
    mx.random.seed(seed)
    from mlx.utils import tree_map

    params = tree_map(lambda p: mx.random.normal(p.shape) * 0.08, model.parameters())
    model.update(params)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
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
    """A recurrent mixer that, as a verify round's forward, hands its input and a replay
    to a ``BatchedSSMCache`` (the replay runs the same mixer over a prefix of that input,
    masked per row by the cache: ``spec_round_rollback``). Not a module: the layer keeps
    the mixer among its children, so the parameter tree is unchanged."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if cache is not None and getattr(cache, "spec_round_awaits_record", False):
            inner = self.inner

            def replay(target: Any, prefix: mx.array) -> object:
                return inner(prefix, target.make_mask(prefix.shape[1]), target)

            cache.spec_round_record(replay, x)
        out: mx.array = self.inner(x, mask, cache)
        return out


#: The attribute each recurrent architecture's layers keep their mixer under.
_MIXERS = ("linear_attn", "mixer")


def record_recurrent_layers(model: Any) -> int:
    """Wrap every recurrent mixer of ``model`` (in place) so verify rounds on
    ``BatchedSSMCache`` can roll back (snapshot + replay); returns how many were wrapped.
    The wrapped model computes exactly what it did (the wrapper only records)."""
    wrapped = 0
    for layer in model.layers:
        for name in _MIXERS:
            mixer = getattr(layer, name, None)
            if mixer is None or isinstance(mixer, _RecordingLayer):
                continue
            # Past mlx's Module.__setattr__, which would drop the mixer from the layer's
            # children: the call finds the wrapper, the parameter tree still the mixer.
            object.__setattr__(layer, name, _RecordingLayer(mixer))
            wrapped += 1
    return wrapped
