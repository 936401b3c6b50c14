"""Spectra and keep masks of the projectors (:mod:`.projection`).

Vectorisation convention (everywhere in crispedit): column-major ``vec``, so that for the K-FAC block
``G = A (x) S`` of a linear layer ``s = W a`` we have ``vec(g a^T) = a (x) g`` and
``vec(U_out X U_in^T) = (U_in (x) U_out) vec(X)``. In torch, ``vec(X) = X.T.reshape(-1)``.

Energy rule (paper, eq. "projected_gradients"): sort the eigenvalues in decreasing order and mask the smallest top
set whose sum reaches a ``gamma`` fraction of the total; the rest is kept. The cut is made on sorted positions, so
ties are resolved deterministically and exactly ``k`` directions are masked (:func:`energy_keep_mask`; over the
Kronecker spectrum without forming it, :func:`kronecker_keep_mask`). Eigendecompositions run in float64 by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..checks import check_gamma

__all__ = [
    "vec",
    "unvec",
    "eigh_sym",
    "eigh_psd",
    "energy_keep_mask",
    "kronecker_keep_mask",
    "per_source_keep_mask",
    "masked_corner",
    "row_extents",
]


def vec(X: Tensor) -> Tensor:
    """Column-major vectorisation."""
    return X.transpose(-1, -2).reshape(*X.shape[:-2], -1)


def unvec(v: Tensor, d_out: int, d_in: int) -> Tensor:
    """Inverse of :func:`vec` for a ``d_out x d_in`` matrix."""
    return v.reshape(d_in, d_out).T


def eigh_sym(M: Tensor, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of a symmetric matrix in ``dtype`` (symmetrised first), eigenvalues in
    *increasing* order, unclamped. The solver runs in ``dtype`` itself: float32 is a float32 solver on every
    device (never float64 rounded to float32)."""
    Md = M.detach().to(dtype)
    Md = 0.5 * (Md + Md.T)
    if Md.device.type == "cpu" and dtype == torch.float64:
        # LAPACK's divide-and-conquer through numpy is faster than torch's CPU eigh (docs/benchmarks.md); numpy would
        # compute a float32 matrix in float64, so other dtypes go to torch
        import numpy as np

        ev, U = np.linalg.eigh(Md.numpy())
        return torch.from_numpy(ev), torch.from_numpy(U)
    return torch.linalg.eigh(Md)


def eigh_psd(M: Tensor, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of a symmetric PSD matrix in ``dtype``.

    The matrix is symmetrised first; tiny negative eigenvalues produced by round-off are clamped to
    zero. Eigenvalues are returned in *decreasing* order with matching eigenvector columns.
    """
    evals, evecs = eigh_sym(M, dtype)
    return evals.clamp_min(0.0).flip(0), evecs.flip(1)


def energy_keep_mask(eigvals: Tensor, gamma: float) -> Tensor:
    """Boolean mask (same shape as ``eigvals``) of the directions *kept* by the energy rule.

    The smallest set of largest eigenvalues holding at least ``gamma`` of the total is masked out;
    everything below that cut is kept. If the spectrum is identically zero everything is kept.
    """
    gamma = check_gamma(gamma)
    flat = eigvals.detach().reshape(-1).to(torch.float64).clamp_min(0.0)
    total = flat.sum()
    keep = torch.ones_like(flat, dtype=torch.bool)
    if total <= 0:
        return keep.reshape(eigvals.shape)
    order = torch.argsort(flat, descending=True, stable=True)
    csum = torch.cumsum(flat[order], 0)
    # number of masked directions: smallest k with csum[k-1] >= gamma * total
    k = int(torch.searchsorted(csum, gamma * total, right=False).item()) + 1
    k = min(k, flat.numel())
    keep[order[:k]] = False
    return keep.reshape(eigvals.shape)


def kronecker_keep_mask(lam_out: Tensor, lam_in: Tensor, gamma: float) -> Tensor:
    """:func:`energy_keep_mask` of the Kronecker spectrum ``outer(lam_out, lam_in)`` (``d_out x d_in`` bool), for
    eigenvalues in *decreasing* order (as :func:`eigh_psd` returns them), without sorting its ``d_out d_in``
    entries: each row of the outer product is already sorted, so the count and energy of the entries above a
    threshold are row-wise searches and prefix sums. The threshold is bisected until few entries lie between
    its bounds; those are ranked as the stable sort ranks them (value, then row-major position). Same mask as
    :func:`energy_keep_mask` up to the order in which the energies are summed (a tie of the cut with the γ
    fraction within rounding may move it by one entry). Computed on the CPU whatever the eigenvalues' device."""
    gamma = check_gamma(gamma)
    lo_ = lam_out.detach().to("cpu", torch.float64).clamp_min(0.0)  # a bisection of host reads: on the CPU
    li_ = lam_in.detach().to("cpu", torch.float64).clamp_min(0.0)
    if lo_.numel() > 1 and bool((lo_[1:] > lo_[:-1]).any()) or li_.numel() > 1 and bool((li_[1:] > li_[:-1]).any()):
        return energy_keep_mask(torch.outer(lo_, li_), gamma)  # not sorted: the general rule
    flat = torch.outer(lo_, li_)  # rows sorted in decreasing order
    total = flat.sum()
    keep = torch.ones_like(flat, dtype=torch.bool)
    if total <= 0:
        return keep
    target = gamma * total
    neg = -flat  # rows ascending, for searchsorted
    rowsum = torch.cumsum(flat, dim=1)

    def above(tau: float) -> tuple[Tensor, Tensor]:
        """Per row: number of entries >= tau, and the summed energy over all rows of those entries."""
        cnt = torch.searchsorted(neg, torch.full((flat.shape[0], 1), -tau, dtype=torch.float64), right=True).squeeze(1)
        idx = (cnt - 1).clamp_min(0)
        energy = torch.where(cnt > 0, rowsum.gather(1, idx[:, None]).squeeze(1), torch.zeros((), dtype=torch.float64))
        return cnt, energy.sum()

    # invariant: entries >= hi hold less than the target, entries >= lo at least the target
    hi, lo = float(flat.max()) * 2 + 1.0, 0.0
    n_hi, e_hi = above(hi)
    n_lo, _ = above(lo)
    for _ in range(200):
        if int(n_lo.sum() - n_hi.sum()) <= 4096:
            break
        mid = 0.5 * (hi + lo)
        if not lo < mid < hi:
            break
        n_mid, e_mid = above(mid)
        if e_mid >= target:
            lo, n_lo = mid, n_mid
        else:
            hi, n_hi, e_hi = mid, n_mid, e_mid
    # every entry >= hi is masked; rank the entries in [lo, hi) as the stable descending sort would
    cols = torch.arange(flat.shape[1])
    band = (cols[None, :] >= n_hi[:, None]) & (cols[None, :] < n_lo[:, None])
    cand = band.reshape(-1).nonzero().squeeze(1)
    vals = flat.reshape(-1)[cand]
    order = torch.argsort(vals, descending=True, stable=True)  # cand is in row-major order already
    csum = e_hi + torch.cumsum(vals[order], 0)
    m = int(torch.searchsorted(csum, target, right=False)) + 1
    m = min(m, cand.numel())
    keep = cols[None, :] >= n_hi[:, None]
    keep.reshape(-1)[cand[order[:m]]] = False
    return keep


def per_source_keep_mask(
    U_out: Tensor, U_in: Tensor, sources: Sequence[tuple[Tensor, Tensor]], gamma: float | Sequence[float]
) -> Tensor:
    """Keep mask (``d_out x d_in`` bool) in the Kronecker eigenbasis ``U_out ⊗ U_in`` (orthonormal columns,
    ``d_out x d_out`` / ``d_in x d_in``) that masks at least ``gamma`` of *each* source's K-FAC energy (one
    ``gamma`` for all, or one per source): source ``(A, S)`` (``d_in x d_in``, ``d_out x d_out``) puts
    ``(u_iᵀ S u_i)(v_jᵀ A v_j)`` on entry ``(i, j)`` — exactly its curvature along that basis direction, summing to
    ``tr(S) tr(A)`` — and an entry is masked when it is in any source's :func:`energy_keep_mask` cut. Unlike the
    cut of one merged spectrum, no source can take the whole budget by scale or by a single outlier direction.
    Energies in float64, on the CPU."""
    gammas = [gamma] * len(sources) if isinstance(gamma, (int, float)) else list(gamma)
    if len(gammas) != len(sources):
        raise ValueError(f"{len(gammas)} energy thresholds for {len(sources)} sources")
    Uo, Ui = U_out.detach().to("cpu", torch.float64), U_in.detach().to("cpu", torch.float64)
    keep = torch.ones(Uo.shape[1], Ui.shape[1], dtype=torch.bool)
    for (A, S), g in zip(sources, gammas):
        d_in = ((A.detach().to("cpu", torch.float64) @ Ui) * Ui).sum(0).clamp_min(0.0)
        d_out = ((S.detach().to("cpu", torch.float64) @ Uo) * Uo).sum(0).clamp_min(0.0)
        o_out, o_in = torch.argsort(d_out, descending=True), torch.argsort(d_in, descending=True)
        sorted_keep = kronecker_keep_mask(d_out[o_out], d_in[o_in], g)
        mine = torch.empty_like(sorted_keep)
        mine[o_out[:, None], o_in[None, :]] = sorted_keep
        keep &= mine
    return keep


def masked_corner(mask: Tensor) -> tuple[int, int]:
    """``(r_out, r_in)``: one past the last row and the last column holding a masked (zero) entry of a
    keep ``mask`` (``d_out x d_in``, or ``1 x d_in``); ``(0, 0)`` when nothing is masked. Every masked
    entry lies in ``mask[:r_out, :r_in]``."""
    masked = mask == 0
    rows, cols = masked.any(dim=1), masked.any(dim=0)
    if not bool(rows.any()):
        return 0, 0
    return int(rows.nonzero().max()) + 1, int(cols.nonzero().max()) + 1


def row_extents(mask: Tensor) -> Tensor:
    """Per row of a keep ``mask`` (``d_out x d_in``): one past the last masked (zero) column, 0 for a row with
    nothing masked (int64, length ``d_out``). Its maximum is ``r_in`` of :func:`masked_corner`."""
    out = torch.zeros(mask.shape[0], dtype=torch.int64)
    if mask.shape[1] == 0:
        return out
    cols = torch.arange(1, mask.shape[1] + 1, dtype=torch.int32, device=mask.device)
    for i in range(0, mask.shape[0], 256):  # row chunks: no d_out x d_in integer temporary
        out[i : i + 256] = ((mask[i : i + 256] == 0) * cols).amax(dim=1).cpu()
    return out
