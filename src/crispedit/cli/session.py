"""``crispedit session init|add|status|export|plot``: durable sequential editing from the command line. ``add``
may run under ``torchrun`` (its batches split across the processes; with ``--shard`` the model's decoder blocks too,
as ``edit --shard``); the others run in one process.

Every command checks what it can without torch first — flags, the session directory's JSON files, edit
files, output destinations — and imports :mod:`crispedit.sessions.session` (torch) only then."""

from __future__ import annotations

import json
from pathlib import Path

from ..editing.config import SeqConfig
from ..paths import check_dir_takes_entries, check_output_dir, check_output_file
from ..sessions.files import read_session_meta, read_session_state
from .flags import (
    add_curvature_args,
    add_edits_args,
    add_max_drift_arg,
    add_model_args,
    add_settings_args,
    add_shard_arg,
    add_training_args,
    check_job_files,
    check_shard_launch,
    config_from_args,
    settings_from_args,
)

__all__ = ["add_cli"]


def _fmt(x, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _epochs(train: dict) -> str:
    """The status table's epochs cell of a round's ``train`` record: the loop's epochs, ``-`` for a
    single-pass editor (MEMIT, AlphaEdit, UltraEdit, MEND), which runs none."""
    return "-" if train.get("single_pass") else str(train.get("epochs"))


def _check_session(path) -> None:
    """One-line error unless ``path`` is a session directory whose ``session.json`` and ``state.json`` read
    and have the expected shape (what :meth:`Session.open` checks first, here without torch) and that takes
    new entries (tried with a probe file: every command takes the session's lock file there, ``add`` writes
    its round)."""
    read_session_meta(path)
    read_session_state(path)
    check_dir_takes_entries(path, "session directory")


def cmd_init(args) -> int:
    """``crispedit session init``: create (or reopen) a session directory with its capability factors."""
    edit = config_from_args(args)  # the same mapping of training/curvature flags as `crispedit edit`
    existed = (Path(args.out) / "session.json").is_file()
    if existed:
        read_session_meta(args.out)  # another version's session is refused before any work
    config = SeqConfig(**{**settings_from_args(args, SeqConfig), "edit": edit})
    if not existed:
        check_output_dir(args.out, "--out")
    check_job_files(args, edit.n_cap)
    from ..sessions.session import Session

    s = Session.create(
        args.out,
        args.model,
        config,
        dtype=args.dtype,
        device=args.device,
        cache_file=args.cache,
        progress=None if not args.quiet else False,
    )
    verb = "opened existing" if existed else "created"
    print(f"{verb} session {s.meta['name']} at {args.out}: {len(s.meta['layers'])} layers, round {s.round}")
    return 0


def cmd_add(args) -> int:
    """``crispedit session add``: apply one round of edits and print its retention line. Under ``torchrun`` every
    process runs the round (``--shard``: on the model split across them) and rank 0 alone writes and prints."""
    from ..data import load_edits

    check_shard_launch(args)
    _check_session(args.dir)
    requests = load_edits(args.edits, limit=args.n_edits, offset=args.offset)
    from ..distributed import is_main, process_group_from_env
    from ..editing.history import training_brief
    from ..sessions.session import Session

    with process_group_from_env(args.device) as device:  # under torchrun: batches split across processes
        main_process = is_main()  # read inside: the group is gone after the block
        s = Session.open(args.dir, model=args.model, device=device, shard=args.shard)
        if main_process:
            print(f"round {s.round + 1}: editing {len(requests)} requests from {args.edits}", flush=True)
        rec = s.add(requests, source=str(args.edits), progress=None if not args.quiet and main_process else False)
    if not main_process:
        return 0
    ret = " ".join(f"r{j}={_fmt(v['rel'], 2)}" for j, v in rec["retention"].items())
    print(
        f"round {rec['round']} committed: rel={_fmt(rec['rel'])} rel_all={_fmt(rec['rel_all'])} "
        f"kl_drift={rec['kl_drift']:.5f} kl_predicted={_fmt(rec.get('kl_predicted'), 5)} "
        f"{training_brief(rec['train'])} {rec['edit_seconds']:.1f}s | retention {ret}"
    )
    if rec.get("drift_budget"):
        b = rec["drift_budget"]
        print(
            f"  drift budget: round spent {_fmt(rec.get('kl_predicted_round'), 5)} of {b['round_budget']:.5f}, "
            f"{b['remaining']:.5f} of {b['session_budget']:g} left ({b.get('hits', 0)} steps pulled back)"
        )
    return 0


def cmd_status(args) -> int:
    """``crispedit session status``: rounds, edits, retention matrix and drift (``--json`` for the raw status)."""
    if args.plot:
        check_output_file(args.plot, "--plot")
    _check_session(args.dir)
    from ..sessions.session import Session

    st = Session.open(args.dir).status()
    if args.json:
        print(json.dumps(st, indent=2))
        return 0
    print(
        f"session {st['path']} ({st['name']}) on {st['base']['spec']} [{st['base']['fingerprint'][:12]}]: "
        f"{st['round']} rounds, {st['n_edits']} edits, {st['size_bytes'] / 2**20:.1f} MiB"
    )
    if st["rounds"]:
        k = len(st["rounds"])
        head = "round  edits   rel  rel_all  kl_drift   kl_pred  epochs | " + " ".join(
            f"  r{j:<3d}" for j in range(1, k + 1)
        )
        print(head)
        for r, row in zip(st["rounds"], st["retention"]):
            cells = " ".join(f"{_fmt(v, 2):>5s}" if v is not None else "     " for v in row)
            print(
                f"{r['round']:5d} {r['n_edits']:6d} {_fmt(r['rel']):>5s} {_fmt(r['rel_all']):>8s} "
                f"{r['kl_drift']:9.5f} {_fmt(r.get('kl_predicted'), 5):>9s} {_epochs(r['train']):>7s} | {cells}"
            )
        from ..curvature.predicted import prediction_notes

        for line in prediction_notes(st["rounds"][-1]):  # of the whole change since the base, after the last round
            print(f"note: {line}")
    if st.get("drift_budget"):
        b = st["drift_budget"]
        print(
            f"drift budget ({b['mode']}): {b['budget']:g} nats/token, spent {b['spent']:.5f}, "
            f"remaining {b['remaining']:.5f} (predicted)"
        )
    if args.plot:
        from ..sessions.session import Session as S

        print(f"plot written to {S.open(args.dir).plot(args.plot)}")
    return 0


def cmd_export(args) -> int:
    """``crispedit session export``: write the session's current model as a Hugging Face directory."""
    check_output_dir(args.out, overwrite=args.overwrite, marker="crispedit_session.json")
    _check_session(args.dir)
    from ..sessions.session import Session

    s = Session.open(args.dir, model=args.model, device=args.device)
    out = s.export(args.out, overwrite=args.overwrite, progress=False if args.quiet else None, delta=args.delta)
    what = "delta.safetensors (the change from the base)" if args.delta else "edited model"
    print(f"{what} (round {s.round}) written to {out}")
    return 0


def cmd_plot(args) -> int:
    """``crispedit session plot``: draw the retention / drift evolution PNG."""
    check_output_file(args.out)
    for d in args.dirs:
        _check_session(d)
    from ..sessions.plot import plot_retention
    from ..sessions.session import Session

    statuses = [Session.open(d).status() for d in args.dirs]
    out = plot_retention(statuses, args.out, labels=args.labels.split(",") if args.labels else None)
    print(f"plot written to {out}")
    return 0


def add_cli(sub) -> None:
    """Register ``crispedit session init|add|status|export|plot`` on ``subparsers``."""
    p = sub.add_parser(
        "session", help="durable sequential editing sessions (CrispEdit-Seq, FT-Seq, LoRA-Seq, AlphaEdit-Seq, ...)"
    )
    ss = p.add_subparsers(dest="session_command", required=True)

    i = ss.add_parser("init", help="create a session directory on a base model")
    add_model_args(i)
    add_curvature_args(i)
    i.add_argument("--out", required=True, help="session directory to create")
    add_settings_args(
        i,
        SeqConfig,
        [
            "mode",
            "weighting",
            "mix",
            "edit_gamma",
            "edit_factors",
            "replay",
            "drift_from",
            "recompute_drift",
            "carry_optimizer",
            "reproject_momentum",
        ],
    )
    add_training_args(i)  # --method (lora: LoRA-Seq, a fresh adapter merged every round), training flags
    add_max_drift_arg(i, session=True)
    add_settings_args(i, SeqConfig, ["kl_text", "kl_texts", "check_earlier"])
    i.add_argument("--cache", default=None, help="capability curvature cache file (checked against the model)")
    i.add_argument("--quiet", action="store_true", help="no progress bars")
    i.set_defaults(func=cmd_init)

    a = ss.add_parser("add", help="apply one round of edits to a session")
    a.add_argument("dir", help="the session directory (`crispedit session init --out`)")
    add_edits_args(a)
    a.add_argument("--model", default=None, help="base model location if it moved (fingerprint is checked)")
    a.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, ...")
    add_shard_arg(a)
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    a.set_defaults(func=cmd_add, torchrun=True)  # may run under torchrun

    s = ss.add_parser("status", help="rounds, edit counts, per-round metrics and retention")
    s.add_argument("dir", help="the session directory")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.add_argument("--plot", default=None, help="also write the retention plot (PNG) here")
    s.set_defaults(func=cmd_status)

    e = ss.add_parser("export", help="write the edited model as a loadable model directory")
    e.add_argument("dir", help="the session directory")
    e.add_argument("--out", required=True, help="output directory; must be new or empty")
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="--out may hold an earlier export: replace only the files it wrote, keep all others",
    )
    e.add_argument("--model", default=None, help="base model location if it moved (fingerprint is checked)")
    e.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, ...")
    e.add_argument(
        "--delta",
        action="store_true",
        help="write delta.safetensors (the change from the base; `crispedit delta apply`) instead of the model",
    )
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_export)

    pl = ss.add_parser("plot", help="retention-over-rounds figure for one or more sessions")
    pl.add_argument("dirs", nargs="+", help="session directories, one panel each")
    pl.add_argument("--out", required=True, help="the figure file (PNG)")
    pl.add_argument("--labels", default=None, help="comma-separated panel titles")
    pl.set_defaults(func=cmd_plot)
