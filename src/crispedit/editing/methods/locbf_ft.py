"""LocBF-FT (Yang et al. 2025): plain Adam on ONE MLP output projection with breadth-first mini-batches
(each epoch passes over all edits; lr 5e-4, batch 32, up to 100 epochs, skip/stop 0.01 = the shared defaults).
Its option (which layer trains) is :class:`~crispedit.editing.catalogue.LocBFConfig`."""

from ...errors import CrispEditError
from ..catalogue import LocBFConfig
from ..registry import register_editor
from .base import Editor

__all__ = ["LocBFConfig", "LocBFFTEditor"]


@register_editor
class LocBFFTEditor(Editor):
    """Fine-tuning of ONE of the edit layers (``--layers`` or the default ones), no projection."""
    name = "locbf-ft"  # summary and Config (LocBFConfig): its entry in editing/catalogue.py

    def select_layers(self, model, config):
        """The one picked edit layer (module name -> linear module)."""
        layers, pick = list(super().select_layers(model, config).items()), config.method_config.layer
        i = {"first": 0, "last": -1, "middle": len(layers) // 2}.get(pick, None)
        i = int(pick) if i is None else i
        if not -len(layers) <= i < len(layers):
            raise CrispEditError(f"locbf-ft layer index {i} is out of range for {len(layers)} edit layers")
        return dict([layers[i]])
