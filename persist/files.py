"""Crash-safe safetensors files.

``write_atomic`` saves through MLX's ``mx.save_safetensors`` into a fresh temporary file
in the target's directory, fsyncs it, renames it over the target and fsyncs the
directory: a reader sees the old file or the new one, never a partial one, and a failed
write leaves the target as it was and no temporary behind (``StateWriteError``). A
temporary's name records its writer (pid and pid space), so each write first removes the
temporaries of its target that killed writers left (``remove_stale_temporaries``).
``CHECKSUM_KEY`` in the metadata holds a SHA-256 digest of every array (name, dtype,
shape, bytes) and every other metadata entry. ``read_verified`` checks the file's
structure (safetensors' own rules, which MLX's loader does not all enforce), loads it,
recomputes the digest and raises ``CorruptStateError`` for a truncated, extended,
bit-flipped or mismatched file, returning nothing from it.

The protocol, the checksum's byte format and the failure model are in
``spec/persistence-files.md``.
"""

from __future__ import annotations

import errno as errno_codes
import functools
import hashlib
import json
import math
import os
import re
import secrets
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import BinaryIO, cast

import mlx.core as mx
import numpy as np

if sys.platform != "win32":
    import fcntl

from kvrows.errors import (
    CorruptStateError,
    InvalidInputError,
    StateReadError,
    StateWriteError,
)

__all__ = [
    "CHECKSUM_KEY",
    "STALE_TEMPORARY_SECONDS",
    "TEMPORARY_SUFFIX",
    "checksum",
    "is_temporary",
    "read_safetensors",
    "read_verified",
    "remove_stale_temporaries",
    "sweep_temporaries",
    "write_atomic",
]

#: The metadata entry that holds the file's checksum. It sits under mlx-lm's user
#: metadata prefix ("0.") so mlx-lm's ``load_prompt_cache`` can still parse the file.
CHECKSUM_KEY = "0.kvrows_checksum"

#: How every temporary file's name ends (they also start with "."); mx.save_safetensors
#: would append ".safetensors" to a path lacking it, so the name carries it already.
TEMPORARY_SUFFIX = ".tmp.safetensors"

_CHECKSUM_DOMAIN = b"kvrows-checksum-v1"

# safetensors dtype tag -> bytes per element: the tags mx.save_safetensors writes.
_ELEMENT_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "C64": 8,
}

# mx dtype -> safetensors tag, for the dtypes mx.save_safetensors can write (it refuses
# float64). The checksum hashes the tag, so it does not depend on MLX's dtype names.
_DTYPE_TAGS = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.int8: "I8",
    mx.uint16: "U16",
    mx.int16: "I16",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.float32: "F32",
    mx.uint64: "U64",
    mx.int64: "I64",
    mx.complex64: "C64",
}

#: A temporary whose writer cannot be checked (another host or pid space, or a name
#: without its pid space) is stale once it is this old (seconds since its last change).
STALE_TEMPORARY_SECONDS = 600.0

# What follows ".<target name>." in a temporary's name: "<pid>-<pid space>.<16 hex
# digits>.tmp.safetensors" (before the pid space was recorded: "<pid>.<16 hex>...").
_TEMPORARY_TAIL = re.compile(
    r"(?P<pid>\d+)(?:-(?P<space>[0-9a-f]{8}))?\.[0-9a-f]{16}" + re.escape(TEMPORARY_SUFFIX)
)
_TEMPORARY_NAME = re.compile(r"\.(?P<target>.*)\." + _TEMPORARY_TAIL.pattern)

# A temporary's name keeps at most this many bytes of the target's (names are <= 255 bytes).
_NAME_KEPT = 120

# A safetensors file opens with its header's length, a little-endian u64.
_HEADER_LENGTH_BYTES = 8


# ---------------------------------------------------------------------------- checksum


def checksum(arrays: Mapping[str, mx.array], metadata: Mapping[str, str]) -> str:
    """SHA-256 (hex) over every array and every metadata entry but ``CHECKSUM_KEY``.

    Each field is hashed with its length in front, so no two different contents share a
    byte stream: a domain tag, then per array in name order its name, dtype, shape and
    raw row-major bytes (dtype as its safetensors tag, e.g. "BF16"), then per metadata entry in
    key order its key and value (UTF-8). ``spec/persistence-files.md`` gives the format.
    """
    _check_arrays(arrays, "checksum")
    _check_metadata(metadata, "checksum")
    return _digest(arrays, metadata)


def _digest(arrays: Mapping[str, mx.array], metadata: Mapping[str, str]) -> str:
    digest = hashlib.sha256(_CHECKSUM_DOMAIN)
    _update_count(digest, len(arrays))
    for name in sorted(arrays):
        array = arrays[name]
        _update_field(digest, name.encode())
        # Only a foreign file's array can lack a tag; its checksum cannot match anyway.
        _update_field(digest, _DTYPE_TAGS.get(array.dtype, str(array.dtype)).encode())
        _update_field(digest, ",".join(str(size) for size in array.shape).encode())
        contents = _contiguous_bytes(array)
        _update_count(digest, contents.nbytes)
        digest.update(contents)
    entries = sorted(key for key in metadata if key != CHECKSUM_KEY)
    _update_count(digest, len(entries))
    for key in entries:
        _update_field(digest, key.encode())
        _update_field(digest, metadata[key].encode())
    return digest.hexdigest()


def _update_count(digest: hashlib._Hash, count: int) -> None:
    digest.update(count.to_bytes(8, "little"))


def _update_field(digest: hashlib._Hash, field: bytes) -> None:
    _update_count(digest, len(field))
    digest.update(field)


def _contiguous_bytes(array: mx.array) -> memoryview:
    """The array's row-major bytes without a copy where it is already contiguous."""
    if array.dtype == mx.bfloat16:
        # NumPy has no bfloat16; the bit patterns are what the file holds.
        array = array.view(mx.uint16)
    host = np.ascontiguousarray(np.asarray(array))
    return host.reshape(-1).view(np.uint8).data


# ------------------------------------------------------------------------------ writing


def write_atomic(
    path: str | os.PathLike[str], arrays: Mapping[str, mx.array], metadata: Mapping[str, str]
) -> None:
    """Write ``arrays`` and ``metadata`` (plus ``CHECKSUM_KEY``) to ``path`` atomically.

    The file is saved whole into a temporary in the same directory (a name starting with
    "." and ending in ``TEMPORARY_SUFFIX``), fsynced, renamed over ``path`` and the
    directory fsynced. ``path`` is used as given (no suffix is added). A ``CHECKSUM_KEY``
    entry in ``metadata`` is replaced by the new digest. On any failure the temporary is
    removed, ``path`` holds what it held before (or is still absent), and the OS error
    surfaces as ``StateWriteError`` (errno kept, the OSError chained).
    """
    target = _as_path(path, "write_atomic")
    _check_arrays(arrays, "write_atomic")
    _check_metadata(metadata, "write_atomic")
    remove_stale_temporaries(target)  # first: frees their space for this write
    stamped = {key: value for key, value in metadata.items() if key != CHECKSUM_KEY}
    stamped[CHECKSUM_KEY] = _digest(arrays, stamped)
    temporary = target.with_name(_temporary_name(target.name))
    created = False
    try:
        with _open_temporary(temporary) as handle:
            created = True
            mx.save_safetensors(handle, dict(arrays), stamped)
            handle.flush()
            _sync(handle.fileno())
        os.replace(temporary, target)
    except BaseException as error:
        if created:
            _remove_quietly(temporary)
        if isinstance(error, OSError):
            raise _write_error(target, error) from error
        if isinstance(error, RuntimeError):  # MLX's own write failures carry no errno
            raise StateWriteError(
                f"could not write {target}: {error}; the file is unchanged and no "
                "temporary file is left"
            ) from error
        raise
    try:
        _sync_directory(target.parent)
    except OSError as error:
        raise _write_error(target, error, replaced=True) from error


def _as_path(path: object, operation: str) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidInputError(f"{operation} takes a str or os.PathLike path, got {path!r}")
    resolved = Path(path)
    if not resolved.name:
        raise InvalidInputError(f"{operation} takes a file path, got {str(resolved)!r}")
    return resolved


def _check_arrays(arrays: object, operation: str) -> None:
    if not isinstance(arrays, Mapping):
        raise InvalidInputError(
            f"{operation} takes a mapping of array names to mx.array, got {type(arrays)}"
        )
    for name, array in arrays.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise InvalidInputError(
                f"array name {name!r} is not usable: expected a non-empty str other than "
                "'__metadata__'"
            )
        if not isinstance(array, mx.array):
            raise InvalidInputError(f"array {name!r} is a {type(array)}, expected an mx.array")
        if array.dtype not in _DTYPE_TAGS:
            raise InvalidInputError(
                f"array {name!r} has dtype {array.dtype}, which safetensors files from "
                "mx.save_safetensors cannot hold (float64 is not savable): convert it first"
            )
        _check_text(name, f"array name {name!r}")


def _check_metadata(metadata: object, operation: str) -> None:
    if not isinstance(metadata, Mapping):
        raise InvalidInputError(
            f"{operation} takes a mapping of str metadata entries, got {type(metadata)}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidInputError(
                f"metadata entry {key!r}: {value!r} is not usable: keys and values are str"
            )
        _check_text(key, f"metadata key {key!r}")
        _check_text(value, f"metadata value of {key!r}")


def _check_text(text: str, what: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError as error:
        raise InvalidInputError(f"{what} is not encodable as UTF-8 ({error})") from error


def _temporary_name(target_name: str) -> str:
    # pid and pid space: a later writer of the target can tell whether this writer is
    # gone; 64 random bits (os.urandom, thread-safe) so threads and processes never
    # collide; O_EXCL below makes sure.
    return (
        f"{_temporary_prefix(target_name)}{os.getpid()}-{_pid_space()}."
        f"{secrets.token_hex(8)}{TEMPORARY_SUFFIX}"
    )


def _temporary_prefix(target_name: str) -> str:
    """What every temporary of ``target_name`` starts with: "." + its name (at most
    ``_NAME_KEPT`` bytes) + "."."""
    return f".{os.fsdecode(os.fsencode(target_name)[:_NAME_KEPT])}."


@functools.cache
def _pid_space() -> str:
    """8 hex digits naming the space this process's pid belongs to: the host name, the
    boot and the pid namespace (where the OS tells them), so a pid read from a temporary's
    name is checked only where it names the same process."""
    parts = [socket.gethostname()]
    for source in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(
                os.readlink(source) if source.endswith("/pid") else Path(source).read_text()
            )
        except OSError:
            parts.append("")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def _open_temporary(temporary: Path) -> BinaryIO:
    """A new, exclusively created file, buffered so a failing write raises OSError with
    its errno through mx.save_safetensors (writing by path, MLX drops the errno)."""
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fdopen(descriptor, "wb")
    except BaseException:
        os.close(descriptor)
        raise


def _sync(descriptor: int) -> None:
    """fsync, and on macOS F_FULLFSYNC, where plain fsync leaves data in the drive's cache."""
    if sys.platform == "darwin":
        try:
            fcntl.fcntl(descriptor, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass  # not supported by this file system: fall back to fsync
    os.fsync(descriptor)


def _sync_directory(directory: Path) -> None:
    """Make the rename durable: fsync the directory that holds the new name."""
    if sys.platform == "win32":
        return  # directories cannot be opened for fsync there; the rename is still atomic
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _remove_quietly(temporary: Path) -> None:
    try:
        temporary.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        pass  # left for sweep_temporaries; readers never take a temporary


def _describe_errno(number: int | None) -> str:
    if number is None:
        return "an OS error"
    name = errno_codes.errorcode.get(number, str(number))
    text = os.strerror(number)
    return f"{text[:1].lower()}{text[1:]} ({name})"


def _write_error(target: Path, error: OSError, *, replaced: bool = False) -> StateWriteError:
    if replaced:
        outcome = (
            "the new file is in place but the directory fsync failed, so the rename "
            "may not survive a power loss"
        )
    else:
        outcome = "the file is unchanged and no temporary file is left"
    wrapped = StateWriteError(
        f"could not write {target}: {_describe_errno(error.errno)}; {outcome}"
    )
    wrapped.errno = error.errno
    return wrapped


# ------------------------------------------------------------------------- temporaries


def is_temporary(name: str | os.PathLike[str]) -> bool:
    """Whether a file name is one of ``write_atomic``'s temporaries (never a saved file)."""
    return _TEMPORARY_NAME.fullmatch(Path(name).name) is not None


def _writer_gone(pid: int, space: str | None) -> bool | None:
    """Whether the process that named a temporary is gone: True, False (alive, maybe
    this process's other thread), or None when this process cannot tell (another host or
    pid space, a name without its pid space, or Windows, where kill(pid, 0) terminates)."""
    if space is None or space != _pid_space() or sys.platform == "win32":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's
    except (OSError, OverflowError):
        return None
    return False


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporaries of target ``path`` (in its directory) that killed writers
    left, and return them: those whose writer process is gone, and those whose writer
    cannot be checked (``_writer_gone``) once ``STALE_TEMPORARY_SECONDS`` old. Best
    effort: a directory that cannot be listed, or a file that cannot be removed, is left
    as it is. ``write_atomic`` calls it before each write."""
    target = _as_path(path, "remove_stale_temporaries")
    prefix = _temporary_prefix(target.name)
    cutoff = time.time() - STALE_TEMPORARY_SECONDS
    removed: list[Path] = []
    try:
        entries = list(os.scandir(target.parent))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        match = _TEMPORARY_TAIL.fullmatch(entry.name, len(prefix))
        if match is None:
            continue
        try:
            gone = _writer_gone(int(match["pid"]), match["space"])
            if gone is False or not entry.is_file(follow_symlinks=False):
                continue
            if gone is None and entry.stat(follow_symlinks=False).st_mtime > cutoff:
                continue
            os.unlink(entry.path)
        except OSError:
            continue  # gone meanwhile, or not ours to remove: left
        removed.append(Path(entry.path))
    return removed


def sweep_temporaries(directory: str | os.PathLike[str], older_than: float = 3600.0) -> list[Path]:
    """Remove the temporaries a killed writer left in ``directory`` whose last change is
    at least ``older_than`` seconds old (younger ones may belong to a live writer), and
    return their paths. Only names ``is_temporary`` accepts are touched; a temporary
    another sweeper removed first is skipped."""
    folder = _as_path(directory, "sweep_temporaries")
    if not isinstance(older_than, (int, float)) or not older_than >= 0:
        raise InvalidInputError(
            f"sweep_temporaries takes older_than >= 0 seconds, got {older_than!r}"
        )
    cutoff = time.time() - older_than
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError as error:
        raise _read_error(folder, error) from error
    for entry in entries:
        if not is_temporary(entry.name):
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or entry.stat().st_mtime > cutoff:
                continue
            os.unlink(entry.path)
        except FileNotFoundError:
            continue
        removed.append(Path(entry.path))
    return removed


# ------------------------------------------------------------------------------ reading


def read_safetensors(
    path: str | os.PathLike[str],
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The evaluated arrays and the metadata of a safetensors file (no checksum asked).

    Before MLX parses it, the file must follow safetensors' layout rules: a header
    length that fits the file, a UTF-8 JSON header (space padding only), each tensor's
    byte range matching its dtype and shape, the ranges tiling the data with no gap or
    overlap, and nothing after the last one. Anything else, and anything MLX refuses,
    raises ``CorruptStateError`` naming the path and the fault. One open file serves
    both the check and the load, so a concurrent rename cannot mix two files.
    A file that cannot be opened raises ``StateReadError`` (errno kept).
    """
    source = _as_path(path, "read_safetensors")
    try:
        handle = open(source, "rb")  # noqa: SIM115 - closed below, after the load
    except OSError as error:
        raise _read_error(source, error) from error
    with handle:
        try:
            size = os.fstat(handle.fileno()).st_size
            _check_layout(source, handle, size)
            handle.seek(0)
        except OSError as error:
            raise _read_error(source, error) from error
        try:
            loaded = mx.load(handle, format="safetensors", return_metadata=True)
            arrays, metadata = cast("tuple[dict[str, mx.array], dict[str, str]]", loaded)
            mx.eval(list(arrays.values()))
        except OSError as error:
            raise _read_error(source, error) from error
        except (RuntimeError, ValueError) as error:
            raise CorruptStateError(
                f"{source}: not a readable safetensors file: MLX refused it ({error})"
            ) from error
    return arrays, metadata


def read_verified(
    path: str | os.PathLike[str], *, expect: Mapping[str, str] | None = None
) -> tuple[dict[str, mx.array], dict[str, str]]:
    """``read_safetensors`` plus the checksum: a file without ``CHECKSUM_KEY``, or whose
    content does not hash to it, raises ``CorruptStateError``. ``expect`` names metadata
    entries the file must hold with exactly these values (a file that is whole but is
    not the one asked for, e.g. another key's entry copied over this one, is refused the
    same way). Nothing is returned from a refused file."""
    source = _as_path(path, "read_verified")
    if expect is not None and not (
        isinstance(expect, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in expect.items())
    ):
        raise InvalidInputError(
            f"read_verified's expect is a mapping of str to str, got {expect!r}"
        )
    arrays, metadata = read_safetensors(source)
    recorded = metadata.get(CHECKSUM_KEY)
    if recorded is None:
        raise CorruptStateError(
            f"{source}: no checksum (metadata entry {CHECKSUM_KEY!r}): not written by "
            "kvrows' write_atomic, or its metadata was edited"
        )
    actual = _digest(arrays, metadata)
    if actual != recorded:
        raise CorruptStateError(
            f"{source}: checksum mismatch: the file records {recorded[:16]}... but its "
            f"content hashes to {actual[:16]}...: it is corrupt or was altered"
        )
    for key, wanted in (expect or {}).items():
        found = metadata.get(key)
        if found != wanted:
            raise CorruptStateError(
                f"{source}: metadata {key!r} is {found!r}, expected {wanted!r}: "
                "a whole file, but not the one asked for"
            )
    return arrays, metadata


def _read_error(source: Path, error: OSError) -> StateReadError:
    wrapped = StateReadError(f"could not read {source}: {_describe_errno(error.errno)}")
    wrapped.errno = error.errno
    return wrapped


def _check_layout(source: Path, handle: BinaryIO, size: int) -> None:
    """Refuse (CorruptStateError) a file that breaks safetensors' layout rules."""

    def corrupt(fault: str) -> CorruptStateError:
        return CorruptStateError(f"{source}: not a whole safetensors file: {fault}")

    if size < _HEADER_LENGTH_BYTES:
        raise corrupt(f"{size} bytes, shorter than the 8-byte header length (truncated)")
    (header_length,) = struct.unpack("<Q", handle.read(_HEADER_LENGTH_BYTES))
    if header_length > size - _HEADER_LENGTH_BYTES:
        raise corrupt(
            f"the header claims {header_length} bytes but only "
            f"{size - _HEADER_LENGTH_BYTES} follow (truncated or a damaged length)"
        )
    raw = handle.read(header_length)
    if len(raw) != header_length:
        raise corrupt(f"the header ended after {len(raw)} of {header_length} bytes")
    text = raw.rstrip(b" ")  # the format allows trailing space padding, nothing else
    if not text.startswith(b"{") or not text.endswith(b"}"):
        raise corrupt("the header is not one JSON object (optionally space padded)")
    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
        raise corrupt(f"the header is not valid UTF-8 JSON ({error})") from error
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise corrupt("__metadata__ is not an object of string values")
    ranges = sorted(_tensor_range(name, entry, corrupt) for name, entry in header.items())
    position = 0
    for begin, end, name in ranges:
        if begin != position:
            fault = "overlaps the one before" if begin < position else "leaves a gap before it"
            raise corrupt(f"tensor {name!r} at bytes [{begin}, {end}) {fault}")
        position = end
    expected = _HEADER_LENGTH_BYTES + header_length + position
    if size != expected:
        change = "truncated" if size < expected else "has bytes appended"
        raise corrupt(f"{size} bytes where header and tensors make {expected}: {change}")


def _no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _tensor_range(
    name: str, entry: object, corrupt: Callable[[str], CorruptStateError]
) -> tuple[int, int, str]:
    if not isinstance(entry, dict):
        raise corrupt(f"tensor {name!r} is described by {type(entry).__name__}, not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(_is_count(size) for size in shape)):
        raise corrupt(f"tensor {name!r} has shape {shape!r}, not a list of counts")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise corrupt(f"tensor {name!r} has data_offsets {offsets!r}, not two counts")
    begin, end = offsets
    if end < begin:
        raise corrupt(f"tensor {name!r} has data_offsets {offsets} that run backwards")
    if not isinstance(dtype, str):
        raise corrupt(f"tensor {name!r} has dtype {dtype!r}, not a string")
    element_bytes = _ELEMENT_BYTES.get(dtype)
    if element_bytes is not None and end - begin != math.prod(shape) * element_bytes:
        raise corrupt(
            f"tensor {name!r} ({dtype}, shape {shape}) needs "
            f"{math.prod(shape) * element_bytes} bytes but spans {end - begin}"
        )
    return begin, end, name


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0
