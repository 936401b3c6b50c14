"""The curvature models built from layer statistics: K-FAC factors and the layer-input covariance.

:class:`KFACFactors` holds, per linear layer, the K-FAC factors ``A = E[a aᵀ]`` (layer inputs, ``d_in x d_in``)
and ``S = E[g gᵀ]`` (pre-activation gradients, ``d_out x d_out``) that :mod:`.kfac` collects; as a
:class:`~.base.Curvature` it is the block ``A ⊗ S`` of each layer, with eigenbasis ``U_out ⊗ U_in`` and eigenvalues
``λ_out,i λ_in,j`` from the factors' eigendecompositions (computed once per factor set and cached beside cached
factors: :mod:`.eigen`). :class:`InputCovariance` is the curvature ``A ⊗ I`` of the same ``A`` alone — the
output side left free — which Adam-NSCL projects with and MEMIT and AlphaEdit solve with (their ``input``
statistics hold ``A`` only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .base import Curvature, Eigenbasis
from .eigen import factor_eigh
from .masks import per_source_keep_mask
from .predicted import layer_predicted_kl
from .projection import AlternatingProjector, KroneckerProjector, LayerProjector

__all__ = ["KFACFactors", "InputCovariance", "nullspace_projector"]


@dataclass
class KFACFactors(Curvature):
    """Per-layer K-FAC factors, normalised by the number of rows (tokens) they average over: the curvature
    ``A ⊗ S`` of each layer (:class:`~.base.Curvature`).

    ``parts``: for a merged constraint whose projector masks each part's energy separately (CrispEdit-Seq's
    ``weighting="each"``), the factor sets it was merged from; empty otherwise (never stored). ``part_gammas``:
    the energy threshold of each part (``None``: the edit config's γ); empty: γ for every part. ``part_sweeps``:
    0 masks every part in the merged factors' eigenbasis (one Kronecker projector); ``k > 0`` masks each part in
    its own eigenbasis and composes the parts' projectors by ``k`` sweeps of symmetric alternation
    (:class:`~.projection.AlternatingProjector`; CrispEdit-Seq's ``weighting="apart"``).

    ``source``: the cache file these factors were read from or written to (``path``, ``key``, ``write`` — the
    file's uid; empty for factors built or merged in memory) — what identifies their cached eigenbases
    (:mod:`crispedit.curvature.eigen`); ``_eigh`` holds the eigendecompositions computed for this object."""

    A: dict[str, Tensor]
    S: dict[str, Tensor]
    n_tokens: int
    meta: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict, compare=False, repr=False)
    _eigh: dict = field(default_factory=dict, compare=False, repr=False)
    parts: tuple = field(default=(), compare=False, repr=False)
    part_gammas: tuple = field(default=(), compare=False, repr=False)
    part_sweeps: int = field(default=0, compare=False, repr=False)

    @property
    def layers(self) -> list[str]:
        """The layer names, in the order of ``A``."""
        return list(self.A)

    # -- the curvature interface ----------------------------------------------------------------
    def covers(self, name: str) -> bool:
        """Whether layer ``name`` has both factors (an ``input`` statistics set holds ``A`` alone: no K-FAC)."""
        return name in self.A and name in self.S

    def eigenbasis(self, name: str, *, device: torch.device | str | None = None) -> Eigenbasis:
        """``U_out ⊗ U_in`` from the eigendecompositions of ``S`` and ``A`` (:func:`~.eigen.factor_eigh`: float64
        decompositions, float32 eigenvectors), eigenvalues ``outer(λ_out, λ_in)`` (float64, ``d_out x d_in``)."""
        eig = factor_eigh(self, [name], ("A", "S"), device=device)
        (lam_out, U_out), (lam_in, U_in) = eig[name, "S"], eig[name, "A"]
        return Eigenbasis(U_out, U_in, torch.outer(lam_out, lam_in))

    def projector(
        self, name: str, gamma: float, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> LayerProjector:
        """The Kronecker projector of layer ``name`` at ``gamma`` in ``dtype`` (``None``: float32): the entries of
        ``λ_out λ_inᵀ`` below the γ-energy cut are kept (:meth:`~.projection.KroneckerProjector.from_spectra`). For a
        merged constraint with :attr:`parts`, the merged factors' eigenbasis with a mask covering γ (or the part's
        own :attr:`part_gammas` entry) of each part's energy (:func:`~.masks.per_source_keep_mask`); with
        :attr:`part_sweeps`, each part's own projector at its γ, composed
        (:class:`~.projection.AlternatingProjector`)."""
        gammas = [gamma if g is None else g for g in self.part_gammas or [None] * len(self.parts)]
        if self.parts and self.part_sweeps:
            own = [p.projector(name, g, device=device, dtype=dtype) for p, g in zip(self.parts, gammas)]
            return AlternatingProjector(own, self.part_sweeps)
        eig = factor_eigh(self, [name], ("A", "S"), device=device)
        (lam_out, U_out), (lam_in, U_in) = eig[name, "S"], eig[name, "A"]
        if self.parts:
            keep = per_source_keep_mask(U_out, U_in, [(p.A[name], p.S[name]) for p in self.parts], gammas)
            return KroneckerProjector(U_out, U_in, keep, dtype=dtype or torch.float32)
        return KroneckerProjector.from_spectra(lam_out, U_out, lam_in, U_in, gamma, dtype=dtype or torch.float32)

    def projectors(
        self, names: Iterable[str], gamma: float, *, device: torch.device | str | None = None
    ) -> dict[str, LayerProjector]:
        """:meth:`projector` of every layer in ``names``, their eigenbases fetched or computed in one go (one read
        and one write of the eigenbasis cache file)."""
        names = list(names)
        for f in self.parts if self.part_sweeps else [self]:  # the factor sets whose eigenbases the masks use
            factor_eigh(f, names, ("A", "S"), device=device)
        return super().projectors(names, gamma, device=device)

    def matvec(self, name: str, dW: Tensor) -> Tensor:
        """``S ΔW A`` (``d_out x d_in``), in ``dW``'s dtype and on its device."""
        return self.S[name].to(dW) @ dW @ self.A[name].to(dW)

    def quadratic_form(self, name: str, dW: Tensor, dtype: torch.dtype = torch.float64) -> float:
        """``½ tr(ΔWᵀ S ΔW A)`` in ``dtype`` (:func:`~.predicted.layer_predicted_kl`)."""
        return layer_predicted_kl(dW, self.A[name], self.S[name], dtype)

    def on(self, devices: Mapping[str, torch.device | str], dtype: torch.dtype = torch.float32) -> KFACFactors:
        """The factors of the layers in ``devices``, each on its device in ``dtype`` (same token count and meta)."""
        return KFACFactors(
            {n: self.A[n].to(device=d, dtype=dtype) for n, d in devices.items()},
            {n: self.S[n].to(device=d, dtype=dtype) for n, d in devices.items()},
            self.n_tokens,
            dict(self.meta),
        )

    def merged(self, other: KFACFactors, weight: float | None = None) -> KFACFactors:
        """Streaming average of two factor sets.

        ``weight=None`` weights each by its token count (the authors' code); a float ``w`` in [0, 1]
        gives ``(1 - w) * self + w * other`` (a fixed mixing coefficient).
        """
        if set(self.A) != set(other.A):
            raise ValueError("cannot merge factors of different layers")
        if weight is None:
            n = self.n_tokens + other.n_tokens
            a, b = self.n_tokens / n, other.n_tokens / n
        else:
            a, b = 1.0 - float(weight), float(weight)
        A = {k: a * self.A[k] + b * other.A[k].to(self.A[k]) for k in self.A}
        S = {k: a * self.S[k] + b * other.S[k].to(self.S[k]) for k in self.S}
        return KFACFactors(A, S, self.n_tokens + other.n_tokens, dict(self.meta))

    def rescaled_to(self, ref: KFACFactors) -> KFACFactors:
        """These factors with every ``A`` and ``S`` scaled to the trace of ``ref``'s factor of the same layer
        (same shapes, fp32 or better as stored; a zero-trace factor is left as it is): what makes a fixed mixing
        coefficient a share of each factor's energy when two sets live on different scales."""

        def scale(mine: Tensor, theirs: Tensor) -> Tensor:
            """``mine`` times ``tr(theirs) / tr(mine)`` (``mine`` itself when its trace is not positive)."""
            t = float(torch.diagonal(mine).double().sum())
            return mine if t <= 0 else mine * (float(torch.diagonal(theirs).double().sum()) / t)

        return KFACFactors(
            {k: scale(v, ref.A[k]) for k, v in self.A.items()},
            {k: scale(v, ref.S[k]) for k, v in self.S.items()},
            self.n_tokens,
            dict(self.meta),
        )

    def to_tensors(self) -> dict[str, Tensor]:
        """``{"<layer>::A": A, "<layer>::S": S}`` (S only where present: input-covariance sets hold A alone)."""
        out = {}
        for k in self.A:
            out[f"{k}::A"] = self.A[k]
            if k in self.S:
                out[f"{k}::S"] = self.S[k]
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], n_tokens: int, meta: dict | None = None) -> KFACFactors:
        """The inverse of :meth:`to_tensors`: ``"<layer>::A"`` keys go to ``A``, every other key (``"::S"``)
        to ``S``, with ``n_tokens`` and ``meta`` as given."""
        A, S = {}, {}
        for key, t in tensors.items():
            name, _, kind = key.rpartition("::")
            (A if kind == "A" else S)[name] = t
        return cls(A, S, n_tokens, meta or {})


def nullspace_projector(C: Tensor, threshold: float) -> Tensor:
    """``U₀U₀ᵀ`` (float64, ``d x d``) over the eigenvectors of the symmetric ``C`` with eigenvalue < ``threshold``
    (AlphaEdit's null space: an absolute threshold on the eigenvalues, not an energy fraction)."""
    evals, evecs = torch.linalg.eigh(C.double())
    U0 = evecs[:, evals < threshold]
    return U0 @ U0.T


class InputCovariance(Curvature):
    """The curvature ``A ⊗ I`` of each layer from its input covariance ``A = E[a aᵀ]`` alone (the ``A`` of
    ``factors``: K-FAC factors or an ``input`` statistics set): the output side is left free, so the eigenbasis
    is ``I ⊗ U_in`` with eigenvalues ``λ_in`` for every output row. Adam-NSCL projects onto its low-energy
    directions; MEMIT and AlphaEdit solve with the matrix itself (:meth:`matrix`) and AlphaEdit projects onto
    its null space (:meth:`nullspace`). Eigendecompositions are shared with ``factors``
    (:func:`~.eigen.factor_eigh`)."""

    def __init__(self, factors: KFACFactors):
        self.factors = factors

    @property
    def layers(self) -> list[str]:
        """The layer names, in the order of ``A``."""
        return self.factors.layers

    def covers(self, name: str) -> bool:
        """Whether layer ``name`` has an input covariance."""
        return name in self.factors.A

    def matrix(self, name: str) -> Tensor:
        """``A`` of layer ``name`` (``d_in x d_in``, as stored)."""
        return self.factors.A[name]

    def eigenbasis(self, name: str, *, device: torch.device | str | None = None) -> Eigenbasis:
        """``U_out = None`` (the identity), ``U_in`` and ``λ_in`` (``1 x d_in``, float64) from ``A``'s
        eigendecomposition (:func:`~.eigen.factor_eigh`)."""
        lam_in, U_in = factor_eigh(self.factors, [name], ("A",), device=device)[name, "A"]
        return Eigenbasis(None, U_in, lam_in.reshape(1, -1))

    def projectors(
        self, names: Iterable[str], gamma: float, *, device: torch.device | str | None = None
    ) -> dict[str, LayerProjector]:
        """:meth:`projector` of every layer in ``names`` (input-side Kronecker projectors, any number of output
        rows), their eigenbases fetched or computed in one go."""
        names = list(names)
        factor_eigh(self.factors, names, ("A",), device=device)
        return super().projectors(names, gamma, device=device)

    def matvec(self, name: str, dW: Tensor) -> Tensor:
        """``ΔW A`` (``d_out x d_in``), in ``dW``'s dtype and on its device."""
        return dW @ self.factors.A[name].to(dW)

    def nullspace(self, name: str, threshold: float) -> Tensor:
        """AlphaEdit's projector ``U₀U₀ᵀ`` (float64, ``d_in x d_in``) onto the eigenvectors of layer ``name``'s ``A``
        with eigenvalue below ``threshold`` (:func:`nullspace_projector`)."""
        return nullspace_projector(self.factors.A[name], threshold)

    def merged(self, other: InputCovariance, weight: float | None = None) -> InputCovariance:
        """The input covariance of the merged statistics (:meth:`KFACFactors.merged`)."""
        return InputCovariance(self.factors.merged(other.factors, weight))
