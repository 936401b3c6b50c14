"""The picture of sessions over their rounds ("Evolution of CrispEdit-Seq"): the reliability of each round's edits
after every later round, and the KL drift per round (matplotlib, imported when drawn; written atomically).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..atomic import atomic_write_figure
from ..paths import check_output_file

__all__ = ["plot_retention"]


def plot_retention(statuses: Sequence[dict], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """The "Evolution of CrispEdit-Seq" figure: for each session, the reliability of each round's edits
    after every later round; plus one panel of KL drift per round for all sessions. ``out`` is checked
    before drawing and written atomically (nothing left behind on failure)."""
    out = check_output_file(out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(labels or [s["name"] for s in statuses])
    n = len(statuses)
    fig, axes = plt.subplots(1, n + 1, figsize=(4.2 * (n + 1), 3.6), squeeze=False)
    for ax, st, label in zip(axes[0], statuses, labels):
        rounds = st["rounds"]
        K = len(rounds)
        cmap = plt.get_cmap("viridis", max(K, 2))
        for j in range(1, K + 1):
            xs = [r["round"] for r in rounds if str(j) in r["retention"]]
            ys = [r["retention"][str(j)]["rel"] for r in rounds if str(j) in r["retention"]]
            ax.plot(xs, ys, marker="o", color=cmap(j - 1), label=f"round {j} edits")
        ax.set_title(label)
        ax.set_xlabel("after round")
        ax.set_ylabel("reliability (teacher-forced)")
        ax.set_ylim(-0.03, 1.03)
        ax.set_xticks(range(1, K + 1) if K else [])
        ax.grid(alpha=0.3)
        if K:
            ax.legend(fontsize=7, loc="lower left")
    ax = axes[0][n]
    for st, label in zip(statuses, labels):
        ax.plot([r["round"] for r in st["rounds"]], [r["kl_drift"] for r in st["rounds"]], marker="o", label=label)
    K = max((len(st["rounds"]) for st in statuses), default=0)
    ax.set_xticks(range(1, K + 1) if K else [])
    ax.set_title("KL drift on held-out text")
    ax.set_xlabel("after round")
    ax.set_ylabel("KL(base || edited) per token")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_write_figure(out, fig, dpi=110)
