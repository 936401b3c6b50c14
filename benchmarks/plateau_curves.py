"""Where the plateau rule (``--plateau N``, :func:`crispedit.editing.history.plateaued`) would have ended stored runs:
every ``epoch_loss`` curve in the given report / compare / matrix JSON files (and sequence checkpoints'
``crispedit_sequence`` metadata), the epoch the rule stops at, the loss there and at the run's end, and — where the
run timed its epochs — the share of its training seconds the epochs before the stop took. A run the rule does not
stop trains exactly as without it, so this tells from stored curves alone which runs a setting changes.

    python benchmarks/plateau_curves.py results --epochs 8 --delta 0.02
    python benchmarks/plateau_curves.py runs/compare_zsre_dev1000/checkpoints/crispedit-seq.safetensors --epochs 8

No model is loaded; curves are read as stored (a run's own stop loss where its config is stored beside it, else
``--stop-loss``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def curves(obj, where: str, stop_loss: float | None = None):
    """Yield ``(where, epoch_loss, epoch_seconds | None, stop_loss | None)`` for every training section (a dict with
    a per-epoch ``epoch_loss`` list, single-pass editors' two-value lists left out) inside the JSON value ``obj``;
    ``stop_loss`` is the nearest enclosing ``config``'s (an edit config, or a sequence config's ``edit``)."""
    if isinstance(obj, dict):
        cfg = obj.get("config") if isinstance(obj.get("config"), dict) else None
        if cfg is not None:
            cfg = cfg.get("edit", cfg) if isinstance(cfg.get("edit"), dict) else cfg
            stop_loss = cfg.get("stop_loss", stop_loss)
        loss = obj.get("epoch_loss")
        if isinstance(loss, list) and len(loss) > 3 and not obj.get("single_pass"):
            yield where, [float(x) for x in loss], obj.get("epoch_seconds"), stop_loss
        for k, v in obj.items():
            yield from curves(v, f"{where}/{k}", stop_loss)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from curves(v, f"{where}[{i}]", stop_loss)


def _load(path: Path):
    """The JSON value of a ``.json`` file, or a sequence / training checkpoint's metadata (safetensors header)."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
    return json.loads(path.read_text(encoding="utf-8"))


def main(argv=None) -> int:
    from crispedit.editing.history import plateau_stop

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="JSON files, safetensors checkpoints or folders (searched for *.json)")
    ap.add_argument("--epochs", type=int, default=8, help="the rule's N (default 8)")
    ap.add_argument("--delta", type=float, default=0.02, help="the rule's relative fall (default 0.02)")
    ap.add_argument("--stop-loss", type=float, default=0.01, help="for curves stored without a config (default 0.01)")
    args = ap.parse_args(argv)
    files = []
    for p in map(Path, args.paths):
        files += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    n = stopped = 0
    for f in files:
        try:
            data = _load(f)
        except (OSError, ValueError):
            continue
        for where, loss, secs, stop in curves(data, str(f)):
            n += 1
            stop = args.stop_loss if stop is None else float(stop)
            at = plateau_stop(loss, stop, args.epochs, args.delta)
            if at is None:
                continue
            stopped += 1
            share = ""
            if isinstance(secs, list) and len(secs) == len(loss) and all(s is not None for s in secs):
                share = f", {sum(secs[:at]):.0f} of {sum(secs):.0f} s ({sum(secs[:at]) / sum(secs):.2f})"
            print(
                f"{where}: stops at epoch {at} of {len(loss)} (loss {loss[at - 1]:.4g}; the run ended at "
                f"{loss[-1]:.4g}){share}"
            )
    print(
        f"{stopped} of {n} curves stop earlier under --plateau {args.epochs} (delta {args.delta:g}); the rest train "
        "exactly as without it"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
