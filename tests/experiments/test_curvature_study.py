"""Curvature study: the maths on tiny float64 networks against dense ground truth, the IDX reader,
user errors, and a quick end-to-end run of ``crispedit study mnist``."""

from __future__ import annotations

import csv
import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import SHARED
from crispedit.curvature.masks import eigh_psd, vec
from crispedit.curvature.projection import DenseProjector, KroneckerProjector
from crispedit.errors import CrispEditError
from crispedit.experiments import mnist_study
from crispedit.experiments.ekfac import collect_classifier_ekfac, collect_classifier_kfac, ekfac_eigenvalues
from crispedit.experiments.exact_curvature import (
    ParamLayout,
    bregman_divergence,
    ce_hessian_sqrt,
    ggn_matrix,
    hessian_matrix,
)
from crispedit.experiments.idx_data import load_dataset, load_idx
from crispedit.experiments.mnist_study import MnistStudyConfig, gamma_of
from crispedit.experiments.study_curvature import PARAMS, DenseCurvature

DATA = SHARED / "data" / "images"
D64 = torch.float64


class TinyCNN(nn.Module):
    """conv(1->2, 3x3) - ReLU - maxpool - conv(2->3, 3x3) - ReLU - fc(12->5) - ReLU - fc(5->4), bias-free."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, bias=False)
        self.conv2 = nn.Conv2d(2, 3, 3, bias=False)
        self.fc1 = nn.Linear(12, 5, bias=False)
        self.fc2 = nn.Linear(5, 4, bias=False)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.relu(self.conv2(x))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    model = TinyCNN().to(D64)
    X = torch.randn(7, 1, 10, 10, dtype=D64)
    Y = torch.randint(0, 4, (7,))
    return model, X, Y


def _full_loss(model, layout, X, Y):
    return lambda t: F.cross_entropy(torch.func.functional_call(model, layout.unflatten(t), (X,)), Y)


def test_layout_is_column_major_vec(tiny):
    model, _, _ = tiny
    layout = ParamLayout.of(model)
    theta = layout.params(model)
    assert theta.numel() == sum(p.numel() for p in model.parameters())
    sl = layout.slices()["fc1.weight"]
    assert torch.equal(theta[sl], vec(model.fc1.weight.detach()))
    sl = layout.slices()["conv2.weight"]
    assert torch.equal(theta[sl], vec(model.conv2.weight.detach().reshape(3, -1)))
    back = layout.unflatten(theta)
    for n, p in model.named_parameters():
        assert torch.equal(back[n], p.detach())


def test_ggn_equals_jacobian_products_assembled_by_hand(tiny):
    model, X, _ = tiny
    layout = ParamLayout.of(model)
    theta = layout.params(model)
    G = ggn_matrix(model, X, batch_size=3)
    ref = torch.zeros_like(G)
    for i in range(X.shape[0]):
        J = torch.autograd.functional.jacobian(
            lambda t, i=i: torch.func.functional_call(model, layout.unflatten(t), (X[i : i + 1],)).squeeze(0), theta
        )
        p = torch.softmax(torch.func.functional_call(model, layout.unflatten(theta), (X[i : i + 1],)).squeeze(0), -1)
        H = torch.diag(p) - torch.outer(p, p)
        ref += J.T @ H @ J
    ref /= X.shape[0]
    torch.testing.assert_close(G, ref, rtol=1e-10, atol=1e-13)
    logits = torch.randn(3, 4, dtype=D64)
    L, p = ce_hessian_sqrt(logits), torch.softmax(logits, -1)
    torch.testing.assert_close(L.transpose(1, 2) @ L, torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1))


def test_ggn_is_the_hessian_of_the_bregman_divergence(tiny):
    """Proposition 1 (appendix): D(theta0) = 0, grad D(theta0) = 0, hess D(theta0) = G, and
    D(theta0 + eps v) = eps^2/2 v^T G v + o(eps^2)."""
    model, X, Y = tiny
    layout = ParamLayout.of(model)
    theta0 = layout.params(model)
    D = lambda t: bregman_divergence(model, t, theta0, X, Y)  # noqa: E731
    G = ggn_matrix(model, X)
    assert abs(float(D(theta0))) < 1e-15
    assert float(torch.func.grad(D)(theta0).abs().max()) < 1e-15
    torch.testing.assert_close(torch.func.hessian(D)(theta0), G, rtol=1e-9, atol=1e-12)
    v = torch.randn_like(theta0)
    quad = 0.5 * float(v @ G @ v)
    for eps in (1e-2, 1e-3):
        assert abs(float(D(theta0 + eps * v)) / eps**2 - quad) < 50 * eps * quad
    # the full Hessian of the loss differs (theta0 is not a minimum): the residual is not zero
    H = torch.func.hessian(_full_loss(model, layout, X, Y))(theta0)
    assert float((H - G).norm()) > 1e-3 * float(G.norm())


def test_hessian_matrix_matches_autograd_with_and_without_linear_shortcut(tiny):
    model, X, Y = tiny
    layout = ParamLayout.of(model)
    ref = torch.func.hessian(_full_loss(model, layout, X, Y))(layout.params(model))
    torch.testing.assert_close(hessian_matrix(model, X, Y, batch_size=4, tangent_chunk=16), ref, rtol=1e-10, atol=1e-13)
    fast = hessian_matrix(model, X, Y, batch_size=4, tangent_chunk=16, linear_param="fc1.weight")
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("layer", ["fc1", "conv2"])
def test_activation_nullspace_is_in_gauss_newton_nullspace(layer):
    """Proposition 2: every dW with dW a = 0 for all layer inputs (rows / patches) satisfies
    G_l vec(dW) = 0, and the GGN nullspace is at least as large."""
    torch.manual_seed(1)
    model = TinyCNN().to(D64)
    X = torch.randn(2, 1, 10, 10, dtype=D64)  # 2 examples: fc1 sees 2 inputs in R^12, conv2 8 patches in R^18
    batches = [(X, torch.zeros(2, dtype=torch.long))]
    factors = collect_classifier_kfac(model, batches, [layer])
    A = factors.A[layer]
    lam = eigh_psd(A)[0]
    assert int((lam > 1e-10 * lam[0]).sum()) < A.shape[0]  # rank-deficient inputs
    proj = KroneckerProjector.from_activation_covariance(A, gamma=1 - 1e-12, dtype=D64)  # keeps exactly Null(A)
    W = getattr(model, layer).weight
    d_out = W.shape[0]
    layout = ParamLayout.of(model)
    sl = layout.slices()[f"{layer}.weight"]
    G = ggn_matrix(model, X)[sl, sl]
    g_scale = float(torch.linalg.eigvalsh(G)[-1])
    null_G = int((torch.linalg.eigvalsh(G) < 1e-10 * g_scale).sum())
    null_K = int(proj.mask.sum()) * d_out
    assert 0 < null_K <= null_G
    for _ in range(5):
        dW = proj.project(torch.randn(d_out, A.shape[0], dtype=D64))
        assert float(dW.norm()) > 0.1
        v = vec(dW)
        assert float((G @ v).norm()) < 1e-10 * g_scale * float(v.norm())


def test_kfac_matrix_free_projector_equals_explicit_projector(tiny):
    model, X, Y = tiny
    factors = collect_classifier_kfac(model, [(X[:4], Y[:4]), (X[4:], Y[4:])])
    for layer in ("conv1", "fc1"):
        A, S = factors.A[layer], factors.S[layer]
        for gamma in (0.5, 0.9, 0.999):
            mf = KroneckerProjector.from_factors(A, S, gamma, dtype=D64)
            explicit = DenseProjector.from_matrix(torch.kron(A, S), gamma)
            torch.testing.assert_close(mf.dense(), explicit.dense(), rtol=1e-8, atol=1e-10)
            assert mf.n_kept == explicit._kept


def test_kfac_is_exact_for_the_last_layer_at_uniform_predictions(tiny):
    """With the last layer at zero every example has the same output Hessian, so A (x) S equals the
    exact Gauss-Newton block: this pins the factor scaling (sum over classes, mean over examples)."""
    model, X, Y = tiny
    with torch.no_grad():
        model.fc2.weight.zero_()
    factors = collect_classifier_kfac(model, [(X, Y)], ["fc2"])
    sl = ParamLayout.of(model).slices()["fc2.weight"]
    G = ggn_matrix(model, X)[sl, sl]
    torch.testing.assert_close(torch.kron(factors.A["fc2"], factors.S["fc2"]), G, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("layer", ["conv1", "conv2", "fc1", "fc2"])
def test_ekfac_eigenvalues_are_the_ggn_diagonal_in_the_kronecker_eigenbasis(tiny, layer):
    model, X, Y = tiny
    batches = [(X[:3], Y[:3]), (X[3:], Y[3:])]
    ek = collect_classifier_ekfac(model, batches, [layer], per="example")
    sl = ParamLayout.of(model).slices()[f"{layer}.weight"]
    G = ggn_matrix(model, X)[sl, sl]
    B = torch.kron(ek.U_in[layer], ek.U_out[layer])  # vec(U_out E U_in^T) = (U_in (x) U_out) vec(E)
    diag = torch.diagonal(B.T @ G @ B)
    torch.testing.assert_close(vec(ek.eigvals[layer]), diag, rtol=1e-9, atol=1e-14)
    row = ekfac_eigenvalues(model, batches, ek.U_out, ek.U_in, per="row")[layer]
    if layer.startswith("fc"):  # one row per example: both definitions agree
        torch.testing.assert_close(row, ek.eigvals[layer], rtol=1e-10, atol=1e-15)
    # the EK-FAC projector uses the same matrix-free operator in that basis
    proj = ek.projector(layer, 0.9, dtype=D64)
    assert proj.dense().shape == G.shape


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["exact", "sampled"])
def test_ekfac_runs_where_the_model_is(tiny, mode):
    """A model on a GPU: the exact output gradients' identity, the bases and the sums go to its device (the
    result comes back on the CPU) and give the CPU's eigenvalues; sampled labels are drawn on the CPU from the
    seed, so the same ones."""
    model, X, Y = tiny
    batches = [(X[:3], Y[:3]), (X[3:], Y[3:])]
    ek = collect_classifier_ekfac(model, batches, ["fc1"], mode=mode)
    gpu = [(x.cuda(), y.cuda()) for x, y in batches]
    got = ekfac_eigenvalues(model.cuda(), gpu, ek.U_out, ek.U_in, mode=mode)["fc1"]
    assert got.device.type == "cpu"
    torch.testing.assert_close(got, ek.eigvals["fc1"], rtol=1e-9, atol=1e-14)


# --------------------------------------------------------------------------------------------
# data and user errors


def _write_idx(path: Path, arr: np.ndarray, truncate: int = 0) -> None:
    code = {np.uint8: 0x08}[arr.dtype.type]
    raw = bytes([0, 0, code, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    with gzip.open(path, "wb") as fh:
        fh.write(raw[: len(raw) - truncate])


def test_hessian_abs_masks_negative_curvature_that_the_clamped_hessian_keeps():
    # H = Q diag(4, 2, -3, 1e-6) Q^T. Clamped: spectrum (4, 2, 0, 1e-6), gamma = 0.7 masks 4 and 2 and
    # keeps the -3 direction as if flat. By |lambda|: (4, 3, 2, 1e-6), gamma = 0.7 of 9 masks 4 and -3.
    torch.manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(4, 4, dtype=D64))
    lam = torch.tensor([4.0, 2.0, -3.0, 1e-6], dtype=D64)
    H = Q @ torch.diag(lam) @ Q.T
    neg = Q[:, 2]
    clamped = DenseCurvature(H).projector(PARAMS, 0.7)
    absolute = DenseCurvature(H, absolute=True).projector(PARAMS, 0.7)
    P_c, P_a = clamped.dense(), absolute.dense()
    torch.testing.assert_close(P_c @ neg, neg)  # kept: counted as flat
    torch.testing.assert_close(P_c @ Q[:, 1], torch.zeros_like(neg), atol=1e-12, rtol=0)
    torch.testing.assert_close(P_a @ neg, torch.zeros_like(neg), atol=1e-12, rtol=0)  # masked
    torch.testing.assert_close(P_a @ Q[:, 0], torch.zeros_like(neg), atol=1e-12, rtol=0)
    torch.testing.assert_close(P_a @ Q[:, 1], Q[:, 1])
    torch.testing.assert_close(P_a @ Q[:, 3], Q[:, 3])
    assert clamped._kept == absolute._kept == 2


def test_idx_reader_and_its_errors(tmp_path):
    imgs = (np.arange(3 * 28 * 28) % 256).astype(np.uint8).reshape(3, 28, 28)
    _write_idx(tmp_path / "imgs.gz", imgs)
    assert np.array_equal(load_idx(tmp_path / "imgs.gz"), imgs)
    _write_idx(tmp_path / "short.gz", imgs, truncate=10)
    with pytest.raises(CrispEditError, match="truncated"):
        load_idx(tmp_path / "short.gz")
    (tmp_path / "cut.gz").write_bytes((tmp_path / "imgs.gz").read_bytes()[:40])
    with pytest.raises(CrispEditError):
        load_idx(tmp_path / "cut.gz")
    with pytest.raises(CrispEditError, match="not found"):
        load_idx(tmp_path / "nope.gz")
    with pytest.raises(CrispEditError, match="data directory not found"):
        load_dataset("mnist", "test", tmp_path / "missing")
    with pytest.raises(CrispEditError, match="lacks"):
        load_dataset("mnist", "test", tmp_path)
    # a complete directory: 3 test images
    d = tmp_path / "mnist"
    d.mkdir()
    for split, n in (("train", 3), ("t10k", 3)):
        _write_idx(d / f"{split}-images-idx3-ubyte.gz", imgs[:n])
        _write_idx(d / f"{split}-labels-idx1-ubyte.gz", np.array([1, 2, 3], dtype=np.uint8))
    data = load_dataset("mnist", "test", tmp_path)
    assert data.images.shape == (3, 1, 28, 28) and data.labels.tolist() == [1, 2, 3]
    assert float(data.images.max()) <= 1.0


def test_config_rejects_bad_input():
    with pytest.raises(CrispEditError, match="k values"):
        MnistStudyConfig(k_values=(0.0,))
    with pytest.raises(CrispEditError, match="gamma"):
        MnistStudyConfig(k_values=(20.0,))  # 1 - 1e-20 == 1.0 in float64
    with pytest.raises(CrispEditError, match="unknown method"):
        MnistStudyConfig(methods=("hessian", "adam"))
    assert gamma_of(2) == pytest.approx(0.99)
    assert MnistStudyConfig().k_values[0] == 0.1


def test_cli_bad_arguments_are_one_line_errors(tmp_path, capsys):
    from crispedit import cli

    rc = cli.main(["study", "mnist", "--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "data directory not found" in err
    rc = cli.main(["study", "mnist", "--k-values", "1,x", "--out", str(tmp_path / "o")])
    assert rc == 2 and "--k-values" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------------------------
# end to end


@pytest.mark.skipif(not (DATA / "mnist").is_dir(), reason="needs ../shared/data/images")
def test_quick_study_end_to_end_through_the_cli(tmp_path, capsys):
    from crispedit import cli

    out = tmp_path / "study"
    argv = ["study", "mnist", "--quick", "--data", str(DATA), "--out", str(out), "--k-values", "2", "--quiet"]
    assert "crispedit.cli.mnist" in cli._COMMAND_MODULES
    rc = cli.main(argv)
    assert rc == 0
    printed = capsys.readouterr().out
    assert str(out / "tradeoff.png") in printed and "hessian" in printed
    report = json.loads((out / "results.json").read_text())
    assert report["complete"] and report["config"]["k_values"] == [2.0]
    methods = [r["method"] for r in report["rows"]]
    assert methods[0] == "pretrained" and set(methods[1:]) == set(mnist_study.METHODS)
    n = report["network"]["parameters"]
    for r in report["rows"]:
        assert 0.0 <= r["mnist_acc"] <= 1.0 and 0.0 <= r["fashion_acc"] <= 1.0
        if r["method"] not in ("none", "pretrained"):
            assert r["gamma"] == pytest.approx(0.99) and 0 < r["kept_dims"] < n
    with open(out / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    assert len(table) == len(report["rows"]) and table[0]["method"] == "pretrained"
    assert (out / "tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "results.partial.json").exists()
