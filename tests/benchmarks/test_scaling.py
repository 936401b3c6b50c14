"""benchmarks/scaling.py: points from compare.json and edit_matrix files, the table, the picture, bad input."""

import json

import pytest

from conftest import REPO, load_script

SCRIPT = REPO / "benchmarks" / "scaling.py"


@pytest.fixture()
def scaling():
    return load_script(SCRIPT, "scaling")


def _row(qa, drift, pred=None):
    return {
        "wild": {"qa": {"rel": qa, "gen": qa / 2}, "chat": {"rel": 1.0, "gen": 0.5}},
        "summary": {"kl_drift": drift, "kl_predicted": pred, "ppl": 40.0},
    }


def test_points_from_both_formats_make_a_table_and_a_picture(scaling, tmp_path, capsys):
    cmp_dir = tmp_path / "cmp"
    cmp_dir.mkdir()
    (cmp_dir / "compare.json").write_text(
        json.dumps(
            {
                "settings": {"n_edits": 100},
                "results": {
                    "base": {"summary": {"kl_drift": 0.0}},
                    "crispedit": _row(0.84, 0.008, 0.004),
                    "ft": _row(0.86, 0.28),
                },
            }
        )
    )
    matrix = tmp_path / "m.json"
    matrix.write_text(
        json.dumps(
            {
                "args": {"n_edits": 32},
                "results": [
                    {
                        "overrides": {"method": "crispedit"},
                        "wild": _row(0.94, 0.0036)["wild"],
                        "kl_drift": 0.0036,
                        "ppl": 39.4,
                    },
                    {"overrides": {"method": "crispedit", "lr": 0.001}, "wild": {}, "kl_drift": 1.0, "ppl": 1.0},
                ],
            }
        )
    )
    out = tmp_path / "scal"
    assert scaling.main([str(matrix), str(cmp_dir), "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    assert "| crispedit | 32 | 0.94 / 0.47 |" in table and "| crispedit | 100 | 0.84 / 0.42 |" in table
    assert "| 0.00800 | 0.00400 (2.00×) |" in table and "| 0.28000 | – | 40.00 |" in table  # ft: no prediction
    assert "| ft | 100 |" in table and "base" not in table and "1.00000" not in table  # the lr row is not a default
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert table in capsys.readouterr().out


def test_crosstalk_is_read_where_stored_and_computed_from_answers_where_not(scaling, tmp_path):
    """A compare row that stored ``cross`` keeps it; an older row gets it from its stored answers and the edit file
    its settings name; without a readable edit file it is ``–``."""
    edits = tmp_path / "edits.json"
    edits.write_text(
        json.dumps([{"prompt": f"Q{i}?", "target_new": t} for i, t in enumerate(["Paris", "Rome", "Oslo", "Bern"])])
    )
    new, old = _row(0.5, 0.01), _row(0.25, 0.02)
    new["wild"]["qa"]["cross"] = 0.25
    old["wild"]["qa"]["answers"] = [
        ["Rome", False, [], []],
        ["Rome", True, [], []],
        ["Bern, Switzerland", False, [], []],
        ["Paris", False, [], []],
    ]
    cmp_dir = tmp_path / "cmp"
    cmp_dir.mkdir()
    settings = {"n_edits": 3, "edits": {"file": str(edits), "offset": 1, "n": 3}}
    old["wild"]["qa"]["answers"].pop(0)  # the 3 edits from offset 1: Rome, Oslo, Bern
    (cmp_dir / "compare.json").write_text(json.dumps({"settings": settings, "results": {"crispedit": new, "ft": old}}))
    points = scaling.read_points(cmp_dir)
    assert points[("crispedit", 3)]["qa_cross"] == 0.25
    # "Bern, Switzerland" for Oslo counts; "Paris" for Bern does not: edit 0 (Paris) is outside the compare's slice
    assert points[("ft", 3)]["qa_cross"] == round(1 / 3, 4)
    settings["edits"]["file"] = str(tmp_path / "gone.json")
    (cmp_dir / "compare.json").write_text(json.dumps({"settings": settings, "results": {"ft": old}}))
    assert scaling.read_points(cmp_dir)[("ft", 3)]["qa_cross"] is None
    assert "| ft | 3 | 0.25 / 0.12 | – |" in scaling.scaling_table(scaling.read_points(cmp_dir))


def test_a_file_of_another_kind_is_one_line(scaling, tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    assert scaling.main([str(bad), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neither a compare.json nor an edit_matrix output" in err[0]
    assert not (tmp_path / "o.md").exists()
