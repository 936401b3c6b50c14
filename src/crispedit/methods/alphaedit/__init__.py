"""AlphaEdit (Fang et al. 2025): MEMIT's update projected onto the null space of the preserved keys'
covariance (:mod:`.editor`). Here, torch-free: its options (:class:`AlphaEditConfig`, MEMIT's closed-form
options with the authors' Llama-3 values) and its catalogue entry."""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import check_float
from ...editing.registry import MethodSpec
from ...settings import setting
from ..memit import ClosedFormConfig

__all__ = ["AlphaEditConfig", "METHOD"]


@dataclass
class AlphaEditConfig(ClosedFormConfig):
    """AlphaEdit: ``nullspace_threshold`` (eigenvalues of the per-token covariance ``C = E[kkᵀ]`` below it
    span the null space the update is projected onto; authors 2e-2), ``l2`` (ridge weight; authors' Llama-3
    config 10), batch 100, v* with lr 0.1, clamp 0.75, weight decay 0.5 (the authors' Llama3-8B config)."""

    batch_size: int = 100
    v_lr: float = 0.1
    v_weight_decay: float = 0.5
    clamp: float = 0.75
    nullspace_threshold: float = setting(
        2e-2, help="eigenvalues of E[k k^T] below this span the preserved null space (default 2e-2)"
    )
    l2: float = setting(10.0, help="ridge weight of the update (default 10, the authors' Llama-3 config)")

    def validate(self) -> AlphaEditConfig:
        """The shared checks, a positive threshold and a non-negative ``l2``."""
        super().validate()
        self.nullspace_threshold = check_float(
            "alphaedit nullspace_threshold", self.nullspace_threshold, 0.0, lo_open=True
        )
        self.l2 = check_float("alphaedit l2", self.l2, 0.0)
        return self


METHOD = MethodSpec(
    "alphaedit",
    "MEMIT's update projected onto the null space of the preserved keys' covariance (AlphaEdit)",
    AlphaEditConfig,
    f"{__name__}.editor:AlphaEditEditor",
    sequential="paper",
)
