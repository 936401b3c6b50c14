"""Sequential editing: the tuning stream, the pilots of full-size rounds and the rule that picks among them, the room a
stream leaves, and the stored streams (the confirming stream, with its marks, and the paper's scale on CounterFact) with
their retention maps."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

from .common import HERE, ROOT, drift_cell, load_json, pct, run_line
from .keep_term import KEEP_100, mark_cell, style_of

SEQ_TUNING = HERE / "seq_tuning_zsre_dev100"
SEQ_WRAPPERS = ("qa", "chat", "none")


SEQ_MATCH = ("contexts", "answer_end", "keep_chat", "keep_subject", "keep_weight", "keep_tokens")  # must agree


def _other_defaults(batch: dict, seq: dict) -> list[str]:
    """The :data:`SEQ_MATCH` settings a batch row's config and a sequential row's edit config differ in."""
    want = seq["config"]["edit"]
    return [k for k in SEQ_MATCH if batch["config"].get(k) != want.get(k)]


def seq_batch_row(seq: dict) -> tuple[str, dict] | None:
    """Batch crispedit's row on the tuning stream's edits at the defaults the sequential row ``seq`` ran under (the
    training contexts, answer end and preservation term of its edit config): ``(file name, row)`` of the last
    matching run of ``keep_zsre_dev100_100/``, or ``None`` while none is stored."""
    match = None
    for name in load_json(KEEP_100 / "run.json")["runs"]:
        row = load_json(KEEP_100 / name)["results"].get("crispedit")
        if row is not None and not _other_defaults(row, seq):
            match = (name, row)
    return match


def _kept(record: dict) -> float:
    """The mean over the edited layers of a round record's kept fraction of directions."""
    kept = record.get("projector_kept") or {}
    return sum(kept.values()) / len(kept) if kept else float("nan")


def _assistant_cells(r: dict) -> str:
    """A row's chat length (× the base's) and subject bleed (target in the answer, percent) as two table cells."""
    st, bl = style_of(r)
    return f"×{st['length_ratio']:.2f} | {pct(bl['target'])} %" if st and bl else "– | –"


SEQ_HEADER = (
    "| row | WILD qa / chat / none rel | TF rel | round 1 kept: TF / qa / chat | kept directions, first → last round "
    "| KL drift (× batch) | chat length | bleed | hours |\n|---|---|---|---|---|---|---|---|---|\n"
)


def _batch_line(label: str, batch: dict) -> str:
    """A batch row of :data:`SEQ_HEADER`'s table: reach, teacher-forced rel, drift, the chat measures and hours."""
    return (
        f"| {label} | "
        + " / ".join(f"{batch['wild'][w]['rel']:.2f}" for w in SEQ_WRAPPERS)
        + f" | {batch['summary']['rel']:.2f} | | | {drift_cell(batch['summary']['kl_drift'])} | "
        + f"{_assistant_cells(batch)} | {_hours(batch)} |"
    )


def _hours(row: dict) -> str:
    """A row's edit time in hours (``edit_seconds``, resumed runs' seconds included), or blank without one."""
    return f"{row['edit_seconds'] / 3600:.2f}" if "edit_seconds" in row else ""


def _seq_line(label: str, r: dict, batch: dict | None) -> str:
    """A sequential row of :data:`SEQ_HEADER`'s table: WILD rel per wrapper and teacher-forced rel over all edits,
    round 1's edits after the last round as a share of what they read after round 1 (teacher-forced / QA wrapper /
    chat), the mean kept fraction of directions in the first and last round (– for a row without a projector), KL
    drift as a multiple of ``batch``'s (batch crispedit on the same edits at the same defaults; – without one), the
    chat answers' length and subject bleed, and the edit's hours."""
    first, last = r["retention"][0], r["retention"][-1]
    held = [last["tf_rel"] / first["tf_rel"] if first["tf_rel"] else float("nan")]
    held += [last["wild"][w] / first["wild"][w] if first["wild"].get(w) else float("nan") for w in ("qa", "chat")]
    recs = r["round_records"]
    k0, k1 = _kept(recs[0]), _kept(recs[-1])
    kept = "–" if k0 != k0 or (k0 == 1.0 and k1 == 1.0) else f"{k0:.2f} → {k1:.2f}"
    drift = r["summary"]["kl_drift"]
    times = "–" if batch is None else f"×{drift / batch['summary']['kl_drift']:.2f}"
    return (
        f"| {label} | "
        + " / ".join(f"{r['wild'][w]['rel']:.2f}" for w in SEQ_WRAPPERS)
        + f" | {r['summary']['rel']:.2f} | "
        + " / ".join(f"{h:.2f}" for h in held)
        + f" | {kept} | {drift_cell(drift)} ({times}) | {_assistant_cells(r)} | {_hours(r)} |"
    )


def seq_tuning_table(d: Path = SEQ_TUNING) -> str:
    """One row per stored sequential setting under ``d`` (a compare JSON with a ``crispedit-seq`` row, named by the
    setting; :func:`_seq_line`) beside batch crispedit on the same edits at the same defaults
    (:func:`seq_batch_row`), each batch row once, before the rows read against it."""
    files = sorted(f for f in d.glob("*.json") if f.name != "run.json") if d.is_dir() else []
    if not files:
        return ""
    lines = [SEQ_HEADER.rstrip("\n")]
    shown: set[str] = set()
    for f in files:
        r = load_json(f)["results"]["crispedit-seq"]
        matched = seq_batch_row(r)
        if matched is not None and matched[0] not in shown:
            name, batch = matched
            shown.add(name)
            lines.append(_batch_line(f"batch crispedit ([`{name}`](keep_zsre_dev100_100/{name}))", batch))
        lines.append(
            _seq_line(f"[`{f.stem}`](seq_tuning_zsre_dev100/{f.name})", r, None if matched is None else matched[1])
        )
    return "\n".join(lines) + "\n"


def seq_marks(batch: dict, seq: dict) -> str:
    """The sequential mode's marks, figure by figure, for one stream: ``seq`` a compare's ``crispedit-seq`` row,
    ``batch`` batch crispedit's row on the same edits at the same defaults. Reach per wrapper within 0.05 of batch's,
    teacher-forced rel at least 0.95, round 1's edits after the last round at least 0.9 of what they read after round
    1 (teacher-forced, QA wrapper, chat), KL drift at most 1.5 × batch's, perplexity at most 1.2 × the base's; and the
    rounds' edit times, which the session bounds by construction (docs/sessions.md), as measured."""
    rows = []
    for w in SEQ_WRAPPERS:
        a, b = seq["wild"][w]["rel"], batch["wild"][w]["rel"]
        rows.append(
            (
                f"WILD {w} rel within 0.05 of batch's",
                f"{a:.2f} (batch {b:.2f}; {a - b:+.2f})".replace("-", "−"),
                a >= b - 0.05,
            )
        )
    tf = seq["summary"]["rel"]
    rows.append(("teacher-forced rel ≥ 0.95", f"{tf:.2f}", tf >= 0.95))
    first, last = seq["retention"][0], seq["retention"][-1]
    for name, a, b in (
        ("teacher-forced", last["tf_rel"], first["tf_rel"]),
        ("QA-wrapper", last["wild"].get("qa"), first["wild"].get("qa")),
        ("chat", last["wild"].get("chat"), first["wild"].get("chat")),
    ):
        held = a / b if a is not None and b else None
        rows.append(
            (
                f"round 1's edits keep ≥ 0.9 of their {name} rel after round {len(seq['round_records'])}",
                "–" if held is None else f"{held:.2f} ({a:.2f} of {b:.2f})",
                held is not None and held >= 0.9,
            )
        )
    k, kb = seq["summary"]["kl_drift"], batch["summary"]["kl_drift"]
    rows.append(("KL drift ≤ 1.5 × batch's", f"{drift_cell(k)} (batch {drift_cell(kb)}; ×{k / kb:.2f})", k <= 1.5 * kb))
    ppl, ppl0 = seq["summary"]["ppl"], seq["summary"]["ppl_base"]
    rows.append(("perplexity ≤ 1.2 × the base's", f"{ppl:.2f} (base {ppl0:.2f}; ×{ppl / ppl0:.3f})", ppl <= 1.2 * ppl0))
    out = ["| mark | measured | |", "|---|---|---|"]
    out += [f"| {what} | {val} | {mark_cell(ok)} |" for what, val, ok in rows]
    secs = [r["edit_seconds"] / 60 for r in seq["round_records"]]
    out.append(
        f"| a round's time bounded however many rounds came before (by construction: docs/sessions.md) | "
        f"round 1 {secs[0]:.0f} min, last {secs[-1]:.0f} min, longest {max(secs):.0f} min, median "
        f"{statistics.median(secs):.0f} min | stated |"
    )
    return "\n".join(out) + "\n"


def seq_tuning_marks(name: str = "full.json") -> str:
    """:func:`seq_marks` of the tuning stream's row ``name`` against its batch row (:func:`seq_batch_row`)."""
    seq = load_json(SEQ_TUNING / name)["results"]["crispedit-seq"]
    matched = seq_batch_row(seq)
    return "" if matched is None else seq_marks(matched[1], seq)


def seq_tuning_section() -> str:
    """The results page's section on tuning the sequential mode, when its runs are stored."""
    table = seq_tuning_table()
    if not table:
        return ""
    return f"""## Tuning the sequential mode

[`seq_tuning_zsre_dev100/`](seq_tuning_zsre_dev100/run.json): crispedit-seq in five rounds of 20 on the tuning slice
ZsRE dev 100–199 (not the confirming stream's edits), one setting changed from the session defaults per row, beside
batch crispedit with the same defaults on the same 100 edits. {run_line(SEQ_TUNING)}

{table}
The marks on the tuning stream's default setting (`full`), against batch crispedit on the same edits (the marks are
judged on the confirming stream, ZsRE dev 1000–1999; this is what tuning read):

{seq_tuning_marks()}
"""


SEQ_PILOT = HERE / "seq_pilot_zsre_dev200"


PILOT_LANDS = 0.05  # check 1: every later round's own QA-wrapper reach within this of round 1's right after it
PILOT_KEEPS = 0.9  # check 2: round 1's edits keep this share of their TF, QA and chat reach after the last round


def pilot_checks(row: dict) -> tuple[int, str]:
    """The rule a pilot stream is read by (written before the pilots ran), for a ``crispedit-seq`` row: check 1,
    every later round's own edits read the QA wrapper on the final model within :data:`PILOT_LANDS` of round 1's
    edits right after round 1; check 2, round 1's edits keep at least :data:`PILOT_KEEPS` of their teacher-forced,
    QA-wrapper and chat reach after the last round. ``(checks met, a cell saying which)``."""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.retention import final_by_round  # torch-free

    first, last = row["retention"][0], row["retention"][-1]
    later = final_by_round(row)["qa"][1:]
    lands = all(x >= first["wild"]["qa"] - PILOT_LANDS for x in later)
    keeps = all(
        b >= PILOT_KEEPS * a
        for a, b in (
            (first["tf_rel"], last["tf_rel"]),
            (first["wild"]["qa"], last["wild"]["qa"]),
            (first["wild"]["chat"], last["wild"]["chat"]),
        )
    )
    mark = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    return int(lands) + int(keeps), f"1 {mark(lands)}, 2 {mark(keeps)}"


def pilot_choice(rows: dict[str, dict]) -> str | None:
    """The setting the pilot rule picks among ``rows`` (setting name -> its ``crispedit-seq`` row), written before
    the rows ran: the one meeting more of :func:`pilot_checks`; on a tie, the one with the higher mean all-edit
    WILD reach over :data:`SEQ_WRAPPERS` (what the confirming stream is held to against batch); ``None`` for fewer
    than two rows (nothing to choose between)."""
    if len(rows) < 2:
        return None
    return max(
        sorted(rows),
        key=lambda n: (pilot_checks(rows[n])[0], _mean_reach(rows[n])),
    )


def _seq_setting(config: dict) -> str:
    """A sequential row's settings the pilots vary, in words: the edit γ, and a weighting other than ``each``, edit
    factors at the target's positions only, a fresh Adam each round or a replay of earlier edits where the row ran
    with them."""
    words = [f"edit γ {config['edit_gamma']:g}"]
    if config.get("weighting", "each") != "each":
        words.append(f"weighting {config['weighting']}")
    if config.get("edit_factors", "full") != "full":
        words.append(f"edit factors at the {config['edit_factors']} positions")
    if config.get("carry_optimizer") is False:
        words.append("a fresh Adam each round")
    if config.get("replay"):
        words.append(f"{config['replay']} earlier edits replayed each round")
    return ", ".join(words)


def seq_pilot_table(d: Path = SEQ_PILOT) -> str:
    """One row per stored stream of rounds of the confirming stream's size under ``d`` (a compare JSON with a
    ``crispedit-seq`` row, named by its setting): round 1's edits right after round 1 (what a batch edit
    of that size lands, with the capability constraint alone) and after the last round (teacher-forced / QA wrapper /
    chat), every round's edits on the final model under the QA wrapper
    (:func:`crispedit.experiments.retention.final_by_round`), reach over all edits, the kept fraction of directions
    in the first and last round, KL drift and the edit's hours; empty while none is stored."""
    files = sorted(f for f in d.glob("*.json") if f.name != "run.json") if d.is_dir() else []
    if not files:
        return ""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.retention import final_by_round  # torch-free

    lines = [
        "| setting | round 1 after round 1: TF / qa / chat | round 1 after the last: TF / qa / chat "
        "| each round on the final model: qa | all edits: WILD qa / chat / none | kept directions, first → last "
        "| KL drift | hours | checks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = {f.stem: load_json(f)["results"]["crispedit-seq"] for f in files}
    for f in files:
        r = rows[f.stem]
        first, last = r["retention"][0], r["retention"][-1]
        held = lambda rec: f"{rec['tf_rel']:.2f} / {rec['wild']['qa']:.2f} / {rec['wild']['chat']:.2f}"  # noqa: E731
        qa = " · ".join(f"{x:.2f}" for x in final_by_round(r)["qa"])
        recs = r["round_records"]
        lines.append(
            f"| [`{f.stem}`]({d.name}/{f.name}) | {held(first)} | {held(last)} | {qa} | "
            + " / ".join(f"{r['wild'][w]['rel']:.2f}" for w in SEQ_WRAPPERS)
            + f" | {_kept(recs[0]):.2f} → {_kept(recs[-1]):.2f} | {drift_cell(r['summary']['kl_drift'])} | "
            + f"{r['edit_seconds'] / 3600:.2f} | {pilot_checks(r)[1]} |"
        )
    chosen = pilot_choice(rows)
    if chosen is not None:
        lines += [
            "",
            f"The rule picks `{chosen}` ({_seq_setting(rows[chosen]['config'])}). {_pick_reason(rows, chosen)}",
        ]
        paired = _paired_later(rows, chosen)
        lines += [paired] if paired else []
    return "\n".join(lines) + "\n"


def _mean_reach(row: dict) -> float:
    """A pilot row's tie-break: its mean all-edit WILD reach over :data:`SEQ_WRAPPERS`."""
    return sum(row["wild"][w]["rel"] for w in SEQ_WRAPPERS) / len(SEQ_WRAPPERS)


def _pick_reason(rows: dict[str, dict], chosen: str) -> str:
    """Why :func:`pilot_choice` took ``chosen``: more checks met than every other setting, or as many as some and the
    higher mean reach over all edits (the tie-break), with the figures it compared."""
    met = pilot_checks(rows[chosen])[0]
    tied = [n for n in sorted(rows) if n != chosen and pilot_checks(rows[n])[0] == met]
    if not tied:
        return f"It meets more of the checks ({met} of 2) than every other setting."
    against = ", ".join(f"{_mean_reach(rows[n]):.2f} (`{n}`)" for n in tied)
    return (
        f"It meets as many of the checks ({met} of 2) as {', '.join(f'`{n}`' for n in tied)}, and reaches further "
        f"over all edits: a mean of {_mean_reach(rows[chosen]):.2f} under the QA wrapper, chat and no wrapper, "
        f"against {against}."
    )


def _later_qa(row: dict) -> list[bool]:
    """The QA-wrapper verdicts on the final model of a stream's edits after its first round, in edit order."""
    return [bool(a[1]) for a in row["wild"]["qa"]["answers"][row["seq_chunk"] :]]


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test (binomial, p = 1/2) of ``wins`` against ``losses`` discordant pairs: the chance of a
    split at least this uneven were both settings equally likely to hold an edit; 1.0 without discordant pairs."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def _paired_later(rows: dict[str, dict], chosen: str) -> str:
    """One sentence pairing the chosen pilot stream with each other one over the same edits after round 1 (QA
    wrapper, final model): how many hold only under the chosen setting and only under the other, and the sign test's
    p; streams of other edits or round sizes are left out, and the sentence is empty without any to pair."""
    parts, n = [], 0
    for name in sorted(rows):
        a, b = rows[chosen], rows[name]
        x, y = _later_qa(a), _later_qa(b)
        if name == chosen or a["seq_chunk"] != b["seq_chunk"] or len(x) != len(y) or not x:
            continue
        n, only_a, only_b = len(x), sum(u and not v for u, v in zip(x, y)), sum(v and not u for u, v in zip(x, y))
        parts.append(f"against `{name}`, {only_a} and {only_b} (exact sign test p = {sign_test(only_a, only_b):.2g})")
    if not parts:
        return ""
    return (
        f"Paired over the {n} edits after round 1 (QA wrapper, final model), the edits that hold only under "
        f"`{chosen}` and only under the other setting: " + "; ".join(parts) + "."
    )


PILOT_ALONE = "alone"  # SEQ_PILOT/alone/: batch crispedit on one pilot round's edits alone


def pilot_alone_table(d: Path = SEQ_PILOT) -> str:
    """Batch crispedit on one pilot round's edits alone (compare JSONs under ``d/alone/``) beside what each pilot
    stream's round holding the same edits landed right after its round and read on the final model, under the QA
    wrapper: check 1 compares a later round's edits with round 1's, which are other facts, and this reads them
    against the same facts edited with all the room. Empty while none is stored."""
    alone_dir = d / PILOT_ALONE
    files = sorted(f for f in alone_dir.glob("*.json") if f.name != "run.json") if alone_dir.is_dir() else []
    pilots = sorted(f for f in d.glob("*.json") if f.name != "run.json") if d.is_dir() else []
    if not files or not pilots:
        return ""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.retention import final_by_round, landed_by_round  # torch-free

    streams = {f.stem: load_json(f) for f in pilots}
    lines = [
        "| edits | batch crispedit alone: WILD qa / chat / none | alone: TF | "
        + " | ".join(f"`{n}`: the round holding them, qa right after it / on the final model" for n in streams)
        + " |",
        "|---" * (3 + len(streams)) + "|",
    ]
    verdicts = []
    for f in files:
        alone = load_json(f)
        e, row = alone["settings"]["edits"], alone["results"]["crispedit"]
        cells, gaps = [], []
        for name, stream in streams.items():
            se, seq = stream["settings"]["edits"], stream["results"]["crispedit-seq"]
            k, off = divmod(e["offset"] - se["offset"], seq["seq_chunk"])
            inside = Path(e["file"]).name == Path(se["file"]).name and off == 0 and e["n"] == seq["seq_chunk"]
            landed, final = landed_by_round(seq).get("qa", []), final_by_round(seq).get("qa", [])
            if not inside or not 0 <= k < len(final):
                raise SystemExit(f"{f.name}: its edits are not one round of the pilot stream {name}")
            # a stream whose probes did not record each round's newest edits reads on the final model only
            now = landed[k] if k < len(landed) and landed[k] is not None else None
            cells.append(f"round {k + 1}: {'–' if now is None else f'{now:.2f}'} / {final[k]:.2f}")
            gaps.append(row["wild"]["qa"]["rel"] - final[k])
        span = f"{e['offset']}–{e['offset'] + e['n'] - 1}"
        lines.append(
            f"| [{Path(e['file']).name} {span}]({d.name}/{PILOT_ALONE}/{f.name}) | "
            + " / ".join(f"{row['wild'][w]['rel']:.2f}" for w in SEQ_WRAPPERS)
            + f" | {row['summary']['rel']:.2f} | "
            + " | ".join(cells)
            + " |"
        )
        if all(g > PILOT_LANDS for g in gaps):
            verdicts.append(
                f"Edits {span} read the QA wrapper {min(gaps):.2f}–{max(gaps):.2f} lower as a later round than alone: "
                "the gap check 1 reads is the sequence's, not those edits'."
            )
        elif all(g <= PILOT_LANDS for g in gaps):
            verdicts.append(
                f"Edits {span} read the QA wrapper within {PILOT_LANDS:g} of alone as a later round: the gap check 1 "
                "reads is those edits', not the sequence's."
            )
    return "\n".join(lines) + "\n" + "".join(f"\n{v}\n" for v in verdicts)


def seq_pilot_section(d: Path = SEQ_PILOT) -> str:
    """The results page's section on the short streams of full-size rounds that chose the sequential mode's
    settings (edit γ, Adam's carry, replay), when stored."""
    table = seq_pilot_table(d)
    if not table:
        return ""
    return f"""## Choosing the sequential setting: rounds of 100

[`{d.name}/`]({d.name}/run.json): crispedit-seq in rounds of 100 ZsRE dev edits from 200 on (not the confirming
stream's edits), the round size of the confirming stream, one sequential setting per row. Round 1 trains under the
capability constraint alone, as a batch edit of 100 does, so its edits right after it are what a round lands with
all the room; a later round's edits on the final model say what it landed under the earlier rounds' constraint.
The rule the rows are read by was written before they ran: check 1, every later round's own edits read the QA
wrapper on the final model within {PILOT_LANDS:g} of round 1's edits right after round 1; check 2, round 1's edits
keep at least {PILOT_KEEPS:g} of their teacher-forced, QA-wrapper and chat reach after the last round. The setting
that meets more of them becomes the session default; on a tie, the one with the higher mean reach over all edits
under the QA wrapper, chat and no wrapper (this tie-break was written while the second setting's stream ran, before
its result).
{run_line(d)}

{table}
{_pilot_alone_part(d)}"""


def _pilot_alone_part(d: Path) -> str:
    """The pilot section's paragraph on a later round's edits edited alone (:func:`pilot_alone_table`), when stored."""
    table = pilot_alone_table(d)
    if not table:
        return ""
    return (
        "Check 1 holds a later round's edits to round 1's, which are other facts. The same edits as one batch edit of "
        f"their own, with all the room ([`{PILOT_ALONE}/`]({d.name}/{PILOT_ALONE}/run.json)), beside what the pilot "
        f"round holding them landed. {run_line(d / PILOT_ALONE)}\n\n" + table + "\n"
    )


SEQ_ROOM = HERE / "seq_room"


def seq_room_section(d: Path = SEQ_ROOM) -> str:
    """The results page's section on the room a stream leaves its later rounds (``benchmarks/seq_room.py``
    outputs under ``d``): one table per stored stream, a row per edit-factor setting, the mean kept fraction of
    directions before each round; empty while none is stored."""
    files = sorted(f for f in d.glob("*.json") if f.name != "run.json") if d.is_dir() else []
    if not files:
        return ""
    parts = []
    stored = [(f, load_json(f)) for f in files]
    shares = [(f, r) for f, r in stored if "gradient_share" in r]
    for f, r in stored:
        if "gradient_share" in r:
            continue
        e = r["edits"]
        n = max(len(v) for v in r["kept"].values())
        lines = [
            "| edit factors @ edit γ | " + " | ".join(f"round {i + 1}" for i in range(n)) + " |",
            "|---" * (n + 1) + "|",
        ]
        lines += [f"| {k} | " + " | ".join(f"{x:.2f}" for x in v) + " |" for k, v in r["kept"].items()]
        parts.append(
            f"[`{f.name}`]({d.name}/{f.name}): {Path(e['file']).name} {e['offset']}–{e['offset'] + e['n'] - 1} in "
            f"rounds of {r['chunk']}, {r['seconds'] / 60:.0f} min.\n\n" + "\n".join(lines) + "\n"
        )
    real = load_json(HERE / "compare_zsre_dev1000" / "compare.json")["results"]["crispedit-seq"]
    real_kept = " · ".join(f"{_kept(rec):.2f}" for rec in real["round_records"])
    return f"""## Room for later rounds

[`{d.name}/`]({d.name}/run.json): `benchmarks/seq_room.py` — the share of directions each round's projector would
keep (mean over the edit layers) once the earlier rounds' edit factors join the capability factors, for edit factors
at every position (`full`, the session default) or the target's (`target`) and several edit γs; round 1 is the
capability constraint alone, what batch editing trains in. The edit factors are collected on the unedited model, a
proxy for a stream's (which collects them on the model each round left). {run_line(d)}

{chr(10).join(parts)}
For comparison, a real stream: the stored crispedit-seq row of [1 000 ZsRE edits](#1-000-zsre-edits) (dev
1000–1999, ten rounds of 100, `full` at edit γ 0.95 under that run's defaults) kept, round by round: {real_kept}.
{gradient_share_part(shares)}"""


def constraint_label(setting: str, mix: float) -> str:
    """A room row's constraint as the results page names it, from ``seq_room.py``'s setting key: ``capability``;
    ``<positions>@<edit γ>, mix <m>`` under the default ``each`` weighting; ``<positions>@<edit γ>, apart, <k> sweeps``
    (the mix does not act there); ``<positions>@<edit γ>, <weighting>, mix <m>`` otherwise."""
    if setting == "capability":
        return setting
    key, _, weighting = setting.partition(":")
    if not weighting:
        return f"{key}, mix {mix:g}"
    if weighting.startswith("apart"):
        k = int(weighting[len("apart") :])
        return f"{key}, apart, {k} sweep{'s' if k != 1 else ''}"
    return f"{key}, {weighting}, mix {mix:g}"


def gradient_share_part(shares: list[tuple[Path, dict]]) -> str:
    """The room section's part on the share of a later round's edit gradients each setting keeps (``seq_room.py
    --gradient-share`` outputs), per stream of edits (:func:`_span_part`); empty while none is stored."""
    if not shares:
        return ""
    streams: dict[str, list] = {}
    for f, r in shares:
        e = r["edits"]
        span = f"{Path(e['file']).name} {e['offset']}–{e['offset'] + e['n'] - 1} in rounds of {r['chunk']}"
        streams.setdefault(span, []).append((f, r))
    parts = "".join(_span_part(span, runs) for span, runs in sorted(streams.items(), key=lambda kv: -len(kv[1])))
    return f"""
What of the direction a later round's edits need a constraint lets them follow (`--gradient-share`): for each of
that round's edits, the gradient of its target's loss under an evaluation wrapper (the question as `qa`, `chat` or
`none` renders it) on the edit layers' weights, and the share of its squared norm the projector keeps, averaged over
the edits; `capability` is the constraint alone, what the same edits would have as a round 1 or a batch. The kept
fraction of directions counts eigenpairs; this weighs them by what the edits ask for. A constraint reads as above
(edit factors @ edit γ), with the edit factors' share of the mix whose eigenbasis both sets are masked in under the
default `each` weighting (the session default 0.5), or `apart`: each set masked in its own eigenbasis, the two
projections alternated that many sweeps.
{parts}"""


def _span_part(span: str, runs: list[tuple[Path, dict]]) -> str:
    """One stream's gradient shares: a table with a row per round and constraint (:func:`constraint_label`), a column
    per wrapper, beside the capability constraint alone, the sentence read off it (:func:`_share_reading`) and, with
    ``--exposure`` runs, what a projected step costs (:func:`exposure_part`)."""
    rows, wrappers = {}, []
    for f, r in runs:
        for k, per in r["gradient_share"].items():
            for setting in per[next(iter(per))]:
                key = (k, constraint_label(setting, r["config"]["mix"]))
                vals = {w: v[setting] for w, v in per.items()}
                if key not in rows or len(vals) > len(rows[key][0]):  # the run that measured more wrappers
                    rows[key] = (vals, f)
                wrappers = wrappers if len(wrappers) >= len(per) else list(per)
    lines = ["| round | constraint | " + " | ".join(wrappers) + " |", "|---" * (len(wrappers) + 2) + "|"]
    for (k, label), (vals, f) in sorted(rows.items(), key=lambda kv: (int(kv[0][0]), kv[0][1] != "capability")):
        cells = " | ".join(f"{vals[w]:.3f}" if w in vals else "–" for w in wrappers)
        lines.append(f"| {k} | [{label}]({SEQ_ROOM.name}/{f.name}) | {cells} |")
    return f"""
{span}:

{chr(10).join(lines)}
{_share_reading(rows)}{exposure_part(runs)}"""


def _share_reading(rows: dict) -> str:
    """A sentence read off the gradient-share rows, when they hold the capability constraint and ``full`` edit factors
    under ``each`` at the default mix with an edit γ of at most 0.1 and one of at least 0.8 (round 2, QA wrapper):
    whether masking almost none of the earlier edits' energy gives the later round back its room."""
    qa = {label: vals["qa"] for (k, label), (vals, _) in rows.items() if k == "2" and "qa" in vals}
    each = {s: v for s, v in qa.items() if s.startswith("full@") and s.endswith(", mix 0.5") and s.count(",") == 1}
    low = {s: v for s, v in each.items() if _gamma(s) <= 0.1}
    high = {s: v for s, v in each.items() if _gamma(s) >= 0.8}
    if "capability" not in qa or not low or not high:
        return ""
    (s_lo, v_lo), (s_hi, v_hi) = (
        min(low.items(), key=lambda kv: _gamma(kv[0])),
        min(high.items(), key=lambda kv: _gamma(kv[0])),
    )
    cap = qa["capability"]
    if abs(v_lo - v_hi) <= 0.02 and v_lo < cap - 0.05:
        return (
            f"\nRound 2's edits keep {v_lo:.2f} of their QA-wrapper gradient at edit γ {_gamma(s_lo):g} and "
            f"{v_hi:.2f} at {_gamma(s_hi):g}, against {cap:.2f} under the capability constraint alone: under `each`, "
            "what costs a later round its room is not the edit γ but the capability energy's mask taken in the merged "
            "eigenbasis.\n"
        )
    return ""


def _gamma(label: str) -> float:
    """The edit γ of a room row's constraint label (``<positions>@<γ>, …``)."""
    return float(label.split("@", 1)[1].split(",", 1)[0])


def exposure_part(shares: list[tuple[Path, dict]]) -> str:
    """The table of what a projected step costs for one stream's ``seq_room.py --exposure`` outputs (QA wrapper):
    per round and constraint, the share of the edits' gradient it keeps beside the capability curvature and the
    earlier edits' curvature of the projected step over the raw step's, and the sentences read off round 2
    (:func:`_exposure_reading`); empty while none is stored."""
    rows = {}
    for f, r in shares:
        for k, per in r.get("exposure", {}).items():
            for setting, cost in per.items():
                share = r["gradient_share"][k]["qa"][setting]
                key = (k, constraint_label(setting, r["config"]["mix"]))
                if key not in rows or len(cost) > len(rows[key][1]):  # the run that measured more curvatures
                    rows[key] = (share, cost, f)
    if not rows:
        return ""
    answers = any("edit targets" in v[1] for v in rows.values())  # runs with target rows: the answers' curvature
    lines = [
        "| round | constraint | QA gradient kept | capability curvature | earlier edits' curvature |"
        + (" earlier edits' answers |" if answers else ""),
        "|---|---|---|---|---|" + ("---|" if answers else ""),
    ]
    order = sorted(
        rows,
        key=lambda ks: (int(ks[0]), ks[1] != "capability", "apart" in ks[1], -_gamma(ks[1]) if "@" in ks[1] else 0),
    )
    for k, label in order:
        share, cost, f = rows[k, label]
        lines.append(
            f"| {k} | [{label}]({SEQ_ROOM.name}/{f.name}) | {share:.3f} | {cost['capability']:.4f} | "
            f"{cost['edits']:.4f} |"
            + ((f" {cost['edit targets']:.4f} |" if "edit targets" in cost else " – |") if answers else "")
        )
    return f"""
What a step inside each constraint costs (`--exposure`, the edits under the QA wrapper): the curvature of the
projected gradient over the raw gradient's, `q(P g) / q(g)` summed over the edit layers and averaged over the edits,
for the capability factors and for the earlier rounds' edit factors — per unit of learning rate, how much of what
each set protects a step may spend (1: no projection).{ANSWERS if answers else ""}

{chr(10).join(lines)}
{_exposure_reading({label: v for (k, label), v in rows.items() if k == "2"})}{_over_rounds(rows)}
"""


ANSWERS = (
    " The earlier edits' answers: their edit factors at the target positions alone, the curvature of what those edits"
    " answer (the full factors add their prompts')."
)


def _over_rounds(rows: dict) -> str:
    """For a stream measured over more than one later round: per constraint, the span of the room it keeps and of
    the earlier edits' curvature a step spends, over those rounds; empty for one round."""
    rounds = sorted({int(k) for k, _ in rows})
    if len(rounds) < 2:
        return ""
    labels = sorted({label for _, label in rows if label != "capability"}, key=lambda s: ("apart" in s, -_gamma(s)))
    spans = []
    for label in labels:
        vals = [rows[str(k), label] for k in rounds if (str(k), label) in rows]
        spans.append(
            f"`{label}` keeps {_span([v[0] for v in vals], 2)} and spends {_span([v[1]['edits'] for v in vals], 4)}"
        )
    return f"\nOver rounds {rounds[0]}–{rounds[-1]}: " + "; ".join(spans) + ".\n"


def _exposure_reading(rows: dict) -> str:
    """Sentences read off the exposure rows: whether ``each``'s edit γ moves its room and its protection of the
    earlier edits (shares within 0.02, curvatures within a fifth, over the edit γs stored); under ``apart``, the
    room and the earlier edits' curvature at each edit γ beside the capability constraint alone; and the apart
    settings read beside full ones or ``each`` at about the same room (:func:`_answers_reading`,
    :func:`_equal_room_reading`)."""
    out = []
    each = {s: v for s, v in rows.items() if s.startswith("full@") and s.count(",") == 1}
    apart = {s: v for s, v in rows.items() if s.startswith("full@") and ", apart," in s}
    if len(each) >= 2:
        shares = [v[0] for v in each.values()]
        costs = [v[1]["edits"] for v in each.values()]
        if max(shares) - min(shares) <= 0.02 and max(costs) <= 1.2 * min(costs):
            gammas = sorted(_gamma(s) for s in each)
            out.append(
                f"Under `each` the edit γ moves neither side: from {gammas[0]:g} to {gammas[-1]:g}, round 2 keeps "
                f"{_span(shares, 2)} of its QA gradient and a step spends {_span(costs, 4)} of the earlier edits' "
                "curvature: the capability mask in the merged basis covers the earlier edits' directions whatever "
                "their own mask."
            )
    sweeps: dict[str, dict] = {}  # apart rows by their sweep count; the count measured at the most edit γs is read
    for s, v in apart.items():
        sweeps.setdefault(s.rsplit(", ", 1)[1], {})[s] = v
    if sweeps and "capability" in rows:
        n, apart = max(sweeps.items(), key=lambda kv: len(kv[1]))
        by = sorted(apart.items(), key=lambda kv: -_gamma(kv[0]))
        listed = "; ".join(f"edit γ {_gamma(s):g}: {v[0]:.2f} / {v[1]['edits']:.4f}" for s, v in by)
        cap = rows["capability"]
        out.append(
            f"Masked apart ({n}), the edit γ trades one for the other (room kept / earlier edits' curvature): "
            f"{listed}; the capability constraint alone {cap[0]:.2f} / {cap[1]['edits']:.4f}."
        )
    out += _answers_reading(rows)
    out += _equal_room_reading(each, rows)
    return "".join(f"\n{s}\n" for s in out)


def _equal_room_reading(each: dict, rows: dict) -> list[str]:
    """Sentences pairing the room the ``each`` rows keep (``each``: label -> (share, curvatures, file), their shares
    within 0.02 of one another) with every ``apart`` row of ``rows`` that keeps the same room (within 0.02): what a
    step spends of the earlier edits' curvature under either."""
    shares = [v[0] for v in each.values()]
    if not shares or max(shares) - min(shares) > 0.02:
        return []
    room, spent = sum(shares) / len(shares), _span([v[1]["edits"] for v in each.values()], 4)
    out = []
    for s, (share, cost, _) in sorted(rows.items()):
        if ", apart," not in s or abs(share - room) > 0.02:
            continue
        where = "the target positions" if s.startswith("target@") else "every position"
        out.append(
            f"At the room `each` keeps ({room:.2f}), apart ({s.rsplit(', ', 1)[1]}) with the edit factors at {where} "
            f"(edit γ {_gamma(s):g}) "
            f"keeps {share:.2f} and a step spends {cost['edits']:.4f} of the earlier edits' curvature, against "
            f"{spent} under `each`."
        )
    return out


def _answers_reading(rows: dict) -> list[str]:
    """Sentences pairing each ``apart`` row with target-position edit factors with the full-position one that keeps
    the nearest room (within 0.02), both with the earlier edits' answers' curvature measured: what each spends of
    it."""
    measured = {s: v for s, v in rows.items() if ", apart," in s and "edit targets" in v[1]}
    full = {s: v for s, v in measured.items() if s.startswith("full@")}
    out = []
    for s_t, (share_t, cost_t, _) in sorted(measured.items()):
        if not s_t.startswith("target@") or not full:
            continue
        s_f, (share_f, cost_f, _) = min(full.items(), key=lambda kv: abs(kv[1][0] - share_t))
        if abs(share_f - share_t) > 0.02:
            continue
        out.append(
            f"At about the same room, apart with the edit factors at the target positions (edit γ {_gamma(s_t):g}) "
            f"keeps {share_t:.2f} and a step spends {cost_t['edit targets']:.4f} of the earlier edits' answers' "
            f"curvature; with them over every position (edit γ {_gamma(s_f):g}), {share_f:.2f} and "
            f"{cost_f['edit targets']:.4f}: what the full factors mask beyond the answers is mostly the earlier "
            "edits' prompts, which the later edits' gradients share."
        )
    return out


def _span(values: list[float], digits: int) -> str:
    """``lo–hi`` of ``values`` at ``digits`` decimals, or the one value when they round alike."""
    lo, hi = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return lo if lo == hi else f"{lo}–{hi}"


SEQ_CONFIRM = HERE / "seq_zsre_dev1000"  # ZsRE dev 1000-1999, 10 rounds of 100: the marks are read on it
SEQ_COUNTERFACT = HERE / "seq_counterfact_dev3000"  # CounterFact dev 0-2999, 30 rounds of 100: the paper's scale
SEQ_ROWS = ("crispedit-seq", "ft-seq", "alphaedit-seq")  # a stream's sequential rows, when stored
FULL_TABLE_ROUNDS = 12  # a longer stream's tables show round 1 and every STRIDE-th round; the picture shows all
STRIDE = 5


def confirm_rows(d: Path = SEQ_CONFIRM) -> tuple[dict | None, dict[str, dict]]:
    """A stream's stored rows under ``d``: batch crispedit's (``batch.json``'s ``crispedit`` row, or ``None``) and
    each sequential row of :data:`SEQ_ROWS` stored as ``<method>.json`` (each its own compare run), method -> row.
    Every file must hold the same edits (the compare's requests digest): the rows are read against each other."""
    files = {m: d / f"{m}.json" for m in ("batch", *SEQ_ROWS)}
    payloads = {m: load_json(f) for m, f in files.items() if f.is_file()}
    digests = {m: p["settings"]["requests_digest"] for m, p in payloads.items()}
    if len(set(digests.values())) > 1:
        raise SystemExit(f"{d.name}: the stored rows edit different requests ({digests})")
    batch = payloads.pop("batch")["results"]["crispedit"] if "batch" in payloads else None
    return batch, {m: p["results"][m] for m, p in payloads.items()}


def confirm_payload(d: Path = SEQ_CONFIRM) -> dict:
    """A stream's sequential rows as one compare-shaped payload (``{"results": {method: row}}``), for the
    retention-map picture."""
    return {"results": confirm_rows(d)[1]}


def shown_rounds(n: int) -> list[int]:
    """The 0-based rounds a table of an ``n``-round stream shows: all of them up to :data:`FULL_TABLE_ROUNDS`, else
    round 1, every :data:`STRIDE`-th round and the last (the picture and the stored row hold every round)."""
    if n <= FULL_TABLE_ROUNDS:
        return list(range(n))
    return sorted({0, n - 1, *range(STRIDE - 1, n, STRIDE)})


def retention_map_table(row: dict) -> str:
    """A ``-seq`` row's retention map as a table: after round j (down), the teacher-forced rel of round k's edits
    (across; blank above the diagonal), over :func:`shown_rounds`: :func:`crispedit.experiments.retention.
    retention_map`; empty for a row without one."""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.retention import retention_map  # torch-free

    grid = retention_map(row)
    if not grid:
        return ""
    shown = shown_rounds(len(grid))
    lines = ["| after round | " + " | ".join(str(k + 1) for k in shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for j in shown:
        rec = grid[j]
        lines.append(f"| {j + 1} | " + " | ".join("" if rec[k] is None else f"{rec[k]:.2f}" for k in shown) + " |")
    return "\n".join(lines) + "\n"


def landed_table(row: dict) -> str:
    """A ``-seq`` row's rounds under the QA wrapper and in chat: what each round's edits read right after their round
    (:func:`crispedit.experiments.retention.landed_by_round`) and on the final model (:func:`~crispedit.experiments.
    retention.final_by_round`), a column per round of :func:`shown_rounds`; empty for a row whose probes did not
    measure the former."""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.retention import final_by_round, landed_by_round  # torch-free

    landed, final = landed_by_round(row), final_by_round(row)
    if not landed:
        return ""
    shown = shown_rounds(max(len(v) for v in (*landed.values(), *final.values())))
    lines = ["| round's edits | " + " | ".join(str(k + 1) for k in shown) + " |", "|---" * (len(shown) + 1) + "|"]
    for w in ("qa", "chat"):
        for when, series in (("right after their round", landed.get(w)), ("on the final model", final.get(w))):
            if series:
                cells = ["–" if k >= len(series) or series[k] is None else f"{series[k]:.2f}" for k in shown]
                lines.append(f"| WILD {w}, {when} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seq_stream_section(d: Path, title: str, about: str) -> str:
    """A results-page section on a stored stream (:func:`confirm_rows`: batch crispedit and the sequential rows
    stored under ``d``, each its own compare run), headed ``title`` and introduced by ``about`` (which edits, in
    which rounds, under which cap): the rows stored so far, the sequential mode's marks (:func:`seq_marks`) once
    crispedit-seq and batch are both stored, and every stored row's retention map; empty while nothing is stored."""
    batch, seq = confirm_rows(d)
    if batch is None and not seq:
        return ""
    differ = _other_defaults(batch, seq["crispedit-seq"]) if batch is not None and "crispedit-seq" in seq else []
    if differ:
        raise SystemExit(f"{d.name}: batch.json's crispedit ran with other {', '.join(differ)} than crispedit-seq")
    lines = [SEQ_HEADER.rstrip("\n")]
    if batch is not None:
        lines.append(_batch_line(f"batch crispedit ([`batch.json`]({d.name}/batch.json))", batch))
    lines += [_seq_line(f"{m} ([`{m}.json`]({d.name}/{m}.json))", r, batch) for m, r in seq.items()]
    if batch is not None and "crispedit-seq" in seq:
        marks = "The sequential mode's marks, crispedit-seq against batch crispedit:\n\n" + seq_marks(
            batch, seq["crispedit-seq"]
        )
    else:
        waiting = [
            name
            for name, row in (("batch crispedit", batch), ("crispedit-seq", seq.get("crispedit-seq")))
            if row is None
        ]
        verb = "is" if len(waiting) == 1 else "are"
        marks = f"The sequential mode's marks are read once {' and '.join(waiting)} {verb} stored.\n"
    tables = {m: retention_map_table(r) for m, r in seq.items()}
    maps = "".join(
        f"\n{m}'s retention map (teacher-forced rel of round k's edits after round j; the numbers are the row's "
        f"`retention` records in [`{m}.json`]({d.name}/{m}.json)):\n\n{table}"
        for m, table in tables.items()
        if table
    )
    picture = (
        f"\n![retention maps]({d.name}/retention_map.png)\n" if seq and (d / "retention_map.png").is_file() else ""
    )
    return (
        f"""## {title}

[`{d.name}/`]({d.name}/run.json): {about}, each sequential row at the session defaults, beside batch crispedit on the
same edits with the same training contexts, answer end and preservation term. Each row is its own compare run, stored
as it finishes; hours are its edit time, a resumed run's earlier seconds included. Columns as in the tuning table; the
kept directions are the mean over the edit layers of the fraction of directions the round's projector keeps.
{run_line(d)}

{chr(10).join(lines)}

{marks}{maps}{picture}{_landed_part(seq)}""".rstrip("\n")
        + "\n\n"
    )


def seq_confirm_section(d: Path = SEQ_CONFIRM) -> str:
    """The confirming stream's section (:func:`seq_stream_section`): ZsRE dev 1000–1999 in ten rounds of 100, edits
    no sequential setting was tuned on."""
    return seq_stream_section(
        d,
        "Sequential editing: the confirming stream",
        "ZsRE dev 1000–1999 in rounds of 100 edits (edits no sequential setting was tuned on)",
    )


def seq_counterfact_section(d: Path = SEQ_COUNTERFACT) -> str:
    """The paper's scale (:func:`seq_stream_section`): CounterFact dev 0–2999 in thirty rounds of 100, every row at
    the paper's cap of 25 epochs."""
    return seq_stream_section(
        d,
        "Sequential editing at the paper's scale: CounterFact",
        "CounterFact dev 0–2999 (`counterfact_10k_dev.json`) in rounds of 100 edits, every row at the paper's "
        "cap of 25 epochs (`--epochs 25`; the default cap is 100)",
    )


SEQ_STREAMS = (SEQ_CONFIRM, SEQ_COUNTERFACT)  # the stored streams, in page order


def seq_streams_part() -> str:
    """The stored streams' sections: the confirming ZsRE stream, then the paper's scale on CounterFact."""
    return seq_confirm_section() + seq_counterfact_section()


def _landed_part(seq: dict) -> str:
    """The confirming section's paragraph on what crispedit-seq's rounds landed and kept (:func:`landed_table`), when
    its probes measured each round's own edits."""
    table = landed_table(seq["crispedit-seq"]) if "crispedit-seq" in seq else ""
    if not table:
        return ""
    return (
        "\ncrispedit-seq's rounds in the wild: each round's edits right after their round (what the round landed) and "
        "on the final model (what the later rounds left of it):\n\n" + table
    )
