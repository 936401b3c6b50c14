"""Teacher-forced edit metrics.

For a (prompt, target) pair the model is fed ``prompt + " " + target`` and, at every target position,
its argmax next-token prediction is compared with the target token. ``exact`` is 1 when every target
token is predicted (the ``rel``/``gen`` of ``edit_report.json``), ``token_acc`` the fraction predicted.

Specificity (the paper's teacher-forced table, "Spec"; ``edit_scores(..., specificity=True)``) scores the
locality prompts against their dataset answers the same two ways (``spec`` exact, ``spec_token_acc``).
For CounterFact-style requests — every locality answer equals the edit's true object
(``ground_truth``), i.e. the locality prompts are neighbourhood prompts of the same relation —
``spec_cf`` is the share of neighbourhood prompts where the true object is more likely than the new
one (mean per-token log-probability, as ROME/MEMIT/AlphaEdit compute it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..data.edits import EditRequest
from ..data.tokenize import encode_pairs

__all__ = ["PairScore", "score_pairs", "edit_scores", "summarize_edit_scores"]


@dataclass
class PairScore:
    """Teacher-forced score of one (prompt, target) pair: ``exact`` every target token is the argmax, ``token_acc``
    the fraction that are, ``target_logprob`` the summed log-probability of the target tokens (nats) over
    ``n_tokens`` tokens."""

    exact: bool
    token_acc: float
    target_logprob: float
    n_tokens: int = 0

    @property
    def mean_logprob(self) -> float:
        """Mean log-probability per target token (nats); 0 tokens count as 1."""
        return self.target_logprob / max(self.n_tokens, 1)


@torch.no_grad()
def score_pairs(
    model: nn.Module, tokenizer, prompts: Sequence[str], targets: Sequence[str], batch_size: int = 32
) -> list[PairScore]:
    """Score every ``prompts[i] + ' ' + targets[i]`` under teacher forcing in batches of ``batch_size`` (model in
    eval mode, restored after): one :class:`PairScore` per pair, in order."""
    device = next(model.parameters()).device
    out: list[PairScore] = []
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(prompts), batch_size):
            b = encode_pairs(tokenizer, prompts[i : i + batch_size], targets[i : i + batch_size]).to(device)
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
            labels = b.labels[:, 1:]
            valid = labels != -100
            pred = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            for r in range(labels.shape[0]):
                v = valid[r]
                correct = pred[r][v] == labels[r][v]
                out.append(
                    PairScore(bool(correct.all()), float(correct.float().mean()), float(logp[r][v].sum()), int(v.sum()))
                )
    finally:
        model.train(was_training)
    return out


def _is_counterfact(r: EditRequest) -> bool:
    gt = (r.ground_truth or "").strip()
    return bool(gt) and bool(r.locality) and all(a.strip() == gt for _, a in r.locality) and gt != r.target.strip()


def edit_scores(
    model: nn.Module, tokenizer, requests: Sequence[EditRequest], batch_size: int = 32, *, specificity: bool = False
) -> list[dict]:
    """Per-edit reliability (edit prompt) and generalisation (rephrase prompts), teacher-forced;
    with ``specificity=True`` also locality-prompt scores (``spec``, ``spec_token_acc``, ``spec_cf``)."""
    rel = score_pairs(model, tokenizer, [r.prompt for r in requests], [r.target for r in requests], batch_size)
    reph_prompts, reph_targets, owner = [], [], []
    for i, r in enumerate(requests):
        for p in r.rephrase_prompts:
            reph_prompts.append(p)
            reph_targets.append(r.target)
            owner.append(i)
    gen = score_pairs(model, tokenizer, reph_prompts, reph_targets, batch_size) if reph_prompts else []
    per_edit = []
    for i, r in enumerate(requests):
        g = [s for s, o in zip(gen, owner) if o == i]
        per_edit.append(
            {
                "id": r.id,
                "prompt": r.prompt,
                "target": r.target,
                "rel": rel[i].exact,
                "rel_token_acc": round(rel[i].token_acc, 4),
                "target_logprob": round(rel[i].target_logprob, 4),
                "gen": (sum(s.exact for s in g) / len(g)) if g else None,
                "gen_token_acc": (round(sum(s.token_acc for s in g) / len(g), 4)) if g else None,
            }
        )
    if specificity:
        _add_specificity(model, tokenizer, requests, per_edit, batch_size)
    return per_edit


def _add_specificity(model, tokenizer, requests, per_edit, batch_size) -> None:
    lp, lt, lo, cf_new, cf_owner = [], [], [], [], []
    for i, r in enumerate(requests):
        for p, a in r.locality:
            lp.append(p)
            lt.append(a)
            lo.append(i)
            if _is_counterfact(r):
                cf_new.append((p, r.target))
                cf_owner.append(len(lp) - 1)
    loc = score_pairs(model, tokenizer, lp, lt, batch_size) if lp else []
    new = score_pairs(model, tokenizer, [p for p, _ in cf_new], [t for _, t in cf_new], batch_size) if cf_new else []
    true_beats_new = {k: loc[k].mean_logprob > s.mean_logprob for k, s in zip(cf_owner, new)}
    for i, e in enumerate(per_edit):
        ks = [k for k, o in enumerate(lo) if o == i]
        e["spec"] = (sum(loc[k].exact for k in ks) / len(ks)) if ks else None
        e["spec_token_acc"] = round(sum(loc[k].token_acc for k in ks) / len(ks), 4) if ks else None
        cf = [true_beats_new[k] for k in ks if k in true_beats_new]
        e["spec_cf"] = (sum(cf) / len(cf)) if cf else None


def summarize_edit_scores(per_edit: Sequence[dict]) -> dict:
    """Means over edits (None where no edit has the key, rounded to 4 digits) of ``rel``, ``gen`` and their token
    accuracies, plus ``spec`` / ``spec_token_acc`` / ``spec_cf`` when specificity was scored."""

    def mean(key: str):
        """Mean of ``key`` over the edits that have it (rounded to 4 digits), None if none has it."""
        vals = [float(e[key]) for e in per_edit if e.get(key) is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    out = {
        "rel": mean("rel"),
        "gen": mean("gen"),
        "rel_token_acc": mean("rel_token_acc"),
        "gen_token_acc": mean("gen_token_acc"),
    }
    for key in ("spec", "spec_token_acc", "spec_cf"):  # present only when specificity was scored
        if any(key in e for e in per_edit):
            out[key] = mean(key)
    return out
