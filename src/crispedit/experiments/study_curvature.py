"""The MNIST study's curvature models and the projectors it fine-tunes with (study code, :mod:`.mnist_study`).

Every curvature model of the study is a :class:`~crispedit.curvature.base.Curvature`: K-FAC
(:class:`~crispedit.curvature.factors.KFACFactors`), the activation covariance of Adam-NSCL
(:class:`~crispedit.curvature.factors.InputCovariance`), EK-FAC (:class:`~.ekfac.EKFACFactors`) and the exact
matrices — Gauss-Newton, Hessian, ``|Hessian|`` — as :class:`DenseCurvature`, one block over the flat vector of
all weights. :class:`StudyCurvature` turns one into a whole-network :class:`ParamProjector` at any γ: one dense
projector over every weight for a dense model, one Kronecker projector per layer weight otherwise.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..curvature.base import Curvature, Eigenbasis
from ..curvature.factors import InputCovariance
from ..curvature.masks import eigh_sym, energy_keep_mask
from ..curvature.projection import DenseProjector, KroneckerProjector, LayerProjector
from ..errors import CrispEditError
from .ekfac import collect_classifier_ekfac, collect_classifier_kfac
from .exact_curvature import ParamLayout, ggn_matrix, hessian_matrix
from .idx_data import ImageSplit
from .mnist_config import MnistStudyConfig

__all__ = [
    "PARAMS",
    "ParamProjector",
    "NoProjection",
    "DenseParamProjector",
    "LayerwiseParamProjector",
    "DenseCurvature",
    "StudyCurvature",
    "compute_curvature",
    "hessian_at",
]

PARAMS = "params"  # the one block of a DenseCurvature: the flat (column-major vec) vector of all weights


class ParamProjector:
    """Projects the ``.grad`` of the network's weights in place."""

    kept_dims: int

    def project_(self, model: nn.Module) -> None:  # pragma: no cover - interface
        """Project every parameter gradient of ``model`` in place."""
        raise NotImplementedError


class NoProjection(ParamProjector):
    """Leave gradients as they are (plain fine-tuning)."""

    def __init__(self, n_params: int):
        self.kept_dims = n_params

    def project_(self, model: nn.Module) -> None:
        """Nothing: every gradient is kept."""
        return None


class DenseParamProjector(ParamProjector):
    """A :class:`~crispedit.curvature.projection.DenseProjector` acting on the flat vector of all weights."""

    def __init__(self, layout: ParamLayout, projector: DenseProjector):
        self.layout, self.projector = layout, projector
        self.kept_dims = projector._kept

    def project_(self, model: nn.Module) -> None:
        """Project the flat (column-major ``vec``) gradient of the layout's parameters, length
        ``layout.numel()``, with the dense projector and copy each parameter's part back into its ``.grad``."""
        flat = self.layout.grads(model)
        out = self.layout.unflatten(self.projector.project(flat))
        for name, p in model.named_parameters():
            if name in out:
                p.grad.copy_(out[name])


class LayerwiseParamProjector(ParamProjector):
    """One :class:`~crispedit.curvature.projection.KroneckerProjector` per weight (block-diagonal)."""

    def __init__(self, projectors: dict[str, KroneckerProjector], shapes: dict[str, torch.Size]):
        self.projectors = projectors
        self.kept_dims = 0
        for name, proj in projectors.items():
            d_out = shapes[name][0]
            self.kept_dims += int(proj.mask.sum()) * (d_out if proj.U_out is None else 1)

    def project_(self, model: nn.Module) -> None:
        """Project each weight's ``.grad`` that has a projector, seen as a ``d_out x (d_in k)`` matrix (a conv
        kernel flattened past its first dimension), in place; other gradients are left as they are."""
        for name, p in model.named_parameters():
            proj = self.projectors.get(name)
            if proj is not None and p.grad is not None:
                Q = p.grad.reshape(p.shape[0], -1)
                p.grad.copy_(proj.project(Q).reshape(p.shape))


# -----------------------------------------------------------------------------------------------
# curvature models: computed once at given weights, a projector for any gamma


class DenseCurvature(Curvature):
    """An explicit curvature matrix over the flat vector of all weights (``P x P``, in :class:`ParamLayout` order):
    one block, :data:`PARAMS`, viewed as a ``P x 1`` weight (``U_out`` its eigenvectors, ``U_in = [[1]]``). It is
    decomposed once (float64); its eigenvalues are those of the matrix with negative ones clamped to 0 (a
    negative-curvature direction counts as flat), or with ``absolute`` their magnitudes (a strongly negative
    direction is curved, not flat), decreasing. ``spectrum``: the matrix's trace and largest eigenvalue, and with
    ``count_negative`` the number, most negative value and share of mass of its negative eigenvalues."""

    def __init__(self, matrix: Tensor, *, count_negative: bool = False, absolute: bool = False):
        raw, U = eigh_sym(matrix)  # one decomposition (increasing order) for the ranking and the spectrum facts
        if absolute:  # rank by |lambda|: a strongly negative direction is curved, not flat
            order = torch.argsort(raw.abs(), descending=True, stable=True)
            self.eigvals, self.U = raw.abs()[order], U[:, order]
        else:  # negative eigenvalues (Hessian) are clamped to 0, i.e. kept as if flat
            self.eigvals, self.U = raw.clamp_min(0.0).flip(0), U.flip(1)
        self.spectrum: dict = {"trace": float(matrix.trace()), "max": float(raw[-1].clamp_min(0.0))}
        if count_negative:
            neg = raw[raw < 0]
            self.spectrum.update(
                negative=int(neg.numel()),
                most_negative=float(raw[0]),
                negative_mass=float(-neg.sum() / raw.abs().sum()),
            )

    @property
    def layers(self) -> list[str]:
        """The one block, :data:`PARAMS`."""
        return [PARAMS]

    def eigenbasis(self, name: str, *, device: torch.device | str | None = None) -> Eigenbasis:
        """The matrix's eigenvectors as ``U_out`` (``P x P``), ``U_in = [[1]]``, the ranked eigenvalues ``P x 1``."""
        return Eigenbasis(self.U, torch.ones(1, 1, dtype=self.U.dtype), self.eigvals.reshape(-1, 1))

    def projector(
        self, name: str, gamma: float, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> LayerProjector:
        """A :class:`~crispedit.curvature.projection.DenseProjector` in ``dtype`` (``None``: float64) onto the
        eigenvectors outside the top ``gamma`` share of the eigenvalue energy, from the decomposition made once (none
        is repeated per γ)."""
        return DenseProjector(self.U, energy_keep_mask(self.eigvals, gamma), dtype=dtype or torch.float64)

    def merged(self, other: DenseCurvature, weight: float | None = None) -> DenseCurvature:
        """The curvature of ``(1 - weight) U Λ Uᵀ + weight U' Λ' U'ᵀ`` (``None``: equal weights) of the two ranked
        models (already clamped or made absolute: the average is positive semi-definite)."""
        w = 0.5 if weight is None else float(weight)
        return DenseCurvature((1 - w) * self.dense(PARAMS) + w * other.dense(PARAMS))


class StudyCurvature:
    """One curvature model of the study (``method``: one of :data:`~.mnist_config.METHODS` but ``none``) with what
    maps its blocks onto the network: ``layout`` for a :class:`DenseCurvature` over all weights, else ``shapes``
    (``<layer>.weight`` -> shape) for per-layer blocks. :meth:`projector` builds the whole-network projector."""

    def __init__(
        self,
        method: str,
        curvature: Curvature,
        *,
        layout: ParamLayout | None = None,
        shapes: dict[str, torch.Size] | None = None,
    ):
        self.method, self.curvature, self.layout, self.shapes = method, curvature, layout, shapes

    @property
    def spectrum(self) -> dict | None:
        """The spectrum facts of a dense curvature (:class:`DenseCurvature`), ``None`` for per-layer ones."""
        return getattr(self.curvature, "spectrum", None)

    def projector(self, gamma: float) -> ParamProjector:
        """The projector keeping the ``1 - gamma`` low-energy part of this curvature: a :class:`DenseParamProjector`
        over all weights, or a :class:`LayerwiseParamProjector` with each layer's projector
        (:meth:`~crispedit.curvature.base.Curvature.projector`)."""
        if self.layout is not None:
            return DenseParamProjector(self.layout, self.curvature.projector(PARAMS, gamma))
        projs = {f"{layer}.weight": self.curvature.projector(layer, gamma) for layer in self.curvature.layers}
        return LayerwiseParamProjector(projs, self.shapes)


def compute_curvature(
    method: str,
    model: nn.Module,
    data: ImageSplit,
    cfg: MnistStudyConfig,
    progress: bool | None = None,
    count_negative: bool = False,
    hessian: Tensor | None = None,
) -> StudyCurvature:
    """Curvature model ``method`` of the mean MNIST loss on ``data`` at the model's current weights (``model``: the
    study's network, its layers in ``model.layer_names``). ``hessian``: that Hessian, if already computed
    (``hessian`` and ``hessian_abs`` share it)."""
    batches = [
        (data.images[i : i + cfg.curvature_batch], data.labels[i : i + cfg.curvature_batch])
        for i in range(0, len(data), cfg.curvature_batch)
    ]
    layout = ParamLayout.of(model)
    if method == "ggn":
        G = ggn_matrix(model, data.images, layout=layout, batch_size=cfg.curvature_batch, progress=progress)
        return StudyCurvature(method, DenseCurvature(G), layout=layout)
    if method in ("hessian", "hessian_abs"):
        H = hessian if hessian is not None else hessian_at(model, data, cfg, progress)
        return StudyCurvature(
            method, DenseCurvature(H, count_negative=count_negative, absolute=method == "hessian_abs"), layout=layout
        )
    factors = collect_classifier_kfac(model, batches, model.layer_names, mode=cfg.kfac_output_grads, seed=cfg.seed)
    shapes = {f"{n}.weight": getattr(model, n).weight.shape for n in factors.layers}
    if method == "ekfac":
        ek = collect_classifier_ekfac(
            model, batches, mode=cfg.kfac_output_grads, per=cfg.ekfac_per, seed=cfg.seed, factors=factors
        )
        return StudyCurvature(method, ek, shapes=shapes)
    if method == "kfac":
        return StudyCurvature(method, factors, shapes=shapes)
    if method == "activation_cov":
        return StudyCurvature(method, InputCovariance(factors), shapes=shapes)
    raise CrispEditError(f"unknown method {method!r}")


def hessian_at(model: nn.Module, data: ImageSplit, cfg: MnistStudyConfig, progress: bool | None = None) -> Tensor:
    """The dense Hessian of the mean MNIST loss on ``data`` at the model's current weights."""
    layout = ParamLayout.of(model)
    largest = max(layout.names, key=lambda n: math.prod(dict(model.named_parameters())[n].shape))
    return hessian_matrix(
        model,
        data.images,
        data.labels,
        layout=layout,
        batch_size=cfg.curvature_batch,
        linear_param=largest,
        progress=progress,
    )
