"""Round-1 retention of sequential crispedit (CrispEdit-Seq) under several settings: each run edits the same slice
in rounds through :func:`crispedit.sessions.sequential.run_sequence` and measures, after every round, the first
round's edits (teacher-forced rel, WILD qa / chat rel — the compare's retention probe), without the compare's
final evaluation, so settings can be tried on a tuning slice in a fraction of a compare row's time.

    python benchmarks/seq_retention.py --edits ../shared/data/edits/zsre_dev.json:2000:500 --chunk 100 \\
        --runs 'contexts=bare|contexts=bare;gamma=0.999;n_cap=30' --json runs/seqret.json

A run is ``k=v;k=v`` of :class:`~crispedit.editing.EditConfig` fields (``method`` defaults to ``crispedit``) and,
prefixed ``seq.``, :class:`~crispedit.editing.SeqConfig` fields (``seq.mix=0.8``, ``seq.weighting=tokens``).
Every run starts from the base weights. Run alone: one model job at a time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from edit_matrix import label, parse_runs  # noqa: E402  (same folder)
from edit_tokens import slice_arg  # noqa: E402


def seq_config(overrides: dict):
    """The :class:`~crispedit.editing.SeqConfig` of one run's overrides (``seq.``-prefixed keys go to the
    SeqConfig, the rest to its EditConfig; ``method`` defaults to ``crispedit``)."""
    from crispedit.editing import EditConfig, SeqConfig

    edit_kw = {"method": "crispedit", **{k: v for k, v in overrides.items() if not k.startswith("seq.")}}
    seq_kw = {k[len("seq."):]: v for k, v in overrides.items() if k.startswith("seq.")}
    return SeqConfig(edit=EditConfig(**edit_kw), **seq_kw)


def run_one(model, tokenizer, requests, overrides: dict, chunk: int) -> dict:
    """One sequential run from the base: ``{"run": label, "config": SeqConfig JSON, "rounds": [{"round", "epochs",
    "seconds", "tf_rel", "qa", "chat"}], "edit_seconds"}``; the model is restored to the base afterwards."""
    from crispedit.editing import restore
    from crispedit.evaluation.edit_eval import retention_probe
    from crispedit.sessions.sequential import run_sequence

    cfg = seq_config(overrides)
    rounds = []

    def report(rec: dict, n_rounds: int) -> None:
        """Keep and print one round's retention line."""
        after = rec.get("after_round") or {}
        row = {"round": rec["round"], "epochs": (rec.get("train") or {}).get("epochs"),
               "seconds": round(rec["edit_seconds"], 1), "tf_rel": after.get("tf_rel"),
               **{k: (after.get("wild") or {}).get(k) for k in ("qa", "chat")}}
        rounds.append(row)
        print(f"  [{label(overrides)}] round {row['round']}/{n_rounds}: {row['epochs']} epochs, {row['seconds']} s; "
              f"round-1 edits tf_rel={row['tf_rel']} qa={row['qa']} chat={row['chat']}", flush=True)

    t0 = time.perf_counter()
    res = run_sequence(model, tokenizer, requests, cfg, chunk, progress=False, on_round=report,
                       after_round=retention_probe(tokenizer, requests[:chunk]))
    restore(model, res.original_weights)
    return {"run": label(overrides), "config": cfg.to_json(), "rounds": rounds,
            "edit_seconds": round(time.perf_counter() - t0, 1)}


def table(results: list[dict]) -> str:
    """Markdown: one line per run and measure, the round-1 fraction after each round."""
    n = max(len(r["rounds"]) for r in results)
    lines = ["| run | measure | " + " | ".join(f"r{i + 1}" for i in range(n)) + " | seconds |",
             "|" + "---|" * (n + 3)]
    for r in results:
        for k in ("tf_rel", "qa", "chat"):
            cells = ["–" if x[k] is None else f"{x[k]:.2f}" for x in r["rounds"]]
            lines.append(f"| {r['run']} | {k} | " + " | ".join(cells + [""] * (n - len(cells)))
                         + f" | {r['edit_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", required=True, help="PATH[:OFFSET[:N]] of an edit file")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--chunk", type=int, default=100, help="edits per round")
    ap.add_argument("--runs", required=True, help="'k=v;k=v|k=v' overrides, one run each")
    ap.add_argument("--json", help="write every run's rounds here (rewritten after each run)")
    args = ap.parse_args()
    from crispedit.data import load_edits
    from crispedit.errors import atomic_write_json
    from crispedit.models import load_model

    path, offset, n = slice_arg(args.edits)
    runs = parse_runs(args.runs)
    for r in runs:
        seq_config(r)                       # a bad key fails before the model loads
    model, tok = load_model(args.model)
    requests = load_edits(path, limit=n, offset=offset)
    results = []
    for r in runs:
        results.append(run_one(model, tok, requests, r, args.chunk))
        if args.json:
            atomic_write_json(args.json, {"edits": {"file": path, "offset": offset, "n": len(requests)},
                                          "chunk": args.chunk, "model": args.model, "runs": results})
    print(table(results))


if __name__ == "__main__":
    main()
