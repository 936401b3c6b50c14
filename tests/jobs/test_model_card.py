"""Model cards: every folder crispedit saves a model to gets a ``README.md`` whose Hugging Face front
matter parses (base_model, library_name, tags), with the method, the edits, the measured figures ("not measured"
where the run has none) and an undo command that really runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from crispedit.cli import main
from crispedit.data import EditRequest
from crispedit.editing import EditConfig, SeqConfig
from crispedit.model_card import CARD_FILE, build_card, hub_base_model, read_front_matter
from crispedit.models import load_model
from crispedit.pipeline import run_edit_job

REQS = [
    EditRequest(f"Who wrote book number {i}?", f"Author {chr(65 + i)}", rephrase_prompts=[f"Book {i} was written by"])
    for i in range(3)
]
LAYERS = "model.layers.{1-2}.mlp.down_proj"
SMALL = dict(layers=LAYERS, epochs=3, lr=1e-2, batch_size=4, n_cap=6, max_len=48)


def card_of(folder):
    """``(front matter parsed by PyYAML, the card's text)`` of ``folder/README.md``; the front matter is the
    first block of the file, between two ``---`` lines."""
    text = (folder / CARD_FILE).read_text(encoding="utf-8")
    assert text.startswith("---\n")
    block = text[4 : text.index("\n---\n", 3)]
    meta = yaml.safe_load(block)
    assert meta == read_front_matter(text)  # the module's own reader agrees with PyYAML
    hub = pytest.importorskip("huggingface_hub")
    data = hub.ModelCard(text).data  # and the Hub's own model-card parser
    assert (data.base_model, data.library_name, data.tags) == (meta["base_model"], meta["library_name"], meta["tags"])
    return meta, text


def check_front_matter(meta, base, method):
    assert meta["base_model"] == base and meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert {"crispedit", "knowledge-editing", method} <= set(meta["tags"])


def same_weights(a, b):
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k].view(torch.int32), wb[k].view(torch.int32)) for k in wa)


def test_edit_folder_card_and_its_undo_command(tmp_path, tiny_model_dir, iso_cache):
    """``run_edit_job`` (``crispedit edit``): the card lists the report's figures, WILD per wrapper (``chat``: not
    measured, the tiny tokenizer has no chat template), the edits, and the revert command, which runs."""
    model, tok = load_model(str(tiny_model_dir))
    out = tmp_path / "edited"
    report = run_edit_job(
        model, tok, REQS, EditConfig(method="ft", **SMALL), out, model_spec=str(tiny_model_dir), progress=False
    )
    assert CARD_FILE in report["files"]
    meta, text = card_of(out)
    check_front_matter(meta, str(tiny_model_dir), "ft")
    s = report["summary"]
    assert f"| rel (teacher-forced) | {s['rel']:.3f} |" in text and f"| gen (teacher-forced) | {s['gen']:.3f} |" in text
    assert f"| KL drift, measured | {s['kl_drift']:.6f} |" in text
    assert f"{s['ppl_base']:.2f} → {s['ppl']:.2f}" in text
    assert "| KL drift, predicted | not measured |" in text  # ft holds no factors without --predict-drift
    for ctx in ("qa", "none"):
        w = report["wild"][ctx]
        assert f"| WILD `{ctx}` rel / gen | {w['rel']:.3f} / {w['gen']:.3f} |" in text
    assert report["wild"]["chat"] is None and "| WILD `chat` rel / gen | not measured |" in text
    assert "3 edits:" in text and all(f"| {r.prompt} | {r.target} |" in text for r in REQS)
    assert "| `lr` | `0.01` |" in text and "model.layers.1.mlp.down_proj" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("crispedit delta revert"))
    argv = line.split("#")[0].replace("MODEL_DIR", str(out)).replace("BASE_DIR", str(tmp_path / "base")).split()
    assert main(argv[1:] + ["--quiet"]) == 0  # the card's undo command, as written
    assert same_weights(tmp_path / "base", tiny_model_dir)
    meta, text = card_of(tmp_path / "base")  # delta revert's folder: a card too
    check_front_matter(meta, str(tiny_model_dir), "ft")
    assert "edit-reverted" in meta["tags"] and "crispedit delta apply" in text

    # the edited folder as the base of a further edit: its card's base_model passes on
    assert hub_base_model(out) == str(tiny_model_dir)


def test_no_wild_run_says_not_measured_and_overwrite_keeps_a_users_readme(tmp_path, tiny_model_dir, iso_cache):
    model, tok = load_model(str(tiny_model_dir))
    out = tmp_path / "e"
    cfg = EditConfig(method="ft", **dict(SMALL, epochs=1))
    report = run_edit_job(model, tok, REQS[:1], cfg, out, model_spec="smollm2", wild=False, progress=False)
    meta, text = card_of(out)
    check_front_matter(meta, "HuggingFaceTB/SmolLM2-135M-Instruct", "ft")  # crispedit's named model -> its Hub id
    assert "| WILD rel / gen | not measured |" in text and "dequantised" in text and "1 edit:" in text
    first = (out / CARD_FILE).read_text()
    # --overwrite replaces crispedit's own card ...
    run_edit_job(model, tok, REQS[1:2], cfg, out, model_spec="smollm2", wild=False, overwrite=True, progress=False)
    assert (out / CARD_FILE).read_text() != first and REQS[1].prompt in (out / CARD_FILE).read_text()
    # ... but never a README.md the user put there
    (out / CARD_FILE).write_text("my notes\n")
    report = json.loads((out / "edit_report.json").read_text())
    report["files"].remove(CARD_FILE)
    (out / "edit_report.json").write_text(json.dumps(report))
    report = run_edit_job(
        model, tok, REQS[:1], cfg, out, model_spec="smollm2", wild=False, overwrite=True, progress=False
    )
    assert (out / CARD_FILE).read_text() == "my notes\n" and CARD_FILE not in report["files"]


def test_delta_only_writes_no_card(tmp_path, tiny_model_dir, iso_cache):
    model, tok = load_model(str(tiny_model_dir))
    report = run_edit_job(
        model,
        tok,
        REQS[:1],
        EditConfig(method="ft", **dict(SMALL, epochs=1)),
        tmp_path / "d",
        wild=False,
        delta_only=True,
        progress=False,
    )
    assert not (tmp_path / "d" / CARD_FILE).exists() and CARD_FILE not in report["files"]


def test_session_export_card(tmp_path, tiny_model_dir, monkeypatch):
    from crispedit.sessions.session import Session

    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    s = Session.create(tmp_path / "s", str(tiny_model_dir), SeqConfig(edit=SMALL), progress=False)
    s.add(REQS[:2], plot=False)
    rec = s.add(REQS[2:], plot=False)
    assert main(["session", "export", str(tmp_path / "s"), "--out", str(tmp_path / "x"), "--quiet"]) == 0
    meta, text = card_of(tmp_path / "x")
    check_front_matter(meta, str(tiny_model_dir), "crispedit")
    marker = json.loads((tmp_path / "x" / "crispedit_session.json").read_text())
    assert CARD_FILE in marker["files"]
    assert f"| rel (teacher-forced) | {rec['rel_all']:.3f} |" in text and f"| {rec['kl_drift']:.6f} |" in text
    assert f"| KL drift, predicted | {rec['kl_predicted']:.6f} |" in text
    assert "| WILD rel / gen | not measured |" in text and "3 edits:" in text and "round 2" in text
    assert "crispedit session export SESSION --delta --out DELTA_DIR" in text
    assert "crispedit delta revert DELTA_DIR/delta.safetensors --model MODEL_DIR --out BASE_DIR" in text


def test_delta_apply_card_carries_the_edit_reports_figures_only_for_its_own_delta(tmp_path, tiny_model_dir, iso_cache):
    model, tok = load_model(str(tiny_model_dir))
    report = run_edit_job(
        model,
        tok,
        REQS,
        EditConfig(method="crispedit", **SMALL),
        tmp_path / "a",
        model_spec=str(tiny_model_dir),
        wild=False,
        progress=False,
    )
    delta = tmp_path / "a" / "delta.safetensors"
    assert (
        main(["delta", "apply", str(delta), "--model", str(tiny_model_dir), "--out", str(tmp_path / "b"), "--quiet"])
        == 0
    )
    meta, text = card_of(tmp_path / "b")
    check_front_matter(meta, str(tiny_model_dir), "crispedit")
    s = report["summary"]
    assert f"| rel (teacher-forced) | {s['rel']:.3f} |" in text and "edit report written with this delta" in text
    assert f"| KL drift, predicted | {s['kl_predicted']:.6f} |" in text
    assert f"crispedit delta revert {delta.resolve()} --model MODEL_DIR --out BASE_DIR" in text
    # the same delta away from its report: only the drift travels in the delta; the rest is not measured
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(delta, alone / "delta.safetensors")
    assert (
        main(
            [
                "delta",
                "apply",
                str(alone / "delta.safetensors"),
                "--model",
                str(tiny_model_dir),
                "--out",
                str(tmp_path / "c"),
                "--quiet",
            ]
        )
        == 0
    )
    _, text = card_of(tmp_path / "c")
    assert "| rel (teacher-forced) | not measured |" in text and "| WILD rel / gen | not measured |" in text
    assert f"| KL drift, measured | {s['kl_drift']:.6f} |" in text and "3 edits:" in text


def test_card_escapes_table_cells_and_missing_figures():
    """A prompt with ``|`` and a newline stays one table row; an empty report reads as not measured throughout."""
    text = build_card(
        {"method": "ft", "model": "org/model", "requests": [{"prompt": "a | b\nc", "target": "x"}]},
        made_by="a test",
        revert=["crispedit delta revert D --model M --out B"],
    )
    assert read_front_matter(text)["base_model"] == "org/model"
    assert "| a \\| b c | x |" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "not measured" in ln]
    assert len(rows) == 6  # rel, gen, WILD, KL measured, KL predicted, perplexity


@pytest.mark.parametrize(
    "spec,want",
    [("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"), ("org/name", "org/name"), ("<in-memory>", "<in-memory>")],
)
def test_hub_base_model(spec, want):
    assert hub_base_model(spec) == want


def test_a_downloaded_models_own_card_does_not_name_the_base(tmp_path):
    """A local copy of a Hub model keeps that model's card, whose ``base_model`` is *its* base (SmolLM2-Instruct's
    card names SmolLM2): only a crispedit card passes its base_model on."""
    (tmp_path / CARD_FILE).write_text(
        '---\nbase_model: "HuggingFaceTB/SmolLM2-135M"\nlibrary_name: transformers\n---\n'
    )
    assert hub_base_model(tmp_path) == str(tmp_path)


def test_front_matter_reader_without_pyyaml(monkeypatch):
    """Without PyYAML the reader parses the ``key: value`` / ``- item`` lines crispedit writes, to the same dict."""
    import sys

    text = build_card({"method": "memit", "model": "smollm2"}, made_by="a test", revert=[])
    want = yaml.safe_load(text[4 : text.index("\n---\n", 3)])
    monkeypatch.setitem(sys.modules, "yaml", None)
    assert read_front_matter(text) == want and want["tags"][-1] == "memit"
