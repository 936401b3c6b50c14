"""Edit jobs end to end: load, edit, measure, save — what ``crispedit edit`` runs.

The output directory is written atomically: everything goes to a temporary sibling directory that is
renamed into place only when the model, tokenizer and report are complete, so a failed job leaves
nothing at ``out``.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Sequence

import torch

from . import __version__
from .data.corpus import heldout_text
from .data.edits import EditRequest
from .editing import EditConfig, EditResult, edit
from .errors import CrispEditError, atomic_directory, atomic_write_json
from .evaluation import RuleJudge, edit_scores, kl_drift, summarize_edit_scores
from .evaluation.wild import wild_contexts

__all__ = ["evaluate_edit", "run_edit_job", "environment"]


def environment() -> dict:
    """Library versions, Python, platform and torch thread count (recorded in every report)."""
    import transformers

    return {"crispedit": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "threads": torch.get_num_threads()}


def evaluate_edit(model, tokenizer, requests: Sequence[EditRequest], result: EditResult, *,
                  kl_text: str | Path | None = None, kl_texts: int = 32, max_len: int = 256,
                  progress: bool | None = None) -> tuple[dict, list[dict]]:
    """Summary (rel, gen, kl_drift, ...) and per-edit list for an edited model."""
    per_edit = edit_scores(model, tokenizer, requests)
    summary = summarize_edit_scores(per_edit)
    texts = heldout_text(kl_text, kl_texts)
    drift = kl_drift(model, tokenizer, texts, base_weights=result.original_weights, max_len=max_len, progress=progress)
    summary.update({"kl_drift": round(drift["kl_drift"], 6), "ppl": round(drift["ppl"], 4),
                    "ppl_base": round(drift["ppl_base"], 4), "kl_tokens": drift["tokens"]})
    return summary, per_edit


def build_report(config: EditConfig, model_spec: str, requests: Sequence[EditRequest], result: EditResult,
                 summary: dict, per_edit: list[dict], kl_text: str | None, edits_path: str | None) -> dict:
    """The ``edit_report.json`` dict: what was run, summary, training history, projector, cache, config,
    environment, per-edit scores."""
    summary = dict(summary)
    summary["edit_seconds"] = round(result.edit_seconds, 3)
    summary["cache_seconds"] = round(result.cache_seconds, 3)
    return {
        "method": config.method, "gamma": config.gamma, "layers": result.layers, "n_edits": len(requests),
        "model": model_spec, "edits_file": edits_path, "kl_text": kl_text or "bundled:wikitext_heldout.txt",
        "summary": summary, "training": result.history.to_json(), "projector": result.projector_stats,
        "cache": result.cache_info, "config": config.to_json(), "environment": environment(),
        "per_edit": per_edit,
    }


def run_edit_job(model, tokenizer, requests: Sequence[EditRequest], config: EditConfig, out: str | Path, *,
                 model_spec: str = "<in-memory>", kl_text: str | None = None, edits_path: str | None = None,
                 cache_file: str | None = None, progress: bool | None = None, wild: bool = True) -> dict:
    """Edit, evaluate and save ``model`` to ``out`` (HF format + ``edit_report.json``). With ``wild``
    the report gets a ``wild`` section: free-generation rel / gen / locality under the qa, none and chat
    contexts (rule judge; chat only for models with a chat template)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not (out / "edit_report.json").is_file():
        raise CrispEditError(f"output directory {out} exists and is not an earlier crispedit output; refusing to overwrite")
    if kl_text is not None:
        heldout_text(kl_text, 1)  # fail early on a bad --kl-text, before any work
    t0 = time.perf_counter()
    result = edit(model, tokenizer, requests, config, cache_file=cache_file, progress=progress)
    summary, per_edit = evaluate_edit(model, tokenizer, requests, result, kl_text=kl_text, max_len=config.max_len,
                                      progress=progress)
    report = build_report(config, model_spec, requests, result, summary, per_edit, kl_text, edits_path)
    if wild:
        report["wild"] = wild_contexts(model, tokenizer, requests, RuleJudge(), progress=progress)
        report["wild"]["judge"] = "rule"
    report["summary"]["total_seconds"] = round(time.perf_counter() - t0, 3)
    with atomic_directory(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        atomic_write_json(tmp / "edit_report.json", report)
    return report
