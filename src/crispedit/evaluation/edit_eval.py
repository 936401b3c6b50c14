"""One evaluation of an edited model, used by ``crispedit edit``, sessions, ``compare``, the demo and
``benchmarks/edit_matrix.py``: teacher-forced reliability / generalisation / locality of the requests,
per-token KL drift from the base weights on held-out text, optional WILD free generation per context,
optional lm-eval capability tasks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from ..data.corpus import heldout_text
from ..data.edits import EditRequest
from .drift import kl_drift
from .teacher_forced import edit_scores, summarize_edit_scores

__all__ = ["evaluate_edit", "round_map_probe"]

_log = logging.getLogger("crispedit.evaluate")  # one info line per finished phase: a long evaluation leaves a trail


def evaluate_edit(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    base_weights: dict[str, torch.Tensor],
    *,
    kl_text: str | Path | None = None,
    kl_texts: int = 32,
    max_len: int = 256,
    wild: Sequence[str] = (),
    wild_templates: dict[str, str] | None = None,
    judge=None,
    capabilities: Sequence[str] = (),
    limit: int | dict | None = None,
    max_gen_toks: int | None = None,
    bench_dir: str | Path | None = None,
    assistant: bool = False,
    progress: bool | None = None,
) -> dict:
    """Evaluate the edited ``model`` on ``requests``; ``base_weights`` (parameter name -> pre-edit
    value, e.g. ``EditResult.original_weights``) give the base model for the drift.

    Returns ``{"summary": {rel, gen, loc, rel_token_acc, ... (fractions in [0, 1]), "kl_drift" (nats per
    token, KL(base || edited) on ``kl_texts`` held-out paragraphs of at most ``max_len`` tokens), "ppl",
    "ppl_base", "kl_tokens"}, "per_edit": [one dict per request, in order]}`` plus ``"wild"``
    (:func:`.wild.wild_wrappers` for the ``wild`` evaluation wrappers and the named ``wild_templates``, rule judge
    unless ``judge``) and
    ``"capabilities"`` (:func:`.capabilities.run_capabilities`, ``limit`` items per task, generative answers cut at
    ``max_gen_toks`` tokens) and ``"assistant"``
    (:func:`.assistant.assistant_measures`: style drift and subject bleed through the chat template) when asked."""
    per_edit, summary = _teacher_forced(model, tokenizer, requests)
    summary.update(_drift(model, tokenizer, base_weights, kl_text, kl_texts, max_len, progress))
    out: dict = {"summary": summary, "per_edit": per_edit}
    if wild or wild_templates:
        from .judges import RuleJudge
        from .wild import wild_wrappers

        out["wild"] = wild_wrappers(
            model,
            tokenizer,
            requests,
            judge or RuleJudge(),
            wrappers=list(wild),
            templates=wild_templates,
            progress=progress,
        )
        out["wild"]["judge"] = "rule" if judge is None else type(judge).__name__
    if assistant:
        from .assistant import assistant_measures

        out["assistant"] = assistant_measures(model, tokenizer, requests, base_weights, progress=progress)
    if capabilities:
        out["capabilities"] = _capabilities(model, tokenizer, capabilities, limit, bench_dir, max_gen_toks, progress)
    return out


def _capabilities(
    model: nn.Module,
    tokenizer,
    tasks: Sequence[str],
    limit: int | dict | None,
    bench_dir: str | Path | None,
    max_gen_toks: int | None,
    progress: bool | None,
) -> dict:
    """:func:`.capabilities.run_capabilities` on ``tasks`` (``limit`` items each, generative answers cut at
    ``max_gen_toks`` tokens), a log line per task."""
    from .capabilities import run_capabilities

    scores = run_capabilities(
        model, tokenizer, tasks, limit=limit, bench_dir=bench_dir, max_gen_toks=max_gen_toks, progress=progress
    )
    for name, c in scores.items():
        _log.info(
            "evaluate: %s %s %s (%s items, %.0f s)",
            name,
            c.get("metric"),
            c.get("score"),
            c.get("n"),
            c.get("seconds") or 0,
        )
    return scores


def _teacher_forced(model: nn.Module, tokenizer, requests: Sequence[EditRequest]) -> tuple[list[dict], dict]:
    """``(per_edit, summary)``: each request's teacher-forced scores (:func:`.teacher_forced.edit_scores`) and
    their summary (rel, gen, loc, ...: fractions in [0, 1]), logged."""
    t0 = time.perf_counter()
    per_edit = edit_scores(model, tokenizer, requests)
    summary = summarize_edit_scores(per_edit)
    _log.info(
        "evaluate: teacher-forced rel %s gen %s over %d edits (%.0f s)",
        summary.get("rel"),
        summary.get("gen"),
        len(requests),
        time.perf_counter() - t0,
    )
    return per_edit, summary


def _drift(
    model: nn.Module,
    tokenizer,
    base_weights: dict[str, torch.Tensor],
    kl_text: str | Path | None,
    kl_texts: int,
    max_len: int,
    progress: bool | None,
) -> dict:
    """The summary's drift fields, logged: ``kl_drift`` (nats per token, KL(base || edited) on ``kl_texts`` held-out
    paragraphs of ``kl_text`` of at most ``max_len`` tokens), ``ppl`` and ``ppl_base`` on them, ``kl_tokens``."""
    t0 = time.perf_counter()
    drift = kl_drift(
        model, tokenizer, heldout_text(kl_text, kl_texts), base_weights=base_weights, max_len=max_len, progress=progress
    )
    _log.info(
        "evaluate: KL drift %.5f nats/token, perplexity %.2f (base %.2f) (%.0f s)",
        drift["kl_drift"],
        drift["ppl"],
        drift["ppl_base"],
        time.perf_counter() - t0,
    )
    return {
        "kl_drift": round(drift["kl_drift"], 6),
        "ppl": round(drift["ppl"], 4),
        "ppl_base": round(drift["ppl_base"], 4),
        "kl_tokens": drift["tokens"],
    }


def _wild_rel(
    model: nn.Module, tokenizer, requests: Sequence[EditRequest], wild: Sequence[str], batch_size: int
) -> dict:
    """``{wrapper: WILD rel}`` of ``requests`` on ``model`` under each of ``wild`` (rule judge; ``None`` for a
    wrapper the tokenizer cannot render, e.g. chat without a template)."""
    from .judges import RuleJudge
    from .wild import wild_wrappers

    res = (
        wild_wrappers(
            model, tokenizer, requests, RuleJudge(), wrappers=list(wild), batch_size=batch_size, progress=False
        )
        if wild
        else {}
    )
    return {c: None if res.get(c) is None else res[c]["rel"] for c in wild}


def round_map_probe(
    tokenizer, requests: Sequence[EditRequest], chunk: int, wild: Sequence[str] = ("qa", "chat"), batch_size: int = 32
) -> Callable[[nn.Module, int], dict]:
    """A sequential run's retention as it goes: ``requests`` edited in rounds of ``chunk``, the returned function,
    called on the model after round ``k`` (1-based), gives the record of whether the first round's edits still hold
    — ``{"n": their number, "tf_rel": their mean teacher-forced reliability, "wild": {wrapper: WILD rel (rule
    judge; ``None`` for chat without a chat template)}}`` — plus ``by_round``: the teacher-forced reliability of
    each round ``1..k``'s edits on that model (a row of the retention map; the first entry is ``tf_rel``), and
    ``newest``: round ``k``'s own edits right after it, ``{"n", "tf_rel", "wild"}`` as above (what the round landed,
    before the rounds after it act; for the first round, the first-round record itself)."""
    requests = list(requests)

    def measure(model: nn.Module, k: int) -> dict:
        """The retention record of the model as round ``k`` left it."""
        rel = [e["rel"] for e in edit_scores(model, tokenizer, requests[: k * chunk], batch_size)]
        by_round = [sum(rel[i : i + chunk]) / len(rel[i : i + chunk]) for i in range(0, len(rel), chunk)]
        first = {
            "n": min(chunk, len(rel)),
            "tf_rel": round(by_round[0], 4),
            "wild": _wild_rel(model, tokenizer, requests[:chunk], wild, batch_size),
        }
        own = requests[(k - 1) * chunk : k * chunk]
        newest = (
            first
            if k == 1
            else {
                "n": len(own),
                "tf_rel": round(by_round[-1], 4),
                "wild": _wild_rel(model, tokenizer, own, wild, batch_size),
            }
        )
        return {**first, "by_round": [round(x, 4) for x in by_round], "newest": dict(newest)}

    return measure
