"""The model split across processes with FSDP2 (``--shard``): on CPU with gloo, the tiny random-weight llama.

* Library, float64, 2 processes (``tests/curvature/dist_shard_worker.py``): K-FAC factors collected on the split
  model (every block split, the hooked layers too; uneven batch shards and an idle process) equal the one-process
  factors; a split edit takes the one-process steps and skips and ends at its weights, each process storing the weights
  ``benchmarks/shard_memory.py``'s calculator counts; a split edit killed after its second epoch resumes from its
  checkpoint and ends where the uninterrupted one-process edit does.
* Command line, float32: ``torchrun --nproc-per-node 3 -m crispedit edit --shard`` (3 processes: no weight's rows
  and no batch divide evenly) writes the files a one-process edit writes, with its weights, reusing the factors
  the one-process edit cached; ``cache build --shard`` writes the factors a one-process build reuses.
* ``torchrun --nproc-per-node 2 -m crispedit session add --shard``: a round on the split model commits the files and
  the state a one-process round commits on a copy of the same session, with its weights and its edit factors.
* Bad input: ``--shard`` without torchrun, ``--shard`` with a method that does not train through the loop.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from crispedit.cli import main

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

TESTS = Path(__file__).resolve().parent
SRC = str(TESTS.parents[1] / "src")
LAYERS = "model.layers.{1-2}.mlp.down_proj"
TIMEOUT_S = 300  # a few interpreters importing torch + transformers on a loaded 2-core machine: ~15 s normally


def torchrun(
    args: list, cwd: Path, nproc: int = 2, ok: bool = True, timeout_s: int = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node NPROC ARGS``, one thread per process; with ``ok`` fails the test
    with the processes' output unless it exits 0; fails it when the run takes over ``timeout_s`` seconds."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([SRC, str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OMP_NUM_THREADS="1",
    )
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *map(str, args),
    ]
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:  # run() has killed torchrun; its workers die with it
        pytest.fail(f"torchrun did not finish in {timeout_s}s: {exc.stderr}")
    if ok:
        assert proc.returncode == 0, (
            f"torchrun exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
        )
    return proc


def read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


RECORDS = [
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


@pytest.fixture(scope="module")
def one_process_edit(tiny_model_dir, tmp_path_factory):
    """The float64 one-process edit of ``dist_shard_worker.edit_config``: (base weights, edited weights, history)."""
    from dist_shard_worker import edit_config

    from crispedit.data import load_edits
    from crispedit.editing import edit
    from crispedit.models import load_model
    from crispedit.weights import parameter

    d = tmp_path_factory.mktemp("one_process_edit")
    (d / "edits.json").write_text(json.dumps(RECORDS))
    model, tok = load_model(str(tiny_model_dir), dtype=torch.float64)
    res = edit(model, tok, load_edits(d / "edits.json"), edit_config(), cache_root=d / "cache", progress=False)
    edited = {n: parameter(model, n).detach().clone() for n in res.original_weights}
    return res.original_weights, edited, res.history.to_json()


def assert_same_edit(out: Path, one_process_edit, resumed_at: int | None = None) -> None:
    """Both processes' results in ``out`` equal the one-process edit: the same steps, skips and epoch losses (as the
    reports round them, to six decimals: within one unit of the last, since a difference far below it can still
    fall either side of a rounding boundary), and weights within 1e-5 of the largest weight change: float64
    training, but the projection runs in float32 on gradients summed in another order, and Adam divides each
    element by its own running scale, so an element whose projected gradient is near zero carries that float32
    round-off into a full-size step."""
    base, edited, hist = one_process_edit
    for r in (0, 1):
        got, h = read(out / f"rank{r}_edit.safetensors"), json.loads((out / f"rank{r}_edit.json").read_text())
        assert (h["steps"], h["skipped_batches"], h["epochs"]) == (
            hist["steps"],
            hist["skipped_batches"],
            hist["epochs"],
        )
        assert h["steps"] > 0 and h["skipped_batches"] > 0  # the case exercises both
        assert h.get("resumed_at_epoch") == resumed_at
        torch.testing.assert_close(
            torch.tensor(h["epoch_loss"], dtype=torch.float64),
            torch.tensor(hist["epoch_loss"], dtype=torch.float64),
            rtol=0,
            atol=1.0001e-6,
        )
        assert (
            set(got)
            == set(edited)
            == {f"{n}.weight" for n in ("model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj")}
        )
        for k, w in edited.items():
            step = float((w - base[k]).abs().max())
            assert step > 0 and float((got[k] - w).abs().max()) <= 1e-5 * step, (r, k)


def test_split_model_collects_the_one_process_factors_float64(tiny_model_dir, tmp_path):
    from dist_kfac_worker import CASES, collect

    from crispedit.data import capability_corpus
    from crispedit.models import load_model

    texts = capability_corpus(None, 8)
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    torchrun([TESTS / "dist_shard_worker.py", "kfac", tiny_model_dir, tmp_path / "texts.json", tmp_path], tmp_path)
    model, tok = load_model(str(tiny_model_dir), dtype=torch.float64)
    for case in CASES:
        one = collect(model, tok, texts, case).to_tensors()  # no process group here: one process, every batch
        for r in (0, 1):
            got = read(tmp_path / f"rank{r}_{case}.safetensors")
            assert set(got) == set(one)
            for k, t in one.items():
                assert float((got[k] - t).abs().max() / t.abs().max()) <= 1e-12, (case, r, k)


def test_split_edit_takes_the_one_process_steps_and_stores_what_the_calculator_counts(
    tiny_model_dir, tmp_path, one_process_edit
):
    """A split edit takes the one-process steps and skips to its weights (:func:`assert_same_edit`), and the
    calculator of ``benchmarks/shard_memory.py`` (a meta-device model of the tiny config) gives the bytes of
    weights each of the 2 processes of the split edit stored (measured on the live parameters by the worker), and
    less than the whole model's."""
    from transformers import AutoConfig

    from conftest import load_script

    (tmp_path / "edits.json").write_text(json.dumps(RECORDS))
    torchrun([TESTS / "dist_shard_worker.py", "edit", tiny_model_dir, tmp_path / "edits.json", tmp_path], tmp_path)
    assert_same_edit(tmp_path, one_process_edit)
    calc = load_script("benchmarks/shard_memory.py")
    meta = calc.meta_model(AutoConfig.from_pretrained(tiny_model_dir), torch.float64)
    two, one = calc.predict(meta, LAYERS, 2), calc.predict(meta, LAYERS, 1)
    for r in (0, 1):
        held = json.loads((tmp_path / f"rank{r}_edit.json").read_text())["held_weight_bytes"]
        assert held == two["blocks"] + two["whole"] < one["blocks"] + one["whole"]


def test_a_killed_split_edit_resumes_from_its_checkpoint(tiny_model_dir, tmp_path, one_process_edit):
    from dist_shard_worker import KILL_AFTER

    (tmp_path / "edits.json").write_text(json.dumps(RECORDS))
    killed = torchrun(
        [TESTS / "dist_shard_worker.py", "kill", tiny_model_dir, tmp_path / "edits.json", tmp_path], tmp_path, ok=False
    )
    assert killed.returncode != 0 and not list(tmp_path.glob("rank*_edit.json"))
    assert (tmp_path / "ckpt.safetensors").is_file()
    torchrun([TESTS / "dist_shard_worker.py", "edit", tiny_model_dir, tmp_path / "edits.json", tmp_path], tmp_path)
    assert_same_edit(tmp_path, one_process_edit, resumed_at=KILL_AFTER)


def test_torchrun_edit_shard_writes_the_one_process_edit(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))  # one cache: the split run reuses the factors
    (tmp_path / "edits.json").write_text(json.dumps(RECORDS))
    # 15 sequences in batches of 4, 1, 4, 4, 2 over 3 processes (two with no row of a batch); no block weight's
    # first dimension divides by 3
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
        4,
        "--contexts",
        "bare,prefix:2",
        "--quiet",
    ]
    assert main([str(a) for a in [*args, "--out", tmp_path / "e1"]]) == 0
    capsys.readouterr()
    proc = torchrun(["-m", "crispedit", *args, "--shard", "--out", tmp_path / "e3"], tmp_path, nproc=3)
    assert proc.stdout.count("edited model and edit_report.json written") == 1, proc.stdout  # rank 0 alone

    e1, e3 = tmp_path / "e1", tmp_path / "e3"
    assert sorted(p.name for p in e1.iterdir()) == sorted(p.name for p in e3.iterdir())
    assert json.loads((e1 / "config.json").read_text()) == json.loads((e3 / "config.json").read_text())
    r1, r3 = (json.loads((e / "edit_report.json").read_text()) for e in (e1, e3))
    assert r3["processes"] == 3 and r3["sharded"] is True and "sharded" not in r1
    assert r3["cache"]["hit"] and not r1["cache"]["hit"]  # the one-process cache serves the split run
    assert (r3["training"]["steps"], r3["training"]["skipped_batches"]) == (
        r1["training"]["steps"],
        r1["training"]["skipped_batches"],
    )
    assert r3["wild"].keys() == r1["wild"].keys() and r3["summary"]["rel"] == r1["summary"]["rel"]
    assert r3["summary"]["kl_drift"] == pytest.approx(r1["summary"]["kl_drift"], rel=1e-4)
    w0 = read(tiny_model_dir / "model.safetensors")
    w1, w3 = read(e1 / "model.safetensors"), read(e3 / "model.safetensors")
    assert set(w3) == set(w1) == set(w0)
    changed = [k for k in w0 if not torch.equal(w0[k], w1[k])]
    assert changed == ["model.layers.1.mlp.down_proj.weight", "model.layers.2.mlp.down_proj.weight"]
    for k in w0:  # the frozen weights gathered back bit for bit; the edited ones to fp32 round-off of split batches
        step = float((w1[k] - w0[k]).abs().max())
        assert float((w3[k] - w1[k]).abs().max()) <= 1e-4 * step, k
    d1, d3 = read(e1 / "delta.safetensors"), read(e3 / "delta.safetensors")
    assert set(d1) >= {k for k in changed} and {k for k in d3 if "::" not in k} == {k for k in d1 if "::" not in k}


def test_torchrun_cache_build_shard_is_reused_by_one_process(tiny_model_dir, tmp_path, capsys, monkeypatch):
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
        "--cache-dir",
        tmp_path / "c",
    ]
    proc = torchrun(["-m", "crispedit", *build, "--shard", "--out", tmp_path / "f2.safetensors"], tmp_path)
    assert "on 2 processes" in proc.stdout, proc.stdout
    assert main([str(a) for a in [*build, "--out", tmp_path / "f1.safetensors", "--force"]]) == 0
    capsys.readouterr()
    two, one = read(tmp_path / "f2.safetensors"), read(tmp_path / "f1.safetensors")
    assert set(two) == set(one)
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-6, atol=1e-6 * float(one[k].abs().max()), msg=k)
    assert main([str(a) for a in build]) == 0  # the split build's entry is the one-process build's
    assert "reused" in capsys.readouterr().out


def timeless(x, where: str = ""):
    """``x`` (a session's JSON) without its clock readings: the keys that end in ``seconds`` or name a time
    (``finished``, ``created``), anywhere in it."""
    if isinstance(x, dict):
        return {
            k: timeless(v, f"{where}.{k}")
            for k, v in x.items()
            if not (k.endswith("seconds") or k in ("finished", "created"))
        }
    if isinstance(x, list):
        return [timeless(v, where) for v in x]
    return x


def assert_same_json(got, want, where: str = "") -> None:
    """``got`` equals ``want``: the same keys, lists and strings, integers and booleans exactly, floats to the
    round-off of a float32 model's batches split over processes (1e-4 relative, or 1e-6 absolute near zero)."""
    assert type(got) is type(want) or {type(got), type(want)} <= {int, float}, where
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            assert_same_json(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_json(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-4, abs=1e-6), where
    else:
        assert got == want, where


def test_torchrun_session_add_shard_commits_the_one_process_round(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """One round of a crispedit-seq session on the model split over 2 processes, and in one process on a copy of
    the same session: the same files; ``state.json`` the same apart from clock readings and the keys that say how
    the round ran; the edited weights to the edit test's tolerance; the accumulated edit factors (collected on the
    split model, summed over the processes) and the capability factors ``--recompute-drift`` recollects on the
    edited model to float32 round-off."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("CRISPEDIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "edits.json").write_text(json.dumps(RECORDS))
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    # the 5 bare sequences in batches of 4 and 1 (a batch the second process has no row of)
    init = [
        "session",
        "init",
        "--model",
        tiny_model_dir,
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
        4,
        "--contexts",
        "bare",
        "--kl-texts",
        2,
        "--recompute-drift",
        0.01,
        "--quiet",
        "--out",
        s1,
    ]
    assert main([str(a) for a in init]) == 0
    shutil.copytree(s1, s2)  # the same session twice: base, configuration and capability factors
    add = ["--edits", tmp_path / "edits.json", "--quiet"]
    assert main([str(a) for a in ["session", "add", s1, *add]]) == 0
    capsys.readouterr()
    # a round trains, collects the edit and capability factors, evaluates and plots: longer than an edit
    proc = torchrun(["-m", "crispedit", "session", "add", s2, *add, "--shard"], tmp_path, timeout_s=2 * TIMEOUT_S)
    assert proc.stdout.count("round 1 committed") == 1, proc.stdout  # rank 0 alone prints

    def names(d: Path) -> list[str]:
        return sorted(str(p.relative_to(d)) for p in d.rglob("*"))

    assert names(s2) == names(s1)
    st1, st2 = (json.loads((s / "state.json").read_text()) for s in (s1, s2))
    rec = st2["rounds"][0]
    assert (rec.pop("processes"), rec.pop("sharded")) == (2, True) and "processes" not in st1["rounds"][0]
    for r in (rec, st1["rounds"][0]):  # how the loss was computed: the split model runs the plain loss, one
        for k in ("packed_batches", "padded_per_epoch", "positions_per_epoch"):  # process the packed fast path
            r["train"].pop(k, None)
    assert (rec["train"].pop("fast_loss"), st1["rounds"][0]["train"].pop("fast_loss")) == (False, True)
    assert rec["capability_recomputed"] and st1["rounds"][0]["capability_recomputed"]
    assert_same_json(timeless(st2), timeless(st1))
    base = read(tiny_model_dir / "model.safetensors")
    w1, w2 = read(s1 / "weights-0001.safetensors"), read(s2 / "weights-0001.safetensors")
    assert (
        sorted(w1)
        == sorted(w2)
        == [f"{n}.weight" for n in ("model.layers.1.mlp.down_proj", "model.layers.2.mlp.down_proj")]
    )
    for k in w1:
        step = float((w1[k] - base[k]).abs().max())
        assert step > 0 and float((w2[k] - w1[k]).abs().max()) <= 1e-4 * step, k
    for name in ("edit_factors-0001", "cap_factors-0001"):
        f1, f2 = read(s1 / f"{name}.safetensors"), read(s2 / f"{name}.safetensors")
        assert sorted(f1) == sorted(f2) and f1
        for k in f1:
            torch.testing.assert_close(f2[k], f1[k], rtol=1e-4, atol=1e-4 * float(f1[k].abs().max()), msg=(name, k))


@pytest.mark.parametrize(
    "command", [["edit", "--edits", "E", "--out", "O"], ["cache", "build"], ["session", "add", "O", "--edits", "E"]]
)
def test_shard_without_torchrun_is_one_line(command, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [*command[:2], *[str(tmp_path / a) if a in ("E", "O") else a for a in command[2:]]]
    if "--edits" in command:
        (tmp_path / "E").write_text(json.dumps(RECORDS))
    assert main([*argv, "--shard"]) == 2
    err = capsys.readouterr().err
    assert "--shard splits the model across torchrun's processes" in err and err.count("\n") == 1
    assert not (tmp_path / "O").exists()


def test_shard_refuses_a_method_outside_the_loop(tiny_lm):
    from crispedit.editing import EditConfig, shard_for_edit
    from crispedit.errors import CrispEditError

    model, _ = tiny_lm
    with pytest.raises(CrispEditError, match="--shard runs the projected fine-tuning loop; method 'memit'"):
        shard_for_edit(model, EditConfig(method="memit", layers=LAYERS))
    assert not any(type(m).__name__.startswith("FSDP") for m in model.modules())  # refused before any split
