"""``crispedit`` command line: thin — parses, calls the library, prints.

Errors a user can cause are printed as one line (``crispedit: error: ...``) with exit status 2. Building
the parser and checking the arguments import neither torch nor transformers (the method catalogue and
the configs are torch-free); a command imports them once its cheap checks have passed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from .editing.flags import (add_curvature_args, add_edits_args, add_max_drift_arg, add_model_args, add_training_args,
                            config_from_args, load_job_inputs)
from .curvature.modes import CACHE_KINDS  # torch-free
from .distributed import launched_world_size  # torch-free at import
from .errors import CrispEditError, check_input_dir, check_input_file, check_output_dir, check_output_file

# Modules that add sub-commands: each defines add_cli(subparsers) and sets `func` on its parsers; each is
# torch-free at import (its commands import the heavy modules when they run).
_COMMAND_MODULES: list[str] = [
    "crispedit.evaluation.cli",
    "crispedit.editing.session_cli",
    "crispedit.compare_cli",
    "crispedit.delta_cli",
    "crispedit.mend_cli",
    "crispedit.experiments.mnist_cli",
]


def cmd_edit(args) -> int:
    """``crispedit edit``: validate every input, load the model, edit, evaluate, save ``--out`` atomically; returns
    the exit status."""
    config = config_from_args(args)  # validates before anything slow happens
    check_output_dir(args.out, overwrite=args.overwrite, marker="edit_report.json")
    if args.checkpoint is not None:
        check_output_file(args.checkpoint, "--checkpoint")
        from .editing.checkpoint import check_checkpoint_file  # torch-free

        check_checkpoint_file(args.checkpoint)
    from .distributed import is_main, process_group_from_env

    with process_group_from_env(args.device) as device:  # under torchrun: batches split across processes
        args.device = device
        requests, model, tok, progress = load_job_inputs(args, config.n_cap)
        main_process = is_main()  # read inside: the group is gone after the block
        if not main_process:
            progress = False
        from .pipeline import run_edit_job

        report = run_edit_job(model, tok, requests, config, args.out, model_spec=args.model, kl_text=args.kl_text,
                              edits_path=str(args.edits), cache_file=args.cache, progress=progress,
                              wild=not args.no_wild, overwrite=args.overwrite, predict_drift=args.predict_drift,
                              delta_only=args.delta_only, checkpoint=args.checkpoint)
    if not main_process:
        return 0
    from .editing.loop import training_brief

    s = report["summary"]
    pred = "-" if s.get("kl_predicted") is None else f"{s['kl_predicted']:.5f}"
    print(f"{config.method}: {len(requests)} edits, rel={s['rel']} gen={s['gen']} kl_drift={s['kl_drift']:.5f} "
          f"kl_predicted={pred} edit={s['edit_seconds']:.1f}s cache={s['cache_seconds']:.1f}s "
          f"{training_brief(report['training'], config.lr)}")
    if s.get("drift_budget") and s["drift_budget"].get("max_drift") is not None:
        b = s["drift_budget"]
        print(f"  drift budget {b['max_drift']:g}: {'hit' if b['hit'] else 'not hit'} ({b['hits']} of {b['steps']} steps pulled back)")
    for ctx, w in (report.get("wild") or {}).items():
        if isinstance(w, dict):
            print(f"  WILD {ctx:5}: rel={w['rel']} gen={w['gen']} loc_vs_answer={w['loc_vs_answer']}")
    from .curvature.predicted import prediction_notes

    for line in prediction_notes(s):
        print(f"  note: {line}")
    if args.delta_only:
        print(f"delta.safetensors and edit_report.json written to {args.out}")
    else:
        print(f"edited model and edit_report.json written to {args.out} (+ delta.safetensors)")
    return 0


def cmd_cache_build(args) -> int:
    """``crispedit cache build``: collect (or reuse) the capability K-FAC factors and optionally export them to
    ``--out``."""
    from .data import capability_corpus
    from .editing import EditConfig

    config = EditConfig(layers=args.layers, n_cap=args.n_cap, max_len=args.max_len, label_mode=args.label_mode,
                        kfac_batch_size=args.kfac_batch_size, cap_corpus=args.cap_corpus, seed=args.seed)
    if args.out:
        check_output_file(args.out)
    if args.cache_dir:
        check_output_dir(args.cache_dir, "--cache-dir")  # a file there, or a root that takes no entries: now
    texts = capability_corpus(config.cap_corpus, config.n_cap)
    from .curvature.cache import save_factors
    from .distributed import is_main, process_group_from_env, world_size
    from .editing import capability_factors, curvature_spec
    from .models import cache_dir, load_model, resolve_layers, weight_fingerprint

    with process_group_from_env(args.device) as device:  # under torchrun: shard the corpus, rank 0 writes
        progress = False if args.quiet or not is_main() else None
        model, tok = load_model(args.model, dtype=args.dtype, device=device, trust_remote_code=args.trust_remote_code,
                                progress=progress)
        layers = resolve_layers(model, config.layers)
        fp = weight_fingerprint(model)
        factors, info = capability_factors(model, tok, layers, config, cache_root=args.cache_dir or cache_dir(),
                                           fingerprint=fp, force=args.force, progress=progress, kind=args.kind)
        path = info["path"]
        if args.out:
            if is_main():
                save_factors(args.out, factors, curvature_spec(model, list(layers), texts, config, fp, args.kind),
                             extra={"collect_seconds": info["seconds"], "processes": world_size()})
            path = args.out
        procs = f" on {world_size()} processes" if world_size() > 1 else ""
        state = "reused" if info["hit"] else f"built in {info['seconds']:.1f}s{procs}"
        if is_main():
            what = "K-FAC factors" if args.kind == "kfac" else "input covariances"
            print(f"{what} for {len(layers)} layers ({factors.n_tokens} tokens) {state}: {path}")
    return 0


def cmd_cache_info(args) -> int:
    """``crispedit cache info FILE``: print a factor file's metadata and factor shapes as JSON."""
    check_input_file(args.file, "curvature cache file")
    from .curvature.cache import load_factors

    factors = load_factors(args.file)
    meta = dict(factors.meta)
    meta["shapes"] = {k: [list(factors.A[k].shape)] + ([list(factors.S[k].shape)] if k in factors.S else [])
                      for k in factors.A}
    print(json.dumps(meta, indent=2))
    return 0


def cmd_cache_list(args) -> int:
    """``crispedit cache list``: one line per cached factor file (layers, texts, length, labels, model)."""
    if args.cache_dir:
        check_input_dir(args.cache_dir, "--cache-dir", missing_ok=True)  # absent: nothing cached yet
    from .curvature.cache import load_factors
    from .models import cache_dir

    root = Path(args.cache_dir or cache_dir()) / "kfac"
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        print(f"no cached factors under {root}")
    for f in files:
        try:
            spec = load_factors(f).meta.get("spec", {})
            print(f"{f}  kind={spec.get('kind', 'kfac')} layers={len(spec.get('layers', []))} n={spec.get('n_texts')} len={spec.get('max_len')} "
                  f"labels={spec.get('label_mode')} model={str(spec.get('model_fingerprint'))[:12]}")
        except CrispEditError as exc:
            print(f"{f}  (unreadable: {exc})")
    return 0


def cmd_demo(args) -> int:
    """``crispedit demo``: the embedded default job (:func:`crispedit.demo.run_demo`)."""
    from .demo import run_demo

    return run_demo(n_edits=args.n_edits, epochs=args.epochs, gamma=args.gamma, n_cap=args.n_cap, model_spec=args.model,
                    show=args.show)


class _Parser(argparse.ArgumentParser):
    """argparse with crispedit's error format: one ``crispedit: error:`` line (no usage block), exit 2."""

    def error(self, message: str):  # noqa: D401 - argparse API
        """Print one ``crispedit: error:`` line naming the command and the problem, then exit 2."""
        self.exit(2, f"crispedit: error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``crispedit`` argument parser with every sub-command (including those of ``_COMMAND_MODULES``)."""
    parser = _Parser(prog="crispedit", description="Non-destructive knowledge editing of LLMs (CrispEdit)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("edit", help="edit facts into a model and save it with edit_report.json")
    add_model_args(p)
    add_curvature_args(p)
    add_edits_args(p)
    add_training_args(p)
    add_max_drift_arg(p)
    p.add_argument("--predict-drift", action="store_true",
                   help="report kl_predicted for methods without curvature too (ft, locbf-ft: collects or reuses "
                   "the capability factors; --max-drift and --drift-penalty fetch them anyway)")
    p.add_argument("--delta-only", action="store_true",
                   help="write only delta.safetensors (the changed tensors, reversible) and edit_report.json, "
                   "not the full model")
    p.add_argument("--checkpoint", default=None, metavar="FILE",
                   help="save the training state to FILE after every epoch and, when FILE holds this run (same "
                        "model weights, edits and settings), go on from its last epoch: a killed edit resumes")
    p.add_argument("--kl-text", default=None, help="held-out text for kl_drift (default: bundled WikiText sample)")
    p.add_argument("--cache", default=None, help="use this curvature cache file (checked against the model)")
    p.add_argument("--out", required=True, help="output directory (HF model + delta.safetensors + edit_report.json); "
                   "must be new or empty")
    p.add_argument("--overwrite", action="store_true",
                   help="--out may hold an earlier edit: replace only the files that edit wrote, keep all others")
    p.add_argument("--no-wild", action="store_true",
                   help="skip the WILD section of the report (free generation under qa, none and chat contexts)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_edit)

    pc = sub.add_parser("cache", help="build or inspect K-FAC curvature caches")
    csub = pc.add_subparsers(dest="cache_command", required=True)
    b = csub.add_parser("build", help="collect capability K-FAC factors or input covariances (reused by `edit`)")
    add_model_args(b)
    add_curvature_args(b)
    b.add_argument("--kind", choices=list(CACHE_KINDS), default="kfac",
                   help="kfac: K-FAC factors A and S (crispedit, adam-nscl; default); input: the input covariance "
                   "E[k k^T] alone, forward only (memit, alphaedit)")
    b.add_argument("--cache-dir", default=None, help="cache root (default $CRISPEDIT_CACHE or ~/.cache/crispedit)")
    b.add_argument("--out", default=None, help="also write the factors to this file (for `edit --cache`)")
    b.add_argument("--force", action="store_true", help="recollect even if cached")
    b.add_argument("--quiet", action="store_true")
    b.set_defaults(func=cmd_cache_build)
    i = csub.add_parser("info", help="print a cache file's metadata")
    i.add_argument("file")
    i.set_defaults(func=cmd_cache_info)
    ls = csub.add_parser("list", help="list cached factor files")
    ls.add_argument("--cache-dir", default=None)
    ls.set_defaults(func=cmd_cache_list)

    d = sub.add_parser("demo", help="edit bundled ZsRE facts into SmolLM2 with crispedit and ft; show before/after")
    d.add_argument("--model", default="smollm2")
    d.add_argument("--n-edits", type=int, default=32)
    d.add_argument("--epochs", type=int, default=100)
    d.add_argument("--gamma", type=float, default=0.8)
    d.add_argument("--n-cap", type=int, default=64)
    d.add_argument("--show", type=int, default=6, help="rows in the before/after table")
    d.set_defaults(func=cmd_demo)

    for mod in _COMMAND_MODULES:
        importlib.import_module(mod).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: run one sub-command; user errors print one ``crispedit: error:`` line and return 2."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a flag argparse refused (one line printed already)
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.func not in (cmd_cache_build, cmd_edit) and launched_world_size() > 1:
            raise CrispEditError(f"{parser.prog} {args.command}: only `cache build` and `edit` run under torchrun; "
                                 "run this command in one process (it reuses the factors a torchrun cache build wrote)")
        return int(args.func(args) or 0)
    except CrispEditError as exc:
        print(f"crispedit: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("crispedit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
