"""Hypothesis settings profiles for the conformance machines.

* ``ci``: fast and seeded (the same examples every run, no example database), so
  ``tests/test_conformance.py`` finishes in a few minutes on two cores and never
  flakes; every generated machine draws from its own fixed seed,
  :func:`machine_seed` (``zlib.crc32(f"{family}/{layout}")``, applied by
  ``machines.machine_class``), so what it draws does not depend on which tests ran
  before it; ``kvrows conform --seed N`` explores other examples.
* ``deep``: many more examples and longer operation sequences, randomized, with
  the example database (a failure found once is replayed first next time).
* ``teeth``: a modest derandomized budget without shrinking, for the mutant runs (a
  mutant machine draws from the digest of its own name, not a seed: the mutants' budgets
  are sized to those draws).

``KVROWS_PROFILE`` selects the profile (default ``ci``); profiles are registered
under ``kvrows-<name>`` so they never clash with a project's own.

**Derandomized draws do not depend on test order.** A derandomized run seeds its
generator from the test's code alone, but Hypothesis (6.1xx) also draws, now and then
(5% of integer, 15% of float draws), a literal taken from the source of every
non-library module imported so far in the process; which modules those are depends on
the tests that ran before and what they imported lazily (a family's machine drew other
examples after ``kvrows.app.engine`` had been imported, and one speculative layout then
missed its ``join``). Importing this module therefore makes derandomized runs draw from
Hypothesis's fixed built-in literals only (randomized runs, ``deep``, keep the imported
ones); the draws then depend only on the test's code and the machine's strategies. The
``ci`` profile stays ``derandomize=True`` under its seeds: a seed takes precedence over
``derandomize`` for the random source (Hypothesis documents it), and ``derandomize`` keeps
the module literals and the example database out.
``tests/test_profiles.py`` checks a machine draws the same examples before and after
another family runs and a module of new literals is imported.
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, settings

__all__ = ["PROFILES", "Profile", "active_profile", "machine_seed", "profile_settings"]


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int
    steps: int
    derandomize: bool
    shrink: bool = True
    description: str = ""
    #: Each generated machine draws from its own fixed seed (:func:`machine_seed`).
    seeded: bool = False


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "ci",
            max_examples=105,
            steps=34,
            derandomize=True,
            seeded=True,
            description="CI: minutes",
        ),
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


def _derandomized_draws_ignore_imports() -> None:
    """Derandomized runs draw no literal from the imported modules' source (see the module
    docstring): Hypothesis's constant draw, wrapped, sees no module literals and keeps its
    own cache of the permitted constants while the running settings are derandomized."""
    try:  # private names: a Hypothesis release that renames them must not break imports
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants

        provider = providers.HypothesisProvider
        draw_constant: Any = provider._maybe_draw_constant
        providers.CONSTANTS_CACHE  # noqa: B018  (read below)
    except (ImportError, AttributeError):
        # Draws may then depend on import order again; tests/test_profiles.py says so.
        return
    if getattr(draw_constant, "kvrows_wrapped", False):
        return
    no_module_literals = Constants()
    # Separate from the shared cache, which holds the module literals of randomized runs.
    derandomized_cache = type(providers.CONSTANTS_CACHE)(1024)

    def maybe_draw_constant(self: Any, choice_type: Any, constraints: Any, **kwargs: Any) -> Any:
        running = settings.default
        if running is None or not running.derandomize:
            return draw_constant(self, choice_type, constraints, **kwargs)
        # The provider's cached property: set before the first read, it is never computed.
        self.__dict__["_local_constants"] = no_module_literals
        shared_cache = providers.CONSTANTS_CACHE
        providers.CONSTANTS_CACHE = derandomized_cache
        try:
            return draw_constant(self, choice_type, constraints, **kwargs)
        finally:
            providers.CONSTANTS_CACHE = shared_cache

    maybe_draw_constant.kvrows_wrapped = True  # type: ignore[attr-defined]
    setattr(provider, "_maybe_draw_constant", maybe_draw_constant)  # noqa: B010


_derandomized_draws_ignore_imports()


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


def machine_seed(family: str, layout: str) -> int:
    """The fixed seed of the machine of ``family``'s ``layout`` in a seeded profile: a
    function of the two names only (no counter, no test order)."""
    return zlib.crc32(f"{family}/{layout}".encode())
