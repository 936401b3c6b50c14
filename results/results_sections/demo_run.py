"""The demo: the command ``results/demo/command.sh`` holds, its printed tables, rerunning it, and comparing a rerun with
the stored output (a rate may move by one edit's share)."""

from __future__ import annotations

import datetime
import json
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from .common import HERE, ROOT

DEMO = HERE / "demo"


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
