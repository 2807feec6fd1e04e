"""KV maintenance: which layout a request's per-layer caches join under a storage scheme.

``create_kv_maintenance(scheme)`` (the seed's ``createKvMaintenance``,
``spec/kv-maintenance.md``) returns a :class:`KvMaintenance` whose operations take one
request's per-layer caches and return a new list (the input list is not changed):

* ``prepare_prefill``: with a bf16-first boundary (``quantized_kv_start`` set), every
  affine or TurboQuant layer's lego goes into a one-row delayed layout (``kvrows.delayed``) of the
  lego's implementation, so a prefill cohort converts each row at its own ``start``;
  plain serial rings go into a one-row ragged ring of the delayed ring's plain rows (a
  model shares one mask among its sliding layers, so they must share one column
  convention); other layers are kept. Without a boundary the list is unchanged.
* ``prepare_batch``: with ``start > 0`` the same (rows below ``start`` keep arriving);
  with ``start == 0`` each lego is replaced by its storage (``composed.release()``): every
  lego converted after its first append, so its storage joins the ordinary layouts.
* ``max_append_tokens``: the least of every layer's ``max_append_tokens()`` (layers
  without one: unlimited): prefill chunks cut there convert each row exactly at
  ``start``.

Array-free: the delayed layout of a lego is the one its implementation registered
(:func:`kvrows.delayed.delayed_layout_for`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvrows.delayed import delayed_layout_for
from kvrows.errors import InvalidInputError
from kvrows.geometries import is_geometry_spec
from kvrows.protocols import AppendLimited, Handover
from kvrows.schemes import KvStorageScheme, Plain

__all__ = ["KvMaintenance", "create_kv_maintenance"]


@dataclass(frozen=True)
class KvMaintenance:
    """The layer preparation a scheme needs (see the module docstring)."""

    scheme: KvStorageScheme

    @property
    def converts_later(self) -> bool:
        """Whether some layer is bf16-first (an encoding codec, affine or TurboQuant, with a
        start)."""
        scheme = self.scheme
        if scheme.quantized_kv_start is None:
            return False
        codecs = [scheme.codec, *(codec for _, codec in scheme.layers)]
        return any(codec.encodes for codec in codecs)

    def prepare_prefill(self, caches: Sequence[Any]) -> list[Any]:
        """The request's layers for a prefill cohort: legos in one-row delayed layouts."""
        checked = _caches(caches)
        if not self.converts_later:
            return checked
        return self._delayed(checked)

    def prepare_batch(self, caches: Sequence[Any]) -> list[Any]:
        """The request's layers for the running batch: delayed layouts with ``start > 0``,
        the legos' storages with ``start == 0``."""
        checked = _caches(caches)
        if not self.converts_later:
            return checked
        if self.scheme.quantized_kv_start == 0:
            return [cache.composed.release() if _is_lego(cache) else cache for cache in checked]
        return self._delayed(checked)

    def max_append_tokens(self, caches: Sequence[Any]) -> float:
        """Tokens the next append may add before some layer's boundary (``inf``: none)."""
        limits = [
            float(cache.max_append_tokens())
            for cache in _caches(caches)
            if isinstance(cache, AppendLimited)
        ]
        return min(limits, default=math.inf)

    def _delayed(self, caches: list[Any]) -> list[Any]:
        # Every layout is built (and every lego checked) before any lego is released.
        made: list[tuple[int, Any]] = []
        ring_rows: type[Any] | None = None
        for index, cache in enumerate(caches):
            if _is_lego(cache):
                layout_class = delayed_layout_for(cache)
                if cache.token_geometry.wraps:
                    ring_rows = layout_class.plain_group_class
                made.append(
                    (
                        index,
                        layout_class.from_specs(
                            cache.quantization,
                            cache.token_geometry,
                            geometry=cache.geometry,
                            start=cache.start,
                        ),
                    )
                )
        if ring_rows is not None:
            # A model builds one mask for all its sliding layers: plain serial rings join
            # the ragged ring of the delayed ring's plain rows, whose columns (each row
            # from column 0) the delayed ring's masks follow in every phase.
            for index, cache in enumerate(caches):
                if _plain_serial_ring(cache):
                    made.append(
                        (
                            index,
                            ring_rows.from_specs(
                                Plain(), cache.token_geometry, geometry=cache.geometry
                            ),
                        )
                    )
        out = list(caches)
        for index, layout in made:
            layout.merge_rows([caches[index]])
            out[index] = layout
        return out


def _is_lego(cache: Any) -> bool:
    """A bf16-first lego: a wrapper that hands its serial storage over (``Handover``)."""
    return isinstance(cache, Handover)


def _plain_serial_ring(cache: Any) -> bool:
    """A plain serial ring storage of kvrows (not a layout, not mlx-lm's)."""
    return (
        getattr(cache, "codec_spec", None) == Plain()
        and _wraps(getattr(cache, "token_geometry", None))
        and not hasattr(cache, "row_offsets")
        and not _is_lego(cache)  # a plain-stage lego goes into its delayed layout
        and getattr(cache, "placement", None) is None  # contiguous (a paged ring's rows: pool)
    )


def _wraps(token_geometry: object) -> bool:
    """A geometry whose rows wrap (a ring): its layers share the model's sliding mask."""
    return is_geometry_spec(token_geometry) and token_geometry.wraps


def _caches(caches: Sequence[Any]) -> list[Any]:
    if isinstance(caches, str | bytes) or not isinstance(caches, Sequence):
        raise InvalidInputError(
            f"maintenance takes one request's per-layer caches (a sequence), got "
            f"{type(caches).__name__}"
        )
    return list(caches)


def create_kv_maintenance(scheme: KvStorageScheme) -> KvMaintenance:
    """The maintenance of ``scheme`` (plain: nothing to do; ``start == 0``: legos route to
    their storages in the batch; ``start > 0``: the delayed layouts)."""
    if not isinstance(scheme, KvStorageScheme):
        raise InvalidInputError(
            f"create_kv_maintenance takes a KvStorageScheme, got {type(scheme).__name__}"
        )
    return KvMaintenance(scheme)
