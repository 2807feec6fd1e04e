"""The crash-safe file layer (kvrows.persist.files): atomic writes, the per-file checksum,
refusal of damaged files, and the fault tests of spec/persistence-files.md.

Oracles: the bytes MLX's own ``mx.save_safetensors`` puts in a file (the checksum is
recomputed from them by the spec's byte format, written out again here), the arrays a
test wrote (compared bit for bit), and processes that are killed or starved for real.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import inspect
import io
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, ClassVar

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrows.conformance.profiles import profile_settings
from kvrows.errors import (
    CorruptStateError,
    InvalidInputError,
    KvRowsError,
    StateReadError,
    StateWriteError,
)
from kvrows.persist import files
from kvrows.persist.files import (
    CHECKSUM_KEY,
    STALE_TEMPORARY_SECONDS,
    TEMPORARY_SUFFIX,
    checksum,
    is_temporary,
    read_safetensors,
    read_verified,
    sweep_temporaries,
    write_atomic,
)

Arrays = dict[str, mx.array]


def version(number: int, elements: int = 256) -> dict[str, mx.array]:
    """The arrays of file version ``number``: several dtypes (bfloat16 among them), a
    transposed view, a scalar, an empty array."""
    base = mx.arange(elements, dtype=mx.float32) * (number + 1) - number
    return {
        "keys": base.reshape(-1, 8).T,
        "values": (base * 0.5).astype(mx.bfloat16),
        "scales": mx.full((3,), number, dtype=mx.float16),
        "count": mx.array(number, dtype=mx.int32),
        "empty": mx.zeros((0, 4), dtype=mx.uint8),
        "mask": mx.arange(5) % (number + 2) == 0,
    }


def version_metadata(number: int) -> dict[str, str]:
    return {"0.version": str(number), "format": "kvrows-test"}


# The writer subprocesses build the versions with this very source, so the parent knows
# exactly what each version holds.
_VERSION_SOURCE = (
    "import mlx.core as mx\n" + inspect.getsource(version) + inspect.getsource(version_metadata)
)

# safetensors tag -> MLX dtype (the oracle reads the file's own tags).
_TAG_DTYPES = {
    "BOOL": mx.bool_,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U16": mx.uint16,
    "I16": mx.int16,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "F32": mx.float32,
    "U64": mx.uint64,
    "I64": mx.int64,
    "C64": mx.complex64,
}


def _bits(array: mx.array) -> np.ndarray:
    """An array's exact bit patterns, row-major (bfloat16 through its 16-bit view)."""
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(array))


def assert_same_arrays(found: Arrays, expected: Arrays) -> None:
    assert sorted(found) == sorted(expected)
    for name, array in expected.items():
        assert found[name].dtype == array.dtype, name
        assert found[name].shape == array.shape, name
        assert _bits(found[name]).tobytes() == _bits(array).tobytes(), name


def _split(data: bytes) -> tuple[dict[str, object], bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _field(value: bytes) -> bytes:
    return len(value).to_bytes(8, "little") + value


def spec_checksum(data: bytes) -> str:
    """The checksum of a file's content, from its raw bytes, by the byte format of
    spec/persistence-files.md (independent of kvrows' in-memory path)."""
    header, payload = _split(data)
    metadata = header.pop("__metadata__", None) or {}
    assert isinstance(metadata, dict)
    stream = [b"kvrows-checksum-v1", len(header).to_bytes(8, "little")]
    for name in sorted(header):
        entry = header[name]
        assert isinstance(entry, dict)
        begin, end = entry["data_offsets"]
        stream += [
            _field(name.encode()),
            _field(entry["dtype"].encode()),
            _field(",".join(str(size) for size in entry["shape"]).encode()),
            _field(payload[begin:end]),
        ]
    entries = sorted(key for key in metadata if key != CHECKSUM_KEY)
    stream.append(len(entries).to_bytes(8, "little"))
    for key in entries:
        stream += [_field(key.encode()), _field(metadata[key].encode())]
    return hashlib.sha256(b"".join(stream)).hexdigest()


def _visible(directory: Path) -> list[str]:
    """What a reader listing the directory takes: names not starting with '.'."""
    return sorted(name for name in os.listdir(directory) if not name.startswith("."))


def _temporaries(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if is_temporary(name))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The bytes of one small valid file (so the exhaustive sweeps stay quick)."""
    path = tmp_path_factory.mktemp("saved") / "state.safetensors"
    write_atomic(path, small_version(), {"0.version": "3"})
    return path.read_bytes()


def small_version() -> dict[str, mx.array]:
    """Four dtypes (bfloat16 among them), a scalar and an empty array in few bytes."""
    arrays = version(3, 8)
    return {name: arrays[name] for name in ("values", "count", "empty", "mask")}


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file path Hypothesis examples overwrite (a module fixture: examples share it)."""
    return tmp_path_factory.mktemp("scratch") / "damaged.safetensors"


def _overwrite(path: Path, data: bytes) -> None:
    """Put ``data`` in ``path`` in place. (Truncating to zero and rewriting, as
    ``write_bytes`` does, makes ext4 flush on close, which is slow across many examples.)"""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.ftruncate(descriptor, len(data))
        os.pwrite(descriptor, data, 0)
    finally:
        os.close(descriptor)


def _refused(path: Path, data: bytes) -> CorruptStateError:
    _overwrite(path, data)
    with pytest.raises(CorruptStateError) as caught:
        read_verified(path)
    assert str(path) in str(caught.value)
    return caught.value


# ------------------------------------------------------------------- round trip, checksum


def test_round_trip_is_bit_exact_and_the_checksum_follows_the_spec(tmp_path: Path) -> None:
    path = tmp_path / "state.bin"  # any name: nothing is appended to it
    arrays, metadata = version(1), version_metadata(1)
    write_atomic(path, arrays, metadata)
    assert _visible(tmp_path) == ["state.bin"] and os.listdir(tmp_path) == ["state.bin"]
    found, found_metadata = read_verified(path)
    assert_same_arrays(found, arrays)
    assert found_metadata == {**metadata, CHECKSUM_KEY: checksum(arrays, metadata)}
    data = path.read_bytes()
    assert found_metadata[CHECKSUM_KEY] == spec_checksum(data)
    # The oracle really reads the file: its arrays are MLX's bytes for ours.
    header, payload = _split(data)
    for name, array in arrays.items():
        entry = header[name]
        assert isinstance(entry, dict)
        begin, end = entry["data_offsets"]
        assert payload[begin:end] == _bits(array).tobytes()
        assert _TAG_DTYPES[entry["dtype"]] == array.dtype


def test_checksum_covers_every_field_and_nothing_else() -> None:
    arrays, metadata = version(2, 16), version_metadata(2)
    base = checksum(arrays, metadata)
    assert len(base) == 64 and int(base, 16) >= 0
    # Not covered: dict order, memory layout, the checksum entry itself.
    assert checksum(dict(reversed(arrays.items())), dict(reversed(metadata.items()))) == base
    contiguous = {**arrays, "keys": mx.array(np.ascontiguousarray(np.asarray(arrays["keys"])))}
    assert checksum(contiguous, metadata) == base
    assert checksum(arrays, {**metadata, CHECKSUM_KEY: "anything"}) == base
    values = arrays["values"]
    changed = [
        checksum({**arrays, "renamed": values}, metadata),  # an extra name
        checksum({k: v for k, v in arrays.items() if k != "values"} | {"valuez": values}, metadata),
        checksum({**arrays, "values": values.view(mx.float16)}, metadata),  # dtype, same bits
        checksum({**arrays, "values": values.reshape(2, 8)}, metadata),  # shape
        checksum({**arrays, "values": values.reshape(1, 16)}, metadata),
        checksum({**arrays, "empty": mx.zeros((4, 0), dtype=mx.uint8)}, metadata),
        checksum({**arrays, "count": mx.array(3, dtype=mx.int32)}, metadata),  # one value
        checksum(arrays, {**metadata, "format": "kvrows-tesT"}),  # a value
        checksum(arrays, {**metadata, "extra": ""}),  # an added key
        checksum(arrays, {"0.version": "2"}),  # a removed key
        # Field boundaries are length-prefixed: no two contents share a byte stream.
        checksum(arrays, {**metadata, "a": "b\nc=d"}),
        checksum(arrays, {**metadata, "a": "b", "c": "d"}),
        checksum(arrays, {**metadata, "ab": ""}),
        checksum(arrays, {**metadata, "a": "b"}),
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_checksum_and_write_refuse_bad_input_and_write_nothing(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    good = version(0, 8)
    bad_arrays: list[object] = [
        [good["keys"]],
        {"": good["keys"]},
        {"__metadata__": good["keys"]},
        {1: good["keys"]},
        {"keys": np.zeros(3)},
        {"keys": mx.zeros(3, dtype=mx.float64)},
        {"\ud800": good["keys"]},
    ]
    for arrays in bad_arrays:
        with pytest.raises(InvalidInputError):
            checksum(arrays, {})  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            write_atomic(path, arrays, {})  # type: ignore[arg-type]
    for metadata in [["a"], {"a": 1}, {2: "b"}, {"a": "\udfff"}]:
        with pytest.raises(InvalidInputError):
            write_atomic(path, good, metadata)  # type: ignore[arg-type]
    for bad_path in [3, None, b"state"]:
        with pytest.raises(InvalidInputError):
            write_atomic(bad_path, good, {})  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            read_verified(bad_path)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        read_verified(path, expect={"a": 1})  # type: ignore[dict-item]
    assert os.listdir(tmp_path) == []


def test_a_target_with_the_longest_name_is_written(tmp_path: Path) -> None:
    """The temporary keeps only a prefix of the target's name (in bytes), so a target
    whose name is at the file system's limit still gets a temporary."""
    path = tmp_path / ("é" * 127 + "x")  # 255 bytes of UTF-8
    write_atomic(path, version(1, 8), {})
    assert os.listdir(tmp_path) == [path.name]
    assert_same_arrays(read_verified(path)[0], version(1, 8))


def test_a_stale_checksum_entry_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    write_atomic(path, version(1), {**version_metadata(1), CHECKSUM_KEY: "0" * 64})
    _, metadata = read_verified(path)
    assert metadata[CHECKSUM_KEY] == spec_checksum(path.read_bytes()) != "0" * 64


def test_loaded_arrays_are_owned_and_evaluated(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    write_atomic(path, version(1), version_metadata(1))
    found, _ = read_verified(path)
    path.unlink()  # nothing is read later from the (now gone) file
    write_atomic(path, version(2), version_metadata(2))
    assert_same_arrays(found, version(1))


def test_concurrent_writers_in_threads_never_collide(tmp_path: Path) -> None:
    path = tmp_path / "state.safetensors"
    failures: list[BaseException] = []

    def writer(number: int) -> None:
        try:
            for _ in range(8):
                write_atomic(path, version(number, 64), version_metadata(number))
        except BaseException as error:  # pragma: no cover - reported below
            failures.append(error)

    threads = [threading.Thread(target=writer, args=(number,)) for number in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert os.listdir(tmp_path) == ["state.safetensors"]
    found, metadata = read_verified(path)
    assert_same_arrays(found, version(int(metadata["0.version"]), 64))


# ----------------------------------------------------------------------- write failures


class _FillingDisk(io.FileIO):
    """A temporary on a disk that fills up after ``room`` bytes: a short write, then
    ENOSPC, as write(2) behaves on a full file system."""

    room = 300
    observed: ClassVar[list[tuple[str, int]]] = []

    def write(self, data: object) -> int:
        chunk = bytes(data)  # type: ignore[call-overload]
        left = self.room - self.tell()
        if left <= 0:
            _FillingDisk.observed.append((str(self.name), os.fstat(self.fileno()).st_size))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(chunk[:left])


def _full_disk(temporary: Path) -> BinaryIO:
    return io.BufferedWriter(_FillingDisk(temporary, "xb"), buffer_size=64)


@pytest.mark.parametrize("had_old", [True, False])
def test_a_full_disk_leaves_the_target_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, had_old: bool
) -> None:
    path = tmp_path / "state.safetensors"
    if had_old:
        write_atomic(path, version(1), version_metadata(1))
    before = path.read_bytes() if had_old else None
    _FillingDisk.observed = []
    monkeypatch.setattr(files, "_open_temporary", _full_disk)
    with pytest.raises(StateWriteError) as caught:
        write_atomic(path, version(2), version_metadata(2))
    error = caught.value
    assert isinstance(error, KvRowsError) and isinstance(error, OSError)
    assert error.errno == errno.ENOSPC
    assert str(path) in str(error) and "no space left on device (ENOSPC)" in str(error)
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    # The failure struck mid-file: part of the temporary had reached the disk.
    (temporary, size_on_disk), *_ = _FillingDisk.observed
    assert is_temporary(temporary) and Path(temporary).parent == tmp_path
    assert 0 < size_on_disk <= _FillingDisk.room
    assert not Path(temporary).exists() and _temporaries(tmp_path) == []
    if had_old:
        assert path.read_bytes() == before
        assert_same_arrays(read_verified(path)[0], version(1))
    else:
        assert os.listdir(tmp_path) == []


_FILE_SIZE_LIMITED = (
    """
import errno, json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from write(2) instead of a kill
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from kvrows.errors import KvRowsError, StateWriteError
from kvrows.persist.files import write_atomic
"""
    + _VERSION_SOURCE
    + """
try:
    write_atomic(sys.argv[1], version(2, 4096), version_metadata(2))
except StateWriteError as error:
    print(json.dumps({"errno": error.errno, "message": str(error),
                      "kinds": [isinstance(error, KvRowsError), isinstance(error, OSError)],
                      "cause": getattr(error.__cause__, "errno", None)}))
"""
)


def test_a_real_file_size_limit_fails_the_write_cleanly(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel refuse the write past 4 KiB (EFBIG), as a full
    disk would with ENOSPC: the error surfaces, the old file stays, no temporary."""
    path = tmp_path / "state.safetensors"
    write_atomic(path, version(1), version_metadata(1))
    before = path.read_bytes()
    assert len(before) < 4096  # the old file fits; the new one (16 KiB of keys) does not
    run = subprocess.run(
        # -B: the child's own imports write no bytecode (a cache cut at 4 KiB would be
        # published whole by Python's rename, and every later import would fail on it).
        [sys.executable, "-B", "-c", _FILE_SIZE_LIMITED, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(run.stdout)
    assert report["errno"] == errno.EFBIG == report["cause"]
    assert report["kinds"] == [True, True]
    assert str(path) in report["message"] and "(EFBIG)" in report["message"]
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["state.safetensors"]


def test_a_failed_fsync_or_rename_leaves_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.safetensors"
    write_atomic(path, version(1), version_metadata(1))
    before = path.read_bytes()

    def failing_sync(descriptor: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with monkeypatch.context() as patch:
        patch.setattr(files, "_sync", failing_sync)
        with pytest.raises(StateWriteError) as caught:
            write_atomic(path, version(2), version_metadata(2))
    assert caught.value.errno == errno.EIO and "(EIO)" in str(caught.value)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["state.safetensors"]

    # A rename onto a directory fails for real.
    occupied = tmp_path / "occupied"
    (occupied / "inside").mkdir(parents=True)
    with pytest.raises(StateWriteError) as caught:
        write_atomic(occupied, version(2), version_metadata(2))
    assert caught.value.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST)
    assert os.listdir(occupied) == ["inside"]
    assert sorted(os.listdir(tmp_path)) == ["occupied", "state.safetensors"]

    # A missing directory: nothing can be created.
    with pytest.raises(StateWriteError) as caught:
        write_atomic(tmp_path / "absent" / "state.safetensors", version(2), {})
    assert caught.value.errno == errno.ENOENT
    assert str(tmp_path / "absent" / "state.safetensors") in str(caught.value)


def test_a_failed_directory_fsync_reports_the_new_file_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.safetensors"
    write_atomic(path, version(1), version_metadata(1))

    def failing_directory_sync(directory: Path) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(files, "_sync_directory", failing_directory_sync)
    with pytest.raises(StateWriteError, match="new file is in place") as caught:
        write_atomic(path, version(2), version_metadata(2))
    assert caught.value.errno == errno.EIO
    assert_same_arrays(read_verified(path)[0], version(2))
    assert os.listdir(tmp_path) == ["state.safetensors"]


# ---------------------------------------------------------------- killed writers, readers

# A writer that saves version 1 whole, then stalls at ``stage`` of writing version 2
# (after half the temporary's bytes, after its fsync, or after the rename) and says so,
# so the parent kills it at a known point.
_STALLING_WRITER = (
    """
import io, os, sys, time
from pathlib import Path
from kvrows.persist import files
"""
    + _VERSION_SOURCE
    + """
target, stage = sys.argv[1], sys.argv[2]

def stall(what):
    print(what, flush=True)
    time.sleep(120)

class HalfWritten(io.FileIO):
    def write(self, data):
        if self.tell() >= 2048:
            os.fsync(self.fileno())
            stall(f"mid-write {self.name}")
        return super().write(bytes(data)[: max(1, 2048 - self.tell())])

files.write_atomic(target, version(1), version_metadata(1))
print("old written", flush=True)
if stage == "mid-write":
    files._open_temporary = lambda path: io.BufferedWriter(HalfWritten(path, "xb"), 256)
elif stage == "before-rename":
    real_replace = os.replace
    def replace(source, destination):
        stall(f"before-rename {source}")
    files.os.replace = replace
elif stage == "after-rename":
    files._sync_directory = lambda directory: stall("after-rename")
files.write_atomic(target, version(2, 4096), version_metadata(2))
print("unreachable", flush=True)
"""
)


@contextlib.contextmanager
def _writer_process(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``script`` run by a child Python, its stdout piped to the test; on the way out the
    child is killed if an assertion left it running, and its pipe is closed."""
    writer = subprocess.Popen(
        [sys.executable, "-B", "-c", script, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        yield writer
    finally:
        if writer.poll() is None:  # pragma: no cover - only when an assertion failed
            writer.kill()
            writer.wait()
        if writer.stdout is not None:
            writer.stdout.close()


def _kill(writer: subprocess.Popen[str]) -> None:
    """SIGKILL ``writer`` wherever it is: no handler, no cleanup."""
    writer.send_signal(signal.SIGKILL)
    assert writer.wait(timeout=60) == -signal.SIGKILL


def _kill_at(path: Path, stage: str) -> list[str]:
    with _writer_process(_STALLING_WRITER, str(path), stage) as writer:
        assert writer.stdout is not None
        lines = [writer.stdout.readline().strip(), writer.stdout.readline().strip()]
        assert lines[0] == "old written" and lines[1].startswith(stage), lines
        _kill(writer)
    return lines


@pytest.mark.parametrize(
    ("stage", "survivor"), [("mid-write", 1), ("before-rename", 1), ("after-rename", 2)]
)
def test_a_writer_killed_mid_write_leaves_a_whole_file(
    tmp_path: Path, stage: str, survivor: int
) -> None:
    path = tmp_path / "state.safetensors"
    lines = _kill_at(path, stage)
    found, metadata = read_verified(path)
    assert metadata["0.version"] == str(survivor)
    assert_same_arrays(found, version(1) if survivor == 1 else version(2, 4096))
    assert _visible(tmp_path) == ["state.safetensors"]  # readers see no temporary
    leftovers = _temporaries(tmp_path)
    if stage == "after-rename":
        assert leftovers == []
        return
    (leftover,) = leftovers
    assert lines[1].endswith(leftover)
    temporary = tmp_path / leftover
    if stage == "mid-write":  # a partial file, which read_verified refuses
        assert temporary.stat().st_size == 2048 < 4096 * 4  # version 2's keys alone
        with pytest.raises(CorruptStateError):
            read_verified(temporary)
    # The sweeper leaves a young temporary (its writer may be alive) and removes an old one.
    assert sweep_temporaries(tmp_path, older_than=3600) == []
    old = time.time() - 7200
    os.utime(temporary, (old, old))
    assert sweep_temporaries(tmp_path, older_than=3600) == [temporary]
    assert os.listdir(tmp_path) == ["state.safetensors"]
    assert read_verified(path)[1]["0.version"] == "1"


@pytest.mark.parametrize("stage", ["mid-write", "before-rename"])
def test_a_write_removes_the_temporaries_its_killed_writers_left(
    tmp_path: Path, stage: str
) -> None:
    """A killed writer's temporary, seconds old (before: kept until a sweep an hour later):
    its name records the writer's pid and pid space, the writer is gone, so the next write
    of the target removes it."""
    path = tmp_path / "state.safetensors"
    lines = _kill_at(path, stage)
    (leftover,) = _temporaries(tmp_path)
    assert lines[1].endswith(leftover)
    write_atomic(path, version(3), version_metadata(3))
    assert os.listdir(tmp_path) == ["state.safetensors"]
    assert read_verified(path)[1]["0.version"] == "3"
    pid, space = leftover.removeprefix(".state.safetensors.").split(".")[0].split("-")
    assert space == files._pid_space()  # the killed process shared this pid space
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid), 0)


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_write_keeps_live_young_and_other_targets_temporaries(tmp_path: Path) -> None:
    """What the write of ``state.safetensors`` removes: its temporaries whose writer is
    gone; where the writer cannot be checked (another pid space, or a name without one),
    only those at least STALE_TEMPORARY_SECONDS old. Kept: a live writer's (this process's
    other threads), young uncheckable ones, other targets' and look-alikes."""
    here, dead, live = files._pid_space(), _dead_pid(), os.getpid()
    elsewhere = "0" * 8 if here != "0" * 8 else "1" * 8
    stale = STALE_TEMPORARY_SECONDS + 60
    cases = {  # name: (age in seconds, removed)
        f".state.safetensors.{dead}-{here}.0123456789abcdef": (0, True),
        f".state.safetensors.{live}-{here}.0123456789abcdef": (10 * stale, False),
        f".state.safetensors.{dead}-{elsewhere}.1123456789abcdef": (0, False),
        f".state.safetensors.{dead}-{elsewhere}.2123456789abcdef": (stale, True),
        f".state.safetensors.{dead}.3123456789abcdef": (0, False),  # older names
        f".state.safetensors.{dead}.4123456789abcdef": (stale, True),
        f".other.safetensors.{dead}-{here}.0123456789abcdef": (stale, False),
        f".state.safetensors.x.{dead}-{here}.0123456789abcdef": (stale, False),
        f".state.safetensors.{dead}-{here}.0123456789ABCDEF": (stale, False),
    }
    now = time.time()
    for name, (age, _) in cases.items():
        path = tmp_path / (name + TEMPORARY_SUFFIX)
        path.write_bytes(b"x")
        os.utime(path, (now - age, now - age))
    write_atomic(tmp_path / "state.safetensors", small_version(), {})
    left = set(os.listdir(tmp_path))
    for name, (_, removed) in cases.items():
        assert ((name + TEMPORARY_SUFFIX) not in left) is removed, name
    assert "state.safetensors" in left


# A writer that rewrites the target forever, alternating versions of different sizes.
_REWRITING_WRITER = (
    """
import sys
from kvrows.persist.files import write_atomic
"""
    + _VERSION_SOURCE
    + """
contents = [(version(n, 256 * (1 + 7 * n)), version_metadata(n)) for n in range(2)]
written = 0
while True:
    arrays, metadata = contents[written % 2]
    write_atomic(sys.argv[1], arrays, metadata)
    written += 1
    if written == 1:
        print("started", flush=True)
"""
)


def test_readers_see_only_whole_files_while_a_writer_rewrites_and_is_killed(
    tmp_path: Path,
) -> None:
    """This process reads in a loop while another rewrites the target; every read
    verifies and is one of the two versions; both versions are seen, with changes
    between reads (so reads and writes did interleave); then the writer is killed at
    whatever point it has reached and the target is still whole."""
    path = tmp_path / "state.safetensors"
    expected = {n: version(n, 256 * (1 + 7 * n)) for n in range(2)}
    seen: list[int] = []
    with _writer_process(_REWRITING_WRITER, str(path)) as writer:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 60  # a hang guard, not a measurement
        while time.monotonic() < deadline:
            found, metadata = read_verified(path)
            number = int(metadata["0.version"])
            assert_same_arrays(found, expected[number])
            seen.append(number)
            changes = sum(1 for a, b in itertools.pairwise(seen) if a != b)
            if len(seen) >= 40 and changes >= 6:
                break
        assert writer.poll() is None, "the writer died on its own"
        _kill(writer)
    assert {0, 1} <= set(seen), seen
    assert sum(1 for a, b in itertools.pairwise(seen) if a != b) >= 6, seen
    found, metadata = read_verified(path)
    assert_same_arrays(found, expected[int(metadata["0.version"])])
    assert _visible(tmp_path) == ["state.safetensors"]
    for name in _temporaries(tmp_path):  # at most the one the kill interrupted
        os.utime(tmp_path / name, (0, 0))
    assert len(sweep_temporaries(tmp_path, older_than=60)) <= 1
    assert os.listdir(tmp_path) == ["state.safetensors"]


# -------------------------------------------------------------------- sweeping, reading


def test_the_sweeper_removes_only_old_temporaries(tmp_path: Path) -> None:
    names = {
        ".state.safetensors.123.0123456789abcdef" + TEMPORARY_SUFFIX: True,
        ".a.b.7.fedcba9876543210" + TEMPORARY_SUFFIX: True,
        "state.safetensors.123.0123456789abcdef" + TEMPORARY_SUFFIX: False,  # no dot
        ".state.safetensors.123.0123456789ABCDEF" + TEMPORARY_SUFFIX: False,
        ".state.safetensors.x.0123456789abcdef" + TEMPORARY_SUFFIX: False,
        ".hidden.safetensors": False,
        "state.safetensors": False,
    }
    for name, temporary in names.items():
        assert is_temporary(name) is temporary and is_temporary(tmp_path / name) is temporary
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (0, 0))
    young = ".young.1.0000000000000000" + TEMPORARY_SUFFIX
    (tmp_path / young).write_bytes(b"x")
    (tmp_path / (".dir.1.1111111111111111" + TEMPORARY_SUFFIX)).mkdir()
    removed = sweep_temporaries(tmp_path, older_than=600)
    assert sorted(p.name for p in removed) == sorted(n for n, t in names.items() if t)
    assert young in os.listdir(tmp_path)
    assert sweep_temporaries(tmp_path, older_than=600) == []
    assert [p.name for p in sweep_temporaries(tmp_path, older_than=0)] == [young]
    for older_than in [-1, float("nan"), "1"]:
        with pytest.raises(InvalidInputError):
            sweep_temporaries(tmp_path, older_than=older_than)  # type: ignore[arg-type]
    with pytest.raises(StateReadError):
        sweep_temporaries(tmp_path / "absent")


def test_unreadable_paths_raise_state_read_error(tmp_path: Path) -> None:
    for path, code in [(tmp_path / "absent.safetensors", errno.ENOENT), (tmp_path, None)]:
        with pytest.raises(StateReadError) as caught:
            read_verified(path)
        assert isinstance(caught.value, OSError) and isinstance(caught.value, KvRowsError)
        assert str(path) in str(caught.value)
        if code is not None:
            assert caught.value.errno == code


# --------------------------------------------------------------------- damaged files


def test_every_single_bit_flip_is_refused(saved: bytes, scratch: Path) -> None:
    """Exhaustive: each bit of a whole file, flipped alone. MLX writes no padding, so
    no byte is ignorable and every flip must be refused (never different data)."""
    causes: set[str] = set()
    for position in range(len(saved)):
        for bit in range(8):
            damaged = bytearray(saved)
            damaged[position] ^= 1 << bit
            causes.add(str(_refused(scratch, bytes(damaged))).split(": ")[1])
    # Both guards are exercised: the layout check and the checksum.
    assert {"not a whole safetensors file", "checksum mismatch"} <= causes


def test_every_truncation_is_refused(saved: bytes, scratch: Path) -> None:
    for length in range(len(saved)):
        _refused(scratch, saved[:length])


@profile_settings()
@given(flips=st.sets(st.tuples(st.integers(0, 10**6), st.integers(0, 7)), min_size=1, max_size=6))
def test_random_bit_flips_are_refused(
    saved: bytes, scratch: Path, flips: set[tuple[int, int]]
) -> None:
    damaged = bytearray(saved)
    for position, bit in {(p % len(saved), b) for p, b in flips}:
        damaged[position] ^= 1 << bit
    if bytes(damaged) != saved:  # two flips of one bit cancel: then it is the same file
        _refused(scratch, bytes(damaged))


@profile_settings()
@given(tail=st.binary(min_size=1, max_size=64), cut=st.integers(0, 64))
def test_appended_or_replaced_tails_are_refused(
    saved: bytes, scratch: Path, tail: bytes, cut: int
) -> None:
    """Bytes appended (MLX's loader accepts them) or a tail replaced by other bytes."""
    assert "appended" in str(_refused(scratch, saved + tail))
    replaced = saved[: len(saved) - cut] + tail
    if replaced != saved:
        _refused(scratch, replaced)


def _rewrite_header(data: bytes, edit: Callable[[dict[str, object]], None]) -> bytes:
    header, payload = _split(data)
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(text)) + text + payload


def test_mlx_accepts_what_the_layout_check_refuses(saved: bytes, scratch: Path) -> None:
    """Each damage here loads silently through mx.load (so the layout check is what
    stops it) and is refused by read_safetensors itself, checksum or not."""
    (length,) = struct.unpack("<Q", saved[:8])

    def overlap(header: dict[str, object]) -> None:
        # The first tensor in the data moves 2 bytes into the next one.
        entries = [e for n, e in header.items() if n != "__metadata__" and isinstance(e, dict)]
        first = min(entries, key=lambda e: e["data_offsets"][0])
        begin, end = first["data_offsets"]
        first["data_offsets"] = [begin + 2, end + 2]

    damages = {
        "appended": saved + b"\0" * 8,
        "nul padding": struct.pack("<Q", length + 2)
        + saved[8 : 8 + length]
        + b"\0\0"
        + saved[8 + length :],
        "overlap": _rewrite_header(saved, overlap),
    }
    for name, data in damages.items():
        _overwrite(scratch, data)
        arrays = mx.load(str(scratch))
        assert isinstance(arrays, dict) and len(arrays) == 4, name
        with pytest.raises(CorruptStateError, match="not a whole safetensors file"):
            read_safetensors(scratch)


def test_space_padding_is_allowed_and_each_padding_flip_refused(
    saved: bytes, scratch: Path
) -> None:
    """The format allows a header padded with spaces (other writers align it); MLX's
    files have none. A padded file holds the same content; a flipped pad is refused."""
    (length,) = struct.unpack("<Q", saved[:8])
    padded = struct.pack("<Q", length + 5) + saved[8 : 8 + length] + b" " * 5 + saved[8 + length :]
    _overwrite(scratch, padded)
    found, _ = read_verified(scratch)
    assert_same_arrays(found, small_version())
    for position in range(8 + length, 8 + length + 5):
        for bit in range(8):
            damaged = bytearray(padded)
            damaged[position] ^= 1 << bit
            _refused(scratch, bytes(damaged))


# ------------------------------------------------------------------ mismatched files


def test_mismatched_files_are_refused(tmp_path: Path) -> None:
    first, second = tmp_path / "first.safetensors", tmp_path / "second.safetensors"
    write_atomic(first, version(1), version_metadata(1))
    write_atomic(second, version(2), version_metadata(2))
    one, two = first.read_bytes(), second.read_bytes()
    scratch = tmp_path / "mixed.safetensors"
    (length_one,) = struct.unpack("<Q", one[:8])
    (length_two,) = struct.unpack("<Q", two[:8])
    assert length_one == length_two and len(one) == len(two)  # same layout, other values

    # The second file's header (and checksum) over the first file's data.
    assert "checksum mismatch" in str(
        _refused(scratch, two[: 8 + length_two] + one[8 + length_one :])
    )

    arrays, metadata = read_verified(first)
    stamped = {**metadata}
    # Arrays swapped in from the other file, under this file's metadata and checksum.
    mx.save_safetensors(str(scratch), read_verified(second)[0], stamped)
    assert "checksum mismatch" in str(_refused(scratch, scratch.read_bytes()))
    edits: list[tuple[Arrays, dict[str, str]]] = [
        ({**arrays, "scales": arrays["count"], "count": arrays["scales"]}, stamped),  # names
        ({**arrays, "values": arrays["values"].view(mx.float16)}, stamped),  # dtype
        ({**arrays, "keys": arrays["keys"].reshape(4, -1)}, stamped),  # shape
        ({k: v for k, v in arrays.items() if k != "empty"}, stamped),  # an array dropped
        (arrays, {**stamped, "0.version": "2"}),  # metadata edited
        (arrays, {**stamped, "extra": "x"}),  # added
        (arrays, {k: v for k, v in stamped.items() if k != "format"}),  # removed
    ]
    for edited_arrays, edited_metadata in edits:
        mx.save_safetensors(str(scratch), edited_arrays, edited_metadata)
        assert "checksum mismatch" in str(_refused(scratch, scratch.read_bytes()))
    # Without a checksum: not a kvrows file.
    mx.save_safetensors(str(scratch), arrays, version_metadata(1))
    assert CHECKSUM_KEY in str(_refused(scratch, scratch.read_bytes()))
    mx.save_safetensors(str(scratch), arrays)
    assert CHECKSUM_KEY in str(_refused(scratch, scratch.read_bytes()))

    # A whole file in the wrong place: the caller names what it expects.
    scratch.write_bytes(two)
    assert read_verified(scratch, expect={"0.version": "2"})[1]["0.version"] == "2"
    with pytest.raises(CorruptStateError, match="not the one asked for"):
        read_verified(scratch, expect={"0.version": "1"})
    with pytest.raises(CorruptStateError, match="not the one asked for"):
        read_verified(scratch, expect={"0.absent": ""})


def test_garbage_is_refused(tmp_path: Path) -> None:
    scratch = tmp_path / "garbage.safetensors"
    for data in [
        b"",
        b"\x00" * 7,
        b"\xff" * 64,
        struct.pack("<Q", 2) + b"{}",  # a valid empty file has no checksum
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 4) + b"{}  " + b"x",
        struct.pack("<Q", 12) + b'{"a":{},"a"}',
        struct.pack("<Q", 15) + b'{"a":{},"a":{}}',
        struct.pack("<Q", 10) + b'{"a":true}',
        struct.pack("<Q", 17) + b'{"__metadata__":1}',
        _rewrite_header(struct.pack("<Q", 2) + b"{}", lambda h: h.update(a={"dtype": "F32"})),
        b"PK\x03\x04 a zip file, not safetensors",
        struct.pack("<Q", 200_006) + b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    ]:
        _refused(scratch, data)
