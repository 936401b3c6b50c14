"""The single-pass editors' shared skeleton: MEMIT and AlphaEdit (``methods/memit/closed_form.py``), UltraEdit, MEND.

Such an editor writes its change in one pass over the requests, without the projected loop:
:meth:`SinglePassEditor.apply` measures the mean target NLL (:func:`target_nll`) before, takes the weight
changes the editor yields (:meth:`SinglePassEditor.updates`) and adds each in place once it is checked
finite — before the editor computes the next one, which may read the model as changed so far — then
measures the NLL after. The :class:`~crispedit.editing.history.TrainHistory` is marked ``single_pass`` and its
``epoch_loss`` holds those two NLLs; an editor adds its own counts (steps, sequences, tokens, contexts).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from ..data.edits import EditRequest
from ..data.tokenize import collate, join_prompt_target, split_context_target
from ..errors import CrispEditError
from ..layers import weight_matrix
from .editor import EditContext, Editor, EditOutcome
from .history import TrainHistory

__all__ = ["SinglePassEditor", "target_nll"]


@torch.no_grad()
def target_nll(model: nn.Module, tokenizer, requests: Sequence[EditRequest], batch_size: int = 32) -> float:
    """Mean over requests of the target's mean negative log-likelihood (nats per target token) after the bare
    ``prompt + " " + target`` under teacher forcing."""
    device = next(model.parameters()).device
    total = 0.0
    for b in range(0, len(requests), batch_size):
        rows = [
            split_context_target(tokenizer, r.prompt, join_prompt_target(r.prompt, r.target))
            for r in requests[b : b + batch_size]
        ]
        batch = collate(tokenizer, rows, max_len=10**6).to(device)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        labels = batch.labels[:, 1:]
        lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        per = -(lp * (labels != -100)).sum(1) / (labels != -100).sum(1).clamp_min(1)
        total += float(per.sum())
    return total / max(len(requests), 1)


class SinglePassEditor(Editor):
    """Base of the editors that compute their weight changes in one pass (module docstring). A subclass
    implements :meth:`updates` and optionally :meth:`start`, :meth:`stats` and :meth:`carried_state`; it
    changes only the edit layers' weights (the default :meth:`Editor.changes`). ``form``: what the default
    :meth:`stats` reports per layer; ``nonfinite_hint``: text added to the one-line error for an update that
    is not finite."""

    carries_optimizer = False
    form = "single-pass"
    nonfinite_hint = ""

    def start(self, model: nn.Module, tokenizer, requests: Sequence[EditRequest], ctx: EditContext) -> dict:
        """Checks and set-up before anything is measured; returns the edit's state, which :meth:`updates`,
        :meth:`stats` and :meth:`carried_state` share (default: an empty one)."""
        return {}

    def updates(
        self,
        model: nn.Module,
        tokenizer,
        requests: Sequence[EditRequest],
        ctx: EditContext,
        state: dict,
        history: TrainHistory,
    ) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(edit layer name, ΔW)`` (``d_out x d_in``) as each change is computed; each is added to the
        layer's weight before this resumes. Counts what it ran into ``history``."""
        raise NotImplementedError

    def stats(self, layers: dict[str, nn.Module], state: dict) -> dict[str, dict]:
        """Per-layer report: ``kept_fraction`` (the share of input directions the update may use; default all)
        and ``form``."""
        return {n: {"kept_fraction": 1.0, "form": self.form} for n in layers}

    def carried_state(self, state: dict) -> dict[str, Tensor]:
        """Tensors a session carries to the next round (default: none)."""
        return {}

    def add_update(self, layer: nn.Module, name: str, dW: Tensor) -> None:
        """Add ``dW`` to ``layer``'s weight in place; one-line :class:`CrispEditError` (nothing added) when it
        is not finite."""
        if not torch.isfinite(dW).all():
            raise CrispEditError(f"{self.name}: the update of {name} is not finite{self.nonfinite_hint}")
        W = weight_matrix(layer)
        with torch.no_grad():
            W.add_(dW.to(W.device, W.dtype))

    def apply(self, model, tokenizer, requests, ctx: EditContext) -> EditOutcome:
        """:meth:`start`, the target NLL, every update of :meth:`updates` added in place, the target NLL again.
        The history's ``epoch_loss`` holds the two NLLs (nats/token, bare prompt), ``converged`` whether the
        last reached ``stop_loss``; the outcome the editor's :meth:`stats` and, when ``ctx.keep_optimizer``,
        its :meth:`carried_state`."""
        state = self.start(model, tokenizer, requests, ctx)
        t0 = time.perf_counter()
        history = TrainHistory(single_pass=True)
        history.epoch_loss.append(target_nll(model, tokenizer, requests))
        with contextlib.closing(self.updates(model, tokenizer, requests, ctx, state, history)) as changes:
            for name, dW in changes:
                self.add_update(ctx.layers[name], name, dW)
        history.epoch_loss.append(target_nll(model, tokenizer, requests))
        history.converged = history.epoch_loss[-1] <= ctx.config.stop_loss
        history.seconds = time.perf_counter() - t0 + history.extra.get("resumed_seconds", 0.0)  # + a resumed run's
        return EditOutcome(
            history,
            self.stats(ctx.layers, state),
            self.carried_state(state) if ctx.keep_optimizer else {},
            self.carries_state and bool(ctx.optimizer_state),
        )
