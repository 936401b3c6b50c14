"""crispedit's exceptions and the one-line messages of failed writes.

Every mistake a user can make (bad edit file, unknown layer, gamma out of range, a cache built for
another model...) raises :class:`CrispEditError` with a one-line message naming the offending input.
The CLI prints that line and exits non-zero. A write the system refuses midway (no space left, a read-only
file system, no permission) is a :class:`WriteError` naming the destination and the OS's reason
(:func:`write_failure` reads that reason from whatever a writer raised); a file another crispedit version
wrote is a :class:`VersionError` (:mod:`crispedit.versions`).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from pathlib import Path


class CrispEditError(Exception):
    """An error caused by user input; its message is one line that names the problem."""


class VersionError(CrispEditError):
    """A stored file that another crispedit version wrote (or this one in another format): crispedit is 0.x and
    reads back only what this very version writes (:func:`~crispedit.versions.check_written_by`)."""


class WriteError(CrispEditError, OSError):
    """A file could not be written: ``path`` (the destination, never a temporary name) and ``reason`` (the
    OS's words in lower case, e.g. ``no space left on device``). A :class:`CrispEditError` (one line) and an
    :class:`OSError` (what a caller that skips an unwritable file catches)."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"cannot write {self.path}: {reason} (nothing was written)")


#: The errors a write meets from its surroundings rather than from a bug.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
_OS_ERROR_CODE = re.compile(r"\(?os error (\d+)\)?|\[Errno (\d+)\]")
_NEARLY_FULL = 1 << 20  # bytes: less free space than this after a short write means the disk filled up
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (at most 8 deep)."""
    seen: list[BaseException] = []
    while exc is not None and len(seen) < 8 and not any(exc is s for s in seen):
        seen.append(exc)
        yield exc
        exc = exc.__cause__ or exc.__context__


def _free_bytes(directory: Path) -> int | None:
    """Bytes still free to this process on ``directory``'s file system (``None``: unknown)."""
    try:
        st = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def write_failure(exc: BaseException, directory: str | os.PathLike | None = None) -> str | None:
    """Why a write failed, in the OS's words in lower case (``no space left on device``, ``read-only file
    system``, ``permission denied``), or ``None`` when ``exc`` is no I/O failure (a bug, or a user error
    already). Read from an :class:`OSError`'s code or from a writer's message that carries one (safetensors'
    and tokenizers' ``... (os error 28)``), along ``exc``'s causes. An :class:`OSError` without a code (numpy's
    short write ``"N requested and M written"``, what GGUF writers raise) is ``no space left on device`` when
    ``directory``'s file system has (almost) no free space left; a short write on a disk with room is
    described by its own text."""
    if isinstance(exc, CrispEditError):
        return None
    plain = None
    for e in _chain(exc):
        code = e.errno if isinstance(e, OSError) else None
        if not code:
            m = _OS_ERROR_CODE.search(str(e))
            code = int(m.group(1) or m.group(2)) if m else None
        if code:
            return os_reason(OSError(code, os.strerror(code)))
        if isinstance(e, OSError) and plain is None:
            plain = e
    if plain is None:
        return None
    free = _free_bytes(Path(directory)) if directory is not None else None
    if free is not None and free < _NEARLY_FULL:
        return os_reason(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    text = (str(plain).splitlines() or [""])[0]
    return f"the write stopped short ({text})" if _SHORT_WRITE.search(text) else None


def os_error_line(exc: OSError) -> str | None:
    """One line for an :class:`OSError` that reached the command line outside crispedit's writers: ``"<file>:
    <the OS's reason>"`` when it names a file, the reason alone for a failure a write meets from its surroundings
    (:data:`WRITE_ERRNOS`: no space, read-only, permission, quota, file size); ``None`` for any other (a bug,
    whose traceback helps)."""
    if exc.errno is None or not (exc.filename or exc.errno in WRITE_ERRNOS):
        return None
    reason = os_reason(OSError(exc.errno, exc.strerror or os.strerror(exc.errno)))
    return f"{os.fsdecode(exc.filename)}: {reason}" if exc.filename else reason


def os_reason(exc: OSError) -> str:
    """The OS's reason for ``exc`` in lower case (``permission denied``, ``read-only file system``)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return reason[:1].lower() + reason[1:]
