"""Text the unedited model writes itself, kept on disk by the weights that wrote it.

The preservation term (:mod:`.keep`) holds the unedited model's greedy answers to the bundled everyday prompts. Those
answers depend only on the weights that write them, the tokenizer's chat template, the prompts and the answer
length, so they are written once per model and read back by every later edit of it — every round of a session
(whose model-written text is the session base's, :func:`~.contexts.prefixes_from`), every single edit in the
playground. The file is ``<cache root>/written/<weight fingerprint>.json`` (:func:`~crispedit.models.cache_dir`;
:func:`~crispedit.weights.weight_fingerprint`), one entry per (kind, settings, chat template, prompts) digest.
Greedy answers written in the same batches are the same answers, so a read entry is what writing would give.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

from ..atomic import atomic_write_json
from ..errors import CrispEditError
from ..versions import check_written_by, stamped

__all__ = ["WRITTEN_FORMAT", "written_path", "entry_key", "cached_writing"]

WRITTEN_FORMAT = 1


def written_path(fingerprint: str, root: str | Path | None = None) -> Path:
    """The cache file of the text written by the weights of ``fingerprint`` (under ``root``, default the cache
    root)."""
    from ..models import cache_dir

    return Path(root or cache_dir()) / "written" / f"{fingerprint}.json"


def entry_key(kind: str, settings: dict, template: str | None, prompts: Sequence[str]) -> str:
    """The digest naming one entry: SHA-256 of the kind, the settings (JSON), the chat template and the prompts."""
    h = hashlib.sha256(json.dumps([kind, settings, template or ""], sort_keys=True).encode())
    for p in prompts:
        h.update(b"\0" + p.encode())
    return f"{kind}-{h.hexdigest()[:32]}"


def _read(path: Path, fingerprint: str) -> dict:
    """The entries of ``path`` (empty when it does not exist); one line for a file that is not one."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise CrispEditError(f"written-text cache {path} is corrupt; delete it to write it again") from None
    check_written_by(data, path, then="delete it to write it again", format=WRITTEN_FORMAT)
    entries = data.get("entries")
    if data.get("fingerprint") != fingerprint or not isinstance(entries, dict) or not all(
            isinstance(v, list) and all(isinstance(s, str) for s in v) for v in entries.values()):
        raise CrispEditError(f"written-text cache {path} is malformed; delete it to write it again")
    return entries


def cached_writing(model, tokenizer, kind: str, settings: dict, prompts: Sequence[str],
                   write: Callable[[], list[str]], root: str | Path | None = None) -> list[str]:
    """``write()`` — one string per prompt, written by ``model`` as it is now — read from the cache when the same
    weights wrote it before for the same ``kind``, ``settings``, chat template and ``prompts``, else written and
    stored (atomically, beside the file's other entries)."""
    from ..weights import weight_fingerprint

    if not prompts:
        return []
    fp = weight_fingerprint(model)
    path = written_path(fp, root)
    key = entry_key(kind, settings, getattr(tokenizer, "chat_template", None), prompts)
    entries = _read(path, fp)
    if key in entries and len(entries[key]) == len(prompts):
        return list(entries[key])
    out = list(write())
    entries = {**_read(path, fp), key: out}  # another process may have added entries meanwhile
    atomic_write_json(path, stamped({"format": WRITTEN_FORMAT, "fingerprint": fp, "entries": entries}))
    return out
