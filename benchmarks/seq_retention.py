"""Round-1 retention of sequential crispedit (CrispEdit-Seq) under several settings: each run edits the same slice
in rounds through :func:`crispedit.sessions.in_memory.run_sequence` and measures, after every round, the first
round's edits (teacher-forced rel, WILD qa / chat rel — the compare's retention probe), without the compare's
final evaluation, so settings can be tried on a tuning slice in a fraction of a compare row's time.

    python benchmarks/seq_retention.py --edits ../shared/data/edits/zsre_dev.json:2000:500 --chunk 100 \\
        --runs 'contexts=bare|contexts=bare;gamma=0.999;n_cap=30' --json runs/seqret.json

A run is ``k=v;k=v`` of :class:`~crispedit.editing.EditConfig` fields (``method`` defaults to ``crispedit``) and,
prefixed ``seq.``, :class:`~crispedit.editing.SeqConfig` fields (``seq.mix=0.8``, ``seq.weighting=tokens``).
Every run starts from the base weights. Run alone: one model job at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from edit_matrix import label, parse_runs  # noqa: E402  (same folder)
from edit_tokens import slice_arg  # noqa: E402


def seq_config(overrides: dict):
    """The :class:`~crispedit.editing.SeqConfig` of one run's overrides (``seq.``-prefixed keys go to the
    SeqConfig, the rest to its EditConfig; ``method`` defaults to ``crispedit``)."""
    from crispedit.editing import EditConfig, SeqConfig

    edit_kw = {"method": "crispedit", **{k: v for k, v in overrides.items() if not k.startswith("seq.")}}
    seq_kw = {k[len("seq.") :]: v for k, v in overrides.items() if k.startswith("seq.")}
    return SeqConfig(edit=EditConfig(**edit_kw), **seq_kw)


def spectrum(factors) -> dict:
    """Per layer (its block index) of a :class:`~crispedit.curvature.kfac.KFACFactors`: trace, largest eigenvalue and
    the top-5 eigenvalues' share of the trace of ``A`` and of ``S`` (float64 eigenvalues)."""
    import torch

    out = {}
    for name in sorted(factors.A):
        row = {}
        for k, M in (("A", factors.A[name]), ("S", factors.S[name])):
            lam = torch.linalg.eigvalsh(M.double()).flip(0).clamp_min(0.0)
            tr = float(lam.sum())
            row.update(
                {
                    f"tr{k}": round(tr, 6),
                    f"top{k}": round(float(lam[0]), 6),
                    f"top5{k}_share": round(float(lam[:5].sum()) / tr, 4) if tr > 0 else 0.0,
                }
            )
        out[name] = row
    return out


@contextlib.contextmanager
def factor_spectra(rounds: list):
    """While open, every call of :func:`crispedit.sessions.sequential.accumulate` (once per round, after it is
    edited) appends ``{"chunk": spectrum of the round's edit factors, "accumulated": of the running average}`` to
    ``rounds``: what the next round's projector is built from besides the capability factors."""
    from crispedit.sessions import sequential

    real = sequential.accumulate

    def recording(acc, new):
        out = real(acc, new)
        rounds.append({"chunk": spectrum(new), "accumulated": spectrum(out)})
        return out

    sequential.accumulate = recording
    try:
        yield
    finally:
        sequential.accumulate = real


def run_one(
    model, tokenizer, requests, overrides: dict, chunk: int, wild=("qa", "chat"), on_round=None, spectra: bool = False
) -> dict:
    """One sequential run from the base: ``{"run": label, "config": SeqConfig JSON, "rounds": [{"round", "epochs",
    "last_loss", "seconds", "tf_rel", <one WILD rel per context of wild>, "kept"}], "edit_seconds"}`` — ``kept``
    the mean over the edited layers of the fraction of directions the round's projector left free; the model is
    restored to the base afterwards. ``wild=()`` probes teacher-forced only (about half the probe's time);
    ``on_round(partial)`` is called after every round with the run so far (``edit_seconds`` ``None``).
    ``spectra``: each row also holds ``factors`` (:func:`factor_spectra`'s entry of its round) and the result
    ``capability`` (the capability factors' :func:`spectrum`)."""
    from crispedit.editing import restore
    from crispedit.evaluation.edit_eval import round_map_probe
    from crispedit.sessions.in_memory import run_sequence

    cfg = seq_config(overrides)
    head = {"run": label(overrides), "config": cfg.to_json()}
    rounds = []
    wild = tuple(wild)

    def report(rec: dict, n_rounds: int) -> None:
        """Keep and print one round's retention line."""
        after = rec.get("after_round") or {}
        train = rec.get("train") or {}
        kept = list((rec.get("projector_kept") or {}).values())
        row = {
            "round": rec["round"],
            "epochs": train.get("epochs"),
            "last_loss": (train.get("epoch_loss") or [None])[-1],
            "seconds": round(rec["edit_seconds"], 1),
            "tf_rel": after.get("tf_rel"),
            **{k: (after.get("wild") or {}).get(k) for k in wild},
            "kept": round(sum(kept) / len(kept), 4) if kept else None,
        }
        if spectra and len(seen) >= rec["round"]:
            row["factors"] = seen[rec["round"] - 1]
        rounds.append(row)
        print(
            f"  [{head['run']}] round {row['round']}/{n_rounds}: {row['epochs']} epochs, {row['seconds']} s; "
            f"round-1 edits " + " ".join(f"{k}={row[k]}" for k in ("tf_rel",) + wild),
            flush=True,
        )
        if on_round is not None:
            on_round({**head, "rounds": list(rounds), "edit_seconds": None})

    seen: list[dict] = []
    t0 = time.perf_counter()
    with factor_spectra(seen) if spectra else contextlib.nullcontext():
        res = run_sequence(
            model,
            tokenizer,
            requests,
            cfg,
            chunk,
            progress=False,
            on_round=report,
            after_round=round_map_probe(tokenizer, requests, chunk, wild=wild),
        )
    restore(model, res.original_weights)
    out = {**head, "rounds": rounds, "edit_seconds": round(time.perf_counter() - t0, 1)}
    if spectra and res.state.cap is not None:
        out["capability"] = spectrum(res.state.cap)
    return out


def table(results: list[dict]) -> str:
    """Markdown: one line per run and measure, the round-1 fraction after each round."""
    n = max(len(r["rounds"]) for r in results)
    lines = ["| run | measure | " + " | ".join(f"r{i + 1}" for i in range(n)) + " | seconds |", "|" + "---|" * (n + 3)]
    for r in results:
        measures = [k for k in r["rounds"][0] if k not in ("round", "epochs", "last_loss", "seconds", "factors")]
        secs = "–" if r["edit_seconds"] is None else f"{r['edit_seconds']:.0f}"
        for k in measures:
            cells = ["–" if x.get(k) is None else f"{x[k]:.2f}" for x in r["rounds"]]
            lines.append(f"| {r['run']} | {k} | " + " | ".join(cells + [""] * (n - len(cells))) + f" | {secs} |")
    return "\n".join(lines) + "\n"


def stream_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every stream benchmark takes: ``--edits PATH[:OFFSET[:N]]``, ``--model``, ``--chunk`` (edits per
    round); described by the first paragraph of ``doc``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--edits", required=True, help="PATH[:OFFSET[:N]] of an edit file")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--chunk", type=int, default=100, help="edits per round")
    return ap


def stream_record(args: argparse.Namespace, requests: list, **more) -> dict:
    """A stream benchmark's ``--json`` head — the edit slice (``{"file", "offset", "n"}``), ``chunk``, ``model``, the
    ``environment`` that ran it (:func:`crispedit.versions.environment`: versions, the source commit, the CPU) — and
    ``more``."""
    from crispedit.versions import environment

    path, offset, _ = slice_arg(args.edits)
    return {
        "edits": {"file": path, "offset": offset, "n": len(requests)},
        "chunk": args.chunk,
        "model": args.model,
        "environment": environment(),
        **more,
    }


def main() -> None:
    ap = stream_parser(__doc__)
    ap.add_argument("--runs", required=True, help="'k=v;k=v|k=v' overrides, one run each")
    ap.add_argument(
        "--wild",
        default="qa,chat",
        help="WILD wrappers to probe after each round (comma list; '' = teacher-forced only)",
    )
    ap.add_argument("--json", help="write every run's rounds here (rewritten after every round)")
    ap.add_argument(
        "--spectra",
        action="store_true",
        help="record per round the trace and top eigenvalues of the edit factors (chunk and accumulated)",
    )
    args = ap.parse_args()
    from crispedit.versions import source_commit

    source_commit()  # the commit at the start: the record names the code that ran, not one committed meanwhile
    wild = tuple(w for w in args.wild.split(",") if w)
    from crispedit.atomic import atomic_write_json
    from crispedit.data import load_edits
    from crispedit.models import load_model

    path, offset, n = slice_arg(args.edits)
    runs = parse_runs(args.runs)
    for r in runs:
        seq_config(r)  # a bad key fails before the model loads
    model, tok = load_model(args.model)
    requests = load_edits(path, limit=n, offset=offset)
    results: list[dict] = []

    def save(partial: dict | None = None) -> None:
        """Rewrite ``--json`` with the finished runs and, given one, the run in progress."""
        if args.json:
            atomic_write_json(
                args.json, stream_record(args, requests, wild=list(wild), runs=results + ([partial] if partial else []))
            )

    for r in runs:
        results.append(run_one(model, tok, requests, r, args.chunk, wild=wild, on_round=save, spectra=args.spectra))
        save()
    print(table(results))


if __name__ == "__main__":
    main()
