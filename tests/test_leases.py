"""Leases over cache state: order, release, and cleanup on failure (spec/contract.md)."""

from __future__ import annotations

from typing import Any

import pytest

from kvrows.errors import LayoutStateError
from kvrows.leases import lease_cache_state, lease_cache_states


class _Fake:
    """A cache whose state is a tag; temporary state is released into ``log``."""

    def __init__(
        self,
        tag: str,
        log: list[str],
        *,
        temporary: bool,
        fail: bool = False,
        fail_release: bool = False,
    ) -> None:
        self.tag, self.log, self.temporary = tag, log, temporary
        self.fail, self.fail_release = fail, fail_release

    @property
    def state(self) -> tuple[Any, ...]:
        if self.fail:
            raise RuntimeError(f"state of {self.tag} failed")
        return (self.tag,)

    @property
    def state_needs_dispose(self) -> bool:
        return self.temporary

    def dispose_state(self, arrays: tuple[Any, ...]) -> None:
        if self.fail_release:
            raise OSError(f"release of {self.tag} failed")
        self.log.append(f"released {arrays[0]}")


def test_owned_views_first_then_borrowed() -> None:
    log: list[str] = []
    caches: list[Any] = [
        _Fake("a", log, temporary=False),
        _Fake("b", log, temporary=True),
        _Fake("c", log, temporary=False),
        _Fake("d", log, temporary=True),
    ]
    lease = lease_cache_states(caches)
    assert lease.borrow() == ("b", "d", "a", "c")
    lease.close()
    assert log == ["released b", "released d"]
    lease.close()  # idempotent
    assert log == ["released b", "released d"]
    with pytest.raises(LayoutStateError):
        lease.borrow()


def test_transfer_ends_ownership_without_release() -> None:
    log: list[str] = []
    lease = lease_cache_state(_Fake("x", log, temporary=True))  # type: ignore[arg-type]
    assert lease.transfer() == ("x",)
    lease.close()
    assert log == [] and lease.closed


def test_failed_acquisition_closes_what_was_acquired() -> None:
    log: list[str] = []
    caches: list[Any] = [
        _Fake("a", log, temporary=True),
        _Fake("b", log, temporary=False, fail=True),
    ]
    with pytest.raises(RuntimeError, match="state of b failed"):
        lease_cache_states(caches)
    assert log == ["released a"]


def test_failed_cleanup_raises_both_errors() -> None:
    log: list[str] = []
    caches: list[Any] = [
        _Fake("a", log, temporary=True, fail_release=True),
        _Fake("b", log, temporary=True, fail=True),
    ]
    with pytest.raises(ExceptionGroup) as caught:
        lease_cache_states(caches)
    kinds = {type(error) for error in caught.value.exceptions}
    assert kinds == {RuntimeError, OSError}


def test_a_failed_release_does_not_stop_the_later_ones() -> None:
    """Several owned states, early releases failing: every later one is still released,
    each once, and every failure is reported."""
    log: list[str] = []
    caches: list[Any] = [
        _Fake("a", log, temporary=True, fail_release=True),
        _Fake("b", log, temporary=True),
        _Fake("c", log, temporary=True, fail_release=True),
        _Fake("d", log, temporary=True),
        _Fake("e", log, temporary=False),
    ]
    lease = lease_cache_states(caches)
    with pytest.raises(ExceptionGroup) as caught:
        lease.close()
    assert log == ["released b", "released d"]
    assert sorted(str(error) for error in caught.value.exceptions) == [
        "release of a failed",
        "release of c failed",
    ]
    assert lease.closed
    lease.close()  # ownership ended before the releases ran: nothing is released twice
    assert log == ["released b", "released d"]


def test_one_failed_release_raises_itself_after_the_others() -> None:
    log: list[str] = []
    caches: list[Any] = [
        _Fake("a", log, temporary=True, fail_release=True),
        _Fake("b", log, temporary=True),
        _Fake("c", log, temporary=True),
    ]
    with pytest.raises(OSError, match="release of a failed"), lease_cache_states(caches):
        pass
    assert log == ["released b", "released c"]


def test_failed_acquisition_releases_every_acquired_state_past_a_failed_release() -> None:
    log: list[str] = []
    caches: list[Any] = [
        _Fake("a", log, temporary=True, fail_release=True),
        _Fake("b", log, temporary=True),
        _Fake("c", log, temporary=True, fail_release=True),
        _Fake("d", log, temporary=True),
        _Fake("e", log, temporary=True, fail=True),
    ]
    with pytest.raises(ExceptionGroup) as caught:
        lease_cache_states(caches)
    assert log == ["released b", "released d"]
    acquisition, cleanup = caught.value.exceptions
    assert isinstance(acquisition, RuntimeError)
    assert isinstance(cleanup, ExceptionGroup)
    assert sorted(str(error) for error in cleanup.exceptions) == [
        "release of a failed",
        "release of c failed",
    ]
