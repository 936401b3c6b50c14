"""The playground's model side: one loaded model, its capability curvature fetched once, and a stack of
reversible edits, each one request at a time.

:class:`Playground` holds the model and answers the page's three actions:

* :meth:`~Playground.ask` — the model's answer to a question through its chat template
  (:func:`crispedit.demo.chat_answers`, the demo's before/after answers);
* :meth:`~Playground.edit` — one fact edited in with :func:`crispedit.editing.api.edit` on the factors
  fetched at start-up (so an edit only trains), then measured with
  :func:`crispedit.evaluation.edit_eval.evaluate_edit`: the answer under the ``qa`` evaluation wrapper
  (the paper's, never trained) with the rule judge, and the KL drift from the model as it was at start-up
  on held-out text, beside the drift the factors predict;
* :meth:`~Playground.undo` — the last edit taken out bit for bit through its delta
  (:func:`crispedit.delta.build_delta` / :func:`crispedit.delta.revert_delta_tensors`, fingerprint-checked).

One lock serialises them: a request that arrives while another holds the model fails at once with
:class:`PlaygroundBusy` instead of waiting. Bad text (not a string, empty, longer than ``max_chars``) is
refused before the lock is taken; an edit that fails (or leaves non-finite weights) is rolled back, so a
refused or failed request leaves the weights as they were. Torch is imported when a playground is built,
not when this module is.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checks import check_positive_int
from ..errors import CrispEditError

__all__ = ["Playground", "PlaygroundBusy", "check_text", "DEFAULT_MAX_CHARS", "DEFAULT_KL_TEXTS", "DEFAULT_UNDO_DEPTH"]

DEFAULT_MAX_CHARS = 300  # per question and per answer
DEFAULT_KL_TEXTS = 8  # held-out paragraphs the drift is measured on after each edit
DEFAULT_UNDO_DEPTH = 32  # deltas kept for undo (SmolLM2's default layers: about 18 MB each)
STYLE_PROMPTS = 8  # unrelated prompts whose answers are compared with the start-up model's after each edit


class PlaygroundBusy(CrispEditError):
    """Another request holds the model (an edit is training): this one was refused, not queued."""


def check_text(what: str, value: Any, max_chars: int) -> str:
    """``value`` stripped, once it is a non-empty string of at most ``max_chars`` characters, all of them text
    (no lone surrogate, which valid JSON can carry and no tokenizer takes); one-line :class:`CrispEditError`
    naming ``what`` otherwise."""
    if not isinstance(value, str):
        raise CrispEditError(f"the {what} must be text, got {'nothing' if value is None else type(value).__name__}")
    text = value.strip()
    if not text:
        raise CrispEditError(f"the {what} is empty")
    if len(text) > max_chars:
        raise CrispEditError(f"the {what} is {len(text)} characters long; the playground takes at most {max_chars}")
    bad = next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)
    if bad is not None:
        raise CrispEditError(f"the {what} holds a lone surrogate (character {bad + 1}), which is not text")
    return text


@dataclass
class _Applied:
    """One edit on the stack: what was asked, and its delta while it can still be undone."""

    question: str
    answer: str
    delta: tuple | None  # (tensors, header) of build_delta; None once it fell off the undo depth


LR_FACTOR = 2.0  # the playground's default learning rate over the library's (per model family)


def playground_config(config, family: str | None):
    """The :class:`~crispedit.editing.config.EditConfig` an edit in the playground runs with, validated for the
    model family ``family``: ``config`` (default: crispedit's defaults with ``precision="auto"``: a bfloat16
    training forward where the hardware has it natively); when its
    learning rate was left unset, :data:`LR_FACTOR` times the method's default for that family (the family
    scaling, e.g. Gemma-3's, kept), so an edit takes fewer epochs. An lr the user gave is kept."""
    from ..editing.config import EditConfig

    config = config or EditConfig(precision="auto")
    config = config.validate()
    scaled = config.for_family(family)
    return scaled if config.lr is not None else replace(scaled, lr=float(f"{scaled.lr * LR_FACTOR:.6g}"))


class Playground:
    """A model to ask and edit. ``config``: the :class:`~crispedit.editing.config.EditConfig` every edit runs with
    (default: :func:`playground_config` — crispedit's defaults with a bfloat16 training forward where the hardware
    has it natively and twice the learning rate, for an edit in under a minute on a CPU); its capability factors are
    fetched here, once, from ``cache_file``, from the
    content-addressed cache under ``cache_root`` or collected (:func:`~crispedit.editing.api.edit_factors`).
    ``kl_text`` / ``kl_texts``: the held-out text the drift is measured on (default: bundled WikiText);
    ``max_chars``: the longest question or answer taken; ``undo_depth``: how many of the latest edits keep
    their delta; ``name``: the model as the page shows it."""

    def __init__(
        self,
        model,
        tokenizer,
        config=None,
        *,
        cache_file: str | Path | None = None,
        cache_root: str | Path | None = None,
        kl_text: str | Path | None = None,
        kl_texts: int = DEFAULT_KL_TEXTS,
        max_chars: int = DEFAULT_MAX_CHARS,
        undo_depth: int = DEFAULT_UNDO_DEPTH,
        max_new_tokens: int = 24,
        name: str = "model",
        progress: bool | None = False,
    ) -> None:
        from ..editing.api import edit_factors, snapshot
        from ..editing.registry import get_editor
        from ..layers import model_family

        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.config = playground_config(config, model_family(model))
        self.kl_text, self.kl_texts = kl_text, check_positive_int("--kl-texts", kl_texts)
        self.max_chars = check_positive_int("--max-chars", max_chars)
        self.undo_depth = check_positive_int("--undo-depth", undo_depth)
        self.max_new_tokens = check_positive_int("max new tokens", max_new_tokens)
        editor = get_editor(self.config.method)
        self.layers = editor.select_layers(model, self.config)
        t0 = time.perf_counter()
        self.factors, info = edit_factors(
            model,
            tokenizer,
            editor,
            self.layers,
            self.config,
            cache_root=cache_root,
            cache_file=cache_file,
            progress=progress,
        )
        self.cache = {"path": info.get("path"), "hit": info.get("hit"), "seconds": round(time.perf_counter() - t0, 3)}
        self.drift_modules = editor.drift_modules(model, self.layers, self.config)
        self.params = editor.changes(model, self.layers, self.config)
        self.start_weights = snapshot(self.params)  # the model at start-up: what the drift is measured from
        from ..evaluation.assistant import base_style_answers, style_prompts

        self.style_prompts = style_prompts(STYLE_PROMPTS)
        self.style_base = base_style_answers(model, tokenizer, self.style_prompts)  # asked once, at start-up
        self.edits: list[_Applied] = []
        self._lock = threading.Lock()
        self._running: tuple[str, float] | None = None

    @property
    def via(self) -> str:
        """How :meth:`ask` puts a question: ``"chat template"`` or ``"bare question"`` (no template)."""
        return "chat template" if getattr(self.tokenizer, "chat_template", None) else "bare question"

    @contextlib.contextmanager
    def _hold(self, what: str) -> Iterator[None]:
        """The model for one request (``what``: ``"an edit"``, ...); :class:`PlaygroundBusy` if another holds it."""
        if not self._lock.acquire(blocking=False):
            running = self._running
            doing = (
                f"{running[0]} is running ({time.monotonic() - running[1]:.0f} s so far)"
                if running
                else "another request is running"
            )
            raise PlaygroundBusy(f"busy: {doing}; one request at a time — try again when it has finished")
        self._running = (what, time.monotonic())
        try:
            yield
        finally:
            self._running = None
            self._lock.release()

    def _answer(self, question: str) -> str:
        from ..demo import chat_answers

        return chat_answers(self.model, self.tokenizer, [question], self.max_new_tokens)[0]

    def ask(self, question: Any) -> dict:
        """``{"question", "answer", "seconds"}``: the model's greedy answer to ``question`` through its chat
        template (bare without one)."""
        question = check_text("question", question, self.max_chars)
        with self._hold("a question"):
            t0 = time.perf_counter()
            answer = self._answer(question)
        return {"question": question, "answer": answer, "seconds": round(time.perf_counter() - t0, 3)}

    def edit(self, question: Any, answer: Any, subject: Any = None) -> dict:
        """Edit ``answer`` in as the answer to ``question`` and measure it (:meth:`_edit` documents the result);
        ``subject`` (optional: what the question is about) adds the subject-bleed check. The weights are as
        before when it raises."""
        question = check_text("question", question, self.max_chars)
        answer = check_text("new answer", answer, self.max_chars)
        subject = (
            None
            if subject is None or (isinstance(subject, str) and not subject.strip())
            else check_text("subject", subject, self.max_chars)
        )
        with self._hold("an edit"):
            return self._edit(question, answer, subject)

    def _edit(self, question: str, target: str, subject: str | None = None) -> dict:
        """Train, check, keep the delta, measure; any failure puts the weights back before it propagates.
        Returns the new ``answer``, ``wild_qa`` (``prompt``, ``answer``, ``correct``, ``judge``), ``tf_rel``,
        ``drift`` (``measured`` and ``predicted`` nats/token from the start-up model, ``edit_predicted`` of this
        edit alone, ``ppl`` / ``ppl_base``, ``texts``), ``style`` (:func:`~crispedit.evaluation.assistant.style_drift`
        on :data:`STYLE_PROMPTS` unrelated prompts against the start-up model), ``bleed`` (with a ``subject``:
        :func:`~crispedit.evaluation.assistant.subject_bleed` of this edit; else None), ``edit_seconds`` (training),
        ``eval_seconds``,
        ``seconds`` (all), ``epochs``, ``loss`` and the new :meth:`state`."""
        from ..curvature.predicted import predicted_kl
        from ..data.edits import EditRequest
        from ..delta import build_delta
        from ..editing.api import restore
        from ..evaluation.assistant import style_drift, subject_bleed
        from ..evaluation.wild import HELD_OUT_WRAPPER, render_prompt
        from ..pipeline import EditJob, Measures

        t0 = time.perf_counter()
        request = EditRequest(prompt=question, target=target, subject=subject)
        measures = Measures(wild=(HELD_OUT_WRAPPER,), assistant=False, kl_text=self.kl_text, kl_texts=self.kl_texts)
        job = EditJob(self.model, self.tokenizer, [request], self.config, measures, progress=False)
        result = None
        try:
            result = job.edit(factors=self.factors)  # a failed edit puts the weights back itself
            delta = build_delta(self.model, result.original_weights, {"question": question, "answer": target})
            t1 = time.perf_counter()
            ev = job.evaluate(self.start_weights)  # drift from the start-up model
            answer = self._answer(question)
            style = style_drift(
                self.model,
                self.tokenizer,
                self.start_weights,
                self.style_prompts,
                examples=1,
                base_answers=self.style_base,
            )
            bleed = subject_bleed(self.model, self.tokenizer, [request], result.original_weights, examples=1)
        except CrispEditError as exc:
            if result is not None:
                restore(self.model, result.original_weights)
            raise CrispEditError(f"{exc} (the edit was rolled back; the model is as before)") from None
        except BaseException:
            if result is not None:
                restore(self.model, result.original_weights)
            raise
        self.edits.append(_Applied(question, target, delta))
        for old in self.edits[: -self.undo_depth]:
            old.delta = None
        s, qa = ev["summary"], ev["wild"][HELD_OUT_WRAPPER]
        total = predicted_kl(self.drift_modules, self.factors, self.start_weights)
        mine = result.kl_predicted
        return {
            "question": question,
            "target": target,
            "answer": answer,
            "wild_qa": {
                "prompt": render_prompt(self.tokenizer, question, HELD_OUT_WRAPPER),
                "answer": qa["examples"][0]["answer"],
                "correct": bool(qa["rel"]),
                "judge": ev["wild"]["judge"],
            },
            "tf_rel": s["rel"],
            "drift": {
                "measured": s["kl_drift"],
                "predicted": None if total is None else total["total"],
                "edit_predicted": None if mine is None else mine["total"],
                "ppl": s["ppl"],
                "ppl_base": s["ppl_base"],
                "texts": self.kl_texts,
            },
            "style": style,
            "bleed": bleed,
            "edit_seconds": round(result.edit_seconds, 3),
            "eval_seconds": round(time.perf_counter() - t1, 3),
            "seconds": round(time.perf_counter() - t0, 3),
            "epochs": len(result.history.epoch_loss),
            "loss": result.history.epoch_loss[-1] if result.history.epoch_loss else None,
            "state": self.state(),
        }

    def undo(self) -> dict:
        """Take the last edit out, bit for bit (its delta, checked against the model's fingerprint). Returns
        ``{"undone": {"question", "answer"}, "answer"}`` (the model's answer to that question now) and the new
        :meth:`state`; a one-line error when there is nothing (left) to undo."""
        from ..delta import revert_delta_tensors

        with self._hold("an undo"):
            if not self.edits:
                raise CrispEditError("nothing to undo: no edit has been made since start-up (or all were undone)")
            last = self.edits[-1]
            if last.delta is None:
                raise CrispEditError(
                    f"the {len(self.edits)} edit(s) left are older than the undo depth "
                    f"({self.undo_depth}); they can no longer be undone"
                )
            revert_delta_tensors(self.model, *last.delta, source=f"undo of edit {len(self.edits)}")
            self.edits.pop()
            answer = self._answer(last.question)
        return {"undone": {"question": last.question, "answer": last.answer}, "answer": answer, "state": self.state()}

    def state(self) -> dict:
        """What the page shows besides the results: the model, method, γ, edit layers, the curvature source
        (path, cache hit, seconds), the limits, whether a request is running, and the applied edits (oldest
        first, each with ``undoable``)."""
        running = self._running
        return {
            "model": self.name,
            "method": self.config.method,
            "gamma": self.config.gamma,
            "layers": list(self.layers),
            "via": self.via,
            "curvature": self.cache,
            "max_chars": self.max_chars,
            "undo_depth": self.undo_depth,
            "busy": running[0] if running else None,
            "edits": [
                {"question": e.question, "answer": e.answer, "undoable": e.delta is not None} for e in self.edits
            ],
        }
