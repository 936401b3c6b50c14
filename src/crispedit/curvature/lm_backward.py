"""The backward of a language model's loss that K-FAC's output-gradient statistics need.

The LM head sees only the positions that carry loss (:func:`head_on_rows`, :func:`lm_row_logits`). Labels:
``sampled`` draws each position's label from the model's own predictive distribution (Monte-Carlo Fisher =
Gauss-Newton for softmax cross-entropy, what the paper's Bregman argument needs), seeded per text
(:func:`sample_labels`); ``empirical`` uses the text's next token (empirical Fisher, what the authors' code does).
When the head is a plain linear map (:func:`plain_head`) the gradient of the summed cross-entropy with respect to
the final hidden states is formed directly as ``(softmax(z) - onehot(y)) W``, a few sequences at a time
(:func:`lm_backward`), so no ``N x V`` log-softmax graph is kept.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..forward_args import static_attention_mask
from .lm_batches import LMBatch

__all__ = ["LabelMode", "sample_labels", "head_on_rows", "lm_row_logits", "lm_labels", "plain_head", "lm_backward"]


class LabelMode(str, Enum):
    """Where the labels behind ``S`` come from: ``sampled`` from the model's own predictive distribution
    (Monte-Carlo Fisher = Gauss-Newton), ``empirical`` the text's next token (empirical Fisher)."""

    SAMPLED = "sampled"
    EMPIRICAL = "empirical"


def _seq_seed(seed: int, index: int) -> int:
    h = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def sample_labels(logits: Tensor, seed: int, index: int) -> Tensor:
    """Labels drawn from ``softmax(logits)`` (``T x V``) with a generator of ``logits``' device seeded by (seed,
    sequence index): the same sequence gets the same labels whatever the batching (drawn where the logits are, so
    a GPU collection moves no logits to the host; a GPU's random stream differs from the CPU's, so factors
    collected on a GPU are another sample of the same statistics, not the CPU's bit for bit).

    Drawn by inversion: one uniform per position against the float64 cumulative distribution (``T x V``), the
    label the first entry above it — exactly categorical, and on a CPU far cheaper than ``torch.multinomial``,
    which draws an exponential variate per vocabulary entry."""
    gen = torch.Generator(device=logits.device).manual_seed(_seq_seed(seed, index))
    cdf = torch.softmax(logits.detach().float(), dim=-1).double().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=gen, device=cdf.device, dtype=torch.float64) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[1] - 1).squeeze(-1)


@contextlib.contextmanager
def head_on_rows(model: nn.Module, rows: Tensor, skip: Sequence[nn.Module] = ()) -> Iterator[bool]:
    """Feed the output embedding (LM head) only the hidden states at ``rows`` (``B x T`` bool), as one
    ``1 x N x H`` sequence, so that the ``V``-wide logits are formed for the ``N`` loss positions only.
    Yields whether the head was found (a model without ``get_output_embeddings``, or whose head is in
    ``skip``, runs unchanged)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or any(head is m for m in skip):
        yield False
        return

    def pre(mod, args):
        """Forward pre-hook: feed the head ``h[rows]`` as one ``1 x N x H`` sequence when the hidden states are
        ``B x T x H`` with ``B x T`` the shape of ``rows``; otherwise leave the input unchanged."""
        h = args[0]
        if h.dim() != 3 or tuple(h.shape[:2]) != tuple(rows.shape):
            return None
        return (h[rows].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(pre)
    try:
        yield True
    finally:
        handle.remove()


def lm_row_logits(model: nn.Module, batch: LMBatch, skip: Sequence[nn.Module] = ()) -> Tensor:
    """Float32 (or wider) next-token logits ``N x V`` of ``model`` at the ``N`` loss positions of ``batch``
    (row-major order, as ``batch.labels``). The LM head runs on those positions only when the model
    exposes it (:func:`head_on_rows`); otherwise the full ``B x T x V`` logits are formed and gathered."""
    n = batch.n_rows
    with head_on_rows(model, batch.rows, skip):
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
    if (
        logits.dim() == 3
        and logits.shape[0] == 1
        and logits.shape[1] == n
        and tuple(logits.shape[:2]) != tuple(batch.rows.shape)
    ):
        logits = logits.squeeze(0)  # a view: its backward copies nothing
    elif logits.dim() == 3 and tuple(logits.shape[:2]) == tuple(batch.rows.shape):
        logits = logits[batch.rows]
    else:
        raise RuntimeError(
            f"unexpected logits shape {tuple(logits.shape)} for a batch of shape {tuple(batch.rows.shape)}"
        )
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def lm_labels(logits: Tensor, batch: LMBatch, label_mode: LabelMode, seed: int) -> Tensor:
    """Labels of the ``N`` rows: the text's next tokens (empirical) or draws from ``softmax(logits)`` seeded
    per (``seed``, corpus index) with :func:`sample_labels` (sampled; the same whatever the batching)."""
    if label_mode is LabelMode.EMPIRICAL:
        return batch.labels
    parts, off = [], 0
    for idx, c in zip(batch.indices, batch.counts):
        parts.append(sample_labels(logits[off : off + c], seed, idx))
        off += c
    return torch.cat(parts)


def plain_head(model: nn.Module, batch: LMBatch, skip: Sequence[nn.Module] = ()) -> nn.Module | None:
    """The model's LM head if its logits are exactly ``F.linear(h, head.weight, head.bias)`` of the final
    hidden states (no soft-capping, scaling or other post-processing), else None. Checked by a no-grad probe
    on the first 8 tokens of ``batch``'s first sequence; a head in ``skip`` (a hooked layer) gives None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if head is None or not isinstance(weight, Tensor) or weight.dim() != 2 or any(head is m for m in skip):
        return None
    seen = []
    h = head.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            t = min(8, batch.input_ids.shape[1])
            logits = model(
                input_ids=batch.input_ids[:1, :t], attention_mask=batch.attention_mask[:1, :t], use_cache=False
            ).logits
            if len(seen) != 1 or seen[0].dim() != 3:
                return None
            mine = F.linear(seen[0], weight, getattr(head, "bias", None))
    finally:
        h.remove()
    if mine.shape != logits.shape:
        return None
    ok = torch.allclose(mine.float(), logits.float(), rtol=1e-4, atol=1e-4 * float(logits.float().abs().max()) + 1e-6)
    return head if ok else None


@contextlib.contextmanager
def _hidden_at_rows(head: nn.Module, batch: LMBatch) -> Iterator[list[Tensor]]:
    """While active, ``head`` (the LM head) records the final hidden states at ``batch``'s loss rows (``N x H``,
    still in the autograd graph) and is fed an empty sequence instead, so the model forms no logits at all."""
    out: list[Tensor] = []

    def pre(mod, args):
        """Forward pre-hook: record ``h[rows]`` (``N x H``) and feed the head the empty ``B x 0 x H`` instead."""
        h = args[0]
        out.append(batch.take(h))
        return (h[:, :0], *args[1:])

    handle = head.register_forward_pre_hook(pre)
    try:
        yield out
    finally:
        handle.remove()


def _ce_grad_rows(
    hidden: Tensor, head: nn.Module, batch: LMBatch, label_mode: LabelMode, seed: int, chunk_rows: int = 2048
) -> Tensor:
    """Gradient of the summed next-token cross-entropy with respect to the final hidden states at the loss
    rows, ``N x H``: ``(softmax(z) - onehot(y)) W`` with ``z = hidden W^T (+ b)`` formed in float32, a few
    whole sequences (at most ``chunk_rows`` rows unless one sequence is longer) at a time, the one-hot
    subtracted in place from the softmax (the only ``n x V`` buffers are ``z`` and its softmax, one chunk each).
    Labels as :func:`lm_labels` (sampled ones drawn from each sequence's own float32 logits)."""
    W, bias = head.weight, getattr(head, "bias", None)
    counts = batch.counts
    grads, start, i = [], 0, 0
    while i < len(counts):
        j, n = i, 0
        while j < len(counts) and (n == 0 or n + counts[j] <= chunk_rows):
            n += counts[j]
            j += 1
        z = F.linear(hidden[start : start + n], W, bias).float()
        if label_mode is LabelMode.EMPIRICAL:
            y = batch.labels[start : start + n]
        else:
            parts, off = [], 0
            for idx, c in zip(batch.indices[i:j], counts[i:j]):
                parts.append(sample_labels(z[off : off + c], seed, idx))
                off += c
            y = torch.cat(parts)
        p = torch.softmax(z, dim=-1)
        del z
        p[torch.arange(n, device=p.device), y] -= 1.0
        grads.append(p.to(W.dtype) @ W)
        del p
        start, i = start + n, j
    return torch.cat(grads)


def lm_backward(
    model: nn.Module,
    batch: LMBatch,
    label_mode: LabelMode,
    seed: int,
    head: nn.Module | None = None,
    skip: Sequence[nn.Module] = (),
) -> None:
    """Forward ``batch`` and backpropagate its summed next-token cross-entropy over the loss rows (parameters
    are expected frozen; whatever in the graph requires grad gets its gradient hooks called).

    With ``head`` (from :func:`plain_head`) the model stops before its LM head and the hidden-state gradient
    is formed directly by :func:`_ce_grad_rows` (no ``N x V`` log-softmax graph is kept); otherwise the
    logits at the loss rows (:func:`lm_row_logits`) go through ``F.cross_entropy`` and autograd."""
    if head is None:
        logits = lm_row_logits(model, batch, skip)
        F.cross_entropy(logits, lm_labels(logits, batch, label_mode, seed), reduction="sum").backward()
        return
    with _hidden_at_rows(head, batch) as hidden:
        model(
            input_ids=batch.input_ids,
            attention_mask=static_attention_mask(model, batch.attention_mask, batch.padded),
            use_cache=False,
        )
    (h,) = hidden
    if h.requires_grad:
        with torch.profiler.record_function("crispedit.kfac.head_grad"):
            dh = _ce_grad_rows(h.detach(), head, batch, label_mode, seed)
        h.backward(dh)
