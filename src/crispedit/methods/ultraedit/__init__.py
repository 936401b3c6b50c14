"""UltraEdit (Gu et al. 2025): training-free lifelong editing by a closed-form ridge solve per layer
(:mod:`.editor`). Here, torch-free: its options (:class:`UltraEditConfig`) and its catalogue entry."""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import check_float, check_int
from ...editing.registry import MethodConfig, MethodSpec
from ...settings import setting

__all__ = ["UltraEditConfig", "METHOD"]


@dataclass
class UltraEditConfig(MethodConfig):
    """UltraEdit: ``lr`` of the pseudo-values ``v = −lr·‖ĥ‖²·ĝ`` (authors: 1e-6), ``ridge`` weight of the
    closed-form solve ``ΔWᵀ = (HᵀH + ridge·I)⁻¹HᵀV`` (authors: 1), ``batch_size`` edits per solve (32, as in
    CrispEdit's comparison)."""

    lr: float = setting(
        1e-6, help="scale of the pseudo-values v = -lr * ||h_hat||^2 * g_hat (default 1e-6, the authors')"
    )
    ridge: float = setting(1.0, help="ridge weight of the solve (H^T H + ridge I)^-1 H^T V (default 1)")
    batch_size: int = setting(
        32, help="edits per closed-form solve; the normalisation statistics run across all of them"
    )

    def validate(self) -> UltraEditConfig:
        """Positive ``lr``, ``ridge`` and ``batch_size``."""
        self.lr = check_float("ultraedit lr", self.lr, 0.0, 1e6, lo_open=True)
        self.ridge = check_float("ultraedit ridge", self.ridge, 0.0, lo_open=True)
        self.batch_size = check_int("ultraedit batch_size", self.batch_size, 1)
        return self


# No -seq row of its own: UltraEdit is lifelong by construction (its batch run already writes the edits batch
# after batch with carried normalisation statistics; --ultraedit-batch-size is its round size).
METHOD = MethodSpec(
    "ultraedit",
    "lifelong-normalised gradient pseudo-values written by a ridge solve (UltraEdit)",
    UltraEditConfig,
    f"{__name__}.editor:UltraEditEditor",
    sequential="none",
)
