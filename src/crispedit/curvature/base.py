"""One interface for every curvature model of the capability loss.

A curvature model ``G`` is block-diagonal over a set of weight matrices (the edit layers, keyed by module name);
the block of a ``d_out x d_in`` weight acts on its column-major ``vec`` (:func:`~.masks.vec`). Everything
built on curvature asks it the same four questions, and :class:`Curvature` answers them:

* :meth:`~Curvature.eigenbasis` — the block's eigenbasis as a Kronecker pair ``U_out ⊗ U_in`` with one
  eigenvalue per basis element (:class:`Eigenbasis`);
* :meth:`~Curvature.projector` — the projector onto the directions kept under the energy threshold γ (the
  editors' gradient projection);
* :meth:`~Curvature.quadratic_form` — ``½ vec(ΔW)ᵀ G vec(ΔW)``, the predicted drift of a weight change in nats
  per token for a Fisher / Gauss-Newton ``G`` (:mod:`.predicted`), and :meth:`~Curvature.matvec`, ``G vec(ΔW)``
  as a weight-shaped matrix (the form's gradient);
* :meth:`~Curvature.merged` — the weighted average with another curvature of the same kind (sequential
  sessions fold the edits' curvature into the capability's).

An implementation defines :attr:`~Curvature.layers`, :meth:`~Curvature.eigenbasis` and
:meth:`~Curvature.merged`; the projector, the quadratic form, its gradient and the dense matrix
(:meth:`~Curvature.dense`, tests only) follow from the eigenbasis, and an implementation overrides them where it
has a cheaper form of the same numbers (K-FAC's ``½ tr(ΔWᵀ S ΔW A)``). The implementations:
:class:`~.factors.KFACFactors` (K-FAC ``A ⊗ S``), :class:`~.factors.InputCovariance` (the layer-input covariance
``A ⊗ I``: Adam-NSCL, MEMIT and AlphaEdit) and, for the MNIST study, EK-FAC and the exact Gauss-Newton
(:mod:`crispedit.experiments.study_curvature`). Every one is checked against its dense float64 twin by one case
list (``tests/curvature/test_interface.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .masks import energy_keep_mask
from .projection import KroneckerProjector, LayerProjector

__all__ = ["Eigenbasis", "Curvature"]


@dataclass(frozen=True)
class Eigenbasis:
    """The eigendecomposition of one block of a curvature model in Kronecker form: the block is
    ``(U_in ⊗ U_out) diag(vec(eigvals)) (U_in ⊗ U_out)ᵀ`` on column-major ``vec(ΔW)``.

    ``U_out``: ``d_out x d_out`` orthonormal columns, or ``None`` for the identity (a curvature that leaves the
    output side free: the input covariance); ``U_in``: ``d_in x d_in`` orthonormal columns; ``eigvals``: the
    curvature along ``U_out[:, i] ⊗ U_in[:, j]`` at ``[i, j]`` (``d_out x d_in``, or ``1 x d_in`` when ``U_out`` is
    ``None``: the same for every output row), float64."""

    U_out: Tensor | None
    U_in: Tensor
    eigvals: Tensor


class Curvature(ABC):
    """A block-diagonal curvature model over named weight matrices (see the module docstring).

    Subclasses implement :attr:`layers`, :meth:`eigenbasis` and :meth:`merged`; the other methods have
    defaults computed from the eigenbasis in float64 (projections in float32, as every projector applies them)."""

    @property
    @abstractmethod
    def layers(self) -> list[str]:
        """The names of the blocks (module names of the weights), in order."""

    @abstractmethod
    def eigenbasis(self, name: str, *, device: torch.device | str | None = None) -> Eigenbasis:
        """The eigendecomposition of block ``name`` (:class:`Eigenbasis`); ``device``: where to decompose it when
        it is not computed yet (default: where the statistics lie). Returned on the CPU."""

    @abstractmethod
    def merged(self, other: Curvature, weight: float | None = None) -> Curvature:
        """The average of this curvature and ``other`` (same kind, same blocks): ``(1 - weight) · self + weight ·
        other`` of the statistics that define them; ``weight=None``: weighted by the number of rows each was
        averaged over, where the kind records it."""

    def covers(self, name: str) -> bool:
        """Whether this curvature has a block ``name`` it can measure a change of weight ``name`` with."""
        return name in self.layers

    def on(self, devices: Mapping[str, torch.device | str], dtype: torch.dtype = torch.float32) -> Curvature:
        """This curvature restricted to the blocks in ``devices``, each with its statistics on its device in
        ``dtype``, for repeated :meth:`quadratic_form` / :meth:`matvec` calls there (a drift budget's every step).
        Default: ``self`` (every call casts what it uses)."""
        return self

    def projector(
        self, name: str, gamma: float, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> LayerProjector:
        """The projector of block ``name`` onto its kept directions under energy threshold ``gamma``: those outside
        the smallest top set of eigenvalues holding ``gamma`` of their sum (:func:`~.masks.energy_keep_mask`),
        applied matrix-free (:class:`~.projection.KroneckerProjector`) in ``dtype`` (``None``: float32)."""
        eb = self.eigenbasis(name, device=device)
        keep = energy_keep_mask(eb.eigvals, gamma)
        return KroneckerProjector(eb.U_out, eb.U_in, keep, dtype=dtype or torch.float32)

    def projectors(
        self, names: Iterable[str], gamma: float, *, device: torch.device | str | None = None
    ) -> dict[str, LayerProjector]:
        """:meth:`projector` of every block in ``names``, keyed by name."""
        return {name: self.projector(name, gamma, device=device) for name in names}

    def matvec(self, name: str, dW: Tensor) -> Tensor:
        """``G vec(ΔW)`` of block ``name`` as a ``d_out x d_in`` matrix (the gradient of :meth:`quadratic_form` in
        ``ΔW``), in ``dW``'s dtype and on its device."""
        eb = self.eigenbasis(name)
        Ui = eb.U_in.to(device=dW.device, dtype=dW.dtype)
        lam = eb.eigvals.to(device=dW.device, dtype=dW.dtype)
        if eb.U_out is None:
            return ((dW @ Ui) * lam) @ Ui.T
        Uo = eb.U_out.to(device=dW.device, dtype=dW.dtype)
        return Uo @ ((Uo.T @ dW @ Ui) * lam) @ Ui.T

    def quadratic_form(self, name: str, dW: Tensor, dtype: torch.dtype = torch.float64) -> float:
        """``½ vec(ΔW)ᵀ G vec(ΔW)`` of block ``name`` for a ``d_out x d_in`` change ``dW``, computed in ``dtype`` on
        ``dW``'s device: for a Fisher / Gauss-Newton ``G`` of the per-token loss, the change's predicted KL drift
        in nats per token (:mod:`.predicted`)."""
        d = dW.to(dtype)
        return 0.5 * float((d * self.matvec(name, d)).sum())

    def dense(self, name: str, d_out: int | None = None) -> Tensor:
        """The explicit ``(d_in d_out) x (d_in d_out)`` float64 matrix of block ``name`` on column-major
        ``vec(ΔW)`` (tests only); ``d_out`` is needed only when the output side is free (``U_out`` is ``None``)."""
        eb = self.eigenbasis(name)
        Ui = eb.U_in.to(torch.float64)
        if eb.U_out is None:
            if d_out is None:
                raise ValueError(f"block {name} leaves the output side free: give d_out")
            Uo = torch.eye(d_out, dtype=torch.float64)
            lam = eb.eigvals.to(torch.float64).expand(d_out, -1)
        else:
            Uo, lam = eb.U_out.to(torch.float64), eb.eigvals.to(torch.float64)
        K = torch.kron(Ui, Uo)
        return (K * lam.T.reshape(-1)) @ K.T
