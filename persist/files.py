"""Crash-safe safetensors files.

``write_atomic`` writes through MLX's ``mx.save_safetensors`` to a temporary file in the
target's directory, fsyncs it, renames it over the target and fsyncs the directory, so a
reader sees the old file or the new one, never a partial one. ``CHECKSUM_KEY`` in the
metadata holds a digest of every array (name, dtype, shape, bytes) and every other
metadata entry; ``read_verified`` recomputes it and raises ``CorruptStateError`` for a
truncated, bit-flipped or mismatched file, having built nothing from it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np

from kvrows.errors import CorruptStateError

__all__ = ["CHECKSUM_KEY", "checksum", "read_safetensors", "read_verified", "write_atomic"]

#: The metadata entry that holds the file's checksum. It sits under mlx-lm's user
#: metadata prefix ("0.") so mlx-lm's ``load_prompt_cache`` can still parse the file.
CHECKSUM_KEY = "0.kvrows_checksum"


def checksum(arrays: dict[str, mx.array], metadata: dict[str, str]) -> str:
    """SHA-256 over every array (name, dtype, shape, bytes) and every metadata entry but
    the checksum itself, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(f"{name}|{array.dtype}|{tuple(array.shape)}|".encode())
        digest.update(_bytes(array))
    for key in sorted(metadata):
        if key != CHECKSUM_KEY:
            digest.update(f"{key}={metadata[key]}\n".encode())
    return digest.hexdigest()


def _bytes(array: mx.array) -> bytes:
    if array.dtype == mx.bfloat16:
        array = array.view(mx.uint16)
    return bytes(np.ascontiguousarray(np.array(array, copy=False)).tobytes())


def write_atomic(
    path: str | os.PathLike[str], arrays: dict[str, mx.array], metadata: dict[str, str]
) -> None:
    """Write ``arrays`` and ``metadata`` (plus ``CHECKSUM_KEY``) to ``path`` atomically."""
    target = Path(path)
    stamped = {**metadata, CHECKSUM_KEY: checksum(arrays, metadata)}
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp.safetensors")
    try:
        mx.save_safetensors(str(temporary), arrays, stamped)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    finally:
        if temporary.exists():
            temporary.unlink()
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_safetensors(path: str | os.PathLike[str]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The arrays and metadata of a safetensors file (no checksum asked for); a file MLX
    cannot parse raises ``CorruptStateError``."""
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError, OSError) as error:
        raise CorruptStateError(f"{path}: not a readable safetensors file ({error})") from error
    arrays, metadata = cast(tuple[dict[str, mx.array], dict[str, str]], loaded)
    return dict(arrays), dict(metadata)


def read_verified(path: str | os.PathLike[str]) -> tuple[dict[str, mx.array], dict[str, str]]:
    """``read_safetensors`` plus the checksum check (a file without one is refused)."""
    arrays, metadata = read_safetensors(path)
    recorded = metadata.get(CHECKSUM_KEY)
    if recorded is None:
        raise CorruptStateError(f"{path}: no {CHECKSUM_KEY} entry: not a kvrows file")
    if checksum(arrays, metadata) != recorded:
        raise CorruptStateError(f"{path}: checksum mismatch: the file is corrupt")
    return arrays, metadata
