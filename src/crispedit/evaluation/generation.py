"""Batched greedy generation with KV cache, stopping at any of a set of stop strings."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["generate_answers"]


@torch.no_grad()
def generate_answers(model: nn.Module, tokenizer, prompts: Sequence[str], *, max_new_tokens: int = 40,
                     stop: Sequence[str] = (".", "\n"), batch_size: int = 16) -> list[str]:
    """Greedy continuation of each prompt, cut at the first stop string (kept out of the answer)."""
    device = next(model.parameters()).device
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outs: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(list(prompts[i:i + batch_size]), return_tensors="pt", padding=True).to(device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                 stop_strings=list(stop) or None, tokenizer=tokenizer)
            for row in gen[:, enc["input_ids"].shape[1]:]:
                text = tokenizer.decode(row, skip_special_tokens=True)
                cut = min([text.find(s) for s in stop if s and text.find(s) >= 0] or [len(text)])
                outs.append(text[:cut].strip())
    finally:
        tokenizer.padding_side = side
    return outs
