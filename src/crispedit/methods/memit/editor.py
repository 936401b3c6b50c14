"""MEMIT (Meng et al. 2023): each edit layer's MLP output projection gets the closed-form update
``ΔW = R Kᵀ (λC + K Kᵀ)⁻¹`` — the least-squares map of the batch's keys ``K`` to its residuals ``R``,
regularised by the per-token key covariance ``C = E[kkᵀ]`` of the capability corpus (λ = 15000, the
authors' ``mom2_update_weight``). Keys, ``v*`` and the residual spread over the layers are
:mod:`crispedit.editing.keyvalue`; the batch loop is :class:`.closed_form.ClosedFormEditor`. Options:
:class:`~crispedit.methods.memit.MEMITConfig`."""

from __future__ import annotations

import torch
from torch import Tensor

from . import MEMITConfig
from .closed_form import ClosedFormEditor

__all__ = ["MEMITConfig", "MEMITEditor", "memit_delta"]


def memit_delta(K: Tensor, R: Tensor, C: Tensor, lam: float) -> Tensor:
    """``R Kᵀ (λC + K Kᵀ)⁻¹`` in float64: ``K`` ``d_in x N`` keys, ``R`` ``d_out x N`` residuals, ``C``
    ``d_in x d_in``; returns ``d_out x d_in``. It minimises ``‖ΔW K − R‖² + λ tr(ΔW C ΔWᵀ)``."""
    K, R, C = K.double(), R.double(), C.double()
    adj = torch.linalg.solve(lam * C + K @ K.T, K)  # d_in x N (the system is symmetric)
    return R @ adj.T


class MEMITEditor(ClosedFormEditor):
    """MEMIT: closed-form, covariance-regularised key → value update of every edit layer."""

    name = "memit"

    def solve(self, name, K, R, C, cfg, state):
        """:func:`memit_delta` with λ = ``cfg.cov_weight``."""
        return memit_delta(K, R, C, cfg.cov_weight)
