"""``crispedit report``: a markdown table and a grouped-bar figure comparing ``crispedit eval`` runs.

Edit metrics (WILD ``rel``/``gen``/``loc_*`` or the teacher-forced variants) and capability scores
(lm-eval tasks; ``kl_drift`` and ``ppl`` are listed in the table only, being on other scales) are
shown side by side, in the spirit of the paper's Figure 1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..atomic import atomic_write_bytes
from ..errors import CrispEditError
from ..paths import check_output_file, read_text_file
from ..versions import check_written_by

__all__ = ["load_run", "run_rows", "run_labels", "markdown_table", "plot_runs", "render_runs_png", "write_report"]

_EDIT_ORDER = [
    "rel",
    "gen",
    "loc_vs_answer",
    "loc_vs_base",
    "cross",
    "rel_token_acc",
    "rel_exact",
    "gen_token_acc",
    "gen_exact",
    "spec_token_acc",
    "spec_exact",
    "spec_cf",
]
_UNBOUNDED = {"kl_drift", "ppl", "ppl_base"}


def load_run(path: str | Path) -> dict:
    """One ``crispedit eval`` result file as a dict (one-line errors for a missing, non-UTF-8, non-JSON
    or wrongly shaped file, and for one another crispedit version wrote:
    :func:`~crispedit.versions.check_written_by`)."""
    path = Path(path)
    text = read_text_file(path, "run file")
    try:
        run = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CrispEditError(f"{path}: not a JSON file ({exc.msg} at line {exc.lineno})") from None
    if (
        not isinstance(run, dict)
        or not isinstance(run.get("edit"), dict)
        or not isinstance(run.get("capabilities"), dict)
    ):
        raise CrispEditError(f"{path}: not a `crispedit eval` result (needs 'edit' and 'capabilities' objects)")
    if not isinstance(run.get("config", {}), dict):
        raise CrispEditError(f"{path}: not a `crispedit eval` result ('config' is not an object)")
    check_written_by(run, path, "rerun `crispedit eval`")
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
    return [
        f"{lab} ({Path(r.get('_path', str(i))).stem})" if labels.count(lab) > 1 else lab
        for i, (lab, r) in enumerate(zip(labels, runs))
    ]


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
    """A markdown table with one row per run: its edit metrics, then its capability scores."""
    edit_keys, cap_keys, rows = run_rows(runs)
    head = ["run"] + edit_keys + cap_keys
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for lab, row in zip(run_labels(runs), rows):
        lines.append("| " + " | ".join([lab] + [_fmt(row.get(k)) for k in edit_keys + cap_keys]) + " |")
    return "\n".join(lines) + "\n"


def plot_runs(runs: Sequence[dict], path: str | Path) -> None:
    """Write :func:`render_runs_png`'s figure to ``path`` atomically."""
    atomic_write_bytes(path, render_runs_png(runs))


def render_runs_png(runs: Sequence[dict]) -> bytes:
    """PNG bytes of grouped bars: edit metrics, then capability scores in [0, 1]; one colour per run (no bar
    where a run lacks the metric)."""
    try:
        import matplotlib
    except ImportError:
        raise CrispEditError("the figure needs matplotlib: pip install matplotlib") from None

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
    return buf.getvalue()


def write_report(
    paths: Sequence[str | Path], out_md: str | Path | None = None, out_png: str | Path | None = None
) -> str:
    """Load the runs, write the markdown table to ``out_md`` and the figure to ``out_png`` (each optional)
    and return the table. Both destinations are checked before anything is written, and the figure is
    rendered before the table is written, so a failure leaves neither file behind."""
    for dest, flag in ((out_md, "--out"), (out_png, "--png")):
        if dest:
            check_output_file(dest, flag)
    runs = [load_run(p) for p in paths]
    table = markdown_table(runs)
    png = render_runs_png(runs) if out_png else None
    if out_png:
        atomic_write_bytes(out_png, png)
    if out_md:
        atomic_write_bytes(out_md, table.encode())
    return table
