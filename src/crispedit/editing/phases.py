"""The edit settings by phase: which parameters and method, the capability curvature, the projection, the training
loop, the training sequences, and the drift bound — each a :class:`~crispedit.settings.Settings` dataclass that
declares its fields (default, help, command-line flag) and checks them.

:class:`~crispedit.editing.config.EditConfig` is all of them at once (it derives from each), so a user writes one
flat ``EditConfig(method="crispedit", gamma=0.9, epochs=20)`` and a report stores one flat dict, while code that
needs one phase says so in its signature: the curvature cache and collection take a :class:`CurvatureConfig` (its
fields, with the model and layers, are the cache key), the loop a :class:`TrainingConfig`. A phase checks what it
can alone; what depends on the method (its default learning rate and preservation term, whether it trains in steps
a drift bound can act on, its own options) is checked by ``EditConfig``.

The paper's defaults (Table "Default hyperparameters"): Adam lr 5e-4, batch 32, early stopping at loss 0.01
(batches below it are skipped, training stops once an epoch's mean loss is below it), sampled labels
(Gauss-Newton), γ 0.7–0.9. Here: γ 0.8, up to 100 epochs ended by that early stopping (the paper's 25 steps are
thousands of edits / 32 per epoch × 25; for the tens of edits a user edits at once 25 epochs stop short:
docs/methods.md, "Training defaults"), 64 capability texts of at most 256 tokens on a CPU (the paper: 10,000
Wikipedia documents of 512 tokens on a GPU).

Torch-free: a command's arguments are checked before torch is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..checks import SEED_MAX, check_float, check_gamma, check_int, check_lr, check_positive_int
from ..errors import CrispEditError
from ..settings import Settings, setting
from .registry import method_names, method_spec

__all__ = [
    "MethodSelection",
    "CurvatureConfig",
    "ProjectionConfig",
    "TrainingConfig",
    "SequencesConfig",
    "DriftConfig",
    "ProjectionTarget",
    "PRECISIONS",
    "PROJECTION_PRECISIONS",
    "BATCH_ORDERS",
    "STOP_RULES",
    "LABEL_MODES",
    "DEFAULT_LR",
    "MAX_EPOCHS",
    "MAX_KEEP_TOKENS",
    "KEEP_OFF",
]

# the training forward's arithmetic; "auto" is bf16 where the device has it natively (crispedit.models.native_bf16),
# else fp32, decided when the edit runs
PRECISIONS = ("fp32", "bf16", "auto")
# the projection's GEMMs; curvature.precision.ROTATION_PRECISIONS, torch-free here
PROJECTION_PRECISIONS = ("fp32", "tf32")
BATCH_ORDERS = ("request", "length")  # which sequences of a context share a batch
STOP_RULES = ("loss", "greedy")  # what ends training before the epoch cap (editing/loop.py)
LABEL_MODES = ("sampled", "empirical")
DEFAULT_LR = 5e-4  # the paper's Adam learning rate; a method may set its own (LoRAConfig.SHARED)
MAX_EPOCHS = 100_000
MAX_KEEP_TOKENS = 1024  # tokens of one held answer (editing/keep.py), at most
# the preservation term's settings of a method that sets none of its own (MethodConfig.SHARED): off
KEEP_OFF = {"keep_chat": 0, "keep_subject": 0, "keep_weight": 1.0}


class ProjectionTarget(str, Enum):
    """Where the low-curvature projection acts: the gradient, the Adam update, or Adam's moments (eigenbasis)."""

    GRADIENT = "gradient"  # project the raw gradient, then a plain Adam step (the paper)
    UPDATE = "update"  # project the Adam update itself: the step stays inside the kept subspace
    EIGENBASIS = "eigenbasis"  # Adam's moments in the K-FAC eigenbasis on the masked rotated gradient


def _methods_help(cls: type) -> str:
    return "; ".join(f"{n}: {method_spec(n).summary}" for n in method_names()) + " (default {default})"


def _keep_help(cls: type) -> str:
    on = [(n, method_spec(n).shared) for n in method_names()]
    held = (
        "; ".join(
            f"{n}: {s['keep_chat']} / {s['keep_subject']} / {s['keep_weight']:g}"
            for n, s in on
            if s.get("keep_chat") or s.get("keep_subject")
        )
        or "none"
    )
    return (
        "hold the unedited model's own chat answers to N bundled everyday prompts while the edit trains (a hinge "
        f"on every answer token that became less likely; default: the method's — {held} — else 0)"
    )


def _subject_help(cls: type) -> str:
    from ..data.corpus import SUBJECT_KEEPS

    return (
        "... and its answers to K questions about each edit's subject that ask no particular relation "
        f"(at most {len(SUBJECT_KEEPS)}; default: the method's, else 0)"
    )


def _contexts_help(cls: type) -> str:
    from .contexts import DEFAULT_CONTEXTS, TRAINING_CONTEXTS

    names = ", ".join(name + (":N" if c.counted else "") for name, c in TRAINING_CONTEXTS.items())
    return (
        f"training contexts each request is trained in: comma list of {names} (default: 'default' = "
        f"{DEFAULT_CONTEXTS}; chat only for models with a chat template)"
    )


def _answer_ends() -> tuple[str, ...]:
    from .contexts import ANSWER_ENDS

    return tuple(ANSWER_ENDS)


@dataclass
class MethodSelection(Settings):
    """Which method edits and which parameters it trains; ``options`` are the method's own settings (its
    ``Config`` dataclass), stored complete."""

    method: str = setting("crispedit", help=_methods_help, choices=method_names)
    layers: str | None = setting(
        None,
        help="module-path pattern, e.g. 'model.layers.{15-19}.mlp.down_proj' "
        "(default: per-architecture, see docs/cli.md, 'Choosing layers')",
    )
    options: dict = setting(default_factory=dict, help="the method's own settings", cli=False)


@dataclass
class CurvatureConfig(Settings):
    """The capability statistics: ``n_cap`` texts of at most ``max_len`` tokens (plus ``cap_chat`` chat answers),
    labels sampled from the model or the text's own, the seed of both. With the model and the edited layers these
    fields are what a cached statistics file is found by (:func:`crispedit.editing.api.curvature_spec`);
    ``kfac_batch_size`` changes only how fast they are collected."""

    n_cap: int = setting(64, help="number of capability texts for K-FAC (default {default})")
    max_len: int = setting(256, help="max tokens per capability text (default {default})")
    label_mode: str = setting(
        "sampled",
        choices=LABEL_MODES,
        help="K-FAC labels: sampled from the model (Gauss-Newton, default) or the text's own tokens",
    )
    kfac_batch_size: int = setting(8, help="capability texts per statistics batch (default {default})")
    cap_corpus: str | None = setting(None, help="capability corpus (.txt/.jsonl/.json); default: bundled WikiText")
    cap_chat: int = setting(
        0,
        metavar="N",
        help="bundled chat prompts whose answers, written by the unedited model through its chat "
        "template, join the capability corpus, so the curvature protects how it answers "
        "(default {default})",
    )
    seed: int = setting(
        0, help="seed of the sampled labels, the drawn context sentences and the held prompts (default {default})"
    )

    def validate(self) -> CurvatureConfig:
        """Check the curvature fields (one-line errors); then the other phases'."""
        for name in ("n_cap", "max_len", "kfac_batch_size"):
            setattr(self, name, check_positive_int(name.replace("_", "-"), getattr(self, name)))
        if self.label_mode not in LABEL_MODES:
            raise CrispEditError(f"label mode must be 'sampled' or 'empirical', got {self.label_mode!r}")
        from ..data.corpus import CHAT_PROMPTS

        self.cap_chat = check_int("cap-chat", self.cap_chat, 0, CHAT_PROMPTS)
        self.seed = check_int("seed", self.seed, 0, SEED_MAX)
        super().validate()
        return self


@dataclass
class ProjectionConfig(Settings):
    """How the gradient is kept out of the capability loss's high-curvature directions: the energy threshold
    ``gamma``, what is projected, and the projection's arithmetic on a GPU."""

    gamma: float = setting(0.8, help="energy threshold in (0, 1) (default {default})")
    projection_target: str = setting(
        ProjectionTarget.GRADIENT.value,
        flag="--projection",
        choices=tuple(t.value for t in ProjectionTarget),
        help="project the raw gradient (paper), the Adam update, or run Adam in the K-FAC eigenbasis",
    )
    projection_precision: str = setting(
        "fp32",
        choices=PROJECTION_PRECISIONS,
        help="the projection's matrix products on a GPU: fp32, or tf32 tensor cores "
        "(inputs rounded to 10 mantissa bits, float32 sums; docs/curvature.md bounds "
        "what leaks); the CPU always fp32",
    )

    def validate(self) -> ProjectionConfig:
        """Check the projection fields (one-line errors); then the other phases'."""
        self.gamma = check_gamma(self.gamma)
        try:
            self.projection_target = ProjectionTarget(self.projection_target).value
        except ValueError:
            raise CrispEditError(
                "projection target must be one of "
                f"{', '.join(t.value for t in ProjectionTarget)}, "
                f"got {self.projection_target!r}"
            ) from None
        if self.projection_precision not in PROJECTION_PRECISIONS:
            raise CrispEditError(
                f"projection precision must be one of {', '.join(PROJECTION_PRECISIONS)}, "
                f"got {self.projection_precision!r}"
            )
        super().validate()
        return self


@dataclass
class TrainingConfig(Settings):
    """The projected loop's optimiser, batches and stop rules. Units: ``lr`` per Adam step, ``epochs`` passes over
    the training sequences, losses in nats per target token; ``lr=None`` takes the method's default, set for the
    model family when the edit runs (:meth:`~crispedit.editing.config.EditConfig.for_family`)."""

    lr: float | None = setting(
        None, help="Adam learning rate (default: the method's; 5e-4 (Gemma-3: 5e-5, crispedit.families), LoRA 5e-3)"
    )
    betas: tuple[float, float] = setting((0.9, 0.999), help="Adam's betas", cli=False)
    batch_size: int = setting(32, help="edit sequences per step (default {default})")
    batch_tokens: int | None = setting(
        None,
        metavar="N",
        help="pack each step's batch up to N padded tokens (sequences x longest, "
        "length-sorted within a context) instead of --batch-size sequences: fewer, "
        "fuller steps on a GPU",
    )
    batch_order: str = setting(
        "request",
        choices=BATCH_ORDERS,
        help="which sequences of a context share a batch of --batch-size: in request order "
        "(default), or sorted by length (the same number of steps, little padding: fewer "
        "tokens computed)",
    )
    precision: str = setting(
        "fp32",
        choices=PRECISIONS,
        help="the training forward and backward: fp32, bf16 autocast (matmuls in bfloat16; the "
        "trained weights, their gradients, Adam and the projection stay float32), or auto: bf16 "
        "where the device computes it natively (a GPU, a CPU with AVX-512 or AMX), else fp32",
    )
    epochs: int = setting(
        100,
        help="maximum epochs over the edits (default {default}; the paper: 25); training stops "
        "earlier once an epoch's mean loss is below 0.01, or at a plateau (--plateau)",
    )
    skip_loss: float = setting(0.01, help="a batch whose loss is below it takes no step", cli=False)
    stop_loss: float = setting(0.01, help="training stops once an epoch's mean loss is below it", cli=False)
    stop_rule: str = setting(
        "loss",
        choices=STOP_RULES,
        help="loss: stop once an epoch's mean loss is below 0.01 (default, the paper's); greedy: also stop "
        "once every training sequence's target is the model's greedy continuation (checked after an epoch "
        "whose loss is below 0.1): fewer epochs for a few edits, a smaller margin",
    )
    # the plateau rule (editing/loop.py: plateaued)
    plateau_epochs: int = setting(
        8,
        flag="--plateau",
        metavar="N",
        help="also stop once the epoch loss is below twice the stop loss and its best has "
        "not fallen by 2% in N epochs (default {default}; 0: the paper's rule alone)",
    )
    plateau_delta: float = setting(
        0.02, help="the relative fall of the best epoch loss that resets the plateau count", cli=False
    )

    def validate(self) -> TrainingConfig:
        """Check the training fields (one-line errors); then the other phases'."""
        if self.lr is not None:  # unset: the method's default, set for the model family when the edit runs
            self.lr = check_lr("learning rate (--lr)", self.lr)
        self.batch_size = check_positive_int("batch-size", self.batch_size)
        if self.batch_tokens is not None:
            self.batch_tokens = check_positive_int("batch-tokens", self.batch_tokens)
        if self.batch_order not in BATCH_ORDERS:
            raise CrispEditError(f"batch order must be one of {', '.join(BATCH_ORDERS)}, got {self.batch_order!r}")
        if self.precision not in PRECISIONS:
            raise CrispEditError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        self.epochs = check_int("epochs", check_positive_int("epochs", self.epochs), 1, MAX_EPOCHS)
        self.skip_loss = check_float("skip_loss", self.skip_loss, 0.0)
        self.stop_loss = check_float("stop_loss", self.stop_loss, 0.0)
        if self.stop_rule not in STOP_RULES:
            raise CrispEditError(f"stop rule must be one of {', '.join(STOP_RULES)}, got {self.stop_rule!r}")
        self.plateau_epochs = check_int("plateau epochs (--plateau)", self.plateau_epochs, 0, MAX_EPOCHS)
        self.plateau_delta = check_float("plateau delta", self.plateau_delta, 0.0, 1.0, lo_open=True, hi_open=True)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise CrispEditError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(check_float("Adam beta", b, 0.0, 1.0, hi_open=True) for b in self.betas)  # type: ignore[assignment]
        super().validate()
        return self


@dataclass
class SequencesConfig(Settings):
    """What the loop trains on besides the edits' own loss: the training contexts each request becomes, what ends
    its answer, a per-epoch sample of them, and the preservation term (:mod:`crispedit.editing.keep`) — the
    unedited model's answers to ``keep_chat`` bundled chat prompts and ``keep_subject`` subject questions per edit,
    their first ``keep_tokens`` tokens held with weight ``keep_weight``. A ``keep_*`` of ``None`` is the method's
    default (its ``Config.SHARED``, else :data:`KEEP_OFF`), filled in by ``EditConfig``."""

    contexts: str = setting("default", help=_contexts_help)
    answer_end: str = setting(
        "period",
        choices=_answer_ends,
        help="what follows the target in training: period = a period in every context, the chat reply's "
        "too, and no end of turn, so chat answers go on in the model's own words (default); auto = the "
        "chat end-of-turn in chat, a period elsewhere; eos = EOS instead of the period; none = the target "
        "alone (the paper)",
    )
    context_sample: int | None = setting(
        None,
        metavar="K",
        help="train each request on a seeded sample of K of its context sequences "
        "per epoch (every epoch another sample) instead of all of them: fewer "
        "tokens per epoch",
    )
    keep_chat: int | None = setting(None, metavar="N", help=_keep_help)
    keep_subject: int | None = setting(None, metavar="K", help=_subject_help)
    keep_weight: float | None = setting(
        None, metavar="W", help="weight of that preservation term beside the edit loss (default: the method's, else 1)"
    )
    keep_tokens: int = setting(
        24,
        metavar="T",
        help="tokens of each held answer (longer answers hold more of the assistant's form and "
        "cost more per step; default {default})",
    )

    def validate(self) -> SequencesConfig:
        """Check the sequence fields (one-line errors); then the other phases'."""
        from .contexts import ANSWER_ENDS, parse_contexts

        parse_contexts(self.contexts)
        if self.answer_end not in ANSWER_ENDS:
            raise CrispEditError(f"answer end must be one of {', '.join(ANSWER_ENDS)}, got {self.answer_end!r}")
        if self.context_sample is not None:
            self.context_sample = check_positive_int("context-sample", self.context_sample)
        from ..data.corpus import CHAT_PROMPTS, SUBJECT_KEEPS

        if self.keep_chat is not None:
            self.keep_chat = check_int("keep-chat", self.keep_chat, 0, CHAT_PROMPTS)
        if self.keep_subject is not None:
            self.keep_subject = check_int("keep-subject", self.keep_subject, 0, len(SUBJECT_KEEPS))
        if self.keep_weight is not None:
            self.keep_weight = check_float("keep weight (--keep-weight)", self.keep_weight, 0.0, lo_open=True)
        self.keep_tokens = check_int("keep-tokens", self.keep_tokens, 1, MAX_KEEP_TOKENS)
        super().validate()
        return self


@dataclass
class DriftConfig(Settings):
    """A bound on how far the change may move the model, in the K-FAC predicted KL drift (nats/token): a trust
    region ``max_drift`` (``None``: none) and a Lagrangian weight ``drift_penalty`` β (train edit loss + β ·
    predicted KL). Fine-tuning methods only (``MethodSpec.drift_budget``)."""

    max_drift: float | None = setting(None, help="budget on the predicted KL drift in nats/token", cli=False)
    drift_penalty: float = setting(
        0.0,
        metavar="BETA",
        help="train edit loss + BETA x the K-FAC predicted KL drift (nats/token) of the "
        "change, so the edit takes the flattest directions (default {default}; fine-tuning "
        "methods: ft, locbf-ft and lora get the capability factors fetched, lora on its "
        "merged update)",
    )

    def validate(self) -> DriftConfig:
        """Check the drift fields (one-line errors); then the other phases'."""
        self.drift_penalty = check_float("drift penalty (--drift-penalty)", self.drift_penalty, 0.0)
        if self.max_drift is not None:
            self.max_drift = check_float("max drift (--max-drift)", self.max_drift, 0.0, lo_open=True)
        super().validate()
        return self
