"""Edit requests, their loaders, and text corpora."""

from .corpus import BUNDLED_EDITS, bundled_path, capability_corpus, corpus_digest, heldout_text, load_texts
from .edits import EditRequest, detect_format, load_edits, parse_edits, save_edits_jsonl

__all__ = [
    "EditRequest",
    "load_edits",
    "parse_edits",
    "save_edits_jsonl",
    "detect_format",
    "capability_corpus",
    "heldout_text",
    "load_texts",
    "corpus_digest",
    "bundled_path",
    "BUNDLED_EDITS",
]
