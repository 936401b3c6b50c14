"""CrispEdit-Seq: one editing round at a time, with streaming K-FAC constraints (paper, Algorithm 2).

A round edits one chunk of requests with the shared projected loop
(:func:`crispedit.editing.loop.projected_finetune`). Afterwards the K-FAC factors of the chunk's *full*
``prompt + " " + target`` sequences (no prompt masking: the paper's ablation shows masking hurts) are
collected on the edited model and folded into the accumulated edit factors by an exact token-weighted
streaming average (so the accumulated edit factors equal a one-shot collection over the union of the
chunks, for a fixed model). The next round's projector is rebuilt from capability + edit factors:

* ``weighting="fixed"``: ``(1 - mix) * cap + mix * edits`` with a fixed coefficient
  (``mix=0.5``): earlier edits keep a constant share of the constraint however large the
  capability corpus is;
* ``weighting="trace"``: the same mix of the two sets after the edit factors are scaled to the capability
  factors' traces, layer by layer, so ``mix`` is the edits' share of each factor's energy (with raw factors the
  edits' output-gradient covariance, when larger than the capability one, takes most of it whatever ``mix``);
* ``weighting="each"`` (default): the eigenbasis of ``trace``'s mix, with a mask that covers γ of the capability
  factors'
  energy *and* γ of the accumulated edit factors' energy, each measured in that basis
  (:func:`~crispedit.curvature.masks.per_source_keep_mask`): neither set can take the whole budget, by its
  scale or by one outlier direction (results/README.md);
* ``weighting="apart"``: γ of the capability energy masked in the capability factors' own eigenbasis — the
  mask a batch edit or a first round uses — and ``edit_gamma`` of the edit energy in the edit factors' own, the two
  projectors composed by symmetric alternation (:class:`~crispedit.curvature.projection.AlternatingProjector`,
  :data:`APART_SWEEPS` sweeps). Under ``each`` the capability mask in the merged basis also covers the earlier
  edits' directions, whatever ``edit_gamma``; apart, the capability mask is the first round's and ``edit_gamma``
  trades the later rounds' room against the earlier edits' protection (results/README.md, room for later rounds);
* ``weighting="tokens"``: the authors' code, a token-count-weighted average; the capability corpus
  (thousands of tokens) swamps the edits (tens of tokens each).

With ``replay`` a round also trains on a seeded sample of the stream's earlier edits (:func:`replayed`) beside
its own: the constraint keeps later rounds away from what earlier rounds' edits need, and rehearsal repairs what
it lets through. The round's edit factors and record stay its own edits'.

The Adam state is carried across rounds; when the projector changes its first moment is re-projected
onto the new kept subspace (the authors do the same) so stale momentum cannot push the weights along
directions that are now constrained. Optionally (``recompute_drift``, paper 0.25) the capability factors
are recollected on the edited model once a trained weight has drifted by more than that relative
Frobenius norm since they were last computed.

``mode="batch"`` is the comparison baseline: every round re-edits the base model on the union of all
rounds so far, with capability factors only (plain CrispEdit). ``method="ft"`` with ``mode="sequential"``
is the paper's "FT Sequential" (no projection); ``method="lora"`` is "LoRA Sequential" (a fresh adapter
trained and merged every round; only the merged weights carry over).

The round itself is :meth:`Editor.apply` — the same set-up around the loop as a batch :func:`edit`.
Rounds are driven either durably, one ``add`` at a time, by :class:`~crispedit.sessions.session.Session`, or
in memory over consecutive chunks of one edit set by :func:`~crispedit.sessions.in_memory.run_sequence`
(``crispedit compare``'s ``<method>-seq`` rows).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from torch import Tensor, nn

from ..curvature.factors import KFACFactors
from ..curvature.kfac import collect_lm_kfac
from ..curvature.predicted import mixing_layers, predicted_kl, steep_layers
from ..data.edits import EditRequest
from ..editing.api import restore
from ..editing.config import EDIT_FACTOR_ROWS, MODES, WEIGHTINGS, EditConfig, SeqConfig
from ..editing.contexts import sequences_for
from ..editing.editor import EditContext, EditOutcome
from ..editing.registry import get_editor
from ..editing.written import prefixes_from
from ..errors import CrispEditError
from ..weights import parameter

__all__ = [
    "SeqConfig",
    "SeqState",
    "combine_factors",
    "round_edit_factors",
    "run_round",
    "replayed",
    "drift_spent",
    "weight_drift",
    "WEIGHTINGS",
    "MODES",
    "APART_SWEEPS",
]

APART_SWEEPS = 2  # symmetric-alternation sweeps of weighting "apart" (each sweep: two more part projections)


@dataclass
class SeqState:
    """What carries from one round to the next (all CPU tensors; what a session stores)."""

    weights: dict[str, Tensor]  # current values of the parameters the editor changes, by full name
    cap: KFACFactors | None = None  # capability factors
    edits: KFACFactors | None = None  # accumulated edit factors (token-weighted average)
    optim: dict[str, Tensor] = field(default_factory=dict)  # flattened Adam state
    cap_ref: dict[str, Tensor] | None = None  # weights the capability factors were computed at (None: base)

    def to_tensors(self) -> tuple[dict[str, Tensor], dict]:
        """The state as one flat tensor dict (``weights::<name>``, ``cap::<layer>::A`` / ``::S``, ``edits::...``,
        ``optim::<key>``, ``cap_ref::<name>``; contiguous CPU tensors) and the JSON-ready facts the tensors do not
        hold (the factors' token counts, which parts are present): what :meth:`from_tensors` takes back."""
        out = {f"weights::{n}": t for n, t in self.weights.items()}
        meta: dict = {}
        for part in ("cap", "edits"):
            f = getattr(self, part)
            if f is not None:
                out.update({f"{part}::{k}": t for k, t in f.to_tensors().items()})
                meta[f"{part}_tokens"] = int(f.n_tokens)
        out.update({f"optim::{k}": t for k, t in self.optim.items()})
        if self.cap_ref is not None:
            out.update({f"cap_ref::{n}": t for n, t in self.cap_ref.items()})
            meta["cap_ref"] = True
        return {k: t.detach().cpu().contiguous() for k, t in out.items()}, meta

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], meta: dict) -> SeqState:
        """The state :meth:`to_tensors` wrote as ``(tensors, meta)``."""

        def part(prefix: str) -> dict[str, Tensor]:
            """The tensors stored under ``prefix``, keyed by the rest of their names."""
            return {k[len(prefix) :]: t for k, t in tensors.items() if k.startswith(prefix)}

        def factors(name: str) -> KFACFactors | None:
            """The factors stored under ``name`` (``cap`` or ``edits``), or ``None`` when the state had none."""
            return (
                KFACFactors.from_tensors(part(f"{name}::"), int(meta[f"{name}_tokens"]))
                if f"{name}_tokens" in meta
                else None
            )

        return cls(
            weights=part("weights::"),
            cap=factors("cap"),
            edits=factors("edits"),
            optim=part("optim::"),
            cap_ref=part("cap_ref::") if meta.get("cap_ref") else None,
        )


# ---------------------------------------------------------------------------------------------
# factor policy


def combine_factors(
    cap: KFACFactors, edits: KFACFactors | None, weighting: str, mix: float, edit_gamma: float | None = None
) -> KFACFactors:
    """The constraint for the next round: capability factors merged with the accumulated edit factors
    (``weighting`` and ``mix`` as the module docstring says; per layer, same shapes as ``cap``); under ``each``
    the edit factors' energy is masked to ``edit_gamma`` (``None``: the edit config's γ)."""
    if edits is None:
        return cap
    if weighting == "tokens":
        return cap.merged(edits)
    if weighting == "fixed":
        return cap.merged(edits, weight=mix)
    if weighting in ("trace", "each", "apart"):
        merged = cap.merged(edits.rescaled_to(cap), weight=mix)
        if weighting in ("each", "apart"):
            merged.parts, merged.part_gammas = (cap, edits), (None, edit_gamma)
        if weighting == "apart":
            merged.part_sweeps = APART_SWEEPS
        return merged
    raise CrispEditError(f"unknown factor weighting {weighting!r}")


def round_edit_factors(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    layers: dict[str, nn.Module],
    config: EditConfig,
    round_index: int,
    progress: bool | None = None,
    rows: str = "full",
) -> KFACFactors:
    """K-FAC factors of the requests' training sequences — every edit context — on ``model``: the edits are
    protected in the forms they were taught. ``rows="full"`` (the paper): every position of context and target
    (no prompt masking); ``"target"``: only the positions that predict the target (and answer end) tokens, the
    loss the round trained, so the factors describe the edits' own curvature rather than the prompts'."""
    if rows not in EDIT_FACTOR_ROWS:
        raise CrispEditError(f"edit factor rows must be one of {', '.join(EDIT_FACTOR_ROWS)}, got {rows!r}")
    kw = dict(
        max_len=config.max_len,
        batch_size=config.kfac_batch_size,
        label_mode=config.label_mode,
        seed=config.seed + 1000 * round_index,
        progress=progress,
        desc="K-FAC[edits]",
    )
    if rows == "full":
        return collect_lm_kfac(model, tokenizer, edit_texts(tokenizer, requests, config, model), layers, **kw)
    seqs = sequences_for(tokenizer, requests, config, model)[0]
    return collect_lm_kfac(model, tokenizer, [s.ids for s in seqs], layers, loss_from=[s.n_context for s in seqs], **kw)


def edit_texts(
    tokenizer, requests: Sequence[EditRequest], config: EditConfig, model: nn.Module | None = None
) -> list[str]:
    """The text of every training sequence of ``requests`` (context + target + answer end); ``model``
    writes the ``gen`` prefixes when that context is used."""
    return [s.text for s in sequences_for(tokenizer, requests, config, model)[0]]


def replayed(earlier: Sequence[EditRequest], n: int, seed: int, round_index: int) -> list[EditRequest]:
    """The earlier edits round ``round_index`` rehearses: ``min(n, len(earlier))`` of ``earlier`` (the stream's
    edits before this round, oldest first), a sample drawn from ``seed`` and the round's index — so a redone round
    draws the same ones and every round draws others — in stream order."""
    k = min(max(n, 0), len(earlier))
    if k == 0:
        return []
    picked = random.Random(seed * 1_000_003 + round_index).sample(range(len(earlier)), k)
    return [earlier[i] for i in sorted(picked)]


def accumulate(acc: KFACFactors | None, new: KFACFactors) -> KFACFactors:
    """Exact streaming average (token-weighted): equals one collection over the union on a fixed model."""
    return new if acc is None else acc.merged(new)


# ---------------------------------------------------------------------------------------------
# the round


def weight_drift(weights: dict[str, Tensor], ref: dict[str, Tensor]) -> dict[str, float]:
    """Relative Frobenius change ``|W - W_ref| / |W_ref|`` per layer."""
    return {
        n: float((weights[n].double() - ref[n].double()).norm() / ref[n].double().norm().clamp_min(1e-30))
        for n in weights
    }


def _round_budget(ec, spent: float):
    """``(config, budget record)`` of a round that may spend what the session's ``--max-drift`` has left after
    ``spent`` (nats/token predicted): the config with ``max_drift`` set to that remainder, and the record
    (``None`` without a session budget). One-line error when the budget is spent."""
    if ec.max_drift is None:
        return ec, None
    remaining = ec.max_drift - spent
    if remaining <= ec.max_drift * 1e-3:  # (rounding of the float32 pull-back: under 0.1 % left is spent)
        raise CrispEditError(
            f"the session's drift budget is spent ({spent:.6g} of {ec.max_drift:g} nats/token "
            "predicted); start a new session for more edits"
        )
    return replace(ec, max_drift=remaining), {
        "session_budget": ec.max_drift,
        "spent_before": spent,
        "round_budget": remaining,
    }


def run_round(
    model: nn.Module,
    tokenizer,
    layers: dict[str, nn.Module],
    requests: Sequence[EditRequest],
    state: SeqState,
    config: SeqConfig,
    round_index: int,
    *,
    base_weights: dict[str, Tensor],
    union: Sequence[EditRequest] | None = None,
    earlier: Sequence[EditRequest] = (),
    capability: Callable[[], KFACFactors] | None = None,
    progress: bool | None = None,
    drift_spent: float = 0.0,
    checkpoint: Path | None = None,
) -> tuple[SeqState, dict]:
    """Apply one round (``round_index`` counts from 1) and return the new state and a record.

    ``layers`` are the editor's edit layers (:meth:`Editor.select_layers`); ``state.weights`` and
    ``base_weights`` hold the parameters the editor changes (:meth:`Editor.changes`, full names).
    ``model``'s changed parameters are set from ``state.weights`` first, so the result depends only on
    (state, requests, config, round_index): an interrupted round redone from the stored state gives
    the same result. ``union`` (batch mode) is every request so far; ``earlier`` (sequential mode) the stream's
    requests before this round, of which ``config.replay`` (:func:`replayed`) train beside ``requests`` — the
    round's edit factors and its record's edits stay its own; ``capability`` recollects the
    capability factors on the current model (used when ``recompute_drift`` triggers). The prefixes the model
    writes itself (MEMIT's context templates, the ``gen`` context) are the unedited model's in every round
    (:func:`~crispedit.editing.written.prefixes_from` with ``base_weights``).

    Drift: the record holds ``kl_predicted`` (the capability factors' predicted KL drift of the change from
    the base, nats per token; what ``kl_drift`` measures) and ``kl_predicted_round`` (of this round's own
    change). With ``config.edit.max_drift`` the session has one budget: a sequential round may spend
    ``max_drift - drift_spent`` (``drift_spent``: the sum of the earlier rounds' ``kl_predicted_round``),
    enforced on its own change (:class:`~crispedit.curvature.predicted.DriftBudget` with the capability
    factors ``state.cap``, which a session of a method without curvature — ft, locbf-ft, LoRA on its adapted
    modules — holds when it has a budget or penalty); a batch-mode round re-edits the base and gets the whole
    budget. A spent budget is a one-line error. ``config.edit.drift_penalty`` reads the round's own change, or under
    ``config.drift_from == "base"`` (sequential mode) the change from ``base_weights``: the session's whole drift.

    ``checkpoint``: a file the round's fine-tuning loop saves its state to after every epoch and resumes from
    (:mod:`crispedit.editing.checkpoint`; its identity covers the round's starting weights and carried optimizer
    state), so a round killed while training goes on from its last epoch.
    """
    editor = get_editor(config.edit.method)
    t0 = time.perf_counter()
    plan = _plan_round(editor, state, config, requests, round_index, base_weights, union, earlier, drift_spent)
    restore(model, plan.start)  # the round starts from these values
    drift_modules = editor.drift_modules(model, layers, plan.edit)  # what state.cap predicts the drift of (LoRA: q/v)
    with prefixes_from(base_weights):  # the prefixes the model writes itself: the unedited model's, every round
        outcome = editor.apply(
            model,
            tokenizer,
            plan.train,
            EditContext(
                plan.edit,
                layers,
                plan.constraint,
                optimizer_state=state.optim if plan.carry else {},
                reproject_momentum=config.reproject_momentum,
                keep_optimizer=plan.carry,
                progress=progress,
                drift_factors=state.cap,
                drift_reference=base_weights if config.drift_from == "base" and not plan.batch else None,
                checkpoint=checkpoint,
            ),
        )
    weights = {n: parameter(model, n).detach().cpu().clone() for n in base_weights}
    new = SeqState(
        weights=weights, cap=state.cap, edits=state.edits, optim=outcome.optimizer_state, cap_ref=state.cap_ref
    )
    record = _round_record(
        outcome, plan, config, _drift_record(drift_modules, state.cap, base_weights, plan.start, weights)
    )
    if config.uses_weighting:  # the rounds that merge edit factors into their constraint
        t1 = time.perf_counter()
        with prefixes_from(base_weights):  # the texts the round trained; their factors on the edited model
            new.edits = accumulate(
                state.edits,
                round_edit_factors(
                    model,
                    tokenizer,
                    requests,
                    layers,
                    plan.edit,
                    round_index,
                    progress=progress,
                    rows=config.edit_factors,
                ),
            )
        record["edit_factor_tokens"] = new.edits.n_tokens
        record["edit_factor_seconds"] = round(time.perf_counter() - t1, 3)
        if config.recompute_drift is not None:
            _recompute_capability(new, state.cap_ref or base_weights, config.recompute_drift, capability, record)
    # a round resumed from its loop checkpoint also counts the killed run's training seconds
    record["edit_seconds"] = round(time.perf_counter() - t0 + outcome.history.extra.get("resumed_seconds", 0.0), 3)
    return new, record


@dataclass
class _RoundPlan:
    """What a round trains, from where and under what: ``edit`` (the edit config, ``max_drift`` cut to what the
    session's budget has left), ``batch`` (batch mode: re-edit the base on the union), ``start`` (the changed
    parameters' starting values, full name -> CPU tensor), ``train`` (the requests the loop trains: the round's own
    plus the ``rehearsed`` earlier ones, or the union), ``constraint`` (the factors the projector is built from;
    ``None`` for an editor without curvature), ``carry`` (whether the optimizer state goes on from the last round)
    and ``budget`` (the drift budget's record, ``None`` without one)."""

    edit: EditConfig
    batch: bool
    start: dict[str, Tensor]
    train: list[EditRequest]
    rehearsed: list[EditRequest]
    constraint: KFACFactors | None
    carry: bool
    budget: dict | None


def _plan_round(
    editor,
    state: SeqState,
    config: SeqConfig,
    requests: Sequence[EditRequest],
    round_index: int,
    base_weights: dict[str, Tensor],
    union: Sequence[EditRequest] | None,
    earlier: Sequence[EditRequest],
    drift_spent: float,
) -> _RoundPlan:
    """:class:`_RoundPlan` of :func:`run_round` (its arguments); one-line error for a curvature editor without
    capability factors or a spent drift budget."""
    ec = config.edit
    batch = config.mode == "batch"
    constraint = None
    if editor.needs_curvature:
        if state.cap is None:
            raise CrispEditError("this session has no capability factors")
        constraint = (
            state.cap
            if batch
            else combine_factors(state.cap, state.edits, config.weighting, config.mix, config.edit_gamma)
        )
    # EigenbasisAdam's moments live in the previous round's eigenbasis: not carried into a new basis
    carry = (
        config.carry_optimizer and ec.projection_target != "eigenbasis" and editor.carries_optimizer and not batch
    ) or (editor.carries_state and not batch)
    rehearsed = [] if batch else replayed(earlier, config.replay, ec.seed, round_index)
    ec, budget = _round_budget(ec, 0.0 if batch else float(drift_spent))
    return _RoundPlan(
        edit=ec,
        batch=batch,
        start=dict(base_weights if batch else state.weights),
        train=list(union) if batch else list(requests) + rehearsed,
        rehearsed=rehearsed,
        constraint=constraint,
        carry=carry,
        budget=budget,
    )


def _round_record(outcome: EditOutcome, plan: _RoundPlan, config: SeqConfig, drift: dict) -> dict:
    """A round's record from the loop's ``outcome`` (:class:`~crispedit.editing.editor.EditOutcome`): its training
    history, whether the optimizer state carried, each layer's kept fraction of directions (and each part's, for a
    composed projector: ``projector_parts_kept``), how many earlier edits it rehearsed (with ``replay``), the
    predicted ``drift`` (:func:`_drift_record`) and the drift budget's account."""
    record: dict = {
        "train": outcome.history.to_json(),
        "optimizer_carried": outcome.optimizer_carried,
        "projector_kept": {n: v["kept_fraction"] for n, v in outcome.projector_stats.items()},
    }
    parts = {n: [p["kept_fraction"] for p in v["parts"]] for n, v in outcome.projector_stats.items() if "parts" in v}
    if parts:  # a composed projector: its kept fraction is a bound, each part's its own
        record["projector_parts_kept"] = parts
    if config.replay:
        record["replayed"] = len(plan.rehearsed)
    record.update(drift)
    if plan.budget is not None:
        record["drift_budget"] = {
            **plan.budget,
            **(outcome.drift_budget or {}),
            "remaining": plan.edit.max_drift - (record["kl_predicted_round"] or 0.0),
        }
    return record


def _drift_record(
    modules: dict[str, nn.Module],
    cap: KFACFactors | None,
    base: dict[str, Tensor],
    start: dict[str, Tensor],
    weights: dict[str, Tensor],
) -> dict:
    """A round record's predicted drift (nats per token, from the capability factors ``cap`` on ``modules``):
    ``kl_predicted`` of the change from ``base``, ``kl_predicted_round`` of the round's own change from ``start``,
    and the layers where the change from the base is steep or mixes directions (None and empty lists without
    factors)."""
    total = predicted_kl(modules, cap, base, weights)
    own = predicted_kl(modules, cap, start, weights)
    return {
        "kl_predicted": None if total is None else total["total"],
        "kl_predicted_round": None if own is None else own["total"],
        "steep_layers": [] if total is None else steep_layers(total["layers"]),
        "mixing_layers": [] if total is None else mixing_layers(total["layers"]),
    }


def _recompute_capability(
    new: SeqState, ref: dict[str, Tensor], threshold: float, capability: Callable[[], KFACFactors] | None, record: dict
) -> None:
    """``recompute_drift``: record each trained weight's relative drift from ``ref`` (the weights the capability
    factors were last collected on) and, past ``threshold``, recollect them on the current model into ``new``."""
    drift = weight_drift(new.weights, ref)
    record["drift_since_capability"] = {n: round(v, 5) for n, v in drift.items()}
    if max(drift.values()) > threshold:
        if capability is None:
            raise CrispEditError("capability factors must be recomputed but no collector was given")
        new.cap = capability()
        new.cap_ref = {n: w.clone() for n, w in new.weights.items()}
        record["capability_recomputed"] = True


def drift_spent(rounds: Sequence[dict]) -> float:
    """The drift budget the committed ``rounds`` (their :func:`run_round` records) spent: the sum of their own
    predicted drift (``kl_predicted_round``, nats per token; rounds without a prediction spend nothing)."""
    return float(sum(r.get("kl_predicted_round") or 0.0 for r in rounds))
