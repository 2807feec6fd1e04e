"""Recurrent state in the NumPy reference: ``SSMCache``, ``BatchedSSMCache`` and the
layers that drive them in tests (``spec/SSMCache.md``).

The caches are the row machinery's (``reference/rows.py``) with the state geometry
(``reference/geometries/recurrent.py``), declared in ``reference/classes.py`` and
re-exported here; this module writes the layer the caches are tested with:
:func:`gated_delta_forward`, the recurrence of Qwen3-Next's linear attention in float32,
step by step, with padded rows masked so a masked position leaves a row's state as it was;
and :func:`plane_state_forward`, a toy layer keeping planes of any number and shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvrows.errors import InvalidInputError, plane_layer_input_message, qkv_shape_message
from kvrows.recurrent import CONV, RECURRENT, StateShapes
from kvrows.reference.classes import BatchedSSMCache, SSMCache
from kvrows.reference.codecs import numpy_dtype

__all__ = [
    "BatchedSSMCache",
    "GatedDeltaParams",
    "SSMCache",
    "gated_delta_forward",
    "plane_state_forward",
]

Array = npt.NDArray[Any]


# -- the layer ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GatedDeltaParams:
    """One gated DeltaNet layer's weights (float32) and head layout.

    ``conv_weight [C, K]`` (``C = 2 * key_heads * key_dim + value_heads * value_dim``),
    ``a_log [Hv]``, ``dt_bias [Hv]``; ``value_heads`` a multiple of ``key_heads``."""

    conv_weight: Array
    a_log: Array
    dt_bias: Array
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


def _silu(x: Array) -> Array:
    return x / (np.float32(1) + np.exp(-x))


def _rms(x: Array, eps: float) -> Array:
    scale: Array = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return x / scale


def gated_delta_forward(
    params: GatedDeltaParams, cache: Any, qkv: Array, a: Array, b: Array
) -> Array:
    """One gated DeltaNet forward over ``S`` positions: ``qkv [B, S, C]`` (the pre-conv
    projections, activation dtype), ``a``, ``b`` ``[B, S, Hv]``. Reads and writes
    ``cache`` (``None``: no state kept); returns ``y [B, S, Hv, Dv]`` float32.

    During a padded run (``cache.make_mask``) masked positions feed zeros to the conv, do
    not change the recurrent state, and each row's new conv plane is the ``K - 1`` inputs
    ending at its last real token. In a verify round it records its inputs for the replay.
    """
    if qkv.ndim != 3 or qkv.shape[-1] != params.channels:
        raise InvalidInputError(qkv_shape_message(params.channels, qkv.shape))
    rows, span, channels = (int(n) for n in qkv.shape)
    hv, dv, hk, dk, kernel = (
        params.value_heads, params.value_dim, params.key_heads, params.key_dim, params.kernel,
    )  # fmt: skip
    if cache is not None and getattr(cache, "spec_round_awaits_record", False):
        cache.spec_round_record(functools.partial(gated_delta_forward, params), qkv, a, b)
    mask = None if cache is None else cache.make_mask(span)
    x = qkv if mask is None else np.where(mask[..., None], qkv, np.zeros((), qkv.dtype))
    held = None if cache is None else cache[CONV]
    if held is None:
        held = np.zeros((rows, kernel - 1, channels), dtype=qkv.dtype)
    window = np.concatenate([held, x], axis=1)
    lengths = None if cache is None else cache.lengths
    if lengths is None:
        new_conv = window[:, span:]
    else:
        ends = np.clip(np.asarray(lengths), 0, span)
        new_conv = np.stack([window[r, e : e + kernel - 1] for r, e in enumerate(ends)])
    f = window.astype(np.float32)
    w = params.conv_weight.astype(np.float32)
    acc = f[:, 0:span] * w[:, 0]
    for j in range(1, kernel):
        acc = acc + f[:, j : j + span] * w[:, j]
    out = _silu(acc)
    q = out[..., : hk * dk].reshape(rows, span, hk, dk)
    k = out[..., hk * dk : 2 * hk * dk].reshape(rows, span, hk, dk)
    v = out[..., 2 * hk * dk :].reshape(rows, span, hv, dv)
    q = _rms(q, 1e-6) * np.float32(1.0 / dk)
    k = _rms(k, 1e-6) * np.float32(dk**-0.5)
    repeat = hv // hk
    q, k = np.repeat(q, repeat, axis=2), np.repeat(k, repeat, axis=2)
    g = np.exp(
        -np.exp(params.a_log.astype(np.float32))
        * np.logaddexp(np.float32(0), a.astype(np.float32) + params.dt_bias.astype(np.float32))
    ).astype(np.float32)
    beta = (np.float32(1) / (np.float32(1) + np.exp(-b.astype(np.float32)))).astype(np.float32)
    state = None if cache is None else cache[RECURRENT]
    if state is None:
        state = np.zeros((rows, hv, dv, dk), dtype=np.float32)
    ys = []
    for t in range(span):
        decayed = state * g[:, t, :, None, None]
        memory = np.sum(decayed * k[:, t, :, None, :], axis=-1)
        delta = (v[:, t] - memory) * beta[:, t, :, None]
        updated = decayed + k[:, t, :, None, :] * delta[..., None]
        ys.append(np.sum(updated * q[:, t, :, None, :], axis=-1))
        state = updated if mask is None else np.where(mask[:, t, None, None, None], updated, state)
    if cache is not None:
        cache[CONV] = np.ascontiguousarray(new_conv)
        cache[RECURRENT] = state.astype(np.float32)
        cache.advance(span)
    return np.stack(ys, axis=1).astype(np.float32)


def plane_state_forward(shapes: StateShapes, cache: Any, x: Array) -> Array:
    """A toy recurrent layer over the planes ``shapes`` declares (any number, any rank):
    at each position every plane ``p`` (per-row shape ``R``) becomes
    ``0.5 * p + x[:, t, :prod(R)]`` (float32, stored in the plane's dtype). ``x`` is
    ``[B, S, C]`` with ``C`` at least every plane's size. Masked positions (a padded run)
    leave the planes as they were; in a verify round it records ``x`` for the replay.
    Returns plane 0 flattened after each position, ``[B, S, prod(R0)]`` float32.

    Every step is one float32 rounding and one cast, so the optimized twin's planes equal
    these bit for bit."""
    rows, span = int(x.shape[0]), int(x.shape[1])
    sizes = [int(np.prod(shape)) for shape, _ in shapes.planes]
    if x.ndim != 3 or x.shape[-1] < max(sizes):
        raise InvalidInputError(plane_layer_input_message(max(sizes), tuple(x.shape)))
    if cache is not None and getattr(cache, "spec_round_awaits_record", False):
        cache.spec_round_record(functools.partial(plane_state_forward, shapes), x)
    mask = None if cache is None else cache.make_mask(span)
    planes = []
    for i, (shape, dtype) in enumerate(shapes.planes):
        held = None if cache is None else cache[i]
        planes.append(np.zeros((rows, *shape), numpy_dtype(dtype)) if held is None else held)
    ys = []
    for t in range(span):
        step = x[:, t].astype(np.float32)
        for i, ((shape, _), size) in enumerate(zip(shapes.planes, sizes, strict=True)):
            held = planes[i]
            update = held.astype(np.float32) * np.float32(0.5) + step[:, :size].reshape(
                rows, *shape
            )
            new = update.astype(held.dtype)
            if mask is not None:
                keep = mask[:, t].reshape(rows, *([1] * len(shape)))
                new = np.where(keep, new, held)
            planes[i] = new
        ys.append(planes[0].astype(np.float32).reshape(rows, -1))
    if cache is not None:
        for i, plane in enumerate(planes):
            cache[i] = np.ascontiguousarray(plane)
        cache.advance(span)
    return np.stack(ys, axis=1)
