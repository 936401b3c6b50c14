"""Sequential editing sessions: factor merging, crash safety (kill -9 included), refusals, size."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, build_llama
from crispedit.cli import main
from crispedit.curvature.factors import KFACFactors
from crispedit.data import EditRequest, load_edits, save_edits_jsonl
from crispedit.editing import EditConfig, get_editor
from crispedit.editing.optim import load_optimizer_state, optimizer_state, reproject_first_moment
from crispedit.errors import CrispEditError
from crispedit.layers import resolve_layers
from crispedit.models import load_model
from crispedit.sessions import session as session_mod
from crispedit.sessions import store as store_mod
from crispedit.sessions.sequential import SeqConfig, accumulate, combine_factors, round_edit_factors
from crispedit.sessions.session import Session
from crispedit.versions import source_commit

LAYERS = "model.layers.{1-2}.mlp.down_proj"
ROUNDS = [
    [
        EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}", rephrase_prompts=[f"Book {i} is by?"])
        for i in range(k * 4, k * 4 + 4)
    ]
    for k in range(2)
]
INIT = [
    "--layers",
    LAYERS,
    "--epochs",
    "25",
    "--lr",
    "1e-2",
    "--batch-size",
    "4",
    "--n-cap",
    "6",
    "--max-len",
    "48",
    "--kl-texts",
    "4",
    "--quiet",
]


def _config(**kw) -> SeqConfig:
    edit = dict(method="crispedit", layers=LAYERS, epochs=25, lr=1e-2, batch_size=4, n_cap=6, max_len=48)
    edit.update(kw.pop("edit", {}))
    return SeqConfig(edit=EditConfig(**edit), kl_texts=4, **kw)


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny models on a shared CPU: one thread is several times faster and deterministic across processes
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _env(cache: Path) -> dict:
    env = dict(os.environ, CRISPEDIT_CACHE=str(cache), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    return env


def _tensor_files(d: Path) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return {f.name: load_file(str(f)) for f in sorted(d.glob("*.safetensors"))}


def _strip(rounds: list[dict]) -> list[dict]:
    """Round records without wall-clock fields, where they ran and the marks of a resumed training (where it went
    on)."""
    drop = {"finished", "environment", "resumed_at_epoch"}  # and every key naming seconds

    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in drop and "seconds" not in k}
        return x

    return [clean(r) for r in rounds]


def assert_same_session(a: Path, b: Path) -> None:
    ta, tb = _tensor_files(a), _tensor_files(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert sorted(ta[name]) == sorted(tb[name])
        for key in ta[name]:
            assert torch.equal(ta[name][key], tb[name][key]), f"{name}:{key} differs"
    sa, sb = json.loads((a / "state.json").read_text()), json.loads((b / "state.json").read_text())
    assert sa["round"] == sb["round"] and sa["files"] == sb["files"]
    assert _strip(sa["rounds"]) == _strip(sb["rounds"])
    assert sorted(p.name for p in (a / "rounds").iterdir()) == sorted(p.name for p in (b / "rounds").iterdir())


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tiny_model_dir):
    """Reference through the CLI: init, round 1 (snapshot), round 2 uninterrupted, export."""
    root = tmp_path_factory.mktemp("session_ref")
    cache = root / "cache"
    old = os.environ.get("CRISPEDIT_CACHE")
    os.environ["CRISPEDIT_CACHE"] = str(cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        files = []
        for k, reqs in enumerate(ROUNDS, 1):
            files.append(root / f"r{k}.jsonl")
            save_edits_jsonl(files[-1], reqs)
        sess = root / "sess"
        assert main(["session", "init", "--model", str(tiny_model_dir), "--out", str(sess), *INIT]) == 0
        assert main(["session", "add", str(sess), "--edits", str(files[0]), "--quiet"]) == 0
        snap = root / "after_round1"
        shutil.copytree(sess, snap)
        assert main(["session", "add", str(sess), "--edits", str(files[1]), "--quiet"]) == 0
        export = root / "export"
        assert main(["session", "export", str(sess), "--out", str(export)]) == 0
    finally:
        torch.set_num_threads(threads)
        if old is None:
            os.environ.pop("CRISPEDIT_CACHE", None)
        else:
            os.environ["CRISPEDIT_CACHE"] = old
    return {
        "root": root,
        "cache": cache,
        "sess": sess,
        "snap": snap,
        "files": files,
        "export": export,
        "model_dir": tiny_model_dir,
    }


def _resume_copy(ref, dst: Path) -> Path:
    shutil.copytree(ref["snap"], dst)
    return dst


# ---------------------------------------------------------------------------------------------
# the algorithm


def test_streaming_merge_equals_union(tiny_lm64):
    """Token-weighted accumulation of per-round edit factors == one collection over the union (same model)."""
    model, tok = tiny_lm64
    layers = resolve_layers(model, LAYERS)
    cfg = EditConfig(layers=LAYERS, label_mode="empirical", max_len=48, kfac_batch_size=3)
    parts = [round_edit_factors(model, tok, reqs, layers, cfg, k) for k, reqs in enumerate(ROUNDS, 1)]
    acc = None
    for p in parts:
        acc = accumulate(acc, p)
    union = round_edit_factors(model, tok, ROUNDS[0] + ROUNDS[1], layers, cfg, 1)
    assert acc.n_tokens == union.n_tokens == sum(p.n_tokens for p in parts)
    for n in layers:
        torch.testing.assert_close(acc.A[n], union.A[n], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(acc.S[n], union.S[n], rtol=1e-5, atol=1e-7)


def test_target_edit_factors_cover_the_trained_tokens_only(tiny_lm64):
    """``edit_factors="target"``: the edit factors average the positions that predict each training sequence's
    target (and answer end) — the tokens the round trained — and nothing of the prompts."""
    from crispedit.editing.contexts import sequences_for

    model, tok = tiny_lm64
    layers = resolve_layers(model, LAYERS)
    cfg = EditConfig(layers=LAYERS, label_mode="empirical", max_len=256, kfac_batch_size=3)
    full = round_edit_factors(model, tok, ROUNDS[0], layers, cfg, 1)
    target = round_edit_factors(model, tok, ROUNDS[0], layers, cfg, 1, rows="target")
    seqs = sequences_for(tok, ROUNDS[0], cfg, model)[0]
    assert target.n_tokens == sum(len(s.ids) - s.n_context for s in seqs) < full.n_tokens
    assert not torch.allclose(target.S[next(iter(layers))], full.S[next(iter(layers))])
    with pytest.raises(CrispEditError, match="edit factor rows must be one of full, target"):
        SeqConfig(edit_factors="prompt")
    with pytest.raises(CrispEditError, match="edit factor rows"):
        round_edit_factors(model, tok, ROUNDS[0], layers, cfg, 1, rows="prompt")
    ft = SeqConfig(edit=EditConfig(method="ft", layers=LAYERS), edit_factors="target")
    assert (
        "edit_factors" not in ft.identity() and SeqConfig(edit_factors="target").identity()["edit_factors"] == "target"
    )


def test_combine_weightings():
    g = torch.Generator().manual_seed(0)
    mk = lambda n: KFACFactors({"l": torch.randn(3, 3, generator=g)}, {"l": torch.randn(2, 2, generator=g)}, n)  # noqa: E731
    cap, ed = mk(900), mk(100)
    tok = combine_factors(cap, ed, "tokens", 0.5)
    torch.testing.assert_close(tok.A["l"], 0.9 * cap.A["l"] + 0.1 * ed.A["l"])
    fix = combine_factors(cap, ed, "fixed", 0.3)
    torch.testing.assert_close(fix.S["l"], 0.7 * cap.S["l"] + 0.3 * ed.S["l"])
    assert combine_factors(cap, None, "fixed", 0.5) is cap
    with pytest.raises(CrispEditError):
        SeqConfig(weighting="nope")


def test_trace_weighting_mixes_energy_shares_whatever_the_scales():
    """``trace``: the edit factors scaled to the capability factors' traces before the fixed mix, so ten times
    larger edit factors (as SmolLM2's edit S is) take ``mix`` of the energy, not nine tenths of it."""
    g = torch.Generator().manual_seed(0)
    psd = lambda d: (lambda x: x @ x.T)(torch.randn(d, d + 2, generator=g))  # noqa: E731
    cap = KFACFactors({"l": psd(4)}, {"l": psd(3)}, 500)
    ed = KFACFactors({"l": 7.0 * psd(4)}, {"l": 10.0 * psd(3)}, 50)
    tr = lambda m: float(torch.diagonal(m).sum())  # noqa: E731
    scaled = ed.rescaled_to(cap)
    for k in ("A", "S"):
        mine, ref = getattr(scaled, k)["l"], getattr(cap, k)["l"]
        assert tr(mine) == pytest.approx(tr(ref), rel=1e-6)
        torch.testing.assert_close(mine / tr(mine), getattr(ed, k)["l"] / tr(getattr(ed, k)["l"]))  # shape kept
    mixed = combine_factors(cap, ed, "trace", 0.3)
    torch.testing.assert_close(mixed.S["l"], 0.7 * cap.S["l"] + 0.3 * scaled.S["l"])
    raw = combine_factors(cap, ed, "fixed", 0.3)
    assert 0.3 * tr(scaled.S["l"]) / tr(mixed.S["l"]) == pytest.approx(0.3)
    assert 0.3 * tr(ed.S["l"]) / tr(raw.S["l"]) > 0.5  # raw: the edits dominate
    zero = KFACFactors({"l": torch.zeros(4, 4)}, {"l": psd(3)}, 1).rescaled_to(cap)
    assert torch.equal(zero.A["l"], torch.zeros(4, 4))  # nothing to scale
    assert SeqConfig(weighting="trace").weighting == "trace"
    with pytest.raises(CrispEditError):
        SeqConfig(mix=1.5)


def test_each_weighting_masks_each_sets_energy_in_the_merged_basis(tmp_path, tiny_model_dir, monkeypatch):
    """``each``: the constraint is the trace mix carrying its two parts; crispedit's projector is the merged
    eigenbasis with :func:`per_source_keep_mask` of the parts; a session runs its rounds with it."""
    from crispedit.curvature.eigen import factor_eigh
    from crispedit.curvature.masks import per_source_keep_mask
    from crispedit.methods.crispedit import CrispEditEditor

    g = torch.Generator().manual_seed(1)
    psd = lambda d: (lambda x: x @ x.T)(torch.randn(d, d + 1, generator=g))  # noqa: E731
    cap = KFACFactors({"l": psd(5)}, {"l": psd(4)}, 300)
    ed = KFACFactors({"l": 9.0 * psd(5)}, {"l": 20.0 * psd(4)}, 30)
    each = combine_factors(cap, ed, "each", 0.5)
    assert each.parts == (cap, ed) and combine_factors(cap, ed, "trace", 0.5).parts == ()
    torch.testing.assert_close(each.A["l"], combine_factors(cap, ed, "trace", 0.5).A["l"])
    proj = CrispEditEditor().projectors({"l": None}, each, EditConfig(gamma=0.8))["l"]
    eig = factor_eigh(each, ["l"], ("A", "S"))
    want = per_source_keep_mask(
        eig["l", "S"][1], eig["l", "A"][1], [(cap.A["l"], cap.S["l"]), (ed.A["l"], ed.S["l"])], 0.8
    )
    assert torch.equal(proj.mask.bool(), want)
    # edit_gamma: the edit factors' own threshold (the capability factors keep the config's γ)
    hi = combine_factors(cap, ed, "each", 0.5, edit_gamma=0.95)
    assert hi.part_gammas == (None, 0.95) and each.part_gammas == (None, None)
    proj_hi = CrispEditEditor().projectors({"l": None}, hi, EditConfig(gamma=0.8))["l"]
    want_hi = per_source_keep_mask(
        eig["l", "S"][1], eig["l", "A"][1], [(cap.A["l"], cap.S["l"]), (ed.A["l"], ed.S["l"])], [0.8, 0.95]
    )
    assert torch.equal(proj_hi.mask.bool(), want_hi) and proj_hi.mask.sum() <= proj.mask.sum()
    with pytest.raises(CrispEditError, match="edit gamma must lie strictly between 0 and 1"):
        SeqConfig(edit_gamma=1.0)
    st = _two_rounds(tmp_path, tiny_model_dir, monkeypatch, "each")
    assert all(0 < v < 1 for v in st["rounds"][1]["projector_kept"].values())


def _two_rounds(tmp_path, tiny_model_dir, monkeypatch, weighting: str) -> dict:
    """The status of a session of the tiny model under ``weighting`` after the two :data:`ROUNDS` (three epochs
    each), each round's retention checked over the rounds so far."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    s = Session.create(
        tmp_path / "s", str(tiny_model_dir), _config(edit={"epochs": 3}, weighting=weighting), progress=False
    )
    for reqs in ROUNDS:
        s.add(reqs, plot=False)
    st = s.status()
    assert [set(r["retention"]) for r in st["rounds"]] == [{"1"}, {"1", "2"}]
    return st


def test_apart_weighting_masks_each_set_in_its_own_basis(tmp_path, tiny_model_dir, monkeypatch):
    """``apart``: each part masked in its own eigenbasis at its own γ (the capability at the config's, the edits at
    ``edit_gamma``), the two projectors alternated; a session runs its rounds with it and records the parts' kept
    fractions. Adam in the eigenbasis has no single basis to live in there: refused in one line."""
    from crispedit.curvature.projection import AlternatingProjector
    from crispedit.methods.crispedit import CrispEditEditor
    from crispedit.sessions.sequential import APART_SWEEPS

    g = torch.Generator().manual_seed(2)
    psd = lambda d: (lambda x: x @ x.T)(torch.randn(d, d + 1, generator=g))  # noqa: E731
    cap = KFACFactors({"l": psd(5)}, {"l": psd(4)}, 300)
    ed = KFACFactors({"l": 9.0 * psd(5)}, {"l": 20.0 * psd(4)}, 30)
    apart = combine_factors(cap, ed, "apart", 0.5, edit_gamma=0.95)
    assert apart.parts == (cap, ed) and apart.part_sweeps == APART_SWEEPS
    proj = CrispEditEditor().projectors({"l": None}, apart, EditConfig(gamma=0.8))["l"]
    assert isinstance(proj, AlternatingProjector) and proj.sweeps == APART_SWEEPS
    for part, want in zip(proj.parts, (cap.projector("l", 0.8), ed.projector("l", 0.95))):
        assert torch.equal(part.mask, want.mask) and torch.equal(part.U_in, want.U_in)
    assert combine_factors(cap, ed, "each", 0.5).part_sweeps == 0
    with pytest.raises(CrispEditError, match="--weighting apart composes two eigenbases"):
        SeqConfig(weighting="apart", edit=EditConfig(projection_target="eigenbasis"))
    assert SeqConfig(weighting="apart", edit=EditConfig(method="ft", projection_target="eigenbasis")).weighting
    st = _two_rounds(tmp_path, tiny_model_dir, monkeypatch, "apart")
    assert all(0 <= v < 1 for v in st["rounds"][1]["projector_kept"].values())
    parts = st["rounds"][1]["projector_parts_kept"]
    assert set(parts) == set(st["rounds"][1]["projector_kept"]) and all(len(v) == 2 for v in parts.values())
    assert "projector_parts_kept" not in st["rounds"][0]  # round 1: the capability constraint alone


def test_optimizer_state_roundtrip_and_reprojection(tiny_lm, iso_cache):
    from crispedit.editing import capability_factors

    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    cfg = EditConfig(layers=LAYERS, n_cap=4, max_len=32, gamma=0.5)
    factors, _ = capability_factors(model, tok, layers, cfg, progress=False)
    params = get_editor("crispedit").trainable(layers)
    opt = torch.optim.Adam(params.values())
    for p in params.values():
        p.grad = torch.randn_like(p)
    opt.step()
    flat = optimizer_state(opt, params)
    opt2 = torch.optim.Adam(params.values())
    load_optimizer_state(opt2, params, flat)
    assert all(torch.equal(opt2.state[p]["exp_avg"], opt.state[p]["exp_avg"]) for p in params.values())
    projs = get_editor("crispedit").projectors(layers, factors, cfg)
    reproject_first_moment(opt2, params, projs, layers)
    for n, p in params.items():
        m = opt2.state[p]["exp_avg"]
        assert not torch.allclose(m, opt.state[p]["exp_avg"])
        torch.testing.assert_close(projs[n].project(m), m, atol=1e-6, rtol=1e-5)  # inside the kept subspace


# ---------------------------------------------------------------------------------------------
# the session


def test_cli_session_reference_run(ref, capsys):
    sess = ref["sess"]
    st = Session.open(sess).status()
    assert st["round"] == 2 and st["n_edits"] == 8 and len(st["rounds"]) == 2
    r2 = st["rounds"][1]
    assert set(r2["retention"]) == {"1", "2"} and r2["kl_drift"] > 0 and r2["optimizer_carried"]
    assert st["retention"][0][1] is None and st["retention"][1][0] is not None
    assert sorted(st["files"]) == ["cap_factors", "edit_factors", "optim", "weights"]
    assert st["files"]["weights"] == "weights-0002.safetensors"
    assert (sess / "retention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [len(r) for r in Session.open(sess).edits()] == [4, 4]
    assert main(["session", "status", str(sess)]) == 0
    assert "crispedit-seq[each]" in capsys.readouterr().out
    # the exported model is the base with the session's weights in the trained layers
    model, _ = load_model(str(ref["export"]))
    base, _ = load_model(str(ref["model_dir"]))
    from safetensors.torch import load_file

    w = load_file(str(sess / "weights-0002.safetensors"))
    params = dict(model.named_parameters())  # the session stores the changed parameters by full name
    assert set(w) == {f"{n}.weight" for n in resolve_layers(model, LAYERS)}
    assert all(torch.equal(params[n], t) for n, t in w.items())
    changed = {n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters()) if not torch.equal(p, q)}
    assert changed == set(w)


@pytest.mark.parametrize("phase", ["after_train", "after_weights", "before_commit", "after_commit"])
def test_resume_after_crash_between_writes(phase, ref, tmp_path, monkeypatch):
    """A crash at any point of round 2 leaves the session at round 1 (or 2 once committed); the next
    add resumes to exactly the uninterrupted result."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(ref["cache"]))
    sess = _resume_copy(ref, tmp_path / "sess")

    class Crash(BaseException):
        pass

    def fault(p):
        if p == phase:
            raise Crash(p)

    s = Session.open(sess)
    monkeypatch.setattr(store_mod, "fault", fault)
    with pytest.raises(Crash):
        s.add(load_edits(ref["files"][1]), source=str(ref["files"][1]), plot=False)
    monkeypatch.undo()
    monkeypatch.setenv("CRISPEDIT_CACHE", str(ref["cache"]))
    committed = phase == "after_commit"
    s = Session.open(sess)  # a fresh process would do the same: open cleans orphans
    assert s.round == (2 if committed else 1)
    assert (sess / "weights-0001.safetensors").exists() != committed
    assert not list(sess.glob(".*.tmp"))
    if not committed:
        assert not (sess / "weights-0002.safetensors").exists() and not (sess / "rounds" / "round-0002.jsonl").exists()
        assert len(list(sess.glob("training-0002-*.safetensors"))) == 1  # the round's training was kept
        (sess / "training-0002-0123abcd.safetensors").write_bytes(b"other edits'")  # stale: deleted by add
        rec = s.add(load_edits(ref["files"][1]), source=str(ref["files"][1]), plot=False)
        assert rec["train"]["resumed_at_epoch"] == rec["train"]["epochs"]  # ... and nothing trained again
    assert not list(sess.glob("training-*"))  # removed with the commit
    assert_same_session(sess, ref["sess"])


def _wait_for(proc: subprocess.Popen, text: str, timeout: float = 120) -> str:
    seen, t0 = "", time.time()
    while text not in seen:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process ended before printing {text!r}: {seen}")
        seen += line
        if time.time() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {text!r}")
    return seen


def test_kill9_mid_round_resumes_to_uninterrupted_state(ref, tmp_path, monkeypatch):
    """`crispedit session add` killed with SIGKILL in the middle of a round (from outside, during
    training; and from inside, between the round's file writes); re-running add ends where the
    uninterrupted run ended."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(ref["cache"]))
    sess = _resume_copy(ref, tmp_path / "sess")
    cmd = [sys.executable, "-m", "crispedit", "session", "add", str(sess), "--edits", str(ref["files"][1]), "--quiet"]
    # 1) external kill -9 while the round trains (the "round 2: editing" line is printed before training)
    env = _env(ref["cache"])
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    _wait_for(proc, "round 2: editing")
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    # 2) kill -9 between writes: weights of round 2 on disk, state not yet switched
    env[store_mod.FAULT_ENV] = "before_commit"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert (sess / "weights-0002.safetensors").exists()  # written, but not committed
    assert json.loads((sess / "state.json").read_text())["round"] == 1
    # resume (in this process; same thread count and seeds as the CLI)
    s = Session.open(sess)
    assert s.round == 1 and not (sess / "weights-0002.safetensors").exists()
    s.add(load_edits(ref["files"][1]), source=str(ref["files"][1]), plot=False)
    assert_same_session(sess, ref["sess"])


def test_refuses_other_base_and_changed_config(ref, tmp_path, tiny_tok, monkeypatch):
    monkeypatch.setenv("CRISPEDIT_CACHE", str(ref["cache"]))
    other = tmp_path / "other_model"
    build_llama(len(tiny_tok), seed=1).save_pretrained(other)
    tiny_tok.save_pretrained(other)
    with pytest.raises(CrispEditError, match="refusing to mix bases"):
        Session.open(ref["sess"], model=str(other))
    with pytest.raises(CrispEditError, match="different configuration .*gamma"):
        Session.open(ref["sess"], config=_config(edit={"gamma": 0.9}))
    with pytest.raises(CrispEditError, match="different configuration .*weighting"):
        Session.create(ref["sess"], str(ref["model_dir"]), _config(weighting="tokens"))
    # the same configuration reopens; the CLI reports the refusal in one line with status 2
    assert Session.open(ref["sess"], config=_config(), model=str(ref["model_dir"])).round == 2
    assert main(["session", "add", str(ref["sess"]), "--edits", str(ref["files"][0]), "--model", str(other)]) == 2
    assert main(["session", "status", str(tmp_path)]) == 2
    assert json.loads((ref["sess"] / "state.json").read_text())["round"] == 2  # nothing changed


def test_weighting_is_part_of_a_sessions_identity_only_where_rounds_merge_edit_factors(ref, tmp_path, monkeypatch):
    """``session init`` on an existing session reopens it under the same flags and refuses another ``--weighting`` /
    ``--edit-gamma``; methods whose rounds merge no edit factors (ft, batch mode) are the same session under any
    weighting."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(ref["cache"]))
    old = tmp_path / "old"
    shutil.copytree(ref["snap"], old)
    init = ["session", "init", "--model", str(ref["model_dir"]), "--out", str(old), *INIT]
    assert main(init) == 0
    assert main(init + ["--weighting", "fixed"]) == 2
    assert main(init + ["--edit-gamma", "0.9"]) == 2
    ft = EditConfig(method="ft", layers=LAYERS)
    assert SeqConfig(edit=ft, weighting="fixed").identity() == SeqConfig(edit=ft).identity()
    assert SeqConfig(mode="batch", weighting="fixed").identity() == SeqConfig(mode="batch").identity()
    assert SeqConfig(weighting="fixed").identity() != SeqConfig().identity()


def test_session_size_bound(ref):
    """Only the trained layers' weights, Adam moments and factors are stored; size does not grow with rounds."""
    model, _ = load_model(str(ref["model_dir"]))
    layers = resolve_layers(model, LAYERS)
    per_layer = sum(
        m.weight.numel() * 3 + m.weight.shape[0] ** 2 * 2 + m.weight.shape[1] ** 2 * 2 for m in layers.values()
    )
    bound = per_layer * 4 + 64 * 1024  # float32 tensors + headers, JSON and the edit log
    tensors = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))  # noqa: E731
    assert abs(tensors(ref["sess"]) - tensors(ref["snap"])) < 1024  # round 2 replaced round 1's files
    size = sum(f.stat().st_size for f in ref["sess"].rglob("*") if f.is_file() and f.name != "retention.png")
    assert size <= bound
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert tensors(ref["sess"]) < full / 2


@pytest.mark.parametrize(
    "method,mode,drift", [("ft", "sequential", None), ("crispedit", "batch", None), ("crispedit", "sequential", 1e-9)]
)
def test_baselines_and_drift_recompute(method, mode, drift, tmp_path, tiny_model_dir, monkeypatch):
    """FT Sequential and batch-on-the-union run through the same session; the drift option recollects
    the capability factors on the edited model (and stores them with the weights they belong to)."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    cfg = _config(edit={"method": method, "epochs": 3}, mode=mode, recompute_drift=drift)
    s = Session.create(tmp_path / "s", str(tiny_model_dir), cfg, progress=False)
    for reqs in ROUNDS:
        s.add(reqs, plot=False)
    st = s.status()
    files = set(st["files"])
    if method == "ft":
        assert files == {"weights", "optim"} and st["name"] == "ft-seq"
    elif mode == "batch":  # re-edits the base on the union every round, capability factors only, fresh optimizer
        assert files == {"weights", "cap_factors"} and st["name"] == "crispedit-batch"
        assert not st["rounds"][1]["optimizer_carried"]
        assert st["rounds"][1]["train"]["steps"] > st["rounds"][0]["train"]["steps"]  # 8 edits vs 4
    else:
        assert all(r.get("capability_recomputed") for r in st["rounds"])
        assert (
            st["files"]["cap_factors"]
            == "cap_factors-0002.safetensors"
            == st["files"]["cap_ref"].replace("cap_ref", "cap_factors")
        )
        assert sorted(f.name for f in (tmp_path / "s").glob("cap_*")) == [
            "cap_factors-0002.safetensors",
            "cap_ref-0002.safetensors",
        ]
    assert [set(r["retention"]) for r in st["rounds"]] == [{"1"}, {"1", "2"}]


def test_eigenbasis_session_runs_and_does_not_carry_moments_across_bases(tmp_path, tiny_model_dir, monkeypatch):
    """Adam in the eigenbasis works in sessions; its moments belong to one round's eigenbasis, so they are
    not carried into the next round's (different) basis; the edit factors cover every training context."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    cfg = _config(edit={"epochs": 3, "projection_target": "eigenbasis", "contexts": "bare,prefix:1"})
    s = Session.create(tmp_path / "s", str(tiny_model_dir), cfg, progress=False)
    for reqs in ROUNDS:
        s.add(reqs, plot=False)
    st = s.status()
    assert not any(r["optimizer_carried"] for r in st["rounds"]) and "optim" not in st["files"]
    assert st["rounds"][0]["train"]["contexts"] == ["bare", "prefix:1"]
    assert st["rounds"][0]["train"]["sequences"] == 8


def test_lora_seq_stores_the_merged_projections_and_export_matches(tmp_path, tiny_model_dir, monkeypatch):
    """LoRA-Seq: a fresh adapter per round, merged; the session stores (and exports) only the merged
    q/v projections of the edit layers' blocks, and round 2 starts from round 1's merged weights."""
    from safetensors.torch import load_file

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    cfg = _config(edit={"method": "lora", "epochs": 5, "lr": 5e-3, "contexts": "bare"})
    s = Session.create(tmp_path / "s", str(tiny_model_dir), cfg, progress=False)
    qv = {f"model.layers.{i}.self_attn.{t}_proj.weight" for i in (1, 2) for t in "qv"}
    s.add(ROUNDS[0], plot=False)
    w1 = load_file(str(tmp_path / "s" / "weights-0001.safetensors"))
    s.add(ROUNDS[1], plot=False)
    st = s.status()
    assert st["name"] == "lora-seq" and set(st["files"]) == {"weights"}  # no optimizer state, no factors
    assert not any(r["optimizer_carried"] for r in st["rounds"])
    assert all(r["environment"]["source"] == source_commit() for r in st["rounds"])  # which code ran each round
    w2 = load_file(str(tmp_path / "s" / st["files"]["weights"]))
    assert set(w1) == set(w2) == qv and all(not torch.equal(w1[n], w2[n]) for n in qv)
    s.export(tmp_path / "exp")
    model, _ = load_model(str(tmp_path / "exp"))
    base, _ = load_model(str(tiny_model_dir))
    changed = {n for (n, p), (_, q) in zip(model.named_parameters(), base.named_parameters()) if not torch.equal(p, q)}
    assert changed == qv and all(torch.equal(model.get_parameter(n), w2[n]) for n in qv)
    assert not any("lora" in n for n in model.state_dict())


def test_export_overwrite_keeps_other_files(ref, tmp_path, capsys):
    """A second export into a used --out needs --overwrite and then replaces only the earlier export's files."""
    out = tmp_path / "exp"
    shutil.copytree(ref["export"], out)
    (out / "notes.txt").write_text("keep me")
    assert main(["session", "export", str(ref["sess"]), "--out", str(out), "--quiet"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["session", "export", str(ref["sess"]), "--out", str(out), "--overwrite", "--quiet"]) == 0
    marker = json.loads((out / "crispedit_session.json").read_text())
    assert (out / "notes.txt").read_text() == "keep me" and "model.safetensors" in marker["files"]
    assert "notes.txt" not in marker["files"]


def test_session_keeps_its_meaning_of_default_contexts(tmp_path, tiny_model_dir, monkeypatch):
    """A session created under another DEFAULT_CONTEXTS keeps training what 'default' meant then (its
    rounds stay reproducible); a session without the record is malformed."""
    from crispedit.editing.contexts import DEFAULT_CONTEXTS

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    s = Session.create(tmp_path / "s", str(tiny_model_dir), _config(edit={"epochs": 1}), progress=False)
    meta_file = tmp_path / "s" / "session.json"
    meta = json.loads(meta_file.read_text())
    assert meta["default_contexts"] == DEFAULT_CONTEXTS and meta["config"]["edit"]["contexts"] == "default"
    assert s.config.edit.contexts == "default"  # created now: today's default, nothing pinned
    seen = []
    monkeypatch.setattr(
        session_mod,
        "run_round",
        lambda model, tok, layers, reqs, state, config, *a, **k: (
            seen.append(config.edit.contexts) or (_ for _ in ()).throw(RuntimeError("stop"))
        ),
    )
    meta["default_contexts"] = "bare,prefix:3"  # as if created under another default
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(RuntimeError, match="stop"):
        Session.open(tmp_path / "s", config=_config(edit={"epochs": 1})).add(ROUNDS[0], plot=False)
    assert seen == ["bare,prefix:3"]
    del meta["default_contexts"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CrispEditError, match="malformed: no 'default_contexts'"):
        Session.open(tmp_path / "s")
    meta["default_contexts"] = "bare,nonsense:2"
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(CrispEditError, match="malformed: 'default_contexts'"):
        Session.open(tmp_path / "s")


def test_replay_draws_a_seeded_sample_of_the_earlier_edits():
    """``replayed``: at most ``n`` of the earlier edits, in stream order, the same for a redone round, another
    sample for another round or seed; none without earlier edits or with ``n`` 0."""
    from crispedit.sessions.sequential import replayed

    earlier = [r for rs in ROUNDS for r in rs]
    a = replayed(earlier, 3, 0, 5)
    assert len(a) == 3 and a == replayed(earlier, 3, 0, 5)
    assert [earlier.index(r) for r in a] == sorted(earlier.index(r) for r in a)
    assert any(replayed(earlier, 3, 0, k) != a for k in range(6, 10)) and replayed(earlier, 3, 1, 5) != a
    assert replayed(earlier, 50, 0, 5) == earlier and replayed(earlier, 0, 0, 5) == replayed([], 3, 0, 5) == []
    with pytest.raises(CrispEditError, match="replay"):
        SeqConfig(replay=-1)
    assert "replay" not in SeqConfig(mode="batch").identity() and SeqConfig(replay=4).identity()["replay"] == 4


def test_a_round_with_replay_trains_earlier_edits_beside_its_own(tmp_path, tiny_model_dir, monkeypatch):
    """With ``replay=2`` round 2 trains its 4 edits and 2 of round 1's (sequences of 6 edits; the record says
    ``replayed``), while its edit factors and its teacher-forced figures stay its own edits'; round 1 has nothing
    to replay."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    cfg = _config(edit={"epochs": 2, "contexts": "bare"}, replay=2)
    s = Session.create(tmp_path / "s", str(tiny_model_dir), cfg, progress=False)
    for reqs in ROUNDS:
        s.add(reqs, plot=False)
    r1, r2 = s.status()["rounds"]
    assert r1["replayed"] == 0 and r1["train"]["sequences"] == 4
    assert r2["replayed"] == 2 and r2["train"]["sequences"] == 6 and r2["n_edits"] == 4
    # accumulated over the rounds: round 2 adds its own 4 edits' tokens (about round 1's), not 6 edits' worth
    assert abs(r2["edit_factor_tokens"] - 2 * r1["edit_factor_tokens"]) < 0.1 * r1["edit_factor_tokens"]


def test_checked_earlier_is_bounded_and_spread_over_the_stream():
    """All earlier edits up to the cap; past it at most ``cap`` of them, evenly spaced from the first (round 1's
    first edit always among them)."""
    from crispedit.sessions.session import checked_earlier

    assert checked_earlier(5, 10) == [0, 1, 2, 3, 4] and checked_earlier(0, 10) == []
    assert checked_earlier(10, 4) == [0, 3, 6, 9]
    big = checked_earlier(100_000, 1000)
    assert len(big) == 1000 and big[0] == 0 and big[-1] == 99_900


def test_a_round_checks_at_most_check_earlier_earlier_edits(tmp_path, tiny_model_dir, monkeypatch):
    """With ``check_earlier=2`` round 2 checks its own 4 edits and 2 of round 1's: the record counts the 6 checked,
    round 1's retention is over those 2; the setting does not change what a reopened session is matched on."""
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    import crispedit.sessions.session as sess_mod

    seen = []
    real = sess_mod.EditJob

    class Spy(real):
        def __init__(self, model, tok, requests, *a, **k):
            seen.append([r.prompt for r in requests])
            super().__init__(model, tok, requests, *a, **k)

    monkeypatch.setattr(sess_mod, "EditJob", Spy)
    cfg = _config(edit={"epochs": 2, "contexts": "bare"}, check_earlier=2)
    assert cfg.identity() == _config(edit={"epochs": 2, "contexts": "bare"}).identity()
    s = Session.create(tmp_path / "s", str(tiny_model_dir), cfg, progress=False)
    for reqs in ROUNDS:
        s.add(reqs, plot=False)
    r1, r2 = s.status()["rounds"]
    assert "checked_edits" not in r1 and r2["checked_edits"] == 6 and set(r2["retention"]) == {"1", "2"}
    assert seen[-1] == [ROUNDS[0][0].prompt, ROUNDS[0][2].prompt] + [r.prompt for r in ROUNDS[1]]
