import pytest
import torch

from crispedit.curvature.factors import KFACFactors
from crispedit.curvature.masks import eigh_psd, energy_keep_mask, per_source_keep_mask, unvec, vec
from crispedit.curvature.projection import DenseProjector, KroneckerProjector, kronecker_projection_flops
from crispedit.errors import CrispEditError

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
    assert torch.allclose(P_dense, P_dense.T, atol=1e-12)  # symmetric
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
    assert C[~keep].abs().max() < 1e-10  # nothing along masked eigen-directions
    lam_cut = prods[keep].max()
    curv = KFACFactors({"W": A}, {"W": S}, 1)
    qf = 2 * curv.quadratic_form("W", PQ)
    assert qf <= lam_cut * (PQ**2).sum() + 1e-10  # curvature of the step bounded by the cut
    full = 2 * curv.quadratic_form("W", Q) / (Q**2).sum()
    assert qf / (PQ**2).sum() < full  # and far below the unprojected step's


def test_quadratic_form_matches_dense():
    A, S = rand_psd(4, seed=5), rand_psd(3, seed=6)
    dW = rn(3, 4)
    v = vec(dW)
    assert KFACFactors({"W": A}, {"W": S}, 1).quadratic_form("W", dW) == pytest.approx(
        float(0.5 * v @ torch.kron(A, S) @ v), rel=1e-12
    )


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


# -- the exact low-rank form ------------------------------------------------------------------------


def spread_psd(n, decay, seed):
    """PSD matrix with a random eigenbasis and a power-law spectrum k^-decay: the shape real factors have."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=D))
    lam = torch.arange(1, n + 1, dtype=D) ** -decay
    return (U * lam) @ U.T


def both_forms(A, S, gamma, dtype):
    full = KroneckerProjector.from_factors(A, S, gamma, dtype=dtype)
    full = KroneckerProjector(full.U_out, full.U_in, full.mask, dtype=dtype, form="full")
    low = KroneckerProjector(full.U_out, full.U_in, full.mask, dtype=dtype, form="low_rank")
    return full, low


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("shape", [(7, 19), (24, 9), (16, 16), (1, 6)])
@pytest.mark.parametrize("gamma", [0.3, 0.8, 0.95, 0.999])
def test_low_rank_form_equals_full_form(gamma, shape, dtype, tol):
    d_out, d_in = shape
    A, S = spread_psd(d_in, 1.5, seed=d_in), spread_psd(d_out, 1.0, seed=100 + d_out)
    full, low = both_forms(A, S, gamma, dtype)
    assert full.r_out == low.r_out and 0 < low.r_out <= d_out and 0 < low.r_in <= d_in
    Q = torch.randn(d_out, d_in, dtype=D)
    ref = full.project(Q.to(dtype)).double()
    got = low.project(Q.to(dtype))
    assert got.dtype == dtype
    scale = Q.abs().max()
    assert (got.double() - ref).abs().max() <= tol * scale
    # and both are the explicit Kronecker projector (the ground truth of the tests above)
    P_true, _ = explicit_kfac_projector(A, S, gamma)
    assert (vec(got.double()) - P_true @ vec(Q)).abs().max() <= 10 * tol * scale


def test_mask_is_a_staircase_in_the_leading_eigenvectors():
    # eigenvalues decrease along both axes, so the masked top of the Kronecker spectrum is closed towards
    # the top-left: it fits in the leading r_out x r_in corner, which is what makes the low-rank form cheap
    A, S = spread_psd(40, 2.0, seed=1), spread_psd(30, 1.5, seed=2)
    P = KroneckerProjector.from_factors(A, S, 0.8)
    masked = P.mask == 0
    for i, j in masked.nonzero().tolist():
        assert masked[: i + 1, : j + 1].all()
    assert P.r_out < 30 and P.r_in < 40 and P.low_rank
    assert masked[: P.r_out, : P.r_in].any(0).all() and masked[: P.r_out, : P.r_in].any(1).all()


def test_low_rank_is_exact_for_any_mask_shape():
    # EK-FAC's corrected eigenvalues need not decrease along the axes: the corner still holds every masked
    # entry, so the form stays exact (it is merely cheaper or not)
    g = torch.Generator().manual_seed(3)
    U_out, _ = torch.linalg.qr(torch.randn(9, 9, generator=g, dtype=D))
    U_in, _ = torch.linalg.qr(torch.randn(13, 13, generator=g, dtype=D))
    ev = torch.rand(9, 13, generator=g, dtype=D) ** 6
    P = KroneckerProjector.from_eigenbasis(U_out, U_in, ev, 0.7, dtype=D)
    F = KroneckerProjector(U_out, U_in, P.mask, dtype=D, form="full")
    L = KroneckerProjector(U_out, U_in, P.mask, dtype=D, form="low_rank")
    Q = rn(9, 13)
    assert torch.allclose(L.project(Q), F.project(Q), atol=1e-12)
    assert torch.allclose(P.project(Q), F.project(Q), atol=1e-12)


def test_nothing_masked_and_everything_masked():
    # a zero spectrum keeps everything: the projector is the identity and costs nothing
    P = KroneckerProjector.from_factors(torch.zeros(5, 5), rand_psd(4, seed=1), 0.8)
    assert (P.r_out, P.r_in) == (0, 0) and P.low_rank and P.flops_low_rank == 0
    Q = torch.randn(4, 5)
    assert P.project(Q) is Q
    assert P.stats() == {"kept_fraction": 1.0, "r_out": 0, "r_in": 0, "split": 0, "form": "low_rank", "flop_ratio": 0.0}
    # everything masked: the corner is the whole matrix, the full form is cheaper, both give zero
    U_out, U_in = eigh_psd(rand_psd(4, seed=2))[1], eigh_psd(rand_psd(5, seed=3))[1]
    for form in ("auto", "low_rank", "full"):
        Z = KroneckerProjector(U_out, U_in, torch.zeros(4, 5), dtype=D, form=form)
        assert (Z.r_out, Z.r_in) == (4, 5) and Z.low_rank == (form == "low_rank")
        assert Z.project(rn(4, 5)).abs().max() < 1e-12
    assert KroneckerProjector(U_out, U_in, torch.zeros(4, 5)).stats()["form"] == "full"


@pytest.mark.parametrize("gamma", [0.5, 0.9])
def test_input_only_projector_low_rank(gamma):
    A = spread_psd(11, 1.3, seed=4)
    P = KroneckerProjector.from_activation_covariance(A, gamma, dtype=D)
    F = KroneckerProjector(None, P.U_in, P.mask, dtype=D, form="full")
    assert P.low_rank and P.r_out is None and 0 < P.r_in < 11
    Q = rn(6, 11)
    assert torch.allclose(P.project(Q), F.project(Q), atol=1e-12)
    assert P.stats()["r_out"] is None and 0 < P.stats()["flop_ratio"] < 1


def test_transposed_storage_and_rotation_still_agree():
    from transformers.pytorch_utils import Conv1D

    from crispedit.editing.loop import apply_projection

    A, S = spread_psd(10, 1.5, seed=5).float(), spread_psd(6, 1.0, seed=6).float()
    P = KroneckerProjector.from_factors(A, S, 0.8)
    F = KroneckerProjector(P.U_out, P.U_in, P.mask, form="full")
    assert P.low_rank
    conv = Conv1D(6, 10)  # weight stored d_in x d_out
    G = torch.randn(10, 6)
    got = apply_projection(P, conv, G)  # projects G.T (a strided view) and transposes back
    assert got.shape == (10, 6) and torch.allclose(got, F.project(G.T).T, atol=1e-6)
    Q = torch.randn(6, 10)
    assert torch.allclose(P.unrotate(P.rotate(Q)), P.project(Q), atol=1e-6)  # eigenbasis Adam's contract
    assert torch.equal(P.rotate(Q), F.rotate(Q))


def test_flop_counts_match_the_gemms_run():
    from torch.utils.flop_counter import FlopCounterMode

    A, S = spread_psd(30, 1.5, seed=7), spread_psd(20, 1.0, seed=8)
    P = KroneckerProjector.from_factors(A, S, 0.8)
    F = KroneckerProjector(P.U_out, P.U_in, P.mask, form="full")
    Q = torch.randn(20, 30)
    corner = sum(keep.numel() for _, _, keep, _ in P._blocks)
    for proj, elementwise in ((P, corner + 20 * 30), (F, 20 * 30)):
        with FlopCounterMode(display=False) as fc:
            proj.project(Q)
        gemm = (proj.flops_low_rank if proj.low_rank else proj.flops_full) - elementwise
        assert fc.get_total_flops() == gemm
    assert F.flops_full == 4 * 20 * 30 * 50 + 600
    # the two-block form is never dearer than the one-corner form in its cheaper thin-GEMM order
    r_out, r_in = P.r_out, P.r_in
    assert P.flops_low_rank <= 4 * min(r_out * 30 * (20 + r_in), r_in * 20 * (30 + r_out)) + r_out * r_in + 600
    assert kronecker_projection_flops(20, 30, 0, 0) == (0, F.flops_full)
    assert kronecker_projection_flops(20, 30, None, 3) == (4 * 20 * 30 * 3 + 20 * 3 + 600, 4 * 20 * 900 + 600)


def test_projector_moves_with_its_corner():
    P = KroneckerProjector.from_factors(spread_psd(8, 1.5, seed=9), spread_psd(5, 1.0, seed=10), 0.8)
    P.to("cpu")
    assert all(keep.device.type == "cpu" and keep.dtype == torch.bool for _, _, keep, _ in P._blocks)
    with pytest.raises(ValueError, match="form"):
        KroneckerProjector(P.U_out, P.U_in, P.mask, form="lowrank")


@pytest.mark.parametrize("gamma", [0.5, 0.8, 0.99])
def test_low_rank_form_equals_full_form_on_collected_factors(tiny_lm, gamma):
    # factors collected from a model (not synthetic spectra): whatever corner the mask has, both forms agree
    from crispedit.curvature.kfac import collect_lm_kfac
    from crispedit.data import capability_corpus
    from crispedit.layers import resolve_layers

    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    f = collect_lm_kfac(model, tok, capability_corpus(None, 4), layers, max_len=32, batch_size=2, progress=False)
    for name in layers:
        full, low = both_forms(f.A[name].double(), f.S[name].double(), gamma, torch.float32)
        assert (low.r_out, low.r_in) == (full.r_out, full.r_in) and low.r_in > 0
        Q = torch.randn(*full.mask.shape, generator=torch.Generator().manual_seed(0))
        assert (low.project(Q) - full.project(Q)).abs().max() <= 2e-6 * Q.abs().max(), (name, low.stats())


def wide_spectrum_spd(n, seed=0, decades=8.0):
    """A random ``n x n`` symmetric positive definite float32 matrix ``U diag(λ) Uᵀ``, ``λ`` log-spaced from 1 down to
    ``10**-decades``: as wide as a real K-FAC factor's spectrum, where a float32 eigensolver's eigenvectors near the
    γ cut are off by about ``ε₃₂ / gap``."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=D))[0]
    return ((U * torch.logspace(0.0, -decades, n, dtype=D)) @ U.T).float()


def paper_projection(A, S, gamma, Q):
    """The paper's projection of ``Q`` (``d_out x d_in``) for the K-FAC factors ``A`` (``d_in``) and ``S`` (``d_out``),
    all in float64 and independent of the code under test: ``U_out((U_outᵀ Q U_in) ⊙ M)U_inᵀ`` with torch's float64
    eigendecompositions and ``M`` the γ-energy mask of the sorted Kronecker spectrum."""
    lam_in, U_in = torch.linalg.eigh(A.double())
    lam_out, U_out = torch.linalg.eigh(S.double())
    lam_in, U_in = lam_in.flip(0).clamp_min(0), U_in.flip(1)
    lam_out, U_out = lam_out.flip(0).clamp_min(0), U_out.flip(1)
    M = energy_keep_mask(torch.outer(lam_out, lam_in), gamma).double()
    return U_out @ ((U_out.T @ Q.double() @ U_in) * M) @ U_in.T


def _rel(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def _factor_eigh_errors(A, S, gammas, device=None):
    """Relative error, per γ, of the projector crispedit builds from :func:`~crispedit.curvature.eigen.factor_eigh`
    of the factors ``A``, ``S`` (decomposed on ``device``; float32 bases and projection, as every editor uses them)
    against :func:`paper_projection`, on one random gradient."""
    from crispedit.curvature.eigen import factor_eigh
    from crispedit.curvature.factors import KFACFactors

    eig = factor_eigh(KFACFactors({"l": A}, {"l": S}, 100), ["l"], device=device)
    Q = torch.randn(S.shape[0], A.shape[0], generator=torch.Generator().manual_seed(3), dtype=D)
    return {
        g: _rel(
            KroneckerProjector.from_spectra(*eig["l", "S"], *eig["l", "A"], g).project(Q.float()),
            paper_projection(A, S, g, Q),
        )
        for g in gammas
    }


def test_factor_eigh_decomposes_in_float64_on_every_device(monkeypatch):
    """Float32 factors with a wide spectrum: the projector from factor_eigh matches the paper's float64 formula to
    1e-6 up to γ 0.999. A float32 eigensolver (what a GPU ran before: eigh_dtype float32 there) misses by far more,
    so the bound catches it, and eigh_dtype says float64 whatever the device."""
    from crispedit.curvature import eigen

    assert {eigen.eigh_dtype(d) for d in ("cpu", "cuda", "cuda:1", "mps", torch.device("cpu"))} == {torch.float64}
    A, S = wide_spectrum_spd(96, seed=1), wide_spectrum_spd(64, seed=2)
    gammas = (0.8, 0.99, 0.999)
    assert max(_factor_eigh_errors(A, S, gammas).values()) <= 1e-6
    monkeypatch.setattr(eigen, "eigh_dtype", lambda device: torch.float32)  # the old arithmetic on a GPU
    assert _factor_eigh_errors(A, S, gammas)[0.999] > 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_factor_eigh_matches_the_float64_formula():
    """The same on a GPU's own eigensolver (cuSOLVER): decomposed there, in float64."""
    A, S = wide_spectrum_spd(96, seed=1), wide_spectrum_spd(64, seed=2)
    assert max(_factor_eigh_errors(A, S, (0.8, 0.99, 0.999), device="cuda").values()) <= 1e-6


def _stored_eigenbasis_matches_float64(f, layers, gammas=(0.7, 0.8, 0.9, 0.99, 0.999), tol=5e-6, device=None):
    """For the collected factors ``f`` of ``layers``: the projectors built from :func:`factor_eigh` (float64
    decompositions on ``device``, eigenvectors stored and applied in float32) have the float64 masks and project
    within ``tol`` (relative) of :func:`paper_projection`."""
    from crispedit.curvature.eigen import factor_eigh

    eig = factor_eigh(f, layers, device=device)
    for name in layers:
        A, S = f.A[name], f.S[name]
        assert eig[name, "A"][1].dtype == torch.float32 and eig[name, "A"][0].dtype == torch.float64
        Q = torch.randn(S.shape[0], A.shape[0], generator=torch.Generator().manual_seed(0), dtype=D)
        for gamma in gammas:
            got = KroneckerProjector.from_spectra(*eig[name, "S"], *eig[name, "A"], gamma)
            ref = KroneckerProjector.from_factors(A.double(), S.double(), gamma, dtype=D)
            assert torch.equal(got.mask.bool(), ref.mask.bool()), (name, gamma)
            err = _rel(got.project(Q.float()), paper_projection(A, S, gamma, Q))
            assert err <= tol, (name, gamma, err)


def test_stored_float32_eigenbases_give_the_float64_projector(tiny_lm):
    """Eigenvectors kept in float32 after the float64 decomposition (factor_eigh's memory and cache) change neither
    the mask nor, beyond 5e-6 relative up to γ 0.999 (where 2 % of the directions are kept), the projection of
    collected factors."""
    from crispedit.curvature.kfac import collect_lm_kfac
    from crispedit.data import capability_corpus
    from crispedit.layers import resolve_layers

    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    f = collect_lm_kfac(model, tok, capability_corpus(None, 8), layers, max_len=64, batch_size=4, progress=False)
    _stored_eigenbasis_matches_float64(f, layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_stored_eigenbases_give_the_float64_projector(tiny_lm):
    """The same with the decompositions on a GPU."""
    from crispedit.curvature.kfac import collect_lm_kfac
    from crispedit.data import capability_corpus
    from crispedit.layers import resolve_layers

    model, tok = tiny_lm
    layers = resolve_layers(model, "model.layers.{1-2}.mlp.down_proj")
    f = collect_lm_kfac(model, tok, capability_corpus(None, 8), layers, max_len=64, batch_size=4, progress=False)
    _stored_eigenbasis_matches_float64(f, layers, device="cuda")


def hyperbolic_factors(d_out, d_in, seed=0):
    """Random orthogonal eigenbases with spectra whose masked top is a thin cross (reaches far along both
    axes, covers little area): what real K-FAC spectra look like."""
    g = torch.Generator().manual_seed(seed)
    U_out = torch.linalg.qr(torch.randn(d_out, d_out, generator=g, dtype=D))[0]
    U_in = torch.linalg.qr(torch.randn(d_in, d_in, generator=g, dtype=D))[0]
    lam_out = torch.cat([torch.tensor([50.0], dtype=D), torch.linspace(1.0, 0.5, d_out - 1, dtype=D)])
    lam_in = torch.cat([torch.tensor([50.0], dtype=D), torch.linspace(1.0, 0.5, d_in - 1, dtype=D)])
    return U_out, U_in, torch.outer(lam_out, lam_in)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("gamma", [0.78, 0.8])
def test_two_block_form_on_a_cross_shaped_mask(gamma, dtype, tol):
    # the masked set is the first row and the first column (plus the corner): the one-corner form would be
    # the whole matrix, the two-block form is two thin blocks -- and gives the full form's result
    from crispedit.curvature.masks import row_extents
    from crispedit.curvature.projection import staircase_projection_flops

    d_out, d_in = 40, 60
    U_out, U_in, ev = hyperbolic_factors(d_out, d_in)
    P = KroneckerProjector.from_eigenbasis(U_out, U_in, ev, gamma, dtype=dtype)
    F = KroneckerProjector(P.U_out, P.U_in, P.mask, dtype=dtype, form="full")
    assert P.r_out > 0.8 * d_out and P.r_in > 0.8 * d_in  # the bounding corner is nearly everything
    masked = P.mask == 0
    assert masked[0, : P.r_in].all() and masked[: P.r_out, 0].all() and masked.sum() < 2 * (d_out + d_in)
    assert P.low_rank and 0 < P.split < d_out and len(P._blocks) == 2
    one_corner = kronecker_projection_flops(d_out, d_in, d_out, d_in)[0]
    assert P.flops_low_rank < 0.25 * P.flops_full and P.flops_low_rank < 0.25 * one_corner
    low, full, split = staircase_projection_flops(d_out, d_in, row_extents(P.mask))
    assert (low, full, split) == (P.flops_low_rank, P.flops_full, P.split)
    Q = torch.randn(d_out, d_in, dtype=D)
    got, ref = P.project(Q.to(dtype)), F.project(Q.to(dtype))
    assert got.dtype == dtype and (got.double() - ref.double()).abs().max() <= tol * Q.abs().max()
    from torch.utils.flop_counter import FlopCounterMode

    corner = sum(keep.numel() for _, _, keep, _ in P._blocks)
    with FlopCounterMode(display=False) as fc:
        P.project(Q.to(dtype))
    assert fc.get_total_flops() == P.flops_low_rank - corner - d_out * d_in


def test_staircase_flops_scan_every_split():
    # brute force over every split and both GEMM orders per block, against the closed scan
    from crispedit.curvature.masks import row_extents
    from crispedit.curvature.projection import staircase_projection_flops

    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        d_out, d_in = int(torch.randint(2, 12, (1,), generator=g)), int(torch.randint(2, 12, (1,), generator=g))
        mask = (torch.rand(d_out, d_in, generator=g) > 0.3).double()
        e = row_extents(mask).tolist()
        nz = [i for i, x in enumerate(e) if x]
        low, full, split = staircase_projection_flops(d_out, d_in, row_extents(mask))
        if not nz:
            assert low == 0
            continue
        r_out = nz[-1] + 1

        def block(h, w, d_in=d_in, d_out=d_out):
            return 0 if h == 0 or w == 0 else 4 * min(h * d_in * (d_out + w), w * d_out * (d_in + h))

        best = min(
            block(R, max(e[:R], default=0))
            + block(r_out - R, max(e[R:r_out], default=0))
            + R * max(e[:R], default=0)
            + (r_out - R) * max(e[R:r_out], default=0)
            + d_out * d_in
            for R in range(r_out + 1)
        )
        assert low == best and full == 4 * d_out * d_in * (d_out + d_in) + d_out * d_in


def test_kronecker_keep_mask_equals_the_energy_rule_on_the_outer_product():
    """The sort-free mask of a Kronecker spectrum is the energy rule's mask of the materialised outer product:
    distinct values, ties and zeros (ranked by row-major position, as the stable sort ranks them), small and
    SmolLM2-sized spectra; unsorted input falls back to the general rule."""
    from crispedit.curvature.masks import kronecker_keep_mask

    gen = torch.Generator().manual_seed(0)
    cases = []
    for trial in range(60):
        m, n = int(torch.randint(1, 40, (), generator=gen)), int(torch.randint(1, 60, (), generator=gen))
        a = torch.rand(m, generator=gen, dtype=torch.float64) ** 3
        b = torch.rand(n, generator=gen, dtype=torch.float64) ** 3
        if trial % 3 == 0:
            a, b = torch.round(a * 4) / 4, torch.round(b * 4) / 4
        cases.append((a, b))
    for tied in (False, True):
        a, b = (
            torch.rand(576, generator=gen, dtype=torch.float64) ** 4,
            torch.rand(1536, generator=gen, dtype=torch.float64) ** 4,
        )
        if tied:
            a, b = torch.round(a * 50) / 50, torch.round(b * 50) / 50
        cases.append((a, b))
    for a, b in cases:
        a, b = a.sort(descending=True).values, b.sort(descending=True).values
        for gamma in (0.1, 0.5, 0.8, 0.99):
            assert torch.equal(kronecker_keep_mask(a, b, gamma), energy_keep_mask(torch.outer(a, b), gamma))
    a, b = torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64), torch.tensor([0.5, 2.0], dtype=torch.float64)
    assert torch.equal(kronecker_keep_mask(a, b, 0.6), energy_keep_mask(torch.outer(a, b), 0.6))


def test_per_source_mask_masks_gamma_of_each_sources_energy():
    """Each source's energy on the masked entries of the merged basis is at least γ of its total (exactly its
    curvature along those directions: tr(P (A ⊗ S)) summed from the dense Kronecker product), with a source
    100× larger than the other and one dominant direction; the single merged cut leaves the small one bare."""
    gamma = 0.8
    A1, S1 = rand_psd(6, seed=7), rand_psd(5, seed=8)
    g = torch.Generator().manual_seed(9)
    v = torch.randn(5, 1, generator=g, dtype=D)
    A2, S2 = 100 * rand_psd(6, seed=10), 100 * (rand_psd(5, seed=11) + 50 * v @ v.T)  # large, one outlier
    lam_in, U_in = eigh_psd(A1 + A2)
    lam_out, U_out = eigh_psd(S1 + S2)
    keep = per_source_keep_mask(U_out, U_in, [(A1, S1), (A2, S2)], gamma)
    assert keep.shape == (5, 6) and keep.dtype == torch.bool
    basis = torch.kron(U_in, U_out)  # column-major vec: columns = entries (i, j), j major
    masked = basis[:, ~keep.T.reshape(-1)]
    for A, S in ((A1, S1), (A2, S2)):
        G = torch.kron(A, S)
        assert torch.trace(masked.T @ G @ masked) >= gamma * torch.trace(G) * (1 - 1e-9)
    merged = KroneckerProjector.from_factors(A1 + A2, S1 + S2, gamma, dtype=torch.float64).mask.bool()
    assert (~keep).sum() > (~merged).sum()  # the union masks more than the merged cut
    Pm = basis[:, ~merged.T.reshape(-1)]
    G1 = torch.kron(A1, S1)
    assert torch.trace(Pm.T @ G1 @ Pm) < gamma * torch.trace(G1)  # which leaves the small source under γ
    P = KroneckerProjector(U_out, U_in, keep, dtype=torch.float64)
    torch.testing.assert_close(P.dense(), basis[:, keep.T.reshape(-1)] @ basis[:, keep.T.reshape(-1)].T)
    # one threshold per source: the intersection of each source's own cut, so a higher one masks more
    per = per_source_keep_mask(U_out, U_in, [(A1, S1), (A2, S2)], [gamma, 0.95])
    own = [per_source_keep_mask(U_out, U_in, [src], g) for src, g in (((A1, S1), gamma), ((A2, S2), 0.95))]
    assert torch.equal(per, own[0] & own[1]) and bool((keep | ~per).all()) and (~per).sum() > (~keep).sum()
    with pytest.raises(ValueError, match="1 energy thresholds for 2 sources"):
        per_source_keep_mask(U_out, U_in, [(A1, S1), (A2, S2)], [gamma])


def test_alternating_projector_tends_to_the_intersection_of_kept_subspaces():
    """Two Kronecker projectors in different eigenbases: the symmetric alternation is symmetric PSD with spectrum in
    [0, 1], never leaves the first part's kept subspace, and approaches the orthogonal projector onto the
    intersection of both kept subspaces (dense float64 ground truth) as the sweeps grow; its leak into the second
    part's masked directions shrinks with them."""
    from crispedit.curvature.projection import AlternatingProjector

    d_out, d_in, gamma = 4, 5, 0.6
    P1 = KroneckerProjector.from_factors(rand_psd(d_in, seed=20), rand_psd(d_out, seed=21), gamma, dtype=D)
    P2 = KroneckerProjector.from_factors(rand_psd(d_in, seed=22), rand_psd(d_out, seed=23), gamma, dtype=D)
    D1, D2 = P1.dense(), P2.dense()
    # the intersection of the two ranges: the null space of (I - D1) + (I - D2)
    n = d_out * d_in
    ev, U = torch.linalg.eigh(2 * torch.eye(n, dtype=D) - D1 - D2)
    inter = U[:, ev < 1e-9]
    assert inter.shape[1] == max(0, int(D1.trace().round() + D2.trace().round()) - n)  # general position
    exact = inter @ inter.T
    errors, leaks = [], []
    Q = rn(d_out, d_in)
    for sweeps in (1, 4, 64):
        T = AlternatingProjector([P1, P2], sweeps)
        M = T.dense()
        torch.testing.assert_close(M, M.T)
        lam = torch.linalg.eigvalsh(M)
        assert lam.min() > -1e-10 and lam.max() < 1 + 1e-10
        torch.testing.assert_close(D1 @ M, M)  # the first part is never leaked into
        errors.append(float(torch.linalg.matrix_norm(M - exact, 2)))
        leaks.append(T.leak(Q))
        assert leaks[-1][0] < 1e-20
    assert errors[0] > errors[1] > errors[2] and errors[2] < 1e-3
    assert leaks[0][1] > leaks[1][1] > leaks[2][1]
    T = AlternatingProjector([P1, P2], 2)
    assert T.kept_fraction == pytest.approx(max(0.0, P1.kept_fraction + P2.kept_fraction - 1))
    st = T.stats()
    assert (
        st["form"] == "alternating"
        and st["sweeps"] == 2
        and [p["kept_fraction"] for p in st["parts"]]
        == [
            round(P1.kept_fraction, 6),
            round(P2.kept_fraction, 6),
        ]
    )
    assert T.project(Q.float()).dtype == torch.float32
    with pytest.raises(ValueError, match="at least two parts"):
        AlternatingProjector([P1])
    with pytest.raises(ValueError, match="same weight shape"):
        AlternatingProjector([P1, KroneckerProjector.from_factors(rand_psd(3), rand_psd(d_out), gamma)])
    with pytest.raises(ValueError, match="sweeps must be at least 1"):
        AlternatingProjector([P1, P2], 0)
