"""Edit-quality matrix / sweep on one model and one edit set: any EditConfig fields per run.

Loads the model once, runs each configuration from the same base weights (restored between runs),
and records teacher-forced rel / gen, KL drift (measured, ``kl_pred``: the K-FAC prediction from the
capability factors, also for ft: the coherent bound over layers, and ``kl_pred_bd``: the block-diagonal
sum), WILD rel / gen / locality under the qa, none (bare) and
chat contexts (rule judge), epochs and seconds. Writes a JSON (full configs + environment, rewritten
after every run), a markdown table (with ``kl_pred``, its ratio to the measured drift and, for runs with
``max_drift``, the budget's pulled-back steps) and two PNGs (WILD-QA rel and gen against KL drift, one
point per run; ``.pred.png``: predicted against measured drift).

Runs are ``key=value`` pairs separated by ``;`` (any :class:`crispedit.EditConfig` field, or
``options.NAME`` for a setting of the method's own config, e.g. ``method=ultraedit;options.lr=0.001``; values
are parsed as numbers when they look like numbers), several runs separated by ``|``:

    python benchmarks/edit_matrix.py --edits ../shared/data/edits/zsre_dev.json --offset 400 --n-edits 32 \\
        --runs 'method=ft;contexts=bare;answer_end=none|method=crispedit|method=crispedit;gamma=0.9' \\
        --out runs/sweep.json

Predicted vs measured drift over a γ sweep, the baselines and two drift budgets:

    python benchmarks/edit_matrix.py --edits ../shared/data/edits/zsre_dev.json --n-edits 32 \\
        --runs 'method=ft|method=crispedit;gamma=0.5|method=crispedit;gamma=0.8|method=crispedit;gamma=0.95|'\\
'method=adam-nscl|method=crispedit;max_drift=0.002|method=crispedit;max_drift=0.0005' --out runs/drift.json

The older form ``method:labels:target[:gamma]`` (comma separated) is still accepted.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from crispedit.atomic import atomic_write_bytes, atomic_write_json
from crispedit.data import load_edits
from crispedit.editing import EditConfig, edit, restore
from crispedit.evaluation import evaluate_edit
from crispedit.evaluation.wild import check_template
from crispedit.models import load_model
from crispedit.pipeline import drift_summary, environment

DEFAULT_RUNS = (
    "method=ft;contexts=bare;answer_end=none|method=crispedit;contexts=bare;answer_end=none|"
    "method=ft|method=crispedit|method=crispedit;projection_target=update|"
    "method=crispedit;projection_target=eigenbasis"
)


def _value(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def parse_runs(spec: str) -> list[dict]:
    """``'k=v;k=v|k=v'`` (or the older ``method:labels:target[:gamma],...``) -> list of override dicts."""
    if "=" not in spec:
        out = []
        for r in spec.split(","):
            p = r.split(":")
            d = {"method": p[0], "label_mode": p[1], "projection_target": p[2]}
            if len(p) > 3:
                d["gamma"] = float(p[3])
            out.append(d)
        return out
    runs = []
    for run in spec.split("|"):
        d = {}
        for pair in filter(None, (x.strip() for x in run.split(";"))):
            k, _, v = pair.partition("=")
            k = k.strip()
            if k.startswith("options."):  # the method's own settings, e.g. options.lr for UltraEdit's pseudo-value lr
                d.setdefault("options", {})[k[len("options.") :]] = _value(v.strip())
            else:
                d[k] = _value(v.strip())
        runs.append(d)
    return runs


def label(d: dict) -> str:
    """Short name of a run's overrides."""
    return " ".join(f"{k}={v}" for k, v in d.items()) or "defaults"


COLUMNS = [
    "run",
    "tf_rel",
    "tf_gen",
    "qa_rel",
    "qa_gen",
    "none_rel",
    "none_gen",
    "chat_rel",
    "chat_gen",
    "qa_loc",
    "kl_drift",
    "kl_pred",
    "pred/meas",
    "kl_pred_bd",
    "bd/meas",
    "budget_hits",
    "epochs",
    "edit_s",
    "chat_len",
    "chat_bare",
    "answer_kl",
    "bleed",
    "bleed_changed",
]


def extra_contexts(rows: list[dict]) -> list[str]:
    """Names of the user wrappers (``--wild-template``) evaluated in ``rows``, in first-seen order."""
    names: dict[str, None] = {}
    for r in rows:
        names.update((k, None) for k in r["wild"] if k not in ("qa", "none", "chat", "seconds"))
    return list(names)


def columns(extra: list[str]) -> list[str]:
    """Table header: :data:`COLUMNS` then rel/gen of each extra wrapper."""
    return COLUMNS + [f"{n}_{k}" for n in extra for k in ("rel", "gen")]


def row_cells(r: dict, extra: list[str] = ()) -> list[str]:
    """One markdown row of a result (``extra``: the user wrappers' rel/gen appended)."""
    w = r["wild"]

    def f(ctx, k):
        v = (w.get(ctx) or {}).get(k)
        return "–" if v is None else f"{v:.2f}"

    return [
        r["run"],
        f"{r['rel']:.2f}",
        f"{r['gen']:.2f}",
        f("qa", "rel"),
        f("qa", "gen"),
        f("none", "rel"),
        f("none", "gen"),
        f("chat", "rel"),
        f("chat", "gen"),
        f("qa", "loc_vs_answer"),
        f"{r['kl_drift']:.5f}",
        "–" if r.get("kl_predicted") is None else f"{r['kl_predicted']:.5f}",
        _ratio(r),
        "–" if r.get("kl_predicted_blockdiag") is None else f"{r['kl_predicted_blockdiag']:.5f}",
        _ratio(r, "kl_predicted_blockdiag"),
        _hits(r),
        str(r["epochs"]),
        f"{r['edit_seconds']:.0f}",
        _assistant(r, "style", "length_ratio"),
        _assistant(r, "style", "bare_share"),
        _assistant(r, "style", "answer_kl", 4),
        _assistant(r, "bleed", "target"),
        _assistant(r, "bleed", "changed"),
    ] + [f(n, k) for n in extra for k in ("rel", "gen")]


def _assistant(r: dict, part: str, key: str, digits: int = 2) -> str:
    """One figure of a row's chat measures (:mod:`crispedit.evaluation.assistant`), ``–`` where absent."""
    v = ((r.get("assistant") or {}).get(part) or {}).get(key)
    return "–" if v is None else f"{v:.{digits}f}"


def _ratio(r: dict, key: str = "kl_predicted") -> str:
    """Predicted (``key``: the coherent ``kl_predicted`` or ``kl_predicted_blockdiag``) over measured KL drift
    (``–`` without a prediction or with no measured drift)."""
    pred, meas = r.get(key), r.get("kl_drift")
    return "–" if pred is None or not meas else f"{pred / meas:.2f}"


def _hits(r: dict) -> str:
    """``hits/steps`` of the ``max_drift`` budget (``–`` without one)."""
    b = r.get("drift_budget")
    return "–" if not b else f"{b['hits']}/{b['steps']}"


def plot_predicted(out: Path, payload: dict) -> None:
    """``<out>.pred.png``: K-FAC predicted against measured KL drift per run (log-log, y = x dashed; a
    ``max_drift`` budget drawn as a horizontal tick at its value)."""
    import matplotlib.pyplot as plt

    rows = [r for r in payload["results"] if r.get("kl_predicted") is not None and r.get("kl_drift")]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6.4, 5))
    for i, r in enumerate(payload["results"]):
        if r not in rows:
            continue
        ax.scatter([r["kl_drift"]], [r["kl_predicted"]], color=f"C{i % 10}", label=f"{i}: {r['run']}"[:70])
        ax.annotate(str(i), (r["kl_drift"], r["kl_predicted"]), fontsize=8)
        if r.get("drift_budget"):
            ax.scatter([r["kl_drift"]], [r["drift_budget"]["max_drift"]], marker="_", s=200, color=f"C{i % 10}")
    vals = [v for r in rows for v in (r["kl_drift"], r["kl_predicted"]) if v > 0]
    lo, hi = min(vals) / 2, max(vals) * 2
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured KL drift on held-out text (nats/token)")
    ax.set_ylabel("K-FAC predicted drift ½Σtr(ΔWᵀSΔWA) (nats/token)")
    ax.legend(fontsize=6, loc="upper left")
    ax.set_title(payload["title"], fontsize=9)
    save_figure(fig, out.with_suffix(".pred.png"))


def save_figure(fig, path: Path) -> None:
    """Lay out, write ``fig`` to ``path`` (PNG, 120 dpi) through a temporary file and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def write_outputs(out: Path, payload: dict) -> None:
    """JSON, markdown table and PNG next to each other."""
    atomic_write_json(out, payload)
    rows = payload["results"]
    extra = extra_contexts(rows)
    cols = columns(extra)
    md = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    md += "".join("| " + " | ".join(row_cells(r, extra)) + " |\n" for r in rows)
    atomic_write_bytes(out.with_suffix(".md"), md.encode())
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, r in enumerate(rows):
        qa = r["wild"].get("qa") or {}
        x = max(r["kl_drift"], 1e-5)
        ax.scatter([x], [qa.get("rel") or 0], marker="o", color=f"C{i % 10}", label=f"{i}: {r['run']}"[:70])
        ax.scatter([x], [qa.get("gen") or 0], marker="x", color=f"C{i % 10}")
        ax.annotate(str(i), (x, qa.get("rel") or 0), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KL drift on held-out text (nats/token, log)")
    ax.set_ylabel("WILD QA context: rel (o), gen (x)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=6, loc="lower right")
    ax.set_title(payload["title"], fontsize=9)
    save_figure(fig, out.with_suffix(".png"))
    plot_predicted(out, payload)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--edits", required=True)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--n-edits", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=100, help="default epochs for every run (a run may override)")
    ap.add_argument("--runs", default=DEFAULT_RUNS)
    ap.add_argument("--wild", default="qa,none,chat", help="WILD contexts to evaluate ('' = none)")
    ap.add_argument(
        "--wild-template",
        action="append",
        default=[],
        metavar="NAME=TEXT",
        help="also evaluate WILD through this wrapper (TEXT holds {question} once); repeatable",
    )
    ap.add_argument("--out", default="runs/edit_matrix.json")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    templates = {}
    for item in args.wild_template:
        name, sep, text = item.partition("=")
        if not sep or not name or name in templates or name in ("qa", "none", "chat"):
            ap.error(f"--wild-template wants NAME=TEXT with a new name, got {item!r}")
        templates[name] = check_template(text.replace("\\n", "\n"))
    runs = parse_runs(args.runs)
    configs = [EditConfig(**{"epochs": args.epochs, **d}) for d in runs]  # validate all before any work
    requests = load_edits(args.edits, limit=args.n_edits, offset=args.offset)
    model, tok = load_model(args.model, progress=False)
    out = Path(args.out)
    results = []
    title = f"{args.model}, {Path(args.edits).name} [{args.offset}:{args.offset + len(requests)}]"
    extra = list(templates)
    print(" ".join(f"{c:>8}" for c in columns(extra)[1:]) + "  run", flush=True)
    for d, cfg in zip(runs, configs):
        t0 = time.perf_counter()
        res = edit(model, tok, requests, cfg, progress=False, predict_drift=True)  # kl_pred for ft too
        ev = evaluate_edit(
            model,
            tok,
            requests,
            res.original_weights,
            wild=[c for c in args.wild.split(",") if c],
            wild_templates=templates,
            assistant=True,
            progress=False,
        )
        summary, wild = ev["summary"], {k: v for k, v in ev.get("wild", {}).items() if k != "judge"}
        restore(model, res.original_weights)
        row = {
            "run": label(d),
            "overrides": d,
            **summary,
            **drift_summary(res),
            "wild": wild,
            "assistant": ev["assistant"],
            "epochs": len(res.history.epoch_loss),
            "converged": res.history.converged,
            "training": res.history.to_json(),
            "edit_seconds": round(res.edit_seconds, 2),
            "cache_seconds": round(res.cache_seconds, 2),
            "min_kept_fraction": min(v["kept_fraction"] for v in res.projector_stats.values()),
            "total_seconds": round(time.perf_counter() - t0, 2),
            "config": cfg.to_json(),
        }
        results.append(row)
        print(" ".join(f"{c:>8}" for c in row_cells(row, extra)[1:]) + "  " + row["run"], flush=True)
        write_outputs(
            out,
            {
                "title": title,
                "args": vars(args),
                "environment": environment(),
                "results": results,
                "complete": len(results) == len(runs),
            },
        )
    print(f"written to {out} (+ .md, .png)")


if __name__ == "__main__":
    main()
