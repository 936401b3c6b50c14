"""Multi-process K-FAC with ``torch.distributed``: ``torchrun --nproc-per-node 2`` on CPU (gloo) gives
the one-process factors. Two ``torchrun --standalone`` launches (a free rendezvous port each, a timeout each) on
the tiny random-weight llama: the library in float64 (to 1e-12, uneven shards and an idle process) and the
``cache build`` command end to end (the file only rank 0 writes equals a one-process build to fp32 round-off
and is a cache hit for one process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import crispedit
from crispedit.cli import main

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

SRC = str(Path(crispedit.__file__).resolve().parents[1])
TESTS = Path(__file__).resolve().parent
LAYERS = "model.layers.{1-2}.mlp.down_proj"
TIMEOUT_S = 240  # two interpreters importing torch + transformers on a loaded 2-core machine: ~10 s normally


def torchrun(args: list, cwd: Path) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 ARGS`` (``python -m torch.distributed.run``, so the venv's torch
    whatever PATH says), one thread per process; fails the test with both processes' output on error."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([SRC, str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OMP_NUM_THREADS="1",
    )
    env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, args)]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:  # run() has killed torchrun; its workers die with it
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S}s: {exc.stderr}")
    assert proc.returncode == 0, (
        f"torchrun exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return proc


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, dict(fh.metadata() or {})


def test_two_processes_collect_the_one_process_factors_float64(tiny_model_dir, tmp_path):
    from dist_kfac_worker import CASES, collect

    from crispedit.data import capability_corpus
    from crispedit.models import load_model

    texts = capability_corpus(None, 8)
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    torchrun([TESTS / "dist_kfac_worker.py", tiny_model_dir, tmp_path / "texts.json", tmp_path], tmp_path)

    model, tok = load_model(str(tiny_model_dir), dtype=torch.float64)
    for case in CASES:
        one = collect(model, tok, texts, case)  # no process group here: one process, every batch
        for r in (0, 1):
            got, meta = read(tmp_path / f"rank{r}_{case}.safetensors")
            assert meta["world_size"] == "2" and int(meta["n_tokens"]) == one.n_tokens, (case, r, meta)
            ref = one.to_tensors()
            assert set(got) == set(ref)
            for k, t in ref.items():
                assert got[k].dtype == torch.float64
                rel = float((got[k] - t).abs().max() / t.abs().max())
                assert rel <= 1e-12, (case, r, k, rel)
        r0, _ = read(tmp_path / f"rank0_{case}.safetensors")
        r1, _ = read(tmp_path / f"rank1_{case}.safetensors")
        assert all(torch.equal(r0[k], r1[k]) for k in r0), "the processes returned different factors"


def test_torchrun_cache_build_equals_one_process_and_only_rank0_writes(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    build = [
        "cache",
        "build",
        "--model",
        tiny_model_dir,
        "--layers",
        LAYERS,
        "--n-cap",
        12,
        "--max-len",
        32,
        "--kfac-batch-size",
        2,
        "--quiet",
    ]
    proc = torchrun(
        ["-m", "crispedit", *build, "--cache-dir", tmp_path / "c2", "--out", tmp_path / "f2.safetensors"], tmp_path
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("K-FAC factors")]
    assert len(lines) == 1 and "on 2 processes" in lines[0], proc.stdout  # rank 0 alone prints
    written = sorted(p.relative_to(tmp_path / "c2").as_posix() for p in (tmp_path / "c2").rglob("*"))
    assert len(written) == 2 and written[0] == "kfac", written  # one cache file, no temporary left behind
    assert written[1].startswith("kfac/") and written[1].endswith(".safetensors") and "/." not in written[1], written

    assert main([str(a) for a in [*build, "--cache-dir", tmp_path / "c1", "--out", tmp_path / "f1.safetensors"]]) == 0
    assert "on 2 processes" not in capsys.readouterr().out
    two, meta2 = read(tmp_path / "f2.safetensors")
    one, meta1 = read(tmp_path / "f1.safetensors")
    m1, m2 = json.loads(meta1["crispedit"]), json.loads(meta2["crispedit"])
    assert m2["key"] == m1["key"] and m2["n_tokens"] == m1["n_tokens"] and m2["processes"] == 2
    assert set(two) == set(one)
    for k in one:
        scale = float(one[k].abs().max())
        torch.testing.assert_close(two[k], one[k], rtol=1e-6, atol=1e-6 * scale, msg=k)

    # the multi-process cache file is the cache entry a one-process run looks for
    assert main([str(a) for a in [*build, "--cache-dir", tmp_path / "c2"]]) == 0
    assert "reused" in capsys.readouterr().out


def test_torchrun_edit_splits_batches_and_equals_one_process(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from safetensors.torch import load_file

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    recs = [
        {
            "src": f"Who founded club {i}?",
            "alt": f"Founder {chr(65 + i)}",
            "rephrase": f"Club {i} was founded by?",
            "loc": "nq question: who sang it",
            "loc_ans": "someone",
            "subject": f"club {i}",
        }
        for i in range(5)
    ]
    (tmp_path / "edits.json").write_text(json.dumps(recs))
    # 15 sequences in batches of 7, 7, 1: uneven rows per process, and a batch the second process has no row of
    args = [
        "edit",
        "--model",
        tiny_model_dir,
        "--edits",
        tmp_path / "edits.json",
        "--layers",
        LAYERS,
        "--n-cap",
        4,
        "--max-len",
        32,
        "--epochs",
        3,
        "--lr",
        1e-2,
        "--batch-size",
        7,
        "--contexts",
        "bare,prefix:2",
        "--quiet",
        "--no-wild",
    ]
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "c2"))
    proc = torchrun(["-m", "crispedit", *args, "--out", tmp_path / "e2"], tmp_path)
    assert proc.stdout.count("edited model and edit_report.json written") == 1, proc.stdout  # rank 0 alone
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "c1"))
    assert main([str(a) for a in [*args, "--out", tmp_path / "e1"]]) == 0

    r1, r2 = (json.loads((tmp_path / e / "edit_report.json").read_text()) for e in ("e1", "e2"))
    assert r2["processes"] == 2 and "processes" not in r1
    t1, t2 = r1["training"], r2["training"]
    assert (t2["steps"], t2["sequences"], t2["tokens_per_epoch"]) == (
        t1["steps"],
        t1["sequences"],
        t1["tokens_per_epoch"],
    )
    assert t1["steps"] == 9
    torch.testing.assert_close(torch.tensor(t2["epoch_loss"]), torch.tensor(t1["epoch_loss"]), rtol=1e-5, atol=0)
    w0 = load_file(str(tiny_model_dir / "model.safetensors"))
    w1 = load_file(str(tmp_path / "e1" / "model.safetensors"))
    w2 = load_file(str(tmp_path / "e2" / "model.safetensors"))
    changed = [k for k in w0 if not torch.equal(w0[k], w1[k])]
    assert changed == ["model.layers.1.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight"]
    for k in w0:
        step = float((w1[k] - w0[k]).abs().max())
        assert float((w2[k] - w1[k]).abs().max()) <= 1e-4 * step, k  # fp32 round-off of the split batches


def test_other_commands_refuse_torchrun(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["report", str(tmp_path / "run.json")]) == 2
    err = capsys.readouterr().err
    assert "only `cache build`, `edit` and `session add` run under torchrun" in err and err.count("\n") == 1


def test_shard_batch_rows_and_token_shares():
    from crispedit.data.tokenize import EncodedBatch
    from crispedit.editing.loop import shard_batch, target_count

    labels = torch.full((5, 4), -100)
    labels[:, 2:] = 7
    labels[3, 2:] = -100  # a row with no target token
    b = EncodedBatch(torch.arange(20).reshape(5, 4), torch.ones(5, 4, dtype=torch.long), labels, [2, 2, 2, 0, 2])
    parts = [shard_batch(b, r, 3) for r in range(3)]
    assert parts[0].input_ids[:, 0].tolist() == [0, 12] and parts[1].input_ids[:, 0].tolist() == [4, 16]
    assert parts[2].input_ids[:, 0].tolist() == [8] and parts[1].target_lengths == [2, 2]
    assert sum(target_count(p) for p in parts) == target_count(b) == 8
    assert shard_batch(b, 5, 6) is None  # no row
    assert shard_batch(EncodedBatch(b.input_ids[3:4], b.attention_mask[3:4], b.labels[3:4], [0]), 0, 2) is None


def test_helpers_are_no_ops_in_one_process(monkeypatch):
    from crispedit import distributed as d

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert (d.rank(), d.world_size(), d.is_main(), d.launched_world_size()) == (0, 1, True, 1)
    assert d.all_agree(True) and not d.all_agree(False)
    t = torch.ones(3)
    assert d.all_reduce_sum_(t) is t and torch.equal(t, torch.ones(3))
    d.barrier()
    with d.process_group_from_env("cpu") as device:
        assert device == "cpu" and not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "x")
    assert d.launched_world_size() == 1
