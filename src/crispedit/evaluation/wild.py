"""WILD generation protocol (Yang et al. 2025, as used in the CrispEdit paper's appendix).

For every edit request the model answers, greedily and with a bounded number of new tokens
(``WildConfig.max_new_tokens``) cut at ".", "\\n" or EOS: the edit prompt (reliability, ``rel``), its
rephrases (generalisation, ``gen``) and its locality prompts (locality). Each question is rendered by one
*evaluation wrapper*, a renderer in the registry :data:`EVAL_WRAPPERS` (name -> renderer; the CLI's
``--context`` choices and the WILD keys of reports come from it):

* ``qa``   — ``Please answer the question:\\n\\nQ: {question}\\nA:`` (the paper's "QA context");
* ``none`` — the bare prompt ("no context");
* ``chat`` — the model's own chat template with the prompt as the user turn;

or by a user's own template with ``{question}`` (``custom``, ``--context-template``). Evaluation wrappers are
not the *training contexts* of :mod:`crispedit.editing.contexts`: no training context uses the ``qa``
wrapper (:data:`HELD_OUT_WRAPPER`), so it measures generalisation to a wrapper the edit never saw.

A judge (:mod:`.judges`) grades each answer against its gold target. Locality is reported two ways:
``loc_vs_answer`` grades the locality answer against the dataset's answer; ``loc_vs_base`` is the
share of locality answers identical (after :func:`normalize_answer`) to the pre-edit model's answer
to the same rendered prompt (needs a base model). Scores are means over edits of per-edit means.
``cross`` (:func:`crosstalk`) is the share of edits whose reliability answer misses its target and names another
edit's target instead: with many edits at once, a new fact answered for the wrong subject.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..data.edits import EditRequest
from ..errors import CrispEditError
from ..settings import Settings
from .judges import normalize_answer

if TYPE_CHECKING:  # torch only for annotations: WildConfig is checked before a model (or torch) loads
    from torch import nn

__all__ = [
    "EVAL_WRAPPERS",
    "EvalWrapper",
    "eval_wrapper",
    "HELD_OUT_WRAPPER",
    "QA_TEMPLATE",
    "WildConfig",
    "render_prompt",
    "run_wild",
    "crosstalk",
    "wild_wrappers",
    "check_template",
]

_log = logging.getLogger("crispedit.evaluate")  # one info line per wrapper evaluated

QA_TEMPLATE = "Please answer the question:\n\nQ: {question}\nA:"


@dataclass(frozen=True)
class EvalWrapper:
    """One evaluation wrapper: ``render(tokenizer, question)`` is the text the model answers; ``chat_template``:
    it renders the tokenizer's chat template (so it is skipped for tokenizers without one, and the rendered text
    carries its own special tokens: generation adds none)."""

    name: str
    render: Callable[[object, str], str]
    chat_template: bool = False


# name -> evaluation wrapper, in the order reports list them; --context's choices and the WILD keys come from here
EVAL_WRAPPERS: dict[str, EvalWrapper] = {}


def eval_wrapper(name: str, *, chat_template: bool = False):
    """Decorator registering a renderer ``(tokenizer, question) -> text`` as the evaluation wrapper ``name`` in
    :data:`EVAL_WRAPPERS` (``custom`` is reserved for a user's ``--context-template``)."""
    if not name.isidentifier() or name == "custom" or name in EVAL_WRAPPERS:
        raise ValueError(f"evaluation wrapper name {name!r} is taken or not a plain word")

    def register(render: Callable[[object, str], str]) -> Callable[[object, str], str]:
        """Record ``render`` under ``name``; returns it unchanged."""
        EVAL_WRAPPERS[name] = EvalWrapper(name, render, chat_template)
        return render

    return register


@eval_wrapper("qa")
def _qa(tokenizer, question: str) -> str:
    """:data:`QA_TEMPLATE` around ``question`` (the paper's QA context)."""
    return QA_TEMPLATE.format(question=question)


@eval_wrapper("none")
def _none(tokenizer, question: str) -> str:
    """``question`` as it is."""
    return question


@eval_wrapper("chat", chat_template=True)
def _chat(tokenizer, question: str) -> str:
    """The tokenizer's chat template as text: ``question`` as the user turn, then the generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise CrispEditError("--context chat needs a tokenizer with a chat template (this model has none)")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


HELD_OUT_WRAPPER = "qa"  # the wrapper no training context uses: compare's edit success, the Pareto front's axis


def check_template(template: str) -> str:
    """Validate a user wrapper such as ``"Support bot. Customer asks: {question}\nBot:"``: it must contain
    the field ``{question}`` exactly once and no other format field (literal braces are written ``{{ }}``)."""
    import string

    if not isinstance(template, str) or not template.strip():
        raise CrispEditError("--context-template is empty; it must contain {question}")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise CrispEditError(
            f"--context-template is not a valid template ({exc}); write literal braces as {{{{ }}}}"
        ) from None
    if fields.count("question") != 1 or any(f != "question" for f in fields):
        raise CrispEditError(
            f"--context-template must contain {{question}} exactly once and no other field, got {template!r}"
        )
    return template


@dataclass
class WildConfig(Settings):
    """One WILD run: ``context`` — the evaluation wrapper, a name in :data:`EVAL_WRAPPERS` or ``custom`` (the
    stored key keeps its old name) — ``template`` for ``custom`` (a string with ``{question}``), at most
    ``max_new_tokens`` greedy tokens cut at ``stop`` strings or EOS, prompts per generation batch."""

    context: str = HELD_OUT_WRAPPER
    max_new_tokens: int = 40
    stop: tuple[str, ...] = (".", "\n")  # plus EOS, always
    batch_size: int = 64  # a decode step's fixed cost shared by more rows (docs/evaluation.md); answers the same
    template: str | None = None

    KIND = "WILD config"

    def validate(self) -> WildConfig:
        """Check the wrapper, its template and the sizes (one-line errors); return ``self``."""
        if self.template is not None:
            self.template = check_template(self.template)
            if self.context in (HELD_OUT_WRAPPER, None):
                self.context = "custom"
            elif self.context != "custom":
                raise CrispEditError(f"give either a context ({self.context!r}) or a template, not both")
        if self.context not in EVAL_WRAPPERS and self.context != "custom":
            raise CrispEditError(f"unknown context {self.context!r} (use one of: {', '.join(EVAL_WRAPPERS)})")
        if self.context == "custom" and self.template is None:
            raise CrispEditError("context 'custom' needs a template with {question}")
        if int(self.max_new_tokens) <= 0 or int(self.batch_size) <= 0:
            raise CrispEditError("max_new_tokens and batch_size must be positive")
        return self


def render_prompt(tokenizer, question: str, context: str, template: str | None = None) -> str:
    """The text fed to the model for ``question`` under the evaluation wrapper ``context`` (its
    :data:`EVAL_WRAPPERS` renderer; chat: the template, as text; custom: ``template`` with ``{question}``
    filled in)."""
    if context == "custom":
        return check_template(template or "").format(question=question)
    wrapper = EVAL_WRAPPERS.get(context)
    if wrapper is None:
        raise CrispEditError(f"unknown context {context!r} (use one of: {', '.join(EVAL_WRAPPERS)})")
    return wrapper.render(tokenizer, question)


def _chat_wrapper(context: str) -> bool:
    """Whether the evaluation wrapper ``context`` renders the chat template (``custom`` does not)."""
    wrapper = EVAL_WRAPPERS.get(context)
    return wrapper is not None and wrapper.chat_template


def _mean(vals: Sequence[float]) -> float | None:
    vals = [float(v) for v in vals if v is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def crosstalk(answers: Sequence[str], targets: Sequence[str], correct: Sequence[bool]) -> float | None:
    """Share of edits (a fraction in [0, 1]) whose answer misses its own target and begins with *another* edit's
    target — after :func:`normalize_answer`, at a word boundary, and not where that target is how the edit's own
    begins: the new fact landed on the wrong subject.
    ``answers``, ``targets`` and ``correct`` (the judge's verdicts) are aligned per edit; ``None`` for no edits."""
    if not len(answers) == len(targets) == len(correct):
        raise ValueError(
            f"crosstalk needs one answer, target and verdict per edit, got {len(answers)}, "
            f"{len(targets)} and {len(correct)}"
        )
    if not answers:
        return None
    norm = [tuple(normalize_answer(t).split()) for t in targets]
    known = {t for t in norm if t}
    longest = max((len(t) for t in known), default=0)
    hits = 0
    for ans, own, ok in zip(answers, norm, correct):
        if ok:
            continue
        words = tuple(normalize_answer(ans).split())
        # words[:k] is another edit's target, and not the start of this edit's own ("New York" for "New York City")
        hits += any(words[:k] in known and words[:k] != own[:k] for k in range(1, min(longest, len(words)) + 1))
    return round(hits / len(answers), 4)


def _questions(requests: Sequence[EditRequest]) -> list[tuple[int, str, str, str]]:
    """Every question the protocol asks, ``(edit index, kind, question, gold answer)`` with kind ``rel`` (the edit
    prompt), ``gen`` (each rephrase) or ``loc`` (each locality prompt, gold: its recorded answer), edit by edit."""
    kinds: list[tuple[int, str, str, str]] = []
    for i, r in enumerate(requests):
        kinds.append((i, "rel", r.prompt, r.target))
        kinds += [(i, "gen", p, r.target) for p in r.rephrase_prompts]
        kinds += [(i, "loc", p, a) for p, a in r.locality]
    return kinds


def _records(
    requests: Sequence[EditRequest],
    kinds: Sequence[tuple[int, str, str, str]],
    answers: Sequence[str],
    grades: Sequence,
    base_answers: dict[int, str],
) -> list[dict]:
    """One record per edit of the questions ``kinds`` (:func:`_questions`) with the model's ``answers`` and the
    judge's ``grades``: ``rel`` (a row), ``gen`` and ``loc`` (lists of rows); a locality row also holds the base
    model's answer and whether the two agree when ``base_answers`` (question index -> answer) has it."""
    records = [
        {"id": r.id, "prompt": r.prompt, "target": r.target, "rel": None, "gen": [], "loc": []} for r in requests
    ]
    for k, ((i, kind, q, gold), ans, jd) in enumerate(zip(kinds, answers, grades)):
        row = {"question": q, "gold": gold, "answer": ans, "correct": jd.correct, "reason": jd.reason}
        if kind == "rel":
            records[i]["rel"] = row
        elif kind == "gen":
            records[i]["gen"].append(row)
        else:
            if k in base_answers:
                row["base_answer"] = base_answers[k]
                row["agrees_with_base"] = normalize_answer(ans) == normalize_answer(base_answers[k])
            records[i]["loc"].append(row)
    return records


def _scores(records: Sequence[dict], with_base: bool) -> dict:
    """The protocol's scores over ``records`` (:func:`_records`), fractions in [0, 1]: ``rel``, ``gen`` (mean of
    each edit's rephrase mean), ``loc_vs_answer``, ``loc_vs_base`` (``None`` unless ``with_base``) and ``cross``
    (:func:`crosstalk`)."""
    return {
        "rel": _mean([rec["rel"]["correct"] for rec in records]),
        "gen": _mean([_mean([g["correct"] for g in rec["gen"]]) for rec in records]),
        "loc_vs_answer": _mean([_mean([x["correct"] for x in rec["loc"]]) for rec in records]),
        "loc_vs_base": (
            _mean([_mean([x["agrees_with_base"] for x in rec["loc"]]) for rec in records]) if with_base else None
        ),
        "cross": crosstalk(
            [rec["rel"]["answer"] for rec in records],
            [rec["target"] for rec in records],
            [rec["rel"]["correct"] for rec in records],
        ),
    }


def run_wild(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    judge,
    *,
    config: WildConfig | None = None,
    base: tuple[nn.Module, object] | None = None,
    progress: bool | None = None,
) -> dict:
    """Run the protocol; returns ``{"summary", "records", "config", "timings"}`` (records hold raw
    generations; summary scores are fractions in [0, 1])."""
    from .generation import generate_answers

    cfg = config or WildConfig()
    kinds = _questions(requests)
    rendered = [render_prompt(tokenizer, q, cfg.context, cfg.template) for _, _, q, _ in kinds]
    gen_kw = dict(
        max_new_tokens=cfg.max_new_tokens,
        stop=cfg.stop,
        batch_size=cfg.batch_size,
        add_special_tokens=not _chat_wrapper(cfg.context),
        progress=progress,
    )
    t0 = time.perf_counter()
    answers = generate_answers(model, tokenizer, rendered, desc="WILD generate", **gen_kw)
    t_gen = time.perf_counter() - t0
    base_answers: dict[int, str] = {}
    t_base = 0.0
    if base is not None:
        loc_idx = [k for k, item in enumerate(kinds) if item[1] == "loc"]
        bmodel, btok = base
        t0 = time.perf_counter()
        b_rendered = [render_prompt(btok, kinds[k][2], cfg.context, cfg.template) for k in loc_idx]
        outs = generate_answers(bmodel, btok, b_rendered, desc="WILD base", **gen_kw)
        base_answers = dict(zip(loc_idx, outs))
        t_base = time.perf_counter() - t0
    t0 = time.perf_counter()
    grades = judge.grade_many([(q, g, a) for (_, _, q, g), a in zip(kinds, answers)], progress=progress)
    t_judge = time.perf_counter() - t0

    records = _records(requests, kinds, answers, grades, base_answers)
    summary = {
        **_scores(records, with_base=base is not None),
        "n_edits": len(requests),
        "n_generations": len(answers) + len(base_answers),
    }
    return {
        "summary": summary,
        "records": records,
        "config": {**asdict(cfg), "stop": list(cfg.stop) + ["<eos>"]},
        "timings": {"generate_s": round(t_gen, 2), "base_generate_s": round(t_base, 2), "judge_s": round(t_judge, 2)},
    }


def wild_wrappers(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    judge,
    *,
    wrappers: Sequence[str] = tuple(EVAL_WRAPPERS),
    templates: dict[str, str] | None = None,
    batch_size: int = WildConfig.batch_size,
    progress: bool | None = None,
) -> dict:
    """WILD summaries for several evaluation wrappers at once: ``{wrapper: {"rel", "gen", "loc_vs_answer",
    "cross", ...}, ..., "seconds": s}``. A chat-template wrapper (``chat``) is skipped (``None``) for tokenizers
    without a chat template; ``templates`` adds named user wrappers (``{name: "text with {question}"}``). Each wrapper
    also keeps
    three ``examples`` and every ``answers`` row ``[rel answer, rel correct, [gen answers], [gen correct]]``."""
    out: dict = {}
    t0 = time.perf_counter()
    runs = [(c, WildConfig(context=c, batch_size=batch_size)) for c in wrappers]
    runs += [
        (name, WildConfig(context="custom", template=t, batch_size=batch_size)) for name, t in (templates or {}).items()
    ]
    for name, cfg in runs:
        if _chat_wrapper(cfg.context) and not getattr(tokenizer, "chat_template", None):
            out[name] = None
            continue
        t1 = time.perf_counter()
        res = run_wild(model, tokenizer, requests, judge, config=cfg, progress=progress)
        out[name] = {k: res["summary"][k] for k in ("rel", "gen", "loc_vs_answer", "cross")}
        _log.info(
            "evaluate: WILD %s rel %s gen %s over %d edits (%.0f s)",
            name,
            out[name]["rel"],
            out[name]["gen"],
            len(requests),
            time.perf_counter() - t1,
        )
        out[name]["examples"] = [
            {"prompt": r["prompt"], "target": r["target"], "answer": r["rel"]["answer"]} for r in res["records"][:3]
        ]
        # every answer, compactly: [rel answer, rel correct, [gen answers], [gen correct]] per edit
        out[name]["answers"] = [
            [r["rel"]["answer"], r["rel"]["correct"], [g["answer"] for g in r["gen"]], [g["correct"] for g in r["gen"]]]
            for r in res["records"]
        ]
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out
