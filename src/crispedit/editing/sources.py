"""Where the projected loop's batches come from: the batch sources of :func:`.loop.projected_finetune`, and the
training sequences (:mod:`.contexts`) cut into batches (:func:`training_batches`; per epoch a sample of them,
:func:`epoch_subset`).

A source hands the loop each epoch's items in a seeded random order (:meth:`FixedBatches.epoch`), the loss of an
item to backpropagate (:meth:`~FixedBatches.loss`: this process's share of the batch's FT-M loss, under the
training arithmetic) and the batch mean the skip and stop rules read (:meth:`~FixedBatches.batch_mean`: a 0-d
tensor on the device), and whether every training sequence's target is already the model's greedy continuation
(:meth:`~FixedBatches.all_greedy`, for ``--stop-rule greedy``). Three kinds, chosen by :func:`batch_source`:

* :class:`FixedBatches` — every training sequence in fixed batches, built once (the default);
* :class:`SampledBatches` — ``--context-sample``: a seeded sample of every request's sequences, batched anew each
  epoch;
* :class:`RowShards` — under ``torch.distributed``: this process's rows of every fixed batch (:func:`shard_batch`),
  its loss scaled by its share of the batch's target tokens, so that the sum over the processes is the batch mean.
  The loss values and the gradients (:meth:`RowShards.sum_grads`) are summed over the processes before the skip
  test and the projection, so every process takes the one-process step (up to the order of the additions). With
  the model's blocks split across the processes (:func:`crispedit.distributed.shard_model`) every process runs
  every batch: one with no row of a batch runs one row of it with weight 0, because each block's forward gathers
  its weights from all of them.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from ..data.edits import EditRequest
from ..data.tokenize import EncodedBatch, collate
from ..distributed import all_reduce_sum_, is_distributed, is_sharded, rank, world_size
from ..errors import CrispEditError
from ..forward_parts import rows_logits
from .config import EditConfig
from .contexts import TrainingSequence, sequences_for
from .fastpath import make_loss_fn, target_rows

__all__ = [
    "training_batches",
    "epoch_subset",
    "batch_source",
    "FixedBatches",
    "SampledBatches",
    "RowShards",
    "shard_batch",
    "target_count",
]


def training_batches(
    tokenizer,
    sequences: Sequence[TrainingSequence],
    batch_size: int,
    batch_tokens: int | None = None,
    subset: Sequence[int] | None = None,
    by_length: bool = False,
) -> list[EncodedBatch]:
    """Batches of the training sequences (of ``sequences[i]`` for ``i`` in ``subset``, when given), each from one
    context kind, with :attr:`~crispedit.data.tokenize.EncodedBatch.keys` = the sequences' indices in
    ``sequences``: at most ``batch_size`` sequences in request order (``by_length``: the kind's sequences sorted
    by length (stable) first, so a batch holds sequences of similar length and little padding — the same
    number of batches), or — ``batch_tokens`` given — the kind's sequences sorted by length and packed while a
    batch's padded size (sequences × its longest) stays within ``batch_tokens`` (a longer single sequence gets
    a batch of its own)."""
    out = []
    chosen = list(range(len(sequences))) if subset is None else list(subset)
    kinds = list(dict.fromkeys(sequences[i].context for i in chosen))
    for kind in kinds:
        group = [i for i in chosen if sequences[i].context == kind]
        if batch_tokens is None:
            if by_length:
                group = sorted(group, key=lambda i: len(sequences[i].ids))
            chunks = [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
        else:
            chunks, cur = [], []
            for i in sorted(group, key=lambda i: len(sequences[i].ids)):
                if cur and (len(cur) + 1) * len(sequences[i].ids) > batch_tokens:
                    chunks.append(cur)
                    cur = []
                cur.append(i)
            chunks += [cur] if cur else []
        out += [
            collate(tokenizer, [(sequences[i].ids, sequences[i].n_context) for i in chunk], keys=chunk)
            for chunk in chunks
        ]
    return out


def epoch_subset(sequences: Sequence[TrainingSequence], per_request: int, seed: int, epoch: int) -> list[int]:
    """The sequences one epoch trains under ``--context-sample per_request``: for every request, ``per_request`` of
    its training sequences drawn without replacement (all of them when it has no more), seeded by ``(seed,
    epoch)`` so that a run is reproducible and every epoch sees another sample. Indices into ``sequences``,
    sorted."""
    by_request: dict[int, list[int]] = {}
    for i, s in enumerate(sequences):
        by_request.setdefault(s.request, []).append(i)
    rng = random.Random(f"context-sample:{seed}:{epoch}")
    out: list[int] = []
    for r in sorted(by_request):
        idx = by_request[r]
        out += idx if len(idx) <= per_request else rng.sample(idx, per_request)
    return sorted(out)


def target_count(batch: EncodedBatch) -> int:
    """Number of tokens the FT-M loss of ``batch`` averages over (labels other than -100 after the shift)."""
    return int((batch.labels[:, 1:] != -100).sum())


def shard_batch(batch: EncodedBatch, r: int, w: int) -> EncodedBatch | None:
    """Rows ``r, r + w, r + 2w, ...`` of ``batch`` (same padded width), or ``None`` when that leaves no row
    with a target token (a batch of fewer than ``w`` sequences)."""
    rows = list(range(r, batch.input_ids.shape[0], w))
    if not rows:
        return None
    idx = torch.tensor(rows, device=batch.input_ids.device)
    part = EncodedBatch(
        batch.input_ids[idx], batch.attention_mask[idx], batch.labels[idx], [batch.target_lengths[i] for i in rows]
    )
    return part if target_count(part) > 0 else None


def _my_rows(batch: EncodedBatch, split: bool) -> tuple[EncodedBatch | None, float]:
    """This process's rows of ``batch`` (:func:`shard_batch`) and their share of its target tokens, or
    ``(None, 0.0)`` without a row. With the model ``split`` across the processes every process must run the
    batch (each block's forward gathers its weights from all of them): one without rows gets the batch's first
    row that has a target token, with share 0."""
    part = shard_batch(batch, rank(), world_size())
    if part is not None:
        return part, target_count(part) / target_count(batch)
    if not split:
        return None, 0.0
    first = next(i for i in range(batch.input_ids.shape[0]) if (batch.labels[i, 1:] != -100).any())
    return shard_batch(batch, first, batch.input_ids.shape[0]), 0.0


def _shuffled(items: list, gen: torch.Generator) -> list:
    """``items`` in the order of one draw of ``gen`` (the loop's batch-order generator, checkpointed with it)."""
    return [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]


class FixedBatches:
    """Every training sequence in fixed batches (on the device), the same every epoch; an epoch is their indices in
    a seeded random order. ``loss_fn``: the fast loss where its check passes (:func:`.fastpath.make_loss_fn`: the
    frozen prefix cached), else the plain one; ``arithmetic()``: the training forward's context (bf16 autocast or
    nothing). ``contexts``: the edit contexts trained."""

    sharded = False  # whether the gradients must be summed over processes (:meth:`sum_grads`)

    def __init__(self, contexts: list[str], batches: list[EncodedBatch], loss_fn, arithmetic: Callable):
        self.contexts, self.batches, self.loss_fn, self.arithmetic = contexts, batches, loss_fn, arithmetic
        self.first = batches  # the first epoch's batches (what a report counts per epoch)

    @property
    def fast(self) -> bool:
        """Whether the exact fast loss engaged."""
        return self.loss_fn.fast

    def per_epoch(self) -> tuple[int, int]:
        """Sequences and non-padding tokens of one epoch (the first one's, where epochs differ)."""
        return sum(b.input_ids.shape[0] for b in self.first), sum(b.n_tokens for b in self.first)

    def layout(self) -> dict:
        """What an epoch computes (:meth:`.fastpath.LossFn.layout`), for the report."""
        return self.loss_fn.layout()

    def epoch(self, epoch: int, gen: torch.Generator) -> list:
        """Epoch ``epoch``'s items (batch indices) in the order ``gen`` draws."""
        return _shuffled(list(range(len(self.batches))), gen)

    def loss(self, item) -> Tensor | None:
        """The loss of ``item`` to backpropagate (``None``: this process holds no row of it)."""
        with self.arithmetic():
            return self.loss_fn(item)

    def batch_mean(self, loss: Tensor | None) -> Tensor:
        """The batch mean loss as a 0-d tensor on the device (nothing read back)."""
        return loss.detach()

    def sum_grads(self, params: dict[str, nn.Parameter]) -> None:
        """Nothing: one process holds the whole batch."""

    @torch.no_grad()
    def all_greedy(self) -> bool:
        """Whether every target token of every training sequence (all of them, whatever an epoch samples) is the
        model's greedy (argmax) prediction under teacher forcing, so that every trained context's greedy answer is
        its target: one forward per fixed batch, without gradients, in eval mode, under the training arithmetic.
        Every process runs every batch, so all decide alike."""
        model = self.loss_fn.model
        was_training = model.training
        model.eval()
        try:
            for b in self.batches:
                rows, targets = target_rows(b.labels)
                with self.arithmetic():
                    logits = rows_logits(model, rows, input_ids=b.input_ids, attention_mask=b.attention_mask)
                if not bool((logits.argmax(-1) == targets).all()):
                    return False
            return True
        finally:
            model.train(was_training)


class SampledBatches(FixedBatches):
    """``--context-sample``: every epoch a seeded sample of every request's training sequences
    (:func:`epoch_subset`, from the seed and the epoch number), batched anew and readied on the host
    (:meth:`.fastpath.LossFn.prepare`); the fast path's check ran on all of them in fixed batches."""

    def __init__(
        self,
        contexts,
        batches,
        loss_fn,
        arithmetic,
        batch: Callable,
        seqs,
        sample: int,
        seed: int,
        first: list[EncodedBatch],
    ):
        super().__init__(contexts, batches, loss_fn, arithmetic)
        self.batch, self.seqs, self.sample, self.seed, self.first = batch, seqs, sample, seed, first

    def layout(self) -> dict:
        """Nothing: an epoch's batches differ from run to run of the sample."""
        return {}

    def epoch(self, epoch: int, gen: torch.Generator) -> list:
        """Epoch ``epoch``'s sampled batches, readied on the host, in the order ``gen`` draws."""
        host = self.first if epoch == 0 else self.batch(epoch_subset(self.seqs, self.sample, self.seed, epoch))
        return _shuffled([self.loss_fn.prepare(b) for b in host], gen)


class RowShards(FixedBatches):
    """Under ``torch.distributed``: this process's rows of every fixed batch, each loss scaled by the rows' share of
    the batch's target tokens (``shards[i]``: ``(index into the loss function's batches, share)``, or ``None``
    where this process holds no row of batch ``i``)."""

    sharded = True

    def __init__(self, contexts, batches, loss_fn, arithmetic, shards: list[tuple[int, float] | None], device):
        super().__init__(contexts, batches, loss_fn, arithmetic)
        self.shards, self.device = shards, device

    def layout(self) -> dict:
        """Nothing: each process computes its own rows."""
        return {}

    def loss(self, item) -> Tensor | None:
        """This process's share of batch ``item``'s loss (``None`` without a row of it)."""
        with self.arithmetic():
            shard = self.shards[item]
            return None if shard is None else self.loss_fn(shard[0]) * shard[1]

    def batch_mean(self, loss: Tensor | None) -> Tensor:
        """The batch mean: the processes' scaled losses summed (float64, on the device)."""
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if loss is not None:
            value += loss.detach().double()
        return all_reduce_sum_(value)

    def sum_grads(self, params: dict[str, nn.Parameter]) -> None:
        """Sum every parameter's gradient over the processes (a zero gradient where this process had none)."""
        for p in params.values():
            if p.grad is None:  # no rows here, or a parameter this shard did not reach
                p.grad = torch.zeros_like(p)
            all_reduce_sum_(p.grad)


def batch_source(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    params: dict[str, nn.Parameter],
    config: EditConfig,
    fast: bool,
    device,
    arithmetic: Callable,
) -> FixedBatches:
    """The batch source of an edit (see the module docstring), its training sequences written from ``model``'s
    starting weights; ``fast``: try the exact fast loss; ``arithmetic()``: the training forward's context.
    One-line error for ``--context-sample`` under ``torch.distributed``."""
    seqs, contexts = sequences_for(tokenizer, requests, config, model)

    def batch(subset):
        """Batches of ``seqs`` (of those in ``subset``, when given) as ``config`` sizes and orders them."""
        return training_batches(
            tokenizer, seqs, config.batch_size, config.batch_tokens, subset, by_length=config.batch_order == "length"
        )

    batches = [b.to(device) for b in batch(None)]
    sample = config.context_sample
    if sample is not None:
        if is_distributed():
            raise CrispEditError("--context-sample is not available under torch.distributed; train every context")
        first = batch(epoch_subset(seqs, sample, config.seed, 0))
        return SampledBatches(
            contexts,
            batches,
            make_loss_fn(model, params, batches, enabled=fast),
            arithmetic,
            batch,
            seqs,
            sample,
            config.seed,
            first,
        )
    if not is_distributed():  # exact shortcut: the frozen prefix cached
        return FixedBatches(contexts, batches, make_loss_fn(model, params, batches, enabled=fast), arithmetic)
    split = is_sharded(model)
    parts = [_my_rows(b, split) for b in batches]
    shards, j = [], 0
    for part, share in parts:
        shards.append(None if part is None else (j, share))
        j += part is not None
    # the fast path's own checks could differ between processes; a split model takes the plain loss
    loss_fn = make_loss_fn(model, params, [p for p, _ in parts if p is not None], enabled=fast and not split)
    return RowShards(contexts, batches, loss_fn, arithmetic, shards, device)
