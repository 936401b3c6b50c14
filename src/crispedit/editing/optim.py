"""Optimizers of the projected loop.

``projection_target="gradient"`` / ``"update"`` use :class:`torch.optim.Adam` on the weights (the loop
projects the gradient before, or the update after, the step). ``"eigenbasis"`` uses
:class:`EigenbasisAdam`: Adam whose moments live in each layer's K-FAC eigenbasis, on the rotated and
masked gradient ``C = (U_out^T G U_in) * M``; the step is mapped back with ``U_out (.) U_in^T``. The
weight change therefore stays *exactly* inside the kept subspace (Adam's per-coordinate scaling of a
projected gradient moves part of the change outside it), while each kept eigen-direction still gets
its own adaptive step size. With an identity projector (``ft``) it is plain Adam.

Both take ``step(active=...)``: a 0-d boolean tensor on the parameters' device saying whether this step
happens at all (the loop's skip rule, decided on the device from the batch's loss). An inactive step leaves
the weights, the moments and the step count untouched, exactly as if ``step`` had not been called, and no
value is read back to the host: the Adam step count lives on the device and the bias corrections are
tensor operations (:func:`adam_direction`). The arithmetic is :class:`torch.optim.Adam`'s (no weight
decay, no AMSGrad) up to the rounding of the bias corrections.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from ..curvature.projection import IdentityProjector, LayerProjector
from ..errors import CrispEditError
from ..layers import as_weight_matrix
from .config import EditConfig, ProjectionTarget

__all__ = [
    "EigenbasisAdam",
    "GatedAdam",
    "adam_direction",
    "make_optimizer",
    "optimizer_state",
    "load_optimizer_state",
    "reproject_first_moment",
]


def adam_direction(
    state: dict, g: Tensor, active: Tensor | None, lr: float, betas: tuple[float, float], eps: float
) -> Tensor:
    """One Adam update for gradient ``g`` (any shape; the moments ``exp_avg`` / ``exp_avg_sq`` in ``state`` take
    its shape and dtype, ``step`` is a 0-d float32 tensor on its device), applied to ``state`` in place, and the
    change to add to the weights (``g``'s shape). ``active`` (0-d bool on ``g``'s device, or ``None`` = active):
    when false, neither the moments nor the step count change and the returned change is zero. No value is read
    back to the host."""
    b1, b2 = betas
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=g.device)
        state["exp_avg"] = torch.zeros_like(g)
        state["exp_avg_sq"] = torch.zeros_like(g)
    if state["step"].device != g.device:  # a state carried from another device (a stored session)
        state["step"] = state["step"].to(g.device)
    m, v, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
    if active is None:
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        step.add_(1)
    else:
        m.copy_(torch.where(active, torch.lerp(m, g, 1 - b1), m))
        v.copy_(torch.where(active, torch.addcmul(v * b2, g, g, value=1 - b2), v))
        step.add_(active.to(step.dtype))
    t = step.double().clamp_min(1.0)  # an inactive first step: bias corrections of step 1, times a zero change
    step_size = (lr / (1 - b1**t)).to(m.dtype)
    bc2_sqrt = torch.sqrt(1 - b2**t).to(m.dtype)
    delta = m / (v.sqrt() / bc2_sqrt).add_(eps) * -step_size
    return (
        delta if active is None else torch.where(active, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
    )


class GatedAdam(torch.optim.Optimizer):
    """Adam on the weights themselves (:class:`torch.optim.Adam`'s update, no weight decay) whose :meth:`step`
    takes the loop's on-device skip decision (``active``) and reads nothing back to the host. State per
    parameter as torch's Adam: ``step`` (0-d float32, on the parameter's device), ``exp_avg`` and ``exp_avg_sq``
    (the parameter's shape and dtype)."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 5e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        super().__init__(list(params), dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None, active: Tensor | None = None):  # noqa: D102 - torch API
        """One Adam step of every parameter with a gradient; none (weights, moments and count untouched) where
        ``active`` (0-d bool tensor) is false."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                p.add_(adam_direction(self.state[p], p.grad, active, group["lr"], group["betas"], group["eps"]))
        return loss


class EigenbasisAdam(torch.optim.Optimizer):
    """Adam in the Kronecker eigenbasis of each parameter's projector.

    ``params`` and ``projectors`` / ``modules`` are parallel sequences (one weight matrix each). State
    per parameter: ``step`` (scalar tensor), ``exp_avg`` and ``exp_avg_sq`` of shape ``d_out x d_in`` in
    float32, in eigenbasis coordinates. Hyper-parameters as :class:`torch.optim.Adam` (no weight decay).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        projectors: Iterable[LayerProjector],
        modules: Iterable[nn.Module],
        lr: float = 5e-4,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        params = list(params)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self._proj = {id(p): pr for p, pr in zip(params, projectors)}
        self._mod = {id(p): m for p, m in zip(params, modules)}

    @torch.no_grad()
    def step(self, closure=None, active: Tensor | None = None):  # noqa: D102 - torch API
        """One Adam step in each parameter's eigenbasis (see the class docstring); none where ``active`` (0-d
        bool tensor) is false."""
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                proj, mod = self._proj[id(p)], self._mod[id(p)]
                C = proj.rotate(as_weight_matrix(mod, p.grad))
                delta = adam_direction(self.state[p], C, active, group["lr"], group["betas"], group["eps"])
                # masked coordinates have zero moments, hence a zero step: the change stays in the kept subspace
                p.add_(as_weight_matrix(mod, proj.unrotate(delta)).to(p.dtype))
        return loss


def make_optimizer(
    params: dict[str, nn.Parameter],
    projectors: dict[str, LayerProjector],
    layers: dict[str, nn.Module],
    config: EditConfig,
) -> torch.optim.Optimizer:
    """The optimizer the projected loop steps for ``config.projection_target``."""
    if ProjectionTarget(config.projection_target) is ProjectionTarget.EIGENBASIS:
        names = list(params)
        return EigenbasisAdam(
            [params[n] for n in names],
            [projectors[n] for n in names],
            [layers[n] for n in names],
            lr=config.learning_rate,
            betas=config.betas,
        )
    return GatedAdam(params.values(), lr=config.learning_rate, betas=config.betas)


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


def reproject_first_moment(
    opt: torch.optim.Optimizer,
    params: dict[str, nn.Parameter],
    projectors: dict[str, LayerProjector],
    layers: dict[str, nn.Module],
) -> None:
    """Project Adam's first moment of every constrained parameter onto the new kept subspace, in place
    (``d_out x d_in`` moments, transposed storage handled)."""
    with torch.no_grad():
        for name, p in params.items():
            st = opt.state.get(p)
            if st and "exp_avg" in st and not isinstance(projectors[name], IdentityProjector):
                proj, mod = projectors[name], layers[name]
                st["exp_avg"].copy_(as_weight_matrix(mod, proj.project(as_weight_matrix(mod, st["exp_avg"]))))
