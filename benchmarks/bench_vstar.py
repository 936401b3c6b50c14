"""Speed of the v* optimisation (MEMIT / AlphaEdit target values) with and without its exact shortcut, one run.

    python benchmarks/bench_vstar.py [--blocks 30] [--vstar-block 8] [--requests 8] [--steps 5] [--repeats 2]

``crispedit.editing.keyvalue.target_values`` optimises one ``δ`` per request at the output of the last edit
layer's block. Its shortcut computes everything below that block once and runs only the blocks above it each
step, with the output head on the target rows only; the plain path runs the whole model with ``δ`` added by a
hook. Both run here on the same random SmolLM2-shaped llama (``bench_kfac.build_tiny``: hidden 576, MLP 1536,
vocabulary 49 152; ``--blocks`` blocks), the same bundled requests and MEMIT's 6 templates (bare + 5 generated
prefixes), interleaved ``--repeats`` times. Prints the median seconds of each, their ratio, and the largest
difference between the two ``v*`` (the shortcut is exact up to float rounding).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_kfac import build_tiny
from crispedit.data import BUNDLED_EDITS, bundled_path, load_edits
from crispedit.editing import keyvalue as kv
from crispedit.models import decoder_blocks


def run(model, tok, requests, block, templates, settings, fast: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one :func:`~crispedit.editing.keyvalue.target_values` call with the shortcut on or forced
    off, and its ``v*`` (``N x d_model``)."""
    orig = kv._DeltaForward.__init__

    def plain_init(self, *a, **k):
        """The shortcut's constructor, then the plain forward forced."""
        orig(self, *a, **k)
        self.fast = False

    if not fast:
        kv._DeltaForward.__init__ = plain_init
    try:
        t0 = time.perf_counter()
        V, _ = kv.target_values(model, tok, requests, block, templates, settings)
        return time.perf_counter() - t0, V
    finally:
        kv._DeltaForward.__init__ = orig


def main() -> None:
    """Parse the flags, time both paths interleaved, print the medians and their ratio."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=30)
    ap.add_argument("--vstar-block", type=int, default=8, help="block whose output holds v* (SmolLM2 default: 8)")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = build_tiny(n_layers=args.blocks)
    requests = [r for r in load_edits(bundled_path(BUNDLED_EDITS)) if r.subject][:args.requests]
    _, blocks = decoder_blocks(model)
    block = blocks[args.vstar_block]
    templates = kv.context_templates(model, tok, 5)
    # stop_loss 0: every request runs all steps, so both paths do the same number of steps
    settings = kv.KeyValueSettings(steps=args.steps, stop_loss=0.0, chunk=args.requests)
    times = {True: [], False: []}
    vs = {}
    for _ in range(args.repeats):
        for fast in (True, False):
            sec, vs[fast] = run(model, tok, requests, block, templates, settings, fast)
            times[fast].append(sec)
    f, p = statistics.median(times[True]), statistics.median(times[False])
    diff = float((vs[True] - vs[False]).abs().max())
    print(f"v* of {len(requests)} requests x {len(templates)} templates, {args.steps} steps, block {args.vstar_block} "
          f"of {args.blocks}: shortcut {f:.2f}s, plain {p:.2f}s, ratio {f / p:.2f} (max |v* difference| {diff:.2e})")


if __name__ == "__main__":
    main()
