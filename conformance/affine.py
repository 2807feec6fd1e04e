"""The affine family's machine: the base machine at one codec drawn per example.

Every example draws one affine codec, ``(bits, group_size)`` with bits in {2, 3, 4, 5, 6,
8} and group sizes in {32, 64, 128}, and head dims (32, 64, 128) that the group divides.
The base machine does the rest (its model encodes with the reference codec, its
views are the stored triples, its peer is mlx-lm's ``QuantizedKVCache`` with the named
skips ``A1`` and ``A2``). This subclass adds only:

* the geometry strategy (:attr:`AffineMachine.codecs` restricts the draw:
  ``machine_class(family, layout, codecs=[(4, 64)])``);
* serial prompt chunks compare attention on their last :data:`ATTENDED_QUERIES` queries
  (CPU float16 ``quantized_matmul`` is slow; masks are still compared whole);
* the codec's invalid operations: rows of another bit width or group size, plain caches
  and layouts, each refused with ``IncompatibleRowsError`` by both implementations.
"""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import strategies as st

from kvrows.affine_geometry import SUPPORTED_BITS, SUPPORTED_GROUP_SIZES
from kvrows.conformance import strategies as ks
from kvrows.conformance.families import Impl
from kvrows.conformance.machines import Case, ConformanceMachine, Slot
from kvrows.errors import IncompatibleRowsError

__all__ = ["ATTENDED_QUERIES", "CODECS", "HEAD_DIMS", "AffineMachine"]

#: Every supported codec, ``(bits, group_size)``.
CODECS: tuple[tuple[int, int], ...] = tuple(
    (bits, group) for bits in SUPPORTED_BITS for group in SUPPORTED_GROUP_SIZES
)
#: Head dims the examples use (those the example's group size divides).
HEAD_DIMS = (32, 64, 128)
#: A serial prompt chunk's attention is compared on its last this many queries.
ATTENDED_QUERIES = 8


class AffineMachine(ConformanceMachine):
    """The base rules at one affine codec per example (see the module docstring)."""

    codecs: ClassVar[tuple[tuple[int, int], ...]] = CODECS
    attended_queries: ClassVar[int | None] = ATTENDED_QUERIES

    @classmethod
    def geometries(cls) -> st.SearchStrategy[ks.Geometry]:
        return ks.geometries(dims=HEAD_DIMS, codecs=tuple(cls.codecs))

    def _filled(self, impl: Impl, cache: Any) -> Any:
        """``cache`` after one append of two tokens of the example's shapes."""
        return self._fill(impl, cache, self.g.key_dim)

    def _holding(self, impl: Impl, name: str, cache: Any) -> Any:
        """A new ``name`` layout of ``impl`` holding ``cache`` as its row."""
        layout = self._new(impl, name, bits=getattr(cache, "bits", self.g.bits))
        layout.merge_rows([cache])
        return layout

    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        g = self.g
        other_bits = next(b for b in SUPPORTED_BITS if b != g.bits)
        other_group = next(s for s in SUPPORTED_GROUP_SIZES if s != g.group_size)
        serial, bad = self.serial_name, IncompatibleRowsError

        def other(impl: Impl, what: str) -> Any:
            if what == "bits":
                return self._filled(impl, self._new(impl, serial, bits=other_bits))
            cache = self._new(impl, serial, group_size=other_group)
            fits = g.key_dim % other_group == 0 and g.value_dim % other_group == 0
            return self._filled(impl, cache) if fits else cache

        def plain(impl: Impl) -> Any:
            return self._filled(impl, self._new(impl, "KVCache"))

        return [
            (
                "merge_rows of a cache of another bit width",
                lambda impl, lay: lay.merge_rows([other(impl, "bits")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a cache of another group size",
                lambda impl, lay: lay.merge_rows([other(impl, "group")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a valid cache and one of another bit width",
                lambda impl, lay: lay.merge_rows(
                    [self._filled(impl, self._new(impl, serial)), other(impl, "bits")]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain KVCache holding tokens",
                lambda impl, lay: lay.merge_rows([plain(impl)]),
                "V0",
                bad,
            ),
            (
                "merge_rows of an empty plain KVCache",
                lambda impl, lay: lay.merge_rows([self._new(impl, "KVCache")]),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain PaddedKVRows holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, "PaddedKVRows", plain(impl))]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a plain BatchedKVCache holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, "BatchedKVCache", plain(impl))]
                ),
                "V0",
                bad,
            ),
            (
                "merge_rows of a layout of another bit width holding a row",
                lambda impl, lay: lay.merge_rows(
                    [self._holding(impl, self.spec.name, other(impl, "bits"))]
                ),
                "V0",
                bad,
            ),
        ]
