"""The closed-form editors' shared procedure (MEMIT and AlphaEdit differ only in the solve).

:class:`ClosedFormEditor.apply` writes the requests in batches of ``batch_size`` (the method config). Per
batch: the target values ``v*`` at the output of the block holding the last edit layer
(:func:`~crispedit.editing.keyvalue.target_values`); then for each edit layer ``i`` of ``L``, in increasing
depth, its keys ``K`` (``d_in x N``, the current model's), the residual ``R = (V* − Z_now) / (L − i)``
(``d_model x N``) and the update ``ΔW`` of the layer's weight from :meth:`ClosedFormEditor.solve`, added
in place before the next layer's keys are taken. Linear algebra in float64 on the model's device.

The capability statistic is the per-token input covariance ``C = E[k kᵀ]`` of each edit layer
(``curvature_kind = "input"``: an A-only, forward-only collection cached like the K-FAC factors).
A request needs its ``subject``; every request is checked before the model is touched.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import Tensor, nn

from ...data.edits import EditRequest
from ...data.tokenize import collate, join_prompt_target, split_context_target
from ...errors import CrispEditError
from ...models import weight_matrix
from ..catalogue import ClosedFormConfig
from ..keyvalue import (KeyValueSettings, block_outputs, context_templates, edit_blocks, hidden_size, layer_keys,
                        subject_span, target_values)
from ..loop import TrainHistory
from .base import EditContext, EditOutcome, Editor

__all__ = ["ClosedFormEditor", "target_nll"]


@torch.no_grad()
def target_nll(model: nn.Module, tokenizer, requests: Sequence[EditRequest], batch_size: int = 32) -> float:
    """Mean over requests of the target's mean negative log-likelihood (nats per target token) after the bare
    ``prompt + " " + target`` under teacher forcing."""
    device = next(model.parameters()).device
    total = 0.0
    for b in range(0, len(requests), batch_size):
        rows = [split_context_target(tokenizer, r.prompt, join_prompt_target(r.prompt, r.target))
                for r in requests[b:b + batch_size]]
        batch = collate(tokenizer, rows, max_len=10 ** 6).to(device)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
        labels = batch.labels[:, 1:]
        lp = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        per = -(lp * (labels != -100)).sum(1) / (labels != -100).sum(1).clamp_min(1)
        total += float(per.sum())
    return total / max(len(requests), 1)


class ClosedFormEditor(Editor):
    """Base of the closed-form key-value editors: subclasses implement :meth:`solve` (and optionally
    :meth:`prepare`, :meth:`after_batch`). Changes only the edit layers' weights (the default
    :meth:`Editor.changes`)."""

    needs_curvature = True
    curvature_kind = "input"
    carries_optimizer = False

    def check_requests(self, requests):
        """Every request has a subject that occurs in its prompt (one-line error naming the first that does not)."""
        for i, r in enumerate(requests):
            subject_span(r, i)

    def prepare(self, layers: dict[str, nn.Module], C: dict[str, Tensor], cfg: ClosedFormConfig,
                ctx: EditContext) -> dict:
        """Per-edit state built once before the first batch (default: nothing)."""
        return {}

    def solve(self, name: str, K: Tensor, R: Tensor, C: Tensor, cfg: ClosedFormConfig, state: dict) -> Tensor:
        """The update ``ΔW`` (``d_out x d_in``, float64) of layer ``name`` that maps keys ``K`` (``d_in x N``) to
        residuals ``R`` (``d_out x N``), given the layer's input covariance ``C`` (``d_in x d_in``)."""
        raise NotImplementedError

    def after_batch(self, model: nn.Module, tokenizer, requests: Sequence[EditRequest], layers: dict[str, nn.Module],
                    templates: Sequence[str], state: dict) -> None:
        """Hook after each batch has been written (default: nothing)."""

    def stats(self, layers: dict[str, nn.Module], state: dict) -> dict[str, dict]:
        """Per-layer report (``kept_fraction``: the share of input directions the update may use)."""
        return {n: {"kept_fraction": 1.0, "form": "closed-form"} for n in layers}

    def carried_state(self, state: dict) -> dict[str, Tensor]:
        """Tensors a session carries to the next round (default: none)."""
        return {}

    def apply(self, model, tokenizer, requests, ctx: EditContext) -> EditOutcome:
        """Write ``requests`` batch by batch (module docstring); the history's ``epoch_loss`` holds the mean
        target NLL (nats/token, bare prompt) before and after, ``steps`` the v* Adam steps and
        ``extra["vstar_nll"]`` the mean v* target NLL (nats/token, over the templates) before and after
        its optimisation."""
        cfg: ClosedFormConfig = ctx.config.method_config
        layers = ctx.layers
        self.check_requests(requests)  # every request's subject, before anything runs
        _, block = edit_blocks(model, layers)
        if ctx.factors is None or any(n not in ctx.factors.A for n in layers):
            raise CrispEditError(f"{self.name} needs the input covariance of every edit layer")
        C = {n: ctx.factors.A[n] for n in layers}
        t0 = time.perf_counter()
        d_model = hidden_size(model)
        for n, m in layers.items():
            if weight_matrix(m).shape[0] != d_model:
                raise CrispEditError(f"{self.name}: edit layer {n} writes {weight_matrix(m).shape[0]} features, not the "
                                     f"residual stream's {d_model}; edit the MLP output projections (down_proj)")
        history = TrainHistory(contexts=["bare"] + ([f"gen:{cfg.prefixes}"] if cfg.prefixes else []), single_pass=True)
        history.epoch_loss.append(target_nll(model, tokenizer, requests))
        templates = context_templates(model, tokenizer, cfg.prefixes, seed=ctx.config.seed)
        settings = KeyValueSettings(steps=cfg.v_steps, lr=cfg.v_lr, weight_decay=cfg.v_weight_decay, clamp=cfg.clamp,
                                    kl_factor=cfg.kl_factor)
        state = self.prepare(layers, C, cfg, ctx)
        L = len(layers)
        v_first = v_last = 0.0
        for b in range(0, len(requests), cfg.batch_size):
            chunk = list(requests[b:b + cfg.batch_size])
            zs, rec = target_values(model, tokenizer, chunk, block, templates, settings)
            history.steps += rec["steps"]
            v_first += rec["nll_first"] * len(chunk)
            v_last += rec["nll_last"] * len(chunk)
            for i, (name, m) in enumerate(layers.items()):
                K = layer_keys(model, tokenizer, chunk, m, templates).double().T          # d_in x N
                R = (zs - block_outputs(model, tokenizer, chunk, block)).double().T / (L - i)  # d_out x N
                W = weight_matrix(m)
                dW = self.solve(name, K.to(W.device), R.to(W.device), C[name].to(W.device, torch.float64), cfg, state)
                if not torch.isfinite(dW).all():
                    raise CrispEditError(f"{self.name}: the update of {name} is not finite (ill-conditioned solve)")
                with torch.no_grad():
                    W.add_(dW.to(W.dtype))
            self.after_batch(model, tokenizer, chunk, layers, templates, state)
        history.epoch_loss.append(target_nll(model, tokenizer, requests))
        # how far v* itself got (mean over requests, every template): a low value here with a high
        # epoch_loss[-1] says the solve, not the target values, held the edit back
        n = max(len(requests), 1)
        history.extra = {"vstar_nll": [round(v_first / n, 6), round(v_last / n, 6)]}
        history.converged = history.epoch_loss[-1] <= ctx.config.stop_loss
        history.sequences = len(requests) * len(templates)
        history.seconds = time.perf_counter() - t0
        return EditOutcome(history, self.stats(layers, state),
                           self.carried_state(state) if ctx.keep_optimizer else {}, bool(ctx.optimizer_state))
