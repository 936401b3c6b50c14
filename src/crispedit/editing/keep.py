"""Keeping the assistant's own answers while an edit trains: a preservation term of the edit loss.

The capability curvature keeps what its corpus exercises; an edit's training contexts still teach "question →
target" in forms (a bare prompt, a lead-in, a chat turn) that carry over to questions the edit never asked:
the edited model starts answering everything in a bare phrase, and questions about an edited subject start
naming the new target. The preservation term holds those answers in place. Before training, the unedited
model answers, greedily through its chat template, at most ``keep_tokens`` tokens each
(:data:`KEEP_TOKENS` by default):

* the first ``keep_chat`` of the bundled everyday prompts (:func:`~crispedit.data.corpus.chat_prompts`,
  disjoint from the style-drift prompts the evaluation asks);
* the first ``keep_subject`` of :data:`SUBJECT_KEEPS` about the subject of every edit (at most
  :data:`KEEP_SUBJECTS` edits, spread evenly over the edit set) — questions that ask no particular relation,
  worded apart from the evaluation's subject probes. An answer that names the edit's old or new answer is left
  out: there, changing is the edit's job.

Every training step then adds ``keep_weight ×`` the mean, over the answer tokens of one batch of the everyday
answers and one of the subject answers (each kind's batches taken in turn), of ``max(0, NLL_now − NLL_before)``.
A step's share is as many transcripts as an edit batch holds sequences on average (at most :data:`KEEP_BATCH`),
so that a small edit's steps — one fact's few contexts — are not mostly the term's; it is split between the two
kinds in proportion to their counts, each at least one, and the subject answers are topped up to at least half of
it (:func:`kept_rows`; a step may then hold a few more): one edit's four subject questions beside the everyday
prompts are then held at every step, not once in a cycle through all the transcripts — with few edits, each trains
for many steps and would otherwise carry its new answer into every question about its subject. The hinge per token
is zero while no answer token has become less likely than the unedited model made it, so the term costs nothing
the edit does not disturb and pulls back exactly the tokens it does. The gradient joins the edit loss's before the
projection. The stop and skip rules read the edit loss alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..data.corpus import SUBJECT_KEEPS
from ..data.edits import EditRequest
from ..data.tokenize import chat_turn, split_context_target
from .contexts import TrainingSequence
from .hooks import LoopHook
from .sources import training_batches
from .written import own_chat_answers

if TYPE_CHECKING:  # the module top stays torch-free
    from torch import Tensor, nn

__all__ = [
    "KEEP_TOKENS",
    "KEEP_SUBJECTS",
    "KEEP_BATCH",
    "KEEP_KINDS",
    "kept_rows",
    "keep_prompts",
    "keep_sequences",
    "KeepLoss",
    "KeepTerm",
    "keep_term",
]

KEEP_TOKENS = 24  # tokens of each unedited answer kept by default: its form shows in the first few
KEEP_SUBJECTS = 128  # edits whose subject is asked about, at most (evenly spread over a larger edit set)
KEEP_BATCH = 8  # transcripts per training step at most: a small batch, so the term adds little to a step
KEEP_KINDS = ("keep-chat", "keep-subject")  # the context kinds of the everyday and the subject transcripts


def kept_rows(n_chat: int, n_subject: int, per_step: int) -> tuple[int, int]:
    """Transcripts a training step holds of the everyday answers and of the subject answers, of ``n_chat`` and
    ``n_subject`` kept: ``per_step`` shared in proportion to the counts (what one mixed cycle gives on average),
    each kind present at least one, the subject answers at least half of ``per_step`` (rounded up) — never more
    than a kind has."""
    if n_chat <= 0 or n_subject <= 0:
        return min(per_step, max(n_chat, 0)), min(per_step, max(n_subject, 0))
    share = n_subject / (n_chat + n_subject)
    subject = max(-(-per_step // 2), round(per_step * share))
    chat = max(1, round(per_step * (1.0 - share)))
    return min(chat, n_chat), min(subject, n_subject)


def keep_prompts(requests: Sequence[EditRequest], keep_chat: int, keep_subject: int) -> list[tuple[int, str]]:
    """``(request index or -1, prompt)`` of every prompt whose unedited answer is kept: the first ``keep_chat``
    bundled chat prompts (index -1), then the first ``keep_subject`` of :data:`SUBJECT_KEEPS` for the subjects of
    at most :data:`KEEP_SUBJECTS` edits that name one, evenly spaced over ``requests``."""
    from ..data.corpus import chat_prompts

    out = [(-1, p) for p in (chat_prompts(keep_chat) if keep_chat else [])]
    named = [i for i, r in enumerate(requests) if r.subject and r.subject.strip()]
    if keep_subject and named:
        step = max(len(named) / KEEP_SUBJECTS, 1.0)
        chosen = sorted({named[int(k * step)] for k in range(min(len(named), KEEP_SUBJECTS))})
        out += [
            (i, t.replace("{subject}", requests[i].subject.strip()))
            for i in chosen
            for t in SUBJECT_KEEPS[:keep_subject]
        ]
    return out


def keep_sequences(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    keep_chat: int,
    keep_subject: int,
    max_tokens: int = KEEP_TOKENS,
) -> list[TrainingSequence]:
    """The transcripts whose answer tokens the preservation term holds (:func:`keep_prompts`, answered greedily by
    ``model`` — pass it unedited; under :func:`~.written.prefixes_from` the unedited weights are put in while it
    writes — through its chat template, or the bare prompt without one; at most ``max_tokens`` tokens each):
    context kind ``"keep-chat"`` (an everyday prompt, request 0 by convention) or ``"keep-subject"`` (a question
    about request ``i``'s subject), the prompt as context and the answer as target. The everyday prompts' answers are
    written apart from the subject questions' and cached by the weights that wrote them (:mod:`.written`), so
    later edits of the same model read them back. Subject answers that name their edit's old or new answer
    (:func:`~crispedit.evaluation.judges.mentions`) and empty answers are left out."""
    from ..evaluation.judges import mentions
    from ..weights import with_weights
    from .written import cached_writing, writing_weights

    asked = keep_prompts(requests, keep_chat, keep_subject)
    if not asked:
        return []
    chat = [p for i, p in asked if i < 0]
    subject = [p for i, p in asked if i >= 0]
    with with_weights(model, writing_weights()):
        shown, answers, templated = own_chat_answers(model, tokenizer, subject, max_tokens, "answers to keep")

        def write() -> list[str]:
            """The everyday prompts' answers, written now."""
            return own_chat_answers(model, tokenizer, chat, max_tokens, "answers to keep")[1]

        kept = cached_writing(model, tokenizer, "keep-chat", {"max_tokens": max_tokens}, chat, write)
    shown = [chat_turn(tokenizer, p, None) if templated else p for p in chat] + shown
    out = []
    for (i, _), ctx, answer in zip(asked, shown, kept + answers):
        answer = answer.rstrip()
        if not answer.strip():
            continue
        if i >= 0 and any(g and mentions(answer, g) for g in (requests[i].target, requests[i].ground_truth)):
            continue
        full = ctx + answer if templated else f"{ctx} {answer.lstrip()}"
        ids, n = split_context_target(tokenizer, ctx, full, add_special_tokens=not templated)
        out.append(TrainingSequence(KEEP_KINDS[i >= 0], max(i, 0), ids, n, full))
    return out


class KeepLoss:
    """The preservation term over ``sequences`` (:func:`keep_sequences`): each kind's transcripts (everyday,
    subject) in batches by length of :func:`kept_rows` of ``batch_size`` — the transcripts a step holds. ``term(step)``
    is ``weight ×`` the mean, over the answer tokens of each kind's batch ``step mod`` (its number of batches), of
    ``max(0, NLL − NLL at construction)`` — a 0-d tensor (nats/token) with a gradient for the trained ``params``.
    Construct it with the weights the edit starts from. Every process computes the whole term (under ``--shard``
    every process must run the same forwards); the loop divides it by the number of processes before their
    gradients are summed."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        sequences: Sequence[TrainingSequence],
        params: dict[str, nn.Parameter],
        weight: float,
        *,
        batch_size: int = KEEP_BATCH,
        fast: bool = True,
        device=None,
    ):
        import torch

        from .fastpath import make_loss_fn

        device = device or next(model.parameters()).device
        self.weight = float(weight)
        kinds = [[s for s in sequences if s.context == kind] for kind in KEEP_KINDS]
        self.rows = kept_rows(len(kinds[0]), len(kinds[1]), int(batch_size))
        self.batch_size = sum(self.rows)  # transcripts a step holds
        self.batches, self.cycles = [], []  # every batch; per kind, the indices of its batches in turn
        for seqs, rows in zip(kinds, self.rows):
            if seqs:
                kind = training_batches(tokenizer, seqs, rows, by_length=True)
                self.cycles.append(range(len(self.batches), len(self.batches) + len(kind)))
                self.batches += [b.to(device) for b in kind]
        # batches of equal lengths (sorted by length) have no padding: masked anyway, so no step reads back; the
        # hinge compares each token with itself at construction, so the terms may come in the packed order
        self.loss_fn = make_loss_fn(
            model, params, self.batches, enabled=fast, per_token=True, mask_unpadded=True, ordered=False
        )
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                self.before = [self.loss_fn(j).detach() for j in range(len(self.batches))]
        finally:
            model.train(was_training)

    def __len__(self) -> int:
        """Steps until every batch has been taken once (the longer kind's cycle)."""
        return max((len(c) for c in self.cycles), default=0)

    def tokens(self) -> int:
        """Answer tokens over all batches (one pass)."""
        return sum(int(b.numel()) for b in self.before)

    def __call__(self, step: int) -> Tensor | None:
        import torch

        if not self.batches:
            return None
        held = [cycle[step % len(cycle)] for cycle in self.cycles]
        return self.weight * torch.cat([torch.relu(self.loss_fn(j) - self.before[j]) for j in held]).mean()


class KeepTerm(LoopHook):
    """The preservation term as the projected loop adds it: :meth:`add` puts training step ``step``'s term
    (:class:`KeepLoss`, under the training ``arithmetic()``) onto the edit loss, divided by the number of
    ``processes`` (every process computes it whole; their gradients are summed); as a loop hook it hands the
    epoch's mean term to the epoch's one read (:meth:`epoch_value`) and reports it (:meth:`end_epoch`)."""

    section = "keep"

    def __init__(self, keep: KeepLoss, arithmetic, processes: int = 1):
        self.keep, self.arithmetic, self.processes = keep, arithmetic, processes
        self.terms: list[Tensor] = []  # this epoch's terms, on the device (read with the epoch's loss)

    def add(self, loss: Tensor | None, step: int) -> Tensor | None:
        """``loss`` (``None``: this process holds no row of the batch) plus the term of training step ``step``."""
        with self.arithmetic():
            term = self.keep(step)
        if term is None:
            return loss
        self.terms.append(term.detach())
        term = term / self.processes
        return term if loss is None else loss + term

    def epoch_value(self) -> Tensor | None:
        """The mean term of this epoch's steps, a 0-d float64 on the device (``None`` for an epoch without a step);
        the next epoch starts a new mean."""
        import torch

        terms, self.terms = self.terms, []
        return torch.stack([t.double() for t in terms]).mean() if terms else None

    def end_epoch(self, epochs: int, hist, loss: float, value: float | None = None) -> None:
        """Once per epoch: the mean term ``value`` (nats/token, read with the loss; 0 for an epoch without a step)
        appended to ``hist.extra["keep"]`` (a :class:`~.history.TrainHistory`'s), with the transcripts and answer
        tokens it holds and the transcripts a step takes."""
        if "keep" not in hist.extra:
            hist.extra["keep"] = {
                "transcripts": sum(b.input_ids.shape[0] for b in self.keep.batches),
                "per_step": self.keep.batch_size,
                "tokens": self.keep.tokens(),
                "weight": self.keep.weight,
                "epoch_term": [],
            }
        hist.extra["keep"]["epoch_term"].append(round(0.0 if value is None else value, 6))


def keep_term(
    model: nn.Module,
    tokenizer,
    requests: Sequence[EditRequest],
    params: dict[str, nn.Parameter],
    config,
    *,
    fast: bool,
    device,
    arithmetic,
    processes: int,
    split: bool,
    per_step: int = KEEP_BATCH,
) -> KeepTerm | None:
    """The preservation term of an edit under ``config`` (``keep_chat`` / ``keep_subject``; ``None`` when both are
    0), from ``model``'s starting weights, ``per_step`` transcripts a step (at most :data:`KEEP_BATCH`: pass the
    edit batches' mean size); its loss takes the fast path as the edit batches do (not on a model ``split`` across
    the processes)."""
    if not (config.keep_chat or config.keep_subject):
        return None
    kept = keep_sequences(model, tokenizer, requests, config.keep_chat, config.keep_subject, config.keep_tokens)
    return KeepTerm(
        KeepLoss(
            model,
            tokenizer,
            kept,
            params,
            config.keep_weight,
            batch_size=max(1, min(KEEP_BATCH, per_step)),
            fast=fast and not split,
            device=device,
        ),
        arithmetic,
        processes,
    )
