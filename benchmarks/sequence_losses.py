"""How much of an edit's training is spent on sequences it has already learned: every training sequence's own
target loss (nats/target token) after every epoch of a default ``crispedit`` edit, and what the token cost would
be if each epoch trained only the sequences whose loss at the end of the previous epoch was at or above the skip
loss — the bound on what a per-sequence skip rule (instead of the paper's per-batch one) could save, before its
effect on the training is counted.

    python benchmarks/sequence_losses.py --edits ../shared/data/edits/zsre_dev.json:400:32 --json runs/seqloss.json
    python benchmarks/sequence_losses.py --analyse runs/seqloss.json

The per-sequence losses come from a forward over the plain padded batches after each epoch (not timed with the
edit's seconds, but it lengthens the run by about half). Run alone: one model job at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from edit_tokens import slice_arg  # noqa: E402  (same folder)


def sequence_losses(model, batches) -> list[list]:
    """``[batch index, summed target NLL (nats), target tokens, real tokens]`` of every row of ``batches`` (padded
    :class:`~crispedit.data.tokenize.EncodedBatch` es), from one forward of ``model`` without gradients."""
    import torch
    import torch.nn.functional as F

    rows, was = [], model.training
    model.eval()
    with torch.no_grad():
        for i, b in enumerate(batches):
            logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1].float()
            labels = b.labels[:, 1:]
            nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp_min(0), reduction="none")
            mask = (labels != -100).float()
            for r, (s, c) in enumerate(zip((nll * mask).sum(1).tolist(), mask.sum(1).tolist())):
                rows.append([i, s, int(c), int(b.attention_mask[r].sum())])
    model.train(was)
    return rows


def record(model, tokenizer, requests, config) -> dict:
    """Run ``edit`` under ``config`` with the per-sequence losses taken after every epoch: ``{"epochs": [{"mean",
    "rows", "probe_seconds"}], "history": the edit's training summary}``."""
    import crispedit.editing.loop as loop
    from crispedit.editing import edit

    out, sources = {"epochs": []}, []
    real_source, real_end = loop.batch_source, loop._Run.end_epoch

    def source(*a, **k):
        sources.append(real_source(*a, **k))
        return sources[-1]

    def end_epoch(self, hist, losses, *rest):
        mean, values = real_end(self, hist, losses, *rest)  # the hooks' values and the greedy check, as the loop gave
        cfg = self.config
        t0 = time.perf_counter()
        rows = sequence_losses(model, sources[-1].batches)
        out["epochs"].append({"mean": mean, "rows": rows, "probe_seconds": round(time.perf_counter() - t0, 2)})
        print(
            f"epoch {len(out['epochs'])}: loss {mean:.4f}, {sum(r[1] < cfg.skip_loss * r[2] for r in rows)}"
            f"/{len(rows)} sequences below the skip loss",
            flush=True,
        )
        return mean, values

    loop.batch_source, loop._Run.end_epoch = source, end_epoch
    try:
        res = edit(model, tokenizer, requests, config, progress=False)
    finally:
        loop.batch_source, loop._Run.end_epoch = real_source, real_end
    out["history"] = res.history.to_json()
    out["skip_loss"] = config.skip_loss
    return out


def analyse(rec: dict) -> dict:
    """From a :func:`record`: sequences below the skip loss after each epoch, and the token cost of training only
    the sequences at or above it at the previous epoch's end (all of them in the first epoch) over that of
    training every sequence every epoch."""
    epochs, skip = rec["epochs"], rec["skip_loss"]
    full = sum(r[3] for e in epochs for r in e["rows"])
    kept, prev = 0, None
    for e in epochs:
        kept += sum(r[3] for j, r in enumerate(e["rows"]) if prev is None or prev[j][1] >= skip * prev[j][2])
        prev = e["rows"]
    last = sorted((r[1] for r in epochs[-1]["rows"]), reverse=True)
    top = max(1, len(last) // 10)
    return {
        "epochs": len(epochs),
        "sequences": len(epochs[0]["rows"]),
        "below_skip_loss": [sum(r[1] < skip * r[2] for r in e["rows"]) for e in epochs],
        "token_cost_ratio": round(kept / full, 3),
        "last_epoch_loss_share_of_top_tenth": round(sum(last[:top]) / sum(last), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", help="PATH[:OFFSET[:N]] of an edit file")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", help="write the per-epoch per-sequence losses and the analysis here")
    ap.add_argument("--analyse", help="only analyse a file an earlier run wrote with --json")
    args = ap.parse_args()
    if args.analyse:
        print(json.dumps(analyse(json.loads(Path(args.analyse).read_text())), indent=1))
        return
    if not args.edits:
        ap.error("--edits or --analyse is required")
    from crispedit.atomic import atomic_write_json
    from crispedit.data import load_edits
    from crispedit.editing import EditConfig
    from crispedit.models import load_model

    path, offset, n = slice_arg(args.edits)
    model, tok = load_model(args.model)
    rec = record(model, tok, load_edits(path, limit=n, offset=offset), EditConfig(method="crispedit"))
    rec["analysis"] = analyse(rec)
    print(json.dumps(rec["analysis"], indent=1))
    if args.json:
        atomic_write_json(args.json, rec)


if __name__ == "__main__":
    main()
