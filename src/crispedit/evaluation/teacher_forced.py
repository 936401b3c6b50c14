"""Teacher-forced edit metrics.

For a (prompt, target) pair the model is fed ``prompt + " " + target`` and, at every target position,
its argmax next-token prediction is compared with the target token. ``exact`` is 1 when every target
token is predicted (the ``rel``/``gen`` of ``edit_report.json``), ``token_acc`` the fraction predicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from ..data.edits import EditRequest
from ..data.tokenize import encode_pairs

__all__ = ["PairScore", "score_pairs", "edit_scores", "summarize_edit_scores"]


@dataclass
class PairScore:
    exact: bool
    token_acc: float
    target_logprob: float


@torch.no_grad()
def score_pairs(model: nn.Module, tokenizer, prompts: Sequence[str], targets: Sequence[str],
                batch_size: int = 32) -> list[PairScore]:
    device = next(model.parameters()).device
    out: list[PairScore] = []
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(prompts), batch_size):
            b = encode_pairs(tokenizer, prompts[i:i + batch_size], targets[i:i + batch_size]).to(device)
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
            labels = b.labels[:, 1:]
            valid = labels != -100
            pred = logits.argmax(-1)
            logp = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            for r in range(labels.shape[0]):
                v = valid[r]
                correct = (pred[r][v] == labels[r][v])
                out.append(PairScore(bool(correct.all()), float(correct.float().mean()), float(logp[r][v].sum())))
    finally:
        model.train(was_training)
    return out


def edit_scores(model: nn.Module, tokenizer, requests: Sequence[EditRequest], batch_size: int = 32) -> list[dict]:
    """Per-edit reliability (edit prompt) and generalisation (rephrase prompts), teacher-forced."""
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
        per_edit.append({
            "id": r.id, "prompt": r.prompt, "target": r.target,
            "rel": rel[i].exact, "rel_token_acc": round(rel[i].token_acc, 4),
            "target_logprob": round(rel[i].target_logprob, 4),
            "gen": (sum(s.exact for s in g) / len(g)) if g else None,
            "gen_token_acc": (round(sum(s.token_acc for s in g) / len(g), 4)) if g else None,
        })
    return per_edit


def summarize_edit_scores(per_edit: Sequence[dict]) -> dict:
    def mean(key: str):
        vals = [float(e[key]) for e in per_edit if e.get(key) is not None]
        return round(sum(vals) / len(vals), 4) if vals else None

    return {"rel": mean("rel"), "gen": mean("gen"), "rel_token_acc": mean("rel_token_acc"),
            "gen_token_acc": mean("gen_token_acc")}
