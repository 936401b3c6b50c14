"""Batched greedy generation with KV cache, stopping at any of a set of stop strings or EOS.

Prompts are sorted by length before batching (less left padding, fewer wasted positions) and the
answers are returned in the caller's order. Generation stops per sequence at EOS (the tokenizer's
and the model's generation-config EOS ids, e.g. ``<|im_end|>`` for chat models) or as soon as a
stop string appears; the answer is cut before the first stop string.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

__all__ = ["generate_answers", "cut_at_stop", "eos_token_ids"]


def cut_at_stop(text: str, stop: Sequence[str], skip_leading: bool = True) -> str:
    """``text`` up to (excluding) the earliest occurrence of any non-empty stop string, stripped.

    ``skip_leading``: stop strings inside the leading whitespace (a model that opens its answer with
    a newline) do not count, so the answer is the first line/sentence with content.
    """
    if skip_leading:
        text = text.lstrip()
    hits = [text.find(s) for s in stop if s and s in text]
    return text[:min(hits)].strip() if hits else text.strip()


class _StopOnStrings:
    """Per-sequence stopping criterion: done once the new text (after leading whitespace, when
    ``skip_leading``) contains a stop string. Finished rows are padded by ``generate``."""

    def __init__(self, tokenizer, prompt_len: int, stop: Sequence[str], skip_leading: bool):
        self.tok, self.start, self.stop, self.skip = tokenizer, prompt_len, [s for s in stop if s], skip_leading

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = []
        for row in input_ids[:, self.start:]:
            text = self.tok.decode(row[-48:] if row.shape[0] > 48 else row, skip_special_tokens=True)
            if self.skip and row.shape[0] <= 48:
                text = text.lstrip()
            done.append(any(s in text for s in self.stop))
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _stop_criteria(tokenizer, prompt_len: int, stop: Sequence[str], skip_leading: bool):
    """A transformers ``StoppingCriteriaList`` holding :class:`_StopOnStrings` (transformers is imported
    here, not at module load, so the CLI parses its arguments without it)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    global _StopCriterion
    if _StopCriterion is None:
        _StopCriterion = type("StopOnStrings", (_StopOnStrings, StoppingCriteria), {})
    return StoppingCriteriaList([_StopCriterion(tokenizer, prompt_len, stop, skip_leading)])


_StopCriterion = None


def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """EOS ids from the tokenizer and the model's generation config (deduplicated, in order)."""
    ids: list[int] = []
    cands = [getattr(tokenizer, "eos_token_id", None)]
    gc = getattr(model, "generation_config", None)
    g_eos = getattr(gc, "eos_token_id", None) if gc is not None else None
    cands += list(g_eos) if isinstance(g_eos, (list, tuple)) else [g_eos]
    for c in cands:
        if isinstance(c, int) and c not in ids:
            ids.append(c)
    return ids


@torch.no_grad()
def generate_answers(model: nn.Module, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 40,
                     stop: Sequence[str] = (".", "\n"), batch_size: int = 16, add_special_tokens: bool = True,
                     skip_leading_stop: bool = True, progress: bool | None = False,
                     desc: str = "generate") -> list[str]:
    """Greedy continuation of each prompt, cut at the first stop string (kept out of the answer).

    ``add_special_tokens=False`` is for prompts already rendered with a chat template (which carry
    their own special tokens). ``skip_leading_stop``: see :func:`cut_at_stop`. ``progress``: None = a bar on terminals only, False = never.
    """
    if not prompts:
        return []
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outs: list[str | None] = [None] * len(prompts)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    was_training = model.training
    model.eval()
    try:
        for start in tqdm(range(0, len(order), batch_size), desc=desc,
                          disable=(None if progress is None else not progress)):
            idx = order[start:start + batch_size]
            enc = tokenizer([prompts[i] for i in idx], return_tensors="pt", padding=True,
                            add_special_tokens=add_special_tokens).to(device)
            plen = enc["input_ids"].shape[1]
            criteria = _stop_criteria(tokenizer, plen, stop, skip_leading_stop) if any(stop) else None
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 temperature=None, top_p=None, top_k=None,
                                 pad_token_id=pad, eos_token_id=eos or None, stopping_criteria=criteria)
            for i, row in zip(idx, gen[:, plen:]):
                outs[i] = cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stop, skip_leading_stop)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return [o if o is not None else "" for o in outs]
