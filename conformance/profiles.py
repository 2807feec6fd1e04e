"""Hypothesis settings profiles for the conformance machines.

* ``ci``: fast and derandomized (the same examples every run, no example
  database), so ``tests/test_conformance.py`` finishes in a few minutes on two
  cores and never flakes; ``kvrows conform --seed N`` explores other examples.
* ``deep``: many more examples and longer operation sequences, randomized, with
  the example database (a failure found once is replayed first next time).
* ``teeth``: a modest derandomized budget without shrinking, for the mutant runs.

``KVROWS_PROFILE`` selects the profile (default ``ci``); profiles are registered
under ``kvrows-<name>`` so they never clash with a project's own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILES", "Profile", "active_profile", "profile_settings"]


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int
    steps: int
    derandomize: bool
    shrink: bool = True
    description: str = ""


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile("ci", max_examples=150, steps=34, derandomize=True, description="CI: minutes"),
        Profile("deep", max_examples=600, steps=60, derandomize=False, description="deep: long"),
        Profile("teeth", max_examples=60, steps=25, derandomize=True, shrink=False),
    )
}

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _register() -> None:
    for profile in PROFILES.values():
        phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
        if profile.shrink:
            phases.append(Phase.shrink)
        if not profile.derandomize:
            phases.append(Phase.explain)
        extra: dict[str, object] = {"database": None} if profile.derandomize else {}
        settings.register_profile(
            f"kvrows-{profile.name}",
            max_examples=profile.max_examples,
            stateful_step_count=profile.steps,
            derandomize=profile.derandomize,
            deadline=None,
            phases=phases,
            suppress_health_check=_HEALTH,
            print_blob=not profile.derandomize,
            report_multiple_bugs=False,
            **extra,  # type: ignore[arg-type]
        )


_register()


def active_profile(name: str | None = None) -> Profile:
    """``name``, else ``$KVROWS_PROFILE``, else ``ci``."""
    chosen = name or os.environ.get("KVROWS_PROFILE") or "ci"
    try:
        return PROFILES[chosen]
    except KeyError:
        raise ValueError(f"unknown profile {chosen!r}; known: {sorted(PROFILES)}") from None


def profile_settings(name: str | None = None, **overrides: object) -> settings:
    """The registered settings of a profile, with optional overrides."""
    profile = active_profile(name)
    base = settings.get_profile(f"kvrows-{profile.name}")
    return settings(base, **overrides) if overrides else base  # type: ignore[arg-type]
