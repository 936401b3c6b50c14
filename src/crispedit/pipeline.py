"""Edit jobs end to end: edit, measure, save — what ``crispedit edit`` runs.

:class:`EditJob` is one edit followed by its measures, the one place that wires :func:`~crispedit.editing.edit` to
:func:`~crispedit.evaluation.evaluate_edit`: ``crispedit edit`` (:func:`run_edit_job`, which adds the output
folder), ``compare``'s rows, the demo and the playground all run their edits through it, so a failed edit leaves the
model as it was and a non-finite one is refused in the same way everywhere; a session's rounds, which train through
:func:`~crispedit.sessions.sequential.run_round`, are measured by its :meth:`~EditJob.evaluate`.

The output directory is written atomically: everything goes to a temporary sibling directory that is
renamed into place only when the model, tokenizer and report are complete, so a failed job leaves
nothing at ``out`` (with ``overwrite``, only the files of the earlier edit are replaced, one rename each,
the report last).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import atomic_directory, atomic_write_json
from .checks import check_finite_tensors
from .curvature.predicted import mixing_layers, steep_layers, steep_note  # re-exported: pipeline.steep_layers
from .data.corpus import heldout_text
from .data.edits import EditRequest
from .distributed import barrier, full_state_dict, is_main, is_sharded, world_size
from .editing import EditConfig, EditResult, edit, get_editor, restore
from .editing.api import snapshot
from .evaluation import EVAL_WRAPPERS, evaluate_edit
from .models import save_model_dir
from .paths import check_output_dir
from .versions import environment, stamped
from .weights import parameter

__all__ = [
    "EditJob",
    "Measures",
    "run_edit_job",
    "build_report",
    "drift_summary",
    "steep_layers",
    "steep_note",
]


def build_report(
    config: EditConfig,
    model_spec: str,
    requests: Sequence[EditRequest],
    result: EditResult,
    summary: dict,
    per_edit: list[dict],
    kl_text: str | None,
    edits_path: str | None,
) -> dict:
    """The ``edit_report.json`` dict (:func:`~crispedit.versions.stamped` with this crispedit's version): what was run,
    summary, training history, projector, cache, config,
    the files the editor read by content (``inputs``, MEND's network: option -> SHA-256; absent when none),
    environment, per-edit scores."""
    summary = dict(summary)
    summary.update(drift_summary(result))
    summary["edit_seconds"] = round(result.edit_seconds, 3)
    summary["cache_seconds"] = round(result.cache_seconds, 3)
    return stamped(
        {
            "method": config.method,
            "gamma": config.gamma,
            "layers": result.layers,
            "n_edits": len(requests),
            "model": model_spec,
            "edits_file": edits_path,
            "kl_text": kl_text or "bundled:wikitext_heldout.txt",
            "summary": summary,
            "training": result.history.to_json(),
            "projector": result.projector_stats,
            "cache": result.cache_info,
            "config": config.to_json(),
            **({"inputs": result.inputs} if result.inputs else {}),
            "environment": environment(),
            "per_edit": per_edit,
        }
    )


def drift_summary(result: EditResult) -> dict:
    """The report keys of the drift model: ``kl_predicted`` (K-FAC predicted per-token KL drift, nats, the
    coherent bound over layers; ``None`` when no factors cover the changed weights),
    ``kl_predicted_blockdiag`` (the layers' sum), ``kl_predicted_layers`` (per edit layer), ``steep_layers``
    (:func:`steep_layers`: those that dominate the prediction), ``mixing_layers``
    (:func:`~crispedit.curvature.predicted.mixing_layers`: attention q/k/v matrices, whose drift the prediction
    under-reads) and, with
    ``--max-drift``, ``drift_budget`` (``max_drift``, ``hit``, ``hits``, ``steps``, ``final_predicted``)."""
    pred = result.kl_predicted
    out = {
        "kl_predicted": None if pred is None else float(f"{pred['total']:.6g}"),
        "kl_predicted_blockdiag": None if pred is None else float(f"{pred['blockdiag']:.6g}"),
        "kl_predicted_layers": None if pred is None else {k: float(f"{v:.6g}") for k, v in pred["layers"].items()},
        "steep_layers": [] if pred is None else steep_layers(pred["layers"]),
        "mixing_layers": [] if pred is None else mixing_layers(pred["layers"]),
    }
    if result.drift_budget is not None:
        out["drift_budget"] = result.drift_budget
    return out


@dataclass(frozen=True)
class Measures:
    """What an :class:`EditJob` measures once the edit is in (:func:`~crispedit.evaluation.evaluate_edit`'s
    options): WILD free generation under the ``wild`` evaluation wrappers, the assistant's measures (style drift and
    subject bleed through the chat template), KL drift on ``kl_texts`` paragraphs of ``kl_text`` (``None``: the
    bundled held-out WikiText), and the ``capabilities`` tasks on ``limit`` items (generative answers cut at
    ``max_gen_toks`` tokens, local files under ``bench_dir``). The default: every wrapper and the assistant's
    measures, no capability task."""

    wild: tuple[str, ...] = field(default_factory=lambda: tuple(EVAL_WRAPPERS))
    assistant: bool = True
    kl_text: str | None = None
    kl_texts: int = 32
    capabilities: tuple[str, ...] = ()
    limit: int | dict | None = None
    max_gen_toks: int | None = None
    bench_dir: str | None = None


@dataclass
class EditJob:
    """One edit of ``model`` (changed in place) by ``config`` on ``requests``, then its :class:`Measures`.
    :meth:`edit` and :meth:`evaluate` are its two halves (a caller that times or meters the edit alone calls them in
    turn), :meth:`run` both. ``progress``: bars for both (``None``: when stderr is a terminal)."""

    model: object
    tokenizer: object
    requests: Sequence[EditRequest]
    config: EditConfig
    measures: Measures = field(default_factory=Measures)
    progress: bool | None = None

    def edit(self, **options) -> EditResult:
        """:func:`~crispedit.editing.edit` with ``options`` (``checkpoint``, ``cache_file``, ``factors``,
        ``predict_drift``, ``fingerprint``). A failed edit — an exception, or changed weights that are not finite
        (a one-line :class:`~crispedit.errors.CrispEditError`) — puts back what the method changes before it raises,
        so the model is as it was."""
        editor = get_editor(self.config.method)
        before = snapshot(editor.changes(self.model, editor.select_layers(self.model, self.config), self.config))
        try:
            result = edit(self.model, self.tokenizer, self.requests, self.config, progress=self.progress, **options)
            check_finite_tensors(
                {n: parameter(self.model, n) for n in result.original_weights}, f"the {self.config.method} edit"
            )
        except BaseException:
            restore(self.model, before)
            raise
        return result

    def evaluate(self, base_weights: dict) -> dict:
        """:func:`~crispedit.evaluation.evaluate_edit` of the model as it is now against ``base_weights`` (parameter
        name -> the value before the edit, as ``EditResult.original_weights``; ``{}``: the model is the base), KL
        drift on texts of the config's ``max_len``."""
        m = self.measures
        return evaluate_edit(
            self.model,
            self.tokenizer,
            self.requests,
            base_weights,
            kl_text=m.kl_text,
            kl_texts=m.kl_texts,
            max_len=self.config.max_len,
            wild=m.wild,
            capabilities=m.capabilities,
            limit=m.limit,
            max_gen_toks=m.max_gen_toks,
            bench_dir=m.bench_dir,
            assistant=m.assistant,
            progress=self.progress,
        )

    def run(self, *, restore_after: bool = False, **options) -> tuple[EditResult, dict]:
        """:meth:`edit` (with ``options``), then :meth:`evaluate`: ``(result, evaluation)``. ``restore_after``: put
        the base back once measured (also when measuring fails), as a comparison of methods on one model does."""
        result = self.edit(**options)
        try:
            return result, self.evaluate(result.original_weights)
        finally:
            if restore_after:
                restore(self.model, result.original_weights)


def _write_delta(
    folder: Path, model, result: EditResult, requests: Sequence[EditRequest], summary: dict, model_spec: str
) -> dict:
    """Write the edit ``result`` made to ``model`` as a reversible delta into ``folder``
    (:func:`crispedit.delta.write_delta`, with the method, configuration, ``requests`` and ``summary``) and return
    the report's ``delta`` section: the file, its bytes, the tensors it changes and the two fingerprints."""
    from .delta import DELTA_FILE, delta_info, write_delta

    config = result.config
    info = delta_info(config.method, config.to_json(), requests, summary, model=model_spec, layers=result.layers)
    meta = write_delta(folder / DELTA_FILE, model, result.original_weights, info)
    return {
        "file": DELTA_FILE,
        "bytes": (folder / DELTA_FILE).stat().st_size,
        "tensors": sorted(meta["parameters"]),
        "base_fingerprint": meta["base_fingerprint"],
        "edited_fingerprint": meta["edited_fingerprint"],
    }


def run_edit_job(
    model,
    tokenizer,
    requests: Sequence[EditRequest],
    config: EditConfig,
    out: str | Path,
    *,
    model_spec: str = "<in-memory>",
    kl_text: str | None = None,
    edits_path: str | None = None,
    cache_file: str | None = None,
    progress: bool | None = None,
    wild: bool = True,
    overwrite: bool = False,
    predict_drift: bool = False,
    delta_only: bool = False,
    checkpoint: str | Path | None = None,
    fingerprint: str | None = None,
) -> dict:
    """Edit, evaluate and save ``model`` to ``out`` (HF format + ``edit_report.json``). With ``wild``
    the report gets a ``wild`` section: free-generation rel / gen / locality under the qa, none and chat
    contexts (rule judge; chat only for models with a chat template). A non-empty ``out`` is refused
    unless ``overwrite`` and it holds an earlier ``edit_report.json``; then only the files that run wrote
    are replaced (the report's ``files``), the others kept. An edit that leaves inf/nan weights fails
    with a one-line error and writes nothing. Under ``torch.distributed`` every process calls it: the
    curvature collection and every edit batch are split across the processes, each evaluates the
    (identical) edited model, and only rank 0 writes ``out``; the report then records ``processes``.
    ``predict_drift``: also report ``kl_predicted`` for editors without curvature (see
    :func:`crispedit.editing.edit`). Next to the model, ``out/delta.safetensors`` holds the edit as a
    reversible delta (:mod:`crispedit.delta`; the report's ``delta`` section) and ``out/README.md`` the model
    card (:mod:`crispedit.model_card`; never over a README.md of the user's); ``delta_only`` writes the
    delta and the report but not the model (and no card). ``checkpoint``: the training's resumable state file
    (:func:`crispedit.editing.edit`). On a model whose blocks are split across the processes
    (:func:`crispedit.distributed.shard_model`; pass its ``fingerprint``, taken before the split) the weights are
    gathered to rank 0 for saving, and the report records ``sharded``."""
    out = Path(out)
    previous = check_output_dir(out, overwrite=overwrite, marker="edit_report.json")
    if kl_text is not None:
        heldout_text(kl_text, 1)  # fail early on a bad --kl-text, before any work
    t0 = time.perf_counter()
    measures = Measures(wild=tuple(EVAL_WRAPPERS) if wild else (), assistant=wild, kl_text=kl_text)
    result, ev = EditJob(model, tokenizer, requests, config, measures, progress).run(
        cache_file=cache_file, predict_drift=predict_drift, checkpoint=checkpoint, fingerprint=fingerprint
    )
    config = result.config  # what ran: its lr set for the model family
    report = build_report(config, model_spec, requests, result, ev["summary"], ev["per_edit"], kl_text, edits_path)
    if wild:
        report["wild"] = ev["wild"]
        report["assistant"] = ev["assistant"]
    report["summary"]["total_seconds"] = round(time.perf_counter() - t0, 3)
    if world_size() > 1:
        report["processes"] = world_size()
    weights = None
    if is_sharded(model):  # the blocks are split across the processes: gathered (every process takes part)
        report["sharded"] = True
        weights = {} if delta_only else full_state_dict(model)
    if is_main():  # under torchrun every process holds the same edited weights; rank 0 writes them
        from .delta import DELTA_FILE
        from .model_card import build_card, card_may_replace, revert_lines, write_card

        with atomic_directory(out, previous=previous) as tmp:
            # refuses non-finite weights
            files = [] if delta_only else save_model_dir(model, tokenizer, tmp, progress=progress, state_dict=weights)
            report["delta"] = _write_delta(tmp, model, result, requests, report["summary"], model_spec)
            report["delta"]["model_saved"] = not delta_only
            if not delta_only and card_may_replace(out, previous):  # a model folder gets its model card
                card = build_card(
                    report,
                    made_by="`crispedit edit` (`crispedit.pipeline.run_edit_job`)",
                    revert=revert_lines(f"MODEL_DIR/{DELTA_FILE}"),
                )
                files.append(write_card(tmp, card))
            report["files"] = sorted(files + [DELTA_FILE, "edit_report.json"])  # what `--overwrite` may replace later
            atomic_write_json(tmp / "edit_report.json", report)
    barrier()
    return report
