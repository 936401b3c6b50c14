"""User-facing errors and atomic file writes.

Every mistake a user can make (bad edit file, unknown layer, gamma out of range, a cache built for
another model...) raises :class:`CrispEditError` with a one-line message naming the offending input.
The CLI prints that line and exits non-zero; nothing is half-written because every write goes to a
temporary file in the destination directory first and is renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator


def _umask_mode(mode: int = 0o666) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


class CrispEditError(Exception):
    """An error caused by user input; its message is one line that names the problem."""


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _umask_mode())  # mkstemp makes 0600 files; give the file normal permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.chmod(tmp, _umask_mode())  # safetensors always writes 0600; give the file normal permissions
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``path`` only if the block succeeds.

    An existing ``path`` is replaced as a whole (moved aside, then deleted) so a reader never sees
    a mixture of old and new files; on failure the temporary directory is removed and ``path`` is
    left as it was (or absent).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, _umask_mode(0o777))
        yield tmp
        for f in tmp.rglob("*"):  # safetensors (save_pretrained too) writes 0600 files: normal permissions
            if f.is_file() and not f.is_symlink():
                os.chmod(f, _umask_mode())
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.rmdir(old)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_gamma(gamma: float) -> float:
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise CrispEditError(f"gamma must be a number in (0, 1), got {gamma!r}") from None
    if not (0.0 < g < 1.0):
        raise CrispEditError(f"gamma must lie strictly between 0 and 1, got {g}")
    return g


def check_positive_int(name: str, value: Any) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise CrispEditError(f"{name} must be a positive integer, got {value!r}") from None
    if v != value and not (isinstance(value, str) and str(v) == value.strip()):
        if not (isinstance(value, float) and value.is_integer()):
            raise CrispEditError(f"{name} must be a positive integer, got {value!r}")
    if v <= 0:
        raise CrispEditError(f"{name} must be a positive integer, got {value!r}")
    return v
