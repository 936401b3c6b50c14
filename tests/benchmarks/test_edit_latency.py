"""benchmarks/edit_latency.py: one-edit session rounds split into the phases of their records."""

import json

import pytest

from conftest import REPO, load_script
from crispedit.data import EditRequest
from crispedit.data.edits import save_edits_jsonl

SCRIPT = REPO / "benchmarks" / "edit_latency.py"
SET = (
    "layers=model.layers.{1-2}.mlp.down_proj;contexts=bare;batch_size=2;epochs=2;lr=0.01;n_cap=4;max_len=48;"
    "keep_chat=2;keep_subject=1;seq.kl_texts=2"
)


@pytest.fixture()
def script():
    return load_script(SCRIPT, "edit_latency")


def test_settings_parse_to_values(script):
    assert script.parse_set("epochs=3; lr=0.5;contexts=bare;layers=None") == {
        "epochs": 3,
        "lr": 0.5,
        "contexts": "bare",
        "layers": None,
    }


def test_rounds_of_one_edit_are_split_into_phases_that_add_up(
    script, tiny_lm, tmp_path, iso_cache, monkeypatch, capsys
):
    model, tok = tiny_lm
    edits = tmp_path / "edits.jsonl"
    save_edits_jsonl(
        edits,
        [EditRequest(f"Who founded company {i}?", f"Person {chr(65 + i)}", subject=f"company {i}") for i in range(2)],
    )
    monkeypatch.setattr("crispedit.models.load_model", lambda spec, **kw: (model, tok))
    out = script.main(
        ["--edits", f"{edits}:0:2", "--set", SET, "--target", "5", "--evaluate", "--json", str(tmp_path / "l.json")]
    )
    assert [r["round"] for r in out["rounds"]] == [1, 2]
    for r in out["rounds"]:
        ph = r["phases"]
        assert all(ph[k] >= 0 for k in script.PHASES if k != "other") and ph["evaluate"] > 0 and ph["keep"] > 0
        assert ph["total"] == pytest.approx(sum(ph[k] for k in script.PHASES), abs=0.01)
        assert ph["total"] <= r["wall"] + 0.01 and r["epochs"] == 2
    assert out["over_target"] == pytest.approx(out["mean"]["wall"] / 5, abs=1e-3)
    assert json.loads((tmp_path / "l.json").read_text())["rounds"] == out["rounds"]
    assert "x the 5 s target" in capsys.readouterr().out
    final = out["final"]["summary"]  # what the rounds left, over both edits
    assert final["n_edits"] == 2 and final["kl_drift"] == pytest.approx(out["rounds"][-1]["kl_drift"], rel=1e-4)
    assert {"wild_qa_rel", "style_length_ratio", "bleed_target"} <= set(final)
