"""Edit configuration: :class:`EditConfig`, every phase's settings in one flat config
(:mod:`crispedit.editing.phases` declares them, with the paper's defaults and each field's help), and
:class:`SeqConfig`, the settings of a sequential session (:mod:`crispedit.sessions.sequential`).

Method-specific settings live in each method's own config dataclass (its ``Config``, beside its editor
in :mod:`crispedit.methods`, e.g. :class:`~crispedit.methods.lora.LoRAConfig`); ``EditConfig.options`` holds them,
validated and completed with that method's defaults.

Torch-free, like the catalogue it validates against: a command's arguments are checked before torch is
imported.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..checks import check_float, check_gamma, check_int, check_positive_int
from ..errors import CrispEditError
from ..settings import Settings, setting
from .phases import (
    BATCH_ORDERS,
    DEFAULT_LR,
    KEEP_OFF,
    PRECISIONS,
    PROJECTION_PRECISIONS,
    STOP_RULES,
    CurvatureConfig,
    DriftConfig,
    MethodSelection,
    ProjectionConfig,
    ProjectionTarget,
    SequencesConfig,
    TrainingConfig,
)
from .registry import MethodConfig, get_editor, method_names, method_spec

__all__ = [
    "EditConfig",
    "PRECISIONS",
    "PROJECTION_PRECISIONS",
    "BATCH_ORDERS",
    "STOP_RULES",
    "SeqConfig",
    "ProjectionTarget",
    "DEFAULT_LR",
    "WEIGHTINGS",
    "MODES",
    "PAPER_SEQ_CHUNK",
    "MIN_SEQ_ROUNDS",
    "DRIFT_FROM",
    "default_seq_chunk",
]


@dataclass
class EditConfig(DriftConfig, SequencesConfig, TrainingConfig, ProjectionConfig, CurvatureConfig, MethodSelection):
    """Everything that determines an edit besides the model and the requests: the fields of every phase
    (:class:`~crispedit.editing.phases.MethodSelection`, ``CurvatureConfig``, ``ProjectionConfig``,
    ``TrainingConfig``, ``SequencesConfig``, ``DriftConfig``: their docstrings give units and defaults), validated on
    construction; unknown keys rejected by :meth:`from_dict`. What depends on the method is settled here: an unset
    ``keep_*`` becomes the method's default, ``options`` its complete validated config, and a drift bound is refused
    for a method that writes its change in one pass."""

    KIND = "edit config"

    def validate(self) -> EditConfig:
        """Check every field (one-line :class:`CrispEditError` naming the bad one), normalise types, return
        ``self``."""
        spec = method_spec(self.method)
        self.options = spec.Config.from_options(self.method, self.options).to_json()
        for name, off in KEEP_OFF.items():
            if getattr(self, name) is None:
                setattr(self, name, spec.shared.get(name, off))
        super().validate()  # every phase's own checks
        if (self.max_drift is not None or self.drift_penalty > 0) and not spec.drift_budget:
            ok = ", ".join(n for n in method_names() if method_spec(n).drift_budget)
            raise CrispEditError(
                f"--max-drift / --drift-penalty act on the training steps of a fine-tuning method "
                f"({ok}); {self.method} writes its change in one pass without them"
            )
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
        d = super().to_json()
        d["betas"] = list(self.betas)
        return d


WEIGHTINGS = ("fixed", "trace", "each", "apart", "tokens")
MODES = ("sequential", "batch")
EDIT_FACTOR_ROWS = ("full", "target")
DRIFT_FROM = ("round", "base")
PAPER_SEQ_CHUNK = 100  # CrispEdit-Seq's chunk size (paper, Table "Default hyperparameters"; 3000 edits = 30 rounds)
MIN_SEQ_ROUNDS = 10  # ... but a small edit set is still cut into about this many rounds
MAX_REPLAY = 100_000  # earlier edits a round may rehearse, at most


def default_seq_chunk(n_edits: int) -> int:
    """Edits per round of a ``compare`` ``-seq`` row when ``--seq-chunk`` is not given:
    ``min(100, ceil(n_edits / 10))`` — the paper's chunk of 100 edits at its scale (3000 edits, 30 rounds),
    and about 10 rounds for smaller edit sets (100 edits: chunks of 10; one chunk of 100 would just be
    the batch edit)."""
    n = check_positive_int("number of edits", n_edits)
    return max(1, min(PAPER_SEQ_CHUNK, -(-n // MIN_SEQ_ROUNDS)))


@dataclass
class SeqConfig(Settings):
    """Everything that determines a sequential editing session (besides the base model): the edit
    config of every round and the factor policy of :mod:`crispedit.sessions.sequential` (validated on
    construction)."""

    KIND = "session config"

    edit: EditConfig = setting(default_factory=EditConfig, help="the edit config of every round", cli=False)
    mode: str = setting(
        "sequential",
        choices=MODES,
        help="sequential rounds (default) or re-edit the base on the union of all rounds (baseline)",
    )
    weighting: str = setting(
        "each",
        choices=WEIGHTINGS,
        help="capability vs edit factors: gamma of each set's energy masked in the trace-scaled "
        "mix's eigenbasis (each, the default), or each in its own eigenbasis with the two projections "
        "alternated (apart), that mix alone (trace), a fixed mixing "
        "coefficient on the raw factors (fixed), or token counts (authors' code)",
    )
    mix: float = setting(
        0.5, help="share of the edit factors with --weighting fixed, trace or each (default {default})"
    )
    edit_factors: str = setting(
        "full",
        choices=EDIT_FACTOR_ROWS,
        help="positions a round's edit factors are collected at: every position of its training sequences "
        "(full, the default and the paper's) or only those that predict the target (target: the edits' own "
        "curvature, not their prompts')",
    )
    edit_gamma: float | None = setting(
        0.8,
        metavar="G",
        help="with --weighting each or apart: the energy of the accumulated edit factors masked "
        "(default {default}; higher protects earlier rounds' edits more and leaves "
        "later rounds less room)",
    )
    replay: int = setting(
        0,
        metavar="N",
        help="each sequential round also trains on up to N earlier edits of the stream, a seeded sample drawn "
        "anew every round, so what earlier rounds taught is rehearsed where later rounds wore it down (a "
        "replayed edit already held costs its batches a forward); 0: off (default)",
    )
    drift_from: str = setting(
        "round",
        choices=DRIFT_FROM,
        help="what a sequential round's --drift-penalty measures the change from: the round's starting weights "
        "(round, the default: each round pays for its own change) or the session's base (base: a round pays "
        "for the drift of the whole session and may take back what earlier rounds left where it may move)",
    )
    carry_optimizer: bool = setting(
        True, help="carry Adam's state across rounds (default; the flag: a fresh Adam state every round)"
    )
    reproject_momentum: bool = setting(
        True, help="re-project Adam's first moment when the projector changes (default; the flag: keep it as it is)"
    )
    recompute_drift: float | None = setting(
        None, help="recollect capability factors once a weight drifted by more than this (paper: 0.25; default off)"
    )
    kl_text: str | None = setting(None, help="held-out text for KL drift (default: bundled WikiText sample)")
    kl_texts: int = setting(32, help="held-out texts for KL drift (default {default})")
    check_earlier: int = setting(
        1000,
        metavar="N",
        help="earlier edits a session round checks (teacher-forced) besides its own, at most: past N, an evenly "
        "spaced N of them from the session's first edit on, so the check costs the same in a session of any "
        "length (default {default})",
    )

    def validate(self) -> SeqConfig:
        """Check every field (one-line errors), normalise types, return ``self``."""
        if isinstance(self.edit, dict):
            self.edit = EditConfig.from_dict(self.edit)
        self.edit.validate()
        if self.mode not in MODES:
            raise CrispEditError(f"session mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "sequential" and get_editor(self.edit.method).base_only:
            raise CrispEditError(
                f"{self.edit.method} has no sequential mode (what it learned belongs to the unedited model, and a "
                "later round edits an edited one); use --mode batch or another method"
            )
        if self.weighting not in WEIGHTINGS:
            raise CrispEditError(f"factor weighting must be one of {', '.join(WEIGHTINGS)}, got {self.weighting!r}")
        if self.weighting == "apart" and self.uses_weighting and self.edit.projection_target == "eigenbasis":
            raise CrispEditError(
                "--weighting apart composes two eigenbases, so there is none for Adam to keep its moments in; use "
                "--projection gradient or update, or another weighting"
            )
        self.mix = check_float("mix", self.mix, 0.0, 1.0, lo_open=True, hi_open=True)
        if self.edit_gamma is not None:
            self.edit_gamma = check_gamma(self.edit_gamma, "edit gamma")
        if self.edit_factors not in EDIT_FACTOR_ROWS:
            raise CrispEditError(
                f"edit factor rows must be one of {', '.join(EDIT_FACTOR_ROWS)}, got {self.edit_factors!r}"
            )
        self.replay = check_int("replay (--replay)", self.replay, 0, MAX_REPLAY)
        if self.drift_from not in DRIFT_FROM:
            raise CrispEditError(f"--drift-from must be one of {', '.join(DRIFT_FROM)}, got {self.drift_from!r}")
        if self.drift_from == "base" and self.edit.method == "lora":
            raise CrispEditError(
                "--drift-from base measures the change of the weights themselves; LoRA trains a fresh adapter every "
                "round (use --drift-from round)"
            )
        if self.recompute_drift is not None:
            self.recompute_drift = check_float("recompute drift threshold", self.recompute_drift, 0.0, lo_open=True)
        self.kl_texts = check_positive_int("kl-texts", self.kl_texts)
        self.check_earlier = check_positive_int("check-earlier", self.check_earlier)
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
        """:meth:`to_json` without the fields that do not change the rounds (``check_earlier``; ``replay`` in batch
        mode; ``drift_from`` in batch mode or without a drift penalty; ``weighting``, ``mix``, ``edit_factors`` and
        ``edit_gamma`` where :attr:`uses_weighting` is false; an ``edit_gamma`` of ``None`` as the edit γ it stands
        for): what a reopened session or a resumed compare row is matched on, so an ``ft`` session stored under
        another default weighting is still the same session."""
        d = self.to_json()
        d.pop("check_earlier")  # what a round checks afterwards, not what it trains
        if self.mode == "batch":  # every batch-mode round trains on all the edits so far: nothing to replay
            d.pop("replay")
        if self.mode == "batch" or not self.edit.drift_penalty:  # the reference of a penalty that does not act
            d.pop("drift_from")
        if not self.uses_weighting:
            d.pop("weighting"), d.pop("mix"), d.pop("edit_factors"), d.pop("edit_gamma")
        elif d["edit_gamma"] is None:  # the edit γ, spelled out: the same rounds as that value given explicitly
            d["edit_gamma"] = d["edit"]["gamma"]
        return d

    def to_json(self) -> dict:
        """The session config as a JSON-ready dict."""
        d = super().to_json()
        d["edit"] = self.edit.to_json()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SeqConfig:
        """Rebuild from :meth:`to_json` output (the edit config too); unknown keys are rejected."""
        if isinstance(d, dict) and isinstance(d.get("edit"), dict):
            d = {**d, "edit": EditConfig.from_dict(d["edit"])}
        return super().from_dict(d)  # type: ignore[return-value]
