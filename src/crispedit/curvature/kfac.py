"""K-FAC factor collection.

For a linear layer ``s = W a`` (``W``: ``d_out x d_in``) K-FAC approximates its Gauss-Newton block by
``A (x) S`` with ``A = E[a a^T]`` over layer inputs and ``S = E[g g^T]`` over pre-activation gradients
``g = d loss / d s``. Expectations are per row: per token for language models (cross-token terms are
ignored, as in the paper and the authors' code), per spatial patch for convolutions (the standard
"KFC" treatment: unfolded patches are the inputs).

:func:`collect_lm_kfac` runs one pass over a text corpus for every chosen layer at once, from pieces kept apart
so they snap together:

* :mod:`.statistics`: :class:`~.statistics.FactorAccumulator` sums ``a a^T`` and ``g g^T`` rows in float64 (each
  batch's products formed in ``stat_dtype``, float32 by default); :func:`~.statistics.capture_io` records the
  hooked layers' inputs and output gradients in one forward/backward, which stops at the lowest hooked layer;
* :mod:`.lm_batches`: texts tokenised once and grouped by length (``max_padding`` bounds the padded share of a
  batch), padding excluded through the attention mask, never by token id;
* :mod:`.lm_backward`: the labels (``sampled`` from the model's own predictive distribution — Monte-Carlo Fisher
  = Gauss-Newton for softmax cross-entropy, what the paper's Bregman argument needs — or ``empirical``, the text's
  next token, as the authors' code does) and the backward through the LM head on the loss positions only.

Under ``torch.distributed`` each process takes every ``world_size``-th batch and the unnormalised sums and row
counts are all-reduced before the division (:meth:`~.statistics.FactorAccumulator.all_reduce`). The model runs
without a KV cache. :func:`collect_lm_input_covariance` collects the input covariances alone (AlphaEdit's and
Adam-NSCL's null spaces).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..distributed import all_agree, is_distributed, is_sharded, rank, world_size
from .factors import KFACFactors
from .lm_backward import LabelMode, lm_backward, plain_head
from .lm_batches import lm_batches
from .statistics import FactorAccumulator, capture_io, frozen, layer_rows

__all__ = ["collect_lm_kfac", "collect_lm_input_covariance"]


# ---------------------------------------------------------------------------------------------
# hooks


# ---------------------------------------------------------------------------------------------
# language models


def _process_batches(batches: list, shard: bool, split: bool) -> tuple[list, int]:
    """The batches this process runs — every ``w``-th from its rank when ``shard``, else all — and how many of them
    at the end are repeats whose statistics it discards: with the model ``split`` every process runs as many
    batches (FSDP gathers each block in every forward and backward), so one with fewer runs its last (or the
    first) batch again."""
    mine = batches[rank() :: world_size()] if shard else batches
    if not split:
        return mine, 0
    idle = -(-len(batches) // world_size()) - len(mine)
    return mine + [mine[-1] if mine else batches[0]] * idle, idle


def collect_lm_kfac(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str] | Sequence[Sequence[int]],
    layers: dict[str, nn.Module],
    *,
    max_len: int = 256,
    batch_size: int = 8,
    label_mode: LabelMode | str = LabelMode.SAMPLED,
    seed: int = 0,
    stat_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
    desc: str = "K-FAC",
    distributed: bool | None = None,
    max_padding: float | None = 0.25,
    loss_from: Sequence[int] | None = None,
) -> KFACFactors:
    """K-FAC factors of the next-token loss of ``model`` on ``texts`` for all ``layers`` in one pass:
    ``A`` (``d_in x d_in``) and ``S`` (``d_out x d_out``) per layer, in ``out_dtype``.

    Each text is tokenised once (truncated to ``max_len``; token-id sequences are used as given); texts are
    grouped into right-padded batches of at most ``batch_size`` by :func:`~.lm_batches.plan_batches` (by length, at most
    ``max_padding`` of a batch padding; ``None`` keeps corpus order). Every position with a real next token
    (with ``loss_from``, only those predicting token ``loss_from[i]`` or later of text ``i``: :func:`lm_batches`)
    contributes one row to ``A`` and ``S``; factors are divided by the number of such rows, so the batching
    changes nothing but the order of the float64 additions. The LM head and the loss are computed at those positions
    only, and backward stops at the lowest hooked layer (:func:`~.statistics.capture_io`).

    ``distributed`` (default: whether a ``torch.distributed`` group of several processes is initialised):
    process ``r`` of ``w`` runs batches ``r, r + w, r + 2w, ...`` of the same plan (sampled labels are
    seeded by the corpus index of each sequence), then the float64 sums of ``a a^T``, ``g g^T`` and the row
    counts are summed over the processes (:meth:`FactorAccumulator.all_reduce`) and normalised: every
    process returns the one-process factors up to the order of the float64 additions. Every process must
    call it with the same arguments. On a model split across the processes
    (:func:`crispedit.distributed.shard_model`) every process runs the same number of forward and backward
    passes: one with a batch fewer repeats one and discards its statistics.
    """
    label_mode = LabelMode(label_mode)
    device = next(model.parameters()).device
    acc = FactorAccumulator(stat_dtype)
    was_training = model.training
    model.eval()
    batches = lm_batches(
        tokenizer,
        texts,
        max_len=max_len,
        batch_size=batch_size,
        max_padding=max_padding,
        device=device,
        loss_from=loss_from,
    )
    shard = distributed if distributed is not None else is_distributed()
    split = shard and is_sharded(model)
    mine, idle = _process_batches(batches, shard, split)
    quiet = True if rank() != 0 else (None if progress is None else not progress)  # one bar: rank 0's
    bar = tqdm(total=sum(len(b.indices) for b in mine[: len(mine) - idle]), desc=desc, unit="seq", disable=quiet)
    skip = list(layers.values())
    try:
        with frozen(model):
            head = plain_head(model, mine[0], skip) if mine else None
            if split and not all_agree(head is not None):
                head = None  # the processes take the same path
            for i, batch in enumerate(mine):
                with capture_io(layers) as store:
                    lm_backward(model, batch, label_mode, seed, head, skip)
                if i >= len(mine) - idle:
                    continue
                with torch.profiler.record_function("crispedit.kfac.statistics"):
                    for name in layers:
                        cap = store[name]
                        if len(cap.inputs) != 1 or len(cap.grads) != 1:
                            raise RuntimeError(f"layer {name} was called {len(cap.inputs)} times in one forward")
                        acc.add(name, batch.take(cap.inputs[0]), batch.take(cap.grads[0]))
                bar.update(len(batch.indices))
    finally:
        bar.close()
        model.train(was_training)
    if shard:
        from ..layers import weight_matrix

        acc.all_reduce({name: tuple(weight_matrix(m).shape) for name, m in layers.items()}, device)
    meta = {"label_mode": label_mode.value, "seed": seed, "max_len": max_len, "n_texts": len(texts)}
    return acc.factors(list(layers), meta, out_dtype=out_dtype)


class _StopForward(Exception):
    """Raised by a hook once the highest needed layer has run: the rest of the forward is skipped."""


def _covariance_batches(
    tokenizer, texts, max_len: int, batch_size: int, loss_from: Sequence[int] | None, device
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """``(input_ids, attention_mask, counted)`` (``B x T``) batches of ``texts`` in corpus order: every non-padding
    token counted, or — with ``loss_from`` — the loss rows :func:`lm_batches` gives."""
    if loss_from is None:
        for b in range(0, len(texts), batch_size):
            enc = tokenizer(
                list(texts[b : b + batch_size]), return_tensors="pt", padding=True, truncation=True, max_length=max_len
            )
            mask = enc["attention_mask"].to(device)
            yield enc["input_ids"].to(device), mask, mask.bool()
        return
    for batch in lm_batches(
        tokenizer, texts, max_len=max_len, batch_size=batch_size, max_padding=None, device=device, loss_from=loss_from
    ):
        yield batch.input_ids, batch.attention_mask, batch.rows


def collect_lm_input_covariance(
    model: nn.Module,
    tokenizer,
    texts: Sequence[str] | Sequence[Sequence[int]],
    layers: dict[str, nn.Module],
    *,
    max_len: int = 256,
    batch_size: int = 8,
    stat_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
    desc: str = "input covariance",
    loss_from: Sequence[int] | None = None,
) -> KFACFactors:
    """The uncentred input covariance ``C = E[k kᵀ]`` (``d_in x d_in``) of every layer in ``layers`` over
    every non-padding token of ``texts`` (tokenised, truncated to ``max_len``, right-padded): MEMIT's
    ``mom2`` statistic, K-FAC's ``A`` without the loss. Forward only, no labels, no gradients; the forward
    stops once the last of ``layers`` has run. Products in ``stat_dtype``, sums in float64, divided by
    the token count; returned as :class:`KFACFactors` with ``A`` only (``S`` empty). In several
    processes every process runs every batch (no sharding). With ``loss_from`` (one int per text; ``texts`` may
    then be token-id sequences) only the positions that :func:`lm_batches` counts for it are taken: those
    predicting token ``loss_from[i]`` or later of text ``i``."""
    device = next(model.parameters()).device
    order = {id(m): i for i, m in enumerate(model.modules())}
    last = max(layers.values(), key=lambda m: order[id(m)])
    sums: dict[str, Tensor] = {}
    rows = 0
    was_training = model.training
    model.eval()
    pad_side = getattr(tokenizer, "padding_side", "right")
    tokenizer.padding_side = "right"
    bar = tqdm(total=len(texts), desc=desc, unit="seq", disable=(None if progress is None else not progress))
    mask: Tensor | None = None

    def make_hook(name: str, module: nn.Module):
        """A forward hook adding layer ``name``'s input products to ``sums[name]``."""

        def hook(mod, args, output):
            """Forward hook: add ``aᵀ a`` (float64, ``d_in x d_in``) of the non-padding input rows ``a`` to
            ``sums[name]``; stops the forward (:class:`_StopForward`) after the last layer."""
            a = layer_rows(mod, args[0].detach())[mask].to(stat_dtype)
            aa = (a.T @ a).to(torch.float64)
            sums[name] = sums[name] + aa if name in sums else aa
            if mod is last:
                raise _StopForward

        return hook

    handles = [m.register_forward_hook(make_hook(n, m)) for n, m in layers.items()]
    try:
        with frozen(model), torch.no_grad():
            for ids, attn, mask in _covariance_batches(tokenizer, texts, max_len, batch_size, loss_from, device):
                try:
                    model(input_ids=ids, attention_mask=attn)
                except _StopForward:
                    pass
                rows += int(mask.sum())
                bar.update(ids.shape[0])
    finally:
        for h in handles:
            h.remove()
        bar.close()
        tokenizer.padding_side = pad_side
        model.train(was_training)
    if rows == 0 or set(sums) != set(layers):
        raise RuntimeError("no input statistics were collected (no tokens?)")
    A = {k: (sums[k] / rows).to(out_dtype).cpu() for k in layers}
    return KFACFactors(A, {}, rows, {"kind": "input", "max_len": max_len, "n_texts": len(texts)})
