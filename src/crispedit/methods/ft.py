"""FT: plain fine-tuning of the edit layers (FT-M loss, Adam, no projection; the paper's "FT" row)."""

from ..editing.editor import Editor
from ..editing.registry import MethodConfig, MethodSpec

__all__ = ["FTEditor", "METHOD"]

METHOD = MethodSpec(
    "ft",
    "plain fine-tuning of the edit layers (no projection)",
    MethodConfig,
    f"{__name__}:FTEditor",
    sequential="paper",
    drift_budget=True,
)


class FTEditor(Editor):
    """Plain fine-tuning of the edit layers' weights (identity projector)."""

    name = "ft"
