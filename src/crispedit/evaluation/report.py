"""``crispedit report``: a markdown table and a grouped-bar figure comparing ``crispedit eval`` runs.

Edit metrics (WILD ``rel``/``gen``/``loc_*`` or the teacher-forced variants) and capability scores
(lm-eval tasks; ``kl_drift`` and ``ppl`` are listed in the table only, being on other scales) are
shown side by side, in the spirit of the paper's Figure 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from ..errors import CrispEditError, atomic_write_bytes

__all__ = ["load_run", "run_rows", "run_labels", "markdown_table", "plot_runs", "write_report"]

_EDIT_ORDER = ["rel", "gen", "loc_vs_answer", "loc_vs_base", "rel_token_acc", "rel_exact", "gen_token_acc",
               "gen_exact", "spec_token_acc", "spec_exact", "spec_cf"]
_UNBOUNDED = {"kl_drift", "ppl", "ppl_base"}


def load_run(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CrispEditError(f"run file not found: {path}")
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CrispEditError(f"{path}: not a JSON file ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(run, dict) or "edit" not in run or "capabilities" not in run:
        raise CrispEditError(f"{path}: not a `crispedit eval` result (needs 'edit' and 'capabilities')")
    run.setdefault("_path", str(path))
    return run


def _label(run: dict) -> str:
    cfg = run.get("config", {})
    name = str(cfg.get("model", "?"))
    short = Path(name).name if ("/" in name or "\\" in name) else name
    return f"{short} [{cfg.get('protocol', '?')}/{cfg.get('context') or '-'}]"


def run_labels(runs: Sequence[dict]) -> list[str]:
    """One label per run (model name, protocol/context); the run file's name is added where two clash."""
    labels = [_label(r) for r in runs]
    return [f"{lab} ({Path(r.get('_path', str(i))).stem})" if labels.count(lab) > 1 else lab
            for i, (lab, r) in enumerate(zip(labels, runs))]


def run_rows(runs: Sequence[dict]) -> tuple[list[str], list[str], list[dict]]:
    """(edit metric names, capability names, one {metric: value} dict per run)."""
    edit_keys = [k for k in _EDIT_ORDER if any(isinstance(r["edit"].get(k), (int, float)) for r in runs)]
    cap_keys: list[str] = []
    rows = []
    for r in runs:
        row = {k: r["edit"].get(k) for k in edit_keys}
        for task, val in r["capabilities"].items():
            score = val.get("score") if isinstance(val, dict) else val
            if isinstance(score, (int, float)):
                row[task] = score
                if task not in cap_keys:
                    cap_keys.append(task)
        rows.append(row)
    cap_keys = [k for k in cap_keys if k not in _UNBOUNDED] + [k for k in cap_keys if k in _UNBOUNDED]
    return edit_keys, cap_keys, rows


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 0.01 and v != 0 else f"{v:.3f}"
    return str(v)


def markdown_table(runs: Sequence[dict]) -> str:
    edit_keys, cap_keys, rows = run_rows(runs)
    head = ["run"] + edit_keys + cap_keys
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for lab, row in zip(run_labels(runs), rows):
        lines.append("| " + " | ".join([lab] + [_fmt(row.get(k)) for k in edit_keys + cap_keys]) + " |")
    return "\n".join(lines) + "\n"


def plot_runs(runs: Sequence[dict], path: str | Path) -> None:
    """Grouped bars: edit metrics, then capability scores in [0, 1]; one colour per run (no bar where a
    run lacks the metric)."""
    import matplotlib

    matplotlib.use("Agg")
    import io

    import matplotlib.pyplot as plt

    edit_keys, cap_keys, rows = run_rows(runs)
    keys = edit_keys + [k for k in cap_keys if k not in _UNBOUNDED]
    if not keys:
        raise CrispEditError("nothing to plot: the runs hold no edit or capability scores")
    n = len(runs)
    width = 0.8 / max(n, 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(keys) + 2), 4.2))
    for j, (lab, row) in enumerate(zip(run_labels(runs), rows)):
        xs = [i + (j - (n - 1) / 2) * width for i in range(len(keys))]
        ax.bar(xs, [float("nan") if row.get(k) is None else float(row[k]) for k in keys], width, label=lab)
    if edit_keys and len(keys) > len(edit_keys):
        ax.axvline(len(edit_keys) - 0.5, color="grey", lw=0.8, ls="--")
        ax.text(len(edit_keys) / 2 - 0.5, 1.04, "edit", ha="center", fontsize=9)
        ax.text(len(edit_keys) + (len(keys) - len(edit_keys)) / 2 - 0.5, 1.04, "capabilities", ha="center", fontsize=9)
    ax.set_xticks(range(len(keys)))
    ax.set_xticklabels(keys, rotation=30, ha="right")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("score")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def write_report(paths: Sequence[str | Path], out_md: str | Path | None = None, out_png: str | Path | None = None) -> str:
    runs = [load_run(p) for p in paths]
    table = markdown_table(runs)
    if out_md:
        atomic_write_bytes(out_md, table.encode())
    if out_png:
        plot_runs(runs, out_png)
    return table
