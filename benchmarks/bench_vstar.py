"""Speed of the v* optimisation (MEMIT / AlphaEdit target values) under each of its exact forwards, one run.

    python benchmarks/bench_vstar.py [--model smollm2] [--edits PATH[:OFFSET[:N]]] [--vstar-block 8]
        [--chunk 8] [--steps 4] [--repeats 2] [--modes suffix,packed,cached,plain] [--json FILE]

``crispedit.editing.keyvalue.target_values`` optimises one ``δ`` per request at the output of the last edit
layer's block. Its forwards, each exact (the same ``v*`` up to float rounding):

* ``plain``: the whole model with ``δ`` added by a hook;
* ``cached``: everything below the ``v*`` block computed once, only the blocks above it run each step, the
  output head on the target rows only;
* ``packed``: ``cached``, with rows that share beginnings (a template's prefix across a chunk's requests) run
  once as prefix trees;
* ``suffix``: ``cached``, with each row's positions before its ``δ`` computed once (their keys and values
  cached) and only the positions from ``δ`` on run each step — the default where the model allows it.

Each mode runs ``target_values`` on the same requests and MEMIT's 6 templates (bare + 5 prefixes the model
writes), every request for exactly ``--steps`` steps (stop loss 0), interleaved ``--repeats`` times. Prints the
median seconds per request-step of each mode, its ratio to ``plain`` and to ``packed``, and the largest
difference of its ``v*`` from ``plain``'s. ``--model tiny`` uses a random SmolLM2-shaped llama of
``--blocks`` blocks (``bench_kfac.build_tiny``) instead of a real model.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

MODES = ("suffix", "packed", "cached", "plain")


@contextlib.contextmanager
def forced(mode: str):
    """Within: every ``_DeltaForward`` uses ``mode``'s forward (or the plainer one it falls back to)."""
    from crispedit.editing import keyvalue as kv
    from crispedit.editing.fastpath import prefix_sharing

    orig = kv._DeltaForward.__init__

    def init(self, *a, **k):
        """The constructor, then the modes above ``mode`` switched off."""
        orig(self, *a, **k)
        if mode == "plain":
            self.fast = False
        if mode in ("cached", "plain"):
            self.packed = None

    kv._DeltaForward.__init__ = init
    try:
        with kv.suffix_steps(mode == "suffix"), prefix_sharing(mode in ("suffix", "packed")):
            yield
    finally:
        kv._DeltaForward.__init__ = orig


def main(argv=None) -> dict:
    """Parse the flags, time every mode interleaved, print the medians and ratios; returns the figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="a model spec, or 'tiny' (random SmolLM2-shaped llama)")
    ap.add_argument("--blocks", type=int, default=30, help="blocks of --model tiny")
    ap.add_argument("--edits", default=None, metavar="PATH[:OFFSET[:N]]", help="default: the bundled edits")
    ap.add_argument("--vstar-block", type=int, default=8, help="block whose output holds v* (SmolLM2 default: 8)")
    ap.add_argument("--chunk", type=int, default=8, help="requests per forward (KeyValueSettings.chunk)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from crispedit.atomic import atomic_write_json
    from crispedit.data import BUNDLED_EDITS, bundled_path, load_edits
    from crispedit.editing import keyvalue as kv
    from crispedit.layers import decoder_blocks

    if args.model == "tiny":
        from bench_kfac import build_tiny

        model, tok = build_tiny(n_layers=args.blocks)
    else:
        from crispedit.models import load_model

        model, tok = load_model(args.model)
    path, *rest = (args.edits or str(bundled_path(BUNDLED_EDITS))).split(":")
    offset = int(rest[0]) if rest else 0
    requests = [r for r in load_edits(path)[offset:] if r.subject][: args.requests]
    _, blocks = decoder_blocks(model)
    block = blocks[args.vstar_block]
    templates = kv.context_templates(model, tok, 5)
    settings = kv.KeyValueSettings(steps=args.steps, stop_loss=0.0, chunk=args.chunk)
    modes = [m for m in args.modes.split(",") if m]
    times: dict[str, list[float]] = {m: [] for m in modes}
    vs: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for m in modes:
            with forced(m):
                t0 = time.perf_counter()
                vs[m], _ = kv.target_values(model, tok, requests, block, templates, settings)
                times[m].append(time.perf_counter() - t0)
    per = {m: statistics.median(times[m]) / (len(requests) * args.steps) for m in modes}
    ref = vs.get("plain", vs[modes[-1]])
    out = {
        "model": args.model,
        "edits": path,
        "offset": offset,
        "requests": len(requests),
        "steps": args.steps,
        "chunk": args.chunk,
        "templates": len(templates),
        "vstar_block": args.vstar_block,
        "seconds_per_request_step": per,
        "max_abs_vstar_difference": {m: float((vs[m] - ref).abs().max()) for m in modes},
        "vstar_norm": float(ref.norm(dim=1).mean()),
    }
    print(
        f"v* of {len(requests)} requests x {len(templates)} templates, {args.steps} steps, chunks of {args.chunk}, "
        f"block {args.vstar_block} ({Path(path).name}):"
    )
    for m in modes:
        ratios = "".join(f", {per[m] / per[r]:.2f}x {r}" for r in ("plain", "packed") if r in per and r != m)
        print(
            f"  {m:7s} {per[m]:.3f} s per request-step{ratios} (max |v* - plain| "
            f"{out['max_abs_vstar_difference'][m]:.1e}, mean |v*| {out['vstar_norm']:.1f})"
        )
    if args.json:
        atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
