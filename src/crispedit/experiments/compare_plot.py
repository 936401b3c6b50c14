"""The compare picture (``DIR/compare.png``): edit success against KL drift with the KL Pareto front, and each
capability task's change against the base with its paired standard error (matplotlib, imported when drawn).
"""

from __future__ import annotations

from pathlib import Path

from ..atomic import atomic_write_figure
from .compare_table import BREAKING_PPL_RATIO, capability_changes, limit_text, pareto_points

__all__ = ["plot_compare"]


_TASK_LABELS = {
    "arc_challenge": "ARC-C",
    "truthfulqa_mc2": "TruthfulQA-MC2",
    "mmlu": "MMLU",
    "gsm8k_cot": "GSM8K",
    "ifeval": "IFEval",
}


def _place_labels(
    ax, anchors: list[tuple[float, float]], names: list[str], fontsize: int = 8, avoid: list | None = None
) -> None:
    """Annotate each anchor (data coordinates) with its name where the text overlaps no other label, no
    marker and no box of ``avoid`` (display-coordinate bboxes, e.g. the legend's), trying offsets near the
    point first, then farther ones with a leader line; where none fits, the least-overlapping offset. Call
    once the axes' limits and layout are final."""
    renderer = ax.figure.canvas.get_renderer()
    box = ax.get_window_extent(renderer)
    pts = [ax.transData.transform(a) for a in anchors]
    near = [
        (6, 3, "left", "bottom"),
        (6, -3, "left", "top"),
        (-6, 3, "right", "bottom"),
        (-6, -3, "right", "top"),
        (0, 8, "center", "bottom"),
        (0, -8, "center", "top"),
    ]
    far = [
        (dx * k, dy * k, ha, va)
        for k in (2.5, 4, 6)
        for dx, dy, ha, va in [
            (6, 6, "left", "bottom"),
            (6, -6, "left", "top"),
            (-6, 6, "right", "bottom"),
            (-6, -6, "right", "top"),
            (0, 8, "center", "bottom"),
            (0, -8, "center", "top"),
            (8, 0, "left", "center"),
            (-8, 0, "right", "center"),
        ]
    ]
    placed = list(avoid or [])

    def overlap(b, own):
        """Overlap area (pixels²) of bbox ``b`` with the placed labels and the other markers, plus the part
        outside the axes."""
        area = 0.0
        for o in placed:
            area += max(0, min(b.x1, o.x1) - max(b.x0, o.x0)) * max(0, min(b.y1, o.y1) - max(b.y0, o.y0))
        for i, (px, py) in enumerate(pts):
            if i != own:
                area += max(0, min(b.x1, px + 5) - max(b.x0, px - 5)) * max(0, min(b.y1, py + 5) - max(b.y0, py - 5))
        inside = max(0, min(b.x1, box.x1) - max(b.x0, box.x0)) * max(0, min(b.y1, box.y1) - max(b.y0, box.y0))
        return area + (b.width * b.height - inside) * 4

    for i, (anchor, name) in enumerate(zip(anchors, names)):
        ann = ax.annotate(name, anchor, textcoords="offset points", xytext=(0, 0), fontsize=fontsize)
        best = None
        for dx, dy, ha, va in near + far:
            ann.set_position((dx, dy))
            ann.set_ha(ha)
            ann.set_va(va)
            b = ann.get_window_extent(renderer)
            cost = overlap(b, i)
            if best is None or cost < best[0]:
                best = (cost, (dx, dy, ha, va), b)
            if cost == 0:
                break
        dx, dy, ha, va = best[1]
        ann.set_position((dx, dy))
        ann.set_ha(ha)
        ann.set_va(va)
        if abs(dx) > 8 or abs(dy) > 8:
            ax.annotate(
                "",
                anchor,
                xytext=(dx, dy),
                textcoords="offset points",
                arrowprops=dict(arrowstyle="-", color="0.6", lw=0.6, shrinkA=0, shrinkB=3),
            )
        placed.append(best[2])


def _plot_success_panel(ax, payload: dict, pareto: dict, rows: list[str], xy: dict):
    """Draw the left panel of the compare picture on ``ax``: edit success (fraction) against KL drift
    (nats/token, log x axis) at ``xy[m]`` for each of ``rows``, rows that do not break the model as dots and
    breaking rows as red ✕, the KL Pareto front ringed and joined by a dashed line, with axis labels, limits,
    grid, legend and title (no point labels yet). Returns the legend, whose box the labels must avoid."""
    from matplotlib.lines import Line2D

    breaking = pareto["breaking"]
    s = payload["settings"]
    ok = [m for m in rows if m not in breaking]
    bad = [m for m in rows if m in breaking]
    handles = []
    if ok:
        ax.scatter([xy[m][0] for m in ok], [xy[m][1] for m in ok], color="C0", s=36, zorder=3)
        handles.append(Line2D([], [], ls="", marker="o", color="C0", label="edited row"))
    if bad:
        ax.scatter([xy[m][0] for m in bad], [xy[m][1] for m in bad], color="C3", marker="X", s=70, zorder=3)
        handles.append(
            Line2D(
                [],
                [],
                ls="",
                marker="X",
                color="C3",
                markersize=8,
                label=f"breaks the model (perplexity > {BREAKING_PPL_RATIO:g}× base)",
            )
        )
    front = sorted((xy[m] for m in pareto["kl_front"] if m in xy), key=lambda p: p[0])
    if front:
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="0.4", lw=1, zorder=2)
        ax.scatter(
            [p[0] for p in front],
            [p[1] for p in front],
            s=170,
            facecolors="none",
            edgecolors="k",
            linewidths=1.1,
            zorder=4,
        )
        handles.append(
            Line2D(
                [],
                [],
                ls="--",
                marker="o",
                color="0.4",
                markerfacecolor="none",
                markeredgecolor="k",
                markersize=11,
                label="Pareto front (success vs KL drift)",
            )
        )
    ax.set_xscale("log")
    ax.set_xlabel("KL drift on held-out text (nats/token, log scale; left = less drift)")
    ax.set_ylabel("edit success (WILD QA rel)")
    ax.set_ylim(-0.04, 1.06)
    if rows:
        lo, hi = min(p[0] for p in xy.values()), max(p[0] for p in xy.values())
        ax.set_xlim(lo / 2.5, hi * 2.5)
    ax.grid(alpha=0.3, lw=0.5)
    legend = ax.legend(handles=handles, fontsize=8, loc="best", framealpha=0.9)
    ax.set_title(f"{s['model']}, {s['n_edits']} edits: edit success against drift", fontsize=10)
    return legend


def _plot_capability_panel(axc, payload: dict, pareto: dict) -> None:
    """Draw the right panel of the compare picture on ``axc``: one line per row with capability scores (the
    first at the top), per task a marker offset within the line at the score change against the base
    (percentage points), with ± 1 (thick) and ± 2 (thin) paired standard-error bars where per-item scores
    were kept (:func:`capability_changes`), else the unpaired difference as a hollow marker without a bar;
    a zero line, legend and title, breaking rows' names marked and in red."""
    from matplotlib.lines import Line2D

    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    breaking = pareto["breaking"]
    changes = capability_changes(payload)
    base_caps = (res.get("base") or {}).get("capabilities") or {}
    crow = [m for m in pareto["points"] if res[m].get("capabilities")]
    n = len(crow)
    markers, chandles, drawn = "osD^v<>", [], set()
    for j, c in enumerate(caps):
        off = (j - (len(caps) - 1) / 2) * 0.28
        color = f"C{j + 1}" if j + 1 != 3 else "C9"
        for i, m in enumerate(crow):
            y = n - 1 - i + off
            if c in changes.get(m, {}):
                d, e = changes[m][c]
                axc.plot([d - 2 * e, d + 2 * e], [y, y], color=color, lw=0.9, zorder=2)
                axc.plot([d - e, d + e], [y, y], color=color, lw=3, alpha=0.8, zorder=2)
                axc.plot([d], [y], marker=markers[j % len(markers)], color=color, ms=5, zorder=3)
                drawn.add("paired")
            elif res[m]["capabilities"].get(c) is not None and base_caps.get(c) is not None:
                d = 100 * (res[m]["capabilities"][c] - base_caps[c])
                axc.plot([d], [y], marker=markers[j % len(markers)], color=color, ms=5, mfc="none", zorder=3)
                drawn.add("unpaired")
        chandles.append(
            Line2D([], [], color=color, marker=markers[j % len(markers)], ls="", label=_TASK_LABELS.get(c, c))
        )
    if "paired" in drawn:
        chandles.append(Line2D([], [], color="0.3", lw=3, label="± 1 paired SE"))
        chandles.append(Line2D([], [], color="0.3", lw=0.9, label="± 2 paired SE"))
    if "unpaired" in drawn:
        chandles.append(
            Line2D(
                [],
                [],
                color="0.3",
                marker="o",
                mfc="none",
                ls="",
                label="no per-item scores for this row or the base:\nscore difference only, no SE",
            )
        )
    axc.axvline(0, color="0.3", lw=0.8, zorder=1)
    axc.set_yticks(range(n))
    axc.set_yticklabels([m + (" (breaks)" if m in breaking else "") for m in reversed(crow)], fontsize=8)
    for label, m in zip(axc.get_yticklabels(), reversed(crow)):
        if m in breaking:
            label.set_color("C3")
    axc.set_ylim(-0.7, n - 0.3)
    axc.set_xlabel("capability score change against the base (percentage points)")
    axc.grid(alpha=0.3, axis="x", lw=0.5)
    axc.legend(handles=chandles, fontsize=8, loc="best", framealpha=0.9)
    axc.set_title(
        f"capabilities ({limit_text(payload['settings']['evaluation'].get('limit'))}): change against the base",
        fontsize=10,
    )


def plot_compare(payload: dict, path: str | Path) -> None:
    """Write the compare picture to ``path`` (PNG). Left panel: edit success (WILD QA rel, fraction) against
    KL drift on held-out text (nats/token, log x axis; left = less drift), one labelled point per edited row;
    the KL Pareto front (:func:`pareto_points` ``kl_front``) ringed and joined by a dashed line; a row that
    breaks the model (held-out perplexity more than :data:`BREAKING_PPL_RATIO` × the base's,
    :func:`~crispedit.experiments.compare_table.breaking_rows`) drawn as a red ✕ with its own legend entry (it is never
    on the front). A drift of 0 is
    drawn at 1e-6; rows without a QA result are left out. Right panel, when capability tasks ran: each
    task's score change against the base (percentage points) per edited row, with the paired standard error
    (:func:`capability_changes`; thick bar ± 1 SE, thin bar ± 2 SE); a row stored without per-item scores shows
    its unpaired difference as a hollow marker without a bar; breaking rows' names in red."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    pareto = pareto_points(payload)
    rows = [m for m in pareto["points"] if pareto["points"][m][0] is not None]
    xy = {m: (max(res[m]["summary"]["kl_drift"], 1e-6), pareto["points"][m][0]) for m in rows}

    if caps:
        fig, (ax, axc) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1.35, 1]})
    else:
        fig, ax = plt.subplots(figsize=(7.4, 5.2))
        axc = None
    legend = _plot_success_panel(ax, payload, pareto, rows, xy)
    if axc is not None:
        _plot_capability_panel(axc, payload, pareto)
    fig.tight_layout()
    fig.canvas.draw()
    _place_labels(ax, [xy[m] for m in rows], rows, avoid=[legend.get_window_extent(fig.canvas.get_renderer())])
    atomic_write_figure(path, fig, dpi=120)
