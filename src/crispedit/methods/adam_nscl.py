"""Adam-NSCL: gradients projected onto the low-energy subspace of the layer-input covariance ``A``
alone (the paper's "restrictive special case" of CrispEdit)."""

from ..editing.editor import Editor
from ..editing.registry import MethodConfig, MethodSpec

__all__ = ["AdamNSCLEditor", "METHOD"]

METHOD = MethodSpec(
    "adam-nscl",
    "fine-tuning projected onto the null space of the layer-input covariance (Adam-NSCL)",
    MethodConfig,
    f"{__name__}:AdamNSCLEditor",
    curvature=True,
    drift_budget=True,
)


class AdamNSCLEditor(Editor):
    """Adam-NSCL: keeps the *low*-variance input directions of ``A`` (γ-energy threshold), output side free."""

    name = "adam-nscl"
    needs_curvature = True

    def projectors(self, layers, factors, config):
        """One input-side projector per edit layer from the input covariance ``A`` of its capability factors at
        ``config.gamma`` (:class:`~crispedit.curvature.factors.InputCovariance`)."""
        from ..curvature.eigen import eigh_device
        from ..curvature.factors import InputCovariance

        assert factors is not None
        return InputCovariance(factors).projectors(layers, config.gamma, device=eigh_device(layers))
