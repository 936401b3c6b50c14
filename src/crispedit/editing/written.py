"""Text the unedited model writes itself: the lead-ins of the ``gen`` context and MEMIT's templates
(:func:`generated_prefixes`), its replies with the new fact put in (:func:`own_replies`), its chat answers
(:func:`own_chat_answers`) — and the cache that keeps those answers by the weights that wrote them.

Within :func:`prefixes_from` the text is written with given weights put into the model — a session's base weights
in every round — whatever the model holds then (:func:`writing_weights`).

The preservation term (:mod:`.keep`) holds the unedited model's greedy answers to the bundled everyday prompts. Those
answers depend only on the weights that write them, the tokenizer's chat template, the prompts and the answer
length, so they are written once per model and read back by every later edit of it — every round of a session
(whose model-written text is the session base's, :func:`prefixes_from`), every single edit in the
playground. The file is ``<cache root>/written/<weight fingerprint>.json`` (:func:`~crispedit.models.cache_dir`;
:func:`~crispedit.weights.weight_fingerprint`), one entry per (kind, settings, chat template, prompts) digest.
Greedy answers written in the same batches are the same answers, so a read entry is what writing would give.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..atomic import atomic_write_json
from ..data.edits import EditRequest
from ..data.tokenize import chat_turn
from ..errors import CrispEditError
from ..versions import check_written_by, stamped

__all__ = [
    "WRITTEN_FORMAT",
    "written_path",
    "entry_key",
    "cached_writing",
    "prefixes_from",
    "writing_weights",
    "GEN_STARTS",
    "generated_prefixes",
    "own_chat_answers",
    "REPLY_TOKENS",
    "own_replies",
]

WRITTEN_FORMAT = 1
GEN_STARTS = ("The", "Therefore", "Because", "I", "You")  # ROME's seeds for model-written prefixes


@contextlib.contextmanager
def prefixes_from(weights: dict | None) -> Iterator[None]:
    """Within the block, :func:`generated_prefixes` writes with ``weights`` (full parameter name -> tensor: the
    unedited values of the parameters an edit changes) put into the model for the time it writes, whatever the
    model holds then. A session's later rounds run under it with the session's base weights, so every round
    draws the prefixes of the unedited model — MEMIT's context templates, the ``gen`` training context — as the
    authors' code does (it draws them once per process). ``None``: the model as it is."""
    token = _PREFIX_WEIGHTS.set(weights)
    try:
        yield
    finally:
        _PREFIX_WEIGHTS.reset(token)


_PREFIX_WEIGHTS: contextvars.ContextVar = contextvars.ContextVar("crispedit_prefix_weights", default=None)


def writing_weights() -> dict | None:
    """The weights the model writes its own text with here (:func:`prefixes_from`'s; ``None``: as it is)."""
    return _PREFIX_WEIGHTS.get()


def generated_prefixes(model, tokenizer, per_start: int = 4, max_new_tokens: int = 10, seed: int = 0) -> list[str]:
    """Prefixes written by ``model`` itself: ``per_start`` sampled continuations (top-k 5, at most
    ``max_new_tokens`` tokens, seeded, the global RNG untouched) of each of :data:`GEN_STARTS`, on one
    line each and closed with a period — ``len(GEN_STARTS) * per_start`` strings. Call it on the
    unedited model (or under :func:`prefixes_from`, which puts the unedited weights in while it writes); the
    rows of one start share a length, so no padding is involved."""
    import torch

    from ..distributed import is_sharded
    from ..weights import with_weights

    out: list[str] = []
    device = next(model.parameters()).device
    split = is_sharded(model)
    was_training = model.training
    model.eval()
    try:
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            torch.no_grad(),
            with_weights(model, _PREFIX_WEIGHTS.get()),
        ):
            torch.manual_seed(seed)
            for start in GEN_STARTS:
                ids = tokenizer(start, return_tensors="pt")["input_ids"].to(device).repeat(per_start, 1)
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=True,
                    top_k=5,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=tokenizer.eos_token_id,
                    synced_gpus=split,
                )  # a split model: every process runs every step
                for row in tokenizer.batch_decode(gen, skip_special_tokens=True):
                    text = " ".join(row.replace("{", " ").replace("}", " ").split())
                    out.append(text if text[-1:] in ".!?" else text + ".")
    finally:
        model.train(was_training)
    return out


def own_chat_answers(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, desc: str
) -> tuple[list[str], list[str], bool]:
    """``model``'s own greedy answers (at most ``max_new_tokens`` tokens, ended only by its end of turn) to
    ``prompts`` through its chat template, or to the bare prompts without one: ``(shown, answers, templated)``,
    ``shown`` the prompts as the model was fed them."""
    from ..evaluation.generation import generate_answers

    templated = bool(getattr(tokenizer, "chat_template", None))
    shown = [chat_turn(tokenizer, p, None) if templated else p for p in prompts]
    answers = generate_answers(
        model,
        tokenizer,
        shown,
        max_new_tokens=max_new_tokens,
        stop=(),
        add_special_tokens=not templated,
        progress=False,
        desc=desc,
    )
    return shown, answers, templated


REPLY_TOKENS = 48  # tokens of the unedited model's own answer read for its first sentence


def _first_sentence(text: str) -> str:
    """``text`` up to and including its first sentence end (``.``, ``!``, ``?`` followed by a space or the end) or
    line break, stripped."""
    text = text.strip()
    m = re.search(r"[.!?](?=\s|$)|\n", text)
    return text if m is None else text[: m.end()].strip()


def own_replies(model, tokenizer, requests: Sequence[EditRequest]) -> list[str]:
    """For each request, the reply the unedited ``model`` would give through its chat template if it held the new
    fact: the first sentence of its own greedy answer to the prompt with the old answer (``ground_truth``, as a
    whole word, any case) replaced by the target, when that sentence names it; otherwise the target followed by the
    model's own greedy continuation of it (the target put at the start of its reply) to the end of that sentence.
    Under :func:`prefixes_from` the unedited weights are put in while it writes."""
    from ..evaluation.generation import generate_answers
    from ..weights import with_weights

    asked = [chat_turn(tokenizer, r.prompt, None) for r in requests]
    with with_weights(model, _PREFIX_WEIGHTS.get()):
        own = generate_answers(model, tokenizer, asked, max_new_tokens=REPLY_TOKENS, stop=(), add_special_tokens=False)
        out: list[str | None] = []
        for r, a in zip(requests, own):
            first = _first_sentence(a)
            old = (r.ground_truth or "").strip()
            hit = re.search(rf"(?<!\w){re.escape(old)}(?!\w)", first, flags=re.IGNORECASE) if old else None
            out.append(first[: hit.start()] + r.target + first[hit.end() :] if hit else None)
        todo = [k for k, x in enumerate(out) if x is None]
        cont = generate_answers(
            model,
            tokenizer,
            [asked[k] + requests[k].target for k in todo],
            max_new_tokens=24,
            stop=(".", "!", "?", "\n"),
            add_special_tokens=False,
            skip_leading_stop=False,
        )
    for k, c in zip(todo, cont):
        c = c.strip()
        out[k] = requests[k].target + (c if not c or c[0] in ",;:'" else " " + c) + "."
    return [x.strip() for x in out]


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
    if (
        data.get("fingerprint") != fingerprint
        or not isinstance(entries, dict)
        or not all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in entries.values())
    ):
        raise CrispEditError(f"written-text cache {path} is malformed; delete it to write it again")
    return entries


def cached_writing(
    model,
    tokenizer,
    kind: str,
    settings: dict,
    prompts: Sequence[str],
    write: Callable[[], list[str]],
    root: str | Path | None = None,
) -> list[str]:
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
