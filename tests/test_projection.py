import pytest
import torch

from crispedit.errors import CrispEditError
from crispedit.projection import (DenseProjector, KroneckerProjector, eigh_psd, energy_keep_mask,
                                  kfac_quadratic_form, unvec, vec)

D = torch.float64


def rn(*shape):
    return torch.randn(*shape, dtype=D)


def rand_psd(n, rank=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, rank or 2 * n, generator=g, dtype=D)
    # spread the spectrum so the energy rule has something to do
    X = X * torch.logspace(0, -2, X.shape[1], dtype=D)
    return X @ X.T


def explicit_kfac_projector(A, S, gamma):
    """Ground truth: eigendecompose the dense Kronecker product itself and keep the low-energy part."""
    G = torch.kron(A, S)  # acts on column-major vec(W), W: d_out x d_in
    evals, U = torch.linalg.eigh(G)
    evals, U = evals.flip(0).clamp_min(0), U.flip(1)
    csum = torch.cumsum(evals, 0)
    k = int((csum < gamma * csum[-1]).sum()) + 1
    Uk = U[:, k:]
    return Uk @ Uk.T, G


def test_vec_convention():
    W = torch.arange(6.0, dtype=D).reshape(2, 3)
    assert torch.equal(unvec(vec(W), 2, 3), W)
    Uo, Ui = rn(2, 2), rn(3, 3)
    assert torch.allclose(vec(Uo @ W @ Ui.T), torch.kron(Ui, Uo) @ vec(W))


def test_energy_mask_counts():
    ev = torch.tensor([5.0, 3.0, 1.0, 1.0, 0.0], dtype=D)
    # total 10; gamma .5 -> first (5) reaches .5 -> mask 1
    assert energy_keep_mask(ev, 0.5).tolist() == [False, True, True, True, True]
    assert energy_keep_mask(ev, 0.51).tolist() == [False, False, True, True, True]
    assert energy_keep_mask(ev, 0.95).tolist() == [False, False, False, False, True]
    assert energy_keep_mask(torch.zeros(4), 0.9).all()
    # works on matrices, cut by sorted position
    m = energy_keep_mask(torch.tensor([[1.0, 4.0], [0.5, 0.0]]), 0.7)
    assert m.tolist() == [[True, False], [True, True]]


@pytest.mark.parametrize("gamma", [0.0, 1.0, -0.1, 1.5, "x"])
def test_gamma_out_of_range(gamma):
    with pytest.raises(CrispEditError):
        energy_keep_mask(torch.ones(3), gamma)


@pytest.mark.parametrize("gamma", [0.5, 0.8, 0.95])
def test_kronecker_projector_equals_explicit(gamma):
    A, S = rand_psd(5, seed=1), rand_psd(4, seed=2)
    P = KroneckerProjector.from_factors(A, S, gamma, dtype=torch.float64)
    P_dense = P.dense()
    P_true, _ = explicit_kfac_projector(A, S, gamma)
    assert torch.allclose(P_dense, P_true, atol=1e-9)
    assert torch.allclose(P_dense, P_dense.T, atol=1e-12)         # symmetric
    assert torch.allclose(P_dense @ P_dense, P_dense, atol=1e-10)  # idempotent
    assert 0 < P.kept_fraction < 1


def test_kept_directions_have_low_curvature():
    A, S = rand_psd(6, seed=3), rand_psd(5, seed=4)
    gamma = 0.9
    P = KroneckerProjector.from_factors(A, S, gamma, dtype=torch.float64)
    lam_in, U_in = eigh_psd(A)
    lam_out, U_out = eigh_psd(S)
    prods = torch.outer(lam_out, lam_in)
    keep = energy_keep_mask(prods, gamma)
    Q = rn(5, 6)
    PQ = P.project(Q)
    C = U_out.T @ PQ @ U_in
    assert C[~keep].abs().max() < 1e-10                 # nothing along masked eigen-directions
    lam_cut = prods[keep].max()
    qf = 2 * kfac_quadratic_form(A, S, PQ)
    assert qf <= lam_cut * (PQ ** 2).sum() + 1e-10      # curvature of the step bounded by the cut
    full = 2 * kfac_quadratic_form(A, S, Q) / (Q ** 2).sum()
    assert qf / (PQ ** 2).sum() < full                  # and far below the unprojected step's


def test_quadratic_form_matches_dense():
    A, S = rand_psd(4, seed=5), rand_psd(3, seed=6)
    dW = rn(3, 4)
    v = vec(dW)
    assert torch.allclose(kfac_quadratic_form(A, S, dW), 0.5 * v @ torch.kron(A, S) @ v)


def test_activation_covariance_projector():
    # A of rank 3 in 6 dims: Adam-NSCL keeps the low-energy input directions only
    A = rand_psd(6, rank=3, seed=7)
    gamma = 0.9
    P = KroneckerProjector.from_activation_covariance(A, gamma, dtype=torch.float64)
    lam, U = eigh_psd(A)
    keep = energy_keep_mask(lam, gamma)
    Q = rn(4, 6)
    expected = Q @ U[:, keep] @ U[:, keep].T
    assert torch.allclose(P.project(Q), expected, atol=1e-10)
    # masked input directions are removed: the projected update does not change outputs on them
    assert (P.project(Q) @ U[:, ~keep]).abs().max() < 1e-10
    # low-energy, not high-energy, directions are kept (the authors' baseline got this backwards)
    assert keep[-1] and not keep[0]


def test_activation_nullspace_is_inside_kfac_kept_set():
    # Proposition 2 (layerwise, K-FAC form): a direction in the nullspace of A is never masked
    A = rand_psd(5, rank=2, seed=8)
    S = rand_psd(3, seed=9)
    lam, U = eigh_psd(A)
    null_dir = U[:, -1]
    assert lam[-1] < 1e-10
    dW = torch.outer(rn(3), null_dir)
    P = KroneckerProjector.from_factors(A, S, 0.99, dtype=torch.float64)
    assert torch.allclose(P.project(dW), dW, atol=1e-10)


def test_dense_projector_from_matrix():
    A, S = rand_psd(3, seed=10), rand_psd(2, seed=11)
    G = torch.kron(A, S)
    D = DenseProjector.from_matrix(G, 0.8, d_out=2, d_in=3)
    K = KroneckerProjector.from_factors(A, S, 0.8, dtype=torch.float64)
    Q = rn(2, 3)
    assert torch.allclose(D.project(Q), K.project(Q), atol=1e-10)


def test_projection_keeps_input_dtype_and_runs_fp32():
    A, S = rand_psd(8, seed=12).float(), rand_psd(4, seed=13).float()
    P = KroneckerProjector.from_factors(A, S, 0.8)
    Q = torch.randn(4, 8, dtype=torch.bfloat16)
    out = P.project(Q)
    assert out.dtype == torch.bfloat16 and P.U_in.dtype == torch.float32
