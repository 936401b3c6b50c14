"""Every method's edit of the tiny test model, as data to compare across two trees: a refactor that should not change
what an edit does is checked by running this under the old and the new tree and diffing the outputs.

    PYTHONPATH=OLD/src python scripts/edit_identity.py old.json
    PYTHONPATH=NEW/src python scripts/edit_identity.py new.json
    python scripts/edit_identity.py --diff old.json new.json   # one line per method; exit 1 on a difference

Per method (MEND aside: it needs a trained network): the edit report that ``crispedit.pipeline.run_edit_job``
writes, without its timings, paths, versions and environment, and a SHA-256 of every weight of the edited model. The
fine-tuning methods run with the preservation term on; one thread, so the floats are those of one machine and torch.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"created", "path", "file", "environment", "crispedit_version", "uid", "out", "timings", "when"}
LAYERS = "model.layers.{1-2}.mlp.down_proj"


def untimed(x):
    """``x`` without wall-clock figures (keys naming seconds) and the keys of :data:`SKIP`."""
    if isinstance(x, dict):
        return {k: untimed(v) for k, v in x.items() if "second" not in k and k not in SKIP}
    if isinstance(x, list):
        return [untimed(v) for v in x]
    return x


def run(out: Path) -> None:
    """Edit the tiny model with every method and write ``{method: {report, weights, config_keys}}`` to ``out``."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch

    from conftest import build_llama, build_tokenizer
    from crispedit.data import EditRequest
    from crispedit.editing import EditConfig
    from crispedit.editing.registry import method_names
    from crispedit.pipeline import run_edit_job

    torch.set_num_threads(1)
    tok = build_tokenizer()
    base = build_llama(len(tok))
    reqs = [
        EditRequest(f"Who founded club {i}?", f"Founder {chr(65 + i)}", subject=f"club {i}", ground_truth="Nobody")
        for i in range(3)
    ]
    common = dict(layers=LAYERS, epochs=3, batch_size=2, n_cap=4, max_len=48, contexts="bare,prefix:1")
    result = {}
    with tempfile.TemporaryDirectory() as d:
        os.environ["CRISPEDIT_CACHE"] = str(Path(d) / "cache")
        for m in method_names():
            if m == "mend":
                continue
            keep = dict(keep_chat=2, keep_subject=1, keep_tokens=6) if m in ("crispedit", "ft", "adam-nscl") else {}
            model = copy.deepcopy(base)
            run_edit_job(model, tok, reqs, EditConfig(method=m, **common, **keep), Path(d) / m, progress=False)
            h = hashlib.sha256()
            for n, p in sorted(model.state_dict().items()):
                h.update(n.encode())
                h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            report = json.loads((Path(d) / m / "edit_report.json").read_text())
            result[m] = {"report": untimed(report), "weights": h.hexdigest(), "config_keys": list(report["config"])}
            print(m, "done", flush=True)
    out.write_text(json.dumps(result, indent=1))


def diff(a: Path, b: Path) -> int:
    """Print per method whether the weights, the reports and the reports' config key order agree; 1 if any differs."""
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    bad = 0
    for m in sorted(set(x) | set(y)):
        if m not in x or m not in y:
            print(f"{m}: only in {'new' if m in y else 'old'}")
            bad = 1
            continue
        same = [x[m][k] == y[m][k] for k in ("weights", "report", "config_keys")]
        print(
            f"{m}: weights {'same' if same[0] else 'DIFFER'}, report {'same' if same[1] else 'DIFFERS'}, "
            f"config key order {'same' if same[2] else 'differs'}"
        )
        bad |= not (same[0] and same[1])
    return bad


def main() -> int:
    """Run the edits (one argument: the output file) or compare two outputs (``--diff``)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--diff", action="store_true", help="compare two outputs instead of writing one")
    args = p.parse_args()
    if args.diff:
        if len(args.files) != 2:
            p.error("--diff takes two files")
        return diff(*args.files)
    run(args.files[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
