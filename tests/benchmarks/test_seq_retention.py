"""benchmarks/seq_retention.py: sequential runs from the base with round-1 retention after every round."""

import pytest

from conftest import REPO, load_script
from crispedit.data import EditRequest
from crispedit.errors import CrispEditError
from crispedit.weights import weight_fingerprint

SCRIPT = REPO / "benchmarks" / "seq_retention.py"
REQS = [EditRequest(f"Who founded company {i}?", f"Person {chr(65 + i)}") for i in range(4)]
BASE = {
    "layers": "model.layers.{1-2}.mlp.down_proj",
    "contexts": "bare",
    "batch_size": 2,
    "epochs": 2,
    "stop_loss": 0.0,
    "lr": 1e-2,
    "n_cap": 4,
    "max_len": 48,
}


@pytest.fixture()
def script():
    return load_script(SCRIPT, "seq_retention")


def test_overrides_split_between_the_edit_and_the_sequence(script):
    cfg = script.seq_config({"gamma": 0.99, "seq.mix": 0.8, "seq.weighting": "tokens"})
    assert cfg.edit.method == "crispedit" and cfg.edit.gamma == 0.99
    assert cfg.mix == 0.8 and cfg.weighting == "tokens" and cfg.mode == "sequential"
    with pytest.raises(CrispEditError):
        script.seq_config({"gamma": 1.5})
    with pytest.raises(TypeError):
        script.seq_config({"seq.no_such_field": 1})


def test_each_run_starts_from_the_base_and_probes_round_one_after_every_round(script, tiny_lm, iso_cache):
    model, tok = tiny_lm
    fp = weight_fingerprint(model)
    runs = [
        script.run_one(model, tok, REQS, dict(BASE), 2),
        script.run_one(model, tok, REQS, {**BASE, "gamma": 0.99}, 2),
    ]
    assert weight_fingerprint(model) == fp  # restored after each run
    for r in runs:
        assert [x["round"] for x in r["rounds"]] == [1, 2] and all(x["epochs"] == 2 for x in r["rounds"])
        assert all(0 <= x["tf_rel"] <= 1 and 0 <= x["qa"] <= 1 for x in r["rounds"])
    assert runs[1]["config"]["edit"]["gamma"] == 0.99 and "gamma=0.99" in runs[1]["run"]
    md = script.table(runs)
    assert md.count("| tf_rel |") == 2 and "| r1 | r2 | seconds |" in md


def test_teacher_forced_only_probe_and_a_record_after_every_round(script, tiny_lm, iso_cache):
    model, tok = tiny_lm
    seen = []
    run = script.run_one(model, tok, REQS, dict(BASE), 2, wild=(), on_round=seen.append)
    assert [len(p["rounds"]) for p in seen] == [1, 2] and all(p["edit_seconds"] is None for p in seen)
    assert all(set(x) == {"round", "epochs", "last_loss", "seconds", "tf_rel", "kept"} for x in run["rounds"])
    assert all(0 < x["kept"] <= 1 for x in run["rounds"])  # the projector's free fraction
    assert all(x["last_loss"] >= 0 for x in run["rounds"])
    md = script.table([run, seen[0]])
    assert md.count("| tf_rel |") == 2 and "| qa |" not in md and "| – |" in md and md.count("| kept |") == 2


def test_spectra_record_each_rounds_edit_factors(script, tiny_lm, iso_cache):
    """``spectra``: every round's row holds the trace / top eigenvalue / top-5 share of the round's edit factors and
    of their running average, per layer; the run holds the capability factors' (the projector's other input)."""
    model, tok = tiny_lm
    run = script.run_one(model, tok, REQS, dict(BASE), 2, wild=(), spectra=True)
    first, second = (x["factors"] for x in run["rounds"])
    layers = ["model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj"]
    assert sorted(first["chunk"]) == layers and sorted(run["capability"]) == layers
    for part in (first["chunk"], second["accumulated"], run["capability"]):
        for v in part.values():
            assert v["trA"] > 0 and v["trS"] > 0 and 0 < v["top5A_share"] <= 1 and 0 < v["topS"] <= v["trS"]
    assert first["accumulated"] == first["chunk"]  # one chunk: the average is the chunk
    assert "| factors |" not in script.table([run])
    from crispedit.sessions import sequential

    assert sequential.accumulate.__name__ == "accumulate"  # the wrapper is removed afterwards
