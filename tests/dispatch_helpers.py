"""Which functions a call went through: the dispatch tests of the fast paths (the fast
path was taken, not the fallback), through the ``call_log`` fixture."""

from __future__ import annotations

from typing import Any

import pytest


class CallLog:
    """The names of watched functions in the order they were called, and each call's
    positional arguments (``calls``: what a dispatch test asks of the arguments, such as
    how many columns a decode read); ``watch`` wraps one in place for the test, the
    monkeypatch restores it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.names: list[str] = []
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def watch(self, owner: object, name: str) -> None:
        real = getattr(owner, name)

        def logged(*args: Any, **kwargs: Any) -> Any:
            self.names.append(name)
            self.calls.append((name, args))
            return real(*args, **kwargs)

        self._monkeypatch.setattr(owner, name, logged)
