"""Predicted KL drift from the K-FAC factors (``summary.kl_predicted``) and the ``--max-drift`` trust region."""

import json

import pytest
import torch

from crispedit.cli import main
from crispedit.curvature.kfac import collect_lm_kfac
from crispedit.curvature.predicted import DriftBudget, layer_predicted_kl, predicted_kl
from crispedit.data import EditRequest, capability_corpus
from crispedit.editing import EditConfig, edit
from crispedit.editing.api import capability_factors
from crispedit.errors import CrispEditError
from crispedit.evaluation import kl_drift
from crispedit.models import resolve_layers

REQS = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}") for i in range(4)]
LAYERS = "model.layers.{1-2}.mlp.down_proj"


def cfg(method="crispedit", **kw):
    base = dict(method=method, layers=LAYERS, epochs=20, lr=1e-2, batch_size=4, n_cap=6, max_len=48, gamma=0.8)
    base.update(kw)
    return EditConfig(**base)


def kron_form(dW, A, S):
    """½ vec(ΔW)ᵀ (A ⊗ S) vec(ΔW), column-major vec, straight from the definition (float64)."""
    v = dW.double().T.reshape(-1)            # column-major vec of a d_out x d_in matrix
    return 0.5 * float(v @ torch.kron(A.double(), S.double()) @ v)


def spd(n, g):
    x = torch.randn(n, n + 3, generator=g, dtype=torch.float64)
    return x @ x.T / n


def test_layer_form_equals_kronecker_definition():
    g = torch.Generator().manual_seed(0)
    A, S, dW = spd(5, g), spd(3, g), torch.randn(3, 5, generator=g, dtype=torch.float64)
    assert layer_predicted_kl(dW, A, S) == pytest.approx(kron_form(dW, A, S), rel=1e-12)
    assert layer_predicted_kl(dW, A, S) != pytest.approx(kron_form(dW.T.reshape(3, 5), A, S), rel=1e-3)  # orientation matters
    with pytest.raises(ValueError):
        layer_predicted_kl(dW.T, A, S)


def test_edit_reports_prediction_equal_to_direct_kron(tiny_lm, iso_cache):
    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    factors, _ = capability_factors(model, tok, layers, cfg(), progress=False)
    res = edit(model, tok, REQS, cfg(), progress=False)
    direct = {n: kron_form(m.weight.detach() - res.original_weights[f"{n}.weight"], factors.A[n], factors.S[n])
              for n, m in layers.items()}
    assert set(res.kl_predicted["layers"]) == set(layers)
    for n in layers:
        assert res.kl_predicted["layers"][n] == pytest.approx(direct[n], rel=1e-6)
    assert res.kl_predicted["total"] == pytest.approx(sum(direct.values()), rel=1e-6) and res.kl_predicted["total"] > 0
    assert res.drift_budget is None


def test_prediction_for_ft_only_when_asked_and_never_for_lora(tiny_lm, iso_cache):
    model, tok = tiny_lm
    res = edit(model, tok, REQS, cfg("ft", epochs=2), progress=False)
    assert res.kl_predicted is None and res.cache_info == {}
    from crispedit.editing import restore

    restore(model, res.original_weights)
    res = edit(model, tok, REQS, cfg("ft", epochs=2), progress=False, predict_drift=True)
    assert res.kl_predicted["total"] > 0
    restore(model, res.original_weights)
    res = edit(model, tok, REQS, cfg("lora", epochs=2), progress=False, predict_drift=True)
    assert res.kl_predicted is None and res.cache_info == {}   # q/v projections: no factors, none collected


def test_small_change_prediction_approaches_measured_kl(tiny_lm):
    """Sampled-label factors approximate the Fisher: for a small random change the quadratic prediction is
    close to the measured mean per-token KL on the same text (K-FAC's Kronecker factorisation is the gap)."""
    model, tok = tiny_lm
    texts = capability_corpus(None, 24)
    layers = resolve_layers(model, LAYERS)
    factors = collect_lm_kfac(model, tok, texts, layers, max_len=64, label_mode="sampled", progress=False)
    before = {f"{n}.weight": m.weight.detach().clone() for n, m in layers.items()}
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in layers.values():
            m.weight.add_(3e-3 * torch.randn(m.weight.shape, generator=g))
    pred = predicted_kl(layers, factors, before)["total"]
    meas = kl_drift(model, tok, texts, base_weights=before, max_len=64, progress=False)["kl_drift"]
    assert meas > 0
    assert 0.7 < pred / meas < 1.4, (pred, meas)
