"""Shared pytest configuration."""

from __future__ import annotations

import pytest

#: Test files whose tests take seconds to tens of seconds each (the conformance machines,
#: the teeth runs, the pool machines and the draw-order check).
_LONG = ("test_conformance", "test_teeth", "test_paged_pool", "test_profiles")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Long tests first: the two workers then share the long ones and finish together,
    instead of one worker running a long machine alone at the end (stable otherwise)."""
    items.sort(key=lambda item: not any(name in item.nodeid for name in _LONG))
