"""The one projected fine-tuning loop shared by every fine-tuning editor (:func:`projected_finetune`).

Each request becomes one training sequence per edit context (:mod:`.contexts`: bare prompt, chat
template, natural-text prefixes; target followed by its answer end). FT-M loss (cross-entropy on the
target tokens only; context and padding masked), Adam, mini-batches over the sequences, batches whose
loss is already below ``skip_loss`` take no step, training stops once an epoch's mean loss is below
``stop_loss`` (or, with ``plateau_epochs``, once it has stalled just above it: :func:`.history.plateaued`; or,
with ``stop_rule="greedy"``, once every training sequence's target is the model's greedy continuation,
:meth:`.sources.FixedBatches.all_greedy`, checked after an epoch whose loss is below ``GREEDY_BAND × stop_loss``). On an
accelerator both rules are decided without reading a value back to the host inside a step: the skip test is a
0-d boolean on the device that gates the Adam step (:class:`.optim.GatedAdam`), and the losses and the skipped
count are read once per epoch, for the stop test. On the CPU, where a read costs nothing, the skip test is read
and a skipped batch's backward is not run at all (the same steps). Between ``backward`` and ``step`` every
trained weight's gradient is projected
(``projection_target="gradient"``, the paper); alternatively the Adam update itself is projected after
the step (``"update"``), or Adam runs in the K-FAC eigenbasis on the masked rotated gradient
(``"eigenbasis"``, :class:`.optim.EigenbasisAdam`); the last two keep the weight change strictly
inside the kept subspace. Projections run in float32 whatever the training dtype.

The loop itself is :func:`_train`, one screen; what is not the loop sits at its edges. The batches come from a
batch source (:mod:`.sources`: fixed batches, ``--context-sample``'s sampled ones, or under ``torch.distributed``
this process's rows of every batch, its loss scaled by its share of the batch's target tokens and the losses and
gradients summed over the processes, so every process takes the one-process step). The drift budget, the
progress bar, the checkpoint and the preservation term's report are hooks called at fixed points (:mod:`.hooks`).
The timer (:mod:`.steptimer`) wraps each part of a step once, when the loop is set up.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..curvature.precision import rotation_precision
from ..curvature.projection import LayerProjector
from ..data.edits import EditRequest
from ..data.tokenize import EncodedBatch
from ..distributed import is_sharded, world_size
from ..errors import CrispEditError
from ..layers import as_weight_matrix
from ..models import native_bf16
from .checkpoint import LoopCheckpoint, LoopState
from .config import EditConfig, ProjectionTarget
from .contexts import sequences_for
from .fastpath import plain_loss as edit_loss
from .history import GREEDY_BAND, TrainHistory, plateaued
from .hooks import LOG_EVERY, LOG_SECONDS, CheckpointHook, DriftHook, Hooks, ProgressHook
from .keep import KeepTerm, keep_term
from .optim import make_optimizer
from .sources import FixedBatches, batch_source, shard_batch, target_count, training_batches
from .steptimer import NULL_TIMER, StepTimer

_log = logging.getLogger("crispedit.edit")

__all__ = [
    "projected_finetune",
    "edit_loss",
    "apply_projection",
    "edit_batches",
    "resolve_precision",
    "shard_batch",
    "target_count",
    "LOG_EVERY",
    "LOG_SECONDS",
]


def _stalled(epoch_loss: Sequence[float], converged: bool, config: EditConfig) -> bool:
    """Whether ``config``'s plateau rule ends a run that has not converged after these epoch losses."""
    return not converged and plateaued(epoch_loss, config.stop_loss, config.plateau_epochs, config.plateau_delta)


def apply_projection(proj: LayerProjector, module: nn.Module, t: Tensor) -> Tensor:
    """Project a weight-shaped tensor of ``module`` (handles transposed storage)."""
    return as_weight_matrix(module, proj.project(as_weight_matrix(module, t)))


def edit_batches(
    tokenizer, requests: Sequence[EditRequest], config: EditConfig, model: nn.Module | None = None
) -> tuple[list[EncodedBatch], list[str]]:
    """The training batches for ``requests`` under ``config.contexts`` / ``config.answer_end`` (``config.batch_size``
    sequences, or packed to ``config.batch_tokens`` padded tokens) and the
    context names used (``chat`` is dropped from ``default`` for models without a chat template;
    ``model`` writes the ``gen`` prefixes — pass it unedited)."""
    seqs, names = sequences_for(tokenizer, requests, config, model)
    return training_batches(
        tokenizer, seqs, config.batch_size, config.batch_tokens, by_length=config.batch_order == "length"
    ), names


def resolve_precision(precision: str, device) -> str:
    """The training forward's arithmetic an edit runs with on ``device``: ``"bf16"`` or ``"fp32"``; ``"auto"`` is
    bf16 where the device has it natively (:func:`~crispedit.models.native_bf16`), else fp32. An explicit bf16 on a
    device that emulates it runs as asked, with a warning that fp32 would be faster."""
    native = native_bf16(device)
    if precision == "auto":
        return "bf16" if native else "fp32"
    if precision == "bf16" and not native:
        _log.warning(
            "bf16 on %s is emulated here (no native bfloat16 arithmetic: a CPU without AVX-512 or AMX), "
            "many times slower than fp32; --precision fp32 or auto is faster",
            torch.device(device).type,
        )
    return precision


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


def _arithmetic(precision: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The training forward's arithmetic as a context factory: under bfloat16 an autocast region (matrix products in
    bfloat16; the backward follows the forward's dtypes, the float32 weights receive float32 gradients), else
    nothing. The frozen prefix of the fast path is computed beforehand, in the model's own dtype."""
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


class _ProjectedStep:
    """The step after the backward, where the projection acts (``target``): the gradient projected before Adam
    (the paper), or Adam's update projected after it (the weights copied first), or neither here (the eigenbasis
    optimizer masks by itself). Adam is gated by ``active``: an inactive (skipped) step changes nothing. Each part
    charged to its phase of ``timer``; called under ``torch.no_grad``."""

    def __init__(self, params, layers, projectors, opt, target: ProjectionTarget, timer):
        self.params, self.layers, self.projectors, self.target = params, layers, projectors, target
        self.copies = timer.timed("copies", lambda: {n: p.detach().float().clone() for n, p in params.items()})
        self.project_grads = timer.timed("projection", self._project_grads)
        self.optimizer = timer.timed("optimizer", opt.step)
        self.project_update = timer.timed("projection", self._project_update)

    def __call__(self, active: Tensor) -> None:
        before = self.copies() if self.target is ProjectionTarget.UPDATE else None
        if self.target is ProjectionTarget.GRADIENT:
            self.project_grads()
        self.optimizer(active=active)
        if before is not None:
            self.project_update(before)

    def _project_grads(self) -> None:
        for n, p in self.params.items():
            g = apply_projection(self.projectors[n], self.layers[n], p.grad)
            if g is p.grad:
                continue  # nothing masked (the identity): nothing to write
            if g.stride() == p.grad.stride():
                p.grad = g  # a fresh tensor: use it, no copy
            else:
                p.grad.copy_(g)

    def _project_update(self, before: dict[str, Tensor]) -> None:
        for n, p in self.params.items():
            delta = apply_projection(self.projectors[n], self.layers[n], p.detach().float() - before[n])
            p.copy_((before[n] + delta).to(p.dtype))


class _Run:
    """Where the loop stands across epochs (and across a resume): the batch-order ``generator``, the batches run so
    far (``n_batches``) and skipped (``skipped``, a 0-d int32 on the device, read once per epoch), the epoch this
    call starts at, the seconds of earlier calls (``spent``; this call's since ``t0``), whether it converged and the
    losses so far."""

    def __init__(self, config: EditConfig, device, resumed: LoopState | None, t0: float):
        self.config, self.skip_loss, self.t0 = config, config.skip_loss, t0
        self.generator = torch.Generator().manual_seed(config.seed)
        self.skipped = torch.zeros((), dtype=torch.int32, device=device)
        self.n_batches, self.start, self.spent, self.converged, self.epoch_loss = 0, 0, 0.0, False, []
        self.epoch_seconds: list[float | None] = []
        if resumed is not None:  # go on after its last epoch
            self.generator.set_state(resumed.generator)
            self.skipped += resumed.skipped
            self.n_batches, self.start, self.spent = resumed.n_batches, resumed.epochs, resumed.seconds
            self.converged, self.epoch_loss = resumed.converged, resumed.epoch_loss
            self.epoch_seconds = list(resumed.epoch_seconds)
        self.sections = {} if resumed is None else dict(resumed.sections)  # the hooks' report sections so far
        self.section_names: list[str] = []  # which hist.extra entries those are (the hooks', set by the loop)

    def seconds(self) -> float:
        """Training seconds so far, earlier calls included."""
        return self.spent + time.perf_counter() - self.t0

    def history(self, source: FixedBatches, precision: str) -> TrainHistory:
        """The :class:`TrainHistory` this call starts from: the source's contexts and sizes, a resumed run's figures."""
        config = self.config
        hist = TrainHistory(
            contexts=source.contexts,
            fast_loss=source.fast,
            epoch_loss=list(self.epoch_loss),
            converged=self.converged,
            steps=self.n_batches - int(self.skipped),
            plateaued=_stalled(self.epoch_loss, self.converged, config),
            skipped=int(self.skipped),
            epoch_seconds=list(self.epoch_seconds),
        )
        hist.sequences, hist.tokens = source.per_epoch()
        if config.precision != "fp32":  # what bf16 / auto ran as on this device
            hist.extra["precision"] = precision
        if config.stop_rule != "loss":  # `converged` then also means: every target the greedy continuation
            hist.extra["stop_rule"] = config.stop_rule
        hist.extra.update(source.layout())  # fixed batches: what an epoch computes
        hist.extra.update(self.sections)
        if self.start:
            hist.extra.update(resumed_at_epoch=self.start, resumed_seconds=round(self.spent, 3))
        return hist

    def skip_test(self, mean: Tensor) -> Tensor:
        """Whether a batch of mean loss ``mean`` steps (not below the skip loss), a 0-d boolean on the device; a
        skipped batch is counted there."""
        active = ~(mean < self.skip_loss)
        self.skipped = self.skipped + (~active).to(torch.int32)
        return active

    def end_epoch(
        self,
        hist: TrainHistory,
        losses: list[Tensor],
        pending: Sequence[Tensor] = (),
        greedy: Callable[[], bool] | None = None,
    ) -> tuple[float, list[float]]:
        """Once per epoch, the one read back to the host: the epoch's mean loss (nats/target token; appended to
        ``hist``, which also gets the step counts, ``converged`` — below the stop loss, or under the greedy stop
        rule ``greedy()`` true once the loss is below ``GREEDY_BAND ×`` it — and ``plateaued``) and the hooks'
        ``pending`` 0-d values, read with it. Returns the mean loss and the values read. One-line error on a
        non-finite loss."""
        mean, n_skipped, *values = torch.stack(
            [torch.stack([v.double() for v in losses]).mean(), self.skipped.double(), *(v.double() for v in pending)]
        ).tolist()
        hist.skipped, hist.steps = int(n_skipped), self.n_batches - int(n_skipped)
        hist.epoch_loss.append(mean)
        if not math.isfinite(mean):
            raise CrispEditError(
                f"the edit loss became {mean} in epoch {len(hist.epoch_loss)} "
                f"(lr {self.config.learning_rate:g}); lower --lr or check the model and the inputs — "
                "nothing was saved"
            )
        hist.converged = mean < self.config.stop_loss
        if not hist.converged and self.config.stop_rule == "greedy" and mean < GREEDY_BAND * self.config.stop_loss:
            hist.converged = greedy is not None and greedy()
        hist.plateaued = _stalled(hist.epoch_loss, hist.converged, self.config)
        return mean, values

    def state(self, epochs: int, hist: TrainHistory) -> LoopState:
        """The checkpointable state after ``epochs`` epochs (with the seconds so far, earlier calls included)."""
        return LoopState(
            epochs,
            hist.epoch_loss,
            self.n_batches,
            hist.skipped,
            hist.converged,
            self.generator.get_state(),
            {},
            self.seconds(),
            hist.epoch_seconds,
            {k: hist.extra[k] for k in self.section_names if k in hist.extra},
        )


def _backward(loss: Tensor | None) -> None:
    if loss is not None:  # None: this process holds no row of the batch (its gradient is zero)
        loss.backward()


def _step_parts(
    source: FixedBatches,
    run: _Run,
    keep: KeepTerm | None,
    step: _ProjectedStep,
    opt,
    params,
    timer,
    rotations: tuple[str, torch.device | str],
) -> SimpleNamespace:
    """The parts of a step the loop calls, each wrapped once in its phase of ``timer`` (the phases of
    :mod:`.steptimer`; :data:`~.steptimer.NULL_TIMER` leaves them unwrapped). Parts an edit does not use (the
    preservation term, the sum over processes) are no-ops, untimed. ``rotations``: ``(mode, device)`` of the
    projection's float32 GEMMs (:func:`rotation_precision`)."""
    t = timer.timed
    return SimpleNamespace(
        source=source,
        timer=timer,
        step=step,
        rotations=lambda: rotation_precision(*rotations),
        loss=t("forward", source.loss),
        batch_mean=t("bookkeeping", source.batch_mean),
        skip_test=t("bookkeeping", run.skip_test),
        skip_read=t("skip_read", bool),
        keep=(lambda loss, n: loss) if keep is None else t("keep", keep.add),
        zero_grad=t("zero_grad", opt.zero_grad),
        backward=t("backward", _backward),
        sum_grads=t("allreduce", lambda: source.sum_grads(params)) if source.sharded else lambda: None,
    )


def _train(s: SimpleNamespace, run: _Run, hist: TrainHistory, hooks: Hooks, epochs: int, sync_free: bool) -> None:
    """The projected fine-tuning loop: epoch → batch → loss → skip → backward → project → step → stop rule, with
    ``s`` the step's parts (:func:`_step_parts`), ``run`` its counters, ``hooks`` called at fixed points."""
    for epoch in range(run.start, run.start if hist.converged or hist.plateaued else epochs):
        t_epoch, losses = time.perf_counter(), []
        for item in s.source.epoch(epoch, run.generator):  # a seeded order: a resumed run draws what this one would
            s.timer.start_step()
            loss = s.loss(item)  # this process's share of the batch's FT-M loss (None: no row of it here)
            mean = s.batch_mean(loss)  # the batch mean on the device, summed over processes; not read here
            active = s.skip_test(mean)  # a batch whose loss is already below skip_loss takes no step
            losses.append(mean)
            if not sync_free and not s.skip_read(active):
                # The host path's one read per step, on purpose: it decides whether this batch runs its backward, so
                # it cannot wait for the epoch's end; on the CPU it waits for nothing and spares a skipped batch its
                # backward and update. The sync-free path (an accelerator's) reads nothing: `active` gates Adam.
                run.n_batches += 1
                s.timer.end_step(skipped=True)
                continue
            loss = s.keep(loss, run.n_batches)  # + the preservation term: its gradient is projected like the edit's
            s.zero_grad(set_to_none=True)
            s.backward(loss)
            s.sum_grads()  # row shards: every process now holds the one-process gradient
            hooks.before_projection()  # the drift penalty's gradient joins here, to be projected with the rest
            with torch.no_grad(), s.rotations():
                s.step(active)  # project, then Adam (gated by `active`, so skipping needs no read)
                hooks.after_step()  # the drift budget pulls the change back; same weights: same decision
            run.n_batches += 1
            s.timer.end_step()
        # the epoch's one read back to the host, for the stop rules, with what the hooks report (the keep term's mean)
        loss, values = run.end_epoch(hist, losses, hooks.epoch_values(), s.source.all_greedy)
        hist.epoch_seconds.append(time.perf_counter() - t_epoch)
        hooks.end_epoch(epoch + 1, hist, loss, values)  # the keep term's report, the bar and log, the checkpoint
        if hist.converged or hist.plateaued:
            break


def projected_finetune(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    layers: dict[str, nn.Module],
    params: dict[str, nn.Parameter],
    projectors: dict[str, LayerProjector],
    config: EditConfig,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    progress: bool | None = None,
    fast: bool = True,
    drift_budget=None,
    timer: StepTimer | None = None,
    sync_free: bool | None = None,
    checkpoint: str | Path | None = None,
    checkpoint_every: int = 1,
) -> TrainHistory:
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
    bar = tqdm(
        desc=f"edit[{config.method}]",
        unit="epoch",
        total=config.epochs,
        disable=(None if progress is None else not progress),
    )
    with _training(model, params, opt, bar):
        # the batches — training sequences (the lead-ins the model writes), the fast path's checks — and the kept
        # answers from the starting weights, before a checkpoint's are loaded: a resumed run trains on what the
        # uninterrupted one did
        precision = resolve_precision(config.precision, device)
        arithmetic = _arithmetic(precision, device)
        source = batch_source(model, tokenizer, requests, params, config, fast, device, arithmetic)
        t_keep = time.perf_counter()
        keep = keep_term(
            model,
            tokenizer,
            requests,
            params,
            config,
            fast=fast,
            device=device,
            arithmetic=arithmetic,
            processes=world_size(),
            split=is_sharded(model),
            per_step=-(-source.per_epoch()[0] // max(len(source.first), 1)),  # the edit batches' mean size
        )
        setup = {"batches": round(t_keep - t0, 3), "keep": round(time.perf_counter() - t_keep, 3)}
        run = _Run(config, device, ckpt.resume(), t0)
        bar.update(run.start)
        hist = run.history(source, precision)
        hist.extra["setup_seconds"] = setup  # before the first step: the batches (lead-ins written), the kept answers
        hooks = Hooks(
            keep,
            None if drift_budget is None else DriftHook(drift_budget, timer),
            ProgressHook(bar, config.method, config.epochs, run.seconds, config),
            CheckpointHook(ckpt, run.state, run.start, config.epochs),
        )
        run.section_names = hooks.sections
        step = _ProjectedStep(params, layers, projectors, opt, ProjectionTarget(config.projection_target), timer)
        rotations = (config.projection_precision, next(iter(params.values())).device if params else "cpu")
        model.train()
        _train(
            _step_parts(source, run, keep, step, opt, params, timer, rotations),
            run,
            hist,
            hooks,
            config.epochs,
            sync_free,
        )
    hist.seconds = run.seconds()
    return hist
