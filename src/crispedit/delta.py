"""Edits as small reversible deltas: ``delta.safetensors``, apply / revert bit for bit, export as a LoRA adapter.

A delta file holds, for every parameter an edit changed (full parameter name), ``ΔW = edited - base`` in
the stored dtype, computed on the CPU. Floating-point addition is not exactly invertible, so each tensor
also carries two small patches, found when the delta is written by replaying the arithmetic:

* ``<name>::apply_idx`` / ``::apply_val``: flat indices where ``base + ΔW`` is not bit-identical to the
  edited value, and the exact edited values there;
* ``<name>::revert_idx`` / ``::revert_val``: the same for ``edited - ΔW`` against the base.

Applying is ``base + ΔW`` then the apply patch (on the CPU, in the stored dtype — the same operations as
when the patches were found), reverting ``edited - ΔW`` then the revert patch: both are bit-exact. The
safetensors header holds JSON metadata (``crispedit-delta``, :data:`DELTA_FORMAT`, the crispedit version that
wrote it — another version's delta is refused in one line): the base and the
edited fingerprint (:func:`delta_fingerprint`: the architecture part of the model config, the
parameter structure, and the changed tensors' values), method, config, the edit requests,
predicted / measured drift, and per tensor its shape, dtype and patch sizes. Apply refuses a model
whose fingerprint is not the base's (a wrong base, or a delta applied twice), revert one that is not
the edited model's. :func:`export_lora` turns a delta into a peft LoRA adapter (truncated SVD).

The header is read without torch by :func:`crispedit.delta_format.read_delta_header` (``crispedit delta info``).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .atomic import atomic_directory, atomic_save_safetensors, atomic_write_json
from .delta_format import DELTA_FILE, DELTA_FORMAT, DELTA_KIND, check_lora_rank, read_delta_header
from .errors import CrispEditError
from .safetensors_io import load_safetensors
from .versions import stamped
from .weights import parameter

__all__ = [
    "DELTA_FILE",
    "DELTA_FORMAT",
    "delta_fingerprint",
    "build_delta",
    "write_delta",
    "load_delta",
    "apply_delta",
    "revert_delta",
    "revert_delta_tensors",
    "export_lora",
    "delta_info",
]

_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_embd",
    "n_layer",
    "n_head",
    "d_model",
)
_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def _bits(t: Tensor) -> Tensor:
    """``t`` viewed as integers of its width (bitwise comparison: -0.0 differs from 0.0, NaNs compare)."""
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def delta_fingerprint(model: nn.Module, values: Mapping[str, Tensor]) -> str:
    """Hex digest (blake2b-128) identifying ``model`` with ``values`` (full parameter name -> tensor) in
    place of those parameters: the architecture keys of its config (model type, sizes), every parameter's
    name, shape and dtype, and the bytes of ``values``. Cheap (no other tensor is read) and
    deterministic; the same model saved and reloaded keeps it."""
    h = hashlib.blake2b(digest_size=16)
    cfg = getattr(model, "config", None)
    arch = {
        k: getattr(cfg, k) for k in _CONFIG_KEYS if cfg is not None and isinstance(getattr(cfg, k, None), (int, str))
    }
    arch.setdefault("model_type", type(model).__name__)
    h.update(json.dumps(arch, sort_keys=True).encode())
    for name, p in sorted(model.named_parameters()):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    for name in sorted(values):
        t = values[name].detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}=".encode())
        h.update(_bits(t).numpy().tobytes())
    return h.hexdigest()


def _patch(result: Tensor, want: Tensor) -> tuple[Tensor, Tensor]:
    """Flat indices where ``result`` differs bitwise from ``want``, and ``want``'s values there."""
    idx = torch.nonzero(_bits(result).reshape(-1) != _bits(want).reshape(-1)).reshape(-1)
    return idx.to(torch.int64), want.reshape(-1)[idx].clone()


def build_delta(
    model: nn.Module, base_weights: Mapping[str, Tensor], info: dict | None = None
) -> tuple[dict[str, Tensor], dict]:
    """The tensors and header metadata of the delta from ``base_weights`` (full parameter name -> base
    value, e.g. ``EditResult.original_weights``) to ``model``'s current values. Unchanged tensors are left
    out (an edit that changed nothing gives an empty delta). ``info`` (method, config, requests, drift, ...) is stored
    in the metadata as given (JSON-ready).
    Returns ``(tensors, metadata)``, ``metadata`` being the safetensors header's ``str -> str`` map."""
    tensors: dict[str, Tensor] = {}
    params: dict[str, dict] = {}
    base_vals, edited_vals = {}, {}
    for name in sorted(base_weights):
        edited = parameter(model, name).detach().cpu().contiguous()
        base = base_weights[name].detach().cpu().contiguous()
        if base.shape != edited.shape or base.dtype != edited.dtype:
            raise CrispEditError(
                f"base value of {name} has shape/dtype {tuple(base.shape)}/{base.dtype}, "
                f"the model {tuple(edited.shape)}/{edited.dtype}"
            )
        if torch.equal(_bits(base), _bits(edited)):
            continue
        d = edited - base
        ai, av = _patch(base + d, edited)
        ri, rv = _patch(edited - d, base)
        tensors[name] = d
        for kind, idx, val in (("apply", ai, av), ("revert", ri, rv)):
            if idx.numel():  # only tensors whose arithmetic does not round-trip carry a patch
                tensors[f"{name}::{kind}_idx"], tensors[f"{name}::{kind}_val"] = idx, val
        params[name] = {
            "shape": list(d.shape),
            "dtype": str(d.dtype).replace("torch.", ""),
            "apply_patch": int(ai.numel()),
            "revert_patch": int(ri.numel()),
        }
        base_vals[name], edited_vals[name] = base, edited
    meta = stamped(
        {
            "kind": DELTA_KIND,
            "format": DELTA_FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "base_fingerprint": delta_fingerprint(model, base_vals),
            "edited_fingerprint": delta_fingerprint(model, edited_vals),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "model_type": getattr(getattr(model, "config", None), "model_type", type(model).__name__),
            "parameters": params,
            **(info or {}),
        }
    )
    return tensors, {"crispedit_delta": json.dumps(meta)}


def write_delta(
    path: str | Path, model: nn.Module, base_weights: Mapping[str, Tensor], info: dict | None = None
) -> dict:
    """Build (:func:`build_delta`) and write the delta atomically to ``path``; returns its metadata."""
    tensors, header = build_delta(model, base_weights, info)
    atomic_save_safetensors(path, tensors, header)
    return json.loads(header["crispedit_delta"])


def load_delta(path: str | Path) -> tuple[dict[str, Tensor], dict]:
    """``(tensors, metadata)`` of a delta file (header checked first, torch-free; one-line errors for a
    missing, truncated or foreign file)."""
    meta = read_delta_header(path)
    _, tensors = load_safetensors(path, "delta", "crispedit_delta")
    missing = [n for n in meta["parameters"] if n not in tensors]
    if missing:
        raise CrispEditError(f"delta file {path} lacks the tensors of {missing} (damaged)")
    return tensors, meta


def _check_model(model: nn.Module, meta: dict, want: str, path: str | Path) -> dict[str, Tensor]:
    """The current CPU values of the delta's parameters in ``model`` once its fingerprint equals ``meta[want]``
    (one-line errors naming a missing parameter, a wrong base, a delta already applied / not applied)."""
    names = list(meta["parameters"])
    try:
        current = {n: parameter(model, n).detach().cpu().contiguous() for n in names}
    except Exception:
        missing = [n for n in names if n not in dict(model.named_parameters())]
        raise CrispEditError(
            f"the model has no parameter(s) {missing} of delta {path}; it is another architecture"
        ) from None
    fp = delta_fingerprint(model, current)
    if fp == meta[want]:
        return current
    other = "edited_fingerprint" if want == "base_fingerprint" else "base_fingerprint"
    if fp == meta[other]:
        state = "already applied to" if want == "base_fingerprint" else "not applied to"
        raise CrispEditError(
            f"delta {path} is {state} this model (its fingerprint is the delta's "
            f"{'edited' if want == 'base_fingerprint' else 'base'} one); refusing"
        )
    what = "base" if want == "base_fingerprint" else "edited model"
    raise CrispEditError(
        f"the model is not the {what} of delta {path} (fingerprint {fp[:12]}…, the delta's "
        f"{what} is {meta[want][:12]}…); refusing"
    )


def _set(model: nn.Module, values: Mapping[str, Tensor]) -> None:
    with torch.no_grad():
        for n, v in values.items():
            parameter(model, n).copy_(v)


def _patched(result: Tensor, tensors: Mapping[str, Tensor], name: str, kind: str) -> Tensor:
    idx = tensors.get(f"{name}::{kind}_idx")
    if idx is not None:
        flat = result.reshape(-1)
        flat[idx] = tensors[f"{name}::{kind}_val"]
    return result


def apply_delta(model: nn.Module, path: str | Path) -> dict:
    """Put the edit of delta ``path`` into ``model`` (its base; checked by fingerprint) in place, bit for bit
    (``base + ΔW`` on the CPU, then the apply patch). Returns the delta's metadata."""
    tensors, meta = load_delta(path)
    current = _check_model(model, meta, "base_fingerprint", path)
    _set(model, {n: _patched(current[n] + tensors[n], tensors, n, "apply") for n in meta["parameters"]})
    return meta


def revert_delta(model: nn.Module, path: str | Path) -> dict:
    """Take the edit of delta ``path`` out of ``model`` (the edited model; checked by fingerprint) in place,
    bit for bit (``edited - ΔW`` on the CPU, then the revert patch). Returns the delta's metadata."""
    tensors, meta = load_delta(path)
    return revert_delta_tensors(model, tensors, meta, path)


def revert_delta_tensors(
    model: nn.Module,
    tensors: Mapping[str, Tensor],
    meta: dict | Mapping[str, str],
    source: str | Path = "in-memory delta",
) -> dict:
    """:func:`revert_delta` for a delta held in memory: ``tensors`` and ``meta`` as :func:`build_delta` returns
    them (its header map, or the decoded metadata :func:`load_delta` gives); ``source`` names it in errors.
    ``model`` must be the delta's edited model (checked by fingerprint); afterwards it holds the base bit for
    bit. Returns the delta's metadata."""
    if "crispedit_delta" in meta:
        meta = json.loads(meta["crispedit_delta"])
    current = _check_model(model, meta, "edited_fingerprint", source)
    _set(model, {n: _patched(current[n] - tensors[n], tensors, n, "revert") for n in meta["parameters"]})
    return meta


def _lora_factors(d: Tensor, rank: int) -> tuple[Tensor, Tensor, dict]:
    """The rank-``rank`` LoRA factors of one weight change ``d`` (``d_out x d_in``) by truncated SVD in float64:
    ``A`` (``rank x d_in``) and ``B`` (``d_out x rank``) with ``B A`` the best rank-``r`` approximation of ``d``
    (``r = min(rank, d_out, d_in)``, the rest zero-padded), and the record :func:`export_lora` reports for it:
    ``rank`` (``r``), ``rank_full`` (numerical rank of ``d``), ``rel_error`` (``‖d − B A‖_F / ‖d‖_F``), ``shape``."""
    U, s, Vh = torch.linalg.svd(d.double(), full_matrices=False)
    r = min(rank, s.numel())
    root = s[:r].sqrt()
    B = torch.zeros(d.shape[0], rank, dtype=torch.float64)
    A = torch.zeros(rank, d.shape[1], dtype=torch.float64)
    B[:, :r], A[:r] = U[:, :r] * root, root[:, None] * Vh[:r]
    total = float((s**2).sum())
    tol = float(s.max()) * max(d.shape) * torch.finfo(d.dtype).eps if s.numel() else 0.0
    return (
        A,
        B,
        {
            "rank": r,
            "rank_full": int((s > tol).sum()),
            "rel_error": math.sqrt(max(total - float((s[:r] ** 2).sum()), 0.0) / total) if total else 0.0,
            "shape": list(d.shape),
        },
    )


def _linear_changes(model: nn.Module, names: Sequence[str], tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``{module name: ΔW}`` of a delta's changed parameters ``names`` (``tensors``: name -> change), each the
    weight of an ``nn.Linear`` of ``model``; one-line error for any other parameter (a LoRA adapter wraps linear
    layers)."""
    changes = {}
    for name in names:
        mod_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(mod_name) if mod_name else model
        if leaf != "weight" or not isinstance(module, nn.Linear):
            raise CrispEditError(
                f"export-lora handles nn.Linear weights only; {name} is a {type(module).__name__} {leaf}"
            )
        changes[mod_name] = tensors[name]
    return changes


def _scored_with_delta(model: nn.Module, tokenizer, path: str | Path, meta: dict) -> tuple[list, dict]:
    """``(requests, scores)``: the edit requests stored in delta ``path`` (metadata ``meta``) and their
    teacher-forced summary with the whole delta applied to ``model`` (reverted after)."""
    from .data.edits import parse_edits
    from .evaluation import edit_scores, summarize_edit_scores

    requests = parse_edits(meta.get("requests") or [], f"delta {path}")
    if not requests or tokenizer is None:
        raise CrispEditError(
            f"delta {path} holds no edit requests to evaluate"
            if not requests
            else "evaluating an adapter needs the tokenizer"
        )
    apply_delta(model, path)
    scores = summarize_edit_scores(edit_scores(model, tokenizer, requests))
    revert_delta(model, path)
    return requests, scores


def _lora_model(model: nn.Module, factors: dict[str, tuple[Tensor, Tensor]], rank: int, base_name: str | None):
    """``model`` wrapped by peft with a rank-``rank`` LoRA adapter (``lora_alpha = rank``: the merged weight is
    ``W + B A``) on the modules of ``factors`` (module name -> ``(A, B)``), whose matrices it holds."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        lora_dropout=0.0,
        bias="none",
        target_modules=sorted(factors),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_name,
    )
    with warnings.catch_warnings():  # transformers' deprecation notices from inside peft are not the user's concern
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for mod_name, (A, B) in factors.items():
            layer = peft_model.base_model.model.get_submodule(mod_name)
            layer.lora_A["default"].weight.copy_(A.to(layer.lora_A["default"].weight.dtype))
            layer.lora_B["default"].weight.copy_(B.to(layer.lora_B["default"].weight.dtype))
    return peft_model


def export_lora(
    model: nn.Module,
    path: str | Path,
    rank: int,
    out: str | Path,
    *,
    base_name: str | None = None,
    tokenizer=None,
    evaluate: bool = False,
) -> dict[str, dict]:
    """Write delta ``path`` as a peft LoRA adapter directory ``out`` (``adapter_config.json`` +
    ``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base, out)``) for ``model`` (the
    base; checked by fingerprint; peft layers are injected into it). Per changed ``nn.Linear`` weight
    ``ΔW`` (``d_out x d_in``): truncated SVD in float64, ``B = U_r √s_r`` (``d_out x r``), ``A = √s_r V_rᵀ``
    (``r x d_in``), ``r = min(rank, d_out, d_in)`` padded with zeros to ``rank``; ``lora_alpha = rank`` so
    the merged weight is ``W + B A``; a ``rank`` above the largest ``min(d_out, d_in)`` of the delta is refused
    before any work (:func:`~crispedit.delta_format.check_lora_rank`). Returns per module: ``rank`` used,
    ``rank_full`` (numerical rank of ΔW), ``rel_error`` (``‖ΔW − B A‖_F / ‖ΔW‖_F``) and ``shape``. With
    ``evaluate`` (and ``tokenizer``) the edit requests stored in the delta are scored teacher-forced (rel, gen,
    token accuracies) with the full delta and with the adapter, under the key ``"scores"`` (``{"delta": ...,
    "adapter": ...}``); everything is also written to ``out/crispedit_lora.json``."""
    rank = check_lora_rank("rank", rank, read_delta_header(path), path)
    tensors, meta = load_delta(path)
    _check_model(model, meta, "base_fingerprint", path)
    changes = _linear_changes(model, meta["parameters"], tensors)
    scores: dict = {}
    requests = []
    if evaluate:
        requests, scores["delta"] = _scored_with_delta(model, tokenizer, path, meta)
    factors, report = {}, {}
    for mod_name, d in changes.items():
        A, B, report[mod_name] = _lora_factors(d, rank)
        factors[mod_name] = (A, B)
    peft_model = _lora_model(model, factors, rank, base_name)
    if evaluate:
        from .evaluation import edit_scores, summarize_edit_scores

        peft_model.eval()
        scores["adapter"] = summarize_edit_scores(edit_scores(peft_model, tokenizer, requests))
    with atomic_directory(out) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        peft_model.save_pretrained(str(tmp))
        atomic_write_json(
            tmp / "crispedit_lora.json",
            {
                "delta": str(path),
                "rank": rank,
                "layers": report,
                "base_fingerprint": meta["base_fingerprint"],
                "method": meta.get("method"),
                "scores": scores or None,
            },
        )
    if scores:
        report = dict(report, scores=scores)
    return report


def delta_info(method: str, config: dict | None, requests: Sequence[Any], summary: dict | None = None, **extra) -> dict:
    """The descriptive part of a delta's metadata: method, config, the edit requests (crispedit schema),
    ``kl_predicted`` / ``kl_drift`` (nats per token) from ``summary`` and any ``extra`` keys."""
    summary = summary or {}
    return {
        "method": method,
        "config": config,
        "requests": [r.to_json() if hasattr(r, "to_json") else r for r in requests],
        "kl_predicted": summary.get("kl_predicted"),
        "kl_drift": summary.get("kl_drift"),
        **extra,
    }
