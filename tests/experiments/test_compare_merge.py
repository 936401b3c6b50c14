"""`crispedit compare-merge`: the rows of compares run apart under the same settings become one compare."""

import copy
import hashlib
import json

import pytest

from crispedit import pipeline as pipeline_mod
from crispedit.cli import main
from crispedit.data import EditRequest
from crispedit.editing import EditConfig
from crispedit.errors import CrispEditError
from crispedit.experiments import compare as compare_mod
from crispedit.experiments import compare_outputs, compare_table
from crispedit.experiments.compare_merge import merge_compares
from crispedit.versions import stamped

LAYERS = "model.layers.{1-2}.mlp.down_proj"


def _row(qa, kl, ppl):
    return {
        "summary": {"kl_drift": kl, "rel": qa, "gen": qa, "ppl": ppl, "ppl_base": 40.0},
        "wild": {"qa": {"rel": qa, "gen": qa}},
        "capabilities": {"arc_challenge": 0.5},
        "config": {"method": "x"},
    }


def whole():
    """A hand-built compare of four rows, as one run would store it."""
    return stamped(
        {
            "format": compare_outputs.COMPARE_FORMAT,
            "settings": {"model": "m", "n_edits": 4, "edits": {}, "evaluation": {"capabilities": ["arc_challenge"]}},
            "methods": ["crispedit", "ft", "lora", "adam-nscl"],
            "results": {
                "base": _row(0.0, 0.0, 40.0),
                "crispedit": _row(0.8, 0.002, 41.0),
                "ft": _row(0.9, 0.05, 60.0),
                "lora": _row(1.0, 0.9, 130.0),
                "adam-nscl": _row(0.85, 0.003, 41.5),
            },
        }
    )


def split(tmp_path, *groups):
    """Store ``whole()``'s rows as one compare directory per group of methods (each with the base row)."""
    dirs = []
    for i, methods in enumerate(groups):
        p = copy.deepcopy(whole())
        p["methods"] = list(methods)
        p["results"] = {m: p["results"][m] for m in ("base", *methods)}
        d = tmp_path / f"part{i}"
        d.mkdir()
        (d / "compare.json").write_text(json.dumps(p))
        dirs.append(d)
    return dirs


def test_merge_gives_what_one_compare_of_every_row_stores(tmp_path):
    pytest.importorskip("matplotlib")
    a, b = split(tmp_path, ["crispedit", "ft"], ["lora", "adam-nscl"])
    merged = merge_compares([a, b], tmp_path / "all")
    stored = json.loads((tmp_path / "all" / "compare.json").read_text())
    assert stored == merged
    assert merged["results"] == whole()["results"] and merged["methods"] == whole()["methods"]
    assert merged["merged_from"] == [
        {"dir": str(a), "methods": ["crispedit", "ft"]},
        {"dir": str(b), "methods": ["lora", "adam-nscl"]},
    ]
    assert merged["pareto"] == compare_table.pareto_points(whole())
    assert (tmp_path / "all" / "compare.md").read_text() == compare_table.compare_table(merged)
    assert (tmp_path / "all" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    # into one of the sources: that directory becomes the whole compare
    merge_compares([a, b], a)
    assert json.loads((a / "compare.json").read_text())["results"] == whole()["results"]


def test_merge_takes_compares_that_read_the_same_model_and_edits_from_other_paths(tmp_path):
    """Another machine's paths to the same weights and edits (the fingerprint and the requests' digest agree) are
    the same settings; another fingerprint is not."""
    pytest.importorskip("matplotlib")
    a, b = split(tmp_path, ["crispedit"], ["ft"])
    for d, where in ((a, "/srv/models/smollm2"), (b, "smollm2")):
        p = json.loads((d / "compare.json").read_text())
        p["settings"].update(model=where, fingerprint="xxh3-1", requests_digest="abc", edits={"file": where + ".json"})
        (d / "compare.json").write_text(json.dumps(p))
    merged = merge_compares([a, b], tmp_path / "all")
    assert merged["settings"]["model"] == "/srv/models/smollm2" and merged["methods"] == ["crispedit", "ft"]
    p = json.loads((b / "compare.json").read_text())
    p["settings"]["fingerprint"] = "xxh3-2"
    (b / "compare.json").write_text(json.dumps(p))
    with pytest.raises(CrispEditError, match="other settings than .* \\(fingerprint\\)"):
        merge_compares([a, b], tmp_path / "other")


def _tree(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    "case,msg",
    [
        ("one", "at least two compare directories"),
        ("twice", "named twice"),
        ("missing", "is not a compare directory"),
        ("settings", "other settings than .* \\(n_edits\\)"),
        ("base", "the base rows of .* differ \\(summary.ppl 40 vs 41\\)"),
        ("both", "both hold a ft row"),
        ("out-holds-another", "exists and is not one of the merged compares"),
        ("version", "was written by crispedit 0.0.1"),
        ("corrupt", "is corrupt"),
    ],
)
def test_merge_refuses_with_one_line_and_writes_nothing(case, msg, tmp_path, capsys):
    a, b = split(tmp_path, ["crispedit", "ft"], ["ft", "lora"] if case == "both" else ["lora"])
    out = tmp_path / "out"
    dirs = [a, b]
    edit = None
    if case == "one":
        dirs = [a]
    elif case == "twice":
        dirs = [a, tmp_path / "part0" / ".." / "part0"]
    elif case == "missing":
        dirs = [a, tmp_path / "empty"]
        (tmp_path / "empty").mkdir()
    elif case == "settings":
        edit = lambda p: p["settings"].update(n_edits=5)  # noqa: E731
    elif case == "base":
        edit = lambda p: p["results"]["base"]["summary"].update(ppl=41.0)  # noqa: E731
    elif case == "out-holds-another":
        out.mkdir()
        (out / "compare.json").write_text("{}")
    elif case == "version":
        edit = lambda p: p.update(crispedit_version="0.0.1")  # noqa: E731
    if edit is not None:
        p = json.loads((b / "compare.json").read_text())
        edit(p)
        (b / "compare.json").write_text(json.dumps(p))
    if case == "corrupt":
        (b / "compare.json").write_text('{"format": 1, "resu')
    before = _tree(tmp_path)
    code = main(["compare-merge", *map(str, dirs), "--out", str(out)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("crispedit: error:"), err
    assert __import__("re").search(msg, lines[0]), lines[0]
    assert _tree(tmp_path) == before


def test_merged_real_compares_resume_as_one(tiny_lm, tmp_path, iso_cache, monkeypatch):
    """Two compares of one tiny model, each with one method, merge into a directory that a compare of both
    methods resumes without running either again."""
    model, tok = tiny_lm
    reqs = [EditRequest(f"Who founded club {i}?", f"Founder {chr(65 + i)}") for i in range(2)]
    cfg = dict(layers=LAYERS, epochs=2, n_cap=4, max_len=32, contexts="bare", batch_size=4)
    configs = {m: EditConfig(method=m, **cfg) for m in ("ft", "locbf-ft")}
    for m in configs:
        compare_mod.run_compare(model, tok, reqs, [m], tmp_path / m, configs={m: configs[m]}, progress=False)
    merged = merge_compares([tmp_path / "ft", tmp_path / "locbf-ft"], tmp_path / "both")
    ran, real = [], pipeline_mod.edit

    def counting(model, tok, requests, c, **kw):
        ran.append(c.method)
        return real(model, tok, requests, c, **kw)

    monkeypatch.setattr(pipeline_mod, "edit", counting)
    again = compare_mod.run_compare(model, tok, reqs, ["ft", "locbf-ft"], tmp_path / "both", configs=configs)
    assert ran == [] and again["results"] == merged["results"]
    with pytest.raises(CrispEditError, match="holds ft run with another configuration"):
        compare_mod.run_compare(
            model, tok, reqs, ["ft"], tmp_path / "both", configs={"ft": EditConfig(method="ft", **{**cfg, "epochs": 3})}
        )
