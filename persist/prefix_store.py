"""Token prefixes on disk: saved rows found by block hash chain, LRU under a byte budget.

A prompt is cut into blocks of ``block_tokens`` token ids. Block ``j``'s hash chains block
``j - 1``'s hash with the block's ids, and the chain is seeded by a fingerprint of the
model and storage scheme, so stores made for other models or schemes never match. One
**entry** is the per-layer serial caches of one request's prefix at a block boundary,
saved as one crash-safe file named by its last block's hash; its metadata holds the exact
token ids, so a hash collision is a miss, never wrong rows.

Directory layout (``spec/prefix-store.md``)::

    DIR/.lock                          advisory lock (fcntl.flock) for every change
    DIR/entries/<hash>.safetensors     an entry: the caches of the first m blocks
    DIR/entries/<hash>.chain           the block hashes it marked (eviction removes them)
    DIR/blocks/<hash_j>/<hash>         marker: entry <hash> can serve the first j blocks

Writers (``put``, eviction, removal of a corrupt entry) hold the lock; readers do not. A
file is replaced by an atomic rename, so a reader loads a whole entry or finds none; a
reader that loses a race with eviction sees a miss, and an entry that fails to load while
its file is still there is re-checked under the lock and deleted if it is corrupt.

A store whose directory cannot be written (mounted read-only, no permission) still serves
hits: the first refused write makes it read-only, said once (``PrefixStoreWarning``), and
from then on it skips recency, saves, eviction and repairs. A lock that cannot be opened
(e.g. ``.lock`` is a directory) costs a reader its repairs, with a warning, never an error.
"""

from __future__ import annotations

import errno as errno_codes
import fcntl
import hashlib
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import numpy as np

from kvrows.errors import InvalidInputError, KvRowsError, StateWriteError, UnsupportedStateError
from kvrows.protocols import Cache, Handover, ReusableOffset
from kvrows.table import owned_cache_layout

__all__ = [
    "FORMAT_VERSION",
    "READABLE_VERSIONS",
    "LoadPayload",
    "PrefixStore",
    "PrefixStoreWarning",
    "SavePayload",
    "StoredEntry",
    "reusable_copies",
    "servable_prefixes",
]

#: Bumped when the store's directory layout or metadata changes meaning. Version 2: its
#: entries are prompt-cache files of format 2 (layer entries carry their form version).
FORMAT_VERSION = "2"
#: The versions whose entries this store serves: version 1's load through
#: ``kvrows.forms_v1``, so a store written before the bump keeps its hits.
READABLE_VERSIONS = ("1", "2")
#: The version in the key derivation: unchanged since version 1 (the block hashes, and so
#: the entry paths, are the same), so entries of every readable version are found.
_KEY_VERSION = "1"
TOKENS_KEY = "kvrows_prefix_tokens"
FINGERPRINT_KEY = "kvrows_prefix_fingerprint"
VERSION_KEY = "kvrows_prefix_version"

#: ``save(path, caches, metadata)``: write the caches and metadata to ``path`` atomically.
SavePayload = Callable[[Path, Sequence[Cache], Mapping[str, str]], None]
#: ``load(path) -> (caches, metadata)``; raises ``KvRowsError`` or ``OSError`` on failure.
LoadPayload = Callable[[Path], tuple[list[Cache], dict[str, str]]]

_SUFFIX = ".safetensors"
_T = TypeVar("_T")

# What a write into a read-only mount or a directory this process may not change raises.
_READ_ONLY_ERRNOS = frozenset({errno_codes.EROFS, errno_codes.EACCES, errno_codes.EPERM})


class PrefixStoreWarning(RuntimeWarning):
    """The store skipped something it could not do (a read-only directory, a lock that
    cannot be opened); lookups and the caller go on."""


def _default_save(path: Path, caches: Sequence[Cache], metadata: Mapping[str, str]) -> None:
    from kvrows.persist.prompt_cache import save_prompt_cache

    save_prompt_cache(path, caches, metadata)


def _default_load(path: Path) -> tuple[list[Cache], dict[str, str]]:
    from kvrows.persist.prompt_cache import load_prompt_cache

    # require_checksum: an entry is always kvrows' own file, so one without a checksum
    # (e.g. its checksum key's name damaged) is refused, never loaded unverified.
    caches, metadata = load_prompt_cache(path, return_metadata=True, require_checksum=True)
    return list(caches), dict(metadata)


def _describe(error: OSError) -> str:
    """The OS error as "read-only file system (EROFS)", or the error itself without errno."""
    name = errno_codes.errorcode.get(error.errno or 0)
    if name is None:
        return str(error)
    text = os.strerror(error.errno or 0)
    return f"{text[:1].lower()}{text[1:]} ({name})"


def _exists(path: Path) -> bool:
    """``path.exists()``, but an unreadable path (EACCES...) is absent rather than an error."""
    try:
        return path.exists()
    except OSError:
        return False


def _block_hash(previous: bytes, block: Sequence[int]) -> bytes:
    """The chain step: the previous hash and one block's token ids (int64, little-endian)."""
    return hashlib.sha256(previous + np.asarray(block, dtype="<i8").tobytes()).digest()


def servable_prefixes(caches: Sequence[Cache], lengths: Sequence[int]) -> set[int]:
    """Those of ``lengths`` every layer of the serial ``caches`` can be cut to and reused.

    A layer serves ``t`` positions when its decode layout allows publishing its row at
    ``t`` (``can_publish_row``: a wrapped ring only at its full length) and ``t`` is not
    below its ``minimum_reusable_offset`` (a converted bf16-first lego's prefix before its
    conversion is not what a fresh run would hold). A lego is judged by its storage. The
    caches are only borrowed."""
    servable = {t for t in lengths if t > 0}
    for cache in caches:
        if not servable:
            break
        if isinstance(cache, ReusableOffset):
            servable = {t for t in servable if t >= int(cache.minimum_reusable_offset)}
        storage = cache.storage if isinstance(cache, Handover) else cache
        layout = owned_cache_layout(storage)
        if layout is None:
            return set()
        layout.merge_rows([storage])
        servable = {t for t in servable if layout.can_publish_row(0, t)}
    return servable


def reusable_copies(caches: Sequence[Cache], tokens: int) -> list[Cache] | None:
    """Owned copies of serial ``caches`` cut to their first ``tokens`` positions, or
    ``None`` when some layer cannot serve that prefix (``servable_prefixes``). A lego is
    copied through its storage and comes back as a lego of the same phase
    (``composed.over``, its ``minimum_reusable_offset`` kept)."""
    if tokens <= 0:
        return None
    out: list[Cache] = []
    for cache in caches:
        if isinstance(cache, ReusableOffset) and tokens < int(cache.minimum_reusable_offset):
            return None
        storage = cache.storage if isinstance(cache, Handover) else cache
        layout = owned_cache_layout(storage)
        if layout is None:
            return None
        layout.merge_rows([storage])
        if not layout.can_publish_row(0, tokens):
            return None
        copy = layout.extract_row(0)
        copy.trim(int(copy.offset) - tokens)
        if isinstance(cache, Handover):
            minimum = cache.minimum_reusable_offset if cache.converted else None
            copy = cache.composed.over(copy, minimum_reusable_offset=minimum)
        out.append(copy)
    return out


@dataclass(frozen=True)
class StoredEntry:
    """One entry on disk: its key (last block hash), file size and recency stamp."""

    key: str
    nbytes: int
    last_used_ns: int


def _check_tokens(tokens: Sequence[int], what: str) -> tuple[int, ...]:
    out = tuple(tokens)
    for token in out:
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise InvalidInputError(f"{what}: token ids must be integers, got {token!r}")
        if not 0 <= int(token) < 2**63:
            raise InvalidInputError(f"{what}: token ids must be in [0, 2**63), got {token}")
    return tuple(int(t) for t in out)


def _parse_tokens(text: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(t) for t in text.split(",")) if text else ()
    except ValueError:
        return None


class PrefixStore:
    """Saved rows of token prefixes in ``directory``, shared by any number of processes.

    ``byte_budget`` caps the bytes of the entry files: after each ``put`` the least
    recently used entries are deleted until the rest fit (a hit refreshes an entry's
    recency). ``fingerprint`` names the model and storage scheme the rows belong to; it
    seeds the hash chain and is checked on every load. ``save`` / ``load`` write and read
    one entry's caches with metadata (default: ``kvrows.persist.prompt_cache``); ``clock``
    gives the recency stamps (seconds). ``read_only`` becomes true once the directory
    refuses a write (see the module's docstring)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        byte_budget: int,
        block_tokens: int = 16,
        fingerprint: str = "",
        save: SavePayload | None = None,
        load: LoadPayload | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if isinstance(byte_budget, bool) or not isinstance(byte_budget, int) or byte_budget < 0:
            raise InvalidInputError(f"byte_budget must be an int >= 0, got {byte_budget!r}")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise InvalidInputError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
        if not isinstance(fingerprint, str):
            raise InvalidInputError(f"fingerprint must be a str, got {type(fingerprint).__name__}")
        self.directory = Path(directory)
        self.byte_budget = byte_budget
        self.block_tokens = block_tokens
        self.fingerprint = fingerprint
        self._save: SavePayload = save or _default_save
        self._load: LoadPayload = load or _default_load
        self._clock = clock
        self._entries = self.directory / "entries"
        self._blocks = self.directory / "blocks"
        self._lock_path = self.directory / ".lock"
        self.read_only = False
        self._warned: set[str] = set()
        try:
            self._entries.mkdir(parents=True, exist_ok=True)
            self._blocks.mkdir(exist_ok=True)
        except OSError as error:
            # A read-only directory that exists is a store with nothing to add to.
            if not (self.directory.is_dir() and self._note_unwritable(error, "creating")):
                raise InvalidInputError(
                    f"prefix store directory {self.directory} cannot be used: {error}"
                ) from error
        self._seed = hashlib.sha256(
            f"kvrows-prefix-store-v{_KEY_VERSION}\0{fingerprint}".encode()
        ).digest()

    # -- keys -----------------------------------------------------------------------------
    def chain(self, tokens: Sequence[int]) -> list[str]:
        """The hex hashes of the full blocks of ``tokens``, in order."""
        hashes: list[str] = []
        previous = self._seed
        size = self.block_tokens
        for start in range(0, len(tokens) - size + 1, size):
            previous = _block_hash(previous, tokens[start : start + size])
            hashes.append(previous.hex())
        return hashes

    def _entry_path(self, key: str) -> Path:
        return self._entries / f"{key}{_SUFFIX}"

    def _chain_path(self, key: str) -> Path:
        return self._entries / f"{key}.chain"

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's exclusive lock; a lock file that cannot be opened raises
        ``StateWriteError`` (errno kept) naming it."""
        try:
            handle = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            wrapped = StateWriteError(
                f"prefix store lock {self._lock_path} cannot be opened: "
                f"{_describe(error)}; nothing was changed"
            )
            wrapped.errno = error.errno
            raise wrapped from error
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
            yield
        finally:
            os.close(handle)  # closing releases the lock

    def _warn_once(self, topic: str, message: str) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            warnings.warn(message, PrefixStoreWarning, stacklevel=4)

    def _note_unwritable(self, error: OSError, doing: str) -> bool:
        """Whether ``error`` says the directory cannot be written; if so the store is
        read-only from now on, which is said once."""
        if error.errno not in _READ_ONLY_ERRNOS:
            return False
        self.read_only = True
        self._warn_once(
            "read-only",
            f"prefix store {self.directory} is read-only ({_describe(error)} while {doing}): "
            "it serves the entries it holds but no longer saves, evicts or refreshes recency",
        )
        return True

    def _repair(self, action: Callable[[], _T], fallback: _T, doing: str) -> _T:
        """A reader's ``action`` under the lock, or ``fallback`` when the store is
        read-only or the lock or the action fails (said once): never raises."""
        if self.read_only:
            return fallback
        try:
            with self._locked():
                return action()
        except OSError as error:
            if not self._note_unwritable(error, doing):
                self._warn_once(
                    "repair",
                    f"prefix store {self.directory}: {doing} failed: {error}; damaged or "
                    "stale entries are skipped as misses but not removed",
                )
            return fallback

    def _touch(self, path: Path) -> None:
        """Refresh ``path``'s recency; best effort (recency only orders eviction)."""
        if self.read_only:
            return
        stamp = int(self._clock() * 1e9)
        try:
            os.utime(path, ns=(stamp, stamp))
        except FileNotFoundError:
            pass  # evicted meanwhile: nothing to refresh
        except OSError as error:
            if not self._note_unwritable(error, "refreshing recency"):
                self._warn_once(
                    "recency",
                    f"prefix store {self.directory}: cannot refresh recency ({error})",
                )

    # -- writing --------------------------------------------------------------------------
    def put(self, tokens: Sequence[int], caches: Sequence[Cache]) -> int:
        """Store the prefix of ``tokens`` that ends at the last block boundary the caches
        can be cut to; ``caches`` (per-layer serial caches, each covering exactly
        ``len(tokens)`` positions) are only read. Returns the tokens stored (0: nothing,
        when no boundary is servable, the entry alone exceeds the budget, or the store is
        read-only: then a ``PrefixStoreWarning`` says so once and nothing is written)."""
        tokens = _check_tokens(tokens, "put")
        if not caches:
            raise InvalidInputError("put: no caches given; expected one serial cache per layer")
        for layer, cache in enumerate(caches):
            if not isinstance(cache, Cache) or not isinstance(cache.offset, int):
                raise InvalidInputError(
                    f"put: layer {layer} is {type(cache).__name__}; expected a serial cache"
                )
            if cache.offset != len(tokens):
                raise InvalidInputError(
                    f"put: layer {layer} covers {cache.offset} positions; the tokens are "
                    f"{len(tokens)} (a row must cover exactly its tokens)"
                )
        if self.read_only:
            return 0  # said when it became read-only
        size = self.block_tokens
        boundaries = [j * size for j in range(1, len(tokens) // size + 1)]
        servable = servable_prefixes(caches, boundaries[-1:])
        if not servable:
            # Only a full-attention row can be cut anywhere; try the others' boundaries.
            servable = servable_prefixes(caches, boundaries)
        if not servable:
            return 0
        stored = max(servable)
        row = list(caches) if stored == len(tokens) else reusable_copies(caches, stored)
        if row is None:
            return 0
        levels = servable_prefixes(row, boundaries[: stored // size - 1])
        hashes = self.chain(tokens[:stored])
        key = hashes[-1]
        metadata = {
            TOKENS_KEY: ",".join(map(str, tokens[:stored])),
            FINGERPRINT_KEY: self.fingerprint,
            VERSION_KEY: FORMAT_VERSION,
        }
        marked = [hashes[t // size - 1] for t in sorted(levels)]
        try:
            with self._locked():
                self._remove_markers(key)  # an entry replaced under the same key
                path = self._entry_path(key)
                self._save(path, row, metadata)
                self._touch(path)
                self._write_chain(key, marked)
                for block in marked:
                    (self._blocks / block).mkdir(exist_ok=True)
                    (self._blocks / block / key).touch()
                self._evict_locked()
                return stored if path.exists() else 0
        except OSError as error:  # StateWriteError is one too
            if self._note_unwritable(error, "saving an entry"):
                return 0
            raise

    def _write_chain(self, key: str, hashes: list[str]) -> None:
        target = self._chain_path(key)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        temporary.write_text("\n".join(hashes))
        os.replace(temporary, target)

    def _remove_markers(self, key: str) -> None:
        """Under the lock: forget the markers of entry ``key`` (its chain file says which)."""
        chain = self._chain_path(key)
        try:
            blocks = [b for b in chain.read_text().split("\n") if b]
        except FileNotFoundError:
            return
        for block in blocks:
            self._forget_marker(block, key)
        self._unlink(chain)

    def _forget_marker(self, block: str, key: str) -> None:
        self._unlink(self._blocks / block / key)
        with suppress(OSError):  # other entries still mark the block
            (self._blocks / block).rmdir()

    @staticmethod
    def _unlink(path: Path) -> None:
        with suppress(FileNotFoundError):
            path.unlink()

    def _remove_locked(self, key: str) -> None:
        self._remove_markers(key)
        self._unlink(self._entry_path(key))

    def _evict_locked(self) -> None:
        """Under the lock: delete least recently used entries until the rest fit, and the
        temporary files of writers that died (every write happens under the lock, so a
        temporary file seen while holding it is debris)."""
        for name in os.listdir(self._entries):
            if name.startswith("."):
                self._unlink(self._entries / name)
        entries = self.entries()
        total = sum(entry.nbytes for entry in entries)
        for entry in sorted(entries, key=lambda e: (e.last_used_ns, e.key)):
            if total <= self.byte_budget:
                break
            self._remove_locked(entry.key)
            total -= entry.nbytes

    # -- reading --------------------------------------------------------------------------
    def entries(self) -> list[StoredEntry]:
        """The entries on disk now (a snapshot)."""
        out: list[StoredEntry] = []
        try:
            names = os.listdir(self._entries)
        except FileNotFoundError:
            return out
        for name in names:
            if name.startswith(".") or not name.endswith(_SUFFIX):
                continue
            key = name[: -len(_SUFFIX)]
            try:
                stat = os.stat(self._entries / name)
            except FileNotFoundError:
                continue
            out.append(StoredEntry(key, stat.st_size, stat.st_mtime_ns))
        return out

    def __len__(self) -> int:
        return len(self.entries())

    @property
    def nbytes(self) -> int:
        """Bytes of the entry files on disk now."""
        return sum(entry.nbytes for entry in self.entries())

    def longest(
        self, tokens: Sequence[int], *, limit: int | None = None, beyond: int = 0
    ) -> tuple[int, list[Cache]] | None:
        """The longest stored prefix of ``tokens`` at a block boundary, at most ``limit``
        tokens and more than ``beyond``, that every layer can serve: ``(matched, caches)``
        with fresh serial caches of exactly ``matched`` positions, or ``None``.

        An engine passes ``limit = len(prompt) - 1`` (one prompt token is left to compute)
        and ``beyond`` = its in-memory hit. A missing, corrupt or mismatched entry is a
        miss, never an error; a corrupt one is deleted."""
        tokens = _check_tokens(tokens, "longest")
        for name, value in (("limit", limit), ("beyond", beyond)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidInputError(f"longest: {name} must be an int, got {value!r}")
        most = len(tokens) if limit is None else max(0, min(limit, len(tokens)))
        size = self.block_tokens
        hashes = self.chain(tokens[: most - most % size])
        tried: set[str] = set()
        dangling: list[tuple[str, str]] = []
        for level in range(len(hashes), 0, -1):
            matched = level * size
            if matched <= beyond:
                break
            block = hashes[level - 1]
            for key in self._candidates(block, tried, dangling):
                caches = self._try_load(key, tokens[:matched])
                if caches is not None:
                    self._touch(self._entry_path(key))
                    self._clean(dangling)
                    return matched, caches
        self._clean(dangling)
        return None

    def _candidates(
        self, block: str, tried: set[str], dangling: list[tuple[str, str]]
    ) -> Iterator[str]:
        """Entries that may serve the blocks up to ``block``: the entry ending there,
        then the longer entries that marked it, most recently used first."""
        if block not in tried:
            tried.add(block)
            yield block
        try:
            marked = os.listdir(self._blocks / block)
        except OSError:  # none, not a directory, unreadable: no longer entries to offer
            return
        stamped: list[tuple[int, str]] = []
        for key in marked:
            if key in tried:
                continue
            try:
                stamped.append((os.stat(self._entry_path(key)).st_mtime_ns, key))
            except FileNotFoundError:
                dangling.append((block, key))
            except OSError:
                continue  # unreadable: not a candidate
        for _, key in sorted(stamped, reverse=True):
            tried.add(key)
            yield key

    def _try_load(self, key: str, prefix: tuple[int, ...]) -> list[Cache] | None:
        """Entry ``key``'s caches cut to ``len(prefix)``, if it really holds ``prefix``."""
        path = self._entry_path(key)
        if not _exists(path):
            return None
        loaded, _ = self._load_or_error(path)
        if loaded is None:
            if not _exists(path):
                return None  # lost a race with eviction: a miss
            # Under the lock no writer can replace or evict it while we look again.
            loaded = self._repair(
                lambda: self._recheck_locked(key, path), None, "removing a damaged entry"
            )
            if loaded is None:
                return None
        caches, metadata = loaded
        mx.eval([cache.state for cache in caches])  # owned and read now, not from the file later
        stored = _parse_tokens(metadata.get(TOKENS_KEY, ""))
        if (
            stored is None
            or metadata.get(FINGERPRINT_KEY) != self.fingerprint
            or metadata.get(VERSION_KEY) not in READABLE_VERSIONS
            or stored[: len(prefix)] != prefix  # a hash collision, or a replaced entry
            or any(cache.offset != len(stored) for cache in caches)
        ):
            return None
        if len(stored) == len(prefix):
            return caches if servable_prefixes(caches, [len(prefix)]) else None
        return reusable_copies(caches, len(prefix))

    def _recheck_locked(self, key: str, path: Path) -> tuple[list[Cache], dict[str, str]] | None:
        """Under the lock: entry ``key`` loaded again, or None and, if it is still there
        and corrupt, removed. Kept: another version's file (``UnsupportedStateError``) and
        one this process cannot read (an ``OSError``: permission, I/O), not known corrupt."""
        loaded, error = self._load_or_error(path)
        if (
            loaded is None
            and path.exists()
            and not isinstance(error, UnsupportedStateError | OSError)
        ):
            self._remove_locked(key)  # corrupt: a miss, and gone
        return loaded

    def _load_or_error(
        self, path: Path
    ) -> tuple[tuple[list[Cache], dict[str, str]] | None, Exception | None]:
        """The entry's caches and metadata, or the error loading it raised. A file of a
        newer or unknown format (``UnsupportedStateError``) is another version's: kept."""
        try:
            return self._load(path), None
        except (KvRowsError, OSError) as error:
            return None, error

    def _clean(self, dangling: list[tuple[str, str]]) -> None:
        """Remove markers whose entry was found missing (checked again under the lock)."""
        if not dangling:
            return

        def forget() -> None:
            for block, key in dangling:
                if not self._entry_path(key).exists():
                    self._forget_marker(block, key)

        self._repair(forget, None, "removing stale markers")

    def clear(self) -> None:
        """Delete every entry (under the lock)."""
        with self._locked():
            for entry in self.entries():
                self._remove_locked(entry.key)
