"""Write ``training_sequences.json``: the training sequences of a fixed set of (tokenizer, contexts, answer end,
seed) cases on the tiny test tokenizer, as ``build_training_sequences`` builds them. The file was first written
by the if-chain that preceded the training-context registry; ``tests/editing/test_contexts.py`` checks that today's
sequences are the same, token for token. Run from the repository root to rewrite it (only for an intended change):
``python tests/editing/golden/make_training_sequences.py``."""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: its conftest builds the tiny tokenizer

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PREFIXES = [
    "The river flows north through the old town.",
    "Many people visited the museum last year!",
    "Why would anyone build a bridge there?",
    "It rained for three days in the valley.",
    "The committee met again in the spring.",
    "Several new species were found on the island.",
]
WRITTEN = ["The first thing to know is this.", "Because it was late, we left.", "I think so.", "You know it."]
SPECS = [
    "bare",
    "chat",
    "prefix:2",
    "para:3",
    "gen:2",
    "wrap:3",
    "lead:4",
    "bare,chat,prefix:2,lead:4",
    "wrap:64",
    "lead:64",
    "prefix:64",
    "lead:2,gen:1,para:1,wrap:2,bare",
]
CASES = [
    (tok, spec, end, seed)
    for tok in ("plain", "chat")
    for spec in SPECS
    for end in ("auto", "period", "eos", "none")
    for seed in (0, 7)
    if tok == "chat" or "chat" not in spec
]

SHOWN = {("chat", "bare,chat,prefix:2,lead:4", "auto", 0), ("plain", "lead:2,gen:1,para:1,wrap:2,bare", "eos", 7)}


def requests():
    """The edit requests every case trains (targets with and without final punctuation or trailing space)."""
    from crispedit.data import EditRequest

    reqs = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}") for i in range(3)]
    return reqs + [
        EditRequest("Q?", "It is so."),
        EditRequest("What is the capital of Zembla?", "Kinbote! "),
        EditRequest("Name the café on the corner", "Le Petit Zèbre?"),
    ]


def tokenizers():
    """``{"plain": the tiny BPE tokenizer, "chat": the same with a chat template}``."""
    from conftest import build_tokenizer

    plain = build_tokenizer()
    chat = copy.deepcopy(plain)
    chat.chat_template = CHAT
    return {"plain": plain, "chat": chat}


def digest(sequences: list) -> str:
    """SHA-256 of the canonical JSON of ``sequences`` (a list of ``[context, request, ids, n_context, text]``)."""
    blob = json.dumps(sequences, ensure_ascii=False, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def build_all() -> list[dict]:
    """Every case with its sequences ``[context, request, ids, n_context, text]``."""
    from crispedit.editing import EditConfig
    from crispedit.editing.contexts import build_training_sequences, parse_contexts, sequences_for

    toks, reqs = tokenizers(), requests()
    out = []
    for tok, spec in (("chat", "bare,chat,prefix:2,para:2,wrap:2,lead:4"), ("plain", "default")):
        # through sequences_for: the prefixes drawn from the bundled capability corpus
        seqs, names = sequences_for(toks[tok], reqs, EditConfig(contexts=spec, answer_end="auto", seed=3))
        out.append(
            {
                "tokenizer": tok,
                "contexts": spec,
                "answer_end": "auto",
                "seed": 3,
                "via": "sequences_for",
                "names": names,
                "sequences": [[s.context, s.request, s.ids, s.n_context, s.text] for s in seqs],
            }
        )
    for tok, spec, end, seed in CASES:
        seqs = build_training_sequences(
            toks[tok], reqs, parse_contexts(spec), end, prefixes=PREFIXES, written=WRITTEN, seed=seed
        )
        out.append(
            {
                "tokenizer": tok,
                "contexts": spec,
                "answer_end": end,
                "seed": seed,
                "sequences": [[s.context, s.request, s.ids, s.n_context, s.text] for s in seqs],
            }
        )
    return out


def golden() -> list[dict]:
    """What the file stores: every case with the number and digest of its sequences; the sequences themselves
    for the cases of :data:`SHOWN` (to read a difference)."""
    out = []
    for case in build_all():
        seqs = case.pop("sequences")
        key = (case["tokenizer"], case["contexts"], case["answer_end"], case["seed"])
        out.append({**case, "n": len(seqs), "sha256": digest(seqs), **({"sequences": seqs} if key in SHOWN else {})})
    return out


if __name__ == "__main__":
    rows = [json.dumps(case, ensure_ascii=False, separators=(",", ":")) for case in golden()]
    (HERE / "training_sequences.json").write_text("[\n" + ",\n".join(rows) + "\n]\n")
