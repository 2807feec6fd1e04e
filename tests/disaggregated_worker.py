"""One rank of the disaggregated test (``tests/test_disaggregated.py`` runs two under
``mlx.launch``): the demo (rank 0 prefills, rank 1 decodes) on llama under plain, affine4
and turbo, then paged under plain, then a paged row received straight into the decode
engine's pools. Prints ``ok <rank> <what>`` per check passed; a failed check exits non-zero
(the launch ends)."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from kvrows.app.demo import builtin_trace, run_disaggregated_demo
from kvrows.app.disaggregated import recv_prefilled, send_prefilled
from kvrows.app.engine import Engine, FinishEvent, PrefilledRow, Request
from kvrows.app.models import tiny_model
from kvrows.schemes import KvStorageScheme


def prefilled(engine: Engine, request: Request) -> PrefilledRow:
    """``request`` submitted prefill-only to ``engine``, stepped until it ends: the row its
    ``FinishEvent`` hands over."""
    events: list[Any] = []
    engine.submit(request, on_event=events.append, prefill_only=True)
    while engine.has_work():
        engine.step()
    (finish,) = [e for e in events if isinstance(e, FinishEvent)]
    assert finish.prefilled is not None
    return finish.prefilled


def main() -> int:
    group = mx.distributed.init()
    rank = group.rank()
    common: dict[str, Any] = dict(model_path="llama", requests=2, max_batch=2, progress=False)
    if run_disaggregated_demo(schemes=["plain", "affine4", "turbo"], **common) != 0:
        return 1
    print(f"ok {rank} contiguous", flush=True)
    if run_disaggregated_demo(schemes=["plain"], paged=True, **common) != 0:
        return 1
    print(f"ok {rank} paged", flush=True)
    # A paged row arrives in the receiving engine's own pools (no pool of its own).
    engine = Engine(tiny_model("llama"), KvStorageScheme.parse("affine8"), paged=True)
    (request,) = builtin_trace(1)
    if rank == 0:
        send_prefilled([(request, prefilled(engine, request), 0)], 1, group=group)
    else:
        pools = engine.receiving_pools()
        ((got, row, _),) = recv_prefilled(0, group=group, pools=pools)
        assert (got.rid, got.prompt, got.max_tokens) == (
            request.rid,
            request.prompt,
            request.max_tokens,
        ), got
        assert isinstance(row, PrefilledRow) and pools is not None
        assert all(c.pool is p for c, p in zip(row.caches, pools, strict=True))
        stream = engine.submit(got, prefilled=row)
        while engine.has_work():
            engine.step()
        *_, last = list(stream)
        assert isinstance(last, FinishEvent) and len(last.result.tokens) == got.max_tokens
        for pool in pools:
            pool.check_valid()
        print(f"ok {rank} pools", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
