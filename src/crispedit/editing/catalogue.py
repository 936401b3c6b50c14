"""The method catalogue: every built-in editing method's name, one-line summary, options and editor class.

Torch-free on purpose: the CLI builds ``--method`` and the ``--<method>-<option>`` flags from it and
:class:`~crispedit.editing.EditConfig` validates a method and its options against it, so a mistyped
command fails in a fraction of a second. The editor classes (``editing/methods/``, which import torch)
take their ``summary`` and ``Config`` from these entries when they register, and are imported only when
an edit runs (:func:`~crispedit.editing.registry.editor_class`).

Each entry also says whether ``compare`` has a ``<name>-seq`` row for it (``sequential``; see
:class:`~crispedit.editing.registry.MethodSpec`). Method options are :class:`MethodConfig` dataclasses
with the paper's defaults; ``SHARED`` holds a method's own default for a shared setting (LoRA's learning
rate), ``HELP`` one line per option.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SEED_MAX, CrispEditError, check_float, check_int, check_lr
from .registry import MethodConfig, MethodSpec, add_method

__all__ = ["LoRAConfig", "LocBFConfig", "ClosedFormConfig", "MEMITConfig", "AlphaEditConfig", "UltraEditConfig",
           "MENDConfig", "MENDTrainConfig", "BUILTIN_METHODS"]


@dataclass
class LoRAConfig(MethodConfig):
    """Rank ``r`` (≥ 1), scale ``alpha`` (ΔW = alpha/r · B A), adapter ``dropout`` in [0, 1), and the
    comma-separated module names ``targets`` adapted in each edit layer's block. Paper defaults
    (EasyEdit's LoRA config for Llama-3-8B): r 8, alpha 32, dropout 0.1; lr 5e-3."""

    r: int = 8
    alpha: float = 32.0
    dropout: float = 0.1
    targets: str = "q_proj,v_proj"
    SHARED = {"lr": 5e-3}
    HELP = {"r": "adapter rank (default 8)", "alpha": "adapter scale: delta W = alpha/r * B A (default 32)",
            "dropout": "adapter dropout while training (default 0.1)",
            "targets": "comma-separated module names adapted in each edit layer's block (default q_proj,v_proj)"}

    def validate(self) -> "LoRAConfig":
        """r a positive integer, alpha positive, dropout in [0, 1), targets non-empty."""
        self.r = check_int("lora rank r", self.r, 1)
        self.alpha = check_float("lora alpha", self.alpha, 0.0, lo_open=True)
        self.dropout = check_float("lora dropout", self.dropout, 0.0, 1.0, hi_open=True)
        if not [t for t in str(self.targets).split(",") if t.strip()]:
            raise CrispEditError("lora targets is empty; give module names such as q_proj,v_proj")
        return self

    @property
    def scale(self) -> float:
        """``alpha / r``: the factor of ``B A`` in the merged weight."""
        return self.alpha / self.r


@dataclass
class LocBFConfig(MethodConfig):
    """``layer``: which of the edit layers trains — middle, first, last or an index."""

    layer: str = "middle"
    HELP = {"layer": "which edit layer trains: middle (default), first, last or an index into the edit layers"}

    def validate(self) -> "LocBFConfig":
        """One-line error unless ``layer`` is middle / first / last or an integer."""
        self.layer = str(self.layer)
        if self.layer not in ("middle", "first", "last") and not self.layer.lstrip("-").isdigit():
            raise CrispEditError(f"locbf-ft layer must be middle, first, last or an index, got {self.layer!r}")
        return self


_CF_HELP = {
    "batch_size": "edits written per closed-form solve; larger edit sets go in consecutive batches",
    "v_steps": "Adam steps of the target-vector (v*) optimisation",
    "v_lr": "Adam learning rate of the v* optimisation",
    "v_weight_decay": "weight of the ||delta|| / ||h||^2 penalty in the v* optimisation",
    "clamp": "the v* change delta is clamped to clamp * ||h|| (h: the unedited hidden state)",
    "kl_factor": "weight of the KL term on '{subject} is a' in the v* optimisation",
    "prefixes": "model-written prefix contexts the keys and v* are averaged over, besides the bare prompt",
}


@dataclass
class ClosedFormConfig(MethodConfig):
    """Options shared by the closed-form editors (MEMIT, AlphaEdit): ``batch_size`` edits per solve, the
    target-vector optimisation (``v_steps`` Adam steps at ``v_lr``, ``v_weight_decay``, ``clamp`` factor of
    ‖h‖, ``kl_factor`` on "{subject} is a") and the number of model-written ``prefixes`` (0: bare prompt
    only). Defaults: EasyEdit's MEMIT settings for Llama-3 (``hparams/MEMIT/llama3-8b.yaml``: v* lr 0.5, clamp 4,
    weight decay 1e-3; λ 15000 in :class:`MEMITConfig`), the baseline settings CrispEdit's paper says it used.
    They are not MEMIT's authors' (who publish no Llama-3 config); the MEMIT config for Llama-3-8B in
    AlphaEdit's code has lr 0.1, clamp 0.75, weight decay 0.5 (:class:`AlphaEditConfig`'s v* defaults)."""

    batch_size: int = 32
    v_steps: int = 25
    v_lr: float = 0.5
    v_weight_decay: float = 1e-3
    clamp: float = 4.0
    kl_factor: float = 0.0625
    prefixes: int = 5

    def validate(self) -> "ClosedFormConfig":
        """Positive batch size and steps, positive learning rate and clamp, non-negative penalties, 0–50 prefixes."""
        self.batch_size = check_int("closed-form batch_size", self.batch_size, 1)
        self.v_steps = check_int("v_steps", self.v_steps, 1, 100_000)
        self.v_lr = check_float("v_lr", self.v_lr, 0.0, 100.0, lo_open=True)
        self.v_weight_decay = check_float("v_weight_decay", self.v_weight_decay, 0.0)
        self.clamp = check_float("clamp", self.clamp, 0.0, lo_open=True)
        self.kl_factor = check_float("kl_factor", self.kl_factor, 0.0)
        self.prefixes = check_int("prefixes", self.prefixes, 0, 50)
        return self


@dataclass
class MEMITConfig(ClosedFormConfig):
    """MEMIT: ``cov_weight`` λ of the key covariance in ``ΔW = R Kᵀ(λC + KKᵀ)⁻¹`` (authors: 15000, their
    ``mom2_update_weight``), plus the shared closed-form options."""

    cov_weight: float = 15000.0
    HELP = {**_CF_HELP, "cov_weight": "lambda: weight of the key covariance C in (lambda C + K K^T) (default 15000)"}

    def validate(self) -> "MEMITConfig":
        """The shared checks and a positive ``cov_weight``."""
        super().validate()
        self.cov_weight = check_float("memit cov_weight", self.cov_weight, 0.0, lo_open=True)
        return self


@dataclass
class AlphaEditConfig(ClosedFormConfig):
    """AlphaEdit: ``nullspace_threshold`` (eigenvalues of the per-token covariance ``C = E[kkᵀ]`` below it
    span the null space the update is projected onto; authors 2e-2), ``l2`` (ridge weight; authors' Llama-3
    config 10), batch 100, v* with lr 0.1, clamp 0.75, weight decay 0.5 (the authors' Llama3-8B config)."""

    batch_size: int = 100
    v_lr: float = 0.1
    v_weight_decay: float = 0.5
    clamp: float = 0.75
    nullspace_threshold: float = 2e-2
    l2: float = 10.0
    HELP = {**_CF_HELP, "nullspace_threshold": "eigenvalues of E[k k^T] below this span the preserved null space "
            "(default 2e-2)", "l2": "ridge weight of the update (default 10, the authors' Llama-3 config)"}

    def validate(self) -> "AlphaEditConfig":
        """The shared checks, a positive threshold and a non-negative ``l2``."""
        super().validate()
        self.nullspace_threshold = check_float("alphaedit nullspace_threshold", self.nullspace_threshold, 0.0,
                                               lo_open=True)
        self.l2 = check_float("alphaedit l2", self.l2, 0.0)
        return self


@dataclass
class UltraEditConfig(MethodConfig):
    """UltraEdit: ``lr`` of the pseudo-values ``v = −lr·‖ĥ‖²·ĝ`` (authors: 1e-6), ``ridge`` weight of the
    closed-form solve ``ΔWᵀ = (HᵀH + ridge·I)⁻¹HᵀV`` (authors: 1), ``batch_size`` edits per solve (32, as in
    CrispEdit's comparison)."""

    lr: float = 1e-6
    ridge: float = 1.0
    batch_size: int = 32
    HELP = {"lr": "scale of the pseudo-values v = -lr * ||h_hat||^2 * g_hat (default 1e-6, the authors')",
            "ridge": "ridge weight of the solve (H^T H + ridge I)^-1 H^T V (default 1)",
            "batch_size": "edits per closed-form solve; the normalisation statistics run across all of them"}

    def validate(self) -> "UltraEditConfig":
        """Positive ``lr``, ``ridge`` and ``batch_size``."""
        self.lr = check_float("ultraedit lr", self.lr, 0.0, 1e6, lo_open=True)
        self.ridge = check_float("ultraedit ridge", self.ridge, 0.0, lo_open=True)
        self.batch_size = check_int("ultraedit batch_size", self.batch_size, 1)
        return self


@dataclass
class MENDConfig(MethodConfig):
    """MEND (applying a trained gradient-transform network): ``weights``, the network's safetensors file (empty:
    the default one in the cache, ``<cache>/mend/<key>.safetensors`` keyed by the model's weight fingerprint and
    the edit layers, where ``crispedit mend train`` writes by default); ``batch_size`` edit requests per
    forward/backward of the one gradient computation (a memory knob: the update does not depend on it)."""

    weights: str = ""
    batch_size: int = 32
    HELP = {"weights": "trained MEND network (safetensors from `crispedit mend train`; default: the cached one for "
            "this model and these layers)",
            "batch_size": "edit requests per forward/backward of the gradient computation (memory only)"}

    def validate(self) -> "MENDConfig":
        """``weights`` a string (a path or empty), ``batch_size`` positive."""
        if self.weights is None:
            self.weights = ""
        if not isinstance(self.weights, str):
            raise CrispEditError(f"mend weights must be a file path, got {self.weights!r}")
        self.batch_size = check_int("mend batch_size", self.batch_size, 1)
        return self


@dataclass
class MENDTrainConfig:
    """How ``crispedit mend train`` meta-trains MEND's gradient-transform network (not a method option: the
    network file stores it). Authors' defaults (eric-mitchell/mend ``config/alg/mend.yaml`` and
    ``config/config.yaml``) unless noted: ``rank`` 1920 of the low-rank residual layers (capped at the
    ``d_in + d_out`` they act on), ``n_hidden`` 1 (two residual layers), ``edit_lr`` 1e-4 (initial per-layer
    step α), ``lr_lr`` 1e-4 (Adam lr of α), ``c_edit`` 0.1, ``c_loc`` 1.0, ``grad_clip`` 100. Changed for a
    CPU budget: ``lr`` 1e-4 (authors 1e-6 over ~100k steps; we train hundreds), ``steps`` 500, ``batch_size``
    8 edits per step (authors 2 edits, gradients accumulated over 10 batches). Locality: each request's
    locality prompts plus ``loc_texts`` capability-corpus passages of at most ``loc_len`` tokens per step."""

    steps: int = 500
    batch_size: int = 8
    lr: float = 1e-4
    lr_lr: float = 1e-4
    edit_lr: float = 1e-4
    rank: int = 1920
    n_hidden: int = 1
    c_edit: float = 0.1
    c_loc: float = 1.0
    grad_clip: float = 100.0
    loc_texts: int = 2
    loc_len: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "MENDTrainConfig":
        """Every field in range (one-line :class:`CrispEditError` naming it); returns ``self``."""
        self.steps = check_int("mend steps", self.steps, 1, 10_000_000)  # 0 steps would save an untrained network
        self.batch_size = check_int("mend batch_size", self.batch_size, 1, 100_000)
        self.lr = check_lr("mend lr", self.lr)  # an Adam lr: the range `edit --lr` takes
        for name in ("edit_lr", "grad_clip"):
            setattr(self, name, check_float(f"mend {name}", getattr(self, name), 0.0, 1e6, lo_open=True))
        self.lr_lr = check_float("mend lr_lr", self.lr_lr, 0.0, 1e6)
        self.rank = check_int("mend rank", self.rank, 1, 1_000_000)
        self.n_hidden = check_int("mend n_hidden", self.n_hidden, 0, 16)
        self.c_edit = check_float("mend c_edit", self.c_edit, 0.0, lo_open=True)
        self.c_loc = check_float("mend c_loc", self.c_loc, 0.0)
        self.loc_texts = check_int("mend loc_texts", self.loc_texts, 0, 1000)
        self.loc_len = check_int("mend loc_len", self.loc_len, 2, 100_000)
        self.seed = check_int("seed", self.seed, 0, SEED_MAX)
        return self

    def to_json(self) -> dict:
        """The settings as a JSON-ready dict (stored in the network file)."""
        from dataclasses import asdict

        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "MENDTrainConfig":
        """Rebuild from :meth:`to_json` output; unknown keys are a one-line error."""
        from dataclasses import fields

        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CrispEditError(f"unknown MEND training settings: {', '.join(unknown)}")
        return cls(**d)


_M = "crispedit.editing.methods"
# sequential: "paper" = the paper's Table 1 has the method's sequential row (compare --methods all runs
# <name>-seq); ultraedit has none of its own: it is lifelong by construction (its batch run already writes the
# edits batch after batch with carried normalisation statistics; --ultraedit-batch-size is its round size).
# drift_budget: the fine-tuning methods take --max-drift / --drift-penalty (LoRA on its merged update).
BUILTIN_METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("crispedit", "fine-tuning projected onto the low-curvature subspace of the capability K-FAC "
               "(the paper)", MethodConfig, f"{_M}.crispedit:CrispEditEditor", curvature=True, sequential="paper",
               drift_budget=True),
    MethodSpec("ft", "plain fine-tuning of the edit layers (no projection)", MethodConfig, f"{_M}.ft:FTEditor",
               sequential="paper", drift_budget=True),
    MethodSpec("adam-nscl", "fine-tuning projected onto the null space of the layer-input covariance (Adam-NSCL)",
               MethodConfig, f"{_M}.adam_nscl:AdamNSCLEditor", curvature=True, drift_budget=True),
    MethodSpec("lora", "low-rank adapter (peft) on q_proj/v_proj of the edit layers' blocks, merged after training",
               LoRAConfig, f"{_M}.lora:LoRAEditor", sequential="paper", drift_budget=True),
    MethodSpec("locbf-ft", "plain Adam on one MLP output projection (LocBF-FT)", LocBFConfig,
               f"{_M}.locbf_ft:LocBFFTEditor", drift_budget=True),
    MethodSpec("memit", "closed-form key-value update of the edit layers' MLP output projections (MEMIT)",
               MEMITConfig, f"{_M}.memit:MEMITEditor"),
    MethodSpec("alphaedit", "MEMIT's update projected onto the null space of the preserved keys' covariance "
               "(AlphaEdit)", AlphaEditConfig, f"{_M}.alphaedit:AlphaEditEditor", sequential="paper"),
    MethodSpec("ultraedit", "lifelong-normalised gradient pseudo-values written by a ridge solve (UltraEdit)",
               UltraEditConfig, f"{_M}.ultraedit:UltraEditEditor", sequential="none"),
    MethodSpec("mend", "a meta-trained gradient-transform network turns one gradient of the edits into a weight "
               "update (MEND; train it first with `crispedit mend train`)", MENDConfig, f"{_M}.mend:MENDEditor",
               sequential="none"),  # its network belongs to the unedited base: a later round is another model
)

for _spec in BUILTIN_METHODS:
    add_method(_spec)
