"""AlphaEdit (Fang et al. 2025): MEMIT's keys and target values, but the update is projected onto the
null space of the preserved knowledge's keys, so it leaves their outputs unchanged:

    ΔW = R Kᵀ P (K Kᵀ P + K_p K_pᵀ P + l2·I)⁻¹

with ``P = U₀U₀ᵀ`` the projector onto the eigenvectors of the per-token key covariance ``C = E[kkᵀ]``
whose eigenvalues are below ``nullspace_threshold`` (authors: 2e-2), ``K_p K_pᵀ`` the accumulated keys
of earlier batches / session rounds (AlphaEdit-Seq), ``l2`` the ridge weight (authors' Llama-3 config:
10). For any key ``k`` with ``Pk = 0`` (the span of C's large-eigenvalue directions) ``ΔW k = 0``.
Options: :class:`~crispedit.methods.alphaedit.AlphaEditConfig`. In a session the accumulated
``K_p K_pᵀ`` is carried to the next round (stored with the session's state)."""

from __future__ import annotations

import torch
from torch import Tensor

from ...curvature.factors import InputCovariance, nullspace_projector
from ...editing.keyvalue import layer_keys
from ..memit.closed_form import ClosedFormEditor
from . import AlphaEditConfig

__all__ = ["AlphaEditConfig", "AlphaEditEditor", "nullspace_projector", "alphaedit_delta"]

KEY = "::KpKp"  # carried-state key suffix: the accumulated K_p K_pᵀ of a layer (d_in x d_in, float64)


def alphaedit_delta(K: Tensor, R: Tensor, P: Tensor, KpKp: Tensor | None, l2: float) -> Tensor:
    """``R Kᵀ P (K Kᵀ P + K_p K_pᵀ P + l2·I)⁻¹`` in float64 (``K`` ``d_in x N``, ``R`` ``d_out x N``, ``P`` and
    ``KpKp`` ``d_in x d_in``); returns ``d_out x d_in``. Solved as the authors do, as
    ``(P(KKᵀ + K_pK_pᵀ) + l2·I) X = P K Rᵀ``, ``ΔW = Xᵀ``."""
    K, R, P = K.double(), R.double(), P.double()
    N = K @ K.T + (KpKp.double() if KpKp is not None else 0)
    eye = torch.eye(K.shape[0], dtype=torch.float64, device=K.device)
    return torch.linalg.solve(P @ N + l2 * eye, P @ K @ R.T).T


class AlphaEditEditor(ClosedFormEditor):
    """AlphaEdit: MEMIT's closed form restricted to the null space of the capability keys' covariance."""

    name = "alphaedit"
    carries_state = True  # sessions carry K_p K_pᵀ whatever the optimizer setting

    def prepare(self, layers, C, cfg, ctx):
        """``P`` per layer, the null space of its input covariance (:meth:`InputCovariance.nullspace
        <crispedit.curvature.factors.InputCovariance.nullspace>`), and the carried ``K_p K_pᵀ`` (zero without a
        previous round)."""
        cov = InputCovariance(ctx.factors)
        P = {n: cov.nullspace(n, cfg.nullspace_threshold) for n in layers}
        kp = {
            n: (ctx.optimizer_state[n + KEY].double() if n + KEY in ctx.optimizer_state else torch.zeros_like(P[n]))
            for n in layers
        }
        return {"P": P, "KpKp": kp}

    def solve(self, name, K, R, C, cfg, state):
        """:func:`alphaedit_delta` with this layer's ``P`` and accumulated ``K_p K_pᵀ``."""
        return alphaedit_delta(K, R, state["P"][name].to(K.device), state["KpKp"][name].to(K.device), cfg.l2)

    def after_batch(self, model, tokenizer, requests, layers, templates, state):
        """Add the batch's keys (on the edited model, as the authors do) to ``K_p K_pᵀ``."""
        for n, m in layers.items():
            K = layer_keys(model, tokenizer, requests, m, templates).double().cpu()
            state["KpKp"][n] = state["KpKp"][n].cpu() + K.T @ K

    def stats(self, layers, state):
        """``kept_fraction``: the null-space dimension over ``d_in`` (the input directions the update may use)."""
        return {
            n: {"kept_fraction": float(torch.trace(state["P"][n])) / state["P"][n].shape[0], "form": "nullspace"}
            for n in layers
        }

    def restore_carried(self, state, tensors):
        """``K_p K_pᵀ`` of every layer from a batch checkpoint (:meth:`carried_state`'s keys)."""
        state["KpKp"] = {n: tensors[n + KEY].double() for n in state["KpKp"]}

    def carried_state(self, state):
        """The accumulated ``K_p K_pᵀ`` of every layer (``<layer>::KpKp``)."""
        return {n + KEY: t.cpu() for n, t in state["KpKp"].items()}
