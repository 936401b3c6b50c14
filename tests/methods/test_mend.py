"""MEND on the tiny random llama: the network file, meta-training, the editor, the CLI and bad inputs."""

import copy
import hashlib
import json

import pytest
import torch

from crispedit.cli import main
from crispedit.data import EditRequest, capability_corpus
from crispedit.editing import EditConfig, edit, restore
from crispedit.errors import CrispEditError
from crispedit.layers import resolve_layers
from crispedit.methods.mend import MENDTrainConfig
from crispedit.methods.mend.net import (
    MENDNetwork,
    default_layers,
    default_weights_path,
    edit_factors,
    load_network,
    save_network,
)
from crispedit.methods.mend.train import meta_loss, train_mend
from crispedit.weights import weight_fingerprint

LAYERS = "model.layers.{1-2}.mlp.down_proj"


def req(i: int) -> EditRequest:
    return EditRequest(
        f"Who wrote book number {i}?",
        f"Author {chr(65 + i % 26)}",
        rephrase_prompts=[f"Book {i} was written by whom?"],
        locality=[(f"What colour is car {i}?", "red")],
    )


TRAIN = [req(i) for i in range(100, 160)]  # disjoint from the held-out requests below
HELD = [req(i) for i in range(8)]
FAST = dict(batch_size=4, lr=1e-2, edit_lr=1e-3, rank=16, loc_texts=1, loc_len=32)


def trained(model, tok, layers, steps=60, **kw):
    """A network meta-trained for ``steps`` on TRAIN (fast settings for the tiny model)."""
    cfg = MENDTrainConfig(steps=steps, **{**FAST, **kw})
    return train_mend(model, tok, TRAIN, layers, cfg, passages=capability_corpus(None, 4), progress=False)


def identity_copy(net):
    """``net`` with its transform reset to the identity and α to its initial value (same statistics)."""
    ident = copy.deepcopy(net)
    with torch.no_grad():
        for tr in ident.transforms.values():
            for layer in tr.layers:
                layer.up.zero_()
                layer.bias.zero_()
                layer.scale.fill_(1.0)
                layer.shift.zero_()
        ident.alpha.fill_(net.config.edit_lr)
    return ident


def write_trained(model, tok, path, layers=LAYERS, steps=60):
    lay = resolve_layers(model, layers)
    net, _ = trained(model, tok, lay, steps)
    return save_network(path, net, model_fingerprint=weight_fingerprint(model), training={"offset": 100, "n_edits": 60})


def test_default_layers_are_the_mlp_matrices_of_the_last_three_blocks(tiny_lm):
    model, _ = tiny_lm
    assert default_layers(model) == [
        f"model.layers.{i}.mlp.{m}_proj" for i in (1, 2, 3) for m in ("gate", "up", "down")
    ]


def test_network_starts_as_the_identity_and_shares_one_transform_per_shape(tiny_lm):
    model, tok = tiny_lm
    layers = resolve_layers(model, ",".join(default_layers(model)))
    net = MENDNetwork({n: tuple(m.weight.shape) for n, m in layers.items()}, MENDTrainConfig(rank=8))
    assert sorted(net.transforms) == ["32x48", "48x32"]  # (d_in x d_out): gate/up and down
    assert net.modes["model.layers.3.mlp.down_proj"] == ("48x32", 2)
    U, D = edit_factors(model, tok, HELD[:2], layers)["model.layers.2.mlp.up_proj"]
    assert U.shape[1] == 32 and D.shape[1] == 48 and U.shape[0] == D.shape[0] > 0
    dW = net.delta("model.layers.2.mlp.up_proj", U, D, update=True)
    z = net.normalised("model.layers.2.mlp.up_proj", U, D).float()
    assert torch.allclose(dW, -net.config.edit_lr * z[:, 32:].T @ z[:, :32], atol=1e-5)  # identity transform
    # factors of a request do not depend on the batch it is in: ΔW of a batch = the sum of the requests'
    f1, f2 = (
        edit_factors(model, tok, HELD[:1], layers)["model.layers.2.mlp.up_proj"],
        edit_factors(model, tok, HELD[1:2], layers)["model.layers.2.mlp.up_proj"],
    )
    both = net.delta("model.layers.2.mlp.up_proj", U, D)
    assert torch.allclose(
        both, net.delta("model.layers.2.mlp.up_proj", *f1) + net.delta("model.layers.2.mlp.up_proj", *f2), atol=1e-5
    )


def test_meta_training_lowers_the_meta_loss_and_beats_the_identity_on_held_out_edits(tiny_lm):
    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    net, hist = trained(model, tok, layers, steps=60)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters())  # training leaves the model alone
    assert all(p.grad is None for p in model.parameters())
    first, last = sum(hist.loss[:10]) / 10, sum(hist.loss[-10:]) / 10
    assert last < 0.9 * first, (first, last)
    held_trained = meta_loss(net, model, tok, layers, HELD)
    held_ident = meta_loss(identity_copy(net), model, tok, layers, HELD)
    assert held_trained["loss"] < held_ident["loss"]
    assert held_trained["edit_nll"] < held_ident["edit_nll"]


def test_save_load_round_trip_and_refusals(tiny_lm, tmp_path):
    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    net, _ = trained(model, tok, layers, steps=3)
    fp = weight_fingerprint(model)
    path = save_network(tmp_path / "n.safetensors", net, model_fingerprint=fp, training={"offset": 100})
    back = load_network(path, layers, model_fingerprint=fp)
    for k, v in net.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    for key, norm in net.norms.items():
        assert torch.equal(norm.mean, back.norms[key].mean) and norm.n == back.norms[key].n
    assert back.meta["training"] == {"offset": 100} and back.meta["config"]["rank"] == 16
    U, D = edit_factors(model, tok, HELD[:2], layers)[LAYERS.replace("{1-2}", "1")]
    assert torch.allclose(net.delta(LAYERS.replace("{1-2}", "1"), U, D), back.delta(LAYERS.replace("{1-2}", "1"), U, D))
    with pytest.raises(CrispEditError, match="trained for another model") as exc:
        load_network(path, layers, model_fingerprint="0" * 32)
    assert "\n" not in str(exc.value)
    with pytest.raises(CrispEditError, match="trained for layers"):
        load_network(path, resolve_layers(model, "model.layers.{1-3}.mlp.down_proj"), model_fingerprint=fp)
    with pytest.raises(CrispEditError, match="expects layer .* of shape"):
        load_network(
            path,
            {
                "model.layers.1.mlp.down_proj": model.model.layers[1].mlp.up_proj,
                "model.layers.2.mlp.down_proj": model.model.layers[2].mlp.down_proj,
            },
            model_fingerprint=fp,
        )
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CrispEditError, match="truncated or corrupt|not a crispedit MEND"):
        load_network(broken, layers, model_fingerprint=fp)
    with pytest.raises(CrispEditError, match="not found"):
        load_network(tmp_path / "absent.safetensors", layers, model_fingerprint=fp)


def test_editor_with_a_trained_network_beats_the_identity_and_changes_only_its_layers(tiny_lm, tmp_path, iso_cache):
    model, tok = tiny_lm
    layers = resolve_layers(model, LAYERS)
    net, _ = trained(model, tok, layers, steps=60)
    fp = weight_fingerprint(model)
    good = save_network(tmp_path / "trained.safetensors", net, model_fingerprint=fp)
    ident = save_network(tmp_path / "ident.safetensors", identity_copy(net), model_fingerprint=fp)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    results = {}
    for name, path in (("trained", good), ("identity", ident)):
        res = edit(
            model, tok, HELD, EditConfig(method="mend", layers=LAYERS, options={"weights": str(path)}), progress=False
        )
        changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
        assert changed == set(res.original_weights) == {f"model.layers.{i}.mlp.down_proj.weight" for i in (1, 2)}
        assert res.history.steps == 1 and set(res.projector_stats) == set(layers)
        results[name] = res.history.epoch_loss
        restore(model, res.original_weights)
    assert results["trained"][0] == results["identity"][0]  # same base NLL
    assert results["trained"][1] < results["trained"][0]
    assert results["trained"][1] < results["identity"][1], results  # meta-training helps on held-out edits
    # without --layers the file's layers are used; the default cache location is found without an option
    res = edit(model, tok, HELD[:2], EditConfig(method="mend", options={"weights": str(good)}), progress=False)
    assert res.layers == list(layers)
    restore(model, res.original_weights)
    default = default_weights_path(fp, list(layers))
    default.parent.mkdir(parents=True)
    default.write_bytes(good.read_bytes())
    res = edit(model, tok, HELD[:2], EditConfig(method="mend", layers=LAYERS), progress=False)
    assert res.history.epoch_loss[1] < res.history.epoch_loss[0]


def test_editor_without_a_network_says_how_to_train_one(tiny_lm, iso_cache):
    model, tok = tiny_lm
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(CrispEditError, match="no trained MEND network .*crispedit mend train") as exc:
        edit(model, tok, HELD[:2], EditConfig(method="mend", layers=LAYERS), progress=False)
    assert "\n" not in str(exc.value)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"steps": -1}, "mend steps must be"),
        ({"rank": 0}, "mend rank must be between 1 and"),
        ({"lr": float("nan")}, "mend lr must be a finite"),
        ({"c_edit": 0}, "mend c_edit"),
        ({"loc_len": 1}, "mend loc_len"),
    ],
)
def test_train_config_one_line_errors(kw, msg):
    with pytest.raises(CrispEditError, match=msg) as exc:
        MENDTrainConfig(**kw)
    assert "\n" not in str(exc.value)
    with pytest.raises(CrispEditError, match="unknown MEND training settings: depth"):
        MENDTrainConfig.from_json({"depth": 3})
    with pytest.raises(CrispEditError, match="mend batch_size"):
        EditConfig(method="mend", options={"batch_size": 0})


def _edits(tmp_path, n=24, start=0):
    recs = [
        {
            "src": f"Who wrote book number {i}?",
            "alt": f"Author {chr(65 + i % 26)}",
            "rephrase": f"Book {i} was written by whom?",
            "loc": "nq question: who sang it",
            "loc_ans": "someone",
            "subject": f"book number {i}",
        }
        for i in range(start, start + n)
    ]
    p = tmp_path / "edits.json"
    p.write_text(json.dumps(recs))
    return p


def test_cli_train_then_edit_and_bad_inputs(tiny_model_dir, tmp_path, iso_cache, capsys):
    edits = _edits(tmp_path)
    net = tmp_path / "mend.safetensors"
    train = [
        "mend",
        "train",
        "--model",
        tiny_model_dir,
        "--edits",
        edits,
        "--offset",
        8,
        "--n-edits",
        16,
        "--steps",
        4,
        "--batch-size",
        4,
        "--rank",
        8,
        "--layers",
        LAYERS,
        "--n-cap",
        4,
        "--quiet",
    ]
    assert main([str(a) for a in train + ["--out", net]]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "trained 4 steps on 16 edits (offset 8)" in out and str(net) in out
    from crispedit.methods.mend.net import read_network_meta

    meta = read_network_meta(net)
    assert meta["training"]["offset"] == 8 and meta["training"]["n_edits"] == 16 and meta["config"]["steps"] == 4
    common = [
        "edit",
        "--model",
        tiny_model_dir,
        "--edits",
        edits,
        "--n-edits",
        4,
        "--method",
        "mend",
        "--no-wild",
        "--quiet",
    ]
    assert main([str(a) for a in common + ["--mend-weights", net, "--out", tmp_path / "e"]]) == 0, (
        capsys.readouterr().err
    )
    report = json.loads((tmp_path / "e" / "edit_report.json").read_text())
    assert report["inputs"] == {"weights": hashlib.sha256(net.read_bytes()).hexdigest()}  # the network, by content
    assert report["method"] == "mend" and report["layers"] == [
        "model.layers.1.mlp.down_proj",
        "model.layers.2.mlp.down_proj",
    ]
    # one step, no epochs and no fine-tuning lr: the line and the report say what ran
    first, last = report["training"]["epoch_loss"]
    assert report["training"]["epochs"] == 0 and report["training"]["single_pass"] is True
    line = capsys.readouterr().out
    assert f"single-pass target_nll={first:.4g}->{last:.4g}" in line and "epochs=" not in line and "lr=" not in line, (
        line
    )
    assert len(meta["training"]["request_digests"]) == 16
    # editing requests 4-11 overlaps the training slice 8-23 in 4 requests: warned and recorded
    with pytest.warns(UserWarning, match="4 of the 8 edit requests were in the network's training slice"):
        assert (
            main(
                [
                    str(a)
                    for a in common[:5]
                    + ["--offset", 4, "--n-edits", 8]
                    + common[7:]
                    + ["--mend-weights", net, "--out", tmp_path / "o"]
                ]
            )
            == 0
        )
    over = json.loads((tmp_path / "o" / "edit_report.json").read_text())
    assert json.dumps(over).count('"train_overlap": 4') == 2
    capsys.readouterr()
    # default location: `mend train` without --out writes where `edit --method mend` looks
    assert main([str(a) for a in train]) == 0
    capsys.readouterr()
    assert main([str(a) for a in common + ["--layers", LAYERS, "--out", tmp_path / "e2"]]) == 0, capsys.readouterr().err
    bad = [
        (common + ["--mend-weights", tmp_path / "absent.safetensors", "--out", tmp_path / "b1"], "MEND network file"),
        (common + ["--out", tmp_path / "b2"], "no trained MEND network"),
        (train + ["--rank", 0], "mend rank must be between 1 and"),
        (train + ["--offset", 500], "--offset 500 is past the end of"),
        (train + ["--out", tmp_path], "is a directory"),
    ]
    for args, msg in bad:
        assert main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "b1").exists() and not (tmp_path / "b2").exists()
    other = tmp_path / "other.safetensors"
    other.write_bytes(
        net.read_bytes().replace(meta["model_fingerprint"].encode(), b"0" * len(meta["model_fingerprint"]))
    )
    assert main([str(a) for a in common + ["--mend-weights", other, "--out", tmp_path / "b3"]]) == 2
    assert "trained for another model" in capsys.readouterr().err


def test_compare_runs_mend_beside_a_fine_tuning_method(tiny_lm, tmp_path, iso_cache):
    import crispedit.experiments.compare as compare_mod

    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    path = write_trained(model, tok, tmp_path / "mend.safetensors", steps=10)
    cfgs = {
        "ft": EditConfig(method="ft", layers=LAYERS, epochs=2, n_cap=4, max_len=32),
        "mend": EditConfig(method="mend", layers=LAYERS, n_cap=4, max_len=32, options={"weights": str(path)}),
    }
    payload = compare_mod.run_compare(
        model, tok, HELD[:3], ["ft", "mend"], tmp_path / "cmp", configs=cfgs, progress=False
    )
    assert payload["results"]["mend"]["changed"] == [f"model.layers.{i}.mlp.down_proj.weight" for i in (1, 2)]
    assert weight_fingerprint(model) == fp
    assert "| mend |" in (tmp_path / "cmp" / "compare.md").read_text()
    # the row names its network by content; ft reads no file and records none
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    row = payload["results"]["mend"]
    assert row["inputs"] == {"weights": digest} and "inputs" not in payload["results"]["ft"]

    def resume(weights):
        mend = EditConfig(method="mend", layers=LAYERS, n_cap=4, max_len=32, options={"weights": str(weights)})
        return compare_mod.run_compare(
            model, tok, HELD[:3], ["ft", "mend"], tmp_path / "cmp", configs={**cfgs, "mend": mend}, progress=False
        )

    # the same network moved elsewhere is the same run: the stored row is kept, nothing reruns
    moved = tmp_path / "elsewhere" / "copy.safetensors"
    moved.parent.mkdir()
    moved.write_bytes(path.read_bytes())
    path.unlink()
    assert resume(moved)["results"]["mend"] == row
    # another network at the path the row records is another run: refused, naming the file's digests
    write_trained(model, tok, path, steps=3)
    with pytest.raises(
        CrispEditError,
        match=rf"holds mend run with another configuration \(another weights file: "
        rf"sha256 {digest[:12]}…, now "
        rf"{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}…\)",
    ):
        resume(path)
    assert weight_fingerprint(model) == fp


def test_target_only_logprobs_equal_the_full_forward(tiny_lm):
    from crispedit.data.tokenize import encode_pairs
    from crispedit.methods.mend.net import target_token_logprobs

    model, tok = tiny_lm
    batch = encode_pairs(tok, [r.prompt for r in HELD[:3]], [r.target for r in HELD[:3]])
    lp, rows = target_token_logprobs(model, batch)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    labels = batch.labels[:, 1:]
    full = torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)[labels != -100]
    assert torch.allclose(lp, full, atol=1e-5) and rows.tolist() == [
        i for i, n in enumerate(batch.target_lengths) for _ in range(n)
    ]


def test_compare_refuses_mend_without_a_network_before_running_any_method(tiny_lm, tmp_path, iso_cache):
    import crispedit.experiments.compare as compare_mod

    model, tok = tiny_lm
    cfgs = {"ft": EditConfig(method="ft", layers=LAYERS, epochs=1), "mend": EditConfig(method="mend", layers=LAYERS)}
    with pytest.raises(CrispEditError, match="no trained MEND network"):
        compare_mod.run_compare(model, tok, HELD[:2], ["ft", "mend"], tmp_path / "cmp", configs=cfgs, progress=False)
    assert not (tmp_path / "cmp").exists()


def test_mend_has_no_sequential_row():
    from crispedit.editing.registry import seq_row

    assert seq_row("mend") == ("mend", False)
    with pytest.raises(CrispEditError, match="mend has no sequential mode"):
        seq_row("mend-seq")


def test_time_budget_stops_training_and_init_continues_a_saved_network(tiny_model_dir, tmp_path, iso_cache, capsys):
    edits = _edits(tmp_path)
    first, second = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    train = [
        "mend",
        "train",
        "--model",
        tiny_model_dir,
        "--edits",
        edits,
        "--n-edits",
        8,
        "--layers",
        LAYERS,
        "--n-cap",
        4,
        "--quiet",
    ]
    # a budget far below one step: the first step runs, none after it, and the file says so
    assert (
        main(
            [
                str(a)
                for a in train
                + ["--offset", 8, "--steps", 50, "--rank", 8, "--batch-size", 4, "--max-minutes", 1e-6, "--out", first]
            ]
        )
        == 0
    ), capsys.readouterr().err
    assert "trained 1 steps (stopped by --max-minutes" in capsys.readouterr().out
    from crispedit.methods.mend.net import read_network_meta

    a = read_network_meta(first)
    assert a["training"]["history"]["stopped_early"] and a["training"]["total_steps"] == 1
    # continue on another slice: settings come from the file, the steps add up, both slices' digests are kept
    assert main([str(a) for a in train + ["--offset", 16, "--steps", 3, "--init", first, "--out", second]]) == 0
    assert "trained 3 steps, 4 in all from" in capsys.readouterr().out
    b = read_network_meta(second)
    assert b["config"]["rank"] == 8 and b["training"]["total_steps"] == 4
    assert not b["training"]["history"]["stopped_early"]
    curve = b["training"]["history"]["curve"]  # every step's losses are kept, not only the end means
    assert [len(curve[k]) for k in ("loss", "edit_nll", "loc_kl")] == [3, 3, 3]
    assert b["training"]["history"]["loss"]["first10"] == pytest.approx(sum(curve["loss"]) / 3, rel=1e-3)
    assert len(b["training"]["request_digests"]) == 16 and b["training"]["continued_from"]["file"] == str(first)
    for extra, msg in [(["--rank", 4], "drop --rank"), (["--max-minutes", 0], "--max-minutes must be positive")]:
        assert main([str(a) for a in train + ["--init", first, "--out", tmp_path / "c.safetensors"] + extra]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "c.safetensors").exists()


def test_a_batch_session_edits_with_mend_and_a_sequential_one_is_refused(tiny_model_dir, tmp_path, iso_cache):
    """A batch-mode session re-edits the base every round, the model MEND's network was trained for, so it takes
    MEND; a sequential session would edit an edited model and is refused before anything loads."""
    from crispedit.models import load_model
    from crispedit.sessions.sequential import SeqConfig
    from crispedit.sessions.session import Session

    model, tok = load_model(str(tiny_model_dir), progress=False)
    net = write_trained(model, tok, tmp_path / "n.safetensors", steps=10)
    edit_cfg = dict(method="mend", layers=LAYERS, options={"weights": str(net)})
    with pytest.raises(CrispEditError, match="mend has no sequential mode"):
        Session.create(tmp_path / "seq", str(tiny_model_dir), SeqConfig(edit=EditConfig(**edit_cfg)), progress=False)
    assert not (tmp_path / "seq").exists()
    cfg = SeqConfig(edit=EditConfig(**edit_cfg), mode="batch", kl_texts=2)
    s = Session.create(tmp_path / "batch", str(tiny_model_dir), cfg, progress=False)
    for k in range(2):
        s.add(HELD[4 * k : 4 * k + 4], plot=False)
    rounds = s.status()["rounds"]
    assert [r["n_edits"] for r in rounds] == [4, 4] and rounds[1]["train"]["steps"] == 1
