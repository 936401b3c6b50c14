"""Resumable training: the projected loop's state at the end of an epoch, in one safetensors file.

A long edit (a thousand requests on a CPU) can be stopped — a closed laptop, a session's end, ``kill`` —
and started again with the same command: :func:`~crispedit.editing.loop.projected_finetune` given a
``checkpoint`` path writes, atomically, after every ``every`` epochs (and after the last): the trained
tensors, the optimizer's state, the batch-order generator, the skip counters, the history so far and the
drift budget's counters. A later run with the same path, the same config, the same requests and the same
starting weights (:func:`run_identity`) loads it and goes on from the next epoch, so the resumed run takes
exactly the steps the uninterrupted one would have (the per-epoch batch order comes from the saved
generator; ``--context-sample`` draws from the seed and the epoch number). A checkpoint of another run is
refused in one line (it is never silently overwritten); a damaged one too. A finished run's checkpoint
holds its final state, so a resume after the training but before the caller saved its results trains
nothing again. The epoch cap (``epochs``) is not part of a run's identity: it bounds the run without changing
any step before it (the learning rate has no schedule over the epochs), so a run may be resumed under a
larger cap (train longer) or a smaller one not below the epochs already trained. Every file records the crispedit
version that wrote it; another version's is refused in one line (:func:`~crispedit.versions.check_written_by`).
Tensors only, no pickle. Under ``torchrun`` (every process holds the same trained tensors) rank 0 alone writes the
file and every process resumes from it; a file some processes see and others do not is refused in one line
(:func:`agree_on_resume`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import atomic_save_safetensors
from ..distributed import all_agree, is_main
from ..errors import CrispEditError
from ..safetensors_io import load_safetensors, read_safetensors_header
from ..versions import check_written_by, stamped

if TYPE_CHECKING:  # torch is imported by the functions that need it: the header check stays torch-free
    import torch
    from torch import Tensor, nn

    from ..data.edits import EditRequest

__all__ = [
    "run_identity",
    "LoopState",
    "LoopCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "check_checkpoint_file",
    "agree_on_resume",
    "load_run_file",
    "CHECKPOINT_KIND",
    "CLOSED_FORM_KEY",
]

CHECKPOINT_KIND = "training checkpoint"
_KEY = "crispedit_checkpoint"
CLOSED_FORM_KEY = "crispedit_closed_form"  # the metadata key of a closed-form editor's batch checkpoint
_FORMAT = 3  # the file's layout (the crispedit version that wrote it is recorded beside it)
_THEN = "delete it to start over"
_BUDGET_COUNTERS = ("hits", "last", "steps")


def run_identity(
    config_json: dict,
    requests: Sequence[EditRequest],
    params: dict[str, nn.Parameter],
    opt: torch.optim.Optimizer | None = None,
) -> str:
    """Digest (32 hex) of what determines a training run: the config (its JSON, without the epoch cap
    ``epochs``), the requests' content, the trained tensors' names,
    shapes, dtypes and starting values, and the optimizer's starting state (a carried Adam state, as in a
    session's later rounds)."""
    import torch

    from .optim import optimizer_state

    config_json = {k: v for k, v in config_json.items() if k != "epochs"}
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"config": config_json, "requests": [r.to_json() for r in requests]}, sort_keys=True).encode())
    tensors = {f"param::{n}": p.detach() for n, p in params.items()}
    if opt is not None:
        tensors.update({f"opt::{k}": v for k, v in optimizer_state(opt, params).items()})
    for name in sorted(tensors):
        t = tensors[name].cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # (0-d: Adam's step)
    return h.hexdigest()


@dataclass
class LoopState:
    """The loop's counters after ``epochs`` finished epochs: ``epoch_loss`` (one mean loss per epoch,
    nats/target token), ``n_batches`` batches seen, ``skipped`` of them below the skip loss, ``converged``
    (the stop rule fired), the batch-order generator's state, the drift budget's counters, the training
    seconds spent so far and each epoch's wall seconds (``epoch_seconds``)."""

    epochs: int
    epoch_loss: list[float]
    n_batches: int
    skipped: int
    converged: bool
    generator: Tensor
    budget: dict
    seconds: float = 0.0
    epoch_seconds: list = field(default_factory=list)  # wall seconds per epoch
    sections: dict = field(default_factory=dict)  # TrainHistory.extra entries the hooks write per epoch (JSON)


def _global_rng(params: dict[str, nn.Parameter]) -> dict[str, Tensor]:
    """The global random generators' states now: the CPU's (``rng_cpu``) and, for parameters on a CUDA device,
    that device's (``rng_cuda``) — what dropout (LoRA's adapters) draws from in the epochs to come."""
    import torch

    out = {"rng_cpu": torch.get_rng_state()}
    dev = next((p.device for p in params.values() if p.device.type == "cuda"), None)
    if dev is not None:
        out["rng_cuda"] = torch.cuda.get_rng_state(dev)
    return out


def save_checkpoint(
    path: str | Path, identity: str, state: LoopState, params: dict[str, nn.Parameter], opt: torch.optim.Optimizer
) -> None:
    """Write ``state``, the trained tensors ``params`` (as they are now), ``opt``'s state and the global random
    generators' states (so that dropout goes on as it would have) to ``path`` atomically (temporary file +
    rename), tagged with ``identity`` (:func:`run_identity`)."""
    from .optim import optimizer_state

    tensors = {f"param::{n}": p.detach().cpu() for n, p in params.items()}
    tensors.update({f"opt::{k}": v for k, v in optimizer_state(opt, params).items()})
    tensors["generator"] = state.generator.cpu()
    tensors.update(_global_rng(params))
    meta = stamped(
        {
            "format": _FORMAT,
            "identity": identity,
            "epochs": state.epochs,
            "epoch_loss": state.epoch_loss,
            "n_batches": state.n_batches,
            "skipped": state.skipped,
            "converged": state.converged,
            "budget": state.budget,
            "seconds": state.seconds,
            "epoch_seconds": state.epoch_seconds,
            "sections": state.sections,
        }
    )
    atomic_save_safetensors(path, tensors, metadata={_KEY: json.dumps(meta)})


def load_checkpoint(
    path: str | Path,
    identity: str,
    params: dict[str, nn.Parameter],
    opt: torch.optim.Optimizer,
    *,
    max_epochs: int | None = None,
) -> LoopState | None:
    """Load the checkpoint at ``path`` into ``params`` (in place) and ``opt``, set the global random generators to
    their stored states, and return its counters, or ``None`` when there is no file there. ``identity`` is the
    run's :func:`run_identity`. One-line :class:`CrispEditError` for a file of another run (other config, requests,
    starting weights), one holding more than ``max_epochs`` trained epochs, one of another crispedit version or
    format, or a damaged file — ``params`` and ``opt`` untouched then."""
    import torch

    from .optim import load_optimizer_state

    stored_run = load_run_file(path, CHECKPOINT_KIND, _KEY, _FORMAT, identity)
    if stored_run is None:
        return None
    meta, tensors = stored_run
    trained = meta.get("epochs")
    if max_epochs is not None and isinstance(trained, int) and trained > max_epochs:
        raise CrispEditError(
            f"{CHECKPOINT_KIND} file {path} holds {trained} trained epochs, more than the cap of "
            f"{max_epochs} epochs; raise --epochs to at least {trained} or delete it"
        )
    try:
        stored = {n: tensors[f"param::{n}"] for n in params}
        flat = {k[len("opt::") :]: v for k, v in tensors.items() if k.startswith("opt::")}
        state = LoopState(
            int(meta["epochs"]),
            [float(x) for x in meta["epoch_loss"]],
            int(meta["n_batches"]),
            int(meta["skipped"]),
            bool(meta["converged"]),
            tensors["generator"],
            dict(meta["budget"]),
            float(meta["seconds"]),
            [float(x) for x in meta["epoch_seconds"]],
            dict(meta["sections"]),
        )
        rng_cpu = tensors["rng_cpu"]
        for n, p in params.items():
            if stored[n].shape != p.shape:
                raise KeyError(n)
    except (KeyError, TypeError, ValueError) as exc:
        raise CrispEditError(f"{CHECKPOINT_KIND} file {path} is incomplete or corrupt (missing or bad {exc})") from None
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(stored[n].to(device=p.device, dtype=p.dtype))
    opt.state.clear()
    load_optimizer_state(opt, params, flat)
    torch.set_rng_state(rng_cpu)
    dev = next((p.device for p in params.values() if p.device.type == "cuda"), None)
    if dev is not None and "rng_cuda" in tensors:
        torch.cuda.set_rng_state(tensors["rng_cuda"], dev)
    return state


def load_run_file(path: str | Path, kind: str, key: str, fmt: int, identity: str) -> tuple[dict, dict] | None:
    """``(meta, tensors)`` of a resumable run's file at ``path`` (metadata JSON under ``key``), or ``None`` when there
    is none; one-line :class:`CrispEditError` for a damaged file, another format ``fmt`` or another run's
    ``identity``, or one of another crispedit version (:func:`~crispedit.versions.check_written_by`). What the sequence
    and closed-form checkpoints share (their writers :func:`~crispedit.versions.stamped` the metadata)."""
    path = Path(path)
    if not path.exists():
        return None
    meta, tensors = load_safetensors(path, kind, key)
    check_written_by(meta, f"{kind} file {path}", _THEN, format=fmt)
    if meta.get("identity") != identity:
        raise CrispEditError(
            f"{kind} file {path} belongs to another run (other config, edits or starting weights); "
            "delete it or give another path"
        )
    return meta, tensors


def check_checkpoint_file(path: str | Path) -> None:
    """Before any work (torch-free): one-line :class:`CrispEditError` when ``path`` exists and is not a readable
    crispedit training checkpoint of this crispedit version (another kind of file, truncated, another version's).
    Whether it belongs to this run is checked when the training starts (:func:`load_checkpoint`). A closed-form
    editor's batch checkpoint (MEMIT, AlphaEdit: its own metadata key, :data:`CLOSED_FORM_KEY`) counts as one."""
    if Path(path).exists():
        raw, _ = read_safetensors_header(path, CHECKPOINT_KIND, None)
        meta, _ = read_safetensors_header(path, CHECKPOINT_KIND, CLOSED_FORM_KEY if CLOSED_FORM_KEY in raw else _KEY)
        check_written_by(meta, f"{CHECKPOINT_KIND} file {path}", _THEN)


def agree_on_resume(found: bool, path: str | Path) -> None:
    """Under ``torchrun``: one-line :class:`CrispEditError` unless every process found the checkpoint at ``path``
    or none did (a path the processes do not share would have them train on from different states). Every process
    must call it; nothing in a single process."""
    if not (all_agree(found) or all_agree(not found)):
        raise CrispEditError(
            f"{CHECKPOINT_KIND} file {path} is seen by some of torchrun's processes and not by "
            "others; give a path on a file system every process shares"
        )


def budget_counters(budget) -> dict:
    """The drift budget's counters to checkpoint (``{}`` without a budget)."""
    return {} if budget is None else {k: getattr(budget, k) for k in _BUDGET_COUNTERS if hasattr(budget, k)}


def restore_budget_counters(budget, counters: dict) -> None:
    """Put checkpointed counters back into the drift budget (nothing without one)."""
    if budget is not None:
        for k, v in counters.items():
            setattr(budget, k, type(getattr(budget, k))(v))


class LoopCheckpoint:
    """The projected loop's checkpoint file, or none (``path`` ``None``: every method does nothing). Built before
    the training starts: the run's :func:`run_identity` is taken from ``config_json``, ``requests``, the starting
    ``params`` and ``opt``. :meth:`resume` loads a stored state of this run into ``params``, ``opt`` and the drift
    ``budget``; :meth:`save_if_due` writes one every ``every`` epochs after the start and after the last."""

    def __init__(
        self,
        path: str | Path | None,
        every: int,
        config_json: dict,
        requests: Sequence[EditRequest],
        params: dict[str, nn.Parameter],
        opt: torch.optim.Optimizer,
        budget=None,
    ):
        self.path, self.every, self.params, self.opt, self.budget = path, every, params, opt, budget
        self.identity = None if path is None else run_identity(config_json, requests, params, opt)
        self.max_epochs = config_json.get("epochs")

    def resume(self) -> LoopState | None:
        """The stored state of this run (its tensors and the budget's counters already put back), or ``None``
        when there is no checkpoint to go on from."""
        if self.path is None:
            return None
        state = load_checkpoint(self.path, self.identity, self.params, self.opt, max_epochs=self.max_epochs)
        agree_on_resume(state is not None, self.path)
        if state is not None:
            restore_budget_counters(self.budget, state.budget)
        return state

    def save_if_due(self, state: LoopState, start: int, final: bool) -> None:
        """Write ``state`` (its ``budget`` taken from the drift budget now) when ``final`` (converged or the last
        epoch) or when ``every`` epochs have passed since ``start``, the epoch this call began at; rank 0 alone under
        ``torchrun``."""
        if self.path is not None and is_main() and (final or (state.epochs - start) % self.every == 0):
            state.budget = budget_counters(self.budget)
            save_checkpoint(self.path, self.identity, state, self.params, self.opt)
