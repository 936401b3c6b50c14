"""Closed-form editors (MEMIT, AlphaEdit): their solves against direct least squares, the input-covariance
collection and cache kind, subject location, and edits on the tiny random llama."""

import contextlib
import logging

import numpy as np
import pytest
import torch

from crispedit.curvature.cache import CurvatureSpec, cache_key, get_or_build_factors, load_factors, save_factors
from crispedit.curvature.kfac import collect_lm_input_covariance
from crispedit.data import EditRequest, capability_corpus
from crispedit.editing import EditConfig, edit, get_editor
from crispedit.editing.fastpath import prefix_sharing
from crispedit.editing.keyvalue import layer_keys, subject_span, subject_token_index
from crispedit.errors import CrispEditError
from crispedit.layers import resolve_layers
from crispedit.methods.alphaedit.editor import alphaedit_delta, nullspace_projector
from crispedit.methods.memit.editor import memit_delta
from crispedit.weights import weight_fingerprint

LAYERS = "model.layers.{0-1}.mlp.down_proj"
REQS = [
    EditRequest(f"Written by the author of book number {i}", chr(65 + i), subject=f"book number {i}") for i in range(4)
]


def spd(d, rng, scale=1.0):
    A = rng.standard_normal((d, 3 * d))
    return torch.tensor(scale * A @ A.T / (3 * d))


def test_memit_delta_is_the_regularised_least_squares_solution():
    """R Kᵀ(λC + KKᵀ)⁻¹ minimises ‖ΔW K − R‖² + λ tr(ΔW C ΔWᵀ): stack [K, √λ L] with C = L Lᵀ and solve."""
    rng = np.random.default_rng(0)
    d_in, d_out, n, lam = 9, 5, 4, 3.7
    K, R = torch.tensor(rng.standard_normal((d_in, n))), torch.tensor(rng.standard_normal((d_out, n)))
    C = spd(d_in, rng)
    L = np.linalg.cholesky(C.numpy())
    A = np.concatenate([K.numpy().T, np.sqrt(lam) * L.T])  # (n + d_in) x d_in
    B = np.concatenate([R.numpy().T, np.zeros((d_in, d_out))])  # (n + d_in) x d_out
    X, *_ = np.linalg.lstsq(A, B, rcond=None)
    got = memit_delta(K, R, C, lam)
    assert got.dtype == torch.float64 and got.shape == (d_out, d_in)
    np.testing.assert_allclose(got.numpy(), X.T, rtol=1e-9, atol=1e-10)
    # with a tiny λ the keys are written (almost) exactly
    np.testing.assert_allclose((memit_delta(K, R, C, 1e-9) @ K).numpy(), R.numpy(), atol=1e-6)


def test_nullspace_projector_and_alphaedit_delta_against_least_squares():
    """P projects on C's small-eigenvalue directions; ΔW = R KᵀP(KKᵀP + K_pK_pᵀP + l2 I)⁻¹ equals the
    ridge least-squares solution over updates of the form Y U₀ᵀ, and annihilates C's large directions."""
    rng = np.random.default_rng(1)
    d, d_out, n, l2 = 10, 6, 3, 0.7
    Q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    evals = np.array([5.0, 3.0, 2.0, 1.0, 0.5, 0.3, 1e-3, 5e-3, 1e-2, 1.5e-2])  # 4 below 2e-2
    C = torch.tensor(Q @ np.diag(evals) @ Q.T)
    P = nullspace_projector(C, 2e-2)
    assert torch.allclose(P, P.T) and torch.allclose(P @ P, P, atol=1e-12)
    assert round(float(torch.trace(P))) == 4
    U0 = torch.tensor(Q[:, evals < 2e-2])
    assert torch.allclose(P, U0 @ U0.T, atol=1e-10)
    K = torch.tensor(rng.standard_normal((d, n)))
    R = torch.tensor(rng.standard_normal((d_out, n)))
    Kp = torch.tensor(rng.standard_normal((d, 5)))
    got = alphaedit_delta(K, R, P, Kp @ Kp.T, l2)
    # least squares over Y (d_out x r), ΔW = Y U0ᵀ: ‖Y U0ᵀK − R‖² + ‖Y U0ᵀ Kp‖² + l2‖Y‖²
    U = U0.numpy()
    A = np.concatenate([K.numpy().T @ U, Kp.numpy().T @ U, np.sqrt(l2) * np.eye(U.shape[1])])
    B = np.concatenate([R.numpy().T, np.zeros((5, d_out)), np.zeros((U.shape[1], d_out))])
    Y, *_ = np.linalg.lstsq(A, B, rcond=None)
    np.testing.assert_allclose(got.numpy(), Y.T @ U.T, rtol=1e-8, atol=1e-10)
    # preserved keys: any k in the span of C's large-eigenvalue directions is mapped to 0
    big = torch.tensor(Q[:, evals >= 2e-2]) @ torch.tensor(rng.standard_normal((6, 20)))
    assert float((got @ big).abs().max()) < 1e-10 * float(got.abs().max())
    assert float((got @ U0).abs().max()) > 1e-3  # ... while the null-space directions do change


def test_input_covariance_is_the_mean_outer_product_and_stops_early(tiny_lm):
    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    texts = capability_corpus(None, 5)
    calls = []
    late = model.model.layers[3].register_forward_hook(lambda *a: calls.append(1))
    try:
        cov = collect_lm_input_covariance(model, tok, texts, layers, max_len=40, batch_size=2, progress=False)
    finally:
        late.remove()
    assert calls == []  # the forward stopped after block 1
    assert cov.S == {} and set(cov.A) == set(layers)
    # ground truth: every non-padding token of every text, one at a time (no padding at all)
    for name, m in layers.items():
        rows = []
        h = m.register_forward_hook(lambda mod, a, o, rows=rows: rows.append(a[0][0].detach().double()))
        with torch.no_grad():
            for t in texts:
                model(**tok(t, return_tensors="pt", truncation=True, max_length=40))
        h.remove()
        X = torch.cat(rows)
        assert cov.n_tokens == X.shape[0]
        assert torch.allclose(cov.A[name].double(), X.T @ X / X.shape[0], rtol=1e-4, atol=1e-5)


def test_input_cache_kind_round_trip_and_refusals(tiny_lm, tmp_path):
    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    texts = capability_corpus(None, 4)
    base = dict(
        model_fingerprint=weight_fingerprint(model),
        layers=tuple(layers),
        corpus_digest="c",
        n_texts=4,
        max_len=32,
        label_mode="none",
        seed=0,
    )
    spec = CurvatureSpec(**base, kind="input")
    kfac = CurvatureSpec(**{**base, "label_mode": "sampled"})
    assert kfac.as_dict()["kind"] == "kfac" and spec.as_dict()["kind"] == "input"
    assert cache_key(spec) != cache_key(CurvatureSpec(**base))
    f1, info1 = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path)
    f2, info2 = get_or_build_factors(model, tok, layers, texts, spec, root=tmp_path)
    assert not info1["hit"] and info2["hit"]
    assert all(torch.equal(f1.A[n], f2.A[n]) for n in layers) and f2.S == {}
    with pytest.raises(CrispEditError, match="holds input statistics, not kfac") as exc:
        load_factors(info1["path"], kfac)
    assert "\n" not in str(exc.value)
    save_factors(tmp_path / "k.safetensors", type(f1)(f1.A, {n: torch.eye(32) for n in layers}, 5), kfac)
    with pytest.raises(CrispEditError, match="holds kfac statistics, not input"):
        load_factors(tmp_path / "k.safetensors", spec)


def test_subject_location_and_one_line_errors(tiny_tok):
    r = EditRequest("Who founded the city of Rome?", "Romulus", subject="the city of Rome")
    s, e = subject_span(r)
    assert r.prompt[s:e] == "the city of Rome"
    i = subject_token_index(tiny_tok, r.prompt, e)
    ids = tiny_tok(r.prompt)["input_ids"]
    assert tiny_tok.decode(ids[: i + 1]).endswith("Rome") and not tiny_tok.decode(ids[:i]).endswith("Rome")
    assert subject_span(EditRequest("who founded rome?", "x", subject="Rome")) == (12, 16)  # case-insensitive
    for req, msg in [
        (EditRequest("Who founded Rome?", "Romulus"), "has no subject"),
        (EditRequest("Who founded Rome?", "Romulus", subject="Paris"), "'Paris' does not occur"),
    ]:
        with pytest.raises(CrispEditError, match=msg) as exc:
            subject_span(req, 3)
        assert "\n" not in str(exc.value) and "edit request 3" in str(exc.value)


@pytest.mark.parametrize("method", ["memit", "alphaedit"])
def test_a_request_without_subject_is_refused_before_any_change(method, tiny_lm, iso_cache):
    model, tok = tiny_lm
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bad = REQS[:2] + [EditRequest("Who wrote it?", "Z")]
    with pytest.raises(CrispEditError, match="edit request 2 .* has no subject"):
        edit(model, tok, bad, EditConfig(method=method, layers=LAYERS, n_cap=4, max_len=32), progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_memit_writes_the_targets_and_only_the_edit_layers(tiny_lm, iso_cache):
    model, tok = tiny_lm
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = EditConfig(
        method="memit", layers=LAYERS, n_cap=6, max_len=48, options={"cov_weight": 1.0, "v_steps": 60, "batch_size": 3}
    )
    res = edit(model, tok, REQS, cfg, progress=False)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)} == set(res.original_weights)
    first, last = res.history.epoch_loss
    assert last < first - 3.0  # mean target NLL (nats/token) falls by > 3
    assert res.cache_info["spec"]["kind"] == "input" and res.history.steps > 0
    v_first, v_last = res.history.to_json()["vstar_nll"]  # v* itself reached its targets
    assert v_first == pytest.approx(first, rel=0.5) and v_last < v_first - 3.0
    # the authors' λ = 15000 on this tiny model's small keys barely moves the weights: λ matters
    model2 = type(model)(model.config)
    model2.load_state_dict({n: before[n] for n in before})
    res2 = edit(
        model2,
        tok,
        REQS,
        EditConfig(method="memit", layers=LAYERS, n_cap=6, max_len=48, options={"v_steps": 60}),
        progress=False,
    )
    assert res2.history.epoch_loss[1] > last


def test_alphaedit_leaves_preserved_keys_unchanged(tiny_lm, iso_cache):
    """Every edit layer's update is zero on the directions of C with eigenvalues above the threshold."""
    from crispedit.editing.api import capability_factors

    model, tok = tiny_lm
    opts = {"nullspace_threshold": 1.0, "l2": 1.0, "v_steps": 60, "v_lr": 0.5, "clamp": 4.0}
    cfg = EditConfig(method="alphaedit", layers=LAYERS, n_cap=6, max_len=48, options=opts)
    layers = resolve_layers(model, LAYERS)
    C, _ = capability_factors(model, tok, layers, cfg, kind="input", progress=False)
    res = edit(model, tok, REQS, cfg, progress=False)
    assert res.history.epoch_loss[1] < res.history.epoch_loss[0] - 1.0
    for name, m in layers.items():
        evals, evecs = torch.linalg.eigh(C.A[name].double())
        big = evecs[:, evals >= 1.0]
        assert 0 < big.shape[1] < big.shape[0]
        dW = (m.weight.detach() - res.original_weights[f"{name}.weight"]).double()
        assert float(dW.abs().max()) > 1e-4
        assert float((dW @ big).norm()) < 1e-4 * float(dW.norm())
        kept = res.projector_stats[name]["kept_fraction"]
        assert kept == pytest.approx(1 - big.shape[1] / big.shape[0])


@pytest.mark.parametrize("method", ["alphaedit", "memit"])
def test_a_killed_closed_form_edit_resumes_after_its_last_batch(
    method, tiny_lm, iso_cache, tmp_path, monkeypatch, caplog
):
    """A closed-form edit of several batches killed after batch 2 goes on from batch 3 with the layers' weights,
    AlphaEdit's accumulated K_p K_pᵀ and the v* counters of the stored run, and ends where the uninterrupted edit
    ends, reporting (INFO) the batches it wrote; another run's checkpoint is refused in one line."""
    import crispedit.methods.memit.closed_form as cf
    from crispedit.editing import restore
    from crispedit.methods.memit.closed_form import _BatchCheckpoint

    model, tok = tiny_lm
    opts = {
        "batch_size": 1,
        "v_steps": 10,
        "v_lr": 0.5,
        "clamp": 4.0,
        "prefixes": 0,
        **({"nullspace_threshold": 1.0, "l2": 1.0} if method == "alphaedit" else {}),
    }
    cfg = EditConfig(method=method, layers=LAYERS, n_cap=6, max_len=48, options=opts)
    full = edit(model, tok, REQS[:3], cfg, progress=False)
    want = {n: model.get_parameter(n).detach().clone() for n in full.original_weights}
    restore(model, full.original_weights)
    ck, real_save = tmp_path / "cf.safetensors", _BatchCheckpoint.save

    def dying_save(self, batches, *a, **k):
        real_save(self, batches, *a, **k)
        if batches == 2:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:  # (monkeypatch.undo() would also drop iso_cache's CRISPEDIT_CACHE)
        m.setattr(cf._BatchCheckpoint, "save", dying_save)
        with pytest.raises(KeyboardInterrupt):
            edit(model, tok, REQS[:3], cfg, progress=False, checkpoint=ck)
    from crispedit.editing.checkpoint import check_checkpoint_file

    check_checkpoint_file(ck)  # `crispedit edit --checkpoint` takes it
    held = full.history.extra["first_batch_tf_rel"]  # batch 1's edits after each batch
    assert len(held) == 3 and all(0 <= x <= 1 for x in held)
    restore(model, full.original_weights)  # a new process starts from the base
    with caplog.at_level(logging.INFO, logger="crispedit.edit"):
        res = edit(model, tok, REQS[:3], cfg, progress=False, checkpoint=ck)
    assert res.history.extra["resumed_at_batch"] == 2 and res.history.steps == full.history.steps
    logged = [r.getMessage() for r in caplog.records if r.name == "crispedit.edit"]
    assert [m.split(":")[0] for m in logged] == [f"edit[{method}] batch 3/3 written"]  # only what this run wrote
    assert res.history.seconds >= res.history.extra["resumed_seconds"] > 0  # the killed run's time counts
    assert res.history.extra["vstar_nll"] == full.history.extra["vstar_nll"]
    assert res.history.extra["first_batch_tf_rel"] == pytest.approx(held, abs=1e-6)  # kept through the kill
    assert res.history.epoch_loss == pytest.approx(full.history.epoch_loss, abs=1e-5)
    for n, w in want.items():
        assert torch.allclose(model.get_parameter(n), w, atol=1e-6), n
    restore(model, full.original_weights)
    with pytest.raises(CrispEditError, match="closed-form checkpoint file .* belongs to another run"):
        edit(model, tok, REQS[:2], cfg, progress=False, checkpoint=ck)
    assert all(torch.equal(model.get_parameter(n), w) for n, w in full.original_weights.items())


def test_alphaedit_session_accumulates_preserved_keys(tiny_lm, tmp_path, iso_cache):
    """AlphaEdit-Seq: each round's keys join K_p K_pᵀ, stored with the session and used by the next round."""
    from safetensors.torch import load_file

    from crispedit.editing.config import SeqConfig
    from crispedit.sessions.session import Session

    model, tok = tiny_lm
    opts = {"nullspace_threshold": 1.0, "l2": 1.0, "v_steps": 20, "v_lr": 0.5, "clamp": 4.0, "prefixes": 0}
    sc = SeqConfig(
        edit=EditConfig(method="alphaedit", layers=LAYERS, n_cap=6, max_len=48, options=opts),
        carry_optimizer=False,
        kl_texts=2,
    )
    assert sc.name == "alphaedit-seq"
    s = Session.create(tmp_path / "s", (model, tok), sc)
    traces = []
    for reqs in (REQS[:2], REQS[2:]):
        s.add(reqs, plot=False)
        st = s._read_state()
        assert "edit_factors" not in st["files"]  # no K-FAC edit factors for closed forms
        kp = load_file(str(s.path / st["files"]["optim"]))
        assert set(kp) == {f"model.layers.{i}.mlp.down_proj::KpKp" for i in (0, 1)}
        traces.append(float(torch.trace(kp["model.layers.0.mlp.down_proj::KpKp"])))
    assert traces[1] > traces[0] > 0
    # K_p K_pᵀ of round 2 = round 1's + the sum of outer products of round 2's keys on the edited model
    layer = resolve_layers(s._model, LAYERS)["model.layers.0.mlp.down_proj"]
    K2 = layer_keys(s._model, tok, REQS[2:], layer, ["{}"]).double()
    assert traces[1] == pytest.approx(traces[0] + float((K2 * K2).sum()), rel=1e-3)


def test_ultraedit_ridge_solve_and_running_normalisation_against_numpy():
    from crispedit.methods.ultraedit.editor import RunningNorm, pseudo_values, ultraedit_delta

    rng = np.random.default_rng(2)
    H, V = rng.standard_normal((7, 5)), rng.standard_normal((7, 3))
    want = np.linalg.solve(H.T @ H + 2.5 * np.eye(5), H.T @ V).T
    np.testing.assert_allclose(ultraedit_delta(torch.tensor(H), torch.tensor(V), 2.5).numpy(), want, rtol=1e-10)
    lst, *_ = np.linalg.lstsq(np.concatenate([H, np.eye(5)]), np.concatenate([V, np.zeros((5, 3))]), rcond=None)
    np.testing.assert_allclose(ultraedit_delta(torch.tensor(H), torch.tensor(V)).numpy(), lst.T, rtol=1e-9)
    # lifelong normalisation: batch by batch, and through a save / load, equals one pass over all rows
    parts = [rng.standard_normal((n, 4)) * 3 + 1 for n in (5, 1, 9)]
    norm = RunningNorm(4)
    norm.update(torch.tensor(parts[0]))
    norm = RunningNorm.from_tensors(norm.to_tensors("L"), "L", 4)
    for p in parts[1:]:
        norm.update(torch.tensor(p))
    X = np.concatenate(parts)
    assert norm.n == 15
    np.testing.assert_allclose(norm.mean.numpy(), X.mean(0), rtol=1e-12)
    np.testing.assert_allclose(norm.std.numpy(), X.std(0, ddof=1), rtol=1e-12)
    np.testing.assert_allclose(
        norm(torch.tensor(X)).numpy(), (X - X.mean(0)) / (X.std(0, ddof=1) + 1.1920929e-07), rtol=1e-6
    )
    h, g = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0, 0.5]])
    assert torch.allclose(pseudo_values(h, g, 0.1), torch.tensor([[-1.5, 0.5, -0.25]]))
    with pytest.raises(CrispEditError, match="has 4 features, not 6"):
        RunningNorm.from_tensors(norm.to_tensors("L"), "L", 6)


def test_ultraedit_default_layers_are_the_authors_layout_by_depth():
    """Without --layers UltraEdit edits gate_proj / up_proj where its authors do on Llama-3-8B (blocks 11-15 /
    18-24 of 32), placed by depth on other sizes; GPT-2-style blocks without them get the shared default."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from crispedit.layers import default_layer_pattern
    from crispedit.methods.ultraedit.editor import default_layers

    def llama(n):
        return LlamaForCausalLM(
            LlamaConfig(
                vocab_size=32,
                hidden_size=8,
                intermediate_size=16,
                num_hidden_layers=n,
                num_attention_heads=2,
                num_key_value_heads=1,
            )
        )

    assert default_layers(llama(32)) == "model.layers.{11-15}.mlp.gate_proj,model.layers.{18-24}.mlp.up_proj"
    assert default_layers(llama(30)) == "model.layers.{10-14}.mlp.gate_proj,model.layers.{17-23}.mlp.up_proj"
    m = llama(30)
    layers = get_editor("ultraedit").select_layers(m, EditConfig(method="ultraedit"))
    assert len(layers) == 12 and list(layers)[0] == "model.layers.10.mlp.gate_proj"
    given = get_editor("ultraedit").select_layers(
        m, EditConfig(method="ultraedit", layers="model.layers.{4}.mlp.down_proj")
    )
    assert list(given) == ["model.layers.4.mlp.down_proj"]
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=8, n_layer=4, n_head=2))
    assert default_layers(gpt2) == default_layer_pattern(gpt2)


def test_ultraedit_session_carries_the_normalisation(tiny_lm, tmp_path, iso_cache):
    """UltraEdit in a session: the running statistics count every target-predicting row of every round."""
    from safetensors.torch import load_file

    from crispedit.editing.config import SeqConfig
    from crispedit.sessions.session import Session

    model, tok = tiny_lm
    sc = SeqConfig(
        edit=EditConfig(method="ultraedit", layers=LAYERS, contexts="bare", answer_end="none", options={"lr": 0.05}),
        kl_texts=2,
    )
    s = Session.create(tmp_path / "s", (model, tok), sc)
    counts = []
    for reqs in (REQS[:2], REQS[2:]):
        rec = s.add(reqs, plot=False)
        st = load_file(str(s.path / s._read_state()["files"]["optim"]))
        counts.append(float(st["model.layers.0.mlp.down_proj::n"][0]))
        assert rec["train"]["steps"] == 1
    # bare contexts, no answer end: one row per target token of every request so far
    from crispedit.data.tokenize import join_prompt_target, split_context_target

    def n_target(r):
        ids, n = split_context_target(tok, r.prompt, join_prompt_target(r.prompt, r.target))
        return len(ids) - n

    assert counts == [sum(map(n_target, REQS[:2])), sum(map(n_target, REQS))]


def test_ultraedit_lowers_the_target_loss_and_changes_only_the_edit_layers(tiny_lm, iso_cache):
    model, tok = tiny_lm
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    res = edit(
        model,
        tok,
        REQS,
        EditConfig(method="ultraedit", layers="model.layers.{1-2}.mlp.down_proj", options={"lr": 0.05}),
        progress=False,
    )
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"model.layers.{i}.mlp.down_proj.weight" for i in (1, 2)} == set(res.original_weights)
    first, last = res.history.epoch_loss
    assert last < first - 2.0 and res.history.steps == 1 and res.cache_info == {}
    # a smaller scale moves less: the step is proportional to lr (up to the ridge)
    model2 = type(model)(model.config)
    model2.load_state_dict(before)
    edit(
        model2,
        tok,
        REQS,
        EditConfig(method="ultraedit", layers="model.layers.{1-2}.mlp.down_proj", options={"lr": 0.005}),
        progress=False,
    )
    d1 = (model.model.layers[1].mlp.down_proj.weight - before["model.layers.1.mlp.down_proj.weight"]).norm()
    d2 = (model2.model.layers[1].mlp.down_proj.weight - before["model.layers.1.mlp.down_proj.weight"]).norm()
    assert float((d2 / d1).detach()) == pytest.approx(0.1, rel=1e-3)


def test_target_values_side_by_side_equal_one_at_a_time(tiny_lm):
    """Requests optimised in one forward (own δ, loss, stop and clamp each) give the one-at-a-time v*."""
    from crispedit.editing.keyvalue import KeyValueSettings, context_templates, edit_blocks, target_values

    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    _, block = edit_blocks(model, layers)
    templates = context_templates(model, tok, 2)
    reqs = REQS[:3] + [EditRequest("Famous for the long book number 7 series", "Zed", subject="book number 7")]
    # stop_loss 6.0: some requests stop early, at different steps; clamp 0.5: the clamp engages
    kw = dict(steps=8, lr=0.5, clamp=0.5, stop_loss=6.0)
    one = [target_values(model, tok, [r], block, templates, KeyValueSettings(**kw, chunk=1)) for r in reqs]
    V, rec = target_values(model, tok, reqs, block, templates, KeyValueSettings(**kw, chunk=3))
    assert torch.allclose(V, torch.cat([v for v, _ in one]), rtol=1e-4, atol=1e-4)
    assert rec["steps"] == sum(r["steps"] for _, r in one)
    assert 0 < rec["steps"] < 4 * 7  # some stopped early
    assert rec["nll_last"] == pytest.approx(sum(r["nll_last"] for _, r in one) / 4, rel=1e-4)


def _reference_v_star(model, tok, r, block, templates, st):
    """One request's ``v*`` from the keyvalue module docstring, written plainly: every step two full forwards with
    ``δ`` added by a hook, the context rows and the essence prompt apart; the stop rule and the clamp as the
    authors'. ``(v*, first NLL, last NLL, Adam steps)``."""
    from crispedit.data.tokenize import collate, join_prompt_target, split_context_target
    from crispedit.editing import delta_forward as df
    from crispedit.editing import keyvalue as kv

    _, end = kv.subject_span(r)
    ctx = [t.replace("{}", r.prompt, 1) for t in templates]
    batch = collate(tok, [split_context_target(tok, c, join_prompt_target(c, r.target)) for c in ctx])
    pos = torch.tensor([kv.subject_token_index(tok, c, t.index("{}") + end) for c, t in zip(ctx, templates)])
    subj = r.subject.strip()
    kl_text = kv.KL_TEMPLATE.format(subj)
    kl_ids = torch.tensor([tok(kl_text)["input_ids"]])
    kl_pos = torch.tensor([kv.subject_token_index(tok, kl_text, len(subj))])
    with torch.no_grad(), df._add_at(block, pos, torch.zeros(len(pos), 1)) as seen:
        model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    h0 = seen[0][0, pos[0]].float()
    delta = torch.zeros(h0.shape[0], requires_grad=True)
    opt = torch.optim.Adam([delta], lr=st.lr)
    kl0 = first = None
    steps = 0
    for it in range(st.steps):
        opt.zero_grad()
        with df._add_at(block, pos, delta.expand(len(pos), -1)):
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.labels[:, 1:].clamp_min(0)[..., None])[..., 0]
        tmask = batch.labels[:, 1:] != -100
        nll = (-(lp * tmask).sum(1) / tmask.sum(1)).mean()
        with df._add_at(block, kl_pos, delta[None]):
            kl_logp = torch.log_softmax(model(input_ids=kl_ids).logits[0, kl_pos[0]].float(), -1)
        kl0 = kl_logp.detach() if kl0 is None else kl0
        loss = (
            nll
            + st.kl_factor * (kl_logp.exp() * (kl_logp - kl0)).sum()
            + st.weight_decay * delta.norm() / h0.norm() ** 2
        )
        first = float(nll.detach()) if first is None else first
        if float(loss.detach()) < st.stop_loss or it == st.steps - 1:
            return (h0 + delta).detach(), first, float(nll.detach()), steps
        loss.backward()
        opt.step()
        steps += 1
        with torch.no_grad():
            cap = st.clamp * h0.norm()
            if delta.norm() > cap:
                delta *= cap / delta.norm()
    raise AssertionError("unreachable: the last step stops")


@pytest.mark.parametrize("shortcuts", ["suffix", "plain"])
def test_target_values_equal_a_plain_per_request_optimisation(tiny_lm, shortcuts, monkeypatch):
    """The chunked ``v*`` optimisation — target rows and essence prompts in one forward, suffix-only steps (or,
    with the shortcuts off, the cached forward) — gives what a plain loop per request gives: full forwards with δ
    hooked in, the KL prompt run apart."""
    from crispedit.editing import delta_forward as df
    from crispedit.editing import keyvalue as kv

    model, tok = tiny_lm
    _, block = kv.edit_blocks(model, resolve_layers(model, LAYERS))
    templates = kv.context_templates(model, tok, 2)
    reqs = REQS[:3] + [EditRequest("Famous for the long book number 7 series", "Zed", subject="book number 7")]
    # kl_factor 2: the KL term weighs in the gradient; stop_loss 6: requests stop at different steps
    st = kv.KeyValueSettings(steps=6, lr=0.5, clamp=0.5, stop_loss=6.0, kl_factor=2.0, chunk=4)
    ref = [_reference_v_star(model, tok, r, block, templates, st) for r in reqs]
    used: list[str] = []
    for name in ("_suffix", "_fast"):
        real = getattr(df.DeltaForward, name)

        def spy(self, delta, _f=real, _n=name):
            used.append(_n)
            return _f(self, delta)

        monkeypatch.setattr(df.DeltaForward, name, spy)
    with contextlib.ExitStack() as stack:
        if shortcuts == "plain":
            stack.enter_context(df.suffix_steps(False))
            stack.enter_context(prefix_sharing(False))
        V, rec = kv.target_values(model, tok, reqs, block, templates, st)
    assert ("_suffix" in used) is (shortcuts == "suffix") and "_fast" in used  # the checks run the cached one
    assert torch.allclose(V, torch.stack([v for v, *_ in ref]), rtol=1e-4, atol=1e-4)
    assert rec["steps"] == sum(s for *_, s in ref) and 0 < rec["steps"] < 4 * 5
    assert rec["nll_first"] == pytest.approx(sum(f for _, f, _, _ in ref) / 4, rel=1e-4)
    assert rec["nll_last"] == pytest.approx(sum(last for _, _, last, _ in ref) / 4, rel=1e-4)


def test_keys_and_block_outputs_stop_the_forward_at_their_layer(tiny_lm):
    """Keys and block outputs come from a forward stopped at their layer: nothing above it runs (no later
    block, no output head), and the tensors are those a full forward passes through the layer."""
    from crispedit.editing import keyvalue as kv
    from crispedit.layers import decoder_blocks

    model, tok = tiny_lm
    _, blocks = decoder_blocks(model)
    layer, block = blocks[1].mlp.down_proj, blocks[1]
    templates = ["{}", "Once upon a time {}"]
    ran: list[str] = []
    hooks = [
        blocks[2].register_forward_pre_hook(lambda m, a: ran.append("block 2")),
        model.lm_head.register_forward_pre_hook(lambda m, a: ran.append("head")),
    ]
    try:
        K = kv.layer_keys(model, tok, REQS, layer, templates)
        H = kv.block_outputs(model, tok, REQS, block)
    finally:
        for h in hooks:
            h.remove()
    assert ran == []
    texts, ends = kv._filled(REQS, templates)
    enc, pos = kv._positions(tok, texts, ends, "cpu")
    seen: dict = {}

    def keep(key, value):
        seen.setdefault(key, value)  # a hook that returns None leaves the forward as it was

    h1 = layer.register_forward_hook(lambda m, a, o: keep("k", a[0]))
    h2 = block.register_forward_hook(lambda m, a, o: keep("h", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(**enc)
        k_full = seen["k"][torch.arange(len(pos)), pos].view(len(REQS), 2, -1)
        seen.clear()
        bare = [r.prompt for r in REQS]
        enc1, pos1 = kv._positions(tok, bare, [kv.subject_span(r)[1] for r in REQS], "cpu")
        model(**enc1)
    h1.remove()
    h2.remove()
    assert torch.equal(K, 0.5 * (k_full[:, 0] + k_full[:, 1:].mean(1)))
    assert torch.equal(H, seen["h"][torch.arange(len(pos1)), pos1])


def _assert_full_forward_agrees(fwd, model, block, enc, pos, rows, seed):
    """``fwd``'s logits at ``rows`` and their δ-gradient (random δ, ``seed``) equal the full forward's with δ added
    at ``pos`` of ``block``'s output by a hook."""
    from crispedit.editing import delta_forward as df

    delta = torch.randn(len(pos), fwd.h.shape[-1], generator=torch.Generator().manual_seed(seed), requires_grad=True)
    a = fwd(delta)
    (ga,) = torch.autograd.grad(a.square().sum(), delta)
    with df._add_at(block, pos, delta):
        full = model(**enc).logits
    b = full.reshape(-1, full.shape[-1])[rows].float()
    (gb,) = torch.autograd.grad(b.square().sum(), delta)
    assert a.shape == (len(rows), full.shape[-1])
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5) and torch.allclose(ga, gb, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("last", [False, True])
def test_v_star_forward_shortcut_equals_the_plain_forward(tiny_lm, last):
    """The v* steps run only the blocks above the v* block on its cached output, the head on the needed rows:
    same logits and same δ-gradient as a full forward with δ added by a hook; a v* block that is the last
    block falls back to the plain forward."""
    from crispedit.editing import delta_forward as df
    from crispedit.layers import decoder_blocks

    model, tok = tiny_lm
    _, blocks = decoder_blocks(model)
    block = blocks[-1] if last else blocks[1]
    enc = tok(["Alpha beta gamma delta", "One two three"], return_tensors="pt", padding=True)
    enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
    pos = torch.tensor([2, 1])
    rows = torch.tensor([1, 2, enc["input_ids"].shape[1] + 1])
    fwd = df.DeltaForward(model, block, enc, pos, rows)
    assert fwd.fast is (not last)
    _assert_full_forward_agrees(fwd, model, block, enc, pos, rows, seed=0)


def test_v_star_packed_forward_equals_the_plain_forward(tiny_lm):
    """Rows that share a long beginning (a context template's prefix over several requests) run packed as prefix
    trees: the same logits and δ-gradients as the full forward; where a δ position is shared with another row
    (one prompt the beginning of another), the packing is not used."""
    from crispedit.editing import delta_forward as df
    from crispedit.layers import decoder_blocks

    model, tok = tiny_lm
    _, blocks = decoder_blocks(model)
    prefix = "Once upon a time in a land far away there lived"
    texts = [f"{prefix} {w} and the tale" for w in ("alpha beta", "gamma", "delta epsilon zeta", "eta")]
    enc = tok(texts, return_tensors="pt", padding=True)
    enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
    n_pre = len(tok(prefix)["input_ids"])
    lengths = enc["attention_mask"].sum(1)
    pos = torch.tensor([n_pre + 1, n_pre, n_pre + 2, n_pre])  # a token after the shared prefix
    T = enc["input_ids"].shape[1]
    rows = torch.cat([b * T + torch.arange(int(lengths[b]) - 3, int(lengths[b]) - 1) for b in range(4)])
    with df.suffix_steps(False):  # the suffix forward would be preferred
        fwd = df.DeltaForward(model, blocks[1], enc, pos, rows)
    assert fwd.fast and fwd.suffix is None and fwd.packed is not None and fwd.packed.nodes < int(lengths.sum())
    _assert_full_forward_agrees(fwd, model, blocks[1], enc, pos, rows, seed=1)
    with prefix_sharing(False), df.suffix_steps(False):
        assert df.DeltaForward(model, blocks[1], enc, pos, rows).packed is None
    # δ inside the shared prefix: every row passes through that node, so the rows are not packed
    with df.suffix_steps(False):
        shared = df.DeltaForward(model, blocks[1], enc, torch.tensor([n_pre - 2] * 4), rows)
    assert shared.fast and shared.packed is None


def test_v_star_suffix_forward_equals_the_plain_forward(tiny_lm):
    """The v* steps run only each row's positions from its δ on, over the earlier positions' cached keys and values:
    the same logits and δ-gradients as the full forward, on rows of different lengths and δ positions (the suffixes
    packed first-fit, the pasts left-padded); where a logit row lies before its row's δ, the suffix is not used. The
    checks' outcomes are shared through ``verdicts``: a later forward skips them and still agrees, and a failed check
    keeps the later forwards off the shortcut."""
    from crispedit.editing import delta_forward as df
    from crispedit.layers import decoder_blocks

    model, tok = tiny_lm
    _, blocks = decoder_blocks(model)
    texts = [
        "Once upon a time alpha beta and the tale",
        "gamma delta",
        "In a land far away epsilon zeta eta theta",
        "iota kappa lambda mu nu xi",
    ]
    enc = tok(texts, return_tensors="pt", padding=True)
    enc = {k: enc[k] for k in ("input_ids", "attention_mask")}
    lengths = enc["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1  # the batch is padded
    pos = torch.tensor([5, 0, 3, int(lengths[3]) - 1])  # δ first, in the middle and last of a row
    T = enc["input_ids"].shape[1]
    rows = torch.cat([b * T + torch.arange(int(pos[b]), int(lengths[b])) for b in range(4)])
    verdicts: dict = {}
    fwd = df.DeltaForward(model, blocks[1], enc, pos, rows, verdicts)
    assert fwd.fast and fwd.suffix is not None and verdicts == {"fast": True, "suffix": True}
    assert fwd.suffix["inputs"]["input_ids"].shape[1] == int((lengths - pos).max()) < T
    _assert_full_forward_agrees(fwd, model, blocks[1], enc, pos, rows, seed=2)
    later = df.DeltaForward(model, blocks[1], enc, pos, rows, verdicts)  # checks skipped
    assert later.suffix is not None
    _assert_full_forward_agrees(later, model, blocks[1], enc, pos, rows, seed=3)
    assert df.DeltaForward(model, blocks[1], enc, pos, rows, {"fast": True, "suffix": False}).suffix is None
    # a logit row before its row's δ position would need the past's logits: the cached forward serves
    early = torch.cat([rows, torch.tensor([4])])  # row 0, position 4 < its δ at 5
    assert df.DeltaForward(model, blocks[1], enc, pos, early).suffix is None
    with df.suffix_steps(False):
        assert df.DeltaForward(model, blocks[1], enc, pos, rows).suffix is None


def test_alphaedit_seq_from_the_cli(tiny_model_dir, tmp_path, iso_cache, capsys):
    """`session init --method alphaedit` (AlphaEdit-Seq), two `session add` rounds, `status`, `export`."""
    import json

    from crispedit.cli import main

    sess = tmp_path / "sess"
    args = [
        "session",
        "init",
        "--model",
        tiny_model_dir,
        "--out",
        sess,
        "--method",
        "alphaedit",
        "--layers",
        LAYERS,
        "--n-cap",
        4,
        "--max-len",
        32,
        "--alphaedit-v-steps",
        3,
        "--alphaedit-prefixes",
        0,
        "--alphaedit-nullspace-threshold",
        1.0,
        "--kl-texts",
        2,
        "--quiet",
    ]
    assert main([str(a) for a in args]) == 0
    for k in range(2):
        f = tmp_path / f"r{k}.json"
        f.write_text(
            json.dumps(
                [
                    {"prompt": f"The author of book number {k}{j}", "target": "Q", "subject": f"book number {k}{j}"}
                    for j in range(2)
                ]
            )
        )
        assert main(["session", "add", str(sess), "--edits", str(f), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("single-pass target_nll=") == 2 and "epochs=" not in out, out  # AlphaEdit runs no epochs
    assert main(["session", "status", str(sess)]) == 0
    rows = [ln.split("|")[0].split() for ln in capsys.readouterr().out.splitlines() if ln.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(r[-1] == "-" for r in rows), rows  # the epochs cell
    assert main(["session", "status", str(sess), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (
        st["name"] == "alphaedit-seq" and st["round"] == 2 and set(st["files"]) == {"weights", "optim", "cap_factors"}
    )
    assert main(["session", "export", str(sess), "--out", str(tmp_path / "exp"), "--quiet"]) == 0
    assert (tmp_path / "exp" / "config.json").is_file()


@pytest.mark.parametrize(
    "layers,msg",
    [
        ("model.layers.{0-1}.mlp.up_proj", "writes 48 features, not the residual stream's 32"),
        ("lm_head", "is not inside the decoder blocks model.layers"),
    ],
)
def test_closed_form_layers_must_write_the_residual_stream(layers, msg, tiny_lm, iso_cache):
    model, tok = tiny_lm
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CrispEditError, match=msg):
        edit(model, tok, REQS, EditConfig(method="memit", layers=layers, n_cap=4, max_len=32), progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("method", ["memit", "alphaedit"])
def test_sequential_rounds_write_their_templates_with_the_unedited_model(method, tiny_lm, iso_cache):
    """Every round of a closed-form sequence draws MEMIT's context templates from the unedited model (the authors'
    code draws them once per process): while the model writes its prefixes in round 2 it holds the base weights,
    although round 2 starts from round 1's edit; afterwards it holds the edited weights again."""
    from crispedit.editing import SeqConfig
    from crispedit.sessions.in_memory import run_sequence

    model, tok = tiny_lm
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)]
    base = {n: model.get_parameter(n).detach().clone() for n in names}
    seen = []
    generate = model.generate

    def spy(*a, **kw):  # generated_prefixes is the only caller of generate during an edit
        seen.append({n: model.get_parameter(n).detach().clone() for n in names})
        return generate(*a, **kw)

    model.generate = spy
    options = {"prefixes": 2, "v_steps": 2, **({"nullspace_threshold": 1.0} if method == "alphaedit" else {})}
    cfg = SeqConfig(
        edit=EditConfig(method=method, layers=LAYERS, n_cap=4, max_len=32, options=options), mode="sequential"
    )
    run_sequence(model, tok, REQS, cfg, chunk=2, progress=False)
    assert len(seen) >= 2 and len(seen) % 2 == 0  # both rounds wrote their templates ...
    assert all(torch.equal(s[n], base[n]) for s in seen for n in names)  # ... with the base weights in
    assert any(not torch.equal(model.get_parameter(n), base[n]) for n in names)  # and the edit is back in place


def test_a_batched_alphaedit_run_is_alphaedit_seq_in_rounds_of_its_batch_size(tiny_lm, iso_cache):
    """AlphaEdit over 4 requests in batches of 2 (each batch solved on the model the previous one left, ``K_pK_pᵀ``
    accumulated) writes the same weights, bit for bit, as AlphaEdit-Seq in 2 rounds of 2: the rounds draw their
    templates from
    the unedited model, as the batches do."""
    from crispedit.editing import SeqConfig
    from crispedit.sessions.in_memory import run_sequence

    model, tok = tiny_lm
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in (0, 1)]
    base = {n: model.get_parameter(n).detach().clone() for n in names}
    options = {"prefixes": 2, "v_steps": 3, "nullspace_threshold": 1.0, "batch_size": 2}
    cfg = EditConfig(method="alphaedit", layers=LAYERS, n_cap=4, max_len=32, options=options)
    edit(model, tok, REQS, cfg, progress=False)
    batched = {n: model.get_parameter(n).detach().clone() for n in names}
    with torch.no_grad():
        for n in names:
            model.get_parameter(n).copy_(base[n])
    run_sequence(model, tok, REQS, SeqConfig(edit=cfg, mode="sequential"), chunk=2, progress=False)
    for n in names:
        assert not torch.equal(batched[n], base[n])
        torch.testing.assert_close(model.get_parameter(n), batched[n], rtol=0, atol=0)


def test_suffix_layout_packs_suffixes_first_fit_with_their_pasts():
    """Suffixes packed longest first into rows of the longest one's length, each row's pasts side by side and
    left-padded; every index a flat ``b·T + t`` into the batch, -1 for padding."""
    from crispedit.editing.delta_forward import _suffix_layout

    lay = _suffix_layout([2, 1, 3], [5, 2, 4], T=6)  # suffix lengths 3, 1, 1
    assert lay["new"] == [[2, 3, 4], [6 + 1, 12 + 3, -1]]
    assert lay["past"] == [[-1, -1, 0, 1], [6 + 0, 12 + 0, 12 + 1, 12 + 2]]
