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

Each kind of experiment's tables and sections are a module of ``results_sections/`` beside this script (the demo,
the compares, speed, the chat-style remedy, sequential streams, sharding; ``common`` the shared cells); this script
puts them together into the page and the blocks, and redraws the figures.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

# the sections sit beside this script, in results_sections/: importable when it runs and when a test loads it by path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_sections.common import HERE, ROOT, load_json, run_line
from results_sections.compares import (
    BREAKING_PPL_RATIO,
    COMPARES,
    TITLES,
    compare_summary,
    headline_table,
    replaced_rows,
)
from results_sections.demo_run import DEMO, demo_command, demo_table, run_demo
from results_sections.keep_term import (
    CHAT_STYLE,
    CHAT_STYLE_HELDOUT,
    KEEP_100,
    KEEP_100_CF,
    chat_style_table,
    keep_100_section,
    keep_block,
    keep_marks_32,
)
from results_sections.seq_streams import (
    SEQ_STREAMS,
    confirm_payload,
    seq_pilot_section,
    seq_room_section,
    seq_streams_part,
    seq_tuning_section,
)
from results_sections.sharding import SHARD_MEMORY, shard_measured, shard_table
from results_sections.speed import (
    LATENCY,
    STREAM,
    eigh_tables,
    latency_final_table,
    latency_table,
    one_edit_settings_table,
    speed_block,
    speed_table,
    stop_rule_line,
    stream_section,
    subject_rows_line,
    two_threads_line,
)

README = ROOT / "README.md"
SUMMARY = HERE / "README.md"
SHARDING = ROOT / "docs" / "sharding.md"


SCALING = {
    "scaling_zsre": ("wild_zsre_dev100_32.json", "../compare_zsre_dev100", "../compare_zsre_dev1000"),
    "scaling_counterfact": (
        "wild_counterfact_dev100_32.json",
        "../compare_counterfact_dev100",
        "../compare_counterfact_dev1000",
    ),
}


def summary_page() -> str:
    """``results/README.md``: what the folder holds, how to regenerate it, and every stored run's summary."""
    demo = (DEMO / "demo.txt").read_text()
    parts = [
        f"""# Results

<!-- written by results/make.py from the data in this folder: edit the script or the data, never this file -->

Every figure the README and the documentation quote comes from a directory here: one measured experiment
each, with its command, the commit that stored it and the machine (`run.json`), its data (`compare.json`,
benchmark JSON, CSV, the demo's printed output) and the tables and figures drawn from that data. Data written by a
crispedit that records where it ran (`environment`) also names the commit of the source that ran it; each
section's run line lists those commits beside the one `run.json` names. Regenerate
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
{run_line(DEMO)}

```
{demo_table(demo).rstrip()}
```
"""  # noqa: E501 (the page's lines are as long as its text)
    ]
    for name in COMPARES:
        d = HERE / name
        payload = load_json(d / "compare.json")
        rr = replaced_rows(d)
        retention = " · [round-1 retention](" + name + "/retention.png)" if (d / "retention.png").is_file() else ""
        parts.append(
            f"""## {TITLES[name]}

[`{name}/`]({name}/run.json): [full table]({name}/compare.md) · [figure]({name}/compare.png){retention}.
{run_line(d)}

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
{run_line(HERE / "scaling")}

![scaling on ZsRE](scaling/scaling_zsre.png)

![scaling on CounterFact](scaling/scaling_counterfact.png)

## Speed

[`speed/`](speed/run.json): `benchmarks/bench_scale.py` outputs (each JSON holds its arguments and environment;
`gpu_h100/` also the printed logs of `benchmarks/gpu_scale.sh`).
{run_line(HERE / "speed")}

{speed_table()}
{seq_tuning_section()}{seq_pilot_section()}{seq_room_section()}{seq_streams_part()}## One edit at a time

[`edit_latency/`](edit_latency/run.json): `benchmarks/edit_latency.py` — a session fed one ZsRE edit per round in
one process, each round split into the phases its record holds (the training batches; the preservation term's kept
answers; the epochs; the round's edit factors; the rest; the evaluation: teacher-forced reliability of every edit
so far and the KL drift from the base), seconds, and the round's wall time over the 10 s target.
{run_line(LATENCY)}

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
float32. {run_line(HERE / "eigh")}

{eigh_tables()}
## Memory of a split edit

[`shard_memory/`](shard_memory/run.json): what one process holds in an edit with the model's decoder blocks split
across the processes (`--shard`): `benchmarks/shard_memory.py`'s calculator for the Llama-3 shapes, and a small
random-weight llama measured against it. {run_line(SHARD_MEMORY)}

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
{run_line(CHAT_STYLE)}

{chat_style_table()}
## Chat style and subject bleed: held-out edits

[`chat_style_zsre_dev100_32/`](chat_style_zsre_dev100_32/run.json): 32 ZsRE dev edits (100–131) that no setting was
tuned on, with the default contexts: without the preservation term, with it at a first setting, and at the stronger
setting chosen on the tuning slice (75 everyday prompts, four questions about each subject, weight 2); then, on one
later commit, that term with the chat turn's end trained after the target (`auto`) and with a period in its place
(`period`, the default); columns as above.
{run_line(CHAT_STYLE_HELDOUT)}

{chat_style_table(CHAT_STYLE_HELDOUT)}
Marks at 32 edits: crispedit's defaults (the preservation term and the period answer end, `period.json`) against
no term and the chat turn's end (`defaults.json`); for reach, also the same edits paired (lost: reached before and
not after; gained: the reverse):

{keep_marks_32()}
{keep_100_section(KEEP_100, "ZsRE")}{keep_100_section(KEEP_100_CF, "CounterFact")}## Curvature study on MNIST

[`study_mnist/`](study_mnist/run.json): [`results.csv`](study_mnist/results.csv) and the trade-off figure drawn from it
(what each curvature model keeps of MNIST for the Fashion-MNIST accuracy it allows).
{run_line(HERE / "study_mnist")}

![MNIST → Fashion-MNIST trade-off](study_mnist/tradeoff.png)
""")
    return "\n".join(parts)


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
        payload = load_json(d / "compare.json")
        (d / "compare.md").write_text(compare_table(payload))
        plot_compare(payload, d / "compare.png")
        plot_retention(payload, d / "retention.png")
    if (STREAM / "stream.json").is_file():
        _benchmark("session_stream").plot_stream(load_json(STREAM / "stream.json"), STREAM / "stream.png")
    for stream in SEQ_STREAMS:
        if stream.is_dir():
            plot_retention_map(confirm_payload(stream), stream / "retention_map.png")
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
