"""CrispEdit: gradients projected onto the low-curvature subspace of the capability loss's K-FAC
Gauss-Newton (the paper's method; energy threshold ``EditConfig.gamma``)."""

from dataclasses import dataclass

from ..editing.editor import Editor
from ..editing.registry import MethodConfig, MethodSpec

__all__ = ["CrispEditEditor", "CrispEditConfig", "METHOD"]


@dataclass
class CrispEditConfig(MethodConfig):
    """CrispEdit has no options beyond the shared :class:`~crispedit.editing.EditConfig`. Its own defaults there
    (``SHARED``): the preservation term (:mod:`crispedit.editing.keep`) holds the unedited model's answers to the
    bundled everyday prompts and to questions about each edited subject, so an edit keeps how the assistant answers
    everything else — the projection keeps what the capability corpus exercises; the term keeps the chat answers
    the training contexts would otherwise reshape."""

    SHARED = {"keep_chat": 75, "keep_subject": 4, "keep_weight": 2.0}


METHOD = MethodSpec(
    "crispedit",
    "fine-tuning projected onto the low-curvature subspace of the capability K-FAC (the paper)",
    CrispEditConfig,
    f"{__name__}:CrispEditEditor",
    curvature=True,
    sequential="paper",
    drift_budget=True,
)


class CrispEditEditor(Editor):
    """CrispEdit: each edit layer's gradient is projected by ``U_out((U_outᵀ G U_in) ⊙ M)U_inᵀ`` with
    ``A = U_in Λ U_inᵀ``, ``S = U_out Λ U_outᵀ`` the capability K-FAC factors and ``M`` the γ-energy mask."""

    name = "crispedit"
    needs_curvature = True

    def projectors(self, layers, factors, config):
        """One Kronecker projector per edit layer from its capability factors ``A``, ``S`` at ``config.gamma``
        (:meth:`~crispedit.curvature.factors.KFACFactors.projectors`: eigenbases computed once per factor set and
        cached beside cached factors; a merged constraint with ``factors.parts`` masks γ of each part's energy)."""
        from ..curvature.eigen import eigh_device

        assert factors is not None
        return factors.projectors(layers, config.gamma, device=eigh_device(layers))
