"""benchmarks/session_stream.py: a stream of one-edit rounds through `crispedit session add`, one process each."""

import json

import pytest

from conftest import REPO, load_script
from crispedit.data import EditRequest
from crispedit.data.edits import save_edits_jsonl

SCRIPT = REPO / "benchmarks" / "session_stream.py"
INIT = (
    "--layers model.layers.{1-2}.mlp.down_proj --contexts bare --epochs 2 --lr 1e-2 --n-cap 4 --max-len 48 "
    "--kl-texts 2 --keep-chat 2 --keep-subject 1"
)


@pytest.fixture()
def script():
    return load_script(SCRIPT, "session_stream")


def _record(round_no: int, epochs: list[float]) -> dict:
    return {
        "round": round_no,
        "train": {"epochs": len(epochs), "steps": len(epochs), "seconds": sum(epochs), "epoch_seconds": epochs},
        "edit_seconds": sum(epochs) + 1.0,
        "evaluate_seconds": 2.0,
        "kl_drift": 0.001 * round_no,
        "retention": {str(j): {"rel": 1.0 if j < round_no else 0.5} for j in range(1, round_no + 1)},
    }


def test_a_stopped_round_is_counted_apart_and_retention_follows_the_first_rounds(script):
    """A round with one epoch far over the stream's median is flagged and left out of the median and mean wall time;
    the retention rows hold the first ``first`` rounds' rel after every round."""
    records = [_record(1, [1.0, 1.0]), _record(2, [1.0, 90.0]), _record(3, [1.2, 1.0])]
    out = script.summarize(records, {1: 10.0, 2: 100.0, 3: 12.0}, first=2)
    assert out["stalled_rounds"] == [2] and [r["stalled"] for r in out["rounds"]] == [False, True, False]
    assert out["wall_median"] == 11.0 and out["wall_mean"] == 11.0
    assert out["retention_first"] == [[0.5], [1.0, 0.5], [1.0, 1.0]]
    assert out["rounds"][0]["phases"]["evaluate"] == 2.0


def test_a_round_paused_outside_training_is_counted_apart_but_not_a_short_phase_jitter(script):
    """A round stopped during its evaluation has typical epochs but an evaluation far over the stream's median: it is
    flagged; a phase five times its median yet only seconds over it is not."""
    records = [_record(k, [1.0, 1.0]) for k in range(1, 5)]
    records[1]["evaluate_seconds"] = 500.0
    records[2]["evaluate_seconds"] = 12.0  # six times the median, ten seconds over it
    walls = {1: 10.0, 2: 508.0, 3: 20.0, 4: 10.0}
    out = script.summarize(records, walls, first=1)
    assert out["stalled_rounds"] == [2]


def test_the_picture_stacks_each_call_and_follows_drift_and_the_first_edits(script, tmp_path):
    """The stream's PNG is written from a summary: every round's phases and the rest of its call, the KL drift and
    the first rounds' mean rel."""
    records = [_record(k, [1.0, 1.1]) for k in range(1, 4)]
    out = script.summarize(records, {1: 10.0, 2: 11.0, 3: 12.0}, first=2)
    script.plot_stream(out, tmp_path / "stream.png")
    assert (tmp_path / "stream.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_stream_runs_each_round_in_its_own_process_and_resumes(script, tiny_model_dir, tmp_path, iso_cache):
    """Two rounds of one edit, each a `crispedit session add` process; run again, the stream adds nothing and keeps
    the wall times taken; ``--final`` measures the final model over the first round's edit and over both."""
    edits = tmp_path / "edits.jsonl"
    save_edits_jsonl(
        edits,
        [EditRequest(f"Who founded company {i}?", f"Person {chr(65 + i)}", subject=f"company {i}") for i in range(2)],
    )
    sess = tmp_path / "s"
    args = ["--session", str(sess), "--edits", f"{edits}:0:2", f"--init=--model {tiny_model_dir} {INIT}"]
    out = script.main([*args, "--json", str(tmp_path / "s.json")])
    assert [r["round"] for r in out["rounds"]] == [1, 2] and all(
        r["wall"] > r["phases"]["total"] for r in out["rounds"]
    )
    walls = json.loads((tmp_path / "s.walls.json").read_text())
    again = script.main([*args, "--final", "1"])
    assert json.loads((tmp_path / "s.walls.json").read_text()) == walls
    assert [r["wall"] for r in again["rounds"]] == [walls["1"], walls["2"]]
    assert again["final"]["first"]["summary"]["n_edits"] == 1 and again["final"]["all"]["summary"]["n_edits"] == 2
    assert json.loads((tmp_path / "s.json").read_text())["retention_first"] == out["retention_first"]
