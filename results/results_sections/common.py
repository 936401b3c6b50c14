"""Paths and the cell formats every section of the results page shares: a stored JSON, a rate, a drift, a paired change,
the line that says where and how a run was stored."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # results/
ROOT = HERE.parent


def load_json(path: Path) -> dict:
    """The JSON stored at ``path``."""
    return json.loads(path.read_text())


def pct(v) -> str:
    """A fraction as a percentage with one decimal (``–`` for none)."""
    return "–" if v is None else f"{100 * v:.1f}"


def rg(w: dict | None) -> str:
    """``rel / gen`` of a WILD summary ``w`` as percentages (``–`` for none)."""
    return "–" if not w else f"{pct(w.get('rel'))} / {pct(w.get('gen'))}"


def drift_cell(v) -> str:
    """A drift in nats/token: three decimals from 0.1 up, three significant digits below."""
    return "–" if v is None else (f"{v:.3f}" if v >= 0.1 else f"{v:.3g}")


def num_cell(v: float, fmt: str) -> str:
    """``v`` in ``fmt`` below 10 000, in three significant digits above (a broken model's perplexity)."""
    return fmt.format(v) if abs(v) < 1e4 else f"{v:.3g}"


def minutes_cell(s) -> str:
    """Seconds ``s`` as ``H h MM m`` from an hour up, else ``M m SS s`` (``–`` for none)."""
    if s is None:
        return "–"
    s = int(round(s))
    return f"{s // 3600} h {s % 3600 // 60:02d} m" if s >= 3600 else f"{s // 60} m {s % 60:02d} s"


def paired_change(x: list | None, y: list | None) -> tuple[float, float] | None:
    """Mean per-item difference of ``x`` over ``y`` (the same items) and its standard error; ``None`` unless both
    hold the same number (≥ 2) of items."""
    if not x or not y or len(x) != len(y) or len(x) < 2:
        return None
    diff = [u - v for u, v in zip(x, y)]
    mean = sum(diff) / len(diff)
    return mean, (sum((t - mean) ** 2 for t in diff) / (len(diff) - 1) / len(diff)) ** 0.5


def recorded_sources(d: Path) -> dict[str, list[str]]:
    """The crispedit source commits the stored JSONs of folder ``d`` record themselves (every ``environment``'s
    ``source``: rows, rounds, reports; short, with ``+dirty`` kept) -> the files that hold each, sorted; files
    written before crispedit recorded it hold none."""
    found: dict[str, set[str]] = {}

    def walk(x, name: str) -> None:
        if isinstance(x, dict):
            env = x.get("environment")
            if isinstance(env, dict) and env.get("source"):
                sha, _, dirty = str(env["source"]).partition("+")
                found.setdefault(sha[:7] + (f"+{dirty}" if dirty else ""), set()).add(name)
            for v in x.values():
                walk(v, name)
        elif isinstance(x, list):
            for v in x:
                walk(v, name)

    for f in sorted(d.glob("*.json")) if d.is_dir() else []:
        if f.name != "run.json":
            walk(load_json(f), f.name)
    return {k: sorted(v) for k, v in sorted(found.items())}


def run_line(d: Path) -> str:
    """Where and how the run in folder ``d`` was stored (its ``run.json``: commit, date, machine, note; and the
    commits its stored files record themselves, :func:`recorded_sources`), then its command as a bash block."""
    r = load_json(d / "run.json") if (d / "run.json").is_file() else {}
    cmd = r.get("command")
    cmd = "\n".join(cmd) if isinstance(cmd, list) else cmd
    out = [
        f"Stored in `{r.get('commit', '?')}`"
        + (f" ({r['date']})" if r.get("date") else "")
        + (f" on {r['machine']}" if r.get("machine") else "")
        + "."
    ]
    sources = recorded_sources(d)
    if sources:
        out.append(
            "The files record the crispedit source that ran them: "
            + "; ".join(f"`{sha}` ({', '.join(files)})" for sha, files in sources.items())
            + "."
        )
    if r.get("note"):
        out.append(r["note"])
    text = " ".join(out)
    return text + (f"\n\n```bash\n{cmd}\n```" if cmd else "")
