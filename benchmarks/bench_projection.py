"""Projection overhead per edit step, relative to a plain FT step (same model, same batch, one run).

    python benchmarks/bench_projection.py [--model smollm2] [--batch 32] [--repeats 5]

Each repeat times one full step (forward, backward, projection, Adam) for ft, crispedit (gradient
projection) and crispedit (update projection), interleaved so machine noise hits all alike; the
medians and their ratios to ft are printed, with the full config and environment as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from crispedit.data import BUNDLED_EDITS, bundled_path, load_edits
from crispedit.data.tokenize import encode_pairs
from crispedit.editing import EditConfig, capability_factors, get_editor
from crispedit.editing.loop import apply_projection, edit_loss
from crispedit.models import load_model, resolve_layers
from crispedit.pipeline import environment


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-cap", type=int, default=64)
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    model, tok = load_model(args.model, device=args.device)
    device = next(model.parameters()).device
    layers = resolve_layers(model, None)
    cfg = EditConfig(n_cap=args.n_cap)
    factors, info = capability_factors(model, tok, layers, cfg, progress=False)
    reqs = (load_edits(bundled_path(BUNDLED_EDITS)) * 4)[: args.batch]
    batch = encode_pairs(tok, [r.prompt for r in reqs], [r.target for r in reqs]).to(device)
    params = {n: m.weight for n, m in layers.items()}
    for p in model.parameters():
        p.requires_grad_(False)
    for p in params.values():
        p.requires_grad_(True)
    projs = {"ft": get_editor("ft").projectors(layers, None, cfg),
             "crispedit": {n: p.to(device) for n, p in get_editor("crispedit").projectors(layers, factors, cfg).items()}}
    originals = {n: p.detach().clone() for n, p in params.items()}

    def step(kind: str) -> float:
        opt = torch.optim.Adam(params.values(), lr=5e-4)
        method, target = kind.split("/")
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = edit_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            before = {n: p.detach().float().clone() for n, p in params.items()} if target == "update" else None
            if target == "gradient":
                for n, p in params.items():
                    p.grad.copy_(apply_projection(projs[method][n], layers[n], p.grad))
            opt.step()
            if before is not None:
                for n, p in params.items():
                    p.copy_(before[n] + apply_projection(projs[method][n], layers[n], p.detach().float() - before[n]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(originals[n])
        return dt

    kinds = ["ft/gradient", "crispedit/gradient", "crispedit/update"]
    for k in kinds:  # warm-up
        step(k)
    times = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for k in kinds:
            times[k].append(step(k))
    med = {k: statistics.median(v) for k, v in times.items()}
    # the projection alone, for the record
    t0 = time.perf_counter()
    for n, p in params.items():
        apply_projection(projs["crispedit"][n], layers[n], torch.randn_like(p))
    proj_only = time.perf_counter() - t0
    print(f"model={args.model} layers={len(layers)} batch={args.batch} tokens={int(batch.attention_mask.sum())} device={device}")
    for k in kinds:
        print(f"{k:20} median step {med[k] * 1000:8.1f} ms   ratio to ft {med[k] / med['ft/gradient']:.3f}")
    print(f"projection of all {len(layers)} layers alone: {proj_only * 1000:.1f} ms")
    print(json.dumps({"args": vars(args), "median_seconds": med, "ratio_to_ft": {k: med[k] / med["ft/gradient"] for k in kinds},
                      "projection_only_seconds": proj_only, "environment": environment()}))


if __name__ == "__main__":
    main()
