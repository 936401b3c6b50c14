"""benchmarks/sequence_losses.py: per-sequence losses after every epoch of a real edit, and the token-cost bound."""

import pytest
import torch

from conftest import REPO, load_script
from crispedit.data import EditRequest
from crispedit.editing import EditConfig
from crispedit.editing.fastpath import plain_loss
from crispedit.editing.loop import _Run, batch_source, edit_batches

SCRIPT = REPO / "benchmarks" / "sequence_losses.py"


@pytest.fixture()
def script():
    return load_script(SCRIPT, "sequence_losses")


def test_each_epochs_sequence_losses_are_the_edited_models(script, tiny_lm, iso_cache):
    model, tok = tiny_lm
    reqs = [EditRequest(f"Who founded company {i}?", f"Person {i}") for i in range(5)]
    config = EditConfig(
        method="crispedit",
        layers="model.layers.{1-2}.mlp.down_proj",
        contexts="bare,lead:1",
        batch_size=4,
        epochs=3,
        stop_loss=0.0,
        lr=1e-2,
        n_cap=4,
        max_len=48,
    )
    import crispedit.editing.loop as loop

    end = _Run.end_epoch
    rec = script.record(model, tok, reqs, config)
    assert (loop.batch_source, _Run.end_epoch) == (batch_source, end)  # the loop is left as it was
    assert len(rec["epochs"]) == 3 and rec["history"]["epochs"] == 3
    batches, _ = edit_batches(tok, reqs, config, model)
    last = rec["epochs"][-1]["rows"]
    assert len(last) == sum(b.input_ids.shape[0] for b in batches) == 10
    with torch.no_grad():  # the last probe is the edited model's loss, batch by batch
        for i, b in enumerate(batches):
            rows = [r for r in last if r[0] == i]
            assert sum(r[1] for r in rows) / sum(r[2] for r in rows) == pytest.approx(
                float(plain_loss(model, b)), rel=1e-5
            )
    assert rec["epochs"][0]["rows"] != last  # taken after each epoch, not once


def test_the_token_cost_counts_only_sequences_above_the_skip_loss(script):
    # two sequences of 10 and 30 tokens: the second is below the skip loss after epoch 1, the first after epoch 2
    rec = {
        "skip_loss": 0.1,
        "epochs": [
            {"rows": [[0, 5.0, 2, 10], [0, 0.1, 2, 30]]},
            {"rows": [[0, 0.1, 2, 10], [0, 0.1, 2, 30]]},
            {"rows": [[0, 0.1, 2, 10], [0, 0.1, 2, 30]]},
        ],
    }
    got = script.analyse(rec)
    assert got["below_skip_loss"] == [1, 2, 2]
    assert got["token_cost_ratio"] == round((40 + 10 + 0) / 120, 3)


def test_plateau_curves_finds_where_the_rule_would_stop(tmp_path, capsys):
    """benchmarks/plateau_curves.py: a stored run that stalls above its stop loss is reported with the epoch the
    plateau rule stops at and its share of the seconds; a falling curve and a single-pass one are not."""
    import json

    script = load_script(SCRIPT.with_name("plateau_curves.py"), "plateau_curves")
    stall = [0.5, 0.1, 0.0121] + [0.0120] * 9
    report = {
        "config": {"stop_loss": 0.01},
        "training": {"epoch_loss": stall, "epoch_seconds": [2.0] * 12},
        "other": {"training": {"epoch_loss": [0.5, 0.1, 0.05, 0.02, 0.0099]}},
        "closed": {"training": {"epoch_loss": [3.0, 0.1, 0.1, 0.1, 0.1], "single_pass": True}},
    }
    (tmp_path / "run.json").write_text(json.dumps(report))
    assert script.main([str(tmp_path), "--epochs", "8"]) == 0
    out = capsys.readouterr().out
    assert "/training: stops at epoch 11 of 12 (loss 0.012;" in out and "22 of 24 s (0.92)" in out
    assert "1 of 2 curves stop earlier" in out
