"""Speed: the step benchmarks, one edit at a time (the latency profile, its settings, the single-edit stream) and the
eigendecompositions."""

from __future__ import annotations

import statistics
from pathlib import Path

from .common import HERE, drift_cell, load_json, run_line


def speed_table() -> str:
    """One row per method of every stored ``bench_scale.py`` JSON under ``speed/``: the device, the edits, s/epoch,
    s/step, tokens/s, the share of the device's measured GEMM peak and the step time over the run's reference."""
    lines = [
        "| run | device | edits | method | s / epoch | s / step | tokens / s | of GEMM peak | step ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted((HERE / "speed").rglob("*.json")):
        p = load_json(f)
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
        p = load_json(f)
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
        p = load_json(f)
        if "final" not in p:
            continue
        s = p["final"]["summary"]
        wild = _wild_cell(s)
        lines.append(
            f"| [`{f.name}`](edit_latency/{f.name}) | {s['n_edits']} | {p['mean']['wall']:.1f} | {wild} | "
            f"{s['tf_rel']:.2f} | ×{s['style_length_ratio']:.2f} | {s['style_bare_share']:.2f} | "
            f"{s['answer_kl']:.3f} | {s['bleed_target']:.3f} | {drift_cell(s['kl_drift'])} |"
        )
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def stop_rule_line() -> str:
    """A sentence comparing the stored one-edit rounds under the two stop rules (``stop_loss.json``,
    ``stop_greedy.json``: the same edits, side by side): round and training seconds, and what the final model kept."""
    runs = {r: LATENCY / f"stop_{r}.json" for r in ("loss", "greedy")}
    if not all(f.exists() for f in runs.values()):
        return ""
    loss, greedy = (load_json(runs[r]) for r in ("loss", "greedy"))
    a, b = loss["final"]["summary"], greedy["final"]["summary"]
    lm, gm = loss["mean"], greedy["mean"]
    epochs = [sum(r["epochs"] for r in p["rounds"]) for p in (greedy, loss)]
    wild = [_wild_cell(x) for x in (b, a)]
    return (
        f"Under `--stop-rule greedy` the same {b['n_edits']} rounds took {gm['wall']:.1f} s a round against "
        f"{lm['wall']:.1f} s (training {gm['train']:.1f} s against {lm['train']:.1f} s, epochs {epochs[0]} against "
        f"{epochs[1]}), with WILD qa / chat / none {wild[0]} against {wild[1]} and KL drift "
        f"{drift_cell(b['kl_drift'])} against {drift_cell(a['kl_drift'])}, "
        f"but chat answers ×{b['style_length_ratio']:.2f} "
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
    "fast_no_keep.json": "no preservation term, `--context-sample 3`, `seq.kl_texts=4` (edit γ 0.8)",
}


def one_edit_settings_table() -> str:
    """One row per stored run of :data:`ONE_EDIT_SETTINGS` (the same one-edit rounds under the settings each row
    names): the final model's KL drift (and its ratio to the default's), WILD qa / chat / none rel and gen,
    subject bleed, chat answers' length, and the rounds' steps and mean seconds; empty unless the default is stored."""
    got = {f: load_json(LATENCY / f) for f in ONE_EDIT_SETTINGS if (LATENCY / f).exists()}
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
            f"| [{ONE_EDIT_SETTINGS[f]}](edit_latency/{f}) | "
            f"{drift_cell(s['kl_drift'])} (×{s['kl_drift'] / base:.2f}) | "
            f"{wild}, {gen} | {s['bleed_target']:.2f} | ×{s['style_length_ratio']:.2f} | "
            f"{sum(r['steps'] for r in p['rounds'])} | {p['mean']['wall']:.1f} |"
        )
    n = got[default]["final"]["summary"]["n_edits"]
    return (
        f"The same {n} one-edit rounds (`{got[default]['edits'].rsplit('/', 1)[-1]}`, the tuning slice) under the "
        f"settings each row names, on one machine, and the final model over their edits (a WILD rate moves in steps "
        f"of {1 / n:.2f} here):\n\n" + "\n".join(lines) + "\n" + _fast_line(got)
    )


def _fast_line(got: dict) -> str:
    """A sentence on the fastest one-edit setting tried (``fast_no_keep.json``, when stored): its round time against
    the target and the default's, and what the chat answers lost without the preservation term."""
    fast, default = got.get("fast_no_keep.json"), got.get(next(iter(ONE_EDIT_SETTINGS)))
    if fast is None or default is None:
        return ""
    f, d = fast["final"]["summary"], default["final"]["summary"]
    m = fast["mean"]
    return (
        f"\nThe fastest rounds tried drop the preservation term and train 3 of an edit's contexts each epoch: "
        f"{m['wall']:.1f} s a round ({m['wall'] / fast['target']:.1f}× the {fast['target']:g} s target; training "
        f"{m['train']:.1f} s, the rest {m['wall'] - m['train']:.1f} s) against {default['mean']['wall']:.1f} s, and "
        f"the edits still land (WILD qa / chat / none {_wild_cell(f)}), but the assistant's chat answers shrink to "
        f"×{f['style_length_ratio']:.2f} the base's length, {f['style_bare_share']:.2f} of them bare (the default: "
        f"×{d['style_length_ratio']:.2f}, {d['style_bare_share']:.2f}) and the KL drift is "
        f"×{f['kl_drift'] / d['kl_drift']:.2f} the default's: the preservation term is what keeps the "
        "assistant's answers, and even without it a round takes more than the target.\n"
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
        return load_json(LATENCY / f"{name}.json")["final"]["summary"]

    def slice_of(name: str) -> str:
        _, offset, n = load_json(LATENCY / f"{name}.json")["edits"].rsplit(":", 2)
        return f"ZsRE dev {offset}–{int(offset) + int(n) - 1}"

    def compare(before: dict, after: dict) -> str:
        wild = [_wild_cell(x) for x in (before, after)]
        return (
            f"bleed {before['bleed_target']:.3f} → {after['bleed_target']:.3f}, WILD qa / chat / none {wild[0]} → "
            f"{wild[1]}, chat length ×{before['style_length_ratio']:.2f} → ×{after['style_length_ratio']:.2f}, "
            f"KL drift {drift_cell(before['kl_drift'])} → {drift_cell(after['kl_drift'])}"
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
    target = load_json(runs["fp32"])["target"]
    fp32, bf16 = (load_json(runs[r])["rounds"][1] for r in ("fp32", "bf16"))
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

STREAM_AFTER = (10, 25, 50, 75, 100)


def _stream_final_row(label: str, m: dict) -> str:
    """One row of the stream's final measures (``benchmarks/edit_latency.py``'s ``_final_measures`` summary)."""
    s = m["summary"]
    wild = _wild_cell(s)
    return (
        f"| {label} | {s['n_edits']} | {wild} | {s['tf_rel']:.2f} | ×{s['style_length_ratio']:.2f} | "
        f"{s['bleed_target']:.3f} | {drift_cell(s['kl_drift'])} | {s['ppl']:.2f} ({s['ppl_base']:.2f}) |"
    )


def stream_section(d: Path = STREAM) -> str:
    """The results page's section on a stream of one edit per ``crispedit session add`` call
    (``benchmarks/session_stream.py``'s ``stream.json`` under ``d``): the calls' seconds and how they move with the
    rounds before them, the first rounds' edits after later rounds, the KL drift along the stream and the final
    model's measures; empty while none is stored."""
    f = d / "stream.json"
    if not f.is_file():
        return ""
    p = load_json(f)
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
            + f" | {statistics.fmean(got):.2f} | {drift_cell(rounds[k - 1]['kl_drift'])} |"
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
{run_line(d)}

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
    share = load_json(HERE / "speed" / "bench_share_smollm2_100.json")
    bf16 = load_json(HERE / "speed" / "bench_bf16_smollm2_32.json")
    h100 = load_json(HERE / "speed" / "gpu_h100" / "smollm2_1000_tokens_b.json")
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


def eigh_tables() -> str:
    """From ``eigh/``: float64 / float32 ``torch.linalg.eigh`` time per size (with the n³ extrapolation, marked as
    one) and, per γ, the range over SmolLM2's layers of the projection error against the float64 formula for a
    float32 eigensolver and for crispedit's projector."""
    t = load_json(HERE / "eigh" / "bench_eigh_cpu.json")
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
    p = load_json(HERE / "eigh" / "eigh_precision_smollm2.json")
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
