"""Speed of crispedit's lm-eval scoring with and without its context shortcuts, one run.

    python benchmarks/bench_capabilities.py [--model smollm2] [--task truthfulqa_mc2] [--limit 60] [--repeats 2]
        [--bench-dir ../shared/data/benchmarks] [--json FILE]

``crispedit.evaluation.capabilities`` scores a multiple-choice item's answer choices on one KV cache of its
context. Two shortcuts make that cache cheaper: the context's forward keeps logits for its last position only
(``forward_args.last_logits_only``), and a context built on the cache of the beginning it shares with the last context
run in full (a task's fixed preamble runs once). The plain path here turns both off: every context runs in full,
with logits at every position. Both run on the same model and items, interleaved ``--repeats`` times. Prints the
median seconds of each, their ratio, the scores, and the largest difference between the two paths' item values.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import crispedit.evaluation.capabilities as C
import crispedit.evaluation.harness_lm as H
from crispedit.atomic import atomic_write_json
from crispedit.models import load_model


def run(model, tok, task: str, limit: int, bench_dir: str, shortcuts: bool) -> tuple[float, float, list[float]]:
    """Seconds of one :func:`~crispedit.evaluation.capabilities.run_capabilities` call for ``task`` on ``limit``
    items with the context shortcuts on or off, its score and its per-item values."""
    orig = H._ContextCaches.__init__

    def plain_init(self, *a, **k):
        """The caches' constructor, then both shortcuts off: every context in full, logits at every position."""
        orig(self, *a, **k)
        self.head, self.reuse = {}, False

    if not shortcuts:
        H._ContextCaches.__init__ = plain_init
    try:
        t0 = time.perf_counter()
        res = C.run_capabilities(model, tok, [task], limit=limit, bench_dir=bench_dir, progress=False)[task]
        return time.perf_counter() - t0, res["score"], res["items"]
    finally:
        H._ContextCaches.__init__ = orig


def main() -> None:
    """Parse the flags, time both paths interleaved, print the medians, their ratio and the item difference."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="truthfulqa_mc2", help="a task name of crispedit.evaluation.capabilities")
    ap.add_argument("--limit", type=int, default=60, help="items (for MMLU: per subject)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--bench-dir", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/benchmarks"))
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    task = C.parse_tasks(args.task)[0]
    model, tok = load_model(args.model)
    model.eval()
    secs: dict[str, list[float]] = {"plain": [], "shortcuts": []}
    out: dict[str, tuple[float, list[float]]] = {}
    for _ in range(args.repeats):
        for label in secs:
            s, score, items = run(model, tok, task, args.limit, args.bench_dir, label == "shortcuts")
            secs[label].append(s)
            out[label] = (score, items)
            print(f"{label:10s} {s:8.1f} s  score {score:.4f}", flush=True)
    med = {k: statistics.median(v) for k, v in secs.items()}
    diff = max((abs(a - b) for a, b in zip(out["plain"][1], out["shortcuts"][1])), default=0.0)
    print(
        f"{task}, {args.limit} items: plain {med['plain']:.1f} s, shortcuts {med['shortcuts']:.1f} s "
        f"(ratio {med['shortcuts'] / med['plain']:.2f}); largest item difference {diff:.2e}"
    )
    if args.json:
        atomic_write_json(
            args.json,
            {
                "task": task,
                "limit": args.limit,
                "model": args.model,
                "seconds": secs,
                "median": med,
                "ratio": med["shortcuts"] / med["plain"],
                "scores": {k: v[0] for k, v in out.items()},
                "max_item_difference": diff,
            },
        )


if __name__ == "__main__":
    main()
