"""Durable sequential editing sessions (CrispEdit-Seq and its baselines) that survive crashes.

A session directory holds only what the rounds change — the values of the parameters the editor
declares it changes (:meth:`Editor.changes`; for LoRA-Seq the merged q/v projections), the Adam state,
the capability and accumulated edit K-FAC factors of those layers — plus the applied edit log and
JSON metadata; never the whole model. Layout::

    session.json                  immutable: format, base model (spec, fingerprint, dtype), layers, config
    state.json                    THE commit point: committed round, the files it names, per-round records
    weights-NNNN.safetensors      changed parameters (full names) after round NNNN
    optim-NNNN.safetensors        Adam state after round NNNN (sequential modes)
    edit_factors-NNNN.safetensors accumulated edit K-FAC factors after round NNNN (crispedit-seq)
    cap_factors-NNNN.safetensors  capability K-FAC factors (collected at init = 0000, or recollected)
    cap_ref-NNNN.safetensors      weights the recollected capability factors belong to (drift option)
    rounds/round-NNNN.jsonl       the edits applied in round NNNN (crispedit JSONL schema)
    training-NNNN-<edits>.safetensors  round NNNN's training checkpoint while it runs (removed at the commit)
    retention.png                 reliability of every round's edits over time + KL drift (derived)

Commit protocol for round ``k``: train; evaluate; write round ``k``'s files under new names (each
through a temporary file + rename); then atomically replace ``state.json`` naming them — that rename
is the commit; finally delete the files of round ``k-1`` that are no longer named. A crash (kill -9
included) at any point leaves ``state.json`` at round ``k-1`` with all its files intact; the next
``add`` (under an exclusive ``flock``) first deletes orphans — files not named by ``state.json``, temp
files, edit logs past the committed round — and redoes round ``k`` from the stored state, its training going
on from the last epoch its checkpoint holds when the same edits are added again. Every round is deterministic
given (stored state, edits, config), so the resumed session ends exactly where an uninterrupted one would.

Opening a session checks the base model's weight fingerprint and, when a configuration is given, that
it equals the stored one; either mismatch is refused with a one-line :class:`CrispEditError`.
``session.json`` also records what ``--contexts default`` meant at creation (``default_contexts``): a
session keeps training those contexts when :data:`DEFAULT_CONTEXTS` changes, so its rounds stay reproducible.
``session.json`` and ``state.json`` record the crispedit version that wrote them; a session of another version is
refused in one line (:func:`~crispedit.versions.check_written_by`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_directory, atomic_save_safetensors, atomic_write_json
from ..checks import check_finite_tensors
from ..curvature.factors import KFACFactors
from ..data.edits import EditRequest
from ..distributed import barrier, is_main, is_sharded, same_as_main, world_size
from ..editing.api import capability_factors, edit_factors, restore, shard_for_edit
from ..editing.contexts import DEFAULT_CONTEXTS, pinned_contexts
from ..editing.registry import get_editor
from ..errors import CrispEditError
from ..evaluation import summarize_edit_scores
from ..layers import model_family
from ..models import load_model
from ..paths import check_output_dir
from ..pipeline import EditJob, Measures
from ..versions import environment, stamped
from ..weights import parameter, weight_fingerprint
from . import store
from .files import SESSION_FILE, SESSION_FORMAT, STATE_FILE, read_session_meta, read_session_state
from .plot import plot_retention
from .sequential import SeqConfig, SeqState, drift_spent, run_round, weight_drift

__all__ = ["Session", "SESSION_FORMAT", "checked_earlier"]

PLOT_FILE = "retention.png"


class Session:
    """A durable sequential editing session. Create with :meth:`create`, reopen with :meth:`open`.

    >>> s = Session.create("sess", "smollm2", SeqConfig())          # doctest: +SKIP
    >>> s.add(load_edits("round1.json")); s.status(); s.export("edited-model")   # doctest: +SKIP
    """

    def __init__(
        self,
        path: Path,
        meta: dict,
        *,
        model_arg: Any = None,
        device: str | None = None,
        cache_root: str | Path | None = None,
        shard: bool = False,
    ):
        self.path = Path(path)
        self._shard = shard
        self.meta = meta
        self.config = SeqConfig.from_dict(meta["config"])
        self._model_arg = model_arg
        self._device = device
        self._cache_root = cache_root
        self._model = self._tok = None
        self._layers: dict = {}
        self._base: dict[str, torch.Tensor] = {}
        self._state: SeqState | None = None
        self._state_round = -1

    # -- creation / opening ---------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        path: str | Path,
        model: Any = "smollm2",
        config: SeqConfig | None = None,
        *,
        dtype: str = "float32",
        device: str | None = None,
        cache_root: str | Path | None = None,
        cache_file: str | Path | None = None,
        progress: bool | None = None,
    ) -> Session:
        """Create a session on base ``model`` (a spec for :func:`load_model` or a ``(model, tokenizer)``
        pair). An existing session is opened instead if it has the same base and configuration, and
        refused otherwise."""
        path = Path(path)
        config = (config or SeqConfig()).validate()
        if (path / SESSION_FILE).is_file():
            return cls.open(path, config=config, model=model, device=device, cache_root=cache_root)
        check_output_dir(path, "session directory")
        if path.exists() and any(path.iterdir()):
            raise CrispEditError(f"{path} exists and is not a crispedit session; refusing to overwrite")
        spec = "<in-memory>" if isinstance(model, tuple) else str(model)
        m, tok = load_model(model, dtype=None if isinstance(model, tuple) else dtype, device=device, progress=progress)
        fp = weight_fingerprint(m)
        config = replace(config, edit=config.edit.for_family(model_family(m)))  # the session stores the lr it trains
        layers = get_editor(config.edit.method).select_layers(m, config.edit)
        meta = stamped(
            {
                "format": SESSION_FORMAT,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "name": config.name,
                "base": {
                    "spec": spec,
                    "fingerprint": fp,
                    "dtype": str(next(m.parameters()).dtype).replace("torch.", ""),
                    "model_type": getattr(getattr(m, "config", None), "model_type", type(m).__name__),
                },
                "layers": list(layers),
                "config": config.to_json(),
                "default_contexts": DEFAULT_CONTEXTS,
            }
        )
        files: dict[str, str] = {}
        with atomic_directory(path) as tmp:
            # a curvature method's constraint, or the factors a drift budget / penalty of ft, lora, ... is measured with
            cap, info = edit_factors(
                m,
                tok,
                get_editor(config.edit.method),
                layers,
                config.edit,
                cache_root=cache_root,
                cache_file=cache_file,
                progress=progress,
                fingerprint=fp,
            )
            if cap is not None:
                files["cap_factors"] = "cap_factors-0000.safetensors"
                atomic_save_safetensors(
                    tmp / files["cap_factors"],
                    cap.to_tensors(),
                    {"n_tokens": str(cap.n_tokens), "source": json.dumps(info)},
                )
            atomic_write_json(tmp / SESSION_FILE, meta)
            atomic_write_json(
                tmp / STATE_FILE, stamped({"format": SESSION_FORMAT, "round": 0, "files": files, "rounds": []})
            )
        s = cls(path, meta, model_arg=model, device=device, cache_root=cache_root)
        s._adopt_model(m, tok)
        return s

    @classmethod
    def open(
        cls,
        path: str | Path,
        *,
        config: SeqConfig | None = None,
        model: Any = None,
        device: str | None = None,
        cache_root: str | Path | None = None,
        shard: bool = False,
    ) -> Session:
        """Open an existing session. ``config`` (if given) must equal the stored one; ``model`` (a spec
        or a ``(model, tokenizer)`` pair; default: the stored spec) must have the stored fingerprint.

        Under ``torchrun`` every process opens it (rank 0 alone cleans up and, in :meth:`add`, writes). ``shard``
        (a spec, not a pair): the model, loaded on the host, has its decoder blocks split across the processes onto
        ``device`` (:func:`~crispedit.editing.shard_for_edit`; the edited weights stay whole), as ``edit --shard``
        does."""
        path = Path(path)
        meta = read_session_meta(path)
        if config is not None:
            stored = SeqConfig.from_dict(meta["config"]).identity()
            config = config.validate()
            config = replace(config, edit=config.edit.for_family(meta["base"].get("model_type")))  # as create() did
            given = config.identity()
            diff = sorted(_diff_keys(stored, given))
            if diff:
                raise CrispEditError(
                    f"session {path} was created with a different configuration ({', '.join(diff)}); "
                    "start a new session for new settings"
                )
        if model is None and meta["base"]["spec"] == "<in-memory>":
            model = None  # must be given before add/export
        s = cls(path, meta, model_arg=model, device=device, cache_root=cache_root, shard=shard)
        if model is not None and not isinstance(model, tuple) and str(model) != meta["base"]["spec"]:
            s._ensure_model()  # an explicit other location: check it now
        elif isinstance(model, tuple):
            s._ensure_model()
        s._read_state()  # a damaged state.json is named before anything (the lock file included) is written
        with store.session_lock(s.path, blocking=False) as got:
            if got and is_main():
                store.remove_uncommitted(s.path)
        barrier()  # no process reads the session while rank 0 cleans it up
        return s

    # -- public API ------------------------------------------------------------------------------
    @property
    def round(self) -> int:
        """The last committed round (0 before the first ``add``)."""
        return int(self._read_state()["round"])

    def add(
        self,
        requests: Sequence[EditRequest],
        *,
        source: str | None = None,
        progress: bool | None = None,
        plot: bool = True,
    ) -> dict:
        """Apply one round of edits, evaluate retention and drift, and commit. Returns the round record.
        ``plot`` also rewrites ``retention.png`` (derived; a plotting failure never fails the round).

        Under ``torchrun`` every process calls it and runs the round — the batches, the edit factors' collection
        (summed over the processes) and the evaluation split across them — from the committed state rank 0 reads;
        rank 0 alone writes the round, and no process returns before it is committed. The record then says
        ``processes``, and ``sharded`` on a split model (:meth:`open`'s ``shard``)."""
        requests = list(requests)
        if not requests:
            raise CrispEditError("no edit requests given")
        with store.session_lock(self.path, blocking=False) as got:
            if not got:
                raise CrispEditError(f"session {self.path} is busy: another process is adding a round")
            if is_main():
                store.remove_uncommitted(self.path)
            barrier()  # the other processes read the session once rank 0 has cleaned it up
            st = self._read_committed()
            self._ensure_model()
            state = self._load_state(st)
            k = st["round"] + 1
            earlier = [self._round_requests(i) for i in range(1, k)]
            union = [r for rs in earlier for r in rs] + requests
            new, rec = run_round(
                self._model,
                self._tok,
                self._layers,
                requests,
                state,
                self.config,
                k,
                checkpoint=store.training_file(self.path, k, requests),
                base_weights=self._base,
                union=union,
                earlier=union[: -len(requests)],
                capability=lambda: self._recollect_capability(),
                progress=progress,
                drift_spent=drift_spent(st["rounds"]),
            )
            check_finite_tensors(new.weights, f"round {k}")  # never commit inf/nan weights
            store.fault("after_train")
            t_eval = time.perf_counter()
            rec.update(self._evaluate(earlier + [requests], progress))
            rec["evaluate_seconds"] = round(time.perf_counter() - t_eval, 3)
            rec.update(
                {
                    "round": k,
                    "n_edits": len(requests),
                    "source": source,
                    "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "environment": environment(),  # each round is its own process: which code and machine ran it
                }
            )
            if world_size() > 1:
                rec.update(processes=world_size(), **({"sharded": True} if is_sharded(self._model) else {}))
            if is_main():  # every process holds the same round; rank 0 writes it
                store.commit_round(self.path, k, state, new, requests, st, rec)
            barrier()  # no process goes on (or reads the session) before the round is committed
            self._state, self._state_round = new, k
            if is_main():
                store.remove_uncommitted(self.path)
        if plot and is_main():
            with contextlib.suppress(Exception):  # the plot is derived; it never fails a committed round
                self.plot()
        return rec

    def status(self) -> dict:
        """Rounds, edit counts, per-round metrics and the retention matrix (no model needed)."""
        st = self._read_state()
        rounds = st["rounds"]
        retention = [[r["retention"].get(str(j), {}).get("rel") for j in range(1, len(rounds) + 1)] for r in rounds]
        out = {
            "path": str(self.path),
            "name": self.meta["name"],
            "base": self.meta["base"],
            "layers": self.meta["layers"],
            "config": self.meta["config"],
            "round": st["round"],
            "n_edits": sum(r["n_edits"] for r in rounds),
            "files": st["files"],
            "size_bytes": store.session_size(self.path),
            "retention": retention,
            "rounds": rounds,
        }
        budget = self.config.edit.max_drift
        if budget is not None:
            spent = 0.0 if self.config.mode == "batch" else drift_spent(rounds)
            out["drift_budget"] = {
                "budget": budget,
                "spent": spent,
                "remaining": budget - spent,
                "mode": "per re-edit" if self.config.mode == "batch" else "whole session",
            }
        return out

    def export(
        self, out: str | Path, *, overwrite: bool = False, progress: bool | None = None, delta: bool = False
    ) -> Path:
        """Write the edited model (base + session weights) as a loadable Hugging Face directory, or with
        ``delta`` only ``delta.safetensors`` (:func:`~crispedit.sessions.export.export_session`); returns ``out``."""
        from .export import export_session

        return export_session(self, out, overwrite=overwrite, progress=progress, delta=delta)

    def model_at_commit(self) -> tuple[Any, Any, dict]:
        """``(model, tokenizer, state)``: the base model (loaded, and its fingerprint checked, on first use) with the
        committed round's weights in it, its tokenizer, and the committed state (``state.json``: ``round``,
        ``files``, ``rounds``)."""
        st = self._read_state()
        self._ensure_model()
        self._load_state(st)
        return self._model, self._tok, st

    @property
    def base_weights(self) -> dict[str, torch.Tensor]:
        """The base values of the parameters the rounds change (full name -> CPU tensor; empty before the model is
        loaded)."""
        return self._base

    def plot(self, out: str | Path | None = None) -> Path:
        """Write the retention / KL-drift PNG (default ``retention.png`` in the session); returns its path."""
        return plot_retention([self.status()], out or self.path / PLOT_FILE)

    def edits(self) -> list[list[EditRequest]]:
        """The applied edit log, one list per committed round."""
        return [self._round_requests(i) for i in range(1, self.round + 1)]

    # -- internals -----------------------------------------------------------------------------
    def _read_state(self) -> dict:
        return read_session_state(self.path)

    def _read_committed(self) -> dict:
        """The committed state, read by every process (under ``torchrun``); one-line error unless every process
        read rank 0's (a file system that shows the processes different session files)."""
        st = self._read_state()
        digest = int(hashlib.sha256(json.dumps(st, sort_keys=True).encode()).hexdigest()[:15], 16)
        if not same_as_main(digest):
            raise CrispEditError(
                f"session {self.path}: torchrun's processes read different committed states; put "
                "the session on a file system every process shares"
            )
        return st

    def _adopt_model(self, model, tok) -> None:
        self._model, self._tok = model, tok
        default = self.meta["default_contexts"]
        if self.config.edit.contexts.strip() == "default" and default != DEFAULT_CONTEXTS:
            self.config.edit.contexts = pinned_contexts("default", tok, default)  # the session's own 'default'
        editor = get_editor(self.config.edit.method)
        self._layers = editor.select_layers(model, self.config.edit)
        if list(self._layers) != self.meta["layers"]:
            raise CrispEditError(f"layers {list(self._layers)} differ from the session's {self.meta['layers']}")
        # what the rounds change (and the session stores): the editor's declared parameters, on CPU
        self._base = {
            n: p.detach().cpu().clone() for n, p in editor.changes(model, self._layers, self.config.edit).items()
        }

    def _ensure_model(self) -> None:
        if self._model is not None:
            return
        base = self.meta["base"]
        arg = self._model_arg if self._model_arg is not None else base["spec"]
        if arg == "<in-memory>":
            raise CrispEditError(
                f"session {self.path} was created on an in-memory model; pass the base model to open it"
            )
        shard = self._shard and not isinstance(arg, tuple)
        model, tok = load_model(
            arg, dtype=None if isinstance(arg, tuple) else base["dtype"], device=None if shard else self._device
        )  # split: loaded on the host first
        # the fingerprint of the whole model, taken before any split
        fp = shard_for_edit(model, self.config.edit, self._device) if shard else weight_fingerprint(model)
        if base["fingerprint"] != fp:
            shown = "the given model" if isinstance(arg, tuple) else repr(str(arg))
            raise CrispEditError(
                f"session {self.path} was created on base {base['spec']!r} (fingerprint "
                f"{base['fingerprint'][:12]}…); "
                f"{shown} has fingerprint {fp[:12]}… — refusing to mix bases"
            )
        self._adopt_model(model, tok)

    def _load_state(self, st: dict) -> SeqState:
        """The committed state as tensors; also puts the committed weights into the model."""
        if self._state is None or self._state_round != st["round"]:
            self._state = store.read_round_state(self.path, st, self._base)
            self._state_round = st["round"]
        restore(self._model, self._state.weights)
        return self._state

    def _round_requests(self, i: int) -> list[EditRequest]:
        return store.round_requests(self.path, i)

    def _recollect_capability(self) -> KFACFactors:
        factors, _ = capability_factors(
            self._model,
            self._tok,
            self._layers,
            self.config.edit,
            cache_root=self._cache_root,
            progress=False,
            kind=get_editor(self.config.edit.method).curvature_kind,
        )
        return factors

    def _evaluate(self, rounds: list[list[EditRequest]], progress: bool | None) -> dict:
        """Teacher-forced reliability of the round's edits and of the earlier rounds' (all of them, or past
        ``check_earlier`` an evenly spaced sample: :func:`checked_earlier`), per round, and KL drift from the base
        (the job layer's measures, without free generation). A round none of whose edits were checked gets no
        retention entry; ``rel_all`` is over the edits checked, which the record counts (``checked_edits``) when
        they are a sample."""
        measures = Measures(wild=(), assistant=False, kl_text=self.config.kl_text, kl_texts=self.config.kl_texts)
        owner = [j for j, reqs in enumerate(rounds, 1) for _ in reqs]  # the round of every edit so far
        union = [r for reqs in rounds for r in reqs]
        picked = checked_earlier(len(union) - len(rounds[-1]), self.config.check_earlier)
        picked += range(len(union) - len(rounds[-1]), len(union))  # the round's own edits, every one
        checked = [union[i] for i in picked]
        ev = EditJob(self._model, self._tok, checked, self.config.edit, measures, progress).evaluate(self._base)
        by_round: dict[int, list] = {}
        for i, score in zip(picked, ev["per_edit"]):
            by_round.setdefault(owner[i], []).append(score)
        retention = {}
        for j, scores in by_round.items():
            s = summarize_edit_scores(scores)
            retention[str(j)] = {"rel": s["rel"], "gen": s["gen"], "rel_token_acc": s["rel_token_acc"]}
        summary = ev["summary"]
        weights = {n: parameter(self._model, n).detach().cpu() for n in self._base}
        sampled = {"checked_edits": len(checked)} if len(checked) < len(union) else {}
        return {
            **sampled,
            "rel": retention[str(len(rounds))]["rel"],
            "gen": retention[str(len(rounds))]["gen"],
            "rel_all": summary["rel"],
            "gen_all": summary["gen"],
            "retention": retention,
            "kl_drift": summary["kl_drift"],
            "ppl": summary["ppl"],
            "ppl_base": summary["ppl_base"],
            "weight_drift": {n: round(v, 6) for n, v in weight_drift(weights, self._base).items()},
        }


def checked_earlier(n_earlier: int, cap: int) -> list[int]:
    """Which of a session's ``n_earlier`` earlier edits (stream order) a round checks: all of them, or past ``cap``
    every ``ceil(n_earlier / cap)``-th from the first — at most ``cap``, spread over every round, the same edits for
    every round while the count per stride holds."""
    stride = max(1, -(-n_earlier // max(cap, 1)))
    return list(range(0, n_earlier, stride))


def _diff_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out
