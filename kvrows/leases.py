"""Leases over cache state: the seed's ``leaseCacheState(s)``.

A lease hands out ``cache.state`` and, on ``close()``, releases it iff the
cache says its state is temporary (``state_needs_dispose``). No copy,
evaluation or fence is added.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvrows.errors import LayoutStateError
from kvrows.protocols import Cache, StateDisposer

__all__ = ["StateLease", "lease_cache_state", "lease_cache_states"]


class StateLease:
    """Ownership of a tuple of arrays until ``close()`` (idempotent) or ``transfer()``."""

    def __init__(self, value: tuple[Any, ...], release: Callable[[], None]) -> None:
        self._value: tuple[Any, ...] | None = value
        self._release: Callable[[], None] | None = release

    @property
    def closed(self) -> bool:
        return self._value is None

    def borrow(self) -> tuple[Any, ...]:
        if self._value is None:
            raise LayoutStateError("state lease already closed or transferred")
        return self._value

    def transfer(self) -> tuple[Any, ...]:
        """Hand the arrays over without releasing them; ends ownership."""
        value = self.borrow()
        self._value = None
        self._release = None
        return value

    def close(self) -> None:
        """Release (once); ownership ends before the release runs, even if it raises."""
        release = self._release
        self._value = None
        self._release = None
        if release is not None:
            release()

    def __enter__(self) -> StateLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _noop() -> None:
    return None


def lease_cache_state(cache: Cache) -> StateLease:
    """Lease ``cache.state``; closing it disposes the arrays iff the cache asks for it."""
    value = tuple(cache.state)
    if not cache.state_needs_dispose:
        return StateLease(value, _noop)
    if not isinstance(cache, StateDisposer):
        return StateLease(value, _noop)
    return StateLease(value, lambda: cache.dispose_state(value))


def _close_all(leases: Sequence[StateLease]) -> None:
    errors: list[Exception] = []
    for lease in leases:
        try:
            lease.close()
        except Exception as error:
            errors.append(error)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ExceptionGroup("resource cleanup failed", errors)


def lease_cache_states(caches: Sequence[Cache]) -> StateLease:
    """Lease every cache's state: owned (temporary) views first, then borrowed ones.

    If acquiring a lease raises, every lease acquired so far is closed and the
    original error re-raised, or an ``ExceptionGroup`` of it and the cleanup's
    error when the cleanup also fails.
    """
    leases: list[StateLease] = []
    try:
        for owned in (True, False):
            for cache in caches:
                if bool(cache.state_needs_dispose) == owned:
                    leases.append(lease_cache_state(cache))
    except Exception as error:
        try:
            _close_all(leases)
        except Exception as cleanup_error:
            raise ExceptionGroup("state view acquisition failed", [error, cleanup_error]) from None
        raise
    arrays = tuple(array for lease in leases for array in lease.borrow())
    return StateLease(arrays, lambda: _close_all(leases))
