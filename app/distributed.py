"""Tensor parallelism on ``mlx.distributed``: a model sharded over a group, each rank's
caches holding only its KV heads, and the guard that catches a rank that drifted.

:func:`shard_model` splits the model's attention heads and MLP over the group (mlx-lm's
``model.shard`` where the model has one: llama, qwen3, deepseek and others; the same
split here for the attention models that have none: gemma3). Every rank then holds
``num_key_value_heads / N`` KV heads per layer, and ``make_kvrows_cache`` declares that
many (``spec/distributed.md`` §5). An MLA latent has no KV heads: each rank holds it whole.
Recurrent state is not split by heads: a model with recurrent layers is refused.

:func:`check_in_step` is the divergence guard: every rank hashes what it holds (row ids and
offsets) and the group compares the hashes in one small collective; a rank whose hash is
not rank 0's raises :class:`~kvrows.errors.RankDivergenceError` naming it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvrows.errors import InvalidInputError, RankDivergenceError

__all__ = ["agreed", "any_rank", "check_in_step", "shard_model", "sharding"]

#: mlx-lm cache classes whose state is not split by heads.
_RECURRENT = frozenset({"ArraysCache", "MambaCache"})


def sharding(model: Any) -> tuple[int, int] | None:
    """``(rank, size)`` of the group ``model`` was sharded over (``None``: not sharded)."""
    shards = getattr(model, "kvrows_shards", None)
    return None if shards is None else (int(shards[0]), int(shards[1]))


def _attention_models_shard(model: Any, group: Any) -> None:
    """The split of mlx-lm's ``shard`` for a model whose layers have ``self_attn``
    (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``) and ``mlp`` (``gate_proj``,
    ``up_proj``, ``down_proj``) but no ``shard`` of their own (gemma3)."""
    from mlx.nn.layers.distributed import shard_linear

    size = group.size()
    for layer in model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(
                attention,
                name,
                shard_linear(getattr(attention, name), "all-to-sharded", group=group),
            )
        attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
        attention.n_heads //= size
        attention.n_kv_heads //= size
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)


def shard_model(model: Any, group: Any = None) -> Any:
    """Shard ``model`` in place over ``group`` (the global group by default) and return it.
    Refused (``InvalidInputError``, the model untouched) for a model already sharded, one
    with recurrent layers, one whose heads do not divide by the group's size, and one this
    cannot split."""
    made = mx.distributed.init() if group is None else group
    size = made.size()
    if sharding(model) is not None:
        raise InvalidInputError("the model is sharded already")
    name = type(model).__module__.rsplit(".", 1)[-1]
    template = model.make_cache() if hasattr(model, "make_cache") else []
    recurrent = sorted({type(c).__name__ for c in template} & _RECURRENT)
    if recurrent:
        raise InvalidInputError(
            f"{name}: its recurrent layers ({', '.join(recurrent)}) hold state that cannot be "
            "split by heads; tensor parallelism needs attention-only models"
        )
    layers = list(getattr(model, "layers", ()))
    for index, layer in enumerate(layers):
        attention = getattr(layer, "self_attn", None)
        for field in ("n_heads", "n_kv_heads", "num_heads"):
            count = getattr(attention, field, None)
            if isinstance(count, int) and count % size:
                raise InvalidInputError(
                    f"{name}, layer {index}: {count} {field.replace('_', ' ')} do not divide "
                    f"over {size} ranks"
                )
    if hasattr(model, "shard"):
        model.shard(made)
    elif layers and all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in layers):
        _attention_models_shard(model, made)
    else:
        raise InvalidInputError(f"{name}: no way to shard this model over heads")
    model.kvrows_shards = (made.rank(), size)
    mx.eval(model.parameters())
    return model


def _digest(rids: Sequence[str], offsets: Sequence[int]) -> int:
    text = "|".join(f"{rid}:{offset}" for rid, offset in zip(rids, offsets, strict=True))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def _gathered(value: int, group: Any) -> list[int]:
    """``value`` of every rank of ``group``, in rank order (one int32 each)."""
    mine = mx.array([value], dtype=mx.int32)
    every: list[int] = np.array(mx.distributed.all_gather(mine, group=group)).tolist()
    return every


def agreed(text: str, *, group: Any = None) -> bool:
    """Whether every rank of ``group`` holds the same ``text`` (its digest compared)."""
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        return True
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF
    return len(set(_gathered(digest, made))) == 1


def any_rank(flag: bool, *, group: Any = None) -> bool:
    """Whether ``flag`` is set on any rank of ``group`` (every rank gets the same answer)."""
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        return flag
    return any(_gathered(int(flag), made))


def check_in_step(
    step: int, rids: Sequence[str], offsets: Sequence[int], *, group: Any = None
) -> None:
    """Compare what every rank holds at step ``step`` (the running rows' ids and offsets,
    in batch order) across the group; raise ``RankDivergenceError`` naming the ranks that
    differ from rank 0. One all-gather of one int32 per rank."""
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        return
    if len(rids) != len(offsets):
        raise InvalidInputError(f"{len(rids)} row ids but {len(offsets)} offsets")
    every = _gathered(_digest(rids, offsets), made)
    drifted = [rank for rank, value in enumerate(every) if value != every[0]]
    if drifted:
        raise RankDivergenceError(
            f"step {step}: rank(s) {', '.join(map(str, drifted))} hold other rows or offsets "
            f"than rank 0 (this is rank {made.rank()}): the ranks no longer apply the same "
            "row operations"
        )
