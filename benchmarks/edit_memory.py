"""How an edit's memory grows with the edit set: peak resident memory (VmHWM, MiB) of ``crispedit.edit`` at its
defaults on each slice of an edit file, through the capability statistics (from the cache when there), the
training preparation (sequences, batches, the fast path's cached prefix states) and the first ``--steps``
training steps, each slice in a fresh process (a process's peak never falls). The training's later steps repeat
the first ones' shapes, so the peak past them grows only by what the allocator keeps.

    python benchmarks/edit_memory.py --edits ../shared/data/edits/zsre_dev.json:100:100 \\
        --edits ../shared/data/edits/zsre_dev.json:1000:1000 \\
        --edits ../shared/data/edits/counterfact_10k_dev.json:0:3000

Each ``--edits`` is ``PATH[:OFFSET[:N]]`` (as in ``edit_tokens.py``, which counts the tokens and the prefix states'
size without training). Run alone: the figures are this process's, but a second model job slows it. Prints a
Markdown table; ``--json FILE`` writes the rows. Linux only (reads ``/proc/self/status``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from edit_tokens import slice_arg  # noqa: E402  (same folder)

PHASES = ("loaded", "prepared", "first_step", "last_step")


def _mib() -> tuple[int, int]:
    """(VmHWM, VmRSS) of this process in MiB."""
    from crispedit.experiments.compare import proc_status_kib

    return proc_status_kib("VmHWM") // 1024, proc_status_kib("VmRSS") // 1024


class _Enough(Exception):
    """Raised after the last measured step to end the edit there."""


def measure(model, tok, requests, steps: int, config=None) -> dict:
    """The peak and current memory (MiB) of this process after ``requests`` are loaded, after an edit's
    preparation (when its first step starts), after its first step and after step ``steps``, where the edit of
    ``model`` (``config``: the defaults) is ended; ``model`` is left part-edited. ``{phase: {hwm_mib, rss_mib,
    seconds}}`` plus ``steps`` run."""
    import crispedit.editing.loop as loop
    from crispedit import EditConfig, edit
    from crispedit.editing.steptimer import NULL_TIMER

    t0, row = time.perf_counter(), {}

    def mark(phase: str) -> None:
        hwm, rss = _mib()
        row[phase] = {"hwm_mib": hwm, "rss_mib": rss, "seconds": round(time.perf_counter() - t0, 1)}

    mark("loaded")

    class Counted(NULL_TIMER.__class__):
        """The loop's default timer, with memory read at the first step's start, after the first step and after the
        last measured one, where the edit ends."""

        done = 0

        def start_step(self) -> None:
            """Read memory before the first step."""
            if self.done == 0:
                mark("prepared")

        def end_step(self, skipped: bool = False) -> None:
            """Count the step; read memory after the first and the last measured one."""
            self.done += 1
            if self.done == 1:
                mark("first_step")
            if self.done >= steps:
                mark("last_step")
                raise _Enough

    counted = Counted()
    loop.NULL_TIMER = counted  # the timer the loop takes when none is given: its step boundaries
    try:
        edit(model, tok, requests, config or EditConfig(), progress=False)
    except _Enough:
        pass
    finally:
        loop.NULL_TIMER = NULL_TIMER
    return {"steps": counted.done, **row}


def child(path: str, offset: int, n: int | None, steps: int, model_spec: str) -> dict:
    """One slice in this process: the model and the slice's requests loaded, then :func:`measure`."""
    from crispedit import load_edits, load_model

    model, tok = load_model(model_spec)
    requests = load_edits(path, limit=n, offset=offset)
    return {
        "edits_file": Path(path).name,
        "offset": offset,
        "edits": len(requests),
        **measure(model, tok, requests, steps),
    }


def main(argv: list[str] | None = None) -> int:
    """Run every slice in its own process; print the table, write ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", action="append", required=True, metavar="PATH[:OFFSET[:N]]")
    ap.add_argument("--steps", type=int, default=10, help="training steps to run (default 10)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*slice_arg(args.edits[0]), args.steps, args.model)))
        return 0
    rows = []
    for spec in args.edits:
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--edits", spec, "--steps", str(args.steps), "--model", args.model],
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            sys.exit(
                f"edit_memory: {spec} failed: {out.stderr.strip().splitlines()[-1] if out.stderr else out.returncode}"
            )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"| edits | loaded (peak / now) | prepared | first step | step {args.steps} | peak MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[p]['hwm_mib']} / {r[p]['rss_mib']}" if p in r else "—" for p in PHASES]
        peak = max(r[p]["hwm_mib"] for p in PHASES if p in r)
        print(f"| {r['edits_file']} {r['offset']}+{r['edits']} | " + " | ".join(cells) + f" | {peak} |")
    if args.json:
        from crispedit.atomic import atomic_write_bytes

        atomic_write_bytes(
            args.json, json.dumps({"model": args.model, "steps": args.steps, "rows": rows}, indent=2).encode()
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
