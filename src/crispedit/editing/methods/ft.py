"""FT: plain fine-tuning of the edit layers (FT-M loss, Adam, no projection; the paper's "FT" row)."""

from ..registry import register_editor
from .base import Editor

__all__ = ["FTEditor"]


@register_editor
class FTEditor(Editor):
    """Plain fine-tuning of the edit layers' weights (identity projector)."""

    name = "ft"  # summary and options: its entry in editing/catalogue.py
