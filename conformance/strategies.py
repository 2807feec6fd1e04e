"""Hypothesis strategies for the conformance machines (imported as ``ks``).

Values (keys, values, queries) are not drawn element by element: a rule draws
a 32-bit seed and NumPy makes the block, which keeps examples small and fast
while Hypothesis still shrinks the seed, the shapes and the operation sequence.
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import strategies as st

from kvrows.codec import DTYPE_SIZES, CodecSpec
from kvrows.codecs import CODECS
from kvrows.conformance.tolerances import DTYPES

__all__ = [
    "CHECKED_MASKS",
    "Geometry",
    "MaskForm",
    "attention_chunks",
    "chunk_sizes",
    "counts_up_to",
    "geometries",
    "keep_lists",
    "mask_forms",
    "prompt_lengths",
    "ring_keeps",
    "ring_windows",
    "seeds",
    "step_sizes",
    "turbo_geometries",
]


@dataclass(frozen=True)
class Geometry:
    """One example's shapes (KV heads, query heads, head dims, dtype) and the storage
    parameters the family draws: a ring's window ``max_size`` (``None``: full attention)
    and sink tokens ``keep``, an affine codec's ``bits`` / ``group_size`` (``bits ==
    0``: plain), or a TurboQuant codec's ``k_bits`` / ``v_bits`` (``k_bits == 0``: not
    turbo)."""

    dtype: str
    heads: int
    query_heads: int
    key_dim: int
    value_dim: int
    max_size: int | None = None
    bits: int = 0
    group_size: int = 0
    keep: int = 0
    k_bits: int = 0
    v_bits: int = 0
    #: The codec kind of the layout the example drew for (its draw's; empty for a shape
    #: that stores nothing).
    codec_kind: str = ""
    #: A chunked-local geometry's ``chunk_size`` (``None``: not chunked).
    chunk_size: int | None = None

    @property
    def spec(self) -> CodecSpec:
        """The example's codec spec, from its drawn parameters (what the model encodes
        with: the reference codec of this spec)."""
        assert self.codec_kind, "an example drawn without its layout's codec kind"
        return CODECS[self.codec_kind].from_parameters(self.parameters())

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.key_dim)

    @property
    def affine(self) -> bool:
        return self.bits > 0

    @property
    def turbo(self) -> bool:
        return self.k_bits > 0

    @property
    def codec(self) -> str:
        if self.turbo:
            return f"turbo k{self.k_bits}v{self.v_bits}"
        return f"bits={self.bits} group={self.group_size}" if self.affine else "plain"

    def parameters(self) -> dict[str, int]:
        """Constructor values by the composition table's parameter names (a valid default
        where the example has none: a cache of another geometry or codec, a bad input)."""
        return {
            "max_size": self.max_size or 8,
            "keep": self.keep,
            "group_size": self.group_size or 32,
            "bits": self.bits or 8,
            "k_bits": self.k_bits or 8,
            "v_bits": self.v_bits or 3,
            "chunk_size": self.chunk_size or 8,
        }

    @property
    def cap(self) -> int | None:
        """The most positions a row holds between appends (a ring's window, a chunked
        row's chunk; ``None``: every one): what a prefix registers and a hit takes at most."""
        return self.max_size if self.chunk_size is None else self.chunk_size

    def kept(self, tokens: int, held: int | None = None) -> int:
        """Tokens a store of ``tokens`` positions holds: all, a ring's newest window, or
        what a chunked row holds (``held``; with no history its newest ``chunk_size``)."""
        if self.chunk_size is not None:
            return min(tokens, self.chunk_size) if held is None else held
        return tokens if self.max_size is None else min(tokens, self.max_size)

    def positions(self, tokens: int, held: int) -> list[int]:
        """The positions a store of ``tokens`` positions holding ``held`` of them keeps,
        oldest first: a ring's first ``keep`` (sinks), then its newest."""
        head = min(self.keep, tokens, held)
        return [*range(head), *range(tokens - held + head, tokens)]

    def wrapped(self, tokens: int) -> bool:
        """A ring holding ``tokens`` positions has forgotten one (it cannot be trimmed)."""
        return self.max_size is not None and tokens >= self.max_size

    def may_forget(self, offset: int, held: int, count: int) -> bool:
        """A row at ``offset`` holding ``held`` positions may forget its newest ``count``:
        the per-row trim rule (spec/RaggedRotatingRows.md §3 ``trim_rows``; ``trim(n)`` is
        ``trim_rows([n] * B)``): at most its offset, and a ring row only while what it
        retains still holds the whole window of the position it goes back to."""
        if count == 0:
            return True
        if self.chunk_size is not None:  # mlx-lm: anything it holds
            return count <= held
        window = offset if self.max_size is None else self.max_size
        return count <= offset and held - count >= min(offset - count, window)

    def retained(self, before: int, n: int) -> int:
        """Tokens an append of ``n`` onto ``before`` reads: a ring keeps the newest
        ``min(before + 1, max_size)`` after one token, ``min(before, max_size - 1) + n``
        after a block (its first query still sees a whole window); a chunked row
        (``before``: what it holds) its newest ``chunk_size`` and then the block."""
        if self.chunk_size is not None:
            return min(before, self.chunk_size) + n
        if self.max_size is None:
            return before + n
        if n == 1:
            return min(before + 1, self.max_size)
        return min(before, self.max_size - 1) + n

    def token_bytes(self) -> int:
        """Bytes one token of one row occupies (the spec's formula, not the code's)."""
        itemsize = 4 if self.dtype == "float32" else 2
        if self.turbo:
            # Keys: D·k/8 code bytes, float16 scale and zero per 32; values: D·v/8 code
            # bytes, a float16 scale per 32 (spec/turbo-codec.md), whatever the dtype.
            keys = self.key_dim * self.k_bits // 8 + 2 * 2 * self.key_dim // 32
            values = self.value_dim * self.v_bits // 8 + 2 * self.value_dim // 32
            return self.heads * (keys + values)
        if not self.affine:
            return self.heads * (self.key_dim + self.value_dim) * itemsize
        # A group codec: ``D·bits/8`` code bytes, then the per-group planes its spec declares
        # (affine: a scale and a bias in the dtype, ``2·itemsize·D/group``; a microscaling
        # mode: one scale byte per group).
        groups = [p for d in self.dims for p in self.spec.plane_specs("t", d, self.dtype)[1:]]
        codes = sum(d * self.bits // 8 for d in self.dims)
        return self.heads * (codes + sum(DTYPE_SIZES[p.dtype] * p.width for p in groups))

    @property
    def dims(self) -> tuple[int, int]:
        return self.key_dim, self.value_dim

    @property
    def mlx_lm_width_bug(self) -> bool:
        """mlx-lm's affine packed width ``D // (32 // bits)`` differs from ``mx.quantize``'s
        ``ceil(D * bits / 32)`` for a head dim (parity skip A1)."""
        return self.affine and any(
            d // (32 // self.bits) != -(-d * self.bits // 32) for d in self.dims
        )

    @property
    def mlx_lm_reshape_bug(self) -> bool:
        """mlx-lm's quantized attention cannot reshape its output (parity skip A2)."""
        return self.affine and self.query_heads > self.heads and self.value_dim != self.key_dim

    def __str__(self) -> str:
        ring = f", window {self.max_size}" if self.max_size is not None else ""
        ring += f" keep {self.keep}" if self.keep else ""
        return (
            f"{self.dtype}, {self.heads} KV heads, {self.query_heads} query heads, "
            f"dims {self.key_dim}/{self.value_dim}, {self.codec}{ring}"
        )


#: One plain example in this many keeps keys only (values of width 0, as minimax_m3's
#: indexer appends them to a ``KVCache``).
KEYS_ONLY_ONE_IN = 16


def keys_only(*drawn: object) -> bool:
    """Whether a plain example's values have width 0: a function of its other drawn shape
    parameters (their CRC), not a draw of its own, so the derandomized CI examples draw
    what they drew before and the same data replays the same widths."""
    return zlib.crc32(repr(drawn).encode()) % KEYS_ONLY_ONE_IN == 0


@st.composite
def geometries(
    draw: st.DrawFn,
    *,
    dims: tuple[int, ...] = (8, 16),
    codecs: tuple[tuple[int, int], ...] = (),
    windows: st.SearchStrategy[int] | None = None,
    keeps: Callable[[int], st.SearchStrategy[int]] | None = None,
    kind: str = "",
    chunks: st.SearchStrategy[int] | None = None,
) -> Geometry:
    """Shapes, then (when given) a codec ``(bits, group_size)`` of codec kind ``kind``, a
    ring window and its sink tokens (``keeps(max_size)``), a chunk size. A group codec
    takes head dims of ``dims`` that its group divides; a plain example sometimes keys
    only (:func:`keys_only`)."""
    dtype = draw(st.sampled_from(DTYPES), label="dtype")
    heads = draw(st.sampled_from((1, 2, 4)), label="heads")
    group = draw(st.sampled_from((1, 2)), label="query heads per KV head")
    max_size = draw(windows, label="max_size") if windows is not None else None
    keep = draw(keeps(max_size), label="keep") if keeps is not None and max_size else 0
    bits = group_size = 0
    # Only the codecs whose group divides one of the head dims (a ring caps the dims).
    codecs = tuple(c for c in codecs if any(d % c[1] == 0 for d in dims))
    if codecs:
        bits, group_size = draw(st.sampled_from(codecs), label="(bits, group size)")
        dims = tuple(d for d in dims if d % group_size == 0)
    key_dim = draw(st.sampled_from(dims), label="key_dim")
    value_dim = draw(st.sampled_from((key_dim, *dims)), label="value_dim")
    chunk_size = draw(chunks, label="chunk_size") if chunks is not None else None
    geometry = Geometry(
        dtype, heads, heads * group, key_dim, value_dim, max_size, bits, group_size, keep,
        chunk_size=chunk_size, codec_kind=kind,
    )  # fmt: skip
    # A codec that encodes refuses values of width 0; one that stores the block holds them.
    stores_block = bool(kind) and not geometry.spec.encodes
    if stores_block and keys_only(dtype, heads, group, key_dim, max_size, keep, chunk_size):
        return replace(geometry, value_dim=0)
    return geometry


@st.composite
def turbo_geometries(
    draw: st.DrawFn,
    *,
    dims: tuple[int, ...],
    codecs: tuple[tuple[int, int], ...],
    windows: st.SearchStrategy[int] | None = None,
    keeps: Callable[[int], st.SearchStrategy[int]] | None = None,
    kind: str = "",
) -> Geometry:
    """The base shapes at TurboQuant head dims, then a codec ``(k_bits, v_bits)``."""
    base = draw(geometries(dims=dims, windows=windows, keeps=keeps, kind=kind))
    k_bits, v_bits = draw(st.sampled_from(codecs), label="(k_bits, v_bits)")
    return replace(base, k_bits=k_bits, v_bits=v_bits)


def ring_windows(role: str) -> st.SearchStrategy[int]:
    """Ring windows by the layout's role: mostly 4-8 (a ring wraps within a few steps),
    sometimes 12-32; prefill layouts lean to wider windows (prompts and blocks around the
    window); verify layouts run 1-8 mostly, so that rounds cross the window."""
    if role == "prefill":
        return st.one_of(st.integers(4, 8), st.integers(9, 16), st.just(32))
    if role == "verify":
        return st.one_of(st.integers(1, 4), st.integers(2, 8), st.sampled_from((12, 16, 32)))
    return st.one_of(st.integers(4, 8), st.integers(4, 8), st.sampled_from((12, 16, 32)))


def ring_keeps(max_size: int) -> st.SearchStrategy[int]:
    """Sink tokens: none in about two examples of three, else 1 to 3 (below the window)."""
    if max_size < 2:
        return st.just(0)  # a window of one token has no room for a sink
    return st.one_of(st.just(0), st.just(0), st.integers(1, min(3, max_size - 1)))


def attention_chunks(role: str) -> st.SearchStrategy[int]:
    """Chunked attention's chunk sizes: mostly 2-8 (rows cross chunks within a few steps), sometimes 16; 1
    (every query sees only itself) now and then."""
    return st.one_of(st.integers(2, 8), st.integers(2, 8), st.sampled_from((1, 16)))


seeds = st.integers(0, 2**32 - 1)


@dataclass(frozen=True)
class MaskForm:
    """How a mask is asked for: mlx-lm's ``return_array`` and ``window_size`` arguments."""

    return_array: bool = False
    window_size: int | None = None

    def kwargs(self) -> dict[str, Any]:
        return {"return_array": self.return_array, "window_size": self.window_size}

    def mlx_lm_kwargs(self) -> dict[str, Any]:
        """mlx-lm's ``KVCache.make_mask`` takes both positionally-required; ``BatchKVCache``
        ignores ``return_array`` (it always returns an array)."""
        return {"return_array": self.return_array, "window_size": self.window_size}

    def __str__(self) -> str:
        parts = ["array"] if self.return_array else []
        if self.window_size is not None:
            parts.append(f"window {self.window_size}")
        return ", ".join(parts) or "default"


def mask_forms() -> st.SearchStrategy[MaskForm]:
    """Mostly the default form; sometimes an array, sometimes a sliding window."""
    return st.builds(
        MaskForm,
        return_array=st.booleans(),
        window_size=st.one_of(st.none(), st.none(), st.integers(1, 6)),
    )


#: The masks the invariants compare after every step: (N, form).
CHECKED_MASKS: tuple[tuple[int, MaskForm], ...] = (
    (1, MaskForm()),
    (3, MaskForm()),
    (1, MaskForm(return_array=True)),
    (3, MaskForm(window_size=2)),
)


def prompt_lengths(long: bool = True) -> st.SearchStrategy[int]:
    """Mostly short prompts (0 included); sometimes one that crosses the 256-column step."""
    short = st.integers(0, 6)
    medium = st.integers(0, 24)
    if not long:
        return st.one_of(short, medium)
    crossing = st.integers(250, 262)
    return st.integers(0, 9).flatmap(
        lambda pick: short if pick < 6 else medium if pick < 9 else crossing
    )


@st.composite
def chunk_sizes(draw: st.DrawFn, length: int) -> list[int]:
    """``length`` split into 1-4 positive chunks (``[]`` for 0)."""
    if length == 0:
        return []
    if length == 1:
        return [1]
    cuts = draw(st.lists(st.integers(1, length - 1), max_size=3, unique=True), label="cuts")
    bounds = [0, *sorted(cuts), length]
    return [b - a for a, b in itertools.pairwise(bounds)]


def counts_up_to(most: int) -> st.SearchStrategy[int]:
    """A trim count in ``[0, most]``, often exactly ``most`` (a row trimmed to nothing)."""
    return st.one_of(st.just(most), st.integers(0, most))


def step_sizes(multi: bool) -> st.SearchStrategy[int]:
    """Tokens per layout step: 1 (decode) or 2-5 (multi-token: chunked prefill, verify)."""
    return st.integers(2, 5) if multi else st.just(1)


@st.composite
def keep_lists(
    draw: st.DrawFn, row_tokens: tuple[int, ...], mirrored: bool = False
) -> tuple[str, list[int]]:
    """A filter's keep list for rows holding ``row_tokens``: any subset, any order.

    Kinds: ``drop-longest`` (the longest row leaves, survivors shuffled),
    ``reorder`` (every row, permuted), ``none`` (keep nothing), ``subset``.
    ``mirrored``: an mlx-lm batch mirrors the layout, and ``reorder`` comes first (early
    layouts hold one row, which ``drop-longest`` empties: mlx-lm's filter is then skipped
    and its mirror dropped, so its filter check came dozens of examples late).
    """
    rows = len(row_tokens)
    # The kinds a derandomized run must reach first (Hypothesis favours early choices).
    kinds = ["drop-longest", "reorder", "none", "subset"] if rows else ["none", "subset"]
    if mirrored and rows:
        kinds[:2] = kinds[1::-1]
    kind = draw(st.sampled_from(kinds), label="filter kind")
    if kind == "none":
        return kind, []
    if kind == "drop-longest":
        longest = max(range(rows), key=lambda b: row_tokens[b])
        survivors = [b for b in range(rows) if b != longest]
        return kind, draw(st.permutations(survivors), label="keep")
    if kind == "reorder":
        return kind, draw(st.permutations(list(range(rows))), label="keep")
    chosen = draw(st.lists(st.sampled_from(range(rows)), unique=True), label="keep") if rows else []
    return kind, chosen
