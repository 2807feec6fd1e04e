"""The rotating (sliding-window) family's machine: the base machine with a window.

Six classes, two codecs: the plain rings ``RotatingKVCache`` (serial),
``BatchedRotatingCache`` (decode: one shared write column) and ``RaggedRotatingRows``
(prefill/verify: ragged rows, per-row ``trim_rows`` before a row wraps), and the affine
rings ``RotatingQuantizedKVCache``, ``BatchedRotatingQuantCache`` and
``RotatingAffineLayout``. Each layout's serial ring rides along (free requests, solo
replay, extraction). The base machine already speaks windows through the example's
geometry (``max_size``: what a store keeps, when it has wrapped, what a trim or a
publish may do, the semantic mask check of every append). This subclass adds only:

* the geometry strategy (windows of 4-32, the layout's codec) and prompts, chunks and
  blocks around the window;
* the views ``window()`` / ``row_window()`` (the newest ``min(offset, max_size)``
  tokens in temporal order);
* a ring filter keeps the survivors' padding; ragged rings have none;
* mlx-lm's rings (plain codec): serial ``RotatingKVCache`` twins (ring index) and the
  ``BatchRotatingKVCache`` mirror (ring state), with the named skips ``B9`` (a block on
  a wrapped ring: mlx-lm's mask may only hide), ``R1`` (a join re-syncs the mirror by
  ``merge`` of mlx-lm's own ``extract`` of its running rows plus the newcomers' twins)
  and ``R2`` (mlx-lm's extracted ring keeps the oversized buffer: its newest window is
  compared and kept as the request's twin);
* the invalid merges of rings of another window, full-attention caches and other
  codec parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from hypothesis import strategies as st

from kvrows.affine_geometry import SUPPORTED_BITS
from kvrows.conformance import strategies as ks
from kvrows.conformance.families import CONSTRUCTORS
from kvrows.conformance.machines import Case, ConformanceMachine, Slot, Track, view_planes

__all__ = ["RingMachine", "windows"]


def windows(role: str = "decode") -> st.SearchStrategy[int]:
    """Ring windows: mostly 4-8 (a ring wraps within a few steps), sometimes 12-32; the
    prefill machines lean to wider windows (prompts and blocks around the window)."""
    if role == "prefill":
        return st.one_of(st.integers(4, 8), st.integers(9, 16), st.just(32))
    return st.one_of(st.integers(4, 8), st.integers(4, 8), st.sampled_from((12, 16, 32)))


def keeps(max_size: int) -> st.SearchStrategy[int]:
    """Sink tokens: none in about two examples of three, else 1 to 3 (below the window)."""
    if max_size < 2:
        return st.just(0)  # a window of one token has no room for a sink
    return st.one_of(st.just(0), st.just(0), st.integers(1, min(3, max_size - 1)))


def _lm_ring(max_size: int, keep: int = 0) -> Any:
    from mlx_lm.models import cache

    lm: Any = cache
    return lm.RotatingKVCache(max_size, keep)


class RingMachine(ConformanceMachine):
    """The base rules over a ring layout (see the module docstring)."""

    serial_view = "window"
    row_view = "row_window"

    @classmethod
    def window_sizes(cls) -> st.SearchStrategy[int]:
        """The example's ring window (``max_size``)."""
        return windows(cls.spec.role)

    @classmethod
    def geometries(cls) -> st.SearchStrategy[ks.Geometry]:
        sizes = cls.window_sizes()
        if CONSTRUCTORS[cls.spec.name][1]:
            codecs = tuple((bits, group) for bits in SUPPORTED_BITS for group in (32, 64))
            return ks.geometries(dims=(32, 64), codecs=codecs, windows=sizes, keeps=keeps)
        return ks.geometries(windows=sizes, keeps=keeps)

    def teardown(self) -> None:
        if self.geo is not None and self.stats.steps > self._steps_at_start:
            self.stats.variant("sink tokens" if self.g.keep else "no sink tokens")
        super().teardown()

    @property
    def window(self) -> int:
        assert self.g.max_size is not None
        return self.g.max_size

    def _prompt_length(self, data: st.DataObject) -> int:
        m = self.window
        return data.draw(
            st.one_of(st.integers(0, m - 1), st.integers(m, 2 * m + 3)), label="prompt length"
        )

    def _chunk(self, data: st.DataObject) -> int:
        return data.draw(st.one_of(st.just(1), st.integers(2, self.window + 2)), label="chunk")

    def _block_size(self, data: st.DataObject) -> int:
        return data.draw(st.one_of(st.integers(2, 4), st.integers(2, self.window + 2)), label="N")

    def _check_layout_shape(self, slot: Slot) -> None:
        if not self.spec.shared_column:
            self._exact(
                f"layout {slot.ident} left_pad of ragged rings",
                slot.ref.left_pad,
                (0,) * len(slot.rows),
            )

    def _after_filter(self, slot: Slot, pads: tuple[int, ...], keep: list[int]) -> None:
        self._exact(
            "a ring filter keeps every survivor's padding",
            slot.ref.left_pad,
            tuple(pads[i] for i in keep),
        )

    # ------------------------------------------------------------------ mlx-lm
    def _parity(self, slot: Slot) -> bool:
        """mlx-lm's batch ring has no sinks (``B7``): no mirror of a layout with ``keep``."""
        if self.g.keep and self.peer is not None and self.spec.peer:
            self._skip("B7", "BatchRotatingKVCache has no keep: no mirror of this layout")
            return False
        return super()._parity(slot)

    def _peer_divergence(self, slot: Slot, n: int) -> str | None:
        return "B9" if n > 1 and slot.opt.ring_state[2] else None

    def _peer_layout_state(self, slot: Slot, lm: Any) -> None:
        what = f"layout {slot.ident} mlx-lm"
        self._exact(
            f"{what} (_idx, _offset, rotated)",
            (int(lm._idx), int(lm._offset), bool(lm.rotated)),
            slot.opt.ring_state,
        )
        self._exact(f"{what} is_trimmable", lm.is_trimmable(), slot.opt.is_trimmable())

    def _peer_serial_state(self, track: Track) -> None:
        lm = track.lm
        self._exact(
            f"request {track.ident} mlx-lm ring index", int(lm._idx), int(track.opt.ring_index)
        )
        self._exact(
            f"request {track.ident} mlx-lm is_trimmable",
            lm.is_trimmable(),
            not self.g.wrapped(track.tokens),
        )

    def _peer_join(self, slot: Slot, twins: Sequence[Any]) -> None:
        """A join re-syncs the mirror (skip ``R1``): mlx-lm's ``extend`` keeps its running
        geometry where kvrows re-merges every row."""
        assert self.peer is not None
        running: list[Any] = []
        if slot.rows:
            self._skip("R1", "join: mlx-lm extend keeps its geometry; re-merge the mirror")
            if slot.lm is None or slot.lm.keys is None:
                running = [_lm_ring(self.window, self.g.keep) for _ in slot.rows]
            else:
                running = [slot.lm.extract(b) for b in range(len(slot.rows))]
        slot.lm = self.peer.batch.merge([*running, *twins])

    def _peer_filter(self, slot: Slot, keep: list[int]) -> None:
        slot.lm.filter(keep)
        self.stats.check("mlx-lm filter")

    def _peer_extract(self, lm: Any, b: int, track: Track) -> Any:
        """mlx-lm's ``extract(b)``: offset and newest window vs the model; the compact twin."""
        ring = lm.extract(b)
        self._exact("mlx-lm extract offset", int(ring.offset), track.tokens)
        keep = self.g.kept(track.tokens)
        held = int(ring.keys.shape[2])
        self._exact(f"mlx-lm extract holds at least the window ({keep})", held >= keep, True)
        if held > keep:
            self._skip("R2", f"mlx-lm's extracted ring keeps {held} columns, kvrows' {keep}")
        newest = ((ring.keys[..., held - keep :, :],), (ring.values[..., held - keep :, :],))
        self._same_planes(
            "kv.mlx_lm",
            "mlx-lm extract (newest window)",
            view_planes(self.opt_impl, newest),
            self._model_view(track),
        )
        self.stats.check("mlx-lm extract")
        return self._compact(newest[0][0], newest[1][0], track.tokens)

    def _compact(self, keys: Any, values: Any, offset: int) -> Any:
        """An mlx-lm ring holding ``keys``/``values`` (the newest window, in temporal order),
        its index at the end: the layout kvrows' extracted ring has."""
        twin = _lm_ring(self.window, self.g.keep)
        if int(keys.shape[2]):
            twin.keys, twin.values = mx.contiguous(keys), mx.contiguous(values)
        twin.offset, twin._idx = offset, int(keys.shape[2])
        return twin

    def _twin_for(self, track: Track) -> Any:
        """A replayed twin re-laid as kvrows' extracted ring is (newest window, in order)."""
        ring = self._replay(track).lm
        keep = self.g.kept(track.tokens)
        if keep == 0 or ring.keys is None:
            return _lm_ring(self.window, self.g.keep)
        sinks = min(self.g.keep, track.tokens)

        def window(planes: Any) -> Any:
            """mlx-lm's temporal order (its sinks stay first), cut to kvrows' window."""
            idx = ring._idx
            if idx < ring.offset and idx < planes.shape[2]:
                planes = mx.concatenate(
                    [planes[..., :sinks, :], planes[..., idx:, :], planes[..., sinks:idx, :]],
                    axis=2,
                )
            else:
                planes = planes[..., :idx, :]
            tail = planes[..., planes.shape[2] - keep + sinks :, :]
            return mx.concatenate([planes[..., :sinks, :], tail], axis=2) if sinks else tail

        return self._compact(window(ring.keys), window(ring.values), track.tokens)

    # ------------------------------------------------------------- bad input
    def _extra_layout_cases(self, slot: Slot) -> list[Case]:
        g = self.g
        cases: list[Case] = [
            (
                "merge_rows of a ring of another window",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "window")]),
                "V0",
                None,
            ),
            (
                "merge_rows of a full-attention cache",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "full attention")]),
                "V0",
                None,
            ),
            (
                "merge_rows of a good ring and one of another window",
                lambda impl, lay: lay.merge_rows(
                    [self._new(impl, self.serial_name), self._foreign(impl, "window")]
                ),
                "V0",
                None,
            ),
            (
                "merge_rows of an empty layout of another window",
                lambda impl, lay: lay.merge_rows(
                    [self._new(impl, self.spec.name, max_size=self.window + 1)]
                ),
                "V0",
                None,
            ),
        ]
        if g.affine:
            cases += [
                (
                    "merge_rows of a ring with other bits",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "other bits")]),
                    "V0",
                    None,
                ),
                (
                    "merge_rows of a ring with another group size",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "other group")]),
                    "V0",
                    None,
                ),
            ]
        return cases
