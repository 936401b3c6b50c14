"""Per-family edit defaults (torch-free): where the edit window sits and how the default learning rate
scales, for the model families whose measured defaults differ from the rule measured on SmolLM2.

:func:`crispedit.layers.default_layer_pattern` places the window with them; :meth:`EditConfig.for_family
<crispedit.editing.config.EditConfig.for_family>` scales a default learning rate (never one the user gave).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FamilyDefaults", "FAMILY_DEFAULTS", "defaults_for"]


@dataclass(frozen=True)
class FamilyDefaults:
    """Edit defaults of one model family: the edit window starts at block ``⌊start · N⌋`` of N and spans
    ``count`` blocks (at most; fewer for shallow models: ``min(count, N // 4)``, at least 1), and the
    method's default Adam learning rate is multiplied by ``lr_scale`` (an ``--lr`` the user gives is
    never scaled). Measured per family in docs/cli.md, 'Choosing layers'."""

    start: float = 0.15
    count: int = 5
    lr_scale: float = 1.0


#: Families whose measured defaults differ from the rule measured on SmolLM2 (llama). Gemma-3's ``down_proj``
#: weights are much smaller than SmolLM2's, so each Adam step moves them more in relative terms: it edits with
#: a scaled-down learning rate on an earlier window (why and the figures: docs/cli.md, 'Choosing layers',
#: "Gemma-3-270M: a second family").
FAMILY_DEFAULTS: dict[str, FamilyDefaults] = {
    "gemma3": FamilyDefaults(start=0.06, count=4, lr_scale=0.1),
    "gemma3_text": FamilyDefaults(start=0.06, count=4, lr_scale=0.1),
}


def defaults_for(family: str | None) -> FamilyDefaults:
    """The :class:`FamilyDefaults` of ``family`` (a config ``model_type``): its entry in :data:`FAMILY_DEFAULTS`,
    else the rule measured on SmolLM2 (:class:`FamilyDefaults`' own defaults)."""
    return FAMILY_DEFAULTS.get(family or "", FamilyDefaults())
