"""benchmarks/scaling.py: points from compare.json and edit_matrix files, the table, the picture, bad input."""

import json
from pathlib import Path

import pytest
from conftest import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "scaling.py"


@pytest.fixture()
def scaling():
    return load_script(SCRIPT, "scaling")


def _row(qa, drift, pred=None):
    return {"wild": {"qa": {"rel": qa, "gen": qa / 2}, "chat": {"rel": 1.0, "gen": 0.5}},
            "summary": {"kl_drift": drift, "kl_predicted": pred, "ppl": 40.0}}


def test_points_from_both_formats_make_a_table_and_a_picture(scaling, tmp_path, capsys):
    cmp_dir = tmp_path / "cmp"
    cmp_dir.mkdir()
    (cmp_dir / "compare.json").write_text(json.dumps({"settings": {"n_edits": 100}, "results": {
        "base": {"summary": {"kl_drift": 0.0}}, "crispedit": _row(0.84, 0.008, 0.004), "ft": _row(0.86, 0.28)}}))
    matrix = tmp_path / "m.json"
    matrix.write_text(json.dumps({"args": {"n_edits": 32}, "results": [
        {"overrides": {"method": "crispedit"}, "wild": _row(0.94, 0.0036)["wild"], "kl_drift": 0.0036, "ppl": 39.4},
        {"overrides": {"method": "crispedit", "lr": 0.001}, "wild": {}, "kl_drift": 1.0, "ppl": 1.0}]}))
    out = tmp_path / "scal"
    assert scaling.main([str(matrix), str(cmp_dir), "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    assert "| crispedit | 32 | 0.94 / 0.47 |" in table and "| crispedit | 100 | 0.84 / 0.42 |" in table
    assert "| 0.00800 | 0.00400 (2.00×) |" in table and "| 0.28000 | – | 40.00 |" in table  # ft: no prediction
    assert "| ft | 100 |" in table and "base" not in table and "1.00000" not in table  # the lr row is not a default
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert table in capsys.readouterr().out


def test_a_file_of_another_kind_is_one_line(scaling, tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert scaling.main([str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither a compare.json nor an edit_matrix output" in err[0]
    assert not (tmp_path / "o.md").exists()
