"""A session directory's files and the crash-safe commit of a round (the layout and the protocol:
:mod:`.session`'s docstring): the round's tensor files written and synced under new names, ``state.json`` replaced
to name them (the commit), what no committed state names removed, the committed state read back as tensors, the
lock one ``add`` holds, and the training checkpoint of the round in progress. :class:`~.session.Session` drives
them; ``CRISPEDIT_SESSION_FAULT`` kills the process at a named point of the protocol (crash tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from ..atomic import atomic_save_safetensors, atomic_write_json
from ..curvature.factors import KFACFactors
from ..data.edits import EditRequest, load_edits, requests_digest, save_edits_jsonl
from ..distributed import all_agree, is_main
from ..errors import CrispEditError
from ..safetensors_io import load_safetensors
from ..versions import stamped
from .files import SESSION_FORMAT, STATE_FILE, read_session_state
from .sequential import SeqState

__all__ = [
    "LOCK_FILE",
    "FAULT_ENV",
    "fault",
    "session_size",
    "session_lock",
    "training_file",
    "remove_uncommitted",
    "read_round_state",
    "commit_round",
    "round_requests",
]

LOCK_FILE = ".lock"
TENSOR_FILE = re.compile(r"^(weights|optim|edit_factors|cap_factors|cap_ref)-(\d{4,})\.safetensors$")
ROUND_FILE = re.compile(r"^round-(\d{4,})\.jsonl$")
TRAINING_FILE = re.compile(r"^training-(\d{4,})-[0-9a-f]+\.safetensors$")  # a round's training checkpoint
FAULT_ENV = "CRISPEDIT_SESSION_FAULT"


def fault(phase: str) -> None:
    """Crash-test hook: ``CRISPEDIT_SESSION_FAULT=<phase>`` kills this process with SIGKILL at ``phase``
    (after_train, after_weights, before_commit, after_commit). A no-op otherwise."""
    if os.environ.get(FAULT_ENV) == phase:
        os.kill(os.getpid(), signal.SIGKILL)


def _load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    if not path.exists():
        raise CrispEditError(f"session file {path} is missing (session damaged)")
    meta, tensors = load_safetensors(path, "session", None)
    return tensors, meta


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def session_size(path: str | Path) -> int:
    """Bytes on disk of a session directory (all files, the plot included)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


@contextlib.contextmanager
def session_lock(path: Path, blocking: bool = True) -> Iterator[bool]:
    """Hold session ``path``'s exclusive lock (``flock`` on its lock file) for the block; yields whether it was
    taken (``blocking=False``: not when another process holds it). Under ``torchrun`` rank 0 alone takes it and
    every process is told whether it did (every process must enter the block)."""
    if not is_main():
        yield all_agree(True)
        return
    fh = open(path / LOCK_FILE, "a+")
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            got = True
        except BlockingIOError:
            got = False
        try:
            yield all_agree(got)
        finally:
            if got:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
    finally:
        fh.close()


def training_file(path: Path, k: int, requests: Sequence[EditRequest]) -> Path:
    """The checkpoint round ``k``'s training keeps beside the session (``training-NNNN-<edits>.safetensors``,
    named by the round and a digest of its edits), so that an ``add`` killed while training goes on from its
    last epoch when the same edits are added again; another round's or other edits' training files are
    deleted here, by rank 0 alone under ``torchrun`` (they cannot resume anything)."""
    out = path / f"training-{k:04d}-{requests_digest(requests)}.safetensors"
    for f in path.iterdir() if is_main() else ():
        if TRAINING_FILE.match(f.name) and f != out:
            f.unlink(missing_ok=True)
    return out


def remove_uncommitted(path: Path) -> None:
    """Delete what no committed state names: files of an interrupted round, temp files, the training
    checkpoints of committed rounds (an interrupted round's stays: :func:`training_file`)."""
    st = read_session_state(path)
    named = set(st["files"].values())
    for f in path.iterdir():
        if f.name.startswith(".") and (f.name.endswith(".tmp") or f.name.endswith(".old")):
            shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
        elif TENSOR_FILE.match(f.name) and f.name not in named:
            f.unlink(missing_ok=True)
        elif (m := TRAINING_FILE.match(f.name)) and int(m.group(1)) <= st["round"]:
            f.unlink(missing_ok=True)
    rdir = path / "rounds"
    if rdir.is_dir():
        for f in rdir.iterdir():
            m = ROUND_FILE.match(f.name)
            if (m and int(m.group(1)) > st["round"]) or f.name.endswith(".tmp"):
                f.unlink(missing_ok=True)


def read_round_state(path: Path, st: dict, base: dict[str, torch.Tensor]) -> SeqState:
    """The committed state ``st`` (``state.json``) of session ``path`` as tensors; before the first round the
    weights are ``base`` (the changed parameters' base values). One-line error for a missing or incomplete file."""
    files = st["files"]

    def factors(key: str) -> KFACFactors | None:
        """The :class:`KFACFactors` stored under ``files[key]``, or None if the round has no such file."""
        if key not in files:
            return None
        t, meta = _load_tensors(path / files[key])
        return KFACFactors.from_tensors(t, int(meta.get("n_tokens", 0)))

    weights = _load_tensors(path / files["weights"])[0] if "weights" in files else dict(base)
    missing = [n for n in base if n not in weights]
    if missing:
        raise CrispEditError(f"session weights file lacks parameters {missing} (session damaged)")
    return SeqState(
        weights=weights,
        cap=factors("cap_factors"),
        edits=factors("edit_factors"),
        optim=_load_tensors(path / files["optim"])[0] if "optim" in files else {},
        cap_ref=_load_tensors(path / files["cap_ref"])[0] if "cap_ref" in files else None,
    )


def _write_round(
    path: Path, k: int, old: SeqState, new: SeqState, requests: Sequence[EditRequest], old_files: dict
) -> dict:
    """Round ``k``'s files under new names, each synced; the names by key. Factors the round did not change keep
    the committed state's files."""
    files: dict[str, str] = {}
    tag = f"{k:04d}"

    def save(key: str, tensors: dict, meta: dict | None = None) -> None:
        """Write ``tensors`` (with ``meta``) atomically to ``<key>-<round>.safetensors``, fsync it and
        record its name in ``files[key]``."""
        files[key] = f"{key}-{tag}.safetensors"
        atomic_save_safetensors(path / files[key], tensors, meta)
        _fsync(path / files[key])  # on disk before the commit names it (power loss, not just kill -9)

    save("weights", new.weights)
    fault("after_weights")
    if new.optim:
        save("optim", new.optim)
    if new.edits is not None:
        save("edit_factors", new.edits.to_tensors(), {"n_tokens": str(new.edits.n_tokens)})
    if new.cap is not None:
        if new.cap is old.cap and "cap_factors" in old_files:
            files["cap_factors"] = old_files["cap_factors"]
        else:
            save("cap_factors", new.cap.to_tensors(), {"n_tokens": str(new.cap.n_tokens)})
    if new.cap_ref is not None:
        if new.cap_ref is old.cap_ref and "cap_ref" in old_files:
            files["cap_ref"] = old_files["cap_ref"]
        else:
            save("cap_ref", new.cap_ref)
    save_edits_jsonl(path / "rounds" / f"round-{tag}.jsonl", requests)
    return files


def commit_round(
    path: Path, k: int, old: SeqState, new: SeqState, requests: Sequence[EditRequest], st: dict, rec: dict
) -> None:
    """Commit round ``k`` (record ``rec``) onto the committed state ``st``: write its files, then replace
    ``state.json`` naming them — the rename is the commit."""
    files = _write_round(path, k, old, new, requests, st["files"])
    fault("before_commit")
    atomic_write_json(
        path / STATE_FILE,
        stamped({"format": SESSION_FORMAT, "round": k, "files": files, "rounds": st["rounds"] + [rec]}),
    )
    _fsync(path)  # the rename itself
    fault("after_commit")


def round_requests(path: Path, i: int) -> list[EditRequest]:
    """The edits committed round ``i`` applied (its ``rounds/round-NNNN.jsonl``)."""
    return load_edits(path / "rounds" / f"round-{i:04d}.jsonl")
