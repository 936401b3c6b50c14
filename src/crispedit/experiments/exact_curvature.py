"""Exact (dense) curvature of small classifiers: Gauss-Newton, Hessian, Bregman divergence (study code: the MNIST
curvature study, :mod:`.mnist_study`).

Everything here acts on the *whole* trainable parameter vector of a small network, flattened by a
:class:`ParamLayout` with the library's column-major convention: each parameter is viewed as the
matrix ``W = p.reshape(p.shape[0], -1)`` (``d_out x d_in``; for a Conv2d that is the patch matrix of
:func:`crispedit.curvature.statistics.layer_rows`) and vectorised by :func:`crispedit.curvature.masks.vec`. The
diagonal block of a layer therefore lives in the same coordinates as its K-FAC factor ``A (x) S`` and
as :meth:`crispedit.curvature.projection.KroneckerProjector.dense`.

The loss is the mean softmax cross-entropy over the given examples. Its Gauss-Newton matrix is

    G = 1/N sum_i J_i^T H_i J_i,    H_i = diag(p_i) - p_i p_i^T,

with ``J_i`` the logits-parameter Jacobian. Writing ``H_i = L_i^T L_i`` with rows
``L_i[c] = sqrt(p_ic) (e_c - p_i)^T`` (:func:`ce_hessian_sqrt`), ``G = 1/N sum_i (L_i J_i)^T (L_i J_i)``:
the rows of ``L_i J_i`` are, up to sign, the gradients of the loss for label ``c`` weighted by
``sqrt(p_ic)`` -- the exact expectation over labels drawn from the model, i.e. the true Fisher.

Memory: dense matrices are ``P x P`` float64 (8 P^2 bytes: 142 MB for P = 4212).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap
from tqdm.auto import tqdm

from ..curvature.masks import unvec, vec

__all__ = [
    "ParamLayout",
    "ce_hessian_sqrt",
    "ggn_matrix",
    "hessian_matrix",
    "bregman_divergence",
]


@dataclass
class ParamLayout:
    """Order, shapes and offsets of the parameters in a flat (column-major ``vec``) vector."""

    names: list[str]
    shapes: list[torch.Size]

    @classmethod
    def of(cls, model: nn.Module, names: Sequence[str] | None = None) -> ParamLayout:
        """Layout of ``names`` (default: every parameter that requires grad, in module order)."""
        params = dict(model.named_parameters())
        if names is None:
            names = [n for n, p in params.items() if p.requires_grad]
        unknown = [n for n in names if n not in params]
        if unknown:
            raise KeyError(f"unknown parameters {unknown}")
        return cls(list(names), [params[n].shape for n in names])

    @property
    def sizes(self) -> list[int]:
        """Number of entries of each parameter, in order."""
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        """Total number of parameters."""
        return sum(self.sizes)

    def slices(self) -> dict[str, slice]:
        """Each parameter's slice of the flat parameter vector."""
        out, o = {}, 0
        for n, k in zip(self.names, self.sizes):
            out[n] = slice(o, o + k)
            o += k
        return out

    @staticmethod
    def _as_matrix(t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], -1) if t.dim() >= 1 else t.reshape(1, 1)

    def flatten(self, tensors: dict[str, Tensor]) -> Tensor:
        """Concatenate ``vec(t.reshape(d_out, -1))`` of each named tensor."""
        return torch.cat(
            [vec(self._as_matrix(tensors[n])) if tensors[n].dim() >= 2 else tensors[n].reshape(-1) for n in self.names]
        )

    def unflatten(self, flat: Tensor) -> dict[str, Tensor]:
        """Inverse of :meth:`flatten` (differentiable; views where possible)."""
        out = {}
        for (n, shape), sl in zip(zip(self.names, self.shapes), self.slices().values()):
            piece = flat[sl]
            if len(shape) >= 2:
                d_out = shape[0]
                out[n] = unvec(piece, d_out, piece.numel() // d_out).reshape(shape)
            else:
                out[n] = piece.reshape(shape)
        return out

    def params(self, model: nn.Module) -> Tensor:
        """The current values of the model's parameters as one flat detached vector."""
        named = dict(model.named_parameters())
        return self.flatten({n: named[n].detach() for n in self.names})

    def grads(self, model: nn.Module) -> Tensor:
        """The parameters' ``.grad`` concatenated into one flat vector (zeros where None)."""
        named = dict(model.named_parameters())
        return self.flatten(
            {n: (named[n].grad if named[n].grad is not None else torch.zeros_like(named[n])) for n in self.names}
        )


def _functional(model: nn.Module, layout: ParamLayout):
    """``f(flat, x) -> logits`` with the layout's parameters replaced by ``flat``."""
    frozen = {n: p.detach() for n, p in model.named_parameters() if n not in set(layout.names)}
    buffers = dict(model.named_buffers())

    def f(flat: Tensor, x: Tensor) -> Tensor:
        """Logits of ``model`` on ``x`` with the layout's parameters taken from the flat vector ``flat``."""
        return functional_call(model, {**frozen, **buffers, **layout.unflatten(flat)}, (x,))

    return f


def _batches(n: int, batch_size: int) -> Iterable[slice]:
    for start in range(0, n, batch_size):
        yield slice(start, min(n, start + batch_size))


def ce_hessian_sqrt(logits: Tensor) -> Tensor:
    """``L`` (``B x C x C``) with ``L^T L = diag(p) - p p^T``, the Hessian of softmax cross-entropy in
    the logits: row ``c`` is ``sqrt(p_c) (e_c - p)``. The label does not enter."""
    p = torch.softmax(logits, dim=-1)
    eye = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device)
    return p.sqrt().unsqueeze(-1) * (eye - p.unsqueeze(-2))


def ggn_matrix(
    model: nn.Module,
    inputs: Tensor,
    *,
    layout: ParamLayout | None = None,
    batch_size: int = 128,
    dtype: torch.dtype = torch.float64,
    progress: bool | None = None,
) -> Tensor:
    """Dense Gauss-Newton matrix ``1/N sum_i J_i^T H_i J_i`` of the mean cross-entropy (``P x P``).

    Per-example Jacobians come from ``vmap(jacrev)``; the model runs in its own dtype, products are
    accumulated in ``dtype``.
    """
    layout = layout or ParamLayout.of(model)
    f = _functional(model, layout)
    theta = layout.params(model)
    n, P = inputs.shape[0], layout.numel
    G = torch.zeros(P, P, dtype=dtype)

    def single(flat: Tensor, x: Tensor) -> Tensor:
        """Logits (``C``) of one example ``x`` (no batch dimension) at parameters ``flat``."""
        return f(flat, x.unsqueeze(0)).squeeze(0)

    jac = vmap(jacrev(single), in_dims=(None, 0))
    for sl in tqdm(
        list(_batches(n, batch_size)), desc="GGN", unit="batch", disable=None if progress is None else not progress
    ):
        x = inputs[sl]
        with torch.no_grad():
            L = ce_hessian_sqrt(f(theta, x).to(dtype))
        J = jac(theta, x).to(dtype)  # B x C x P
        B = torch.einsum("bkc,bcp->bkp", L, J).reshape(-1, P)
        G += B.T @ B
    return G / n


def hessian_matrix(
    model: nn.Module,
    inputs: Tensor,
    targets: Tensor,
    *,
    layout: ParamLayout | None = None,
    batch_size: int = 256,
    tangent_chunk: int = 32,
    dtype: torch.dtype = torch.float64,
    linear_param: str | None = None,
    progress: bool | None = None,
) -> Tensor:
    """Dense Hessian of the mean cross-entropy over ``(inputs, targets)`` (``P x P``).

    Rows come from batched double-backward Hessian-vector products (``P`` of them per data batch),
    the dominant cost. ``linear_param`` names one parameter in which the network output is
    (piecewise) linear for fixed other parameters -- any weight of a network built from linear/conv
    layers, ReLU and max-pooling. Its diagonal Hessian block then equals its Gauss-Newton block
    (the residual ``sum_c r_c d^2 f_c`` vanishes there), its off-diagonal blocks follow from the
    other rows by symmetry, and its tangents are skipped: choosing the largest parameter removes most
    of the cost. The result is the same matrix autograd's full Hessian gives (tested).
    """
    layout = layout or ParamLayout.of(model)
    named = dict(model.named_parameters())
    params = [named[n] for n in layout.names]
    slices = layout.slices()
    P = layout.numel
    if linear_param is not None and linear_param not in slices:
        raise KeyError(f"linear_param {linear_param!r} is not in the layout")
    rows = [i for n in layout.names if n != linear_param for i in range(slices[n].start, slices[n].stop)]
    rows_t = torch.tensor(rows, dtype=torch.long)
    n = inputs.shape[0]
    H_rows = torch.zeros(len(rows), P, dtype=dtype)
    batches = list(_batches(n, batch_size))
    chunks = list(_batches(len(rows), tangent_chunk))
    bar = tqdm(
        total=len(batches) * len(chunks),
        desc="Hessian",
        unit="hvp-chunk",
        disable=None if progress is None else not progress,
    )
    try:
        for sl in batches:
            logits = model(inputs[sl])
            loss = F.cross_entropy(logits, targets[sl], reduction="sum")
            grads = torch.autograd.grad(loss, params, create_graph=True)
            for ch in chunks:
                idx = rows_t[ch]
                V = torch.zeros(len(idx), P, dtype=params[0].dtype)
                V[torch.arange(len(idx)), idx] = 1.0
                Vs = _unflatten_batched(layout, V)
                hv = torch.autograd.grad(
                    grads, params, [Vs[n] for n in layout.names], retain_graph=True, is_grads_batched=True
                )
                H_rows[ch] += _flatten_batched(layout, dict(zip(layout.names, hv))).to(dtype)
                bar.update(1)
            del grads, loss, logits
    finally:
        bar.close()
    H = torch.zeros(P, P, dtype=dtype)
    H[rows_t] = H_rows / n
    if linear_param is not None:
        s = slices[linear_param]
        H[s, :] = H[:, s].T  # symmetry for the off-diagonal blocks
        G = ggn_matrix(
            model,
            inputs,
            layout=ParamLayout([linear_param], [named[linear_param].shape]),
            batch_size=batch_size,
            dtype=dtype,
            progress=False,
        )
        H[s, s] = G
    return 0.5 * (H + H.T)


def _unflatten_batched(layout: ParamLayout, V: Tensor) -> dict[str, Tensor]:
    return vmap(layout.unflatten)(V)


def _flatten_batched(layout: ParamLayout, tensors: dict[str, Tensor]) -> Tensor:
    return vmap(layout.flatten)(tensors)


def bregman_divergence(
    model: nn.Module,
    theta: Tensor,
    theta0: Tensor,
    inputs: Tensor,
    targets: Tensor,
    *,
    layout: ParamLayout | None = None,
) -> Tensor:
    """Mean Bregman divergence of the cross-entropy between the outputs at ``theta`` and ``theta0``
    (flat vectors in ``layout`` order): ``l(f) - l(f0) - <grad l(f0), f - f0>`` averaged over examples
    (the paper's Definition 1). Differentiable in ``theta``."""
    layout = layout or ParamLayout.of(model)
    f = _functional(model, layout)
    out = f(theta, inputs)
    with torch.no_grad():
        out0 = f(theta0, inputs)
        r0 = torch.softmax(out0, -1) - F.one_hot(targets, out0.shape[-1]).to(out0.dtype)
    loss = F.cross_entropy(out, targets, reduction="none")
    loss0 = F.cross_entropy(out0, targets, reduction="none")
    return (loss - loss0 - ((out - out0) * r0).sum(-1)).mean()
