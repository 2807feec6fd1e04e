"""Caches and rows sent between two processes over ``mlx.distributed`` (``mlx.launch``, the
ring backend on 127.0.0.1): every codec, rings, chunked, recurrent, latent and bf16-first
layers arrive bit for bit and decode as the sender's copy does (``transfer_worker.py``)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from launch_helpers import launch
from transfer_worker import CASES

from kvrows.errors import InvalidInputError
from kvrows.optimized import KVCache
from kvrows.persist.transfer import recv_caches, send_caches, send_rows

WORKER = Path(__file__).with_name("transfer_worker.py")
#: Seconds the two-process launch may take (about 15 s here); then it is killed.
LAUNCH_TIMEOUT = 240


def test_every_family_moves_between_two_processes_bit_for_bit() -> None:
    status, out = launch(WORKER, timeout=LAUNCH_TIMEOUT)
    checked = [line for line in out.splitlines() if line.startswith("ok ")]
    expected = [f"ok {arch} {scheme}" for arch, scheme in CASES] + ["ok row"]
    assert status == 0 and checked == expected, out[-3000:]


def _holding_a_token() -> KVCache:
    cache = KVCache()
    block = mx.zeros((1, 2, 1, 8))
    cache.update_and_fetch(block, block)
    return cache


def test_a_process_alone_refuses_a_transfer_and_sends_nothing() -> None:
    with pytest.raises(InvalidInputError, match="at least 2 processes"):
        send_caches([_holding_a_token()], 1)
    with pytest.raises(InvalidInputError, match="at least 2 processes"):
        recv_caches(1)


class _Pair:
    """A stand-in group of two, as this process's rank 0 (nothing is sent: every call
    here is refused before the first send)."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("peer", [0, 2, -1, True, "1"])
def test_a_peer_outside_the_group_or_this_rank_is_refused(peer: object) -> None:
    with pytest.raises(InvalidInputError, match="dst"):
        send_caches([_holding_a_token()], peer, group=_Pair())  # type: ignore[arg-type]


def test_rows_must_name_rows() -> None:
    with pytest.raises(InvalidInputError, match="rows"):
        send_rows([], [], 1, group=_Pair())
