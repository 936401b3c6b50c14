"""``crispedit edit``: validate every input, load the model, edit, evaluate and save the result (registered
through ``crispedit.cli._COMMAND_MODULES``). Torch-free at import; the command imports torch once its cheap
checks have passed."""

from __future__ import annotations

from ..paths import check_output_dir, check_output_file
from .flags import (
    add_curvature_args,
    add_edits_args,
    add_max_drift_arg,
    add_model_args,
    add_shard_arg,
    add_training_args,
    check_shard_launch,
    config_from_args,
    load_job_inputs,
)

__all__ = ["add_cli", "cmd_edit"]


def cmd_edit(args) -> int:
    """``crispedit edit``: validate every input, load the model, edit, evaluate, save ``--out`` atomically; returns
    the exit status."""
    config = config_from_args(args)  # validates before anything slow happens
    check_output_dir(args.out, overwrite=args.overwrite, marker="edit_report.json")
    if args.checkpoint is not None:
        check_output_file(args.checkpoint, "--checkpoint")
        from ..editing.checkpoint import check_checkpoint_file  # torch-free

        check_checkpoint_file(args.checkpoint)
    check_shard_launch(args)
    from ..distributed import is_main, process_group_from_env

    with process_group_from_env(args.device) as device:  # under torchrun: batches split across processes
        args.device = None if args.shard else device  # --shard: loaded on the host, then split onto the devices
        requests, model, tok, progress = load_job_inputs(args, config.n_cap)
        main_process = is_main()  # read inside: the group is gone after the block
        if not main_process:
            progress = False
        fingerprint = None
        if args.shard:
            from ..editing import shard_for_edit

            fingerprint = shard_for_edit(model, config, device)
        from ..pipeline import run_edit_job

        report = run_edit_job(
            model,
            tok,
            requests,
            config,
            args.out,
            model_spec=args.model,
            kl_text=args.kl_text,
            edits_path=str(args.edits),
            cache_file=args.cache,
            progress=progress,
            wild=not args.no_wild,
            overwrite=args.overwrite,
            predict_drift=args.predict_drift,
            delta_only=args.delta_only,
            checkpoint=args.checkpoint,
            fingerprint=fingerprint,
        )
    if main_process:
        _print_report(report, config.method, len(requests), args.out, args.delta_only)
    return 0


def _print_report(report: dict, method: str, n_edits: int, out, delta_only: bool) -> None:
    """The edit's summary on standard output: the headline figures and training, the drift budget, WILD per
    wrapper, the chat style and subject bleed, the drift prediction's notes and what was written where."""
    from ..editing.history import training_brief

    s = report["summary"]
    pred = "-" if s.get("kl_predicted") is None else f"{s['kl_predicted']:.5f}"
    print(
        f"{method}: {n_edits} edits, rel={s['rel']} gen={s['gen']} kl_drift={s['kl_drift']:.5f} "
        f"kl_predicted={pred} edit={s['edit_seconds']:.1f}s cache={s['cache_seconds']:.1f}s "
        f"{training_brief(report['training'], report['config']['lr'])}"
    )
    if s.get("drift_budget") and s["drift_budget"].get("max_drift") is not None:
        b = s["drift_budget"]
        print(
            f"  drift budget {b['max_drift']:g}: {'hit' if b['hit'] else 'not hit'} ({b['hits']} of {b['steps']} "
            "steps pulled back)"
        )
    for ctx, w in (report.get("wild") or {}).items():
        if isinstance(w, dict):
            cross = f" crosstalk={w['cross']}" if w.get("cross") is not None else ""
            print(f"  WILD {ctx:5}: rel={w['rel']} gen={w['gen']} loc_vs_answer={w['loc_vs_answer']}{cross}")
    a = report.get("assistant") or {}
    if a.get("style"):
        st = a["style"]
        print(
            f"  chat style: length x{st['length_ratio']:.2f} of the base's, bare {st['bare_share']:.2f}, "
            f"changed {st['changed']:.2f}, answer KL {st['answer_kl']:.4f} ({st['n']} unrelated prompts)"
        )
    if a.get("bleed"):
        b = a["bleed"]
        print(
            f"  subject bleed: new target in {b['target']:.3f}, changed {b['changed']:.3f} of {b['n']} other "
            f"questions about {b['edits']} edited subjects"
        )
    from ..curvature.predicted import prediction_notes

    for line in prediction_notes(s):
        print(f"  note: {line}")
    if delta_only:
        print(f"delta.safetensors and edit_report.json written to {out}")
    else:
        print(f"edited model and edit_report.json written to {out} (+ delta.safetensors)")


def add_cli(sub) -> None:
    """Register ``crispedit edit`` on ``subparsers`` (it may run under ``torchrun``: batches split across processes)."""
    from ..evaluation.wild import EVAL_WRAPPERS  # torch-free: named in --no-wild's help

    p = sub.add_parser("edit", help="edit facts into a model and save it with edit_report.json")
    add_model_args(p)
    add_curvature_args(p)
    add_edits_args(p)
    add_training_args(p)
    add_max_drift_arg(p)
    add_shard_arg(p)
    p.add_argument(
        "--predict-drift",
        action="store_true",
        help="report kl_predicted for methods without curvature too (ft, locbf-ft: collects or reuses "
        "the capability factors; --max-drift and --drift-penalty fetch them anyway)",
    )
    p.add_argument(
        "--delta-only",
        action="store_true",
        help="write only delta.safetensors (the changed tensors, reversible) and edit_report.json, not the full model",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="FILE",
        help="save the training state to FILE after every epoch (memit, alphaedit: every batch of edits) "
        "and, when FILE holds this run (same model weights, edits and settings), go on from there: "
        "a killed edit resumes",
    )
    p.add_argument("--kl-text", default=None, help="held-out text for kl_drift (default: bundled WikiText sample)")
    p.add_argument("--cache", default=None, help="use this curvature cache file (checked against the model)")
    p.add_argument(
        "--out",
        required=True,
        help="output directory (HF model + delta.safetensors + edit_report.json); must be new or empty",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="--out may hold an earlier edit: replace only the files that edit wrote, keep all others",
    )
    p.add_argument(
        "--no-wild",
        action="store_true",
        help="skip the WILD section of the report (free generation under the evaluation wrappers "
        + ", ".join(EVAL_WRAPPERS)
        + ")",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_edit, torchrun=True)  # may run under torchrun
