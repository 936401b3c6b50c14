"""A session directory's JSON files — ``session.json`` (base model, layers, config) and ``state.json`` (the
commit point) — read and checked for shape, without torch: ``crispedit session ...`` names a missing,
foreign or damaged session directory before torch is imported. :mod:`.session` describes the layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..editing.contexts import parse_contexts
from ..errors import CrispEditError
from ..paths import check_input_dir, read_text_file
from ..versions import check_written_by

__all__ = [
    "SESSION_FORMAT",
    "SESSION_FILE",
    "STATE_FILE",
    "read_json",
    "check_session_meta",
    "check_session_state",
    "read_session_meta",
    "read_session_state",
]

SESSION_FORMAT = 1
SESSION_FILE, STATE_FILE = "session.json", "state.json"


def read_json(path: Path, what: str) -> dict:
    """The JSON object in ``path`` (a session file); one-line errors for a missing session directory, a
    directory that is not a session, and a file that is not valid JSON or not an object."""
    check_input_dir(path.parent, "session directory")
    if not path.exists():
        raise CrispEditError(f"{path.parent} is not a crispedit session (no {path.name})")
    try:
        data = json.loads(read_text_file(path, what))
    except json.JSONDecodeError:
        raise CrispEditError(f"{what} {path} is corrupt") from None
    if not isinstance(data, dict):
        raise CrispEditError(f"{what} {path} is malformed: a JSON {type(data).__name__}, not an object")
    return data


def _require(d: dict, where: str, **kinds: type | tuple) -> None:
    """One-line error naming the first key of ``kinds`` that ``d`` lacks or holds with the wrong type."""
    for key, kind in kinds.items():
        if key not in d:
            raise CrispEditError(f"{where} is malformed: no {key!r}")
        if not isinstance(d[key], kind) or (kind is int and isinstance(d[key], bool)):
            raise CrispEditError(f"{where} is malformed: {key!r} is a {type(d[key]).__name__}")


def check_session_meta(meta: dict, path: Path) -> dict:
    """``meta`` (``session.json``) if it has the shape this crispedit writes; a one-line error naming the
    first missing or mistyped field otherwise."""
    where = f"session file {path}"
    _require(meta, where, format=int, name=str, base=dict, layers=list, config=dict, default_contexts=str)
    _require(meta["base"], where + " (base)", spec=str, fingerprint=str, dtype=str)
    if not all(isinstance(x, str) for x in meta["layers"]):
        raise CrispEditError(f"{where} is malformed: 'layers' must be a list of names")
    try:
        parse_contexts(meta["default_contexts"])
    except CrispEditError as e:
        raise CrispEditError(f"{where} is malformed: 'default_contexts': {e}") from None
    return meta


def check_session_state(st: dict, path: Path) -> dict:
    """``st`` (``state.json``) if it has the shape this crispedit writes — round, files, one record per
    committed round — and a one-line error naming the first problem otherwise."""
    where = f"session state {path}"
    _require(st, where, round=int, files=dict, rounds=list)
    if st["round"] < 0 or len(st["rounds"]) != st["round"]:
        raise CrispEditError(f"{where} is malformed: round {st['round']} with {len(st['rounds'])} round records")
    for key, name in st["files"].items():
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            raise CrispEditError(f"{where} is malformed: file entry {key!r} is not a file name in the session")
    for i, rec in enumerate(st["rounds"], 1):
        if not isinstance(rec, dict):
            raise CrispEditError(f"{where} is malformed: round record {i} is not an object")
        _require(rec, f"{where} (round {i})", round=int, n_edits=int, retention=dict, kl_drift=(int, float), train=dict)
    return st


_THEN = "start a new session"


def read_session_meta(path: str | Path) -> dict:
    """The checked ``session.json`` of the session directory ``path``: written by this crispedit version in its
    format (:func:`~crispedit.versions.check_written_by`), of the shape :func:`check_session_meta` requires (one-line
    error otherwise)."""
    path = Path(path)
    meta = read_json(path / SESSION_FILE, "session file")
    check_written_by(meta, f"session {path}", _THEN, format=SESSION_FORMAT)
    return check_session_meta(meta, path / SESSION_FILE)


def read_session_state(path: str | Path) -> dict:
    """The checked ``state.json`` of the session directory ``path``: this crispedit version's, in its format
    (:func:`~crispedit.versions.check_written_by`), of the shape :func:`check_session_state` requires."""
    path = Path(path)
    st = read_json(path / STATE_FILE, "session state")
    check_written_by(st, path / STATE_FILE, _THEN, format=SESSION_FORMAT)
    return check_session_state(st, path / STATE_FILE)
