"""Where the seconds of one edit go: a session fed one correction at a time, each round timed by phase.

A session is created on the model (its capability curvature read from the cache when there), then ``--rounds``
rounds of one edit each are added in this process — as the playground and a running service add them, the model
loaded once — and every round is split into the phases its record holds:

    python benchmarks/edit_latency.py --edits ../shared/data/edits/zsre_dev.json:1000:3 --json runs/latency.json

``load`` (model and tokenizer, once), then per round: ``batches`` (the training sequences, the lead-ins the model
writes), ``keep`` (the preservation term's answers and their starting losses), ``train`` (the projected loop's
epochs), ``factors`` (the round's edit factors for the next rounds' constraint), ``other`` (the rest of the
round: projectors, predicted drift, the commit) and ``evaluate`` (teacher-forced reliability of every edit so far
and the KL drift from the base on held-out text). ``--target`` (seconds) is the latency goal; the script prints
each round's wall time over it, measured in this run. ``--set`` runs every round under other settings
(``keep_chat=0``: :class:`~crispedit.editing.EditConfig` fields; ``seq.kl_texts=4``: the session's).
``--evaluate`` then measures what the rounds left, on the final model over every round's edits: WILD free
generation, the assistant's style drift and subject bleed, and the KL drift from the base
(:class:`~crispedit.pipeline.Measures`' defaults) — so a setting that saves seconds shows what it costs.
Run alone: one model job at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from edit_tokens import slice_arg  # noqa: E402  (same folder)
from seq_retention import seq_config  # noqa: E402

PHASES = ("batches", "keep", "train", "factors", "other", "evaluate")


def phases(rec: dict) -> dict:
    """Seconds of each of :data:`PHASES` in one round record (:meth:`~crispedit.sessions.Session.add`'s), and
    ``total``."""
    train = rec.get("train") or {}
    setup = train.get("setup_seconds") or {}
    out = {
        "batches": setup.get("batches", 0.0),
        "keep": setup.get("keep", 0.0),
        "train": train.get("seconds", 0.0) - sum(setup.values()),
        "factors": rec.get("edit_factor_seconds", 0.0),
        "evaluate": rec.get("evaluate_seconds", 0.0),
    }
    out["other"] = rec.get("edit_seconds", 0.0) - out["batches"] - out["keep"] - out["train"] - out["factors"]
    out["total"] = rec.get("edit_seconds", 0.0) + out["evaluate"]
    return {k: round(v, 3) for k, v in out.items()}


def parse_set(text: str) -> dict:
    """``k=v;k=v`` to a dict of Python values (numbers, booleans, ``None`` or strings)."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = None if value.strip() == "None" else value.strip()
    return out


def _final_measures(session, requests, config) -> dict:
    """The final model's :class:`~crispedit.pipeline.Measures` (WILD under every wrapper, style drift, subject
    bleed, KL drift) over ``requests`` against the session's base: the evaluation summary and its seconds."""
    from crispedit.pipeline import EditJob, Measures

    t = time.perf_counter()
    model, tok, _ = session.model_at_commit()
    ev = EditJob(model, tok, requests, config.edit, Measures(kl_texts=config.kl_texts), False).evaluate(
        session.base_weights
    )
    s, style, bleed = ev["summary"], ev["assistant"]["style"], ev["assistant"]["bleed"]
    summary = {
        "n_edits": len(requests),
        "tf_rel": s["rel"],
        **{
            f"wild_{w}_{k}": ev["wild"][w][k]
            for w in ev["wild"]
            if isinstance(ev["wild"][w], dict)
            for k in ("rel", "gen")
        },
        "style_length_ratio": style["length_ratio"],
        "style_bare_share": style["bare_share"],
        "answer_kl": style["answer_kl"],
        "bleed_target": bleed["target"],
        "bleed_changed": bleed["changed"],
        "kl_drift": s["kl_drift"],
        "ppl": s["ppl"],
        "ppl_base": s["ppl_base"],
    }
    print("final: " + "  ".join(f"{k} {v}" for k, v in summary.items()), flush=True)
    return {"summary": summary, "seconds": round(time.perf_counter() - t, 3)}


def main(argv: list[str] | None = None) -> dict:
    """Run the rounds and print the phase table; returns (and with ``--json`` writes) ``{"load_seconds",
    "rounds": [{"round", "phases", "epochs", "steps"}], "mean": phase means, "target", "over_target"}`` and, with
    ``--evaluate``, ``"final": {"summary", "seconds"}``."""
    from crispedit.atomic import atomic_write_json
    from crispedit.data import load_edits
    from crispedit.models import load_model
    from crispedit.sessions.session import Session
    from crispedit.versions import stamped

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument(
        "--edits",
        type=slice_arg,
        default=slice_arg("../shared/data/edits/zsre_dev.json:1000:3"),
        help="FILE:OFFSET:N — one edit per round",
    )
    ap.add_argument("--set", default="", help="k=v;k=v settings of the session (EditConfig fields, seq.<field>)")
    ap.add_argument("--target", type=float, default=10.0, help="latency goal of one round, seconds")
    ap.add_argument(
        "--evaluate",
        action="store_true",
        help="after the rounds, WILD, style drift, subject bleed and KL drift of the final model over every edit",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    path, offset, n = args.edits
    requests = load_edits(path, limit=n, offset=offset)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)[:2]
    load = time.perf_counter() - t0
    config = seq_config(parse_set(args.set))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        session = Session.create(Path(tmp) / "s", (model, tok), config, progress=False)
        for r in requests:
            t = time.perf_counter()
            rec = session.add([r], progress=False, plot=False)
            wall = time.perf_counter() - t
            ph = phases(rec)
            rows.append(
                {
                    "round": rec["round"],
                    "phases": ph,
                    "wall": round(wall, 3),
                    "epochs": rec["train"]["epochs"],
                    "steps": rec["train"]["steps"],
                    "kl_drift": rec.get("kl_drift"),
                }
            )
            print(
                f"round {rec['round']}: {wall:6.1f} s wall = "
                + "  ".join(f"{k} {ph[k]:.1f}" for k in PHASES)
                + f"  ({rec['train']['epochs']} epochs, {rec['train']['steps']} steps; {wall / args.target:.2f}"
                " x the target)",
                flush=True,
            )
        final = _final_measures(session, requests, config) if args.evaluate else None
    mean = {k: round(statistics.fmean(r["phases"][k] for r in rows), 3) for k in (*PHASES, "total")}
    mean["wall"] = round(statistics.fmean(r["wall"] for r in rows), 3)
    out = {
        "model": args.model,
        "edits": f"{path}:{offset}:{n}",
        "set": args.set,
        "load_seconds": round(load, 3),
        "rounds": rows,
        "mean": mean,
        "target": args.target,
        "over_target": round(mean["wall"] / args.target, 3),
        "command": " ".join(["python", "benchmarks/edit_latency.py", *(argv or sys.argv[1:])]),
    }
    if final is not None:
        out["final"] = final
    print(
        f"load {load:.1f} s once; mean round {mean['wall']:.1f} s = {out['over_target']:.2f} x the "
        f"{args.target:g} s target: " + ", ".join(f"{k} {mean[k]:.1f}" for k in PHASES)
    )
    if args.json:
        atomic_write_json(args.json, stamped(out))
    return out


if __name__ == "__main__":
    main()
