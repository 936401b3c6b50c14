"""benchmarks/bench_scale.py on two random SmolLM2-shaped blocks: every phase reported, the JSON written, the
loop's steps read nothing back to the host. No timing is asserted (the machines are shared)."""

import json
from pathlib import Path

import pytest
from conftest import load_script

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scale.py"


@pytest.fixture()
def bench():
    return load_script(BENCH, "bench_scale")


@pytest.mark.parametrize("method", ["crispedit", "ft"])
def test_bench_scale_reports_every_phase(bench, method, tmp_path, capsys):
    out = tmp_path / "scale.json"
    res = bench.main(["--random-init", "smollm2", "--blocks", "2", "--layers", "model.layers.{0-1}.mlp.down_proj",
                      "--synthetic", "6", "--epochs", "2", "--n-cap", "4", "--max-len", "32", "--batch-size", "8",
                      "--method", method, "--sync-free", "on", "--kfac-batch-size", "2", "--profile-kfac",
                      "--json", str(out)])
    text = capsys.readouterr().out
    stored = json.loads(out.read_text())
    assert stored["train"]["epochs"] == 2 and stored["train"]["steps"] >= 2 and stored["train"]["tflops"] > 0
    assert 0 < stored["train"]["fraction_of_peak"] and stored["matmul_peak_tflops"] > 0
    assert stored["host_syncs_per_step"] == 0, stored["profile"]  # the accelerator's path, run on the CPU
    assert stored["train"]["sync_free"] is True
    assert stored["profile"]["per_step"]["aten_ops"] > 0
    if method == "crispedit":
        assert {"kfac", "eigh", "projector"} <= set(stored) and stored["kfac"]["tokens_per_s"] > 0
        assert "kfac" in text and "projector" in text
        prof = stored["kfac_profile"]  # 4 texts in batches of at most 2
        assert prof["batches"] >= 2 and prof["tokens"] == stored["kfac"]["tokens"]
        assert prof["per_batch"]["aten_ops"] > 0 and prof["top_self_cpu"] and "kfac prof" in text
    else:
        assert "kfac" not in stored
    assert res["n_edits"] == 6 and "train" in text and "profile" in text


def test_bench_scale_compares_methods(bench, tmp_path, capsys):
    res = bench.main(["--random-init", "smollm2", "--blocks", "2", "--layers", "model.layers.{0-1}.mlp.down_proj",
                      "--synthetic", "4", "--epochs", "1", "--n-cap", "4", "--max-len", "32", "--batch-size", "8",
                      "--method", "crispedit:bf16+tf32,crispedit,ft", "--no-profile"])
    assert set(res["methods"]) == {"crispedit:bf16+tf32", "crispedit", "ft"} and res["step_ratio"]["ft"] == 1.0
    assert res["step_ratio"]["crispedit"] > 0 and res["step_ratio"]["crispedit:bf16+tf32"] > 0
    assert "step time / ft" in capsys.readouterr().out


def test_synthetic_requests_are_deterministic(bench):
    a, b = bench.synthetic_requests(20, seed=3), bench.synthetic_requests(20, seed=3)
    assert [(r.prompt, r.target) for r in a] == [(r.prompt, r.target) for r in b]
    assert len({r.prompt for r in a}) == 20 and all(r.target.strip() for r in a)


@pytest.mark.slow
def test_bench_scale_compiled_blocks(bench, capsys):
    """The ``:compile`` entry (issue 37 e): the decoder blocks run under ``torch.compile`` (minutes on a CPU),
    the first run's compile time is reported apart, the second run trains the same steps."""
    res = bench.main(["--random-init", "smollm2", "--blocks", "2", "--layers", "model.layers.1.mlp.down_proj",
                      "--synthetic", "4", "--epochs", "1", "--n-cap", "4", "--max-len", "32", "--batch-size", "4",
                      "--no-profile", "--method", "crispedit:compile,crispedit"])
    comp = res["methods"]["crispedit:compile"]
    assert comp["compile"]["mode"] == "default" and comp["compile"]["first_run_seconds"] > 0
    assert comp["train"]["steps"] == res["methods"]["crispedit"]["train"]["steps"] and "step_ratio" in res
    assert "compile    default" in capsys.readouterr().out


def test_a_failing_compiled_entry_leaves_the_others_measured(bench, monkeypatch, capsys):
    """A ``:graphs`` / ``:compile`` entry that fails (an unsupported backend, say) is reported as an error and the
    next entries run from the same weights; other failures still raise."""
    def broken(*a, **k):
        raise RuntimeError("no backend here")

    monkeypatch.setattr(bench.torch, "compile", broken)
    res = bench.main(["--random-init", "smollm2", "--blocks", "2", "--layers", "model.layers.1.mlp.down_proj",
                      "--synthetic", "4", "--epochs", "1", "--n-cap", "4", "--max-len", "32", "--batch-size", "4",
                      "--no-profile", "--method", "ft:graphs,ft"])
    assert res["methods"]["ft:graphs"]["error"] == "RuntimeError: no backend here"
    assert res["methods"]["ft"]["train"]["steps"] > 0 and res["step_ratio"] == {"ft": 1.0}
    assert "[ft:graphs] failed" in capsys.readouterr().out
