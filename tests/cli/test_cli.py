"""The CLI end to end on a tiny model directory, and its answers to bad input."""

import json

import pytest
import torch

from conftest import edits_file
from crispedit.cli import main


def run(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def common(tiny_model_dir, edits, out):
    return [
        "edit",
        "--model",
        tiny_model_dir,
        "--edits",
        edits,
        "--layers",
        "model.layers.{1-2}.mlp.down_proj",
        "--n-cap",
        4,
        "--max-len",
        32,
        "--epochs",
        3,
        "--lr",
        1e-2,
        "--out",
        out,
        "--quiet",
    ]


def test_edit_writes_loadable_model_and_report(tiny_model_dir, tmp_path, iso_cache, capsys):
    out = tmp_path / "out"
    kl = tmp_path / "kl.txt"
    kl.write_text("first held out paragraph of text.\n\nsecond held out paragraph.")
    code, stdout, err = run(common(tiny_model_dir, edits_file(tmp_path), out) + ["--kl-text", kl], capsys)
    assert code == 0, err
    report = json.loads((out / "edit_report.json").read_text())
    for key in ("method", "gamma", "layers", "n_edits", "summary", "per_edit", "config", "environment"):
        assert key in report
    for key in ("rel", "gen", "kl_drift", "edit_seconds", "cache_seconds"):
        assert key in report["summary"]
    assert report["n_edits"] == 4 and len(report["per_edit"]) == 4 and report["method"] == "crispedit"
    # free-generation WILD section per context (the tiny tokenizer has no chat template: chat is None)
    assert set(report["wild"]) >= {"qa", "none", "chat", "seconds"} and report["wild"]["chat"] is None
    for ctx in ("qa", "none"):
        w = report["wild"][ctx]
        assert 0 <= w["rel"] <= 1 and len(w["examples"]) == 3 and 0 <= w["cross"] <= 1 - w["rel"]
        assert (
            f"WILD {ctx:5}: rel={w['rel']} gen={w['gen']} loc_vs_answer={w['loc_vs_answer']} crosstalk={w['cross']}"
        ) in stdout
    assert report["training"]["contexts"] == ["bare", "prefix:2", "lead:4"] and report["training"]["sequences"] == 28
    assert report["layers"] == ["model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj"]
    from transformers import AutoModelForCausalLM

    edited = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    w = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(edited.state_dict()[w], base.state_dict()[w])
    assert torch.equal(
        edited.state_dict()["model.layers.0.mlp.down_proj.weight"],
        base.state_dict()["model.layers.0.mlp.down_proj.weight"],
    )
    # second run reuses the curvature cache; --no-wild drops the section; contexts / answer end / eigenbasis flags
    code, _, err = run(
        common(tiny_model_dir, edits_file(tmp_path), tmp_path / "out2")
        + ["--no-wild", "--contexts", "bare", "--answer-end", "none", "--projection", "eigenbasis"],
        capsys,
    )
    report2 = json.loads((tmp_path / "out2" / "edit_report.json").read_text())
    assert code == 0 and report2["cache"]["hit"] and not report["cache"]["hit"]
    assert "wild" not in report2 and report2["training"]["contexts"] == ["bare"]
    assert report2["config"]["projection_target"] == "eigenbasis" and report2["config"]["answer_end"] == "none"


def test_cache_build_info_and_explicit_file(tiny_model_dir, tmp_path, iso_cache, capsys):
    f = tmp_path / "factors.safetensors"
    code, out, err = run(
        [
            "cache",
            "build",
            "--model",
            tiny_model_dir,
            "--layers",
            "model.layers.{1-2}.mlp.down_proj",
            "--n-cap",
            4,
            "--max-len",
            32,
            "--out",
            f,
            "--quiet",
        ],
        capsys,
    )
    assert code == 0, err and f.is_file()
    code, out, _ = run(["cache", "info", f], capsys)
    assert code == 0 and json.loads(out)["spec"]["layers"] == [
        "model.layers.1.mlp.down_proj",
        "model.layers.2.mlp.down_proj",
    ]
    code, out, _ = run(["cache", "list"], capsys)
    assert code == 0 and ".safetensors" in out
    code, _, err = run(common(tiny_model_dir, edits_file(tmp_path), tmp_path / "o") + ["--cache", f], capsys)
    assert code == 0, err


def _bad(tmp_path, kind, tiny_model_dir, tiny_tok):
    edits = edits_file(tmp_path)
    if kind == "malformed":
        edits.write_text('[{"src": "q?", "alt": ')
    elif kind == "empty":
        edits.write_text("")
    elif kind == "missing_field":
        edits.write_text('[{"prompt": "q?", "target_new": "x"}, {"prompt": "q?"}]')
    elif kind == "empty_target":
        edits.write_text('[{"src": "q?", "alt": ""}]')
    args = common(tiny_model_dir, edits, tmp_path / "out")
    if kind == "unknown_layer":
        args[args.index("--layers") + 1] = "model.layers.{3-7}.mlp.down_proj"
    elif kind == "not_linear":
        args[args.index("--layers") + 1] = "model.layers.1.mlp"
    elif kind == "gamma":
        args += ["--gamma", 1.5]
    elif kind == "gamma0":
        args += ["--gamma", 0]
    elif kind == "n_cap":
        args[args.index("--n-cap") + 1] = 0
    elif kind == "n_edits":
        args += ["--n-edits", 0]
    elif kind == "missing_edits":
        args[args.index("--edits") + 1] = tmp_path / "nope.json"
    elif kind in ("foreign_cache", "truncated_cache"):
        from conftest import build_llama
        from crispedit.curvature.cache import CurvatureSpec, save_factors
        from crispedit.curvature.factors import KFACFactors
        from crispedit.weights import weight_fingerprint

        other = build_llama(len(tiny_tok), seed=1)
        names = ["model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj"]
        f = KFACFactors({n: torch.eye(48) for n in names}, {n: torch.eye(32) for n in names}, 10)
        spec = CurvatureSpec(weight_fingerprint(other), tuple(names), "x", 4, 32, "sampled", 0)
        path = save_factors(tmp_path / "c.safetensors", f, spec)
        if kind == "truncated_cache":
            path.write_bytes(path.read_bytes()[:-100])
        args += ["--cache", path]
    elif kind == "contexts":
        args += ["--contexts", "bare,qa"]
    elif kind == "chat_context":
        args += ["--contexts", "bare,chat"]
    elif kind == "kl_text":
        args += ["--kl-text", tmp_path / "missing.txt"]
    elif kind == "bad_model":
        args[args.index("--model") + 1] = tmp_path
    return args


@pytest.mark.parametrize(
    "kind,msg",
    [
        ("malformed", "malformed JSON"),
        ("empty", "empty"),
        ("missing_field", "record 1"),
        ("empty_target", "'alt' is empty"),
        ("unknown_layer", "unknown layer 'model.layers.4.mlp.down_proj'"),
        ("not_linear", "not a linear layer"),
        ("gamma", "gamma"),
        ("gamma0", "gamma"),
        ("n_cap", "n-cap must be a positive integer"),
        ("n_edits", "positive"),
        ("missing_edits", "not found"),
        ("foreign_cache", "another model"),
        ("truncated_cache", "truncated or corrupt"),
        ("kl_text", "text file not found"),
        ("bad_model", "not a Hugging Face model directory"),
        ("contexts", "unknown edit context 'qa'"),
        ("chat_context", "needs a tokenizer with a chat template"),
    ],
)
def test_bad_input_one_line_error_nothing_written(kind, msg, tiny_model_dir, tiny_tok, tmp_path, iso_cache, capsys):
    args = _bad(tmp_path, kind, tiny_model_dir, tiny_tok)
    code, out, err = run(args, capsys)
    assert code == 2
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("crispedit: error:")]
    assert len(lines) == 1 and msg in lines[0], err
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_refuses_to_overwrite_foreign_directory(tiny_model_dir, tmp_path, iso_cache, capsys):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    code, _, err = run(common(tiny_model_dir, edits_file(tmp_path), out), capsys)
    assert code == 2 and "is not empty; pass --overwrite" in err and (out / "notes.txt").read_text() == "keep me"
    code, _, err = run(common(tiny_model_dir, edits_file(tmp_path), out) + ["--overwrite"], capsys)
    assert code == 2 and "refusing to overwrite" in err and sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_demo_runs_end_to_end_on_a_tiny_model(tiny_model_dir, iso_cache, capsys):
    """The demo's flow (before/after answers, WILD per context, drift) on a tiny model directory."""
    from crispedit.demo import run_demo

    assert run_demo(n_edits=4, epochs=2, n_cap=4, model_spec=str(tiny_model_dir), show=2, progress=False) == 0
    out = capsys.readouterr().out
    assert "bare question (no chat template)" in out
    lines = [ln for ln in out.splitlines() if ln.startswith(("crispedit ", "ft "))]
    assert len(lines) == 2 and all("bare,prefix:2,lead:4" in ln for ln in lines)
    assert "kl_drift" in out and "WILD" in out
    # output that is not a terminal: a line per phase and per few epochs instead of bars
    assert "] loading " in out and "] editing with crispedit" in out and "] ft: edited in" in out
    assert "capability curvature (kfac): collecting over 4 texts" in out
    assert "edit[crispedit] epoch 2/2" in out and "edit[ft] epoch 2/2" in out


def test_overwrite_replaces_only_crispedits_files_quietly(tiny_model_dir, tmp_path, iso_cache, capsys):
    """--overwrite keeps the user's files, replaces the earlier edit and deletes only files that edit listed;
    --quiet saves without transformers' "Writing model shards" bar; the report states the cache's spec."""
    out = tmp_path / "out"
    code, _, err = run(common(tiny_model_dir, edits_file(tmp_path), out) + ["--no-wild"], capsys)
    assert code == 0, err
    assert "Writing model shards" not in err and err.strip() == "", err
    report = json.loads((out / "edit_report.json").read_text())
    assert "model.safetensors" in report["files"] and "edit_report.json" in report["files"]
    spec = report["cache"]["spec"]
    assert (spec["n_texts"], spec["max_len"], spec["label_mode"], spec["layers"]) == (
        4,
        32,
        "sampled",
        ["model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj"],
    )
    (out / "notes.txt").write_text("keep me")
    (out / "old-shard.safetensors").write_text("stale")  # as if the earlier edit had written it
    report["files"].append("old-shard.safetensors")
    (out / "edit_report.json").write_text(json.dumps(report))
    code, _, err = run(common(tiny_model_dir, edits_file(tmp_path), out) + ["--no-wild", "--epochs", 1], capsys)
    assert code == 2 and "--overwrite" in err
    code, stdout, err = run(
        common(tiny_model_dir, edits_file(tmp_path), out) + ["--no-wild", "--epochs", 1, "--overwrite"], capsys
    )
    assert code == 0, err
    assert "epochs=1 last_loss=" in stdout and "lr=0.01" in stdout, stdout  # the loop's line: its epochs and lr
    assert (out / "notes.txt").read_text() == "keep me" and not (out / "old-shard.safetensors").exists()
    new = json.loads((out / "edit_report.json").read_text())
    assert new["training"]["epochs"] == 1 and "notes.txt" not in new["files"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_input_cache_kind_and_closed_form_methods_from_the_cli(tiny_model_dir, tmp_path, iso_cache, capsys):
    """`cache build --kind input` exports an A-only file that `edit --method memit --cache` uses; a K-FAC file
    is refused for memit (and an input file for crispedit) with one line."""
    layers = ["--layers", "model.layers.{0-1}.mlp.down_proj", "--n-cap", 4, "--max-len", 32, "--quiet"]
    cov, kfac = tmp_path / "cov.safetensors", tmp_path / "kfac.safetensors"
    code, out, err = run(
        ["cache", "build", "--model", tiny_model_dir, "--kind", "input", "--out", cov] + layers, capsys
    )
    assert code == 0 and "input covariances for 2 layers" in out, err
    code, out, _ = run(["cache", "info", cov], capsys)
    info = json.loads(out)
    assert info["spec"]["kind"] == "input" and info["shapes"]["model.layers.0.mlp.down_proj"] == [[48, 48]]
    code, out, _ = run(["cache", "list"], capsys)
    assert "kind=input" in out
    assert run(["cache", "build", "--model", tiny_model_dir, "--out", kfac] + layers, capsys)[0] == 0
    edit_args = [
        "edit",
        "--model",
        tiny_model_dir,
        "--edits",
        edits_file(tmp_path),
        "--no-wild",
        "--memit-v-steps",
        5,
        "--memit-prefixes",
        0,
    ] + layers
    code, out, err = run(edit_args + ["--method", "memit", "--cache", cov, "--out", tmp_path / "m"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "m" / "edit_report.json").read_text())
    assert report["method"] == "memit" and report["config"]["options"]["v_steps"] == 5
    assert report["cache"]["spec"]["kind"] == "input"
    code, _, err = run(edit_args + ["--method", "memit", "--cache", kfac, "--out", tmp_path / "m2"], capsys)
    assert code == 2 and "holds kfac statistics, not input" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m2").exists()
    code, _, err = run(
        ["edit", "--model", tiny_model_dir, "--edits", edits_file(tmp_path), "--cache", cov, "--out", tmp_path / "c"]
        + layers,
        capsys,
    )
    assert code == 2 and "holds input statistics, not kfac" in err


def test_log_level_info_prints_the_edits_progress_on_stderr(tiny_model_dir, tmp_path, iso_cache, capsys, monkeypatch):
    """Off a terminal there are no bars: ``--log-level info`` (or $CRISPEDIT_LOG_LEVEL) prints the edit's progress
    — the curvature collection and the epochs — one timed line each on stderr; the default prints none of it; a
    level that is not one gets one error line."""
    edits = edits_file(tmp_path)
    code, _, err = run(["--log-level", "info"] + common(tiny_model_dir, edits, tmp_path / "a"), capsys)
    assert code == 0
    lines = [ln for ln in err.splitlines() if "crispedit." in ln]
    assert any("capability curvature" in ln for ln in lines)
    assert any("edit[crispedit] epoch 3/3: loss" in ln for ln in lines)
    assert all(ln[:4].isdigit() for ln in lines)  # each line starts with its time
    code, _, err = run(common(tiny_model_dir, edits, tmp_path / "b"), capsys)
    assert code == 0 and "edit[crispedit] epoch" not in err
    monkeypatch.setenv("CRISPEDIT_LOG_LEVEL", "INFO")
    code, _, err = run(common(tiny_model_dir, edits, tmp_path / "c"), capsys)
    assert code == 0 and "edit[crispedit] epoch 3/3" in err
    monkeypatch.setenv("CRISPEDIT_LOG_LEVEL", "chatty")
    code, _, err = run(common(tiny_model_dir, edits, tmp_path / "d"), capsys)
    assert code == 2 and err.strip().splitlines() == [
        "crispedit: error: log level 'chatty' (from CRISPEDIT_LOG_LEVEL?) is not one of debug, info, warning, error"
    ]
    assert not (tmp_path / "d").exists()
