"""MEND (Mitchell et al. 2022, "Fast Model Editing at Scale"): a meta-trained gradient-transform network turns
one gradient of the edit requests into the weight update of every edit layer.

The package: the editor that applies a trained network (:mod:`.editor`), the network, its file format and the
one gradient computation it transforms (:mod:`.net`), and its meta-training (:mod:`.train`, run by
``crispedit mend train``). Here, torch-free: the method's options (:class:`MENDConfig`), the training settings
(:class:`MENDTrainConfig`, which the ``mend train`` flags come from) and the catalogue entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import SEED_MAX, check_float, check_int, check_lr
from ...editing.registry import MethodConfig, MethodSpec
from ...errors import CrispEditError
from ...settings import setting

__all__ = ["MENDConfig", "MENDTrainConfig", "METHOD"]


@dataclass
class MENDConfig(MethodConfig):
    """MEND (applying a trained gradient-transform network): ``weights``, the network's safetensors file (empty:
    the default one in the cache, ``<cache>/mend/<key>.safetensors`` keyed by the model's weight fingerprint and
    the edit layers, where ``crispedit mend train`` writes by default); ``batch_size`` edit requests per
    forward/backward of the one gradient computation (a memory knob: the update does not depend on it)."""

    weights: str = setting(
        "",
        help="trained MEND network (safetensors from `crispedit mend train`; default: the "
        "cached one for this model and these layers)",
    )
    batch_size: int = setting(32, help="edit requests per forward/backward of the gradient computation (memory only)")

    def validate(self) -> MENDConfig:
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

    def validate(self) -> MENDTrainConfig:
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
    def from_json(cls, d: dict) -> MENDTrainConfig:
        """Rebuild from :meth:`to_json` output; unknown keys are a one-line error."""
        from dataclasses import fields

        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise CrispEditError(f"unknown MEND training settings: {', '.join(unknown)}")
        return cls(**d)


# No -seq row: its network belongs to the unedited base model, so a later round edits another model.
METHOD = MethodSpec(
    "mend",
    "a meta-trained gradient-transform network turns one gradient of the edits into a weight "
    "update (MEND; train it first with `crispedit mend train`)",
    MENDConfig,
    f"{__name__}.editor:MENDEditor",
    sequential="none",
)
