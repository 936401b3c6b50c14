"""User-facing errors, atomic file writes and checked reads of crispedit's safetensors files.

Every mistake a user can make (bad edit file, unknown layer, gamma out of range, a cache built for
another model...) raises :class:`CrispEditError` with a one-line message naming the offending input.
The CLI prints that line and exits non-zero; nothing is half-written because every write goes to a
temporary file in the destination directory first and is renamed into place. A write the system refuses
midway (no space left, a read-only file system, no permission) is a :class:`WriteError` naming the
destination and the OS's reason.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator


def _umask_mode(mode: int = 0o666) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


class CrispEditError(Exception):
    """An error caused by user input; its message is one line that names the problem."""


class VersionError(CrispEditError):
    """A stored file that another crispedit version wrote (or this one in another format): crispedit is 0.x and
    reads back only what this very version writes (:func:`check_written_by`)."""


#: The key under which every file crispedit reads back (edit report, compare.json, checkpoints, sessions, cache
#: entries, deltas, MEND networks, eval results) records the crispedit version that wrote it.
VERSION_KEY = "crispedit_version"


def crispedit_version() -> str:
    """This crispedit's version (``crispedit.__version__``)."""
    from . import __version__

    return __version__


def stamped(record: dict) -> dict:
    """``record`` with this crispedit's version under :data:`VERSION_KEY` (first): what a writer stores, so that
    :func:`check_written_by` can tell the file is this version's."""
    return {VERSION_KEY: crispedit_version(), **{k: v for k, v in record.items() if k != VERSION_KEY}}


def check_written_by(record: Any, where: str | os.PathLike, then: str = "rerun it", **formats: Any) -> dict:
    """``record`` (a stored file's JSON, or its crispedit metadata) when this crispedit version wrote it — its
    :data:`VERSION_KEY` is ``crispedit.__version__`` and each key of ``formats`` holds the given value (a format
    number) — else a one-line :class:`VersionError` naming the version that wrote ``where``, e.g. ``runs/x/compare.json
    was written by crispedit 0.0.9; this is crispedit 0.1.0 — rerun it`` (``then``: what to do instead).
    crispedit is 0.x: files of other versions are refused, never converted."""
    now = crispedit_version()
    written = record.get(VERSION_KEY) if isinstance(record, dict) else None
    if written == now:
        other = next(((k, record.get(k), v) for k, v in formats.items() if record.get(k) != v), None)
        if other is None:
            return record
        raise VersionError(f"{where} was written by crispedit {now} with {other[0]} {other[1]!r}; this crispedit "
                           f"writes {other[0]} {other[2]!r} — {then}")
    who = f"crispedit {written}" if isinstance(written, str) and written else "a crispedit that recorded no version"
    raise VersionError(f"{where} was written by {who}; this is crispedit {now} — {then}")


def read_record(path: str | os.PathLike, then: str = "rerun it") -> dict:
    """The JSON object crispedit wrote at ``path`` beside its output (a model folder's ``edit_report.json``,
    ``crispedit_delta.json``, ``crispedit_session.json``), checked by :func:`check_written_by` (``then``: what its
    one-line :class:`VersionError` advises); ``{}`` when there is no such file or it is not a JSON object."""
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError, JSONDecodeError
        return {}
    if not isinstance(record, dict):
        return {}
    return check_written_by(record, path, then)


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
            return _os_reason(OSError(code, os.strerror(code)))
        if isinstance(e, OSError) and plain is None:
            plain = e
    if plain is None:
        return None
    free = _free_bytes(Path(directory)) if directory is not None else None
    if free is not None and free < _NEARLY_FULL:
        return _os_reason(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    text = (str(plain).splitlines() or [""])[0]
    return f"the write stopped short ({text})" if _SHORT_WRITE.search(text) else None


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
            reason = write_failure(exc, tmp.parent if tmp is not None else _nearest_existing(path.parent))
        cleanup()
        if reason is None or dest is None or (isinstance(exc, WriteError) and dest == exc.path):
            raise
        raise WriteError(dest, reason) from exc


def os_error_line(exc: OSError) -> str | None:
    """One line for an :class:`OSError` that reached the command line outside crispedit's writers: ``"<file>:
    <the OS's reason>"`` when it names a file, the reason alone for a failure a write meets from its surroundings
    (:data:`WRITE_ERRNOS`: no space, read-only, permission, quota, file size); ``None`` for any other (a bug,
    whose traceback helps)."""
    if exc.errno is None or not (exc.filename or exc.errno in WRITE_ERRNOS):
        return None
    reason = _os_reason(OSError(exc.errno, exc.strerror or os.strerror(exc.errno)))
    return f"{os.fsdecode(exc.filename)}: {reason}" if exc.filename else reason


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


_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the size of a file's JSON header


def read_safetensors_header(path: str | os.PathLike, kind: str, key: str | None) -> tuple[dict, dict[str, dict]]:
    """The crispedit metadata and the tensor table of safetensors file ``path``, read without torch.

    The file is ``<8-byte little-endian n><n bytes of JSON header><data>``; the header maps each tensor
    name to ``{"dtype", "shape", "data_offsets"}`` and ``"__metadata__"`` to a ``str -> str`` map, in which
    crispedit stores its JSON under ``key``.

    Args:
        path: The file.
        kind: What the file should be, for the messages (``"curvature cache"``, ``"MEND network"``,
            ``"delta"``): they read ``"<kind> file <path> ..."`` and ``"<path> is not a crispedit <kind>"``.
        key: The metadata entry holding crispedit's JSON (e.g. ``"crispedit_delta"``); ``None``: return the
            raw ``str -> str`` metadata map, whatever it holds.

    Returns:
        ``(meta, table)``: the JSON object under ``key`` (or the raw map) and, per tensor name, its header
        entry (``data_offsets``: ``[begin, end)`` in bytes from the start of the data section).

    Raises:
        CrispEditError: one line, for a missing, unreadable or directory path, a file that is not
            safetensors or whose data section does not match its header (truncated), and a file without
            valid ``key`` metadata (a foreign file).
    """
    what = f"{kind} file"
    path = check_input_file(path, what)
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or n > size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n).decode("utf-8"))
        if not isinstance(header, dict) or not isinstance(header.get("__metadata__") or {}, dict):
            raise ValueError("header is not an object")
        table = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in table.values()), default=0)
        if end != size - 8 - n:
            raise ValueError(f"the header describes {end} bytes of data, the file holds {size - 8 - n}")
    except (ValueError, OSError, KeyError, TypeError, IndexError) as exc:  # UnicodeDecodeError, JSONDecodeError
        raise CrispEditError(f"{what} {path} is not a safetensors file, or is truncated or corrupt ({exc})") from None
    meta_map = header.get("__metadata__") or {}
    if key is None:
        return meta_map, table
    raw_meta = meta_map.get(key)
    if raw_meta is None:
        raise CrispEditError(f"{path} is not a crispedit {kind} (no {key} metadata)")
    try:
        meta = json.loads(raw_meta)
    except (TypeError, json.JSONDecodeError):
        meta = None
    if not isinstance(meta, dict):
        raise CrispEditError(f"{what} {path} has corrupt metadata")
    return meta, table


def load_safetensors(path: str | os.PathLike, kind: str, key: str | None) -> tuple[dict, dict]:
    """The crispedit metadata and all tensors of safetensors file ``path`` (loaded on the CPU).

    The header is checked first by :func:`read_safetensors_header` (same ``kind`` / ``key`` and errors);
    the tensors are then read with safetensors' ``safe_open`` (this imports torch).

    Returns:
        ``(meta, tensors)``: the JSON object under ``key`` (the raw metadata map for ``None``) and tensor
        name -> ``torch.Tensor`` with the stored shape and dtype.

    Raises:
        CrispEditError: one line, as :func:`read_safetensors_header`, or ``"<kind> file <path> is truncated
            or corrupt (...)"`` when a tensor cannot be read.
    """
    meta, _ = read_safetensors_header(path, kind, key)
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:  # safetensors raises SafetensorError / OSError on damaged files
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise CrispEditError(f"{kind} file {path} is truncated or corrupt ({first})") from None
    return meta, tensors


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


def check_gamma(gamma: float, what: str = "gamma") -> float:
    """``gamma`` as a float strictly inside (0, 1) (one-line error naming ``what`` otherwise)."""
    try:
        g = float(gamma)
    except (TypeError, ValueError):
        raise CrispEditError(f"{what} must be a number in (0, 1), got {gamma!r}") from None
    if not (0.0 < g < 1.0):
        raise CrispEditError(f"{what} must lie strictly between 0 and 1, got {g}")
    return g


def check_positive_int(name: str, value: Any) -> int:
    """``value`` as a positive int (an integral float or numeric string is accepted); one-line error naming
    ``name`` otherwise."""
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


def check_int(name: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as an int within ``[lo, hi]`` (either bound optional); one-line error naming ``name``
    otherwise (non-integers, booleans and integral floats out of range included)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise CrispEditError(f"{name} must be an integer, got {value!r}")
    try:
        v = int(value)
    except (TypeError, ValueError, OverflowError):
        raise CrispEditError(f"{name} must be an integer, got {value!r}") from None
    if isinstance(value, float) and not value.is_integer():
        raise CrispEditError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"between {lo} and {hi}" if lo is not None and hi is not None else (
            "non-negative" if lo == 0 else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise CrispEditError(f"{name} must be {rng}, got {value!r}")
    return v


def check_float(name: str, value: Any, lo: float | None = None, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` as a finite float within the given bounds (open or closed); one-line error naming ``name``
    otherwise — ``inf`` and ``nan`` are always refused."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        raise CrispEditError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or not math.isfinite(v):
        raise CrispEditError(f"{name} must be a finite number, got {value!r}")
    bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
    bad_hi = hi is not None and (v >= hi if hi_open else v > hi)
    if bad_lo or bad_hi:
        if lo is not None and hi is not None:
            rng = f"lie in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        elif lo == 0:
            rng = "be positive" if lo_open else "be non-negative"
        elif lo is not None:
            rng = f"be {'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"be {'<' if hi_open else '<='} {hi:g}"
        raise CrispEditError(f"{name} must {rng}, got {value!r}")
    return v


MAX_LR = 1.0  # an Adam step of more than 1 per weight destroys any model; larger values are typos


def check_lr(name: str, value: Any) -> float:
    """``value`` as an Adam learning rate: a finite number in ``(0, MAX_LR]`` (one-line error naming ``name``
    otherwise). What ``edit --lr`` and ``mend train --lr`` accept."""
    return check_float(name, value, 0.0, MAX_LR, lo_open=True)


SEED_MAX = 2**32 - 1  # numpy's and most RNGs' limit; torch takes more, but a seed must work everywhere


def check_finite_tensors(tensors: dict, what: str) -> None:
    """Refuse (one-line error naming the first offending tensor) when any tensor in ``tensors`` (name ->
    tensor) holds ``inf`` or ``nan`` — called before anything with those values is saved."""
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CrispEditError(f"{what} left non-finite weights (inf/nan) in {bad[0]}{more}; nothing was saved — "
                             "lower --lr or check the model and the inputs")


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
        raise CrispEditError(f"{what} {path} is not UTF-8 text (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); "
                             "convert it to UTF-8") from None


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


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink():
        if p.parent == p:
            break
        p = p.parent
    return p


def _os_reason(exc: OSError) -> str:
    """The OS's reason for ``exc`` in lower case (``permission denied``, ``read-only file system``)."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    return reason[:1].lower() + reason[1:]


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
            raise CrispEditError(f"{flag} {directory} is not writable ({_os_reason(exc)})") from None
        raise CrispEditError(f"{flag} {path}: cannot write in {directory} ({_os_reason(exc)})") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return directory


def _check_parent(path: Path, flag: str) -> None:
    """The nearest existing ancestor of ``path``'s parent is a directory that takes new entries (the temporary
    sibling every write renames into place is made there, or the missing parents)."""
    parent = _nearest_existing(path.parent if path.parent != Path("") else Path("."))
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


def check_output_dir(path: str | os.PathLike, flag: str = "--out", *, overwrite: bool | None = None,
                     marker: str | None = None) -> list[str] | None:
    """Check, before any work, that ``path`` can become an output directory: not a file, and the nearest
    existing parent (and ``path`` itself when it exists) is a directory that takes new entries, tried with
    a probe file (:func:`check_dir_takes_entries`).

    With ``overwrite`` given (True/False), a non-empty ``path`` is refused unless ``overwrite`` is True
    and ``marker`` (the file crispedit writes last, e.g. ``edit_report.json``) shows an earlier crispedit
    output there; then the names of the files that run wrote (the marker's ``"files"`` list, else just
    the marker) are returned, for :func:`atomic_directory`'s ``previous``; a marker another crispedit version
    wrote is refused (:func:`check_written_by`). Returns None otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CrispEditError(f"{flag} {path} is a file, not a directory")
    if path.is_dir():
        check_dir_takes_entries(path, flag)
    _check_parent(path, flag)
    if overwrite is None or not path.is_dir() or not any(path.iterdir()):
        return None
    if not overwrite:
        raise CrispEditError(f"{flag} {path} is not empty; pass --overwrite to replace the files an earlier "
                             "crispedit run wrote there (other files are kept), or choose another directory")
    mark = path / marker if marker else None
    if mark is None or not mark.is_file():
        raise CrispEditError(f"{flag} {path} holds no earlier crispedit output ({marker}); refusing to overwrite "
                             "it even with --overwrite")
    files = read_record(mark, f"remove {path} or choose another directory").get("files")
    names = [str(f) for f in files if isinstance(f, str)] if isinstance(files, list) else []
    return sorted(set(names) | {marker})
