"""Checks of the files and directories a user names, before any work: inputs exist and are readable
(text files decoded as UTF-8), outputs can be written (tried with a probe file), an output directory holds
nothing but an earlier crispedit run's files. Each failure is a one-line
:class:`~crispedit.errors.CrispEditError` naming the flag or input.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from .errors import CrispEditError, os_reason
from .versions import read_record


def read_text_file(path: str | os.PathLike, what: str = "text file") -> str:
    """The whole of a user-given text file decoded as UTF-8 (a leading BOM dropped); one-line errors for
    a missing file, a directory, no permission and bytes that are not UTF-8 (with their offset)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CrispEditError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise CrispEditError(f"{what} {path} is a directory, not a file") from None
    except PermissionError:
        raise CrispEditError(f"{what} {path} is not readable (permission denied)") from None
    except OSError as exc:
        raise CrispEditError(f"{what} {path} could not be read ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CrispEditError(
            f"{what} {path} is not UTF-8 text (byte {exc.start}: {data[exc.start : exc.start + 1]!r}); "
            "convert it to UTF-8"
        ) from None


def file_digest(path: str | os.PathLike, what: str = "file") -> str:
    """SHA-256 of the bytes of ``path`` (64 hex characters), read in 4 MiB blocks; one-line errors for a
    missing or unreadable file, as :func:`check_input_file` gives. What identifies a file a run read (a MEND
    network) where its path may differ between machines."""
    path = check_input_file(path, what)
    h = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    except OSError as exc:
        raise CrispEditError(f"{what} {path} could not be read ({exc.strerror or exc})") from None
    return h.hexdigest()


def check_input_file(path: str | os.PathLike, what: str = "file") -> Path:
    """Check, before any work, that ``path`` is an existing, readable file (not a directory), with the
    one-line errors :func:`read_text_file` gives; for inputs read later, by a library (e.g. a curvature
    cache read once the model is loaded). Returns ``path``."""
    path = Path(path)
    if not path.exists():
        raise CrispEditError(f"{what} not found: {path}")
    if path.is_dir():
        raise CrispEditError(f"{what} {path} is a directory, not a file")
    if not os.access(path, os.R_OK):
        raise CrispEditError(f"{what} {path} is not readable (permission denied)")
    return path


def check_input_dir(path: str | os.PathLike, what: str = "directory", *, missing_ok: bool = False) -> Path:
    """Check, before any work, that ``path`` is an existing, readable directory (not a file): one-line errors
    ``"<what> not found: <path>"`` (unless ``missing_ok``), ``"<what> <path> is a file, not a directory"`` and
    ``"<what> <path> is not readable (permission denied)"``. For directory inputs (``--bench-dir``, ``--data``,
    a session directory, ``cache list --cache-dir``). Returns ``path``."""
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return path
        raise CrispEditError(f"{what} not found: {path}")
    if not path.is_dir():
        raise CrispEditError(f"{what} {path} is a file, not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CrispEditError(f"{what} {path} is not readable (permission denied)")
    return path


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a dangling symlink counts as existing)."""
    p = path
    while not p.exists() and not p.is_symlink():
        if p.parent == p:
            break
        p = p.parent
    return p


def check_dir_takes_entries(directory: str | os.PathLike, flag: str, path: str | os.PathLike | None = None) -> Path:
    """Check, by trying, that new entries can be made in the existing directory ``directory``: create a
    uniquely named empty probe file there (``.crispedit-probe-*.tmp``) and remove it. Permission bits are
    not enough: a read-only or virtual file system (``/proc``, ``/sys``) refuses a new file even where
    they allow it. One-line :class:`CrispEditError` naming ``flag``, the destination ``path`` (default:
    ``directory``), ``directory`` and the OS's reason otherwise. Returns ``directory``."""
    directory = Path(directory)
    try:
        fd, probe = tempfile.mkstemp(prefix=".crispedit-probe-", suffix=".tmp", dir=directory)
    except OSError as exc:
        if path is None or Path(path) == directory:
            raise CrispEditError(f"{flag} {directory} is not writable ({os_reason(exc)})") from None
        raise CrispEditError(f"{flag} {path}: cannot write in {directory} ({os_reason(exc)})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return directory


def _check_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor of ``path``'s parent is a directory that takes new entries (the temporary
    sibling every write renames into place is made there, or the missing parents)."""
    parent = nearest_existing(path.parent if path.parent != Path("") else Path("."))
    if not parent.is_dir():
        raise CrispEditError(f"{flag} {path}: {parent} is a file, not a directory")
    check_dir_takes_entries(parent, flag, path)


def check_output_file(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Check, before any work, that a file can be written at ``path``: not a directory, and the nearest
    existing parent is a directory that takes new entries, tried with a probe file
    (:func:`check_dir_takes_entries`; an existing file must be writable too). Returns ``path``."""
    path = Path(path)
    if path.is_dir():
        raise CrispEditError(f"{flag} {path} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise CrispEditError(f"{flag} {path} exists and is not writable")
    _check_parent(path, flag)
    return path


def check_output_dir(
    path: str | os.PathLike, flag: str = "--out", *, overwrite: bool | None = None, marker: str | None = None
) -> list[str] | None:
    """Check, before any work, that ``path`` can become an output directory: not a file, and the nearest
    existing parent (and ``path`` itself when it exists) is a directory that takes new entries, tried with
    a probe file (:func:`check_dir_takes_entries`).

    With ``overwrite`` given (True/False), a non-empty ``path`` is refused unless ``overwrite`` is True
    and ``marker`` (the file crispedit writes last, e.g. ``edit_report.json``) shows an earlier crispedit
    output there; then the names of the files that run wrote (the marker's ``"files"`` list, else just
    the marker) are returned, for :func:`~crispedit.atomic.atomic_directory`'s ``previous``; a marker another crispedit
    version
    wrote is refused (:func:`~crispedit.versions.check_written_by`). Returns None otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CrispEditError(f"{flag} {path} is a file, not a directory")
    if path.is_dir():
        check_dir_takes_entries(path, flag)
    _check_parent(path, flag)
    if overwrite is None or not path.is_dir() or not any(path.iterdir()):
        return None
    if not overwrite:
        raise CrispEditError(
            f"{flag} {path} is not empty; pass --overwrite to replace the files an earlier "
            "crispedit run wrote there (other files are kept), or choose another directory"
        )
    mark = path / marker if marker else None
    if mark is None or not mark.is_file():
        raise CrispEditError(
            f"{flag} {path} holds no earlier crispedit output ({marker}); refusing to overwrite "
            "it even with --overwrite"
        )
    files = read_record(mark, f"remove {path} or choose another directory").get("files")
    names = [str(f) for f in files if isinstance(f, str)] if isinstance(files, list) else []
    return sorted(set(names) | {marker})
