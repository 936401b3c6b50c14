"""The closed-form editors' shared procedure (MEMIT and AlphaEdit differ only in the solve).

:class:`ClosedFormEditor` (a :class:`~.single_pass.SinglePassEditor`) writes the requests in batches of
``batch_size`` (the method config). Per batch: the target values ``v*`` at the output of the block holding
the last edit layer (:func:`~crispedit.editing.keyvalue.target_values`); then for each edit layer ``i`` of
``L``, in increasing depth, its keys ``K`` (``d_in x N``, the current model's), the residual
``R = (V* − Z_now) / (L − i)`` (``d_model x N``) and the update ``ΔW`` of the layer's weight from
:meth:`ClosedFormEditor.solve`, added in place before the next layer's keys are taken. Linear algebra in
float64 on the model's device.

The capability statistic is the per-token input covariance ``C = E[k kᵀ]`` of each edit layer
(``curvature_kind = "input"``: an A-only, forward-only collection cached like the K-FAC factors).
A request needs its ``subject``; every request is checked before the model is touched.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ...atomic import atomic_save_safetensors
from ...data.edits import EditRequest
from ...distributed import is_main
from ...editing.checkpoint import CLOSED_FORM_KEY, agree_on_resume, load_run_file, run_identity
from ...editing.editor import EditContext
from ...editing.keyvalue import (
    KeyValueSettings,
    block_outputs,
    context_templates,
    edit_blocks,
    hidden_size,
    layer_keys,
    subject_span,
    target_values,
)
from ...editing.loop import LOG_SECONDS
from ...editing.single_pass import SinglePassEditor, target_nll
from ...errors import CrispEditError
from ...layers import weight_matrix
from ...versions import stamped
from . import ClosedFormConfig

__all__ = ["ClosedFormEditor", "target_nll"]

_log = logging.getLogger("crispedit.edit")


class ClosedFormEditor(SinglePassEditor):
    """Base of the closed-form key-value editors: subclasses implement :meth:`solve` (and optionally
    :meth:`prepare`, :meth:`after_batch`, :meth:`stats`, :meth:`carried_state`). Changes only the edit layers'
    weights (the default :meth:`Editor.changes`). The history's ``epoch_loss`` holds the mean target NLL
    (nats/token, bare prompt) before and after, ``steps`` the v* Adam steps and ``extra["vstar_nll"]`` the
    mean v* target NLL (nats/token, over the templates) before and after its optimisation."""

    needs_curvature = True
    curvature_kind = "input"
    form = "closed-form"
    nonfinite_hint = " (ill-conditioned solve)"

    def check_requests(self, requests):
        """Every request has a subject that occurs in its prompt (one-line error naming the first that does not)."""
        for i, r in enumerate(requests):
            subject_span(r, i)

    def prepare(
        self, layers: dict[str, nn.Module], C: dict[str, Tensor], cfg: ClosedFormConfig, ctx: EditContext
    ) -> dict:
        """Per-edit state built once before the first batch (default: nothing)."""
        return {}

    def solve(self, name: str, K: Tensor, R: Tensor, C: Tensor, cfg: ClosedFormConfig, state: dict) -> Tensor:
        """The update ``ΔW`` (``d_out x d_in``, float64) of layer ``name`` that maps keys ``K`` (``d_in x N``) to
        residuals ``R`` (``d_out x N``), given the layer's input covariance ``C`` (``d_in x d_in``)."""
        raise NotImplementedError

    def after_batch(
        self,
        model: nn.Module,
        tokenizer,
        requests: Sequence[EditRequest],
        layers: dict[str, nn.Module],
        templates: Sequence[str],
        state: dict,
    ) -> None:
        """Hook after each batch has been written (default: nothing)."""

    def restore_carried(self, state: dict, tensors: dict[str, Tensor]) -> None:
        """Put back into ``state`` what :meth:`carried_state` returned (a batch checkpoint; default: nothing)."""

    def start(self, model, tokenizer, requests, ctx: EditContext) -> dict:
        """Every request's subject, the input covariance of every edit layer, edit layers that write the residual
        stream (one-line errors), before anything runs; the state holds the edited block and ``C``."""
        from ...curvature.factors import InputCovariance

        layers = ctx.layers
        self.check_requests(requests)
        _, block = edit_blocks(model, layers)
        cov = None if ctx.factors is None else InputCovariance(ctx.factors)
        if cov is None or not all(cov.covers(n) for n in layers):
            raise CrispEditError(f"{self.name} needs the input covariance of every edit layer")
        d_model = hidden_size(model)
        for n, m in layers.items():
            if weight_matrix(m).shape[0] != d_model:
                raise CrispEditError(
                    f"{self.name}: edit layer {n} writes {weight_matrix(m).shape[0]} features, not "
                    "the "
                    f"residual stream's {d_model}; edit the MLP output projections (down_proj)"
                )
        return {"block": block, "C": {n: cov.matrix(n) for n in layers}}

    def updates(self, model, tokenizer, requests, ctx: EditContext, state: dict, history):
        """Write ``requests`` batch by batch (module docstring), yielding each layer's ``ΔW`` in turn."""
        cfg: ClosedFormConfig = ctx.config.method_config
        layers, block, C = ctx.layers, state["block"], state["C"]
        history.contexts = ["bare"] + ([f"gen:{cfg.prefixes}"] if cfg.prefixes else [])
        templates = context_templates(model, tokenizer, cfg.prefixes, seed=ctx.config.seed)
        settings = KeyValueSettings(
            steps=cfg.v_steps, lr=cfg.v_lr, weight_decay=cfg.v_weight_decay, clamp=cfg.clamp, kl_factor=cfg.kl_factor
        )
        state.update(self.prepare(layers, C, cfg, ctx))
        L, n_batches = len(layers), -(-len(requests) // cfg.batch_size)
        ck = _BatchCheckpoint(ctx, requests, layers)
        done, (v_first, v_last) = ck.resume(self, state, history), ck.sums
        report = _Progress(self.name, len(requests), min(done * cfg.batch_size, len(requests)), ctx.progress)
        held = ck.first_batch_tf  # batch 1's edits, teacher-forced, after each batch (a batched run is sequential)
        for k, b in enumerate(range(0, len(requests), cfg.batch_size)):
            if k < done:  # written by an earlier run (its weights and state came from the checkpoint)
                continue
            chunk = list(requests[b : b + cfg.batch_size])
            zs, rec = target_values(model, tokenizer, chunk, block, templates, settings, on_chunk=report)
            history.steps += rec["steps"]
            v_first += rec["nll_first"] * len(chunk)
            v_last += rec["nll_last"] * len(chunk)
            for i, (name, m) in enumerate(layers.items()):
                K = layer_keys(model, tokenizer, chunk, m, templates).double().T  # d_in x N
                R = (zs - block_outputs(model, tokenizer, chunk, block)).double().T / (L - i)  # d_out x N
                W = weight_matrix(m)
                yield (
                    name,
                    self.solve(name, K.to(W.device), R.to(W.device), C[name].to(W.device, torch.float64), cfg, state),
                )
            self.after_batch(model, tokenizer, chunk, layers, templates, state)
            if n_batches > 1:
                held.append(_tf_rel(model, tokenizer, requests[: cfg.batch_size]))
            ck.save(k + 1, self.carried_state(state), history.steps, v_first, v_last)
            report.batch(k + 1, n_batches, rec, held[-1] if held else None)
        report.close()
        if n_batches > 1:
            history.extra["first_batch_tf_rel"] = [None if x is None else round(x, 4) for x in held]
        # how far v* itself got (mean over requests, every template): a low value here with a high
        # epoch_loss[-1] says the solve, not the target values, held the edit back
        n = max(len(requests), 1)
        history.extra["vstar_nll"] = [round(v_first / n, 6), round(v_last / n, 6)]
        history.sequences = len(requests) * len(templates)


def _tf_rel(model: nn.Module, tokenizer, requests: Sequence[EditRequest]) -> float:
    """Teacher-forced reliability of ``requests`` on ``model`` now: the fraction whose target is the greedy
    continuation of its prompt at every target token (:func:`~crispedit.evaluation.teacher_forced.score_pairs`)."""
    from ...evaluation.teacher_forced import score_pairs

    scores = score_pairs(model, tokenizer, [r.prompt for r in requests], [r.target for r in requests])
    return sum(s.exact for s in scores) / max(len(scores), 1)


class _Progress:
    """A closed-form edit's progress: a bar over the requests whose ``v*`` is found (shown as
    :func:`~crispedit.progress.show_progress` says), an INFO line at most every ``LOG_SECONDS`` while they are,
    and one after every written batch (``v*`` target NLL before / after, nats/token; seconds since this run
    started)."""

    def __init__(self, name: str, total: int, done: int, progress: bool | None):
        self.name, self.total, self.done, self.t0 = name, total, done, time.perf_counter()
        self.logged = self.t0
        self.bar = tqdm(
            desc=f"edit[{name}] v*",
            unit="edit",
            total=total,
            initial=done,
            disable=(None if progress is None else not progress),
        )

    def __call__(self, n: int) -> None:
        """``n`` more requests have their ``v*``."""
        self.done += n
        self.bar.update(n)
        if time.perf_counter() - self.logged >= LOG_SECONDS:
            self.logged = time.perf_counter()
            _log.info("edit[%s] v*: %d/%d edits, %.0f s", self.name, self.done, self.total, self.logged - self.t0)

    def batch(self, k: int, n_batches: int, rec: dict, held: float | None = None) -> None:
        """Batch ``k`` of ``n_batches`` is written; ``rec``: its :func:`target_values` record; ``held``: the
        teacher-forced reliability of batch 1's edits now."""
        self.logged = time.perf_counter()
        _log.info(
            "edit[%s] batch %d/%d written: v* NLL %.3f -> %.3f%s, %.0f s",
            self.name,
            k,
            n_batches,
            rec["nll_first"],
            rec["nll_last"],
            "" if held is None else f"; batch 1's edits hold {held:.2f}",
            self.logged - self.t0,
        )

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


class _BatchCheckpoint:
    """A closed-form edit's progress after each finished batch, in ``ctx.checkpoint`` (none: every method does
    nothing): the edit layers' weights, the editor's carried state (AlphaEdit's ``K_p K_pᵀ``), the v* counters and
    the number of batches written, tagged with the run's identity (config, requests, the layers' starting weights
    and the carried state it started from: :func:`~crispedit.editing.checkpoint.run_identity`). Taken after the
    context templates are written, so a resumed run writes the same ones (they come from the unedited model)."""

    KIND, KEY, FORMAT = "closed-form checkpoint", CLOSED_FORM_KEY, 1

    def __init__(self, ctx: EditContext, requests: Sequence[EditRequest], layers: dict[str, nn.Module]):
        self.path, self.layers, self.sums = ctx.checkpoint, layers, (0.0, 0.0)
        self.first_batch_tf: list[float | None] = []  # batch 1's edits after each written batch (stored runs' too)
        self.t0, self.earlier = time.perf_counter(), 0.0  # seconds of this run, and of the stored runs
        start = {f"weight::{n}": m.weight for n, m in layers.items()}
        start.update({f"carried::{k}": t for k, t in ctx.optimizer_state.items()})
        self.identity = None if self.path is None else run_identity(ctx.config.to_json(), requests, start)

    def resume(self, editor: ClosedFormEditor, state: dict, history) -> int:
        """The number of batches a stored run wrote (0 without one), its weights put into the layers, its carried
        state into ``state``, its counters into ``history`` and :attr:`sums`; one-line errors for another run's or
        a damaged file."""
        stored = (
            None if self.path is None else load_run_file(self.path, self.KIND, self.KEY, self.FORMAT, self.identity)
        )
        if self.path is not None:
            agree_on_resume(stored is not None, self.path)
        if stored is None:
            return 0
        meta, tensors = stored
        try:  # everything read and checked before the layers change
            weights = {n: tensors[f"weight::{n}"] for n in self.layers}
            if any(w.shape != m.weight.shape for w, m in zip(weights.values(), self.layers.values())):
                raise ValueError("a layer's weight has another shape")
            carried = {k[len("carried::") :]: t for k, t in tensors.items() if k.startswith("carried::")}
            editor.restore_carried(state, carried)
            history.steps = int(meta["steps"])
            self.sums = (float(meta["v_first"]), float(meta["v_last"]))
            done = int(meta["batches"])
            self.earlier = float(meta["seconds"])
            self.first_batch_tf = [None if x is None else float(x) for x in meta["first_batch_tf_rel"]][:done]
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CrispEditError(f"{self.KIND} file {self.path} is incomplete or corrupt ({exc})") from None
        with torch.no_grad():
            for n, m in self.layers.items():
                m.weight.copy_(weights[n].to(m.weight.device, m.weight.dtype))
        history.extra.update(resumed_at_batch=done, resumed_seconds=round(self.earlier, 3))
        return done

    def save(self, batches: int, carried: dict[str, Tensor], steps: int, v_first: float, v_last: float) -> None:
        """Write the progress after ``batches`` written batches (atomically; rank 0 alone under ``torchrun``)."""
        if self.path is None or not is_main():
            return
        tensors = {f"weight::{n}": m.weight.detach().cpu().contiguous() for n, m in self.layers.items()}
        tensors.update({f"carried::{k}": t.detach().cpu().contiguous() for k, t in carried.items()})
        meta = stamped(
            {
                "format": self.FORMAT,
                "identity": self.identity,
                "batches": batches,
                "steps": int(steps),
                "v_first": float(v_first),
                "v_last": float(v_last),
                "seconds": self.earlier + time.perf_counter() - self.t0,
                "first_batch_tf_rel": self.first_batch_tf,
            }
        )
        atomic_save_safetensors(self.path, tensors, metadata={self.KEY: json.dumps(meta)})
