"""One rank of the tensor-parallel test (``tests/test_tensor_parallel.py`` runs two under
``mlx.launch``): the sharded demo under affine4 with a draft model, then plain paged,
the broadcast, then the divergence guard with one rank made to drift. Prints ``ok <what>``
per check passed; a failed check exits non-zero (the launch ends)."""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

from kvrows.app.demo import run_tensor_parallel_demo
from kvrows.app.distributed import BROADCAST_FIRST, broadcast_text, check_in_step
from kvrows.errors import RankDivergenceError


def main() -> int:
    group = mx.distributed.init()
    rank = group.rank()
    common: dict[str, Any] = dict(model_path="llama", requests=2, max_batch=3, progress=False)
    # Rows join, leave and publish while others decode, in speculative rounds.
    if run_tensor_parallel_demo(schemes=["affine4"], speculative=True, **common) != 0:
        return 1
    print(f"ok {rank} contiguous", flush=True)
    if run_tensor_parallel_demo(schemes=["plain"], paged=True, **common) != 0:
        return 1
    print(f"ok {rank} paged", flush=True)
    for text in ("", "décision", "x" * (BROADCAST_FIRST - 4), "ü" * BROADCAST_FIRST * 3):
        got = broadcast_text(text if rank == 0 else None, group=group)
        assert got == text, (len(got), len(text))
    print(f"ok {rank} broadcast", flush=True)
    check_in_step(0, ["a", "b"], [5, 7], group=group)
    try:
        check_in_step(1, ["a", "b"], [5, 7 + rank], group=group)
    except RankDivergenceError as error:
        assert "rank(s) 1" in str(error), error
        print(f"ok {rank} guard", flush=True)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
