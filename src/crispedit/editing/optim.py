"""Optimizers of the projected loop.

``projection_target="gradient"`` / ``"update"`` use :class:`torch.optim.Adam` on the weights (the loop
projects the gradient before, or the update after, the step). ``"eigenbasis"`` uses
:class:`EigenbasisAdam`: Adam whose moments live in each layer's K-FAC eigenbasis, on the rotated and
masked gradient ``C = (U_out^T G U_in) * M``; the step is mapped back with ``U_out (.) U_in^T``. The
weight change therefore stays *exactly* inside the kept subspace (Adam's per-coordinate scaling of a
projected gradient moves part of the change outside it), while each kept eigen-direction still gets
its own adaptive step size. With an identity projector (``ft``) it is plain Adam.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from ..errors import CrispEditError
from ..models import as_weight_matrix
from ..projection import IdentityProjector, LayerProjector
from .config import EditConfig, ProjectionTarget

__all__ = ["EigenbasisAdam", "make_optimizer", "optimizer_state", "load_optimizer_state", "reproject_first_moment"]


class EigenbasisAdam(torch.optim.Optimizer):
    """Adam in the Kronecker eigenbasis of each parameter's projector.

    ``params`` and ``projectors`` / ``modules`` are parallel sequences (one weight matrix each). State
    per parameter: ``step`` (scalar tensor), ``exp_avg`` and ``exp_avg_sq`` of shape ``d_out x d_in`` in
    float32, in eigenbasis coordinates. Hyper-parameters as :class:`torch.optim.Adam` (no weight decay).
    """

    def __init__(self, params: Iterable[nn.Parameter], projectors: Iterable[LayerProjector],
                 modules: Iterable[nn.Module], lr: float = 5e-4, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8):
        params = list(params)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self._proj = {id(p): pr for p, pr in zip(params, projectors)}
        self._mod = {id(p): m for p, m in zip(params, modules)}

    def set_projectors(self, projectors: Iterable[LayerProjector]) -> None:
        """Use new projectors (same parameter order) from the next step on. The stored moments are
        in the *old* eigenbasis; callers that change the basis should reset or rotate them."""
        for group in self.param_groups:
            for p, pr in zip(group["params"], projectors):
                self._proj[id(p)] = pr

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - torch API
        """One Adam step in each parameter's eigenbasis (see the class docstring)."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                proj, mod = self._proj[id(p)], self._mod[id(p)]
                C = proj.rotate(as_weight_matrix(mod, p.grad))
                st = self.state[p]
                if not st:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(C)
                    st["exp_avg_sq"] = torch.zeros_like(C)
                st["step"] += 1
                t = float(st["step"])
                st["exp_avg"].mul_(b1).add_(C, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(C, C, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                delta = st["exp_avg"] / denom * (-group["lr"] / (1 - b1 ** t))
                # masked coordinates have zero moments, hence a zero step: the change stays in the kept subspace
                p.add_(as_weight_matrix(mod, proj.unrotate(delta)).to(p.dtype))
        return loss


def make_optimizer(params: dict[str, nn.Parameter], projectors: dict[str, LayerProjector],
                   layers: dict[str, nn.Module], config: EditConfig) -> torch.optim.Optimizer:
    """The optimizer the projected loop steps for ``config.projection_target``."""
    if ProjectionTarget(config.projection_target) is ProjectionTarget.EIGENBASIS:
        names = list(params)
        return EigenbasisAdam([params[n] for n in names], [projectors[n] for n in names], [layers[n] for n in names],
                              lr=config.lr, betas=config.betas)
    return torch.optim.Adam(params.values(), lr=config.lr, betas=config.betas, weight_decay=0.0)


def optimizer_state(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """Adam's per-parameter state flattened to ``{"<name>::<key>": tensor}`` (safetensors-ready, on CPU)."""
    out = {}
    for name, p in params.items():
        for key, value in opt.state.get(p, {}).items():
            t = value if torch.is_tensor(value) else torch.tensor(float(value))
            out[f"{name}::{key}"] = t.detach().cpu().clone().reshape(t.shape)
    return out


def load_optimizer_state(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter], flat: dict[str, Tensor]) -> None:
    """Put a flattened optimizer state (:func:`optimizer_state`) back into ``opt`` on the parameters' devices."""
    for key, t in flat.items():
        name, _, k = key.rpartition("::")
        if name not in params:
            raise CrispEditError(f"stored optimizer state names unknown layer {name!r}")
        p = params[name]
        opt.state[p][k] = t.clone() if k == "step" else t.to(device=p.device, dtype=p.dtype).clone()


def reproject_first_moment(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                           projectors: dict[str, LayerProjector], layers: dict[str, nn.Module]) -> None:
    """Project Adam's first moment of every constrained parameter onto the new kept subspace, in place
    (``d_out x d_in`` moments, transposed storage handled)."""
    with torch.no_grad():
        for name, p in params.items():
            st = opt.state.get(p)
            if st and "exp_avg" in st and not isinstance(projectors[name], IdentityProjector):
                proj, mod = projectors[name], layers[name]
                st["exp_avg"].copy_(as_weight_matrix(mod, proj.project(as_weight_matrix(mod, st["exp_avg"]))))
