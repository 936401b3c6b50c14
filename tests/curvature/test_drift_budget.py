"""Predicted KL drift from the K-FAC factors (``summary.kl_predicted``) and the ``--max-drift`` trust region."""

import json

import pytest
import torch

from crispedit.cli import main
from crispedit.curvature.factors import KFACFactors
from crispedit.curvature.kfac import collect_lm_kfac
from crispedit.curvature.predicted import (
    DriftBudget,
    layer_predicted_kl,
    mixing_layers,
    mixing_note,
    predicted_kl,
    prediction_notes,
)
from crispedit.data import EditRequest, capability_corpus
from crispedit.editing import EditConfig, edit
from crispedit.editing.api import capability_factors
from crispedit.errors import CrispEditError
from crispedit.evaluation import kl_drift
from crispedit.layers import resolve_layers
from crispedit.pipeline import steep_layers

REQS = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}") for i in range(4)]
LAYERS = "model.layers.{1-2}.mlp.down_proj"


def cfg(method="crispedit", **kw):
    base = dict(method=method, layers=LAYERS, epochs=20, lr=1e-2, batch_size=4, n_cap=6, max_len=48, gamma=0.8)
    base.update(kw)
    return EditConfig(**base)


def kron_form(dW, A, S):
    """½ vec(ΔW)ᵀ (A ⊗ S) vec(ΔW), column-major vec, straight from the definition (float64)."""
    v = dW.double().T.reshape(-1)  # column-major vec of a d_out x d_in matrix
    return 0.5 * float(v @ torch.kron(A.double(), S.double()) @ v)


def spd(n, g):
    x = torch.randn(n, n + 3, generator=g, dtype=torch.float64)
    return x @ x.T / n


def test_layer_form_equals_kronecker_definition():
    g = torch.Generator().manual_seed(0)
    A, S, dW = spd(5, g), spd(3, g), torch.randn(3, 5, generator=g, dtype=torch.float64)
    assert layer_predicted_kl(dW, A, S) == pytest.approx(kron_form(dW, A, S), rel=1e-12)
    # orientation matters
    assert layer_predicted_kl(dW, A, S) != pytest.approx(kron_form(dW.T.reshape(3, 5), A, S), rel=1e-3)
    with pytest.raises(ValueError):
        layer_predicted_kl(dW.T, A, S)


def test_edit_reports_prediction_equal_to_direct_kron(tiny_lm, iso_cache):
    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    factors, _ = capability_factors(model, tok, layers, cfg(), progress=False)
    res = edit(model, tok, REQS, cfg(), progress=False)
    direct = {
        n: kron_form(m.weight.detach() - res.original_weights[f"{n}.weight"], factors.A[n], factors.S[n])
        for n, m in layers.items()
    }
    assert set(res.kl_predicted["layers"]) == set(layers)
    for n in layers:
        assert res.kl_predicted["layers"][n] == pytest.approx(direct[n], rel=1e-6)
    assert res.kl_predicted["blockdiag"] == pytest.approx(sum(direct.values()), rel=1e-6)
    coherent = sum(v**0.5 for v in direct.values()) ** 2
    assert res.kl_predicted["total"] == pytest.approx(coherent, rel=1e-6) and res.kl_predicted["total"] > 0
    assert res.kl_predicted["blockdiag"] <= res.kl_predicted["total"] <= len(direct) * res.kl_predicted["blockdiag"]
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
    assert res.kl_predicted is None and res.cache_info == {}  # q/v projections: no factors, none collected


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
    pred = predicted_kl(layers, factors, before)
    meas = kl_drift(model, tok, texts, base_weights=before, max_len=64, progress=False)["kl_drift"]
    assert meas > 0
    # independent random changes per layer: the cross-layer terms average out, the block-diagonal sum holds
    assert 0.7 < pred["blockdiag"] / meas < 1.4, (pred, meas)
    assert pred["total"] >= pred["blockdiag"]


# ---------------------------------------------------------------------------------------------
# --max-drift


def test_budget_unit_scales_every_layer_by_one_factor():
    g = torch.Generator().manual_seed(0)
    mods = {n: torch.nn.Linear(5, 3, bias=False) for n in ("a", "b")}
    factors = KFACFactors({n: spd(5, g).float() for n in mods}, {n: spd(3, g).float() for n in mods}, 1)
    params = {n: m.weight for n, m in mods.items()}
    w0 = {n: p.detach().clone() for n, p in params.items()}
    budget = DriftBudget(params, mods, factors, eps=1e-3)
    with torch.no_grad():
        for p in params.values():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    d = {n: params[n].detach() - w0[n] for n in params}
    pred = sum(kron_form(d[n], factors.A[n], factors.S[n]) ** 0.5 for n in params) ** 2  # coherent bound
    assert pred > 1e-3 and budget.enforce()
    c = (1e-3 / pred) ** 0.5
    for n, p in params.items():
        assert torch.allclose(p.detach() - w0[n], c * d[n], atol=1e-6)
    assert sum(
        kron_form(params[n].detach() - w0[n], factors.A[n], factors.S[n]) ** 0.5 for n in params
    ) ** 2 == pytest.approx(1e-3, rel=1e-4)
    assert not budget.enforce() and budget.to_json()["hits"] == 1 and budget.to_json()["steps"] == 2


@pytest.mark.parametrize("method", ["crispedit", "adam-nscl", "ft", "locbf-ft"])
def test_max_drift_keeps_the_predicted_drift_within_budget(method, tiny_lm, iso_cache):
    """Every fine-tuning method holds the budget; ft and locbf-ft (no curvature of their own) are measured with
    the capability factors fetched as ``predict_drift`` fetches them."""
    from crispedit.editing import restore

    model, tok = tiny_lm
    free = edit(model, tok, REQS, cfg(method), progress=False, predict_drift=True)
    free_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    restore(model, free.original_weights)
    eps = free.kl_predicted["total"] / 10
    res = edit(model, tok, REQS, cfg(method, max_drift=eps), progress=False)
    assert res.drift_budget["hit"] and res.drift_budget["hits"] >= 1 and res.drift_budget["max_drift"] == eps
    assert res.drift_budget["final_predicted"] <= eps * 1.001 and res.kl_predicted["total"] <= eps * 1.001
    assert res.kl_predicted["total"] >= eps * 0.5  # the edit still uses its budget
    restore(model, res.original_weights)
    loose = edit(model, tok, REQS, cfg(method, max_drift=1e3), progress=False)
    assert not loose.drift_budget["hit"] and loose.drift_budget["hits"] == 0
    assert all(torch.equal(p, free_weights[n]) for n, p in model.named_parameters())  # a slack budget changes nothing


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(max_drift=0), "max drift (--max-drift) must be positive"),
        (dict(max_drift=float("nan")), "must be a finite number"),
        (dict(max_drift=0.1, method="memit"), "memit writes its change in one pass"),
        (dict(drift_penalty=1.0, method="mend"), "mend writes its change in one pass"),
    ],
)
def test_max_drift_validation(kw, msg):
    with pytest.raises(CrispEditError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        EditConfig(**kw)


@pytest.mark.parametrize("method", ["crispedit", "adam-nscl", "ft", "lora", "locbf-ft"])
def test_every_fine_tuning_method_takes_the_budget_and_the_penalty(method):
    assert EditConfig(method=method, max_drift=0.1, drift_penalty=1.0).max_drift == 0.1


def test_ft_budget_fetches_the_factors_and_the_penalty_runs(tiny_lm, iso_cache):
    """``ft`` with ``max_drift`` collects the capability factors of its edit layers itself (as ``predict_drift``
    does) and ends with the predicted drift within the budget; with ``drift_penalty`` it trains edit loss +
    β · predicted drift and lands with less predicted drift than plain ft."""
    from crispedit.editing import restore

    model, tok = tiny_lm
    res = edit(model, tok, REQS, cfg("ft", max_drift=0.05), progress=False)
    assert res.cache_info["hit"] is False and res.kl_predicted is not None  # fetched without predict_drift
    assert res.drift_budget["hit"] and res.drift_budget["final_predicted"] <= 0.05 * 1.001
    assert res.kl_predicted["total"] <= 0.05 * 1.001
    restore(model, res.original_weights)
    plain = edit(model, tok, REQS, cfg("ft", epochs=40), progress=False, predict_drift=True)
    restore(model, plain.original_weights)
    pen = edit(model, tok, REQS, cfg("ft", epochs=40, drift_penalty=1.0), progress=False)
    assert pen.cache_info["hit"] is True and pen.drift_budget["drift_penalty"] == 1.0 and pen.drift_budget["hits"] == 0
    assert pen.kl_predicted["total"] < 0.8 * plain.kl_predicted["total"]
    assert pen.history.epoch_loss[-1] < 0.5 * pen.history.epoch_loss[0]


def test_lora_budget_acts_on_the_merged_update(tiny_lm, iso_cache):
    """LoRA's budget is measured on its merged update (alpha/r)·B·A of the adapted q/v projections with their
    capability factors: the merged change predicts at most the budget; the penalty lowers the prediction."""
    from crispedit.editing import restore

    model, tok = tiny_lm
    torch.manual_seed(0)
    free = edit(model, tok, REQS, cfg("lora", lr=5e-3, max_drift=1e6), progress=False)
    assert set(free.kl_predicted["layers"]) == {
        f"model.layers.{i}.self_attn.{p}" for i in (1, 2) for p in ("q_proj", "v_proj")
    }
    assert not free.drift_budget["hit"] and free.kl_predicted["total"] > 0
    assert set(free.kl_predicted["layers"]) == set(mixing_layers(free.kl_predicted["layers"]))  # the under-read note
    restore(model, free.original_weights)
    eps = free.kl_predicted["total"] / 10
    torch.manual_seed(0)
    res = edit(model, tok, REQS, cfg("lora", lr=5e-3, max_drift=eps), progress=False)
    assert (
        res.drift_budget["hit"] and res.kl_predicted["total"] <= eps * 1.001 and res.kl_predicted["total"] >= eps * 0.5
    )
    assert not [n for n, _ in model.named_modules() if "lora_" in n]  # merged: no adapter left
    restore(model, res.original_weights)
    torch.manual_seed(0)
    pen = edit(model, tok, REQS, cfg("lora", lr=5e-3, drift_penalty=1.0), progress=False)
    assert pen.kl_predicted["total"] < 0.8 * free.kl_predicted["total"]


def test_low_rank_budget_pulls_back_and_differentiates_through_the_product():
    """:class:`LowRankDriftBudget`: ΔW = s·B·A; the pull-back scales B so that ΔW is scaled exactly, and the
    penalty gradients of A and B are the chain rule of ∂p/∂ΔW (checked against autograd)."""
    from crispedit.curvature.predicted import LowRankDriftBudget

    g = torch.Generator().manual_seed(5)
    mods = {n: torch.nn.Linear(5, 3, bias=False) for n in ("a", "b")}
    factors = KFACFactors({n: spd(5, g).float() for n in mods}, {n: spd(3, g).float() for n in mods}, 1)
    ad = {
        n: (torch.nn.Parameter(torch.randn(2, 5, generator=g)), torch.nn.Parameter(torch.randn(3, 2, generator=g)), 1.5)
        for n in mods
    }
    budget = LowRankDriftBudget(ad, mods, factors, eps=1e-3, penalty=2.0)
    dW = {n: 1.5 * (b @ a).detach() for n, (a, b, _) in ad.items()}
    pred = sum(kron_form(dW[n], factors.A[n], factors.S[n]) ** 0.5 for n in mods) ** 2
    assert budget.predicted() == pytest.approx(pred, rel=1e-5)
    a_, b_ = (
        {n: a.detach().clone().requires_grad_(True) for n, (a, _, _) in ad.items()},
        {n: b.detach().clone().requires_grad_(True) for n, (_, b, _) in ad.items()},
    )
    q = [0.5 * ((factors.S[n] @ (1.5 * b_[n] @ a_[n])) * ((1.5 * b_[n] @ a_[n]) @ factors.A[n])).sum() for n in mods]
    (sum(x.sqrt() for x in q) ** 2).backward()
    for a, b, _ in ad.values():
        a.grad, b.grad = torch.zeros_like(a), torch.zeros_like(b)
    assert budget.add_penalty_gradient() == pytest.approx(pred, rel=1e-5)
    for n, (a, b, _) in ad.items():
        assert torch.allclose(a.grad, 2.0 * a_[n].grad, rtol=1e-4, atol=1e-6)
        assert torch.allclose(b.grad, 2.0 * b_[n].grad, rtol=1e-4, atol=1e-6)
    assert pred > 1e-3 and budget.enforce()
    c = (1e-3 / pred) ** 0.5
    for n, (a, b, _) in ad.items():
        assert torch.allclose(1.5 * (b @ a).detach(), c * dW[n], rtol=1e-5, atol=1e-7)
    assert budget.predicted() == pytest.approx(1e-3, rel=1e-4) and budget.to_json()["hits"] == 1


@pytest.mark.parametrize("method", ["ft", "lora"])
def test_session_of_a_method_without_curvature_spends_its_budget(method, tmp_path, tiny_model_dir, monkeypatch):
    """An ft (or LoRA) session with a budget stores the capability factors it is measured with (of the edit
    layers; LoRA: of its q/v projections) and holds each round within what is left."""
    from crispedit.editing import SeqConfig
    from crispedit.sessions.session import Session

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    base = dict(
        method=method, layers=LAYERS, epochs=20, lr=1e-2 if method == "ft" else 5e-3, batch_size=4, n_cap=6, max_len=48
    )
    s = Session.create(tmp_path / "s", str(tiny_model_dir), SeqConfig(edit={**base, "max_drift": 0.02}), progress=False)
    assert (tmp_path / "s" / "cap_factors-0000.safetensors").is_file()
    a = s.add(REQS[:2], plot=False)
    assert a["drift_budget"]["hit"] and a["kl_predicted_round"] <= 0.02 * 1.001
    assert a["drift_budget"]["final_predicted"] <= 0.02 * 1.001
    plain = Session.create(tmp_path / "p", str(tiny_model_dir), SeqConfig(edit=base), progress=False)
    assert not (tmp_path / "p" / "cap_factors-0000.safetensors").exists()  # no budget: nothing fetched (as before)
    assert plain.add(REQS[:2], plot=False)["kl_predicted"] is None


def test_session_budget_is_spent_round_by_round(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from crispedit.editing import SeqConfig
    from crispedit.sessions.session import Session

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    rounds = [REQS[:2], REQS[2:]]
    base = dict(method="crispedit", layers=LAYERS, epochs=20, lr=1e-2, batch_size=4, n_cap=6, max_len=48)
    free = Session.create(tmp_path / "free", str(tiny_model_dir), SeqConfig(edit=base), progress=False)
    r1 = free.add(rounds[0], plot=False)
    assert r1["kl_predicted"] == pytest.approx(r1["kl_predicted_round"]) and r1["kl_predicted"] > 0
    budget = r1["kl_predicted"] * 0.6  # round 1 alone would overspend it
    s = Session.create(
        tmp_path / "s", str(tiny_model_dir), SeqConfig(edit={**base, "max_drift": budget}), progress=False
    )
    a = s.add(rounds[0], plot=False)
    assert a["drift_budget"]["hit"] and a["kl_predicted_round"] <= budget * 1.001
    assert a["drift_budget"]["spent_before"] == 0 and a["drift_budget"]["round_budget"] == budget
    st = s.status()["drift_budget"]
    assert st["spent"] == pytest.approx(a["kl_predicted_round"]) and st["remaining"] == pytest.approx(
        budget - st["spent"]
    )
    assert main(["session", "status", str(tmp_path / "s")]) == 0
    assert "drift budget (whole session)" in capsys.readouterr().out
    with pytest.raises(CrispEditError, match="drift budget is spent"):
        s.add(rounds[1], plot=False)  # the first round used all of it
    assert s.round == 1


def test_session_round_records_steep_layers_and_status_names_them(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """Each session round records ``steep_layers`` of the change since the base (the rule of the edit report);
    ``session status`` prints the last round's as notes."""
    from crispedit.editing import SeqConfig
    from crispedit.sessions import sequential
    from crispedit.sessions.session import Session

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    base = dict(method="crispedit", layers=LAYERS, epochs=5, lr=1e-2, batch_size=4, n_cap=6, max_len=48)
    seen = []

    def spy(layers):
        """Record the per-layer predictions the round passes; claim the first layer is steep so that the note shows."""
        seen.append(dict(layers))
        return [{"layer": next(iter(layers)), "predicted": 0.5, "share": 0.9, "vs_median": 40.0}]

    monkeypatch.setattr(sequential, "steep_layers", spy)
    s = Session.create(tmp_path / "s", str(tiny_model_dir), SeqConfig(edit=base), progress=False)
    r = s.add(REQS[:2], plot=False)
    assert set(seen[0]) == set(resolve_layers_names()) and all(v >= 0 for v in seen[0].values())
    assert r["steep_layers"][0]["share"] == 0.9 and s.status()["rounds"][-1]["steep_layers"] == r["steep_layers"]
    assert main(["session", "status", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "note: model.layers.1.mlp.down_proj predicts 90% of the drift (0.5 nats/token, 40x" in out


def test_session_budget_second_round_gets_the_rest(tmp_path, tiny_model_dir, monkeypatch):
    from crispedit.editing import SeqConfig
    from crispedit.sessions.session import Session

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    base = dict(method="crispedit", layers=LAYERS, epochs=20, lr=1e-2, batch_size=4, n_cap=6, max_len=48)
    s = Session.create(tmp_path / "s", str(tiny_model_dir), SeqConfig(edit={**base, "max_drift": 1e3}), progress=False)
    a = s.add(REQS[:2], plot=False)
    b = s.add(REQS[2:], plot=False)
    assert b["drift_budget"]["spent_before"] == pytest.approx(a["kl_predicted_round"])
    assert b["drift_budget"]["round_budget"] == pytest.approx(1e3 - a["kl_predicted_round"])
    assert s.status()["drift_budget"]["spent"] == pytest.approx(a["kl_predicted_round"] + b["kl_predicted_round"])
    # from the base vs own
    assert b["kl_predicted"] > 0 and b["kl_predicted"] != pytest.approx(b["kl_predicted_round"])


def test_cli_edit_reports_prediction_and_budget(tmp_path, tiny_model_dir, iso_cache, capsys):
    edits = tmp_path / "e.json"
    edits.write_text(json.dumps([r.to_json() for r in REQS]))
    common = [
        "edit",
        "--model",
        str(tiny_model_dir),
        "--edits",
        str(edits),
        "--layers",
        LAYERS,
        "--n-cap",
        "6",
        "--max-len",
        "48",
        "--epochs",
        "10",
        "--lr",
        "1e-2",
        "--batch-size",
        "4",
        "--no-wild",
        "--quiet",
    ]
    assert main(common + ["--out", str(tmp_path / "a")]) == 0
    s = json.loads((tmp_path / "a" / "edit_report.json").read_text())["summary"]
    assert s["kl_predicted"] > 0 and set(s["kl_predicted_layers"]) == set(resolve_layers_names())
    assert sum(s["kl_predicted_layers"].values()) == pytest.approx(s["kl_predicted_blockdiag"], rel=1e-4)
    assert sum(v**0.5 for v in s["kl_predicted_layers"].values()) ** 2 == pytest.approx(s["kl_predicted"], rel=1e-4)
    assert s["steep_layers"] == steep_layers(s["kl_predicted_layers"])
    eps = s["kl_predicted"] / 4
    assert main(common + ["--out", str(tmp_path / "b"), "--max-drift", str(eps)]) == 0
    out = capsys.readouterr().out
    b = json.loads((tmp_path / "b" / "edit_report.json").read_text())["summary"]
    assert b["drift_budget"]["hit"] and b["kl_predicted"] <= eps * 1.001 and "drift budget" in out
    assert json.loads((tmp_path / "b" / "edit_report.json").read_text())["config"]["max_drift"] == eps


def test_cli_ft_with_a_budget_and_a_penalty(tmp_path, tiny_model_dir, iso_cache, capsys):
    """``crispedit edit --method ft --max-drift EPS`` (no --predict-drift) fetches the factors, ends within the
    budget (``summary.drift_budget.final_predicted`` and ``kl_predicted`` <= EPS) and prints the budget line;
    ``--drift-penalty`` runs for ft too."""
    edits = tmp_path / "e.json"
    edits.write_text(json.dumps([r.to_json() for r in REQS]))
    common = [
        "edit",
        "--model",
        str(tiny_model_dir),
        "--edits",
        str(edits),
        "--layers",
        LAYERS,
        "--n-cap",
        "6",
        "--max-len",
        "48",
        "--epochs",
        "10",
        "--lr",
        "1e-2",
        "--batch-size",
        "4",
        "--no-wild",
        "--quiet",
        "--method",
        "ft",
    ]
    assert main(common + ["--out", str(tmp_path / "b"), "--max-drift", "0.05"]) == 0
    out = capsys.readouterr().out
    s = json.loads((tmp_path / "b" / "edit_report.json").read_text())["summary"]
    assert s["drift_budget"]["hit"] and s["drift_budget"]["final_predicted"] <= 0.05 * 1.001
    assert s["kl_predicted"] <= 0.05 * 1.001 and "drift budget 0.05: hit" in out
    assert main(common + ["--out", str(tmp_path / "p"), "--drift-penalty", "1"]) == 0
    p = json.loads((tmp_path / "p" / "edit_report.json").read_text())["summary"]
    assert p["drift_budget"]["drift_penalty"] == 1.0 and p["kl_predicted"] > 0


def resolve_layers_names():
    return [f"model.layers.{i}.mlp.down_proj" for i in (1, 2)]


def test_edit_matrix_records_kl_pred(tmp_path):
    """benchmarks/edit_matrix.py's table carries kl_pred, its ratio and budget hits; the .pred.png is drawn."""
    from conftest import load_script

    em = load_script("benchmarks/edit_matrix.py")
    row = dict(
        run="method=crispedit",
        rel=1.0,
        gen=0.5,
        wild={},
        kl_drift=0.002,
        kl_predicted=0.003,
        epochs=3,
        edit_seconds=1.0,
        drift_budget={"max_drift": 0.003, "hits": 4, "steps": 9, "hit": True},
    )
    ft = dict(row, run="method=ft", kl_predicted=None, drift_budget=None)
    em.write_outputs(tmp_path / "m.json", {"title": "t", "results": [row, ft]})
    md = (tmp_path / "m.md").read_text().splitlines()
    head = [c.strip() for c in md[0].split("|")]
    cells = dict(zip(head, [c.strip() for c in md[2].split("|")]))
    assert cells["kl_pred"] == "0.00300" and cells["pred/meas"] == "1.50" and cells["budget_hits"] == "4/9"
    assert dict(zip(head, [c.strip() for c in md[3].split("|")]))["kl_pred"] == "–"
    assert (tmp_path / "m.pred.png").read_bytes()[:4] == b"\x89PNG"


def test_edit_matrix_runs_set_a_methods_own_options():
    """``options.NAME=VALUE`` in a run goes to the method's own config (``EditConfig.options``), which validates it."""
    from conftest import load_script
    from crispedit import EditConfig

    em = load_script("benchmarks/edit_matrix.py")
    runs = em.parse_runs("method=ultraedit;options.lr=0.001;options.ridge=2|method=crispedit;gamma=0.9")
    assert runs == [
        {"method": "ultraedit", "options": {"lr": 0.001, "ridge": 2}},
        {"method": "crispedit", "gamma": 0.9},
    ]
    cfg = EditConfig(**runs[0])
    assert cfg.method_config.lr == 0.001 and cfg.method_config.ridge == 2


def test_penalty_gradient_is_the_gradient_of_the_coherent_prediction():
    """``add_penalty_gradient`` adds β·∂p/∂W of the coherent bound p = (Σ_l sqrt(q_l))² — checked against
    autograd (float64 weights and factors; the accumulated change is taken in float32 as in training; one
    layer stored transposed, as GPT-2's Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    g = torch.Generator().manual_seed(3)
    lin, conv = torch.nn.Linear(5, 3, bias=False).double(), Conv1D(3, 4).double()  # Conv1D(nf=d_out, nx=d_in)
    mods = {"a": lin, "b": conv}
    params = {n: m.weight for n, m in mods.items()}
    factors = KFACFactors({"a": spd(5, g), "b": spd(4, g)}, {"a": spd(3, g), "b": spd(3, g)}, 1)
    budget = DriftBudget(params, mods, factors, None, penalty=2.5)
    budget.curvature = factors.on({n: "cpu" for n in factors.A}, torch.float64)  # float64 throughout for the comparison
    budget.start = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    w = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    da, db = w["a"] - budget.start["a"], (w["b"] - budget.start["b"]).T
    q = [
        0.5 * ((factors.S["a"] @ da) * (da @ factors.A["a"])).sum(),
        0.5 * ((factors.S["b"] @ db) * (db @ factors.A["b"])).sum(),
    ]
    total = sum(x.sqrt() for x in q) ** 2
    total.backward()
    for p in params.values():
        p.grad = torch.zeros_like(p)
    p_value = budget.add_penalty_gradient()
    assert p_value == pytest.approx(float(total.detach()), rel=1e-6)
    for n, p in params.items():
        assert torch.allclose(p.grad, 2.5 * w[n].grad, rtol=1e-5, atol=1e-9)


def test_drift_penalty_lowers_the_predicted_drift_and_keeps_the_edit(tiny_lm, iso_cache):
    """``drift_penalty`` trains edit loss + β · predicted drift: the same edits land with a smaller predicted
    drift than without it; a one-pass method (memit) refuses it before any work."""
    model, tok = tiny_lm
    plain = edit(model, tok, REQS, cfg(epochs=40), progress=False)
    from crispedit.editing import restore

    restore(model, plain.original_weights)
    pen = edit(model, tok, REQS, cfg(epochs=40, drift_penalty=1.0), progress=False)
    assert pen.drift_budget["drift_penalty"] == 1.0 and pen.drift_budget["hits"] == 0
    assert pen.kl_predicted["total"] < 0.8 * plain.kl_predicted["total"]
    assert pen.history.epoch_loss[-1] < 0.5 * pen.history.epoch_loss[0]
    with pytest.raises(CrispEditError, match="drift-penalty"):
        cfg("memit", drift_penalty=1.0)
    with pytest.raises(CrispEditError, match="drift penalty"):
        cfg(drift_penalty=-1.0)


def test_steep_layers_names_the_layer_that_dominates_the_prediction():
    # SmolLM2 {2-11} (a sweep of the early blocks): block 11 predicted 0.19 of 0.19 nats/token
    layers = {
        f"model.layers.{i}.mlp.down_proj": v
        for i, v in zip(
            range(2, 12),
            (
                0.000898923,
                4.18018e-05,
                4.4449e-05,
                4.57373e-05,
                4.57375e-05,
                4.55e-05,
                5.38092e-05,
                0.000169241,
                9.64448e-05,
                0.190545,
            ),
        )
    }
    st = steep_layers(layers)
    assert [d["layer"] for d in st] == ["model.layers.11.mlp.down_proj"]  # block 2 is 20x the median but 0.5 % of it
    assert st[0]["share"] == pytest.approx(0.190545 / sum(layers.values()), abs=1e-4) and st[0]["vs_median"] > 1000
    even = {"a": 0.00015, "b": 0.00015, "c": 0.00015, "d": 0.00015, "e": 0.00019}  # the default {4-8}
    assert steep_layers(even) == []
    assert steep_layers({"a": 1.0}) == [] and steep_layers({"a": 0.0, "b": 0.0}) == []
    two = steep_layers({"a": 1.0, "b": 0.01})
    assert [d["layer"] for d in two] == ["a"] and two[0]["vs_median"] == 100.0
    assert steep_layers({"a": 1.0, "b": 0.0})[0]["vs_median"] is None  # no ratio to a zero median
    assert steep_layers({"a": 1.0, "b": 0.2}, factor=10) == [] and steep_layers({"a": 1.0, "b": 0.2}, factor=4)


def test_mixing_layers_names_attention_qkv_and_nothing_after_the_mixing():
    """Query / key / value projections (llama, GPT-2, GPT-NeoX names) are flagged; o_proj and MLP matrices,
    which act after attention mixes positions, not. The note says the prediction under-reads them, and why."""
    names = [
        "model.layers.4.self_attn.v_proj",
        "model.layers.4.self_attn.o_proj",
        "model.layers.4.mlp.down_proj",
        "model.layers.5.self_attn.q_proj",
        "transformer.h.3.attn.c_attn",
        "gpt_neox.layers.2.attention.query_key_value",
        "model.layers.5.self_attn.k_proj",
        "transformer.h.3.mlp.c_proj",
    ]
    assert mixing_layers(names) == [names[0], names[3], names[4], names[5], names[6]]
    assert mixing_layers(["model.layers.1.mlp.down_proj"]) == []
    note = mixing_note(mixing_layers(names))
    assert (
        note.startswith(
            "model.layers.4.self_attn.v_proj, model.layers.5.self_attn.q_proj, transformer.h.3.attn.c_attn and 2 more: "
        )
        and "\n" not in note
    )
    assert "mixes these outputs across positions" in note and "does not model" in note and "under-read" in note
    assert not any(ch.isdigit() for ch in note.split(": ", 1)[1].split("(see")[0])  # no measured figure in it
    assert prediction_notes({"steep_layers": [], "mixing_layers": []}) == []


def test_cli_edit_on_a_value_projection_notes_that_the_prediction_under_reads(
    tmp_path, tiny_model_dir, iso_cache, capsys
):
    """An edit on attention value projections records them as ``mixing_layers`` and prints the one-line note."""
    edits = tmp_path / "e.json"
    edits.write_text(json.dumps([r.to_json() for r in REQS]))
    layers = "model.layers.{1-2}.self_attn.v_proj"
    assert (
        main(
            [
                "edit",
                "--model",
                str(tiny_model_dir),
                "--edits",
                str(edits),
                "--layers",
                layers,
                "--n-cap",
                "6",
                "--max-len",
                "48",
                "--epochs",
                "2",
                "--lr",
                "1e-2",
                "--batch-size",
                "4",
                "--no-wild",
                "--quiet",
                "--out",
                str(tmp_path / "v"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    s = json.loads((tmp_path / "v" / "edit_report.json").read_text())["summary"]
    assert s["mixing_layers"] == [f"model.layers.{i}.self_attn.v_proj" for i in (1, 2)]
    assert "note: model.layers.1.self_attn.v_proj, model.layers.2.self_attn.v_proj: attention mixes" in out


def test_penalty_from_reference_weights_is_the_gradient_of_their_prediction():
    """With ``reference`` the penalty reads the change from those weights (a session's base), checked against
    autograd; the budget's own measure (``predicted``, ``enforce``) still reads the change from the start."""
    g = torch.Generator().manual_seed(5)
    mods = {"a": torch.nn.Linear(5, 3, bias=False).double()}
    params = {"a": mods["a"].weight}
    factors = KFACFactors({"a": spd(5, g)}, {"a": spd(3, g)}, 1)
    ref = {"a": params["a"].detach().clone() - 0.2 * torch.randn(3, 5, generator=g, dtype=torch.float64)}
    budget = DriftBudget(params, mods, factors, None, penalty=1.5, reference=ref)
    budget.curvature = factors.on({"a": "cpu"}, torch.float64)
    budget.start = {"a": params["a"].detach().clone()}
    budget.reference = {"a": ref["a"].clone()}
    with torch.no_grad():
        params["a"].add_(torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.1)
    w = params["a"].detach().clone().requires_grad_(True)
    d = w - ref["a"]
    total = 0.5 * ((factors.S["a"] @ d) * (d @ factors.A["a"])).sum()
    total.backward()
    params["a"].grad = torch.zeros_like(params["a"])
    assert budget.add_penalty_gradient() == pytest.approx(float(total.detach()), rel=1e-6)
    assert torch.allclose(params["a"].grad, 1.5 * w.grad, rtol=1e-5, atol=1e-9)
    since_start = params["a"].detach() - budget.start["a"]
    assert budget.predicted() == pytest.approx(kron_form(since_start, factors.A["a"], factors.S["a"]), rel=1e-6)
    with pytest.raises(ValueError, match="lack"):
        DriftBudget(params, mods, factors, None, penalty=1.0, reference={})


@pytest.mark.parametrize("drift_from", ["round", "base"])
def test_a_session_penalty_reads_its_round_or_the_whole_session(drift_from, tmp_path, tiny_model_dir, monkeypatch):
    """``drift_from="base"``: every sequential round's penalty measures the change from the session's base weights,
    so round 2 starts with the drift round 1 left; ``"round"``: from the round's own start. A config whose penalty
    is off does not keep the setting in its identity; LoRA, which trains a fresh adapter, refuses ``base``."""
    from crispedit.curvature import predicted
    from crispedit.editing import SeqConfig
    from crispedit.sessions.session import Session

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    seen = []
    real = predicted.DriftBudget.__init__

    def spy(self, params, modules, factors, eps, penalty=0.0, reference=None):
        real(self, params, modules, factors, eps, penalty, reference)
        seen.append((self.penalty_deltas(), {n: p.detach().clone() for n, p in params.items()}))

    monkeypatch.setattr(predicted.DriftBudget, "__init__", spy)
    base = dict(method="crispedit", layers=LAYERS, epochs=5, lr=1e-2, batch_size=4, n_cap=6, max_len=48)
    cfg = SeqConfig(edit={**base, "drift_penalty": 1.0}, drift_from=drift_from)
    s = Session.create(tmp_path / "s", str(tiny_model_dir), cfg, progress=False)
    for part in (REQS[:2], REQS[2:]):
        s.add(part, plot=False)
    (d1, w1), (d2, w2) = seen
    assert all(float(d.abs().max()) == 0.0 for d in d1.values())  # round 1 starts at the base either way
    moved = {n: float((w2[n] - w1[n]).abs().max()) for n in w1}
    assert all(v > 0 for v in moved.values())
    if drift_from == "base":  # round 2's penalty reads round 1's change from its first step
        assert all(torch.allclose(d2[n], (w2[n] - w1[n]).float()) for n in d2)
    else:
        assert all(float(d.abs().max()) == 0.0 for d in d2.values())
    assert "drift_from" in cfg.identity()
    assert "drift_from" not in SeqConfig(edit=base, drift_from=drift_from).identity()
    if drift_from == "base":
        with pytest.raises(CrispEditError, match="LoRA trains a fresh adapter"):
            SeqConfig(edit={**base, "method": "lora", "layers": None}, drift_from="base")
