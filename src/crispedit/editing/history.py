"""What a training run did and when it stops: :class:`TrainHistory` (the ``training`` section of an edit report),
its one-line summary (:func:`training_brief`), and the plateau rule that ends a run stalled just above its stop
loss (:func:`plateaued`). A function of the recorded losses alone, so a resumed run decides as the uninterrupted
one did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["TrainHistory", "training_brief", "plateaued", "plateau_stop", "PLATEAU_BAND", "GREEDY_BAND"]

PLATEAU_BAND = 2.0  # the plateau rule acts only once the epoch loss is below this many times the stop loss
# the greedy stop rule is checked only once the epoch loss is below this many times the stop loss: above it a
# target token is rarely the argmax everywhere, and the check costs a forward over the training sequences
GREEDY_BAND = 10.0


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
        return {
            "epoch_loss": [round(x, 6) for x in self.epoch_loss],
            "epochs": 0 if self.single_pass else len(self.epoch_loss),
            "steps": self.steps,
            "skipped_batches": self.skipped,
            "converged": self.converged,
            **({"plateaued": True} if self.plateaued else {}),
            "seconds": round(self.seconds, 3),
            **(
                {"epoch_seconds": [None if x is None else round(x, 2) for x in self.epoch_seconds]}
                if self.epoch_seconds
                else {}
            ),
            "fast_loss": self.fast_loss,
            "contexts": self.contexts,
            "sequences": self.sequences,
            "tokens_per_epoch": self.tokens,
            **({"single_pass": True} if self.single_pass else {}),
            **self.extra,
        }


def training_brief(train: dict, lr: float | None = None) -> str:
    """One line for a report's ``training`` section (:meth:`TrainHistory.to_json`), as the CLI prints it:
    ``"epochs=21 last_loss=0.0096"`` (+ ``" lr=0.0005"`` given ``lr``) for the fine-tuning loop,
    ``"single-pass target_nll=8.308->0.1374"`` (nats/token before -> after) for a single-pass editor, whose
    ``epoch_loss`` is not per epoch and whose learning rate, if any, is its own."""
    loss = train.get("epoch_loss") or []
    if train.get("single_pass"):
        return "single-pass" + (f" target_nll={loss[0]:.4g}->{loss[-1]:.4g}" if len(loss) >= 2 else "")
    return (
        f"epochs={train.get('epochs')}"
        + (f" last_loss={loss[-1]:.4g}" if loss else "")
        + ("" if lr is None else f" lr={lr:g}")
    )


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
