"""The method catalogue: every built-in editing method's name, one-line summary, options and editor class.

Torch-free on purpose: the CLI builds ``--method`` and the ``--<method>-<option>`` flags from it and
:class:`~crispedit.editing.EditConfig` validates a method and its options against it, so a mistyped
command fails in a fraction of a second. The editor classes (``editing/methods/``, which import torch)
take their ``summary`` and ``Config`` from these entries when they register, and are imported only when
an edit runs (:func:`~crispedit.editing.registry.editor_class`).

Method options are :class:`MethodConfig` dataclasses with the paper's defaults; ``SHARED`` holds a
method's own default for a shared setting (LoRA's learning rate), ``HELP`` one line per option.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CrispEditError, check_float, check_int
from .registry import MethodConfig, MethodSpec, add_method

__all__ = ["LoRAConfig", "LocBFConfig", "BUILTIN_METHODS"]


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


_M = "crispedit.editing.methods"
BUILTIN_METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("crispedit", "fine-tuning projected onto the low-curvature subspace of the capability K-FAC "
               "(the paper)", MethodConfig, f"{_M}.crispedit:CrispEditEditor", curvature=True),
    MethodSpec("ft", "plain fine-tuning of the edit layers (no projection)", MethodConfig, f"{_M}.ft:FTEditor"),
    MethodSpec("adam-nscl", "fine-tuning projected onto the null space of the layer-input covariance (Adam-NSCL)",
               MethodConfig, f"{_M}.adam_nscl:AdamNSCLEditor", curvature=True),
    MethodSpec("lora", "low-rank adapter (peft) on q_proj/v_proj of the edit layers' blocks, merged after training",
               LoRAConfig, f"{_M}.lora:LoRAEditor"),
    MethodSpec("locbf-ft", "plain Adam on one MLP output projection (LocBF-FT)", LocBFConfig,
               f"{_M}.locbf_ft:LocBFFTEditor"),
)

for _spec in BUILTIN_METHODS:
    add_method(_spec)
