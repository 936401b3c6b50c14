"""The stored comparisons of methods (`crispedit compare` folders): their summaries and the headline table."""

from __future__ import annotations

from pathlib import Path

from .common import HERE, drift_cell, load_json, minutes_cell, num_cell, paired_change, pct, rg

COMPARES = ("compare_zsre_dev100", "compare_counterfact_dev100", "compare_zsre_dev1000", "compare_counterfact_dev1000")


BREAKING_PPL_RATIO = 2.0  # crispedit.experiments.compare_table.BREAKING_PPL_RATIO (kept here: --check imports no torch)


def paired_cell(row: dict, base: dict, task: str) -> str:
    """The task's score and its paired change against the base on the same items (points, ± standard error)."""
    d, b = (row.get("capability_details") or {}).get(task), (base.get("capability_details") or {}).get(task)
    if not d:
        return "–"
    score = f"{100 * d['score']:.1f}"
    pc = paired_change(d.get("items"), (b or {}).get("items"))
    if pc is None:
        return score
    mean, se = pc
    sig = "**" if abs(mean) > 2 * se else ""
    return f"{score} ({sig}{100 * mean:+.1f} ± {100 * se:.1f}{sig})".replace("-", "−")


def _extras(r: dict) -> list[str]:
    """What a row ran beyond its method's defaults: the rounds of a sequential row, another epoch cap."""
    extra = []
    if r.get("rounds"):
        extra.append(f"{r['rounds']} rounds of {r['seq_chunk']}")
    cfg = r.get("config") or {}
    if cfg.get("epochs") not in (None, 100):
        extra.append(f"{cfg['epochs']} epochs")
    return extra


def _label(m: str, r: dict) -> str:
    """The row's method with :func:`_extras`."""
    extra = _extras(r)
    return m + (f" ({', '.join(extra)})" if extra else "")


def compare_summary(payload: dict) -> str:
    """A compact Markdown table of one stored compare: WILD / teacher-forced in percent, drift, perplexity,
    capabilities with their paired change, edit time."""
    res = payload["results"]
    base = res.get("base") or {}
    ppl0 = (base.get("summary") or {}).get("ppl")
    tasks = list(base.get("capability_details") or {})
    head = [
        "method",
        "WILD qa rel / gen",
        "chat rel / gen",
        "TF rel / gen",
        "KL drift (pred.)",
        "ppl (×base)",
        *tasks,
        "edit time",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, r in res.items():
        s, w = r.get("summary") or {}, r.get("wild") or {}
        tf = {"rel": s.get("rel"), "gen": s.get("gen")} if s.get("rel") is not None else None
        kl, pred = s.get("kl_drift"), s.get("kl_predicted")
        ppl = s.get("ppl")
        ratio = ppl / ppl0 if ppl and ppl0 else None
        ppl_cell = (
            "–"
            if ppl is None
            else num_cell(ppl, "{:.1f}") + (f" (×{num_cell(ratio, '{:.2f}')})" if ratio and m != "base" else "")
        )
        if ratio and ratio > BREAKING_PPL_RATIO:
            ppl_cell += " ✗"
        kl_cell = "0" if m == "base" else drift_cell(kl) + (f" ({drift_cell(pred)})" if pred is not None else "")
        caps = [paired_cell(r, base, t) if m != "base" else paired_cell(r, {}, t) for t in tasks]
        lines.append(
            "| "
            + " | ".join(
                [
                    _label(m, r),
                    rg(w.get("qa")),
                    rg(w.get("chat")),
                    rg(tf) if tf else "–",
                    kl_cell,
                    ppl_cell,
                    *caps,
                    "–" if m == "base" else minutes_cell(r.get("edit_seconds")),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def headline_table() -> str:
    """The README's compare table: 100 and 1 000 held-out ZsRE edits side by side, the rows both hold."""
    a = load_json(HERE / "compare_zsre_dev100" / "compare.json")["results"]
    b = load_json(HERE / "compare_zsre_dev1000" / "compare.json")["results"]
    ppl100, ppl1000 = a["base"]["summary"]["ppl"], b["base"]["summary"]["ppl"]

    def drift(r: dict, ppl0: float, m: str) -> str:
        if m == "base":
            return "0"
        kl, ppl = r["summary"]["kl_drift"], r["summary"]["ppl"]
        return drift_cell(kl) + (f" (ppl ×{ppl / ppl0:.2f} ✗)" if ppl / ppl0 > BREAKING_PPL_RATIO else "")

    lines = [
        "| method | 100 edits: WILD qa rel / gen | KL drift | edit time | 1 000 edits: WILD qa rel / gen | KL drift |",
        "|---|---|---|---|---|---|",
    ]
    for m in [m for m in a if m in b]:
        ea, eb = _extras(a[m]), _extras(b[m])
        label = (
            _label(m, a[m])
            if ea == eb
            else m + " (" + "; ".join(f"{n}: {', '.join(e)}" for n, e in (("100", ea), ("1 000", eb)) if e) + ")"
        )
        lines.append(
            f"| {label} | {rg(a[m]['wild']['qa'])} | "
            f"{drift(a[m], ppl100, m)} | {'–' if m == 'base' else minutes_cell(a[m].get('edit_seconds'))} | "
            f"{rg(b[m]['wild']['qa'])} | {drift(b[m], ppl1000, m)} |"
        )
    return "\n".join(lines) + "\n"


def replaced_rows(d: Path) -> str:
    """Rows stored beside a compare.json (a method at other settings, replaced in the table): one line each."""
    out = []
    for f in sorted(d.glob("*_row.json")):
        p = load_json(f)
        row = (
            p.get("row")
            or p.get(p.get("method", ""))
            or next((v for v in p.values() if isinstance(v, dict) and "summary" in v), None)
            or p
        )
        s, w = row.get("summary") or {}, row.get("wild") or {}
        note = p.get("note") or f"{row.get('method')} at other settings"
        out.append(
            f"- [`{f.name}`]({d.name}/{f.name}): {note}. WILD qa {rg(w.get('qa'))}, TF rel "
            f"{pct(s.get('rel'))}, KL drift {drift_cell(s.get('kl_drift'))}."
        )
    return "\n".join(out)


TITLES = {
    "compare_zsre_dev100": "100 ZsRE edits",
    "compare_counterfact_dev100": "100 CounterFact edits",
    "compare_zsre_dev1000": "1 000 ZsRE edits",
    "compare_counterfact_dev1000": "1 000 CounterFact edits",
}
