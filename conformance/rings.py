"""The conformance state machine of the rotating (sliding-window) family.

Six classes, two codecs: the plain rings ``RotatingKVCache`` (serial),
``BatchedRotatingCache`` (decode: one shared write column) and
``RaggedRotatingRows`` (prefill/verify: ragged rows, per-row ``trim_rows`` before a
row wraps), and the affine rings ``RotatingQuantizedKVCache`` (serial),
``BatchedRotatingQuantCache`` (decode) and ``RotatingAffineLayout`` (prefill). One
machine per layout (:func:`ring_machine_class`); the serial ring of the layout's
codec is exercised by every machine (free requests, solo replay, extraction).

What the machine holds, as ``machines.py``'s does: the reference and the optimized
layouts side by side; for every request its serial rings in both implementations
(and an mlx-lm ``RotatingKVCache`` twin for the plain codec); a NumPy **model** of
every request (the encoded planes of every token appended, minus trims), which
depends on no implementation; for ``BatchedRotatingCache`` an mlx-lm mirror
(``BatchRotatingKVCache``).

Rings read in different column orders (the optimized ring and mlx-lm in physical,
rotated order; the reference serial ring in temporal order), so besides the exact
comparisons the machine checks every mask **semantically**: on every append, the
keys each query sees (identified by their bytes) must be exactly the row's tokens
at positions ``(p - window, p]`` that the ring retains after the update, where
``p`` is the query's position, ``window = window_size or max_size`` and a single
token leaves the newest ``min(T + 1, max_size)`` tokens, a block of ``n`` the
newest ``min(T, max_size - 1) + n`` (``T`` tokens before it). That is the spec's
rule, computed from the model only.

Oracles after every step (:meth:`RingMachine.check_oracles`) and inside the steps:

1. reference vs optimized: offsets, ``left_pad`` (exact, negative after a wrap),
   signatures, geometries, trimmability, ``projected_bytes`` (and the spec formula),
   layout masks exactly (both are in the ring's physical column order), fetched
   K/V exactly at every column that holds a row token, row windows and extracted
   windows byte for byte, attention within ``tolerances``; serial rings through
   ``window()``, the semantic mask check and attention (not ``fetch()``: the two
   implementations read serial rings in different orders);
2. solo replay: every row's ``extract_row`` is a serial ring of the family whose
   ``window()`` equals, byte for byte, the window of the serial ring that saw the
   same appends (and the model's newest ``min(offset, max_size)`` tokens); each
   row's attention output equals its serial ring's within ``attention.solo``;
3. mlx-lm parity (plain codec): serial rings against ``RotatingKVCache``
   (fetched keys/values in physical order, masks, offsets, ring index, attention)
   and ``BatchedRotatingCache`` against ``BatchRotatingKVCache`` driven through
   ``merge``, steps, ``filter``, ``extract`` and ``trim`` (per-row offsets,
   ``left_padding``, ring state, masks, fetched K/V, extracted windows, attention),
   with the named skips of :mod:`kvrows.conformance.parity`: ``B9`` (a multi-token
   step on a wrapped ring: mlx-lm's mask hides the oldest valid token of short
   rows; the step's mask must then be a subset of kvrows' and the stored columns
   still agree), ``B11`` (a trim of a wrapped serial ring: kvrows raises, mlx-lm
   is not asked; also a trim of a wrapped batch), ``R1`` (a join: kvrows re-merges every row, mlx-lm ``extend``
   keeps its running geometry; the mirror is **re-synced** by
   ``BatchRotatingKVCache.merge`` of mlx-lm's own ``extract`` of its running rows
   plus the newcomers' twins, so the physical comparison continues after every
   join), ``R2`` (an extraction after a block: mlx-lm's extracted ring keeps the
   whole oversized temporal buffer; its newest ``min(offset, max_size)`` columns
   are compared and kept as the request's twin), ``B3`` and ``N1`` as for the
   plain family.

Invalid operations (trimming a wrapped ring or layout, trimming more than a row
holds, ``trim_rows`` of a wrapped row, merging a ring of another window, another
codec or codec parameters, a full-attention cache, bad blocks, indices, counts and
keep lists) must raise the same ``KvRowsError`` subclass in both implementations
and change nothing (a snapshot through the public surface and ``repr``).

Cost: the invariant checks what the last rule touched and re-checks everything every
``FULL_CHECK_EVERY`` rules (rules that must change nothing prove it with snapshots).
``KNOWN_BUGS`` lists the bugs this suite found in ``reference/`` that are reported and
not yet fixed; each exempts exactly its case, counted as a ``known bug`` check, and
``tests/test_conformance_rings.py`` fails once a fix lands so the exemption goes too.
The family's example budget is ``FAMILIES["rotating"].examples`` (a share of the
profile's ``max_examples``; ``runner.family_settings``). Calibration of the attention
tolerances: ``python -m kvrows.conformance.rings --examples N --seed S``.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
import numpy.typing as npt
from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvrows import table
from kvrows.affine_geometry import SUPPORTED_BITS
from kvrows.conformance import strategies as ks
from kvrows.conformance.arrays import NUMPY_DTYPES, expand_mask, random_block
from kvrows.conformance.families import Family, Impl, optimized_impl, reference_impl
from kvrows.conformance.machines import Limits, projected_or_error
from kvrows.conformance.parity import DIVERGENCES
from kvrows.conformance.stats import Stats
from kvrows.conformance.tolerances import DTYPES, compare, tolerance
from kvrows.errors import KvRowsError, NotTrimmableError

__all__ = [
    "RING_CLASSES",
    "RING_KINDS",
    "RingGeometry",
    "RingKind",
    "RingMachine",
    "expected_visible",
    "main",
    "ring_geometries",
    "ring_machine_class",
    "ring_snapshot",
]

Array = npt.NDArray[Any]
Planes = tuple[Array, ...]

#: Bugs this suite found in ``reference/`` or ``optimized/`` that are reported but not
#: fixed yet; each exempts exactly its case (and counts it as a check) until the fix
#: lands, when its entry is deleted and the case is compared again.
KNOWN_BUGS: dict[str, str] = {}


# ------------------------------------------------------------------ what is driven
@dataclass(frozen=True)
class RingKind:
    """One ring layout: its serial storage, codec, sibling layouts and what it may do."""

    layout: str
    serial: str
    codec: str  # "plain" | "affine"
    role: str
    #: Layouts of the same codec whose rows this layout's ``merge_rows`` takes (side sources).
    siblings: tuple[str, ...]
    shared_column: bool
    trim_rows: bool
    #: mlx-lm mirrors this layout with ``BatchRotatingKVCache``.
    peer: bool
    tolerance_key: str


_PLAIN_LAYOUTS = ("BatchedRotatingCache", "RaggedRotatingRows")
_AFFINE_LAYOUTS = ("BatchedRotatingQuantCache", "RotatingAffineLayout")

RING_KINDS: dict[str, RingKind] = {
    "BatchedRotatingCache": RingKind(
        "BatchedRotatingCache",
        serial="RotatingKVCache",
        codec="plain",
        role="decode",
        siblings=_PLAIN_LAYOUTS,
        shared_column=True,
        trim_rows=False,
        peer=True,
        tolerance_key="rotating",
    ),
    "RaggedRotatingRows": RingKind(
        "RaggedRotatingRows",
        serial="RotatingKVCache",
        codec="plain",
        role="prefill",
        siblings=_PLAIN_LAYOUTS,
        shared_column=False,
        trim_rows=True,
        peer=False,
        tolerance_key="rotating",
    ),
    "BatchedRotatingQuantCache": RingKind(
        "BatchedRotatingQuantCache",
        serial="RotatingQuantizedKVCache",
        codec="affine",
        role="decode",
        siblings=_AFFINE_LAYOUTS,
        shared_column=True,
        trim_rows=False,
        peer=False,
        tolerance_key="rotating-affine",
    ),
    "RotatingAffineLayout": RingKind(
        "RotatingAffineLayout",
        serial="RotatingQuantizedKVCache",
        codec="affine",
        role="prefill",
        siblings=_AFFINE_LAYOUTS,
        shared_column=True,
        trim_rows=False,
        peer=False,
        tolerance_key="rotating-affine",
    ),
}

_AFFINE_NAMES = frozenset(("RotatingQuantizedKVCache", *_AFFINE_LAYOUTS))

RING_CLASSES = (
    "RotatingKVCache",
    "BatchedRotatingCache",
    "RaggedRotatingRows",
    "RotatingQuantizedKVCache",
    "BatchedRotatingQuantCache",
    "RotatingAffineLayout",
)


def _with_rings(impl: Impl, module: Any) -> Impl:
    """``impl`` with every ring class it lacks taken from ``module`` (mutants stay)."""
    missing = {name: getattr(module, name) for name in RING_CLASSES if name not in impl.classes}
    return impl.with_classes(missing) if missing else impl


@dataclass(frozen=True)
class RingGeometry:
    """One example's shapes, window and codec parameters."""

    dtype: str
    heads: int
    query_heads: int
    key_dim: int
    value_dim: int
    max_size: int
    codec: str
    group_size: int = 0
    bits: int = 0

    @property
    def scale(self) -> float:
        return float(1.0 / np.sqrt(self.key_dim))

    def token_bytes(self) -> int:
        """Bytes one token of one row occupies (the spec's formula, not the code's)."""
        itemsize = int(NUMPY_DTYPES[self.dtype].itemsize)
        if self.codec == "plain":
            return self.heads * (self.key_dim + self.value_dim) * itemsize
        total = 0
        for dim in (self.key_dim, self.value_dim):
            total += dim * self.bits // 8 + 2 * itemsize * dim // self.group_size
        return self.heads * total


def windows(role: str = "decode") -> st.SearchStrategy[int]:
    """Ring windows: mostly 4-8 (a ring wraps within a few steps), sometimes 12-32; the
    prefill machines lean to wider windows (prompts and blocks around the window)."""
    if role == "prefill":
        return st.one_of(st.integers(4, 8), st.integers(9, 16), st.just(32))
    return st.one_of(st.integers(4, 8), st.integers(4, 8), st.sampled_from((12, 16, 32)))


@st.composite
def ring_geometries(draw: st.DrawFn, codec: str, role: str = "decode") -> RingGeometry:
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    heads = draw(st.sampled_from((1, 2, 4)), label="heads")
    group = draw(st.sampled_from((1, 2)), label="query heads per KV head")
    max_size = draw(windows(role), label="max_size")
    if codec == "plain":
        key_dim = draw(st.sampled_from((8, 16)), label="key_dim")
        value_dim = draw(st.sampled_from((key_dim, 8, 16)), label="value_dim")
        return RingGeometry(dtype, heads, heads * group, key_dim, value_dim, max_size, codec)
    key_dim = draw(st.sampled_from((32, 64)), label="key_dim")
    value_dim = draw(st.sampled_from((key_dim, 32, 64)), label="value_dim")
    fits = [g for g in (32, 64) if key_dim % g == 0 and value_dim % g == 0]
    group_size = draw(st.sampled_from(fits), label="group_size")
    bits = draw(st.sampled_from(SUPPORTED_BITS), label="bits")
    return RingGeometry(
        dtype, heads, heads * group, key_dim, value_dim, max_size, codec, group_size, bits
    )


@st.composite
def ring_keep_lists(
    draw: st.DrawFn, row_tokens: tuple[int, ...], pads: tuple[int, ...]
) -> tuple[str, list[int]]:
    """``strategies.keep_lists``, plus ``padded-rows``: keep only rows that still have
    left padding, shuffled (where a ring's filter differs from a plain layout's: the
    survivors' shared padding stays)."""
    padded = [b for b, pad in enumerate(pads) if pad > 0]
    only_padded: bool = bool(padded) and draw(st.booleans(), label="padded rows only")
    if only_padded:
        return "padded-rows", draw(st.permutations(padded), label="keep")
    return draw(ks.keep_lists(row_tokens))


def expected_visible(before: int, n: int, window: int, max_size: int) -> list[range]:
    """Positions query ``i`` of an ``n``-token append onto ``before`` tokens must see.

    The ring keeps the newest ``min(before + 1, max_size)`` tokens after one token, the
    newest ``min(before, max_size - 1) + n`` after a block; query ``i`` (position
    ``before + i``) sees the retained tokens at positions ``(before + i - window,
    before + i]``.
    """
    kept = min(before + 1, max_size) if n == 1 else min(before, max_size - 1) + n
    oldest = before + n - kept
    return [range(max(oldest, p - window + 1), p + 1) for p in range(before, before + n)]


def _lm_cache() -> Any:
    """mlx-lm's cache module (untyped: reached through ``Any``)."""
    from mlx_lm.models import cache

    return cache


def _lm_attention(*args: Any, **kwargs: Any) -> Any:
    """mlx-lm's ``scaled_dot_product_attention`` (what its models call)."""
    from mlx_lm.models import base

    return base.scaled_dot_product_attention(*args, **kwargs)


def _update_with(make: Callable[[Impl], tuple[Any, Any]]) -> Callable[[Impl, Any], object]:
    """A call that appends ``make(impl)``'s keys and values to a cache."""
    return lambda impl, cache: cache.update_and_fetch(*make(impl))


# ----------------------------------------------------------------- array helpers
def _planes_of(impl: Impl, fetched: Any) -> Planes:
    """An ``update_and_fetch`` / ``fetch`` answer as NumPy planes (affine: the triple)."""
    if isinstance(fetched, tuple):
        return tuple(impl.to_numpy(p) for p in fetched)
    return (impl.to_numpy(fetched),)


def _window_planes(impl: Impl, held: Any) -> Planes | None:
    """``window()`` / ``row_window()`` (``(key planes, value planes)`` or ``None``) as NumPy."""
    if held is None:
        return None
    return tuple(impl.to_numpy(p) for group in held for p in group)


def _column_ids(planes: Planes, row: int) -> list[bytes]:
    """The bytes of every column of row ``row`` (all heads, all planes): a token's identity."""
    columns = int(planes[0].shape[2])
    return [
        b"".join(np.ascontiguousarray(p[row, :, c]).tobytes() for p in planes)
        for c in range(columns)
    ]


def _take_columns(planes: Planes, row: int, columns: Sequence[int]) -> Planes:
    index = np.array(list(columns), dtype=np.int64)
    return tuple(np.ascontiguousarray(p[row : row + 1, :, index]) for p in planes)


def _expand(mask: Any, batch: int, n: int, keys: int) -> npt.NDArray[np.bool_]:
    """``expand_mask``, also taking mlx-lm's 1-D ``[S]`` decode mask of a serial ring."""
    if isinstance(mask, mx.array | np.ndarray) and mask.ndim == 1:
        mask = mask[None]
    return expand_mask(mask, batch, n, keys)


def _planes_bytes(planes: Planes | None) -> Any:
    if planes is None:
        return None
    return tuple((p.shape, str(p.dtype), p.tobytes()) for p in planes)


def ring_snapshot(cache: Any, impl: Impl) -> tuple[Any, ...]:
    """Everything observable about a ring or ring layout (public surface and ``repr``)."""
    try:
        fetched: Any = _planes_bytes(
            tuple(p for part in cache.fetch() for p in _planes_of(impl, part))
        )
    except (KvRowsError, ValueError) as error:  # ValueError: KNOWN_BUGS ragged-fetch-empty-row
        fetched = type(error).__name__
    base = (
        type(cache).__name__,
        cache.signature(),
        repr(cache.geometry),
        int(cache.nbytes),
        repr(cache),
        cache.is_trimmable(),
        fetched,
    )
    if hasattr(cache, "batch_size"):
        rows = tuple(
            _planes_bytes(_window_planes(impl, cache.row_window(b)))
            for b in range(cache.batch_size)
        )
        return (
            *base,
            cache.batch_size,
            cache.row_offsets,
            cache.left_pad,
            tuple(int(x) for x in impl.to_numpy(cache.offset).tolist()),
            rows,
        )
    return (*base, int(cache.offset), _planes_bytes(_window_planes(impl, cache.window())))


# ------------------------------------------------------------------------ state
@dataclass
class RingTrack:
    """One request: its model (encoded planes of every token held) and its serial rings.

    In the pool, ``ref``/``opt``/``lm`` *are* the request; inside a layout they are the
    row's solo replay rings.
    """

    ident: int
    ref: Any
    opt: Any
    lm: Any
    keys: Planes
    values: Planes
    appended: bool = False
    geometry_known: bool = False
    history: list[tuple[str, Any, Any]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return int(self.keys[0].shape[2])


@dataclass
class RingSlot:
    """One layout in both implementations, its rows' tracks and its mlx-lm mirror."""

    ident: int
    ref: Any
    opt: Any
    rows: list[RingTrack]
    lm: Any = None


def _cat(a: Planes, b: Planes) -> Planes:
    return tuple(np.concatenate([x, y], axis=2) for x, y in zip(a, b, strict=True))


Case = tuple[str, Callable[[Impl, Any], object], str]

#: The invariant checks what the last rule touched, and everything every this many rules.
FULL_CHECK_EVERY = 4


class RingMachine(RuleBasedStateMachine):
    """Shared rules for every ring layout; see the module docstring."""

    family: ClassVar[Family]
    kind: ClassVar[RingKind]
    ref_impl: ClassVar[Impl]
    opt_impl: ClassVar[Impl]
    parity: ClassVar[bool]
    stats: ClassVar[Stats]
    limits: ClassVar[Limits]
    enforce: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.geo: RingGeometry | None = None
        self.pool: list[RingTrack] = []
        self.slots: list[RingSlot] = []
        self._ids = itertools.count()
        self._draws = itertools.count()
        #: Idents of requests and layouts the current rule touched (checked next).
        self._dirty: set[int] = set()
        self._invariants = 0
        self._steps_at_start = self.stats.steps
        self._codec: Any = None

    def teardown(self) -> None:
        if self.stats.steps > self._steps_at_start:
            self.stats.example_done()

    # ------------------------------------------------------------------ helpers
    @property
    def g(self) -> RingGeometry:
        assert self.geo is not None
        return self.geo

    @property
    def lm_serial(self) -> bool:
        """Serial rings have an mlx-lm twin (plain codec, parity on)."""
        return self.parity and self.kind.codec == "plain"

    def _exact(self, what: str, actual: object, expected: object) -> None:
        if actual != expected:
            raise AssertionError(f"{what}: got {actual!r}, expected {expected!r}")

    def _close(self, quantity: str, what: str, actual: Array, expected: Array) -> None:
        tol = tolerance(self.kind.tolerance_key, quantity, self.g.dtype)
        ok, error = compare(actual, expected, tol)
        ratio = 0.0
        if not tol.exact and actual.shape == expected.shape and actual.size:
            wide = expected.astype(np.float64)
            bound = tol.atol + tol.rtol * np.abs(wide)
            ratio = float(np.max(np.abs(actual.astype(np.float64) - wide) / bound))
        self.stats.error(quantity, self.g.dtype, tol, error, ratio)
        if ok or (not self.enforce and quantity.startswith("attention")):
            return
        raise AssertionError(
            f"{what}: {quantity} differs beyond {tol.describe()} "
            f"(max |diff| = {error:g}; shapes {actual.shape} / {expected.shape}, "
            f"dtypes {actual.dtype} / {expected.dtype})"
        )

    def _same_planes(self, quantity: str, what: str, got: Planes | None, want: Planes) -> None:
        """``got`` equals ``want`` plane by plane (``None`` only when ``want`` holds nothing)."""
        if got is None:
            self._exact(
                f"{what}: holds nothing, so the model's window is empty", want[0].shape[2], 0
            )
            return
        self._exact(f"{what}: plane count", len(got), len(want))
        for i, (a, e) in enumerate(zip(got, want, strict=True)):
            self._close(quantity, f"{what} plane {i}", a, e)

    def _pick(self, data: st.DataObject, items: Sequence[Any], label: str) -> Any:
        return items[data.draw(st.integers(0, len(items) - 1), label=label)]

    def _skip(self, code: str, what: str) -> None:
        assert code in DIVERGENCES, code
        note(f"  parity skip {code}: {what}")
        self.stats.skip(code)

    def _new(self, impl: Impl, name: str) -> Any:
        """A new ring or ring layout of ``impl`` with this example's window and codec."""
        g = self.g
        if name in _AFFINE_NAMES:
            return impl.cls(name)(g.max_size, g.group_size, g.bits)
        return impl.cls(name)(g.max_size)

    def _encode(self, block: Array) -> Planes:
        planes: Planes = self._codec.encode(block)
        return planes

    def _model_window(self, track: RingTrack) -> Planes:
        """The model's newest ``min(offset, max_size)`` tokens: keys' planes, then values'."""
        keep = min(track.tokens, self.g.max_size)
        start = track.tokens - keep
        return tuple(np.ascontiguousarray(p[:, :, start:]) for p in (*track.keys, *track.values))

    def _touch(self, *items: RingTrack | RingSlot) -> None:
        self._dirty.update(item.ident for item in items)

    def _rng(self, data: st.DataObject) -> np.random.Generator:
        """A generator for one rule's blocks: the drawn seed plus a per-example draw count,
        so two blocks never repeat (tokens are identified by their bytes)."""
        return np.random.default_rng([data.draw(ks.seeds, label="seed"), next(self._draws)])

    def _block(self, rng: np.random.Generator, rows: int, n: int, dim: int) -> Array:
        return random_block(rng, (rows, self.g.heads, n, dim), self.g.dtype)

    def _queries(self, rng: np.random.Generator, rows: int, n: int) -> Array:
        g = self.g
        return random_block(rng, (rows, g.query_heads, n, g.key_dim), g.dtype)

    def _new_track(self) -> RingTrack:
        g = self.g
        empty_k = self._encode(np.zeros((1, g.heads, 0, g.key_dim), NUMPY_DTYPES[g.dtype]))
        empty_v = self._encode(np.zeros((1, g.heads, 0, g.value_dim), NUMPY_DTYPES[g.dtype]))
        lm = None
        if self.lm_serial:
            lm = _lm_cache().RotatingKVCache(g.max_size)
        return RingTrack(
            ident=next(self._ids),
            ref=self._new(self.ref_impl, self.kind.serial),
            opt=self._new(self.opt_impl, self.kind.serial),
            lm=lm,
            keys=empty_k,
            values=empty_v,
        )

    def _record_append(self, track: RingTrack, keys: Array, values: Array) -> None:
        track.keys = _cat(track.keys, self._encode(keys))
        track.values = _cat(track.values, self._encode(values))
        track.appended = track.geometry_known = True
        track.history.append(("append", keys, values))

    def _record_trim(self, track: RingTrack, count: int) -> None:
        keep = track.tokens - count
        track.keys = tuple(np.ascontiguousarray(p[:, :, :keep]) for p in track.keys)
        track.values = tuple(np.ascontiguousarray(p[:, :, :keep]) for p in track.values)
        track.history.append(("trim", count, None))

    def _replay(self, source: RingTrack) -> RingTrack:
        """A new track whose fresh serial rings saw exactly ``source``'s appends and trims."""
        track = self._new_track()
        to = self.opt_impl.to_native
        for kind, a, b in source.history:
            if kind == "append":
                track.ref.update_and_fetch(a, b)
                track.opt.update_and_fetch(to(a), to(b))
                if track.lm is not None:
                    track.lm.update_and_fetch(to(a), to(b))
                self._record_append(track, a, b)
            else:
                track.ref.trim(a)
                track.opt.trim(a)
                if track.lm is not None:
                    track.lm.trim(a)
                self._record_trim(track, a)
        return track

    # ---------------------------------------------------------- mask semantics
    def _visibility(
        self,
        what: str,
        fetched_keys: Planes,
        mask: npt.NDArray[np.bool_],
        rows: Sequence[tuple[int, Planes, int]],
        n: int,
        window: int,
    ) -> list[list[int]]:
        """Each row's queries see exactly the tokens :func:`expected_visible` names.

        ``rows``: ``(batch index, the row's model key planes after the append, tokens
        before it)``. Keys are identified by their bytes, so the check is independent of
        the column order. Returns, per row, the columns some query sees.
        """
        seen: list[list[int]] = []
        for b, model_keys, before in rows:
            have = _column_ids(fetched_keys, b)
            ids = _column_ids(model_keys, 0)
            position = {token: p for p, token in enumerate(ids)}
            expected = expected_visible(before, n, window, self.g.max_size)
            columns: set[int] = set()
            for i in range(n):
                visible = [c for c in range(len(have)) if mask[b, 0, i, c]]
                columns.update(visible)
                got = sorted(have[c] for c in visible)
                want = sorted(ids[p] for p in expected[i])
                if got != want:
                    shown = [
                        position.get(have[c], f"col {c}: not a token of the row") for c in visible
                    ]
                    raise AssertionError(
                        f"{what}: row {b} query {i} (position {before + i}) sees positions "
                        f"{shown}, expected {list(expected[i])} (window {window}, "
                        f"max_size {self.g.max_size}, n {n})"
                    )
            seen.append(sorted(columns))
        self.stats.check("visibility")
        return seen

    def _masks_equal(self, what: str, masks: Sequence[npt.NDArray[np.bool_]]) -> None:
        for name, other in zip(("optimized", "mlx-lm"), masks[1:], strict=False):
            if other.shape != masks[0].shape or not np.array_equal(other, masks[0]):
                raise AssertionError(
                    f"{what}: the {name} mask differs:\n{other.astype(int)}\n"
                    f"vs\n{masks[0].astype(int)}"
                )
        self.stats.check("masks")

    # ------------------------------------------------------------ serial steps
    def _serial_append(
        self, track: RingTrack, keys: Array, values: Array, queries: Array, form: ks.MaskForm
    ) -> None:
        """Append one block to a free request everywhere; masks, visibility, attention."""
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        n = int(keys.shape[2])
        kw = form.kwargs()
        mask_ref, mask_opt = track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)
        mask_lm = track.lm.make_mask(n, **form.mlx_lm_kwargs()) if track.lm is not None else None
        k_opt, v_opt, q_opt = (opt.to_native(x) for x in (keys, values, queries))
        before = track.tokens
        fk_ref, fv_ref = track.ref.update_and_fetch(keys, values)
        fk_opt, fv_opt = track.opt.update_and_fetch(k_opt, v_opt)
        keys_ref, keys_opt = _planes_of(ref, fk_ref), _planes_of(opt, fk_opt)
        s_ref, s_opt = int(keys_ref[0].shape[2]), int(keys_opt[0].shape[2])
        self._exact(f"request {track.ident}: columns read (reference, optimized)", s_opt, s_ref)
        exp_ref, exp_opt = _expand(mask_ref, 1, n, s_ref), _expand(mask_opt, 1, n, s_opt)
        model_keys = _cat(track.keys, self._encode(keys))
        rows = [(0, model_keys, before)]
        window = form.window_size or g.max_size
        what = f"request {track.ident} append {n} onto {before} ({form})"
        self._visibility(f"{what} (reference)", keys_ref, exp_ref, rows, n, window)
        self._visibility(f"{what} (optimized)", keys_opt, exp_opt, rows, n, window)
        values_ref, values_opt = _planes_of(ref, fv_ref), _planes_of(opt, fv_opt)
        if all(
            a.tobytes() == e.tobytes()
            for a, e in zip(keys_opt + values_opt, keys_ref + values_ref, strict=True)
        ):
            # Same columns in the same order: the masks must be the same booleans.
            self._masks_equal(what, [exp_ref, exp_opt])
        out_ref = ref.to_numpy(ref.attend(queries, track.ref, mask_ref, g.scale))
        out_opt = opt.to_numpy(opt.attend(q_opt, track.opt, mask_opt, g.scale))
        self._close("attention", f"{what} attention", out_opt, out_ref)
        if track.lm is not None:
            lk, lv = track.lm.update_and_fetch(k_opt, v_opt)
            exp_lm = _expand(mask_lm, 1, n, int(lk.shape[2]))
            self._masks_equal(f"{what} mask vs mlx-lm", [exp_opt, exp_lm])
            for name, got, want in (("keys", keys_opt, lk), ("values", values_opt, lv)):
                self._close(
                    "kv.mlx_lm", f"{what} fetched {name} vs mlx-lm", got[0], opt.to_numpy(want)
                )
            out_lm = _lm_attention(q_opt, lk, lv, cache=track.lm, scale=g.scale, mask=mask_lm)
            self._close("attention.mlx_lm", f"{what} attention", out_opt, opt.to_numpy(out_lm))
            self.stats.check("mlx-lm serial")
        self._record_append(track, keys, values)

    def _trim_serial(self, track: RingTrack, n: int) -> None:
        """Serial trim: clamps before the wrap; ``NotTrimmableError`` once wrapped (n > 0)."""
        wrapped = track.tokens >= self.g.max_size
        self._exact(
            f"request {track.ident} is_trimmable (reference, optimized)",
            (track.ref.is_trimmable(), track.opt.is_trimmable()),
            (not wrapped, not wrapped),
        )
        if n and wrapped:

            def snap() -> tuple[Any, Any]:
                return ring_snapshot(track.ref, self.ref_impl), ring_snapshot(
                    track.opt, self.opt_impl
                )

            before = snap()
            for impl, cache in ((self.ref_impl, track.ref), (self.opt_impl, track.opt)):
                try:
                    cache.trim(n)
                except NotTrimmableError:
                    pass
                else:
                    raise AssertionError(f"{impl.name}: trim({n}) of a wrapped ring did not raise")
            self._exact("a refused trim changes nothing", snap(), before)
            if track.lm is not None:
                self._skip("B11", f"trim({n}) of a wrapped ring (mlx-lm would mutate)")
            return
        expected = min(n, track.tokens)
        self._exact("reference trim() return", track.ref.trim(n), expected)
        self._exact("optimized trim() return", track.opt.trim(n), expected)
        if track.lm is not None:
            self._exact("mlx-lm trim() return", track.lm.trim(n), expected)
        self._record_trim(track, expected)

    # ------------------------------------------------------------------- rules
    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        self.geo = data.draw(ring_geometries(self.kind.codec, self.kind.role), label="geometry")
        from kvrows.reference.codecs import AffineCodec, PlainCodec

        g = self.geo
        self._codec = PlainCodec() if g.codec == "plain" else AffineCodec(g.group_size, g.bits)
        note(f"geometry: {g}")

    def _prompt(self, data: st.DataObject) -> int:
        m = self.g.max_size
        return data.draw(
            st.one_of(st.integers(0, m - 1), st.integers(m, 2 * m + 3)), label="prompt length"
        )

    @precondition(lambda self: self.geo is not None and len(self.pool) < self.limits.pool)
    @rule(data=st.data())
    def new_request(self, data: st.DataObject) -> None:
        """A request with a prompt shorter or longer than the window, in random chunks."""
        length = self._prompt(data)
        chunks = data.draw(ks.chunk_sizes(length), label="chunks")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        track = self._new_track()
        note(f"new_request: request {track.ident}, prompt {length} in chunks {chunks}")
        self.stats.op("new_request")
        self._touch(track)
        for n in chunks:
            keys = self._block(rng, 1, n, self.g.key_dim)
            values = self._block(rng, 1, n, self.g.value_dim)
            self._serial_append(track, keys, values, self._queries(rng, 1, n), form)
        self.pool.append(track)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def prefill_chunk(self, data: st.DataObject) -> None:
        """One more chunk (single token or block, up to past the window) into a request."""
        track = self._pick(data, self.pool, "request")
        n = data.draw(st.one_of(st.just(1), st.integers(2, self.g.max_size + 2)), label="chunk")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        note(f"prefill_chunk: request {track.ident} (+{n} onto {track.tokens})")
        self.stats.op("prefill_chunk")
        self._touch(track)
        keys = self._block(rng, 1, n, self.g.key_dim)
        values = self._block(rng, 1, n, self.g.value_dim)
        self._serial_append(track, keys, values, self._queries(rng, 1, n), form)

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def trim_request(self, data: st.DataObject) -> None:
        """Serial trim: clamps before the wrap, raises (changing nothing) after it."""
        track = self._pick(data, self.pool, "request")
        n = data.draw(st.integers(0, track.tokens + 2), label="n")
        note(f"trim_request: request {track.ident} holding {track.tokens}, trim({n})")
        self.stats.op("trim_request")
        self._touch(track)
        self._trim_serial(track, n)

    def _merge_sources(
        self, data: st.DataObject, room: int
    ) -> tuple[list[tuple[str, Any, Any]], list[RingTrack], list[RingTrack]]:
        count = data.draw(st.integers(1, min(room, len(self.pool))), label="rows to merge")
        chosen = data.draw(
            st.permutations(list(range(len(self.pool)))).map(lambda p: p[:count]), label="requests"
        )
        picked = [self.pool[i] for i in chosen]
        sources: list[tuple[str, Any, Any]] = []
        incoming: list[RingTrack] = []
        side_rows = 0
        if data.draw(st.booleans(), label="via a side layout"):
            side_rows = data.draw(st.integers(1, len(picked)), label="side layout rows")
        if side_rows:
            kind = data.draw(st.sampled_from(self.kind.siblings), label="side layout kind")
            side_ref, side_opt = self._new(self.ref_impl, kind), self._new(self.opt_impl, kind)
            group = picked[:side_rows]
            side_ref.merge_rows([t.ref for t in group])
            side_opt.merge_rows([t.opt for t in group])
            sources.append(("layout " + kind, side_ref, side_opt))
            incoming.extend(group)
        for t in picked[side_rows:]:
            sources.append((f"request {t.ident}", t.ref, t.opt))
            incoming.append(t)
        return sources, incoming, picked

    def _new_slot(self, data: st.DataObject) -> RingSlot:
        how = data.draw(st.sampled_from(("constructor", "table", "make_empty_batch")), label="how")
        if how == "make_empty_batch" and self.slots:
            model = self.slots[0]
            ref, opt = model.ref.make_empty_batch(), model.opt.make_empty_batch()
        elif how == "table" and self.pool:
            # The row-layout table: a decode layout is the storage's owned layout, a
            # prefill layout its prefill layout.
            get: Callable[[Any], Any] = (
                table.owned_cache_layout
                if self.kind.role == "decode"
                else table.prefill_cache_layout
            )
            ref, opt = get(self.pool[0].ref), get(self.pool[0].opt)
            for name, made in (
                ("reference", ref),
                ("optimized", opt),
            ):
                self._exact(
                    f"the table's {self.kind.role} layout ({name})",
                    type(made).__name__,
                    self.kind.layout,
                )
                self._exact(f"the table's layout window ({name})", made.max_size, self.g.max_size)
            # The table holds the real classes: a mutant (teeth tests) is constructed instead.
            if type(ref) is not self.ref_impl.cls(self.kind.layout):
                ref = self._new(self.ref_impl, self.kind.layout)
            if type(opt) is not self.opt_impl.cls(self.kind.layout):
                opt = self._new(self.opt_impl, self.kind.layout)
        else:
            ref, opt = (
                self._new(self.ref_impl, self.kind.layout),
                self._new(self.opt_impl, self.kind.layout),
            )
        self._exact("new layout class (reference)", type(ref), self.ref_impl.cls(self.kind.layout))
        self._exact("new layout class (optimized)", type(opt), self.opt_impl.cls(self.kind.layout))
        slot = RingSlot(next(self._ids), ref, opt, [])
        self.slots.append(slot)
        return slot

    @precondition(lambda self: bool(self.pool))
    @rule(data=st.data())
    def merge(self, data: st.DataObject) -> None:
        """Form a batch, or join rows (at any ring phase) into a running one."""
        targets = [s for s in self.slots if len(s.rows) < self.limits.rows]
        new = len(self.slots) < self.limits.layouts and data.draw(st.booleans(), label="new layout")
        if not targets and not new:
            return
        slot = self._new_slot(data) if new or not targets else self._pick(data, targets, "layout")
        room = self.limits.rows - len(slot.rows)
        sources, incoming, consumed = self._merge_sources(data, room)
        kind = "join" if slot.rows else "merge"
        note(
            f"{kind}: layout {slot.ident} ({slot.ref!r}) <- {[s[0] for s in sources]} = requests "
            f"{[t.ident for t in incoming]} with tokens {[t.tokens for t in incoming]}"
        )
        self.stats.op(kind)
        self._touch(slot)
        before = (
            [ring_snapshot(s[1], self.ref_impl) for s in sources],
            [ring_snapshot(s[2], self.opt_impl) for s in sources],
        )
        slot.ref.merge_rows([s[1] for s in sources])
        slot.opt.merge_rows([s[2] for s in sources])
        after = (
            [ring_snapshot(s[1], self.ref_impl) for s in sources],
            [ring_snapshot(s[2], self.opt_impl) for s in sources],
        )
        self._exact("merge sources are borrowed and left unchanged", after, before)
        self._mirror_merge(slot, [t.lm for t in incoming])
        for t in consumed:
            self.pool.remove(t)
        slot.rows.extend(incoming)

    def _mirror_merge(self, slot: RingSlot, twins: Sequence[Any]) -> None:
        """mlx-lm: ``BatchRotatingKVCache.merge``; a join re-syncs the mirror (skip ``R1``)."""
        if not (self.parity and self.kind.peer) or not twins:
            return

        running: list[Any] = []
        if slot.rows:
            self._skip("R1", "join: mlx-lm extend keeps its geometry; re-merge the mirror")
            if slot.lm is None or slot.lm.keys is None:
                running = [_lm_cache().RotatingKVCache(self.g.max_size) for _ in slot.rows]
            else:
                running = [slot.lm.extract(b) for b in range(len(slot.rows))]
        slot.lm = _lm_cache().BatchRotatingKVCache.merge([*running, *twins])
        self.stats.check("mlx-lm merge")

    @precondition(lambda self: len(self.slots) >= 2)
    @rule(data=st.data())
    def merge_layout(self, data: st.DataObject) -> None:
        """Merge one running layout into another (the source is borrowed and unchanged)."""
        target = self._pick(data, self.slots, "target layout")
        others = [s for s in self.slots if s is not target and s.rows]
        if not others:
            return
        source = self._pick(data, others, "source layout")
        if len(target.rows) + len(source.rows) > self.limits.rows:
            return
        note(f"merge_layout: layout {source.ident} into layout {target.ident}")
        self.stats.op("merge_layout")
        self._touch(target)
        before = ring_snapshot(source.ref, self.ref_impl), ring_snapshot(source.opt, self.opt_impl)
        target.ref.merge_rows([source.ref])
        target.opt.merge_rows([source.opt])
        after = ring_snapshot(source.ref, self.ref_impl), ring_snapshot(source.opt, self.opt_impl)
        self._exact("a merged layout is borrowed and left unchanged", after, before)
        copies = [self._replay(t) for t in source.rows]
        self._mirror_merge(target, [t.lm for t in copies])
        target.rows.extend(copies)

    def _step(self, slot: RingSlot, n: int, rng: np.random.Generator, form: ks.MaskForm) -> None:
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        rows = len(slot.rows)
        keys = self._block(rng, rows, n, g.key_dim)
        values = self._block(rng, rows, n, g.value_dim)
        queries = self._queries(rng, rows, n)
        k_opt, v_opt, q_opt = (opt.to_native(x) for x in (keys, values, queries))
        positions = [t.tokens for t in slot.rows]
        self._exact(
            "positions (reference offset)", ref.to_numpy(slot.ref.offset).tolist(), positions
        )
        self._exact(
            "positions (optimized offset)", opt.to_numpy(slot.opt.offset).tolist(), positions
        )
        kw = form.kwargs()
        mask_ref, mask_opt = slot.ref.make_mask(n, **kw), slot.opt.make_mask(n, **kw)
        lm = slot.lm if (self.parity and self.kind.peer) else None
        rotated = bool(slot.opt.ring_state[2]) if self.kind.shared_column else False
        mask_lm = lm.make_mask(n, **form.mlx_lm_kwargs()) if lm is not None else None
        fk_ref, fv_ref = slot.ref.update_and_fetch(keys, values)
        fk_opt, fv_opt = slot.opt.update_and_fetch(k_opt, v_opt)
        keys_ref, keys_opt = _planes_of(ref, fk_ref), _planes_of(opt, fk_opt)
        values_ref, values_opt = _planes_of(ref, fv_ref), _planes_of(opt, fv_opt)
        s = int(keys_ref[0].shape[2])
        self._exact(
            "fetched key shapes (optimized vs reference)",
            [p.shape for p in keys_opt],
            [p.shape for p in keys_ref],
        )
        self._exact(
            "fetched value shapes", [p.shape for p in values_opt], [p.shape for p in values_ref]
        )
        exp_ref, exp_opt = _expand(mask_ref, rows, n, s), _expand(mask_opt, rows, n, s)
        what = f"layout {slot.ident} step of {n} ({form})"
        self._masks_equal(what, [exp_ref, exp_opt])
        window = form.window_size or g.max_size
        model = [
            (b, _cat(t.keys, self._encode(keys[b : b + 1])), t.tokens)
            for b, t in enumerate(slot.rows)
        ]
        seen = self._visibility(f"{what} (reference)", keys_ref, exp_ref, model, n, window)
        self._visibility(f"{what} (optimized)", keys_opt, exp_opt, model, n, window)
        for b, columns in enumerate(seen):
            for name, got, want in (
                ("keys", keys_opt, keys_ref),
                ("values", values_opt, values_ref),
            ):
                for i, (a, e) in enumerate(
                    zip(
                        _take_columns(got, b, columns), _take_columns(want, b, columns), strict=True
                    )
                ):
                    self._close("kv.fetched", f"{what} fetched {name} row {b} plane {i}", a, e)
        out_ref = ref.to_numpy(ref.attend(queries, slot.ref, mask_ref, g.scale))
        out_opt = opt.to_numpy(opt.attend(q_opt, slot.opt, mask_opt, g.scale))
        self._close("attention", f"{what} attention", out_opt, out_ref)
        if lm is not None:
            self._step_parity(
                slot,
                lm,
                what,
                n,
                rotated,
                mask_lm,
                exp_opt,
                (k_opt, v_opt, q_opt),
                (keys_opt, values_opt),
                out_opt,
                model,
                window,
            )
        # Solo replay: each row's serial rings take the same block; same attention output.
        for b, track in enumerate(slot.rows):
            kb, vb, qb = keys[b : b + 1], values[b : b + 1], queries[b : b + 1]
            kb_opt, vb_opt, qb_opt = (opt.to_native(x) for x in (kb, vb, qb))
            solo_masks = track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)
            track.ref.update_and_fetch(kb, vb)
            track.opt.update_and_fetch(kb_opt, vb_opt)
            solo_ref = ref.to_numpy(ref.attend(qb, track.ref, solo_masks[0], g.scale))
            solo_opt = opt.to_numpy(opt.attend(qb_opt, track.opt, solo_masks[1], g.scale))
            self._close(
                "attention.solo",
                f"reference row {b} vs its serial ring",
                out_ref[b : b + 1],
                solo_ref,
            )
            self._close(
                "attention.solo",
                f"optimized row {b} vs its serial ring",
                out_opt[b : b + 1],
                solo_opt,
            )
            if track.lm is not None:
                track.lm.update_and_fetch(kb_opt, vb_opt)
            self._record_append(track, kb, vb)
        self.stats.check("solo attention", rows)

    def _step_parity(
        self,
        slot: RingSlot,
        lm: Any,
        what: str,
        n: int,
        rotated: bool,
        mask_lm: Any,
        exp_opt: npt.NDArray[np.bool_],
        inputs: tuple[Any, Any, Any],
        fetched: tuple[Planes, Planes],
        out_opt: Array,
        model: list[tuple[int, Planes, int]],
        window: int,
    ) -> None:
        """mlx-lm's ``BatchRotatingKVCache`` on the same step (B9 excluded exactly)."""

        opt = self.opt_impl
        k_opt, v_opt, q_opt = inputs
        positions = np.array(lm.offset).tolist()
        lk, lv = lm.update_and_fetch(k_opt, v_opt)
        self._exact(
            "mlx-lm offsets captured before the step are unchanged",
            np.array(positions).tolist(),
            [t.tokens for t in slot.rows],
        )
        s = int(lk.shape[2])
        exp_lm = _expand(mask_lm, len(slot.rows), n, s)
        for name, got, want in (("keys", fetched[0], lk), ("values", fetched[1], lv)):
            self._close("kv.mlx_lm", f"{what} fetched {name} vs mlx-lm", got[0], opt.to_numpy(want))
        same = exp_lm.shape == exp_opt.shape and np.array_equal(exp_lm, exp_opt)
        if not same and n > 1 and rotated:
            # B9: mlx-lm trims its mask from the pre-reordering index: it may only hide.
            self._exact(
                f"{what}: B9 only hides keys kvrows shows", bool(np.all(exp_opt | ~exp_lm)), True
            )
            self._skip("B9", f"{what}: mlx-lm hides the oldest valid token of a short row")
            return
        self._masks_equal(f"{what} vs mlx-lm", [exp_opt, exp_lm])
        self._visibility(f"{what} (mlx-lm)", _planes_of(opt, lk), exp_lm, model, n, window)
        out_lm = _lm_attention(q_opt, lk, lv, cache=lm, scale=self.g.scale, mask=mask_lm)
        self._close("attention.mlx_lm", f"{what} attention", out_opt, opt.to_numpy(out_lm))
        self.stats.check("mlx-lm step")

    def _steppable(self) -> list[RingSlot]:
        return [s for s in self.slots if s.rows]

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def decode_step(self, data: st.DataObject) -> None:
        """One token for every row."""
        slot = self._pick(data, self._steppable(), "layout")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        note(f"decode_step: layout {slot.ident} {slot.opt!r}, mask {form}")
        self.stats.op("decode_step")
        self._touch(slot)
        self._step(slot, 1, rng, form)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def multi_step(self, data: st.DataObject) -> None:
        """A block of N > 1 tokens for every row (chunked prefill, a verify block)."""
        slot = self._pick(data, self._steppable(), "layout")
        n = data.draw(st.one_of(st.integers(2, 4), st.integers(2, self.g.max_size + 2)), label="N")
        form = data.draw(ks.mask_forms(), label="mask form")
        rng = self._rng(data)
        note(f"multi_step: layout {slot.ident} {slot.opt!r}, N={n}, mask {form}")
        self.stats.op("multi_step")
        self._touch(slot)
        self._step(slot, n, rng, form)

    @precondition(lambda self: bool(self.slots))
    @rule(data=st.data())
    def filter_layout(self, data: st.DataObject) -> None:
        """Keep any subset in any order (rings keep their padding)."""
        slot = self._pick(data, self.slots, "layout")
        kind, keep = data.draw(
            ring_keep_lists(tuple(t.tokens for t in slot.rows), slot.ref.left_pad), label="keep"
        )
        via_table = data.draw(st.booleans(), label="via table.filter_layout_rows")
        note(f"filter ({kind}): layout {slot.ident} {slot.opt!r} keep {keep}")
        self.stats.op(f"filter:{kind}")
        self._touch(slot, *slot.rows)
        pads = slot.ref.left_pad
        if via_table:
            table.filter_layout_rows(slot.ref, keep)
            table.filter_layout_rows(slot.opt, keep)
        else:
            slot.ref.filter_rows(keep)
            slot.opt.filter_rows(keep)
        self._exact(
            "a ring filter keeps every survivor's padding",
            slot.ref.left_pad,
            tuple(pads[i] for i in keep),
        )
        if self.parity and self.kind.peer and slot.lm is not None:
            if not keep:
                self._skip("N1", "filter([]) on mlx-lm; the mirror restarts at the next merge")
                slot.lm = None
            else:
                slot.lm.filter(keep)
                self.stats.check("mlx-lm filter")
        kept = [slot.rows[i] for i in keep]
        dropped = [t for t in slot.rows if all(t is not k for k in kept)]
        slot.rows = kept
        for track in dropped:
            if len(self.pool) < self.limits.pool:
                self.pool.append(track)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def extract(self, data: st.DataObject) -> None:
        """Extract a row (an independent serial ring), maybe kept as a new request."""
        slot = self._pick(data, self._steppable(), "layout")
        b = data.draw(st.integers(0, len(slot.rows) - 1), label="row")
        sole = len(slot.rows) == 1 and data.draw(st.booleans(), label="via extract_sole_row")
        track = slot.rows[b]
        note(f"extract: layout {slot.ident} row {b} (request {track.ident}, {track.tokens} tokens)")
        self.stats.op("extract")
        self._touch(slot)
        got_ref: Any
        got_opt: Any
        if sole:
            got_ref, got_opt = table.extract_sole_row(slot.ref), table.extract_sole_row(slot.opt)
        else:
            got_ref, got_opt = slot.ref.extract_row(b), slot.opt.extract_row(b)
        self._check_serial_like(f"extract_row({b})", got_ref, got_opt, track)
        twin = None
        if self.parity and self.kind.peer:
            if slot.lm is None or slot.lm.keys is None:
                self._skip("B3", "extract from an mlx-lm batch with no keys")
            else:
                twin = self._lm_extract(slot.lm, b, track)
        if len(self.pool) < self.limits.pool and data.draw(st.booleans(), label="keep as request"):
            copy = RingTrack(
                ident=next(self._ids),
                ref=got_ref,
                opt=got_opt,
                lm=twin,
                keys=track.keys,
                values=track.values,
                appended=track.tokens > 0,
                geometry_known=got_ref.geometry is not None,
                history=list(track.history) if track.tokens else [],
            )
            if copy.lm is None and self.lm_serial:
                # No mlx-lm extraction to adopt: a replayed twin, re-laid as kvrows' extracted
                # ring is (its newest window in temporal order, the index at the end).
                copy.lm = self._compact_twin(self._replay(track).lm, track.tokens)
            note(f"  extracted row becomes request {copy.ident}")
            self._touch(copy)
            self.pool.append(copy)

    def _compact_twin(self, ring: Any, offset: int) -> Any:
        """An mlx-lm ``RotatingKVCache`` holding ``ring``'s newest ``min(offset, max_size)``
        tokens in temporal order, its index at the end (kvrows' extracted layout)."""

        keep = min(offset, self.g.max_size)
        twin = _lm_cache().RotatingKVCache(self.g.max_size)
        if keep == 0 or ring.keys is None:
            return twin
        if ring._idx < ring.offset and ring._idx < ring.keys.shape[2]:
            keys = mx.concatenate(
                [ring.keys[..., ring._idx :, :], ring.keys[..., : ring._idx, :]], axis=2
            )
            values = mx.concatenate(
                [ring.values[..., ring._idx :, :], ring.values[..., : ring._idx, :]], axis=2
            )
        else:
            keys, values = ring.keys[..., : ring._idx, :], ring.values[..., : ring._idx, :]
        twin.keys = mx.contiguous(keys[..., keys.shape[2] - keep :, :])
        twin.values = mx.contiguous(values[..., values.shape[2] - keep :, :])
        twin.offset, twin._idx = offset, keep
        return twin

    def _lm_extract(self, lm: Any, b: int, track: RingTrack) -> Any:
        """mlx-lm's ``extract(b)``: offset and newest window vs the model; the compact twin."""
        ring = lm.extract(b)
        self._exact("mlx-lm extract offset", int(ring.offset), track.tokens)
        keep = min(track.tokens, self.g.max_size)
        held = int(ring.keys.shape[2])
        self._exact(f"mlx-lm extract holds at least the window ({keep})", held >= keep, True)
        if held > keep:
            self._skip("R2", f"mlx-lm's extracted ring keeps {held} columns, kvrows' {keep}")
        window = (
            self.opt_impl.to_numpy(ring.keys[..., held - keep :, :]),
            self.opt_impl.to_numpy(ring.values[..., held - keep :, :]),
        )
        self._same_planes(
            "kv.mlx_lm", "mlx-lm extract (newest window)", window, self._model_window(track)
        )
        self.stats.check("mlx-lm extract")

        twin = _lm_cache().RotatingKVCache(self.g.max_size)
        if keep:
            twin.keys = mx.contiguous(ring.keys[..., held - keep :, :])
            twin.values = mx.contiguous(ring.values[..., held - keep :, :])
        twin.offset, twin._idx = track.tokens, keep
        return twin

    def _check_serial_like(self, what: str, got_ref: Any, got_opt: Any, track: RingTrack) -> None:
        """An extracted/published row: a serial ring holding the row's newest window."""
        ref, opt = self.ref_impl, self.opt_impl
        self._exact(f"{what}: reference type", type(got_ref), ref.cls(self.kind.serial))
        self._exact(f"{what}: optimized type", type(got_opt), opt.cls(self.kind.serial))
        self._exact(
            f"{what}: offsets", (got_ref.offset, got_opt.offset), (track.tokens, track.tokens)
        )
        self._exact(
            f"{what}: max_size", (got_ref.max_size, got_opt.max_size), (self.g.max_size,) * 2
        )
        self._exact(f"{what}: signatures", got_opt.signature(), got_ref.signature())
        self._exact(
            f"{what}: signature is the serial ring's", got_ref.signature(), track.ref.signature()
        )
        self._exact(f"{what}: geometry", got_opt.geometry, got_ref.geometry)
        self._exact(
            f"{what}: is_trimmable",
            (got_ref.is_trimmable(), got_opt.is_trimmable()),
            (track.tokens < self.g.max_size,) * 2,
        )
        model = self._model_window(track)
        for name, impl, got, solo in (
            ("reference", ref, got_ref, track.ref),
            ("optimized", opt, got_opt, track.opt),
        ):
            window = _window_planes(impl, got.window())
            self._same_planes("kv.solo", f"{what} ({name}) window vs the model", window, model)
            solo_window = _window_planes(impl, solo.window())
            self._same_planes(
                "kv.solo", f"{what} ({name}) solo ring window vs the model", solo_window, model
            )
        self.stats.check("solo replay")

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        """``table.publish_row``: the row as a serial ring, or ``None`` when it cannot cover."""
        slot = self._pick(data, self._steppable(), "layout")
        b = data.draw(st.integers(0, len(slot.rows) - 1), label="row")
        track = slot.rows[b]
        tokens = data.draw(st.integers(0, track.tokens + 2), label="tokens")
        note(f"publish: layout {slot.ident} row {b} ({track.tokens} tokens) covering {tokens}")
        self.stats.op("publish")
        self._touch(slot)
        # The spec's rule: the whole row, or a shorter prefix while the ring could be trimmed.
        expected = tokens == track.tokens or tokens < track.tokens < self.g.max_size
        self._exact("can_publish_row (reference)", slot.ref.can_publish_row(b, tokens), expected)
        self._exact("can_publish_row (optimized)", slot.opt.can_publish_row(b, tokens), expected)
        got_ref = table.publish_row(slot.ref, b, tokens)
        got_opt = table.publish_row(slot.opt, b, tokens)
        self._exact(
            "publish_row returns None (reference, optimized)",
            (got_ref is None, got_opt is None),
            (not expected,) * 2,
        )
        if got_ref is not None:
            self._check_serial_like(f"publish_row({b}, {tokens})", got_ref, got_opt, track)

    @precondition(lambda self: any(s.rows for s in self.slots))
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        """Trim every row by ``n`` (only before the ring wraps, at most the shortest row)."""
        slot = self._pick(data, self._steppable(), "layout")
        trimmable = slot.ref.is_trimmable()
        self._exact("is_trimmable (optimized vs reference)", slot.opt.is_trimmable(), trimmable)
        if self.kind.trim_rows:
            self._exact(
                "ragged is_trimmable: no row has wrapped",
                trimmable,
                all(t.tokens < self.g.max_size for t in slot.rows),
            )
        if not trimmable:
            return
        shortest = min(t.tokens for t in slot.rows)
        n = data.draw(ks.counts_up_to(shortest), label="n")
        note(f"trim: layout {slot.ident} {slot.opt!r} trim({n})")
        self.stats.op("trim")
        self._touch(slot)
        self._exact("trim() return (reference)", slot.ref.trim(n), n)
        self._exact("trim() return (optimized)", slot.opt.trim(n), n)
        if self.parity and self.kind.peer and slot.lm is not None:
            self._exact("trim() return (mlx-lm)", slot.lm.trim(n), n)
            self.stats.check("mlx-lm trim")
        for track in slot.rows:
            self._solo_trim(track, n)

    def _solo_trim(self, track: RingTrack, n: int) -> None:
        self._exact("solo trim (reference)", track.ref.trim(n), n)
        self._exact("solo trim (optimized)", track.opt.trim(n), n)
        if track.lm is not None:
            track.lm.trim(n)
        self._record_trim(track, n)

    @precondition(lambda self: self.kind.trim_rows and any(s.rows for s in self.slots))
    @rule(data=st.data())
    def trim_rows(self, data: st.DataObject) -> None:
        """Per-row rollback (ragged rings): rows that have not wrapped forget ``counts[b]``."""
        slot = self._pick(data, self._steppable(), "layout")
        counts = [
            0
            if t.tokens >= self.g.max_size
            else data.draw(ks.counts_up_to(t.tokens), label=f"count {b}")
            for b, t in enumerate(slot.rows)
        ]
        note(f"trim_rows: layout {slot.ident} {slot.opt!r} counts {counts}")
        self.stats.op("trim_rows")
        self._touch(slot)
        expected = max(counts, default=0)
        self._exact("trim_rows() return (reference)", slot.ref.trim_rows(counts), expected)
        self._exact("trim_rows() return (optimized)", slot.opt.trim_rows(counts), expected)
        for track, count in zip(slot.rows, counts, strict=True):
            self._solo_trim(track, count)

    # ------------------------------------------------------------ invalid input
    def _bad_blocks(
        self, rows: int, known: bool
    ) -> list[tuple[str, Callable[[Impl], tuple[Any, Any]]]]:
        g = self.g
        rng = np.random.default_rng(0)
        other = next(d for d in NUMPY_DTYPES if d != g.dtype)

        def block(
            shape_k: tuple[int, ...], shape_v: tuple[int, ...], dk: str, dv: str
        ) -> Callable[[Impl], tuple[Any, Any]]:
            k = (
                random_block(rng, shape_k, dk)
                if dk in NUMPY_DTYPES
                else np.zeros(shape_k, dtype=dk)
            )
            v = (
                random_block(rng, shape_v, dv)
                if dv in NUMPY_DTYPES
                else np.zeros(shape_v, dtype=dv)
            )
            return lambda impl: (impl.to_native(k), impl.to_native(v))

        b = max(rows, 1)
        step = g.group_size or 8  # another head dim the codec can store
        good_k, good_v = (b, g.heads, 1, g.key_dim), (b, g.heads, 1, g.value_dim)
        cases = [
            ("keys of rank 3", block(good_k[1:], good_v[1:], g.dtype, g.dtype)),
            (
                "N = 0",
                block((b, g.heads, 0, g.key_dim), (b, g.heads, 0, g.value_dim), g.dtype, g.dtype),
            ),
            ("int32 keys and values", block(good_k, good_v, "int32", "int32")),
            ("keys and values of different dtypes", block(good_k, good_v, g.dtype, other)),
            (
                "keys and values with different N",
                block(good_k, (b, g.heads, 2, g.value_dim), g.dtype, g.dtype),
            ),
        ]
        if rows:
            cases.append(
                (
                    "one row too many",
                    block((b + 1, *good_k[1:]), (b + 1, *good_v[1:]), g.dtype, g.dtype),
                )
            )
        if known:
            cases += [
                ("a different dtype", block(good_k, good_v, other, other)),
                (
                    "one KV head more",
                    block(
                        (b, g.heads + 1, 1, g.key_dim),
                        (b, g.heads + 1, 1, g.value_dim),
                        g.dtype,
                        g.dtype,
                    ),
                ),
                (
                    "a different key dim",
                    block((b, g.heads, 1, g.key_dim + step), good_v, g.dtype, g.dtype),
                ),
                (
                    "a different value dim",
                    block(good_k, (b, g.heads, 1, g.value_dim + step), g.dtype, g.dtype),
                ),
            ]
        if g.codec == "affine":
            # A head dim the group does not divide: refused even before the geometry is known.
            cases.append(
                (
                    "a key dim the group does not divide",
                    block((b, g.heads, 1, g.key_dim + 8), good_v, g.dtype, g.dtype),
                )
            )
        k_np, v_np = random_block(rng, good_k, g.dtype), random_block(rng, good_v, g.dtype)
        cases.append(
            (
                "the other implementation's arrays",
                lambda impl: (
                    (k_np, v_np)
                    if impl.name != "reference"
                    else (mx.array(k_np.astype(np.float32)), mx.array(v_np.astype(np.float32)))
                ),
            )
        )
        return cases

    def _foreign(self, impl: Impl, what: str) -> Any:
        """A serial cache of ``impl`` that a layout of this machine must refuse to merge."""
        g = self.g
        heads, key_dim, dtype, size = g.heads, g.key_dim, g.dtype, g.max_size
        name = self.kind.serial
        args: tuple[int, ...] = (size,) if g.codec == "plain" else (size, g.group_size, g.bits)
        if what == "dtype":
            dtype = next(d for d in NUMPY_DTYPES if d != g.dtype)
        elif what == "heads":
            heads = g.heads + 1
        elif what == "key_dim":
            key_dim = g.key_dim + (g.group_size or 8)
        elif what == "window":
            args = (size + 1, *args[1:])
        elif what == "full attention":
            name = "KVCache"
            args = ()
        elif what == "other codec":
            if g.codec == "plain":
                name, args = "RotatingQuantizedKVCache", (size, 32, 8)
                key_dim = 32
            else:
                name, args = "RotatingKVCache", (size,)
        elif what == "other bits":
            args = (size, g.group_size, 8 if g.bits != 8 else 4)
        elif what == "other group":
            args = (size, 64 if g.group_size == 32 else 32, g.bits)
            key_dim = 64
        cache = impl.cls(name)(*args)
        rng = np.random.default_rng(1)
        value_dim = g.value_dim if what not in ("other codec", "other group") else key_dim
        k = random_block(rng, (1, heads, 2, key_dim), dtype)
        v = random_block(rng, (1, heads, 2, value_dim), dtype)
        cache.update_and_fetch(impl.to_native(k), impl.to_native(v))
        return cache

    def _layout_cases(self, slot: RingSlot) -> list[Case]:
        rows = len(slot.rows)
        known = slot.ref.geometry is not None
        g = self.g
        cases: list[Case] = []
        if rows == 0:
            k = random_block(np.random.default_rng(2), (1, g.heads, 1, g.key_dim), g.dtype)
            v = random_block(np.random.default_rng(3), (1, g.heads, 1, g.value_dim), g.dtype)
            cases.append(
                (
                    "update of an empty layout",
                    lambda impl, lay: lay.update_and_fetch(impl.to_native(k), impl.to_native(v)),
                    "V0",
                )
            )
        else:
            for label, make in self._bad_blocks(rows, known):
                cases.append(
                    (
                        f"update with {label}",
                        _update_with(make),
                        "V0",
                    )
                )
            shortest = min(t.tokens for t in slot.rows)
            if slot.ref.is_trimmable():
                cases.append(
                    (
                        f"trim({shortest + 1}) past the shortest row",
                        lambda impl, lay: lay.trim(shortest + 1),
                        "B4",
                    )
                )
            else:
                cases.append(("trim(1) of a wrapped ring", lambda impl, lay: lay.trim(1), "B11"))
            if self.kind.trim_rows:
                counts = [t.tokens for t in slot.rows]
                counts[-1] += 1
                cases += [
                    (
                        f"trim_rows({counts}) past a row",
                        lambda impl, lay: lay.trim_rows(counts),
                        "V0",
                    ),
                    (
                        "trim_rows with one count too many",
                        lambda impl, lay: lay.trim_rows([0] * (rows + 1)),
                        "V0",
                    ),
                    (
                        "trim_rows with a negative count",
                        lambda impl, lay: lay.trim_rows([-1] * rows),
                        "V0",
                    ),
                    ("trim_rows of a non-sequence", lambda impl, lay: lay.trim_rows(0), "V0"),
                ]
                wrapped = [b for b, t in enumerate(slot.rows) if t.tokens >= g.max_size]
                if wrapped:
                    one = [1 if b == wrapped[0] else 0 for b in range(rows)]
                    cases.append(
                        (
                            f"trim_rows({one}) of a wrapped row",
                            lambda impl, lay: lay.trim_rows(one),
                            "V0",
                        )
                    )
            cases.append(
                ("filter naming a row twice", lambda impl, lay: lay.filter_rows([0, 0]), "V0")
            )
        cases += [
            ("trim(-1)", lambda impl, lay: lay.trim(-1), "V0"),
            ("make_mask(0)", lambda impl, lay: lay.make_mask(0), "V0"),
            ("make_mask(True)", lambda impl, lay: lay.make_mask(True), "V0"),
            (
                "make_mask(1, window_size=0)",
                lambda impl, lay: lay.make_mask(1, window_size=0),
                "V0",
            ),
            ("projected_bytes(-1)", lambda impl, lay: lay.projected_bytes(-1), "V0"),
            (f"extract_row({rows}) out of range", lambda impl, lay: lay.extract_row(rows), "V0"),
            ("extract_row(-1)", lambda impl, lay: lay.extract_row(-1), "V0"),
            ("extract_row(1.0)", lambda impl, lay: lay.extract_row(1.0), "V0"),
            (f"can_publish_row({rows}, 0)", lambda impl, lay: lay.can_publish_row(rows, 0), "V0"),
            (f"filter naming row {rows}", lambda impl, lay: lay.filter_rows([rows]), "V0"),
            ("filter with a non-sequence", lambda impl, lay: lay.filter_rows(0), "V0"),
            ("filter with a string", lambda impl, lay: lay.filter_rows("0"), "V0"),
            (
                "merge_rows of a bare ring (not a sequence)",
                lambda impl, lay: lay.merge_rows(self._new(impl, self.kind.serial)),
                "V0",
            ),
            ("merge_rows of a foreign object", lambda impl, lay: lay.merge_rows([object()]), "V0"),
            (
                "merge_rows of the other implementation's ring",
                lambda impl, lay: lay.merge_rows(
                    [
                        self._new(
                            self.opt_impl if impl.name == "reference" else self.ref_impl,
                            self.kind.serial,
                        )
                    ]
                ),
                "V0",
            ),
            (
                "merge_rows of a ring of another window",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "window")]),
                "V0",
            ),
            (
                "merge_rows of a full-attention cache",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "full attention")]),
                "V0",
            ),
            (
                "merge_rows of a ring of the other codec",
                lambda impl, lay: lay.merge_rows([self._foreign(impl, "other codec")]),
                "V0",
            ),
            (
                "merge_rows of a good ring and one of another window",
                lambda impl, lay: lay.merge_rows(
                    [self._new(impl, self.kind.serial), self._foreign(impl, "window")]
                ),
                "V0",
            ),
            (
                "merge_rows of two rings of different dtypes",
                lambda impl, lay: lay.merge_rows(
                    [self._foreign(impl, "dtype"), self._foreign(impl, "heads")]
                ),
                "B5",
            ),
            (
                "merge_rows of an empty layout of another window",
                lambda impl, lay: lay.merge_rows(
                    [
                        impl.cls(self.kind.layout)(
                            *(
                                (g.max_size + 1,)
                                if g.codec == "plain"
                                else (g.max_size + 1, g.group_size, g.bits)
                            )
                        )
                    ]
                ),
                "V0",
            ),
        ]
        if g.codec == "affine":
            cases += [
                (
                    "merge_rows of a ring with other bits",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "other bits")]),
                    "V0",
                ),
                (
                    "merge_rows of a ring with another group size",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "other group")]),
                    "V0",
                ),
            ]
        if self.lm_serial:
            cases.append(
                (
                    "merge_rows of an mlx-lm RotatingKVCache",
                    lambda impl, lay: lay.merge_rows([_lm_cache().RotatingKVCache(g.max_size)]),
                    "V0",
                )
            )
        if known:
            cases += [
                (
                    "merge_rows of a ring of another dtype",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "dtype")]),
                    "B5",
                ),
                (
                    "merge_rows of a ring with another head count",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "heads")]),
                    "N2",
                ),
                (
                    "merge_rows of a ring with another key dim",
                    lambda impl, lay: lay.merge_rows([self._foreign(impl, "key_dim")]),
                    "V0",
                ),
            ]
        return cases

    def _serial_cases(self, track: RingTrack) -> list[Case]:
        cases: list[Case] = [
            (
                f"serial update with {label}",
                _update_with(make),
                "V0",
            )
            for label, make in self._bad_blocks(1 if track.appended else 0, track.geometry_known)
        ]
        cases += [
            ("serial trim(-1)", lambda impl, c: c.trim(-1), "V0"),
            ("serial trim(1.5)", lambda impl, c: c.trim(1.5), "V0"),
            ("serial make_mask(0)", lambda impl, c: c.make_mask(0), "V0"),
            (
                "serial make_mask(1, window_size=0)",
                lambda impl, c: c.make_mask(1, window_size=0),
                "V0",
            ),
            (
                "table.filter_layout_rows of a serial ring",
                lambda impl, c: table.filter_layout_rows(c, [0]),
                "V0",
            ),
        ]
        if track.tokens >= self.g.max_size:
            cases.append(("serial trim(1) of a wrapped ring", lambda impl, c: c.trim(1), "B11"))
        if not track.appended:
            cases.append(
                ("fetch of a ring that never held a token", lambda impl, c: c.fetch(), "V0")
            )
        return cases

    def _everything(self) -> tuple[list[Any], list[Any]]:
        ref_snaps, opt_snaps = [], []
        caches: list[tuple[Any, Any]] = [(t.ref, t.opt) for t in self.pool]
        for s in self.slots:
            caches.append((s.ref, s.opt))
            caches.extend((t.ref, t.opt) for t in s.rows)
        for r, o in caches:
            ref_snaps.append(ring_snapshot(r, self.ref_impl))
            opt_snaps.append(ring_snapshot(o, self.opt_impl))
        return ref_snaps, opt_snaps

    @precondition(lambda self: bool(self.pool) or bool(self.slots))
    @rule(data=st.data())
    def invalid(self, data: st.DataObject) -> None:
        """A bad call: both raise the same KvRowsError subclass; nothing changes anywhere."""
        targets: list[tuple[str, Any, Any, list[Case], RingSlot | None, RingTrack | None]] = []
        for t in self.pool:
            targets.append((f"request {t.ident}", t.ref, t.opt, self._serial_cases(t), None, t))
        for s in self.slots:
            targets.append((f"layout {s.ident}", s.ref, s.opt, self._layout_cases(s), s, None))
        name, ref_obj, opt_obj, cases, slot, track = self._pick(data, targets, "target")
        label, call, code = self._pick(data, cases, "invalid operation")
        note(f"invalid: {name}: {label}")
        self.stats.op("invalid")
        before = self._everything()
        errors: list[type[BaseException]] = []
        for impl, obj in ((self.ref_impl, ref_obj), (self.opt_impl, opt_obj)):
            try:
                call(impl, obj)
            except KvRowsError as error:
                errors.append(type(error))
            except Exception as error:
                raise AssertionError(
                    f"{impl.name}: {label} raised {type(error).__name__} ({error}), not a KvRowsError"
                ) from error
            else:
                raise AssertionError(f"{impl.name}: {label} did not raise")
        self._exact(f"{label}: error types (reference, optimized)", errors[1], errors[0])
        self._exact(
            f"{label}: every cache unchanged after the failed call", self._everything(), before
        )
        self.stats.check("error types")
        if (slot is not None and self.parity and self.kind.peer and slot.lm is not None) or (
            track is not None and track.lm is not None and code == "B11"
        ):
            self._skip(code, label)

    # ---------------------------------------------------------------- oracles
    @invariant()
    def check_oracles(self) -> None:
        """Check what the last rule touched; everything every ``FULL_CHECK_EVERY`` rules.

        Rules that must change nothing prove it with snapshots (``invalid``, merge
        sources), so the untouched state is re-checked only periodically.
        """
        if self.geo is None:
            return
        self._invariants += 1
        full = self._invariants % FULL_CHECK_EVERY == 0
        for track in self.pool:
            if full or track.ident in self._dirty:
                self._check_request(track)
        for slot in self.slots:
            if full or slot.ident in self._dirty:
                self._check_slot(slot)
        self._dirty.clear()

    def _check_request(self, track: RingTrack) -> None:
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        what = f"request {track.ident}"
        self._exact(
            f"{what} offsets (reference, optimized)",
            (track.ref.offset, track.opt.offset),
            (track.tokens,) * 2,
        )
        self._exact(f"{what} signature", track.opt.signature(), track.ref.signature())
        self._exact(f"{what} geometry", track.opt.geometry, track.ref.geometry)
        self._exact(
            f"{what} is_trimmable (reference, optimized)",
            (track.ref.is_trimmable(), track.opt.is_trimmable()),
            (track.tokens < g.max_size,) * 2,
        )
        model = self._model_window(track)
        self._same_planes(
            "kv.stored",
            f"{what} window() (reference)",
            _window_planes(ref, track.ref.window()),
            model,
        )
        self._same_planes(
            "kv.stored",
            f"{what} window() (optimized)",
            _window_planes(opt, track.opt.window()),
            model,
        )
        for n, form in ks.CHECKED_MASKS:
            kw = form.kwargs()
            m_ref, m_opt = track.ref.make_mask(n, **kw), track.opt.make_mask(n, **kw)
            keys = (
                min(track.tokens + 1, g.max_size)
                if n == 1
                else min(track.tokens, g.max_size - 1) + n
            )
            e_ref, e_opt = _expand(m_ref, 1, n, keys), _expand(m_opt, 1, n, keys)
            # Serial rings read in different orders: the same number of visible keys per query.
            self._exact(
                f"{what} make_mask({n}, {form}) visible counts",
                e_opt.sum(axis=-1).tolist(),
                e_ref.sum(axis=-1).tolist(),
            )
            if track.lm is not None:
                e_lm = _expand(track.lm.make_mask(n, **form.mlx_lm_kwargs()), 1, n, keys)
                self._masks_equal(f"{what} make_mask({n}, {form}) vs mlx-lm", [e_opt, e_lm])
        if track.lm is not None:
            lm = track.lm
            self._exact(f"{what} mlx-lm offset", int(lm.offset), track.tokens)
            self._exact(f"{what} mlx-lm ring index", int(lm._idx), int(track.opt.ring_index))
            self._exact(f"{what} mlx-lm is_trimmable", lm.is_trimmable(), track.tokens < g.max_size)
            if lm.keys is not None and track.appended:
                lk, lv = lm.keys_and_values()
                fk, fv = track.opt.fetch()
                self._close(
                    "kv.mlx_lm",
                    f"{what} fetch() keys vs mlx-lm",
                    opt.to_numpy(fk),
                    opt.to_numpy(lk),
                )
                self._close(
                    "kv.mlx_lm",
                    f"{what} fetch() values vs mlx-lm",
                    opt.to_numpy(fv),
                    opt.to_numpy(lv),
                )
            self.stats.check("mlx-lm serial")
        self.stats.check("reference vs optimized")

    def _check_slot(self, slot: RingSlot) -> None:
        ref, opt, g = self.ref_impl, self.opt_impl, self.g
        r, o = slot.ref, slot.opt
        what = f"layout {slot.ident}"
        tokens = tuple(t.tokens for t in slot.rows)
        rows = len(slot.rows)
        self._exact(f"{what} batch_size", (r.batch_size, o.batch_size), (rows, rows))
        self._exact(f"{what} row_offsets (reference)", r.row_offsets, tokens)
        self._exact(f"{what} row_offsets (optimized)", o.row_offsets, tokens)
        self._exact(f"{what} left_pad", o.left_pad, r.left_pad)
        if self.kind.trim_rows:
            self._exact(f"{what} left_pad of ragged rings", r.left_pad, (0,) * rows)
        for name, impl, lay in (("reference", ref, r), ("optimized", opt, o)):
            offset = impl.to_numpy(lay.offset)
            self._exact(
                f"{what} offset ({name})",
                (offset.tolist(), str(offset.dtype)),
                (list(tokens), "int32"),
            )
        self._exact(f"{what} signature", o.signature(), r.signature())
        self._exact(f"{what} geometry", o.geometry, r.geometry)
        self._exact(f"{what} max_tokens", (r.max_tokens, o.max_tokens), (float("inf"),) * 2)
        self._exact(f"{what} is_trimmable", o.is_trimmable(), r.is_trimmable())
        for t in (0, 1, g.max_size - 1, g.max_size + 5):
            want: int | str = (
                g.token_bytes() * min(t, g.max_size)
                if r.geometry is not None
                else "LayoutStateError"
            )
            self._exact(
                f"{what} projected_bytes({t}) (reference, optimized)",
                (projected_or_error(r, t), projected_or_error(o, t)),
                (want, want),
            )
        r.check_valid()
        o.check_valid()
        # Layout masks: both in the ring's physical column order, so exactly equal.
        lm = slot.lm if (self.parity and self.kind.peer) else None
        rotated = bool(o.ring_state[2]) if self.kind.shared_column else False
        for n, form in ks.CHECKED_MASKS:
            kw = form.kwargs()
            m_ref, m_opt = r.make_mask(n, **kw), o.make_mask(n, **kw)
            keys = int(np.shape(m_ref)[-1])
            masks = [_expand(m_ref, rows, n, keys), _expand(m_opt, rows, n, keys)]
            self._masks_equal(f"{what} make_mask({n}, {form})", masks)
            if lm is not None and rows:
                e_lm = _expand(lm.make_mask(n, **form.mlx_lm_kwargs()), rows, n, keys)
                if n > 1 and rotated:
                    self._exact(
                        f"{what} make_mask({n}) vs mlx-lm: B9 only hides",
                        bool(np.all(masks[1] | ~e_lm)),
                        True,
                    )
                else:
                    self._masks_equal(f"{what} make_mask({n}, {form}) vs mlx-lm", [masks[1], e_lm])
        self._check_fetch(slot, what, tokens)
        for b, track in enumerate(slot.rows):
            model = self._model_window(track)
            self._same_planes(
                "kv.stored",
                f"{what} row_window({b}) (reference)",
                _window_planes(ref, r.row_window(b)),
                model,
            )
            self._same_planes(
                "kv.stored",
                f"{what} row_window({b}) (optimized)",
                _window_planes(opt, o.row_window(b)),
                model,
            )
            self._check_serial_like(
                f"{what} extract_row({b})", r.extract_row(b), o.extract_row(b), track
            )
        self.stats.check("reference vs optimized")
        if lm is not None:
            self._exact(f"{what} mlx-lm offsets", np.array(lm.offset).tolist(), list(tokens))
            self._exact(
                f"{what} mlx-lm left_padding", np.array(lm.left_padding).tolist(), list(r.left_pad)
            )
            self._exact(
                f"{what} mlx-lm (_idx, _offset, rotated)",
                (int(lm._idx), int(lm._offset), bool(lm.rotated)),
                o.ring_state,
            )
            self._exact(f"{what} mlx-lm is_trimmable", lm.is_trimmable(), o.is_trimmable())
            if lm.keys is None:
                self._exact(
                    f"{what}: mlx-lm holds no keys, so neither does kvrows", o.buffer_length, 0
                )
            else:
                lk, lv = lm.keys_and_values()
                fk, fv = o.fetch()
                self._close(
                    "kv.mlx_lm",
                    f"{what} fetch() keys vs mlx-lm",
                    opt.to_numpy(fk),
                    opt.to_numpy(lk),
                )
                self._close(
                    "kv.mlx_lm",
                    f"{what} fetch() values vs mlx-lm",
                    opt.to_numpy(fv),
                    opt.to_numpy(lv),
                )
            self.stats.check("mlx-lm layout")

    def _check_fetch(self, slot: RingSlot, what: str, tokens: tuple[int, ...]) -> None:
        """``fetch()``: both raise or both read; each row's token columns are the same bytes,
        and they hold a contiguous newest run of the row's tokens covering its window."""
        ref, opt = self.ref_impl, self.opt_impl
        outcomes: list[Any] = []
        for lay in (slot.ref, slot.opt):
            try:
                outcomes.append(lay.fetch())
            except KvRowsError as error:
                outcomes.append(type(error))
            except ValueError:
                if lay is slot.ref and 0 in tokens and "ragged-fetch-empty-row" in KNOWN_BUGS:
                    self.stats.check("known bug ragged-fetch-empty-row")
                    return
                raise
        raised = [isinstance(x, type) for x in outcomes]
        if not sum(tokens) and raised == [False, True] and "fetch-no-rows" in KNOWN_BUGS:
            # The reference's answer is the bug (contract: fetch of an empty cache raises).
            self.stats.check("known bug fetch-no-rows")
            return
        self._exact(f"{what} fetch() raises (reference, optimized)", raised[1], raised[0])
        if raised[0]:
            self._exact(f"{what} fetch() raises only when no row has held a token", sum(tokens), 0)
            return
        k_ref, v_ref = _planes_of(ref, outcomes[0][0]), _planes_of(ref, outcomes[0][1])
        k_opt, v_opt = _planes_of(opt, outcomes[1][0]), _planes_of(opt, outcomes[1][1])
        self._exact(
            f"{what} fetch() shapes",
            [p.shape for p in k_opt + v_opt],
            [p.shape for p in k_ref + v_ref],
        )
        for b, track in enumerate(slot.rows):
            ids = _column_ids(track.keys, 0)
            position = {token: p for p, token in enumerate(ids)}
            held = [(c, position[x]) for c, x in enumerate(_column_ids(k_ref, b)) if x in position]
            found = sorted(p for _, p in held)
            newest = list(range(track.tokens - len(found), track.tokens))
            self._exact(f"{what} fetch() row {b}: a newest run of the row's tokens", found, newest)
            self._exact(
                f"{what} fetch() row {b}: covers the window",
                len(found) >= min(track.tokens, self.g.max_size),
                True,
            )
            columns = [c for c, _ in held]
            for name, got, want in (("keys", k_opt, k_ref), ("values", v_opt, v_ref)):
                for i, (a, e) in enumerate(
                    zip(
                        _take_columns(got, b, columns), _take_columns(want, b, columns), strict=True
                    )
                ):
                    self._close("kv.fetched", f"{what} fetch() {name} row {b} plane {i}", a, e)


def ring_machine_class(
    family: Family,
    layout: str,
    *,
    stats: Stats | None = None,
    reference: Impl | None = None,
    optimized: Impl | None = None,
    parity: bool = True,
    limits: Limits | None = None,
    enforce: bool = True,
    name: str | None = None,
) -> type[RingMachine]:
    """A machine class for ring ``layout`` (same signature as ``machines.machine_class``).

    ``optimized`` may be a mutant (``optimized_impl().with_classes({...})``); the ring
    classes it lacks are filled in from ``kvrows.optimized`` (and ``kvrows.reference``).
    """
    import kvrows.optimized
    import kvrows.reference

    kind = RING_KINDS[layout]
    family.layout(layout)  # the layout must be one of the family's
    attrs = {
        "family": family,
        "kind": kind,
        "ref_impl": _with_rings(reference or reference_impl(), kvrows.reference),
        "opt_impl": _with_rings(optimized or optimized_impl(), kvrows.optimized),
        "parity": parity,
        "stats": stats or Stats(family.name, layout),
        "limits": limits or Limits(pool=4, layouts=2, rows=6),
        "enforce": enforce,
        "__module__": __name__,
        "__doc__": f"Conformance of the rotating family's {layout} ({kind.role} layout).",
    }
    return type(name or f"Rotating{layout}Machine", (RingMachine,), attrs)


# ------------------------------------------------------------------ calibration
def main(argv: Sequence[str] | None = None) -> int:
    """Measure the rotating family's errors with attention tolerances recorded, not enforced
    (everything exact stays enforced); how spec/tolerances.md's rotating rows were chosen::

        python -m kvrows.conformance.rings --examples 300 --seed 1 [--layout NAME ...]
    """
    import argparse
    import time

    from hypothesis import seed as hypothesis_seed
    from hypothesis.stateful import run_state_machine_as_test

    from kvrows.conformance.families import FAMILIES
    from kvrows.conformance.profiles import profile_settings

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--layout", action="append", default=None, help="only these layouts")
    args = parser.parse_args(argv)
    family = FAMILIES["rotating"]
    settings = profile_settings(
        "deep",
        max_examples=args.examples,
        stateful_step_count=args.steps,
        database=None,
        phases=[p for p in profile_settings("deep").phases if p.name != "shrink"],
    )
    print(
        f"{'layout':<26} {'quantity':<17} {'dtype':<9} {'max |diff|':<12} {'diff/tol':<9} "
        f"{'compared':<9} tolerance"
    )
    failed = 0
    for layout in args.layout or [spec.name for spec in family.layouts]:
        stats = Stats(family.name, layout)
        cls: Any = ring_machine_class(family, layout, stats=stats, enforce=False)
        if args.seed is not None:
            cls = hypothesis_seed(args.seed)(cls)
        started = time.monotonic()
        try:
            with mx.stream(mx.cpu):
                run_state_machine_as_test(cls, settings=settings)
        except Exception as error:
            failed += 1
            print(f"{layout}: FAILED: {error!r}")
        print(
            f"{layout}: {stats.examples} examples, {time.monotonic() - started:.0f}s",
            file=sys.stderr,
        )
        for (quantity, dtype), record in sorted(stats.errors.items()):
            if record.tolerance.exact:
                continue
            print(
                f"{layout:<26} {quantity:<17} {dtype:<9} {record.max_error:<12.4g} "
                f"{record.max_ratio:<9.3f} {record.comparisons:<9} {record.tolerance.describe()}"
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
