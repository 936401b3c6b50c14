"""A text corpus as language-model batches for curvature statistics: tokenised once, grouped by
length so that a batch wastes at most a bounded share on padding (:func:`plan_batches`), the positions that carry a
loss taken from the attention mask, never from token ids (:func:`loss_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["loss_positions", "plan_batches", "LMBatch", "lm_batches"]


def loss_positions(attention_mask: Tensor) -> Tensor:
    """Positions ``t`` that predict a real next token: ``mask[t] and mask[t+1]`` (B x T-1)."""
    m = attention_mask.bool()
    return m[:, :-1] & m[:, 1:]


def plan_batches(lengths: Sequence[int], batch_size: int, max_padding: float | None = 0.25) -> list[list[int]]:
    """Group sequence indices into batches of at most ``batch_size`` sequences.

    ``max_padding=None`` keeps the corpus order in consecutive chunks (``[0..b-1], [b..2b-1], ...``).
    A float sorts the sequences by decreasing length (ties keep corpus order) and fills batches in that
    order, closing a batch early when adding the next sequence would make more than that fraction of
    its ``n_seqs x longest`` token slots padding (``0`` = only equal lengths share a batch). Sequences
    shorter than 2 tokens carry no next-token loss and are left out of every batch. Returns lists of
    indices into ``lengths``; the plan depends on nothing but its arguments (every process of a
    distributed run computes the same one)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_padding is not None and not 0.0 <= max_padding < 1.0:
        raise ValueError(f"max_padding must be in [0, 1), got {max_padding}")
    useful = [i for i, n in enumerate(lengths) if n >= 2]
    if max_padding is None:
        return [useful[i : i + batch_size] for i in range(0, len(useful), batch_size)]
    order = sorted(useful, key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in order:
        if cur:
            longest = lengths[cur[0]]
            pad = 1.0 - (real + lengths[i]) / ((len(cur) + 1) * longest)
            if len(cur) == batch_size or pad > max_padding:
                batches.append(cur)
                cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    if cur:
        batches.append(cur)
    return batches


@dataclass
class LMBatch:
    """One right-padded batch of tokenised texts.

    ``indices``: corpus index of each row (what seeds its sampled labels); ``input_ids`` and
    ``attention_mask``: ``B x T`` (``mask``: what the model is fed,
    :func:`~crispedit.forward_args.static_attention_mask`);
    ``rows``: ``B x T`` bool, position ``t`` predicts a real next token
    (:func:`loss_positions` with a False last column); ``labels``: ``N`` next-token ids of the ``N`` True
    positions of ``rows`` in row-major order (sequence by sequence, each a prefix of its row); ``flat``: their
    flat row-major indices (``N``, on the batch's device), ``counts``: the loss rows per sequence (host
    ints) and ``padded``: whether any row is padded, derived from ``rows`` / the mask when not given."""

    indices: list[int]
    input_ids: Tensor
    attention_mask: Tensor
    rows: Tensor
    labels: Tensor
    flat: Tensor | None = None
    counts: list[int] | None = None
    padded: bool | None = None

    def __post_init__(self) -> None:
        # what the collection needs from ``rows`` on the host, computed once: no step of it reads ``rows`` back
        if self.counts is None:
            self.counts = self.rows.sum(1).tolist()
        if self.flat is None:
            self.flat = self.rows.reshape(-1).nonzero().squeeze(1)
        if self.padded is None:
            self.padded = bool((self.attention_mask == 0).any())

    def take(self, x: Tensor) -> Tensor:
        """The loss rows of ``x`` (``B x T x ...``): ``x[rows]``, ``N x ...`` in row-major order, by index (no
        value read back to the host)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.flat)

    @property
    def n_rows(self) -> int:
        """Number of loss positions (K-FAC rows) in the batch."""
        return int(self.labels.numel())


def lm_batches(
    tokenizer,
    texts: Sequence[str] | Sequence[Sequence[int]],
    *,
    max_len: int,
    batch_size: int,
    max_padding: float | None = 0.25,
    device: torch.device | str = "cpu",
    loss_from: Sequence[int] | None = None,
) -> list[LMBatch]:
    """Tokenise ``texts`` once (truncated to ``max_len`` tokens, the tokenizer's special tokens included;
    sequences of token ids are taken as they are, truncated the same way) and group them with
    :func:`plan_batches`; each batch is right-padded with the tokenizer's pad id (masking comes from the
    attention mask, never from the token id) and put on ``device``. ``loss_from`` (one int per text): only
    the positions predicting token ``loss_from[i]`` or later of text ``i`` are loss rows (a prompt's tokens
    left out); default every position with a real next token."""
    ids = _token_ids(tokenizer, texts, max_len)
    if loss_from is not None and len(loss_from) != len(ids):
        raise ValueError(f"loss_from has {len(loss_from)} entries for {len(ids)} texts")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    out = []
    for idx in plan_batches([len(x) for x in ids], batch_size, max_padding):
        T = max(len(ids[i]) for i in idx)
        input_ids = torch.full((len(idx), T), pad_id, dtype=torch.long)
        attn = torch.zeros((len(idx), T), dtype=torch.long)
        for r, i in enumerate(idx):
            input_ids[r, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
            attn[r, : len(ids[i])] = 1
        rows = torch.zeros((len(idx), T), dtype=torch.bool)
        rows[:, :-1] = loss_positions(attn)
        if loss_from is not None:  # position t predicts token t + 1
            first = torch.tensor([max(int(loss_from[i]) - 1, 0) for i in idx])
            rows &= torch.arange(T)[None, :] >= first[:, None]
        labels = input_ids[:, 1:][rows[:, :-1]]
        flat = rows.reshape(-1).nonzero().squeeze(1)
        out.append(
            LMBatch(
                list(idx),
                input_ids.to(device),
                attn.to(device),
                rows.to(device),
                labels.to(device),
                flat.to(device),
                rows.sum(1).tolist(),
                bool((attn == 0).any()),
            )
        )
    return out


def _token_ids(tokenizer, texts, max_len: int) -> list[list[int]]:
    """Token ids of ``texts`` (strings are tokenised, id sequences copied), each truncated to ``max_len``."""
    texts = list(texts)
    if all(isinstance(t, str) for t in texts):
        return tokenizer(texts, truncation=True, max_length=max_len)["input_ids"] if texts else []
    if any(isinstance(t, str) for t in texts):
        raise TypeError("texts must be all strings or all token-id sequences")
    return [[int(x) for x in t][:max_len] for t in texts]
