"""MEMIT (Meng et al. 2023): each edit layer's MLP output projection gets the closed-form update
``ΔW = R Kᵀ (λC + K Kᵀ)⁻¹`` (:mod:`.editor`), written batch by batch by the closed-form procedure that
AlphaEdit shares (:mod:`.closed_form`). Here, torch-free: the closed-form options both take
(:class:`ClosedFormConfig`), MEMIT's own (:class:`MEMITConfig`) and its catalogue entry."""

from __future__ import annotations

from dataclasses import dataclass

from ...checks import check_float, check_int
from ...editing.registry import MethodConfig, MethodSpec
from ...settings import setting

__all__ = ["ClosedFormConfig", "MEMITConfig", "METHOD"]


@dataclass
class ClosedFormConfig(MethodConfig):
    """Options shared by the closed-form editors (MEMIT, AlphaEdit): ``batch_size`` edits per solve, the
    target-vector optimisation (``v_steps`` Adam steps at ``v_lr``, ``v_weight_decay``, ``clamp`` factor of
    ‖h‖, ``kl_factor`` on "{subject} is a") and the number of model-written ``prefixes`` (0: bare prompt
    only). Defaults: EasyEdit's MEMIT settings for Llama-3 (``hparams/MEMIT/llama3-8b.yaml``: v* lr 0.5, clamp 4,
    weight decay 1e-3; λ 15000 in :class:`MEMITConfig`), the baseline settings CrispEdit's paper says it used.
    They are not MEMIT's authors' (who publish no Llama-3 config); the MEMIT config for Llama-3-8B in
    AlphaEdit's code has lr 0.1, clamp 0.75, weight decay 0.5
    (:class:`~crispedit.methods.alphaedit.AlphaEditConfig`'s v* defaults)."""

    batch_size: int = setting(
        32, help="edits written per closed-form solve; larger edit sets go in consecutive batches"
    )
    v_steps: int = setting(25, help="Adam steps of the target-vector (v*) optimisation")
    v_lr: float = setting(0.5, help="Adam learning rate of the v* optimisation")
    v_weight_decay: float = setting(1e-3, help="weight of the ||delta|| / ||h||^2 penalty in the v* optimisation")
    clamp: float = setting(4.0, help="the v* change delta is clamped to clamp * ||h|| (h: the unedited hidden state)")
    kl_factor: float = setting(0.0625, help="weight of the KL term on '{subject} is a' in the v* optimisation")
    prefixes: int = setting(
        5, help="model-written prefix contexts the keys and v* are averaged over, besides the bare prompt"
    )

    def validate(self) -> ClosedFormConfig:
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

    cov_weight: float = setting(
        15000.0, help="lambda: weight of the key covariance C in (lambda C + K K^T) (default 15000)"
    )

    def validate(self) -> MEMITConfig:
        """The shared checks and a positive ``cov_weight``."""
        super().validate()
        self.cov_weight = check_float("memit cov_weight", self.cov_weight, 0.0, lo_open=True)
        return self


METHOD = MethodSpec(
    "memit",
    "closed-form key-value update of the edit layers' MLP output projections (MEMIT)",
    MEMITConfig,
    f"{__name__}.editor:MEMITEditor",
)
