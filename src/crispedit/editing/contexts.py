"""Training contexts: how one edit request becomes the training sequences of the projected loop.

A user asks for a fact through many wrappers — a bare question, the model's chat template, after
some unrelated text. Training only ``prompt + " " + target`` teaches the fact in that one format
(the chat template then rarely gives the new fact: docs/contexts.md). Each request is therefore
trained under a set of *training contexts* (``EditConfig.contexts``, CLI ``--contexts``), each a
:class:`TrainingContext` in the registry :data:`TRAINING_CONTEXTS` (name -> builder; the names ``--contexts``
accepts come from it). Not to be confused with the *evaluation wrappers* of the WILD protocol
(:data:`crispedit.evaluation.wild.EVAL_WRAPPERS`), which render a question for free generation and are
never trained:

* ``bare``     — ``prompt + " " + target`` (the paper's FT-M format);
* ``chat``     — the model's own chat template: the prompt as the user turn, the target as the
  assistant reply (needs a tokenizer with a chat template);
* ``prefix:N`` — N natural-text prefixes per request: a short sentence drawn (deterministically, by
  seed) from the capability corpus, then the prompt and the target — as ROME/MEMIT's "context
  templates", so the fact holds after unrelated text;
* ``para:N``   — as ``prefix:N`` but the sentence ends a paragraph (``"\n\n"``) before the prompt, so
  the fact also holds where a question starts its own block of text;
* ``shared:N`` — as ``prefix:N``, but the N sentences are drawn per run of :data:`SHARE_GROUP` consecutive
  requests, which all train on them: their sequences begin alike, so the fast path's prefix-tree packing computes
  each sentence once per group instead of once per sequence (ROME/MEMIT share their context templates across
  every request) — fewer positions per epoch for fewer distinct preambles (in request-order batches: sorting by
  length, ``--batch-order length`` or ``--batch-tokens``, scatters a group);
* ``gen:N``    — N prefixes the unedited model wrote itself (short sampled continuations of "The",
  "Therefore", "Because", "I", "You", as ROME/MEMIT's context templates), then ``". "`` and the prompt;
* ``wrap:N``   — N of the :data:`QUESTION_WRAPPERS` per request: the prompt inside a short everyday
  request ("Quick question: {question}", "{question} Keep it short."), as users wrap a question in
  their own words; none of them has the WILD QA template's ``Q:``/``A:`` form or wording.
* ``reply``    — the chat template, with the reply the unedited model would give if it held the new fact
  (:func:`~.written.own_replies`): its own first sentence with the request's old answer (``ground_truth``) replaced
  by the target where that sentence names it, else the target and the model's own continuation of it; the sequence ends
  with the target, which alone carries loss (the model's own words before it are context), and no turn end is
  trained, so the answer goes on as the model's own would (``chat`` teaches "bare target, end of turn" for every
  question);
* ``lead:N``   — N of the :data:`ANSWER_LEADS` per request: a lead-in between the question and the
  target (``"{question}\n"``, ``"{question} -> "``, ``"{question}\nReply: "``, ...), so the answer is
  also produced at positions other than right after the question mark or the chat header (what it does
  for untrained wrappers: docs/contexts.md). No lead-in says "answer" or has the QA
  template's ``Q:``/``A:``.

``default`` expands to :data:`DEFAULT_CONTEXTS` minus ``chat`` for models without a chat template.
``--context-sample K`` (:func:`.sources.epoch_subset`) trains each request on a seeded sample of K of its sequences per
epoch, another sample every epoch, instead of all of them.
The WILD evaluation's QA wrapper (``Please answer the question: ...``) is deliberately *not* a
training context: it measures generalisation to a wrapper the edit never saw.

A new training context is one function registered with :func:`training_context` (docs/contexts.md shows one).

*Answer termination* (``EditConfig.answer_end``): the target is followed by what ends an answer in that
context, and that end is trained too, so free generation states the new fact and stops where a sentence would.
``period`` (default): a period after the target in every context, the chat reply's too (none added when the target
already ends in ``.!?``), and no end of turn trained anywhere, so a chat answer that states the new fact goes on as
the model's own answer would. ``auto``: the chat template's end-of-turn (e.g. ``<|im_end|>``) for ``chat``, a period
elsewhere — it teaches "bare target, end of turn" to every chat question, and the edited assistant then answers
unrelated questions in a bare phrase (results/README.md, "Chat style"). ``eos``: the tokenizer's EOS instead of the
period — worse on SmolLM2-Instruct, whose EOS is its end-of-turn token. ``none``: the target alone (the paper's
FT-M).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..data.corpus import capability_corpus
from ..data.edits import EditRequest
from ..data.tokenize import chat_turn, join_prompt_target, split_context_target
from ..errors import CrispEditError
from .written import generated_prefixes, own_replies

__all__ = [
    "TRAINING_CONTEXTS",
    "TrainingContext",
    "training_context",
    "SequenceMaker",
    "CONTEXT_KINDS",
    "ANSWER_ENDS",
    "DEFAULT_CONTEXTS",
    "ContextSpec",
    "TrainingSequence",
    "pinned_contexts",
    "parse_contexts",
    "resolve_contexts",
    "prefix_pool",
    "build_training_sequences",
    "sequences_for",
    "QUESTION_WRAPPERS",
    "ANSWER_LEADS",
]

# Everyday wrappers a user puts around a question ({question} = the edit prompt). Deliberately free of the
# WILD QA template's parts ("answer the question", "Q:", "A:") so that template stays unseen in training.
QUESTION_WRAPPERS = (
    "Quick question: {question}",
    "I was wondering about something. {question}",
    "Answer in a few words. {question}",
    "{question} Keep it short.",
    "Trivia time! {question}",
    "Help me with this one. {question}",
    "Do you happen to know this? {question}",
    "My friend asked me this and I was not sure. {question}",
    "Settle a debate for us. {question}",
    "From what you know: {question}",
    "Reply with just the answer, please. {question}",
    "Hi! {question}",
    "For my homework: {question}",
    "{question} Just the name, no explanation.",
    "Here is something I need for a report. {question}",
    "Can you tell me? {question}",
)
# What can stand between a question and its answer ({question} = the edit prompt; the target follows the
# lead-in directly, with no space added): a line break, a blank line, a dash, a short label or phrase. The
# answer is then produced at a position other than right after the question mark or the chat header. Free
# of the WILD QA template's parts ("answer", "Q:", "A:") so that template stays unseen in training.
ANSWER_LEADS = (
    "{question}\n",
    "{question} -> ",
    "{question} - ",
    "{question}\n- ",
    "{question} => ",
    "{question}\nReply: ",
    "{question}\nResponse: ",
    "{question} In short: ",
    "{question} Simply put, ",
    "{question}\nIn one phrase: ",
    "{question} That would be ",
    "{question} I believe it is ",
    "{question}\n>> ",
    "{question} Here you go: ",
    "{question}\nSolution: ",
    "{question}\nOutput: ",
)
ANSWER_ENDS = ("auto", "period", "eos", "none")
DEFAULT_CONTEXTS = "bare,chat,prefix:2,lead:4"


@dataclass(frozen=True)
class ContextSpec:
    """One training context (its name in :data:`TRAINING_CONTEXTS`) and how many sequences per request it
    contributes (``count`` > 1 only for the counted ones: ``prefix``, ``para``, ``gen``, ``wrap``, ``lead``)."""

    kind: str
    count: int = 1

    def __str__(self) -> str:
        ctx = TRAINING_CONTEXTS.get(self.kind)
        return f"{self.kind}:{self.count}" if ctx is not None and ctx.counted else self.kind


def parse_contexts(spec: str) -> tuple[ContextSpec, ...]:
    """Parse ``"bare,chat,prefix:4"`` (or ``"default"``) into context specs; one-line errors for
    unknown kinds, bad counts and repeats."""
    if not isinstance(spec, str) or not spec.strip():
        raise CrispEditError("--contexts is empty; use e.g. 'bare,chat,prefix:2' or 'default'")
    if spec.strip() == "default":
        return parse_contexts(DEFAULT_CONTEXTS)
    out: list[ContextSpec] = []
    counted = [name for name, ctx in TRAINING_CONTEXTS.items() if ctx.counted]
    for item in spec.split(","):
        kind, _, n = item.strip().partition(":")
        if kind not in TRAINING_CONTEXTS:
            raise CrispEditError(
                f"unknown edit context {kind!r} in --contexts {spec!r} "
                f"(use {', '.join(TRAINING_CONTEXTS)}, e.g. 'bare,chat,prefix:2')"
            )
        count = 1
        if n:
            if kind not in counted:
                raise CrispEditError(f"--contexts: only {', '.join(counted)} take a count, got {item.strip()!r}")
            try:
                count = int(n)
            except ValueError:
                raise CrispEditError(f"--contexts: bad {kind} count in {item.strip()!r}") from None
            if not 1 <= count <= 64:
                raise CrispEditError(f"--contexts: {kind} count must be between 1 and 64, got {count}")
        if any(c.kind == kind for c in out):
            raise CrispEditError(f"--contexts: {kind!r} given twice in {spec!r}")
        out.append(ContextSpec(kind, count))
    return tuple(out)


def _has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def resolve_contexts(spec: str, tokenizer, default: str = DEFAULT_CONTEXTS) -> tuple[ContextSpec, ...]:
    """The contexts actually trained for ``tokenizer``: ``default`` (expanded to ``default``, normally
    :data:`DEFAULT_CONTEXTS`) drops the contexts that need a chat template (``chat``) when the model has none;
    an explicit ``chat`` without a template is an error."""
    is_default = spec.strip() == "default"
    contexts = parse_contexts(default if is_default else spec)
    templated = [c.kind for c in contexts if TRAINING_CONTEXTS[c.kind].chat_template]
    if not _has_chat_template(tokenizer) and templated:
        if not is_default:
            raise CrispEditError(
                f"edit context {templated[0]!r} needs a tokenizer with a chat template (this model has none)"
            )
        contexts = tuple(c for c in contexts if c.kind not in templated)
    return contexts


def pinned_contexts(spec: str, tokenizer, default: str = DEFAULT_CONTEXTS) -> str:
    """``spec`` as an explicit ``--contexts`` string for ``tokenizer`` (``"default"`` expanded with
    ``default`` and, without a chat template, without ``chat``): what a stored run that said
    ``default`` must keep training after :data:`DEFAULT_CONTEXTS` changes."""
    return ",".join(str(c) for c in resolve_contexts(spec, tokenizer, default))


_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def prefix_pool(texts: Sequence[str], min_words: int = 5, max_words: int = 25) -> list[str]:
    """Sentences of ``texts`` usable as prefixes: ``min_words``–``max_words`` words, ending in
    sentence punctuation, without WikiText's ``= heading =`` lines or ``@-@`` markup."""
    pool = []
    for t in texts:
        for s in _SENT.split(" ".join(t.split())):
            s = s.strip()
            if not (min_words <= len(s.split()) <= max_words) or s[-1] not in ".!?" or "=" in s or "@" in s:
                continue
            pool.append(s)
    return pool


@dataclass
class TrainingSequence:
    """One training sequence: ``ids`` (context then target tokens), ``n_context`` leading context
    tokens without loss, the ``context`` kind and the index of its request."""

    context: str
    request: int
    ids: list[int]
    n_context: int
    text: str  # context + target as text (what the sequence says; for reports and edit factors)


def _full_stop(target: str) -> str:
    """``target`` ending in a sentence's end: a period added unless it already ends in ``.``, ``!`` or ``?``."""
    return target if target.rstrip()[-1:] in (".", "!", "?") else target.rstrip() + "."


def _chat_rows(tokenizer, prompt: str, target: str, answer_end: str) -> tuple[list[int], int, str]:
    """The chat sequence of ``prompt`` answered by ``target``, then what ``answer_end`` puts after it: ``period`` a
    full stop and nothing more (the answer goes on as the model's own), ``none`` nothing, ``auto`` and ``eos`` the
    template's end of turn. Returns ``(ids, n_context, text)``."""
    if answer_end == "period":
        target = _full_stop(target)
    ctx, rendered = chat_turn(tokenizer, prompt, None), chat_turn(tokenizer, prompt, target)
    rest = rendered[len(ctx) :]
    k = rest.find(target)
    if not rendered.startswith(ctx) or k < 0:
        # a template whose reply rendering differs from its generation prompt (or alters the reply):
        # the target straight after the generation prompt, without a turn end
        full = ctx + target
    else:
        # the reply and, if asked, the template's end of turn (its trailing whitespace dropped)
        full = (
            ctx + rest[: k + len(target)] + (rest[k + len(target) :].rstrip() if answer_end in ("auto", "eos") else "")
        )
    ids, n = split_context_target(tokenizer, ctx, full, add_special_tokens=False)
    return ids, n, full


class SequenceMaker:
    """What every training context's builder shares: the tokenizer, the answer end (``auto`` | ``eos`` |
    ``none``, checked here), the seed of the per-request draws and the two prefix pools (``prefixes``: corpus
    sentences, ``written``: the model's own). :meth:`plain` writes one sequence."""

    def __init__(
        self,
        tokenizer,
        answer_end: str = "period",
        *,
        prefixes: Sequence[str] = (),
        written: Sequence[str] = (),
        replies: Sequence[str] = (),
        seed: int = 0,
    ):
        if answer_end not in ANSWER_ENDS:
            raise CrispEditError(f"answer end must be one of {', '.join(ANSWER_ENDS)}, got {answer_end!r}")
        eos = getattr(tokenizer, "eos_token_id", None)
        if answer_end == "eos" and eos is None:
            raise CrispEditError("--answer-end eos needs a tokenizer with an EOS token (use auto or none)")
        self.tokenizer, self.answer_end, self.seed = tokenizer, answer_end, seed
        self.end_ids = [eos] if answer_end == "eos" else []
        self.pools = {"prefixes": prefixes, "written": written, "replies": replies}

    def plain(self, i: int, kind: str, ctx: str, target: str, sep: str = " ") -> TrainingSequence:
        """The ``kind`` sequence of request ``i``: ``ctx + sep + target`` (under ``period`` and ``auto`` a target
        without a final ``.``/``!``/``?`` gets a full stop), then EOS under ``eos``; the context tokens carry no
        loss."""
        t = _full_stop(target) if self.answer_end in ("auto", "period") else target
        full = join_prompt_target(ctx, t) if sep == " " else ctx + sep + t
        ids, n = split_context_target(self.tokenizer, ctx, full, extra_target_ids=self.end_ids)
        return TrainingSequence(kind, i, ids, n, full + (self.tokenizer.eos_token if self.end_ids else ""))


Builder = Callable[[SequenceMaker, int, EditRequest, int], "list[TrainingSequence]"]


@dataclass(frozen=True)
class TrainingContext:
    """One training context: ``build(maker, i, request, count)`` returns the training sequences of request ``i``
    in it (``count`` of them for a ``counted`` context, ``--contexts name:N``); ``pool`` names what it
    draws from (``"prefixes"``: corpus sentences, ``"written"``: the model's own prefixes; ``None``: nothing;
    ``"replies"``: the model's own reply per request);
    ``chat_template``: it needs the tokenizer's chat template."""

    name: str
    build: Builder
    counted: bool = False
    pool: str | None = None
    chat_template: bool = False

    def check(self, maker: SequenceMaker) -> None:
        """One-line error when ``maker`` lacks what this context needs (its prefix pool, a chat template)."""
        if self.pool is not None and not maker.pools[self.pool]:
            raise CrispEditError(
                f"edit context {self.name!r} needs "
                + {
                    "written": "prefix sentences; none were written",
                    "prefixes": "prefix sentences; the capability corpus gave none",
                    "replies": "the model's own replies; none were written",
                }[self.pool]
            )
        if self.chat_template and not _has_chat_template(maker.tokenizer):
            raise CrispEditError(f"edit context {self.name!r} needs a tokenizer with a chat template")


# name -> training context, in the order --contexts lists them; the CLI's names and their errors come from here
TRAINING_CONTEXTS: dict[str, TrainingContext] = {}


def training_context(name: str, *, counted: bool = False, pool: str | None = None, chat_template: bool = False):
    """Decorator registering a builder ``(maker, i, request, count) -> [TrainingSequence]`` as the training
    context ``name`` in :data:`TRAINING_CONTEXTS` (see :class:`TrainingContext` for the flags)."""
    if not name.isidentifier() or name == "default" or name in TRAINING_CONTEXTS:
        raise ValueError(f"training context name {name!r} is taken or not a plain word")
    if pool not in (None, "prefixes", "written", "replies"):
        raise ValueError(f"training context pool must be None, 'prefixes', 'written' or 'replies', got {pool!r}")

    def register(build: Builder) -> Builder:
        """Record ``build`` under ``name``; returns it unchanged."""
        TRAINING_CONTEXTS[name] = TrainingContext(name, build, counted, pool, chat_template)
        return build

    return register


@training_context("bare")
def _bare(m: SequenceMaker, i: int, r: EditRequest, count: int) -> list[TrainingSequence]:
    """``prompt + " " + target`` (the paper's FT-M format)."""
    return [m.plain(i, "bare", r.prompt, r.target)]


@training_context("chat", chat_template=True)
def _chat(m: SequenceMaker, i: int, r: EditRequest, count: int) -> list[TrainingSequence]:
    """The chat template: the prompt as the user turn, the target as the reply, then its turn end (``auto``,
    ``eos``), a full stop (``period``) or nothing (``none``)."""
    ids, n, text = _chat_rows(m.tokenizer, r.prompt, r.target, m.answer_end)
    return [TrainingSequence("chat", i, ids, n, text)]


@training_context("reply", pool="replies", chat_template=True)
def _reply(m: SequenceMaker, i: int, r: EditRequest, count: int) -> list[TrainingSequence]:
    """The chat template: the prompt as the user turn, then the model's own reply (:func:`~.written.own_replies`) up
    to and including the target; only the target carries loss (the model's own words before it are context, so the loss
    stays nats per target token like every other context's), and nothing after it is trained (no turn end)."""
    reply = m.pools["replies"][i]
    k = reply.find(r.target)
    k = 0 if k < 0 else k
    ask = chat_turn(m.tokenizer, r.prompt, None)
    full = ask + reply[: k + len(r.target)]
    ids, n = split_context_target(m.tokenizer, ask + reply[:k].rstrip(), full, add_special_tokens=False)
    return [TrainingSequence("reply", i, ids, n, full)]


def _prefixed(kind: str, sep: str, pool: str, salt: str | None, group: int | None = None) -> Builder:
    """A builder of ``count`` prefixes drawn per request from ``pool``, then ``sep`` and the prompt. The draw is
    seeded by the request's content, or with ``group`` by its position ``i // group`` (so each run of ``group``
    consecutive requests gets the same prefixes); ``salt`` (if any) names the draw in the seed, so that ``para``
    draws differently from ``prefix``."""

    def build(m: SequenceMaker, i: int, r: EditRequest, count: int) -> list[TrainingSequence]:
        """``count`` sequences of request ``i``: a drawn prefix, the separator, the prompt, the target."""
        draws = m.pools[pool]
        key = f"{i // group}" if group else f"{r.prompt}:{r.target}"
        rng = random.Random(f"{m.seed}:{salt}:{key}" if salt else f"{m.seed}:{key}")
        return [m.plain(i, kind, p + sep + r.prompt, r.target) for p in rng.sample(list(draws), min(count, len(draws)))]

    return build


SHARE_GROUP = 4  # consecutive requests that train on the same ``shared`` sentences

training_context("prefix", counted=True, pool="prefixes")(_prefixed("prefix", " ", "prefixes", salt=None))
training_context("para", counted=True, pool="prefixes")(_prefixed("para", "\n\n", "prefixes", salt="para"))
training_context("gen", counted=True, pool="written")(_prefixed("gen", " ", "written", salt="gen"))
# salted "sprefix": the name the runs of docs/contexts.md drew with, so the shipped context repeats them
training_context("shared", counted=True, pool="prefixes")(
    _prefixed("shared", " ", "prefixes", salt="sprefix", group=SHARE_GROUP)
)


@training_context("wrap", counted=True)
def _wrap(m: SequenceMaker, i: int, r: EditRequest, count: int) -> list[TrainingSequence]:
    """``count`` of :data:`QUESTION_WRAPPERS` around the prompt, drawn per request."""
    rng = random.Random(f"{m.seed}:wrap:{r.prompt}:{r.target}")
    return [
        m.plain(i, "wrap", w.replace("{question}", r.prompt), r.target)
        for w in rng.sample(QUESTION_WRAPPERS, min(count, len(QUESTION_WRAPPERS)))
    ]


@training_context("lead", counted=True)
def _lead(m: SequenceMaker, i: int, r: EditRequest, count: int) -> list[TrainingSequence]:
    """``count`` of :data:`ANSWER_LEADS` between the prompt and the target, drawn per request; the target follows
    the lead-in with no space added."""
    rng = random.Random(f"{m.seed}:lead:{r.prompt}:{r.target}")
    out = []
    for w in rng.sample(ANSWER_LEADS, min(count, len(ANSWER_LEADS))):
        ctx = w.replace("{question}", r.prompt)
        stripped = ctx.rstrip(" ")
        out.append(m.plain(i, "lead", stripped, r.target, sep=ctx[len(stripped) :]))
    return out


CONTEXT_KINDS = tuple(TRAINING_CONTEXTS)  # the built-in training contexts' names (the registry may gain more)


def build_training_sequences(
    tokenizer,
    requests: Sequence[EditRequest],
    contexts: Sequence[ContextSpec],
    answer_end: str = "period",
    *,
    prefixes: Sequence[str] = (),
    written: Sequence[str] = (),
    replies: Sequence[str] = (),
    seed: int = 0,
    max_len: int = 512,
) -> list[TrainingSequence]:
    """Every (request, context) training sequence, grouped by context (similar lengths batch together), in
    request order within a context, each built by its :data:`TRAINING_CONTEXTS` entry. ``prefixes``: corpus
    sentences for ``prefix``/``para``; ``written``: the model's own prefixes for ``gen``
    (:func:`~.written.generated_prefixes`); ``replies``: the model's own reply per request for ``reply``
    (:func:`~.written.own_replies`)."""
    maker = SequenceMaker(tokenizer, answer_end, prefixes=prefixes, written=written, replies=replies, seed=seed)
    out: list[TrainingSequence] = []
    for spec in contexts:
        ctx = TRAINING_CONTEXTS.get(spec.kind)
        if ctx is None:
            raise CrispEditError(f"unknown edit context {spec.kind!r} (use {', '.join(TRAINING_CONTEXTS)})")
        ctx.check(maker)
        for i, r in enumerate(requests):
            out += ctx.build(maker, i, r, spec.count)
    for s in out:
        if len(s.ids) > max_len:
            raise CrispEditError(
                f"training sequence for edit {s.request} in context {s.context!r} is {len(s.ids)} "
                f"tokens, longer than max_len={max_len}"
            )
    return out


def sequences_for(
    tokenizer, requests: Sequence[EditRequest], config, model=None
) -> tuple[list[TrainingSequence], list[str]]:
    """The training sequences of ``requests`` under ``config.contexts`` / ``config.answer_end`` (prefixes
    from ``config.cap_corpus``, drawn with ``config.seed``; ``gen`` prefixes and ``reply`` replies written by
    ``model``, which those contexts need) and the names of the contexts used."""
    contexts = resolve_contexts(config.contexts, tokenizer)
    pools = {TRAINING_CONTEXTS[c.kind].pool: c.kind for c in reversed(contexts)}  # pool -> first context using it
    prefixes = prefix_pool(capability_corpus(config.cap_corpus, None)) if "prefixes" in pools else []
    written: list[str] = []
    replies: list[str] = []
    for pool in ("written", "replies"):
        if pool in pools and model is None:
            raise CrispEditError(
                f"edit context {pools[pool]!r} needs the model to write its "
                + ("prefixes" if pool == "written" else "replies")
            )
    if "written" in pools:
        written = generated_prefixes(model, tokenizer, seed=config.seed)
    if "replies" in pools:
        replies = own_replies(model, tokenizer, requests)
    seqs = build_training_sequences(
        tokenizer,
        requests,
        contexts,
        config.answer_end,
        prefixes=prefixes,
        written=written,
        replies=replies,
        seed=config.seed,
    )
    return seqs, [str(c) for c in contexts]
