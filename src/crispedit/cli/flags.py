"""CLI flags shared by ``edit``, ``session init``, ``compare`` and ``cache build``, built from the config
dataclasses: defaults come from :class:`EditConfig`'s fields, ``--method`` choices from the method
catalogue, and every method's own options (its ``Config`` dataclass) become ``--<method>-<option>``
flags. The command modules (``cli/edit.py``, ``cli/session.py``, ...) import it and never each other.
Torch-free (it reads the catalogue, never an editor class): building the parser and checking the flags
import neither torch nor transformers; :func:`load_job_inputs` imports them once every cheaper input has
been checked."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import MISSING, fields

from ..editing.config import BATCH_ORDERS, PRECISIONS, PROJECTION_PRECISIONS, EditConfig, ProjectionTarget
from ..editing.contexts import ANSWER_ENDS, DEFAULT_CONTEXTS, TRAINING_CONTEXTS
from ..editing.keep import SUBJECT_KEEPS
from ..editing.registry import SEQ_SUFFIX, method_names, method_spec, seq_row, sequential_rows
from ..errors import CrispEditError
from ..paths import check_input_file

__all__ = ["add_model_args", "add_shard_arg", "check_shard_launch", "add_edits_args", "add_curvature_args",
           "add_training_args", "add_method_option_args",
           "add_max_drift_arg",
           "config_from_args", "method_options_from_args", "parse_methods", "check_job_files", "load_job_inputs",
           "DEFAULTS"]

DEFAULTS = {f.name: f.default for f in fields(EditConfig) if f.default is not MISSING}


def _keep_defaults() -> str:
    """The methods that hold their answers by default, with their chat prompts / subject questions / weight."""
    on = [(n, method_spec(n).shared) for n in method_names()]
    return "; ".join(f"{n}: {s['keep_chat']} / {s['keep_subject']} / {s['keep_weight']:g}" for n, s in on
                     if s.get("keep_chat") or s.get("keep_subject")) or "none"


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model --dtype --device --trust-remote-code``."""
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf file, an HF model dir or a hub id")
    p.add_argument("--dtype", default="float32", help="model dtype: float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)")


def add_shard_arg(p: argparse.ArgumentParser) -> None:
    """``--shard``: split the model's decoder blocks across torchrun's processes (FSDP2)."""
    p.add_argument("--shard", action="store_true",
                   help="under torchrun: split the frozen decoder blocks across the processes (FSDP2), each "
                   "holding 1/N of them; the edited layers stay whole on every process (see docs/sharding.md)")


def check_shard_launch(args) -> None:
    """One-line error for ``--shard`` outside ``torchrun`` (one process has nothing to split across)."""
    from ..distributed import launched_world_size  # torch-free

    if getattr(args, "shard", False) and launched_world_size() < 2:
        raise CrispEditError("--shard splits the model across torchrun's processes; launch it with "
                             "`torchrun --nproc-per-node N -m crispedit ... --shard` (N >= 2)")


def add_edits_args(p: argparse.ArgumentParser, *, n_required: bool = False) -> None:
    """``--edits FILE --n-edits N --offset K`` (the edit requests a command reads)."""
    p.add_argument("--edits", required=True, help="edit file: ZsRE, CounterFact/WikiBigEdit or crispedit JSON/JSONL")
    p.add_argument("--n-edits", type=int, required=n_required, default=None,
                   help="number of edits from --offset" + ("" if n_required else " (default: all)"))
    p.add_argument("--offset", type=int, default=0, help="skip the first K edits")


def add_curvature_args(p: argparse.ArgumentParser) -> None:
    """Edit layers and capability-curvature flags (``EditConfig`` fields ``layers`` .. ``seed``)."""
    d = DEFAULTS
    p.add_argument("--layers", default=d["layers"],
                   help="module-path pattern, e.g. 'model.layers.{15-19}.mlp.down_proj' "
                   "(default: per-architecture, see docs/cli.md, 'Choosing layers')")
    p.add_argument("--n-cap", type=int, default=d["n_cap"],
                   help=f"number of capability texts for K-FAC (default {d['n_cap']})")
    p.add_argument("--max-len", type=int, default=d["max_len"],
                   help=f"max tokens per capability text (default {d['max_len']})")
    p.add_argument("--label-mode", choices=["sampled", "empirical"], default=d["label_mode"],
                   help="K-FAC labels: sampled from the model (Gauss-Newton, default) or the text's own tokens")
    p.add_argument("--cap-corpus", default=d["cap_corpus"],
                   help="capability corpus (.txt/.jsonl/.json); default: bundled WikiText")
    p.add_argument("--cap-chat", type=int, default=d["cap_chat"], metavar="N",
                   help="bundled chat prompts whose answers, written by the unedited model through its chat template, "
                        "join the capability corpus, so the curvature protects how it answers (default "
                        f"{d['cap_chat']})")
    p.add_argument("--kfac-batch-size", type=int, default=d["kfac_batch_size"])
    p.add_argument("--seed", type=int, default=d["seed"])


def add_method_option_args(p: argparse.ArgumentParser, methods: Sequence[str] | None = None) -> None:
    """``--<method>-<option>`` for every option of every registered method's ``Config`` (default: the method's);
    ``methods``: only those methods' options (a command that runs one method)."""
    for method in method_names() if methods is None else methods:
        cfg_cls = method_spec(method).Config
        for f in fields(cfg_cls):
            kind = type(f.default) if f.default is not MISSING else str
            help_ = cfg_cls.HELP.get(f.name, f"{method} option {f.name} (default {f.default})")
            p.add_argument(f"--{method}-{f.name.replace('_', '-')}", dest=_dest(method, f.name),
                           type=kind if kind in (int, float) else str, default=None, help=f"[{method}] {help_}")


def add_training_args(p: argparse.ArgumentParser, *, method: bool = True, options: Sequence[str] | None = None) -> None:
    """``--method`` (choices: the catalogue), ``--gamma --epochs --lr --batch-size``, projection target,
    training contexts, answer end and the per-method option flags (``options``: only those methods')."""
    d = DEFAULTS
    if method:
        p.add_argument("--method", default=d["method"], choices=method_names(),
                       help="; ".join(f"{n}: {method_spec(n).summary}" for n in method_names())
                       + f" (default {d['method']})")
    p.add_argument("--gamma", type=float, default=d["gamma"], help=f"energy threshold in (0, 1) (default {d['gamma']})")
    p.add_argument("--epochs", type=int, default=d["epochs"],
                   help=f"maximum epochs over the edits (default {d['epochs']}; the paper: 25); training stops "
                        "earlier once an epoch's mean loss is below 0.01, or at a plateau (--plateau)")
    p.add_argument("--plateau", type=int, default=d["plateau_epochs"], metavar="N",
                   help="also stop once the epoch loss is below twice the stop loss and its best has not fallen by "
                   f"{d['plateau_delta'] * 100:g}%% in N epochs (default {d['plateau_epochs']}; 0: the paper's rule "
                   "alone)")
    p.add_argument("--lr", type=float, default=None, help="Adam learning rate (default: the method's; 5e-4 (Gemma-3: "
                                                          "5e-5, crispedit.families), LoRA 5e-3)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"],
                   help=f"edit sequences per step (default {d['batch_size']})")
    p.add_argument("--batch-tokens", type=int, default=None, metavar="N",
                   help="pack each step's batch up to N padded tokens (sequences x longest, length-sorted within a "
                        "context) instead of --batch-size sequences: fewer, fuller steps on a GPU")
    p.add_argument("--batch-order", choices=BATCH_ORDERS, default=d["batch_order"],
                   help="which sequences of a context share a batch of --batch-size: in request order (default), or "
                        "sorted by length (the same number of steps, little padding: fewer tokens computed)")
    p.add_argument("--context-sample", type=int, default=None, metavar="K",
                   help="train each request on a seeded sample of K of its context sequences per epoch (every "
                        "epoch another sample) instead of all of them: fewer tokens per epoch")
    p.add_argument("--precision", choices=PRECISIONS, default=d["precision"],
                   help="the training forward and backward: fp32, bf16 autocast (matmuls in bfloat16; the trained "
                        "weights, their gradients, Adam and the projection stay float32), or auto: bf16 where the "
                        "device computes it natively (a GPU, a CPU with AVX-512 or AMX), else fp32")
    p.add_argument("--projection-precision", choices=PROJECTION_PRECISIONS, default=d["projection_precision"],
                   help="the projection's matrix products on a GPU: fp32, or tf32 tensor cores (inputs rounded to "
                        "10 mantissa bits, float32 sums; docs/curvature.md bounds what leaks); the CPU always fp32")
    p.add_argument("--projection", choices=[t.value for t in ProjectionTarget], default=d["projection_target"],
                   help="project the raw gradient (paper), the Adam update, or run Adam in the K-FAC eigenbasis")
    p.add_argument("--contexts", default=d["contexts"],
                   help="training contexts each request is trained in: comma list of "
                   + ", ".join(name + (":N" if c.counted else "") for name, c in TRAINING_CONTEXTS.items()) + " "
                   f"(default: 'default' = {DEFAULT_CONTEXTS}; chat only for models with a chat template)")
    p.add_argument("--drift-penalty", type=float, default=d["drift_penalty"], metavar="BETA",
                   help="train edit loss + BETA x the K-FAC predicted KL drift (nats/token) of the change, so the "
                   f"edit takes the flattest directions (default {d['drift_penalty']:g}; fine-tuning methods: ft, "
                   "locbf-ft and lora get the capability factors fetched, lora on its merged update)")
    on = _keep_defaults()
    p.add_argument("--keep-chat", type=int, default=None, metavar="N",
                   help="hold the unedited model's own chat answers to N bundled everyday prompts while the edit "
                        f"trains (a hinge on every answer token that became less likely; default: the method's — {on} "
                        "— else 0)")
    p.add_argument("--keep-subject", type=int, default=None, metavar="K",
                   help="... and its answers to K questions about each edit's subject that ask no particular "
                        f"relation (at most {len(SUBJECT_KEEPS)}; default: the method's, else 0)")
    p.add_argument("--keep-weight", type=float, default=None, metavar="W",
                   help="weight of that preservation term beside the edit loss (default: the method's, else 1)")
    p.add_argument("--keep-tokens", type=int, default=d["keep_tokens"], metavar="T",
                   help="tokens of each held answer (longer answers hold more of the assistant's form and cost more "
                        f"per step; default {d['keep_tokens']})")
    p.add_argument("--answer-end", choices=list(ANSWER_ENDS), default=d["answer_end"],
                   help="what follows the target in training: auto = the chat end-of-turn in chat, a period "
                   "elsewhere (default); eos = EOS instead of the period; none = the target alone (the paper)")
    add_method_option_args(p, options)


def add_max_drift_arg(p: argparse.ArgumentParser, *, session: bool = False) -> None:
    """``--max-drift EPS``: the trust region on the K-FAC predicted KL drift (``EditConfig.max_drift``)."""
    what = ("for the whole session, spent round by round" if session
            else "after every step the accumulated change is scaled back into it")
    p.add_argument("--max-drift", type=float, default=None, metavar="EPS",
                   help=f"budget on the predicted KL drift in nats/token ({what}); fine-tuning methods (crispedit, "
                   "adam-nscl, ft, locbf-ft, lora on its merged update); the prediction under-reads large moves such "
                   "as ft's")


def _dest(method: str, option: str) -> str:
    return f"opt_{method.replace('-', '_')}__{option}"


def method_options_from_args(args, methods: Sequence[str]) -> dict[str, dict]:
    """``{method: {option: value}}`` from the ``--<method>-<option>`` flags that were given; a flag of a
    method not among ``methods`` is a one-line error (a ``<method>-seq`` row counts as its method: the
    flags apply to both rows)."""
    methods = [seq_row(m)[0] for m in methods]
    out: dict[str, dict] = {}
    for method in method_names():
        for f in fields(method_spec(method).Config):
            value = getattr(args, _dest(method, f.name), None)
            if value is None:
                continue
            if method not in methods:
                raise CrispEditError(f"--{method}-{f.name.replace('_', '-')} applies to method {method}, "
                                     f"which is not being run ({', '.join(methods)})")
            out.setdefault(method, {})[f.name] = value
    return out


def config_from_args(args, method: str | None = None, options: dict | None = None) -> EditConfig:
    """The validated :class:`EditConfig` of the parsed flags for ``method`` (default ``args.method``)."""
    method = method or args.method
    if options is None:
        options = method_options_from_args(args, [method]).get(method, {})
    return EditConfig(method=method, gamma=args.gamma, layers=args.layers, lr=args.lr, batch_size=args.batch_size,
                      batch_tokens=getattr(args, "batch_tokens", None),
                      batch_order=getattr(args, "batch_order", "request"),
                      context_sample=getattr(args, "context_sample", None),
                      precision=getattr(args, "precision", "fp32"),
                      projection_precision=getattr(args, "projection_precision", "fp32"),
                      epochs=args.epochs, plateau_epochs=args.plateau,
                      projection_target=args.projection, n_cap=args.n_cap, max_len=args.max_len,
                      label_mode=args.label_mode, kfac_batch_size=args.kfac_batch_size, cap_corpus=args.cap_corpus,
                      cap_chat=args.cap_chat, keep_chat=args.keep_chat, keep_subject=args.keep_subject,
                      keep_weight=args.keep_weight, keep_tokens=args.keep_tokens, seed=args.seed,
                      contexts=args.contexts,
                      answer_end=args.answer_end, options=options,
                      max_drift=getattr(args, "max_drift", None), drift_penalty=args.drift_penalty)


def parse_methods(spec: str) -> list[str]:
    """``"crispedit,ft,lora-seq"`` (or ``all``) -> compare rows in the given order, each once: registered
    method names and ``<method>-seq`` sequential rows (:func:`~crispedit.editing.registry.seq_row`); one-line
    error naming an unknown one. ``all`` = every method, then the paper's sequential rows
    (:func:`~crispedit.editing.registry.sequential_rows`: crispedit-seq, ft-seq, lora-seq, alphaedit-seq)."""
    items = [s.strip() for s in str(spec).split(",") if s.strip()]
    if items == ["all"]:
        return method_names() + [m + SEQ_SUFFIX for m in sequential_rows()]
    if not items:
        raise CrispEditError(f"--methods is empty; choose from {', '.join(method_names())}")
    out: list[str] = []
    for m in items:
        seq_row(m)  # unknown (or a -seq row of a method without one) -> one-line error with the choices
        if m not in out:
            out.append(m)
    return out


def check_job_files(args, n_cap: int) -> None:
    """Check the side files an editing command reads once its model is loaded, before that: ``--cap-corpus``
    (``n_cap`` texts), ``--kl-text`` and that a ``--cache`` file and a ``--mend-weights`` file exist (each only when
    given; one-line
    errors). Torch-free."""
    from ..data import capability_corpus, heldout_text

    if args.cap_corpus:
        capability_corpus(args.cap_corpus, n_cap)
    if args.kl_text is not None:
        heldout_text(args.kl_text, 1)
    if getattr(args, "cache", None):
        check_input_file(args.cache, "curvature cache file")
    if getattr(args, _dest("mend", "weights"), None):
        check_input_file(getattr(args, _dest("mend", "weights")), "MEND network file (--mend-weights)")


def load_job_inputs(args, n_cap: int):
    """What an editing command reads, checked cheapest first: the side files (:func:`check_job_files`), the
    edit requests, then the model (the first point where torch is imported). Returns ``(requests, model,
    tokenizer, progress)`` where ``progress`` is ``False`` under ``--quiet`` and ``None`` (auto) otherwise."""
    from ..data import load_edits

    check_job_files(args, n_cap)
    requests = load_edits(args.edits, limit=args.n_edits, offset=args.offset)
    progress = False if args.quiet else None
    from ..models import load_model  # torch and transformers: only now that every cheaper input is checked

    model, tok = load_model(args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code,
                            progress=progress)
    return requests, model, tok, progress
