"""Which crispedit wrote a stored file: every file crispedit reads back records the version that wrote it
(:data:`VERSION_KEY`, :func:`stamped`), and a file of another version is refused in one line
(:func:`check_written_by`, a :class:`~crispedit.errors.VersionError`), never converted.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from .errors import VersionError

#: The key under which every file crispedit reads back (edit report, compare.json, checkpoints, sessions, cache
#: entries, deltas, MEND networks, eval results) records the crispedit version that wrote it.
VERSION_KEY = "crispedit_version"


def crispedit_version() -> str:
    """This crispedit's version (``crispedit.__version__``)."""
    from . import __version__

    return __version__


@functools.cache
def source_commit(where: str | os.PathLike | None = None) -> str | None:
    """The git commit of the crispedit source that is running (``where``: a folder of it; default this package's),
    with ``+dirty`` when its tracked files under ``where`` differ from that commit: which code made a measured run,
    finer than :func:`crispedit_version` while crispedit is run from a checkout. ``None`` for an installed copy
    outside any git work tree, or without a working ``git``."""
    folder = Path(where) if where is not None else Path(__file__).parent

    def git(*args: str) -> str | None:
        """``git -C folder ARGS``'s stripped output, or ``None`` when it fails or cannot run."""
        try:
            done = subprocess.run(
                ["git", "-C", str(folder), *args], capture_output=True, text=True, timeout=10, check=False
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if not head:
        return None
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return head + ("+dirty" if changed else "")


def environment() -> dict:
    """Where a run ran, recorded in every edit report, compare row and session round: library versions, the
    crispedit source's git commit when run from a checkout (:func:`source_commit`, else ``None``), Python, platform,
    the CPU's model name (``None`` where the system does not say), torch's thread count and the CUDA device's name
    (``None`` without CUDA). Imports torch and transformers when called, not when this module is imported."""
    import torch
    import transformers

    return {
        "crispedit": crispedit_version(),
        "source": source_commit(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def cpu_name() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name`` on Linux, else :func:`platform.processor`), or
    ``None`` where neither says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


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
        raise VersionError(
            f"{where} was written by crispedit {now} with {other[0]} {other[1]!r}; this crispedit "
            f"writes {other[0]} {other[2]!r} — {then}"
        )
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
