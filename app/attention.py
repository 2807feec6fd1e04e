"""Row attention inside unmodified mlx-lm models: mixed-precision delayed rows, and
codecs that defer part of the read (TurboQuant's rotated values, ``Codec.defers_values``:
``dispatch`` hands those to the cache's codec, which un-rotates the output).

An mlx-lm attention layer calls ``scaled_dot_product_attention(q, keys, values, cache=…,
scale=…, mask=…)``, a function each model module imports by name from
``mlx_lm.models.base``; it picks one codec for the whole batch. While a delayed layout
(``kvrows.delayed``) holds plain and converted rows together, each row must attend with
its own codec. :func:`row_attention` rebinds that imported name, in the modules of the
model's layers (and in ``mlx_lm.models.base``), to :func:`dispatch` for as long as the
scope is open, and opens ``kvrows.delayed.row_reads()`` so mixed layouts answer with a
pending pair. ``dispatch`` hands a pending pair to its layout's ``attend_rows`` (each
group through mlx-lm's own function, with the group's own reads and mask) and passes
every other call to mlx-lm's function unchanged, so other caches and models compute
exactly as before. Scopes nest and are reference-counted; the last one to close restores
every module. A model whose layers do not use mlx-lm's function cannot be hooked
(``InvalidInputError``); one that calls ``mx.fast.scaled_dot_product_attention`` itself
gets the pending pair and fails loudly.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from types import ModuleType
from typing import Any

from kvrows.app.ring_order import in_time_order
from kvrows.delayed import row_reads
from kvrows.errors import InvalidInputError
from kvrows.protocols import PendingRows, RowAttention

__all__ = [
    "attention_scope",
    "dispatch",
    "gains_from_hook",
    "hookable_modules",
    "needs_hook",
    "row_attention",
]

_NAME = "scaled_dot_product_attention"
_lock = threading.Lock()
_depth = 0
_patched: list[ModuleType] = []


def _original() -> Any:
    from mlx_lm.models import base

    original = getattr(base, "_kvrows_original_sdpa", None)
    if original is None:
        original = getattr(base, _NAME)
        base._kvrows_original_sdpa = original  # type: ignore[attr-defined]
    return original


class _GroupCache:
    """What mlx-lm's function reads off a cache: the codec spec's parameters, so
    ``bits`` / ``group_size`` for an affine group (its quantized path), nothing for a plain
    one (a group whose codec defers values attends through its codec, never here)."""

    def __init__(self, codec: Any) -> None:
        for name, value in codec.parameters().items():
            setattr(self, name, value)


def dispatch(
    queries: Any,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: Any = None,
) -> Any:
    """mlx-lm's attention, or each row group's own when ``keys`` is a pending pair."""
    original = _original()
    # A lego or delayed layout names the codec of the read it just returned (a converting
    # append reads plain); other storages read through their codec.
    codec = getattr(cache, "last_read_codec", None) or getattr(cache, "codec", None)
    pending = isinstance(keys, PendingRows)
    if not pending:
        # A wrapped shared ring reads in its own phase's order: time order instead, so a row
        # sums its window in one order alone and in a batch (kvrows.app.ring_order).
        keys, values, mask = in_time_order(cache, keys, values, mask)
    if getattr(codec, "defers_values", False) and not pending:
        # The read returned values the codec must finish (TurboQuant: rotated values, the
        # output un-rotated once per query row): its own attention, not mlx-lm's.
        if sinks is not None:
            raise InvalidInputError(
                f"{type(cache).__name__}: attention sinks over deferred values are not supported"
            )
        return codec.attend(queries, keys, values, mask, scale)  # type: ignore[union-attr]
    if not pending and sinks is None and _attends_itself(codec):
        # An encoding codec on the CPU's host path: faster than mlx-lm's quantized kernel.
        return codec.attend(queries, keys, values, mask, scale)  # type: ignore[union-attr]
    if not pending:
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def attend(q: Any, group: Any, k: Any, v: Any, group_mask: Any, s: float) -> Any:
        if group.codec.defers_values:  # a TurboQuant group: its codec finishes the values
            if sinks is not None:
                raise InvalidInputError(
                    f"{type(group).__name__}: attention sinks over deferred values are not "
                    "supported"
                )
            return group.codec.attend(q, k, v, group_mask, s)
        if sinks is None and group.codec.attends_itself():  # the CPU's host path
            return group.codec.attend(q, k, v, group_mask, s)
        return original(
            q, k, v, cache=_GroupCache(group.codec_spec), scale=s, mask=group_mask, sinks=sinks
        )

    return keys.layout.attend_rows(queries, scale, attend, pending=keys)


#: :func:`hookable_modules` per live model (by identity): a scan of every module of a
#: model costs about 3.5 µs a module, and every hooked forward asks.
_HOOKABLE: dict[int, tuple[weakref.ref[Any], list[ModuleType]]] = {}


def hookable_modules(model: Any) -> list[ModuleType]:
    """The modules of ``model``'s layers that call mlx-lm's attention by its imported name
    (found once per model)."""
    key = id(model)
    known = _HOOKABLE.get(key)
    if known is not None and known[0]() is model:
        return list(known[1])
    found = _scan_hookable(model)
    try:
        ref = weakref.ref(model, lambda _, key=key: _HOOKABLE.pop(key, None))  # type: ignore[misc]
    except TypeError:  # (an object that takes no weak reference: scanned every time)
        return found
    _HOOKABLE[key] = (ref, found)
    return list(found)


def _scan_hookable(model: Any) -> list[ModuleType]:
    original = _original()
    found: dict[str, ModuleType] = {}
    modules = model.modules() if hasattr(model, "modules") else []
    for module in modules:
        name = type(module).__module__
        python_module = sys.modules.get(name)
        if python_module is None or name in found:
            continue
        if getattr(python_module, _NAME, None) in (original, dispatch):
            found[name] = python_module
    return list(found.values())


@contextmanager
def row_attention(model: Any) -> Iterator[None]:
    """Inside, delayed layouts with mixed rows attend row group by row group in ``model``."""
    from mlx_lm.models import base

    modules = hookable_modules(model)
    if not modules:
        raise InvalidInputError(
            f"{type(model).__name__} does not call mlx-lm's scaled_dot_product_attention: "
            "its delayed layers cannot attend mixed-precision rows (run without a bf16-first "
            "start, or one row at a time)"
        )
    global _depth
    with _lock:
        original = _original()
        for module in [base, *modules]:
            if getattr(module, _NAME, None) is original:
                setattr(module, _NAME, dispatch)
                _patched.append(module)
        _depth += 1
    try:
        with row_reads():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for module in _patched:
                    setattr(module, _NAME, original)
                _patched.clear()


def _attends_itself(codec: Any) -> bool:
    attends = getattr(codec, "attends_itself", None)
    return bool(attends is not None and attends())


def needs_hook(caches: Sequence[Any]) -> bool:
    """Whether a forward over ``caches`` must run inside :func:`row_attention`: some layer
    says it needs it (``RowAttention``: a delayed layout's mixed rows, a shared ring read in
    time order, a lego that converts to TurboQuant) or reads deferred values
    (``Codec.defers_values``)."""
    return any(
        (isinstance(cache, RowAttention) and cache.needs_row_attention)
        or getattr(getattr(cache, "codec", None), "defers_values", False)
        for cache in caches
    )


def gains_from_hook(caches: Sequence[Any]) -> bool:
    """Whether a forward over ``caches`` would be faster inside :func:`row_attention`: some
    layer's codec attends itself now (``attends_itself``: an encoding codec on the CPU's
    host path, where mlx-lm's quantized kernel is slower)."""
    return any(_attends_itself(getattr(cache, "codec", None)) for cache in caches)


@contextmanager
def attention_scope(model: Any, caches: Sequence[Any]) -> Iterator[None]:
    """:func:`row_attention` around a forward of ``model`` over ``caches`` when they need it
    (:func:`needs_hook`), or gain from it (:func:`gains_from_hook`) and ``model`` can be
    hooked; nothing otherwise."""
    hooked = needs_hook(caches) or (gains_from_hook(caches) and bool(hookable_modules(model)))
    with row_attention(model) if hooked else nullcontext():
        yield
