"""The one projected fine-tuning loop shared by every fine-tuning editor.

FT-M loss (cross-entropy on the target tokens only; prompt and padding masked), Adam, mini-batches
over the edits, batches whose loss is already below ``skip_loss`` are skipped, training stops once an
epoch's mean loss is below ``stop_loss``. Between ``backward`` and ``step`` every trained weight's
gradient is projected (``projection_target="gradient"``, the paper); alternatively the Adam update
itself is projected after the step (``"update"``), which keeps the weight change strictly inside the
kept subspace. Projections run in float32 whatever the training dtype.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..data.edits import EditRequest
from ..data.tokenize import EncodedBatch, encode_pairs
from ..projection import LayerProjector
from .config import EditConfig, ProjectionTarget
from .fastpath import make_loss_fn, plain_loss as edit_loss

__all__ = ["projected_finetune", "edit_loss", "TrainHistory", "apply_projection"]


@dataclass
class TrainHistory:
    epoch_loss: list[float] = field(default_factory=list)
    steps: int = 0
    skipped: int = 0
    converged: bool = False
    seconds: float = 0.0
    fast_loss: bool = False  # the exact shortcut of editing/fastpath.py was used

    def to_json(self) -> dict:
        return {"epoch_loss": [round(x, 6) for x in self.epoch_loss], "epochs": len(self.epoch_loss),
                "steps": self.steps, "skipped_batches": self.skipped, "converged": self.converged,
                "seconds": round(self.seconds, 3), "fast_loss": self.fast_loss}


def _as_matrix(module: nn.Module, t: Tensor) -> Tensor:
    # GPT-2's Conv1D stores W transposed (d_in x d_out)
    return t.T if type(module).__name__ == "Conv1D" else t


def apply_projection(proj: LayerProjector, module: nn.Module, t: Tensor) -> Tensor:
    """Project a weight-shaped tensor of ``module`` (handles transposed storage)."""
    return _as_matrix(module, proj.project(_as_matrix(module, t)))


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
) -> TrainHistory:
    """Edit ``model`` in place. Only ``params`` train; everything else is frozen for the duration."""
    device = next(model.parameters()).device
    target = ProjectionTarget(config.projection_target)
    projectors = {n: pr.to(device) for n, pr in projectors.items()}  # built on CPU; applied where W lives
    flags = {p: p.requires_grad for p in model.parameters()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    opt = optimizer or torch.optim.Adam(params.values(), lr=config.lr, betas=config.betas, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    batches = [b.to(device) for b in _batches(tokenizer, requests, config.batch_size)]
    hist, t0 = TrainHistory(), time.perf_counter()
    model.train()
    loss_fn = make_loss_fn(model, params, batches, enabled=fast)  # exact shortcut: frozen prefix cached
    hist.fast_loss = bool(getattr(loss_fn, "fast", False))
    bar = tqdm(range(config.epochs), desc=f"edit[{config.method}]", unit="epoch",
               disable=(None if progress is None else not progress))
    try:
        for _epoch in bar:
            losses = []
            for bi in torch.randperm(len(batches), generator=gen).tolist():
                loss = loss_fn(bi)
                losses.append(loss.item())
                if loss.item() < config.skip_loss:
                    hist.skipped += 1
                    continue
                opt.zero_grad(set_to_none=True)
                loss.backward()
                before = {n: p.detach().float().clone() for n, p in params.items()} if target is ProjectionTarget.UPDATE else None
                with torch.no_grad():
                    if target is ProjectionTarget.GRADIENT:
                        for n, p in params.items():
                            p.grad.copy_(apply_projection(projectors[n], layers[n], p.grad))
                    opt.step()
                    if before is not None:
                        for n, p in params.items():
                            delta = apply_projection(projectors[n], layers[n], p.detach().float() - before[n])
                            p.copy_((before[n] + delta).to(p.dtype))
                hist.steps += 1
            mean = sum(losses) / len(losses)
            hist.epoch_loss.append(mean)
            bar.set_postfix(loss=f"{mean:.4f}")
            if not math.isfinite(mean):
                raise FloatingPointError(f"edit loss became {mean}; lower the learning rate")
            if mean < config.stop_loss:
                hist.converged = True
                break
    finally:
        bar.close()
        model.eval()
        opt.zero_grad(set_to_none=True)
        for p, f in flags.items():
            p.requires_grad_(f)
    hist.seconds = time.perf_counter() - t0
    return hist


def _batches(tokenizer, requests: Sequence[EditRequest], batch_size: int) -> list[EncodedBatch]:
    out = []
    for i in range(0, len(requests), batch_size):
        chunk = requests[i:i + batch_size]
        out.append(encode_pairs(tokenizer, [r.prompt for r in chunk], [r.target for r in chunk]))
    return out
