"""Tokenisation of (context, target) pairs for teacher-forced training and evaluation.

A training or scoring sequence is a *context* (the text the model is given) followed by a *target*
(the tokens it should produce, the only positions with a loss). :func:`split_context_target` finds
where the target starts in a tokenised ``full`` text: at the end of the tokenised context, or — when
a tokenizer merges tokens across the boundary — at the longest common prefix of the two
tokenisations. :func:`collate` right-pads rows into an :class:`EncodedBatch` whose ``labels`` are
-100 on context and padding positions (padding is found from the attention mask, never from token
ids). :func:`encode_pairs` is the classic form ``prompt + " " + target`` without chat template or EOS
(the paper's and the authors' setting, and the teacher-forced metrics'); the training contexts of
:mod:`crispedit.editing.contexts` build richer rows with the same two functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["chat_turn", "EncodedBatch", "encode_pairs", "join_prompt_target", "split_context_target", "collate"]


def join_prompt_target(prompt: str, target: str) -> str:
    """The paper's training/scoring text: ``prompt + " " + target``."""
    return prompt + " " + target


@dataclass
class EncodedBatch:
    """A right-padded batch: ``input_ids``, ``attention_mask`` and ``labels`` are ``B x T`` (long);
    ``labels`` is -100 where there is no loss; ``target_lengths[i]`` counts row i's target tokens; ``keys[i]``
    (optional) names row i's training sequence, for caches kept per sequence."""

    input_ids: Tensor  # B x T
    attention_mask: Tensor  # B x T
    labels: Tensor  # B x T, -100 where no loss
    target_lengths: list[int]
    keys: list[int] | None = None  # which training sequence each row is (indices into the caller's list), if known

    def to(self, device) -> EncodedBatch:
        """The same batch on ``device``."""
        return EncodedBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.labels.to(device),
            self.target_lengths,
            self.keys,
        )

    @property
    def n_tokens(self) -> int:
        """Number of non-padding tokens in the batch."""
        return int(self.attention_mask.sum())


def split_context_target(
    tokenizer, context: str, full: str, *, add_special_tokens: bool = True, extra_target_ids: Sequence[int] = ()
) -> tuple[list[int], int]:
    """Token ids of ``full`` (+ ``extra_target_ids`` appended, e.g. EOS) and the number of leading
    context tokens ``n`` (``ids[n:]`` is the target; at least one token on each side)."""
    c_ids = tokenizer(context, add_special_tokens=add_special_tokens)["input_ids"]
    ids = list(tokenizer(full, add_special_tokens=add_special_tokens)["input_ids"]) + list(extra_target_ids)
    n = 0
    while n < min(len(c_ids), len(ids)) and c_ids[n] == ids[n]:
        n += 1
    n = max(1, min(n, len(ids) - 1))
    return ids, n


def collate(
    tokenizer, rows: Sequence[tuple[list[int], int]], max_len: int = 512, keys: Sequence[int] | None = None
) -> EncodedBatch:
    """Right-pad ``rows`` of ``(ids, n_context)`` into one batch (labels only on ``ids[n_context:]``); ``keys``
    name the rows (:attr:`EncodedBatch.keys`)."""
    import torch  # here, not at the top: edit contexts (parsed while the CLI checks arguments) import this module

    if not rows:
        raise ValueError("no rows to collate")
    for ids, _ in rows:
        if len(ids) > max_len:
            raise ValueError(f"context + target is {len(ids)} tokens, longer than max_len={max_len}")
    T = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids_t = torch.full((len(rows), T), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    for i, (ids, n) in enumerate(rows):
        ids_t[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        labels[i, n : len(ids)] = torch.tensor(ids[n:])
    return EncodedBatch(ids_t, mask, labels, [len(ids) - n for ids, n in rows], None if keys is None else list(keys))


def encode_pairs(tokenizer, prompts: Sequence[str], targets: Sequence[str], max_len: int = 512) -> EncodedBatch:
    """Batch of ``prompt + " " + target`` sequences with the loss on the target tokens only."""
    if len(prompts) != len(targets):
        raise ValueError("prompts and targets differ in length")
    rows = [split_context_target(tokenizer, p, join_prompt_target(p, t)) for p, t in zip(prompts, targets)]
    return collate(tokenizer, rows, max_len)


def chat_turn(tokenizer, question: str, answer: str | None) -> str:
    """The chat template rendered as text: ``question`` as the user turn, then either the generation
    prompt (``answer is None``) or ``answer`` as the assistant reply with the template's turn end."""
    msgs = [{"role": "user", "content": question}]
    if answer is None:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    msgs.append({"role": "assistant", "content": answer})
    return tokenizer.apply_chat_template(msgs, tokenize=False)
