"""``crispedit compare`` on the command line (registered through ``crispedit.cli._COMMAND_MODULES``).

Torch-free: every argument is checked here before :mod:`crispedit.experiments.compare` (torch) is imported."""

from __future__ import annotations

from pathlib import Path

from ..checks import check_positive_int
from ..errors import CrispEditError
from ..paths import check_output_dir

__all__ = ["add_cli", "cmd_compare", "cmd_compare_merge", "DEFAULT_CAPABILITIES", "DEFAULT_LIMITS", "GEN_TOKENS"]

DEFAULT_CAPABILITIES = "ifeval"
DEFAULT_LIMITS = {"ifeval": 48}  # items per task without --limit (other tasks: all): what a CPU evaluates per row
# The session settings the -seq rows take as --seq-<name> flags (the rest keep the session defaults)
SEQ_SETTINGS = ("weighting", "mix", "edit_gamma", "edit_factors", "replay", "drift_from", "carry_optimizer")
GEN_TOKENS = 256  # generative tasks' answers are cut here (IFEval's own cap is 1280 tokens): what a CPU can run


def cmd_compare(args) -> int:
    """``crispedit compare``: validate every input, load the model once, run the methods, print the table."""
    from ..editing.config import SeqConfig
    from ..editing.registry import seq_row
    from ..evaluation.capabilities import check_capability_inputs, parse_tasks
    from .flags import config_from_args, load_job_inputs, method_options_from_args, parse_methods

    methods = parse_methods(args.methods)
    options = method_options_from_args(args, methods)
    configs = {}
    for m in methods:  # all validated up front; a -seq row: its method's config in sequential mode
        base, seq = seq_row(m)
        cfg = config_from_args(args, base, options.get(base, {}))
        configs[m] = (
            SeqConfig(edit=cfg, mode="sequential", **{k: getattr(args, f"seq_{k}") for k in SEQ_SETTINGS})
            if seq
            else cfg
        )
    if args.seq_chunk is not None:
        check_positive_int("--seq-chunk", args.seq_chunk)
        if not any(seq_row(m)[1] for m in methods):
            raise CrispEditError("--seq-chunk sets the round size of the -seq rows, and none is being run")
    tasks = parse_tasks(args.capabilities)
    check_capability_inputs(tasks, args.bench_dir)  # a wrong --bench-dir fails now, not after the first method ran
    check_output_dir(args.out)
    if args.limit is not None:
        check_positive_int("--limit", args.limit)
    limit = args.limit if args.limit is not None else {t: DEFAULT_LIMITS.get(t) for t in tasks}
    check_positive_int("--max-gen-toks", args.max_gen_toks)
    if args.n_edits is None or args.n_edits < 1:
        raise CrispEditError(f"--n-edits must be a positive integer, got {args.n_edits}")
    first = configs[methods[0]]
    n_cap = (first.edit if isinstance(first, SeqConfig) else first).n_cap
    requests, model, tok, progress = load_job_inputs(args, n_cap)
    from ..experiments.compare import run_compare
    from ..experiments.compare_outputs import JSON_FILE, MD_FILE, PNG_FILE
    from ..experiments.compare_table import compare_table

    payload = run_compare(
        model,
        tok,
        requests,
        methods,
        args.out,
        configs=configs,
        model_spec=args.model,
        edits_info={"file": str(args.edits), "offset": args.offset, "n": len(requests)},
        capabilities=tasks,
        limit=limit,
        max_gen_toks=args.max_gen_toks,
        bench_dir=args.bench_dir,
        kl_text=args.kl_text,
        seq_chunk=args.seq_chunk,
        progress=progress,
    )
    print(compare_table(payload))
    print(f"written to {Path(args.out) / JSON_FILE} (+ {MD_FILE}, {PNG_FILE})")
    return 0


def cmd_compare_merge(args) -> int:
    """``crispedit compare-merge``: the rows of several compares of the same settings in one directory."""
    check_output_dir(args.out)
    from ..experiments.compare_merge import merge_compares
    from ..experiments.compare_outputs import JSON_FILE, MD_FILE, PNG_FILE
    from ..experiments.compare_table import compare_table

    payload = merge_compares(args.dirs, args.out)
    print(compare_table(payload))
    print(f"written to {Path(args.out) / JSON_FILE} (+ {MD_FILE}, {PNG_FILE})")
    return 0


def add_cli(sub) -> None:
    """Register ``crispedit compare`` and ``crispedit compare-merge`` on ``subparsers``."""
    from ..editing.config import MIN_SEQ_ROUNDS, PAPER_SEQ_CHUNK, SeqConfig
    from ..editing.registry import SEQ_SUFFIX, method_names, sequential_rows
    from .flags import add_curvature_args, add_edits_args, add_model_args, add_settings_args, add_training_args

    p = sub.add_parser("compare", help="run several editing methods on the same edits and tabulate them")
    add_model_args(p)
    add_curvature_args(p)
    add_edits_args(p, n_required=True)
    seqs = ", ".join(m + SEQ_SUFFIX for m in sequential_rows(every=True))
    paper = ", ".join(m + SEQ_SUFFIX for m in sequential_rows())
    p.add_argument(
        "--methods",
        required=True,
        help=f"comma list of methods ({', '.join(method_names())}) and sequential rows ({seqs}: the method "
        f"in rounds of --seq-chunk edits), or all (every method plus {paper})",
    )
    p.add_argument(
        "--seq-chunk",
        type=int,
        default=None,
        metavar="N",
        help=f"edits per round of the -seq rows (default min({PAPER_SEQ_CHUNK}, "
        f"ceil(n-edits/{MIN_SEQ_ROUNDS})): the paper's {PAPER_SEQ_CHUNK}, but about {MIN_SEQ_ROUNDS} "
        "rounds for small edit sets; 10 for 100 edits)",
    )
    add_settings_args(
        p, SeqConfig, SEQ_SETTINGS, prefix="seq", note="the -seq rows; as `crispedit session init {flag}`"
    )
    p.add_argument(
        "--out",
        required=True,
        help="output directory (compare.json, compare.md, compare.png; retention.png with -seq rows)",
    )
    p.add_argument(
        "--capabilities",
        default=DEFAULT_CAPABILITIES,
        help="lm-eval capability tasks, e.g. ifeval,arc_challenge,truthfulqa_mc2, or none (default "
        f"{DEFAULT_CAPABILITIES}: the assistant's instruction following; needs crispedit[eval])",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"items per capability task (default: all, but IFEval's first {DEFAULT_LIMITS['ifeval']} prompts)",
    )
    p.add_argument(
        "--max-gen-toks",
        type=int,
        default=GEN_TOKENS,
        metavar="N",
        help=f"answers of generative capability tasks (IFEval) are cut at N tokens, base and edited rows "
        f"alike (default {GEN_TOKENS}; IFEval's own cap is 1280)",
    )
    p.add_argument("--bench-dir", default=None, help="local benchmark files (see `crispedit eval`)")
    p.add_argument("--kl-text", default=None, help="held-out text for KL drift (default: bundled WikiText sample)")
    add_training_args(p, method=False)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_compare)

    m = sub.add_parser(
        "compare-merge",
        help="one compare from several run under the same settings (e.g. its methods split over machines)",
    )
    m.add_argument("dirs", nargs="+", metavar="DIR", help="compare directories (each holds compare.json), two or more")
    m.add_argument(
        "--out",
        required=True,
        help="output directory (compare.json, compare.md, compare.png); may be one of the DIRs",
    )
    m.set_defaults(func=cmd_compare_merge)
