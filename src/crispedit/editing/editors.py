"""Editors: each answers two questions — which parameters train, and which projector applies.

All fine-tuning editors share :func:`crispedit.editing.loop.projected_finetune`. Register a new one
with :func:`register_editor` (see CONTRIBUTING.md, "add an editor").
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ..curvature.kfac import KFACFactors
from ..models import weight_matrix
from ..projection import IdentityProjector, KroneckerProjector, LayerProjector
from .config import EditConfig

__all__ = ["Editor", "EDITORS", "register_editor", "get_editor"]


class Editor:
    """Base editor: trains the weight of every chosen linear layer."""

    name = "base"
    needs_curvature = False

    def trainable(self, layers: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
        """The parameters that train: module name -> weight (``d_out x d_in``, or transposed for Conv1D)."""
        return {name: m.weight for name, m in layers.items()}

    def projectors(self, layers: dict[str, nn.Module], factors: KFACFactors | None,
                   config: EditConfig) -> dict[str, LayerProjector]:
        """One projector per layer name for this editor, built from ``factors`` under ``config``."""
        raise NotImplementedError


EDITORS: dict[str, Callable[[], Editor]] = {}


def register_editor(cls: type[Editor]) -> type[Editor]:
    """Class decorator: register an :class:`Editor` subclass under its ``name``."""
    EDITORS[cls.name] = cls
    return cls


def get_editor(name: str) -> Editor:
    """A fresh instance of the editor registered as ``name``."""
    return EDITORS[name]()


@register_editor
class FTEditor(Editor):
    """Plain fine-tuning of the chosen layers (identity projector: the paper's "no projection")."""

    name = "ft"

    def projectors(self, layers, factors, config):
        """One projector per layer name for this editor, built from ``factors`` under ``config``."""
        out = {}
        for name, m in layers.items():
            d_out, d_in = weight_matrix(m).shape
            out[name] = IdentityProjector(d_out, d_in)
        return out


@register_editor
class CrispEditEditor(Editor):
    """CrispEdit: gradients projected onto the low-curvature subspace of the K-FAC Gauss-Newton."""

    name = "crispedit"
    needs_curvature = True

    def projectors(self, layers, factors, config):
        """One projector per layer name for this editor, built from ``factors`` under ``config``."""
        assert factors is not None
        return {name: KroneckerProjector.from_factors(factors.A[name], factors.S[name], config.gamma)
                for name in layers}


@register_editor
class AdamNSCLEditor(Editor):
    """Adam-NSCL: gradients projected onto the low-energy subspace of the layer-input covariance A
    alone (the paper's "restrictive special case"). Keeps the *low*-variance directions."""

    name = "adam-nscl"
    needs_curvature = True

    def projectors(self, layers, factors, config):
        """One projector per layer name for this editor, built from ``factors`` under ``config``."""
        assert factors is not None
        return {name: KroneckerProjector.from_activation_covariance(factors.A[name], config.gamma)
                for name in layers}
