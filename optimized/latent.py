"""The optimized latent caches (``spec/MLACache.md``, ``spec/EncodedLatentCache.md``).

:class:`LatentSurface` is ``MLACache``'s surface on the optimized row machinery
(``classes.build`` puts it first among the preset's bases; the growing geometry's
shared-column buffers). ``EncodedLatentCache`` is the same surface in two stage stores
(``kvrows.latent.EncodedLatentMembers``); ``PagedLatentCache`` (``optimized/paged.py``) is
it over the paged placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeGuard

import mlx.core as mx

from kvrows.codec import DTYPE_SIZES, PlaneSet, as_role
from kvrows.compositions import composition
from kvrows.errors import InvalidInputError, preview_blocks_message
from kvrows.latent import (
    EncodedLatentMembers,
    LatentSurfaceMembers,
    int_vector_message,
)
from kvrows.optimized.codecs import Codec, dtype_name, mlx_dtype
from kvrows.optimized.codecs.latent import LatentArrayCodec
from kvrows.optimized.geometries.growing import GrowingGeometry
from kvrows.optimized.rows import Layout, RowWindow, Store, arrays, mapped, owned
from kvrows.optimized.speculative import SpeculativeLayout

__all__ = ["DecodedWindow", "EncodedLatentCache", "LatentSurface", "encodes_latent"]

Planes = tuple[mx.array, ...]


def _ints(cache: Any, value: Any, what: str) -> list[int]:
    integers = isinstance(value, mx.array) and value.ndim == 1
    if not integers or (value.size and not mx.issubdtype(value.dtype, mx.integer)):
        raise InvalidInputError(int_vector_message(type(cache).__name__, what))
    listed: list[int] = value.tolist()
    return listed


# The machinery's members the surface uses (at run time the preset's own bases).
if TYPE_CHECKING:

    class _OnRows(LatentSurfaceMembers):
        _planes: PlaneSet | None
        _stores: list[Store] | None
        _stages: tuple[Any, ...]
        row_stages: tuple[int, ...]
        _offsets: list[int]
        _pads: list[int]

        def _visible_rows(self, store: Store) -> PlaneSet: ...

        def _visible(self, planes: PlaneSet) -> PlaneSet: ...
        def _clear(self) -> None: ...
        def _changed(self) -> None: ...
        def _row_windows(self) -> list[RowWindow]: ...
else:
    _OnRows = LatentSurfaceMembers


class LatentSurface(_OnRows):
    """``MLACache``'s surface on the optimized row machinery (``classes.build`` lists it
    first): the array half of ``kvrows.latent.LatentSurfaceMembers``. The rows are the
    growing geometry's shared-column buffers (tensors ``latent``, ``rope``, ``index``,
    ``[slots, 1, capacity, ·]``); an empty cache lends one empty row to a merge (it is its
    own serial storage); ``preview`` is what the next append will return."""

    def _dtype_of(self, array: Any) -> str:
        return dtype_name(array)

    def _as4(self, array: Any) -> Any:
        return mx.expand_dims(array, 1)

    def _as3(self, array: Any) -> Any:
        return array[:, 0]

    def _native(self, array: Any) -> bool:
        return isinstance(array, mx.array)

    def _as_dtype(self, array: Any, dtype: str) -> Any:
        return array if dtype_name(array) == dtype else array.astype(mlx_dtype(dtype))

    def _int_array(self, values: Sequence[int]) -> Any:
        return mx.array(list(values), dtype=mx.int32)

    def _ints(self, value: Any, what: str) -> list[int]:
        return _ints(self, value, what)

    def _row_windows(self) -> list[RowWindow]:
        return super()._row_windows() or [(None, 0)]

    def _visible_planes(self) -> PlaneSet:
        """The columns that hold tokens (views; nothing before the first write)."""
        return {} if self._planes is None else self._visible(self._planes)

    def held_arrays(self) -> tuple[Any, ...]:
        """The buffers held, whole, each as an array of its own (``a[:]``: no primitive,
        where a view of the written columns is one more per plane in every step's graph;
        a later append rebinds the cache's arrays, never these)."""
        if self._stores is not None:  # rows of several stages: each store's that holds any
            # (a stage whose rows were all trimmed to nothing holds no planes)
            held = [s.planes for s in self._stores if s.planes is not None]
        else:
            held = [] if self._planes is None else [self._planes]
        return tuple(a[:] for planes in held for a in arrays(planes))

    def _with_exact(self, planes: Any, rows: Sequence[int]) -> Any:
        latent, rope, index, _ = planes
        return latent, rope, index, self._rows_only(self._read()["latent"], rows)

    def _rows_only(self, array: Any, rows: Sequence[int]) -> Any:
        kept = mx.array([b in rows for b in range(int(array.shape[0]))])
        return mx.where(kept[:, None, None, None], array, mx.zeros_like(array))

    def planes(self) -> tuple[Planes, mx.array | None, mx.array | None, None]:
        """The stored columns: latent codec planes, rope, index (no exact latent)."""
        visible = self._visible_planes()

        def one(tensor: str) -> mx.array | None:
            return visible[tensor][0] if tensor in visible else None

        return visible.get("latent", ()), one("rope"), one("index"), None

    def _state_planes(self) -> tuple[Any, Any, Any]:
        if self.width == 0:
            return None, None, None
        latent, rope, index, _ = self.planes()
        return latent, rope, index

    def _adopt_state(self, planes: PlaneSet | None, offsets: list[int], width: int) -> None:
        self._clear()
        self._offsets = list(offsets)
        self._pads = [width - o for o in offsets]
        if planes is not None:
            self._planes = mapped(planes, owned)
            mx.eval(*arrays(self._planes))
        self._changed()

    def preview(self, latent: mx.array, rope: mx.array) -> tuple[mx.array, mx.array]:
        """What ``append(latent, rope, index)`` will return for the latent and rope
        (``[B, 1, width + N, ·]``), changing nothing: the drop-in hands it to the model's
        MLA layer before the layer has computed the index block."""
        self._spec_usable()
        four, _, _, _ = self._checked(latent, rope, None, staged=True)
        if not four:
            raise InvalidInputError(preview_blocks_message(type(self).__name__))
        if self.width == 0:
            return latent, rope
        # The block as each row's stage will read it (an encoded latent: decoded).
        stages = self.row_stages
        role = as_role("latent")
        block = latent
        for stage in sorted(set(stages)):
            codec = self._stages[stage]
            if not codec.spec.inner.encodes:
                continue  # the plain latent reads as it is
            read = codec.fetched(codec.encode(latent, role), role).astype(latent.dtype)
            rows = mx.array([s == stage for s in stages])[:, None, None, None]
            block = mx.where(rows, read, block)
        held_latent, held_rope, _ = self._read_all()
        return (
            mx.concatenate([held_latent, block], axis=2),
            mx.concatenate([held_rope, rope], axis=2),
        )


def encodes_latent(codec: object) -> TypeGuard[LatentArrayCodec]:
    """Whether ``codec`` (a store's) is a latent codec storing the latent encoded (its
    spec's inner codec encodes: a ``Latent``'s)."""
    inner = getattr(getattr(codec, "spec", None), "inner", None)
    return bool(getattr(inner, "encodes", False))


#: An encoded latent's decoded window: what it mirrors (by identity: the growing
#: placement's codes plane, new buffers mean a new window; the paged placement's pool) and
#: the latent decoded into the activations' dtype, ``[slots, 1, capacity, R]``.
Window = tuple[object, mx.array]


class DecodedWindow:
    """An encoded latent's **decoded window** (``spec/EncodedLatentCache.md`` §5), one
    mechanism for both placements: a dense ``[slots, 1, capacity, R]`` array of the
    encoded rows' latent decoded into the activations' dtype, built by the first append
    after a change dropped it (one decode of every visible column), then extended by each
    append with its own block's codes decoded (the codecs decode token by token, so the
    window is bit for bit the decode of the whole codes). Every write and row operation
    drops it (``_changed``); an append, and each row operation a placement knows how to
    carry it through, puts it back. The placement says where its columns are
    (``_window_view``) and records the codes an append writes (``_written``)."""

    #: Reads take the latent from the decoded window (``False``: every read decodes the
    #: whole latent, the eager path the window replaces; the conformance oracle and the
    #: benchmarks' baseline).
    keeps_window: ClassVar[bool] = True
    _dense_window: Window | None = None
    #: The encoded latent block an append is writing (its encoded rows', in slot order):
    #: the placement's write records it, its ``_write_blocks`` decodes it into the window.
    _written: Planes | None = None

    if TYPE_CHECKING:

        def _shapes(self) -> Any: ...
        @property
        def latent_spec(self) -> Any: ...

    def _changed(self) -> None:
        """Every write and row operation calls it: the window is dropped, and the next
        append builds it again (an append puts its extended window back, a row operation
        that can carry it does)."""
        super()._changed()  # type: ignore[misc]
        self._dense_window = None

    def _laid_window(
        self, codec: LatentArrayCodec, codes: Planes, slots: int, start: int, capacity: int
    ) -> mx.array:
        """``codes`` (``[rows, 1, columns, ·]``) decoded once into the activations' dtype
        and laid at columns ``start …`` of a ``[slots, 1, capacity, R]`` window."""
        decoded = codec.decoded(codes, "latent", self._shapes().dtype)
        rows, columns = int(decoded.shape[0]), int(decoded.shape[2])
        pads = [(0, slots - rows), (0, 0), (start, capacity - start - columns), (0, 0)]
        return mx.pad(decoded, pads)

    @staticmethod
    def _decode_into(window: mx.array, codec: LatentArrayCodec, written: Planes, stop: int) -> None:
        """The appended block's codes (``written``: its encoded rows, the window's first
        slots) decoded into the columns they went to, ending at ``stop``."""
        rows, n = int(written[0].shape[0]), int(written[0].shape[2])
        decoded = codec.decode(written, "latent")
        if decoded.dtype != window.dtype:  # (TurboQuant decodes in float32)
            decoded = decoded.astype(window.dtype)
        window[:rows, :, stop - n : stop] = decoded

    def _window_view(self) -> mx.array | None:
        """The window's visible columns (its encoded rows'), ``None`` while none is held."""
        raise NotImplementedError

    def window_token_bytes(self) -> int:
        """The window's bytes per token of a row (``R`` values in the activations' dtype;
        0 with ``keeps_window`` off or a plain latent): admission projects them beside the
        codes, since a decoding layout holds both (``nbytes``). A row still warm holds its
        exact latent instead, as many bytes, so the sum bounds every stage."""
        shapes = self._shapes()
        if shapes is None or not self.keeps_window or not self.latent_spec.inner.encodes:
            return 0
        return int(shapes.rank * DTYPE_SIZES[shapes.dtype])

    @property
    def window_nbytes(self) -> int:
        """Bytes of the decoded window held (0 while none is: before the first append
        after a row operation that dropped it, or a cache of no encoded row)."""
        return 0 if self._dense_window is None else int(self._dense_window[1].nbytes)


class EncodedLatentCache(
    DecodedWindow, EncodedLatentMembers, LatentSurface, SpeculativeLayout, GrowingGeometry, Layout
):
    """The latent plane through a codec, rope and index exact, bf16-first per row
    (``spec/EncodedLatentCache.md``): the latent surface on the row machinery, its rows in
    two stage stores (the plain latent, then the encoded one).

    A read takes the encoded rows' latent from a **decoded window** (§5 of the spec): the
    whole latent decoded once (by the first append after a row operation that dropped it),
    then each append decodes only its own columns into it; the codecs decode token by
    token, so the window is bit for bit the decode of the whole codes."""

    composition = composition("EncodedLatentCache")

    def _encoded_store(self) -> tuple[LatentArrayCodec, PlaneSet, int] | None:
        """The store whose codec encodes the latent (at most one stage does): its codec,
        planes and how many rows it holds (``None``: no such store holds planes)."""
        held = self._encoded_rows()
        return None if held is None else (held[0], held[1], len(held[2]))

    def _encoded_rows(self) -> tuple[LatentArrayCodec, PlaneSet, Sequence[int]] | None:
        """``_encoded_store`` with the batch rows it holds (in slot order)."""
        held: list[tuple[Codec, PlaneSet | None, Sequence[int]]]
        if self._stores is None:
            held = [(self.codec, self._planes, range(len(self._offsets)))]
        else:
            held = [(s.codec, s.planes, s.rows) for s in self._stores]
        for codec, planes, rows in held:
            if planes is not None and encodes_latent(codec):
                return codec, planes, rows
        return None

    def _read(self) -> dict[str, Any]:
        """The machinery's read; one store of encoded rows with its window held (a decode
        step's read) takes the latent from the window and views the other planes only
        (no view of the codes it would not read)."""
        planes, window = self._planes, self._dense_window
        if planes is None or window is None or window[0] is not planes["latent"][0]:
            return super()._read()
        others = dict(planes)
        del others["latent"]  # (the window's)
        plain = self._visible(others)
        start, rows = self._origin, len(self._offsets)
        latent = window[1][:rows, :, start : start + self.width]
        return {"latent": latent, **{t: p[0] for t, p in plain.items()}}

    def _fetched(self, codec: Codec, visible: PlaneSet) -> dict[str, Any]:
        latent = visible.get("latent")
        if not (self.keeps_window and latent is not None and encodes_latent(codec)):
            return super()._fetched(codec, visible)
        window = self._window_read(latent)
        # The other tensors are plain: their planes are what a read returns.
        return {
            t: window if p is latent else codec.fetched(p, as_role(t)) for t, p in visible.items()
        }

    def _window_read(self, visible: Planes) -> mx.array:
        """The encoded rows' visible latent (``visible``: its codes): the window's
        columns, or with none held the codes decoded (a read changes nothing: the next
        append builds the window)."""
        held = self._encoded_store()
        shapes = self._shapes()
        assert held is not None and shapes is not None
        _, planes, rows = held
        window = self._dense_window
        if window is None or window[0] is not planes["latent"][0]:
            return held[0].decoded(visible, "latent", shapes.dtype)
        return window[1][:rows, :, self._origin : self._origin + self.width]

    def _built_window(self) -> Window | None:
        """A window of the encoded store's visible columns, decoded once and laid at
        their columns (``None``: no store holds encoded rows)."""
        held, shapes = self._encoded_store(), self._shapes()
        if held is None or shapes is None or not self.keeps_window:
            return None
        codec, planes, rows = held
        start, stop = self._origin, self._origin + self.width
        codes = planes["latent"][0]
        latent = tuple(p[:rows, :, start:stop] for p in planes["latent"])
        slots, capacity = int(codes.shape[0]), int(codes.shape[2])
        return codes, self._laid_window(codec, latent, slots, start, capacity)

    def _write_blocks(self, blocks: dict[str, Any], shapes: Any) -> None:
        """The machinery's write; a window held before it takes the block's codes decoded
        at the columns they went to: every row's newest (the rows share one write column).
        A write that outgrew the buffers moved their columns to fresh ones (origin 0): the
        window's move the same way, one copy (as the codes'). With none held, the write
        builds it (the read after it would decode every column anyway)."""
        kept, self._written = self._dense_window, None
        origin, width = self._origin, self.width
        super()._write_blocks(blocks, shapes)
        written, self._written = self._written, None
        held = self._encoded_store()
        if kept is None:
            self._dense_window = self._built_window()
            return
        if written is None or held is None:
            return
        codec, planes, rows = held
        codes, window = planes["latent"][0], kept[1]
        if codes is not kept[0]:  # ``_reallocate``: the old columns at 0 .. width
            slots, capacity = int(codes.shape[0]), int(codes.shape[2])
            pads = [(0, slots - rows), (0, 0), (0, capacity - width), (0, 0)]
            window = mx.pad(window[:rows, :, origin : origin + width], pads)
        self._decode_into(window, codec, written, self._origin + self.width)
        self._dense_window = (codes, window)

    def _write(self, block: PlaneSet, n: int, shapes: Any) -> None:
        if encodes_latent(self.codec):
            self._written = block["latent"]
        super()._write(block, n, shapes)

    def _append_stores(self, shares: list[PlaneSet], n: int, geometry: Any) -> None:
        assert self._stores is not None
        for store, share in zip(self._stores, shares, strict=True):
            if encodes_latent(store.codec):
                self._written = share["latent"]
        super()._append_stores(shares, n, geometry)

    def _join(
        self, sources: Sequence[Any], incoming: list[RowWindow], shapes: Any, stages: list[int]
    ) -> None:
        """The machinery's. Rows joining the one store of encoded rows leave the running
        rows' columns as they were (a free slot: in place) or move them right by the new
        left padding (new buffers): the window's follow, and only what is new is decoded,
        the joining rows' columns and the running rows' new left padding."""
        kept, origin, width, batch = self._dense_window, self._origin, self.width, self.batch_size
        before = self._encoded_store() if self._stores is None else None
        super()._join(sources, incoming, shapes, stages)
        held = self._encoded_store()
        if kept is None or before is None or held is None or self._stores is not None:
            return
        codec, planes, joined = held
        codes, dtype = planes["latent"][0], dtype_name(kept[1])
        start, target = self._origin, self.width
        grow = target - width
        if codes is kept[0]:  # a free slot, the padding left of the origin: nothing moved
            window = kept[1]
        else:  # new buffers: the running rows' columns ``grow`` right of the origin
            slots, capacity = int(codes.shape[0]), int(codes.shape[2])
            right = capacity - start - grow - width
            pads = [(0, slots - batch), (0, 0), (start + grow, right), (0, 0)]
            window = mx.pad(kept[1][:batch, :, origin : origin + width], pads)

        def decoded(first: int, last: int, begin: int, end: int) -> mx.array:
            latent = tuple(p[first:last, :, begin:end] for p in planes["latent"])
            return codec.decoded(latent, "latent", dtype)

        if grow and batch:
            window[:batch, :, start : start + grow] = decoded(0, batch, start, start + grow)
        window[batch:joined, :, start : start + target] = decoded(
            batch, joined, start, start + target
        )
        self._dense_window = (codes, window)

    def _trim_rows(self, counts: Sequence[int], *, justify: bool = False) -> int:
        """The machinery's. Rows that forget columns in place (equal counts: nothing
        moves) keep the window, which still holds their columns decoded; a rollback that
        rolls rows right into fresh planes (``_align``) moves each row's kept columns of
        the window the same way, one slice per row, the other columns the decode of the
        zero codes the fresh planes hold there."""
        kept, origin, pads = self._dense_window, self._origin, list(self._pads)
        trimmed = super()._trim_rows(counts, justify=justify)
        held = self._encoded_rows()
        if kept is None or held is None:
            return trimmed
        codec, planes, rows = held
        codes = planes["latent"][0]
        if codes is kept[0]:
            self._dense_window = kept
            return trimmed
        shapes = self._shapes()
        if shapes is None or self._origin:  # (``_align``'s fresh planes start at column 0)
            return trimmed
        zero = codec.decoded(
            codec.zeros(1, 1, 1, shapes.rank, shapes.dtype), "latent", shapes.dtype
        )
        window = mx.tile(zero, (int(codes.shape[0]), 1, int(codes.shape[2]), 1))
        for slot, b in enumerate(rows):
            count, source, target = self._tokens_held[b], origin + pads[b], self._pads[b]
            if count:  # (MLX faults on empty slices)
                window[slot : slot + 1, :, target : target + count] = kept[1][
                    slot : slot + 1, :, source : source + count
                ]
        self._dense_window = (codes, window)
        return trimmed

    def _keep_rows(self, order: list[int]) -> None:
        """The machinery's; one store's kept rows gathered by slot (the origin moves, no
        column does): the window's slots are gathered the same way (buffers released to
        other columns: rebuilt at the next read)."""
        kept, origin = self._dense_window, self._origin
        shared = min(self._pads[b] for b in order)
        single = self._stores is None
        super()._keep_rows(order)
        held = self._encoded_store()
        if kept is None or held is None or not single or self._stores is not None:
            return
        if self._origin != origin + shared:
            return  # released slots: new buffers, their columns from 0
        codes, window = held[1]["latent"][0], kept[1]
        if codes is not kept[0]:
            window = self._gather_slots({"latent": (window,)}, order)["latent"][0]
        if window.shape[:3] == codes.shape[:3]:
            self._dense_window = (codes, window)

    def _held_planes(self) -> tuple[Any, ...]:
        """The stores' planes and the decoded window (``nbytes`` counts both)."""
        held = super()._held_planes()
        return held if self._dense_window is None else (*held, self._dense_window[1])

    def _window_view(self) -> mx.array | None:
        if self._dense_window is None or (store := self._encoded_store()) is None:
            return None
        start, stop = self._origin, self._origin + self.width
        return self._dense_window[1][: store[2], :, start:stop]

    def held_arrays(self) -> tuple[Any, ...]:
        """The buffers held and, while one is held, the window's (an evaluation at a step's
        end evaluates the window too)."""
        held = super().held_arrays()
        window = self._dense_window
        if window is None or self._encoded_store() is None:
            return held
        return (*held, window[1][:])
