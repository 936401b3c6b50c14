"""Capability drift on held-out text: per-token KL(base || edited) and perplexity.

The base model is either a second model or, cheaper, the edited model with its original weights
swapped back in for each batch (only the trained layers differ, so this needs no second copy).
KL is averaged over every position that predicts a real next token (attention mask, never token ids).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..curvature.kfac import loss_positions
from ..weights import parameter

__all__ = ["kl_drift", "answer_kl", "swapped_weights", "perplexity"]


@contextlib.contextmanager
def swapped_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Temporarily put ``weights`` (full parameter name, or module name for its ``weight`` -> tensor)
    into ``model``; the current values come back on exit."""
    targets = {name: parameter(model, name) for name in weights}
    saved = {}
    with torch.no_grad():
        for name, w in weights.items():
            saved[name] = targets[name].detach().clone()
            targets[name].copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for name, w in saved.items():
                targets[name].copy_(w)


def _encode(tokenizer, texts, max_len, device):
    side = tokenizer.padding_side
    tokenizer.padding_side = "right"
    try:
        enc = tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True, max_length=max_len)
    finally:
        tokenizer.padding_side = side
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


@torch.no_grad()
def kl_drift(model: nn.Module, tokenizer, texts: Sequence[str], *, base_weights: dict[str, torch.Tensor] | None = None,
             base_model: nn.Module | None = None, max_len: int = 256, batch_size: int = 8,
             progress: bool | None = None) -> dict:
    """Mean per-token KL(base || model) and both perplexities on ``texts``."""
    if (base_weights is None) == (base_model is None):
        raise ValueError("give exactly one of base_weights or base_model")
    device = next(model.parameters()).device
    kl_sum, nll_base, nll_model, n = 0.0, 0.0, 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for i in tqdm(range(0, len(texts), batch_size), desc="KL drift",
                      disable=(None if progress is None else not progress)):
            ids, attn = _encode(tokenizer, texts[i:i + batch_size], max_len, device)
            pos = loss_positions(attn)
            labels = ids[:, 1:][pos]
            lp, lq = _log_probs(model, ids, attn, pos, base_weights, base_model)
            kl_sum += float((lq.exp() * (lq - lp)).sum())
            nll_model -= float(lp.gather(-1, labels[:, None]).sum())
            nll_base -= float(lq.gather(-1, labels[:, None]).sum())
            n += int(pos.sum())
    finally:
        model.train(was_training)
    return {"kl_drift": kl_sum / max(n, 1), "ppl": math.exp(nll_model / max(n, 1)),
            "ppl_base": math.exp(nll_base / max(n, 1)), "tokens": n}


def _log_probs(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor,
               base_weights: dict[str, torch.Tensor] | None, base_model: nn.Module | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probabilities (float32, ``N x V`` at the ``N`` True positions of ``pos``, ``B x T-1``) of
    ``model`` as it is and of the base: ``base_model``, or ``model`` with ``base_weights`` swapped in."""
    lp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)[pos]
    if base_model is not None:
        bdev = next(base_model.parameters()).device
        blog = base_model(input_ids=ids.to(bdev), attention_mask=attn.to(bdev)).logits[:, :-1].float().to(ids.device)
    else:
        with swapped_weights(model, base_weights):
            blog = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    return lp, torch.log_softmax(blog, -1)[pos]


@torch.no_grad()
def answer_kl(model: nn.Module, sequences: Sequence[Sequence[int]], starts: Sequence[int], *,
              base: dict[str, torch.Tensor] | nn.Module, pad_id: int = 0, batch_size: int = 8) -> dict:
    """Mean per-token KL(base || model) (nats) over the answer tokens of token-id ``sequences``: the positions
    predicting token ``starts[i]`` or later of sequence ``i`` (e.g. a chat prompt's tokens, then the base model's
    own answer from ``starts[i]`` on). ``base``: a second model, or weights (full name -> tensor) swapped into
    ``model``. Returns
    ``{"kl": nats per answer token, "tokens": answer tokens counted}``."""
    if len(sequences) != len(starts):
        raise ValueError(f"{len(starts)} answer starts for {len(sequences)} sequences")
    device = next(model.parameters()).device
    kl_sum, n = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(sequences), batch_size):
            rows, first = sequences[i:i + batch_size], starts[i:i + batch_size]
            width = max(len(r) for r in rows)
            ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
            attn = torch.zeros((len(rows), width), dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, :len(r)], attn[b, :len(r)] = torch.tensor(list(r), dtype=torch.long), 1
            pos = loss_positions(attn) & (torch.arange(width - 1)[None, :] >= torch.tensor(first)[:, None] - 1)
            ids, attn, pos = ids.to(device), attn.to(device), pos.to(device)
            lp, lq = (_log_probs(model, ids, attn, pos, base, None) if isinstance(base, dict)
                      else _log_probs(model, ids, attn, pos, None, base))
            kl_sum += float((lq.exp() * (lq - lp)).sum())
            n += int(pos.sum())
    finally:
        model.train(was_training)
    return {"kl": kl_sum / max(n, 1), "tokens": n}


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer, texts: Sequence[str], max_len: int = 256, batch_size: int = 8) -> float:
    """exp(mean next-token NLL, nats) over the non-padding tokens of ``texts`` (each cut to ``max_len``)."""
    device = next(model.parameters()).device
    nll, n = 0.0, 0
    for i in range(0, len(texts), batch_size):
        ids, attn = _encode(tokenizer, texts[i:i + batch_size], max_len, device)
        pos = loss_positions(attn)
        lp = torch.log_softmax(model(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)[pos]
        nll -= float(lp.gather(-1, ids[:, 1:][pos][:, None]).sum())
        n += int(pos.sum())
    return math.exp(nll / max(n, 1))
