"""A stream of edits fed to a session through the CLI, one ``crispedit session add`` process per round, as a service
that starts a process per correction would: the wall time of every call, what each round's record says it spent,
and how the first rounds' edits hold as the stream goes on.

    python benchmarks/session_stream.py --session runs/stream/session \\
        --edits ../shared/data/edits/zsre_dev.json:1000:100 --json runs/stream/stream.json

Resumable: a round the session has committed is not run again, and the wall times already taken are kept (in
``<session>.walls.json``, written after every call). ``--per-round`` edits go in each round; ``--init`` passes flags
to ``crispedit session init`` (``--init="--stop-rule greedy"``). A round's wall time counts the process start, the
model's loading and everything ``session add`` does; a round whose process was stopped or starved (its longest
epoch, or one of its phases, over :data:`STALL` times the stream's median: :func:`stalled`) is counted apart.
``--final K`` then measures the final model (WILD under every wrapper, style drift, subject bleed, KL drift:
``edit_latency.py``'s measures) over the first K rounds' edits and over all of them. Run alone: one model job at a
time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from edit_latency import PHASES, _final_measures, phases  # noqa: E402  (same folder)
from edit_tokens import slice_arg  # noqa: E402

STALL = 5.0  # a round whose longest epoch (or a phase) is this many times the stream's median was stopped or starved
STALL_SECONDS = 30.0  # and a phase that many seconds over its median: a short phase's jitter is not a stall


def _cli(*args: str) -> list[str]:
    """The command line of one ``crispedit`` call on this tree's code."""
    return [sys.executable, "-m", "crispedit", "--log-level", "warning", *args]


def _committed(session: Path) -> list[dict]:
    """The round records the session has committed (its ``state.json``), oldest first."""
    state = session / "state.json"
    return json.loads(state.read_text())["rounds"] if state.exists() else []


def run_stream(session: Path, path: str, offset: int, n: int, per_round: int, init: list[str], walls: Path) -> dict:
    """Create ``session`` when missing, then add the rounds it lacks, timing each call; returns ``{round: seconds}``
    (the calls of this and earlier runs)."""
    from crispedit.atomic import atomic_write_json

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}  # every call runs this tree's code
    taken = {int(k): v for k, v in json.loads(walls.read_text()).items()} if walls.exists() else {}
    if not (session / "session.json").exists():
        subprocess.run(_cli("session", "init", "--out", str(session), "--quiet", *init), check=True, env=env)
    for k in range(len(_committed(session)), -(-n // per_round)):
        start, count = offset + k * per_round, min(per_round, n - k * per_round)
        t = time.perf_counter()
        subprocess.run(
            _cli("session", "add", str(session), "--edits", path, "--offset", str(start), "--n-edits", str(count))
            + ["--quiet"],
            check=True,
            env=env,
        )
        taken[k + 1] = round(time.perf_counter() - t, 3)
        atomic_write_json(walls, {str(r): s for r, s in sorted(taken.items())})
        print(f"round {k + 1}: {taken[k + 1]:.1f} s", flush=True)
    return taken


def call_seconds(row: dict) -> float:
    """What a :func:`summarize` row's call spent outside its round's record (process start, model loading, the
    commit), seconds; 0 without a wall time."""
    return row["wall"] - row["phases"]["total"] if row["wall"] is not None else 0.0


def stalled(records: list[dict], rows: list[dict]) -> list[bool]:
    """Whether each round was stopped or starved: its longest epoch over :data:`STALL` times the stream's median
    epoch, or one of its phases — or the rest of its call (process start, loading, commit) — over :data:`STALL`
    times that phase's median over the stream and :data:`STALL_SECONDS` above it (a pause outside training shows
    there, not in an epoch)."""
    epochs = [e for r in records for e in (r["train"].get("epoch_seconds") or []) if e is not None]
    typical = statistics.median(epochs) if epochs else 0.0

    def parts(row: dict) -> dict:
        call = {"call": call_seconds(row)} if row["wall"] is not None else {}
        return {**{k: row["phases"][k] for k in PHASES}, **call}

    each = [parts(row) for row in rows]
    median = {k: statistics.median(p[k] for p in each if k in p) for k in {k for p in each for k in p}}
    out = []
    for r, p in zip(records, each):
        longest = max((e for e in (r["train"].get("epoch_seconds") or []) if e is not None), default=0.0)
        slow = any(v > STALL * median[k] and v - median[k] > STALL_SECONDS for k, v in p.items())
        out.append(bool((typical and longest > STALL * typical) or slow))
    return out


def summarize(records: list[dict], walls: dict, first: int) -> dict:
    """Per round: the call's wall time, the record's phases (:func:`edit_latency.phases`), epochs, steps, KL drift
    and whether it stalled (:func:`stalled`); the median and mean wall time over the rounds that did not; and the
    teacher-forced reliability of each of the first ``first`` rounds' edits after every round (``retention[k][j]``:
    round ``j + 1``'s edits after round ``k + 1``)."""
    rows = [
        {
            "round": r["round"],
            "wall": walls.get(r["round"]),
            "phases": phases(r),
            "epochs": r["train"]["epochs"],
            "steps": r["train"]["steps"],
            "kl_drift": r.get("kl_drift"),
        }
        for r in records
    ]
    for row, flag in zip(rows, stalled(records, rows)):
        row["stalled"] = flag
    clean = [w["wall"] for w in rows if w["wall"] is not None and not w["stalled"]]
    retention = [
        [r["retention"].get(str(j), {}).get("rel") for j in range(1, min(first, r["round"]) + 1)] for r in records
    ]
    return {
        "rounds": rows,
        "wall_median": round(statistics.median(clean), 3) if clean else None,
        "wall_mean": round(statistics.fmean(clean), 3) if clean else None,
        "stalled_rounds": [w["round"] for w in rows if w["stalled"]],
        "retention_first": retention,
    }


def plot_stream(summary: dict, path: str | Path) -> None:
    """Write a stream's picture to ``path`` (PNG) from its :func:`summarize` output: each round's wall time split into
    the phases its record holds and the rest of the call (:func:`call_seconds`), seconds, a stopped or starved round
    marked instead; and, per round, the KL drift from the base (nats/token) beside the mean teacher-forced rel of the
    first rounds' edits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from crispedit.atomic import atomic_write_figure

    rounds = summary["rounds"]
    x = [r["round"] for r in rounds]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 6.0), sharex=True)
    timed = [r for r in rounds if not r.get("stalled")]  # a stopped round's seconds are the pause's, not the round's
    below = [0.0] * len(timed)
    for name in (*PHASES, "call"):
        if name == "call":  # what the process spent outside the round's own record
            height = [max(call_seconds(r), 0.0) for r in timed]
        else:
            height = [r["phases"][name] for r in timed]
        top.bar([r["round"] for r in timed], height, bottom=below, width=1.0, label=name)
        below = [a + b for a, b in zip(below, height)]
    apart = [r["round"] for r in rounds if r.get("stalled")]
    if apart:
        top.plot(apart, [0.0] * len(apart), "kx", label="stopped or starved")
    top.set_ylabel("seconds")
    top.set_title("one edit per `crispedit session add` call: where each call's seconds go", fontsize=10)
    top.legend(fontsize=7, ncol=4)
    bottom.plot(x, [r["kl_drift"] for r in rounds], color="tab:red")
    bottom.set_ylabel("KL drift from the base", color="tab:red")
    bottom.set_xlabel("round")
    held = bottom.twinx()
    first = [
        statistics.fmean(v for v in rets if v is not None) if any(v is not None for v in rets) else float("nan")
        for rets in summary["retention_first"]
    ]
    held.plot(x, first, color="tab:blue")
    held.set_ylim(0.0, 1.05)
    held.set_ylabel(f"TF rel of the first {len(summary['retention_first'][-1])} edits", color="tab:blue")
    atomic_write_figure(path, fig, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    """Run (or resume) the stream, then summarize it; returns (and with ``--json`` writes) the summary, with
    ``"final": {"first": measures, "all": measures}`` under ``--final``."""
    from crispedit.atomic import atomic_write_json
    from crispedit.data import load_edits
    from crispedit.sessions.session import Session
    from crispedit.versions import stamped

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--session", required=True, type=Path, help="the session directory (created when missing)")
    ap.add_argument("--edits", type=slice_arg, required=True, help="FILE:OFFSET:N — the stream's edits")
    ap.add_argument("--per-round", type=int, default=1, help="edits per round (default 1)")
    ap.add_argument("--init", default="", help="flags for `crispedit session init` (the model: --model)")
    ap.add_argument("--first", type=int, default=10, help="rounds whose edits' retention is followed (default 10)")
    ap.add_argument(
        "--final",
        type=int,
        default=0,
        metavar="K",
        help="measure the final model over the first K rounds' edits and over all of them",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    path, offset, n = args.edits
    walls = args.session.with_name(args.session.name + ".walls.json")
    taken = run_stream(args.session, path, offset, n, args.per_round, args.init.split(), walls)
    out = {
        "edits": f"{path}:{offset}:{n}",
        "per_round": args.per_round,
        "init": args.init,
        **summarize(_committed(args.session), taken, args.first),
        "command": " ".join(["python", "benchmarks/session_stream.py", *(argv or sys.argv[1:])]),
    }
    if args.final:
        session = Session.open(args.session)
        requests = load_edits(path, limit=n, offset=offset)
        out["final"] = {
            "first": _final_measures(session, requests[: args.final * args.per_round], session.config),
            "all": _final_measures(session, requests, session.config),
        }
    print(f"median round {out['wall_median']} s over {len(out['rounds'])} rounds; stalled: {out['stalled_rounds']}")
    if args.json:
        atomic_write_json(args.json, stamped(out))
    return out


if __name__ == "__main__":
    main()
