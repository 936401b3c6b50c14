"""Regenerate every table and figure of ``results/`` from the stored data, the summary page and the README's blocks.

    python results/make.py            # tables, figures, results/README.md, the README's generated blocks
    python results/make.py --check    # exit 1 if results/README.md or a README block is not what the data gives
    python results/make.py --demo     # rerun the demo (results/demo/command.sh), store its output, then the above

Each directory under ``results/`` is one measured experiment: ``run.json`` (the command, the commit that stored
it, the machine) and its data (``compare.json``, bench JSON, CSV, the demo's printed output). Everything else —
``compare.md``, ``*.png``, the scaling tables, ``results/README.md`` and the README blocks between
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` (and those of ``docs/sharding.md``) — is written by this
script and never by hand.
``--check`` (run by ``tests/experiments/test_results.py``) needs neither torch nor matplotlib.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
README = ROOT / "README.md"
SUMMARY = HERE / "README.md"
SHARDING = ROOT / "docs" / "sharding.md"
SHARD_MEMORY = HERE / "shard_memory"
DEMO = HERE / "demo"
COMPARES = ("compare_zsre_dev100", "compare_counterfact_dev100", "compare_zsre_dev1000", "compare_counterfact_dev1000")
SCALING = {
    "scaling_zsre": ("wild_zsre_dev100_32.json", "../compare_zsre_dev100", "../compare_zsre_dev1000"),
    "scaling_counterfact": (
        "wild_counterfact_dev100_32.json",
        "../compare_counterfact_dev100",
        "../compare_counterfact_dev1000",
    ),
}
BREAKING_PPL_RATIO = 2.0  # crispedit.experiments.compare_table.BREAKING_PPL_RATIO (kept here: --check imports no torch)


# ----------------------------------------------------------------------------------------------------- the demo
def demo_command() -> list[str]:
    """The demo's command line (``results/demo/command.sh``, one line; what ``make demo`` runs), split."""
    lines = [ln for ln in (DEMO / "command.sh").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return shlex.split(lines[-1])


def demo_table(text: str) -> str:
    """The tables the demo prints after its progress lines: everything after its ``[ N s] done`` line."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^\[\s*\d+ s\] done$", line):
            return "\n".join(lines[i + 1 :]).strip("\n") + "\n"
    raise SystemExit("results/demo/demo.txt: no '[ N s] done' line — not the demo's output")


def mask_timings(text: str) -> str:
    """``text`` with every timing replaced by ``*``: the ``[ N s]`` prefixes, ``N s`` / ``Ns`` anywhere, and the
    values under an ``edit s`` column header (right-aligned in the header's span) up to the next blank line."""
    out, span = [], None
    for line in text.splitlines():
        if not line.strip():
            span = None
        elif span is not None:
            a, b = span
            line = line[:a] + ("*" if line[a:b].strip() else "").rjust(b - a) + line[b:]  # any width of number
        m = re.search(r"(?<!\S)edit s(?!\S)", line)
        if m:
            start = line.rfind("  ", 0, m.start())  # the column's right-aligned cell starts after the previous gap
            span = (start + 2 if start >= 0 else m.start(), m.end())
        line = re.sub(r"^\[\s*\d+ s\]", "[* s]", line)
        line = re.sub(r"(?<![\w.])\d+(?:\.\d+)?\s?s\b", "* s", line)
        out.append(line)
    return "\n".join(out) + "\n"


def compare_demo_tables(stored: str, live: str, rtol: float = 0.02, flips: int = 1) -> list[str]:
    """The differences between two demo tables, timings masked: every token must match, except decimal numbers
    (``0.00227``, ``x1.02``), which may differ by ``rtol`` relative (the last digits of float32 arithmetic differ
    between CPUs), and rates (``1.00/0.83``), which may differ by one edit's share in at most ``flips`` places: on
    another CPU's kernels a greedy answer whose two best tokens nearly tie may come out the other way. Answers and
    epochs must be equal, and a rate may move by one share only where the stored table shows how many edits there
    are (the rows of its first table). ``[]`` when they agree."""
    a, b = mask_timings(stored).splitlines(), mask_timings(live).splitlines()
    share = 1.0 / n if (n := _edit_rows(a)) else 0.0
    diffs, flipped = [], []
    if len(a) != len(b):
        diffs.append(f"{len(a)} lines stored, {len(b)} printed")
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        tx, ty = x.split(), y.split()
        ok = len(tx) == len(ty)
        moved = 0
        for u, v in zip(tx, ty) if ok else ():
            if u == v:
                continue
            fu, fv = _decimal(u), _decimal(v)
            ru, rv = _rate(u), _rate(v)
            if fu is not None and fv is not None and abs(fu - fv) <= rtol * max(abs(fu), abs(fv)):
                continue
            if ru and rv and all(abs(p - q) <= share + 0.006 for p, q in zip(ru, rv)):
                moved += sum(p != q for p, q in zip(ru, rv))
                continue
            ok = False
        line = f"line {i + 1}:\n  stored:  {x}\n  printed: {y}"
        if not ok:
            diffs.append(line)
        elif moved:
            flipped.append((moved, line))
    if sum(m for m, _ in flipped) > flips:
        diffs += [f"{line} (a rate moved by one edit's share; at most {flips} may)" for _, line in flipped]
    return diffs


def _edit_rows(lines: list[str]) -> int:
    """Rows of the first table of a demo table's ``lines`` (after its line of dashes, up to a blank line): its
    edits; 0 without one."""
    for i, line in enumerate(lines):
        if line.strip() and set(line.strip()) == {"-"}:
            return next((j - i - 1 for j in range(i + 1, len(lines)) if not lines[j].strip()), len(lines) - i - 1)
    return 0


def _rate(tok: str) -> tuple[float, float] | None:
    m = re.fullmatch(r"(\d\.\d+)/(\d\.\d+)", tok)
    return (float(m.group(1)), float(m.group(2))) if m else None


def _decimal(tok: str) -> float | None:
    m = re.fullmatch(r"x?(-?\d+\.\d+)", tok)
    return float(m.group(1)) if m else None


def run_demo() -> None:
    """Run the demo command, store its output as ``demo/demo.txt`` and its record as ``demo/run.json``."""
    cmd = demo_command()
    exe = [sys.executable, "-m", "crispedit"] if cmd[0] == "crispedit" else cmd[:1]
    t0 = datetime.datetime.now(datetime.timezone.utc)
    proc = subprocess.run(exe + cmd[1:], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"the demo failed (exit {proc.returncode}); nothing stored")
    (DEMO / "demo.txt").write_text(proc.stdout)
    seconds = (datetime.datetime.now(datetime.timezone.utc) - t0).total_seconds()
    _write_run(
        DEMO,
        {
            "command": shlex.join(cmd),
            "commit": _git("rev-parse", "--short", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "src")),
            "date": t0.date().isoformat(),
            "machine": _machine(),
            "wall_seconds": round(seconds),
        },
    )


def _machine() -> str:
    """``platform`` and CPU model, core count and whether the CPU computes bfloat16 natively."""
    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.*)", info).group(1)
    except (OSError, AttributeError):
        pass
    import os

    bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    return f"{cpu}, {os.cpu_count()} cores, {'native' if bf16 else 'no native'} bf16; {platform.platform()}"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _write_run(d: Path, record: dict) -> None:
    (d / "run.json").write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------------------ the compares
def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.1f}"


def _rg(w: dict | None) -> str:
    return "–" if not w else f"{_pct(w.get('rel'))} / {_pct(w.get('gen'))}"


def _drift(v) -> str:
    """A drift in nats/token: three decimals from 0.1 up, three significant digits below."""
    return "–" if v is None else (f"{v:.3f}" if v >= 0.1 else f"{v:.3g}")


def _num(v: float, fmt: str) -> str:
    """``v`` in ``fmt`` below 10 000, in three significant digits above (a broken model's perplexity)."""
    return fmt.format(v) if abs(v) < 1e4 else f"{v:.3g}"


def _minutes(s) -> str:
    if s is None:
        return "–"
    s = int(round(s))
    return f"{s // 3600} h {s % 3600 // 60:02d} m" if s >= 3600 else f"{s // 60} m {s % 60:02d} s"


def _paired_change(x: list | None, y: list | None) -> tuple[float, float] | None:
    """Mean per-item difference of ``x`` over ``y`` (the same items) and its standard error; ``None`` unless both
    hold the same number (≥ 2) of items."""
    if not x or not y or len(x) != len(y) or len(x) < 2:
        return None
    diff = [u - v for u, v in zip(x, y)]
    mean = sum(diff) / len(diff)
    return mean, (sum((t - mean) ** 2 for t in diff) / (len(diff) - 1) / len(diff)) ** 0.5


def _paired(row: dict, base: dict, task: str) -> str:
    """The task's score and its paired change against the base on the same items (points, ± standard error)."""
    d, b = (row.get("capability_details") or {}).get(task), (base.get("capability_details") or {}).get(task)
    if not d:
        return "–"
    score = f"{100 * d['score']:.1f}"
    pc = _paired_change(d.get("items"), (b or {}).get("items"))
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
            else _num(ppl, "{:.1f}") + (f" (×{_num(ratio, '{:.2f}')})" if ratio and m != "base" else "")
        )
        if ratio and ratio > BREAKING_PPL_RATIO:
            ppl_cell += " ✗"
        kl_cell = "0" if m == "base" else _drift(kl) + (f" ({_drift(pred)})" if pred is not None else "")
        caps = [_paired(r, base, t) if m != "base" else _paired(r, {}, t) for t in tasks]
        lines.append(
            "| "
            + " | ".join(
                [
                    _label(m, r),
                    _rg(w.get("qa")),
                    _rg(w.get("chat")),
                    _rg(tf) if tf else "–",
                    kl_cell,
                    ppl_cell,
                    *caps,
                    "–" if m == "base" else _minutes(r.get("edit_seconds")),
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def headline_table() -> str:
    """The README's compare table: 100 and 1 000 held-out ZsRE edits side by side, the rows both hold."""
    a = _load(HERE / "compare_zsre_dev100" / "compare.json")["results"]
    b = _load(HERE / "compare_zsre_dev1000" / "compare.json")["results"]
    ppl100, ppl1000 = a["base"]["summary"]["ppl"], b["base"]["summary"]["ppl"]

    def drift(r: dict, ppl0: float, m: str) -> str:
        if m == "base":
            return "0"
        kl, ppl = r["summary"]["kl_drift"], r["summary"]["ppl"]
        return _drift(kl) + (f" (ppl ×{ppl / ppl0:.2f} ✗)" if ppl / ppl0 > BREAKING_PPL_RATIO else "")

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
            f"| {label} | {_rg(a[m]['wild']['qa'])} | "
            f"{drift(a[m], ppl100, m)} | {'–' if m == 'base' else _minutes(a[m].get('edit_seconds'))} | "
            f"{_rg(b[m]['wild']['qa'])} | {drift(b[m], ppl1000, m)} |"
        )
    return "\n".join(lines) + "\n"


def _replaced_rows(d: Path) -> str:
    """Rows stored beside a compare.json (a method at other settings, replaced in the table): one line each."""
    out = []
    for f in sorted(d.glob("*_row.json")):
        p = _load(f)
        row = (
            p.get("row")
            or p.get(p.get("method", ""))
            or next((v for v in p.values() if isinstance(v, dict) and "summary" in v), None)
            or p
        )
        s, w = row.get("summary") or {}, row.get("wild") or {}
        note = p.get("note") or f"{row.get('method')} at other settings"
        out.append(
            f"- [`{f.name}`]({d.name}/{f.name}): {note}. WILD qa {_rg(w.get('qa'))}, TF rel "
            f"{_pct(s.get('rel'))}, KL drift {_drift(s.get('kl_drift'))}."
        )
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------- speed
def speed_table() -> str:
    """One row per method of every stored ``bench_scale.py`` JSON under ``speed/``: the device, the edits, s/epoch,
    s/step, tokens/s, the share of the device's measured GEMM peak and the step time over the run's reference."""
    lines = [
        "| run | device | edits | method | s / epoch | s / step | tokens / s | of GEMM peak | step ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted((HERE / "speed").rglob("*.json")):
        p = _load(f)
        if "methods" not in p:
            continue
        model = p["args"].get("model") or f"random-init {p['args'].get('random_init')}"
        for m, r in p["methods"].items():
            t = r.get("train") or {}
            lines.append(
                f"| [`{f.relative_to(HERE / 'speed')}`](speed/{f.relative_to(HERE / 'speed')}) | "
                f"{p['device_name']} ({model}, {p['args']['dtype']}) | {p['n_edits']} | `{m}` | "
                f"{t.get('s_per_epoch', 0):.2f} | {t.get('s_per_step', 0):.3f} | "
                f"{t.get('tokens_per_s', 0):,.0f} | {100 * t.get('fraction_of_peak', 0):.1f} % | "
                f"{p.get('step_ratio', {}).get(m, float('nan')):.2f} |"
            )
    return "\n".join(lines) + "\n"


LATENCY = HERE / "edit_latency"
LATENCY_PHASES = ("batches", "keep", "train", "factors", "other", "evaluate")  # benchmarks/edit_latency.py PHASES


def latency_table() -> str:
    """One row per round of every stored ``benchmarks/edit_latency.py`` JSON under ``edit_latency/`` and one per
    run's mean: the seconds of each phase, the round's wall time and its ratio to the run's target."""
    lines = [
        "| run | round | " + " | ".join(LATENCY_PHASES) + " | wall s | × target | epochs / steps |",
        "|---|---|" + "---|" * (len(LATENCY_PHASES) + 3),
    ]
    for f in sorted(LATENCY.glob("*.json")):
        p = _load(f)
        if "rounds" not in p:
            continue
        name = f"[`{f.name}`](edit_latency/{f.name})"
        for r in p["rounds"]:
            ph = r["phases"]
            lines.append(
                f"| {name} | {r['round']} | "
                + " | ".join(f"{ph[k]:.1f}" for k in LATENCY_PHASES)
                + f" | {r['wall']:.1f} | {r['wall'] / p['target']:.1f} | {r['epochs']} / {r['steps']} |"
            )
        m = p["mean"]
        lines.append(
            f"| {name} | **mean** | "
            + " | ".join(f"{m[k]:.1f}" for k in LATENCY_PHASES)
            + f" | **{m['wall']:.1f}** | **{p['over_target']:.1f}** | |"
        )
    return "\n".join(lines) + "\n"


def _wild_cell(summary: dict, measure: str = "rel") -> str:
    """``qa / chat / none`` of a final-measures summary's WILD ``measure`` (``rel`` or ``gen``), two decimals each
    (``benchmarks/edit_latency.py``'s ``wild_<wrapper>_<measure>`` fields)."""
    return " / ".join(f"{summary[f'wild_{w}_{measure}']:.2f}" for w in ("qa", "chat", "none"))


def latency_final_table() -> str:
    """One row per stored ``benchmarks/edit_latency.py --evaluate`` JSON under ``edit_latency/``: what its rounds
    left on the final model over every round's edit — WILD rel per wrapper, teacher-forced rel, the chat answers'
    length ratio and bare share, the answer KL, subject bleed and KL drift — beside its mean round time."""
    lines = [
        "| run | edits | mean round s | WILD qa / chat / none rel | TF rel | chat length | turned bare | answer KL "
        "| bleed target | KL drift |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(LATENCY.glob("*.json")):
        p = _load(f)
        if "final" not in p:
            continue
        s = p["final"]["summary"]
        wild = _wild_cell(s)
        lines.append(
            f"| [`{f.name}`](edit_latency/{f.name}) | {s['n_edits']} | {p['mean']['wall']:.1f} | {wild} | "
            f"{s['tf_rel']:.2f} | ×{s['style_length_ratio']:.2f} | {s['style_bare_share']:.2f} | "
            f"{s['answer_kl']:.3f} | {s['bleed_target']:.3f} | {_drift(s['kl_drift'])} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def stop_rule_line() -> str:
    """A sentence comparing the stored one-edit rounds under the two stop rules (``stop_loss.json``,
    ``stop_greedy.json``: the same edits, side by side): round and training seconds, and what the final model kept."""
    runs = {r: LATENCY / f"stop_{r}.json" for r in ("loss", "greedy")}
    if not all(f.exists() for f in runs.values()):
        return ""
    loss, greedy = (_load(runs[r]) for r in ("loss", "greedy"))
    a, b = loss["final"]["summary"], greedy["final"]["summary"]
    lm, gm = loss["mean"], greedy["mean"]
    epochs = [sum(r["epochs"] for r in p["rounds"]) for p in (greedy, loss)]
    wild = [_wild_cell(x) for x in (b, a)]
    return (
        f"Under `--stop-rule greedy` the same {b['n_edits']} rounds took {gm['wall']:.1f} s a round against "
        f"{lm['wall']:.1f} s (training {gm['train']:.1f} s against {lm['train']:.1f} s, epochs {epochs[0]} against "
        f"{epochs[1]}), with WILD qa / chat / none {wild[0]} against {wild[1]} and KL drift "
        f"{_drift(b['kl_drift'])} against {_drift(a['kl_drift'])}, but chat answers ×{b['style_length_ratio']:.2f} "
        f"the base's length against ×{a['style_length_ratio']:.2f} ({b['style_bare_share']:.2f} of them bare against "
        f"{a['style_bare_share']:.2f}) — most likely as the preservation term gets fewer steps to hold their form — "
        "so the loss rule stays the default.\n"
    )


ONE_EDIT_SETTINGS = {  # one-edit round settings measured on the same rounds back to back; the first is the default
    "projection_gradient.json": "defaults (`--projection gradient`)",
    "projection_eigenbasis.json": "`--projection eigenbasis`",
    "projection_update.json": "`--projection update`",
    "lr_2e-4.json": "`--lr 2e-4` (default 5e-4)",
    "stop_loss_0.05.json": "`stop_loss=0.05` (default 0.01)",
    "stop_loss_0.03.json": "`stop_loss=0.03`",
}


def one_edit_settings_table() -> str:
    """One row per stored run of :data:`ONE_EDIT_SETTINGS` (the same one-edit rounds under one changed setting each,
    back to back): the final model's KL drift (and its ratio to the default's), WILD qa / chat / none rel and gen,
    subject bleed, chat answers' length, and the rounds' steps and mean seconds; empty unless the default is stored."""
    got = {f: _load(LATENCY / f) for f in ONE_EDIT_SETTINGS if (LATENCY / f).exists()}
    default = next(iter(ONE_EDIT_SETTINGS))
    if default not in got:
        return ""
    base = got[default]["final"]["summary"]["kl_drift"]
    lines = [
        "| setting | KL drift (× default) | WILD qa / chat / none: rel, gen | subject bleed | chat length | steps | "
        "s a round |",
        "|---|---|---|---|---|---|---|",
    ]
    for f, p in got.items():
        s = p["final"]["summary"]
        wild = _wild_cell(s)
        gen = _wild_cell(s, "gen")
        lines.append(
            f"| [{ONE_EDIT_SETTINGS[f]}](edit_latency/{f}) | {_drift(s['kl_drift'])} (×{s['kl_drift'] / base:.2f}) | "
            f"{wild}, {gen} | {s['bleed_target']:.2f} | ×{s['style_length_ratio']:.2f} | "
            f"{sum(r['steps'] for r in p['rounds'])} | {p['mean']['wall']:.1f} |"
        )
    n = got[default]["final"]["summary"]["n_edits"]
    return (
        f"The same {n} one-edit rounds (`{got[default]['edits'].rsplit('/', 1)[-1]}`, the tuning slice) under one "
        f"changed setting each, back to back on one machine, and the final model over their edits (a WILD rate moves "
        f"in steps of {1 / n:.2f} here):\n\n" + "\n".join(lines) + "\n"
    )


def subject_rows_line() -> str:
    """A sentence on the preservation term's subject answers held at every step of a one-edit round: the final model's
    subject bleed, WILD reach, chat answers' length and KL drift before and after, on the tuning slice
    (``stop_loss.json`` against ``subject_rows.json``) and on held-out edits (``heldout_before.json`` against
    ``heldout_subject_rows.json``, run side by side)."""
    pairs = [("stop_loss", "subject_rows"), ("heldout_before", "heldout_subject_rows")]
    if not all((LATENCY / f"{f}.json").exists() for pair in pairs for f in pair):
        return ""

    def side(name: str) -> dict:
        return _load(LATENCY / f"{name}.json")["final"]["summary"]

    def slice_of(name: str) -> str:
        _, offset, n = _load(LATENCY / f"{name}.json")["edits"].rsplit(":", 2)
        return f"ZsRE dev {offset}–{int(offset) + int(n) - 1}"

    def compare(before: dict, after: dict) -> str:
        wild = [_wild_cell(x) for x in (before, after)]
        return (
            f"bleed {before['bleed_target']:.3f} → {after['bleed_target']:.3f}, WILD qa / chat / none {wild[0]} → "
            f"{wild[1]}, chat length ×{before['style_length_ratio']:.2f} → ×{after['style_length_ratio']:.2f}, "
            f"KL drift {_drift(before['kl_drift'])} → {_drift(after['kl_drift'])}"
        )

    (tb, ta), (hb, ha) = ((side(a), side(b)) for a, b in pairs)
    return (
        "With the subject answers at least half of every step's kept transcripts (one edit's subject then held at "
        f"every step), the final model of the one-edit rounds read, on the tuning slice ({slice_of('subject_rows')}, "
        f"`stop_loss.json` → `subject_rows.json`): {compare(tb, ta)}; on {ha['n_edits']} held-out edits "
        f"({slice_of('heldout_subject_rows')}, `heldout_before.json` → `heldout_subject_rows.json`): "
        f"{compare(hb, ha)}.\n"
    )


def two_threads_line() -> str:
    """A sentence on the one-edit rounds run on both cores with nothing else running (``two_threads_fp32.json``,
    ``two_threads_bf16.json``, one after the other): the second round of each (the first also wrote what later
    rounds read from the cache), its phases and its ratio to the target."""
    runs = {r: LATENCY / f"two_threads_{r}.json" for r in ("fp32", "bf16")}
    if not all(f.exists() for f in runs.values()):
        return ""
    target = _load(runs["fp32"])["target"]
    fp32, bf16 = (_load(runs[r])["rounds"][1] for r in ("fp32", "bf16"))
    a, b = fp32["phases"], bf16["phases"]
    return (
        "On both cores with nothing else running, a one-edit round (the second of a session) took "
        f"{fp32['wall']:.1f} s ({fp32['wall'] / target:.1f}× the {target:g} s target): the kept answers "
        f"{a['keep']:.1f} s, training {a['train']:.1f} s "
        f"over {fp32['steps']} steps ({a['train'] / fp32['steps']:.2f} s a step), the evaluation {a['evaluate']:.1f} s "
        f"and the rest {a['batches'] + a['factors'] + a['other']:.1f} s; under bf16 autocast {bf16['wall']:.1f} s "
        f"(training {b['train']:.1f} s over {bf16['steps']} steps, {b['train'] / bf16['steps']:.2f} s a step). "
        "Training alone takes more than the target: a step is a forward and backward pass through the 135M-parameter "
        "model on the edit's sequences and the kept answers, and an edit takes tens of steps.\n"
    )


STREAM = HERE / "single_edit_stream"
# the rounds after which the first rounds' edits are shown, where the stream has them
STREAM_AFTER = (10, 25, 50, 75, 100)


def _stream_final_row(label: str, m: dict) -> str:
    """One row of the stream's final measures (``benchmarks/edit_latency.py``'s ``_final_measures`` summary)."""
    s = m["summary"]
    wild = _wild_cell(s)
    return (
        f"| {label} | {s['n_edits']} | {wild} | {s['tf_rel']:.2f} | ×{s['style_length_ratio']:.2f} | "
        f"{s['bleed_target']:.3f} | {_drift(s['kl_drift'])} | {s['ppl']:.2f} ({s['ppl_base']:.2f}) |"
    )


def stream_section(d: Path = STREAM) -> str:
    """The results page's section on a stream of one edit per ``crispedit session add`` call
    (``benchmarks/session_stream.py``'s ``stream.json`` under ``d``): the calls' seconds and how they move with the
    rounds before them, the first rounds' edits after later rounds, the KL drift along the stream and the final
    model's measures; empty while none is stored."""
    f = d / "stream.json"
    if not f.is_file():
        return ""
    p = _load(f)
    rounds = p["rounds"]
    n = len(rounds)
    clean = [r for r in rounds if not r["stalled"] and r["wall"] is not None]
    walls = [r["wall"] for r in clean]
    tenth = max(1, n // 10)

    def ends(value) -> tuple[float, float]:
        """``value`` of a round, its mean over the first and over the last tenth of the timed rounds."""
        return statistics.fmean(map(value, clean[:tenth])), statistics.fmean(map(value, clean[-tenth:]))

    head, tail = ends(lambda r: r["wall"])
    evaluate = ends(lambda r: r["phases"]["evaluate"])
    steps = ends(lambda r: r["steps"])

    path, offset, _ = p["edits"].rsplit(":", 2)
    mean_phase = {k: statistics.fmean(r["phases"][k] for r in clean) for k in LATENCY_PHASES}
    call = statistics.fmean(r["wall"] - r["phases"]["total"] for r in clean)
    first = len(p["retention_first"][-1])
    after = [k for k in STREAM_AFTER if k <= n] + ([n] if n not in STREAM_AFTER else [])
    lines = [
        "| after round | " + " | ".join(f"edit {j}" for j in range(1, first + 1)) + " | mean | KL drift |",
        "|---|" + "---|" * (first + 2),
    ]
    for k in after:
        rets = p["retention_first"][k - 1]
        got = [v for v in rets if v is not None]
        lines.append(
            f"| {k} | "
            + " | ".join("–" if v is None else f"{v:.2f}" for v in rets)
            + " | –" * (first - len(rets))
            + f" | {statistics.fmean(got):.2f} | {_drift(rounds[k - 1]['kl_drift'])} |"
        )
    final = ""
    if "final" in p:
        final = (
            "\nThe final model, on the first rounds' edits and on every edit of the stream (WILD free generation "
            "under each wrapper, teacher-forced rel, its chat answers' length over the base's, subject bleed, KL drift "
            "from the base, perplexity with the base's in brackets):\n\n"
            "| edits | n | WILD qa / chat / none rel | TF rel | chat length | bleed target | KL drift | ppl |\n"
            "|---|---|---|---|---|---|---|---|\n"
            + _stream_final_row(f"the first {first}", p["final"]["first"])
            + "\n"
            + _stream_final_row("all", p["final"]["all"])
            + "\n"
        )
    stalled = p["stalled_rounds"]
    apart = f" ({len(stalled)} stopped or starved rounds counted apart)" if stalled else ""
    return f"""## One edit at a time: a stream

[`{d.name}/`]({d.name}/run.json): `benchmarks/session_stream.py` — {n} rounds of one edit each ({Path(path).name}
{offset}–{int(offset) + n - 1}), each round one `crispedit session add` process as a service starting a process per
correction would run it: the call's wall time counts the process start and the model's loading.
{_run_line(d)}

A call took {statistics.median(walls):.1f} s in the median ({statistics.fmean(walls):.1f} s mean, slowest
{max(walls):.1f} s) over {len(walls)} rounds{apart}:
the first {tenth} rounds {head:.1f} s on average, the last {tenth} {tail:.1f} s. A
round's record splits its mean into {", ".join(f"{k} {v:.1f} s" for k, v in mean_phase.items())}; the process start,
loading and commit took {call:.1f} s more. What grows is the check of the earlier edits in the evaluate phase,
bounded by `--check-earlier` (1 000 edits; past it a fixed sample): evaluate took
{evaluate[0]:.1f} and {evaluate[1]:.1f} s in the first and the last {tenth} rounds; training, which varies by edit,
{steps[0]:.1f} and {steps[1]:.1f} steps.

![the stream]({d.name}/stream.png)

The teacher-forced rel of each of the first {first} rounds' edits after later rounds, and the KL drift from the base
then:

{chr(10).join(lines)}
{final}
"""


def speed_facts() -> dict:
    """The ratios the README's Speed section quotes, from the stored benchmarks."""
    share = _load(HERE / "speed" / "bench_share_smollm2_100.json")
    bf16 = _load(HERE / "speed" / "bench_bf16_smollm2_32.json")
    h100 = _load(HERE / "speed" / "gpu_h100" / "smollm2_1000_tokens_b.json")
    return {
        "packed": share["step_ratio"]["crispedit:noshare"],
        "bf16": (
            bf16["methods"]["crispedit"]["train"]["s_per_step"]
            / bf16["methods"]["crispedit:bf16"]["train"]["s_per_step"]
        ),
        "gemm": share["methods"]["crispedit"]["train"]["fraction_of_peak"],
        "h100_fp32": h100["methods"]["crispedit"]["train"]["s_per_epoch"],
        "h100_tf32": h100["methods"]["crispedit:tf32"]["train"]["s_per_epoch"],
    }


def speed_block() -> str:
    """The README's speed table (the figures its Speed section rests on)."""
    f = speed_facts()
    return (
        "| measured | figure | run |\n|---|---|---|\n"
        f"| a CPU edit step, SmolLM2, 100 edits, default contexts (2 cores) | {100 * f['gemm']:.0f} % of the CPU's "
        "float32 GEMM peak | [`bench_share_smollm2_100.json`](results/speed/bench_share_smollm2_100.json) |\n"
        f"| the same step without shared-prefix packing | {f['packed']:.2f}× the time | same file |\n"
        f"| `--precision bf16` on a CPU with AVX512-BF16, 32 edits | a step {f['bf16']:.2f}× faster | "
        "[`bench_bf16_smollm2_32.json`](results/speed/bench_bf16_smollm2_32.json) |\n"
        f"| one H100, SmolLM2 shape, 1 000 edits, `--batch-tokens 16384` | {f['h100_fp32']:.2f} s / epoch "
        f"({f['h100_tf32']:.2f} with `--projection-precision tf32`) | "
        "[`gpu_h100/`](results/speed/gpu_h100/smollm2_1000_tokens_b.json) |\n"
    )


# ------------------------------------------------------------------------------------------- eigendecompositions
def eigh_tables() -> str:
    """From ``eigh/``: float64 / float32 ``torch.linalg.eigh`` time per size (with the n³ extrapolation, marked as
    one) and, per γ, the range over SmolLM2's layers of the projection error against the float64 formula for a
    float32 eigensolver and for crispedit's projector."""
    t = _load(HERE / "eigh" / "bench_eigh_cpu.json")
    lines = ["| size | float32 (s) | float64 (s) | float64 / float32 |", "|---|---|---|---|"]
    for n, r in t["sizes"].items():
        lines.append(
            f"| {int(n):,} | {r['float32']['min_s']:.2f} | {r['float64']['min_s']:.2f} | "
            f"{r['ratio_float64_over_float32']:.2f}× |".replace(",", " ")
        )
    ex = t["extrapolated"]
    lines.append(
        f"| {ex['n']:,} (extrapolated as n³ from {ex['from_n']:,}) | {ex['float32_s']:.0f} | "
        f"{ex['float64_s']:.0f} | {ex['float64_s'] / ex['float32_s']:.2f}× |".replace(",", " ")
    )
    p = _load(HERE / "eigh" / "eigh_precision_smollm2.json")
    rows = ["| γ | float32 eigensolver | crispedit (float64 decomposition, float32 bases) |", "|---|---|---|"]
    for g in p["gammas"]:
        f32 = [v[str(g)]["float32_eigh"] for v in p["layers"].values()]
        ours = [v[str(g)]["crispedit"] for v in p["layers"].values()]
        rows.append(f"| {g} | {min(f32):.1e} – {max(f32):.1e} | {min(ours):.1e} – {max(ours):.1e} |")
    return (
        "`torch.linalg.eigh` on the CPU, fastest of "
        f"{t['repeats']} interleaved runs ([`bench_eigh_cpu.json`](eigh/bench_eigh_cpu.json)):\n\n"
        + "\n".join(lines)
        + "\n\nRelative projection error against the paper's formula in float64, range over "
        "SmolLM2's five default `down_proj` layers "
        "([`eigh_precision_smollm2.json`](eigh/eigh_precision_smollm2.json)):\n\n" + "\n".join(rows) + "\n"
    )


CHAT_STYLE = HERE / "chat_style_zsre_dev400_32"
CHAT_STYLE_HELDOUT = HERE / "chat_style_zsre_dev100_32"


def chat_style_table(d: Path = CHAT_STYLE) -> str:
    """From a directory of edit reports and its ``run.json`` (``runs``: report file -> what was run): per run, WILD
    qa / chat rel / gen, teacher-forced rel, KL drift, the chat style measures (answer length over the base's, the
    share of long answers turned bare, KL on the base's own answers) and the subject bleed, then the epochs."""
    runs = _load(d / "run.json")["runs"]
    lines = [
        "| run | WILD qa | WILD chat | TF rel | KL drift | chat length (× base) | turned bare | answer KL | "
        "subject bleed | epochs |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, what in runs.items():
        r = _load(d / name)
        s, w, a = r["summary"], r.get("wild") or {}, r.get("assistant") or {}
        st, bl = a.get("style") or {}, a.get("bleed") or {}
        lines.append(
            f"| {what} | {_rg(w.get('qa'))} | {_rg(w.get('chat'))} | {_pct(s.get('rel'))} | "
            f"{s['kl_drift']:.5f} | ×{st['length_ratio']:.2f} | {_pct(st['bare_share'])} | "
            f"{st['answer_kl']:.3f} | {_pct(bl.get('target'))} | {r['training']['epochs']} |"
        )
    return "\n".join(lines) + "\n"


KEEP_100 = HERE / "keep_zsre_dev100_100"
KEEP_100_CF = HERE / "keep_counterfact_dev100_100"
KEEP_ROWS = ("crispedit", "ft", "adam-nscl", "alphaedit")  # the rows of the compares before and after, when stored


def _style(r: dict) -> tuple[dict, dict]:
    a = r.get("assistant") or {}
    return a.get("style") or {}, a.get("bleed") or {}


def _keep_runs(d: Path) -> list[tuple[str, dict]]:
    """The compare payloads of a before/after directory, in the order its ``run.json`` lists them under ``runs``
    (file -> what its rows ran with): the first before the remedy, the last at today's defaults."""
    return [(name, _load(d / name)["results"]) for name in _load(d / "run.json")["runs"]]


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
        st, bl = _style(r)
        style = f"×{st['length_ratio']:.2f} | {_pct(st['bare_share'])} | {st['answer_kl']:.3f}" if st else "– | – | –"
        bleed = f"{_pct(bl.get('target'))} / {_pct(bl.get('changed'))}" if bl else "–"
        epochs = (r.get("training") or {}).get("epochs", "–") if _trains(r) else "–"
        lines.append(
            f"| {name} | {_rg(w.get('qa'))} | {_rg(w.get('chat'))} | {_pct(s.get('rel'))} | {s['kl_drift']:.5f} | "
            f"{style} | {bleed} | {_paired(r, base if r is not base else {}, 'ifeval')} | {epochs} |"
        )
    return "\n".join(lines) + "\n"


def _mark(ok: bool) -> str:
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
    st, bl = _style(after)
    st0, _ = _style(before)
    w, w0 = after.get("wild") or {}, before.get("wild") or {}
    rows = [
        (
            "chat answer length within [0.9, 1.1] × the base's",
            f"×{st['length_ratio']:.2f} (before: ×{st0['length_ratio']:.2f})",
            0.9 <= st["length_ratio"] <= 1.1,
        ),
        ("subject bleed (target in the answer) ≤ 5 %", f"{_pct(bl['target'])} %", bl["target"] <= 0.05),
    ]
    for wrapper in ("qa", "chat"):
        a, b = (w.get(wrapper) or {}).get("rel"), (w0.get(wrapper) or {}).get("rel")
        rows.append(
            (
                f"WILD {wrapper} rel within 3 points of before",
                f"{_pct(a)} % (before: {_pct(b)} %; {100 * (a - b):+.0f} points{_turned(w0, w, wrapper)})".replace(
                    "-", "−"
                ),
                a >= b - 0.03,
            )
        )
    k, k0 = after["summary"]["kl_drift"], before["summary"]["kl_drift"]
    rows.append(("KL drift ≤ 1.2 × before's", f"{k:.5f} (before: {k0:.5f}; ×{k / k0:.2f})", k <= 1.2 * k0))
    if base is not None:
        x = ((after.get("capability_details") or {}).get("ifeval") or {}).get("items")
        pc = _paired_change(x, ((base.get("capability_details") or {}).get("ifeval") or {}).get("items"))
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
    out += [f"| {what} | {val} | {_mark(ok)} |" for what, val, ok in rows]
    return "\n".join(out) + "\n"


def keep_marks_32() -> str:
    """The marks on the 32 held-out edits: crispedit's defaults (the preservation term, the period answer end)
    against no term and the chat turn's end."""
    return keep_marks(_load(CHAT_STYLE_HELDOUT / "defaults.json"), _load(CHAT_STYLE_HELDOUT / "period.json"))


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
    runs = _load(d / "run.json")["runs"]
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
{_run_line(d)}

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


# ----------------------------------------------------------------------------------------- sequential tuning
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
    for name in _load(KEEP_100 / "run.json")["runs"]:
        row = _load(KEEP_100 / name)["results"].get("crispedit")
        if row is not None and not _other_defaults(row, seq):
            match = (name, row)
    return match


def _kept(record: dict) -> float:
    """The mean over the edited layers of a round record's kept fraction of directions."""
    kept = record.get("projector_kept") or {}
    return sum(kept.values()) / len(kept) if kept else float("nan")


def _assistant_cells(r: dict) -> str:
    """A row's chat length (× the base's) and subject bleed (target in the answer, percent) as two table cells."""
    st, bl = _style(r)
    return f"×{st['length_ratio']:.2f} | {_pct(bl['target'])} %" if st and bl else "– | –"


SEQ_HEADER = (
    "| row | WILD qa / chat / none rel | TF rel | round 1 kept: TF / qa / chat | kept directions, first → last round "
    "| KL drift (× batch) | chat length | bleed | hours |\n|---|---|---|---|---|---|---|---|---|\n"
)


def _batch_line(label: str, batch: dict) -> str:
    """A batch row of :data:`SEQ_HEADER`'s table: reach, teacher-forced rel, drift and the chat measures."""
    return (
        f"| {label} | "
        + " / ".join(f"{batch['wild'][w]['rel']:.2f}" for w in SEQ_WRAPPERS)
        + f" | {batch['summary']['rel']:.2f} | | | {_drift(batch['summary']['kl_drift'])} | "
        + f"{_assistant_cells(batch)} | |"
    )


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
        + f" | {kept} | {_drift(drift)} ({times}) | {_assistant_cells(r)} | {r['edit_seconds'] / 3600:.2f} |"
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
        r = _load(f)["results"]["crispedit-seq"]
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
    rows.append(("KL drift ≤ 1.5 × batch's", f"{_drift(k)} (batch {_drift(kb)}; ×{k / kb:.2f})", k <= 1.5 * kb))
    ppl, ppl0 = seq["summary"]["ppl"], seq["summary"]["ppl_base"]
    rows.append(("perplexity ≤ 1.2 × the base's", f"{ppl:.2f} (base {ppl0:.2f}; ×{ppl / ppl0:.3f})", ppl <= 1.2 * ppl0))
    out = ["| mark | measured | |", "|---|---|---|"]
    out += [f"| {what} | {val} | {_mark(ok)} |" for what, val, ok in rows]
    secs = [r["edit_seconds"] / 60 for r in seq["round_records"]]
    out.append(
        f"| a round's time bounded however many rounds came before (by construction: docs/sessions.md) | "
        f"round 1 {secs[0]:.0f} min, last {secs[-1]:.0f} min, longest {max(secs):.0f} min, median "
        f"{statistics.median(secs):.0f} min | stated |"
    )
    return "\n".join(out) + "\n"


def seq_tuning_marks(name: str = "full.json") -> str:
    """:func:`seq_marks` of the tuning stream's row ``name`` against its batch row (:func:`seq_batch_row`)."""
    seq = _load(SEQ_TUNING / name)["results"]["crispedit-seq"]
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
batch crispedit with the same defaults on the same 100 edits. {_run_line(SEQ_TUNING)}

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
        key=lambda n: (pilot_checks(rows[n])[0], sum(rows[n]["wild"][w]["rel"] for w in SEQ_WRAPPERS)),
    )


def seq_pilot_table(d: Path = SEQ_PILOT) -> str:
    """One row per stored stream of rounds of the confirming stream's size under ``d`` (a compare JSON with a
    ``crispedit-seq`` row, named by its edit-factor setting): round 1's edits right after round 1 (what a batch edit
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
    for f in files:
        r = _load(f)["results"]["crispedit-seq"]
        first, last = r["retention"][0], r["retention"][-1]
        held = lambda rec: f"{rec['tf_rel']:.2f} / {rec['wild']['qa']:.2f} / {rec['wild']['chat']:.2f}"  # noqa: E731
        qa = " · ".join(f"{x:.2f}" for x in final_by_round(r)["qa"])
        recs = r["round_records"]
        lines.append(
            f"| [`{f.stem}`]({d.name}/{f.name}) | {held(first)} | {held(last)} | {qa} | "
            + " / ".join(f"{r['wild'][w]['rel']:.2f}" for w in SEQ_WRAPPERS)
            + f" | {_kept(recs[0]):.2f} → {_kept(recs[-1]):.2f} | {_drift(r['summary']['kl_drift'])} | "
            + f"{r['edit_seconds'] / 3600:.2f} | {pilot_checks(r)[1]} |"
        )
    rows = {f.stem: _load(f)["results"]["crispedit-seq"] for f in files}
    chosen = pilot_choice(rows)
    if chosen is not None:
        gamma = rows[chosen]["config"]["edit_gamma"]
        lines += ["", f"The rule picks `{chosen}` (edit γ {gamma:g})."]
    return "\n".join(lines) + "\n"


def seq_pilot_section(d: Path = SEQ_PILOT) -> str:
    """The results page's section on the short streams of full-size rounds that chose the sequential mode's edit
    factors, when stored."""
    table = seq_pilot_table(d)
    if not table:
        return ""
    return f"""## Choosing the edit factors: rounds of 100

[`{d.name}/`]({d.name}/run.json): crispedit-seq in rounds of 100 ZsRE dev edits from 200 on (not the confirming
stream's edits), the round size of the confirming stream, one edit-factor setting per row. Round 1 trains under the
capability constraint alone, as a batch edit of 100 does, so its edits right after it are what a round lands with
all the room; a later round's edits on the final model say what it landed under the earlier rounds' constraint.
The rule the rows are read by was written before they ran: check 1, every later round's own edits read the QA
wrapper on the final model within {PILOT_LANDS:g} of round 1's edits right after round 1; check 2, round 1's edits
keep at least {PILOT_KEEPS:g} of their teacher-forced, QA-wrapper and chat reach after the last round. The setting
that meets more of them becomes the session default; on a tie, the one with the higher mean reach over all edits
under the QA wrapper, chat and no wrapper (this tie-break was written while the second setting's stream ran, before
its result).
{_run_line(d)}

{table}
"""


SEQ_ROOM = HERE / "seq_room"


def seq_room_section(d: Path = SEQ_ROOM) -> str:
    """The results page's section on the room a stream leaves its later rounds (``benchmarks/seq_room.py``
    outputs under ``d``): one table per stored stream, a row per edit-factor setting, the mean kept fraction of
    directions before each round; empty while none is stored."""
    files = sorted(f for f in d.glob("*.json") if f.name != "run.json") if d.is_dir() else []
    if not files:
        return ""
    parts = []
    for f in files:
        r = _load(f)
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
    real = _load(HERE / "compare_zsre_dev1000" / "compare.json")["results"]["crispedit-seq"]
    real_kept = " · ".join(f"{_kept(rec):.2f}" for rec in real["round_records"])
    return f"""## Room for later rounds

[`{d.name}/`]({d.name}/run.json): `benchmarks/seq_room.py` — the share of directions each round's projector would
keep (mean over the edit layers) once the earlier rounds' edit factors join the capability factors, for edit factors
at every position (`full`, the session default) or the target's (`target`) and several edit γs; round 1 is the
capability constraint alone, what batch editing trains in. The edit factors are collected on the unedited model, a
proxy for a stream's (which collects them on the model each round left). {_run_line(d)}

{chr(10).join(parts)}
For comparison, a real stream: the stored crispedit-seq row of [1 000 ZsRE edits](#1-000-zsre-edits) (dev
1000–1999, ten rounds of 100, `full` at edit γ 0.95 under that run's defaults) kept, round by round: {real_kept}.
"""


SEQ_CONFIRM = HERE / "seq_zsre_dev1000"
SEQ_ROWS = ("crispedit-seq", "ft-seq", "alphaedit-seq")  # the confirming stream's sequential rows, when stored


def retention_map_table(row: dict) -> str:
    """A ``-seq`` row's retention map as a table: after round j (down), the teacher-forced rel of round k's edits
    (across; blank above the diagonal): :func:`crispedit.experiments.retention.retention_map`; empty for a row without
    one."""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.retention import retention_map  # torch-free

    grid = retention_map(row)
    if not grid:
        return ""
    n = len(grid)
    lines = ["| after round | " + " | ".join(str(k + 1) for k in range(n)) + " |", "|---" * (n + 1) + "|"]
    for j, rec in enumerate(grid):
        lines.append(f"| {j + 1} | " + " | ".join("" if v is None else f"{v:.2f}" for v in rec) + " |")
    return "\n".join(lines) + "\n"


def landed_table(row: dict) -> str:
    """A ``-seq`` row's rounds under the QA wrapper and in chat: what each round's edits read right after their round
    (:func:`crispedit.experiments.retention.landed_by_round`) and on the final model (:func:`~crispedit.experiments.
    retention.final_by_round`), a column per round; empty for a row whose probes did not measure the former."""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.retention import final_by_round, landed_by_round  # torch-free

    landed, final = landed_by_round(row), final_by_round(row)
    if not landed:
        return ""
    n = max(len(v) for v in (*landed.values(), *final.values()))
    lines = ["| round's edits | " + " | ".join(str(k + 1) for k in range(n)) + " |", "|---" * (n + 1) + "|"]
    for w in ("qa", "chat"):
        for when, series in (("right after their round", landed.get(w)), ("on the final model", final.get(w))):
            if series:
                cells = ["–" if v is None else f"{v:.2f}" for v in series]
                lines.append(f"| WILD {w}, {when} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def seq_confirm_section(d: Path = SEQ_CONFIRM) -> str:
    """The results page's section on the confirming stream (``d``: ``seq.json``, the sequential rows' compare;
    ``batch.json``, batch crispedit's on the same edits), with the sequential mode's marks (:func:`seq_marks`) and
    crispedit-seq's retention map; empty while either is not stored."""
    if not ((d / "seq.json").is_file() and (d / "batch.json").is_file()):
        return ""
    seq, batch = _load(d / "seq.json")["results"], _load(d / "batch.json")["results"]["crispedit"]
    rows = [m for m in SEQ_ROWS if m in seq]
    differ = _other_defaults(batch, seq["crispedit-seq"]) if "crispedit-seq" in seq else []
    if differ:
        raise SystemExit(f"{d.name}: batch.json's crispedit ran with other {', '.join(differ)} than crispedit-seq")
    lines = [SEQ_HEADER.rstrip("\n"), _batch_line(f"batch crispedit ([`batch.json`]({d.name}/batch.json))", batch)]
    lines += [_seq_line(f"{m} ([`seq.json`]({d.name}/seq.json))", seq[m], batch) for m in rows]
    chunk = seq[rows[0]].get("seq_chunk")
    n_rounds = len(seq[rows[0]]["round_records"])
    marks = seq_marks(batch, seq["crispedit-seq"]) if "crispedit-seq" in seq else ""
    picture = f"\n![retention maps]({d.name}/retention_map.png)\n" if (d / "retention_map.png").is_file() else ""
    return f"""## Sequential editing: the confirming stream

[`{d.name}/`]({d.name}/run.json): ZsRE dev 1000–1999 in {n_rounds} rounds of {chunk} edits (edits no sequential
setting was tuned on), each sequential row at the session defaults, beside batch crispedit on the same 1 000 edits
with the same training contexts, answer end and preservation term. Columns as in the tuning table; the kept
directions are the mean over the edit layers of the fraction of directions the round's projector keeps.
{_run_line(d)}

{chr(10).join(lines)}

The sequential mode's marks, crispedit-seq against batch crispedit:

{marks}
crispedit-seq's retention map (teacher-forced rel of round k's edits after round j; the numbers are every row's
`retention` records in `seq.json`):

{retention_map_table(seq["crispedit-seq"]) if "crispedit-seq" in seq else ""}{picture}{_landed_part(seq)}"""


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


# ----------------------------------------------------------------------------------------- sharded memory
GPU_GIB = (24, 40, 80, 141)  # the device memories the table marks as fitting


def shard_table() -> str:
    """From ``shard_memory/table.json``: what one process holds (GiB, activations aside) for the Llama-3 shapes
    per N, and the smallest of :data:`GPU_GIB` it fits, for the docs' sharding page."""
    t = _load(SHARD_MEMORY / "table.json")
    ns = list(next(iter(t[s]["per_process"] for s in ("llama3-8b", "llama3-70b"))))
    lines = ["| shape, edited layers | " + " | ".join(f"N = {n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
    for shape, name in (("llama3-8b", "Llama-3-8B"), ("llama3-70b", "Llama-3-70B")):
        cells = []
        for n in ns:
            gib = t[shape]["per_process"][n]["total"] / 2**30
            fit = next((f"{g} GB" for g in GPU_GIB if gib < g), "none")
            cells.append(f"{gib:.1f} GiB ({fit})")
        lines.append(f"| {name}, `{t[shape]['layers']}` | " + " | ".join(cells) + " |")
    return (
        "\n".join(lines) + f"\n\nPer process, {t['dtype']} weights, activations not counted; in brackets the "
        "smallest of 24, 40, 80 and 141 GB devices it fits before activations. From "
        "[`table.json`](../results/shard_memory/table.json).\n"
    )


def shard_measured() -> str:
    """From ``shard_memory/measure_*.json``: per run, the weights a process stores and its peak resident memory during
    the edit above the process's own (interpreter and libraries, before the model), against the calculator (MiB)."""
    runs = (("measure_2proc.json", "2 processes, not split"), ("measure_2proc_shard.json", "2 processes, `--shard`"))
    lines = [
        "| run | weights stored | calculator | peak during the edit, above the bare process | calculator total |",
        "|---|---|---|---|---|",
    ]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    for f, what in runs:
        r = _load(SHARD_MEMORY / f)
        p = max(r["processes"], key=lambda x: x["peak_bytes"] - x["rss_base"])
        pred = p["predicted"]
        lines.append(
            f"| {what} ([json](../results/shard_memory/{f})) | {mib(p['held_weights'])} | "
            f"{mib(pred['blocks'] + pred['whole'])} | {mib(p['peak_bytes'] - p['rss_base'])} | "
            f"{mib(pred['total'])} |"
        )
    return (
        "\n".join(lines) + "\n\nThe process with the higher peak of each run; the bare process is its resident "
        "memory before the model was built.\n"
    )


# ---------------------------------------------------------------------------------------------- summary page
def _run_line(d: Path) -> str:
    r = _load(d / "run.json") if (d / "run.json").is_file() else {}
    cmd = r.get("command")
    cmd = "\n".join(cmd) if isinstance(cmd, list) else cmd
    out = [
        f"Stored in `{r.get('commit', '?')}`"
        + (f" ({r['date']})" if r.get("date") else "")
        + (f" on {r['machine']}" if r.get("machine") else "")
        + "."
    ]
    if r.get("note"):
        out.append(r["note"])
    text = " ".join(out)
    return text + (f"\n\n```bash\n{cmd}\n```" if cmd else "")


TITLES = {
    "compare_zsre_dev100": "100 ZsRE edits",
    "compare_counterfact_dev100": "100 CounterFact edits",
    "compare_zsre_dev1000": "1 000 ZsRE edits",
    "compare_counterfact_dev1000": "1 000 CounterFact edits",
}


def summary_page() -> str:
    """``results/README.md``: what the folder holds, how to regenerate it, and every stored run's summary."""
    demo = (DEMO / "demo.txt").read_text()
    parts = [
        f"""# Results

<!-- written by results/make.py from the data in this folder: edit the script or the data, never this file -->

Every figure the README and the documentation quote comes from a directory here: one measured experiment
each, with its command, the commit that stored it and the machine (`run.json`), its data (`compare.json`,
benchmark JSON, CSV, the demo's printed output) and the tables and figures drawn from that data. Regenerate
every table and figure, this page and the README's generated blocks with

```bash
python results/make.py              # --check: only compare; --demo: rerun the demo first
```

`tests/experiments/test_results.py` fails when this page or a README block is not what the data gives, and (marked `ci`)
when `make demo` no longer prints the stored demo table. Runs were measured on this project's 2-core CPU
machines with SmolLM2-135M-Instruct unless the run says otherwise; results of earlier one-off sweeps are in
the git history (`git log -- docs/results`). A new experiment is a new directory with its `run.json` and data,
and a section in `results/make.py`.

## The demo

`{shlex.join(demo_command())}` (what `make demo` runs: [`demo/command.sh`](demo/command.sh); output [`demo/demo.txt`](demo/demo.txt)).
{_run_line(DEMO)}

```
{demo_table(demo).rstrip()}
```
"""  # noqa: E501 (the page's lines are as long as its text)
    ]
    for name in COMPARES:
        d = HERE / name
        payload = _load(d / "compare.json")
        rr = _replaced_rows(d)
        retention = " · [round-1 retention](" + name + "/retention.png)" if (d / "retention.png").is_file() else ""
        parts.append(
            f"""## {TITLES[name]}

[`{name}/`]({name}/run.json): [full table]({name}/compare.md) · [figure]({name}/compare.png){retention}.
{_run_line(d)}

WILD and teacher-forced (TF) in percent; KL drift on held-out text in nats/token, in brackets what the K-FAC
factors predicted; capability scores in percent with the paired change against the base on the same items
(bold: more than twice its standard error); ✗: perplexity more than {BREAKING_PPL_RATIO:g}× the base's (the
model is broken).

{compare_summary(payload)}"""
            + (f"\nAlso stored:\n\n{rr}\n" if rr else "")
        )
    parts.append(f"""## Scaling with the number of edits

[`scaling/`](scaling/run.json): WILD QA rel / gen and crosstalk, KL drift (measured and predicted) and perplexity
against the number of edits (32, 100, 1 000), per method, drawn from the compares above and the stored
32-edit runs. Tables: [ZsRE](scaling/scaling_zsre.md), [CounterFact](scaling/scaling_counterfact.md).
{_run_line(HERE / "scaling")}

![scaling on ZsRE](scaling/scaling_zsre.png)

![scaling on CounterFact](scaling/scaling_counterfact.png)

## Speed

[`speed/`](speed/run.json): `benchmarks/bench_scale.py` outputs (each JSON holds its arguments and environment;
`gpu_h100/` also the printed logs of `benchmarks/gpu_scale.sh`).
{_run_line(HERE / "speed")}

{speed_table()}
{seq_tuning_section()}{seq_pilot_section()}{seq_room_section()}{seq_confirm_section()}## One edit at a time

[`edit_latency/`](edit_latency/run.json): `benchmarks/edit_latency.py` — a session fed one ZsRE edit per round in
one process, each round split into the phases its record holds (the training batches; the preservation term's kept
answers; the epochs; the round's edit factors; the rest; the evaluation: teacher-forced reliability of every edit
so far and the KL drift from the base), seconds, and the round's wall time over the 10 s target.
{_run_line(LATENCY)}

{latency_table()}
{two_threads_line()}
Runs made with `--evaluate` then measure what their rounds left, on the final model over every round's edit (WILD
free generation, the chat answers' form, subject bleed through three probes per edit, KL drift from the base):

{latency_final_table()}
{stop_rule_line()}
{subject_rows_line()}
{one_edit_settings_table()}
{stream_section()}## Eigendecompositions: float64 against float32

[`eigh/`](eigh/run.json): what decomposing the K-FAC factors in float64 (every device) costs and buys against
float32. {_run_line(HERE / "eigh")}

{eigh_tables()}
## Memory of a split edit

[`shard_memory/`](shard_memory/run.json): what one process holds in an edit with the model's decoder blocks split
across the processes (`--shard`): `benchmarks/shard_memory.py`'s calculator for the Llama-3 shapes, and a small
random-weight llama measured against it. {_run_line(SHARD_MEMORY)}

{shard_table()}
{shard_measured()}
## Chat style and subject bleed: the tuning slice

[`chat_style_zsre_dev400_32/`](chat_style_zsre_dev400_32/run.json): 32 ZsRE dev edits (400–431, the slice the
training contexts and the preservation term were tuned on) with the default contexts and with the `reply` context,
with and without `--cap-chat 75`, and with the preservation term at several strengths, each edit report stored.
WILD and TF in percent; chat length: the edited model's chat answers to 32 unrelated prompts over the base's, in
tokens; turned bare: of the base's answers longer than five words, the share now five or fewer; answer KL:
KL(base ‖ edited) on the base's own answers, nats/token; subject bleed: share of three other questions about each
edited subject now answered with its new target.
{_run_line(CHAT_STYLE)}

{chat_style_table()}
## Chat style and subject bleed: held-out edits

[`chat_style_zsre_dev100_32/`](chat_style_zsre_dev100_32/run.json): 32 ZsRE dev edits (100–131) that no setting was
tuned on, with the default contexts: without the preservation term, with it at a first setting, and at the stronger
setting chosen on the tuning slice (75 everyday prompts, four questions about each subject, weight 2); then, on one
later commit, that term with the chat turn's end trained after the target (`auto`) and with a period in its place
(`period`, the default); columns as above.
{_run_line(CHAT_STYLE_HELDOUT)}

{chat_style_table(CHAT_STYLE_HELDOUT)}
Marks at 32 edits: crispedit's defaults (the preservation term and the period answer end, `period.json`) against
no term and the chat turn's end (`defaults.json`); for reach, also the same edits paired (lost: reached before and
not after; gained: the reverse):

{keep_marks_32()}
{keep_100_section(KEEP_100, "ZsRE")}{keep_100_section(KEEP_100_CF, "CounterFact")}## Curvature study on MNIST

[`study_mnist/`](study_mnist/run.json): [`results.csv`](study_mnist/results.csv) and the trade-off figure drawn from it
(what each curvature model keeps of MNIST for the Fashion-MNIST accuracy it allows).
{_run_line(HERE / "study_mnist")}

![MNIST → Fashion-MNIST trade-off](study_mnist/tradeoff.png)
""")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------- README blocks
def readme_blocks() -> dict[str, str]:
    """Generated README blocks by name."""
    return {
        "demo": f"```\n{demo_table((DEMO / 'demo.txt').read_text()).rstrip()}\n```\n",
        "compare": headline_table(),
        "speed": speed_block(),
        "keep": keep_block(),
    }


def fill_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with the content between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->`` replaced."""
    for name, body in blocks.items():
        pat = re.compile(rf"(<!-- results:{name} -->\n).*?(<!-- /results:{name} -->)", re.S)
        if not pat.search(text):
            raise SystemExit(f"no <!-- results:{name} --> block where it is written")
        text = pat.sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return text


# --------------------------------------------------------------------------------------------------- figures
def _benchmark(name: str):
    """The module of ``benchmarks/<name>.py`` (its plotting and table functions)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def figures() -> None:
    """Redraw every table and figure from the data (needs crispedit's plotting dependencies)."""
    sys.path.insert(0, str(ROOT / "src"))
    from crispedit.experiments.compare_plot import plot_compare
    from crispedit.experiments.compare_table import compare_table
    from crispedit.experiments.retention import plot_retention, plot_retention_map
    from crispedit.experiments.study_report import write_plot

    for name in COMPARES:
        d = HERE / name
        payload = _load(d / "compare.json")
        (d / "compare.md").write_text(compare_table(payload))
        plot_compare(payload, d / "compare.png")
        plot_retention(payload, d / "retention.png")
    if (STREAM / "stream.json").is_file():
        _benchmark("session_stream").plot_stream(_load(STREAM / "stream.json"), STREAM / "stream.png")
    if (SEQ_CONFIRM / "seq.json").is_file():
        plot_retention_map(_load(SEQ_CONFIRM / "seq.json"), SEQ_CONFIRM / "retention_map.png")
    scaling = _benchmark("scaling")
    for stem, runs in SCALING.items():
        points: dict = {}
        for r in runs:
            points.update(scaling.read_points(HERE / "scaling" / r))
        (HERE / "scaling" / f"{stem}.md").write_text(scaling.scaling_table(points))
        scaling.plot_scaling(points, HERE / "scaling" / f"{stem}.png")
    import csv

    with open(HERE / "study_mnist" / "results.csv") as fh:
        rows = [
            {k: (v if k == "method" else (float(v) if v else None)) for k, v in r.items()} for r in csv.DictReader(fh)
        ]
    write_plot(HERE / "study_mnist" / "tradeoff.png", rows, title="MNIST → Fashion-MNIST, SmallLeNet")


def main(argv=None) -> int:
    """Regenerate, or with ``--check`` compare, the derived files."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--check",
        action="store_true",
        help="compare results/README.md and the README's (and "
        "docs/sharding.md's) blocks with "
        "what the data gives; write nothing",
    )
    ap.add_argument("--demo", action="store_true", help="rerun the demo command and store its output first")
    args = ap.parse_args(argv)
    if args.demo:
        run_demo()
    want = {
        SUMMARY: summary_page(),
        README: fill_blocks(README.read_text(), readme_blocks()),
        SHARDING: fill_blocks(SHARDING.read_text(), {"shard-table": shard_table(), "shard-measured": shard_measured()}),
    }
    if args.check:
        stale = [p.relative_to(ROOT) for p, text in want.items() if not p.is_file() or p.read_text() != text]
        for p in stale:
            print(f"{p} is not what the data in results/ gives: run python results/make.py", file=sys.stderr)
        return 1 if stale else 0
    figures()
    for p, text in want.items():
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
