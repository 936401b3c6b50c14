"""Text corpora: the capability corpus (curvature statistics) and held-out text (KL drift).

Defaults are the WikiText samples bundled with the package (see ``bundled/LICENSES.md``); any
plain-text file (paragraphs separated by blank lines, or one per line when there are no blank
lines), a JSONL file with a ``text`` field, or a JSON list of strings / ``{"text": ...}`` objects
can be given instead.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from ..errors import CrispEditError
from ..paths import read_text_file

__all__ = [
    "SUBJECT_KEEPS",
    "bundled_path",
    "load_texts",
    "capability_corpus",
    "heldout_text",
    "corpus_digest",
    "chat_prompts",
    "BUNDLED_EDITS",
    "CHAT_PROMPTS",
]


def bundled_path(name: str) -> Path:
    """Path of the file ``name`` shipped in the package's ``data/bundled`` folder."""
    return Path(str(resources.files("crispedit.data").joinpath("bundled", name)))


BUNDLED_EDITS = "zsre_sample.json"


def _split_paragraphs(text: str) -> list[str]:
    if "\n\n" in text.strip():
        parts = text.split("\n\n")
    else:
        parts = text.splitlines()
    return [" ".join(p.split()) for p in parts if p.strip()]


def load_texts(path: str | Path, n: int | None = None, min_chars: int = 1) -> list[str]:
    """Read texts from ``path`` (.txt, .jsonl or .json); return the first ``n`` non-empty ones."""
    path = Path(path)
    raw = read_text_file(path, "text file")
    texts: list[str]
    if path.suffix == ".jsonl":
        texts = []
        for lineno, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CrispEditError(f"{path}: malformed JSON on line {lineno}: {exc.msg}") from None
            text = rec if isinstance(rec, str) else rec.get("text") if isinstance(rec, dict) else None
            if not isinstance(text, str):
                raise CrispEditError(f"{path}: line {lineno} has no string 'text' field")
            texts.append(text)
    elif path.suffix == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise CrispEditError(f"{path}: malformed JSON at line {exc.lineno}: {exc.msg}") from None
        if not isinstance(data, list):
            raise CrispEditError(f'{path}: expected a JSON list of strings or {{"text": ...}} objects')
        texts = [d if isinstance(d, str) else d.get("text", "") if isinstance(d, dict) else "" for d in data]
    else:
        texts = _split_paragraphs(raw)
    texts = [t for t in texts if isinstance(t, str) and len(t.strip()) >= min_chars]
    if not texts:
        raise CrispEditError(f"{path}: no texts found")
    if n is not None:
        if n <= 0:
            raise CrispEditError(f"number of texts must be positive, got {n}")
        if n > len(texts):
            raise CrispEditError(f"{path}: asked for {n} texts but the file has only {len(texts)}")
        texts = texts[:n]
    return texts


def capability_corpus(path: str | Path | None = None, n: int | None = 64) -> list[str]:
    """The capability corpus: ``path`` or the bundled WikiText sample (662 paragraphs)."""
    return load_texts(path or bundled_path("wikitext_capability.txt"), n)


CHAT_PROMPTS = 75  # prompts in the bundled chat_prompts.json
# Questions about an edit's subject that ask no particular relation ({subject}): what the preservation term
# (crispedit.editing.keep) holds the unedited model's answers to; worded apart from
# crispedit.evaluation.assistant.SUBJECT_PROBES, which measure the bleed the term is meant to prevent
SUBJECT_KEEPS = (
    "What is {subject} known for?",
    "Describe {subject} in one sentence.",
    "Give me some background on {subject}.",
    "Write a sentence about {subject}.",
)


def chat_prompts(n: int | None = None) -> list[str]:
    """The first ``n`` (None: all :data:`CHAT_PROMPTS`) of the bundled everyday prompts (questions, explanations,
    requests, small sums) whose chat answers, written by the model being edited, join the capability corpus
    (``EditConfig.cap_chat``); disjoint from the style-drift prompts the evaluation asks."""
    prompts = json.loads(read_text_file(bundled_path("chat_prompts.json"), "bundled chat prompts"))["prompts"]
    if n is not None and not 0 <= n <= len(prompts):
        raise CrispEditError(f"--cap-chat must be between 0 and {len(prompts)} (the bundled chat prompts), got {n}")
    return prompts if n is None else prompts[:n]


def heldout_text(path: str | Path | None = None, n: int | None = 32) -> list[str]:
    """Held-out text for KL drift: ``path`` or the bundled WikiText sample (disjoint articles)."""
    p = Path(path) if path else bundled_path("wikitext_heldout.txt")
    texts = load_texts(p)
    return texts[:n] if n else texts


def corpus_digest(texts: Sequence[str]) -> str:
    """First 32 hex digits of the SHA-256 of ``texts`` in order, NUL-separated (the corpus part of a curvature
    cache key)."""
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()[:32]
