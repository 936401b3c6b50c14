"""Adam-NSCL: gradients projected onto the low-energy subspace of the layer-input covariance ``A``
alone (the paper's "restrictive special case" of CrispEdit)."""

from ...curvature.eigen import eigh_device, factor_eigh
from ...curvature.projection import KroneckerProjector
from ..registry import register_editor
from .base import Editor

__all__ = ["AdamNSCLEditor"]


@register_editor
class AdamNSCLEditor(Editor):
    """Adam-NSCL: keeps the *low*-variance input directions of ``A`` (γ-energy threshold), output side free."""

    name = "adam-nscl"  # summary and options: its entry in editing/catalogue.py
    needs_curvature = True

    def projectors(self, layers, factors, config):
        """One input-side projector per edit layer from its capability factor ``A`` at ``config.gamma``."""
        assert factors is not None
        eig = factor_eigh(factors, layers, ("A",), device=eigh_device(layers))
        return {name: KroneckerProjector.from_input_spectrum(*eig[name, "A"], config.gamma) for name in layers}
