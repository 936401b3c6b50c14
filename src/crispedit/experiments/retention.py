"""Round-1 retention of a compare's sequential rows: does what the first round taught still hold later?

A ``-seq`` row of ``crispedit compare`` stores, for every round, the first round's edits measured on the model
as it stood after that round (``retention``: one :func:`~crispedit.evaluation.edit_eval.round_map_probe` record
per round — ``n`` edits, teacher-forced ``tf_rel``, ``wild`` ``{"qa": rel, "chat": rel}``, each a fraction of
the round-1 edits); a batched closed-form row (MEMIT, AlphaEdit over several batches — AlphaEdit-Seq in rounds of
its batch size) stores its first batch's teacher-forced reliability after every batch (``training.first_batch_tf_rel``),
read here as the same series without WILD measures. This module turns those records into the compare's retention table
(markdown,
:func:`retention_table`), its summary per row (:func:`retention_summary`: the fraction after the last round,
and that fraction over the one after the first round — what of what the first round achieved is kept) and its picture
(:func:`plot_retention`, ``DIR/retention.png``). Every round's probe also measures that round's own edits right after
it (``newest``: :func:`landed_by_round`, what each round landed), and from the rows' per-edit records this module
reads every round's edits on the *final* model (:func:`final_by_round`: which rounds the last one overwrote); the
two are tables under the first, so a round that landed little is told apart from one that a later round undid.
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

from ..atomic import atomic_write_figure

__all__ = [
    "retention_rows",
    "retention_series",
    "retention_summary",
    "retention_table",
    "plot_retention",
    "final_by_round",
    "landed_by_round",
    "retention_map",
    "plot_retention_map",
    "RETENTION_PNG",
    "RETENTION_MAP_PNG",
]

RETENTION_PNG = "retention.png"
RETENTION_MAP_PNG = "retention_map.png"
_MEASURES = (("tf_rel", "teacher-forced rel"), ("qa", "WILD qa rel"), ("chat", "WILD chat rel"))


def _batches(row: dict) -> list:
    """A batched closed-form row's teacher-forced reliability of its first batch after every batch (its report's
    ``training.first_batch_tf_rel``; a batched AlphaEdit run is AlphaEdit-Seq in rounds of its batch size)."""
    return list((row.get("training") or {}).get("first_batch_tf_rel") or [])


def retention_rows(payload: dict) -> list[str]:
    """The rows of a compare payload (``compare.json``) that hold a per-round retention record — a ``-seq`` row's
    probes, or a batched closed-form row's first batch after every batch — in the payload's method order."""
    res = payload.get("results", {})
    return [
        m
        for m in payload.get("methods", [])
        if m in res and (any(res[m].get("retention") or []) or any(v is not None for v in _batches(res[m])))
    ]


def retention_series(row: dict) -> dict[str, list[float | None]]:
    """``{measure: [fraction after the first round, after the second, …]}`` for one ``-seq`` row, measures ``tf_rel``,
    ``qa``
    and ``chat`` (fractions of the round-1 edits; ``None`` where a round has no record or the measure was not
    taken, e.g. ``chat`` for a tokenizer without a chat template). A batched closed-form row gives its first
    batch's teacher-forced series (batches for rounds) and no WILD measures."""
    out: dict[str, list[float | None]] = {k: [] for k, _ in _MEASURES}
    if not row.get("retention") and _batches(row):
        held = _batches(row)
        return {"tf_rel": held, "qa": [None] * len(held), "chat": [None] * len(held)}
    for rec in row.get("retention") or []:
        rec = rec or {}
        wild = rec.get("wild") or {}
        out["tf_rel"].append(rec.get("tf_rel"))
        for k in ("qa", "chat"):
            out[k].append(wild.get(k))
    return out


def retention_map(row: dict) -> list[list[float | None]]:
    """The retention map of a ``-seq`` row: entry ``[j][k]`` is the teacher-forced reliability of round ``k + 1``'s
    edits measured after round ``j + 1`` (``k <= j``; ``None`` above the diagonal and where a round has no
    record), from its rounds' ``by_round`` records (:func:`~crispedit.evaluation.edit_eval.round_map_probe`);
    ``[]`` for a row without them."""
    recs = [(rec or {}).get("by_round") for rec in row.get("retention") or []]
    if not any(recs):
        return []
    n = len(recs)
    return [[(r[k] if r and k < len(r) else None) for k in range(n)] for r in recs]


def plot_retention_map(payload: dict, path: str | Path) -> bool:
    """Write the retention maps to ``path`` (PNG): one heatmap per ``-seq`` row with a map (:func:`retention_map`),
    after-round down, edited-in round across, each cell the fraction of that round's edits that hold (teacher
    forced, 0–1, written in the cell). Returns ``False`` (and writes nothing) when no row has one."""
    maps = {m: retention_map(r) for m, r in payload.get("results", {}).items()}
    maps = {m: v for m, v in maps.items() if v}
    if not maps:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    # wide enough for the title over a single map; constrained layout keeps the labels inside the figure
    fig, axes = plt.subplots(
        1, len(maps), figsize=(max(5.2, 0.5 + 3.6 * len(maps)), 3.8), squeeze=False, layout="constrained"
    )
    for ax, (m, grid) in zip(axes[0], maps.items()):
        a = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
        im = ax.imshow(a, vmin=0.0, vmax=1.0, cmap="viridis", origin="upper")
        n = len(grid)
        if n <= 12:
            for j in range(n):
                for k in range(j + 1):
                    if not np.isnan(a[j, k]):
                        ax.text(
                            k,
                            j,
                            f"{a[j, k]:.2f}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white" if a[j, k] < 0.6 else "black",
                        )
        ax.set_title(m, fontsize=10)
        ax.set_xlabel("edits of round")
        ax.set_ylabel("measured after round")
        ticks = list(range(0, n, max(1, n // 10)))
        ax.set_xticks(ticks, [str(t + 1) for t in ticks])
        ax.set_yticks(ticks, [str(t + 1) for t in ticks])
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="teacher-forced rel")
    fig.suptitle("Retention map: each round's edits after every later round", fontsize=11)
    atomic_write_figure(path, fig, dpi=120)
    return True


def _round_size(row: dict) -> int | None:
    """Edits per round: a ``-seq`` row's ``seq_chunk``, a batched closed-form row's batch size (``options``)."""
    if row.get("seq_chunk"):
        return int(row["seq_chunk"])
    size = ((row.get("config") or {}).get("options") or {}).get("batch_size")
    return int(size) if size and _batches(row) else None


def final_by_round(row: dict) -> dict[str, list[float]]:
    """``{measure: [fraction of round k's edits that hold on the final model for k = 1, 2, …]}`` — measures
    ``tf_rel`` (from the row's per-edit ``tf.rel``), ``qa`` and ``chat`` (per-edit WILD verdicts), rounds being
    consecutive slices of the edits of the row's round (or batch) size, the last possibly shorter. ``{}`` for a
    row without rounds; a measure without per-edit records is left out."""
    size = _round_size(row)
    if not size:
        return {}
    per_edit = {"tf_rel": list((row.get("tf") or {}).get("rel") or [])}
    for k in ("qa", "chat"):
        per_edit[k] = [a[1] for a in ((row.get("wild") or {}).get(k) or {}).get("answers") or []]
    return {k: [fmean(map(float, v[i : i + size])) for i in range(0, len(v), size)] for k, v in per_edit.items() if v}


def landed_by_round(row: dict) -> dict[str, list[float | None]]:
    """``{measure: [fraction of round k's edits that hold right after round k for k = 1, 2, …]}`` — what each
    round landed before any later round acted, from the ``newest`` record of every round's probe (measures as in
    :func:`final_by_round`; ``None`` for a round without one); ``{}`` for a row whose probes hold none."""
    recs = [(rec or {}).get("newest") for rec in row.get("retention") or []]
    if not any(recs):
        return {}
    out = {"tf_rel": [r and r.get("tf_rel") for r in recs]}
    for k in ("qa", "chat"):
        out[k] = [r and (r.get("wild") or {}).get(k) for r in recs]
    return {k: v for k, v in out.items() if any(x is not None for x in v)}


def retention_summary(row: dict) -> dict[str, dict]:
    """Per measure of :func:`retention_series`: ``{"first": fraction after the first round, "last": after the last
    round, "kept": last / first}`` (``kept`` ``None`` where ``first`` is 0 or either is missing) — ``last`` is
    the fraction of the first round's edits that still hold after the last round, ``kept`` the share of what the
    first round achieved that survives."""
    out = {}
    for k, series in retention_series(row).items():
        first = series[0] if series else None
        last = series[-1] if series else None
        kept = last / first if first and last is not None else None
        out[k] = {"first": first, "last": last, "kept": kept}
    return out


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _round_table(
    title: str, n_rounds: int, body: list[tuple[str, str, list, list[str]]], tail_head: tuple[str, ...] = ()
) -> str:
    """A markdown section: ``title``, then a table of ``row | measure | r1 … r<n_rounds> | *tail_head*`` with one
    line per ``(row, measure, fractions per round, tail cells)`` of ``body`` (missing rounds left blank)."""
    head = ["row", "measure"] + [f"r{i + 1}" for i in range(n_rounds)] + list(tail_head)
    lines = ["", title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, label, series, tail in body:
        cells = [_fmt(v) for v in series] + [""] * (n_rounds - len(series))
        lines.append("| " + " | ".join([name, label] + cells + tail) + " |")
    return "\n".join(lines) + "\n"


def retention_table(payload: dict) -> str:
    """The markdown section on round-1 retention (``""`` when no row has one): a heading line, then a table with
    one line per ``-seq`` row and measure — the fraction of the first round's edits that hold after each round, then
    ``kept`` (after the last round over after the first round)."""
    rows = retention_rows(payload)
    if not rows:
        return ""
    res = payload["results"]
    n_rounds = max(len(retention_series(res[m])["tf_rel"]) for m in rows)
    n = next((rec.get("n") for m in rows for rec in res[m].get("retention") or [] if rec and rec.get("n")), None)
    body = []
    for m in rows:
        series, summary = retention_series(res[m]), retention_summary(res[m])
        name = m if res[m].get("retention") else f"{m} (batch 1, after each batch)"
        body += [
            (name, label, series[k], [_fmt(summary[k]["kept"])])
            for k, label in _MEASURES
            if any(v is not None for v in series[k])
        ]
    title = (
        f"Round-1 retention: the first round's {f'{n} ' if n else ''}edits measured after every round (fraction "
        "that holds; kept = after the last round over after the first round):"
    )
    return _round_table(title, n_rounds, body, ("kept (last / r1)",)) + _final_table(payload, rows)


def _final_table(payload: dict, rows: list[str]) -> str:
    """The markdown tables of :func:`landed_by_round` and :func:`final_by_round` for ``rows`` (each ``""`` when no
    row has its records): what every round landed right after it, then what of it the final model holds."""
    out = ""
    for read, title in (
        (landed_by_round, "Every round's edits right after their round (fraction that holds, oldest round first):"),
        (final_by_round, "Every round's edits on the final model (fraction that holds, oldest round first):"),
    ):
        per_row = {m: read(payload["results"][m]) for m in rows}
        per_row = {m: f for m, f in per_row.items() if f}
        if per_row:
            n_rounds = max(len(v) for f in per_row.values() for v in f.values())
            body = [(m, label, f[k], []) for m, f in per_row.items() for k, label in _MEASURES if k in f]
            out += _round_table(title, n_rounds, body)
    return out


def plot_retention(payload: dict, path: str | Path) -> bool:
    """Write the retention picture to ``path`` (PNG): one panel per measure (teacher-forced, WILD qa, WILD chat
    rel of the round-1 edits, fraction, 0–1) against the round after which it was measured, one line per
    ``-seq`` row. Returns ``False`` (and writes nothing) when no row has a retention record."""
    rows = retention_rows(payload)
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = payload["results"]
    measures = [
        (k, label) for k, label in _MEASURES if any(v is not None for m in rows for v in retention_series(res[m])[k])
    ]
    from matplotlib.ticker import MaxNLocator

    colors = {m: f"C{i % 10}" for i, m in enumerate(rows)}  # one colour per row in every panel
    fig, axes = plt.subplots(1, len(measures), figsize=(4.2 * len(measures), 3.8), sharey=True, squeeze=False)
    for ax, (k, label) in zip(axes[0], measures):
        for m in rows:
            series = retention_series(res[m])[k]
            pts = [(i + 1, v) for i, v in enumerate(series) if v is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3.5, color=colors[m])
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("after round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("round-1 edits that hold (fraction)")
    handles = [plt.Line2D([], [], color=colors[m], marker="o", ms=3.5) for m in rows]
    axes[0][0].legend(handles, rows, fontsize=8, loc="lower left")
    fig.suptitle("Round-1 retention of the sequential rows", fontsize=11)
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=120)
    return True
