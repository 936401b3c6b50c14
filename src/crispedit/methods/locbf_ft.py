"""LocBF-FT (Yang et al. 2025): plain Adam on ONE MLP output projection with breadth-first mini-batches
(each epoch passes over all edits; lr 5e-4, batch 32, up to 100 epochs, skip/stop 0.01 = the shared defaults).
Its option, which of the edit layers trains, is :class:`LocBFConfig`."""

from dataclasses import dataclass

from ..editing.editor import Editor
from ..editing.registry import MethodConfig, MethodSpec
from ..errors import CrispEditError
from ..settings import setting

__all__ = ["LocBFConfig", "LocBFFTEditor", "METHOD"]


@dataclass
class LocBFConfig(MethodConfig):
    """``layer``: which of the edit layers trains — middle, first, last or an index."""

    layer: str = setting(
        "middle", help="which edit layer trains: middle (default), first, last or an index into the edit layers"
    )

    def validate(self) -> "LocBFConfig":
        """One-line error unless ``layer`` is middle / first / last or an integer."""
        self.layer = str(self.layer)
        if self.layer not in ("middle", "first", "last") and not self.layer.lstrip("-").isdigit():
            raise CrispEditError(f"locbf-ft layer must be middle, first, last or an index, got {self.layer!r}")
        return self


METHOD = MethodSpec(
    "locbf-ft",
    "plain Adam on one MLP output projection (LocBF-FT)",
    LocBFConfig,
    f"{__name__}:LocBFFTEditor",
    drift_budget=True,
)


class LocBFFTEditor(Editor):
    """Fine-tuning of ONE of the edit layers (``--layers`` or the default ones), no projection."""

    name = "locbf-ft"

    def select_layers(self, model, config):
        """The one picked edit layer (module name -> linear module)."""
        layers, pick = list(super().select_layers(model, config).items()), config.method_config.layer
        i = {"first": 0, "last": -1, "middle": len(layers) // 2}.get(pick, None)
        i = int(pick) if i is None else i
        if not -len(layers) <= i < len(layers):
            raise CrispEditError(f"locbf-ft layer index {i} is out of range for {len(layers)} edit layers")
        return dict([layers[i]])
