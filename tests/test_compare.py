"""`crispedit compare`: same edits, same base, same evaluation for every method; resumable."""

import json

import pytest

from crispedit import compare as compare_mod
from crispedit.cli import main
from crispedit.data import EditRequest
from crispedit.editing import EditConfig
from crispedit.errors import CrispEditError
from crispedit.models import weight_fingerprint

from test_cli import edits_file

LAYERS = "model.layers.{1-2}.mlp.down_proj"
REAL_EDIT = compare_mod.edit
REQS = [EditRequest(f"Who founded club {i}?", f"Founder {chr(65 + i)}", rephrase_prompts=[f"Club {i} was founded by?"],
                    locality=[("nq question: who sang it", "someone")]) for i in range(3)]


def configs(methods, **kw):
    base = dict(layers=LAYERS, epochs=4, n_cap=4, max_len=32, contexts="bare", batch_size=4)
    base.update(kw)
    return {m: EditConfig(method=m, **base) for m in methods}


def counting_edit(monkeypatch, fail_on=None):
    """Wrap compare's edit(): record which methods ran; raise KeyboardInterrupt (a kill) on ``fail_on``."""
    ran, real = [], REAL_EDIT

    def fake(model, tok, requests, cfg, **kw):
        ran.append(cfg.method)
        if cfg.method == fail_on:
            real(model, tok, requests, cfg, **kw)   # the model is edited ... then the process "dies"
            raise KeyboardInterrupt
        return real(model, tok, requests, cfg, **kw)

    monkeypatch.setattr(compare_mod, "edit", fake)
    return ran


def test_compare_runs_every_method_from_the_same_base_and_resumes(tiny_lm, tmp_path, iso_cache, monkeypatch):
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    out = tmp_path / "cmp"
    methods = ["ft", "locbf-ft", "lora"]
    ran = counting_edit(monkeypatch, fail_on="locbf-ft")
    with pytest.raises(KeyboardInterrupt):
        compare_mod.run_compare(model, tok, REQS, methods, out, configs=configs(methods), progress=False)
    assert weight_fingerprint(model) == fp                     # the interrupted edit was undone
    partial = json.loads((out / "compare.json").read_text())
    assert set(partial["results"]) == {"base", "ft"} and ran == ["ft", "locbf-ft"]
    ran = counting_edit(monkeypatch)
    payload = compare_mod.run_compare(model, tok, REQS, methods, out, configs=configs(methods), progress=False)
    assert ran == ["locbf-ft", "lora"]                         # only the missing methods ran again
    assert payload["results"]["ft"] == partial["results"]["ft"]
    assert weight_fingerprint(model) == fp
    res = payload["results"]
    assert res["base"]["summary"]["kl_drift"] == 0.0
    for m in methods:
        r = res[m]
        assert r["summary"]["kl_drift"] > 0 and r["edit_seconds"] > 0 and r["config"]["method"] == m
        assert set(r["wild"]) >= {"qa", "none", "chat"} and r["wild"]["chat"] is None   # no chat template
        assert r["memory"]["measure"] and r["memory"]["increase_mib"] is not None
    assert res["locbf-ft"]["changed"] == ["model.layers.2.mlp.down_proj.weight"]
    assert res["ft"]["summary"]["kl_predicted"] > 0 and res["lora"]["summary"]["kl_predicted"] is None
    assert set(res["ft"]["summary"]["kl_predicted_layers"]) == {"model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj"}
    assert res["lora"]["config"]["lr"] == 5e-3 and res["lora"]["config"]["options"]["r"] == 8
    md = (out / "compare.md").read_text()
    assert md.splitlines()[0].startswith("| method | QA rel | QA gen | none rel") and "| KL pred |" in md.splitlines()[0]
    assert [line.split("|")[1].strip() for line in md.splitlines()[2:6]] == ["base (unedited)"] + methods
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_refuses_other_settings_in_the_same_dir(tiny_lm, tmp_path, iso_cache):
    model, tok = tiny_lm
    out = tmp_path / "cmp"
    compare_mod.run_compare(model, tok, REQS, ["ft"], out, configs=configs(["ft"]), progress=False)
    with pytest.raises(compare_mod.CrispEditError, match="other settings.*requests_digest"):
        compare_mod.run_compare(model, tok, REQS[:2], ["ft"], out, configs=configs(["ft"]), progress=False)
    with pytest.raises(compare_mod.CrispEditError, match="holds ft run with another configuration"):
        compare_mod.run_compare(model, tok, REQS, ["ft"], out, configs=configs(["ft"], epochs=5), progress=False)
    old = json.loads((out / "compare.json").read_text())      # written before EditConfig had max_drift
    del old["results"]["ft"]["config"]["max_drift"]
    (out / "compare.json").write_text(json.dumps(old))
    again = compare_mod.run_compare(model, tok, REQS, ["ft"], out, configs=configs(["ft"]), progress=False)
    assert again["results"]["ft"]["summary"] == old["results"]["ft"]["summary"]   # resumed, not rerun


def test_compare_cli(tiny_model_dir, tmp_path, iso_cache, capsys):
    out = tmp_path / "cmp"
    args = ["compare", "--model", tiny_model_dir, "--edits", edits_file(tmp_path), "--n-edits", 2, "--layers", LAYERS,
            "--methods", "ft,lora", "--out", out, "--epochs", 2, "--n-cap", 4, "--max-len", 32, "--contexts", "bare",
            "--lora-r", 4, "--quiet"]
    assert main([str(a) for a in args]) == 0
    payload = json.loads((out / "compare.json").read_text())
    assert payload["methods"] == ["ft", "lora"] and payload["results"]["lora"]["config"]["options"]["r"] == 4
    assert "| lora |" in capsys.readouterr().out


@pytest.mark.parametrize("extra,msg", [(["--methods", "ft,rome"], "unknown method 'rome'"),
                                       (["--methods", "ft", "--lora-r", "4"], "--lora-r applies to method lora"),
                                       (["--methods", "lora", "--lora-r", "0"], "lora rank r must be at least 1"),
                                       (["--methods", "ft", "--capabilities", "arc,xyz"], "unknown capability task")])
def test_compare_cli_one_line_errors(extra, msg, tiny_model_dir, tmp_path, capsys):
    args = ["compare", "--model", tiny_model_dir, "--edits", edits_file(tmp_path), "--n-edits", 2,
            "--out", tmp_path / "cmp"] + extra
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cmp").exists()


def test_compare_runs_the_closed_form_methods_on_one_input_cache(tiny_lm, tmp_path, iso_cache):
    """memit and alphaedit in compare: the first collects the input covariance, the second reuses it; each
    changes only the edit layers' down_proj and the base is restored between them."""
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    reqs = [EditRequest(f"Who founded club {i}?", f"Founder {chr(65 + i)}", subject=f"club {i}",
                        rephrase_prompts=[f"Club {i} was founded by?"]) for i in range(2)]
    methods = ["memit", "alphaedit"]
    cfgs = {m: EditConfig(method=m, layers=LAYERS, n_cap=4, max_len=32, options={"v_steps": 3, "prefixes": 0})
            for m in methods}
    payload = compare_mod.run_compare(model, tok, reqs, methods, tmp_path / "cmp", configs=cfgs, progress=False)
    res = payload["results"]
    assert res["memit"]["cache_hit"] is False and res["alphaedit"]["cache_hit"] is True
    for m in methods:
        assert res[m]["changed"] == [f"model.layers.{i}.mlp.down_proj.weight" for i in (1, 2)]
    assert weight_fingerprint(model) == fp
    assert "| alphaedit |" in (tmp_path / "cmp" / "compare.md").read_text()


def test_compare_refuses_requests_a_method_cannot_take_before_running_any(tiny_lm, tmp_path, iso_cache, monkeypatch):
    model, tok = tiny_lm
    ran = counting_edit(monkeypatch)
    with pytest.raises(CrispEditError, match="edit request 0 .* has no subject"):
        compare_mod.run_compare(model, tok, REQS, ["ft", "memit"], tmp_path / "cmp", configs=configs(["ft", "memit"]),
                                progress=False)
    assert ran == [] and not (tmp_path / "cmp").exists()
