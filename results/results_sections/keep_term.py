"""The chat-style remedy: the preservation term and the answer end, before and after, with their marks."""

from __future__ import annotations

from pathlib import Path

from .common import HERE, load_json, paired_change, pct, rg, run_line
from .compares import paired_cell

CHAT_STYLE = HERE / "chat_style_zsre_dev400_32"
CHAT_STYLE_HELDOUT = HERE / "chat_style_zsre_dev100_32"


def chat_style_table(d: Path = CHAT_STYLE) -> str:
    """From a directory of edit reports and its ``run.json`` (``runs``: report file -> what was run): per run, WILD
    qa / chat rel / gen, teacher-forced rel, KL drift, the chat style measures (answer length over the base's, the
    share of long answers turned bare, KL on the base's own answers) and the subject bleed, then the epochs."""
    runs = load_json(d / "run.json")["runs"]
    lines = [
        "| run | WILD qa | WILD chat | TF rel | KL drift | chat length (× base) | turned bare | answer KL | "
        "subject bleed | epochs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, what in runs.items():
        r = load_json(d / name)
        s, w, a = r["summary"], r.get("wild") or {}, r.get("assistant") or {}
        st, bl = a.get("style") or {}, a.get("bleed") or {}
        lines.append(
            f"| {what} | {rg(w.get('qa'))} | {rg(w.get('chat'))} | {pct(s.get('rel'))} | "
            f"{s['kl_drift']:.5f} | ×{st['length_ratio']:.2f} | {pct(st['bare_share'])} | "
            f"{st['answer_kl']:.3f} | {pct(bl.get('target'))} | {r['training']['epochs']} |"
        )
    return "\n".join(lines) + "\n"


KEEP_100 = HERE / "keep_zsre_dev100_100"
KEEP_100_CF = HERE / "keep_counterfact_dev100_100"
KEEP_ROWS = ("crispedit", "ft", "adam-nscl", "alphaedit")  # the rows of the compares before and after, when stored


def style_of(r: dict) -> tuple[dict, dict]:
    """``(style drift, subject bleed)`` of a compare row's assistant measures (empty dicts without them)."""
    a = r.get("assistant") or {}
    return a.get("style") or {}, a.get("bleed") or {}


def _keep_runs(d: Path) -> list[tuple[str, dict]]:
    """The compare payloads of a before/after directory, in the order its ``run.json`` lists them under ``runs``
    (file -> what its rows ran with): the first before the remedy, the last at today's defaults."""
    return [(name, load_json(d / name)["results"]) for name in load_json(d / "run.json")["runs"]]


def _row_settings(r: dict, name: str) -> str:
    """What a fine-tuning row of a before/after run trained with, from its own config: the preservation term or none,
    and the answer end; a closed-form row, which trains neither, is named by its run's file ``name``."""
    c = r.get("config") or {}
    if not _trains(r):
        return f"closed form ({name})"
    term = "the term" if c.get("keep_chat") or c.get("keep_subject") else "no term"
    end = "the period answer end" if c.get("answer_end") == "period" else "the chat turn's end"
    return f"{term}, {end}"


def _trains(r: dict) -> bool:
    """Whether a compare row is a fine-tuning method's: its config holds the training contexts' settings and its
    training record is not a single-pass editor's (``single_pass``, as AlphaEdit, MEMIT and the others write)."""
    return "keep_chat" in (r.get("config") or {}) and not (r.get("training") or {}).get("single_pass")


def keep_table(d: Path = KEEP_100) -> str:
    """From the compare payloads of ``d`` (:func:`_keep_runs`: the same edits before the remedy, at today's
    defaults and any step between): per method row, WILD qa / chat, teacher-forced rel, KL drift, the chat style
    measures, the subject bleed (target in the answer / changed at all) and IFEval with its paired change against
    the base; the last run's rows in bold."""
    runs = _keep_runs(d)
    lines = [
        "| row | WILD qa | WILD chat | TF rel | KL drift | chat length (× base) | turned bare | answer KL | "
        "bleed: target / changed | IFEval | epochs |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first = runs[0][1]
    rows = [("base", first["base"], first["base"])]
    for k, (run, res) in enumerate(runs):
        bold = "**" if k == len(runs) - 1 else ""
        rows += [(f"{bold}{m}, {_row_settings(res[m], run)}{bold}", res[m], res["base"]) for m in KEEP_ROWS if m in res]
    for name, r, base in rows:
        s, w = r["summary"], r.get("wild") or {}
        st, bl = style_of(r)
        style = f"×{st['length_ratio']:.2f} | {pct(st['bare_share'])} | {st['answer_kl']:.3f}" if st else "– | – | –"
        bleed = f"{pct(bl.get('target'))} / {pct(bl.get('changed'))}" if bl else "–"
        epochs = (r.get("training") or {}).get("epochs", "–") if _trains(r) else "–"
        lines.append(
            f"| {name} | {rg(w.get('qa'))} | {rg(w.get('chat'))} | {pct(s.get('rel'))} | {s['kl_drift']:.5f} | "
            f"{style} | {bleed} | {paired_cell(r, base if r is not base else {}, 'ifeval')} | {epochs} |"
        )
    return "\n".join(lines) + "\n"


def mark_cell(ok: bool) -> str:
    """A mark's verdict cell: ``met`` or a bold ``not met``."""
    return "met" if ok else "**not met**"


def _turned(w0: dict, w: dict, wrapper: str) -> str:
    """``": L edits lost, G gained"``: of the same edits under ``wrapper``, how many the ``before`` run's WILD
    answers (``w0``) reached and the ``after`` run's (``w``) do not, and the reverse — the paired view of a change in
    reach; empty when the two runs do not hold the same number of per-edit answers."""
    a0, a = (w0.get(wrapper) or {}).get("answers") or [], (w.get(wrapper) or {}).get("answers") or []
    if not a or len(a) != len(a0):
        return ""
    lost = sum(bool(x[1]) and not y[1] for x, y in zip(a0, a))
    gained = sum(bool(y[1]) and not x[1] for x, y in zip(a0, a))
    return f": {lost} edit{'s' * (lost != 1)} lost, {gained} gained"


def keep_marks(before: dict, after: dict, base: dict | None = None) -> str:
    """The marks of the chat-style remedy, figure by figure, for one edit set: ``before`` and ``after`` are the
    same method's rows (edit reports or compare rows) before the remedy and at today's defaults, ``base`` the
    unedited model's compare row (IFEval's paired change; ``None`` where the runs have no IFEval)."""
    st, bl = style_of(after)
    st0, _ = style_of(before)
    w, w0 = after.get("wild") or {}, before.get("wild") or {}
    rows = [
        (
            "chat answer length within [0.9, 1.1] × the base's",
            f"×{st['length_ratio']:.2f} (before: ×{st0['length_ratio']:.2f})",
            0.9 <= st["length_ratio"] <= 1.1,
        ),
        ("subject bleed (target in the answer) ≤ 5 %", f"{pct(bl['target'])} %", bl["target"] <= 0.05),
    ]
    for wrapper in ("qa", "chat"):
        a, b = (w.get(wrapper) or {}).get("rel"), (w0.get(wrapper) or {}).get("rel")
        rows.append(
            (
                f"WILD {wrapper} rel within 3 points of before",
                f"{pct(a)} % (before: {pct(b)} %; {100 * (a - b):+.0f} points{_turned(w0, w, wrapper)})".replace(
                    "-", "−"
                ),
                a >= b - 0.03,
            )
        )
    k, k0 = after["summary"]["kl_drift"], before["summary"]["kl_drift"]
    rows.append(("KL drift ≤ 1.2 × before's", f"{k:.5f} (before: {k0:.5f}; ×{k / k0:.2f})", k <= 1.2 * k0))
    if base is not None:
        x = ((after.get("capability_details") or {}).get("ifeval") or {}).get("items")
        pc = paired_change(x, ((base.get("capability_details") or {}).get("ifeval") or {}).get("items"))
        if pc is not None:
            mean, se = pc
            rows.append(
                (
                    "IFEval within paired noise of the base (change within 2 standard errors)",
                    f"{100 * mean:+.1f} ± {100 * se:.1f} points on {len(x)} items".replace("-", "−"),
                    abs(mean) <= 2 * se,
                )
            )
    out = ["| mark | measured | |", "|---|---|---|"]
    out += [f"| {what} | {val} | {mark_cell(ok)} |" for what, val, ok in rows]
    return "\n".join(out) + "\n"


def keep_marks_32() -> str:
    """The marks on the 32 held-out edits: crispedit's defaults (the preservation term, the period answer end)
    against no term and the chat turn's end."""
    return keep_marks(load_json(CHAT_STYLE_HELDOUT / "defaults.json"), load_json(CHAT_STYLE_HELDOUT / "period.json"))


def keep_marks_100(d: Path = KEEP_100) -> str:
    """The marks on 100 held-out edits: crispedit's row in the last run of ``d`` (:func:`_keep_runs`) against its row
    in the first, IFEval against the last run's base."""
    runs = _keep_runs(d)
    before, after = runs[0][1], runs[-1][1]
    return keep_marks(before["crispedit"], after["crispedit"], after["base"])


def keep_100_section(d: Path, dataset: str) -> str:
    """The results page's section on the remedy at 100 held-out edits of ``dataset`` (the directory ``d``, its runs
    in ``run.json`` order: :func:`_keep_runs`), with the marks once it holds a run after the first; empty while
    ``d`` is not stored."""
    if not (d / "run.json").exists():
        return ""
    runs = load_json(d / "run.json")["runs"]
    listed = "; ".join(f"`{name}`: {label}" for name, label in runs.items())
    marks = (
        f"\nMarks, crispedit's last row against its first; for reach, also the same edits paired:\n\n"
        f"{keep_marks_100(d)}"
        if len(runs) > 1
        else ""
    )
    return f"""## The remedy at 100 edits: {dataset}

[`{d.name}/`]({d.name}/run.json): 100 {dataset} dev edits (100–199) that no setting was tuned on,
through `crispedit compare` with IFEval on 48 items. Its runs, in order: {listed}.
Columns as above, bleed also as the share of subject questions whose answer changed at all, IFEval in percent with
its paired change against the base (** where it passes two standard errors).
{run_line(d)}

{keep_table(d)}{marks}
"""


def keep_block() -> str:
    """The README's table of the preservation term at 100 held-out edits, with its marks."""
    return (
        keep_table()
        + "\nMarks, crispedit's last row against its first "
        + "([all of it](results/README.md#the-remedy-at-100-edits-zsre)):\n\n"
        + keep_marks_100()
    )
