"""A prefix store that cannot be written (mounted read-only, no permission) or whose lock
is damaged: lookups serve what it holds and never raise; ``put`` skips with one warning;
the engine and ``kvrows demo`` run on.

The tests run as root, where chmod does not stop a write, so a read-only directory is
simulated by making the calls that write raise ``EROFS`` / ``EACCES``, as the kernel does
on a read-only mount or without permission; a real chmod-ed directory is tested where the
test's user is not root."""

from __future__ import annotations

import builtins
import errno
import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from kvrows.app.cli import main
from kvrows.app.demo import builtin_trace
from kvrows.app.engine import Engine, model_fingerprint
from kvrows.app.models import tiny_model
from kvrows.errors import StateWriteError
from kvrows.optimized import KVCache
from kvrows.persist.prefix_store import PrefixStore, PrefixStoreWarning
from kvrows.protocols import Cache
from kvrows.schemes import KvStorageScheme

BLOCK = 2
TOKENS = (101, 102, 103, 104)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _row(tokens: tuple[int, ...]) -> list[Cache]:
    """One layer whose position ``p`` holds the value ``tokens[p]`` (its own oracle)."""
    cache = KVCache()
    values = np.array(tokens, dtype=np.float32).reshape(1, 1, len(tokens), 1)
    cache.update_and_fetch(mx.array(values), mx.array(values + 0.5))
    return [cache]


def _holds(caches: list[Cache], tokens: tuple[int, ...]) -> bool:
    keys, values = caches[0].state[:2]
    expected = np.array(tokens, dtype=np.float32).reshape(1, 1, len(tokens), 1)
    return bool(
        np.array_equal(np.array(keys)[..., : len(tokens), :], expected)
        and np.array_equal(np.array(values)[..., : len(tokens), :], expected + 0.5)
    )


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``directory`` with its size and modification time."""
    out: dict[str, tuple[int, int]] = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            status = os.lstat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), directory)] = (
                status.st_size,
                status.st_mtime_ns,
            )
    return out


@pytest.fixture
def unwritable(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Call ``unwritable.append(code)`` to make every write raise ``OSError(code)`` from
    then on: opening for writing, creating, renaming, removing, stamping times."""
    codes: list[int] = []

    def refuse(path: object) -> None:
        if codes:
            raise OSError(codes[0], os.strerror(codes[0]), str(path))

    real_open, real_builtin_open = os.open, builtins.open

    def guarded_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & _WRITE_FLAGS:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    def guarded_builtin_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(letter in mode for letter in "wax+"):
            refuse(file)
        return real_builtin_open(file, mode, *args, **kwargs)

    def guard(name: str) -> None:
        real = getattr(os, name)

        def guarded(path: Any, *args: Any, **kwargs: Any) -> Any:
            refuse(path)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, name, guarded)

    monkeypatch.setattr(os, "open", guarded_open)
    monkeypatch.setattr(builtins, "open", guarded_builtin_open)
    for name in ("utime", "replace", "rename", "unlink", "remove", "mkdir", "rmdir"):
        guard(name)
    yield codes


def _entry(store: PrefixStore, tokens: tuple[int, ...]) -> Path:
    return store.directory / "entries" / f"{store.chain(tokens)[-1]}.safetensors"


def _damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # a bit of the data: the checksum refuses it
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("code", [errno.EROFS, errno.EACCES])
def test_a_read_only_store_serves_hits_and_skips_writes(
    tmp_path: Path, unwritable: list[int], code: int
) -> None:
    """Hits come back whole; recency, saves, eviction and the removal of a damaged entry
    are skipped; one warning says the store is read-only; nothing on disk changes."""
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
    damaged = (7, 8, 9, 10)
    for tokens in (TOKENS, damaged):
        assert store.put(tokens, _row(tokens)) == 4
    _damage(_entry(store, damaged))
    before = _snapshot(tmp_path)
    unwritable.append(code)
    with pytest.warns(PrefixStoreWarning, match="read-only") as caught:
        hit = store.longest(TOKENS)
        assert hit is not None and hit[0] == 4 and _holds(hit[1], TOKENS)
        hit = store.longest((*TOKENS[:2], 0, 0))  # through a marker: a cut copy
        assert hit is not None and hit[0] == 2 and _holds(hit[1], TOKENS[:2])
        assert store.longest(damaged) is None  # a miss, not removed
        assert store.put((1, 2, 3, 4), _row((1, 2, 3, 4))) == 0  # skipped, not raised
        hit = store.longest(TOKENS)
        assert hit is not None and _holds(hit[1], TOKENS)
    assert len(caught) == 1 and store.read_only
    message = str(caught[0].message)
    assert str(tmp_path) in message and os.strerror(code).lower() in message.lower()
    assert _snapshot(tmp_path) == before


def test_put_on_a_read_only_store_warns_once_and_writes_nothing(
    tmp_path: Path, unwritable: list[int]
) -> None:
    """The first write the store tries is a put: it returns 0 and says why, once."""
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
    before = _snapshot(tmp_path)
    unwritable.append(errno.EROFS)
    with pytest.warns(PrefixStoreWarning, match="read-only") as caught:
        assert store.put(TOKENS, _row(TOKENS)) == 0
        assert store.put(TOKENS, _row(TOKENS)) == 0
        assert store.longest(TOKENS) is None
    assert len(caught) == 1 and _snapshot(tmp_path) == before


def test_a_read_only_directory_without_a_store_is_an_empty_store(
    tmp_path: Path, unwritable: list[int]
) -> None:
    unwritable.append(errno.EROFS)
    with pytest.warns(PrefixStoreWarning, match="read-only"):
        store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, at the start
        assert store.longest(TOKENS) is None and store.put(TOKENS, _row(TOKENS)) == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any permission bits")
def test_a_chmod_read_only_store_serves_hits(tmp_path: Path) -> None:
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
    assert store.put(TOKENS, _row(TOKENS)) == 4
    paths = [Path(root) / name for root, _, names in os.walk(tmp_path) for name in names]
    folders = [Path(root) for root, _, _ in os.walk(tmp_path)]
    try:
        for path in paths:
            path.chmod(stat.S_IRUSR)
        for folder in folders:
            folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
        before = _snapshot(tmp_path)
        reader = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
        with pytest.warns(PrefixStoreWarning, match="read-only"):
            assert reader.put((1, 2, 3, 4), _row((1, 2, 3, 4))) == 0
            hit = reader.longest(TOKENS)
        assert hit is not None and _holds(hit[1], TOKENS)
        assert set(_snapshot(tmp_path)) == set(before)
    finally:
        for folder in folders:
            folder.chmod(stat.S_IRWXU)


# -- a lock that is a directory -----------------------------------------------------------
def test_a_lock_that_is_a_directory_is_a_miss_and_a_warning(tmp_path: Path) -> None:
    """Before: IsADirectoryError out of ``longest``. Now lookups that need the lock (a
    damaged entry, a dangling marker) miss with one warning; hits need no lock; ``put``
    raises ``StateWriteError`` naming the lock (the engine counts it and runs on)."""
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
    damaged = (7, 8, 9, 10)
    for tokens in (TOKENS, damaged):
        assert store.put(tokens, _row(tokens)) == 4
    _damage(_entry(store, damaged))
    (tmp_path / ".lock").unlink()
    (tmp_path / ".lock").mkdir()
    with pytest.warns(PrefixStoreWarning, match=r"\.lock") as caught:
        assert store.longest(damaged) is None
        assert store.longest((*damaged[:2], 0, 0)) is None  # through its marker
        hit = store.longest(TOKENS)
        assert hit is not None and _holds(hit[1], TOKENS)
    assert len(caught) == 1 and not store.read_only
    assert "is a directory" in str(caught[0].message).lower()
    assert _entry(store, damaged).exists()  # left: repairs need the lock
    with pytest.raises(StateWriteError, match=r"\.lock") as raised:
        store.put((1, 2, 3, 4), _row((1, 2, 3, 4)))
    assert raised.value.errno == errno.EISDIR


# -- the engine and the demo --------------------------------------------------------------
def test_the_engine_runs_on_a_read_only_store(tmp_path: Path, unwritable: list[int]) -> None:
    """A store filled by one engine, then read-only: a new engine loads its prefixes and
    gives the same tokens (before: OSError EROFS out of the engine on the first hit)."""
    model = tiny_model("llama")
    scheme = KvStorageScheme.parse("plain")
    trace = builtin_trace(4)

    def engine() -> Engine:
        store = PrefixStore(
            tmp_path, byte_budget=1 << 30, fingerprint=model_fingerprint(model, scheme)
        )
        return Engine(model, scheme, max_batch=4, prefill_chunk=16, prefix_store=store)

    first, cold = engine().run(trace)
    assert cold.store_writes > 0
    before = _snapshot(tmp_path)
    unwritable.append(errno.EROFS)
    with pytest.warns(PrefixStoreWarning, match="read-only") as caught:
        second, warm = engine().run(trace)
    assert len(caught) == 1 and warm.store_hits > 0 and warm.store_errors == 0
    assert [r.tokens for r in second] == [r.tokens for r in first]
    assert _snapshot(tmp_path) == before


def test_kvrows_demo_on_a_read_only_store(
    tmp_path: Path, unwritable: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """A store one demo filled, then read-only: before, the second demo's first disk hit
    was a traceback (EROFS). Now it loads its prefixes, says the store is read-only once,
    and passes its checks."""
    argv = ["demo", "--quiet", "--scheme", "plain", "--requests", "4"]
    argv += ["--prefix-store", str(tmp_path)]
    assert main(argv) == 0
    capsys.readouterr()
    unwritable.append(errno.EROFS)
    with pytest.warns(PrefixStoreWarning, match="read-only"):
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") == 2 and "FAIL" not in out
    table = out.split("prefix store ")[1].splitlines()[3:]
    rows = {line.split()[0]: line.split() for line in table[:2] if line.split()}
    assert int(rows["llama"][2]) > 0  # disk hits, from a read-only store


# -- entries this process cannot read -----------------------------------------------------
def test_an_entry_this_process_cannot_read_is_a_miss_and_kept(tmp_path: Path) -> None:
    """Not known to be corrupt, so not deleted (before: deleted as corrupt)."""
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
    assert store.put(TOKENS, _row(TOKENS)) == 4

    def unreadable(path: Path) -> tuple[list[Cache], dict[str, str]]:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    reader = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK, load=unreadable)
    before = _snapshot(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reader.longest(TOKENS) is None
    assert _snapshot(tmp_path) == before
    hit = store.longest(TOKENS)
    assert hit is not None and _holds(hit[1], TOKENS)


def test_a_directory_in_place_of_an_entry_is_a_miss(tmp_path: Path) -> None:
    """Before: IsADirectoryError out of ``longest`` (removing it as a corrupt file)."""
    store = PrefixStore(tmp_path, byte_budget=1 << 20, block_tokens=BLOCK)
    assert store.put(TOKENS, _row(TOKENS)) == 4
    entry = _entry(store, TOKENS)
    entry.unlink()
    entry.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.longest(TOKENS) is None
        assert store.longest((*TOKENS[:2], 0, 0)) is None
    assert entry.is_dir()
