"""Recurrent state in the MLX implementation: ``SSMCache``, ``BatchedSSMCache`` and the
layers that drive them in tests (``spec/SSMCache.md``).

The caches are the row machinery's (``optimized/rows.py``) with the state geometry
(``optimized/geometries/recurrent.py``), declared in ``optimized/classes.py`` and
re-exported here with the layers that drive them in tests. The same classes are the
drop-in for mlx-lm's ``ArraysCache(size=n)`` in its hybrid and SSM models
(``qwen3_next``, ``mamba2``, ``lfm2``, ``rwkv7``, ``kimi_linear``…): the layers write
``cache[i]``, read ``cache.lengths`` and call ``cache.advance(S)`` and ``cache.make_mask(S)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from kvrows.errors import InvalidInputError, plane_layer_input_message, qkv_shape_message
from kvrows.optimized.classes import BatchedSSMCache, SSMCache
from kvrows.recurrent import CONV, RECURRENT, StateShapes

__all__ = [
    "BatchedSSMCache",
    "GatedDeltaParams",
    "SSMCache",
    "gated_delta_forward",
    "plane_state_forward",
]

_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


# -- the layer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GatedDeltaParams:
    """One gated DeltaNet layer's weights (float32) and head layout (the reference's
    ``GatedDeltaParams`` in MLX arrays)."""

    conv_weight: mx.array
    a_log: mx.array
    dt_bias: mx.array
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int

    @property
    def kernel(self) -> int:
        return int(self.conv_weight.shape[1])

    @property
    def channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim


def _rms(x: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_forward(
    params: GatedDeltaParams, cache: Any, qkv: mx.array, a: mx.array, b: mx.array
) -> mx.array:
    """The reference's ``gated_delta_forward`` in MLX (same masking, same conv-plane rule,
    float32 recurrence step by step)."""
    if qkv.ndim != 3 or qkv.shape[-1] != params.channels:
        raise InvalidInputError(qkv_shape_message(params.channels, qkv.shape))
    rows, span, channels = (int(n) for n in qkv.shape)
    hv, dv, hk, dk, kernel = (
        params.value_heads, params.value_dim, params.key_heads, params.key_dim, params.kernel,
    )  # fmt: skip
    if cache is not None and getattr(cache, "spec_round_awaits_record", False):
        cache.spec_round_record(functools.partial(gated_delta_forward, params), qkv, a, b)
    mask = None if cache is None else cache.make_mask(span)
    x = qkv if mask is None else mx.where(mask[..., None], qkv, mx.zeros((), qkv.dtype))
    held = None if cache is None else cache[CONV]
    if held is None:
        held = mx.zeros((rows, kernel - 1, channels), dtype=qkv.dtype)
    window = mx.concatenate([held, x], axis=1)
    lengths = None if cache is None else cache.lengths
    if lengths is None:
        new_conv = window[:, span:]
    else:
        ends = mx.clip(lengths, 0, span)
        positions = (ends[:, None] + mx.arange(kernel - 1))[..., None]
        new_conv = mx.take_along_axis(window, positions, axis=1)
    f = window.astype(mx.float32)
    w = params.conv_weight.astype(mx.float32)
    acc = f[:, 0:span] * w[:, 0]
    for j in range(1, kernel):
        acc = acc + f[:, j : j + span] * w[:, j]
    out = acc * mx.sigmoid(acc)
    q = out[..., : hk * dk].reshape(rows, span, hk, dk)
    k = out[..., hk * dk : 2 * hk * dk].reshape(rows, span, hk, dk)
    v = out[..., 2 * hk * dk :].reshape(rows, span, hv, dv)
    q = _rms(q, 1e-6) * (1.0 / dk)
    k = _rms(k, 1e-6) * (dk**-0.5)
    repeat = hv // hk
    if repeat > 1:
        q, k = mx.repeat(q, repeat, axis=2), mx.repeat(k, repeat, axis=2)
    g = mx.exp(
        -mx.exp(params.a_log.astype(mx.float32))
        * mx.logaddexp(mx.zeros((), mx.float32), a.astype(mx.float32) + params.dt_bias)
    )
    beta = mx.sigmoid(b.astype(mx.float32))
    state = None if cache is None else cache[RECURRENT]
    if state is None:
        state = mx.zeros((rows, hv, dv, dk), dtype=mx.float32)
    ys = []
    for t in range(span):
        decayed = state * g[:, t, :, None, None]
        memory = mx.sum(decayed * k[:, t, :, None, :], axis=-1)
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        updated = decayed + k[:, t, :, None, :] * delta[..., None]
        ys.append(mx.sum(updated * q[:, t, :, None, :], axis=-1))
        state = updated if mask is None else mx.where(mask[:, t, None, None, None], updated, state)
    if cache is not None:
        conv_plane, state_plane = mx.contiguous(new_conv), state
        mx.eval(conv_plane, state_plane)
        cache[CONV] = conv_plane
        cache[RECURRENT] = state_plane
        cache.advance(span)
    return mx.stack(ys, axis=1)


def plane_state_forward(shapes: StateShapes, cache: Any, x: mx.array) -> mx.array:
    """The reference's ``plane_state_forward`` in MLX (the same float32 steps and casts,
    so the planes agree bit for bit)."""
    rows, span = int(x.shape[0]), int(x.shape[1])
    sizes = [math.prod(shape) for shape, _ in shapes.planes]
    if x.ndim != 3 or x.shape[-1] < max(sizes):
        raise InvalidInputError(plane_layer_input_message(max(sizes), tuple(x.shape)))
    if cache is not None and getattr(cache, "spec_round_awaits_record", False):
        cache.spec_round_record(functools.partial(plane_state_forward, shapes), x)
    mask = None if cache is None else cache.make_mask(span)
    planes = []
    for i, (shape, dtype) in enumerate(shapes.planes):
        held = None if cache is None else cache[i]
        planes.append(mx.zeros((rows, *shape), dtype=_DTYPES[dtype]) if held is None else held)
    ys = []
    for t in range(span):
        step = x[:, t].astype(mx.float32)
        for i, ((shape, _), size) in enumerate(zip(shapes.planes, sizes, strict=True)):
            held = planes[i]
            update = held.astype(mx.float32) * 0.5 + step[:, :size].reshape(rows, *shape)
            new = update.astype(held.dtype)
            if mask is not None:
                keep = mask[:, t].reshape(rows, *([1] * len(shape)))
                new = mx.where(keep, new, held)
            planes[i] = new
        ys.append(planes[0].astype(mx.float32).reshape(rows, -1))
    if cache is not None:
        written = [mx.contiguous(plane) for plane in planes]
        mx.eval(*written)
        for i, plane in enumerate(written):
            cache[i] = plane
        cache.advance(span)
    return mx.stack(ys, axis=1)
