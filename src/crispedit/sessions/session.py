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
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_directory, atomic_save_safetensors, atomic_write_json
from ..checks import check_finite_tensors
from ..curvature.factors import KFACFactors
from ..data.edits import EditRequest, load_edits, requests_digest, save_edits_jsonl
from ..distributed import all_agree, barrier, is_main, is_sharded, same_as_main, world_size
from ..editing.api import capability_factors, edit_factors, shard_for_edit
from ..editing.contexts import DEFAULT_CONTEXTS, pinned_contexts
from ..editing.registry import get_editor
from ..errors import CrispEditError
from ..evaluation import evaluate_edit, summarize_edit_scores
from ..layers import model_family
from ..model_card import build_card, card_may_replace, revert_lines, write_card
from ..models import load_model, save_model_dir
from ..paths import check_output_dir
from ..safetensors_io import load_safetensors
from ..versions import stamped
from ..weights import parameter, weight_fingerprint
from .files import SESSION_FILE, SESSION_FORMAT, STATE_FILE, read_session_meta, read_session_state
from .plot import plot_retention
from .sequential import SeqConfig, SeqState, drift_spent, run_round, weight_drift

__all__ = ["Session", "SESSION_FORMAT", "session_size"]

LOCK_FILE, PLOT_FILE = ".lock", "retention.png"
_TENSOR_FILE = re.compile(r"^(weights|optim|edit_factors|cap_factors|cap_ref)-(\d{4,})\.safetensors$")
_ROUND_FILE = re.compile(r"^round-(\d{4,})\.jsonl$")
_TRAINING_FILE = re.compile(r"^training-(\d{4,})-[0-9a-f]+\.safetensors$")  # a round's training checkpoint
FAULT_ENV = "CRISPEDIT_SESSION_FAULT"


def _fault(phase: str) -> None:
    """Crash-test hook: ``CRISPEDIT_SESSION_FAULT=<phase>`` kills this process with SIGKILL at ``phase``
    (after_train, after_weights, before_commit, after_commit). A no-op otherwise."""
    if os.environ.get(FAULT_ENV) == phase:
        os.kill(os.getpid(), signal.SIGKILL)


def _load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    if not path.exists():
        raise CrispEditError(f"session file {path} is missing (session damaged)")
    meta, tensors = load_safetensors(path, "session", None)
    return tensors, meta


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def session_size(path: str | Path) -> int:
    """Bytes on disk of a session directory (all files, the plot included)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


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
        with s._lock(blocking=False) as got:
            if got and is_main():
                s._cleanup()
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
        with self._lock(blocking=False) as got:
            if not got:
                raise CrispEditError(f"session {self.path} is busy: another process is adding a round")
            if is_main():
                self._cleanup()
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
                checkpoint=self._training_file(k, requests),
                base_weights=self._base,
                union=union,
                capability=lambda: self._recollect_capability(),
                progress=progress,
                drift_spent=drift_spent(st["rounds"]),
            )
            check_finite_tensors(new.weights, f"round {k}")  # never commit inf/nan weights
            _fault("after_train")
            t_eval = time.perf_counter()
            rec.update(self._evaluate(earlier + [requests], progress))
            rec["evaluate_seconds"] = round(time.perf_counter() - t_eval, 3)
            rec.update(
                {
                    "round": k,
                    "n_edits": len(requests),
                    "source": source,
                    "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                }
            )
            if world_size() > 1:
                rec.update(processes=world_size(), **({"sharded": True} if is_sharded(self._model) else {}))
            if is_main():  # every process holds the same round; rank 0 writes it
                self._commit(k, state, new, requests, st, rec)
            barrier()  # no process goes on (or reads the session) before the round is committed
            self._state, self._state_round = new, k
            if is_main():
                self._cleanup()
        if plot and is_main():
            with contextlib.suppress(Exception):  # the plot is derived; it never fails a committed round
                self.plot()
        return rec

    def _commit(
        self, k: int, old: SeqState, new: SeqState, requests: Sequence[EditRequest], st: dict, rec: dict
    ) -> None:
        """Commit round ``k`` (record ``rec``) onto the committed state ``st``: write its files, then replace
        ``state.json`` naming them — the rename is the commit (the module docstring's protocol)."""
        files = self._write_round(k, old, new, requests, st["files"])
        _fault("before_commit")
        atomic_write_json(
            self.path / STATE_FILE,
            stamped({"format": SESSION_FORMAT, "round": k, "files": files, "rounds": st["rounds"] + [rec]}),
        )
        _fsync(self.path)  # the rename itself
        _fault("after_commit")

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
            "size_bytes": session_size(self.path),
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
        ``delta`` only ``delta.safetensors`` (the change from the base, reversible: :mod:`crispedit.delta`;
        apply it with ``crispedit delta apply``). A non-empty ``out`` is refused unless ``overwrite`` and it
        holds an earlier export; then only the files that export wrote are replaced, other files kept."""
        out = Path(out)
        marker = "crispedit_session.json"
        previous = check_output_dir(out, overwrite=overwrite, marker=marker)
        st = self._read_state()
        self._ensure_model()
        self._load_state(st)
        with atomic_directory(out, previous=previous) as tmp:
            if delta:
                from ..delta import DELTA_FILE, delta_info, write_delta

                check_finite_tensors(self._state.weights, f"session {self.path}")
                last = st["rounds"][-1] if st["rounds"] else {}
                info = delta_info(
                    self.config.edit.method,
                    self.config.edit.to_json(),
                    [r for reqs in self.edits() for r in reqs],
                    last,
                    model=self.meta["base"]["spec"],
                    layers=self.meta["layers"],
                    session=self.meta["name"],
                    round=st["round"],
                    session_config=self.meta["config"],
                )
                write_delta(tmp / DELTA_FILE, self._model, self._base, info)
                files = [DELTA_FILE]
            else:
                files = save_model_dir(self._model, self._tok, tmp, progress=progress, what=f"session {self.path}")
                if card_may_replace(out, previous):
                    files.append(write_card(tmp, self._card(st)))
            atomic_write_json(
                tmp / marker,
                stamped(
                    {
                        "session": str(self.path.resolve()),
                        "name": self.meta["name"],
                        "base": self.meta["base"],
                        "round": st["round"],
                        "n_edits": sum(r["n_edits"] for r in st["rounds"]),
                        "layers": self.meta["layers"],
                        "files": sorted(files + [marker]),
                    }
                ),
            )
        return out

    def _card(self, st: dict) -> str:
        """The model card of an export at committed state ``st``: the last round's measurements (teacher-forced
        rel / gen over every edit so far, KL drift, perplexity, predicted drift); WILD is not run by sessions."""
        last = st["rounds"][-1] if st["rounds"] else {}
        summary = {k: last.get(k) for k in ("kl_drift", "kl_predicted", "ppl", "ppl_base")}
        summary.update(rel=last.get("rel_all"), gen=last.get("gen_all"))
        requests = [r.to_json() for reqs in self.edits() for r in reqs]
        report = {
            "method": self.config.edit.method,
            "config": self.meta["config"],
            "model": self.meta["base"]["spec"],
            "n_edits": len(requests),
            "requests": requests,
            "summary": summary,
            "layers": self.meta["layers"],
        }
        name = self.meta["name"]
        return build_card(
            report,
            made_by=f"`crispedit session export` of session `{name}` at round {st['round']}",
            revert=[
                "# MODEL_DIR is this folder; SESSION the session directory it was exported from",
                "crispedit session export SESSION --delta --out DELTA_DIR   # the change as a delta",
                *revert_lines("DELTA_DIR/delta.safetensors", where=None),
            ],
            note=f"Session `{name}` ({self.config.mode} mode): {st['round']} round(s) of edits applied "
            "one after another; the figures are those measured after the last round, over all "
            "edits so far.",
        )

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

    @contextlib.contextmanager
    def _lock(self, blocking: bool = True) -> Iterator[bool]:
        """Hold the session's exclusive lock (``flock`` on its lock file) for the block; yields whether it was
        taken (``blocking=False``: not when another process holds it). Under ``torchrun`` rank 0 alone takes it
        and every process is told whether it did (every process must enter the block)."""
        if not is_main():
            yield all_agree(True)
            return
        fh = open(self.path / LOCK_FILE, "a+")
        try:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                got = True
            except BlockingIOError:
                got = False
            try:
                yield all_agree(got)
            finally:
                if got:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
        finally:
            fh.close()

    def _training_file(self, k: int, requests: Sequence[EditRequest]) -> Path:
        """The checkpoint round ``k``'s training keeps beside the session (``training-NNNN-<edits>.safetensors``,
        named by the round and a digest of its edits), so that an ``add`` killed while training goes on from its
        last epoch when the same edits are added again; another round's or other edits' training files are
        deleted here, by rank 0 alone under ``torchrun`` (they cannot resume anything)."""
        path = self.path / f"training-{k:04d}-{requests_digest(requests)}.safetensors"
        for f in self.path.iterdir() if is_main() else ():
            if _TRAINING_FILE.match(f.name) and f != path:
                f.unlink(missing_ok=True)
        return path

    def _cleanup(self) -> None:
        """Delete what no committed state names: files of an interrupted round, temp files, the training
        checkpoints of committed rounds (an interrupted round's stays: :meth:`_training_file`)."""
        st = self._read_state()
        named = set(st["files"].values())
        for f in self.path.iterdir():
            if f.name.startswith(".") and (f.name.endswith(".tmp") or f.name.endswith(".old")):
                shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink(missing_ok=True)
            elif _TENSOR_FILE.match(f.name) and f.name not in named:
                f.unlink(missing_ok=True)
            elif (m := _TRAINING_FILE.match(f.name)) and int(m.group(1)) <= st["round"]:
                f.unlink(missing_ok=True)
        rdir = self.path / "rounds"
        if rdir.is_dir():
            for f in rdir.iterdir():
                m = _ROUND_FILE.match(f.name)
                if (m and int(m.group(1)) > st["round"]) or f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)

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
            files = st["files"]

            def factors(key: str) -> KFACFactors | None:
                """The :class:`KFACFactors` stored under ``files[key]``, or None if the round has no such file."""
                if key not in files:
                    return None
                t, meta = _load_tensors(self.path / files[key])
                return KFACFactors.from_tensors(t, int(meta.get("n_tokens", 0)))

            weights = _load_tensors(self.path / files["weights"])[0] if "weights" in files else dict(self._base)
            missing = [n for n in self._base if n not in weights]
            if missing:
                raise CrispEditError(f"session weights file lacks parameters {missing} (session damaged)")
            self._state = SeqState(
                weights=weights,
                cap=factors("cap_factors"),
                edits=factors("edit_factors"),
                optim=_load_tensors(self.path / files["optim"])[0] if "optim" in files else {},
                cap_ref=_load_tensors(self.path / files["cap_ref"])[0] if "cap_ref" in files else None,
            )
            self._state_round = st["round"]
        with torch.no_grad():
            for n, w in self._state.weights.items():
                parameter(self._model, n).copy_(w)
        return self._state

    def _write_round(
        self, k: int, old: SeqState, new: SeqState, requests: Sequence[EditRequest], old_files: dict
    ) -> dict:
        files: dict[str, str] = {}
        tag = f"{k:04d}"

        def save(key: str, tensors: dict, meta: dict | None = None) -> None:
            """Write ``tensors`` (with ``meta``) atomically to ``<key>-<round>.safetensors``, fsync it and
            record its name in ``files[key]``."""
            files[key] = f"{key}-{tag}.safetensors"
            atomic_save_safetensors(self.path / files[key], tensors, meta)
            _fsync(self.path / files[key])  # on disk before the commit names it (power loss, not just kill -9)

        save("weights", new.weights)
        _fault("after_weights")
        if new.optim:
            save("optim", new.optim)
        if new.edits is not None:
            save("edit_factors", new.edits.to_tensors(), {"n_tokens": str(new.edits.n_tokens)})
        if new.cap is not None:
            if new.cap is old.cap and "cap_factors" in old_files:
                files["cap_factors"] = old_files["cap_factors"]
            else:
                save("cap_factors", new.cap.to_tensors(), {"n_tokens": str(new.cap.n_tokens)})
        if new.cap_ref is not None:
            if new.cap_ref is old.cap_ref and "cap_ref" in old_files:
                files["cap_ref"] = old_files["cap_ref"]
            else:
                save("cap_ref", new.cap_ref)
        save_edits_jsonl(self.path / "rounds" / f"round-{tag}.jsonl", requests)
        return files

    def _round_requests(self, i: int) -> list[EditRequest]:
        return load_edits(self.path / "rounds" / f"round-{i:04d}.jsonl")

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
        """Teacher-forced reliability of every round's edits so far, and KL drift from the base."""
        ev = evaluate_edit(
            self._model,
            self._tok,
            [r for reqs in rounds for r in reqs],
            self._base,
            kl_text=self.config.kl_text,
            kl_texts=self.config.kl_texts,
            max_len=self.config.edit.max_len,
            progress=progress,
        )
        retention, start = {}, 0
        for j, reqs in enumerate(rounds, 1):
            s = summarize_edit_scores(ev["per_edit"][start : start + len(reqs)])
            start += len(reqs)
            retention[str(j)] = {"rel": s["rel"], "gen": s["gen"], "rel_token_acc": s["rel_token_acc"]}
        summary = ev["summary"]
        weights = {n: parameter(self._model, n).detach().cpu() for n in self._base}
        return {
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


def _diff_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _diff_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out
