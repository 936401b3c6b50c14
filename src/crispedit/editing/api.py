"""High-level batch editing: the editor picks its layers, the (cached) curvature is fetched, the changed
parameters are snapshotted, and the editor applies the edit (:meth:`Editor.apply`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..curvature.cache import CurvatureSpec, get_or_build_factors, layer_shapes, load_factors
from ..curvature.factors import KFACFactors
from ..data.corpus import capability_corpus, chat_prompts, corpus_digest
from ..data.edits import EditRequest
from ..errors import CrispEditError
from ..layers import model_family
from ..models import cache_dir
from ..weights import parameter, weight_fingerprint
from .config import EditConfig
from .contexts import resolve_contexts
from .editor import EditContext, Editor
from .history import TrainHistory
from .phases import CurvatureConfig
from .registry import get_editor

__all__ = [
    "EditResult",
    "edit",
    "shard_for_edit",
    "restore",
    "snapshot",
    "capability_factors",
    "capability_sequences",
    "curvature_spec",
    "edit_factors",
    "prepare",
    "Prepared",
    "CHAT_ANSWER_TOKENS",
]


@dataclass
class EditResult:
    """What :func:`edit` did: edit layer names, :class:`TrainHistory`, projector stats per trained tensor
    (kept fraction; for Kronecker projectors the masked corner ``r_out`` / ``r_in``, the form used and the
    low-rank/full FLOP ratio), curvature and training seconds, cache info, and the pre-edit values of
    every parameter the editor changes (full parameter name -> tensor as stored) for drift or undo;
    ``kl_predicted``: the K-FAC predicted per-token KL drift of the change (nats; ``{"total", "layers"}``,
    :func:`~crispedit.curvature.predicted.predicted_kl`; ``None`` without factors for the changed
    weights); ``drift_budget``: what ``--max-drift`` did (``None`` without a budget); ``inputs``: the files
    the editor read besides the model, by content (:meth:`Editor.input_digests`: MEND's network); ``config``:
    the :class:`EditConfig` that ran, its learning rate set for the model family."""

    layers: list[str]
    history: TrainHistory
    projector_stats: dict[str, dict]
    cache_seconds: float
    edit_seconds: float
    cache_info: dict = field(default_factory=dict)
    original_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    kl_predicted: dict | None = None
    drift_budget: dict | None = None
    inputs: dict[str, str] = field(default_factory=dict)
    config: EditConfig | None = None  # the config that ran (its lr set for the model family)


CHAT_ANSWER_TOKENS = 128  # at most this many tokens of the model's own answer per capability chat prompt


def _corpus_key(config: CurvatureConfig) -> tuple[list[str], list[str]]:
    """The capability corpus of ``config`` as its content address sees it: the texts (``cap_corpus``, ``n_cap``) and
    the chat prompts whose answers join them (``cap_chat``). The answers are not read: they are a function of the
    model (its fingerprint is in the key), the prompts and :data:`CHAT_ANSWER_TOKENS`, so a cached entry is found
    without generating them."""
    return capability_corpus(config.cap_corpus, config.n_cap), chat_prompts(config.cap_chat)


def curvature_spec(
    model: nn.Module, layers: Sequence[str], config: CurvatureConfig, fingerprint: str | None = None, kind: str = "kfac"
) -> CurvatureSpec:
    """The content-address of a capability statistics collection for ``model`` and ``layers`` under ``config``
    (its capability texts and chat prompts, :func:`_corpus_key`): K-FAC factors (``kind="kfac"``) or the input
    covariance alone (``kind="input"``, which depends on neither labels nor seed: label mode ``none``, seed 0)."""
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    inp = kind == "input"
    texts, chat = _corpus_key(config)
    digest = corpus_digest(
        texts if not chat else [*texts, f"chat answers of at most {CHAT_ANSWER_TOKENS} tokens:", *chat]
    )
    return CurvatureSpec(
        model_fingerprint=fingerprint or weight_fingerprint(model),
        layers=tuple(layers),
        corpus_digest=digest,
        n_texts=len(texts) + len(chat),
        max_len=config.max_len,
        label_mode="none" if inp else config.label_mode,
        seed=0 if inp else config.seed,
        stat_dtype="float32",
        model_dtype=dtype,
        kind=kind,
    )


def capability_factors(
    model: nn.Module,
    tokenizer,
    layers: dict[str, nn.Module],
    config: CurvatureConfig,
    *,
    cache_root: str | Path | None = None,
    cache_file: str | Path | None = None,
    fingerprint: str | None = None,
    force: bool = False,
    progress: bool | None = None,
    kind: str = "kfac",
) -> tuple[KFACFactors, dict]:
    """Capability K-FAC factors for ``layers`` (``kind="input"``: the input covariance ``A = E[k kᵀ]`` alone): from
    ``cache_file`` if given (its full spec — model,
    layers, corpus, n_cap, max_len, label mode, seed, dtypes — and every factor's shape checked against
    what this edit asks for), else from the content-addressed cache, else collected and cached. ``info``
    holds the path, whether it was a hit, the seconds and the spec the factors were built with."""
    fingerprint = fingerprint or weight_fingerprint(model)
    spec = curvature_spec(model, list(layers), config, fingerprint, kind)
    if cache_file is not None:
        t0 = time.perf_counter()
        factors = load_factors(cache_file, spec, shapes=layer_shapes(layers))
        return factors, {
            "path": str(cache_file),
            "hit": True,
            "seconds": time.perf_counter() - t0,
            "spec": factors.meta.get("spec"),
        }
    return get_or_build_factors(
        model,
        tokenizer,
        layers,
        lambda: capability_sequences(model, tokenizer, config),
        spec,
        root=cache_root or cache_dir(),
        batch_size=config.kfac_batch_size,
        force=force,
        progress=progress,
    )


def capability_sequences(model: nn.Module, tokenizer, config: CurvatureConfig) -> tuple[list, list[int] | None]:
    """What the capability statistics of ``config`` are collected on, as ``(sequences, loss_from)`` for
    :func:`~crispedit.curvature.kfac.collect_lm_kfac`: the capability texts alone (``loss_from`` None) or, with
    ``cap_chat``, every text's token ids (cut to ``max_len``, every position counted) followed by the chat
    transcripts of the ``cap_chat`` bundled prompts — the prompt through the chat template, then ``model``'s own
    greedy answer of at most :data:`CHAT_ANSWER_TOKENS` tokens and its end of turn — of which only the answer's
    positions count. Models without a chat template answer the bare prompt."""
    texts, chat = _corpus_key(config)
    if not chat:
        return texts, None
    from .written import own_chat_answers

    shown, answers, templated = own_chat_answers(model, tokenizer, chat, CHAT_ANSWER_TOKENS, "capability chat answers")
    ids = [x[: config.max_len] for x in tokenizer(texts, truncation=True, max_length=config.max_len)["input_ids"]]
    loss_from = [0] * len(ids)
    for p, prompt, a in zip(chat, shown, answers):
        full = (
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": a}], tokenize=False
            )
            if templated
            else f"{p} {a}"
        )
        head = tokenizer(prompt, add_special_tokens=not templated)["input_ids"]
        seq = tokenizer(full, add_special_tokens=not templated)["input_ids"][: config.max_len]
        ids.append(seq)
        loss_from.append(min(len(head), len(seq) - 1))
    return ids, loss_from


def edit_factors(
    model: nn.Module,
    tokenizer,
    editor,
    layers: dict[str, nn.Module],
    config: EditConfig,
    *,
    factors: KFACFactors | None = None,
    cache_root: str | Path | None = None,
    cache_file: str | Path | None = None,
    progress: bool | None = None,
    predict_drift: bool = False,
    fingerprint: str | None = None,
) -> tuple[KFACFactors | None, dict]:
    """The capability statistics an edit with ``editor`` on ``layers`` uses: those it needs
    (``editor.needs_curvature``, of its ``curvature_kind``, for ``layers``) or else the K-FAC factors of the
    modules whose change the drift is predicted for (:meth:`Editor.drift_modules`): always when ``config`` sets
    ``max_drift`` or ``drift_penalty`` (the budget and the penalty are measured with them: ft, locbf-ft, LoRA's
    adapted modules), and with ``predict_drift`` when those are the edit layers (not LoRA's q/v projections).
    Given ``factors`` are checked to cover those modules; otherwise fetched by :func:`capability_factors`.
    Returns ``(factors or None, info)`` (``info`` empty when nothing was fetched)."""
    changed = editor.changes(model, layers, config)
    predictable = any(f"{n}.weight" in changed for n in layers)  # not LoRA's q/v projections
    budget = config.max_drift is not None or config.drift_penalty > 0
    info: dict = {}
    if not (editor.needs_curvature or budget or (predict_drift and predictable)):
        return factors, info
    need = layers if editor.needs_curvature else editor.drift_modules(model, layers, config)
    if factors is None:
        factors, info = capability_factors(
            model,
            tokenizer,
            need,
            config,
            cache_root=cache_root,
            cache_file=cache_file,
            fingerprint=fingerprint,
            progress=progress,
            kind=editor.curvature_kind,
        )
    missing = [n for n in need if n not in factors.A]
    if missing:
        raise CrispEditError(f"curvature factors do not cover layers {missing}")
    return factors, info


class Prepared(NamedTuple):
    """What an edit needs before it trains (:func:`prepare`): the ``config`` that runs (validated, its learning rate
    set for the model's family), the ``editor``, its edit ``layers`` (module name -> module), the parameters it
    ``changed`` (full name -> parameter), the capability ``factors`` (or ``None``) and their fetch ``info``."""

    config: EditConfig
    editor: Editor
    layers: dict[str, nn.Module]
    changed: dict[str, nn.Parameter]
    factors: KFACFactors | None
    info: dict


def prepare(
    model: nn.Module, tokenizer, requests: Sequence[EditRequest], config: EditConfig, **factor_options
) -> Prepared:
    """Everything an edit of ``model`` with ``requests`` settles before it trains, the batch edit's and a sequence's
    alike: the config for the model's family, the editor (which checks the requests: e.g. the closed-form editors'
    subjects), the contexts (one this model cannot take fails here, before any work), the edit layers, the changed
    parameters and the capability statistics (:func:`edit_factors` with ``factor_options``). One-line error for no
    requests."""
    config = config.validate().for_family(model_family(model))
    if not requests:
        raise CrispEditError("no edit requests given")
    editor = get_editor(config.method)
    editor.check_requests(requests)
    resolve_contexts(config.contexts, tokenizer)
    layers = editor.select_layers(model, config)
    changed = editor.changes(model, layers, config)
    factors, info = edit_factors(model, tokenizer, editor, layers, config, **factor_options)
    return Prepared(config, editor, layers, changed, factors, info)


def edit(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    config: EditConfig | None = None,
    *,
    factors: KFACFactors | None = None,
    cache_root: str | Path | None = None,
    cache_file: str | Path | None = None,
    progress: bool | None = None,
    predict_drift: bool = False,
    checkpoint: str | Path | None = None,
    fingerprint: str | None = None,
) -> EditResult:
    """Apply ``requests`` to ``model`` in place with ``config.method`` and return what happened.

    ``result.original_weights`` holds the pre-edit values of every parameter the editor declares it
    changes (:meth:`Editor.changes`, full parameter names), to measure drift or undo the edit with
    :func:`restore`. ``result.kl_predicted`` is the drift the capability factors predict for the change;
    editors without curvature (ft, locbf-ft) get it only with ``predict_drift`` or a drift budget / penalty
    (their factors are then fetched from the cache or collected, like a curvature editor's; LoRA's, of its
    adapted modules, with a budget or penalty only). A learning rate left unset is set for the model's family
    (:meth:`EditConfig.for_family`) in the config that runs — ``result.config``, what a caller reports; the
    caller's ``config`` is left as it was. ``checkpoint``: a file the fine-tuning loop writes its state to
    after every epoch and resumes from when it holds this run (same config, requests and starting weights;
    :mod:`.checkpoint`); ``edit_seconds`` then counts the training seconds of the earlier runs too.
    ``fingerprint``: the model's :func:`~crispedit.models.weight_fingerprint` when the caller has it (a model split
    across processes cannot be hashed whole: it is taken before the split).
    """
    config, editor, layers, changed, factors, info = prepare(
        model,
        tokenizer,
        requests,
        config or EditConfig(),
        factors=factors,
        cache_root=cache_root,
        cache_file=cache_file,
        progress=progress,
        predict_drift=predict_drift,
        fingerprint=fingerprint,
    )
    inputs = editor.input_digests(model, config)  # of the unedited model: MEND's default file is keyed by its weights
    cache_seconds = info.get("seconds", 0.0)
    original = snapshot(changed)
    drift_modules = editor.drift_modules(model, layers, config)  # before apply: LoRA wraps them while it trains
    t0 = time.perf_counter()
    ctx = EditContext(
        config, layers, factors, progress=progress, checkpoint=None if checkpoint is None else Path(checkpoint)
    )
    outcome = editor.apply(model, tokenizer, requests, ctx)
    edit_seconds = time.perf_counter() - t0 + outcome.history.extra.get("resumed_seconds", 0.0)
    from ..curvature.predicted import predicted_kl

    return EditResult(
        list(layers),
        outcome.history,
        outcome.projector_stats,
        cache_seconds,
        edit_seconds,
        info,
        original,
        predicted_kl(drift_modules, factors, original),
        outcome.drift_budget,
        inputs,
        config,
    )


def shard_for_edit(model: nn.Module, config: EditConfig, device: str | None = None) -> str:
    """Split ``model``'s decoder blocks across the processes of the default group for an edit under ``config``
    (:func:`crispedit.distributed.shard_model`), keeping whole the weights its editor trains; returns the weight
    fingerprint of the unsplit model (the curvature cache key: a cache built by one process serves a split run,
    and back). One-line error for a method that does not train through the projected loop (single-pass and adapter
    editors read or wrap the frozen weights themselves)."""
    from ..distributed import shard_model
    from .editor import Editor

    config = config.validate().for_family(model_family(model))
    editor = get_editor(config.method)
    if type(editor).apply is not Editor.apply:
        raise CrispEditError(
            f"--shard runs the projected fine-tuning loop; method {config.method!r} edits "
            "otherwise (run it without --shard)"
        )
    fingerprint = weight_fingerprint(model)
    layers = editor.select_layers(model, config)
    shard_model(model, editor.trainable(layers).values(), device)
    return fingerprint


def snapshot(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached copies of ``params`` (name -> tensor, same device and dtype)."""
    return {n: p.detach().clone() for n, p in params.items()}


def restore(model: nn.Module, original_weights: dict[str, torch.Tensor]) -> None:
    """Undo an edit: put back the values recorded in ``EditResult.original_weights`` (full parameter
    names; module names mean their ``weight``)."""
    with torch.no_grad():
        for name, w in original_weights.items():
            parameter(model, name).copy_(w)
