"""Caches and rows that move between processes over ``mlx.distributed``.

A transfer sends what a prompt-cache file holds (:func:`kvrows.persist.prompt_cache.
saved_arrays`: each cache's planes as stored, so affine, microscaling and TurboQuant codes
stay encoded and nothing is decoded on either side), through the group's point-to-point
``send`` / ``recv``:

1. the header's length, one ``int32``;
2. the header, UTF-8 JSON as ``uint8``: the file's metadata and, in order, each array's
   name, shape and dtype;
3. each array that holds an element, in the header's order (an empty one is rebuilt from
   its shape).

The receiver restores the caches as a file's loader does (:func:`kvrows.persist.
prompt_cache.restored_caches`: the signature-keyed form of each layer, legos wrapped back,
the restored signature checked against the sender's), so a received cache's saved form is
the sent one's, bit for bit. Both sides must call in the same order: a send with no
matching receive blocks (MLX collectives have no timeout; the caller bounds the run).

:func:`send_rows` / :func:`recv_rows` move rows of running layouts: each row leaves its
layouts as serial caches (``extract_row``: owned, compact, encoded) and arrives as serial
caches the receiver merges into its own batch (``merge_rows``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from kvrows.errors import CorruptStateError, InvalidInputError
from kvrows.persist.prompt_cache import restored_caches, saved_arrays
from kvrows.protocols import DropInWrapper

__all__ = ["recv_caches", "recv_rows", "send_caches", "send_rows"]

Implementation = Literal["optimized", "reference"]

#: The metadata entry a row transfer adds: how many rows, each of the same layer count.
ROWS_KEY = "kvrows_rows"


def _group(group: Any) -> Any:
    made = mx.distributed.init() if group is None else group
    if made.size() < 2:
        raise InvalidInputError(
            f"a transfer needs a group of at least 2 processes, this one has {made.size()} "
            "(run under mlx.launch -n 2 or more)"
        )
    return made


def _peer(group: Any, peer: object, what: str) -> int:
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < group.size():
        raise InvalidInputError(
            f"{what} must be a rank of the group, 0 .. {group.size() - 1}, got {peer!r}"
        )
    if peer == group.rank():
        raise InvalidInputError(f"{what} {peer} is this process's own rank")
    return peer


def _dtype(name: str) -> mx.Dtype:
    dtype = getattr(mx, name, None)
    if not isinstance(dtype, mx.Dtype):
        raise CorruptStateError(f"a transfer names an unknown dtype {name!r}")
    return dtype


def send_caches(
    caches: Sequence[Any],
    dst: int,
    *,
    metadata: Mapping[str, str] | None = None,
    group: Any = None,
) -> int:
    """Send ``caches`` (one per layer, as :func:`~kvrows.persist.prompt_cache.
    save_prompt_cache` takes them) and ``metadata`` to rank ``dst`` of ``group`` (the
    global group by default); returns the bytes of the arrays sent. Refused (nothing
    sent) as a save refuses, or for a ``dst`` that is not another rank of the group."""
    made = _group(group)
    target = _peer(made, dst, "dst")
    arrays, described = saved_arrays(caches, metadata)
    entries = [[name, list(a.shape), str(a.dtype).rsplit(".", 1)[-1]] for name, a in arrays.items()]
    header = json.dumps({"metadata": described, "arrays": entries}).encode()
    sent = 0
    for part in (
        mx.array([len(header)], dtype=mx.int32),
        mx.array(np.frombuffer(header, dtype=np.uint8)),
        *(a for a in arrays.values() if a.size),
    ):
        # One at a time: the receiver takes them in this order.
        mx.eval(mx.distributed.send(part, target, group=made))
        sent += part.nbytes
    return sent - 4 - len(header)


def recv_caches(
    src: int,
    *,
    group: Any = None,
    implementation: Implementation = "optimized",
    like: Sequence[Any] | None = None,
    pools: Sequence[Any] | None = None,
) -> tuple[list[Any], dict[str, str]]:
    """The caches and metadata rank ``src`` sends with :func:`send_caches`, as
    ``implementation``'s classes (owned, evaluated arrays). A header or form that does
    not describe caches raises ``CorruptStateError``. A model's drop-in (an MLA layer's
    pair) travels as the cache behind it: ``like``, the receiver's fresh caches of the
    same model, puts each such layer behind its drop-in again. ``pools``: per layer, the
    receiver's block pool a paged layer's positions are written into (``None``: a pool of
    its own; a transfer of several rows uses them for each row), so a paged row arrives
    in the receiving engine's pools; a pool for a layer that is not paged raises
    ``InvalidInputError``, and a pool that cannot take the blocks ``PoolExhaustedError``
    (the transfer is read either way)."""
    made = _group(group)
    source = _peer(made, src, "src")
    length = mx.distributed.recv((1,), mx.int32, source, group=made)
    size = int(np.array(length)[0])
    raw = mx.distributed.recv((size,), mx.uint8, source, group=made) if size else mx.array([])
    mx.eval(raw)
    try:
        header = json.loads(bytes(np.array(raw, dtype=np.uint8)).decode())
        described = {str(k): str(v) for k, v in header["metadata"].items()}
        entries = [
            (str(n), tuple(int(d) for d in shape), str(t)) for n, shape, t in header["arrays"]
        ]
    except (ValueError, KeyError, TypeError) as error:
        raise CorruptStateError(
            f"rank {source} sent an unreadable transfer header: {error}"
        ) from None
    arrays: dict[str, mx.array] = {}
    for name, shape, dtype_name in entries:
        dtype = _dtype(dtype_name)
        if int(np.prod(shape, dtype=np.int64)) == 0:
            arrays[name] = mx.zeros(shape, dtype)
            continue
        arrays[name] = mx.distributed.recv(shape, dtype, source, group=made)
        mx.eval(arrays[name])
    caches, user = restored_caches(
        arrays,
        described,
        implementation=implementation,
        source=f"a transfer from rank {source}",
        pools=pools,
    )
    if like is not None:
        if len(like) != len(caches):
            raise InvalidInputError(
                f"like has {len(like)} layers, rank {source} sent {len(caches)} caches"
            )
        caches = [
            fresh.rewrap(cache)
            if isinstance(fresh, DropInWrapper) and not isinstance(cache, DropInWrapper)
            else cache
            for cache, fresh in zip(caches, like, strict=True)
        ]
    return caches, user


def send_rows(layouts: Sequence[Any], rows: Sequence[int], dst: int, *, group: Any = None) -> int:
    """Send rows ``rows`` of ``layouts`` (one layout per layer, each holding the batch) to
    rank ``dst``: each row's layers extracted as serial caches and sent in one transfer.
    The layouts are unchanged (filter the rows out after, if they leave). Returns the bytes
    of the arrays sent."""
    if isinstance(rows, int | str | bytes) or not isinstance(rows, Sequence) or not rows:
        raise InvalidInputError(f"rows must be a non-empty sequence of row indices, got {rows!r}")
    caches = [layout.extract_row(row) for row in rows for layout in layouts]
    return send_caches(caches, dst, metadata={ROWS_KEY: str(len(rows))}, group=group)


def recv_rows(
    src: int,
    *,
    group: Any = None,
    implementation: Implementation = "optimized",
    pools: Sequence[Any] | None = None,
) -> list[list[Any]]:
    """The rows rank ``src`` sends with :func:`send_rows`: per row, its per-layer serial
    caches (merge each layer's into the receiving layout with ``merge_rows``). ``pools``:
    per layer, the receiver's block pool a paged row's positions are written into (every
    row's), as :func:`recv_caches` takes them."""
    caches, described = recv_caches(src, group=group, implementation=implementation, pools=pools)
    count = _row_count(src, caches, described)
    layers = len(caches) // count
    return [caches[r * layers : (r + 1) * layers] for r in range(count)]


def _row_count(src: int, caches: Sequence[Any], described: Mapping[str, str]) -> int:
    try:
        count = int(described[ROWS_KEY])
    except (KeyError, ValueError):
        raise CorruptStateError(f"rank {src} sent caches, not rows (no {ROWS_KEY!r})") from None
    if count < 1 or len(caches) % count:
        raise CorruptStateError(f"rank {src} sent {len(caches)} caches for {count} rows")
    return count
