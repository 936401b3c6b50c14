"""Edit requests and their loaders.

Accepted inputs (a JSON list or JSONL, one record per line); the format is auto-detected per file:

* ZsRE (EasyEdit / MEND eval form): ``src``, ``alt``, optional ``rephrase``, ``loc``, ``loc_ans``,
  ``subject``, ``answers``. The ``nq question: `` prefix of locality prompts is removed and a ``?``
  appended, as EasyEdit does.
* CounterFact / WikiBigEdit flat records: ``prompt``, ``target_new``, optional ``subject``,
  ``ground_truth``, ``rephrase_prompt``, ``locality_prompt``, ``locality_ground_truth``.
* crispedit's normalised schema: ``prompt``, ``target``, optional ``subject``, ``rephrase_prompts``
  (list), ``locality`` (list of ``{"prompt", "answer"}``), ``ground_truth``, ``id``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_bytes
from ..errors import CrispEditError
from ..paths import read_text_file

__all__ = ["EditRequest", "load_edits", "parse_edits", "save_edits_jsonl", "detect_format", "requests_digest"]


@dataclass
class EditRequest:
    """One fact to edit: after editing, ``prompt`` should be answered with ``target``."""

    prompt: str
    target: str
    subject: str | None = None
    rephrase_prompts: list[str] = field(default_factory=list)
    locality: list[tuple[str, str]] = field(default_factory=list)  # (prompt, answer) pairs
    ground_truth: str | None = None
    id: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("prompt is empty")
        if not isinstance(self.target, str) or not self.target.strip():
            raise ValueError("target is empty")
        self.rephrase_prompts = [str(r) for r in self.rephrase_prompts if isinstance(r, str) and r.strip()]
        self.locality = [(str(p), str(a)) for p, a in self.locality]

    def to_json(self) -> dict[str, Any]:
        """The request in the crispedit JSON schema (locality pairs as ``{"prompt", "answer"}`` objects)."""
        d = asdict(self)
        d["locality"] = [{"prompt": p, "answer": a} for p, a in self.locality]
        return d


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, list):
        return value
    return [value]


def _strip_nq(prompt: str) -> str:
    p = prompt.strip()
    if p.lower().startswith("nq question:"):
        p = p[len("nq question:") :].strip()
        if p and not p.endswith("?"):
            p += "?"
    return p


def detect_format(record: dict) -> str:
    """The schema of one edit record: ``zsre`` (src/alt), ``flat`` (CounterFact / WikiBigEdit prompt/target_new)
    or ``crispedit`` (prompt/target); ``ValueError`` naming its keys otherwise."""
    if "src" in record and "alt" in record:
        return "zsre"
    if "prompt" in record and "target_new" in record:
        return "flat"
    if "prompt" in record and "target" in record:
        return "crispedit"
    keys = ", ".join(sorted(record)[:8])
    raise ValueError(
        f"unrecognised record (keys: {keys}); expected ZsRE src/alt, "
        "CounterFact/WikiBigEdit prompt/target_new, or prompt/target"
    )


def _answer_text(ans: Any) -> str:
    if isinstance(ans, list):
        ans = ans[0] if ans else ""
    if isinstance(ans, dict):  # EasyEdit nested locality answers
        ans = ans.get("answer") or ans.get("ground_truth") or ""
    return str(ans)


def _from_record(rec: dict, fmt: str, index: int) -> EditRequest:
    def req(key: str) -> str:
        """The string field ``key`` of ``rec`` (a one-element list unwrapped); ``ValueError`` if missing, not a
        string or blank."""
        if key not in rec:
            raise ValueError(f"missing field {key!r}")
        val = rec[key]
        if isinstance(val, list) and len(val) == 1:
            val = val[0]
        if not isinstance(val, str):
            raise ValueError(f"field {key!r} must be a string, got {type(val).__name__}")
        if not val.strip():
            raise ValueError(f"field {key!r} is empty")
        return val

    if fmt == "zsre":
        loc = []
        if rec.get("loc") and rec.get("loc_ans") not in (None, ""):
            loc = [(_strip_nq(str(rec["loc"])), _answer_text(rec["loc_ans"]))]
        answers = rec.get("answers") or []
        return EditRequest(
            prompt=req("src"),
            target=req("alt"),
            subject=rec.get("subject"),
            rephrase_prompts=_as_list(rec.get("rephrase")),
            locality=loc,
            ground_truth=str(answers[0]) if answers else rec.get("pred"),
            id=str(rec.get("case_id", index)),
        )
    if fmt == "flat":
        lp, la = _as_list(rec.get("locality_prompt")), _as_list(rec.get("locality_ground_truth"))
        loc = [(str(p), _answer_text(a)) for p, a in zip(lp, la) if str(p).strip()]
        return EditRequest(
            prompt=req("prompt"),
            target=req("target_new"),
            subject=rec.get("subject"),
            rephrase_prompts=_as_list(rec.get("rephrase_prompt")),
            locality=loc,
            ground_truth=_answer_text(rec["ground_truth"]) if rec.get("ground_truth") else None,
            id=str(rec.get("case_id", index)),
        )
    loc_items = rec.get("locality") or []
    loc = []
    for item in loc_items:
        if isinstance(item, dict):
            if "prompt" not in item or "answer" not in item:
                raise ValueError("locality items need 'prompt' and 'answer'")
            loc.append((str(item["prompt"]), str(item["answer"])))
        elif isinstance(item, (list, tuple)) and len(item) == 2:
            loc.append((str(item[0]), str(item[1])))
        else:
            raise ValueError("locality items must be {prompt, answer} objects")
    return EditRequest(
        prompt=req("prompt"),
        target=req("target"),
        subject=rec.get("subject"),
        rephrase_prompts=_as_list(rec.get("rephrase_prompts", rec.get("rephrase_prompt"))),
        locality=loc,
        ground_truth=rec.get("ground_truth"),
        id=str(rec.get("id", index)),
    )


def parse_edits(records: Iterable[Any], source: str = "<edits>") -> list[EditRequest]:
    """Normalise a list of raw records into :class:`EditRequest` objects (errors name the record)."""
    out = []
    for i, rec in enumerate(records):
        if isinstance(rec, EditRequest):
            out.append(rec)
            continue
        if not isinstance(rec, dict):
            raise CrispEditError(f"{source}: record {i} is a {type(rec).__name__}, expected a JSON object")
        try:
            out.append(_from_record(rec, detect_format(rec), i))
        except ValueError as exc:
            raise CrispEditError(f"{source}: record {i}: {exc}") from None
    if not out:
        raise CrispEditError(f"{source}: no edit records")
    return out


def load_edits(path: str | Path, limit: int | None = None, offset: int = 0) -> list[EditRequest]:
    """Load edit requests from a JSON list or JSONL file (format auto-detected)."""
    path = Path(path)
    text = read_text_file(path, "edit file")
    if not text.strip():
        raise CrispEditError(f"{path}: edit file is empty")
    stripped = text.lstrip()
    records: list[Any]
    if stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CrispEditError(f"{path}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
    else:
        records = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise CrispEditError(f"{path}: malformed JSON on line {lineno}: {exc.msg}") from None
        if len(records) == 1 and isinstance(records[0], list):
            records = records[0]
    if not isinstance(records, list):
        raise CrispEditError(f"{path}: expected a JSON list of edit records or one record per line (JSONL)")
    if offset < 0:
        raise CrispEditError(f"offset must be non-negative, got {offset}")
    if records and offset >= len(records):
        raise CrispEditError(f"--offset {offset} is past the end of {path}, which has {len(records)} edit records")
    records = records[offset:]
    if limit is not None:
        if limit <= 0:
            raise CrispEditError(f"number of edits must be positive, got {limit}")
        records = records[:limit]
    return parse_edits(records, source=str(path))


def save_edits_jsonl(path: str | Path, edits: Iterable[EditRequest]) -> None:
    """Write ``edits`` to ``path`` as crispedit JSONL (one request per line), atomically."""
    data = "".join(json.dumps(e.to_json()) + "\n" for e in edits)
    atomic_write_bytes(path, data.encode())


def requests_digest(requests: Iterable[EditRequest]) -> str:
    """Digest (24 hex) of the requests' content (prompts, targets, rephrasings, locality), in order."""
    blob = json.dumps([r.to_json() for r in requests], sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=12).hexdigest()
