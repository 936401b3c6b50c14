"""CUDA path check: a bf16 (or fp32) model on a GPU, K-FAC statistics and projections in fp32+.

Runs the whole edit pipeline — capability K-FAC collection, projector build, projected training,
teacher-forced scores, KL drift — on ``--device`` and checks the dtype contract: trained weights keep
the model dtype, factors are float32 or better, projectors are float32 or better. Prints the timings
of each phase (CUDA-synchronised).

    python benchmarks/gpu_check.py --model smollm2 --device cuda --dtype bfloat16

``--random-init DIR`` builds the architecture of the model directory ``DIR`` (its config.json and
tokenizer) with random weights instead of loading them: for machines where the weights cannot be
copied. Quality figures are then meaningless; the dtype checks and timings are not.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from crispedit.data import load_edits
from crispedit.data.corpus import BUNDLED_EDITS, bundled_path, heldout_text
from crispedit.editing import EditConfig, edit
from crispedit.editing.api import capability_factors
from crispedit.evaluation import edit_scores, kl_drift, summarize_edit_scores
from crispedit.layers import resolve_layers
from crispedit.models import load_model


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _load(args):
    if not args.random_init:
        return load_model(args.model, dtype=args.dtype, device=args.device)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(args.random_init)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    tok = AutoTokenizer.from_pretrained(args.random_init)
    return load_model((model, tok), device=args.device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random-init", default=None, metavar="DIR")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n-edits", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--n-cap", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    model, tok = _load(args)
    dev = str(next(model.parameters()).device)
    requests = load_edits(bundled_path(BUNDLED_EDITS), limit=args.n_edits)
    cfg = EditConfig(method="crispedit", epochs=args.epochs, n_cap=args.n_cap)
    layers = resolve_layers(model, cfg.layers)
    row: dict = {
        "device": dev,
        "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else None,
        "dtype": args.dtype,
        "random_init": bool(args.random_init),
        "load_s": round(time.perf_counter() - t0, 2),
    }

    with tempfile.TemporaryDirectory() as cache:
        _sync(dev)
        t = time.perf_counter()
        factors, _ = capability_factors(model, tok, layers, cfg, cache_root=cache, progress=False)
        _sync(dev)
        row["kfac_s"] = round(time.perf_counter() - t, 2)
        row["factor_dtypes"] = sorted({str(f.dtype) for f in list(factors.A.values()) + list(factors.S.values())})
        t = time.perf_counter()
        res = edit(model, tok, requests, cfg, factors=factors, progress=False)
        _sync(dev)
        row["edit_s"] = round(time.perf_counter() - t, 2)
    row["epochs"] = len(res.history.epoch_loss)
    row["s_per_epoch"] = round(res.edit_seconds / max(row["epochs"], 1), 4)
    row["final_loss"] = round(res.history.epoch_loss[-1], 5)
    row["fast_loss"] = res.history.fast_loss
    params = {n: m.weight for n, m in layers.items()}
    row["trained_dtypes"] = sorted({str(p.dtype) for p in params.values()})
    row["trained_devices"] = sorted({str(p.device) for p in params.values()})
    row["kept_fraction_min"] = min(v["kept_fraction"] for v in res.projector_stats.values())
    t = time.perf_counter()
    row.update({k: v for k, v in summarize_edit_scores(edit_scores(model, tok, requests)).items() if v is not None})
    row.update(kl_drift(model, tok, heldout_text(None, 32), base_weights=res.original_weights))
    _sync(dev)
    row["eval_s"] = round(time.perf_counter() - t, 2)
    row["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.startswith("cuda") else None

    ok_factors = all(d in ("torch.float32", "torch.float64") for d in row["factor_dtypes"])
    ok_weights = row["trained_dtypes"] == [str(getattr(torch, args.dtype))]
    row["dtype_contract_ok"] = ok_factors and ok_weights
    print(json.dumps(row, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)
    if not row["dtype_contract_ok"]:
        raise SystemExit("dtype contract violated")


if __name__ == "__main__":
    main()
