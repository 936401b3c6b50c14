"""Edit configuration: the paper's defaults, written once.

Paper (Table "Default hyperparameters"): Adam lr 5e-4 (:data:`DEFAULT_LR`; a method may set its own, e.g.
LoRA 5e-3), batch 32, 25 steps, early stopping at loss 0.01 (batches below it are skipped, training stops
once an epoch's mean loss is below it). Our default is up to 100 epochs over the edits, ended by that
early stopping: the paper's 25 steps are thousands of edits / 32 per epoch x 25; for the tens of edits a
user edits at once, 25 epochs stop short (measured in docs/methods.md, "Training defaults"). Curvature: sampled labels
(Gauss-Newton), gamma 0.8 (the paper uses 0.7 for ZsRE and 0.9 for CounterFact / WikiBigEdit on Llama-3-8B), 64
capability texts of at most 256
tokens on CPU (the paper uses 10,000 Wikipedia documents of 512 tokens on a GPU).

Method-specific settings live in each method's own config dataclass (its ``Config``, beside its editor
in :mod:`crispedit.methods`, e.g. :class:`~crispedit.methods.lora.LoRAConfig`); ``EditConfig.options`` holds them,
validated and completed with that method's defaults. :class:`SeqConfig` adds the settings of a
sequential session (:mod:`crispedit.sessions.sequential`).

Torch-free, like the catalogue it validates against: a command's arguments are checked before torch is
imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum

from ..checks import SEED_MAX, check_float, check_gamma, check_int, check_lr, check_positive_int
from ..errors import CrispEditError
from .registry import MethodConfig, get_editor, method_names, method_spec

__all__ = ["EditConfig", "PRECISIONS", "PROJECTION_PRECISIONS", "BATCH_ORDERS", "SeqConfig", "ProjectionTarget",
           "DEFAULT_LR", "WEIGHTINGS", "MODES", "PAPER_SEQ_CHUNK",
           "MIN_SEQ_ROUNDS", "default_seq_chunk"]

# the training forward's arithmetic (EditConfig.precision); "auto" is bf16 where the device has it natively
# (crispedit.models.native_bf16), else fp32, decided when the edit runs
PRECISIONS = ("fp32", "bf16", "auto")
# the projection's GEMMs (EditConfig.projection_precision); curvature.precision.ROTATION_PRECISIONS, torch-free here
PROJECTION_PRECISIONS = ("fp32", "tf32")
BATCH_ORDERS = ("request", "length")  # EditConfig.batch_order: which sequences of a context share a batch
DEFAULT_LR = 5e-4  # the paper's Adam learning rate; LoRA overrides it (LoRAConfig.SHARED)
MAX_EPOCHS = 100_000
MAX_KEEP_TOKENS = 1024  # tokens of one held answer (editing/keep.py), at most
# the preservation term's settings of a method that sets none of its own (MethodConfig.SHARED): off
KEEP_OFF = {"keep_chat": 0, "keep_subject": 0, "keep_weight": 1.0}


class ProjectionTarget(str, Enum):
    """Where the low-curvature projection acts: the gradient, the Adam update, or Adam's moments (eigenbasis)."""

    GRADIENT = "gradient"  # project the raw gradient, then a plain Adam step (the paper)
    UPDATE = "update"      # project the Adam update itself: the step stays inside the kept subspace
    EIGENBASIS = "eigenbasis"  # Adam's moments in the K-FAC eigenbasis on the masked rotated gradient


@dataclass
class EditConfig:
    """Everything that determines an edit besides the model and the requests (validated on
    construction; unknown keys rejected by :meth:`from_dict`). Units: ``lr`` per Adam step,
    ``epochs`` passes over the training sequences, ``n_cap`` texts of at most ``max_len`` tokens.
    ``lr=None`` takes the method's default (:data:`DEFAULT_LR` unless its config says otherwise);
    ``options`` are the method's own settings (its ``Config`` dataclass), stored complete."""

    method: str = "crispedit"
    gamma: float = 0.8
    layers: str | None = None           # module-path pattern; None = per-architecture default
    lr: float | None = None             # None = the method's default (DEFAULT_LR; LoRA 5e-3)
    betas: tuple[float, float] = (0.9, 0.999)
    batch_size: int = 32
    # pack batches up to this many padded tokens instead (None = batch_size sequences)
    batch_tokens: int | None = None
    batch_order: str = "request"        # batch_size sequences of one context in request order, or sorted by "length"
    context_sample: int | None = None   # train each request on a seeded sample of this many of its sequences per epoch
    # the training forward: fp32, bf16 autocast (weights, grads, Adam stay fp32), auto
    precision: str = "fp32"
    projection_precision: str = "fp32"  # the projection's GEMMs on a GPU: fp32, or tf32 tensor cores (CPU: always fp32)
    epochs: int = 100                   # maximum; stop_loss ends it earlier (paper: 25 steps, see above)
    skip_loss: float = 0.01
    stop_loss: float = 0.01
    # also stop at a plateau near the stop loss (editing/loop.py: plateaued): this many epochs without a
    # plateau_delta relative fall of the best epoch loss, the last one below PLATEAU_BAND x stop_loss; 0 = off (the
    # paper's rule alone)
    plateau_epochs: int = 8
    plateau_delta: float = 0.02
    projection_target: str = ProjectionTarget.GRADIENT.value
    # how each request becomes training sequences (editing/contexts.py)
    contexts: str = "default"           # e.g. "bare,chat,prefix:2,lead:4"; "default" = DEFAULT_CONTEXTS
    answer_end: str = "auto"            # auto | eos | none
    # capability curvature
    n_cap: int = 64
    max_len: int = 256
    label_mode: str = "sampled"
    kfac_batch_size: int = 8
    cap_corpus: str | None = None       # path; None = bundled WikiText sample
    # bundled chat prompts whose answers, written by the unedited model through its chat template, join the
    # capability corpus, so the curvature also protects how the assistant answers (0 = text alone)
    cap_chat: int = 0
    # the preservation term (editing/keep.py): the unedited model's answers to this many bundled chat prompts
    # and to this many subject questions per edit are held while the edit trains, with this weight (0, 0: off),
    # each answer's first keep_tokens tokens; None = the method's default (Config.SHARED, else KEEP_OFF)
    keep_chat: int | None = None
    keep_subject: int | None = None
    keep_weight: float | None = None
    keep_tokens: int = 24
    seed: int = 0
    options: dict = field(default_factory=dict)  # the method's own settings (Editor.Config fields)
    # trust region on the predicted KL drift (nats/token, fine-tuning methods; MethodSpec.drift_budget);
    # None = no budget
    max_drift: float | None = None
    # Lagrangian weight β on the predicted drift: train edit loss + β · predicted KL (fine-tuning methods)
    drift_penalty: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> EditConfig:
        """Check every field (one-line :class:`CrispEditError` naming the bad one), normalise types, return
        ``self``."""
        spec = method_spec(self.method)
        self.options = spec.Config.from_options(self.method, self.options).to_json()
        self.gamma = check_gamma(self.gamma)
        for name in ("batch_size", "epochs", "n_cap", "max_len", "kfac_batch_size"):
            setattr(self, name, check_positive_int(name.replace("_", "-"), getattr(self, name)))
        if self.batch_tokens is not None:
            self.batch_tokens = check_positive_int("batch-tokens", self.batch_tokens)
        if self.batch_order not in BATCH_ORDERS:
            raise CrispEditError(f"batch order must be one of {', '.join(BATCH_ORDERS)}, got {self.batch_order!r}")
        if self.context_sample is not None:
            self.context_sample = check_positive_int("context-sample", self.context_sample)
        if self.precision not in PRECISIONS:
            raise CrispEditError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.projection_precision not in PROJECTION_PRECISIONS:
            raise CrispEditError(f"projection precision must be one of {', '.join(PROJECTION_PRECISIONS)}, "
                                 f"got {self.projection_precision!r}")
        if self.lr is not None:  # unset: the method's default, set for the model family when the edit runs
            self.lr = check_lr("learning rate (--lr)", self.lr)
        self.epochs = check_int("epochs", self.epochs, 1, MAX_EPOCHS)
        self.seed = check_int("seed", self.seed, 0, SEED_MAX)
        from ..data.corpus import CHAT_PROMPTS

        self.cap_chat = check_int("cap-chat", self.cap_chat, 0, CHAT_PROMPTS)
        from .keep import SUBJECT_KEEPS

        for name, off in KEEP_OFF.items():
            if getattr(self, name) is None:
                setattr(self, name, spec.shared.get(name, off))
        self.keep_chat = check_int("keep-chat", self.keep_chat, 0, CHAT_PROMPTS)
        self.keep_subject = check_int("keep-subject", self.keep_subject, 0, len(SUBJECT_KEEPS))
        self.keep_weight = check_float("keep weight (--keep-weight)", self.keep_weight, 0.0, lo_open=True)
        self.keep_tokens = check_int("keep-tokens", self.keep_tokens, 1, MAX_KEEP_TOKENS)
        self.skip_loss = check_float("skip_loss", self.skip_loss, 0.0)
        self.stop_loss = check_float("stop_loss", self.stop_loss, 0.0)
        self.plateau_epochs = check_int("plateau epochs (--plateau)", self.plateau_epochs, 0, MAX_EPOCHS)
        self.plateau_delta = check_float("plateau delta", self.plateau_delta, 0.0, 1.0, lo_open=True, hi_open=True)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise CrispEditError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        self.betas = tuple(check_float("Adam beta", b, 0.0, 1.0, hi_open=True) for b in self.betas)  # type: ignore[assignment]
        try:
            self.projection_target = ProjectionTarget(self.projection_target).value
        except ValueError:
            raise CrispEditError("projection target must be one of "
                                 f"{', '.join(t.value for t in ProjectionTarget)}, "
                                 f"got {self.projection_target!r}") from None
        from .contexts import ANSWER_ENDS, parse_contexts

        parse_contexts(self.contexts)
        if self.answer_end not in ANSWER_ENDS:
            raise CrispEditError(f"answer end must be one of {', '.join(ANSWER_ENDS)}, got {self.answer_end!r}")
        if self.label_mode not in ("sampled", "empirical"):
            raise CrispEditError(f"label mode must be 'sampled' or 'empirical', got {self.label_mode!r}")
        self.drift_penalty = check_float("drift penalty (--drift-penalty)", self.drift_penalty, 0.0)
        if self.max_drift is not None or self.drift_penalty > 0:
            if self.max_drift is not None:
                self.max_drift = check_float("max drift (--max-drift)", self.max_drift, 0.0, lo_open=True)
            if not spec.drift_budget:
                ok = ", ".join(n for n in method_names() if method_spec(n).drift_budget)
                raise CrispEditError(f"--max-drift / --drift-penalty act on the training steps of a fine-tuning method "
                                     f"({ok}); {self.method} writes its change in one pass without them")
        return self

    @property
    def learning_rate(self) -> float:
        """The Adam learning rate: ``lr``, or while it is unset the method's own default (:data:`DEFAULT_LR` unless
        its config says otherwise), before any family scaling (:meth:`for_family`)."""
        return self.lr if self.lr is not None else method_spec(self.method).shared.get("lr", DEFAULT_LR)

    def for_family(self, family: str | None) -> EditConfig:
        """A new config whose learning rate is set for the model family ``family`` (a config ``model_type``): an
        unset ``lr`` becomes the method's own default (LoRA's) or, for a method on the shared :data:`DEFAULT_LR`,
        ``DEFAULT_LR × FAMILY_DEFAULTS[family].lr_scale`` (Gemma-3: 5e-5; :mod:`crispedit.families`); an lr that
        is set is kept, so the scaling happens once. :func:`~crispedit.editing.edit`, sessions and ``compare``
        call it with the model's family; what they store holds the lr that ran."""
        from ..families import defaults_for

        if self.lr is not None:
            return replace(self)
        shared = method_spec(self.method).shared
        lr = shared["lr"] if "lr" in shared else float(f"{DEFAULT_LR * defaults_for(family).lr_scale:.6g}")
        return replace(self, lr=lr)

    @property
    def method_config(self) -> MethodConfig:
        """The method's own validated config dataclass (built from ``options``)."""
        return method_spec(self.method).Config.from_options(self.method, self.options)

    def to_json(self) -> dict:
        """The config as a JSON-ready dict, every field (what reports and sessions store)."""
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> EditConfig:
        """Rebuild from :meth:`to_json` output; unknown keys are rejected, absent ones take their defaults."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CrispEditError(f"unknown edit config keys: {', '.join(unknown)}")
        return cls(**d)


WEIGHTINGS = ("fixed", "trace", "each", "tokens")
MODES = ("sequential", "batch")
EDIT_FACTOR_ROWS = ("full", "target")
PAPER_SEQ_CHUNK = 100  # CrispEdit-Seq's chunk size (paper, Table "Default hyperparameters"; 3000 edits = 30 rounds)
MIN_SEQ_ROUNDS = 10    # ... but a small edit set is still cut into about this many rounds


def default_seq_chunk(n_edits: int) -> int:
    """Edits per round of a ``compare`` ``-seq`` row when ``--seq-chunk`` is not given:
    ``min(100, ceil(n_edits / 10))`` — the paper's chunk of 100 edits at its scale (3000 edits, 30 rounds),
    and about 10 rounds for smaller edit sets (100 edits: chunks of 10; one chunk of 100 would just be
    the batch edit)."""
    n = check_positive_int("number of edits", n_edits)
    return max(1, min(PAPER_SEQ_CHUNK, -(-n // MIN_SEQ_ROUNDS)))


@dataclass
class SeqConfig:
    """Everything that determines a sequential editing session (besides the base model): the edit
    config of every round and the factor policy of :mod:`crispedit.sessions.sequential` (validated on
    construction)."""

    edit: EditConfig = field(default_factory=EditConfig)
    mode: str = "sequential"            # "sequential" (CrispEdit-Seq / FT Sequential) or "batch" (union re-edit)
    # capability vs edit factors: "each" / "trace" / "fixed" (mix), "tokens" (authors')
    weighting: str = "each"
    mix: float = 0.5                    # share of the edit factors when weighting is "fixed", "trace" or "each"
    edit_factors: str = "full"          # positions of the edit factors: "full" sequences (paper) or "target" only
    edit_gamma: float | None = 0.95     # energy masked of the edit factors under "each" (None: edit.gamma)
    carry_optimizer: bool = True        # keep Adam's state across rounds
    reproject_momentum: bool = True     # re-project Adam's first moment when the projector changes
    recompute_drift: float | None = None  # recollect capability factors past this relative drift (paper 0.25)
    kl_text: str | None = None          # held-out text for KL drift (None = bundled WikiText)
    kl_texts: int = 32

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> SeqConfig:
        """Check every field (one-line errors), normalise types, return ``self``."""
        if isinstance(self.edit, dict):
            self.edit = EditConfig.from_dict(self.edit)
        self.edit.validate()
        if self.mode not in MODES:
            raise CrispEditError(f"session mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.weighting not in WEIGHTINGS:
            raise CrispEditError(f"factor weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        self.mix = check_float("mix", self.mix, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.edit_gamma is not None:
            self.edit_gamma = check_gamma(self.edit_gamma, "edit gamma")
        if self.edit_factors not in EDIT_FACTOR_ROWS:
            raise CrispEditError(f"edit factor rows must be one of {', '.join(EDIT_FACTOR_ROWS)}, "
                                 f"got {self.edit_factors!r}")
        if self.recompute_drift is not None:
            self.recompute_drift = check_float("recompute drift threshold", self.recompute_drift, 0.0, lo_open=True)
        self.kl_texts = check_positive_int("kl-texts", self.kl_texts)
        return self

    @property
    def name(self) -> str:
        """Display name: ``<method>-seq[weighting]`` or ``<method>-batch``."""
        if self.mode == "batch":
            return f"{self.edit.method}-batch"
        return f"{self.edit.method}-seq" + (f"[{self.weighting}]" if self.uses_weighting else "")

    @property
    def uses_weighting(self) -> bool:
        """Whether ``weighting`` and ``mix`` change the rounds: sequential mode of a K-FAC curvature method (the
        only rounds that merge edit factors into their constraint)."""
        if self.mode == "batch":
            return False
        ed = get_editor(self.edit.method)
        return bool(ed.needs_curvature and ed.curvature_kind == "kfac")

    def identity(self) -> dict:
        """:meth:`to_json` without the fields that do not change the rounds (``weighting``, ``mix``,
        ``edit_factors`` and ``edit_gamma`` where :attr:`uses_weighting` is false; an ``edit_gamma`` of ``None`` as the
        edit γ it stands for): what a reopened session or a resumed compare row is matched on, so an ``ft`` session
        stored under another default weighting is still the same session."""
        d = self.to_json()
        if not self.uses_weighting:
            d.pop("weighting"), d.pop("mix"), d.pop("edit_factors"), d.pop("edit_gamma")
        elif d["edit_gamma"] is None:  # the edit γ, spelled out: the same rounds as that value given explicitly
            d["edit_gamma"] = d["edit"]["gamma"]
        return d

    def to_json(self) -> dict:
        """The session config as a JSON-ready dict."""
        d = asdict(self)
        d["edit"] = self.edit.to_json()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SeqConfig:
        """Rebuild from :meth:`to_json` output; unknown keys are rejected."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CrispEditError(f"unknown session config keys: {', '.join(unknown)}")
        d = dict(d)
        if isinstance(d.get("edit"), dict):
            d["edit"] = EditConfig.from_dict(d["edit"])
        return cls(**d)
