"""The compare table (``DIR/compare.md``, shaped like the paper's Table 1) and the Pareto fronts it marks.

Pareto fronts (:func:`pareto_front`, :func:`pareto_points`): edit success is the WILD qa reliability (the
paper's wrapper, never trained). The primary front is against minus the KL drift on held-out text
(``pareto.kl_front``, column ``Pareto (KL)``, the front drawn in ``compare.png``): capability scores on a
``--limit`` of items carry a sampling error of several points, the KL drift hardly any. With
``--capabilities`` a second front against capability retention — the mean over the tasks of score / base
score — is kept too (``pareto.front``, column ``Pareto (capabilities)``). An edited row is on a front when
no other candidate is at least as good on both and better on one; the unedited base is the reference, and
a row that breaks the model — held-out perplexity more than :data:`BREAKING_PPL_RATIO` × the base's
(``pareto.breaking``, ✗ in both columns, a red ✕ in the picture) — is no candidate for either front. Under the
table, each task's change against the base on the same items (paired mean difference ± its standard error,
in points) says which capability differences are larger than that error; the picture's second panel draws
them. :func:`~crispedit.experiments.compare_outputs.render_outputs` re-renders compare.md / compare.png from a
stored compare.json.
"""

from __future__ import annotations

import json

from ..curvature.predicted import prediction_notes
from ..evaluation import EVAL_WRAPPERS, HELD_OUT_WRAPPER
from ..evaluation.capabilities import paired_change
from .retention import retention_table

__all__ = [
    "compare_table",
    "pareto_front",
    "pareto_points",
    "capability_changes",
    "perplexity_ratios",
    "breaking_rows",
    "limit_text",
    "BREAKING_PPL_RATIO",
]


def limit_text(limit) -> str:
    """A stored capability item limit as words: ``"limit 250"``, ``"all items"`` or ``"ifeval 48, mmlu all"``."""
    if isinstance(limit, dict):
        return ", ".join(f"{t} {'all' if n is None else n}" for t, n in limit.items()) or "all items"
    return "all items" if limit is None else f"limit {limit}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _duration(s: float | None) -> str:
    if s is None:
        return ""
    m, sec = divmod(int(round(s)), 60)
    return f"{m}m {sec:02d}s" if m else f"{s:.1f}s"


BREAKING_PPL_RATIO = 2.0  # a row whose held-out perplexity is more than this many times the base's breaks the model


def pareto_front(points: dict[str, tuple[float | None, float | None]]) -> list[str]:
    """The names (in ``points`` order) on the Pareto front of two objectives, both to be maximised:
    ``points`` maps a name to ``(success, retention)``. A point is on the front unless another point is
    at least as high on both and strictly higher on one (equal points are all on it); a point with a
    ``None`` or NaN coordinate is never on it and dominates nothing."""

    def ok(p):
        """Whether both coordinates of ``p`` are set (not ``None``) and not NaN."""
        return all(v is not None and v == v for v in p)

    valid = {n: (float(p[0]), float(p[1])) for n, p in points.items() if ok(p)}
    return [
        n
        for n, (a, b) in valid.items()
        if not any(x >= a and y >= b and (x > a or y > b) for m, (x, y) in valid.items() if m != n)
    ]


def _retention(payload: dict, r: dict) -> float | None:
    caps = payload["settings"]["evaluation"]["capabilities"]
    if not caps:
        return -r["summary"]["kl_drift"]
    base = payload["results"].get("base", {}).get("capabilities", {})
    ratios = [r["capabilities"][c] / base[c] for c in caps if r["capabilities"].get(c) is not None and base.get(c)]
    return sum(ratios) / len(ratios) if ratios else None


def perplexity_ratios(payload: dict) -> dict[str, float]:
    """``{row: ratio}`` for each edited row: its perplexity on the held-out drift text divided by the unedited
    base's on the same text (dimensionless; 1.0 = unchanged). The base perplexity is the one measured with the
    row (``summary.ppl_base``), else the base row's ``summary.ppl``; rows without both numbers are left out."""
    res = payload["results"]
    base_row = ((res.get("base") or {}).get("summary") or {}).get("ppl")
    out = {}
    for m in payload["methods"]:
        s = (res.get(m) or {}).get("summary") or {}
        ppl, base = s.get("ppl"), s.get("ppl_base") or base_row
        if m != "base" and ppl is not None and base:
            out[m] = ppl / base
    return out


def breaking_rows(payload: dict) -> dict[str, float]:
    """``{row: perplexity ratio}`` for the edited rows that break the model: held-out perplexity more than
    :data:`BREAKING_PPL_RATIO` times the base's (:func:`perplexity_ratios`). They are not candidates for
    either Pareto front (:func:`pareto_points`)."""
    return {m: r for m, r in perplexity_ratios(payload).items() if r > BREAKING_PPL_RATIO}


def pareto_points(payload: dict) -> dict:
    """The Pareto picture of a compare payload, over the edited rows (not the unedited base)::

        {"success": label, "kl": label, "kl_front": [rows], "retention": label, "front": [rows],
         "points": {row: [success, retention]}, "breaking": {row: perplexity ratio}, "breaking_rule": text}

    Success = WILD qa rel (fraction). ``kl_front``: the front of success against minus the KL drift on
    held-out text (nats/token; 0 = unchanged), the primary one. ``front``: the front against retention = the
    mean over capability tasks of score / base score when capability tasks ran (1.0 = unchanged), else minus
    the KL drift (then the same as ``kl_front``). ``breaking``: the rows whose held-out perplexity rose more
    than :data:`BREAKING_PPL_RATIO` × the base's (:func:`breaking_rows`); they stay in ``points`` but are
    excluded from both fronts, so a model that no longer works can neither sit on a front nor push a working
    row off it. :func:`pareto_front` picks each front."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    rows = [m for m in payload["methods"] if m in res and m != "base"]
    breaking = breaking_rows(payload)
    candidates = [m for m in rows if m not in breaking]
    success = {m: (res[m]["wild"].get(HELD_OUT_WRAPPER) or {}).get("rel") for m in rows}
    points = {m: [success[m], _retention(payload, res[m])] for m in rows}
    kl = {m: (success[m], -res[m]["summary"]["kl_drift"]) for m in candidates}
    return {
        "success": f"WILD {HELD_OUT_WRAPPER} rel",
        "kl": "KL drift on held-out text (nats/token, lower is better)",
        "kl_front": pareto_front(kl),
        "retention": ("mean capability score / base score over " + ", ".join(caps))
        if caps
        else "-KL drift on held-out text (nats/token)",
        "front": pareto_front({m: tuple(points[m]) for m in candidates}),
        "points": points,
        "breaking": {m: round(r, 4) for m, r in breaking.items()},
        "breaking_rule": f"held-out perplexity more than {BREAKING_PPL_RATIO:g}x the base's: breaks the model, "
        "not a candidate for either front",
    }


def capability_changes(payload: dict) -> dict:
    """``{row: {task: [change, stderr]}}``: each edited row's change of each capability score against the
    unedited base on the same items (:func:`~crispedit.evaluation.capabilities.paired_change`), in
    percentage points; rows or tasks without per-item scores are left out."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    base = (res.get("base") or {}).get("capability_details") or {}
    out: dict = {}
    for m in payload["methods"]:
        details = (res.get(m) or {}).get("capability_details") or {}
        for c in caps:
            pc = paired_change((details.get(c) or {}).get("items"), (base.get(c) or {}).get("items"))
            if pc is not None:
                out.setdefault(m, {})[c] = [round(100 * pc[0], 2), round(100 * pc[1], 2)]
    return out


def _ppl_cell(r: dict, ratio: float | None, breaks: bool) -> str:
    ppl = r["summary"].get("ppl")
    if ppl is None:
        return "–"
    text = f"{ppl:.1f}" if ppl < 1e4 else f"{ppl:.2e}"
    if ratio is None:
        return text
    return f"{text} ({_ratio(ratio)})" + (" ✗" if breaks else "")


def _ratio(r: float) -> str:
    return f"×{r:.2f}" if r < 10 else f"×{r:.3g}"


def _assistant(r: dict, part: str, key: str):
    """One figure of a row's ``assistant`` section (:mod:`~crispedit.evaluation.assistant`), or None."""
    return ((r.get("assistant") or {}).get(part) or {}).get(key)


def _table_columns(payload: dict) -> list[tuple]:
    """The table's value columns before the drift ones, as ``(header, getter, higher_is_better)``: WILD rel and
    gen per context (the held-out wrapper's name upper-cased), teacher-forced rel and gen, one column per
    capability task, then the chat measures (``higher_is_better`` None: never bold): the style drift's answer
    length over the base's (a ratio) and the share of long answers turned bare, and the subject bleed (the share
    of other questions about an edited subject answered with its new target). Each getter maps a result row to
    its stored score (a fraction in [0, 1], shown in percent; the ratio as ×) or None where the row has none."""
    caps = payload["settings"]["evaluation"]["capabilities"]
    wrappers = payload["settings"]["evaluation"].get("wild") or list(EVAL_WRAPPERS)
    cols = [
        (
            f"{w.upper() if w == HELD_OUT_WRAPPER else w} {k}",
            (lambda wrapper, key: lambda r: (r["wild"].get(wrapper) or {}).get(key))(w, k),
            True,
        )
        for w in wrappers
        for k in ("rel", "gen")
    ]
    cols += [("TF rel", lambda r: r["summary"].get("rel"), True), ("TF gen", lambda r: r["summary"].get("gen"), True)]
    cols += [(c, (lambda task: lambda r: r["capabilities"].get(task))(c), True) for c in caps]
    cols += [
        ("chat len", lambda r: _assistant(r, "style", "length_ratio"), None),
        ("chat bare", lambda r: _assistant(r, "style", "bare_share"), None),
        ("bleed", lambda r: _assistant(r, "bleed", "target"), None),
    ]
    return cols


def _pareto_mark(m: str, front: list[str], breaking: dict) -> str:
    """The Pareto cell of row ``m`` for ``front``: – for the base, ✗ for a breaking row, ★ on the front."""
    return "–" if m == "base" else "✗" if m in breaking else "★" if m in front else ""


def _table_row(
    m: str, r: dict, cols: list[tuple], edited: list[dict], ratio: float | None, pareto: dict, caps: list[str]
) -> str:
    """The markdown table line of row ``m`` (result ``r``): its name, each of ``cols`` in percent (bold, for an
    edited row, where within 5 % (relative) of the best of the ``edited`` rows), KL drift and its prediction
    (nats/token), perplexity with its ``ratio`` to the base's, edit and curvature time, peak memory (MiB, with
    its rise) and the Pareto marks (the capability one only with ``caps``)."""
    cells = [m if m != "base" else "base (unedited)"]
    for head, get, higher in cols:
        v = get(r)
        if higher is None:
            cells.append("–" if v is None else f"×{v:.2f}" if head == "chat len" else _pct(v))
            continue
        best = max((x for x in (get(e) for e in edited) if x is not None), default=None)
        text = _pct(v)
        if m != "base" and v is not None and best is not None and best > 0 and v >= 0.95 * best:
            text = f"**{text}**"
        cells.append(text)
    mem = r.get("memory") or {}
    peak = (
        ""
        if not mem
        else (
            f"{mem['peak_mib']:.0f} (+{mem['increase_mib']:.0f})"
            if mem.get("peak_mib")
            else f"+{mem['increase_mib']:.0f}"
        )
    )
    pred = r["summary"].get("kl_predicted")
    cells += [
        f"{r['summary']['kl_drift']:.5f}",
        "–" if pred is None else f"{pred:.5f}",
        _ppl_cell(r, ratio, m in pareto["breaking"]),
        _duration(r.get("edit_seconds")),
        _duration(r.get("cache_seconds")) if r.get("cache_seconds") else "",
        peak,
        _pareto_mark(m, pareto["kl_front"], pareto["breaking"]),
    ]
    if caps:
        cells.append(_pareto_mark(m, pareto["front"], pareto["breaking"]))
    return "| " + " | ".join(cells) + " |"


def _fronts_line(pareto: dict, caps: list[str]) -> str:
    """The paragraph under the table naming the rows on the KL front, on the capability front (only with
    ``caps``) and the breaking rows with their perplexity ratios to the base's."""
    breaking = pareto["breaking"]
    return (
        "\nPareto front against KL drift (Pareto (KL) ★): "
        + (", ".join(pareto["kl_front"]) or "none")
        + (
            ". Pareto front against capability retention (Pareto (capabilities) ★): "
            + (", ".join(pareto["front"]) or "none")
            if caps
            else ""
        )
        + ". Breaking the model (✗: held-out perplexity more than "
        f"{BREAKING_PPL_RATIO:g}× the base's; on neither front): "
        + (", ".join(f"{m} ({_ratio(v)})" for m, v in breaking.items()) or "none")
        + ".\n"
    )


def _settings_note(payload: dict, edited: list[dict], pareto: dict) -> str:
    """The note under the fronts: model, number of edits and their sources, what each column measures (and
    in which unit), the capability tasks' item limit, how peak memory was measured (from the first of the
    ``edited`` rows that recorded it) and what each Pareto column means."""
    s = payload["settings"]
    caps = s["evaluation"]["capabilities"]
    return (
        f"\n{s['model']} · {s['n_edits']} edits {json.dumps(s['edits'])} · WILD rule judge (qa = the paper's "
        "wrapper, never trained) · TF = teacher-forced · KL drift = mean per-token KL(base‖edited) on held-out "
        "text (nats) · KL pred = the K-FAC prediction ½·Σ tr(ΔWᵀSΔWA) from the capability factors"
        " · ppl = perplexity on the same held-out text (×base: over the unedited model's)"
        + (f" · capabilities: lm-eval, {limit_text(s['evaluation'].get('limit'))}" if caps else "")
        + f" · peak memory: {next((r['memory']['measure'] for r in edited if r.get('memory')), '–')}"
        + f" · Pareto (KL) ★: on the front of edit success ({pareto['success']}) vs KL drift on held-out text "
        "among the edited rows that do not break the model"
        + (f" · Pareto (capabilities) ★: the same against capability retention ({pareto['retention']})" if caps else "")
        + "\n"
    )


def _crosstalk_note(res: dict, rows: list[str]) -> str:
    """The note on the ``rows`` whose WILD wrappers carry ``cross`` (:func:`~crispedit.evaluation.wild.crosstalk`):
    per row, the percent of edits answered with another edit's target, wrapper by wrapper — the base row's is the
    level common answers reach by chance; empty when no row has it."""
    cells = []
    for m in rows:
        wild = res[m].get("wild") or {}
        got = [(c, w["cross"]) for c, w in wild.items() if isinstance(w, dict) and w.get("cross") is not None]
        if got:
            cells.append(
                f"{m}: " + " / ".join(f"{v * 100:.1f}" for _, v in got) + " (" + " / ".join(c for c, _ in got) + ")"
            )
    if not cells:
        return ""
    return (
        "\nCrosstalk (WILD reliability answers that miss their own target and give another edit's, percent of "
        "edits; the base row's is chance): " + "; ".join(cells) + "\n"
    )


def _row_notes(payload: dict, rows: list[str]) -> str:
    """The notes on single ``rows`` after the settings note, each a paragraph present only where it applies:
    the paired capability change against the base (points ± standard error, with the items per task;
    :func:`capability_changes`), the crosstalk of each row's WILD wrappers (:func:`_crosstalk_note`), the ``-seq``
    rows' rounds, chunk size and mean seconds per round, and the drift prediction's notes
    (:func:`~crispedit.curvature.predicted.prediction_notes`). Empty when none apply."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    note = ""
    changes = capability_changes(payload)
    if changes:
        n_items = {
            c: len(((res["base"].get("capability_details") or {}).get(c) or {}).get("items") or []) for c in caps
        }
        note += (
            "\nCapability change against the base on the same items (paired mean difference ± standard "
            "error, points; "
            + ", ".join(f"{c}: {n_items[c]} items" for c in caps if n_items[c])
            + "): "
            + "; ".join(
                f"{m}: " + ", ".join(f"{c} {d:+.1f} ± {e:.1f}" for c, (d, e) in ch.items()) for m, ch in changes.items()
            )
            + "\n"
        )
    note += _crosstalk_note(res, rows)
    seq = [(m, res[m]) for m in rows if "rounds" in res[m]]
    if seq:
        note += (
            "\nSequential rows (the method in rounds of consecutive edits, each round from the previous "
            "round's weights; the final model evaluated on all edits): "
            + "; ".join(
                f"{m}: {r['rounds']} rounds of {r['seq_chunk']}, "
                f"{sum(r['round_seconds']) / len(r['round_seconds']):.1f}s per round"
                for m, r in seq
            )
            + "\n"
        )
    pred_notes = [(m, line) for m in rows for line in prediction_notes(res[m]["summary"])]
    if pred_notes:
        note += (
            "\nDrift prediction notes (a steep layer dominates it, or attention mixes what it models): "
            + "; ".join(f"{m}: {line}" for m, line in pred_notes)
            + "\n"
        )
    return note


def compare_table(payload: dict) -> str:
    """The markdown table (the paper's Table 1 shape): WILD rel / gen per context, teacher-forced
    rel / gen, capability scores (all in percent), KL drift and its K-FAC prediction (nats/token), held-out
    perplexity with its ratio to the base's (✗: more than :data:`BREAKING_PPL_RATIO` ×, the row breaks the
    model), edit time (+ curvature time), peak memory (MiB), then ``Pareto (KL)`` (★ for the rows on the front
    of edit success against KL drift, :func:`pareto_points` ``kl_front``) and, with capability tasks,
    ``Pareto (capabilities)`` (the front against capability retention); a breaking row shows ✗ in both, as
    it is no candidate. Per column the best edited method and those within 5 % (relative) of it are in bold.
    A line under the table names the rows on each front, the KL front first, and the breaking rows; notes
    give each row's paired capability change against the base (:func:`capability_changes`, where per-item
    scores were kept), the ``-seq`` rows' rounds, chunk size and mean time per round, and the drift
    prediction's notes per row (:func:`~crispedit.curvature.predicted.prediction_notes`: steep layers,
    attention q/k/v layers), and the ``-seq`` rows' round-1 retention after every round and every round's edits
    on the final model (:func:`~crispedit.experiments.retention.retention_table`)."""
    res = payload["results"]
    caps = payload["settings"]["evaluation"]["capabilities"]
    rows = [m for m in ["base"] + list(payload["methods"]) if m in res]
    cols = _table_columns(payload)
    edited = [res[m] for m in rows if m != "base"]
    head = (
        ["method"]
        + [c[0] for c in cols]
        + ["KL drift", "KL pred", "ppl (×base)", "edit time", "curvature", "peak mem MiB (+rise)", "Pareto (KL)"]
        + (["Pareto (capabilities)"] if caps else [])
    )
    pareto = pareto_points(payload)
    ratios = perplexity_ratios(payload)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [_table_row(m, res[m], cols, edited, ratios.get(m), pareto, caps) for m in rows]
    return (
        "\n".join(lines)
        + "\n"
        + _fronts_line(pareto, caps)
        + _settings_note(payload, edited, pareto)
        + _row_notes(payload, rows)
        + retention_table(payload)
    )
