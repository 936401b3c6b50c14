"""The per-phase step profile of the real edit loop (editing/steptimer.py, bench_projection.py --profile): it runs
on a tiny model, its phases add up to the step, and timing a run does not change what the run computes. No
speed is asserted (the machines are shared)."""

import json
import sys

import pytest
import torch

from conftest import REPO, load_script
from crispedit.data import BUNDLED_EDITS, bundled_path, load_edits
from crispedit.editing import EditConfig, capability_factors, get_editor
from crispedit.editing.loop import projected_finetune
from crispedit.editing.steptimer import MAIN_PHASES, NULL_TIMER, StepTimer
from crispedit.layers import resolve_layers

BENCH = REPO / "benchmarks" / "bench_projection.py"
PATTERN = "model.layers.{1-2}.mlp.down_proj"


@pytest.fixture()
def bench():
    return load_script(BENCH, "bench_projection")


def _setup(tiny_lm, iso_cache):
    model, tok = tiny_lm
    layers = resolve_layers(model, PATTERN)
    factors, _ = capability_factors(model, tok, layers, EditConfig(n_cap=4, max_len=32), progress=False)
    return model, tok, layers, factors, load_edits(bundled_path(BUNDLED_EDITS))[:6]


def test_profile_phases_sum_to_the_step(bench, tiny_lm, iso_cache, capsys):
    model, tok, layers, factors, reqs = _setup(tiny_lm, iso_cache)
    before = {n: m.weight.detach().clone() for n, m in layers.items()}
    res = bench.profile_steps(
        model, tok, layers, factors, reqs, repeats=2, epochs=2, discard=1, contexts="bare,prefix:1"
    )
    assert set(res["kinds"]) == set(bench.KINDS) and res["steps_per_run"] >= 2
    for kind, r in res["kinds"].items():
        b = r["breakdown"]
        assert r["fast_loss"] and b["steps"] == 2 * (res["steps_per_run"] - 1) and len(r["runs"]) == 2
        assert all(b[k] >= 0 for k in MAIN_PHASES) and b["forward"] > 0 and b["backward"] > 0 and b["optimizer"] > 0
        timed = sum(b[k] for k in MAIN_PHASES) + b["other"]
        assert abs(b["step"] - timed) <= 0.1 * b["step"] + 5e-3, (kind, b)  # the phases cover the step
        assert b["other"] == pytest.approx(sum(b["other_parts"].values()))
        assert "zero_grad" in b["other_parts"] and "bookkeeping" in b["other_parts"]
    assert "copies" in res["kinds"]["crispedit/update"]["breakdown"]["other_parts"]
    assert res["kinds"]["crispedit/gradient"]["breakdown"]["projection"] > 0
    for n, m in layers.items():  # the benchmark puts the weights back
        assert torch.equal(m.weight, before[n])
    over = bench.print_profile(res)
    out = capsys.readouterr().out
    assert over["ft/gradient"] == {"paired": 0.0, "attributed": 0.0} and set(over) == set(bench.KINDS)
    assert "overhead per fast-path step" in out and ("PASS" in out or "FAIL" in out)
    for phase in ("forward", "backward", "projection", "optimizer", "other", "step"):
        assert f"  {phase} " in out


def test_timing_a_run_changes_nothing(tiny_lm, iso_cache):
    model, tok, layers, factors, reqs = _setup(tiny_lm, iso_cache)
    cfg = EditConfig(epochs=3, contexts="bare", batch_size=4)
    editor = get_editor("crispedit")
    projs = editor.projectors(layers, factors, cfg)
    start = {n: m.weight.detach().clone() for n, m in layers.items()}
    results = []
    for timer in (None, StepTimer(record_functions=True)):
        with torch.no_grad():
            for n, m in layers.items():
                m.weight.copy_(start[n])
        hist = projected_finetune(
            model, tok, reqs, layers, editor.trainable(layers), projs, cfg, progress=False, timer=timer
        )
        results.append((hist.epoch_loss, {n: m.weight.detach().clone() for n, m in layers.items()}))
    (l0, w0), (l1, w1) = results
    assert l0 == l1 and all(torch.equal(w0[n], w1[n]) for n in w0)
    assert len(timer.steps) == hist.steps and not timer.skipped
    # every step's phases add up to it (median over steps: a preempted gap on a shared machine is one outlier)
    gaps = sorted(abs(r["step"] - sum(v for k, v in r.items() if k != "step")) / r["step"] for r in timer.steps)
    assert gaps[len(gaps) // 2] <= 0.05, gaps


def test_step_timer_records_skipped_batches_and_the_null_timer_is_inert():
    t = StepTimer()
    t.start_step()
    with t.phase("forward"):
        pass
    t.end_step(skipped=True)
    t.start_step()
    with t.phase("forward"), t.phase("bookkeeping"):
        pass
    with t.phase("forward"):  # a phase may repeat within a step: its times add
        pass
    t.end_step()
    assert len(t.skipped) == 1 and len(t.steps) == 1 and set(t.steps[0]) == {"forward", "bookkeeping", "step"}
    b = t.breakdown()
    assert b["steps"] == 1 and b["projection"] == 0.0 and b["other_parts"] == {"bookkeeping": t.steps[0]["bookkeeping"]}
    assert StepTimer().breakdown() == {}
    NULL_TIMER.start_step()
    with NULL_TIMER.phase("forward"):
        pass
    NULL_TIMER.end_step()
    assert NULL_TIMER.phase("a") is NULL_TIMER.phase("b")  # one shared no-op context, nothing allocated


def test_bench_main_profile_on_a_tiny_model(bench, monkeypatch, capsys, iso_cache):
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_projection.py",
            "--model",
            "tiny-small",
            "--tiny-blocks",
            "3",
            "--batch",
            "3",
            "--contexts",
            "bare",
            "--repeats",
            "1",
            "--epochs",
            "2",
            "--n-cap",
            "2",
            "--max-len",
            "16",
            "--threads",
            "1",
            "--profile",
            "--torch-profile",
        ],
    )
    bench.main()
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert "overhead per fast-path step (crispedit gradient projection vs ft)" in out
    # the loop's ranges in the torch.profiler table
    assert "crispedit.projection" in out and "crispedit.forward" in out
    assert set(summary["overhead"]) == {"ft/gradient", "crispedit/gradient", "crispedit/update"}
    assert isinstance(summary["pass"], bool) and summary["overhead_goal"] == 0.05
    assert summary["breakdown"]["crispedit/gradient"]["steps"] >= 1


def test_factors_from_a_cache_file_map_onto_other_layers_in_order(bench, tiny_lm, iso_cache):
    model, tok = tiny_lm
    layers = resolve_layers(model, PATTERN)
    factors, info = capability_factors(model, tok, layers, EditConfig(n_cap=2, max_len=16), progress=False)
    same = bench.factors_from_file(info["path"], layers)
    assert same.layers == list(layers)
    other = resolve_layers(model, "model.layers.{2-3}.mlp.down_proj")
    mapped = bench.factors_from_file(info["path"], other)
    assert mapped.layers == list(other)
    for a, b in zip(layers, other):
        assert torch.equal(mapped.A[b], factors.A[a]) and torch.equal(mapped.S[b], factors.S[a])
    with pytest.raises(SystemExit, match="does not fit"):
        bench.factors_from_file(info["path"], resolve_layers(model, "model.layers.{2-3}.mlp.up_proj"))


@pytest.mark.parametrize("sync_free", [False, True])
def test_the_only_read_in_a_step_is_the_host_skip_rule(sync_free, tiny_lm, iso_cache):
    """Under ``torch.profiler``, the values read back to the host inside the steps of the real loop: on its host
    path (the CPU default) exactly one per batch, in the ``skip_read`` phase (it decides the batch's backward, so
    it cannot wait for the epoch's end); on the sync-free path none. Any other read inside a step fails this."""
    from torch.profiler import ProfilerActivity, profile

    model, tok, layers, factors, reqs = _setup(tiny_lm, iso_cache)
    cfg = EditConfig(epochs=2, contexts="bare", batch_size=2, stop_loss=0.0)
    editor = get_editor("crispedit")
    timer = StepTimer(record_functions=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        hist = projected_finetune(
            model,
            tok,
            reqs,
            layers,
            editor.trainable(layers),
            editor.projectors(layers, factors, cfg),
            cfg,
            progress=False,
            timer=timer,
            sync_free=sync_free,
        )
    phases = {}
    for e in prof.events():
        if e.name != "aten::_local_scalar_dense":
            continue
        parents, p = [], e.cpu_parent
        while p is not None:
            parents.append(p.name)
            p = p.cpu_parent
        phase = next((n for n in parents if n.startswith("crispedit.")), "between steps")
        phases[phase] = phases.get(phase, 0) + 1
    batches = hist.steps + hist.skipped
    assert batches == 6 and len(hist.epoch_loss) == 2
    in_steps = {k: v for k, v in phases.items() if k != "between steps"}
    assert in_steps == ({} if sync_free else {"crispedit.skip_read": batches}), phases
    assert all(("skip_read" in r) is not sync_free for r in timer.steps + timer.skipped)
