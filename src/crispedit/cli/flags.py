"""CLI flags shared by ``edit``, ``session init``, ``compare`` and ``cache build``, generated from the config
dataclasses: each :class:`~crispedit.editing.EditConfig` field declared with :func:`~crispedit.settings.setting`
becomes a flag with its default, help, metavar and choices (:func:`add_settings_args`, the one walker), ``--method``
choices come from the method catalogue, and every method's own options (its ``Config`` dataclass) become
``--<method>-<option>`` flags. :func:`config_from_args` reads the same fields back. The command modules
(``cli/edit.py``, ``cli/session.py``, ...) import it and never each other. Torch-free (it reads the catalogue, never
an editor class): building the parser and checking the flags import neither torch nor transformers;
:func:`load_job_inputs` imports them once every cheaper input has been checked."""

from __future__ import annotations

import argparse
import functools
from collections.abc import Iterable, Sequence
from dataclasses import MISSING, fields
from typing import get_args, get_type_hints

from ..editing.config import EditConfig
from ..editing.phases import CurvatureConfig, DriftConfig, ProjectionConfig, SequencesConfig, TrainingConfig
from ..editing.registry import SEQ_SUFFIX, method_names, method_spec, seq_row, sequential_rows
from ..errors import CrispEditError
from ..paths import check_input_file
from ..settings import Settings

__all__ = [
    "add_model_args",
    "add_shard_arg",
    "check_shard_launch",
    "add_edits_args",
    "add_curvature_args",
    "add_training_args",
    "add_method_option_args",
    "add_settings_args",
    "settings_from_args",
    "add_max_drift_arg",
    "config_from_args",
    "method_options_from_args",
    "parse_methods",
    "check_job_files",
    "load_job_inputs",
]


def _field_names(cls: type[Settings]) -> list[str]:
    return [f.name for f in fields(cls)]


@functools.cache
def _hints(cls: type[Settings]) -> dict:
    """The evaluated field annotations of ``cls``, once per class (every flag of a parser asks)."""
    return get_type_hints(cls)


def _value_type(cls: type[Settings], name: str) -> type:
    """The scalar a flag of field ``name`` parses to: its annotation without ``None`` (``int | None`` -> int), str
    for anything else."""
    hint = _hints(cls)[name]
    kinds = [k for k in get_args(hint) if k is not type(None)] or [hint]
    return kinds[0] if kinds[0] in (int, float, str, bool) else str


def add_settings_args(
    p: argparse.ArgumentParser,
    cls: type[Settings],
    names: Iterable[str] | None = None,
    *,
    prefix: str = "",
    note: str = "",
) -> None:
    """One flag per field of ``cls`` (``names``: only those, in that order) that :func:`~crispedit.settings.setting`
    offers the command line: ``--<name>`` (or its ``flag``), stored under the field's name, with the field's default,
    help, metavar and choices; a boolean that defaults to true becomes ``--no-<name>``. ``prefix`` (e.g. ``"seq"``)
    names the flags ``--<prefix>-<name>`` (``--<prefix>-no-<name>``) and stores them under ``<prefix>_<name>``, one
    command's settings offered on another's line; ``note`` then ends each help in brackets, ``{flag}`` standing for
    the unprefixed flag."""
    for name in _field_names(cls) if names is None else names:
        meta = cls.metadata_of(name)
        if not meta or not meta.get("cli", True):
            continue
        f = cls.__dataclass_fields__[name]
        default = None if f.default is MISSING else f.default
        flag = meta.get("flag") or "--" + name.replace("_", "-")
        help_ = cls.help_of(name).replace("%", "%%")
        dest = name
        kind = _value_type(cls, name)
        if kind is bool and default:
            flag = "--no-" + flag[2:]
        if prefix:
            help_ += f" ({note.format(flag=flag)})" if note else ""
            flag, dest = f"--{prefix}-{flag[2:]}", f"{prefix}_{name}"
        if kind is bool:
            p.add_argument(flag, dest=dest, action="store_false" if default else "store_true", help=help_)
            continue
        choices = meta.get("choices")
        choices = list(choices() if callable(choices) else choices) if choices is not None else None
        extra = {"metavar": meta["metavar"]} if meta.get("metavar") else {}
        p.add_argument(flag, dest=dest, type=kind, default=default, choices=choices, help=help_, **extra)


def settings_from_args(args: argparse.Namespace, cls: type[Settings]) -> dict:
    """``{field: value}`` of the fields of ``cls`` that the parsed ``args`` hold (those its parser offered)."""
    return {name: getattr(args, name) for name in _field_names(cls) if hasattr(args, name)}


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model --dtype --device --trust-remote-code``."""
    p.add_argument(
        "--model",
        default="smollm2",
        help="smollm2 (default), a .gguf file, an HF model dir (e.g. the --out of `crispedit edit`) or a hub id",
    )
    p.add_argument("--dtype", default="float32", help="model dtype: float32 (default), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (default), cuda, cuda:1, ...")
    p.add_argument("--trust-remote-code", action="store_true", help="allow model code from the hub (off by default)")


def add_shard_arg(p: argparse.ArgumentParser) -> None:
    """``--shard``: split the model's decoder blocks across torchrun's processes (FSDP2)."""
    p.add_argument(
        "--shard",
        action="store_true",
        help="under torchrun: split the frozen decoder blocks across the processes (FSDP2), each "
        "holding 1/N of them; the edited layers stay whole on every process (see docs/sharding.md)",
    )


def check_shard_launch(args) -> None:
    """One-line error for ``--shard`` outside ``torchrun`` (one process has nothing to split across)."""
    from ..distributed import launched_world_size  # torch-free

    if getattr(args, "shard", False) and launched_world_size() < 2:
        raise CrispEditError(
            "--shard splits the model across torchrun's processes; launch it with "
            "`torchrun --nproc-per-node N -m crispedit ... --shard` (N >= 2)"
        )


def add_edits_args(p: argparse.ArgumentParser, *, n_required: bool = False, required: bool = True) -> None:
    """``--edits FILE --n-edits N --offset K`` (the edit requests a command reads; ``required``: ``--edits`` too)."""
    p.add_argument(
        "--edits", required=required, help="edit file: ZsRE, CounterFact/WikiBigEdit or crispedit JSON/JSONL"
    )
    p.add_argument(
        "--n-edits",
        type=int,
        required=n_required,
        default=None,
        help="number of edits from --offset" + ("" if n_required else " (default: all)"),
    )
    p.add_argument("--offset", type=int, default=0, help="skip the first K edits")


def add_curvature_args(p: argparse.ArgumentParser) -> None:
    """The edit layers and the capability-curvature flags (:class:`~crispedit.editing.phases.CurvatureConfig`)."""
    add_settings_args(p, EditConfig, ["layers"])
    add_settings_args(p, CurvatureConfig)


def add_method_option_args(p: argparse.ArgumentParser, methods: Sequence[str] | None = None) -> None:
    """``--<method>-<option>`` for every option of every registered method's ``Config`` (default: the method's);
    ``methods``: only those methods' options (a command that runs one method)."""
    for method in method_names() if methods is None else methods:
        cfg_cls = method_spec(method).Config
        for f in fields(cfg_cls):
            help_ = cfg_cls.help_of(f.name) or f"{method} option {f.name} (default {f.default})"
            kind = _value_type(cfg_cls, f.name)
            p.add_argument(
                f"--{method}-{f.name.replace('_', '-')}",
                dest=_dest(method, f.name),
                type=kind if kind in (int, float) else str,
                default=None,
                help=f"[{method}] {help_}".replace("%", "%%"),
            )


def add_training_args(p: argparse.ArgumentParser, *, method: bool = True, options: Sequence[str] | None = None) -> None:
    """``--method`` (choices: the catalogue), then the projection, training, training-sequence and drift-penalty
    flags (their phases' fields) and the per-method option flags (``options``: only those methods')."""
    if method:
        add_settings_args(p, EditConfig, ["method"])
    for phase in (ProjectionConfig, TrainingConfig, SequencesConfig, DriftConfig):
        add_settings_args(p, phase)
    add_method_option_args(p, options)


def add_max_drift_arg(p: argparse.ArgumentParser, *, session: bool = False) -> None:
    """``--max-drift EPS``: the trust region on the K-FAC predicted KL drift (``EditConfig.max_drift``)."""
    what = (
        "for the whole session, spent round by round"
        if session
        else "after every step the accumulated change is scaled back into it"
    )
    p.add_argument(
        "--max-drift",
        type=float,
        default=None,
        metavar="EPS",
        help=f"budget on the predicted KL drift in nats/token ({what}); fine-tuning methods (crispedit, "
        "adam-nscl, ft, locbf-ft, lora on its merged update); the prediction under-reads large moves such "
        "as ft's",
    )


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
                raise CrispEditError(
                    f"--{method}-{f.name.replace('_', '-')} applies to method {method}, "
                    f"which is not being run ({', '.join(methods)})"
                )
            out.setdefault(method, {})[f.name] = value
    return out


def config_from_args(args, method: str | None = None, options: dict | None = None) -> EditConfig:
    """The validated :class:`EditConfig` of the parsed flags for ``method`` (default ``args.method``): every field
    its parser offered, the rest at their defaults."""
    method = method or args.method
    if options is None:
        options = method_options_from_args(args, [method]).get(method, {})
    return EditConfig(**{**settings_from_args(args, EditConfig), "method": method, "options": options})


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

    model, tok = load_model(
        args.model, dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code, progress=progress
    )
    return requests, model, tok, progress
