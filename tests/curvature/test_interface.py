"""Every curvature model against its dense float64 twin, through one case list.

Each case builds a :class:`~crispedit.curvature.base.Curvature` from random statistics of one small block and,
independently, the dense ``(d_in d_out) x (d_in d_out)`` float64 matrix those statistics define on column-major
``vec(ΔW)`` (K-FAC: ``A ⊗ S``; the input covariance: ``A ⊗ I``; EK-FAC: ``Σ λ_ij vec(u_i v_jᵀ) vec(u_i v_jᵀ)ᵀ``;
the exact Gauss-Newton: the matrix itself). The same checks run on every case: the eigenbasis rebuilds the twin,
the quadratic form (predicted drift) and its gradient are the twin's, the projector at γ is the projector onto the
twin's eigenvectors outside the γ-energy top set, and the merge of two is the twin of the merged statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from crispedit.curvature.factors import InputCovariance, KFACFactors
from crispedit.curvature.masks import energy_keep_mask, unvec, vec
from crispedit.experiments.ekfac import EKFACFactors
from crispedit.experiments.study_curvature import PARAMS, DenseCurvature

D64 = torch.float64
D_OUT, D_IN = 3, 4


def rand_psd(d: int, seed: int, rank: int | None = None) -> torch.Tensor:
    """A random ``d x d`` PSD matrix (float64) with a spread spectrum, of rank ``rank`` (default full)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(d, rank or d, generator=g, dtype=D64) * torch.logspace(0, -1.5, rank or d, dtype=D64)
    return X @ X.T


def rand_orthonormal(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=D64))[0]


@dataclass
class Case:
    """One implementation: ``build(seed) -> (curvature, raw statistics)``, ``twin(raw)`` the dense float64 matrix,
    ``merge(raw1, raw2, w)`` the raw statistics of the weighted merge, and the block's name and shape."""

    build: Callable[[int], tuple[Any, Any]]
    twin: Callable[[Any], torch.Tensor]
    merge: Callable[[Any, Any, float], Any]
    name: str = "layer"
    d_out: int = D_OUT
    d_in: int = D_IN


def _kfac(seed):
    A, S = rand_psd(D_IN, seed), rand_psd(D_OUT, seed + 100)
    return KFACFactors({"layer": A}, {"layer": S}, 10 + seed), (A, S)


def _input(seed):
    A = rand_psd(D_IN, seed)
    return InputCovariance(KFACFactors({"layer": A}, {}, 10 + seed)), A


def _ekfac(seed):
    g = torch.Generator().manual_seed(seed)
    U_out, U_in = rand_orthonormal(D_OUT, 7), rand_orthonormal(D_IN, 8)  # one basis for every seed: merges
    lam = torch.rand(D_OUT, D_IN, generator=g, dtype=D64) * torch.logspace(0, -2, D_IN, dtype=D64)
    return EKFACFactors({"layer": U_out}, {"layer": U_in}, {"layer": lam}, {}), (U_out, U_in, lam)


def _ekfac_twin(raw):
    U_out, U_in, lam = raw
    G = torch.zeros(D_OUT * D_IN, D_OUT * D_IN, dtype=D64)
    for i in range(D_OUT):
        for j in range(D_IN):
            v = vec(torch.outer(U_out[:, i], U_in[:, j]))
            G += lam[i, j] * torch.outer(v, v)
    return G


P_DENSE = 6


def _dense(seed):
    G = rand_psd(P_DENSE, seed)
    return DenseCurvature(G), G


CASES = {
    "kfac": Case(
        _kfac,
        lambda r: torch.kron(r[0], r[1]),
        lambda r1, r2, w: ((1 - w) * r1[0] + w * r2[0], (1 - w) * r1[1] + w * r2[1]),
    ),
    "input_covariance": Case(
        _input, lambda A: torch.kron(A, torch.eye(D_OUT, dtype=D64)), lambda a, b, w: (1 - w) * a + w * b
    ),
    "ekfac": Case(_ekfac, _ekfac_twin, lambda r1, r2, w: (r1[0], r1[1], (1 - w) * r1[2] + w * r2[2])),
    "exact_ggn": Case(_dense, lambda G: G, lambda a, b, w: (1 - w) * a + w * b, name=PARAMS, d_out=P_DENSE, d_in=1),
}
cases = pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """``got`` equals ``want`` up to ``rel`` of ``want``'s largest entry (eigenvectors are stored in float32)."""
    torch.testing.assert_close(got.to(D64), want, rtol=0, atol=rel * float(want.abs().max()))


def projector_matrix(proj, d_out: int, d_in: int) -> torch.Tensor:
    """The explicit matrix of a layer projector on ``vec`` of a ``d_out x d_in`` weight, column by column."""
    n = d_out * d_in
    eye = torch.eye(n, dtype=D64)
    return torch.stack([vec(proj.project(unvec(eye[:, k], d_out, d_in)).to(D64)) for k in range(n)], dim=1)


def twin_projector(G: torch.Tensor, gamma: float) -> torch.Tensor:
    """The projector onto the eigenvectors of ``G`` outside the γ-energy top set, with every eigenspace the cut
    touches removed whole (a repeated eigenvalue has no preferred vectors within its eigenspace)."""
    evals, U = torch.linalg.eigh(G)
    evals, U = evals.flip(0).clamp_min(0.0), U.flip(1)
    keep = energy_keep_mask(evals, gamma)
    tol = 1e-9 * float(evals.max())
    for lam in evals[~keep]:
        keep &= (evals - lam).abs() > tol
    return U[:, keep] @ U[:, keep].T


@cases
def test_the_eigenbasis_rebuilds_the_dense_twin(case):
    curv, raw = case.build(0)
    assert case.name in curv.layers and curv.covers(case.name)
    eb = curv.eigenbasis(case.name)
    assert eb.U_in.shape == (case.d_in, case.d_in)
    close(curv.dense(case.name, d_out=case.d_out), case.twin(raw))


@cases
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_quadratic_form_and_its_gradient_are_the_twins(case, dtype):
    curv, raw = case.build(1)
    G = case.twin(raw)
    dW = torch.randn(case.d_out, case.d_in, generator=torch.Generator().manual_seed(3), dtype=D64)
    v = vec(dW)
    want = 0.5 * float(v @ G @ v)
    rel = 1e-5 if dtype == torch.float64 else 1e-4
    assert curv.quadratic_form(case.name, dW, dtype) == pytest.approx(want, rel=rel)
    close(vec(curv.matvec(case.name, dW.to(dtype))), G @ v, rel=rel)
    on = curv.on({case.name: "cpu"}, torch.float32)  # what a drift budget measures with, every step
    assert on.quadratic_form(case.name, dW.float(), torch.float32) == pytest.approx(want, rel=1e-4)


@cases
@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.99])
def test_the_projector_at_gamma_is_the_twins(case, gamma):
    curv, raw = case.build(2)
    proj = curv.projector(case.name, gamma)
    close(projector_matrix(proj, case.d_out, case.d_in), twin_projector(case.twin(raw), gamma), rel=1e-5)
    assert curv.projectors([case.name], gamma)[case.name].kept_fraction == proj.kept_fraction


@cases
def test_the_merge_is_the_twin_of_the_merged_statistics(case):
    (c1, r1), (c2, r2) = case.build(3), case.build(4)
    close(c1.merged(c2, 0.3).dense(case.name, d_out=case.d_out), case.twin(case.merge(r1, r2, 0.3)))


def test_kfac_merge_by_token_count():
    (c1, (A1, S1)), (c2, (A2, S2)) = _kfac(5), _kfac(9)  # 15 and 19 tokens
    w = 19 / 34
    close(c1.merged(c2).dense("layer"), torch.kron((1 - w) * A1 + w * A2, (1 - w) * S1 + w * S2))


def test_input_statistics_are_no_kfac_curvature_and_their_null_space_is_alphaedits():
    """An ``input`` statistics set (``A`` alone) covers no K-FAC block (no drift is predicted from it); as an
    input covariance its null space at a threshold projects onto the eigenvectors of ``A`` below it."""
    A = rand_psd(D_IN, 11, rank=2)
    stats = KFACFactors({"layer": A}, {}, 5)
    assert not stats.covers("layer") and InputCovariance(stats).covers("layer")
    evals, U = torch.linalg.eigh(A)
    U0 = U[:, evals < 1e-8]
    assert U0.shape[1] == 2
    close(InputCovariance(stats).nullspace("layer", 1e-8), U0 @ U0.T, rel=1e-10)
