"""The capabilities the application asks instead of concrete types (``spec/contract.md``
§0.10, ``kvrows.protocols``): which of today's classes have each, and what the members the
app relies on answer.

Oracles: the contract's capability table (which family has which capability), positions
written by hand for the ring reads (a ring of 4 columns after 6 single-token appends), and
classes constructed independently for the lego's signatures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import kvrows.optimized as opt
import kvrows.reference as ref
from kvrows.app.attention import needs_hook
from kvrows.conformance.arrays import as_numpy
from kvrows.delayed import row_reads
from kvrows.protocols import (
    Converting,
    Handover,
    LatentAppend,
    PagedRows,
    PendingRows,
    RowAttention,
    StateWritten,
    TimeOrderedReads,
)

CAPABILITIES: dict[str, type] = {
    "Converting": Converting,
    "Handover": Handover,
    "LatentAppend": LatentAppend,
    "PagedRows": PagedRows,
    "RowAttention": RowAttention,
    "StateWritten": StateWritten,
}

#: Per class of either implementation, the capabilities it has (the rest it must not).
EXPECTED: dict[str, set[str]] = {
    "KVCache": set(),
    "QuantizedKVCache": set(),
    "BatchedKVCache": set(),
    "Bf16FirstQuantizedKVCache": {"Handover", "RowAttention"},
    "Bf16FirstRotatingQuantizedKVCache": {"Handover", "RowAttention"},
    "Bf16FirstTurboQuantKVCache": {"Handover", "RowAttention"},
    "DelayedQuantizedKVCache": {"Converting", "RowAttention"},
    "DelayedRotatingQuantizedKVCache": {"Converting", "RowAttention"},
    "DelayedTurboQuantKVCache": {"Converting", "RowAttention"},
    "PagedKVCache": {"PagedRows"},
    "PagedKvRows": {"PagedRows"},
    "MLACache": {"LatentAppend"},
    "EncodedLatentCache": {"LatentAppend"},
    "SSMCache": {"StateWritten"},
    "BatchedSSMCache": {"StateWritten"},
}

CONSTRUCT: dict[str, Callable[[Any], Any]] = {
    "Bf16FirstRotatingQuantizedKVCache": lambda cls: cls(max_size=8, start=4),
    "DelayedRotatingQuantizedKVCache": lambda cls: cls(max_size=8, start=4),
    "Bf16FirstQuantizedKVCache": lambda cls: cls(start=4),
    "Bf16FirstTurboQuantKVCache": lambda cls: cls(start=4),
    "DelayedQuantizedKVCache": lambda cls: cls(start=4),
    "DelayedTurboQuantKVCache": lambda cls: cls(start=4),
}


def _make(package: Any, name: str) -> Any:
    cls = getattr(package, name)
    return CONSTRUCT.get(name, lambda c: c())(cls)


@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_class_has_the_capabilities_of_the_table(package: Any, name: str) -> None:
    cache = _make(package, name)
    has = {cap for cap, protocol in CAPABILITIES.items() if isinstance(cache, protocol)}
    assert has == EXPECTED[name]


@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
def test_needs_row_attention(package: Any) -> None:
    # Mixed rows, a TurboQuant target (its reads defer values) and a shared ring (read in
    # time order) attend inside row_attention; an affine full-attention lego does not.
    assert _make(package, "DelayedQuantizedKVCache").needs_row_attention
    assert _make(package, "Bf16FirstTurboQuantKVCache").needs_row_attention
    assert not _make(package, "Bf16FirstQuantizedKVCache").needs_row_attention
    assert not needs_hook([package.KVCache(), package.QuantizedKVCache()])


def test_shared_rings_need_row_attention_and_the_app_asks_for_it() -> None:
    ring = opt.RotatingKVCache(max_size=8)
    lego = opt.Bf16FirstRotatingQuantizedKVCache(max_size=8, start=4)
    assert isinstance(ring, RowAttention) and ring.needs_row_attention
    assert lego.needs_row_attention
    assert needs_hook([opt.KVCache(), ring])
    assert needs_hook([opt.Bf16FirstTurboQuantKVCache(start=4)])
    assert not needs_hook([opt.KVCache(), opt.Bf16FirstQuantizedKVCache(start=4)])


def _positions(array: Any) -> list[int]:
    return [int(v) for v in as_numpy(array)[0, 0, :, 0]]


def _append_single_tokens(cache: Any, count: int) -> tuple[Any, Any]:
    """Append positions ``0 .. count - 1`` one token at a time, each key and value holding
    its position; returns the last read."""
    reads: tuple[Any, Any] = (None, None)
    for t in range(count):
        block = mx.full((1, 1, 1, 32), float(t))
        reads = cache.update_and_fetch(block, block)
    return reads


@pytest.mark.parametrize(
    ("keep", "physical", "in_time"),
    [
        # 4 ring columns; positions 4 and 5 overwrote the columns of 0 and 1.
        (0, [4, 5, 2, 3], [2, 3, 4, 5]),
        # One sink (column 0 keeps position 0); 3 ring columns, 4 and 5 replaced 1 and 2.
        (1, [0, 4, 5, 3], [0, 3, 4, 5]),
    ],
)
@pytest.mark.parametrize("lego", [False, True], ids=["ring", "lego"])
def test_a_wrapped_ring_puts_its_read_in_time_order(
    keep: int, physical: list[int], in_time: list[int], lego: bool
) -> None:
    cache = (
        opt.Bf16FirstRotatingQuantizedKVCache(max_size=4, group_size=32, keep=keep, start=100)
        if lego
        else opt.RotatingKVCache(max_size=4, keep=keep)
    )
    keys, values = _append_single_tokens(cache, 6)
    assert _positions(keys) == physical
    # A mask column follows its key: mark the column holding the newest position.
    mask = mx.array([[p == 5 for p in physical]])
    assert isinstance(cache, TimeOrderedReads)
    ordered_keys, ordered_values, ordered_mask = cache.reads_in_time_order(keys, values, mask)
    assert _positions(ordered_keys) == in_time
    assert _positions(ordered_values) == in_time
    assert np.asarray(ordered_mask).tolist() == [[p == 5 for p in in_time]]


def test_a_ring_that_has_not_wrapped_reads_unchanged() -> None:
    ring = opt.RotatingKVCache(max_size=4)
    keys, values = _append_single_tokens(ring, 3)
    assert ring.reads_in_time_order(keys, values, None) == (keys, values, None)


@pytest.mark.parametrize("package", [ref, opt], ids=["reference", "optimized"])
def test_a_lego_names_the_signatures_of_the_storages_it_takes(package: Any) -> None:
    affine = package.Bf16FirstQuantizedKVCache(group_size=32, bits=4, start=4)
    assert affine.composed.storage_signatures() == {
        package.KVCache().signature(),
        package.QuantizedKVCache(group_size=32, bits=4).signature(),
    }
    turbo = package.Bf16FirstTurboQuantKVCache(k_bits=4, v_bits=2, start=4)
    assert turbo.composed.storage_signatures() == {
        package.KVCache().signature(),
        package.TurboQuantKVCache(k_bits=4, v_bits=2).signature(),
    }


def test_a_mixed_read_is_a_pending_pair() -> None:
    plain = opt.Bf16FirstQuantizedKVCache(group_size=32, bits=8, start=2)
    converted = opt.Bf16FirstQuantizedKVCache(group_size=32, bits=8, start=2)
    plain.update_and_fetch(mx.zeros((1, 1, 1, 32)), mx.zeros((1, 1, 1, 32)))
    converted.update_and_fetch(mx.zeros((1, 1, 2, 32)), mx.zeros((1, 1, 2, 32)))
    layout = opt.DelayedQuantizedKVCache(group_size=32, bits=8, start=2)
    layout.merge_rows([plain, converted])
    assert layout.phase == "mixed"
    with row_reads():
        keys, _ = layout.update_and_fetch(mx.ones((2, 1, 1, 32)), mx.ones((2, 1, 1, 32)))
    assert isinstance(keys, PendingRows) and keys.layout is layout
    assert not isinstance(mx.zeros((1,)), PendingRows)
    assert not isinstance((mx.zeros((1,)), mx.zeros((1,))), PendingRows)


PROPERTIES = [Converting, Handover, PagedRows, PendingRows, RowAttention, StateWritten]


@pytest.mark.parametrize("protocol", PROPERTIES, ids=lambda p: p.__name__)
def test_asking_a_capability_evaluates_no_property(protocol: type) -> None:
    # Python 3.11's runtime protocols evaluate properties (hasattr): one that refuses (a
    # layout's state inside a speculative round) would escape from isinstance, and one
    # that builds something would build it on every ask. The members are looked up on
    # the class instead (kvrows.protocols._StaticMembers).
    def refuse(self: object) -> Any:
        raise AssertionError("isinstance evaluated a property")

    def method(self: object, *args: object, **kwargs: object) -> None:
        return None

    members: dict[str, Any] = {}
    for name in dir(protocol):
        member = getattr(protocol, name, None)
        if isinstance(member, property):
            members[name] = property(refuse)
        elif name in {"__setitem__"} or (callable(member) and not name.startswith("_")):
            members[name] = method
    assert any(isinstance(m, property) for m in members.values())
    probe = type("Probe", (), members)()
    assert isinstance(probe, protocol)
