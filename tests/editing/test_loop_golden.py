"""The projected loop does exactly what it did when tests/editing/golden/loop_runs.json was written: every fine-tuning
method, each projection target, the preservation term, context sampling, the drift budget, bf16, the plateau rule,
the sync-free skip rule under a StepTimer and a resumed checkpoint give the same training report (timings aside)
and the same trained weights, bit for bit. Float results are exact only on the torch and kind of machine that
wrote them, so the file holds a run per kind (torch, architecture, CPU vendor, instruction set): on a kind it lacks
the test is skipped (add that kind's run with ``python tests/editing/golden/make_loop_runs.py`` from a commit whose
loop is trusted)."""

import importlib.util
import json
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"


def _script():
    spec = importlib.util.spec_from_file_location("make_loop_runs", GOLDEN / "make_loop_runs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_loop_edits_as_it_did(tmp_path):
    mod = _script()
    env = mod.environment()
    stored = mod.stored_run(json.loads((GOLDEN / "loop_runs.json").read_text()), env)
    if stored is None:
        pytest.skip(f"loop_runs.json holds no run of {env}")
    assert set(stored["cases"]) == set(mod.CASES)
    now = mod.golden()
    for name, case in stored["cases"].items():
        assert now["cases"][name] == case, name
