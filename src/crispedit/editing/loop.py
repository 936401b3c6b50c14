"""The one projected fine-tuning loop shared by every fine-tuning editor.

Each request becomes one training sequence per edit context (:mod:`.contexts`: bare prompt, chat
template, natural-text prefixes; target followed by its answer end). FT-M loss (cross-entropy on the
target tokens only; context and padding masked), Adam, mini-batches over the sequences, batches whose
loss is already below ``skip_loss`` take no step, training stops once an epoch's mean loss is below
``stop_loss`` (or, with ``plateau_epochs``, once it has stalled just above it: :func:`plateaued`). On an
accelerator both rules are decided without reading a value back to the host inside a step: the skip test is a
0-d boolean on the device that gates the Adam step (:class:`.optim.GatedAdam`), and the losses and the skipped
count are read once per epoch, for the stop test. On the CPU, where a read costs nothing, the skip test is read
and a skipped batch's backward is not run at all (the same steps). Between ``backward`` and ``step`` every
trained weight's gradient is projected
(``projection_target="gradient"``, the paper); alternatively the Adam update itself is projected after
the step (``"update"``), or Adam runs in the K-FAC eigenbasis on the masked rotated gradient
(``"eigenbasis"``, :class:`.optim.EigenbasisAdam`); the last two keep the weight change strictly
inside the kept subspace. Projections run in float32 whatever the training dtype.

Under ``torch.distributed`` (``torchrun ... -m crispedit edit``) every batch is split by rows across the
processes (:func:`shard_batch`): each process computes the cross-entropy of its rows scaled by its share
of the batch's target tokens, the scaled losses and the gradients are summed over the processes before
the skip test and the projection, so every process takes the one-process step (up to the order of the
additions) and the weights stay identical on all of them. With the model's decoder blocks split across the
processes (:func:`crispedit.distributed.shard_model`, ``--shard``) the same holds — the edited weights are whole on
every process — and every process runs every batch's forward and backward (a process with no row of a batch runs
one row of it with weight 0), because each block's forward gathers its weights from all of them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..curvature.projection import LayerProjector, rotation_precision
from ..data.edits import EditRequest
from ..data.tokenize import EncodedBatch
from ..distributed import all_reduce_sum_, is_distributed, is_sharded, rank, world_size
from ..errors import CrispEditError
from ..layers import as_weight_matrix
from ..models import native_bf16
from .checkpoint import LoopCheckpoint, LoopState
from .config import EditConfig, ProjectionTarget
from .contexts import epoch_subset, sequences_for, training_batches
from .fastpath import make_loss_fn
from .fastpath import plain_loss as edit_loss
from .keep import KeepLoss, keep_sequences
from .optim import make_optimizer
from .steptimer import NULL_TIMER, StepTimer

_log = logging.getLogger("crispedit.edit")
LOG_EVERY = 5  # epochs between the loop's INFO lines (for output that is not a terminal: no bar there) ...
LOG_SECONDS = 60.0  # ... or fewer, once this many seconds have passed since the last line (long epochs)
PLATEAU_BAND = 2.0  # the plateau rule acts only once the epoch loss is below this many times the stop loss

__all__ = ["projected_finetune", "edit_loss", "TrainHistory", "training_brief", "apply_projection", "edit_batches",
           "resolve_precision",
           "shard_batch", "plateaued", "plateau_stop", "PLATEAU_BAND"]


@dataclass
class TrainHistory:
    """What the loop did: per-epoch mean loss (nats/target token), Adam steps, skipped batches,
    whether the stop loss was reached, wall seconds, whether the exact fast loss engaged, the edit
    contexts trained and the number of training sequences / tokens per epoch. ``extra``: figures of one
    method's own (MEMIT / AlphaEdit: the v* target NLL, nats/token, before and after its Adam steps),
    written into the report beside the others. ``single_pass``: the editor wrote its change in one pass
    over the edits without the loop (MEMIT, AlphaEdit, UltraEdit, MEND); ``epoch_loss`` then holds the mean
    target NLL before and after (nats/token), not epochs, and the report says ``epochs`` 0."""

    epoch_loss: list[float] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0
    converged: bool = False
    seconds: float = 0.0
    fast_loss: bool = False  # the exact shortcut of editing/fastpath.py was used
    contexts: list[str] = field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    extra: dict = field(default_factory=dict)
    single_pass: bool = False
    # wall seconds of each epoch (None for epochs a resumed checkpoint did not time); a process stopped
    # (SIGSTOP) or starved by another job shows as one long epoch
    epoch_seconds: list[float | None] = field(default_factory=list)
    # the plateau rule (EditConfig.plateau_epochs) ended the run before the stop loss or the epoch cap
    plateaued: bool = False

    def to_json(self) -> dict:
        """JSON-ready summary (the ``training`` section of an edit report; a single-pass editor's also
        carries ``"single_pass": true``)."""
        return {"epoch_loss": [round(x, 6) for x in self.epoch_loss],
                "epochs": 0 if self.single_pass else len(self.epoch_loss),
                "steps": self.steps, "skipped_batches": self.skipped, "converged": self.converged,
                **({"plateaued": True} if self.plateaued else {}), "seconds": round(self.seconds, 3),
                **({"epoch_seconds": [None if x is None else round(x, 2) for x in self.epoch_seconds]}
                   if self.epoch_seconds else {}),
                "fast_loss": self.fast_loss, "contexts": self.contexts,
                "sequences": self.sequences, "tokens_per_epoch": self.tokens,
                **({"single_pass": True} if self.single_pass else {}), **self.extra}


def training_brief(train: dict, lr: float | None = None) -> str:
    """One line for a report's ``training`` section (:meth:`TrainHistory.to_json`), as the CLI prints it:
    ``"epochs=21 last_loss=0.0096"`` (+ ``" lr=0.0005"`` given ``lr``) for the fine-tuning loop,
    ``"single-pass target_nll=8.308->0.1374"`` (nats/token before -> after) for a single-pass editor, whose
    ``epoch_loss`` is not per epoch and whose learning rate, if any, is its own."""
    loss = train.get("epoch_loss") or []
    if train.get("single_pass"):
        return "single-pass" + (f" target_nll={loss[0]:.4g}->{loss[-1]:.4g}" if len(loss) >= 2 else "")
    return (f"epochs={train.get('epochs')}" + (f" last_loss={loss[-1]:.4g}" if loss else "")
            + ("" if lr is None else f" lr={lr:g}"))


def plateaued(epoch_loss: Sequence[float], stop_loss: float, epochs: int, delta: float) -> bool:
    """Whether an edit's loss has stalled just above its goal, so that more epochs would buy nothing: the last
    epoch's mean loss (nats/target token) is below ``PLATEAU_BAND × stop_loss`` and the lowest of the last
    ``epochs`` epoch losses is not ``delta`` (a fraction) below the lowest before them. ``False`` with
    ``epochs`` 0 (the rule off) or fewer than ``epochs + 1`` losses. A function of the losses alone, so a
    resumed run decides as the uninterrupted one did."""
    if epochs <= 0 or len(epoch_loss) <= epochs or not epoch_loss[-1] < PLATEAU_BAND * stop_loss:
        return False
    return min(epoch_loss[-epochs:]) > (1.0 - delta) * min(epoch_loss[:-epochs])


def plateau_stop(epoch_loss: Sequence[float], stop_loss: float, epochs: int, delta: float) -> int | None:
    """The epoch (1-based) at which :func:`plateaued` would have ended a run with these epoch losses before its
    last epoch, or ``None`` (the run trains exactly as it did under that rule)."""
    return next((k for k in range(1, len(epoch_loss)) if plateaued(epoch_loss[:k], stop_loss, epochs, delta)), None)


def _stalled(epoch_loss: Sequence[float], converged: bool, config: EditConfig) -> bool:
    """Whether ``config``'s plateau rule ends a run that has not converged after these epoch losses."""
    return not converged and plateaued(epoch_loss, config.stop_loss, config.plateau_epochs, config.plateau_delta)


def apply_projection(proj: LayerProjector, module: nn.Module, t: Tensor) -> Tensor:
    """Project a weight-shaped tensor of ``module`` (handles transposed storage)."""
    return as_weight_matrix(module, proj.project(as_weight_matrix(module, t)))


def edit_batches(tokenizer, requests: Sequence[EditRequest], config: EditConfig, model: nn.Module | None = None
                 ) -> tuple[list[EncodedBatch], list[str]]:
    """The training batches for ``requests`` under ``config.contexts`` / ``config.answer_end`` (``config.batch_size``
    sequences, or packed to ``config.batch_tokens`` padded tokens) and the
    context names used (``chat`` is dropped from ``default`` for models without a chat template;
    ``model`` writes the ``gen`` prefixes — pass it unedited)."""
    seqs, names = sequences_for(tokenizer, requests, config, model)
    return training_batches(tokenizer, seqs, config.batch_size, config.batch_tokens,
                            by_length=config.batch_order == "length"), names


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
    part = EncodedBatch(batch.input_ids[idx], batch.attention_mask[idx], batch.labels[idx],
                        [batch.target_lengths[i] for i in rows])
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


def resolve_precision(precision: str, device) -> str:
    """The training forward's arithmetic an edit runs with on ``device``: ``"bf16"`` or ``"fp32"``; ``"auto"`` is
    bf16 where the device has it natively (:func:`~crispedit.models.native_bf16`), else fp32. An explicit bf16 on a
    device that emulates it runs as asked, with a warning that fp32 would be faster."""
    native = native_bf16(device)
    if precision == "auto":
        return "bf16" if native else "fp32"
    if precision == "bf16" and not native:
        _log.warning("bf16 on %s is emulated here (no native bfloat16 arithmetic: a CPU without AVX-512 or AMX), "
                     "many times slower than fp32; --precision fp32 or auto is faster", torch.device(device).type)
    return precision


class _EpochPlan:
    """The batches of every epoch and their losses: all training sequences in fixed batches, or (``--context-sample``)
    a seeded sample of every request's sequences batched anew each epoch; under ``torch.distributed`` each
    process takes its rows of every batch (:func:`shard_batch`) and its loss is scaled by its share of the batch's
    target tokens, so the sum over processes is the batch mean."""

    def __init__(self, model, tokenizer, requests, params, config: EditConfig, fast: bool, device):
        self.tokenizer, self.config, self.device = tokenizer, config, device
        self.precision = resolve_precision(config.precision, device)
        self.seqs, self.contexts = sequences_for(tokenizer, requests, config, model)
        self.batches = [b.to(device) for b in self._batch(None)]
        self.sample = config.context_sample
        if self.sample is not None and is_distributed():
            raise CrispEditError("--context-sample is not available under torch.distributed; train every context")
        self._first = self._batch(epoch_subset(self.seqs, self.sample, config.seed, 0)) if self.sample else self.batches
        self.shards = None
        if is_distributed():  # this process's rows of every batch and their share of its target tokens
            split = is_sharded(model)
            parts = [_my_rows(b, split) for b in self.batches]
            self.shards, j = [], 0
            for part, share in parts:
                self.shards.append(None if part is None else (j, share))
                j += part is not None
            # the fast path's own checks could differ between processes; a split model takes the plain loss
            self.loss_fn = make_loss_fn(model, params, [p for p, _ in parts if p is not None],
                                        enabled=fast and not split)
        else:
            self.loss_fn = make_loss_fn(model, params, self.batches, enabled=fast)  # exact shortcut: prefix cached
        self.keep = None  # the preservation term (editing/keep.py), from the starting weights like the sequences
        if config.keep_chat or config.keep_subject:
            kept = keep_sequences(model, tokenizer, requests, config.keep_chat, config.keep_subject,
                                  config.keep_tokens)
            self.keep = KeepLoss(model, tokenizer, kept, params, config.keep_weight,
                                 fast=fast and not is_sharded(model), device=device)  # as the edit batches
        self.keep_terms: list[Tensor] = []

    def _arithmetic(self):
        """The forward's arithmetic: under bfloat16 (:attr:`precision`) an autocast region (matrix products in
        bfloat16; the backward follows the forward's dtypes, the float32 weights receive float32 gradients), else
        nothing. The frozen prefix of the fast path was computed at plan time, in the model's own dtype."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def with_keep(self, loss: Tensor | None, step: int, timer) -> Tensor | None:
        """``loss`` plus the preservation term of training step ``step`` (``loss`` as it is without one)."""
        if self.keep is None:
            return loss
        with timer.phase("keep"), self._arithmetic():
            term = self.keep(step)
        if term is None:
            return loss
        self.keep_terms.append(term.detach())
        term = term / world_size()  # every process computed it whole; their gradients are summed
        return term if loss is None else loss + term

    def keep_report(self, hist: TrainHistory) -> None:
        """Once per epoch: the mean preservation term of its steps (nats/token, 0 for an epoch without a step)
        appended to ``hist.extra["keep"]``, with the transcripts and answer tokens it holds."""
        if self.keep is None:
            return
        mean = float(torch.stack(self.keep_terms).mean()) if self.keep_terms else 0.0
        self.keep_terms = []
        if "keep" not in hist.extra:
            hist.extra["keep"] = {"transcripts": sum(b.input_ids.shape[0] for b in self.keep.batches),
                                  "tokens": self.keep.tokens(), "weight": self.keep.weight, "epoch_term": []}
        hist.extra["keep"]["epoch_term"].append(round(mean, 6))

    def _batch(self, subset):
        c = self.config
        return training_batches(self.tokenizer, self.seqs, c.batch_size, c.batch_tokens, subset,
                                by_length=c.batch_order == "length")

    def per_epoch(self) -> tuple[int, int]:
        """Sequences and non-padding tokens of one epoch (the first one's, under ``--context-sample``)."""
        return sum(b.input_ids.shape[0] for b in self._first), sum(b.n_tokens for b in self._first)

    def epoch(self, epoch: int, gen: torch.Generator) -> list:
        """This epoch's items in a seeded random order: batch indices, or batches readied on the host."""
        if self.sample is None:
            items = list(range(len(self.batches)))
        else:
            host = (self._first if epoch == 0
                    else self._batch(epoch_subset(self.seqs, self.sample, self.config.seed, epoch)))
            items = [self.loss_fn.prepare(b) for b in host]
        return [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]

    def loss(self, item, timer) -> tuple[Tensor | None, Tensor]:
        """The loss to backpropagate (``None``: this process holds no row of the batch) and the batch mean as a
        0-d tensor on the device (summed over processes)."""
        if self.shards is None:
            with timer.phase("forward"), self._arithmetic():
                loss = self.loss_fn(item)
            return loss, loss.detach()
        with timer.phase("forward"), self._arithmetic():
            shard = self.shards[item]
            loss = None if shard is None else self.loss_fn(shard[0]) * shard[1]
        with timer.phase("bookkeeping"):
            value = torch.zeros((), dtype=torch.float64, device=self.device)
            if loss is not None:
                value += loss.detach().double()
            return loss, all_reduce_sum_(value)


def _update(params, layers, projectors, target: ProjectionTarget, opt, active: Tensor, drift_budget, timer,
            rotations: tuple[str, torch.device | str] = ("fp32", "cpu")) -> None:
    """The step after backward: the penalty gradient, the projection (of the gradient before Adam, or of its
    update after it; the eigenbasis optimizer masks by itself), Adam gated by ``active``, the drift budget.
    ``rotations``: ``(mode, device)`` of the projection's float32 GEMMs (:func:`rotation_precision`)."""
    if drift_budget is not None and drift_budget.penalty > 0:
        with timer.phase("drift"):
            drift_budget.add_penalty_gradient()  # + β ∂(predicted drift)/∂W, projected below
    before = None
    if target is ProjectionTarget.UPDATE:
        with timer.phase("copies"):
            before = {n: p.detach().float().clone() for n, p in params.items()}
    with torch.no_grad(), rotation_precision(*rotations):
        if target is ProjectionTarget.GRADIENT:
            with timer.phase("projection"):
                for n, p in params.items():
                    g = apply_projection(projectors[n], layers[n], p.grad)
                    if g is p.grad:
                        continue  # nothing masked (the identity): nothing to write
                    if g.stride() == p.grad.stride():
                        p.grad = g  # a fresh tensor: use it, no copy
                    else:
                        p.grad.copy_(g)
        with timer.phase("optimizer"):
            opt.step(active=active)  # an inactive (skipped) step changes nothing
        if before is not None:
            with timer.phase("projection"):
                for n, p in params.items():
                    delta = apply_projection(projectors[n], layers[n], p.detach().float() - before[n])
                    p.copy_((before[n] + delta).to(p.dtype))
        if drift_budget is not None and drift_budget.eps is not None:
            with timer.phase("drift"):
                drift_budget.enforce()  # same weights on every process: the same decision


@contextlib.contextmanager
def _training(model: nn.Module, params: dict[str, nn.Parameter], opt, bar) -> Iterator[None]:
    """Within: only ``params`` require gradients; after (whatever happened): the progress bar closed, the model
    in eval mode, no gradient held, every parameter's ``requires_grad`` as it was."""
    flags = {p: p.requires_grad for p in model.parameters()}
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in params.values():
            p.requires_grad_(True)
        yield
    finally:
        bar.close()
        model.eval()
        opt.zero_grad(set_to_none=True)
        for p, f in flags.items():
            p.requires_grad_(f)


def _sum_grads(params) -> None:
    """Sum every parameter's gradient over the processes (a zero gradient where this process had none)."""
    for p in params.values():
        if p.grad is None:  # no rows here, or a parameter this shard did not reach
            p.grad = torch.zeros_like(p)
        all_reduce_sum_(p.grad)


class _Counters:
    """Where the loop stands across epochs (and across a resume): the batch-order ``generator``, the batches
    run so far (``n_batches``) and skipped (``skipped``, a 0-d int32 on the device, read once per epoch), the
    epoch this call starts at, the seconds of earlier calls, whether it converged and the losses so far."""

    def __init__(self, seed: int, device, resumed: LoopState | None):
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped = torch.zeros((), dtype=torch.int32, device=device)
        self.n_batches, self.start, self.spent, self.converged, self.epoch_loss = 0, 0, 0.0, False, []
        self.epoch_seconds: list[float | None] = []
        if resumed is not None:  # go on after its last epoch
            self.generator.set_state(resumed.generator)
            self.skipped += resumed.skipped
            self.n_batches, self.start, self.spent = resumed.n_batches, resumed.epochs, resumed.seconds
            self.converged, self.epoch_loss = resumed.converged, resumed.epoch_loss
            self.epoch_seconds = list(resumed.epoch_seconds)

    def history(self, plan: _EpochPlan) -> TrainHistory:
        """The :class:`TrainHistory` this call starts from: the plan's contexts and sizes, a resumed run's figures."""
        hist = TrainHistory(contexts=plan.contexts, fast_loss=plan.loss_fn.fast, epoch_loss=list(self.epoch_loss),
                            converged=self.converged, steps=self.n_batches - int(self.skipped),
                            plateaued=_stalled(self.epoch_loss, self.converged, plan.config),
                            skipped=int(self.skipped), epoch_seconds=list(self.epoch_seconds))
        hist.sequences, hist.tokens = plan.per_epoch()
        if plan.config.precision != "fp32":  # what bf16 / auto ran as on this device
            hist.extra["precision"] = plan.precision
        if plan.sample is None and plan.shards is None:  # fixed batches: what an epoch computes
            hist.extra.update(plan.loss_fn.layout())
        if self.start:
            hist.extra.update(resumed_at_epoch=self.start, resumed_seconds=round(self.spent, 3))
        return hist

    def end_epoch(self, hist: TrainHistory, losses: list[Tensor], config: EditConfig) -> float:
        """Once per epoch, the one read back to the host: the epoch's mean loss (nats/target token; appended to
        ``hist``, which also gets the step counts and ``converged``: below ``config.stop_loss``). One-line error on a
        non-finite loss."""
        mean, n_skipped = torch.stack([torch.stack([v.double() for v in losses]).mean(),
                                       self.skipped.double()]).tolist()
        hist.skipped, hist.steps = int(n_skipped), self.n_batches - int(n_skipped)
        hist.epoch_loss.append(mean)
        if not math.isfinite(mean):
            raise CrispEditError(f"the edit loss became {mean} in epoch {len(hist.epoch_loss)} (lr {config.lr:g}); "
                                 "lower --lr or check the model and the inputs — nothing was saved")
        hist.converged = mean < config.stop_loss
        hist.plateaued = _stalled(hist.epoch_loss, hist.converged, config)
        return mean

    def state(self, epochs: int, hist: TrainHistory, seconds: float) -> LoopState:
        """The checkpointable state after ``epochs`` epochs (``seconds`` in all, earlier calls included)."""
        return LoopState(epochs, hist.epoch_loss, self.n_batches, hist.skipped, hist.converged,
                         self.generator.get_state(), {}, seconds, hist.epoch_seconds)


class _Step:
    """One batch of the loop: its loss, the skip rule (a batch whose loss is below ``config.skip_loss`` takes no
    step; ``sync_free``: decided on the device, gating Adam, else read on the host and the backward not run), the
    backward, the gradients summed over the processes (sharded plans) and the projected update (:func:`_update`)."""

    def __init__(self, params, layers, projectors, opt, config: EditConfig, drift_budget, timer, sync_free: bool):
        self.params, self.layers, self.projectors, self.opt = params, layers, projectors, opt
        self.target, self.skip_loss = ProjectionTarget(config.projection_target), config.skip_loss
        self.drift_budget, self.timer, self.sync_free = drift_budget, timer, sync_free
        self.rotations = (config.projection_precision, next(iter(params.values())).device if params else "cpu")

    def __call__(self, plan: _EpochPlan, item, counters: _Counters) -> Tensor:
        """Run ``item`` of ``plan`` (counted in ``counters``); returns its batch mean loss, a 0-d tensor on the
        device."""
        timer = self.timer
        timer.start_step()
        loss, value = plan.loss(item, timer)
        with timer.phase("bookkeeping"):  # the skip rule: a batch below skip_loss takes no step
            active = ~(value < self.skip_loss)
            counters.skipped = counters.skipped + (~active).to(torch.int32)
        if not self.sync_free:
            # The host path's one read per step, on purpose: it decides whether this batch runs its backward, so it
            # cannot wait for the epoch's end; on the CPU (its default) it waits for nothing and spares a skipped
            # batch its backward and update. The sync-free path (an accelerator's) reads nothing per step.
            with timer.phase("skip_read"):
                skip = not bool(active)
            if skip:
                counters.n_batches += 1
                timer.end_step(skipped=True)
                return value
        loss = plan.with_keep(loss, counters.n_batches, timer)
        with timer.phase("zero_grad"):
            self.opt.zero_grad(set_to_none=True)
        with timer.phase("backward"):
            if loss is not None:
                loss.backward()
        if plan.shards is not None:
            with timer.phase("allreduce"):
                _sum_grads(self.params)
        _update(self.params, self.layers, self.projectors, self.target, self.opt, active, self.drift_budget, timer,
                self.rotations)
        counters.n_batches += 1
        timer.end_step()
        return value


def projected_finetune(model: nn.Module, tokenizer, requests: Sequence[EditRequest], layers: dict[str, nn.Module],
                       params: dict[str, nn.Parameter], projectors: dict[str, LayerProjector], config: EditConfig, *,
                       optimizer: torch.optim.Optimizer | None = None, progress: bool | None = None, fast: bool = True,
                       drift_budget=None, timer: StepTimer | None = None, sync_free: bool | None = None,
                       checkpoint: str | Path | None = None, checkpoint_every: int = 1) -> TrainHistory:
    """Edit ``model`` in place with ``requests``; only ``params`` train (any parameters: layer weights,
    adapter matrices; ``layers[name]`` is the module owning ``params[name]``, for its storage orientation)
    and everything else is frozen for the duration. ``projectors[name]`` constrains ``params[name]``;
    ``optimizer`` (e.g. Adam state carried across session rounds) defaults to :func:`.optim.make_optimizer`.
    ``drift_budget`` (a :class:`~crispedit.curvature.predicted.DriftBudget` over ``params``, ``--max-drift``)
    pulls the accumulated change back into its predicted-KL budget after every step. ``timer`` (a
    :class:`~.steptimer.StepTimer`) records the seconds of every phase of every step; without it the
    phases cost nothing. ``sync_free`` (default: on an accelerator): the skip rule gates Adam on the device, so
    no step waits for it; else the loss is read (free on the CPU) and a skipped batch runs no backward. Both
    take the same steps. ``checkpoint``: a file the loop's state is written to every ``checkpoint_every`` epochs
    and after the last, and resumed from when it holds this run (:mod:`.checkpoint`). Returns the
    :class:`TrainHistory`."""
    device = next(model.parameters()).device
    sync_free = device.type != "cpu" if sync_free is None else sync_free
    timer = NULL_TIMER if timer is None else timer
    projectors = {n: pr.to(device) for n, pr in projectors.items()}  # built on CPU; applied where W lives
    opt = optimizer or make_optimizer(params, projectors, layers, config)
    t0 = time.perf_counter()
    ckpt = LoopCheckpoint(checkpoint, checkpoint_every, config.to_json(), requests, params, opt, drift_budget)
    bar = tqdm(desc=f"edit[{config.method}]", unit="epoch", total=config.epochs,
               disable=(None if progress is None else not progress))
    with _training(model, params, opt, bar):
        # the plan — training sequences (the lead-ins the model writes), the fast path's checks — from the starting
        # weights, before a checkpoint's are loaded: a resumed run trains on what the uninterrupted one did
        plan = _EpochPlan(model, tokenizer, requests, params, config, fast, device)
        run = _Counters(config.seed, device, ckpt.resume())
        bar.update(run.start)
        hist = run.history(plan)
        step = _Step(params, layers, projectors, opt, config, drift_budget, timer, sync_free)
        model.train()
        logged = time.perf_counter()
        for epoch in range(run.start, run.start if hist.converged or hist.plateaued else config.epochs):
            t_epoch = time.perf_counter()
            losses = [step(plan, item, run) for item in plan.epoch(epoch, run.generator)]
            loss = run.end_epoch(hist, losses, config)
            plan.keep_report(hist)
            hist.epoch_seconds.append(time.perf_counter() - t_epoch)
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            done = hist.converged or hist.plateaued
            if ((epoch + 1) % LOG_EVERY == 0 or done or epoch + 1 == config.epochs
                    or time.perf_counter() - logged >= LOG_SECONDS):
                logged = time.perf_counter()
                _log.info("edit[%s] epoch %d/%d: loss %.4f, %.0f s", config.method, epoch + 1, config.epochs, loss,
                          run.spent + time.perf_counter() - t0)
            ckpt.save_if_due(run.state(epoch + 1, hist, run.spent + time.perf_counter() - t0), run.start,
                             final=done or epoch + 1 == config.epochs)
            if hist.plateaued:
                _log.info("edit[%s] stopped at a plateau after epoch %d: the best loss of the last %d epochs is not "
                          "%g%% below the earlier best", config.method, epoch + 1, config.plateau_epochs,
                          100 * config.plateau_delta)
            if done:
                break
    hist.seconds = run.spent + time.perf_counter() - t0
    return hist
