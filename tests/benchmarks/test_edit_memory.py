"""benchmarks/edit_memory.py: memory is read at every phase of a real edit, which ends after the asked steps."""

import copy

import crispedit.editing.loop as loop
from conftest import REPO, load_script
from crispedit.data import EditRequest
from crispedit.editing import EditConfig

SCRIPT = REPO / "benchmarks" / "edit_memory.py"


def test_measure_reads_every_phase_and_stops_after_the_steps(tiny_lm):
    script = load_script(SCRIPT, "edit_memory")
    model, tok = tiny_lm
    model = copy.deepcopy(model)  # left part-edited
    reqs = [EditRequest(f"Who founded company {i}?", f"Person {i}") for i in range(6)]
    config = EditConfig(
        method="ft",
        layers="model.layers.1.mlp.down_proj",
        contexts="bare",
        batch_size=2,
        epochs=5,
        stop_loss=0.0,
        skip_loss=0.0,
    )
    timer = loop.NULL_TIMER
    row = script.measure(model, tok, reqs, 2, config)
    assert row["steps"] == 2 and loop.NULL_TIMER is timer
    assert set(script.PHASES) <= set(row)
    for p in script.PHASES:
        assert 0 < row[p]["rss_mib"] <= row[p]["hwm_mib"]
    hwm = [row[p]["hwm_mib"] for p in script.PHASES]
    assert hwm == sorted(hwm)  # a peak never falls
