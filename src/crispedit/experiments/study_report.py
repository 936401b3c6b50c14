"""Tables and trade-off plots of the curvature study (CSV and PNG, written atomically)."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

from ..atomic import atomic_write_bytes

__all__ = ["CSV_FIELDS", "write_csv", "write_plot"]

CSV_FIELDS = ["method", "k", "gamma", "mnist_acc", "fashion_acc", "kept_dims", "kept_fraction", "recomputes", "seconds"]

_STYLE = {  # method -> (label, colour, marker)
    "hessian": ("Hessian (exact)", "#000000", "o"),
    "hessian_abs": ("|Hessian| (exact, ranked by |λ|)", "#7f7f7f", "P"),
    "ggn": ("Gauss-Newton (exact)", "#d62728", "s"),
    "kfac": ("K-FAC", "#1f77b4", "^"),
    "ekfac": ("EK-FAC", "#2ca02c", "v"),
    "activation_cov": ("activation cov. (Adam-NSCL)", "#ff7f0e", "D"),
}


def write_csv(path: str | Path, rows: Sequence[dict]) -> None:
    """Write ``rows`` (the study's CSV_FIELDS columns) to ``path`` atomically."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    atomic_write_bytes(path, buf.getvalue().encode())


def write_plot(path: str | Path, rows: Sequence[dict], title: str = "") -> None:
    """Trade-off plot: Fashion-MNIST test accuracy gained (x) vs MNIST test accuracy kept (y); one curve
    per method over the gamma sweep (labelled with k at the ends), fine-tuning without projection
    and the pre-trained model as single points."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5.6), dpi=130)
    for method, (label, colour, marker) in _STYLE.items():
        pts = sorted((r for r in rows if r["method"] == method), key=lambda r: r["k"])
        if not pts:
            continue
        xs = [100 * r["fashion_acc"] for r in pts]
        ys = [100 * r["mnist_acc"] for r in pts]
        ax.plot(xs, ys, marker=marker, color=colour, label=label, lw=1.6, ms=5, alpha=0.9)
        for r, x, y in ((pts[0], xs[0], ys[0]), (pts[-1], xs[-1], ys[-1])):
            ax.annotate(
                f"k={r['k']:g}",
                (x, y),
                textcoords="offset points",
                xytext=(4, -10 if r is pts[0] else 4),
                fontsize=7,
                color=colour,
            )
    for method, label, marker, colour in (
        ("none", "unprojected fine-tuning", "*", "#9467bd"),
        ("pretrained", "pre-trained (before fine-tuning)", "X", "#7f7f7f"),
    ):
        for r in rows:
            if r["method"] == method:
                ax.plot(
                    [100 * r["fashion_acc"]],
                    [100 * r["mnist_acc"]],
                    marker=marker,
                    ms=13,
                    ls="none",
                    color=colour,
                    label=label,
                )
    ax.set_xlabel("Fashion-MNIST test accuracy after fine-tuning (%)  →  better edit")
    ax.set_ylabel("MNIST test accuracy kept (%)  →  better preservation")
    ax.set_title(title + ("\n" if title else "") + "projected fine-tuning, γ = 1 − 10^(−k)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.85)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
