"""Which functions a call went through: the dispatch tests of the fast paths (the fast
path was taken, not the fallback), through the ``call_log`` fixture."""

from __future__ import annotations

from typing import Any

import pytest


class CallLog:
    """The names of watched functions in the order they were called (``watch`` wraps one
    in place for the test; the monkeypatch restores it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.names: list[str] = []

    def watch(self, owner: object, name: str) -> None:
        real = getattr(owner, name)

        def logged(*args: Any, **kwargs: Any) -> Any:
            self.names.append(name)
            return real(*args, **kwargs)

        self._monkeypatch.setattr(owner, name, logged)
