"""Projection overhead per edit step, relative to a plain FT step (same model, same batch, one run).

    python benchmarks/bench_projection.py [--model smollm2] [--batch 32] [--repeats 5]

Each repeat times one full step (forward, backward, projection, Adam) for ft, crispedit (gradient
projection; each layer's projector in the form it picks, see ``--form``) and crispedit (update
projection), interleaved so machine noise hits all alike; the medians and their ratios to ft are
printed with each layer's masked corner, with the full config and environment as JSON.

    python benchmarks/bench_projection.py --flops [--decays 0.5,1,1.5,2] [--gamma 0.8] [--cache FILE --layer NAME]

No model: the projector's cost at Llama-3-8B ``down_proj`` shapes (``d_out`` 4096, ``d_in`` 14336) against
an analytic count of one fwd+bwd edit step (``--edits`` x ``--tokens`` tokens through ``--blocks``
blocks; hidden 4096, intermediate 14336, 32 heads / 8 KV heads, vocabulary 128256), for factors whose
eigenvalues follow power laws ``k^-decay`` (or, with ``--cache``, the spectrum of a real layer's factors
rescaled to these sizes), then a one-layer timing of the full against the low-rank form at
``--time-shape``.
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
from crispedit.projection import (KroneckerProjector, energy_keep_mask, kronecker_projection_flops, masked_corner,
                                  row_extents, staircase_projection_flops)

# Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B)
LLAMA3_8B = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256)


def llama_step_flops(n_seq: int, seq_len: int, blocks: int, *, hidden: int, inter: int, heads: int, kv_heads: int,
                     vocab: int, edited: int) -> dict:
    """FLOPs (a multiply-add counts 2) of one edit step of a Llama block stack: forward of ``blocks`` blocks
    on ``n_seq`` sequences of ``seq_len`` tokens, and the backward an edit runs with every weight frozen but
    ``edited`` ``down_proj`` matrices (``hidden x inter``): activation gradients through every block above
    the lowest (the lowest edited ``down_proj`` is its block's last matmul, so nothing below it is
    differentiated) plus the edited weights' gradients. Attention scores and values are counted over the
    full ``seq_len x seq_len`` square (an upper bound for causal kernels; < 0.1 % of the total here).
    ``head`` is the LM head's forward plus its input gradient (the fast path runs it on every step)."""
    tokens = n_seq * seq_len
    kv = hidden * kv_heads // heads
    matmul = 2 * tokens * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter)  # q, o, k, v; gate, up, down
    attn = 2 * 2 * n_seq * seq_len * seq_len * hidden                              # Q K^T and A V, all heads
    fwd = blocks * (matmul + attn)
    bwd = (blocks - 1) * (matmul + 2 * attn) + edited * 2 * tokens * hidden * inter
    head = 2 * 2 * tokens * hidden * vocab
    return {"tokens": tokens, "forward": fwd, "backward": bwd, "step": fwd + bwd, "head": head}


def power_law(n: int, decay: float) -> torch.Tensor:
    """``k^-decay`` for ``k = 1..n`` (float64, decreasing)."""
    return torch.arange(1, n + 1, dtype=torch.float64) ** -decay


def rescaled(lam: torch.Tensor, n: int) -> torch.Tensor:
    """A decreasing spectrum of any length resampled to ``n`` values: ``log lambda`` interpolated at the
    same fractional ranks ``(k + 1/2) / n`` (float64, decreasing)."""
    import numpy as np

    lam = lam.to(torch.float64).sort(descending=True).values
    lam = lam.clamp_min(float(lam[0]) * 1e-30)
    src = (np.arange(len(lam)) + 0.5) / len(lam)
    dst = (np.arange(n) + 0.5) / n
    return torch.from_numpy(np.exp(np.interp(dst, src, np.log(lam.numpy()))))


def _spectra(args, d_out: int, d_in: int) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(label, lambda_out, lambda_in)`` for every spectrum asked for, at ``d_out`` / ``d_in`` values."""
    out = [(f"power {d:g}", power_law(d_out, d), power_law(d_in, d)) for d in args.decays]
    if args.cache:
        from crispedit.curvature.cache import load_factors
        from crispedit.projection import eigh_psd

        f = load_factors(args.cache)
        name = args.layer or f.layers[len(f.layers) // 2]
        lam_in, lam_out = eigh_psd(f.A[name])[0], eigh_psd(f.S[name])[0]
        out.append((f"cache {name}", rescaled(lam_out, d_out), rescaled(lam_in, d_in)))
    return out


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flops_main(args) -> None:
    """``--flops``: projector FLOPs at Llama-3-8B down_proj shapes vs an analytic edit step, then a one-layer
    timing of both forms at ``--time-shape`` (see the module docstring)."""
    d_out, d_in = LLAMA3_8B["hidden"], LLAMA3_8B["inter"]
    step = llama_step_flops(args.edits, args.tokens, args.blocks, edited=args.blocks, **LLAMA3_8B)
    print(f"Llama-3-8B edit step: {args.edits} edits x {args.tokens} tokens through {args.blocks} blocks, "
          f"{args.blocks} down_proj ({d_out}x{d_in}) trained: fwd {step['forward'] / 1e12:.3f} + bwd "
          f"{step['backward'] / 1e12:.3f} = {step['step'] / 1e12:.3f} TFLOP (LM head fwd+bwd {step['head'] / 1e12:.3f} more)")
    full_one = kronecker_projection_flops(d_out, d_in, d_out, d_in)[1]
    print(f"full projector: {full_one / 1e12:.3f} TFLOP per layer, x{args.blocks} = "
          f"{args.blocks * full_one / step['step']:.2f} x the step; gamma={args.gamma}")
    rows = []
    print(f"{'spectrum':24} {'masked':>8} {'r_out':>6} {'r_in':>6} {'split':>6} {'form':>8} {'1-corner':>9} "
          f"{'low/full':>9} {'TFLOP/layer':>11} {'proj/step':>10} {'w/ head':>8}")
    for label, lo, li in _spectra(args, d_out, d_in):
        keep = energy_keep_mask(torch.outer(lo, li), args.gamma)
        r_out, r_in = masked_corner(keep)
        one_corner = kronecker_projection_flops(d_out, d_in, r_out, r_in)[0]
        low, full, split = staircase_projection_flops(d_out, d_in, row_extents(keep))
        used = min(low, full)
        row = {"spectrum": label, "masked_fraction": 1 - float(keep.double().mean()), "r_out": r_out, "r_in": r_in,
               "split": split, "one_corner_ratio": one_corner / full,
               "form": "low_rank" if low < full else "full", "flop_ratio": low / full, "tflop_per_layer": used / 1e12,
               "proj_over_step": args.blocks * used / step["step"],
               "proj_over_step_with_head": args.blocks * used / (step["step"] + step["head"])}
        rows.append(row)
        print(f"{label:24} {row['masked_fraction']:8.3g} {r_out:6d} {r_in:6d} {split:6d} {row['form']:>8} "
              f"{row['one_corner_ratio']:9.4f} {row['flop_ratio']:9.4f} "
              f"{row['tflop_per_layer']:11.4f} {row['proj_over_step']:10.4f} {row['proj_over_step_with_head']:8.4f}")
        del keep
    # one layer, timed: both forms on the same projector (random orthogonal eigenbases, the same spectra)
    t_out, t_in = args.time_shape
    g = torch.Generator().manual_seed(0)
    U_out = torch.linalg.qr(torch.randn(t_out, t_out, generator=g))[0]
    U_in = torch.linalg.qr(torch.randn(t_in, t_in, generator=g))[0]
    Q = torch.randn(t_out, t_in, generator=g)
    timings = []
    print(f"one {t_out}x{t_in} layer, float32, {torch.get_num_threads()} thread(s), median of {args.repeats}:")
    for label, lo, li in _spectra(args, t_out, t_in):
        keep = energy_keep_mask(torch.outer(lo, li), args.gamma)
        full = KroneckerProjector(U_out, U_in, keep, form="full")
        auto = KroneckerProjector(U_out, U_in, keep)
        err = float((auto.project(Q) - full.project(Q)).abs().max() / Q.abs().max())
        tf, ta = _median_seconds(lambda: full.project(Q), args.repeats), _median_seconds(lambda: auto.project(Q), args.repeats)
        timings.append({"spectrum": label, **auto.stats(), "full_ms": tf * 1e3, "auto_ms": ta * 1e3,
                        "speedup": tf / ta if ta > 0 else float("inf"), "max_rel_diff": err})
        t = timings[-1]
        print(f"  {label:24} r_out={auto.r_out:5d} r_in={auto.r_in:5d} form={t['form']:8} full {t['full_ms']:8.2f} ms  "
              f"chosen {t['auto_ms']:8.2f} ms  (x{t['speedup']:.1f}; flop ratio {t['flop_ratio']:.4f}; max |diff| "
              f"{err:.1e} of max |Q|)")
    print(json.dumps({"args": {k: v for k, v in vars(args).items()}, "step_flops": step, "rows": rows,
                      "timings": timings, "environment": environment()}))


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _shape(text: str) -> tuple[int, int]:
    a, _, b = text.lower().partition("x")
    return int(a), int(b)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n-cap", type=int, default=64)
    ap.add_argument("--device", default=None)
    ap.add_argument("--form", choices=["auto", "full"], default="auto",
                    help="projector form of the crispedit rows (auto: the cheaper of low-rank and full per layer)")
    fl = ap.add_argument_group("--flops: Llama-3-8B shapes, no model")
    fl.add_argument("--flops", action="store_true", help="projector FLOPs vs an analytic edit step, one-layer timing")
    fl.add_argument("--gamma", type=float, default=0.8)
    fl.add_argument("--decays", type=_floats, default=[0.5, 1.0, 1.5, 2.0], help="power-law exponents of both spectra")
    fl.add_argument("--cache", default=None, help="also the spectrum of a real factor file, rescaled")
    fl.add_argument("--layer", default=None, help="layer of --cache (default: the middle one)")
    fl.add_argument("--edits", type=int, default=32)
    fl.add_argument("--tokens", type=int, default=30, help="tokens per edit sequence")
    fl.add_argument("--blocks", type=int, default=5, help="blocks run per step = edited down_proj layers")
    fl.add_argument("--time-shape", type=_shape, default=(512, 1792), help="d_outxd_in of the timed layer")
    args = ap.parse_args()
    if args.flops:
        return flops_main(args)
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
    if args.form == "full":
        projs["crispedit"] = {n: KroneckerProjector(p.U_out, p.U_in, p.mask, form="full") for n, p in projs["crispedit"].items()}
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
    stats = {n: p.stats() for n, p in projs["crispedit"].items()}
    for n, st in stats.items():
        print(f"  {n}: kept {st['kept_fraction']:.4f} r_out={st['r_out']} r_in={st['r_in']} form={st['form']} "
              f"flop ratio {st['flop_ratio']:.4f}")
    print(json.dumps({"args": vars(args), "median_seconds": med, "ratio_to_ft": {k: med[k] / med["ft/gradient"] for k in kinds},
                      "projection_only_seconds": proj_only, "projectors": stats, "environment": environment()}))


if __name__ == "__main__":
    main()
