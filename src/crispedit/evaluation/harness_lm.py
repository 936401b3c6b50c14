"""The in-memory model as an lm-evaluation-harness language model (:func:`harness_lm`), and the variant that scores
a multiple-choice item's choices on one cached context (:func:`prefix_sharing_lm_class`), each context built on the
longest beginning it shares with the one before: a task's fixed few-shot preamble runs once, not once per item.
:mod:`.capabilities` runs the tasks through it. Imports torch and lm-eval when called, not on import.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

__all__ = ["harness_lm", "prefix_sharing_lm_class", "MIN_SHARED_CONTEXT"]

MIN_SHARED_CONTEXT = 32  # tokens: a shorter beginning shared with the previous context is recomputed, not copied


class _ContextCaches:
    """KV caches (batch 1) of multiple-choice contexts, each built on the longest beginning it shares with the
    last context computed in full — a task's fixed preamble (TruthfulQA's six Q/A pairs, an MMLU subject's five
    examples) is then run once, not once per item. Reuse needs at least :data:`MIN_SHARED_CONTEXT` shared tokens
    and a cache that can be cut back exactly (full attention in every layer: no sliding window). Contexts met in
    sorted token order share the most. Callers copy a returned cache before extending it."""

    def __init__(self, model: nn.Module, device):
        from ..forward_args import last_logits_only, takes_full_masks

        self.model, self.device, self.head = model, device, last_logits_only(model)
        self.reuse = takes_full_masks(model)
        self.anchor: list[int] = []
        self.anchor_cache = None

    def _run(self, ids: list[int], past):
        import torch

        return self.model(
            input_ids=torch.tensor([ids], device=self.device), past_key_values=past, use_cache=True, **self.head
        ).past_key_values

    def __call__(self, prefix: list[int]):
        """The KV cache of the token list ``prefix`` (``None`` for an empty one)."""
        import copy

        if not prefix:
            return None
        n = 0
        if self.anchor_cache is not None:
            limit = min(len(self.anchor), len(prefix))
            while n < limit and self.anchor[n] == prefix[n]:
                n += 1
        if n >= MIN_SHARED_CONTEXT:
            cache = copy.deepcopy(self.anchor_cache)
            if len(self.anchor) > n:  # a negative count removes that many tokens in every transformers version
                cache.crop(n - len(self.anchor))
            return self._run(prefix[n:], cache) if n < len(prefix) else cache
        cache = self._run(prefix, None)
        if self.reuse:
            self.anchor, self.anchor_cache = list(prefix), cache
        return cache


def prefix_sharing_lm_class():
    """An ``HFLM`` whose loglikelihood encodes each shared context once (KV cache) for all its choices.

    lm-eval's stock HFLM re-runs the whole context for every answer choice of a multiple-choice item
    (25-shot ARC: ~2.5k tokens x 4 choices). Here requests are grouped by their tokenised context, the
    context minus its last token is run once with ``use_cache`` (on the cache of the beginning it shares with
    the context before it, :class:`_ContextCaches`), and the choices are scored as one batch on top of that
    cache. Results equal the stock ones (tested); requests longer than the model's window fall back to the
    stock path (which truncates from the left).
    """
    import copy

    import torch
    import torch.nn.functional as F
    from lm_eval.models.huggingface import HFLM
    from tqdm.auto import tqdm

    class PrefixSharingHFLM(HFLM):
        """lm-eval's HF model, scoring requests that share a context in one forward pass."""

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            """``(log P(continuation | context), is_greedy)`` per request, contexts shared across choices."""
            encoded = []
            for req in requests:
                ctx, cont = req.args
                if ctx == "":
                    encoded.append(([self.prefix_token_id], self.tok_encode(cont)))
                else:
                    encoded.append(self._encode_pair(ctx, cont))
            groups: dict[tuple, list[int]] = {}
            for i, (c, _) in enumerate(encoded):
                groups.setdefault(tuple(c), []).append(i)
            results: list = [None] * len(requests)
            fallback = [i for i, (c, k) in enumerate(encoded) if len(c) + len(k) > self.max_length or not k]
            if fallback:
                for i, r in zip(fallback, super().loglikelihood([requests[i] for i in fallback], disable_tqdm=True)):
                    results[i] = r
            skip = set(fallback)
            dev = self.model.device if hasattr(self.model, "device") else next(self.model.parameters()).device
            bs = max(int(self.batch_size) if str(self.batch_size).isdigit() else 8, 1)
            caches = _ContextCaches(self.model, dev)
            with torch.no_grad():
                for ctx in tqdm(sorted(groups), desc="loglikelihood (shared contexts)", disable=disable_tqdm or None):
                    idx = [i for i in groups[ctx] if i not in skip]
                    if not idx:
                        continue
                    cache = caches(list(ctx[:-1]))
                    for s in range(0, len(idx), bs):
                        for i, ans in self._score_choices(
                            ctx, [encoded[i][1] for i in idx[s : s + bs]], cache, dev, idx[s : s + bs]
                        ):
                            results[i] = ans
                            self.cache_hook.add_partial("loglikelihood", requests[i].args, ans)
            return results

        def _score_choices(self, ctx: tuple, conts: list[list[int]], cache, dev, idx: list[int]):
            """``(request index, (log-likelihood, is_greedy))`` of each continuation token list in ``conts`` after
            the context ``ctx``, one batch on copies of ``cache`` (the KV cache of ``ctx[:-1]``, or ``None``)."""
            n_prefix, L = len(ctx) - 1, max(len(k) for k in conts)
            ids = torch.full((len(conts), L), self.tokenizer.pad_token_id or 0, dtype=torch.long)
            mask = torch.zeros((len(conts), n_prefix + L), dtype=torch.long)
            mask[:, :n_prefix] = 1
            for r, k in enumerate(conts):
                row = [ctx[-1]] + list(k[:-1])
                ids[r, : len(row)] = torch.tensor(row)
                mask[r, n_prefix : n_prefix + len(row)] = 1
            past = None
            if cache is not None:
                past = copy.deepcopy(cache)
                past.batch_repeat_interleave(len(conts))
            logits = self.model(
                input_ids=ids.to(dev), attention_mask=mask.to(dev), past_key_values=past, use_cache=past is not None
            ).logits
            logp = F.log_softmax(logits.float(), dim=-1)
            for r, (i, k) in enumerate(zip(idx, conts)):
                tgt = torch.tensor(k, device=dev)
                lp = logp[r, : len(k)]
                yield i, (float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all()))

    return PrefixSharingHFLM


def harness_lm(model: nn.Module, tokenizer, batch_size: int, max_length: int | None, share_prefix: bool, show: bool):
    """The in-memory ``model`` as an lm-eval language model on its own device (choices of an item scored on one
    cached context with ``share_prefix``); without ``show`` its request bars are off."""
    from lm_eval.models.huggingface import HFLM

    lm_cls = prefix_sharing_lm_class() if share_prefix else HFLM
    lm = lm_cls(
        pretrained=model,
        tokenizer=tokenizer,
        batch_size=batch_size,
        device=str(next(model.parameters()).device),
        max_length=max_length,
    )
    if not show:
        # the evaluator calls these without disable_tqdm: bind it on this instance only
        for name in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
            setattr(lm, name, functools.partial(getattr(lm, name), disable_tqdm=True))
    return lm
