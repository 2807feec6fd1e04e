"""Write the compatibility fixtures: files saved by this version of kvrows.

``tests/data/saved_v<N>/`` (``N``: the prompt-cache format, ``kvrows.forms.FORMAT_VERSION``)
holds, for both implementations, one prompt-cache file per persisting class and codec
(``save_prompt_cache``) and a prefix store of serial entries (``PrefixStore.put``), with
``manifest.json``: per case what was built (class, constructor arguments, appends), its
files, and per implementation the facts a load must restore (class, offsets, signature)
and ``content_digest`` (``DIGEST_RULE``) of the live caches, computed before anything was
saved (never read back from a file).
``tests/test_saved_files_load.py`` loads them with the current loaders; a later format
keeps a reader for them (``spec/persistence-files.md``, "Files written by earlier
versions"). Deterministic: fixed seeds and small shapes, so rerunning it on the same
version writes the same bytes.

    .venv/bin/python tools/write_saved_files.py [OUT_DIR]
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import mlx.core as mx
import numpy as np

import kvrows.optimized as optimized
import kvrows.reference as reference
from kvrows.forms import FORMAT_VERSION
from kvrows.persist.prefix_store import FORMAT_VERSION as STORE_FORMAT_VERSION
from kvrows.persist.prefix_store import PrefixStore
from kvrows.persist.prompt_cache import save_prompt_cache
from kvrows.schemes import Affine, Plain, Turbo

IMPLEMENTATIONS: dict[str, Any] = {"optimized": optimized, "reference": reference}
HEADS, DIM = 1, 64  # the smallest head turbo takes; affine groups of 32
LATENT_WIDTHS = (64, 16, 32)  # kv_lora_rank, rope_head_dim, index_head_dim
STORE_BLOCK_TOKENS = 4
STORE_FINGERPRINT = "saved-files-fixture"
DIGEST_RULE = (
    "sha256 of content_record(caches): per layer its offset, row_offsets and left_pad (a "
    "negative pad as 0), then what it reads: a serial KV cache fetch() (if it holds tokens) "
    "and the fetch after one probe token, a ring's token columns sorted by content; a KV "
    "layout the same of each row's extract_row(b); a latent layout current(), each row from "
    "its left_pad, before and after one probe token per row; a recurrent cache its planes; "
    "a TurboQuant read (its planes) as its keys decoded and its values decoded still rotated, "
    "bfloat16. "
    "Floats as float32, integers as int64, little-endian, each with its name and shape"
)
PROBE_SEED = 12345


# -- the content a load must restore --------------------------------------------------------


def _host(array: Any) -> np.ndarray[Any, Any]:
    """``array`` (MLX or NumPy, bfloat16 included) as NumPy: floats float32, ints int64."""
    if isinstance(array, mx.array):
        is_float = mx.issubdtype(array.dtype, mx.floating)
        array = np.array(array.astype(mx.float32 if is_float else mx.int64))
    else:
        array = np.asarray(array)
        is_float = array.dtype.kind == "f" or array.dtype.name == "bfloat16"
    return np.ascontiguousarray(array.astype("<f4" if is_float else "<i8"))


def _flat(name: str, reads: Any) -> list[tuple[str, Any]]:
    """Nested tuples of arrays (a codec's planes) as named leaves."""
    if isinstance(reads, tuple | list):
        return [leaf for i, part in enumerate(reads) for leaf in _flat(f"{name}.{i}", part)]
    return [(name, reads)]


def _ints(value: Any) -> Any:
    """An offset as JSON: an int, or a list of ints (a layout's per-row offsets)."""
    if isinstance(value, int):
        return value
    return [int(v) for v in np.asarray(value).reshape(-1).tolist()]


def layer_facts(cache: Any) -> dict[str, Any]:
    """What a load must restore besides the arrays: class, offsets, signature. A ring's
    pad below 0 means its pad columns were overwritten: the same rows as a pad of 0
    (``spec/persistence.md`` §1), which is how a restored ring layout reports it."""
    facts: dict[str, Any] = {"class": type(cache).__name__, "signature": cache.signature()}
    for name in ("offset", "row_offsets", "left_pad"):
        if hasattr(cache, name):
            facts[name] = _ints(getattr(cache, name))
    if "left_pad" in facts:
        facts["left_pad"] = [max(pad, 0) for pad in facts["left_pad"]]
    return facts


def _is_reference(cache: Any) -> bool:
    return type(cache).__module__.startswith("kvrows.reference")


def _probe(cache: Any, rows: int, shapes: Sequence[tuple[int, ...]], dtype: str) -> list[Any]:
    """One deterministic block ``[rows, *shape]`` per shape (one token: the shapes hold
    ``1`` on the token axis), native to ``cache``'s implementation."""
    rng = np.random.default_rng(PROBE_SEED)
    blocks = [rng.standard_normal((rows, *shape)).astype(np.float32) for shape in shapes]
    if _is_reference(cache):
        return [_native(reference, block, dtype) for block in blocks]
    return [_native(optimized, block, dtype) for block in blocks]


def _columns_in_canonical_order(reads: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A ring's reads with their token columns (axis 2) sorted by content: a ring reads
    its buffer in physical order, which depends on how the state was laid out (a
    restored ring may hold the same columns rotated), not on what it holds."""
    hosts = [(name, _host(array)) for name, array in reads]
    if not hosts:
        return hosts
    columns = hosts[0][1].shape[2]
    keys = [b"".join(host[:, :, t].tobytes() for _, host in hosts) for t in range(columns)]
    order = sorted(range(columns), key=keys.__getitem__)
    return [(name, host[:, :, order]) for name, host in hosts]


def _decoded(cache: Any, keys: Any, values: Any) -> tuple[Any, Any]:
    """A read as the digest records it: a TurboQuant read (its planes) as its keys decoded
    and its values decoded still rotated, bfloat16 (what the read was when the fixtures
    were written); any other read as it is."""
    codec = getattr(cache, "last_read_codec", None) or getattr(cache, "codec", None)
    spec = getattr(codec, "spec", None)
    if not isinstance(spec, Turbo) or not isinstance(keys, tuple | list):
        return keys, values
    if _is_reference(cache):
        from kvrows.reference import turbo_codec as ref_turbo

        bf16 = np.dtype(ml_dtypes.bfloat16)
        return (
            ref_turbo.decode_keys(keys[0], keys[1], keys[2], spec.k_bits).astype(bf16),
            ref_turbo.rotated_values(values[0], values[1], spec.v_bits).astype(bf16),
        )
    from kvrows.optimized import turbo_codec as opt_turbo

    return (
        opt_turbo.decode_keys(keys[0], keys[1], keys[2], spec.k_bits).astype(mx.bfloat16),
        opt_turbo.rotated_values(values[0], values[1], spec.v_bits).astype(mx.bfloat16),
    )


def _serial_reads(cache: Any, label: str) -> list[tuple[str, Any]]:
    """A serial KV cache's fetch now and after a probe token (mutates ``cache``)."""
    ring = hasattr(cache, "max_size")
    out: list[tuple[str, Any]] = []
    if int(cache.offset) > 0:
        keys, values = _decoded(cache, *cache.fetch())
        now = _flat(f"{label}now.keys", keys) + _flat(f"{label}now.values", values)
        out += _columns_in_canonical_order(now) if ring else now
    geometry = cache.geometry
    if geometry is not None:
        shape = [(geometry.heads, 1, geometry.key_dim), (geometry.heads, 1, geometry.value_dim)]
        keys, values = _decoded(
            cache, *cache.update_and_fetch(*_probe(cache, 1, shape, geometry.dtype))
        )
        after = _flat(f"{label}next.keys", keys) + _flat(f"{label}next.values", values)
        out += _columns_in_canonical_order(after) if ring else after
    return out


def _latent_reads(cache: Any) -> list[tuple[str, Any]]:
    """Each row's latent, rope and index planes from its left pad, now and after a probe
    token (mutates ``cache``)."""
    out: list[tuple[str, Any]] = []
    for when in ("now", "next"):
        if when == "next":
            widths = [(1, 1, plane.shape[-1]) for plane in cache.current() if plane is not None]
            cache.append(*_probe(cache, cache.batch_size, widths, "float32"))
        for name, plane in zip(("latent", "rope", "index"), cache.current(), strict=True):
            if plane is None:
                continue
            host = _host(plane)
            for b, pad in enumerate(cache.left_pad):
                out.append((f"{when}.{name}.row{b}", host[b, :, max(pad, 0) :]))
    return out


def _reads(cache: Any) -> list[tuple[str, Any]]:
    """What the cache reads, by public API, pad columns left out (mutates ``cache``)."""
    if hasattr(cache, "current"):  # latent: [B, 1, T, width] planes, right-aligned rows
        return _latent_reads(cache)
    if hasattr(cache, "advance"):  # recurrent: planes without a token axis
        return [(f"plane{i}", plane) for i, plane in enumerate(cache.cache) if plane is not None]
    if hasattr(cache, "row_offsets"):  # a KV layout: each row as the serial cache it holds
        rows = len(cache.row_offsets)
        return [
            read for b in range(rows) for read in _serial_reads(cache.extract_row(b), f"row{b}.")
        ]
    return _serial_reads(cache, "")


def content_record(caches: Sequence[Any]) -> bytes:
    """The bytes ``content_digest`` hashes (``DIGEST_RULE``); mutates the caches (probe
    tokens), so call it on caches that are not saved afterwards."""
    stream = bytearray()

    def put(data: bytes) -> None:
        stream.extend(len(data).to_bytes(8, "little") + data)

    put(str(len(caches)).encode())
    for cache in caches:
        facts = {k: v for k, v in layer_facts(cache).items() if k not in ("class", "signature")}
        put(json.dumps(facts, sort_keys=True).encode())
        for name, array in _reads(cache):
            host = _host(array)
            put(f"{name}:{host.dtype.str}:{host.shape}".encode())
            put(host.tobytes())
    return bytes(stream)


def content_digest(caches: Sequence[Any]) -> str:
    """``DIGEST_RULE``'s digest of ``caches`` (which it changes: probe tokens)."""
    with mx.stream(mx.cpu):
        return hashlib.sha256(content_record(caches)).hexdigest()


# -- what is built ---------------------------------------------------------------------------


def _native(impl: Any, block: np.ndarray[Any, Any], dtype: str = "float32") -> Any:
    if impl is optimized:
        return mx.array(block).astype(getattr(mx, dtype))
    if dtype == "bfloat16":
        import ml_dtypes

        return block.astype(ml_dtypes.bfloat16)
    return block.astype(dtype)


def _fill(impl: Any, cache: Any, sizes: Sequence[int], seed: int, dtype: str) -> Any:
    rng = np.random.default_rng(seed)
    for n in sizes:
        keys, values = (rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32) for _ in "kv")
        cache.update_and_fetch(_native(impl, keys, dtype), _native(impl, values, dtype))
    return cache


@dataclass(frozen=True)
class Case:
    """One saved file: a name, what is built (recorded in the manifest) and its builder."""

    name: str
    built: dict[str, Any]
    build: Callable[[Any], list[Any]]
    store: bool = False  # also a prefix-store entry (serial caches only)


def _serial(cls: str, args: dict[str, Any], sizes: list[int], dtype: str = "float32") -> Case:
    def build(impl: Any) -> list[Any]:
        return [_fill(impl, getattr(impl, cls)(**args), sizes, 1, dtype)]

    built = {"class": cls, "args": args, "appends": sizes, "dtype": dtype}
    return Case(f"{cls}-{_label(args)}-{dtype}", built, build)


def _label(args: dict[str, Any]) -> str:
    return "_".join(f"{k}{v}" for k, v in args.items()) or "default"


def _layout(cls: str, args: dict[str, Any], rows: list[list[int]], decode: int) -> Case:
    """Rows of the layout's serial class merged, then ``decode`` one-token appends."""

    def build(impl: Any) -> list[Any]:
        layout_class = getattr(impl, cls)
        serial_class = getattr(impl, layout_class.composition.serial)
        layout = layout_class(**args)
        layout.merge_rows(
            [
                _fill(impl, serial_class(**args), sizes, 10 + i, "float32")
                for i, sizes in enumerate(rows)
            ]
        )
        _fill(impl, _WholeBatch(layout, len(rows)), [1] * decode, 99, "float32")
        return [layout]

    built = {"class": cls, "args": args, "rows": rows, "decode_appends": decode}
    return Case(f"{cls}-{_label(args)}", built, build)


class _WholeBatch:
    """``update_and_fetch`` of a whole-batch block on a layout (``_fill`` appends ``B = 1``)."""

    def __init__(self, layout: Any, rows: int) -> None:
        self.layout, self.rows = layout, rows

    def update_and_fetch(self, keys: Any, values: Any) -> Any:
        def widen(block: Any) -> Any:
            if isinstance(block, mx.array):
                return mx.concatenate([block] * self.rows, axis=0)
            return np.concatenate([block] * self.rows, axis=0)

        return self.layout.update_and_fetch(widen(keys), widen(values))


def _lego(cls: str, args: dict[str, Any], sizes: list[int]) -> Case:
    def build(impl: Any) -> list[Any]:
        return [_fill(impl, getattr(impl, cls)(**args), sizes, 2, "float16")]

    built = {"class": cls, "args": args, "appends": sizes, "dtype": "float16"}
    return Case(f"{cls}-{_label(args)}-{sum(sizes)}tokens", built, build)


def _delayed(cls: str, args: dict[str, Any], rows: list[int]) -> Case:
    """Legos of the delayed layout's parameters (one per row), merged."""

    def build(impl: Any) -> list[Any]:
        layout_class = getattr(impl, cls)
        legos = [
            _fill(impl, layout_class.lego_class(**args), [n], 20 + i, "float16")
            for i, n in enumerate(rows)
        ]
        layout = layout_class(**args)
        layout.merge_rows(legos)
        return [layout]

    built = {"class": cls, "args": args, "rows_of_legos": rows, "dtype": "float16"}
    return Case(f"{cls}-{_label(args)}", built, build)


_CODECS: dict[str, Any] = {
    "plain": Plain(),
    "affine4": Affine(bits=4, group_size=32),
    "affine8": Affine(bits=8, group_size=32),
    "turbo": Turbo(k_bits=8, v_bits=3),
}


def _paged(codec: str, rows: list[list[int]] | None, sizes: list[int]) -> Case:
    """A serial paged cache, or (``rows``) a layout of paged rows; block size 4."""

    def build(impl: Any) -> list[Any]:
        pool = impl.BlockPool(_CODECS[codec], block_size=4)
        if rows is None:
            return [_fill(impl, impl.PagedKVCache(pool=pool), sizes, 3, "float32")]
        layout = impl.PagedKvRows(pool=pool)
        layout.merge_rows(
            [
                _fill(impl, impl.PagedKVCache(pool=pool), r, 30 + i, "float32")
                for i, r in enumerate(rows)
            ]
        )
        return [layout]

    cls = "PagedKVCache" if rows is None else "PagedKvRows"
    built: dict[str, Any] = {"class": cls, "pool": {"codec": codec, "block_size": 4}}
    built.update({"appends": sizes} if rows is None else {"rows": rows})
    return Case(f"{cls}-{codec}", built, build)


def _latent(cls: str, codec: str | None, start: int, paged: bool) -> Case:
    """Three rows (5, 2 and 0 tokens) of a latent layout with a DSA index plane."""

    def build(impl: Any) -> list[Any]:
        spec = None if codec is None else _CODECS[codec]
        rng = np.random.default_rng(4)
        pool = None
        if paged:
            pool = impl.LatentBlockPool(spec, block_size=3, index_head_dim=LATENT_WIDTHS[2])
        rows = []
        for n in (5, 2, 0):
            kwargs: dict[str, Any] = {} if spec is None else {"codec": spec, "start": start}
            if paged:
                cache = impl.PagedLatentCache(*LATENT_WIDTHS, pool=pool, **kwargs)
            else:
                cache = getattr(impl, cls)(*LATENT_WIDTHS, **kwargs)
            if n:
                blocks = [
                    rng.standard_normal((1, 1, n, w)).astype(np.float32) for w in LATENT_WIDTHS
                ]
                cache.append(*(_native(impl, b) for b in blocks))
            rows.append(cache)
        layout = rows[0].make_empty_batch()
        layout.merge_rows(rows)
        return [layout]

    built: dict[str, Any] = {"class": cls, "widths": LATENT_WIDTHS, "rows": [5, 2, 0]}
    if codec is not None:
        built.update(codec=codec, start=start)
    if paged:
        built["pool"] = {"block_size": 3}
    return Case(f"{cls}-{codec or 'plain'}", built, build)


def _recurrent(batched: bool) -> Case:
    """A written SSMCache (conv bfloat16 [1, 3, 12], state float32 [1, 2, 4, 8], 5 tokens);
    batched: it, an empty one and one of 2 tokens merged."""

    def serial(impl: Any, seed: int, tokens: int) -> Any:
        rng = np.random.default_rng(seed)
        cache = impl.SSMCache()
        cache[0] = _native(impl, rng.standard_normal((1, 3, 12)).astype(np.float32), "bfloat16")
        cache[1] = _native(impl, rng.standard_normal((1, 2, 4, 8)).astype(np.float32))
        cache.advance(tokens)
        return cache

    def build(impl: Any) -> list[Any]:
        if not batched:
            return [serial(impl, 5, 5)]
        layout = impl.BatchedSSMCache()
        layout.merge_rows([serial(impl, 5, 5), impl.SSMCache(), serial(impl, 6, 2)])
        return [layout]

    cls = "BatchedSSMCache" if batched else "SSMCache"
    built = {"class": cls, "conv": [3, 12, "bfloat16"], "state": [2, 4, 8, "float32"]}
    return Case(cls, built, build)


def _layers() -> Case:
    """Three layers in one file: plain, quantized, ring."""

    def build(impl: Any) -> list[Any]:
        return [
            _fill(impl, impl.KVCache(), [8], 7, "float32"),
            _fill(impl, impl.QuantizedKVCache(group_size=32, bits=8), [8], 8, "float32"),
            _fill(impl, impl.RotatingKVCache(max_size=8, keep=0), [8], 9, "float32"),
        ]

    built = {
        "layers": ["KVCache", "QuantizedKVCache(32, 8)", "RotatingKVCache(8, 0)"],
        "appends": [8],
    }
    return Case("three-layers", built, build, store=True)


def _stored(case: Case) -> Case:
    return Case(case.name, case.built, case.build, store=True)


def cases() -> list[Case]:
    ring = {"max_size": 4, "keep": 0}
    ring_keep = {"max_size": 6, "keep": 2}
    quant4, quant8 = {"group_size": 32, "bits": 4}, {"group_size": 32, "bits": 8}
    ring_quant = {"max_size": 4, "group_size": 32, "bits": 4, "keep": 1}
    turbo = {"k_bits": 8, "v_bits": 3}
    return [
        # serial storages, every codec; 8 tokens so the prefix store takes them whole
        _stored(_serial("KVCache", {}, [5, 3], "float16")),
        _serial("KVCache", {}, [3, 1], "bfloat16"),
        _stored(_serial("QuantizedKVCache", quant4, [5, 3])),
        _serial("QuantizedKVCache", quant8, [3, 1]),
        _stored(_serial("TurboQuantKVCache", turbo, [5, 3])),
        _serial("TurboQuantKVCache", {"k_bits": 4, "v_bits": 2}, [3, 1]),
        _serial("RotatingKVCache", ring, [3, 1, 1, 1]),  # wrapped
        _serial("RotatingKVCache", ring_keep, [4, 1, 1, 1, 1]),
        _stored(_serial("RotatingKVCache", {"max_size": 8, "keep": 0}, [5, 3])),
        _serial("RotatingQuantizedKVCache", ring_quant, [3, 1, 1, 1]),
        # layouts: two rows, then decode appends (the rings wrap)
        _layout("PaddedKVRows", {}, [[3], [1]], 1),
        _layout("BatchedKVCache", {}, [[3], [1]], 1),
        _layout("PaddedQuantKVRows", quant4, [[3], [1]], 1),
        _layout("BatchedQuantizedKVCache", quant8, [[3], [1]], 1),
        _layout("BatchedTurboQuantKVCache", turbo, [[3], [1]], 1),
        _layout("BatchedRotatingCache", ring, [[3], [2]], 2),
        _layout("RaggedRotatingRows", ring_keep, [[5], [2]], 2),
        _layout("SpeculativeRotatingKVCache", ring, [[3], [2]], 2),
        _layout("BatchedRotatingQuantCache", ring_quant, [[3], [2]], 2),
        _layout("RotatingAffineLayout", ring_quant, [[3], [2]], 2),
        _layout("SpeculativeRotatingAffineLayout", ring_quant, [[3], [2]], 2),
        # bf16-first legos, before and after their conversion; delayed layouts of them
        _lego("Bf16FirstQuantizedKVCache", {**quant4, "start": 3}, [2]),
        _stored(_lego("Bf16FirstQuantizedKVCache", {**quant4, "start": 3}, [5, 3])),
        _lego(
            "Bf16FirstRotatingQuantizedKVCache",
            {"max_size": 6, **quant4, "keep": 0, "start": 3},
            [5, 1],
        ),
        _lego("Bf16FirstTurboQuantKVCache", {**turbo, "start": 3}, [5]),
        _delayed("DelayedQuantizedKVCache", {**quant4, "start": 3}, [5, 2]),
        _delayed(
            "DelayedRotatingQuantizedKVCache",
            {"max_size": 6, **quant4, "keep": 0, "start": 3},
            [5, 2],
        ),
        _delayed("DelayedTurboQuantKVCache", {**turbo, "start": 3}, [5, 2]),
        # paged, every codec
        _stored(_paged("plain", None, [5, 3])),
        _paged("affine4", None, [5, 3]),
        _paged("turbo", None, [5, 3]),
        _paged("plain", [[5], [2]], []),
        _paged("affine8", [[5], [2]], []),
        # latent
        _latent("MLACache", None, 0, paged=False),
        _latent("EncodedLatentCache", "affine4", 3, paged=False),
        _latent("EncodedLatentCache", "turbo", 0, paged=False),
        _latent("PagedLatentCache", None, 0, paged=True),
        _latent("PagedLatentCache", "affine4", 3, paged=True),
        # recurrent
        _recurrent(batched=False),
        _recurrent(batched=True),
        _layers(),
    ]


# -- writing ---------------------------------------------------------------------------------


def _store_tokens(index: int, count: int) -> list[int]:
    """Distinct token ids per entry, so no two entries share a block."""
    return [1000 * (index + 1) + t for t in range(count)]


def write(out: Path) -> dict[str, Any]:
    """Write every case of both implementations under ``out``; returns the manifest."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    records: list[dict[str, Any]] = []
    with mx.stream(mx.cpu):
        stores = {
            implementation: PrefixStore(
                out / f"prefix_store_{implementation}",
                byte_budget=1 << 30,
                block_tokens=STORE_BLOCK_TOKENS,
                fingerprint=STORE_FINGERPRINT,
            )
            for implementation in IMPLEMENTATIONS
        }
        for index, case in enumerate(cases()):
            record: dict[str, Any] = {"name": case.name, "built": case.built, "live": {}}
            record["prompt_cache"] = {}
            for implementation, impl in IMPLEMENTATIONS.items():
                caches = case.build(impl)
                # The digest probes (appends a token), so it reads a twin built alike.
                record["live"][implementation] = {
                    "layers": [layer_facts(cache) for cache in caches],
                    "content_digest": content_digest(case.build(impl)),
                }
                relative = f"prompt_cache/{implementation}/{case.name}.safetensors"
                (out / relative).parent.mkdir(parents=True, exist_ok=True)
                save_prompt_cache(out / relative, caches, {"fixture": case.name})
                record["prompt_cache"][implementation] = relative
                if case.store:
                    tokens = _store_tokens(index, int(caches[0].offset))
                    stored = stores[implementation].put(tokens, caches)
                    if stored != len(tokens):
                        raise SystemExit(f"{case.name}: the store kept {stored} of {len(tokens)}")
                    record["prefix_store"] = {"tokens": tokens}
            records.append(record)
    for implementation in IMPLEMENTATIONS:  # the store makes its lock again
        (out / f"prefix_store_{implementation}" / ".lock").unlink(missing_ok=True)
    _check_coverage(records)
    manifest = {
        "prompt_cache_format": FORMAT_VERSION,
        "prefix_store_format": STORE_FORMAT_VERSION,
        "prefix_store": {"block_tokens": STORE_BLOCK_TOKENS, "fingerprint": STORE_FINGERPRINT},
        "content_digest": DIGEST_RULE,
        "cases": records,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _check_coverage(records: list[dict[str, Any]]) -> None:
    """Every class either implementation can save has a file (``kvrows classes``)."""
    saved = {
        layer["class"]
        for record in records
        for live in record["live"].values()
        for layer in live["layers"]
    }
    for implementation, impl in IMPLEMENTATIONS.items():
        missing = set(impl.declared_classes()) - saved
        if missing:
            raise SystemExit(f"no file for {implementation}'s {sorted(missing)}")


def main(argv: Sequence[str]) -> None:
    root = Path(__file__).resolve().parent.parent
    out = Path(argv[0]) if argv else root / "tests" / "data" / f"saved_v{FORMAT_VERSION}"
    manifest = write(out)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{len(manifest['cases'])} cases, {size} bytes, in {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
