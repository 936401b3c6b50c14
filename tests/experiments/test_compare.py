"""`crispedit compare`: same edits, same base, same evaluation for every method; resumable."""

import dataclasses
import json

import pytest

import crispedit
from conftest import edits_file
from crispedit import pipeline as pipeline_mod
from crispedit.cli import main
from crispedit.data import EditRequest
from crispedit.editing import EditConfig
from crispedit.errors import CrispEditError
from crispedit.experiments import compare as compare_mod
from crispedit.experiments import compare_outputs, compare_plot, compare_table
from crispedit.experiments.retention import retention_map
from crispedit.versions import source_commit, stamped
from crispedit.weights import weight_fingerprint

LAYERS = "model.layers.{1-2}.mlp.down_proj"
REAL_EDIT = pipeline_mod.edit
REAL_RUN_SEQUENCE = compare_mod.run_sequence
REQS = [
    EditRequest(
        f"Who founded club {i}?",
        f"Founder {chr(65 + i)}",
        rephrase_prompts=[f"Club {i} was founded by?"],
        locality=[("nq question: who sang it", "someone")],
    )
    for i in range(3)
]


def configs(methods, **kw):
    base = dict(layers=LAYERS, epochs=4, n_cap=4, max_len=32, contexts="bare", batch_size=4)
    base.update(kw)
    return {m: EditConfig(method=m, **base) for m in methods}


def counting_edit(monkeypatch, fail_on=None):
    """Wrap the edit() that compare's rows run (through pipeline.EditJob): record which methods ran; raise
    KeyboardInterrupt (a kill) on ``fail_on``."""
    ran, real = [], REAL_EDIT

    def fake(model, tok, requests, cfg, **kw):
        ran.append(cfg.method)
        if cfg.method == fail_on:
            real(model, tok, requests, cfg, **kw)  # the model is edited ... then the process "dies"
            raise KeyboardInterrupt
        return real(model, tok, requests, cfg, **kw)

    monkeypatch.setattr(pipeline_mod, "edit", fake)
    return ran


def test_compare_runs_every_method_from_the_same_base_and_resumes(tiny_lm, tmp_path, iso_cache, monkeypatch):
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    out = tmp_path / "cmp"
    methods = ["ft", "locbf-ft", "lora"]
    ran = counting_edit(monkeypatch, fail_on="locbf-ft")
    with pytest.raises(KeyboardInterrupt):
        compare_mod.run_compare(model, tok, REQS, methods, out, configs=configs(methods), progress=False)
    assert weight_fingerprint(model) == fp  # the interrupted edit was undone
    partial = json.loads((out / "compare.json").read_text())
    assert set(partial["results"]) == {"base", "ft"} and ran == ["ft", "locbf-ft"]
    ran = counting_edit(monkeypatch)
    payload = compare_mod.run_compare(model, tok, REQS, methods, out, configs=configs(methods), progress=False)
    assert ran == ["locbf-ft", "lora"]  # only the missing methods ran again
    assert payload["results"]["ft"] == partial["results"]["ft"]
    assert weight_fingerprint(model) == fp
    res = payload["results"]
    assert res["base"]["summary"]["kl_drift"] == 0.0
    for m in methods:
        r = res[m]
        assert r["summary"]["kl_drift"] > 0 and r["edit_seconds"] > 0 and r["config"]["method"] == m
        assert set(r["wild"]) >= {"qa", "none", "chat"} and r["wild"]["chat"] is None  # no chat template
        assert r["memory"]["measure"] and r["memory"]["increase_mib"] is not None
    for r in res.values():  # where each row ran: rows of one compare may come from several processes
        assert r["environment"]["crispedit"] == crispedit.__version__ and r["environment"]["threads"] >= 1
        assert r["environment"]["source"] == source_commit()
    assert res["locbf-ft"]["changed"] == ["model.layers.2.mlp.down_proj.weight"]
    assert res["ft"]["summary"]["kl_predicted"] > 0 and res["lora"]["summary"]["kl_predicted"] is None
    assert set(res["ft"]["summary"]["kl_predicted_layers"]) == {
        "model.layers.1.mlp.down_proj",
        "model.layers.2.mlp.down_proj",
    }
    assert res["lora"]["config"]["lr"] == 5e-3 and res["lora"]["config"]["options"]["r"] == 8
    md = (out / "compare.md").read_text()
    assert (
        md.splitlines()[0].startswith("| method | QA rel | QA gen | none rel") and "| KL pred |" in md.splitlines()[0]
    )
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
    old = json.loads((out / "compare.json").read_text())
    again = compare_mod.run_compare(model, tok, REQS, ["ft"], out, configs=configs(["ft"]), progress=False)
    assert again["results"]["ft"]["summary"] == old["results"]["ft"]["summary"]  # resumed, not rerun
    config = old["results"]["ft"]["config"]
    del config["max_drift"]  # a row whose config lacks a field: another one
    (out / "compare.json").write_text(json.dumps(old))
    with pytest.raises(compare_mod.CrispEditError, match="holds ft run with another configuration"):
        compare_mod.run_compare(model, tok, REQS, ["ft"], out, configs=configs(["ft"]), progress=False)
    config["max_drift"] = None
    # rows stored as contexts 'default' under another default are another configuration: refused
    for key, value in (("default_contexts", "bare,chat,prefix:2"), ("fingerprint", "xxh3-" + "0" * 32)):
        bad = json.loads(json.dumps(old))
        bad["settings"][key] = value
        (out / "compare.json").write_text(json.dumps(bad))
        with pytest.raises(compare_mod.CrispEditError, match=f"other settings \\({key}\\)"):
            compare_mod.run_compare(model, tok, REQS, ["ft"], out, configs=configs(["ft"]), progress=False)


def test_compare_cli(tiny_model_dir, tmp_path, iso_cache, capsys):
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--model",
        tiny_model_dir,
        "--edits",
        edits_file(tmp_path),
        "--n-edits",
        2,
        "--layers",
        LAYERS,
        "--methods",
        "ft,lora",
        "--out",
        out,
        "--epochs",
        2,
        "--n-cap",
        4,
        "--max-len",
        32,
        "--contexts",
        "bare",
        "--lora-r",
        4,
        "--quiet",
        "--limit",
        2,
        "--max-gen-toks",
        8,
    ]
    assert main([str(a) for a in args]) == 0
    payload = json.loads((out / "compare.json").read_text())
    assert payload["methods"] == ["ft", "lora"] and payload["results"]["lora"]["config"]["options"]["r"] == 4
    # IFEval by default, offline from the prompts bundled in the package, paired with the base on the same items
    assert payload["settings"]["evaluation"]["capabilities"] == ["ifeval"]
    assert payload["settings"]["evaluation"]["max_gen_toks"] == 8
    for row in ("base", "ft", "lora"):
        ifeval = payload["results"][row]["capability_details"]["ifeval"]
        assert ifeval["source"] == "bundled" and ifeval["n"] == 2 and len(ifeval["items"]) == 2
        assert set(payload["results"][row]["assistant"]) == {"style", "bleed"}
    assert payload["results"]["base"]["assistant"]["style"]["length_ratio"] == 1.0
    table = capsys.readouterr().out
    assert "| lora |" in table and "chat len" in table and "bleed" in table


def test_compare_cli_seq_row_with_the_default_chunk(tiny_model_dir, tmp_path, iso_cache, capsys):
    """``--methods lora-seq`` from the command line: the shared flags and --lora-* reach the row's SeqConfig;
    without --seq-chunk 2 edits go in rounds of default_seq_chunk(2) = 1."""
    out = tmp_path / "cmp"
    args = [
        "compare",
        "--model",
        tiny_model_dir,
        "--edits",
        edits_file(tmp_path),
        "--n-edits",
        2,
        "--layers",
        LAYERS,
        "--methods",
        "lora-seq",
        "--out",
        out,
        "--epochs",
        2,
        "--n-cap",
        4,
        "--max-len",
        32,
        "--contexts",
        "bare",
        "--lora-r",
        4,
        "--quiet",
        "--capabilities",
        "none",
    ]
    assert main([str(a) for a in args]) == 0
    row = json.loads((out / "compare.json").read_text())["results"]["lora-seq"]
    assert row["rounds"] == 2 and row["seq_chunk"] == 1 and row["config"]["mode"] == "sequential"
    assert row["config"]["edit"]["epochs"] == 2 and row["config"]["edit"]["options"]["r"] == 4
    assert "lora-seq: 2 rounds of 1" in capsys.readouterr().out


def _seq_row(tiny_model_dir, tmp_path, settings: list) -> dict:
    """The crispedit-seq row of a two-edit compare on the tiny model (rounds of one) run with ``settings``."""
    out = tmp_path / "cmp"
    args = ["compare", "--model", tiny_model_dir, "--edits", edits_file(tmp_path), "--n-edits", 2, "--layers", LAYERS]
    args += ["--methods", "crispedit-seq", *settings, "--out", out, "--epochs", 2, "--n-cap", 4, "--max-len", 32]
    args += ["--contexts", "bare", "--quiet", "--capabilities", "none"]
    assert main([str(a) for a in args]) == 0
    return json.loads((out / "compare.json").read_text())["results"]["crispedit-seq"]


def test_compare_cli_seq_weighting_reaches_the_seq_row(tiny_model_dir, tmp_path, iso_cache):
    """``--seq-weighting each --seq-mix 0.2 --seq-replay 1 --seq-no-carry-optimizer``: the crispedit-seq row runs
    with them (and says so in its stored config; its second round trains one of the first round's edits beside its
    own)."""
    settings = ["--seq-weighting", "each", "--seq-mix", 0.2, "--seq-replay", 1, "--seq-no-carry-optimizer"]
    row = _seq_row(tiny_model_dir, tmp_path, settings)
    assert row["config"]["weighting"] == "each" and row["rounds"] == 2 and row["config"]["replay"] == 1
    assert row["config"]["carry_optimizer"] is False and row["config"]["mix"] == 0.2
    assert [r["replayed"] for r in row["round_records"]] == [0, 1]
    assert all(0 < v < 1 for v in row["round_records"][1]["projector_kept"].values())


def test_compare_cli_seq_apart_with_target_edit_factors(tiny_model_dir, tmp_path, iso_cache):
    """``--seq-weighting apart --seq-edit-factors target --seq-edit-gamma 0.8``: the row's second round projects
    with the two parts alternated and records each part's kept fraction."""
    settings = ["--seq-weighting", "apart", "--seq-edit-factors", "target", "--seq-edit-gamma", 0.8]
    row = _seq_row(tiny_model_dir, tmp_path, settings)
    c = row["config"]
    assert (c["weighting"], c["edit_factors"], c["edit_gamma"], row["rounds"]) == ("apart", "target", 0.8, 2)
    second = row["round_records"][1]
    assert set(second["projector_parts_kept"]) == set(second["projector_kept"])
    assert "projector_parts_kept" not in row["round_records"][0]


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--methods", "ft,rome"], "unknown method 'rome'"),
        (["--methods", "ft", "--lora-r", "4"], "--lora-r applies to method lora"),
        (["--methods", "lora", "--lora-r", "0"], "lora rank r must be at least 1"),
        (["--methods", "ft", "--capabilities", "arc,xyz"], "unknown capability task"),
        (["--methods", "ft,ultraedit-seq"], "ultraedit has no sequential mode"),
        (["--methods", "rome-seq"], "unknown method 'rome-seq'"),
        (["--methods", "ft", "--seq-chunk", "2"], "--seq-chunk sets the round size"),
        (["--methods", "ft-seq", "--seq-chunk", "0"], "--seq-chunk must be a positive"),
    ],
)
def test_compare_cli_one_line_errors(extra, msg, tiny_model_dir, tmp_path, capsys):
    args = [
        "compare",
        "--model",
        tiny_model_dir,
        "--edits",
        edits_file(tmp_path),
        "--n-edits",
        2,
        "--out",
        tmp_path / "cmp",
    ] + extra
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cmp").exists()


def test_compare_runs_the_closed_form_methods_on_one_input_cache(tiny_lm, tmp_path, iso_cache):
    """memit and alphaedit in compare: the first collects the input covariance, the second reuses it; each
    changes only the edit layers' down_proj and the base is restored between them."""
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    reqs = [
        EditRequest(
            f"Who founded club {i}?",
            f"Founder {chr(65 + i)}",
            subject=f"club {i}",
            rephrase_prompts=[f"Club {i} was founded by?"],
        )
        for i in range(2)
    ]
    methods = ["memit", "alphaedit"]
    cfgs = {
        m: EditConfig(method=m, layers=LAYERS, n_cap=4, max_len=32, options={"v_steps": 3, "prefixes": 0})
        for m in methods
    }
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
        compare_mod.run_compare(
            model, tok, REQS, ["ft", "memit"], tmp_path / "cmp", configs=configs(["ft", "memit"]), progress=False
        )
    assert ran == [] and not (tmp_path / "cmp").exists()


# ---------------------------------------------------------------------------------------------
# sequential rows (<method>-seq) and the Pareto front


def seq_configs(methods, **kw):
    """EditConfigs for batch rows, SeqConfigs (sequential mode) for -seq rows, all with the tiny settings."""
    from crispedit.editing import SeqConfig

    out = {}
    for m in methods:
        base = m[:-4] if m.endswith("-seq") else m
        cfg = configs([base], **kw)[base]
        out[m] = SeqConfig(edit=cfg) if m.endswith("-seq") else cfg
    return out


def counting_runs(monkeypatch, fail_on=None):
    """Record which rows ran through compare's edit() and run_sequence(); a kill on ``fail_on`` (a -seq row)."""
    ran = counting_edit(monkeypatch)
    real = REAL_RUN_SEQUENCE

    def fake(model, tok, requests, cfg, chunk, **kw):
        ran.append(cfg.edit.method + "-seq")
        res = real(model, tok, requests, cfg, chunk, **kw)
        if ran[-1] == fail_on:
            raise KeyboardInterrupt
        return res

    monkeypatch.setattr(compare_mod, "run_sequence", fake)
    return ran


def test_compare_seq_rows_run_in_rounds_evaluate_all_edits_and_resume(tiny_lm, tmp_path, iso_cache, monkeypatch):
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    out = tmp_path / "cmp"
    methods = ["ft", "ft-seq", "crispedit-seq"]
    ran = counting_runs(monkeypatch, fail_on="crispedit-seq")
    with pytest.raises(KeyboardInterrupt):
        compare_mod.run_compare(
            model, tok, REQS, methods, out, configs=seq_configs(methods), seq_chunk=2, progress=False
        )
    assert weight_fingerprint(model) == fp  # the interrupted sequence was undone
    assert set(json.loads((out / "compare.json").read_text())["results"]) == {"base", "ft", "ft-seq"}
    ran = counting_runs(monkeypatch)
    payload = compare_mod.run_compare(
        model, tok, REQS, methods, out, configs=seq_configs(methods), seq_chunk=2, progress=False
    )
    assert ran == ["crispedit-seq"] and weight_fingerprint(model) == fp  # only the missing row ran
    res = payload["results"]
    for m in ("ft-seq", "crispedit-seq"):
        r = res[m]
        assert r["rounds"] == 2 and r["seq_chunk"] == 2  # ceil(3 / 2)
        assert [x["n_edits"] for x in r["round_records"]] == [2, 1] and len(r["round_seconds"]) == 2
        assert all(x["environment"]["source"] == source_commit() for x in r["round_records"])  # who ran each round
        # (rounded)
        assert all(t > 0 for t in r["round_seconds"]) and r["edit_seconds"] >= sum(r["round_seconds"]) - 0.01
        assert set(r["summary"]) == set(res["ft"]["summary"])  # measured exactly like a batch row
        assert r["summary"]["kl_drift"] > 0 and r["config"]["mode"] == "sequential"
        assert set(r["wild"]) >= {"qa", "none", "chat"}
        # after every round, how much of round 1 (its 2 edits) still holds: teacher-forced and in the wild
        ret = r["retention"]
        assert len(ret) == 2 and all(x["n"] == 2 and 0 <= x["tf_rel"] <= 1 for x in ret)
        assert all(set(x["wild"]) == {"qa", "chat"} and 0 <= x["wild"]["qa"] <= 1 for x in ret)
        assert ret == [x["after_round"] for x in r["round_records"]]
        # the retention map: after round j, every round k <= j's edits, teacher-forced (round 1's is tf_rel)
        assert [len(x["by_round"]) for x in ret] == [1, 2] and all(x["by_round"][0] == x["tf_rel"] for x in ret)
        # each round's own edits right after it: round 1's is the first-round record, round 2's its one edit
        assert ret[0]["newest"] == {k: ret[0][k] for k in ("n", "tf_rel", "wild")}
        assert ret[1]["newest"]["n"] == 1 and ret[1]["newest"]["tf_rel"] == ret[1]["by_round"][1]
        assert set(ret[1]["newest"]["wild"]) == {"qa", "chat"}
        grid = retention_map(r)
        assert len(grid) == 2 and grid[0][1] is None and grid[1] == ret[1]["by_round"]
        assert grid[1][1] == pytest.approx(sum(r["tf"]["rel"][2:]) / 1, abs=1e-3)  # round 2's edit, final model
        # every edit's teacher-forced scores, in edit order: round 1's after the last round is its retention there
        tf = r["tf"]
        assert len(tf["rel"]) == len(tf["gen"]) == len(REQS) and set(tf["rel"]) <= {0, 1}
        assert sum(tf["rel"]) / len(REQS) == pytest.approx(r["summary"]["rel"], abs=1e-3)
        assert sum(tf["rel"][:2]) / 2 == pytest.approx(ret[-1]["tf_rel"], abs=1e-3)
    assert res["ft-seq"]["config"]["edit"]["method"] == "ft" and res["ft-seq"]["summary"]["kl_predicted"] > 0
    # crispedit-seq folded round 1's edits into round 2's constraint; ft-seq has no constraint to grow
    assert res["crispedit-seq"]["round_records"][0]["edit_factor_tokens"] > 0
    assert "edit_factor_tokens" not in res["ft-seq"]["round_records"][0]
    md = (out / "compare.md").read_text()
    assert "| ft-seq |" in md and "ft-seq: 2 rounds of 2" in md and "crispedit-seq: 2 rounds of 2" in md
    assert "Round-1 retention: the first round's 2 edits" in md and "| crispedit-seq | WILD qa rel |" in md
    assert (out / "retention.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "retention_map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ran = counting_runs(monkeypatch)  # a third run: nothing left to do
    compare_mod.run_compare(model, tok, REQS, methods, out, configs=seq_configs(methods), seq_chunk=2, progress=False)
    assert ran == []
    with pytest.raises(
        CrispEditError, match=r"holds ft-seq run with another configuration \(rounds of 2 edits, now 3\)"
    ):
        compare_mod.run_compare(
            model, tok, REQS, ["ft-seq"], out, configs=seq_configs(["ft-seq"]), seq_chunk=3, progress=False
        )
    with pytest.raises(CrispEditError, match="holds ft-seq run with another configuration"):
        compare_mod.run_compare(
            model, tok, REQS, ["ft-seq"], out, configs=seq_configs(["ft-seq"], epochs=5), seq_chunk=2, progress=False
        )
    # the factor weighting: it names the stored one for a crispedit-seq row, and does not matter to ft-seq's rounds
    other = {
        m: dataclasses.replace(c, weighting="fixed") if m.endswith("-seq") else c
        for m, c in seq_configs(methods).items()
    }
    with pytest.raises(CrispEditError, match=r"factor weighting each, now fixed: --seq-weighting each resumes it"):
        compare_mod.run_compare(model, tok, REQS, methods, out, configs=other, seq_chunk=2, progress=False)
    compare_mod.run_compare(
        model, tok, REQS, ["ft-seq"], out, configs={"ft-seq": other["ft-seq"]}, seq_chunk=2, progress=False
    )
    assert ran == []
    # the edit factors' γ and positions, the replay: named the same way
    crisp = seq_configs(["crispedit-seq"])["crispedit-seq"]
    for change, hint in (
        ({"edit_gamma": 0.9}, r"edit-factor gamma 0.8, now 0.9: --seq-edit-gamma 0.8 resumes it"),
        ({"edit_factors": "target"}, r"edit factors at full positions, now target: --seq-edit-factors full resumes it"),
        ({"replay": 3}, r"replay of 0 earlier edits, now 3: --seq-replay 0 resumes it"),
        ({"mix": 0.1}, r"the edit factors' share of the mix 0.5, now 0.1: --seq-mix 0.5 resumes it"),
        (
            {"carry_optimizer": False},
            r"Adam's state carried across rounds: True, now False: leaving out --seq-no-carry-optimizer resumes it",
        ),
    ):
        with pytest.raises(CrispEditError, match=hint):
            compare_mod.run_compare(
                model,
                tok,
                REQS,
                ["crispedit-seq"],
                out,
                seq_chunk=2,
                progress=False,
                configs={"crispedit-seq": dataclasses.replace(crisp, **change)},
            )
    assert ran == []


def test_a_seq_row_killed_between_or_inside_rounds_resumes_where_it_stopped(tiny_lm, tmp_path, iso_cache, monkeypatch):
    """A -seq row keeps its finished rounds (and the round in progress its finished epochs) across a kill: the
    resumed row trains only what was left and ends exactly where the uninterrupted row does."""
    import crispedit.editing.checkpoint as ckpt_mod
    import crispedit.sessions.in_memory as seq_mod

    model, tok = tiny_lm
    methods = ["crispedit-seq"]
    whole = compare_mod.run_compare(
        model, tok, REQS, methods, tmp_path / "whole", configs=seq_configs(methods), seq_chunk=1, progress=False
    )["results"]["crispedit-seq"]
    assert not list((tmp_path / "whole" / "checkpoints").glob("*"))  # removed once the row is written
    real_round, real_save = seq_mod.run_round, ckpt_mod.save_checkpoint
    rounds = []

    def counting_round(*a, **kw):
        rounds.append(a[6])  # round_index
        return real_round(*a, **kw)

    monkeypatch.setattr(seq_mod, "run_round", counting_round)
    out = tmp_path / "cut"
    seq_file = out / "checkpoints" / "crispedit-seq.safetensors"

    def dying_save(path, *a, **kw):  # dies right after round 2's first epoch is saved
        real_save(path, *a, **kw)
        if seq_file.exists() and len(rounds) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "save_checkpoint", dying_save)
    with pytest.raises(KeyboardInterrupt):
        compare_mod.run_compare(
            model, tok, REQS, methods, out, configs=seq_configs(methods), seq_chunk=1, progress=False
        )
    assert rounds == [1, 2] and (out / "checkpoints" / "crispedit-seq.round.safetensors").exists()
    monkeypatch.setattr(ckpt_mod, "save_checkpoint", real_save)
    rounds.clear()
    resumed = compare_mod.run_compare(
        model, tok, REQS, methods, out, configs=seq_configs(methods), seq_chunk=1, progress=False
    )["results"]["crispedit-seq"]
    assert rounds == [2, 3]  # round 1 came from the checkpoint

    def measured(d):  # without the wall-clock entries (edit_seconds, epoch_seconds, ...)
        if isinstance(d, dict):
            return {k: measured(v) for k, v in d.items() if not k.endswith("seconds") and k != "resumed_at_epoch"}
        return [measured(v) for v in d] if isinstance(d, list) else d

    assert resumed["round_records"][1]["train"]["resumed_at_epoch"] == 1  # round 2 went on from its epoch 1
    r2 = resumed["round_records"][1]  # its seconds count the killed run's epoch 1 and all the rest
    assert r2["train"]["resumed_seconds"] > 0
    assert resumed["round_seconds"][1] >= r2["train"]["seconds"] + r2["edit_factor_seconds"] - 0.01
    assert measured(resumed["round_records"]) == measured(whole["round_records"])
    assert measured(resumed["summary"]) == measured(whole["summary"]) and measured(resumed["wild"]) == measured(
        whole["wild"]
    )
    assert resumed["edit_seconds"] >= sum(resumed["round_seconds"]) - 0.01
    assert not list((out / "checkpoints").glob("*"))
    # a checkpoint of another run is refused in one line, not overwritten
    (out / "compare.json").unlink()
    seq_mod.save_sequence_checkpoint(seq_file, "another run", seq_mod.SeqState(weights={}), [], 0.0)
    with pytest.raises(CrispEditError, match="sequence checkpoint file .* belongs to another run"):
        compare_mod.run_compare(
            model, tok, REQS, methods, out, configs=seq_configs(methods), seq_chunk=1, progress=False
        )


def timeless(d):
    """``d`` without its ``seconds`` entries (at any depth): the measurements alone."""
    if isinstance(d, dict):
        return {k: timeless(v) for k, v in d.items() if k != "seconds"}
    return [timeless(v) for v in d] if isinstance(d, list) else d


def test_seq_row_with_one_round_equals_the_batch_row(tiny_lm, tmp_path, iso_cache):
    """chunk = n: one round from the base with a fresh optimizer and (for crispedit) the capability factors
    alone as the constraint — the batch edit, so every measurement matches. With chunk < n crispedit-seq
    differs (round 2 trains under the grown constraint from round 1's weights)."""
    model, tok = tiny_lm
    methods = ["ft", "ft-seq", "crispedit", "crispedit-seq"]
    res = compare_mod.run_compare(
        model, tok, REQS, methods, tmp_path / "one", configs=seq_configs(methods), seq_chunk=len(REQS), progress=False
    )["results"]
    for m in ("ft", "crispedit"):
        batch, seq = res[m], res[m + "-seq"]
        assert seq["rounds"] == 1
        assert seq["summary"]["kl_drift"] == batch["summary"]["kl_drift"] > 0
        assert seq["summary"]["kl_predicted"] == batch["summary"]["kl_predicted"]
        assert seq["summary"]["rel"] == batch["summary"]["rel"]
        assert timeless(seq["wild"]) == timeless(batch["wild"])
    two = compare_mod.run_compare(
        model,
        tok,
        REQS,
        ["crispedit-seq"],
        tmp_path / "two",
        configs=seq_configs(["crispedit-seq"]),
        seq_chunk=1,
        progress=False,
    )["results"]
    assert two["crispedit-seq"]["rounds"] == 3
    assert two["crispedit-seq"]["summary"]["kl_drift"] != res["crispedit"]["summary"]["kl_drift"]


def test_compare_refuses_a_seq_row_without_a_sequential_config(tiny_lm, tmp_path):
    from crispedit.editing import SeqConfig

    model, tok = tiny_lm
    with pytest.raises(CrispEditError, match="configuration given for ft-seq is not one of ft in sequential mode"):
        compare_mod.run_compare(
            model,
            tok,
            REQS,
            ["ft-seq"],
            tmp_path / "c",
            configs={"ft-seq": SeqConfig(edit=EditConfig(method="ft"), mode="batch")},
            progress=False,
        )
    with pytest.raises(CrispEditError, match="no sequential mode"):
        compare_mod.run_compare(
            model,
            tok,
            REQS,
            ["ultraedit-seq"],
            tmp_path / "c",
            configs={"ultraedit-seq": EditConfig(method="ultraedit")},
            progress=False,
        )
    with pytest.raises(CrispEditError, match="--seq-chunk sets the round size"):
        compare_mod.run_compare(
            model, tok, REQS, ["ft"], tmp_path / "c", configs=configs(["ft"]), seq_chunk=2, progress=False
        )
    assert not (tmp_path / "c").exists()


def test_parse_methods_seq_rows_and_all():
    from crispedit.cli.flags import parse_methods
    from crispedit.editing.config import default_seq_chunk
    from crispedit.editing.registry import method_names, seq_row

    assert parse_methods("crispedit-seq,ft,ft-seq,ft") == ["crispedit-seq", "ft", "ft-seq"]
    assert parse_methods("all") == method_names() + ["alphaedit-seq", "crispedit-seq", "ft-seq", "lora-seq"]
    assert seq_row("lora-seq") == ("lora", True) and seq_row("lora") == ("lora", False)
    assert seq_row("adam-nscl-seq") == ("adam-nscl", True)  # not in `all`, but may be named
    for bad, msg in [
        ("rome-seq", "unknown method 'rome-seq': 'rome' is not a method"),
        ("ultraedit-seq", "ultraedit has no sequential mode"),
        ("ft-seq-seq", "'ft-seq' is not a method"),
    ]:
        with pytest.raises(CrispEditError, match=msg):
            parse_methods(f"ft,{bad}")
    assert [default_seq_chunk(n) for n in (1, 5, 32, 100, 3000, 10000)] == [1, 1, 4, 10, 100, 100]
    from crispedit.editing.registry import MethodConfig, MethodSpec, add_method

    with pytest.raises(ValueError, match="may not end in '-seq'"):
        add_method(MethodSpec("x-seq", "a name that would shadow a sequential row", MethodConfig, "m:C"))
    with pytest.raises(ValueError, match="sequential must be one of"):
        MethodSpec("x", "bad mode", MethodConfig, "m:C", sequential="sometimes")


def test_pareto_front_on_hand_built_points():
    front = compare_table.pareto_front(
        {
            "a": (0.9, -0.010),  # best success
            "b": (0.5, -0.001),  # better retention than a, worse success: both on the front
            "c": (0.4, -0.002),  # dominated by b on both
            "d": (0.9, -0.010),  # equal to a: equal points are all on the front
            "e": (None, 0.0),  # no qa result: never on it, dominates nothing
            "f": (0.2, -0.0005),  # the least drift
            "g": (0.5, -0.003),  # ties b's success, worse retention: dominated
            "h": (float("nan"), 1.0),
        }
    )
    assert front == ["a", "b", "d", "f"]
    assert compare_table.pareto_front({}) == [] and compare_table.pareto_front({"x": (0.0, -1.0)}) == ["x"]


def _row(qa, kl, caps=None, ppl=None):
    summary = {"kl_drift": kl, "rel": 0.0, "gen": 0.0}
    if ppl is not None:
        summary.update(ppl=ppl, ppl_base=40.0)
    return {"summary": summary, "wild": {"qa": {"rel": qa, "gen": qa}}, "capabilities": caps or {}}


def test_pareto_points_and_the_table_marking():
    """Without capability tasks retention is -KL drift; with them the mean score / base score (the base row
    is the reference, never a candidate)."""
    settings = {"model": "m", "n_edits": 4, "edits": {}, "evaluation": {"capabilities": [], "limit": None}}
    results = {
        "base": _row(0.0, 0.0),
        "crispedit": _row(0.8, 0.002),
        "ft": _row(0.9, 0.05),
        "lora": _row(0.3, 0.01),
        "ft-seq": _row(0.1, 0.0005),
    }
    payload = {"settings": settings, "methods": ["crispedit", "ft", "lora", "ft-seq"], "results": results}
    p = compare_table.pareto_points(payload)
    assert p["success"] == "WILD qa rel" and p["retention"].startswith("-KL drift")
    assert p["points"]["ft"] == [0.9, -0.05] and "base" not in p["points"]
    assert p["front"] == p["kl_front"] == ["crispedit", "ft", "ft-seq"]  # lora: dominated by crispedit
    assert list(p)[:3] == ["success", "kl", "kl_front"] and p["breaking"] == {}  # no perplexity stored: none marked
    table = compare_table.compare_table(payload).splitlines()
    assert table[0].endswith("| Pareto (KL) |")
    marks = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in table[2:7]}
    assert marks == {"base (unedited)": "–", "crispedit": "★", "ft": "★", "lora": "", "ft-seq": "★"}
    caps = dict(settings, evaluation={"capabilities": ["arc", "tqa"], "limit": 10})
    results = {
        "base": _row(0.0, 0.0, {"arc": 0.5, "tqa": 0.4}),
        "crispedit": _row(0.8, 0.002, {"arc": 0.5, "tqa": 0.4}),
        "ft": _row(0.9, 0.05, {"arc": 0.25, "tqa": 0.4}),
        "lora": _row(0.3, 0.0001, {"arc": 0.5, "tqa": 0.2}),
    }
    p = compare_table.pareto_points({"settings": caps, "methods": ["crispedit", "ft", "lora"], "results": results})
    assert (
        p["points"]["ft"] == [0.9, 0.75] and p["points"]["lora"] == [0.3, 0.75] and p["points"]["crispedit"][1] == 1.0
    )
    assert p["front"] == ["crispedit", "ft"] and "arc, tqa" in p["retention"]  # lora's low KL no longer counts
    assert p["kl_front"] == ["crispedit", "ft", "lora"]  # ... but on the KL front it does
    payload = {"settings": caps, "methods": ["crispedit", "ft", "lora"], "results": results}
    table = compare_table.compare_table(payload).splitlines()
    assert table[0].endswith("| Pareto (KL) | Pareto (capabilities) |")  # the KL front first
    marks = {
        line.split("|")[1].strip(): (line.split("|")[-3].strip(), line.split("|")[-2].strip()) for line in table[2:6]
    }
    assert marks == {"base (unedited)": ("–", "–"), "crispedit": ("★", "★"), "ft": ("★", "★"), "lora": ("★", "")}
    fronts = [ln for ln in table if ln.startswith("Pareto front against KL drift")]
    assert fronts == [
        "Pareto front against KL drift (Pareto (KL) ★): crispedit, ft, lora. Pareto front against "
        "capability retention (Pareto (capabilities) ★): crispedit, ft. Breaking the model (✗: held-out "
        "perplexity more than 2× the base's; on neither front): none."
    ]
    assert not [ln for ln in table if ln.startswith("Capability change")]  # no per-item scores stored


def test_capability_changes_pair_items_with_the_base():
    """The paired change is the mean item difference against the base in points with its standard error;
    rows or tasks stored without per-item scores are left out of the note, not guessed."""
    settings = {"model": "m", "n_edits": 4, "edits": {}, "evaluation": {"capabilities": ["arc", "tqa"], "limit": 4}}
    base_items = {"arc": [1.0, 0.0, 1.0, 0.0], "tqa": [0.5, 0.25, 0.75, 0.5]}

    def with_items(qa, kl, items):
        r = _row(qa, kl, {c: sum(v) / len(v) for c, v in items.items()})
        r["capability_details"] = {c: {"items": v} for c, v in items.items()}
        return r

    results = {
        "base": with_items(0.0, 0.0, base_items),
        "crispedit": with_items(0.8, 0.002, {"arc": [1.0, 0.0, 1.0, 1.0], "tqa": [0.5, 0.25, 0.75, 0.5]}),
        "ft": with_items(0.9, 0.05, {"arc": [0.0, 0.0, 0.0, 0.0]}),
        "old": _row(0.5, 0.01, {"arc": 0.5, "tqa": 0.5}),
    }
    payload = {"settings": settings, "methods": ["crispedit", "ft", "old"], "results": results}
    ch = compare_table.capability_changes(payload)
    # crispedit: arc differences (0, 0, 0, 1) -> +25 points, SE = sd(0,0,0,1)/2 = 0.5/2 = 25 points; tqa unchanged
    assert ch["crispedit"] == {"arc": [25.0, 25.0], "tqa": [0.0, 0.0]}
    # ft: arc differences (-1, 0, -1, 0) -> -50 points, SE = sd/2 = (1/sqrt(3))/2; no tqa items
    assert ch["ft"] == {"arc": [-50.0, round(100 * (1 / 3) ** 0.5 / 2, 2)]} and "old" not in ch
    note = [ln for ln in compare_table.compare_table(payload).splitlines() if ln.startswith("Capability change")]
    assert len(note) == 1 and "arc: 4 items" in note[0] and "crispedit: arc +25.0 ± 25.0, tqa +0.0 ± 0.0" in note[0]
    assert "ft: arc -50.0 ± 28.9" in note[0] and "old:" not in note[0]


def test_compare_table_notes_a_steep_layer():
    """A row whose summary names a steep layer (``pipeline.steep_layers``) gets the same one-line note that
    ``crispedit edit`` prints; rows without one add nothing."""
    settings = {"model": "m", "n_edits": 4, "edits": {}, "evaluation": {"capabilities": [], "limit": None}}
    wide = _row(0.9, 0.08)
    wide["summary"]["steep_layers"] = [
        {"layer": "model.layers.11.mlp.down_proj", "predicted": 0.19, "share": 0.99, "vs_median": 760.0}
    ]
    payload = {
        "settings": settings,
        "methods": ["crispedit", "wide"],
        "results": {"base": _row(0.0, 0.0), "crispedit": _row(0.8, 0.002), "wide": wide},
    }
    notes = [ln for ln in compare_table.compare_table(payload).splitlines() if ln.startswith("Drift prediction notes")]
    assert (
        len(notes) == 1
        and "wide: model.layers.11.mlp.down_proj predicts 99% of the drift (0.19 nats/token, "
        "760x the other layers' median)"
        in notes[0]
        and "crispedit:" not in notes[0]
    )
    del wide["summary"]["steep_layers"]
    assert "Drift prediction notes" not in compare_table.compare_table(payload)
    wide["summary"]["mixing_layers"] = ["model.layers.4.self_attn.v_proj"]
    notes = [ln for ln in compare_table.compare_table(payload).splitlines() if ln.startswith("Drift prediction notes")]
    assert len(notes) == 1 and "wide: model.layers.4.self_attn.v_proj: attention mixes" in notes[0]


def test_compare_table_notes_crosstalk_per_wrapper():
    """Rows whose WILD wrappers carry ``cross`` get it in percent, wrapper by wrapper, the base row's too (chance);
    rows without it add nothing."""
    settings = {"model": "m", "n_edits": 4, "edits": {}, "evaluation": {"capabilities": [], "limit": None}}
    crisp, old = _row(0.8, 0.002), _row(0.9, 0.05)
    crisp["wild"] = {
        "qa": {"rel": 0.8, "gen": 0.5, "cross": 0.118},
        "none": {"rel": 1.0, "gen": 0.3, "cross": 0.0},
        "chat": None,
    }
    base = _row(0.0, 0.0)
    base["wild"]["qa"]["cross"] = 0.01
    payload = {
        "settings": settings,
        "methods": ["crispedit", "old"],
        "results": {"base": base, "crispedit": crisp, "old": old},
    }
    notes = [ln for ln in compare_table.compare_table(payload).splitlines() if ln.startswith("Crosstalk")]
    assert len(notes) == 1 and notes[0].endswith("chance): base: 1.0 (qa); crispedit: 11.8 / 0.0 (qa / none)")
    del crisp["wild"]["qa"]["cross"], crisp["wild"]["none"]["cross"], base["wild"]["qa"]["cross"]
    assert "Crosstalk" not in compare_table.compare_table(payload)


def test_alphaedit_seq_carries_kp_like_the_batch_run_across_its_batches(tiny_lm, tmp_path, iso_cache):
    """AlphaEdit-Seq: K_p K_pᵀ goes from round to round through the session state. With no model-written
    prefixes (so both runs use the same key templates) rounds of one edit give exactly what one alphaedit
    run with batches of one gives (it accumulates K_p across its batches); LoRA-Seq changes only q/v."""
    model, tok = tiny_lm
    reqs = [
        EditRequest(
            f"Who founded club {i}?",
            f"Founder {chr(65 + i)}",
            subject=f"club {i}",
            rephrase_prompts=[f"Club {i} was founded by?"],
        )
        for i in range(3)
    ]
    opts = {
        "v_steps": 5,
        "prefixes": 0,
        "batch_size": 1,
        "nullspace_threshold": 1.0,
        "l2": 1.0,
        "v_lr": 0.5,
        "clamp": 4.0,
    }
    cfgs = {**seq_configs(["alphaedit", "alphaedit-seq"], options=opts), **seq_configs(["lora-seq"])}
    res = compare_mod.run_compare(
        model, tok, reqs, list(cfgs), tmp_path / "c", configs=cfgs, seq_chunk=1, progress=False
    )["results"]
    seq = res["alphaedit-seq"]
    assert seq["rounds"] == 3 and [r["optimizer_carried"] for r in seq["round_records"]] == [False, True, True]
    assert seq["summary"]["kl_drift"] == res["alphaedit"]["summary"]["kl_drift"] > 0
    assert timeless(seq["wild"]) == timeless(res["alphaedit"]["wild"])
    assert seq["summary"]["rel"] == res["alphaedit"]["summary"]["rel"]
    assert res["lora-seq"]["rounds"] == 3 and all(
        n.endswith(("q_proj.weight", "v_proj.weight")) for n in res["lora-seq"]["changed"]
    )


def breaking_payload():
    """Hand-built compare payload (capability tasks with per-item scores, perplexities against a base of 40):
    lora edits best and drifts least of the rest but its perplexity is 2.5x the base's; ft is at 1.9x."""
    settings = {"model": "m", "n_edits": 4, "edits": {}, "evaluation": {"capabilities": ["arc_challenge"], "limit": 4}}

    def with_items(qa, kl, ppl, items):
        r = _row(qa, kl, {"arc_challenge": sum(items) / len(items)}, ppl=ppl)
        r["capability_details"] = {"arc_challenge": {"items": items}}
        return r

    results = {
        "base": with_items(0.0, 0.0, 40.0, [1.0, 0.0, 1.0, 0.0]),
        "crispedit": with_items(0.8, 0.002, 41.0, [1.0, 0.0, 1.0, 1.0]),
        "ft": with_items(0.9, 0.05, 76.0, [1.0, 0.0, 0.0, 0.0]),
        "lora": with_items(1.0, 0.001, 100.0, [1.0, 1.0, 1.0, 1.0]),
        "mend": _row(None, 13.0, {"arc_challenge": 0.75}),
    }
    results["mend"]["wild"]["qa"] = None
    return stamped(
        {
            "format": compare_outputs.COMPARE_FORMAT,
            "settings": settings,
            "methods": ["crispedit", "ft", "lora", "mend"],
            "results": results,
        }
    )


def test_a_row_whose_perplexity_more_than_doubles_breaks_the_model_and_is_on_neither_front():
    """lora would dominate every row on both fronts; at 2.5x the base's perplexity it is marked ✗ and left out,
    so crispedit and ft (1.9x: not breaking) make up both fronts. A row without a perplexity is never marked."""
    payload = breaking_payload()
    assert compare_table.perplexity_ratios(payload) == {"crispedit": 1.025, "ft": 1.9, "lora": 2.5}
    assert compare_table.breaking_rows(payload) == {"lora": 2.5}
    p = compare_table.pareto_points(payload)
    assert p["breaking"] == {"lora": 2.5} and "lora" in p["points"]
    assert p["kl_front"] == p["front"] == ["crispedit", "ft"]
    # without the rule lora alone would be on both fronts
    assert compare_table.pareto_front(
        {m: (pt[0], -payload["results"][m]["summary"]["kl_drift"]) for m, pt in p["points"].items()}
    ) == ["lora"]
    table = compare_table.compare_table(payload).splitlines()
    cells = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]] for ln in table[2:7]}
    head = [c.strip() for c in table[0].split("|")[1:-1]]
    ppl, kl_col, cap_col = head.index("ppl (×base)"), head.index("Pareto (KL)"), head.index("Pareto (capabilities)")
    assert kl_col < cap_col
    assert cells["lora"][ppl] == "100.0 (×2.50) ✗" and cells["lora"][kl_col] == cells["lora"][cap_col] == "✗"
    assert cells["ft"][ppl] == "76.0 (×1.90)" and cells["ft"][kl_col] == cells["ft"][cap_col] == "★"
    assert cells["base (unedited)"][ppl] == "40.0" and cells["mend"][ppl] == "–"
    line = next(ln for ln in table if ln.startswith("Pareto front against KL drift"))
    assert line.index("KL drift") < line.index("capability retention") and line.endswith("front): lora (×2.50).")


def test_render_outputs_redraws_a_stored_compare_without_running_anything(tmp_path):
    """The stored compare.json is the input: compare.md and compare.png are rewritten from it (the picture has
    the drift panel and the capability panel), its pareto section recomputed, its results kept as they were."""
    pytest.importorskip("matplotlib")
    payload = breaking_payload()
    payload["pareto"] = {"front": ["lora"]}  # a stale stored front
    (tmp_path / "compare.json").write_text(json.dumps(payload))
    out = compare_outputs.render_outputs(tmp_path)
    stored = json.loads((tmp_path / "compare.json").read_text())
    assert stored["results"] == payload["results"] and stored["pareto"]["kl_front"] == ["crispedit", "ft"]
    assert out["pareto"] == stored["pareto"]
    assert (tmp_path / "compare.md").read_text() == compare_table.compare_table(stored)
    png = (tmp_path / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width = int.from_bytes(png[16:20], "big")
    assert width > 1200  # two panels side by side
    payload["settings"]["evaluation"]["capabilities"] = []
    compare_plot.plot_compare(payload, tmp_path / "one.png")
    assert int.from_bytes((tmp_path / "one.png").read_bytes()[16:20], "big") < width  # drift panel only
    with pytest.raises(CrispEditError, match="nothing to render"):
        compare_outputs.render_outputs(tmp_path / "missing")
    (tmp_path / "compare.json").write_text(json.dumps(dict(payload, format=99)))
    with pytest.raises(CrispEditError, match="with format 99; this crispedit writes format 1"):
        compare_outputs.render_outputs(tmp_path)
