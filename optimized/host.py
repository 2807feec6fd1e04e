"""NumPy views of MLX buffers on the CPU backend, where NumPy's copies run near memcpy's
speed and MLX's slice updates and per-element gathers do not (``spec/paged.md``,
``spec/turbo-codec.md``): the paged pool writes and gathers through them, the TurboQuant
value read looks its centroids up through them; the pool's large reads go into buffers it
keeps from read to read (:class:`KeptBuffers`, ``spec/paged-pool.md`` §6). Every helper
returns ``None`` (or is not called) on other backends, which keep the MLX ops."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = [
    "CODES_PER_LOOKUP",
    "E4M3_BIAS_SHIFT",
    "KEPT_BUFFER_BYTES",
    "FreshHost",
    "KeptBuffers",
    "PlacedE4m3",
    "RowDecoder",
    "code_runs",
    "decode_groups",
    "e4m3_floats",
    "e8m0_scales",
    "fresh_host",
    "group_rows",
    "host_fields",
    "host_readable",
    "host_views",
    "keep_every_buffer",
    "kept_from",
    "lookup_codes",
    "on_cpu",
    "scratch",
]


#: Batch rows ``[lo, hi)`` of a tensor's planes, columns ``[start, S)``, decoded on the
#: host: float32 ``[hi - lo, heads, S - start, dim]`` (a codec's decoder for :mod:`host
#: attention <kvrows.optimized.codecs.host_attention>`).
RowDecoder = Callable[[int, int, int], "np.ndarray[Any, Any]"]
#: ``(shape, dtype) -> (image, target)``: an evaluated MLX array to fill on the host and a
#: writable NumPy view of its buffer (:func:`fresh_host`, a slot of :class:`KeptBuffers`).
FreshHost = Callable[[tuple[int, ...], mx.Dtype], tuple[mx.array, "np.ndarray[Any, Any]"]]


#: A thread's scratch buffers (:func:`scratch`), by slot.
_SCRATCH = threading.local()
#: Scratch buffers up to this size stay with their thread between calls.
KEPT_SCRATCH_BYTES = 64 << 20


def scratch(slot: str, shape: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """A float32 buffer of ``shape`` from this thread's ``slot``, valid until the thread
    asks that slot again: the host attention's decoded rows and scores, chunk after chunk
    and step after step. Writing fresh pages costs here (a take into a new 4 MiB buffer ran
    5x slower than into one written before, and a decode step at B = 1 writes one chunk),
    so a buffer up to :data:`KEPT_SCRATCH_BYTES` is kept and grown, never given back."""
    size = math.prod(shape)
    buffers: dict[str, np.ndarray[Any, Any]] = getattr(_SCRATCH, "buffers", None) or {}
    _SCRATCH.buffers = buffers
    flat = buffers.get(slot)
    if flat is None or flat.size < size:
        flat = np.empty(size, dtype=np.float32)
        if size * 4 <= KEPT_SCRATCH_BYTES:
            buffers[slot] = flat
    return flat[:size].reshape(shape)


def on_cpu() -> bool:
    """Whether MLX computes on the CPU backend (NumPy and MLX then share memory)."""
    return bool(mx.default_device() == mx.cpu)


#: NumPy dtype strings of the plane dtypes the CPU write path serves.
_MX_DTYPES = {
    np.dtype(np.float16).str: mx.float16,
    np.dtype(np.float32).str: mx.float32,
    np.dtype(np.uint32).str: mx.uint32,
    np.dtype(np.uint8).str: mx.uint8,
    np.dtype(np.int8).str: mx.int8,
    np.dtype(np.uint16).str: mx.uint16,
    np.dtype(np.int32).str: mx.int32,
}


def host_views(planes: Sequence[mx.array]) -> list[np.ndarray[Any, Any]] | None:
    """Writable NumPy views of the pool's planes on the CPU backend (``None`` elsewhere, or
    for a dtype NumPy lacks): the planes are evaluated, owned by the pool alone and read
    only through evaluated copies (gathers), so writing their buffers in place is what an
    MLX slice update with buffer donation does, without its slow copy kernel."""
    if not on_cpu() or any(p.dtype == mx.bfloat16 for p in planes):
        return None
    views = [np.asarray(p) for p in planes]
    if not all(
        v.flags.writeable and v.flags.c_contiguous and v.dtype.str in _MX_DTYPES for v in views
    ):
        return None
    return views


def host_readable(plane: mx.array) -> np.ndarray[Any, Any] | None:
    """A NumPy view of an evaluated plane's buffer on the CPU backend (bfloat16 as its
    ``uint16`` bits: a gather moves bits), ``None`` elsewhere or for a dtype NumPy lacks."""
    if not on_cpu():
        return None
    if plane.dtype == mx.bfloat16:
        plane = plane.view(mx.uint16)
        mx.eval(plane)
    view = np.asarray(plane)
    return view if view.flags.c_contiguous and view.dtype.str in _MX_DTYPES else None


def fresh_host(shape: tuple[int, ...], dtype: mx.Dtype) -> tuple[mx.array, np.ndarray[Any, Any]]:
    """A fresh evaluated MLX array of ``shape`` and ``dtype`` and a writable NumPy view of
    its buffer (bfloat16 through its ``uint16`` bits)."""
    bits = mx.uint16 if dtype == mx.bfloat16 else dtype
    image = mx.zeros(shape, dtype=bits)
    mx.eval(image)
    target = np.asarray(image)
    if not (target.flags.writeable and target.flags.c_contiguous):  # not its own buffer
        image = mx.array(np.zeros(target.shape, dtype=target.dtype))
        target = np.asarray(image)
    if dtype == mx.bfloat16:
        image = image.view(mx.bfloat16)
    return image, target


#: Host-written MLX outputs at least this large are kept between calls (:class:`KeptBuffers`).
#: glibc's ``malloc`` serves a larger block (past its largest mmap threshold, 32 MiB on
#: 64-bit) with fresh pages from the kernel and unmaps it on ``free``: MLX's CPU allocator
#: keeps no cache, so every such output faulted in and zeroed its pages again, about
#: 1 ms a MiB here (a paged read of 2 x 537 MB: over a second a step). Smaller blocks
#: ``malloc`` reuses itself.
KEPT_BUFFER_BYTES = 32 << 20
#: A kept buffer's room past the output it was made for (a decode step's read grows by a
#: column per step: a fresh buffer about every 32nd part of the row length in steps).
KEPT_HEADROOM = 1 / 32
#: The size from which :class:`KeptBuffers` keeps outputs now, and the headroom it gives
#: them (:func:`keep_every_buffer`).
_KEPT: ContextVar[tuple[int, float]] = ContextVar(
    "kvrows_kept", default=(KEPT_BUFFER_BYTES, KEPT_HEADROOM)
)


def kept_from() -> int:
    """The size in bytes from which :class:`KeptBuffers` keeps outputs now (0 inside
    :func:`keep_every_buffer`)."""
    return _KEPT.get()[0]


@contextmanager
def keep_every_buffer() -> Iterator[None]:
    """Inside, :class:`KeptBuffers` keeps outputs of every size, each buffer made twice
    the output it is for (the conformance machines draw it per example on the CPU, so the
    reuse runs at their small shapes, across reads that grow or shrink, too)."""
    token = _KEPT.set((0, 1.0))
    try:
        yield
    finally:
        _KEPT.reset(token)


class KeptBuffers:
    """Buffers of host-written MLX outputs (:func:`fresh_host`'s), one per slot, that the
    next output of the slot reuses once nothing else holds the previous one.

    :meth:`fresh` gives the slot's kept flat buffer to ``mx.slice_update`` of one element
    (the buffer kept by this object alone): MLX donates an input's buffer to the output
    only when no other array, view (NumPy's included) or pending op holds it, which is
    the rule its own in-place updates rely on; otherwise it copies into a fresh buffer
    (while the previous output itself is alive no donation is tried: a new buffer).
    Either way the output's buffer is the new output's alone, so writing it is as safe as
    writing a fresh one, and an output a caller still holds never changes. An output
    below :data:`KEPT_BUFFER_BYTES` is :func:`fresh_host`'s (its slot is left as it is).
    ``reused`` counts the outputs written into a kept buffer."""

    def __init__(self) -> None:
        #: Each slot's flat buffer and the output last written into it (weakly: while that
        #: output lives MLX would not donate, so the slot takes a new buffer, not a copy).
        self._kept: dict[Hashable, tuple[mx.array, weakref.ref[mx.array]]] = {}
        self.reused = 0

    def fresh(
        self, slot: Hashable, shape: tuple[int, ...], dtype: mx.Dtype
    ) -> tuple[mx.array, np.ndarray[Any, Any]]:
        """:func:`fresh_host`'s pair for ``shape`` and ``dtype``, in slot ``slot``'s
        buffer when that fits (at least the output, at most twice the headroom past it);
        else in a new buffer for the slot, :data:`KEPT_HEADROOM` past the output."""
        bits = mx.uint16 if dtype == mx.bfloat16 else dtype
        size = math.prod(shape)
        least, headroom = _KEPT.get()
        if size * bits.size < least:
            return fresh_host(shape, dtype)
        kept, last = self._kept.pop(slot, (None, None))
        address = None
        if (
            kept is not None
            and (last is None or last() is None)
            and kept.dtype == bits
            and size <= kept.size <= size * (1 + 2 * headroom)
        ):
            address = _address(kept)
            flat = mx.slice_update(kept, mx.zeros((1,), bits), mx.array([0]), axes=(0,))
        else:
            flat = mx.zeros((size + math.ceil(size * headroom),), dtype=bits)
        del kept  # the slice update's input only: donated unless a caller holds the buffer
        image = flat[:size].reshape(shape)
        mx.eval(flat, image)
        target = np.asarray(image)
        if not (target.flags.writeable and target.flags.c_contiguous):  # not a view: a copy
            return fresh_host(shape, dtype)
        self.reused += _address(target) == address
        if dtype == mx.bfloat16:
            image = image.view(mx.bfloat16)
        self._kept[slot] = (flat, weakref.ref(image))
        return image, target

    def clear(self) -> None:
        """Give every kept buffer back (held outputs keep theirs)."""
        self._kept.clear()

    def __deepcopy__(self, memo: dict[int, Any]) -> KeptBuffers:
        return KeptBuffers()  # a cache of memory, not state: a copy starts empty


def _address(array: mx.array | np.ndarray[Any, Any]) -> int:
    """The address of ``array``'s first element (an MLX array's through a NumPy view,
    dropped at once: a view held would keep its buffer from being donated)."""
    return int(np.asarray(array).__array_interface__["data"][0])


def host_fields(stream: np.ndarray[Any, Any], bits: int, field: int) -> np.ndarray[Any, Any]:
    """A little-endian bitstream of ``bits``-bit codes (``uint8``, the first code in the low
    bits: MLX's affine packing and TurboQuant's) as consecutive ``field``-bit fields, ``intp``
    (``field`` a multiple of ``bits`` dividing a run of 8 codes; 8: the bytes as they are).

    A run of 8 codes is ``bits`` bytes: the stream, copied once with a few bytes of padding,
    is read as one (unaligned) little-endian word per run, ``bits`` bytes apart, and each
    field is one shift and mask of it."""
    if field == 8:
        return stream
    word = 4 if bits <= 4 else 8
    flat = stream.reshape(-1)
    runs = int(flat.size) // bits
    padded = np.zeros(int(flat.size) + word - bits, dtype=np.uint8)
    padded[: flat.size] = flat
    words = np.ndarray((runs,), dtype=f"<u{word}", buffer=padded, strides=(bits,))
    per_run, mask = 8 * bits // field, (1 << field) - 1
    fields = np.empty((runs, per_run), dtype=np.intp)
    for j in range(per_run):
        np.bitwise_and(words >> (j * field), mask, out=fields[:, j], casting="unsafe")
    return fields.reshape(*stream.shape[:-1], int(stream.shape[-1]) * 8 // field)


#: Codes looked up together per ``bits`` on the host: the index of ``k`` codes has ``k·bits``
#: bits (at most 16: the table of runs, at most 512 KiB, stays in a core's cache), and ``k``
#: divides a run of 8. Fewer, wider takes are cheaper (8 bits: 0.5 against 0.8 ms a
#: million codes).
CODES_PER_LOOKUP = {2: 4, 3: 4, 4: 2, 5: 2, 6: 2, 8: 2}

#: The item a take moves per lookup of ``k`` float32 levels: one machine copy.
_RUN_ITEMS: dict[int, Any] = {1: np.uint32, 2: np.uint64, 4: np.complex128}


def code_runs(
    levels: np.ndarray[Any, Any], bits: int, per_lookup: int | None = None
) -> np.ndarray[Any, Any]:
    """``[2^(k·bits), k]`` float32 (``k = per_lookup``, default ``CODES_PER_LOOKUP[bits]``):
    for each index of ``k`` codes (the first in the low bits), their ``levels``; one take
    (or gather) then reads ``k`` values."""
    k = CODES_PER_LOOKUP[bits] if per_lookup is None else per_lookup
    index = np.arange(2 ** (k * bits), dtype=np.uint32)[:, None]
    shifts = np.arange(0, k * bits, bits, dtype=np.uint32)[None, :]
    runs: np.ndarray[Any, Any] = np.ascontiguousarray(
        np.asarray(levels, dtype=np.float32)[(index >> shifts) & ((1 << bits) - 1)]
    )
    return runs


def lookup_codes(
    stream: np.ndarray[Any, Any],
    bits: int,
    runs: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """The float32 levels of a ``bits``-bit code stream ``[..., W]`` (``uint8``) as
    ``[..., W·8/bits]``: one take of :func:`code_runs` per ``k`` codes, each run moved as
    one item. ``mode="clip"`` writes straight into the output (``"raise"`` buffers it
    first); every index is in range by construction. ``out``: a float32 buffer of the
    result's shape to write (default: a new one)."""
    k = int(runs.shape[1])
    if k * bits == 16:  # whole byte pairs: the stream's own little-endian uint16s
        indices = np.ascontiguousarray(stream).view("<u2")
    else:
        indices = host_fields(stream, bits, k * bits)
    if out is None:
        out = np.empty((*stream.shape[:-1], int(stream.shape[-1]) * 8 // bits), dtype=np.float32)
    item = _RUN_ITEMS[k]
    np.take(runs.view(item).reshape(-1), indices.reshape(-1), out=out.view(item).reshape(-1),
            mode="clip")  # fmt: skip
    return out


#: An E4M3 code's bits placed in a float32's (:class:`PlacedE4m3`) read as its level times
#: ``2**-E4M3_BIAS_SHIFT``: the exponent bias is 127 there against E4M3's 7.
E4M3_BIAS_SHIFT = 120
#: The placed bits kept: the sign (bit 31) and the code's exponent and mantissa (bits 20-26);
#: an ``int8`` code shifted left by 20 carries its sign through bits 27-31.
_E4M3_PLACED = np.int32(np.uint32(0x87F00000).view(np.int32))


@dataclass(frozen=True, eq=False)
class PlacedE4m3:
    """The levels of FP8 E4M3 codes (``mxfp8``) with no table take: each code's 7 exponent
    and mantissa bits and its sign go into a float32's bits, which then hold the level
    times ``2**-120`` exactly, subnormals included (the scales carry the ``2**120``). A cast,
    a shift and a mask, where a take of the code pairs costs twice as much. The NaN codes
    (``0x7F``, ``0xFF``; the encoder saturates at 448, but a loaded plane may hold them)
    would read as 480: a chunk holding one takes ``runs`` (the E4M3 levels' code runs)."""

    runs: np.ndarray[Any, Any]

    def levels(self, codes: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
        signed = codes.view(np.int8)
        if codes.max() == 0xFF or signed.max() == 0x7F:  # two reductions, no temporaries
            lookup_codes(codes, 8, self.runs, out)
            out *= np.float32(2.0**-E4M3_BIAS_SHIFT)  # exact: a power of two, no underflow
            return
        placed = out.view(np.int32)
        np.copyto(placed, signed, casting="unsafe")
        placed <<= 20
        placed &= _E4M3_PLACED


def e8m0_scales(codes: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """E8M0 scale bytes as float32 (``2**(e - 127)``) by placing each byte in a float32's
    exponent field: a cast and a shift, where ml_dtypes' cast takes five times as long.
    The two codes the placement misreads are set apart when present: 0 (``2**-127``, a
    float32 subnormal) and 255 (NaN)."""
    placed = codes.astype(np.uint32)
    placed <<= 23
    if codes.size and (codes.min() == 0 or codes.max() == 0xFF):
        placed[codes == 0] = 0x00400000
        placed[codes == 0xFF] = 0x7FC00000
    return placed.view(np.float32)


def e4m3_floats(codes: np.ndarray[Any, Any], runs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """E4M3 bytes (nvfp4's scales) as float32, exactly: :class:`PlacedE4m3`'s placement,
    then the ``2**120`` back (``runs``: the E4M3 levels' code runs, for NaN codes)."""
    out = np.empty(codes.shape, dtype=np.float32)
    PlacedE4m3(runs).levels(codes, out)
    out *= np.float32(2.0**E4M3_BIAS_SHIFT)
    return out


def decode_groups(
    codes: np.ndarray[Any, Any],
    bits: int,
    runs: np.ndarray[Any, Any] | PlacedE4m3 | None,
    group_size: int,
    out: np.ndarray[Any, Any],
    scales: np.ndarray[Any, Any],
    *,
    offsets: np.ndarray[Any, Any] | None = None,
    biases: np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, Any]:
    """Every codec's host decode, into ``out`` (float32 ``[..., W·8/bits]``): each code's
    level (:func:`lookup_codes` of ``runs``; ``None``: the codes are the levels, a cast;
    :class:`PlacedE4m3`: its bit placement), then per group of ``group_size``
    ``(level + offsets) · scales + biases`` (each ``[..., groups, 1]``; ``offsets`` and
    ``biases`` where given), in place."""
    if runs is None:
        np.copyto(out, codes, casting="unsafe")
    elif isinstance(runs, PlacedE4m3):
        runs.levels(codes, out)
    else:
        lookup_codes(codes, bits, runs, out)
    groups = out.reshape(*out.shape[:-1], out.shape[-1] // group_size, group_size)
    if offsets is not None:
        groups += offsets
    groups *= scales
    if biases is not None:
        groups += biases
    return out


def group_rows(
    stream: np.ndarray[Any, Any],
    bits: int,
    runs: np.ndarray[Any, Any] | PlacedE4m3 | None,
    group_size: int,
    slot: str,
    scales: np.ndarray[Any, Any],
    *,
    offsets: np.ndarray[Any, Any] | None = None,
    biases: np.ndarray[Any, Any] | None = None,
) -> RowDecoder:
    """The :data:`RowDecoder` of a code stream ``[B, H, S, W]`` and its per-group planes
    ``[B, H, S, groups, 1]`` (:func:`decode_groups`), each chunk into the thread's
    ``slot`` (:func:`scratch`)."""

    def rows(lo: int, hi: int, start: int) -> np.ndarray[Any, Any]:
        codes = stream[lo:hi, :, start:]
        out = scratch(slot, (*codes.shape[:-1], int(codes.shape[-1]) * 8 // bits))

        def cut(plane: np.ndarray[Any, Any] | None) -> np.ndarray[Any, Any] | None:
            return None if plane is None else plane[lo:hi, :, start:]

        return decode_groups(codes, bits, runs, group_size, out, scales[lo:hi, :, start:],
                             offsets=cut(offsets), biases=cut(biases))  # fmt: skip

    return rows
