"""Adam-NSCL: gradients projected onto the low-energy subspace of the layer-input covariance ``A``
alone (the paper's "restrictive special case" of CrispEdit)."""

from ..editing.editor import Editor
from ..editing.registry import MethodConfig, MethodSpec

__all__ = ["AdamNSCLEditor", "METHOD"]

METHOD = MethodSpec("adam-nscl", "fine-tuning projected onto the null space of the layer-input covariance "
                    "(Adam-NSCL)", MethodConfig, f"{__name__}:AdamNSCLEditor", curvature=True, drift_budget=True)


class AdamNSCLEditor(Editor):
    """Adam-NSCL: keeps the *low*-variance input directions of ``A`` (γ-energy threshold), output side free."""

    name = "adam-nscl"
    needs_curvature = True

    def projectors(self, layers, factors, config):
        """One input-side projector per edit layer from its capability factor ``A`` at ``config.gamma``."""
        from ..curvature.eigen import eigh_device, factor_eigh
        from ..curvature.projection import KroneckerProjector

        assert factors is not None
        eig = factor_eigh(factors, layers, ("A",), device=eigh_device(layers))
        return {name: KroneckerProjector.from_input_spectrum(*eig[name, "A"], config.gamma) for name in layers}
