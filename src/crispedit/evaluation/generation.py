"""Batched greedy generation with KV cache, stopping at any of a set of stop strings or EOS.

Prompts are sorted by length before batching (less left padding, fewer wasted positions) and the
answers are returned in the caller's order. Generation stops per sequence at EOS (the tokenizer's
and the model's generation-config EOS ids, e.g. ``<|im_end|>`` for chat models) or as soon as a
stop string appears; the answer is cut before the first stop string. Decoding is a short greedy loop
(:func:`_greedy`) rather than ``model.generate``, so that a row whose answer has ended leaves the batch.

A prefix that every prompt shares (a chat template's system turn, a wrapper's instruction) is computed once: its
KV cache is copied to every row of a batch and the rest of each prompt follows it, padded between the prefix and
its own tokens (masked there; positions count real tokens only), so each row sees what it would alone. This is
done for models with one full attention mask in every layer (:func:`~crispedit.forward_args.takes_full_masks`); others
generate from the whole prompt.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..distributed import broadcast_, is_sharded
from ..forward_args import last_logits_only, takes_full_masks

__all__ = ["generate_answers", "cut_at_stop", "eos_token_ids"]


def cut_at_stop(text: str, stop: Sequence[str], skip_leading: bool = True) -> str:
    """``text`` up to (excluding) the earliest occurrence of any non-empty stop string, stripped.

    ``skip_leading``: stop strings inside the leading whitespace (a model that opens its answer with
    a newline) do not count, so the answer is the first line/sentence with content.
    """
    if skip_leading:
        text = text.lstrip()
    hits = [text.find(s) for s in stop if s and s in text]
    return text[: min(hits)].strip() if hits else text.strip()


class _StopOnStrings:
    """Whether a row's new tokens end its answer: an EOS id, or a stop string in the new text (after leading
    whitespace, when ``skip_leading``; the last 48 tokens are decoded)."""

    def __init__(self, tokenizer, stop: Sequence[str], skip_leading: bool, eos: set[int]):
        self.tok, self.stop, self.skip, self.eos = tokenizer, [s for s in stop if s], skip_leading, eos

    def __call__(self, row: list[int]) -> bool:
        if row[-1] in self.eos:
            return True
        if not self.stop:
            return False
        text = self.tok.decode(row[-48:], skip_special_tokens=True)
        if self.skip and len(row) <= 48:
            text = text.lstrip()
        return any(s in text for s in self.stop)


def _greedy(
    model: nn.Module,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    past,
    max_new_tokens: int,
    done: Callable[[list[int]], bool],
) -> list[list[int]]:
    """Greedy decoding of a left-padded batch (``B x T`` ids and key mask; ``past``: a KV cache of its first
    positions, or ``None``): each row's new tokens up to and including the one after which ``done`` says it has
    ended, at most ``max_new_tokens``. Rows that have ended leave the batch (their cache rows dropped), so the
    steps after most answers ended cost what the remaining rows cost. Positions count real tokens only. On a model
    split across processes (:func:`crispedit.distributed.shard_model`) every process must call it with the same
    batch; they decode process 0's tokens, so they run the same forwards."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    start = 0 if past is None else past.get_seq_length()
    head = last_logits_only(model)
    out = model(
        input_ids=input_ids[:, start:],
        attention_mask=mask,
        position_ids=pos[:, start:],
        past_key_values=past,
        use_cache=True,
        **head,
    )
    past, last = out.past_key_values, pos[:, -1]
    alive = list(range(input_ids.shape[0]))
    rows: list[list[int]] = [[] for _ in alive]
    split = is_sharded(model)
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1].argmax(-1)
        if split:  # a model split across processes: every process takes process 0's tokens, so all stop together
            broadcast_(nxt)
        for r, t in zip(alive, nxt.tolist()):
            rows[r].append(t)
        keep = [j for j, r in enumerate(alive) if not done(rows[r])]
        if not keep or step == max_new_tokens - 1:
            break
        if len(keep) < len(alive):
            sel = torch.tensor(keep, device=mask.device)
            past.batch_select_indices(sel)
            mask, nxt, last, alive = mask[sel], nxt[sel], last[sel], [alive[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        last = last + 1
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=last[:, None],
            past_key_values=past,
            use_cache=True,
        )
    return rows


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
def generate_answers(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int = 40,
    stop: Sequence[str] = (".", "\n"),
    batch_size: int = 16,
    add_special_tokens: bool = True,
    skip_leading_stop: bool = True,
    progress: bool | None = False,
    desc: str = "generate",
) -> list[str]:
    """Greedy continuation of each prompt, cut at the first stop string (kept out of the answer).

    ``add_special_tokens=False`` is for prompts already rendered with a chat template (which carry
    their own special tokens). ``skip_leading_stop``: see :func:`cut_at_stop`. ``progress``: None = a bar on terminals
    only, False = never.
    """
    if not prompts:
        return []
    device = next(model.parameters()).device
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    ids = tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))
    outs: list[str | None] = [None] * len(prompts)
    was_training = model.training
    model.eval()
    try:
        prefix, cache = _prefix_cache(model, ids, device)
        done = _StopOnStrings(tokenizer, stop, skip_leading_stop, set(eos))
        for start in tqdm(
            range(0, len(order), batch_size), desc=desc, disable=(None if progress is None else not progress)
        ):
            idx = order[start : start + batch_size]
            input_ids, mask = _left_padded([ids[i] for i in idx], prefix, pad, device)
            past = None
            if cache is not None:
                past = copy.deepcopy(cache)
                past.batch_repeat_interleave(len(idx))
            rows = _greedy(model, input_ids, mask, past, max_new_tokens, done)
            for i, row in zip(idx, rows):
                outs[i] = cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stop, skip_leading_stop)
    finally:
        model.train(was_training)
    return [o if o is not None else "" for o in outs]


MIN_SHARED_PREFIX = 16  # tokens: a shorter common prefix does not pay for its cache copy per batch (docs/evaluation.md)


def _prefix_cache(model: nn.Module, ids: Sequence[Sequence[int]], device) -> tuple[int, object | None]:
    """The length ``P`` of the token prefix every prompt of ``ids`` shares (at least one token of each prompt left
    after it) and its KV cache (batch 1), or ``(0, None)`` when it is shorter than :data:`MIN_SHARED_PREFIX` or the
    model cannot take a mask with padding between the prefix and the rest (:func:`_shares_prefix`)."""
    if len(ids) < 2 or not _shares_prefix(model):
        return 0, None
    first, n = ids[0], min(len(x) for x in ids) - 1
    p = 0
    while p < n and all(x[p] == first[p] for x in ids):
        p += 1
    if p < MIN_SHARED_PREFIX:
        return 0, None
    out = model(input_ids=torch.tensor([first[:p]], device=device), use_cache=True, **last_logits_only(model))
    return p, out.past_key_values


def _shares_prefix(model: nn.Module) -> bool:
    """Whether a cached shared prefix can be exact for ``model``: one full attention mask in every layer (no
    sliding window, whose cache layers keep only their window)."""
    return takes_full_masks(model)


def _left_padded(rows: Sequence[Sequence[int]], prefix: int, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` (``B x T``) of token rows padded to the longest: on the left, or — with a
    shared ``prefix`` of that many tokens — between the prefix and the rest of each row (mask 0 there)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        gap = width - len(r)
        ids[b, :prefix], mask[b, :prefix] = torch.tensor(r[:prefix], dtype=torch.long), 1
        ids[b, prefix + gap :], mask[b, prefix + gap :] = torch.tensor(r[prefix:], dtype=torch.long), 1
    return ids.to(device), mask.to(device)
