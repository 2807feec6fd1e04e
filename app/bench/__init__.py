"""``kvrows bench``: every family's benchmarks through one runner (:mod:`.runner`).

Each family module supplies only its cases and a ``family(quick=...)`` that returns
them as a :class:`~kvrows.app.bench.runner.Family`:

* :mod:`.plain`: the plain family's row operations against mlx-lm's ``BatchKVCache``,
  a plain copy of the same bytes and the NumPy reference;
* :mod:`.affine`: quantize throughput, the affine layout's row operations against the
  plain layout, decode attention against mlx-lm's kernels;
* :mod:`.ring`: the sliding-window family against mlx-lm's ``BatchRotatingKVCache``;
* :mod:`.engine`: the engine's throughput against mlx-lm's ``BatchGenerator``;
* :mod:`.speculative`: the engine with a draft model against itself without one and
  against mlx-lm's serial speculative generation;
* :mod:`.delayed`: bf16-first schemes: per-row conversion (delayed layouts) against
  whole-cache conversion (mlx-lm's rule) and the solo runs, at each ``quantized_kv_start``;
* :mod:`.turbo`: TurboQuant's value distortion against the paper, bytes per token of every
  scheme, teacher-forced quality against plain on the tiny models, decode attention cost;
* :mod:`.paged`: block-table row operations and the paged decode step against the
  contiguous layouts and mlx-lm, append into a reused pool against memcpy;
* :mod:`.serve`: ``kvrows serve`` against ``mlx_lm.server`` over HTTP on one checkpoint
  (server processes: not part of ``all``; needs the ``serve`` extra);
* :mod:`.distributed`: rows between two processes per scheme against a local copy, the
  tensor-parallel decision record, tokens/s at one and two ranks (one ``mlx.launch``: not
  part of ``all``).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the runner imports MLX; the CLI reads FAMILIES without it
    from kvrows.app.bench.runner import Family

__all__ = ["FAMILIES", "IN_PROCESS", "family", "run"]

#: ``kvrows bench --family`` names, in run order, and the module of each.
FAMILIES = {
    "plain": "plain",
    "affine": "affine",
    "rotating": "ring",
    "engine": "engine",
    "speculative": "speculative",
    "delayed": "delayed",
    "turbo": "turbo",
    "paged": "paged",
    "serve": "serve",
    "distributed": "distributed",
}

#: What ``--family all`` runs: every in-process family (``serve`` starts servers,
#: ``distributed`` an ``mlx.launch``).
IN_PROCESS = tuple(name for name in FAMILIES if name not in ("serve", "distributed"))


def family(name: str, *, quick: bool = False, **options: Any) -> Family:
    """The family called ``name`` (see :data:`FAMILIES`) at its quick or full shapes
    (``options``: the family's own, e.g. the delayed family's ``starts``)."""
    module = importlib.import_module(f"kvrows.app.bench.{FAMILIES[name]}")
    made: Family = module.family(quick=quick, **options)
    return made


def run(
    name: str,
    *,
    quick: bool = False,
    repeats: int | None = None,
    kv_starts: Sequence[int] | None = None,
    plot: str | None = None,
    contexts: str | None = None,
) -> int:
    """Run family ``name``, or every family for ``"all"``; 0 unless a result was wrong.
    ``kv_starts``: the delayed family's starts (``kvrows bench --kv-start N``); ``plot``:
    the engine and serve families' latency PNG (``kvrows bench --plot FILE``); ``contexts``: its
    serving trace's document lengths, ``"LO-HI"`` (``kvrows bench --contexts 1024-2048``)."""
    from kvrows.errors import InvalidInputError

    # Refused before any family builds its sources (that alone takes seconds).
    if name != "all" and name not in FAMILIES:
        raise InvalidInputError(f"unknown bench family {name!r}; known: {', '.join(FAMILIES)}")
    if repeats is not None and repeats < 1:
        raise InvalidInputError(f"--repeats must be >= 1, got {repeats}")
    spans = None if contexts is None else _span(contexts)
    from kvrows.app.bench.runner import run_family

    names = list(IN_PROCESS) if name == "all" else [name]
    status = 0
    # The options each family takes, by name (one not given is left to the family).
    given: dict[str, dict[str, Any]] = {
        "delayed": {"starts": kv_starts or None},
        "engine": {"plot": plot, "serving_contexts": spans},
        "serve": {"plot": plot},
    }
    for each in names:
        options = {k: v for k, v in given.get(each, {}).items() if v is not None}
        made = family(each, quick=quick, **options)
        status = max(status, run_family(made, quick=quick, repeats=repeats))
    return status


def _span(text: str) -> tuple[int, int]:
    """``"LO-HI"`` as two token counts, ``1 <= LO <= HI``."""
    from kvrows.errors import InvalidInputError

    low, _, high = text.partition("-")
    try:
        span = (int(low), int(high))
    except ValueError:
        span = (0, 0)
    if not 1 <= span[0] <= span[1]:
        raise InvalidInputError(f"--contexts takes LO-HI token counts (1024-2048), got {text!r}")
    return span
