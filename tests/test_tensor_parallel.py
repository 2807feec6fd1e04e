"""Tensor parallelism over two processes (``mlx.launch -n 2 --backend ring`` on 127.0.0.1):
the sharded llama's batch is bit-identical to its solo replays, every rank's tokens equal
one process's, each rank holds half the KV bytes (contiguous and paged), and the divergence
guard names a rank that drifted (``tensor_parallel_worker.py``). In this process: what
sharding refuses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from launch_helpers import launch

from kvrows.app.distributed import check_in_step, shard_model, sharding
from kvrows.app.models import tiny_model
from kvrows.errors import InvalidInputError

WORKER = Path(__file__).with_name("tensor_parallel_worker.py")
#: Seconds the launch may take (about 30 s here); then its process group is killed.
LAUNCH_TIMEOUT = 300


def test_two_ranks_serve_the_trace_as_one_process_with_half_the_kv_each() -> None:
    status, out = launch(WORKER, timeout=LAUNCH_TIMEOUT)
    assert status == 0, out[-3000:]
    # The launcher relays both ranks' output as it comes: a line of one rank can land
    # after another's unfinished line, so lines are found where they are, not at starts.
    for what in ("contiguous", "paged", "broadcast", "guard"):
        for rank in (0, 1):
            assert re.search(rf"\bok {rank} {what}\b", out), out[-3000:]
    rows = [m.split() for m in re.findall(r"llama\s+\S+\s+2\s+\d+[^\n]*", out)]
    assert len(rows) == 2 and all(row[-1] == "PASS" for row in rows), out[-3000:]
    for row in rows:  # KV bytes per token: one rank's, one process's
        assert 2 * int(row[6]) == int(row[7]), row


class _Group:
    """A stand-in group (sharding refuses before any collective)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize(
    ("arch", "size", "match"),
    [
        ("qwen3_next", 2, "recurrent layers"),
        ("llama", 3, "do not divide over 3 ranks"),
    ],
)
def test_sharding_refuses_what_it_cannot_split(arch: str, size: int, match: str) -> None:
    model: Any = tiny_model(arch)
    with pytest.raises(InvalidInputError, match=match):
        shard_model(model, _Group(size))
    assert sharding(model) is None


def test_the_guard_has_nothing_to_compare_in_one_process() -> None:
    check_in_step(0, ["a"], [3])  # the global group of one process: no collective
    with pytest.raises(InvalidInputError, match="row ids"):
        check_in_step(0, ["a"], [3, 4], group=_Group(2))


def test_one_process_is_told_to_launch(capsys: pytest.CaptureFixture[str]) -> None:
    from kvrows.app import cli

    assert cli.main(["demo", "--tensor-parallel", "--requests", "1", "--quiet"]) == 2
    assert "mlx.launch -n 2" in capsys.readouterr().err


def test_a_store_hit_is_the_smallest_every_engine_holds(tmp_path: Path) -> None:
    """Engines that must decide alike take the smallest of their disk-store hits: an entry
    one of them lacks (written by only some ranks) is served by none, a longer one is
    loaded again at the agreed length; the tokens are the same either way."""
    from kvrows.app.engine import Engine, Request, model_fingerprint
    from kvrows.persist.prefix_store import PrefixStore
    from kvrows.schemes import KvStorageScheme

    model = tiny_model("llama")
    scheme = KvStorageScheme()
    prompt = tuple(range(3, 60))  # three full blocks of 16 and a tail

    def engine(agreement: Any = None) -> Engine:
        store = PrefixStore(
            tmp_path, byte_budget=1 << 26, fingerprint=model_fingerprint(model, scheme)
        )
        return Engine(model, scheme, prefix_store=store, store_agreement=agreement)

    (first,), _ = engine().run([Request("a", prompt, max_tokens=4)])
    calls: list[int] = []

    def none_has_it(hit: int) -> int:
        calls.append(hit)
        return 0

    (missed,), _ = engine(none_has_it).run([Request("b", prompt, max_tokens=4)])
    assert calls == [48] and missed.store_hit_tokens == 0 and missed.tokens == first.tokens
    calls.clear()

    def one_has_less(hit: int) -> int:
        calls.append(hit)
        return min(hit, 16)

    (shorter,), _ = engine(one_has_less).run([Request("c", prompt, max_tokens=4)])
    assert calls == [48, 16] and shorter.store_hit_tokens == 16
    assert shorter.tokens == first.tokens
