"""Atomic writes: nothing is half-written.

Every write goes to a temporary file (or directory) beside its destination first and is renamed into place,
with normal permissions; when it fails the temporary is removed and the destination is as it was. A write the
system refuses (no space left, a read-only file system, no permission) is a
:class:`~crispedit.errors.WriteError` naming the destination, never the temporary name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .errors import WriteError, write_failure
from .paths import nearest_existing


def _umask_mode(mode: int = 0o666) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def _destination(exc: BaseException, tmp: Path, path: Path) -> Path | None:
    """The file a failed write through the temporary ``tmp`` (renamed onto ``path`` on success) meant: ``path``,
    or the file of the same name inside ``path`` when the error names one inside ``tmp``; ``None`` when the error
    names a file elsewhere (something the block read, not what it wrote)."""
    named = exc.path if isinstance(exc, WriteError) else getattr(exc, "filename", None)
    if named is None:
        return path
    named = Path(os.fsdecode(named))
    if named == tmp or named == path:
        return path
    for root in (tmp, path):
        with contextlib.suppress(ValueError):
            return path / named.relative_to(root)
    return None


@contextlib.contextmanager
def _writing(path: Path, tmp: Path | None, cleanup) -> Iterator[None]:
    """Run a write of ``path`` (through ``tmp``, removed by ``cleanup()`` on any failure): an I/O failure
    (:func:`write_failure`, judged before the temporary file is removed) becomes a :class:`WriteError` naming
    the destination; anything else propagates as it is."""
    try:
        yield
    except BaseException as exc:
        reason, dest = None, _destination(exc, tmp, path) if tmp is not None else path
        if isinstance(exc, WriteError):
            reason = exc.reason
        elif isinstance(exc, Exception) and dest is not None:
            reason = write_failure(exc, tmp.parent if tmp is not None else nearest_existing(path.parent))
        cleanup()
        if reason is None or dest is None or (isinstance(exc, WriteError) and dest == exc.path):
            raise
        raise WriteError(dest, reason) from exc


def _unlink(path: str | os.PathLike) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory and a rename; a write the
    system refuses is a :class:`WriteError` (and ``path`` is as it was)."""
    path = Path(path)
    with _writing(path, None, lambda: None):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with _writing(path, Path(tmp), lambda: _unlink(tmp)):
        os.fchmod(fd, _umask_mode())  # mkstemp makes 0600 files; give the file normal permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (:func:`atomic_write_bytes`)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def atomic_write_figure(path: str | os.PathLike, fig, dpi: int = 110) -> Path:
    """Render a matplotlib figure as PNG in memory and write it to ``path`` atomically (nothing, not even
    a temporary file, is left behind when ``path`` cannot be written); closes the figure."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    try:
        fig.savefig(buf, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s directory for a writer that needs a file name (not bytes); it is
    renamed onto ``path`` (normal permissions) when the block succeeds and removed when it fails, so
    ``path`` is either the complete new file or as it was. An I/O failure in the block (:func:`write_failure`)
    is a :class:`WriteError` naming ``path``."""
    path = Path(path)
    with _writing(path, None, lambda: None):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    with _writing(path, Path(tmp), lambda: _unlink(tmp)):
        yield Path(tmp)
        os.chmod(tmp, _umask_mode())
        os.replace(tmp, path)


def atomic_save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """Save ``tensors`` as a safetensors file at ``path`` atomically (temporary file + rename, normal
    permissions: safetensors writes 0600); a write the system refuses is a :class:`WriteError`."""
    from safetensors.torch import save_file

    with atomic_file(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, previous: Iterable[str] | None = None) -> Iterator[Path]:
    """Yield a temporary sibling directory that replaces ``path`` only if the block succeeds.

    With ``previous=None`` an existing ``path`` is replaced as a whole (moved aside, then deleted) so a
    reader never sees a mixture of old and new files. With ``previous`` (the names of the files an
    earlier run wrote there) only those are touched: each new file is renamed into ``path`` (a
    ``*.json`` report last, so it marks a complete write), files of ``previous`` the new run did not
    write are deleted, and every other file in ``path`` is kept. On failure the temporary directory is
    removed and ``path`` is left as it was (or absent); an I/O failure (:func:`write_failure`) is a
    :class:`WriteError` naming the file of ``path`` that could not be written.
    """
    path = Path(path)
    with _writing(path, None, lambda: None):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    with _writing(path, tmp, lambda: shutil.rmtree(tmp, ignore_errors=True)):
        os.chmod(tmp, _umask_mode(0o777))
        yield tmp
        for f in tmp.rglob("*"):  # safetensors (save_pretrained too) writes 0600 files: normal permissions
            if f.is_file() and not f.is_symlink():
                os.chmod(f, _umask_mode())
        if path.exists() and previous is not None:
            new = sorted(p.name for p in tmp.iterdir())
            for name in sorted(new, key=lambda n: n.endswith(".json")):  # reports (json) land last
                dest = path / name
                if dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                os.replace(tmp / name, dest)
            for name in set(previous) - set(new):
                stale = path / Path(name).name
                if stale.is_file() or stale.is_symlink():
                    stale.unlink()
            shutil.rmtree(tmp, ignore_errors=True)
        elif path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.rmdir(old)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
