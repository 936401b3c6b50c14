"""benchmarks/edit_tokens.py: the per-epoch counts it prints are the loop's own batches."""

import pytest

from conftest import REPO, load_script
from crispedit.data import EditRequest
from crispedit.editing import EditConfig
from crispedit.editing.loop import edit_batches

SCRIPT = REPO / "benchmarks" / "edit_tokens.py"


@pytest.fixture()
def script():
    return load_script(SCRIPT, "edit_tokens")


def test_slice_argument(script):
    assert script.slice_arg("a.json") == ("a.json", 0, None)
    assert script.slice_arg("a.json:100") == ("a.json", 100, None)
    assert script.slice_arg("a.json:100:32") == ("a.json", 100, 32)


def test_counts_are_the_loops_batches(script, tiny_lm):
    model, tok = tiny_lm
    reqs = [EditRequest(f"Who founded company {i}?", f"Person {i}") for i in range(5)]
    config = EditConfig(contexts="bare,prefix:1", batch_size=4)
    row = script.count(tok, reqs, config, model, d_model=8)
    batches, _ = edit_batches(tok, reqs, config, model)
    assert row["edits"] == 5 and row["sequences"] == 10 and row["steps"] == len(batches)
    assert row["real_tokens"] < row["padded_tokens"] == sum(b.input_ids.numel() for b in batches)
    assert row["prefix_states_mb"] == round(row["padded_tokens"] * 8 * 4 / 1e6)
