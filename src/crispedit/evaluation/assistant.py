"""What an edit does to the assistant where people use it: through the model's chat template.

KL drift on held-out text and log-likelihood tasks do not see how an instruct model *answers*. Two measures do,
each comparing the edited model's greedy chat answers with the base model's (the edited model with its original
weights swapped back in, so no second copy):

* **style drift** (:func:`style_drift`) — the answers to :func:`style_prompts`, prompts unrelated to any edit:
  ``length_ratio`` (the edited answers' total length in tokens over the base's), ``bare_share`` (of the prompts the
  base answers in more than :data:`BARE_WORDS` words, the share the edited model now answers in a bare phrase of at
  most that many), ``changed`` (the share of answers that differ at all, after :func:`~.judges.normalize_answer`)
  and ``answer_kl`` (KL(base || edited), nats per token, teacher-forced on the base model's own answers);
* **subject bleed** (:func:`subject_bleed`) — for each edit with a subject, the :data:`SUBJECT_PROBES` questions
  about that subject that do not ask the edited relation: ``target`` (the share of answers that now name the edit's
  new target, :func:`~.judges.mentions`, where the base's answer did not) and ``changed`` (the share that differ at
  all).

Answers are greedy, at most :data:`MAX_NEW_TOKENS` new tokens, ended only by the end of turn. Models without a chat
template are measured on the bare prompts.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

from ..data.edits import EditRequest
from ..errors import CrispEditError

__all__ = [
    "style_prompts",
    "style_drift",
    "base_style_answers",
    "subject_bleed",
    "subject_probes",
    "assistant_measures",
    "SUBJECT_PROBES",
    "BARE_WORDS",
    "MAX_NEW_TOKENS",
    "STYLE_PROMPTS",
    "BLEED_EDITS",
]

_log = logging.getLogger("crispedit.evaluate")

MAX_NEW_TOKENS = 48  # per answer: enough to see an answer's form, cheap enough for every report
BARE_WORDS = 5  # an answer of at most this many words is a bare phrase
STYLE_PROMPTS = 32  # style-drift prompts per evaluation (the bundled set's size)
BLEED_EDITS = 64  # edits whose subject is probed per evaluation (the first ones; every edit when fewer)
# Questions about an edit's subject that ask no particular relation ({subject}: the request's subject)
SUBJECT_PROBES = (
    "Tell me one fact about {subject}.",
    "Who is associated with {subject}?",
    "What do you know about {subject}?",
)


def style_prompts(n: int | None = STYLE_PROMPTS) -> list[str]:
    """The first ``n`` (None: all) of the bundled style-drift prompts (``chat_probes.json``: everyday questions and
    requests, unrelated to any edit set and disjoint from the capability corpus's chat prompts)."""
    from ..data.corpus import bundled_path

    prompts = json.loads(bundled_path("chat_probes.json").read_text(encoding="utf-8"))["prompts"]
    return prompts if n is None else prompts[:n]


def subject_probes(requests: Sequence[EditRequest], limit: int | None = BLEED_EDITS) -> list[tuple[int, str]]:
    """``(request index, question)`` for the :data:`SUBJECT_PROBES` of the first ``limit`` requests that name a
    subject (None: all of them)."""
    idx = [i for i, r in enumerate(requests) if r.subject and r.subject.strip()]
    idx = idx if limit is None else idx[:limit]
    return [(i, p.format(subject=requests[i].subject.strip())) for i in idx for p in SUBJECT_PROBES]


def _render(tokenizer, prompts: Sequence[str]) -> tuple[list[str], bool]:
    """``prompts`` as the model sees them: through its chat template (generation prompt added), or bare when it
    has none; and whether the template was used (its text carries its own special tokens)."""
    if not getattr(tokenizer, "chat_template", None):
        return list(prompts), False
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ], True


def _answers(
    model, tokenizer, texts: Sequence[str], templated: bool, base, progress: bool | None, desc: str
) -> list[str]:
    """Greedy answers to the rendered ``texts``, ended only by EOS (end of turn): of ``model``, or — ``base`` given
    — of the base: a second model, or a dict of weights swapped into ``model`` for the time it answers."""
    import contextlib

    from .drift import swapped_weights
    from .generation import generate_answers

    if base is not None and not isinstance(base, dict):
        model = base
    ctx = swapped_weights(model, base) if isinstance(base, dict) else contextlib.nullcontext()
    with ctx:
        return generate_answers(
            model,
            tokenizer,
            texts,
            max_new_tokens=MAX_NEW_TOKENS,
            stop=(),
            add_special_tokens=not templated,
            progress=progress,
            desc=desc,
        )


def _words(text: str) -> int:
    return len(text.split())


def style_drift(
    model,
    tokenizer,
    base,
    prompts: Sequence[str] | None = None,
    *,
    progress: bool | None = False,
    examples: int = 3,
    base_answers: Sequence[str] | None = None,
) -> dict:
    """The style-drift figures of the edited ``model`` against its base (``base``: the pre-edit values of the
    changed parameters, full name -> tensor, or the base model itself) on ``prompts`` (default
    :func:`style_prompts`): ``n``, ``length_ratio``, ``bare_share``, ``changed``, ``answer_kl`` (see the module
    docstring), ``tokens_base`` / ``tokens_edited``
    (mean answer length, tokens) and the first ``examples`` prompts with both answers. ``base_answers``: the base's
    answers to ``prompts`` when already known (:func:`base_style_answers`: a playground asks them once)."""
    from .drift import answer_kl
    from .judges import normalize_answer

    prompts = list(style_prompts() if prompts is None else prompts)
    if not prompts:
        raise CrispEditError("style drift needs at least one prompt")
    texts, templated = _render(tokenizer, prompts)
    if base_answers is None:
        base_answers = _answers(model, tokenizer, texts, templated, base, progress, "style (base)")
    elif len(base_answers) != len(prompts):
        raise ValueError(f"{len(base_answers)} base answers for {len(prompts)} style prompts")
    edited = _answers(model, tokenizer, texts, templated, None, progress, "style (edited)")
    enc = lambda xs: [tokenizer(x, add_special_tokens=False)["input_ids"] for x in xs]  # noqa: E731
    n_base, n_edit = [len(x) for x in enc(base_answers)], [len(x) for x in enc(edited)]
    long_base = [i for i, a in enumerate(base_answers) if _words(a) > BARE_WORDS]
    bare = [i for i in long_base if _words(edited[i]) <= BARE_WORDS]
    prompt_ids = tokenizer(texts, add_special_tokens=not templated)["input_ids"]
    seqs = [p + a for p, a in zip(prompt_ids, enc(base_answers))]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    kl = answer_kl(model, seqs, [len(p) for p in prompt_ids], base=base, pad_id=pad)
    return {
        "n": len(prompts),
        "length_ratio": round(sum(n_edit) / max(sum(n_base), 1), 4),
        "bare_share": round(len(bare) / len(long_base), 4) if long_base else 0.0,
        "changed": round(
            sum(normalize_answer(a) != normalize_answer(b) for a, b in zip(base_answers, edited)) / len(prompts), 4
        ),
        "answer_kl": round(kl["kl"], 6),
        "kl_tokens": kl["tokens"],
        "tokens_base": round(sum(n_base) / len(prompts), 2),
        "tokens_edited": round(sum(n_edit) / len(prompts), 2),
        "examples": [
            {"prompt": prompts[i], "base": base_answers[i], "edited": edited[i]}
            for i in range(min(examples, len(prompts)))
        ],
    }


def base_style_answers(model, tokenizer, prompts: Sequence[str]) -> list[str]:
    """``model``'s answers to the style ``prompts`` as :func:`style_drift` asks them (its ``base_answers``)."""
    texts, templated = _render(tokenizer, prompts)
    return _answers(model, tokenizer, texts, templated, None, False, "style (base)")


def subject_bleed(
    model,
    tokenizer,
    requests: Sequence[EditRequest],
    base,
    *,
    limit: int | None = BLEED_EDITS,
    progress: bool | None = False,
    examples: int = 3,
) -> dict | None:
    """The subject-bleed figures of the edited ``model`` against its ``base`` (pre-edit weights or the base model,
    as :func:`style_drift`) on the :func:`subject_probes` of ``requests``: ``edits``
    probed, ``n`` questions, ``target`` (the share of answers that name their edit's new target where the base's
    did not), ``changed`` (the share that differ from the base's at all), ``by_probe`` (the two shares for each
    of :data:`SUBJECT_PROBES` alone, over the edits probed: which kind of question carries the new target) and
    up to ``examples`` answers that name the target. ``None`` when no request names a subject."""
    from .judges import mentions, normalize_answer

    probes = subject_probes(requests, limit)
    if not probes:
        return None
    texts, templated = _render(tokenizer, [q for _, q in probes])
    base_answers = _answers(model, tokenizer, texts, templated, base, progress, "subject probes (base)")
    edited = _answers(model, tokenizer, texts, templated, None, progress, "subject probes (edited)")
    hits = [
        k
        for k, (i, _) in enumerate(probes)
        if mentions(edited[k], requests[i].target) and not mentions(base_answers[k], requests[i].target)
    ]
    differs = [normalize_answer(a) != normalize_answer(b) for a, b in zip(base_answers, edited)]
    # subject_probes lists each subject's questions in SUBJECT_PROBES order: question k asks template k mod m
    m, n_edits = len(SUBJECT_PROBES), len(probes) // len(SUBJECT_PROBES)
    return {
        "edits": n_edits,
        "n": len(probes),
        "target": round(len(hits) / len(probes), 4),
        "changed": round(sum(differs) / len(probes), 4),
        "by_probe": [
            {
                "question": template,
                "target": round(sum(k % m == j for k in hits) / n_edits, 4),
                "changed": round(sum(differs[j::m]) / n_edits, 4),
            }
            for j, template in enumerate(SUBJECT_PROBES)
        ],
        "examples": [
            {
                "question": probes[k][1],
                "target": requests[probes[k][0]].target,
                "base": base_answers[k],
                "edited": edited[k],
            }
            for k in hits[:examples]
        ],
    }


def assistant_measures(
    model,
    tokenizer,
    requests: Sequence[EditRequest],
    base,
    *,
    bleed_limit: int | None = BLEED_EDITS,
    progress: bool | None = False,
) -> dict:
    """``{"style": style_drift(...), "bleed": subject_bleed(...)}`` of the edited ``model`` against ``base`` (its
    pre-edit weights or the base model; the ``assistant`` section of an edit report), with the seconds each
    took; ``bleed`` is None without requests that name a subject."""
    t0 = time.perf_counter()
    style = style_drift(model, tokenizer, base, progress=progress)
    style["seconds"] = round(time.perf_counter() - t0, 2)
    _log.info(
        "evaluate: style drift length x%.2f, bare %.2f, changed %.2f, answer KL %.4f (%.0f s)",
        style["length_ratio"],
        style["bare_share"],
        style["changed"],
        style["answer_kl"],
        style["seconds"],
    )
    t0 = time.perf_counter()
    bleed = subject_bleed(model, tokenizer, requests, base, limit=bleed_limit, progress=progress)
    if bleed is not None:
        bleed["seconds"] = round(time.perf_counter() - t0, 2)
        _log.info(
            "evaluate: subject bleed target %.3f, changed %.3f over %d questions (%.0f s)",
            bleed["target"],
            bleed["changed"],
            bleed["n"],
            bleed["seconds"],
        )
    return {"style": style, "bleed": bleed}
