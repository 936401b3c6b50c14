"""Write ``loop_runs.json``: what the projected fine-tuning loop (:func:`crispedit.editing.loop.projected_finetune`)
does on the tiny test model in a fixed set of cases — every fine-tuning method, each projection target, the
preservation term, context sampling, the drift budget and penalty, bf16, the plateau rule, a StepTimer with the
skip rule decided on the device (sync-free), and a checkpointed run resumed under a larger epoch cap. Per case:
the edit's ``training`` section without its timings, the projector and drift figures, and a SHA-256 of every
trained tensor's bytes afterwards. ``tests/editing/test_loop_golden.py`` checks that today's loop does exactly
the same where the file holds a run of the same torch on the same kind of machine (float results are not portable:
another CPU vendor's or instruction set's kernels round differently), so the file holds one run per kind of machine.
Run from the repository root to write this kind's run, keeping the others (only for an intended change, or on a
kind the file lacks, from a commit whose loop is trusted): ``python tests/editing/golden/make_loop_runs.py``; after
an intended change, rewrite every kind's run or drop the ones that cannot be rerun."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: conftest's tiny model and tokenizer

LAYERS = "model.layers.{1-2}.mlp.down_proj"
BASE = dict(
    layers=LAYERS,
    epochs=10,
    lr=0.2,
    batch_size=2,
    n_cap=4,
    max_len=48,
    contexts="bare,prefix:1",
    skip_loss=1.0,
    stop_loss=0.65,
    plateau_epochs=0,
    keep_chat=0,
    keep_subject=0,
    keep_weight=1.0,
)
# name -> EditConfig fields over BASE (and "how": the way the loop is called)
CASES = {
    "crispedit": dict(method="crispedit"),
    "crispedit-update": dict(method="crispedit", projection_target="update"),
    "crispedit-eigenbasis": dict(method="crispedit", projection_target="eigenbasis"),
    "adam-nscl": dict(method="adam-nscl"),
    "ft": dict(method="ft"),
    "converged": dict(method="ft", stop_loss=0.9),
    "locbf-ft": dict(method="locbf-ft", layers="model.layers.2.mlp.down_proj"),
    "lora": dict(method="lora", lr=0.05, epochs=4),
    "keep": dict(method="crispedit", keep_chat=2, keep_subject=1, keep_tokens=6),
    "context-sample": dict(method="ft", context_sample=2, contexts="bare,prefix:2,lead:1"),
    "drift": dict(method="crispedit", max_drift=1e-3, drift_penalty=0.5),
    "bf16": dict(method="ft", precision="bf16"),
    "plateau": dict(method="ft", stop_loss=0.3, skip_loss=0.0, epochs=12, plateau_epochs=2, plateau_delta=0.2),
    "sync-free-timed": dict(method="crispedit", how="sync_free"),
    "keep-sync-free": dict(method="ft", keep_chat=2, keep_subject=1, keep_tokens=6, how="sync_free"),
    "resumed": dict(method="crispedit", how="resume"),
}


def requests():
    """The edit requests every case trains (with subjects, for the preservation term's subject questions)."""
    from crispedit.data import EditRequest

    return [EditRequest(f"Who founded club {i}?", f"Founder {chr(65 + i)}", subject=f"club {i}") for i in range(3)]


def _untimed(section: dict) -> dict:
    """A report section without its wall-clock figures (every key naming seconds)."""
    return {k: v for k, v in section.items() if "seconds" not in k}


def _digest(tensors: dict) -> str:
    """SHA-256 of the named tensors' bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _direct(model, tok, config, **loop_kwargs):
    """The loop called as an editor's ``apply`` calls it, with ``loop_kwargs`` (sync_free, timer): its history and
    the trained tensors."""
    from crispedit.editing.api import edit_factors
    from crispedit.editing.loop import projected_finetune
    from crispedit.editing.registry import get_editor

    config = config.validate().for_family("llama")
    editor = get_editor(config.method)
    layers = editor.select_layers(model, config)
    factors, _ = edit_factors(model, tok, editor, layers, config, progress=False)
    params = editor.trainable(layers)
    hist = projected_finetune(
        model,
        tok,
        requests(),
        layers,
        params,
        editor.projectors(layers, factors, config),
        config,
        progress=False,
        **loop_kwargs,
    )
    return {"training": _untimed(hist.to_json())}, params


def run_case(name: str, model, tok, tmp: Path) -> dict:
    """One case on a copy of ``model``: its training section (untimed), projector and drift figures, weights."""
    import torch

    from crispedit.editing import EditConfig, edit
    from crispedit.editing.steptimer import StepTimer
    from crispedit.weights import parameter

    fields = {**BASE, **CASES[name]}
    how = fields.pop("how", "edit")
    model = copy.deepcopy(model)
    config = EditConfig(**fields)
    if how == "sync_free":
        timer = StepTimer()
        out, params = _direct(model, tok, config, sync_free=True, timer=timer)
        out["timed_steps"] = [len(timer.steps), len(timer.skipped)]
        out["timed_phases"] = sorted({k for row in timer.steps for k in row})
        return {**out, "weights": _digest(params)}
    if how == "resume":  # three epochs, stopped; then resumed under the full cap from its checkpoint
        ckpt = tmp / f"{name}.safetensors"
        first = edit(
            copy.deepcopy(model),
            tok,
            requests(),
            EditConfig(**{**fields, "epochs": 3}),
            progress=False,
            checkpoint=ckpt,
        )
        res = edit(model, tok, requests(), config, progress=False, checkpoint=ckpt)
        out = {"first": _untimed(first.history.to_json())}
    else:
        res, out = edit(model, tok, requests(), config, progress=False), {}
    out.update(
        training=_untimed(res.history.to_json()),
        projector=res.projector_stats,
        kl_predicted=res.kl_predicted,
        drift_budget=res.drift_budget,
    )
    with torch.no_grad():
        out["weights"] = _digest({n: parameter(model, n) for n in res.original_weights})
    return out


def cpu_vendor() -> str:
    """The CPU's vendor (``GenuineIntel``, ``AuthenticAMD``; ``/proc/cpuinfo``'s ``vendor_id``, else what
    :func:`platform.processor` says): math libraries pick their kernels by it."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment() -> dict:
    """Where the float results were computed: they are exact only on the same torch and kind of machine — the
    architecture, the CPU's vendor and the instruction set torch's kernels use (the cases run on one thread,
    whatever the machine has)."""
    import torch

    return {
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpu": cpu_vendor(),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def stored_run(stored: dict, env: dict) -> dict | None:
    """The run of ``stored`` (``loop_runs.json``'s content) made under ``env``, or ``None``."""
    return next((r for r in stored["runs"] if r["environment"] == env), None)


def golden(names=None) -> dict:
    """Every case (or ``names``) run now, under a private curvature cache: ``{"environment", "cases"}``."""
    import torch

    from conftest import build_llama, build_tokenizer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tok = build_tokenizer()
    model = build_llama(len(tok))
    with tempfile.TemporaryDirectory() as d, mock.patch.dict(os.environ, {"CRISPEDIT_CACHE": str(Path(d) / "cache")}):
        try:
            cases = {n: run_case(n, model, tok, Path(d)) for n in (names or CASES)}
        finally:
            torch.set_num_threads(threads)
    return {"environment": environment(), "cases": cases}


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "loop_runs.json"
    run = golden()
    kept = (
        [r for r in json.loads(out.read_text())["runs"] if r["environment"] != run["environment"]]
        if out.exists()
        else []
    )
    out.write_text(json.dumps({"runs": [*kept, run]}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}: the run of {run['environment']} beside {len(kept)} other kind(s)")
