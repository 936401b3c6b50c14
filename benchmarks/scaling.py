"""How each method's edits and drift grow with the number of edits, from stored runs.

Reads any mix of ``crispedit compare`` outputs (a ``compare.json`` or its directory) and
``benchmarks/edit_matrix.py`` outputs (their JSON), takes every edited row's WILD qa / chat reliability and
generalisation, the QA wrapper's crosstalk (the share of edits answered with another edit's target; for a row
stored before it was recorded, computed from its stored answers and the compare's edit file where that file can
be read), KL drift (nats/token on held-out text), the drift the K-FAC quadratic model predicted (and the
measured / predicted ratio: how far the prediction, what ``--max-drift`` budgets, under-reads at each size) and
perplexity, keyed by method and number of edits, and writes a table (Markdown) and a five-panel PNG (QA rel, QA
gen, QA crosstalk, KL drift and perplexity on log axes; x: number of edits, log axis). An edit_matrix row counts when
its overrides name only ``method`` and, optionally,
the defaults' contexts (it is then the method at its defaults). Where two runs give the same method and size,
the later file on the command line wins.

    python benchmarks/scaling.py results/scaling/wild_zsre_dev100_32.json results/compare_zsre_dev100 \\
        results/compare_zsre_dev1000 --out results/scaling/scaling_zsre
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from crispedit.atomic import atomic_write_bytes, atomic_write_figure  # noqa: E402
from crispedit.data.edits import load_edits  # noqa: E402  (torch-free)
from crispedit.editing.contexts import DEFAULT_CONTEXTS  # noqa: E402  (torch-free)
from crispedit.errors import CrispEditError  # noqa: E402
from crispedit.evaluation.wild import crosstalk  # noqa: E402  (torch-free)

KEYS = ("qa_rel", "qa_gen", "qa_cross", "chat_rel", "chat_gen", "kl_drift", "kl_predicted", "ppl")


def _point(wild: dict, summary: dict, targets: list[str] | None = None) -> dict:
    """The figures of one edited row: WILD qa / chat rel and gen, the qa wrapper's crosstalk (fractions), KL drift
    and its K-FAC prediction (nats/token; ``None`` where the row has none), perplexity. A row stored before
    crosstalk was recorded gets it from its stored answers and the edits' ``targets`` (in order) where given."""

    def w(ctx: str, k: str):
        return (wild.get(ctx) or {}).get(k)

    cross = w("qa", "cross")
    answers = w("qa", "answers")
    if cross is None and targets and answers and len(answers) == len(targets):
        cross = crosstalk([a[0] for a in answers], targets, [a[1] for a in answers])
    return {
        "qa_rel": w("qa", "rel"),
        "qa_gen": w("qa", "gen"),
        "qa_cross": cross,
        "chat_rel": w("chat", "rel"),
        "chat_gen": w("chat", "gen"),
        "kl_drift": summary.get("kl_drift"),
        "kl_predicted": summary.get("kl_predicted"),
        "ppl": summary.get("ppl"),
    }


def _targets(edits: dict) -> list[str] | None:
    """The targets of a compare's edits (``settings.edits``: file, offset, n), the file read relative to the
    working directory or the repository; ``None`` where it cannot be read."""
    for base in (Path.cwd(), ROOT):
        path = base / str(edits.get("file", ""))
        if edits.get("file") and path.is_file():
            try:
                return [r.target for r in load_edits(path, limit=int(edits["n"]), offset=int(edits.get("offset", 0)))]
            except (CrispEditError, KeyError, ValueError):
                return None
    return None


def read_points(path: str | Path) -> dict[tuple[str, int], dict]:
    """``{(method, n_edits): figures}`` of every edited row in one stored run (compare.json, its directory, or an
    edit_matrix JSON); methods at non-default settings in an edit_matrix file are left out."""
    path = Path(path)
    if path.is_dir():
        path = path / "compare.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CrispEditError(f"cannot read stored run {path}: {exc}") from None
    out: dict[tuple[str, int], dict] = {}
    if "settings" in data and isinstance(data.get("results"), dict):  # crispedit compare
        n = int(data["settings"]["n_edits"])
        targets = _targets(data["settings"].get("edits") or {})
        for m, r in data["results"].items():
            if m != "base" and isinstance(r, dict) and "summary" in r:
                out[(m, n)] = _point(r.get("wild") or {}, r["summary"], targets)
        return out
    if "args" in data and isinstance(data.get("results"), list):  # edit_matrix
        n = int(data["args"]["n_edits"])
        for r in data["results"]:
            ov = dict(r.get("overrides") or {})
            m = ov.pop("method", "crispedit")
            if ov.pop("contexts", DEFAULT_CONTEXTS) == DEFAULT_CONTEXTS and not ov:
                out[(m, n)] = _point(r.get("wild") or {}, r)
        return out
    raise CrispEditError(f"{path} is neither a compare.json nor an edit_matrix output")


def scaling_table(points: dict[tuple[str, int], dict]) -> str:
    """Markdown: one row per method and number of edits (sorted), the :data:`KEYS` figures and the measured /
    predicted drift ratio."""
    lines = [
        "| method | edits | WILD qa rel / gen | qa crosstalk | chat rel / gen | KL drift | predicted (measured / "
        "pred.) "
        "| perplexity |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt="{:.2f}"):
        return "–" if v is None else fmt.format(v)

    for m, n in sorted(points, key=lambda k: (k[0], k[1])):
        p = points[(m, n)]
        pred, drift = p.get("kl_predicted"), p["kl_drift"]
        ratio = f" ({drift / pred:.2f}×)" if pred and drift is not None else ""
        lines.append(
            f"| {m} | {n} | {f(p['qa_rel'])} / {f(p['qa_gen'])} | {f(p['qa_cross'], '{:.3f}')} | "
            f"{f(p['chat_rel'])} / {f(p['chat_gen'])} | "
            f"{f(drift, '{:.5f}')} | {f(pred, '{:.5f}')}{ratio} | {f(p['ppl'])} |"
        )
    return "\n".join(lines) + "\n"


def plot_scaling(points: dict[tuple[str, int], dict], path: str | Path) -> None:
    """Five panels against the number of edits (log x): WILD QA rel, QA gen, QA crosstalk, KL drift and perplexity
    (log y); one line per method with a point per stored size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(20, 3.8))
    panels = [
        ("qa_rel", "WILD QA rel"),
        ("qa_gen", "WILD QA gen"),
        ("qa_cross", "WILD QA crosstalk"),
        ("kl_drift", "KL drift (nats/token)"),
        ("ppl", "perplexity"),
    ]
    colours = plt.get_cmap("tab20").colors
    for i, method in enumerate(sorted({m for m, _ in points})):
        sizes = sorted(n for m, n in points if m == method)
        for ax, (key, _) in zip(axes, panels):
            xs = [n for n in sizes if points[(method, n)][key] is not None]
            ax.plot(
                xs, [points[(method, n)][key] for n in xs], marker="o", label=method, color=colours[i % len(colours)]
            )
    for ax, (key, title) in zip(axes, panels):
        ax.set_xscale("log")
        ax.set_xlabel("edits")
        ax.set_title(title)
        if key in ("kl_drift", "ppl"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write_figure(path, fig)
    plt.close(fig)


def main(argv=None) -> int:
    """Read the runs, write ``OUT.md`` and ``OUT.png``, print the table; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="compare.json files or directories, edit_matrix JSON files")
    ap.add_argument("--out", required=True, help="output stem: writes OUT.md and OUT.png")
    args = ap.parse_args(argv)
    try:
        points: dict[tuple[str, int], dict] = {}
        for r in args.runs:
            points.update(read_points(r))
        if not points:
            raise CrispEditError("the runs hold no edited rows")
        table = scaling_table(points)
        out = Path(args.out)
        atomic_write_bytes(out.with_suffix(".md"), table.encode())
        plot_scaling(points, out.with_suffix(".png"))
    except CrispEditError as exc:
        print(f"scaling: error: {exc}", file=sys.stderr)
        return 2
    print(table, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
