"""Edit-quality matrix on one model and one edit set: methods x label modes x projection targets.

Loads the model once, runs each configuration from the same base weights (restored between runs),
and prints rel / gen / kl_drift / epochs / seconds, plus a JSON with the full configs and environment.

    python benchmarks/edit_matrix.py --edits ../shared/data/edits/zsre_dev.json --offset 100 --n-edits 32 \
        --epochs 100 --out runs/edit_matrix.json
"""

from __future__ import annotations

import argparse
import json
import time

from crispedit.data import load_edits
from crispedit.editing import EditConfig, edit, restore
from crispedit.errors import atomic_write_json
from crispedit.models import load_model
from crispedit.pipeline import environment, evaluate_edit

DEFAULT_RUNS = [
    ("crispedit", "sampled", "gradient"),
    ("ft", "sampled", "gradient"),
    ("adam-nscl", "sampled", "gradient"),
    ("crispedit", "empirical", "gradient"),
    ("crispedit", "sampled", "update"),
    ("adam-nscl", "sampled", "update"),
    # a second gamma for both projection targets: compares gradient vs update projection at equal drift
    ("crispedit", "sampled", "gradient", 0.95),
    ("crispedit", "sampled", "update", 0.95),
    ("crispedit", "sampled", "gradient", 0.6),
    ("crispedit", "sampled", "update", 0.6),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--edits", required=True)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--n-edits", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--n-cap", type=int, default=64)
    ap.add_argument("--layers", default=None)
    ap.add_argument("--runs", default=None, help="comma list of method:labels:target[:gamma], e.g. crispedit:sampled:gradient:0.9")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = DEFAULT_RUNS if not args.runs else [tuple(r.split(":")) for r in args.runs.split(",")]
    runs = [(r[0], r[1], r[2], float(r[3]) if len(r) > 3 else args.gamma) for r in runs]
    requests = load_edits(args.edits, limit=args.n_edits, offset=args.offset)
    model, tok = load_model(args.model)
    results = []
    print(f"{'method':10} {'labels':9} {'proj':8} {'gamma':>5} {'rel':>6} {'gen':>6} {'kl_drift':>10} {'ppl':>8} {'epochs':>6} {'edit_s':>7} {'kept':>6}")
    for method, labels, target, gamma in runs:
        cfg = EditConfig(method=method, gamma=gamma, epochs=args.epochs, n_cap=args.n_cap, label_mode=labels,
                         projection_target=target, layers=args.layers)
        t0 = time.perf_counter()
        res = edit(model, tok, requests, cfg, progress=False)
        summary, _ = evaluate_edit(model, tok, requests, res, progress=False)
        restore(model, res.original_weights)
        kept = min(v["kept_fraction"] for v in res.projector_stats.values())
        row = {"method": method, "label_mode": labels, "projection_target": target, "gamma": gamma, **summary,
               "epochs": len(res.history.epoch_loss), "converged": res.history.converged,
               "edit_seconds": round(res.edit_seconds, 2), "cache_seconds": round(res.cache_seconds, 2),
               "min_kept_fraction": kept, "total_seconds": round(time.perf_counter() - t0, 2), "config": cfg.to_json()}
        results.append(row)
        print(f"{method:10} {labels:9} {target:8} {gamma:5.2f} {summary['rel']:6.3f} {summary['gen']:6.3f} {summary['kl_drift']:10.6f} "
              f"{summary['ppl']:8.3f} {row['epochs']:6d} {row['edit_seconds']:7.1f} {kept:6.3f}", flush=True)
        if args.out:  # rewritten after every run: an interrupted matrix keeps the rows it finished
            atomic_write_json(args.out, {"args": vars(args), "environment": environment(), "results": results,
                                         "complete": len(results) == len(runs)})
    if args.out:
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
