"""A whole sequence of rounds in memory: one edit set cut into consecutive chunks, each a :func:`~.sequential.run_round`
from the state the one before left — what a session does one ``add`` at a time, without per-round evaluation or
session files — resumable from a checkpoint file after every round (``crispedit compare``'s ``<method>-seq``
rows).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from ..atomic import atomic_save_safetensors
from ..checks import check_positive_int
from ..curvature.factors import KFACFactors
from ..curvature.predicted import predicted_kl
from ..data.edits import EditRequest
from ..editing.api import restore
from ..editing.checkpoint import load_run_file, run_identity
from ..errors import CrispEditError
from ..versions import environment, stamped
from .sequential import SeqConfig, SeqState, drift_spent, run_round

__all__ = ["SeqResult", "run_sequence", "save_sequence_checkpoint", "load_sequence_checkpoint", "SEQ_CHECKPOINT_KIND"]


# ---------------------------------------------------------------------------------------------
# a sequence's checkpoint

SEQ_CHECKPOINT_KIND = "sequence checkpoint"
_SEQ_KEY = "crispedit_sequence"
_SEQ_FORMAT = 1


def save_sequence_checkpoint(
    path: str | Path, identity: str, state: SeqState, records: Sequence[dict], seconds: float
) -> None:
    """Write, atomically, a sequence's progress after its last finished round to ``path`` (safetensors): the
    :class:`SeqState` (:meth:`SeqState.to_tensors`), the rounds' records, the seconds spent so far and the run's
    ``identity`` (:func:`~crispedit.editing.checkpoint.run_identity` of the sequence's configuration, chunk,
    requests and starting weights)."""
    tensors, state_meta = state.to_tensors()
    meta = stamped(
        {
            "format": _SEQ_FORMAT,
            "identity": identity,
            "rounds": list(records),
            "seconds": float(seconds),
            "state": state_meta,
        }
    )
    atomic_save_safetensors(path, tensors, metadata={_SEQ_KEY: json.dumps(meta)})


def load_sequence_checkpoint(path: str | Path, identity: str) -> tuple[SeqState, list[dict], float] | None:
    """``(state, records, seconds)`` stored at ``path`` by :func:`save_sequence_checkpoint` for the run with
    ``identity``, or ``None`` when there is no file. One-line :class:`CrispEditError` for a file of another run,
    another crispedit version or format, or a damaged file."""
    stored = load_run_file(path, SEQ_CHECKPOINT_KIND, _SEQ_KEY, _SEQ_FORMAT, identity)
    if stored is None:
        return None
    meta, tensors = stored
    try:
        state = SeqState.from_tensors(tensors, dict(meta["state"]))
        records = [dict(r) for r in meta["rounds"]]
        seconds = float(meta["seconds"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CrispEditError(
            f"{SEQ_CHECKPOINT_KIND} file {path} is incomplete or corrupt (missing or bad {exc})"
        ) from None
    return state, records, seconds


# ---------------------------------------------------------------------------------------------
# a whole sequence in memory


@dataclass
class SeqResult:
    """What :func:`run_sequence` did. Named like :class:`~crispedit.editing.api.EditResult` where they
    agree: ``layers`` (edit layer names), ``original_weights`` (pre-edit values of every parameter the
    editor changes, full name -> tensor on the model's device: undo with
    :func:`~crispedit.editing.api.restore`), ``edit_seconds`` (all rounds, wall), ``cache_seconds`` /
    ``cache_info`` (fetching the capability statistics), ``kl_predicted`` (K-FAC predicted per-token KL
    drift of the final change from the base, nats; ``None`` without K-FAC factors for the changed weights),
    ``drift_budget`` (the last round's, with ``max_drift``). Plus ``chunk`` (edits per round), ``rounds``
    (one :func:`run_round` record per round, with ``round``, ``n_edits`` and ``edit_seconds``) and the final
    :class:`SeqState`."""

    layers: list[str]
    chunk: int
    rounds: list[dict]
    original_weights: dict[str, Tensor]
    edit_seconds: float
    cache_seconds: float
    cache_info: dict
    kl_predicted: dict | None
    state: SeqState
    drift_budget: dict | None = None

    @property
    def round_seconds(self) -> list[float]:
        """Wall seconds of each round (training, plus the edit-factor collection of crispedit-seq; a round resumed
        from its loop checkpoint adds the killed run's training seconds)."""
        return [r["edit_seconds"] for r in self.rounds]


class _Progress:
    """Where a sequence keeps its progress: the sequence checkpoint ``path`` (:func:`save_sequence_checkpoint`) for
    the run with ``identity``, and beside it the round in progress's loop checkpoint
    (``<stem>.round.safetensors``). ``path=None``: nothing is kept (every method does nothing)."""

    def __init__(self, path: str | Path | None, config: SeqConfig, chunk: int, requests, base: dict[str, Tensor]):
        self.path = None if path is None else Path(path)
        self.round = None
        self.identity = ""
        if self.path is not None:
            self.round = self.path.with_name(self.path.name.removesuffix(".safetensors") + ".round.safetensors")
            self.identity = run_identity({"sequence": config.to_json(), "chunk": chunk}, requests, base)

    def resume(self, model: nn.Module, base: dict[str, Tensor]) -> tuple[SeqState, list[dict], float] | None:
        """The stored ``(state, records, seconds)``, checked against the sequence's parameters ``base``, with the
        state's weights put into ``model``; ``None`` without a file."""
        stored = None if self.path is None else load_sequence_checkpoint(self.path, self.identity)
        if stored is not None:
            state = stored[0]
            if set(state.weights) != set(base) or any(state.weights[n].shape != t.shape for n, t in base.items()):
                raise CrispEditError(
                    f"{SEQ_CHECKPOINT_KIND} file {self.path} is incomplete or corrupt (its weights are "
                    "not this sequence's parameters)"
                )
            restore(model, state.weights)
        return stored

    def save(self, state: SeqState, records: Sequence[dict], seconds: float) -> None:
        """Keep the finished rounds (the round in progress's loop checkpoint is then spent)."""
        if self.path is not None:
            save_sequence_checkpoint(self.path, self.identity, state, records, seconds)
            self.round.unlink(missing_ok=True)


def run_sequence(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    config: SeqConfig,
    chunk: int,
    *,
    factors: KFACFactors | None = None,
    cache_root=None,
    cache_file=None,
    progress: bool | None = None,
    predict_drift: bool = False,
    on_round: Callable[[dict, int], None] | None = None,
    after_round: Callable[[nn.Module, int], dict] | None = None,
    checkpoint: str | Path | None = None,
) -> SeqResult:
    """Edit ``model`` in place in ``ceil(len(requests) / chunk)`` sequential rounds: round ``k`` is
    :func:`run_round` on requests ``[(k-1)·chunk, k·chunk)`` from the state the previous round left (what a
    session does one ``add`` at a time, here in memory, without per-round evaluation or files).
    ``config.mode`` must be ``"sequential"``. The capability statistics (``factors``, or fetched like
    :func:`~crispedit.editing.api.edit` does, ``predict_drift`` included) are the rounds' constraint and
    the drift model. The model is left edited; ``result.original_weights`` undoes it. ``on_round(record,
    n_rounds)`` is called after every round (progress reports); ``after_round(model, k)``, before it, measures
    the model as round ``k`` left it (e.g. how many of the first round's edits still hold), stored in the round's record
    under ``after_round``.

    ``checkpoint``: a file that holds, after every round, the state and the records so far
    (:func:`save_sequence_checkpoint`); a run with the same file, configuration, chunk, requests and starting
    weights goes on after the last stored round, and the round in progress goes on from its last epoch (its loop
    checkpoints beside it, ``<stem>.round.safetensors``), so the resumed sequence is the uninterrupted one.
    ``edit_seconds`` then counts the earlier runs' seconds too. The caller removes the file once it has kept the
    result."""
    from ..editing.api import capability_factors, prepare, snapshot

    config = config.validate()
    if config.mode != "sequential":
        raise CrispEditError(f"run_sequence runs sequential rounds; session mode {config.mode!r} is not supported")
    chunk = check_positive_int("edits per round (--seq-chunk)", chunk)
    requests = list(requests)
    ec, editor, layers, changed, factors, info = prepare(
        model,
        tokenizer,
        requests,
        config.edit,
        factors=factors,
        cache_root=cache_root,
        cache_file=cache_file,
        progress=progress,
        predict_drift=predict_drift,
    )
    original = snapshot(changed)
    base = {n: p.detach().cpu().clone() for n, p in changed.items()}
    kept = _Progress(checkpoint, config, chunk, requests, base)
    state, records, earlier = kept.resume(model, base) or (SeqState(weights=dict(base), cap=factors), [], 0.0)

    def capability() -> KFACFactors:  # recompute_drift: recollect on the current (edited) model
        """Capability curvature factors collected afresh on the model's current (edited) weights."""
        return capability_factors(
            model, tokenizer, layers, ec, cache_root=cache_root, progress=False, kind=editor.curvature_kind
        )[0]

    t0 = time.perf_counter()
    n_rounds = -(-len(requests) // chunk)
    for k, start in enumerate(range(0, len(requests), chunk), 1):
        if k <= len(records):  # stored by an earlier run
            continue
        part = requests[start : start + chunk]
        state, rec = run_round(
            model,
            tokenizer,
            layers,
            part,
            state,
            config,
            k,
            base_weights=base,
            earlier=requests[:start],
            capability=capability,
            progress=progress,
            drift_spent=drift_spent(records),
            checkpoint=kept.round,
        )
        rec.update(round=k, n_edits=len(part), environment=environment())  # rounds resumed elsewhere differ
        earlier += float(rec["train"].get("resumed_seconds", 0.0))  # the killed run's part of this round
        if after_round is not None:
            rec["after_round"] = after_round(model, k)
        records.append(rec)
        kept.save(state, records, earlier + time.perf_counter() - t0)
        if on_round is not None:
            on_round(rec, n_rounds)
    return SeqResult(
        list(layers),
        chunk,
        records,
        original,
        earlier + time.perf_counter() - t0,
        float(info.get("seconds", 0.0)),
        info,
        predicted_kl(editor.drift_modules(model, layers, ec), factors, original),
        state,
        records[-1].get("drift_budget"),
    )
