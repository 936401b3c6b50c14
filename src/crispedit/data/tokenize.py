"""Tokenisation of (prompt, target) pairs for teacher-forced training and evaluation.

The text is ``prompt + " " + target`` without chat template or EOS (the paper's and the authors'
setting). Target tokens are those after the tokenised prompt; when a tokenizer merges across the
boundary the split falls at the longest common prefix of the two tokenisations. Batches are right
padded; ``labels`` is -100 on prompt and padding positions (padding is found from the attention
mask, never from token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

__all__ = ["EncodedBatch", "encode_pairs", "join_prompt_target"]


def join_prompt_target(prompt: str, target: str) -> str:
    return prompt + " " + target


@dataclass
class EncodedBatch:
    input_ids: Tensor       # B x T
    attention_mask: Tensor  # B x T
    labels: Tensor          # B x T, -100 where no loss
    target_lengths: list[int]

    def to(self, device) -> "EncodedBatch":
        return EncodedBatch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device),
                            self.target_lengths)


def encode_pairs(tokenizer, prompts: Sequence[str], targets: Sequence[str], max_len: int = 512) -> EncodedBatch:
    if len(prompts) != len(targets):
        raise ValueError("prompts and targets differ in length")
    seqs, label_rows, tlens = [], [], []
    for p, t in zip(prompts, targets):
        p_ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        full = tokenizer(join_prompt_target(p, t), add_special_tokens=True)["input_ids"]
        n = 0
        while n < min(len(p_ids), len(full)) and p_ids[n] == full[n]:
            n += 1
        n = max(1, min(n, len(full) - 1))  # at least one context token and one target token
        if len(full) > max_len:
            raise ValueError(f"prompt + target is {len(full)} tokens, longer than max_len={max_len}")
        seqs.append(full)
        label_rows.append([-100] * n + full[n:])
        tlens.append(len(full) - n)
    T = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (s, lab) in enumerate(zip(seqs, label_rows)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, : len(s)] = torch.tensor(lab)
    return EncodedBatch(ids, mask, labels, tlens)
