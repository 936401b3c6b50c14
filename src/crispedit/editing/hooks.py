"""What the projected loop (:func:`.loop.projected_finetune`) calls at fixed points, besides its own step.

A hook may act at three points of the loop: :meth:`LoopHook.before_projection` (every step: the gradients summed,
not yet projected), :meth:`LoopHook.after_step` (every step: after the optimizer, under ``no_grad``) and
:meth:`LoopHook.end_epoch` (the epoch's mean loss read). A hook with a figure of its own on the device
(the preservation term's mean) hands it over in :meth:`LoopHook.epoch_value`, so that it is read with the loss, in
the epoch's one read back to the host. The loop's own are the drift budget (:class:`DriftHook`),
the progress bar and log lines (:class:`ProgressHook`), the checkpoint (:class:`CheckpointHook`) and the
preservation term's report (:class:`~.keep.KeepTerm`). What a hook does, it charges to its timer phase itself.
The module imports nothing of the package (:mod:`.keep`, which the config reads, builds on it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["LoopHook", "Hooks", "DriftHook", "ProgressHook", "CheckpointHook", "LOG_EVERY", "LOG_SECONDS"]

_log = logging.getLogger("crispedit.edit")
LOG_EVERY = 5  # epochs between the loop's INFO lines (for output that is not a terminal: no bar there) ...
LOG_SECONDS = 60.0  # ... or fewer, once this many seconds have passed since the last line (long epochs)


class LoopHook:
    """A hook that does nothing at any point; subclasses override the points they act at. ``section``: the key of
    the :class:`~.history.TrainHistory`'s ``extra`` the hook writes epoch by epoch (a JSON value), which a checkpoint
    carries so that a resumed run reports it whole."""

    section: str | None = None

    def before_projection(self) -> None:
        """Every step, after the backward (and the sum over processes), before the projection."""

    def after_step(self) -> None:
        """Every step, after the optimizer step (under ``torch.no_grad``)."""

    def epoch_value(self):
        """At the epoch's end, before its read: a 0-d tensor on the device to be read with the epoch's loss (given
        back as ``value`` to :meth:`end_epoch`), or ``None``."""
        return None

    def end_epoch(self, epochs: int, hist, loss: float, value: float | None = None) -> None:
        """After ``epochs`` epochs in all, with the :class:`~.history.TrainHistory` ``hist`` updated, ``loss`` the
        epoch's mean loss and ``value`` what :meth:`epoch_value` handed over, read (``None`` if nothing)."""


class Hooks(LoopHook):
    """Several hooks called in order (``None`` entries left out)."""

    def __init__(self, *hooks: LoopHook | None):
        self.hooks = [h for h in hooks if h is not None]
        self.pending: list[LoopHook] = []  # the hooks whose values are in this epoch's read, in order
        self.sections = [h.section for h in self.hooks if h.section]

    def before_projection(self) -> None:
        """Every hook's :meth:`~LoopHook.before_projection`."""
        for h in self.hooks:
            h.before_projection()

    def after_step(self) -> None:
        """Every hook's :meth:`~LoopHook.after_step`."""
        for h in self.hooks:
            h.after_step()

    def epoch_values(self) -> list:
        """Every hook's :meth:`~LoopHook.epoch_value` that is not ``None``, in order (0-d tensors, to be read)."""
        values = [(h, h.epoch_value()) for h in self.hooks]
        self.pending = [h for h, v in values if v is not None]
        return [v for _, v in values if v is not None]

    def end_epoch(self, epochs: int, hist, loss: float, value=()) -> None:
        """Every hook's :meth:`~LoopHook.end_epoch`, each given its own value of ``value`` (the read
        :meth:`epoch_values`, in their order)."""
        read = dict(zip(map(id, self.pending), value))
        for h in self.hooks:
            h.end_epoch(epochs, hist, loss, read.get(id(h)))


class DriftHook(LoopHook):
    """The ``--drift-penalty`` gradient (``β ∂(predicted drift)/∂W``, added before the projection, so projected with
    the edit's) and the ``--max-drift`` trust region (the accumulated change pulled back into its predicted-KL
    budget after every step; the weights are the same on every process, so is the decision) of a
    :class:`~crispedit.curvature.predicted.DriftBudget`, each charged to the ``drift`` phase of ``timer``."""

    def __init__(self, budget, timer):
        if budget.penalty > 0:
            self.before_projection = timer.timed("drift", budget.add_penalty_gradient)
        if budget.eps is not None:
            self.after_step = timer.timed("drift", budget.enforce)


class ProgressHook(LoopHook):
    """The progress ``bar`` (one tick per epoch, the loss beside it) and the INFO lines of edit ``method``: every
    :data:`LOG_EVERY` epochs, at the last (``cap``) or a stopping one, or once :data:`LOG_SECONDS` have passed since
    the last line; ``clock()``: the training seconds so far."""

    def __init__(self, bar, method: str, cap: int, clock: Callable[[], float], config):
        self.bar, self.method, self.cap, self.clock, self.config = bar, method, cap, clock, config
        self.logged = time.perf_counter()

    def end_epoch(self, epochs: int, hist, loss: float, value: float | None = None) -> None:
        """Tick the bar; log the epoch when due, and a plateau stop."""
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss:.4f}")
        done = hist.converged or hist.plateaued
        if epochs % LOG_EVERY == 0 or done or epochs == self.cap or time.perf_counter() - self.logged >= LOG_SECONDS:
            self.logged = time.perf_counter()
            _log.info("edit[%s] epoch %d/%d: loss %.4f, %.0f s", self.method, epochs, self.cap, loss, self.clock())
        if hist.plateaued:
            _log.info(
                "edit[%s] stopped at a plateau after epoch %d: the best loss of the last %d epochs is not "
                "%g%% below the earlier best",
                self.method,
                epochs,
                self.config.plateau_epochs,
                100 * self.config.plateau_delta,
            )


class CheckpointHook(LoopHook):
    """The loop's state written to ``ckpt`` (:class:`~.checkpoint.LoopCheckpoint`) when due: every ``ckpt.every``
    epochs after the run's start, after the last (``cap``) and after a stopping one. ``state(epochs, hist)``: the
    :class:`~.checkpoint.LoopState` now; ``start``: the epoch this call began at."""

    def __init__(self, ckpt, state: Callable, start: int, cap: int):
        self.ckpt, self.state, self.start, self.cap = ckpt, state, start, cap

    def end_epoch(self, epochs: int, hist, loss: float, value: float | None = None) -> None:
        """Save when due."""
        final = hist.converged or hist.plateaued or epochs == self.cap
        self.ckpt.save_if_due(self.state(epochs, hist), self.start, final=final)
