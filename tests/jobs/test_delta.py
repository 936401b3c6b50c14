"""Reversible deltas: delta.safetensors written by `crispedit edit`, apply / revert bit for bit, export-lora."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import build_llama, load_script
from crispedit.cli import main
from crispedit.data import EditRequest
from crispedit.delta import (
    apply_delta,
    build_delta,
    delta_fingerprint,
    export_lora,
    revert_delta,
    revert_delta_tensors,
    write_delta,
)
from crispedit.delta_format import read_delta_header
from crispedit.editing import EditConfig, edit
from crispedit.errors import CrispEditError
from crispedit.models import load_model

REQS = [EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}") for i in range(4)]
LAYERS = "model.layers.{1-2}.mlp.down_proj"
W1 = "model.layers.1.mlp.down_proj.weight"


def bits(model):
    return {n: p.detach().clone().view(torch.int32) for n, p in model.named_parameters()}


def same_bits(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def edited_pair(tiny_lm, tmp_path):
    """A tiny model edited with crispedit plus two entries whose float arithmetic does not round-trip; the
    delta file; the base and edited bits."""
    model, tok = tiny_lm
    base = bits(model)
    res = edit(
        model,
        tok,
        REQS,
        EditConfig(layers=LAYERS, epochs=5, lr=1e-2, batch_size=4, n_cap=6, max_len=48),
        progress=False,
    )
    w = model.get_parameter(W1)
    with torch.no_grad():  # base 3.0 -> 1e-9: base + Δ rounds to 0; base 1e-9 -> 3: edited - Δ rounds to 0
        res.original_weights[W1][0, 0], w[0, 0] = 3.0, 1e-9
        res.original_weights[W1][0, 1], w[0, 1] = 1e-9, 3.0
    base[W1] = res.original_weights[W1].clone().view(torch.int32)
    path = tmp_path / "delta.safetensors"
    meta = write_delta(path, model, res.original_weights, {"method": "crispedit"})
    return model, res, path, meta, base, bits(model)


def test_apply_revert_bit_exact_with_patches_and_refusals(tiny_lm, tmp_path):
    model, res, path, meta, base, edited = edited_pair(tiny_lm, tmp_path)
    assert set(meta["parameters"]) == set(res.original_weights)  # only changed tensors
    p = meta["parameters"][W1]
    assert p["apply_patch"] >= 1 and p["revert_patch"] >= 1 and p["dtype"] == "float32"
    t = load_file(path)
    assert torch.equal(t[W1], model.get_parameter(W1).detach() - res.original_weights[W1])  # ΔW as stored
    revert_delta(model, path)
    assert same_bits(bits(model), base)  # back to the base, bit for bit
    with pytest.raises(CrispEditError, match="not applied to this model"):
        revert_delta(model, path)
    apply_delta(model, path)
    assert same_bits(bits(model), edited)  # the edited model, bit for bit
    with pytest.raises(CrispEditError, match="already applied to this model"):
        apply_delta(model, path)


def test_in_memory_delta_reverts_bit_exact_and_refuses_twice(tiny_lm, tmp_path):
    """The delta :func:`build_delta` returns, never written, reverts like the file (patches included)."""
    model, res, _, _, base, edited = edited_pair(tiny_lm, tmp_path)
    tensors, header = build_delta(model, res.original_weights, {"method": "crispedit"})
    assert f"{W1}::revert_idx" in tensors  # the patch is exercised
    meta = revert_delta_tensors(model, tensors, header)
    assert same_bits(bits(model), base) and W1 in meta["parameters"]
    with pytest.raises(CrispEditError, match="delta in-memory delta is not applied to this model"):
        revert_delta_tensors(model, tensors, header)
    assert same_bits(bits(model), base)  # the refusal changed nothing


def test_patches_are_needed(tiny_lm, tmp_path):
    """Without the patches plain ``base + ΔW`` would not give the edited values back (the test would be vacuous)."""
    model, res, path, meta, base, edited = edited_pair(tiny_lm, tmp_path)
    t = load_file(path)
    plain = res.original_weights[W1] + t[W1]
    assert not torch.equal(plain, model.get_parameter(W1).detach())


def test_wrong_base_is_refused(tiny_lm, tmp_path, tiny_tok):
    _, _, path, meta, _, _ = edited_pair(tiny_lm, tmp_path)
    other = build_llama(len(tiny_tok), seed=1)
    before = bits(other)
    with pytest.raises(CrispEditError, match="is not the base of delta"):
        apply_delta(other, path)
    assert same_bits(bits(other), before)  # nothing changed


def test_fingerprint_survives_save_and_reload(tiny_model_dir, tmp_path):
    model, tok = load_model(str(tiny_model_dir))
    values = {W1: model.get_parameter(W1)}
    fp = delta_fingerprint(model, values)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    again, _ = load_model(str(tmp_path / "m"))
    assert delta_fingerprint(again, {W1: again.get_parameter(W1)}) == fp
    with torch.no_grad():
        again.get_parameter(W1)[0, 0] += 1e-6
    assert delta_fingerprint(again, {W1: again.get_parameter(W1)}) != fp


def test_unchanged_tensors_are_left_out(tiny_lm):
    model, _ = tiny_lm
    w = {n: p.detach().clone() for n, p in model.named_parameters() if "down_proj" in n}
    tensors, header = build_delta(model, w)
    assert tensors == {} and json.loads(header["crispedit_delta"])["parameters"] == {}


def _edit_cli(tmp_path, model_dir, out, *extra):
    edits = tmp_path / "e.json"
    edits.write_text(json.dumps([r.to_json() for r in REQS]))
    return main(
        [
            "edit",
            "--model",
            str(model_dir),
            "--edits",
            str(edits),
            "--layers",
            LAYERS,
            "--n-cap",
            "6",
            "--max-len",
            "48",
            "--epochs",
            "5",
            "--lr",
            "1e-2",
            "--batch-size",
            "4",
            "--no-wild",
            "--quiet",
            "--out",
            str(out),
            *extra,
        ]
    )


def _weights(d):
    return load_file(d / "model.safetensors")


def test_cli_edit_delta_apply_revert_info(tmp_path, tiny_model_dir, iso_cache, capsys):
    assert _edit_cli(tmp_path, tiny_model_dir, tmp_path / "a") == 0
    a = tmp_path / "a"
    report = json.loads((a / "edit_report.json").read_text())
    assert "delta.safetensors" in report["files"] and report["delta"]["model_saved"]
    assert report["delta"]["tensors"] == [f"model.layers.{i}.mlp.down_proj.weight" for i in (1, 2)]
    meta = read_delta_header(a / "delta.safetensors")
    assert meta["method"] == "crispedit" and len(meta["requests"]) == 4 and meta["config"]["layers"] == LAYERS
    assert (
        meta["kl_predicted"] == report["summary"]["kl_predicted"] and meta["kl_drift"] == report["summary"]["kl_drift"]
    )
    assert (a / "delta.safetensors").stat().st_size < (a / "model.safetensors").stat().st_size / 5
    capsys.readouterr()
    assert main(["delta", "info", str(a / "delta.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "crispedit edit" in out and meta["base_fingerprint"] in out and "2 changed tensors" in out
    assert (
        main(
            [
                "delta",
                "apply",
                str(a / "delta.safetensors"),
                "--model",
                str(tiny_model_dir),
                "--out",
                str(tmp_path / "b"),
                "--quiet",
            ]
        )
        == 0
    )
    edited, applied = _weights(a), _weights(tmp_path / "b")
    assert edited.keys() == applied.keys() and all(
        torch.equal(edited[k].view(torch.int32), applied[k].view(torch.int32)) for k in edited
    )
    assert (
        main(
            [
                "delta",
                "revert",
                str(a / "delta.safetensors"),
                "--model",
                str(tmp_path / "b"),
                "--out",
                str(tmp_path / "c"),
                "--quiet",
            ]
        )
        == 0
    )
    base, reverted = _weights(tiny_model_dir), _weights(tmp_path / "c")
    assert all(torch.equal(base[k].view(torch.int32), reverted[k].view(torch.int32)) for k in base)
    capsys.readouterr()
    assert main(["delta", "apply", str(a / "delta.safetensors"), "--model", str(a), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already applied" in err and not (tmp_path / "d").exists()


def test_cli_delta_only(tmp_path, tiny_model_dir, iso_cache):
    assert _edit_cli(tmp_path, tiny_model_dir, tmp_path / "a", "--delta-only") == 0
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["delta.safetensors", "edit_report.json"]
    assert json.loads((tmp_path / "a" / "edit_report.json").read_text())["files"] == names


def test_export_lora_merges_to_base_plus_delta(tmp_path, tiny_model_dir, iso_cache, capsys):
    from peft import PeftModel

    assert _edit_cli(tmp_path, tiny_model_dir, tmp_path / "a", "--delta-only") == 0
    delta = tmp_path / "a" / "delta.safetensors"
    d = load_file(delta)
    full = max(int(torch.linalg.matrix_rank(d[k].double())) for k in d if "::" not in k)
    assert (
        main(
            [
                "delta",
                "export-lora",
                str(delta),
                "--model",
                str(tiny_model_dir),
                "--rank",
                str(full),
                "--out",
                str(tmp_path / "lora"),
                "--quiet",
                "--evaluate",
            ]
        )
        == 0
    )
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "lora").iterdir()}
    base, _ = load_model(str(tiny_model_dir))
    want = {k: base.get_parameter(k).detach() + d[k] for k in d if "::" not in k}
    merged = PeftModel.from_pretrained(base, str(tmp_path / "lora")).merge_and_unload()
    for k, w in want.items():
        assert torch.allclose(merged.get_parameter(k).detach(), w, atol=1e-5), k
    info = json.loads((tmp_path / "lora" / "crispedit_lora.json").read_text())
    assert all(v["rel_error"] < 1e-5 for v in info["layers"].values())
    sc = info["scores"]
    assert sc["adapter"]["rel_token_acc"] == pytest.approx(sc["delta"]["rel_token_acc"])  # full rank: same model
    assert sc["delta"]["rel_token_acc"] > 0
    capsys.readouterr()
    assert (
        main(
            [
                "delta",
                "export-lora",
                str(delta),
                "--model",
                str(tiny_model_dir),
                "--rank",
                "1",
                "--out",
                str(tmp_path / "lora1"),
                "--quiet",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "relative Frobenius error" in out and "scores" not in out
    info = json.loads((tmp_path / "lora1" / "crispedit_lora.json").read_text())
    assert all(0 < v["rel_error"] < 1 and v["rank"] == 1 for v in info["layers"].values())


def test_session_export_delta_applies_to_the_base(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from crispedit.editing import SeqConfig
    from crispedit.sessions.session import Session

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    cfg = SeqConfig(edit=dict(layers=LAYERS, epochs=3, lr=1e-2, batch_size=4, n_cap=6, max_len=48))
    s = Session.create(tmp_path / "s", str(tiny_model_dir), cfg, progress=False)
    s.add(REQS[:2], plot=False)
    rec = s.add(REQS[2:], plot=False)
    assert main(["session", "export", str(tmp_path / "s"), "--out", str(tmp_path / "full"), "--quiet"]) == 0
    assert main(["session", "export", str(tmp_path / "s"), "--out", str(tmp_path / "d"), "--delta", "--quiet"]) == 0
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["crispedit_session.json", "delta.safetensors"]
    meta = read_delta_header(tmp_path / "d" / "delta.safetensors")
    assert len(meta["requests"]) == 4 and meta["round"] == 2 and meta["kl_drift"] == rec["kl_drift"]
    assert (
        main(
            [
                "delta",
                "apply",
                str(tmp_path / "d" / "delta.safetensors"),
                "--model",
                str(tiny_model_dir),
                "--out",
                str(tmp_path / "applied"),
                "--quiet",
            ]
        )
        == 0
    )
    full, applied = _weights(tmp_path / "full"), _weights(tmp_path / "applied")
    assert full.keys() == applied.keys() and all(torch.equal(full[k], applied[k]) for k in full)


def test_delta_info_reads_the_header_without_torch(tiny_lm, tmp_path):
    run_cli = load_script("tests/cli/test_cli_startup.py").run_cli

    _, _, path, meta, _, _ = edited_pair(tiny_lm, tmp_path)
    rc, heavy, out, err = run_cli(["delta", "info", path, "--json"], tmp_path)
    assert rc == 0 and heavy == [], (heavy, err)
    shown = json.loads(out)
    assert shown["base_fingerprint"] == meta["base_fingerprint"] and shown["parameters"] == meta["parameters"]
    assert shown["tensors"][W1]["shape"] == [32, 48] and f"{W1}::apply_idx" in shown["tensors"]


def test_bf16_delta_round_trips_bit_for_bit(tiny_tok, tmp_path):
    model = build_llama(len(tiny_tok), dtype=torch.bfloat16)
    w = model.get_parameter(W1)
    base = {W1: w.detach().clone()}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w.add_(torch.randn(w.shape, generator=g).to(torch.bfloat16) * 0.3)
    edited = w.detach().clone()
    meta = write_delta(tmp_path / "d.safetensors", model, base)
    assert meta["parameters"][W1]["dtype"] == "bfloat16" and meta["dtype"] == "bfloat16"
    assert meta["parameters"][W1]["apply_patch"] + meta["parameters"][W1]["revert_patch"] > 0  # bf16 rounds often
    revert_delta(model, tmp_path / "d.safetensors")
    assert torch.equal(w.detach().view(torch.int16), base[W1].view(torch.int16))
    apply_delta(model, tmp_path / "d.safetensors")
    assert torch.equal(w.detach().view(torch.int16), edited.view(torch.int16))


def test_damaged_and_foreign_delta_files_are_refused_in_one_line(tiny_lm, tmp_path):
    """The shared header reader: a truncated delta is caught from the header alone (``delta info`` too), a
    safetensors file that is not a delta and a file that is not safetensors are named as such."""
    model, _ = tiny_lm
    base = {W1: model.get_parameter(W1).detach().clone()}
    with torch.no_grad():
        model.get_parameter(W1)[0, 0] += 1.0
    path = tmp_path / "delta.safetensors"
    write_delta(path, model, base, {"method": "test"})
    assert read_delta_header(path)["parameters"][W1]["shape"] == list(base[W1].shape)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-3])
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(other), metadata={"crispedit": "{}"})
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"x" * 16)
    for f, match in (
        (cut, "delta file .* is not a safetensors file, or is truncated or corrupt"),
        (other, "is not a crispedit delta \\(no crispedit_delta metadata\\)"),
        (junk, "is not a safetensors file"),
    ):
        for read in (read_delta_header, lambda p: apply_delta(model, p)):
            with pytest.raises(CrispEditError, match=match) as exc:
                read(f)
            assert "\n" not in str(exc.value)


def test_export_lora_rank_is_bounded_by_the_delta_before_any_work(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """A LoRA rank above the largest min(d_out, d_in) of the delta's changed matrices (the tiny down_proj is
    32 x 48: 32) is one line before the model loads, however large; the bound itself exports. The library
    refuses it before any SVD, and a delta that changed no matrix has nothing to export."""
    import crispedit.models
    from crispedit.delta_format import lora_rank_limit

    model, _ = load_model(str(tiny_model_dir))
    w = model.get_parameter(W1)
    base = {W1: w.detach().clone()}
    with torch.no_grad():
        w[0, 0] += 0.5
    delta = tmp_path / "d.safetensors"
    meta = write_delta(delta, model, base, {"method": "test"})
    assert lora_rank_limit(meta) == 32
    revert_delta(model, delta)
    monkeypatch.setattr(crispedit.models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    for rank in (33, 2**40, 2**70):
        assert (
            main(
                [
                    "delta",
                    "export-lora",
                    str(delta),
                    "--model",
                    str(tiny_model_dir),
                    "--rank",
                    str(rank),
                    "--out",
                    str(tmp_path / "lora"),
                    "--quiet",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err
        assert err == (
            f"crispedit: error: --rank {rank} is more than a LoRA adapter of the layers of delta {delta} "
            "can "
            "hold: at most 32 (min(d_out, d_in) of its largest changed matrix)\n"
        )
    assert not (tmp_path / "lora").exists()
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **k: pytest.fail("the SVD ran"))
    with pytest.raises(CrispEditError, match="rank 1180591620717411303424 is more than"):
        export_lora(model, delta, 2**70, tmp_path / "lora")
    monkeypatch.undo()
    assert (
        main(
            [
                "delta",
                "export-lora",
                str(delta),
                "--model",
                str(tiny_model_dir),
                "--rank",
                "32",
                "--out",
                str(tmp_path / "lora"),
                "--quiet",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "lora" / "crispedit_lora.json").read_text())["rank"] == 32
    norm = "model.layers.1.post_attention_layernorm.weight"
    p = model.get_parameter(norm)
    base = {norm: p.detach().clone()}
    with torch.no_grad():
        p[0] += 1.0
    write_delta(tmp_path / "n.safetensors", model, base, {"method": "test"})
    with pytest.raises(CrispEditError, match="changes no weight matrix"):
        export_lora(model, tmp_path / "n.safetensors", 1, tmp_path / "lora-n")
